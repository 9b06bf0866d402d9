"""Legality of candidate groups: convexity, outputs that escape, dtypes without a kernel."""

from __future__ import annotations

from collections.abc import Iterator

import onnx
from onnx import TensorProto, helper

from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.patterns.base import Match
from onnx_gtco.plan.candidates import collect, is_convex
from onnx_gtco.plan.types import Candidate, Reject


def diamond(dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """a -> Relu(r) -> Exp(e) -> Add(r, e) : {Relu, Add} is not convex (the path through Exp leaves and re-enters)."""
    x = helper.make_tensor_value_info("x", dtype, [4])
    y = helper.make_tensor_value_info("y", dtype, [4])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Exp", ["r"], ["e"], name="exp"),
             helper.make_node("Add", ["r", "e"], ["y"], name="add")]
    return helper.make_model(helper.make_graph(nodes, "d", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])


class Fixed:
    """A rule that proposes fixed node sets, to test the legality layer alone."""

    name = "fixed"

    def __init__(self, *groups: tuple[int, ...]) -> None:
        self.groups = groups

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for g in self.groups:
            yield Match(frozenset(g), "elementwise", {"n": len(g)})


def test_convexity() -> None:
    view = GraphView(load_model(diamond()))
    assert not is_convex(view, frozenset([0, 2]))
    assert is_convex(view, frozenset([0, 1, 2]))
    assert is_convex(view, frozenset([1, 2]))


def test_collect_rejects_with_reasons_and_dedupes() -> None:
    view = GraphView(load_model(diamond()))
    cands, rejects = collect(view, [Fixed((0, 2), (0, 1, 2), (0, 1, 2), (1, 2))], max_size=8)
    assert [sorted(c.nodes) for c in cands] == [[0, 1, 2], [1, 2]]
    assert isinstance(cands[0], Candidate) and cands[0].attr("n") == 3
    assert [r.reason for r in rejects] == ["not convex: a path leaves the group and re-enters it"]
    _, rejects = collect(view, [Fixed((0, 1, 2))], max_size=2)
    assert rejects[0].reason == "3 nodes > max group size 2"


def test_float64_groups_are_left_unfused_with_the_reason() -> None:
    view = GraphView(load_model(diamond(TensorProto.DOUBLE)))
    cands, rejects = collect(view, [Fixed((1, 2))], max_size=8)
    assert cands == []
    assert "double" in rejects[0].reason and "no fused kernel" in rejects[0].reason


def test_view_edges_and_external_tensors() -> None:
    view = GraphView(load_model(diamond()))
    assert view.preds[2] == frozenset([0, 1]) and view.succs[0] == frozenset([1, 2])
    assert view.desc_mask[0] == 0b110 and view.anc_mask[2] == 0b011
    assert view.external_inputs(frozenset([1, 2])) == ("r",)
    assert view.external_outputs(frozenset([0, 1])) == ("r", "e")
    assert view.external_outputs(frozenset([2])) == ("y",)
