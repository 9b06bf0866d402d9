"""Einsums that are a matrix product up to permutations as MatMuls (families/gemm/einsum.py): equal to the Einsum,
constant operands permuted once, other forms left alone, and tf2onnx's Einsum BERT layer fused like a MatMul one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import assert_close_through_built_libraries
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.gemm.einsum import einsum_matmuls, einsum_product
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView


def einsum_model(equation: str, a: list[int], b: list[int], context: str = "") -> onnx.ModelProto:
    """One Einsum of inputs a and b; `context` "weight": b a constant; "scores": a Softmax reads the product;
    "probs": a is a Softmax's output (attention's P)."""
    rng = np.random.default_rng(len(equation))
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, a)]
    inits, nodes = [], []
    if context == "weight":
        inits.append(numpy_helper.from_array(rng.standard_normal(b).astype(np.float32), "b"))
    else:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, b))
    first = "a"
    if context == "probs":
        nodes.append(helper.make_node("Softmax", ["a"], ["p"], axis=-1))
        first = "p"
    product = "y" if context != "scores" else "s"
    nodes.append(helper.make_node("Einsum", [first, "b"], [product], equation=equation))
    if context == "scores":
        nodes.append(helper.make_node("Softmax", ["s"], ["y"], axis=-1))
    out = list(np.einsum(equation, np.zeros(a), np.zeros(b)).shape)
    graph = helper.make_graph(nodes, "einsum", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


PRODUCTS = {  # tf2onnx's BERT layer, a transposed result
    "projection": ("abc,cde->abde", [2, 5, 16], [16, 4, 8], "weight", {"MatMul", "Reshape"}),
    "scores": ("aecd,abcd->acbe", [2, 7, 4, 8], [2, 5, 4, 8], "scores", {"MatMul", "Transpose"}),
    "values": ("acbe,aecd->abcd", [2, 4, 5, 7], [2, 7, 4, 8], "probs", {"MatMul", "Transpose"}),
    "out_projection": ("abcd,cde->abe", [2, 5, 4, 8], [4, 8, 16], "weight", {"MatMul", "Reshape"}),
    "transposed": ("ij,jk->ki", [3, 4], [4, 5], "weight", {"MatMul", "Transpose"}),
}


@pytest.mark.parametrize("case", list(PRODUCTS))
def test_a_matrix_product_einsum_becomes_a_matmul_with_its_values(case: str) -> None:
    equation, a, b, context, ops = PRODUCTS[case]
    model = load_model(einsum_model(equation, a, b, context))
    rewritten, count = einsum_matmuls(model)
    assert count == 1
    got_ops = {n.op_type for n in rewritten.graph.node} - {"Softmax"}
    assert "Einsum" not in got_ops and got_ops <= ops, got_ops
    if context == "weight":  # the weight permuted and reshaped once, into an initializer
        assert not any(n.input[0] == "b" for n in rewritten.graph.node if n.op_type in ("Transpose", "Reshape"))
    onnx.checker.check_model(rewritten, full_check=True)
    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal(a).astype(np.float32)}
    if context != "weight":
        feeds["b"] = rng.standard_normal(b).astype(np.float32)
    want, got = _run(model, feeds), _run(rewritten, feeds)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_scores_read_the_second_operand_first_so_no_transpose_follows_the_matmul() -> None:
    """tf2onnx's scores name the second operand's free letter first ([a, c, b, e]): B @ A needs no Transpose of the
    product, so the attention rule sees MatMul(q, kᵀ) straight into the mask's Add."""
    model = load_model(einsum_model("aecd,abcd->acbe", [2, 7, 4, 8], [2, 5, 4, 8], "scores"))
    rewritten, _ = einsum_matmuls(model)
    matmul = next(n for n in rewritten.graph.node if n.op_type == "MatMul")
    assert rewritten.graph.node[-1].op_type == "Softmax" and rewritten.graph.node[-1].input[0] == matmul.output[0]


