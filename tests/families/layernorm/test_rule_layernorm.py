"""LayerNorm as one op and in its decomposed forms, with and without the residual Add feeding it."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_gtco.families.layernorm.rule import LayerNormPattern

RULE = LayerNormPattern()
CHAIN = {"mean", "sub", "sq", "var", "eps_add", "sqrt", "div", "gamma", "beta"}


def decomposed(kit, *, square: str = "Pow", two_subs: bool = False, recip: bool = False, opset: int = 17,
               axes: tuple[int, ...] = (-1,), eps: bool = True, outputs: tuple[str, ...] = ("beta", "res")):
    """a + b -> x -> ReduceMean -> Sub -> Pow 2 -> ReduceMean -> Add eps -> Sqrt -> Div -> *gamma +beta."""
    g = kit.graph()
    g.input("a", [2, 5, 8])
    g.input("b", [2, 5, 8])
    g.op("Add", ["a", "b"], "res")

    def mean(x: str, name: str) -> str:
        if opset >= 18:
            return g.op("ReduceMean", [x, g.const(f"{name}_axes", np.array(axes))], name)
        return g.op("ReduceMean", [x], name, axes=list(axes))

    mean("res", "mean")
    g.op("Sub", ["res", "mean"], "sub")
    num = g.op("Sub", ["res", "mean"], "sub2") if two_subs else "sub"
    if square == "Pow":
        g.op("Pow", ["sub", g.const("two", np.float32(2))], "sq")
    else:
        g.op("Mul", ["sub", "sub"], "sq")
    mean("sq", "var")
    std_in = g.op("Add", ["var", g.const("eps", np.float32(1e-6))], "eps_add") if eps else "var"
    g.op("Sqrt", [std_in], "sqrt")
    if recip:
        g.op("Reciprocal", ["sqrt"], "recip")
        g.op("Mul", [num, "recip"], "div")
    else:
        g.op("Div", [num, "sqrt"], "div")
    g.op("Mul", ["div", g.weight("g", 8)], "gamma")
    g.op("Add", ["gamma", g.weight("bt", 8)], "beta")
    g.output(*outputs)
    return g.view(opset)


@pytest.mark.parametrize(("kwargs", "extra"), [
    ({}, set()),
    ({"square": "Mul"}, set()),
    ({"two_subs": True}, {"sub2"}),
    ({"recip": True}, {"recip"}),
    ({"opset": 18}, set()),
])
def test_decomposed_forms(kit, kwargs: dict, extra: set[str]) -> None:
    view = decomposed(kit, **kwargs)
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    assert kit.groups(view, matches) == [CHAIN | extra, CHAIN | extra | {"res"}]
    assert matches[0].attrs == {"epsilon": pytest.approx(1e-6), "axis": -1, "hidden": 8, "decomposed": True,
                                "affine": True, "residual": False}
    assert matches[1].attrs["residual"] is True
    cands, _ = kit.collect(view)
    with_res = next(c for c in cands if c.family == "layernorm" and c.attr("residual"))
    assert view.external_outputs(with_res.nodes) == ("res", "beta")  # the sum leaves too: two outputs


def test_layernormalization_op(kit) -> None:
    g = kit.graph()
    g.input("a", [2, 5, 8])
    g.input("b", [2, 5, 8])
    g.op("Add", ["a", "b"], "res")
    g.op("LayerNormalization", ["res", g.weight("g", 8), g.weight("bt", 8)], "ln", axis=-1, epsilon=1e-5)
    g.output("ln")
    view = g.view()
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"ln"}, {"res", "ln"}]
    assert matches[1].attrs == {"epsilon": pytest.approx(1e-5), "axis": -1, "hidden": 8, "decomposed": False,
                                "affine": True, "residual": True}


def test_near_misses(kit) -> None:
    view = decomposed(kit, axes=(1,))
    _, rejects = kit.run(RULE, view)
    assert rejects[0].reason == "ReduceMean 'mean' over axes (1,) is not over the trailing axes"
    view = decomposed(kit, eps=False)
    _, rejects = kit.run(RULE, view)
    assert rejects[0].reason == "the variance is not followed by Add eps (scalar constant) -> Sqrt"
    view = decomposed(kit, outputs=("beta", "res", "var"))  # the variance is a graph output
    matches, rejects = kit.run(RULE, view)
    assert matches == []
    assert rejects[0].reason == "intermediate 'var' of the decomposed LayerNorm is also read outside it"
    view = decomposed(kit, outputs=("beta", "res", "sub"))
    _, rejects = kit.run(RULE, view)
    assert rejects[0].reason == "intermediate 'sub' of the decomposed LayerNorm is also read outside it"
    view = decomposed(kit, outputs=("beta", "res", "div"))  # normalized x leaves: no affine epilogue
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches)[0] == CHAIN - {"gamma", "beta"} and matches[0].attrs["affine"] is False


def test_a_plain_mean_is_not_a_near_miss(kit) -> None:
    g = kit.graph()
    g.input("x", [2, 5, 8])
    g.op("ReduceMean", ["x"], "pool", axes=[1])
    g.output("pool")
    assert kit.run(RULE, g.view()) == ([], [])
