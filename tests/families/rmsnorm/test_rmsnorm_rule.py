"""RMSNorm's rule (onnx_gtco/families/rmsnorm/rule.py): the decomposed spellings, ONNX's RMSNormalization and
onnxruntime's SkipSimplifiedLayerNormalization, the residual Add before it, and what it leaves to LayerNorm."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from rms_models import forms_model, llama_block

from onnx_gtco.families.layernorm.rule import LayerNormPattern
from onnx_gtco.families.rmsnorm.rule import RmsNormPattern
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView

RULE = RmsNormPattern()


def decomposed(kit, *, square: str = "Pow", spelling: str = "div1", weight: str = "after", opset: int = 17,
               leak: str | None = None):
    """a + b -> x -> x² -> ReduceMean -> Add eps -> Sqrt -> (1 / . then x * . | x / .) -> [* gamma]."""
    g = kit.graph()
    g.input("a", [2, 5, 8])
    g.input("b", [2, 5, 8])
    g.op("Add", ["a", "b"], "res")
    if square == "Pow":
        g.op("Pow", ["res", g.const("two", np.float32(2))], "sq")
    else:
        g.op("Mul", ["res", "res"], "sq")
    if opset >= 18:
        g.op("ReduceMean", ["sq", g.const("axes", np.array([-1]))], "ms")
    else:
        g.op("ReduceMean", ["sq"], "ms", axes=[-1])
    g.op("Add", ["ms", g.const("eps", np.float32(1e-6))], "eps_add")
    g.op("Sqrt", ["eps_add"], "sqrt")
    if spelling == "div1":
        g.op("Div", [g.const("one", np.float32(1)), "sqrt"], "inv")
        g.op("Mul", ["res", "inv"], "norm")
    elif spelling == "recip":
        g.op("Reciprocal", ["sqrt"], "inv")
        g.op("Mul", ["inv", "res"], "norm")
    else:
        g.op("Div", ["res", "sqrt"], "norm")
    outs = ["norm"]
    if weight:
        g.op("Mul", [g.weight("g", 8), "norm"] if weight == "before" else ["norm", g.weight("g", 8)], "gamma")
        outs = ["gamma"]
    g.output(*outs, "res", *([leak] if leak else []))
    return g.view(opset)


CHAIN = {"sq", "ms", "eps_add", "sqrt", "norm"}


@pytest.mark.parametrize(("kwargs", "extra"), [
    ({}, {"inv", "gamma"}),
    ({"square": "Mul"}, {"inv", "gamma"}),
    ({"spelling": "recip", "weight": "before"}, {"inv", "gamma"}),
    ({"spelling": "div"}, {"gamma"}),
    ({"opset": 18}, {"inv", "gamma"}),
    ({"weight": None}, {"inv"}),
])
def test_decomposed_spellings(kit, kwargs: dict, extra: set[str]) -> None:
    view = decomposed(kit, **kwargs)
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    assert kit.groups(view, matches) == [CHAIN | extra, CHAIN | extra | {"res"}]
    affine = kwargs.get("weight", "after") is not None
    assert matches[0].attrs == {"epsilon": pytest.approx(1e-6), "axis": -1, "hidden": 8, "form": "decomposed",
                                "affine": affine, "residual": False}
    assert matches[1].attrs["residual"] and set(matches[1].roles) == {"a", "b", *(("gamma",) if affine else ())}
    assert matches[1].outputs == {"y": "gamma" if affine else "norm", "sum": "res"}


def test_a_leaking_intermediate_is_rejected_with_its_name(kit) -> None:
    view = decomposed(kit, leak="ms")
    matches, rejects = kit.run(RULE, view)
    assert matches == [] and len(rejects) == 1
    assert "'ms'" in rejects[0].reason and "read outside" in rejects[0].reason


def test_layernorm_variance_is_left_to_layernorm(kit) -> None:
    """LayerNorm's second half is an RMSNorm of x - mean: the RMSNorm rule proposes nothing there, LayerNorm's all."""
    g = kit.graph()
    g.input("x", [2, 5, 8])
    g.op("ReduceMean", ["x"], "mean", axes=[-1])
    g.op("Sub", ["x", "mean"], "d")
    g.op("Pow", ["d", g.const("two", np.float32(2))], "sq")
    g.op("ReduceMean", ["sq"], "var", axes=[-1])
    g.op("Add", ["var", g.const("eps", np.float32(1e-5))], "eps_add")
    g.op("Sqrt", ["eps_add"], "sqrt")
    g.op("Div", ["d", "sqrt"], "y")
    g.output("y")
    view = g.view()
    assert kit.run(RULE, view) == ([], [])
    assert len(kit.run(LayerNormPattern(), view)[0]) == 1


def test_the_ops(kit) -> None:
    """RMSNormalization (opset 23) and SkipSimplifiedLayerNormalization: one node each, the residual form of the
    first where an Add feeds it, the skip node's sum as a second output."""
    view = GraphView(load_model(forms_model()))
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    by_form = {}
    for m in matches:
        by_form.setdefault(m.attrs["form"], []).append(m)
    onnx_op = by_form["RMSNormalization"]
    assert [len(m.nodes) for m in onnx_op] == [1, 2] and onnx_op[1].attrs["residual"]
    assert onnx_op[0].attrs["hidden"] == 64 and onnx_op[0].attrs["epsilon"] == pytest.approx(1e-5)
    (skip,) = by_form["SkipSimplifiedLayerNormalization"]
    assert skip.attrs["residual"] and set(skip.roles) == {"a", "b", "gamma"} and set(skip.outputs) == {"y", "sum"}
    assert [m.attrs["affine"] for m in by_form["decomposed"]] == [False]


def test_skip_with_bias_or_read_statistics_is_rejected(kit) -> None:
    def model(bias: bool, stats: bool) -> onnx.ModelProto:
        w = numpy_helper.from_array(np.ones(8, np.float32), "w")
        ins = ["x", "s", "w", "w" if bias else ""]
        outs = ["y", "mean" if stats else "", "", ""]
        node = helper.make_node("SkipSimplifiedLayerNormalization", ins, outs, domain="com.microsoft", name="skip")
        io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in ("x", "s", "y")]
        graph = helper.make_graph([node], "g", io[:2], io[2:] + ([helper.make_tensor_value_info(
            "mean", TensorProto.FLOAT, [2, 1])] if stats else []), [w])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(
            "com.microsoft", 1)], ir_version=10)

    for bias, stats, why in ((True, False, "bias"), (False, True, "statistics")):
        matches, rejects = kit.run(RULE, GraphView(load_model(model(bias, stats))))
        assert matches == [] and len(rejects) == 1 and why in rejects[0].reason


def test_every_norm_of_a_llama_block_is_a_candidate(kit) -> None:
    view = GraphView(load_model(llama_block(layers=2)))
    cands, _ = kit.collect(view)
    norms = [c for c in cands if c.family == "rmsnorm"]
    pows = {n.id for n in view.nodes if n.op_type == "Pow"}
    assert len(pows) == 5 and all(any(p in c.nodes for c in norms) for p in pows)