@pytest.mark.parametrize("equation, a, b, context, product", [
    ("bhqd,bhkd->bhqk", [1, 2, 5, 8], [1, 2, 6, 8], "scores", False),  # read as it is by the attention rule
    ("ab,cb->ac", [3, 4], [5, 4], "weight", False),                    # A Bᵀ: read as it is too
    ("abc,cd->ad", [2, 3, 4], [4, 5], "weight", False),                # b summed within one operand
    ("ab,ab->ab", [3, 4], [3, 4], "scores", False),                    # nothing summed
    ("bhwc,hkc->bhwk", [2, 6, 5, 8], [6, 9, 8], "weight", True),       # SAM's relative position: per head
    ("aecd,abcd->acbe", [2, 7, 4, 8], [2, 5, 4, 8], "", True),         # computed tensors, no attention
], ids=["batched-matmul", "a-times-b-transposed", "summed-within-one", "elementwise", "per-head-table",
        "no-attention"])
def test_other_forms_are_left_alone(equation: str, a: list[int], b: list[int], context: str, product: bool) -> None:
    """Forms that are no matrix product here, or that the rules read as they are; and products that feed neither a
    GEMM nor an attention (ONNX Runtime's one Einsum kernel beats a MatMul with Transposes around it)."""
    model = load_model(einsum_model(equation, a, b, context))
    assert einsum_matmuls(model) == (model, 0)
    view = GraphView(model)
    assert (einsum_product(view, next(n for n in view.nodes if n.op_type == "Einsum")) is not None) == product


def tf2onnx_layer() -> onnx.ModelProto:
    """A BERT layer as tf2onnx writes it: Einsum projections of W [C, H, D], scores Einsum("aecd,abcd->acbe", q, k*s),
    P V Einsum("acbe,aecd->abcd"), output projection Einsum("abcd,cde->abe"), a padding mask from an int mask."""
    rng = np.random.default_rng(0)
    h, d, c, s = 4, 16, 64, 12

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    nodes = [helper.make_node("LayerNormalization", ["x", "g", "beta"], ["ln"], axis=-1),
             *(helper.make_node("Einsum", ["ln", f"w{r}"], [f"{r}0"], equation="abc,cde->abde") for r in "qkv"),
             *(helper.make_node("Add", [f"{r}0", f"b{r}"], [f"{r}"]) for r in "qkv"),
             helper.make_node("Mul", ["k", "scale"], ["ks"]),
             helper.make_node("Unsqueeze", ["mask", "axes"], ["m4"]),
             helper.make_node("Cast", ["m4"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Sub", ["one", "mf"], ["keep"]),
             helper.make_node("Mul", ["keep", "big"], ["madd"]),
             helper.make_node("Einsum", ["ks", "q"], ["qk"], equation="aecd,abcd->acbe"),
             helper.make_node("Add", ["qk", "madd"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["p"], axis=3),
             helper.make_node("Einsum", ["p", "v"], ["o"], equation="acbe,aecd->abcd"),
             helper.make_node("Einsum", ["o", "wo"], ["o2"], equation="abcd,cde->abe"),
             helper.make_node("Add", ["o2", "bo"], ["o3"]),
             helper.make_node("Add", ["o3", "x"], ["res"]),
             helper.make_node("LayerNormalization", ["res", "g", "beta"], ["y"], axis=-1)]
    inits = [w("g", c), w("beta", c), *(w(f"w{r}", c, h, d) for r in "qkv"), *(w(f"b{r}", h, d) for r in "qkv"),
             w("wo", h, d, c), w("bo", c), numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
             numpy_helper.from_array(np.float32(1), "one"), numpy_helper.from_array(np.float32(-10000), "big"),
             numpy_helper.from_array(np.float32(d ** -0.5), "scale")]
    graph = helper.make_graph(nodes, "tf2onnx_layer",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, s, c]),
                               helper.make_tensor_value_info("mask", TensorProto.INT64, [2, s])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, s, c])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_tf2onnx_einsum_attention_fuses_into_one_attention_node_with_gemms(tmp_path: Path) -> None:
    """Before, no Einsum of this layer was a MatMul to the rules: the attention's Softmax had "no operand from a QKᵀ
    MatMul" and the projections ran as ONNX Runtime Einsums. Now the attention is one node, every projection a GEMM,
    and the rewritten model computes the original through the CPU library and the emulated kernels."""
    original = tf2onnx_layer()
    result = optimize(original, GtcoConfig())
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention_f32") == 1 and "Einsum" not in ops and "Softmax" not in ops, ops
    assert sum(op.startswith(("Gemm_", "Qkv_")) for op in ops) >= 2, ops
    assert_close_through_built_libraries(original, result.model, tmp_path, 2e-3, "tf2onnx layer fp32", "Attention_")
