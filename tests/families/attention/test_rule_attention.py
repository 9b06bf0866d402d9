"""Attention in the forms exporters write: BERT, torch SDPA, timm fused qkv, Swin windows, ONNX Attention."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from onnx_gtco.families.attention.rule import AttentionPattern
from onnx_gtco.ir.view import GraphView
from onnx_gtco.patterns.util import const_scalar, static_value

RULE = AttentionPattern()
CORE = {"qk", "scale", "mask_add", "softmax"}


def bert(kit, *, outputs: tuple[str, ...] = ("out",)):
    """x[1,8,16] -> q/k/v projections -> 2 heads x 8 -> (QKᵀ / sqrt 8 + mask) -> softmax -> PV -> merge."""
    g = kit.graph()
    g.input("x", [1, 8, 16])
    g.input("mask", [1, 1, 1, 8])
    heads = g.const("heads", np.array([1, 8, 2, 8], dtype=np.int64))
    merged = g.const("merged", np.array([1, 8, 16], dtype=np.int64))
    for n in "qkv":
        g.op("MatMul", ["x", g.weight(f"w{n}", 16, 16)], f"{n}_proj")
        g.op("Reshape", [f"{n}_proj", heads], f"{n}_split")
    g.op("Transpose", ["q_split"], "q_t", perm=[0, 2, 1, 3])
    g.op("Transpose", ["k_split"], "k_t", perm=[0, 2, 3, 1])
    g.op("Transpose", ["v_split"], "v_t", perm=[0, 2, 1, 3])
    g.op("MatMul", ["q_t", "k_t"], "qk")
    g.op("Div", ["qk", g.const("sqrt_d", np.float32(math.sqrt(8)))], "scale")
    g.op("Add", ["scale", "mask"], "mask_add")
    g.op("Softmax", ["mask_add"], "softmax", axis=-1)
    g.op("MatMul", ["softmax", "v_t"], "pv")
    g.op("Transpose", ["pv"], "merge_t", perm=[0, 2, 1, 3])
    g.op("Reshape", ["merge_t", merged], "merge")
    g.op("MatMul", ["merge", g.weight("wo", 16, 16)], "out")
    g.output(*outputs)
    return g


def test_bert_form_gives_bmm_softmax_attention_and_the_extended_variant(kit) -> None:
    view = bert(kit).view()
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    assert kit.groups(view, matches) == [
        CORE,
        CORE | {"pv"},
        CORE | {"pv", "q_split", "q_t", "k_split", "k_t", "v_split", "v_t", "merge_t", "merge"},
    ]
    assert [m.family for m in matches] == ["bmm_softmax", "attention", "attention"]
    base, ext = matches[1].attrs, matches[2].attrs
    assert base == {
        "heads": 2, "head_dim": 8, "seq_q": 8, "seq_k": 8, "scale": pytest.approx(1 / math.sqrt(8)),
        "mask": True, "bias": False, "nan_guard": False, "batch_dims": (1,),
        "q_layout": "bhsd", "k_layout": "bhds", "v_layout": "bhsd", "out_layout": "bhsd",
    }
    assert {k: ext[k] for k in ("q_layout", "k_layout", "v_layout", "out_layout")} == dict.fromkeys(
        ("q_layout", "k_layout", "v_layout", "out_layout"), "bshd_merged")


def sdpa(kit, *, guard: bool = True, cast: bool = False):
    """torch SDPA: Mul(q, sqrt s), Transpose(k) -> Mul(kᵀ, sqrt s), MatMul, Softmax, NaN guard, MatMul."""
    g = kit.graph()
    for n in "qkv":
        g.input(n, [1, 2, 8, 4])
    root = g.const("root_scale", np.float32(math.sqrt(0.5)))
    g.op("Mul", ["q", root], "q_scaled")
    g.op("Transpose", ["k"], "k_t", perm=[0, 1, 3, 2])
    g.op("Mul", ["k_t", root], "k_scaled")
    g.op("MatMul", ["q_scaled", "k_scaled"], "qk")
    g.op("Softmax", ["qk"], "softmax", axis=-1)
    probs = "softmax"
    if cast:
        probs = g.op("Cast", ["softmax"], "cast", to=TensorProto.FLOAT)
    if guard:
        g.op("IsNaN", [probs], "isnan")
        probs = g.op("Where", ["isnan", g.const("zero", np.float32(0)), probs], "guard")
    g.op("MatMul", [probs, "v"], "pv")
    g.output("pv")
    return g


def test_sdpa_form_scales_on_both_sides_and_the_nan_guard(kit) -> None:
    view = sdpa(kit).view()
    matches, _ = kit.run(RULE, view)
    core = {"q_scaled", "k_scaled", "qk", "softmax", "isnan", "guard"}
    assert kit.groups(view, matches) == [core, core | {"pv"}, core | {"pv", "k_t"}]
    assert matches[0].attrs["scale"] == pytest.approx(0.5)
    assert matches[0].attrs["nan_guard"] is True and matches[0].attrs["mask"] is False
    assert matches[2].attrs["k_layout"] == "bhsd"  # the explicit kᵀ is inside: the kernel reads k as it is


def test_a_same_type_cast_of_the_probabilities_leaves_at_load_and_the_chain_fuses(kit) -> None:
    """The export's Cast of the probabilities to the type they have is a no-op the load stage removes; the chain
    from the scaled q and k to PV is one attention group as without it."""
    view = sdpa(kit, guard=False, cast=True).view()
    assert "cast" not in {n.name for n in view.nodes}
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches)[1] == {"q_scaled", "k_scaled", "qk", "softmax", "pv"}


def test_scale_computed_from_a_runtime_shape_is_evaluated_statically(kit) -> None:
    """torch's opset-14 SDPA: scale = sqrt(1 / sqrt(float(q.shape[-1]))) when the loader left it unfolded."""
    g = kit.graph()
    g.input("q", [1, 2, 8, 4])
    g.op("Shape", ["q"], "shape")
    g.op("Slice", ["shape", g.const("m1", np.array([-1])), g.const("big", np.array([2**62]))], "last")
    g.op("Cast", ["last"], "as_float", to=TensorProto.FLOAT)
    g.op("Sqrt", ["as_float"], "root_d")
    g.op("Div", [g.const("one", np.float32(1)), "root_d"], "inv")
    g.op("Sqrt", ["inv"], "root_scale")
    g.output("root_scale")
    model = onnx.shape_inference.infer_shapes(g.model())
    view = GraphView(model)
    assert view.const_value("root_scale") is None
    assert const_scalar(view, "root_scale") == pytest.approx(0.5 ** 0.5)
    assert static_value(view, "last").tolist() == [4]


