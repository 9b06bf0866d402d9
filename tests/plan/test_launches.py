"""Kernel launches per transformer layer: the QKV projection packed into one GEMM and the GEMM + LayerNorm groups
the planner chooses, as the report counts them."""

from __future__ import annotations

import pytest

from onnx_gtco.config import GtcoConfig
from onnx_gtco.cost.model import Estimate, launches
from onnx_gtco.models import build
from onnx_gtco.pipeline import optimize
from onnx_gtco.plan.types import Candidate, freeze_attrs
from onnx_gtco.report import summary
from onnx_gtco.report_md import family_rows, render


@pytest.fixture(scope="module", params=["vit-b16", "bert-base"])
def fp16_report(request):
    return request.param, optimize(build(request.param), GtcoConfig(target="sm_90", precision="fp16")).report


def test_at_most_five_launches_per_layer_at_fp16(fp16_report) -> None:
    name, rep = fp16_report
    la = rep["launches"]
    assert la["per_block"]["anchor"] == "attention" and la["per_block"]["blocks"] == 11
    assert la["per_block"]["ours"] <= 5, la
    # qkv GEMM, attention, two GEMM + LayerNorm, fc1: no QKV node, no LayerNorm between two GEMMs
    assert "qkv" not in rep["families"]
    merged = [g for g in rep["groups"] if g["attrs"].get("layernorm")]
    assert len(merged) >= 2 * 12 - 1, [g["name"] for g in merged]
    for g in merged:  # the report names what the merge replaced, and the model's saving
        assert g["instead_of"]["groups"] == ["gemm", "layernorm"]
        assert g["predicted_us"] < g["instead_of"]["predicted_us"]
    assert la["original_nodes"] > la["ours"] and rep["nodes_before"] == la["original_nodes"]
    assert rep["predicted_us_after_pdl"] < rep["predicted_us_after"]
    text = summary(rep)
    assert f"launches   {la['ours']} per forward" in text and "per layer 5" in text and "with PDL" in text
    md = render(rep)
    assert f"| kernel launches per layer | {la['per_block']['original_launching_nodes']:g} | 5 | - |" in md
    assert "Assumed, not measured" in md
    # the family table adds up to the predicted time after, also where Q, K and V were packed first (BERT)
    assert sum(f["after_us"] for f in family_rows(rep)) == pytest.approx(rep["predicted_us_after"], abs=0.01)
    assert ("predicted_us_before_planned" in rep) == (name == "bert-base")
    assert ("packed each block's Q, K and V" in md) == (name == "bert-base")


def test_fp32_keeps_the_pair_where_the_normalize_step_costs_more(fp16_report) -> None:
    name = fp16_report[0]
    rep = optimize(build(name, depth=2), GtcoConfig(target="sm_90", precision="fp32")).report
    # TF32: the normalize step reads fp32 panels back, which the cost model prices above the launch it saves
    assert not [g for g in rep["groups"] if g["attrs"].get("layernorm")]
    assert rep["launches"]["per_block"]["ours"] == 7


def test_a_qkv_node_costs_a_launch_per_projection() -> None:
    cand = Candidate(frozenset({1, 2, 3}), "qkv", "qkv", freeze_attrs({"ns": (64, 64, 32)}))
    assert launches(cand) == 3
    assert launches(Candidate(frozenset({1}), "gemm", "gemm")) == 1
    hw = GtcoConfig(target="sm_90").hw
    assert Estimate(launches=3).time_us(hw, "fp16") == pytest.approx(3 * hw.launch_us)
    # the GEMM + LayerNorm normalize step: half the time at fp16 as at fp32
    e = Estimate(panel_elems=1e5)
    assert e.time_us(hw, "fp32") == pytest.approx(2 * e.time_us(hw, "fp16"))
