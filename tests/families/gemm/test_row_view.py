"""GPT-2's Conv1D MLP: addmm on the rows (a 2-D Gemm), a Reshape back to [B, S, N], then the tanh GELU written out as
Pow, Mul, Add, Tanh; the Reshape moves after the activation before planning (families/gemm/row_view.py, exact), so
the GEMM's epilogue applies the GELU: one launch less a layer, equal to the original through the functions, the CPU
library and the emulated kernels, at static and at symbolic sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import assert_close_through_built_libraries
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.gemm.row_view import sunk_reshapes
from onnx_gtco.ir.load import load_model

B, S, C, F = 2, 8, 32, 128


def conv1d_mlp(*, symbolic: bool = False, read_between: bool = False) -> onnx.ModelProto:
    """x [B, S, C] -> Reshape [B*S, C] -> Gemm(w1, b1) -> Reshape [B, S, F] -> tanh GELU -> Reshape [B*S, F] ->
    Gemm(w2, b2) -> Reshape [B, S, C]. `symbolic`: batch and seq named, the Reshapes' shapes computed from Shape
    (the TorchScript export). `read_between`: the reshaped pre-activation is also a graph output."""
    rng = np.random.default_rng(3)
    f32 = np.float32
    inits = [numpy_helper.from_array((0.2 * rng.standard_normal(s)).astype(f32), n)
             for n, s in (("w1", (C, F)), ("b1", (F,)), ("w2", (F, C)), ("b2", (C,)))]
    inits += [numpy_helper.from_array(np.float32(v), n) for n, v in (
        ("three", 3.0), ("k", 0.044715), ("root", np.sqrt(2 / np.pi)), ("one", 1.0), ("half", 0.5))]
    nodes = []
    if symbolic:
        inits += [numpy_helper.from_array(np.array([-1, C], np.int64), "rows_c"),
                  numpy_helper.from_array(np.array([-1, F], np.int64), "rows_f"),
                  numpy_helper.from_array(np.array([0], np.int64), "zero"),
                  numpy_helper.from_array(np.array([2], np.int64), "two"),
                  numpy_helper.from_array(np.array([F], np.int64), "f"),
                  numpy_helper.from_array(np.array([C], np.int64), "c")]
        nodes += [helper.make_node("Shape", ["x"], ["xs"]),
                  helper.make_node("Slice", ["xs", "zero", "two"], ["lead"]),
                  helper.make_node("Concat", ["lead", "f"], ["to_f"], axis=0),
                  helper.make_node("Concat", ["lead", "c"], ["to_c"], axis=0)]
    else:
        inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
            ("rows_c", [B * S, C]), ("rows_f", [B * S, F]), ("to_f", [B, S, F]), ("to_c", [B, S, C]))]
    nodes += [helper.make_node("Reshape", ["x", "rows_c"], ["x2"]),
              helper.make_node("Gemm", ["x2", "w1", "b1"], ["h2"]),
              helper.make_node("Reshape", ["h2", "to_f"], ["h"]),
              helper.make_node("Pow", ["h", "three"], ["h3"]),
              helper.make_node("Mul", ["h3", "k"], ["kh3"]),
              helper.make_node("Add", ["h", "kh3"], ["inner"]),
              helper.make_node("Mul", ["inner", "root"], ["arg"]),
              helper.make_node("Tanh", ["arg"], ["t"]),
              helper.make_node("Add", ["t", "one"], ["t1"]),
              helper.make_node("Mul", ["h", "half"], ["hh"]),
              helper.make_node("Mul", ["hh", "t1"], ["g"]),
              helper.make_node("Reshape", ["g", "rows_f"], ["g2"]),
              helper.make_node("Gemm", ["g2", "w2", "b2"], ["y2"]),
              helper.make_node("Reshape", ["y2", "to_c"], ["y"])]
    dims = ["batch", "seq"] if symbolic else [B, S]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*dims, C])]
    if read_between:
        outs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, [*dims, F]))
    graph = helper.make_graph(nodes, "conv1d_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, C])],
                              outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


X = np.random.default_rng(0).standard_normal((B, S, C)).astype(np.float32)


@pytest.mark.parametrize("symbolic", [False, True])
def test_the_reshape_moves_after_the_activation_with_the_same_values(symbolic: bool) -> None:
    model = load_model(conv1d_mlp(symbolic=symbolic))
    sunk, moved = sunk_reshapes(model)
    assert moved == ["g"]
    ops = [n.op_type for n in sunk.graph.node]
    gemm = ops.index("Gemm")
    assert ops[gemm + 1] != "Reshape" and "Tanh" in ops[gemm + 1:ops.index("Gemm", gemm + 1)]
    np.testing.assert_array_equal(_run(sunk, X)[0], _run(model, X)[0])


def test_a_reshaped_result_read_elsewhere_stays() -> None:
    assert sunk_reshapes(load_model(conv1d_mlp(read_between=True)))[1] == []


@pytest.mark.parametrize("symbolic", [False, True])
def test_the_gemm_applies_the_gelu(symbolic: bool) -> None:
    result = optimize(conv1d_mlp(symbolic=symbolic), GtcoConfig(precision="fp16"))
    acts = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("activation")
            for n in result.model.graph.node if n.op_type == "Gemm_f16"]
    assert acts == [b"gelu_tanh", b"none"], acts
    assert not [n.op_type for n in result.model.graph.node if n.op_type in ("Tanh", "Pow", "Elementwise_f16")]


@pytest.mark.slow
def test_the_libraries_compute_the_original(tmp_path: Path) -> None:
    original = conv1d_mlp(symbolic=True)
    rewritten = optimize(original, GtcoConfig(precision="fp16")).model
    assert_close_through_built_libraries(original, rewritten, tmp_path, 5e-3, "conv1d mlp fp16", "Gemm_",
                                         sizes=({"batch": 2, "seq": 8}, {"batch": 1, "seq": 37}))
