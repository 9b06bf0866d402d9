"""End to end on the built-in models: every attention block fused, >= 90% of FLOPs fused, outputs unchanged."""

from __future__ import annotations

import onnx
import pytest

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.models import build
from onnx_gtco.plugin.coverage import candidate_coverage
from onnx_gtco.runtime.check import compare, default_tolerances

# (name, overrides): full-size models where CPU time allows, fewer layers where a full one adds nothing new.
BUILTINS = [
    ("vit-tiny", {}),
    ("vit-b16", {}),
    ("deit-s", {"depth": 4}),
    ("deit-b", {"depth": 2}),
    ("bert-tiny", {}),
    ("bert-base", {"depth": 4}),
]


def softmax_ids(result) -> set[int]:
    return {n.id for n in result.view.nodes if n.op_type == "Softmax"}


def assert_fully_fused(result, min_share: float = 0.9) -> None:
    rep = result.report
    in_attention = set()
    for g in result.plan.fused_groups:
        if g.family in ("attention", "bmm_softmax"):
            in_attention |= g.nodes
    # an attention group without a device kernel on the target costs its nodes unfused, so the plan may run a
    # Softmax outside one (fp32 attention has no kernel yet); it must not while an attention candidate has one
    coverage = candidate_coverage(result.view, result.report["precision"])
    missing = {i for i in softmax_ids(result) - in_attention
               if any(c.family in ("attention", "bmm_softmax") and i in c.nodes
                      and coverage(c).on(result.report["target"]) for c in result.candidates)}
    assert not missing, f"softmax nodes left outside attention groups that have device kernels: {missing}"
    assert all(any(c.family in ("attention", "bmm_softmax") and i in c.nodes for c in result.candidates)
               for i in softmax_ids(result)), "a softmax no attention rule matched"
    fused = set().union(*(g.nodes for g in result.plan.fused_groups))
    assert sum(rep["unfused_ops"].values()) == len(result.view) - len(fused)
    assert "Softmax" not in rep["unfused_ops"] and "MatMul" not in rep["unfused_ops"]
    assert rep["fused_flop_share"] >= min_share, rep["fused_flop_share"]
    assert rep["nodes_after"] < rep["nodes_before"]
    assert rep["predicted_us_after"] < rep["predicted_us_before"]


@pytest.mark.parametrize(("name", "overrides"), BUILTINS, ids=[b[0] for b in BUILTINS])
def test_builtin_model_end_to_end(name: str, overrides: dict) -> None:
    model = build(name, seed=0, **overrides)
    result = optimize(model, GtcoConfig())
    assert_fully_fused(result)
    diffs = compare(model, result.model, "cpu", rtol=1e-4, atol=1e-5)
    assert all(d.ok for d in diffs), diffs
    assert min(d.cosine for d in diffs) > 0.99999


def test_a_search_past_its_state_budget_still_fuses_and_computes_the_original() -> None:
    """With a state budget no segment's search fits in, every segment is covered greedily: the model still fuses
    its attention and GEMMs, the report says which segments, and the rewritten model computes the original."""
    model = build("bert-tiny", seed=0)
    result = optimize(model, GtcoConfig(max_states=1))
    rep = result.report
    greedy = [r for r in rep["rejected"] if r["pattern"] == "dp"]
    assert greedy and all("covered greedily" in r["reason"] for r in greedy), rep["rejected"]
    assert {"attention", "gemm"} <= {g["family"] for g in rep["groups"]}
    assert rep["predicted_us_after"] < rep["predicted_us_before"]
    diffs = compare(model, result.model, "cpu", rtol=1e-4, atol=1e-5)
    assert all(d.ok for d in diffs), diffs


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_converts_and_passes_check_at_its_tolerance(precision: str) -> None:
    """A half precision marks every fused node and converts the model (onnx_gtco.precision): fused nodes on half
    tensors, inputs and outputs in their dtypes. Through the functions the model passes `check` against the fp32
    original with the defaults `check` uses for that precision (read from the model's metadata), not fp32's."""
    model = build("vit-tiny", depth=2, seed=1)
    result = optimize(model, GtcoConfig(precision=precision, target="sm_80"))
    gtco_nodes = [n for n in result.model.graph.node if n.domain == "ai.gtco"]
    assert gtco_nodes
    half = {"fp16": "_f16", "bf16": "_bf16"}[precision]
    for n in gtco_nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["precision"] == precision.encode()
        assert n.op_type.endswith(half)
    assert [v.type.tensor_type.elem_type for v in result.model.graph.output] == [
        v.type.tensor_type.elem_type for v in model.graph.output]
    rtol, atol, why = default_tolerances(result.model)
    assert precision in why and rtol > 1e-4
    diffs = compare(model, result.model, "cpu", rtol=rtol, atol=atol)
    assert all(d.ok for d in diffs), diffs


def test_vit_b16_repeats_share_functions_and_planning_stays_small() -> None:
    result = optimize(build("vit-b16", seed=0), GtcoConfig())
    per_layer = {}
    for g in result.plan.fused_groups:
        per_layer[g.family] = per_layer.get(g.family, 0) + 1
    assert per_layer.get("attention", 0) == 12
    # twelve identical blocks: each distinct group body is stored once
    assert len(result.model.functions) < len(result.plan.fused_groups) / 6
    # the DP explores a bounded number of remaining-node sets (linear in depth, not exponential)
    assert result.plan.states < 200 * len(result.view)


def test_optimize_twice_is_byte_identical() -> None:
    model = build("bert-tiny", seed=0)
    a, b = optimize(model, GtcoConfig()), optimize(model, GtcoConfig())
    assert a.model.SerializeToString(deterministic=True) == b.model.SerializeToString(deterministic=True)
    assert a.report == b.report