def fused_qkv(kit, unbind: str = "Gather"):
    """timm: qkv Linear -> Reshape[B,N,3,H,D] -> Transpose[2,0,3,1,4] -> unbind -> q*s @ kᵀ -> softmax @ v."""
    g = kit.graph()
    g.input("x", [1, 8, 16])
    g.op("MatMul", ["x", g.weight("w", 16, 48)], "qkv")
    g.op("Add", ["qkv", g.weight("b", 48)], "qkv_bias")
    g.op("Reshape", ["qkv_bias", g.const("s5", np.array([1, 8, 3, 2, 8]))], "qkv_split")
    g.op("Transpose", ["qkv_split"], "qkv_t", perm=[2, 0, 3, 1, 4])
    if unbind == "Gather":
        for i, n in enumerate("qkv"):
            g.op("Gather", ["qkv_t", g.const(f"i{i}", np.array(i))], n, axis=0)
    else:
        g.op("Split", ["qkv_t", g.const("ones", np.array([1, 1, 1]))], "split", outputs=3, axis=0)
        for i, n in enumerate("qkv"):
            g.op("Squeeze", ["split" if i == 0 else f"split:{i}", g.const(f"ax{i}", np.array([0]))], n)
    g.op("Mul", ["q", g.const("s", np.float32(8 ** -0.5))], "q_scaled")
    g.op("Transpose", ["k"], "k_t", perm=[0, 1, 3, 2])
    g.op("MatMul", ["q_scaled", "k_t"], "qk")
    g.op("Softmax", ["qk"], "softmax", axis=-1)
    g.op("MatMul", ["softmax", "v"], "pv")
    g.op("Transpose", ["pv"], "merge_t", perm=[0, 2, 1, 3])
    g.op("Reshape", ["merge_t", g.const("s3", np.array([1, 8, 16]))], "merge")
    g.output("merge")
    return g


