"""Binders of the attention families ("attention", "bmm_softmax") for plugins/families/attention/attention_op.h.

The rule (families/attention/rule.py with _heads.py and _scores.py) found q, k, v (the tensors before the head split),
the additive mask and bias, the scale and the layouts, and the rewrite wrote them in role order (opspec). What only
the binder knows is what the C++ kernel takes: one batch dim, the layouts it indexes, additive terms that broadcast
to [B, H, Sq, Sk] scores (a mask with mask_period P to [B / P, P, H, Sq, Sk] with a batch dim of 1: Swin's shifted
windows) reached with nothing else between QKᵀ and the Softmax, inputs whose shapes fit the
layouts, and of the ONNX Attention op (opset 23) only the plain form (no attn_mask but a constant causal or
sliding-window one, past key/value, softcap or grouped-query heads). A causal or windowed node (is_causal, or a
constant causal or sliding-window mask the rule recognized) runs a BAND instance, which generates the mask. Anything
else gives a reason string, and that node keeps running its function.

C++ roles (`gtco::AttentionGlue::InRole`, the same for both families): CPP_IN; output role OUT_Y.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx

from onnx_gtco.families.attention.kernel import is_banded, layout_shape, reads_mask
from onnx_gtco.kernels.family import Problem
from onnx_gtco.opspec import FusedOp
from onnx_gtco.plugin.binding import Binding, FusedNode, bind_roles, present, read

IN_ROLES = CPP_IN = ("q", "k", "v", "mask", "bias")  # IN_Q, IN_K, IN_V, IN_MASK, IN_BIAS in attention_op.h
CPP_OUT = {"attention": ("out",), "bmm_softmax": ("probs",)}
IN_LAYOUTS = ("bhsd", "bshd", "bshd_merged", "qkv_packed")
LAYOUTS = {"q": IN_LAYOUTS, "k": (*IN_LAYOUTS, "bhds"), "v": IN_LAYOUTS, "out": ("bhsd", "bshd", "bshd_merged")}
PROBE = 5  # the size tried for a symbolic batch or sequence dim when checking an input's shape against its layout


def _onnx_attention(fn: onnx.FunctionProto) -> onnx.NodeProto | None:
    ops = [n for n in fn.node if n.op_type != "Constant"]
    return ops[0] if len(ops) == 1 and ops[0].op_type == "Attention" else None


def _plain_onnx_attention(att: onnx.NodeProto, band_mask: bool = False, guarded: bool = False) -> str | None:
    """Why the kernel cannot run this ONNX Attention op, or None. band_mask: its attn_mask is a constant causal or
    sliding-window mask the rule recognized (the node is causal or windowed and does not read it); guarded: the node
    gives zeros for a row whose every key is masked (nan_guard), as the op does."""
    a = {x.name: onnx.helper.get_attribute_value(x) for x in att.attribute}
    if len(att.input) > 3 and att.input[3] and not band_mask and not guarded:
        return ("ONNX Attention with attn_mask: the op gives zeros for fully masked rows (its errata) where the "
                "node's nan_guard=0 gives NaN")
    if any(t for t in att.input[4:]) or any(t for t in att.output[1:]):
        return "ONNX Attention with past_key / past_value / nonpad_kv_seqlen or extra outputs is not bound"
    if float(a.get("softcap", 0.0) or 0.0) != 0.0:
        return f"ONNX Attention softcap={a['softcap']} is not supported by the kernel"
    qh, kvh = a.get("q_num_heads"), a.get("kv_num_heads")
    if qh is not None and kvh is not None and int(qh) != int(kvh):
        return f"grouped-query attention (q_num_heads={qh}, kv_num_heads={kvh}) is not supported"
    return None


def _fits(shape: tuple[Any, ...] | None, layout: str, b: Any, h: int, s: Any, d: int) -> bool:
    """The inferred shape (ints and symbols) fits `layout`; symbolic dims of the problem are not compared."""
    if shape is None:
        return True
    want = layout_shape(layout, b if isinstance(b, int) else PROBE, h, s if isinstance(s, int) else PROBE, d)
    other = layout_shape(layout, b if isinstance(b, int) else PROBE + 9, h, s if isinstance(s, int) else PROBE + 9, d)
    return len(shape) == len(want) and all(not isinstance(x, int) or w != o or x == w
                                           for x, w, o in zip(shape, want, other, strict=True))


def _addend(info: Any, role: str, op: FusedOp) -> str | None:
    """Why the mask or bias input does not broadcast to the scores [B, H, Sq, Sk], or None. A mask with
    mask_period P broadcasts to [B / P, P, H, Sq, Sk] with a batch dim of 1 (Swin's window mask, row b % P)."""
    b, period = op["batch_dims"][0], (op.int("mask_period") or 0) if role == "mask" else 0
    scores = [b, op["heads"], op["seq_q"], op["seq_k"]]
    if period < 0 or (period and isinstance(b, int) and b % period):
        return f"mask_period {period} does not divide the batch {b}"
    if period:
        scores = [1, period, *scores[1:]]
    shape = info.shape or ()
    if len(shape) > len(scores):
        return f"{role} input {info.name!r} of rank {len(shape)}: the kernel takes addends of rank <= {len(scores)}"
    for got, want in zip(shape, scores[len(scores) - len(shape):], strict=True):
        if isinstance(got, int) and isinstance(want, int) and got not in (1, want):
            return f"{role} input {info.name!r} {list(shape)} does not broadcast to the scores {scores}"
    return None


SEQ_AXIS = {"bhsd": -2, "bshd": -3, "bshd_merged": -2, "qkv_packed": -2}
"""Axis (from the end) of the sequence in an attention operand of each layout."""


@dataclass(frozen=True)
class AttentionBinder:
    """Binder for one of the two families (see the module docstring)."""

    family: str
    header: str = "attention/attention_op.h"

    def __post_init__(self) -> None:
        if self.family not in CPP_OUT:
            raise ValueError(f"unknown attention family {self.family!r}")

    @property
    def cpp_struct(self) -> str:
        return "gtco::Attention" if self.family == "attention" else "gtco::BmmSoftmax"

    @staticmethod
    def operand_flags(node: FusedNode, binding: Binding, problem: Problem) -> dict[str, bool]:
        """Whether the node reads a mask and a bias."""
        del node, problem
        return present(binding, (("mask", "in", 3), ("bias", "in", 4)))

    @staticmethod
    def extent_dims(node: FusedNode, binding: Binding) -> tuple[tuple[int, int], ...]:
        """The query's sequence dim (of q, or of the packed qkv), by its layout."""
        first = binding.inputs[0]
        rank = len(node.inputs[first].shape or ())
        axis = SEQ_AXIS.get(str(node.attrs.get("q_layout", "bhsd")))
        return () if axis is None or rank < -axis else ((first, rank + axis),)

    def bind(self, node: FusedNode) -> Binding | str:
        op = read(node, self.family)
        if isinstance(op, str):
            return op
        why = self._why(node, op)
        if why is not None:
            return why
        need = {"q": True, "k": True, "mask": reads_mask(op), "bias": op["bias"]}
        if self.family == "attention":
            need["v"] = True
        bound = bind_roles(node, op, need, CPP_IN, CPP_OUT[self.family])
        return bound if isinstance(bound, str) else self._shapes(node, op) or bound

    def _why(self, node: FusedNode, op: FusedOp) -> str | None:
        h, d = op.int("heads"), op.int("head_dim")
        if not (h and h > 0 and d and d > 0):
            return f"heads={op['heads']!r} and head_dim={op['head_dim']!r} must be known ints"
        if len(op["batch_dims"]) != 1:
            return f"batch_dims {list(op['batch_dims'])}: only [B, H, Sq, Sk] score cores (one batch dim) are bound"
        for role in ("q", "k", "v", "out") if self.family == "attention" else ("q", "k"):
            if op[f"{role}_layout"] not in LAYOUTS[role]:
                return (f"{role}_layout {op[f'{role}_layout']!r} is not one the kernel reads "
                        f"({', '.join(LAYOUTS[role])})")
        if op["scores_path"]:
            return (f"{', '.join(op['scores_path'])} between QKᵀ and the Softmax: the kernel adds one mask and one "
                    "bias to [B, H, Sq, Sk] scores")
        att = _onnx_attention(node.function)
        if att is not None:
            return _plain_onnx_attention(att, band_mask=is_banded(op) and "mask" not in op.inputs,
                                         guarded=bool(op["nan_guard"]))
        return None

    def _shapes(self, node: FusedNode, op: FusedOp) -> str | None:
        h, d, b = int(op["heads"]), int(op["head_dim"]), op["batch_dims"][0]
        kv = op.int("kv_heads") or h  # grouped-query attention: k and v hold kv_heads heads
        if h % kv:
            return f"kv_heads {kv} does not divide heads {h}"
        for role in ("q", "k", "v"):
            if role not in op.inputs:
                continue
            layout, seq = op[f"{role}_layout"], op["seq_q" if role == "q" else "seq_k"]
            heads = h if role == "q" else kv
            info = node.inputs[op.inputs[role]]
            if not _fits(info.shape, layout, b, heads, seq, d):
                return (f"{role} input {info.name!r} has shape {info.shape}; {role}_layout {layout} needs "
                        f"{list(layout_shape(layout, b, heads, seq, d))} (heads {heads}, head_dim {d})")
        for role in ("mask", "bias"):
            if role in op.inputs and (why := _addend(node.inputs[op.inputs[role]], role, op)):
                return why
        out = node.outputs[op.outputs[CPP_OUT[self.family][0]]] if op.outputs else None
        if out is not None and out.dtype and out.dtype != node.dtype:
            return f"output {out.name!r} is {out.dtype}, not {node.dtype}"
        return None


BINDERS = (AttentionBinder("attention"), AttentionBinder("bmm_softmax"))
"""The attention binders, one per family (pass them to the library builder)."""
