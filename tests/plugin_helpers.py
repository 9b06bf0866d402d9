"""Helpers of the custom-op library tests: model builders and the optimize + build_library step.

The ORT headers come from onnx_gtco.plugin.headers (downloaded once into the per-user cache, then reused), and the
libraries from its build cache, so a second run compiles nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.plugin.library import LibraryResult, build_library
from onnx_gtco.runtime.session import METADATA_KEY


@dataclass
class Built:
    """An original model file, its rewritten model file (with gtco.library metadata) and the library build."""

    original: Path
    rewritten: Path
    lib: LibraryResult


def ln_softmax_model(hidden: int | str = "H", elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """(x + r) -> LayerNormalization(gamma, beta) -> Softmax: one Layernorm_f32 (residual) and one Softmax_f32 node.
    With a symbolic hidden size the kernels accept any row length and check the operands at run time."""
    dt = helper.tensor_dtype_to_np_dtype(elem)
    g = numpy_helper.from_array(np.linspace(0.5, 1.5, 16).astype(dt), "gamma")
    b = numpy_helper.from_array(np.linspace(-1, 1, 16).astype(dt), "beta")
    nodes = [helper.make_node("Add", ["x", "r"], ["s"], name="res"),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
             helper.make_node("Softmax", ["y"], ["z"], name="sm", axis=-1)]
    io = [helper.make_tensor_value_info(n, elem, ["N", hidden]) for n in ("x", "r", "z")]
    graph = helper.make_graph(nodes, "ln_softmax", io[:2], io[2:], [g, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def build_model(model: onnx.ModelProto, out_dir: Path, *, cuda: bool = False,
                config: GtcoConfig | None = None) -> Built:
    """optimize (with `config`) + build_library into out_dir; writes original.onnx and model.gtco.onnx (with the
    metadata)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    original = out_dir / "original.onnx"
    onnx.save(model, str(original))
    result = optimize(model, config)
    lib = build_library(result.model, out_dir, cuda=cuda)
    result.model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
    rewritten = out_dir / "model.gtco.onnx"
    onnx.save(result.model, str(rewritten))
    return Built(original, rewritten, lib)


def decomposed_ln_model(*, reciprocal: bool, affine: bool, opset: int = 17) -> onnx.ModelProto:
    """x -> ReduceMean / Sub / Mul(d, d) / ReduceMean / Add eps / Sqrt / (Div | Reciprocal + Mul) [-> Mul g -> Add b]
    over the last axis of [N, 4, 16], the way exporters decompose LayerNorm."""
    h = helper.make_node
    inits = [numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]
    nodes = [h("ReduceMean", ["x"], ["mean"], name="rm0", axes=[-1]),
             h("Sub", ["x", "mean"], ["d"], name="sub"),
             h("Mul", ["d", "d"], ["sq"], name="sq"),
             h("ReduceMean", ["sq"], ["var"], name="rm1", axes=[-1]),
             h("Add", ["var", "eps"], ["ve"], name="add_eps"),
             h("Sqrt", ["ve"], ["std"], name="sqrt")]
    if reciprocal:
        nodes += [h("Reciprocal", ["std"], ["inv"], name="recip"), h("Mul", ["inv", "d"], ["n"], name="norm")]
    else:
        nodes += [h("Div", ["d", "std"], ["n"], name="norm")]
    out = "n"
    if affine:
        inits += [numpy_helper.from_array(np.linspace(0.5, 2, 16).astype(np.float32), "g"),
                  numpy_helper.from_array(np.linspace(-1, 1, 16).astype(np.float32), "b")]
        nodes += [h("Mul", ["g", "n"], ["ng"], name="gamma"), h("Add", ["ng", "b"], ["y"], name="beta")]
        out = "y"
    nodes.append(h("Identity", [out], ["out"], name="id"))
    graph = helper.make_graph(nodes, "ln_decomposed", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                     ["N", 4, 16])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def relu_gemm_model(rows: int | str, k: int, n: int) -> onnx.ModelProto:
    """Y = Relu(X @ W + b), fp16: one Gemm_f16 node with a bias and a ReLU, both in cuBLASLt's epilogue."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16), "W")
    b = numpy_helper.from_array((0.5 * rng.standard_normal(n)).astype(np.float16), "b")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["xw"], name="mm"),
             helper.make_node("Add", ["xw", "b"], ["xwb"], name="add"),
             helper.make_node("Relu", ["xwb"], ["Y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT16, [rows, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [rows, n])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="session", autouse=True)
def _need_cxx() -> None:
    """The library tests' folders take this fixture (their conftest imports it): they skip where g++ is missing."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the custom-op library")
