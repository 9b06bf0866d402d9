"""Swin V2's cosine attention: normalized q and k, a per-head temperature on the scores (moved onto q before
planning, families/attention/head_scale.py), a relative-position bias, and Hugging Face's shifted-window mask added
twice between the window Reshapes (summed into one, families/attention/mask_sum.py): every attention fused with a
device kernel and equal to the original through the functions, the CPU library and the emulated kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import assert_close_through_built_libraries
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.attention.head_scale import scaled_queries
from onnx_gtco.families.attention.mask_sum import summed_masks
from onnx_gtco.ir.load import load_model
from onnx_gtco.plugin.coverage import model_coverage

B, W, H, N, D = 2, 4, 2, 16, 16  # images, windows per image, heads, tokens per window, head dim
C = H * D


def cosine_windows(*, shifted: bool = True, temperature_shape: tuple[int, ...] = (H, 1, 1), twice: bool = True,
                   seed: int = 0) -> onnx.ModelProto:
    """x [B * W, N, C] -> q, k, v projections -> heads -> normalize q and k (ReduceL2, Clip, Expand, Div, as
    F.normalize exports) -> (q̂ k̂ᵀ) * temperature + bias -> [shifted: Reshape [B, W, H, N, N] + mask (+ mask again)
    -> Reshape] -> Softmax -> P v -> merge -> projection."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    mask = np.where(rng.random((1, W, 1, N, N)) < 0.3, -100.0, 0.0).astype(f32)
    mask[..., np.arange(N), np.arange(N)] = 0.0  # every query keeps itself
    inits = [numpy_helper.from_array((0.2 * rng.standard_normal((C, C))).astype(f32), f"w{n}") for n in "qkvo"]
    inits += [numpy_helper.from_array(np.array([B * W, N, H, D], np.int64), "split"),
              numpy_helper.from_array(np.array([B * W, N, C], np.int64), "merged"),
              numpy_helper.from_array(np.array([-1], np.int64), "last"),
              numpy_helper.from_array(f32(1e-12), "eps"),
              numpy_helper.from_array(np.array([B * W, H, N, D], np.int64), "full"),
              numpy_helper.from_array(np.exp(rng.uniform(1.0, 3.0, temperature_shape)).astype(f32), "temperature"),
              numpy_helper.from_array((0.5 * rng.standard_normal((1, H, N, N))).astype(f32), "bias"),
              numpy_helper.from_array(mask, "mask"),
              numpy_helper.from_array(np.array([B, W, H, N, N], np.int64), "windows"),
              numpy_helper.from_array(np.array([B * W, H, N, N], np.int64), "scores")]
    nodes = []
    for n in "qkv":
        nodes += [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}p"]),
                  helper.make_node("Reshape", [f"{n}p", "split"], [f"{n}s"]),
                  helper.make_node("Transpose", [f"{n}s"], [f"{n}h"], perm=[0, 2, 1, 3])]
    for n in "qk":
        nodes += [helper.make_node("ReduceL2", [f"{n}h", "last"], [f"{n}l2"], keepdims=1),
                  helper.make_node("Clip", [f"{n}l2", "eps"], [f"{n}c"]),
                  helper.make_node("Expand", [f"{n}c", "full"], [f"{n}e"]),
                  helper.make_node("Div", [f"{n}h", f"{n}e"], [f"{n}n"])]
    nodes += [helper.make_node("Transpose", ["kn"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qn", "kt"], ["qk"]),
              helper.make_node("Mul", ["qk", "temperature"], ["qks"]),
              helper.make_node("Add", ["qks", "bias"], ["s"])]
    scores = "s"
    if shifted:
        nodes += [helper.make_node("Reshape", ["s", "windows"], ["sw"]),
                  helper.make_node("Add", ["sw", "mask"], ["sm1"])]
        last = "sm1"
        if twice:
            nodes.append(helper.make_node("Add", ["sm1", "mask"], ["sm2"]))
            last = "sm2"
        nodes.append(helper.make_node("Reshape", [last, "scores"], ["sb"]))
        scores = "sb"
    nodes += [helper.make_node("Softmax", [scores], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merged"], ["om"]),
              helper.make_node("MatMul", ["om", "wo"], ["y"])]
    graph = helper.make_graph(nodes, "cosine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B * W, N, C])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B * W, N, C])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


X = np.random.default_rng(5).standard_normal((B * W, N, C)).astype(np.float32)


def test_the_per_head_temperature_moves_onto_q_and_the_two_masks_become_one() -> None:
    model = load_model(cosine_windows())
    scaled, found = scaled_queries(model)
    assert [h.mul.outputs[0] for h in found] == ["qks"]
    summed, count = summed_masks(scaled)
    assert count == 1
    ops = [n.op_type for n in summed.graph.node]
    assert ops.count("Add") == 2 and ops.count("Mul") == 1  # the bias and the summed mask; q * temperature
    mul = next(n for n in summed.graph.node if n.op_type == "Mul")
    assert mul.input[0] == "qn" and mul.output[0] in next(n for n in summed.graph.node if n.output[0] == "qks").input
    want = _run(model, X)
    np.testing.assert_allclose(_run(summed, X), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, N, 1), (1, 1, 1, N), ()])
def test_a_scale_that_is_not_per_head_stays_on_the_scores(shape: tuple[int, ...]) -> None:
    """A scale varying along the query or key rows does not commute with the product; a scalar is the attention's own
    scale (the rule takes it): neither is moved."""
    model = load_model(cosine_windows(temperature_shape=shape, shifted=False))
    assert scaled_queries(model)[1] == []


def test_a_mask_beside_a_bias_is_not_summed() -> None:
    """Only constant masks (0 / -100) are summed: the mask added once after the bias leaves the bias alone."""
    model = load_model(cosine_windows(twice=False))
    assert summed_masks(model)[1] == 0


@pytest.mark.parametrize("shifted", [False, True])
def test_cosine_attention_is_fused_with_a_kernel(shifted: bool) -> None:
    result = optimize(cosine_windows(shifted=shifted), GtcoConfig(precision="fp16"))
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention_f16") == 1 and "Softmax" not in ops, ops
    coverage = model_coverage(result.model)
    assert coverage.error is None and {n: c.reason for n, c in coverage.nodes.items() if not c.archs} == {}


@pytest.mark.slow
def test_cosine_attention_computes_the_original_through_the_libraries(tmp_path: Path) -> None:
    original = cosine_windows()
    rewritten = optimize(original, GtcoConfig(precision="fp16")).model
    assert_close_through_built_libraries(original, rewritten, tmp_path, 5e-3, "cosine fp16", "Attention_")