@pytest.mark.parametrize("unbind", ["Gather", "Split"])
def test_timm_fused_qkv_is_absorbed_up_to_the_packed_projection_output(kit, unbind: str) -> None:
    view = fused_qkv(kit, unbind).view()
    matches, _ = kit.run(RULE, view)
    ext = matches[-1]
    unbound = {"q", "k", "v"} | ({"split"} if unbind == "Split" else set())
    assert kit.names(view, ext.nodes) == {"qkv_split", "qkv_t", "q_scaled", "k_t", "qk", "softmax", "pv",
                                          "merge_t", "merge"} | unbound
    assert view.external_inputs(ext.nodes)[0] == "qkv_bias"
    assert (ext.attrs["q_layout"], ext.attrs["k_layout"], ext.attrs["v_layout"], ext.attrs["out_layout"]) == (
        "qkv_packed", "qkv_packed", "qkv_packed", "bshd_merged")
    assert ext.attrs["scale"] == pytest.approx(8 ** -0.5) and ext.attrs["heads"] == 2


def swin(kit, mask_shape: tuple[int, ...] = (1, 4, 1, 8, 8), bias: bool = False):
    """Window attention: q*s @ kᵀ + rel-pos bias -> Reshape[B,nW,H,N,N] + shift mask -> Reshape -> softmax
    (`bias`: a random term in place of the 0 / -100 mask; the windows [B, nW] follow mask_shape's first dims)."""
    g = kit.graph(seed=3)
    for n in "qkv":
        g.input(n, [4, 2, 8, 4])
    g.op("Mul", ["q", g.const("s", np.float32(0.5))], "q_scaled")
    g.op("Transpose", ["k"], "k_t", perm=[0, 1, 3, 2])
    g.op("MatMul", ["q_scaled", "k_t"], "qk")
    g.op("Add", ["qk", g.weight("rel_pos", 1, 2, 8, 8)], "bias_add")
    win = [max(1, 4 // mask_shape[1]), mask_shape[1], 2, 8, 8]
    g.op("Reshape", ["bias_add", g.const("win", np.array(win))], "to_windows")
    rng = np.random.default_rng(0)
    mask = rng.standard_normal(mask_shape) if bias else np.where(rng.random(mask_shape) > 0.5, -100.0, 0.0)
    mask = mask.astype(np.float32)
    g.op("Add", [g.const("shift_mask", mask), "to_windows"], "mask_add")
    g.op("Reshape", ["mask_add", g.const("back", np.array([4, 2, 8, 8]))], "from_windows")
    g.op("Softmax", ["from_windows"], "softmax", axis=-1)
    g.op("MatMul", ["softmax", "v"], "pv")
    g.output("pv")
    return g


def test_swin_walks_through_reshape_add_reshape_and_tells_mask_from_bias(kit) -> None:
    view = swin(kit).view()
    matches, _ = kit.run(RULE, view)
    core = {"q_scaled", "qk", "bias_add", "to_windows", "mask_add", "from_windows", "softmax"}
    assert kit.groups(view, matches)[:2] == [core, core | {"pv"}]
    attrs = matches[1].attrs
    assert (attrs["mask"], attrs["bias"], attrs["heads"], attrs["seq_q"]) == (True, True, 2, 8)
    assert attrs["batch_dims"] == (4,)
    assert attrs["scale"] == pytest.approx(0.5)
    # the shift mask between the reshapes is the mask, read at batch row b % nW; nothing else is in the way
    assert (attrs["mask_period"], "scores_path" in attrs) == (4, False)
    assert "shift_mask" in matches[1].roles["mask"] and "rel_pos" in matches[1].roles["bias"]


@pytest.mark.parametrize("term", ["bias", "per_image"])
def test_swin_window_term_that_is_not_a_periodic_mask_stays_a_scores_path(kit, term: str) -> None:
    """A bias added between the window reshapes, or a mask with a dim per image, is no mask read at row b % nW: the
    reshapes stay in scores_path (the binder refuses those)."""
    g = swin(kit, mask_shape=(2, 2, 1, 8, 8) if term == "per_image" else (1, 4, 1, 8, 8), bias=term == "bias")
    view = g.view()
    matches, _ = kit.run(RULE, view)
    attrs = matches[1].attrs
    assert "mask_period" not in attrs and attrs["scores_path"][:2] == ("Reshape", "Reshape")


def test_onnx_attention_op_is_a_single_node_candidate(kit) -> None:
    g = kit.graph()
    for n in "qkv":
        g.input(n, [1, 2, 8, 4])
    g.op("Attention", ["q", "k", "v"], "attn")
    g.output("attn")
    view = g.view(opset=23)
    matches, _ = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"attn"}]
    assert matches[0].family == "attention"
    assert matches[0].attrs["scale"] == pytest.approx(0.5) and matches[0].attrs["heads"] == 2


