"""Elementwise chains: maximal convex groups, the reshapes between them, BERT's mask prep, pairs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from onnx_gtco.families.elementwise.rule import ElementwisePattern
from onnx_gtco.ir.view import GraphView

RULE = ElementwisePattern()


def test_bert_mask_prep_is_one_chain(kit) -> None:
    g = kit.graph()
    g.input("mask", [1, 8], TensorProto.INT64)
    g.input("scores", [1, 2, 8, 8])
    g.op("Unsqueeze", ["mask", g.const("axes", np.array([1, 2]))], "unsqueeze")
    g.op("Cast", ["unsqueeze"], "cast", to=TensorProto.FLOAT)
    g.op("Sub", [g.const("one", np.float32(1)), "cast"], "sub")
    g.op("Mul", ["sub", g.const("big", np.float32(-10000))], "mul")
    g.op("Softmax", ["scores"], "sm", axis=-1)  # keeps the chain's reader outside the elementwise group
    g.op("Add", ["sm", "mul"], "add")
    g.output("add")
    view = g.view()
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches)[0] == {"unsqueeze", "cast", "sub", "mul", "add"}
    assert matches[0].attrs == {"ops": ("Unsqueeze", "Cast", "Sub", "Mul", "Add")}
    assert {"sub", "mul"} in kit.groups(view, matches)  # pairs inside the larger group


def test_non_convex_component_is_split_and_trailing_reshape_kept(kit) -> None:
    """r1 -> s1 -> MatMul -> a(s1, mm) -> t: a path leaves {r1, s1, a, t} and re-enters it."""
    g = kit.graph()
    g.input("x", [4, 8])
    g.op("Relu", ["x"], "r1")
    g.op("Sigmoid", ["r1"], "s1")
    g.op("MatMul", ["s1", g.weight("w", 8, 8)], "mm")
    g.op("Add", ["s1", "mm"], "a")
    g.op("Tanh", ["a"], "t")
    g.op("Reshape", ["t", g.const("shape", np.array([32]))], "flat")
    g.output("flat")
    view = g.view()
    matches, rejects = kit.run(RULE, view)
    # the trailing Reshape joins: the group writes its output densely, which is the reshape's layout too
    assert kit.groups(view, matches) == [{"r1", "s1"}, {"a", "t", "flat"}, {"a", "t"}]
    assert [(r.anchor, r.reason) for r in rejects] == [
        ("r1", "5 connected elementwise nodes split into 2 convex groups: a path leaves them and comes back")]
    _, rejects = kit.collect(view)
    assert [r.pattern for r in rejects] == ["elementwise"]  # only its own: every group it proposes is legal


def test_integer_shape_arithmetic_is_not_proposed(kit) -> None:
    g = kit.graph()
    g.input("x", [4, 8])
    g.op("Shape", ["x"], "shape")
    g.op("Mul", ["shape", g.const("unit", np.array(1))], "twice")
    g.op("Add", ["twice", g.const("zero", np.array(0))], "plus")
    g.op("Relu", ["x"], "r")
    g.op("Neg", ["r"], "n")
    g.op("Reshape", ["n", "plus"], "y")
    g.output("y")
    view = GraphView(onnx.shape_inference.infer_shapes(g.model()))  # unfolded, as exporters may leave it
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"r", "n"}]


def test_int8_chain_is_rejected_with_the_reason(kit) -> None:
    """An int8-only chain is data, not shape arithmetic: the report says why it stays unfused."""
    g = kit.graph()
    g.input("q", [4, 16], TensorProto.INT8)
    g.op("Add", ["q", g.const("zero_point", np.int8(3))], "shift")
    g.op("Mul", ["shift", g.const("gain", np.int8(2))], "scale")
    g.op("Relu", ["scale"], "relu")
    g.output("relu")
    view = g.view()
    matches, rejects = kit.run(RULE, view)
    assert matches == []
    assert [(r.anchor, r.reason) for r in rejects] == [
        ("shift", "3 elementwise nodes compute only integers (int8): no fused kernel for quantized elementwise "
                  "chains")]


def test_a_value_every_layer_reads_joins_none_of_their_groups(kit) -> None:
    """BERT's mask, computed once and read by every layer: each layer's group reads it as an input. Joined, one
    candidate would span every layer (and the plan's states grow with it); four readers still join."""
    from onnx_gtco.families.elementwise.rule import MAX_SHARED_READERS

    for readers, shared in ((MAX_SHARED_READERS + 2, False), (MAX_SHARED_READERS, True)):
        g = kit.graph()
        g.input("mask", [1, 8])
        g.op("Neg", ["mask"], "prep")
        for k in range(readers):
            g.input(f"s{k}", [1, 8])
            g.op("Softmax", [f"s{k}"], f"sm{k}", axis=-1)  # each layer's scores, computed outside the rule
            g.op("Add", [f"sm{k}", "prep"], f"add{k}")
            g.op("Relu", [f"add{k}"], f"relu{k}")
            g.output(f"relu{k}")
        view = g.view()
        matches, _ = kit.run(RULE, view)
        groups = kit.groups(view, matches)
        spans = [grp for grp in groups if len({n for n in grp if n.startswith(("add", "relu"))}) > 2]
        assert bool(spans) == shared, groups
        if not shared:  # each layer's own pair, the shared node in none
            assert sorted(map(sorted, groups)) == sorted(sorted({f"add{k}", f"relu{k}"}) for k in range(readers))
