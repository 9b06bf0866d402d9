"""GEMM epilogues: bias, the activation forms exporters write (found by what they compute), residual."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_gtco.patterns._act import find_activation
from onnx_gtco.patterns.gemm import GemmPattern

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