def test_near_misses_say_why(kit) -> None:
    g = kit.graph()
    for n in "qkv":
        g.input(n, [1, 2, 8, 8])
    g.input("s", [1])
    g.op("MatMul", ["q", "k"], "qk")
    g.op("Softmax", ["qk"], "sm_axis1", axis=1)
    g.op("Mul", ["qk", "s"], "runtime_scale")  # qk is read twice: the Softmax chain below also fails for it
    g.op("MatMul", ["q", "v"], "qk2")
    g.op("Mul", ["qk2", "s"], "scale2")
    g.op("Softmax", ["scale2"], "sm_scale", axis=-1)
    g.op("MatMul", ["q", "k"], "qk3")
    g.op("Softmax", ["qk3"], "sm_b", axis=-1)
    g.op("MatMul", ["v", "sm_b"], "pv_swapped")
    g.op("MatMul", ["q", g.weight("w", 8, 8)], "proj")
    g.op("Softmax", ["proj"], "sm_proj", axis=-1)
    g.output("sm_axis1", "runtime_scale", "sm_scale", "pv_swapped", "sm_proj")
    view = g.view()
    matches, rejects = kit.run(RULE, view)
    assert {r.anchor: r.reason for r in rejects} == {
        "sm_axis1": "Softmax axis 1 is not the last axis",
        "sm_scale": "scale of Mul 'scale2' on the scores is not a scalar constant",
        "sm_b": "second MatMul 'pv_swapped' reads the scores as its B operand",
        "sm_proj": "MatMul 'proj' before the Softmax has a constant 2-D B: a projection, not QKᵀ",
    }
    assert kit.groups(view, matches) == [{"qk3", "sm_b"}]  # the BMM+softmax half still fuses
    assert matches[0].family == "bmm_softmax"


def test_scale_after_the_mask_scales_the_mask_too(kit) -> None:
    """softmax((QKᵀ + mask) * s) is softmax(s QKᵀ + s mask): scale s and mask_scale s (the mask is no 0 / -inf
    constant here, so the two readings differ); a scale between the mask and the bias scales only the mask."""
    g = kit.graph()
    for n in ("q", "k", "mask"):
        g.input(n, [1, 2, 8, 8])
    g.op("MatMul", ["q", "k"], "qk")
    g.op("Add", ["qk", "mask"], "masked")
    g.op("Mul", ["masked", g.const("s", np.float32(0.125))], "scaled")
    g.op("Softmax", ["scaled"], "softmax", axis=-1)
    g.output("softmax")
    view = g.view()
    matches, rejects = kit.run(RULE, view)
    assert [r.reason for r in rejects] == ["attention probabilities 'softmax' are also read outside (graph output or a "
                                          "second reader)"]
    assert kit.groups(view, matches) == [{"qk", "masked", "scaled", "softmax"}]
    attrs = matches[0].attrs
    assert (attrs["scale"], attrs["mask_scale"], attrs["mask"]) == (0.125, 0.125, True)
    assert "bias_scale" not in attrs and matches[0].roles["mask"] == "mask"

    g = kit.graph()
    for n in ("q", "k", "mask"):
        g.input(n, [1, 2, 8, 8])
    g.op("MatMul", ["q", "k"], "qk")
    g.op("Div", ["qk", g.const("d", np.float32(2.0))], "half")
    g.op("Add", ["half", "mask"], "masked")
    g.op("Mul", ["masked", g.const("s", np.float32(0.25))], "scaled")
    g.op("Add", ["scaled", g.weight("rel_pos", 1, 2, 8, 8)], "biased")
    g.op("Softmax", ["biased"], "softmax", axis=-1)
    g.output("softmax")
    (match,), _ = kit.run(RULE, g.view())
    assert (match.attrs["scale"], match.attrs["mask_scale"], match.attrs["bias"]) == (0.125, 0.25, True)
    assert "bias_scale" not in match.attrs


