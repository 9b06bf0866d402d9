"""Kernel launches per transformer layer, as the report counts them from the plan: the QKV projection packed into
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
from onnx_gtco.report import summary
from onnx_gtco.report_md import family_rows, render


@pytest.fixture(scope="module", params=["vit-b16", "bert-base"])
def fp16_report(request):
    return request.param, optimize(build(request.param), GtcoConfig(target="h200", precision="fp16")).report


def test_the_report_counts_the_plans_launches_per_layer(fp16_report) -> None:
    _, rep = fp16_report
    la = rep["launches"]
    blk = la["per_block"]
    assert blk["anchor"] == "attention" and blk["blocks"] == 11
    assert blk["ours"] < blk["original_launching_nodes"] and la["ours"] < la["original_launching_nodes"]
    assert la["original_nodes"] == rep["nodes_before"]
    assert "qkv" not in rep["families"]  # BERT's three projections packed into one GEMM before matching
    for g in rep["groups"]:  # where a GEMM + LayerNorm was chosen, the report names what it replaced and why
        if g["attrs"].get("layernorm"):
            assert g["instead_of"]["groups"] == ["gemm", "layernorm"]
            assert g["predicted_us"] < g["instead_of"]["predicted_us"]
    assert 0 < la["after_ours"] <= la["ours"]
    assert rep["predicted_us_after_pdl"] < rep["predicted_us_after"]
    text = summary(rep)
    assert f"launches   {la['ours']} per forward" in text and f"per layer {blk['ours']:g}" in text
    assert "with PDL" in text
    md = render(rep)
    assert f"| kernel launches per layer | {blk['original_launching_nodes']:g} | {blk['ours']:g} | - |" in md
    assert "Assumed, not measured" in md
    # the family table adds up to the predicted time after, also where Q, K and V were packed first (BERT)
    assert sum(f["after_us"] for f in family_rows(rep)) == pytest.approx(rep["predicted_us_after"], abs=0.01)
    # both were rewritten before planning (ViT's patch embedding as patchify + GEMM, BERT's Q, K and V packed):
    # the report prices the model as given and as planned
    assert rep["predicted_us_before_planned"] != rep["predicted_us_before"]
    assert "The planner rewrote the graph first" in md


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
