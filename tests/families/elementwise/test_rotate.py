"""Rotary embeddings' rotate-half as a signed roll (families/elementwise/rotate.py): the rewrite is exact, leaves
other Concats alone, and lets the whole rotary embedding (x * cos + rotate_half(x) * sin) run as one elementwise
kernel, also where the attention after it takes the query's scale; equal to the original through the function, the
CPU library and the emulated kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import assert_close_through_built_libraries
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.elementwise.rotate import rotate_halves, signed_rolls
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.plugin.coverage import model_coverage

B, H, S, D = 2, 4, 16, 32


def _i64(name: str, v: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array([v], np.int64), name)


def rotary_model(*, other_source: bool = False, axis: int = -1, neg_read_twice: bool = False,
                 attention: bool = False, symbolic: bool = False, packed: bool = False) -> onnx.ModelProto:
    """q [B, H, S, D] (and k): q * cos + Concat(-q[..., D/2:], q[..., :D/2]) * sin with cos, sin [1, 1, S, D]
    computed from positions; with `attention`, the scaled scores softmax(q_rot * scale @ k_rot^T) @ v after it.
    `symbolic`: as the TorchScript exporter writes it with dynamic axes: q, k, v inputs [batch, seq, H, D] split into
    heads by a Transpose, the angles an input [seq, D] whose cos and sin are unsqueezed to [1, 1, seq, D] once, and
    (with `attention`) a second layer reading those tables too: rotary and attention over the first one's output.
    `packed` (with `attention`): q, k and v sliced from one [B, S, 3 * H * D] input as ModernBERT's dynamo export
    writes it (Reshape [B, S, 3, H, D], then per tensor Slice, Squeeze, head-split Transpose)."""
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    freqs = np.outer(np.arange(S), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)[None, None].astype(np.float32)
    inits = [_i64("zero", 0), _i64("half", D // 2), _i64("end", 2**62),
             _i64("last", 3 if axis == -1 else 2), numpy_helper.from_array(np.float32(D ** -0.5), "scale")]
    if not symbolic:
        inits.append(numpy_helper.from_array(emb, "angles"))
    nodes = [helper.make_node("Cos", ["angles"], ["cos"]), helper.make_node("Sin", ["angles"], ["sin"])]
    if symbolic:
        inits.append(numpy_helper.from_array(np.array([0, 1], np.int64), "lead"))
        nodes = [helper.make_node("Cos", ["angles"], ["cos2"]), helper.make_node("Sin", ["angles"], ["sin2"]),
                 helper.make_node("Unsqueeze", ["cos2", "lead"], ["cos"]),
                 helper.make_node("Unsqueeze", ["sin2", "lead"], ["sin"])]
        nodes += [helper.make_node("Transpose", [f"{x}_bshd"], [x], perm=[0, 2, 1, 3]) for x in "qkv"]

    if packed:
        inits += [numpy_helper.from_array(np.array([B, S, 3, H, D], np.int64), "qkv_shape"),
                  numpy_helper.from_array(np.array([2], np.int64), "part_axis")]
        nodes.append(helper.make_node("Reshape", ["qkv", "qkv_shape"], ["qkv5"]))
        for i, x in enumerate("qkv"):
            inits += [_i64(f"{x}_from", i), _i64(f"{x}_to", i + 1)]
            nodes += [helper.make_node("Slice", ["qkv5", f"{x}_from", f"{x}_to", "part_axis"], [f"{x}_part"]),
                      helper.make_node("Squeeze", [f"{x}_part", "part_axis"], [f"{x}_bshd"]),
                      helper.make_node("Transpose", [f"{x}_bshd"], [x], perm=[0, 2, 1, 3])]

    def rope(x: str) -> str:
        src2 = "other" if other_source else x
        nodes.extend([
            helper.make_node("Slice", [x, "zero", "half", "last"], [f"{x}1"]),
            helper.make_node("Slice", [src2, "half", "end", "last"], [f"{x}2"]),
            helper.make_node("Neg", [f"{x}2"], [f"{x}n"]),
            helper.make_node("Concat", [f"{x}n", f"{x}1"], [f"{x}r"], axis=axis),
            helper.make_node("Mul", [x, "cos"], [f"{x}c"]),
            helper.make_node("Mul", [f"{x}r", "sin"], [f"{x}s"]),
            helper.make_node("Add", [f"{x}c", f"{x}s"], [f"{x}_rot"]),
        ])
        return f"{x}_rot"

    def attend(q: str, k: str, v: str, out: str) -> str:
        """softmax(q * scale @ k^T) @ v, written to `out`."""
        nodes.extend([helper.make_node("Mul", [q, "scale"], [f"{out}_qs"]),
                      helper.make_node("Transpose", [k], [f"{out}_kt"], perm=[0, 1, 3, 2]),
                      helper.make_node("MatMul", [f"{out}_qs", f"{out}_kt"], [f"{out}_scores"]),
                      helper.make_node("Softmax", [f"{out}_scores"], [f"{out}_probs"], axis=-1),
                      helper.make_node("MatMul", [f"{out}_probs", v], [out])])
        return out

    q = rope("q")
    outputs = [q]
    if neg_read_twice:
        outputs.append("qn")
    if attention:
        outputs = [attend(q, rope("k"), "v", "out")]
        if symbolic:  # the second layer
            x = rope("out")
            outputs = [attend(x, x, "out", "layer2")]
    shape = ["batch", H, "seq", D] if symbolic else [B, H, S, D]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
              for n in ("q", *(("k", "v") if attention else ()), *(("other",) if other_source else ()))]
    if packed:
        inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [B, S, 3 * H * D])]
    if symbolic:
        inputs = [helper.make_tensor_value_info(f"{i.name}_bshd", TensorProto.FLOAT, ["batch", "seq", H, D])
                  for i in inputs] + [helper.make_tensor_value_info("angles", TensorProto.FLOAT, ["seq", D])]
    half = [B, H, S, D // 2]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, half if o == "qn" else shape) for o in outputs]
    graph = helper.make_graph(nodes, "rope", inputs, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_rotate_half_becomes_a_roll_times_a_sign_with_the_same_bits() -> None:
    model = load_model(rotary_model())
    rewritten, found = signed_rolls(model)
    assert [(r.half, r.width) for r in found] == [(D // 2, D)]
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Neg" not in ops and ops.count("Concat") == 1
    sign = next(numpy_helper.to_array(t) for t in rewritten.graph.initializer if t.name.endswith("rotate_half_sign"))
    np.testing.assert_array_equal(sign, np.r_[-np.ones(D // 2), np.ones(D // 2)].astype(np.float32))
    onnx.checker.check_model(rewritten, full_check=True)
    q = np.random.default_rng(2).standard_normal((B, H, S, D)).astype(np.float32)
    np.testing.assert_array_equal(_run(rewritten, {"q": q})[0], _run(model, {"q": q})[0])


@pytest.mark.parametrize("kwargs", [{"other_source": True}, {"axis": 2}, {"neg_read_twice": True}],
                         ids=["halves-of-two-tensors", "another-axis", "negated-half-read-elsewhere"])
def test_other_concats_are_left_alone(kwargs: dict) -> None:
    model = load_model(rotary_model(**kwargs))
    assert rotate_halves(GraphView(model)) == []
    assert signed_rolls(model) == (model, [])


def _fused_ops(model: onnx.ModelProto) -> dict[str, list[str]]:
    funcs = {f.name: [n.op_type for n in f.node] for f in model.functions}
    return {n.name: funcs[n.op_type] for n in model.graph.node if n.domain == "ai.gtco"}


def test_a_rotary_embedding_before_an_attention_is_one_elementwise_kernel_per_tensor() -> None:
    result = optimize(rotary_model(attention=True), GtcoConfig(precision="fp16"))
    fused = _fused_ops(result.model)
    ropes = [ops for ops in fused.values() if "Concat" in ops]
    assert len(ropes) == 2 and all(ops.count("Slice") == 2 and "Sin" not in ops for ops in ropes), fused
    assert not [n.op_type for n in result.model.graph.node if n.op_type in ("Slice", "Concat", "Neg")]
    coverage = model_coverage(result.model)
    assert {n: c.reason for n, c in coverage.nodes.items() if not c.archs} == {}


def test_q_and_k_rotaries_of_a_packed_qkv_leave_its_reshape_to_onnxruntime() -> None:
    """ModernBERT's form: q, k and v sliced from one reshaped packed tensor, v only head-split. The rotary group less
    v's slice (which the attention reads through) would write the shared Reshape's result, of another shape than its
    rotated q and k, and had no kernel, so the DP left the attention unfused to keep the rotaries in one kernel; the
    group now reads that Reshape (a view, free in ONNX Runtime) instead, and the attention fuses too."""
    result = optimize(rotary_model(attention=True, packed=True), GtcoConfig(precision="fp16"))
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention_f16") == 1 and "Softmax" not in ops, ops
    coverage = model_coverage(result.model)
    assert coverage.error is None and {n: c.reason for n, c in coverage.nodes.items() if not c.archs} == {}


@pytest.mark.slow
def test_the_cpu_library_and_the_emulated_kernels_compute_the_original(tmp_path: Path) -> None:
    original = rotary_model(attention=True)
    rewritten = optimize(original, GtcoConfig(precision="fp16")).model
    assert_close_through_built_libraries(original, rewritten, tmp_path, 5e-3, "rotary fp16", "Elementwise_")


def test_over_symbolic_dims_the_roll_folds_and_every_fused_node_has_a_kernel() -> None:
    """The TorchScript exporter's form (batch and sequence symbolic, heads split by a Transpose, the cos / sin tables
    unsqueezed once for two layers): the head split and the rotate-half roll fold into the rotary kernel over
    run-time shapes, so no Transpose, Slice, Concat or Neg is left to launch, and every fused node has a device
    kernel."""
    result = optimize(rotary_model(attention=True, symbolic=True), GtcoConfig(precision="fp16"))
    ropes = [ops for ops in _fused_ops(result.model).values() if "Concat" in ops]
    assert sum(ops.count("Concat") for ops in ropes) == 3 and sum(ops.count("Slice") for ops in ropes) == 6, ropes
    # nor the head split's Transposes: they fold into the rotary kernels' loads
    assert not [n.op_type for n in result.model.graph.node if n.op_type in ("Slice", "Concat", "Neg", "Transpose")]
    coverage = model_coverage(result.model)
    assert {n: c.reason for n, c in coverage.nodes.items() if not c.archs} == {}


@pytest.mark.slow
def test_over_symbolic_dims_the_libraries_compute_the_original_at_two_sizes(tmp_path: Path) -> None:
    original = rotary_model(attention=True, symbolic=True)
    rewritten = optimize(original, GtcoConfig(precision="fp16")).model
    assert_close_through_built_libraries(original, rewritten, tmp_path, 5e-3, "symbolic rotary fp16", "Elementwise_",
                                         sizes=({"batch": 2, "seq": 16}, {"batch": 1, "seq": 5}))
