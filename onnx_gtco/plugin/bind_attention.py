"""Binders of the attention families ("attention", "bmm_softmax") for plugins/ort/attention_op.h.

A fused attention node's inputs are whatever its group swallowed: q, k, v (or one packed qkv, or the projections
before the head split), the mask and bias, and constants (the head split's shape tensors, Gather indices, the
scale). The binder reads the node's model-local function, finds the QKᵀ MatMul, the scale, the additive terms,
the Softmax, the optional NaN guard and the PV MatMul, and follows each of q, k, v up to the node input it comes
from. It then *proves* the layout attributes the C++ kernel indexes by: it replays each branch's view ops (Reshape,
Transpose, Gather, Split, Slice, Squeeze, Unsqueeze, Flatten) on an index array of the input's shape and checks
the result is exactly the operand the layout names (and likewise for the head merge of the output). It also checks
the scale attribute against the body's scalar factors and the mask / bias / nan_guard flags against the body.
A body that is one ONNX Attention op (opset 23) binds its Q, K, V as they are (4-D bhsd or 3-D bshd_merged,
is_causal allowed; attn_mask, past key/value, softcap and grouped-query heads are refused).
Anything the C++ side does not do gives a reason string, and that node keeps running its function.

Roles (C++ `gtco::AttentionGlue::InRole`, the same for both families): IN_ROLES; output role: "out" / "probs".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from onnx_gtco.kernels.attention import from_bhsd, layout_shape, to_bhsd
from onnx_gtco.patterns._scores import MASK_FLOOR
from onnx_gtco.plugin.binding import Binding, FusedNode

IN_ROLES = ("q", "k", "v", "mask", "bias")  # IN_Q, IN_K, IN_V, IN_MASK, IN_BIAS in attention_op.h
OUT_ROLES = {"attention": ("out",), "bmm_softmax": ("probs",)}
DTYPES = ("f32", "f16", "bf16")
IN_LAYOUTS = ("bhsd", "bshd", "bshd_merged", "qkv_packed")
K_LAYOUTS = (*IN_LAYOUTS, "bhds")
OUT_LAYOUTS = ("bhsd", "bshd", "bshd_merged")
VIEW_OPS = ("Reshape", "Transpose", "Gather", "Split", "Slice", "Squeeze", "Unsqueeze", "Flatten", "Identity")
SEQ_PROBE = {"q": 5, "k": 7}  # sizes tried for a symbolic seq_q / seq_k when replaying the view ops
BATCH_PROBE = 2


class _Unbound(Exception):
    """A reason the node cannot be bound (the message)."""


def _text(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, (list, tuple)):
        return [_text(x) for x in v]
    return v


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return _text(onnx.helper.get_attribute_value(a))
    return default


@dataclass
class _Body:
    """The function body of one fused node, indexed."""

    node: FusedNode
    producer: dict[str, onnx.NodeProto] = field(default_factory=dict)
    consumers: dict[str, list[onnx.NodeProto]] = field(default_factory=dict)
    inputs: dict[str, int] = field(default_factory=dict)     # function input name -> node input index
    outputs: dict[str, int] = field(default_factory=dict)
    visited: set[int] = field(default_factory=set)            # id() of body nodes the walk explained
    opset: int = 0

    @classmethod
    def of(cls, fn: FusedNode) -> _Body:
        b = cls(fn)
        f = fn.function
        b.inputs = {t: i for i, t in enumerate(f.input)}
        b.outputs = {t: i for i, t in enumerate(f.output)}
        b.opset = next((o.version for o in f.opset_import if o.domain in ("", "ai.onnx")), 0)
        for n in f.node:
            for t in n.output:
                if t:
                    b.producer[t] = n
            for t in n.input:
                if t:
                    b.consumers.setdefault(t, []).append(n)
        return b

    def where(self, n: onnx.NodeProto) -> str:
        return f"{n.op_type} {n.name!r}"

    def const(self, t: str) -> np.ndarray | None:
        """The value of a constant tensor: a node input with a known value, or a Constant node's output."""
        if t in self.inputs:
            info = self.node.inputs[self.inputs[t]]
            return None if info.value is None else np.asarray(info.value)
        n = self.producer.get(t)
        if n is not None and n.op_type == "Constant":
            self.visited.add(id(n))
            for a in n.attribute:
                if a.name == "value":
                    return onnx.numpy_helper.to_array(a.t)
                if a.name in ("value_float", "value_int", "value_floats", "value_ints"):
                    return np.asarray(onnx.helper.get_attribute_value(a))
        return None

    def need_const(self, t: str, n: onnx.NodeProto, what: str) -> np.ndarray:
        v = self.const(t)
        if v is None:
            raise _Unbound(f"{what} of {self.where(n)} is computed at run time; the binder can only check "
                           f"constant ones")
        return v

    def sole_reader(self, t: str) -> onnx.NodeProto | None:
        users = self.consumers.get(t, [])
        return users[0] if len(users) == 1 and t not in self.outputs else None

    def scalar_factor(self, n: onnx.NodeProto) -> tuple[str, float] | None:
        """Mul/Div by a one-element constant: (the other operand, the factor); else None."""
        if n.op_type not in ("Mul", "Div") or len(n.input) != 2:
            return None
        a, b = n.input
        vb = self.const(b)
        if vb is not None and vb.size == 1 and float(vb.reshape(())) != 0.0 and self.const(a) is None:
            f = float(vb.reshape(()))
            return a, (f if n.op_type == "Mul" else 1.0 / f)
        va = self.const(a)
        if n.op_type == "Mul" and va is not None and va.size == 1 and self.const(b) is None:
            return b, float(va.reshape(()))
        return None


