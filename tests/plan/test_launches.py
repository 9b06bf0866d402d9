"""Kernel launches per transformer layer, as the report counts them from the plan (the counts of the H200 plans
of ViT-B/16 and BERT-base: tests/plan/test_calibrated_plans.py): the QKV projection packed into
one GEMM, the GEMM + LayerNorm groups where the estimate chooses them, and the PDL line."""

from __future__ import annotations

import pytest
from pins import FUSED_FORMS

from onnx_gtco.calibration import hardware
from onnx_gtco.config import GtcoConfig
from onnx_gtco.cost.model import Estimate, launches, memory_us, vendor_gemm_us
from onnx_gtco.models import build
from onnx_gtco.pipeline import optimize
from onnx_gtco.plan.types import Candidate, freeze_attrs


def test_fused_layernorms_take_a_layer_to_five_launches(calibrated) -> None:
    """Where the estimate prices a separate LayerNorm (as its own kernel or as elementwise pieces) and the vendor
    GEMM dear, every block's two GEMM + LayerNorm pairs fuse: qkv GEMM, attention, two GEMM + LayerNorm, fc1."""
    calibrated("h200", **FUSED_FORMS)
    rep = optimize(build("bert-base", depth=3), GtcoConfig(target="h200", precision="fp16")).report
    merged = [g for g in rep["groups"] if g["attrs"].get("layernorm")]
    # all but the last block's second pair, whose LayerNorm output is the graph's
    assert len(merged) == 2 * 3 - 1, [g["name"] for g in merged]
    assert rep["launches"]["per_block"]["ours"] == 5


def test_a_qkv_node_costs_a_launch_per_projection() -> None:
    cand = Candidate(frozenset({1, 2, 3}), "qkv", "qkv", freeze_attrs({"ns": (64, 64, 32)}))
    assert launches(cand) == 3
    assert launches(Candidate(frozenset({1}), "gemm", "gemm")) == 1
    hw = hardware("h200")
    # ORT runs matmul work on the vendor GEMM, one per launch; other work as memory-bound kernels
    gemm = Estimate(mm_flops=3e9, dram_bytes=3e6, launches=3)
    assert gemm.ort_us(hw, "fp16") == pytest.approx(3 * vendor_gemm_us(1e9, 1e6, False, hw))
    assert gemm.ort_us(hw, "fp32") > gemm.ort_us(hw, "fp16")  # TF32's lower peak
    assert Estimate(dram_bytes=1e6, launches=1).ort_us(hw) == pytest.approx(memory_us(1e6, 0.0, hw))
    assert Estimate().ort_us(hw) == 0.0
