"""Grouped-query attention (fewer key / value heads than query heads, each read by kv_group query heads): the kernels
in the emulation against the fp64 reference and against the same attention over K and V repeated by hand; what
`check` refuses; the rule folding transformers' repeat_kv (Unsqueeze, Expand, Reshape: 4-D, or the 3-D form a dynamo
export gives K) into the attention node; such a model equal to its original through its functions, the CPU library
and the emulated kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cpu_session import assert_close_through_built_libraries, assert_close_through_library
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.attention.kernel import AttentionFamily, BmmSoftmaxFamily, make_problem, output_dtype_array
from onnx_gtco.kernels.emulate import build_emulated, run_emulated
from onnx_gtco.kernels.family import from_storage, rel_error, to_storage
from onnx_gtco.plugin.coverage import model_coverage

ATTN, BMM = AttentionFamily(), BmmSoftmaxFamily()
TOL = {"f16": 2e-3, "bf16": 8e-3, "f32": 4e-4}
CONFIG = {"BQ": 64, "BKV": 64, "WARPS": 4, "STAGES": 2}

CASES = [  # (family, dtype, heads, kv_group, q/k/v layout, seq)
    (ATTN, "f16", 4, 2, "bhsd", 80),
    (ATTN, "bf16", 8, 4, "bshd_merged", 64),
    (ATTN, "f32", 4, 4, "bhsd", 49),
    (BMM, "f16", 4, 2, "bhsd", 72),
]


def _problem(family, dtype: str, heads: int, group: int, layout: str, seq: int):
    flags = {"q_layout": layout, "k_layout": layout, "kv_group": group}
    if family is ATTN:
        flags |= {"v_layout": layout, "out_layout": layout}
    return make_problem(family.name, dtype, batch=2, heads=heads, seq_q=seq, head_dim=64, **flags)


@pytest.mark.parametrize(("family", "dtype", "heads", "group", "layout", "seq"), CASES,
                         ids=[f"{c[0].name}-{c[1]}-h{c[2]}g{c[3]}-{c[4]}" for c in CASES])
def test_grouped_query_attention_matches_the_reference_of_repeated_k_and_v(tmp_path: Path, family, dtype: str,
                                                                           heads: int, group: int, layout: str,
                                                                           seq: int) -> None:
    prob = _problem(family, dtype, heads, group, layout, seq)
    inst = family.instantiate(prob, CONFIG, "sm_90")
    lib = build_emulated(inst, tmp_path, extra=("-O1",))
    inputs = family.random_inputs(prob, seed=5)
    assert inputs["k"].size * group == inputs["q"].size  # k holds heads / kv_group heads
    arrays = dict(inputs)
    for name, (shape, dt) in family.outputs(prob).items():
        arrays[name] = output_dtype_array(shape, dt)
    out = run_emulated(lib, inst.symbol, family.args_fields(prob, arrays), arrays, list(family.outputs(prob)))
    ref = family.reference(prob, inputs)
    # the same attention over K and V repeated by hand: each key / value head serves `group` query heads in a row
    plain = _problem(family, dtype, heads, 1, "bhsd", seq)
    bhsd = {n: _to_bhsd(inputs[n], layout, heads if n == "q" else heads // group) for n in inputs}
    rep = {n: np.repeat(x, 1 if n == "q" else group, axis=1) for n, x in bhsd.items()}
    want = family.reference(plain, rep)
    for name, got in out.items():
        mine = ref[name] if family is BMM or layout == "bhsd" else _to_bhsd(ref[name], layout, heads, float_=True)
        np.testing.assert_allclose(mine, want[name], rtol=1e-9, atol=1e-9)
        err = rel_error(from_storage(got, dtype), from_storage(to_storage(ref[name], dtype), dtype))
        assert err < TOL[dtype], f"{name}: ‖err‖/‖ref‖ = {err:.3g}"


def _to_bhsd(x: np.ndarray, layout: str, heads: int, float_: bool = False) -> np.ndarray:
    if layout == "bhsd":
        return x
    b, s, hd = x.shape
    y = x.reshape(b, s, heads, hd // heads).transpose(0, 2, 1, 3)
    return y if float_ else np.ascontiguousarray(y)


@pytest.mark.parametrize(("heads", "group", "layout", "words"), [
    (4, 3, "bhsd", "does not divide heads"),
    (4, 2, "qkv_packed", "qkv_packed"),
])
def test_check_refuses_what_grouped_query_attention_cannot_read(heads: int, group: int, layout: str,
                                                                 words: str) -> None:
    why = ATTN.check(_problem(ATTN, "f16", heads, group, layout, 64), CONFIG, "sm_90")
    assert why is not None and words in why


# ---------------------------------------------------------------------------------------------------------------
# repeat_kv in models
B, H, HKV, S, D = 2, 4, 2, 16, 32


def gqa_model(*, k_bmm_form: bool, v_heads: int = HKV) -> onnx.ModelProto:
    """x [B, S, H*D] -> q (H heads), k and v (HKV heads) projections, K and V repeated by transformers' repeat_kv
    (Unsqueeze axis 2, Expand [B, HKV, H/HKV, S, D], Reshape), scaled scores, softmax, P V, the heads merged back.
    `k_bmm_form`: K reaches the scores as a dynamo export writes it: the repeat reshaped to [B*H, S, D], transposed
    in 3-D and reshaped to [B, H, D, S]. `v_heads`: V's heads, repeated to H as K's are."""
    rng = np.random.default_rng(0)

    def c(name: str, v: object) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(v), name)

    inits = [c("wq", (0.2 * rng.standard_normal((H * D, H * D))).astype(np.float32)),
             c("wk", (0.2 * rng.standard_normal((H * D, HKV * D))).astype(np.float32)),
             c("wv", (0.2 * rng.standard_normal((H * D, v_heads * D))).astype(np.float32)),
             c("sq", np.array([B, S, H, D], np.int64)), c("skv", np.array([B, S, HKV, D], np.int64)),
             c("sv", np.array([B, S, v_heads, D], np.int64)),
             c("two", np.array([2], np.int64)), c("rep", np.array([B, HKV, H // HKV, S, D], np.int64)),
             c("rep_v", np.array([B, v_heads, H // v_heads, S, D], np.int64)),
             c("bhsd", np.array([B, H, S, D], np.int64)), c("flat", np.array([B * H, S, D], np.int64)),
             c("bhds", np.array([B, H, D, S], np.int64)), c("merged", np.array([B, S, H * D], np.int64)),
             c("scale", np.float32(D ** -0.5))]
    nodes: list[onnx.NodeProto] = []

    def node(op: str, ins: list[str], out: str, **kw: object) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=out, **kw))
        return out

    def heads(w: str, shape: str, name: str) -> str:
        return node("Transpose", [node("Reshape", [node("MatMul", ["x", w], f"{name}_mm"), shape], f"{name}_r")],
                    f"{name}_t", perm=[0, 2, 1, 3])

    def repeat(t: str, name: str, to: str, times: str = "rep") -> str:
        return node("Reshape", [node("Expand", [node("Unsqueeze", [t, "two"], f"{name}_u"), times], f"{name}_e"), to],
                    f"{name}_rep")

    q, k, v = heads("wq", "sq", "q"), heads("wk", "skv", "k"), heads("wv", "sv", "v")
    if k_bmm_form:
        kt = node("Reshape", [node("Transpose", [repeat(k, "k", "flat")], "k_t3", perm=[0, 2, 1]), "bhds"], "k_tr")
    else:
        kt = node("Transpose", [repeat(k, "k", "bhsd")], "k_tr", perm=[0, 1, 3, 2])
    scores = node("MatMul", [node("Mul", [q, "scale"], "q_s"), kt], "scores")
    ctx = node("MatMul", [node("Softmax", [scores], "probs", axis=-1), repeat(v, "v", "bhsd", "rep_v")], "ctx")
    node("Reshape", [node("Transpose", [ctx], "ctx_t", perm=[0, 2, 1, 3]), "merged"], "y")
    graph = helper.make_graph(nodes, "gqa", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, H * D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, H * D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("k_bmm_form", [False, True], ids=["4d", "k-3d-bmm-form"])
def test_the_repeat_of_k_and_v_folds_into_the_attention_node(tmp_path: Path, k_bmm_form: bool) -> None:
    original = gqa_model(k_bmm_form=k_bmm_form)
    rewritten = optimize(original, GtcoConfig(precision="fp16")).model
    (att,) = [n for n in rewritten.graph.node if n.op_type.startswith("Attention_")]
    attrs = {a.name: helper.get_attribute_value(a) for a in att.attribute}
    assert attrs["kv_heads"] == HKV and attrs["heads"] == H
    assert not [n.op_type for n in rewritten.graph.node if n.op_type in ("Expand", "Unsqueeze")]
    coverage = model_coverage(rewritten)
    assert coverage.nodes[att.name].archs, coverage.nodes[att.name].reason
    assert_close_through_library(original, rewritten, None, tmp_path, 5e-3, "gqa functions")


def test_k_and_v_repeated_unalike_keep_their_repeats_outside_the_node(tmp_path: Path) -> None:
    """K of 2 heads and V of 1, each repeated to 4: one kv_heads cannot describe both, so neither repeat folds in
    and the node reads K and V as repeated, in a layout it names, while q's head split and the head merge still
    fold in (a V branch cut back to its core operand is named as that operand, bhsd)."""
    original = gqa_model(k_bmm_form=False, v_heads=1)
    rewritten = optimize(original, GtcoConfig(precision="fp16")).model
    (att,) = [n for n in rewritten.graph.node if n.op_type.startswith("Attention_")]
    attrs = {a.name: helper.get_attribute_value(a) for a in att.attribute}
    assert "kv_heads" not in attrs and {attrs["k_layout"], attrs["v_layout"]} <= {b"bhsd", b"bhds"}
    assert attrs["q_layout"] == attrs["out_layout"] == b"bshd_merged"
    funcs = {f.name: [n.op_type for n in f.node] for f in rewritten.functions}
    assert "Expand" not in funcs[att.op_type]
    coverage = model_coverage(rewritten)
    assert coverage.nodes[att.name].archs, coverage.nodes[att.name].reason
    assert_close_through_library(original, rewritten, None, tmp_path, 5e-3, "unalike repeats")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_cpu_library_and_the_emulated_kernels_compute_the_original(tmp_path: Path, precision: str) -> None:
    original = gqa_model(k_bmm_form=True)
    rewritten = optimize(original, GtcoConfig(precision=precision)).model
    assert any(n.op_type.startswith("Attention_") for n in rewritten.graph.node)
    bound = {"fp32": 2e-3, "bf16": 3e-2}[precision]
    assert_close_through_built_libraries(original, rewritten, tmp_path, bound, f"gqa {precision}", "Attention_")