def _apply_view(body: _Body, n: onnx.NodeProto, x: np.ndarray, out: str) -> np.ndarray:
    """One view op of a branch on an index array (what ONNX computes for it)."""
    op, opset = n.op_type, body.opset
    if op == "Identity":
        return x
    if op == "Reshape":
        shape = [int(s) for s in body.need_const(n.input[1], n, "the shape")]
        if not _attr(n, "allowzero", 0):
            shape = [x.shape[i] if s == 0 and i < x.ndim else s for i, s in enumerate(shape)]
        return x.reshape(shape)
    if op == "Transpose":
        perm = _attr(n, "perm") or list(range(x.ndim - 1, -1, -1))
        return x.transpose([int(p) for p in perm])
    if op == "Gather":
        idx = body.need_const(n.input[1], n, "the index")
        return np.take(x, idx.astype(np.int64), axis=int(_attr(n, "axis", 0)))
    if op == "Flatten":
        axis = int(_attr(n, "axis", 1)) % (x.ndim + 1) if x.ndim else 0
        return x.reshape(int(np.prod(x.shape[:axis])), -1)
    if op in ("Squeeze", "Unsqueeze"):
        if opset >= 13 and len(n.input) > 1 and n.input[1]:
            axes = [int(a) for a in body.need_const(n.input[1], n, "the axes").reshape(-1)]
        else:
            axes = [int(a) for a in (_attr(n, "axes") or [])]
        if op == "Squeeze":
            axes = [a % x.ndim for a in axes] or [i for i, s in enumerate(x.shape) if s == 1]
            return np.squeeze(x, axis=tuple(axes))
        rank = x.ndim + len(axes)
        for a in sorted(a % rank for a in axes):
            x = np.expand_dims(x, a)
        return x
    if op == "Split":
        axis = int(_attr(n, "axis", 0)) % x.ndim
        k = len(n.output)
        if len(n.input) > 1 and n.input[1]:
            sizes = [int(s) for s in body.need_const(n.input[1], n, "the split sizes")]
        elif _attr(n, "split") is not None:
            sizes = [int(s) for s in _attr(n, "split")]
        else:
            chunk = -(-x.shape[axis] // k)
            sizes = [min(chunk, max(0, x.shape[axis] - chunk * i)) for i in range(k)]
        bounds = np.cumsum([0, *sizes])
        i = list(n.output).index(out)
        return np.take(x, np.arange(bounds[i], bounds[i + 1]), axis=axis)
    if op == "Slice":
        if opset >= 10:
            starts, ends = (body.need_const(t, n, "a bound") for t in n.input[1:3])
            axes_v = body.need_const(n.input[3], n, "the axes") if len(n.input) > 3 and n.input[3] else None
            steps_v = body.need_const(n.input[4], n, "the steps") if len(n.input) > 4 and n.input[4] else None
        else:
            starts, ends = np.asarray(_attr(n, "starts")), np.asarray(_attr(n, "ends"))
            axes_v, steps_v = _attr(n, "axes"), None
        axes = [int(a) % x.ndim for a in (axes_v if axes_v is not None else range(len(starts)))]
        steps = [int(s) for s in (steps_v if steps_v is not None else [1] * len(axes))]
        index = [slice(None)] * x.ndim
        for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
            index[a] = slice(int(s), int(e), st)
        return x[tuple(index)]
    raise _Unbound(f"{body.where(n)} is not a view op")


@dataclass
class _Branch:
    index: int                                # node input index the operand comes from
    chain: list[tuple[onnx.NodeProto, str]]   # view ops from that input down to the core operand, each with the
                                              # output the branch follows (a Split has several)
    factor: float = 1.0                       # scalar Mul/Div factors met on the way


def _trace_up(body: _Body, t: str, role: str, scaled: bool) -> _Branch:
    chain: list[tuple[onnx.NodeProto, str]] = []
    factor = 1.0
    while t not in body.inputs:
        n = body.producer.get(t)
        if n is None:
            raise _Unbound(f"{role} operand {t!r} has no producer in the body")
        found = body.scalar_factor(n) if scaled else None
        if found is not None:
            t, f = found
            factor *= f
        elif n.op_type in VIEW_OPS:
            chain.append((n, t))
            t = n.input[0]
        else:
            raise _Unbound(f"{role} comes from {body.where(n)}, not from a view of a node input")
        body.visited.add(id(n))
    return _Branch(body.inputs[t], chain[::-1], factor)


def _replay(body: _Body, branch: _Branch, x: np.ndarray) -> np.ndarray:
    """Run the branch's view ops on x (the node input's values)."""
    for n, out in branch.chain:
        try:
            x = _apply_view(body, n, x, out)
        except (ValueError, IndexError) as e:
            raise _Unbound(f"replaying {body.where(n)} failed: {e}") from None
    return x


def _concrete(v: Any, probe: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else probe


def _check_shape(info_shape: tuple[Any, ...] | None, want: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """The inferred shape (ints and symbols) is compatible with `want`; `other` is `want` for other probe sizes
    of the symbolic dims, so dims where the two differ are not compared."""
    if info_shape is None:
        return True
    if len(info_shape) != len(want):
        return False
    return all(not isinstance(x, int) or w != o or x == w
               for x, w, o in zip(info_shape, want, other, strict=True))


class AttentionBinder:
    """Binder for one of the two families (see the module docstring)."""

    header = "attention_op.h"

    def __init__(self, family: str) -> None:
        if family not in OUT_ROLES:
            raise ValueError(f"unknown attention family {family!r}")
        self.family = family
        self.cpp_struct = "gtco::Attention" if family == "attention" else "gtco::BmmSoftmax"
        self.in_roles = IN_ROLES
        self.out_roles = OUT_ROLES[family]

    def bind(self, node: FusedNode) -> Binding | str:
        try:
            return self._bind(node)
        except _Unbound as e:
            return str(e)

    # ------------------------------------------------------------------------------------------------------------
    def _bind(self, node: FusedNode) -> Binding:
        with_v = self.family == "attention"
        if node.family != self.family:
            raise _Unbound(f"node {node.node.name!r} is of family {node.family!r}, not {self.family!r}")
        if node.dtype not in DTYPES:
            raise _Unbound(f"dtype {node.dtype}: the kernel takes {', '.join(DTYPES)}")
        a = {k: _text(v) for k, v in node.attrs.items()}
        heads, head_dim = a.get("heads"), a.get("head_dim")
        if not (isinstance(heads, int) and heads > 0 and isinstance(head_dim, int) and head_dim > 0):
            raise _Unbound(f"heads={heads!r} and head_dim={head_dim!r} must be known ints")
        batch_dims = list(a.get("batch_dims") or [])
        if len(batch_dims) != 1:
            raise _Unbound(f"batch_dims {batch_dims}: only [B, H, Sq, Sk] score cores (one batch dim) are bound")
        lay = {"q": a.get("q_layout", "bhsd"), "k": a.get("k_layout", "bhds")}
        if with_v:
            lay |= {"v": a.get("v_layout", "bhsd"), "out": a.get("out_layout", "bhsd")}
        allowed = {"q": IN_LAYOUTS, "k": K_LAYOUTS, "v": IN_LAYOUTS, "out": OUT_LAYOUTS}
        for role, name in lay.items():
            if name not in allowed[role]:
                raise _Unbound(f"{role}_layout {name!r} is not one the kernel reads ({', '.join(allowed[role])})")
        ops = [n for n in node.function.node if n.op_type != "Constant"]
        if len(node.node.output) != 1:
            raise _Unbound(f"the node has {len(node.node.output)} outputs; the kernel writes one "
                           f"(an intermediate of the group is read outside it)")
        body = _Body.of(node)
        for n in node.function.node:
            if n.domain not in ("", "ai.onnx"):
                raise _Unbound(f"{body.where(n)} of domain {n.domain!r} in the body")
        if any(n.op_type == "Attention" for n in ops):
            return self._bind_onnx_attention(node, body, ops, lay, a)
        if a.get("causal"):
            raise _Unbound("attribute causal=1 on a MatMul/Softmax body (only ONNX Attention bodies are causal)")

        # Softmax and the score chain above it
        sms = [n for n in ops if n.op_type == "Softmax"]
        if len(sms) != 1:
            raise _Unbound(f"the body has {len(sms)} Softmax nodes, not one")
        sm = sms[0]
        axis = _attr(sm, "axis")
        if axis is None and body.opset < 13:
            raise _Unbound(f"{body.where(sm)} (opset {body.opset}) uses the default axis 1, not the last axis")
        if axis is not None and int(axis) not in (-1, 3):
            raise _Unbound(f"{body.where(sm)} axis {axis} is not the last axis of [B, H, Sq, Sk]")
        body.visited.add(id(sm))
        scale, addends, t, seen_scale = 1.0, [], sm.input[0], False
        while True:
            if t in body.outputs or len(body.consumers.get(t, [])) != 1:
                raise _Unbound(f"scores {t!r} are read by more than the next op of the chain")
            n = body.producer.get(t)
            if n is None:
                raise _Unbound("the Softmax does not read a QKᵀ MatMul of the body")
            body.visited.add(id(n))
            if n.op_type == "MatMul":
                break
            found = body.scalar_factor(n)
            if found is not None:
                t, f = found
                scale *= f
                seen_scale = True
            elif n.op_type == "Add" and len(n.input) == 2:
                if seen_scale:
                    raise _Unbound(f"the scale is applied after {body.where(n)}, not to QKᵀ")
                ext = [x for x in n.input if x in body.inputs]
                if len(ext) != 1:
                    raise _Unbound(f"{body.where(n)}: exactly one operand must be a node input (the mask or bias)")
                addends.append(ext[0])
                t = next(x for x in n.input if x != ext[0])
            else:
                raise _Unbound(f"{body.where(n)} between QKᵀ and the Softmax is not a scalar scale or an "
                               f"additive mask/bias")
        qk = n

        # the additive terms: which is the mask and which the bias (the pattern's rule)
        roles: dict[str, int] = {}
        for t in addends:
            val = body.const(t)
            kind = "mask"
            if val is not None:
                vals = np.unique(np.asarray(val, dtype=np.float64))
                is_mask = vals.size <= 2 and all(v == 0.0 or v <= MASK_FLOOR for v in vals)
                kind = "mask" if is_mask else "bias"
            if kind in roles:
                raise _Unbound(f"two additive {kind}s on the scores; the kernel takes one mask and one bias")
            roles[kind] = body.inputs[t]
        for kind in ("mask", "bias"):
            if bool(a.get(kind, 0)) != (kind in roles):
                raise _Unbound(f"attribute {kind}={a.get(kind, 0)} but the body has "
                               f"{'a' if kind in roles else 'no'} {kind} Add")

        # P: pass-through ops, the NaN guard, then (attention) the PV MatMul
        p, guard = self._probs(body, sm.output[0])
        if bool(a.get("nan_guard", 0)) != guard:
            raise _Unbound(f"attribute nan_guard={a.get('nan_guard', 0)} but the body "
                           f"{'has' if guard else 'has no'} Where(IsNaN(P), 0, P)")
        q = _trace_up(body, qk.input[0], "q", scaled=True)
        k = _trace_up(body, qk.input[1], "k", scaled=True)
        scale *= q.factor * k.factor
        branches = {"q": q, "k": k}
        out_chain: list[tuple[onnx.NodeProto, str]] = []
        if with_v:
            pv = body.sole_reader(p)
            if pv is None or pv.op_type != "MatMul" or pv.input[0] != p:
                raise _Unbound("the probabilities are not the A operand of one PV MatMul")
            body.visited.add(id(pv))
            branches["v"] = _trace_up(body, pv.input[1], "v", scaled=False)
            t = pv.output[0]
            while t not in body.outputs:
                n = body.sole_reader(t)
                if n is None or n.op_type not in ("Transpose", "Reshape", "Identity", "Flatten", "Squeeze",
                                                  "Unsqueeze") or n.input[0] != t:
                    raise _Unbound(f"the PV output {t!r} does not reach the node output through a head merge")
                body.visited.add(id(n))
                out_chain.append((n, n.output[0]))
                t = n.output[0]
        elif p not in body.outputs:
            raise _Unbound(f"the probabilities {p!r} are not the node output")
        out_index = body.outputs[t if with_v else p]

        left = [n for n in node.function.node if id(n) not in body.visited and n.op_type != "Constant"]
        if left:
            raise _Unbound(f"{body.where(left[0])} in the body is not part of the attention chain")
        if not math.isclose(scale, float(a.get("scale", 1.0 / math.sqrt(head_dim))), rel_tol=1e-5):
            raise _Unbound(f"attribute scale={a.get('scale')} but the body scales QKᵀ by {scale:.8g}")

        self._check_layouts(node, body, branches, lay, out_chain, out_index, a)
        self._check_types(node, branches, roles, out_index, a)
        ins = {"q": q.index, "k": k.index, "v": branches["v"].index if with_v else -1,
               "mask": roles.get("mask", -1), "bias": roles.get("bias", -1)}
        return Binding(tuple(ins[r] for r in IN_ROLES), (out_index,))

    def _bind_onnx_attention(self, node: FusedNode, body: _Body, ops: list[onnx.NodeProto], lay: dict[str, str],
                             a: dict[str, Any]) -> Binding:
        """A body that is one ONNX Attention op (opset 23): q, k, v as they are, no mask (see the reasons)."""
        if self.family != "attention" or len(ops) != 1:
            raise _Unbound("an ONNX Attention op in a body with other ops")
        att = ops[0]
        extra = [t for t in att.input[3:] if t]
        if len(att.input) > 3 and att.input[3]:
            raise _Unbound("ONNX Attention with attn_mask: the op gives zeros for fully masked rows (its errata) "
                           "where the kernel's nan_guard=0 gives NaN; not bound yet")
        if extra:
            raise _Unbound("ONNX Attention with past_key / past_value / nonpad_kv_seqlen is not bound")
        if float(_attr(att, "softcap", 0.0) or 0.0) != 0.0:
            raise _Unbound(f"ONNX Attention softcap={_attr(att, 'softcap')} is not supported by the kernel")
        if any(t not in body.inputs for t in att.input[:3]):
            raise _Unbound("ONNX Attention q, k, v are not node inputs")
        if att.output[0] not in body.outputs or any(t in body.outputs for t in att.output[1:] if t):
            raise _Unbound("ONNX Attention: only its first output may leave the node")
        qh, kvh = _attr(att, "q_num_heads"), _attr(att, "kv_num_heads")
        if qh is not None and kvh is not None and int(qh) != int(kvh):
            raise _Unbound(f"grouped-query attention (q_num_heads={qh}, kv_num_heads={kvh}) is not supported")
        if bool(_attr(att, "is_causal", 0)) != bool(a.get("causal", 0)):
            raise _Unbound(f"attribute causal={a.get('causal', 0)} but the op has is_causal="
                           f"{_attr(att, 'is_causal', 0)}")
        h, d = int(a["heads"]), int(a["head_dim"])
        scale = _attr(att, "scale")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
        if not math.isclose(scale, float(a.get("scale", 1.0 / math.sqrt(d))), rel_tol=1e-5):
            raise _Unbound(f"attribute scale={a.get('scale')} but the op scales QKᵀ by {scale:.8g}")
        if (a.get("mask") and not a.get("causal")) or a.get("bias") or a.get("nan_guard"):
            raise _Unbound("attributes mask/bias/nan_guard set on an ONNX Attention op without attn_mask")
        idx = {r: body.inputs[t] for r, t in zip(("q", "k", "v"), att.input[:3], strict=True)}
        bdim = a["batch_dims"][0]
        for role, i in idx.items():
            if lay[role] not in ("bhsd", "bshd_merged"):
                raise _Unbound(f"{role}_layout {lay[role]!r} for an ONNX Attention op")
            seq = a.get("seq_q" if role == "q" else "seq_k")
            b, sq = _concrete(bdim, BATCH_PROBE), _concrete(seq, SEQ_PROBE["q"])
            want = layout_shape(lay[role], b, h, sq, d)
            other = layout_shape(lay[role], b if isinstance(bdim, int) else b + 9, h,
                                 sq if isinstance(seq, int) else sq + 9, d)
            if not _check_shape(node.inputs[i].shape, want, other):
                raise _Unbound(f"{role} input {node.inputs[i].name!r} has shape {node.inputs[i].shape}; "
                               f"{role}_layout {lay[role]} needs {want} (heads {h}: grouped-query attention and "
                               f"other head counts are not supported)")
        if lay["out"] != lay["q"]:
            raise _Unbound(f"out_layout {lay['out']} differs from q_layout {lay['q']} for an ONNX Attention op")
        self._check_types(node, {r: _Branch(i, []) for r, i in idx.items()}, {}, 0, a)
        body.visited.add(id(att))
        return Binding((idx["q"], idx["k"], idx["v"], -1, -1), (0,))

    @staticmethod
    def _probs(body: _Body, p: str) -> tuple[str, bool]:
        guard = False

        def through(t: str) -> str:
            while True:
                n = body.sole_reader(t)
                if n is None or n.op_type not in ("Identity", "Dropout"):
                    return t
                if n.op_type == "Dropout":
                    if len(n.output) > 1 and n.output[1]:
                        raise _Unbound(f"{body.where(n)} has its mask output in use")
                    if len(n.input) > 2 and n.input[2]:
                        mode = body.const(n.input[2])
                        if mode is None or bool(mode.reshape(())):
                            raise _Unbound(f"{body.where(n)} may run in training mode")
                body.visited.add(id(n))
                t = n.output[0]

        p = through(p)
        users = body.consumers.get(p, [])
        if len(users) == 2 and p not in body.outputs:
            isnan = next((u for u in users if u.op_type == "IsNaN"), None)
            where = next((u for u in users if u.op_type == "Where"), None)
            zero = body.const(where.input[1]) if where is not None else None
            if isnan is None or where is None or where.input[0] != isnan.output[0] or where.input[2] != p \
                    or body.consumers.get(isnan.output[0], []) != [where] or zero is None or zero.size != 1 \
                    or float(zero.reshape(())) != 0.0:
                raise _Unbound("the probabilities have two readers that are not the NaN guard "
                               "Where(IsNaN(P), 0, P)")
            body.visited |= {id(isnan), id(where)}
            guard = True
            p = through(where.output[0])
        return p, guard

    @staticmethod
    def _check_layouts(node: FusedNode, body: _Body, branches: dict[str, _Branch], lay: dict[str, str],
                       out_chain: list[tuple[onnx.NodeProto, str]], out_index: int, a: dict[str, Any]) -> None:
        """Replay each branch on an index array and check it gives exactly the operand its layout names."""
        h, d = int(a["heads"]), int(a["head_dim"])
        bdim = a["batch_dims"][0]
        b = _concrete(bdim, BATCH_PROBE)
        seqs = {"q": a.get("seq_q"), "k": a.get("seq_k")}
        if seqs["q"] == seqs["k"] and not isinstance(seqs["q"], int):
            probes = {"q": SEQ_PROBE["q"], "k": SEQ_PROBE["q"]}  # one symbol (self-attention): one size
        else:
            probes = dict(SEQ_PROBE)
        s = {r: _concrete(seqs[r], probes[r]) for r in ("q", "k")}
        packed = [r for r in branches if lay[r] == "qkv_packed"]
        if packed and (set(packed) != set(branches) or len({branches[r].index for r in packed}) != 1):
            raise _Unbound(f"qkv_packed must be one node input for all of {', '.join(branches)}")
        for which, (role, br) in enumerate(branches.items()):
            seq = s["q"] if role == "q" else s["k"]
            shape = layout_shape(lay[role], b, h, seq, d)
            other = layout_shape(lay[role], b if isinstance(bdim, int) else b + 9, h,
                                 seq if isinstance(seqs["q" if role == "q" else "k"], int) else seq + 9, d)
            info = node.inputs[br.index]
            if not _check_shape(info.shape, shape, other):
                raise _Unbound(f"{role} input {info.name!r} has shape {info.shape}; {role}_layout {lay[role]} "
                               f"needs {shape} (heads {h}, head_dim {d})")
            x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
            got = _replay(body, br, x)
            want = to_bhsd(x, lay[role], b, h, seq, d, which)
            if role == "k":
                want = want.transpose(0, 1, 3, 2)
            if got.shape != want.shape or not np.array_equal(got, want):
                raise _Unbound(f"the body's view ops on {role} input {info.name!r} do not give the "
                               f"{role}_layout={lay[role]} operand the kernel reads (got {list(got.shape)}, "
                               f"want {list(want.shape)}{' with other elements' if got.shape == want.shape else ''})")
        if "out" in lay:
            x = np.arange(b * h * s["q"] * d, dtype=np.int64).reshape(b, h, s["q"], d)
            got = _replay(body, _Branch(-1, out_chain), x)
            want = from_bhsd(x, lay["out"])
            if got.shape != want.shape or not np.array_equal(got, want):
                raise _Unbound(f"the head merge after PV does not write out_layout={lay['out']} "
                               f"(got {list(got.shape)}, want {list(want.shape)})")
            other = layout_shape(lay["out"], b if isinstance(bdim, int) else b + 9, h,
                                 s["q"] if isinstance(seqs["q"], int) else s["q"] + 9, d)
            info = node.outputs[out_index]
            if not _check_shape(info.shape, tuple(want.shape), other):
                raise _Unbound(f"output {info.name!r} has shape {info.shape}; out_layout {lay['out']} needs "
                               f"{list(want.shape)}")

    @staticmethod
    def _check_types(node: FusedNode, branches: dict[str, _Branch], roles: dict[str, int], out_index: int,
                     a: dict[str, Any]) -> None:
        dt = node.dtype
        named = [(r, br.index) for r, br in branches.items()] + list(roles.items())
        for role, i in named:
            info = node.inputs[i]
            if info.dtype and info.dtype != dt:
                raise _Unbound(f"{role} input {info.name!r} is {info.dtype}; the {node.node.op_type} kernel "
                               f"takes {dt} only")
        for role, i in roles.items():
            shape = node.inputs[i].shape
            if shape is not None and len(shape) > 4:
                raise _Unbound(f"{role} input {node.inputs[i].name!r} of rank {len(shape)}: the kernel takes "
                               f"[B', H', Sq', Sk'] addends of rank <= 4")
            scores = [a["batch_dims"][0], a["heads"], a.get("seq_q"), a.get("seq_k")]
            for got, want in zip(shape or (), scores[4 - len(shape or ()):], strict=True):
                if isinstance(got, int) and isinstance(want, int) and got not in (1, want):
                    raise _Unbound(f"{role} input {node.inputs[i].name!r} {list(shape or ())} does not broadcast "
                                   f"to the scores [B, H, Sq, Sk] = {scores}")
        info = node.outputs[out_index]
        if info.dtype and info.dtype != dt:
            raise _Unbound(f"output {info.name!r} is {info.dtype}, not {dt}")


BINDERS = (AttentionBinder("attention"), AttentionBinder("bmm_softmax"))
"""The attention binders, one per family (pass them to the library builder)."""
