"""GEMM epilogues: bias, the activation forms exporters write (found by what they compute), residual."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_gtco.families.gemm.rule import GemmPattern
from onnx_gtco.patterns.find_activation import find_activation

RULE = GemmPattern()


def linear(kit, act: str, *, residual: bool = True, outputs: tuple[str, ...] = ("y",), opset: int = 17):
    """x[4,8] @ W[8,16] + b -> activation `act` (nodes named a0, a1, ...) -> + r[4,16] -> y."""
    g = kit.graph()
    g.input("x", [4, 8])
    g.input("r", [4, 16])
    g.op("MatMul", ["x", g.weight("w", 8, 16)], "mm")
    x = g.op("Add", [g.weight("b", 16), "mm"], "bias")
    c = {k: g.const(k, np.float32(v)) for k, v in
         (("half", 0.5), ("one", 1.0), ("sqrt2", 1.4142135), ("inv_sqrt2", 0.70710677), ("three", 3.0),
          ("k0", 0.044715), ("k1", 0.7978846), ("qg", 1.702), ("zero", 0.0), ("six", 6.0))}
    forms = {
        "none": [],
        "relu": [("Relu", [x])],
        "relu6": [("Clip", [x, c["zero"], c["six"]])],
        "gelu_div": [("Div", [x, c["sqrt2"]]), ("Erf", ["a0"]), ("Add", ["a1", c["one"]]), ("Mul", [x, "a2"]),
                     ("Mul", ["a3", c["half"]])],
        "gelu_mul": [("Mul", [x, c["half"]]), ("Mul", [c["inv_sqrt2"], x]), ("Erf", ["a1"]),
                     ("Add", [c["one"], "a2"]), ("Mul", ["a0", "a3"])],
        "gelu_tanh_pow": [("Pow", [x, c["three"]]), ("Mul", ["a0", c["k0"]]), ("Add", [x, "a1"]),
                          ("Mul", ["a2", c["k1"]]), ("Tanh", ["a3"]), ("Add", ["a4", c["one"]]),
                          ("Mul", [x, c["half"]]), ("Mul", ["a6", "a5"])],
        "gelu_tanh_cube": [("Mul", [x, x]), ("Mul", ["a0", x]), ("Mul", ["a1", c["k0"]]), ("Add", [x, "a2"]),
                           ("Mul", ["a3", c["k1"]]), ("Tanh", ["a4"]), ("Add", ["a5", c["one"]]),
                           ("Mul", [x, c["half"]]), ("Mul", ["a7", "a6"])],
        "gelu_op": [("Gelu", [x])],
        "silu": [("Sigmoid", [x]), ("Mul", [x, "a0"])],
        "quick_gelu": [("Mul", [x, c["qg"]]), ("Sigmoid", ["a0"]), ("Mul", [x, "a1"])],
    }
    last = x
    for i, (op, ins) in enumerate(forms[act]):
        last = g.op(op, ins, f"a{i}")
    g.op("Add", [last, "r"] if residual else [last, g.weight("c", 16)], "res" if residual else "y")
    if residual:
        g.op("Identity", ["res"], "y")
    g.output(*outputs)
    return g.view(opset), [f"a{i}" for i in range(len(forms[act]))]


@pytest.mark.parametrize(("form", "name"), [
    ("relu", "relu"), ("relu6", "relu6"), ("gelu_div", "gelu_erf"), ("gelu_mul", "gelu_erf"),
    ("gelu_tanh_pow", "gelu_tanh"), ("gelu_tanh_cube", "gelu_tanh"), ("silu", "silu"), ("quick_gelu", "quick_gelu"),
])
def test_prefix_variants_with_each_activation_form(kit, form: str, name: str) -> None:
    view, act = linear(kit, form)
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    full = {"mm", "bias", *act}
    assert kit.groups(view, matches) == [{"mm"}, {"mm", "bias"}, full, full | {"res"}]
    assert [(m.attrs["bias"], m.attrs["activation"], m.attrs["residual"]) for m in matches] == [
        (False, "none", False), (True, "none", False), (True, name, False), (True, name, True)]
    assert {k: matches[0].attrs[k] for k in ("m", "n", "k", "trans_b", "batch")} == {
        "m": 4, "n": 16, "k": 8, "trans_b": False, "batch": ()}


def test_gelu_op_of_opset_20_both_approximations(kit) -> None:
    view, _ = linear(kit, "gelu_op", opset=20)
    assert kit.run(RULE, view)[0][2].attrs["activation"] == "gelu_erf"
    g = kit.graph()
    g.input("x", [4, 8])
    g.op("Gelu", ["x"], "gelu", approximate="tanh")
    g.output("gelu")
    view = g.view(opset=20)
    assert find_activation(view, "x") == ("gelu_tanh", frozenset([0]), "gelu")


def test_bias_then_residual_without_activation(kit) -> None:
    view, _ = linear(kit, "none")
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"mm"}, {"mm", "bias"}, {"mm", "bias", "res"}]
    assert matches[-1].attrs["activation"] == "none" and matches[-1].attrs["residual"] is True


def test_gemm_op_with_trans_b_and_batched_matmul(kit) -> None:
    g = kit.graph()
    g.input("x", [4, 8])
    g.input("a", [2, 3, 5, 8])
    g.input("b", [2, 3, 8, 7])
    g.op("Gemm", ["x", g.weight("w", 16, 8), g.weight("c", 16)], "fc", transB=1)
    g.op("Relu", ["fc"], "relu")
    g.op("MatMul", ["a", "b"], "bmm")
    g.output("relu", "bmm")
    view = g.view()
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"fc"}, {"fc", "relu"}, {"bmm"}]
    assert {k: matches[1].attrs[k] for k in ("m", "n", "k", "trans_b", "bias", "activation")} == {
        "m": 4, "n": 16, "k": 8, "trans_b": True, "bias": True, "activation": "relu"}
    bmm = matches[2].attrs
    assert (bmm["m"], bmm["n"], bmm["k"], bmm["batch"]) == (5, 7, 8, (2, 3))


def test_near_misses(kit) -> None:
    g = kit.graph()
    g.input("x", [4, 8])
    g.input("v", [8])
    g.input("r", [1, 16])
    g.op("MatMul", ["x", g.weight("w", 8, 16)], "mm")
    g.op("Add", ["mm", g.weight("col", 4, 1)], "colbias")
    g.op("MatMul", ["x", g.weight("w2", 8, 16)], "mm2")
    g.op("Add", ["mm2", "r"], "broadcast_res")
    g.op("MatMul", ["x", "v"], "gemv")
    g.output("colbias", "broadcast_res", "gemv")
    view = g.view()
    matches, rejects = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"mm"}, {"mm2"}]
    assert [r.reason for r in rejects] == [
        "Add 'colbias' of constant shape (4, 1) does not broadcast along axis -1",
        "residual Add 'broadcast_res' operand shape (1, 16) differs from the output shape (4, 16)",
        "MatMul 'gemv' has a 1-D operand (a GEMV, not a GEMM)",
    ]


def test_an_intermediate_graph_output_stops_the_epilogue(kit) -> None:
    view, _ = linear(kit, "gelu_div", outputs=("y", "a1"))
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"mm"}, {"mm", "bias"}]
    cands, _ = kit.collect(view)
    gemms = [c for c in cands if c.family == "gemm"]
    assert all(view.external_outputs(c.nodes) for c in cands)
    assert sorted(sorted(kit.names(view, c.nodes)) for c in gemms) == [["bias", "mm"], ["mm"]]


def layer_scale_block(kit, gamma_shape: tuple[int, ...] = (16,), act: bool = True):
    """x[2,5,8] -> MatMul W[8,16] + b -> [Relu] -> Mul gamma -> + r[2,5,16] (DINOv2 / CaiT LayerScale)."""
    g = kit.graph()
    g.input("x", [2, 5, 8])
    g.input("r", [2, 5, 16])
    g.op("MatMul", ["x", g.weight("w", 8, 16)], "mm")
    out = g.op("Add", ["mm", g.weight("b", 16)], "bias")
    if act:
        out = g.op("Relu", [out], "relu")
    g.op("Mul", [g.weight("gamma", *gamma_shape), out], "ls")
    g.op("Add", ["r", "ls"], "res")
    g.output("res")
    return g.view()


def test_layer_scale_mul_joins_before_the_residual(kit) -> None:
    """A per-channel Mul between the GEMM (+bias, +activation) and the residual Add is the epilogue's LayerScale:
    the chain up to the residual is one group, gamma its layer_scale role."""
    view = layer_scale_block(kit)
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    assert kit.groups(view, matches) == [{"mm"}, {"mm", "bias"}, {"mm", "bias", "relu"},
                                         {"mm", "bias", "relu", "ls"}, {"mm", "bias", "relu", "ls", "res"}]
    assert ["layer_scale" in m.attrs for m in matches] == [False, False, False, True, True]
    last = matches[-1]
    assert last.attrs["layer_scale"] is True and last.attrs["residual"] is True
    assert (last.roles["layer_scale"], last.roles["residual"], last.roles["bias"]) == ("gamma", "r", "b")
    assert kit.groups(view, [c for c in kit.collect(view)[0] if c.family == "gemm"])[-1] == {
        "mm", "bias", "relu", "ls", "res"}


@pytest.mark.parametrize(("gamma_shape", "joins"), [((1, 1, 16), True), ((1,), False), ((5, 16), False)])
def test_only_a_per_column_constant_is_a_layer_scale(kit, gamma_shape: tuple[int, ...], joins: bool) -> None:
    """[1, 1, N] is one factor per column too; a scalar Mul or a [rows, N] one is no LayerScale (the group stops
    before it and the residual)."""
    view = layer_scale_block(kit, gamma_shape, act=False)
    matches, _ = kit.run(RULE, view)
    assert ("ls" in kit.groups(view, matches)[-1]) is joins
    assert ("res" in kit.groups(view, matches)[-1]) is joins
