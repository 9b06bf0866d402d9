"""The attention family's fused ops: attention (softmax(scores) v) and bmm_softmax (the probabilities alone)."""

from __future__ import annotations

from onnx_gtco.opspec import BOOL, DIM, DIMS, FLOAT, INT, INTS, STR, STRS, Attr, OpSpec

_ATTENTION = (Attr("heads", DIM), Attr("head_dim", DIM), Attr("seq_q", DIM), Attr("seq_k", DIM),
              Attr("scale", FLOAT), Attr("mask", BOOL, False), Attr("bias", BOOL, False),
              Attr("nan_guard", BOOL, False), Attr("batch_dims", DIMS, ()), Attr("q_layout", STR, "bhsd"),
              Attr("k_layout", STR, "bhds"), Attr("causal", BOOL, False), Attr("scores_path", STRS, ()),
              Attr("mask_period", INT, 0), Attr("mask_scale", FLOAT, 1.0), Attr("bias_scale", FLOAT, 1.0),
              Attr("kv_heads", DIM, None), Attr("window", INTS, ()))

SPECS = (
    # softmax(scale * q kᵀ + mask_scale * mask + bias_scale * bias) v; scores_path: ops between QKᵀ and the Softmax
    # other than the scale and the additive terms (a reshape, a Where mask), which a kernel reading [B, H, Sq, Sk]
    # scores cannot take; mask_period: the mask is read at batch row b % mask_period (Swin's window mask
    # [1, nW, 1|H, N, N]; 0: row b); mask_scale / bias_scale: the scales the graph applies after adding the term;
    # kv_heads: the heads of k and v where fewer than q's (grouped-query attention: the repeat of k and v folded in);
    # causal: key j > query i masked (upper-left); window [left, right]: key j of query i kept only where
    # i - left <= j <= i + right (sliding-window attention); both generated in the kernel, no mask read for them
    OpSpec("attention", ("q", "k", "v", "mask", "bias"), ("out",),
           (*_ATTENTION, Attr("v_layout", STR, "bhsd"), Attr("out_layout", STR, "bhsd")), per_layer=True),
    OpSpec("bmm_softmax", ("q", "k", "mask", "bias"), ("probs",), _ATTENTION),
)
