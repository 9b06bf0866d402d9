"""Multi-head attention, ``softmax(scale * Q Kᵀ + mask + bias) V``, in every form exporters write it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from onnx_gtco.families.attention import heads
from onnx_gtco.families.attention.scores import Scores, band_attrs, neutral_constant, walk_probs, walk_scores
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, Reject, is_op
from onnx_gtco.patterns.util import dim, dims, rank


class AttentionPattern:
    """Attention sites, anchored at each Softmax over the last axis (and the ONNX ``Attention`` op).

    Formula: ``O = softmax(s * Q Kᵀ + sm * M + sb * B) V``. The products are MatMuls, or Einsums that are one
    (tf2onnx's "bhqd,bhkd->bhqk" reads k as it is: k_layout then names k itself, not kᵀ); s is a Div/Mul by a scalar
    after the product, or Muls by sqrt(s) on q and k before it (or none); M an additive mask (run-time, or 0/-big
    constants, or a ``Where``) and B an additive bias (Swin's relative position bias). sm and sb are 1 unless a scale
    follows their Add: ``softmax((Q Kᵀ + M) * s)`` scales the mask too, so mask_scale / bias_scale are the product of
    the scales after that Add (s is the product of all of them). Swin's shifted-window mask, added between
    Reshape [B*nW, H, N, N] -> [B, nW, H, N, N] and back, is the mask with ``mask_period`` nW: batch row b reads
    the mask of window b % nW.

        q --[Mul √s]--.                    mask        bias
                       MatMul --[Div s]--> Add --> [Reshape -> Add -> Reshape] --> Softmax --.
        kᵀ -[Mul √s]--'                                                                     |
                                        O <-- MatMul <-- [Where(IsNaN(P), 0, P)] <-- P <----'
                                                 ^-- v

    Three candidates per site: "bmm_softmax" (QKᵀ MatMul .. Softmax, output P), "attention" (through PV)
    and "attention" with the head split of q, k, v (Reshape[B,S,H,D] -> Transpose, k's Transpose[0,2,3,1],
    the unbind of a packed qkv: Reshape[B,S,3,H,D] -> Transpose[2,0,3,1,4] -> Split/Gather/Slice ->
    Squeeze) and the head merge (Transpose[0,2,1,3] -> Reshape[B,S,H*D]) pulled in where only the chain
    reads them. A constant mask that is the causal one or a sliding window (``band_attrs``: a static export of a
    LLaMA-style block, ModernBERT's local layers) makes the node causal or gives it a window (mask 1 and no mask
    role: the kernel generates it); one of zeros is no mask. attrs: heads, head_dim, seq_q, seq_k, scale, mask, bias,
    nan_guard, causal, window, mask_period, mask_scale,
    bias_scale, batch_dims, q_layout, k_layout, and for "attention" v_layout, out_layout. Layouts: "bhsd", "bhds"
    (kᵀ as the MatMul reads it), "bshd", "bshd_merged" ([B, S, H*D]), "qkv_packed" (one [B, S, 3*H*D] tensor for q,
    k and v).
    """

    name = "attention"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for node in view.nodes:
            if is_op(node, "Softmax"):
                yield from self._site(view, node)
            elif is_op(node, "Attention"):
                yield from self._onnx_attention(view, node)

    def _site(self, view: GraphView, sm: Node) -> Iterator[Match | Reject]:
        r, axis = rank(view, sm.inputs[0]), int(sm.attrs.get("axis", -1))
        if (r is None and axis != -1) or (r is not None and axis % r != r - 1):
            yield Reject(self.name, sm.name, f"Softmax axis {axis} is not the last axis")
            return
        s = walk_scores(view, sm)
        if isinstance(s, str):
            yield Reject(self.name, sm.name, s)
            return
        pv = walk_probs(view, s)
        attrs = self._attrs(view, s)
        terms = {k: t for k, t in (("mask", s.mask_tensor), ("bias", s.bias_tensor)) if t}
        plain_mask = bool(s.mask_tensor) and not s.mask_period and "scores_path" not in attrs
        if plain_mask and neutral_constant(view, s.mask_tensor):
            attrs["mask"] = False  # a mask of zeros: nothing to read (the node keeps it for its function)
            del terms["mask"]
        elif plain_mask and (banded := band_attrs(view, s.mask_tensor, attrs["seq_q"], attrs["seq_k"], s.mask_scale)):
            attrs |= banded  # causal or a window: the kernel generates it; the node keeps the constant for its function
            del terms["mask"]
        yield Match(frozenset(s.nodes), "bmm_softmax", attrs, {"q": s.q, "k": s.k, **terms}, {"probs": s.probs})
        if isinstance(pv, str):
            yield Reject(self.name, sm.name, pv)
            return
        base = s.nodes | {pv.id}
        attrs |= {"v_layout": "bhsd", "out_layout": "bhsd"}
        ins = {"q": s.q, "k": s.k, "v": pv.inputs[1]}
        yield Match(frozenset(base), "attention", attrs, ins | terms, {"out": pv.outputs[0]})
        group = set(base)
        core = len(dims(view, s.qk.outputs[0]) or (0, 0, 0, 0))
        h, d = attrs["heads"], attrs["head_dim"]
        width = h * d if isinstance(h, int) and isinstance(d, int) else None
        factor, names, srcs, rep = heads.split_heads(view, group, frozenset(base), ins, core, width, k_rows=s.k_rows)
        out_layout, out = heads.merge_heads(view, group, pv.outputs[0], core)
        if group == base:
            return
        ext = attrs | {"scale": s.scale * factor, "q_layout": names["q"], "k_layout": names["k"],
                       "v_layout": names["v"], "out_layout": out_layout}
        if rep > 1:  # grouped-query attention: k and v hold heads / rep heads
            if not isinstance(h, int):
                return
            ext["kv_heads"] = h // rep
        yield Match(frozenset(group), "attention", ext, srcs | terms, {"out": out})

    @staticmethod
    def _attrs(view: GraphView, s: Scores) -> dict[str, Any]:
        scores = dims(view, s.qk.outputs[0]) or ("?", "?", "?", "?")
        head_dim = dim(view, s.q, -1)
        if not isinstance(head_dim, int):
            head_dim = dim(view, s.k, -1 if s.k_rows else -2)
        return {
            "heads": scores[-3] if len(scores) >= 4 else 1,
            "head_dim": head_dim,
            "seq_q": scores[-2],
            "seq_k": scores[-1],
            "scale": float(s.scale),
            "mask": s.mask,
            "bias": s.bias,
            "nan_guard": s.nan_guard,
            **({"scores_path": tuple(s.path)} if s.path else {}),
            **({"mask_period": s.mask_period} if s.mask_period else {}),
            **{f"{k}_scale": float(v) for k, v in (("mask", s.mask_scale), ("bias", s.bias_scale)) if v != 1.0},
            "batch_dims": tuple(scores[:-3] if len(scores) >= 4 else scores[:-2]),
            "q_layout": "bhsd",
            "k_layout": "bhsd" if s.k_rows else "bhds",
        }

    def _onnx_attention(self, view: GraphView, node: Node) -> Iterator[Match | Reject]:
        q, k = dims(view, node.inputs[0]), dims(view, node.inputs[1])
        if q is None or k is None:
            yield Reject(self.name, node.name, "Attention op with q or k of unknown rank")
            return
        if len(q) == 4:
            heads, seq_q, head_dim, seq_k, lay = q[1], q[2], q[3], k[2], "bhsd"
        else:
            heads = int(node.attrs.get("q_num_heads", 0)) or "?"
            seq_q, seq_k, lay = q[1], k[1], "bshd_merged"
            head_dim = q[2] // heads if isinstance(q[2], int) and isinstance(heads, int) else "?"
        scale = node.attrs.get("scale")
        if scale is None and not isinstance(head_dim, int):
            yield Reject(self.name, node.name, "Attention op without scale and with a symbolic head_dim")
            return
        has_mask = len(node.inputs) > 3 and bool(node.inputs[3])
        roles = dict(zip(("q", "k", "v", "mask"), node.inputs[:4], strict=False))
        causal = bool(node.attrs.get("is_causal", 0))
        window: dict[str, Any] = {}
        if has_mask and neutral_constant(view, node.inputs[3]):  # one that masks nothing
            has_mask = False
            del roles["mask"]
        elif has_mask and (found := band_attrs(view, node.inputs[3], seq_q, seq_k)):  # a static export's causal or
            causal = causal or bool(found.pop("causal", False))  # sliding-window attn_mask: generated, not read
            window = found
            del roles["mask"]
        yield Match(frozenset([node.id]), "attention", {
            "heads": heads, "head_dim": head_dim, "seq_q": seq_q, "seq_k": seq_k,
            "scale": float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),  # type: ignore[arg-type]
            # a row whose every key the mask takes out gives zeros (the op's definition), as the guard does
            "mask": has_mask or causal, "bias": False, "nan_guard": has_mask,
            "causal": causal, **window, "batch_dims": (q[0],),
            "q_layout": lay, "k_layout": lay, "v_layout": lay, "out_layout": lay,
        }, {k: t for k, t in roles.items() if t}, {"out": node.outputs[0]})


RULES = (AttentionPattern(),)