def test_scale_after_a_where_mask_is_refused(kit) -> None:
    g = kit.graph()
    for n in ("q", "k"):
        g.input(n, [1, 2, 8, 8])
    g.input("keep", [1, 1, 8, 8], TensorProto.BOOL)
    g.op("MatMul", ["q", "k"], "qk")
    g.op("Where", ["keep", "qk", g.const("ninf", np.float32(-np.inf))], "masked")
    g.op("Mul", ["masked", g.const("s", np.float32(0.125))], "scaled")
    g.op("Softmax", ["scaled"], "softmax", axis=-1)
    g.output("softmax")
    _, rejects = kit.run(RULE, g.view())
    assert rejects[0].reason == "the scale is applied after Where 'masked' (mask/bias), not to QKᵀ"


def test_graph_outputs_inside_the_chain_leave_only_legal_candidates(kit) -> None:
    view = bert(kit, outputs=("out", "scale", "q_t")).view()
    matches, rejects = kit.run(RULE, view)
    assert matches == [] and rejects[0].reason == "scores 'scale' are also read outside the attention chain"
    view = bert(kit, outputs=("out", "softmax", "q_t")).view()
    matches, rejects = kit.run(RULE, view)
    assert kit.groups(view, matches) == [CORE]
    assert "also read outside" in rejects[0].reason
    view = bert(kit, outputs=("out", "q_t")).view()  # q's transpose is an output: the extension stops there
    cands, _ = kit.collect(view)
    ext = max((c for c in cands if c.family == "attention"), key=lambda c: len(c.nodes))
    assert kit.names(view, ext.nodes) == CORE | {"pv", "k_split", "k_t", "v_split", "v_t", "merge_t", "merge"}
    assert ext.attr("q_layout") == "bhsd" and ext.attr("k_layout") == "bshd_merged"
    for c in cands:
        assert view.external_outputs(c.nodes)


def test_collect_keeps_every_attention_candidate(kit) -> None:
    view = bert(kit).view()
    cands, _ = kit.collect(view)
    fams = sorted(c.family for c in cands if c.pattern == "attention")
    assert fams == ["attention", "attention", "bmm_softmax"]


def test_scale_from_the_static_last_dim_of_a_dynamic_shape(kit) -> None:
    g = kit.graph()
    g.input("q", ["batch", 2, "seq", 4])
    g.op("Shape", ["q"], "shape")
    g.op("Slice", ["shape", g.const("m1", np.array([-1])), g.const("big", np.array([2**62]))], "last")
    g.op("Gather", ["shape", g.const("i3", np.array(3))], "d")
    g.op("Gather", ["shape", g.const("i0", np.array(0))], "b")
    g.op("Cast", ["last"], "as_float", to=TensorProto.FLOAT)
    g.output("as_float", "d", "b")
    view = GraphView(onnx.shape_inference.infer_shapes(g.model()))
    assert const_scalar(view, "as_float") == 4.0 and const_scalar(view, "d") == 4.0
    assert static_value(view, "b") is None


def tf2onnx_einsum(kit, *, qk: str = "bhqd,bhkd->bhqk", pv: str = "bhqk,bhkd->bhqd"):
    """tf2onnx's BERT attention: q, k, v [1,8,2,8] -> Transpose [0,2,1,3] -> Einsum(qk) -> Mul s -> Add mask ->
    Softmax -> Einsum(pv) -> Transpose -> Reshape [1,8,16]."""
    g = kit.graph()
    g.input("x", [1, 8, 16])
    g.input("mask", [1, 1, 1, 8])
    heads = g.const("heads", np.array([1, 8, 2, 8], dtype=np.int64))
    for n in "qkv":
        g.op("MatMul", ["x", g.weight(f"w{n}", 16, 16)], f"{n}_proj")
        g.op("Reshape", [f"{n}_proj", heads], f"{n}_split")
        g.op("Transpose", [f"{n}_split"], f"{n}_t", perm=[0, 2, 1, 3])
    g.op("Einsum", ["q_t", "k_t"], "qk", equation=qk)
    g.op("Mul", ["qk", g.const("s", np.float32(8 ** -0.5))], "scale")
    g.op("Add", ["scale", "mask"], "mask_add")
    g.op("Softmax", ["mask_add"], "softmax", axis=-1)
    g.op("Einsum", ["softmax", "v_t"], "pv", equation=pv)
    g.op("Transpose", ["pv"], "merge_t", perm=[0, 2, 1, 3])
    g.op("Reshape", ["merge_t", g.const("merged", np.array([1, 8, 16], dtype=np.int64))], "merge")
    g.output("merge")
    return g


def test_einsum_scores_of_tf2onnx_are_attention_reading_k_as_it_is(kit) -> None:
    """Einsum("bhqd,bhkd->bhqk") is Q Kᵀ with k untransposed: k_layout names k itself (bhsd, not bhds), and the head
    split pulls in the same Transpose for q, k and v."""
    view = tf2onnx_einsum(kit).view()
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    split = {f"{n}_{op}" for n in "qkv" for op in ("split", "t")}
    assert kit.groups(view, matches) == [CORE, CORE | {"pv"}, CORE | {"pv", "merge_t", "merge"} | split]
    assert [m.family for m in matches] == ["bmm_softmax", "attention", "attention"]
    base, ext = matches[1].attrs, matches[2].attrs
    assert (base["q_layout"], base["k_layout"], base["v_layout"], base["head_dim"]) == ("bhsd", "bhsd", "bhsd", 8)
    assert base["scale"] == pytest.approx(8 ** -0.5) and base["mask"] is True
    assert {ext[f"{r}_layout"] for r in ("q", "k", "v", "out")} == {"bshd_merged"}
    assert matches[2].roles["k"] == "k_proj"


@pytest.mark.parametrize(("qk", "pv", "reason"), [
    ("bhqd,bhkd->bhkq", "bhqk,bhkd->bhqd", "Add 'mask_add' before the Softmax: no operand comes from a QKᵀ MatMul"),
    ("bhqd,bhkd->bhqk", "bhqk,bhdk->bhqd", "Einsum 'pv' reads V transposed"),
    ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhdq", "the probabilities go to Einsum 'pv', not to a MatMul with V"),
])
def test_einsums_that_are_no_batched_matmul_are_left_alone(kit, qk: str, pv: str, reason: str) -> None:
    """Scores transposed by the equation (K Qᵀ), V read transposed, an output in another order: no attention group
    (the BMM+softmax half still fuses where only PV is off). S = D = 8 here, so every equation is shape-valid."""
    view = tf2onnx_einsum(kit, qk=qk, pv=pv).view()
    matches, rejects = kit.run(RULE, view)
    assert any(reason in r.reason for r in rejects), rejects
    assert all(m.family == "bmm_softmax" for m in matches)
    assert bool(matches) == qk.endswith("bhqk")


def test_a_packed_qkv_of_merged_rows_is_read_after_its_reshape(kit) -> None:
    """GPT-2's Conv1D: addmm on the rows [B*S, 3C], a Reshape to [B, S, 3C], a Split into q, k, v, each split into
    heads. The attention reads the packed [B, S, 3C] tensor (qkv_packed); the Reshape that merged B and S stays
    outside (no packed layout reads [B*S, 3C])."""
    b, s, h, d = 2, 8, 2, 4
    g = kit.graph()
    g.input("x", [b * s, h * d])
    g.op("Gemm", ["x", g.weight("w", h * d, 3 * h * d)], "addmm")
    g.op("Reshape", ["addmm", g.const("rows", np.array([b, s, 3 * h * d], np.int64))], "packed")
    g.op("Split", ["packed"], "split", outputs=3, axis=-1)
    heads = g.const("heads", np.array([b, s, h, d], np.int64))
    for i, n in enumerate("qkv"):
        g.op("Reshape", [f"split:{i}" if i else "split", heads], f"{n}_split")
        g.op("Transpose", [f"{n}_split"], f"{n}_t", perm=[0, 2, 3, 1] if n == "k" else [0, 2, 1, 3])
    g.op("MatMul", ["q_t", "k_t"], "qk")
    g.op("Softmax", ["qk"], "softmax", axis=-1)
    g.op("MatMul", ["softmax", "v_t"], "pv")
    g.output("pv")
    view = g.view()
    matches, _ = kit.run(RULE, view)
    packed = [m for m in matches if m.attrs.get("q_layout") == "qkv_packed"]
    assert len(packed) == 1 and packed[0].roles["q"] == "packed"
    assert "addmm" not in kit.names(view, packed[0].nodes) and "packed" not in kit.names(view, packed[0].nodes)
