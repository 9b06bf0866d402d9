"""The attention score chain, walked up from a Softmax: QKᵀ MatMul -> scale -> mask/bias Adds -> Softmax.

The two products are MatMuls, or Einsums whose equation is one (onnx_gtco.ir.einsum; tf2onnx writes
Einsum("bhqd,bhkd->bhqk") for Q Kᵀ, reading k as it is, and Einsum("bhqk,bhkd->bhqd") for P V).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from onnx_gtco.ir.einsum import batched_matmul
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import const_close, const_scalar, sole_reader

PATH_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Cast", "Identity")  # reshape scores, keep values
MASK_FLOOR = -50.0  # a constant additive term whose values are 0 and <= this is a mask (Swin: -100)


@dataclass
class Scores:
    """One attention site's score chain (built per call, never kept)."""

    qk: Node
    softmax: Node
    nodes: set[int] = field(default_factory=set)
    q: str = ""
    k: str = ""
    k_rows: bool = False  # the QKᵀ product reads k as [.., S, D] (an Einsum with a transposed B), not as kᵀ
    probs: str = ""
    scale: float = 1.0
    mask: bool = False
    bias: bool = False
    nan_guard: bool = False
    mask_tensor: str = ""  # the additive mask / bias operand, when one Add adds it to the scores
    mask_period: int = 0  # Swin's shifted windows: the mask is read at batch row b % mask_period (0: at row b)
    bias_tensor: str = ""
    mask_scale: float = 1.0  # what the scales applied after the mask's / bias's Add multiply it by:
    bias_scale: float = 1.0  # softmax((QKᵀ + M) * s) adds s * M to s * QKᵀ
    path: list[str] = field(default_factory=list)  # what else is between QKᵀ and the Softmax (reshapes, a Where,
                                                   # a second mask or bias Add), from the Softmax up


def scalar_operand(view: GraphView, node: Node) -> tuple[str, float] | None:
    """For Mul/Div by a one-value constant: (the other operand, the factor it applies); else None."""
    if not is_op(node, "Mul", "Div") or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    sb = const_scalar(view, b)
    if sb is not None and sb != 0.0:
        return a, (sb if node.op_type == "Mul" else 1.0 / sb)
    sa = const_scalar(view, a)
    if node.op_type == "Mul" and sa is not None:
        return b, sa
    return None


def matmul_form(node: Node | None) -> bool | None:
    """For a MatMul, or an Einsum of two operands that is one with A as it is stored: whether it reads B
    transposed ([.., N, K]); None for any other node."""
    if is_op(node, "MatMul"):
        return False
    if is_op(node, "Einsum") and node is not None and len(node.inputs) == 2:
        form = batched_matmul(node.attrs.get("equation"))
        if form is not None and not form.trans_a:
            return form.trans_b
    return None


def is_projection(view: GraphView, mm: Node) -> bool:
    """A MatMul by a constant 2-D weight (a linear layer); a constant Q (learned queries) is attention."""
    shape = view.shape(mm.inputs[1])
    return view.is_constant(mm.inputs[1]) and (shape is None or len(shape) <= 2)


def leads_to_qk(view: GraphView, tensor: str, depth: int = 8) -> bool:
    """`tensor` is computed from a QKᵀ MatMul (not a projection) through score-preserving ops."""
    node = view.producer_of(tensor)
    if node is None or depth == 0:
        return False
    if matmul_form(node) is not None:
        return not is_projection(view, node)
    if is_op(node, *PATH_OPS):
        return leads_to_qk(view, node.inputs[0], depth - 1)
    if is_op(node, "Add", "Mul", "Div", "Where"):
        ins = node.inputs[1:] if node.op_type == "Where" else node.inputs
        return any(leads_to_qk(view, t, depth - 1) for t in ins if t and not view.is_constant(t))
    return False


def additive_kind(view: GraphView, tensor: str) -> str:
    """"mask" for a run-time tensor or a constant of 0 / large negatives, else "bias" (relative position)."""
    val = view.const_value(tensor)
    if val is None:
        return "mask"
    vals = np.unique(np.asarray(val, dtype=np.float64))
    return "mask" if vals.size <= 2 and all(v == 0.0 or v <= MASK_FLOOR for v in vals) else "bias"


def constant_band(view: GraphView, tensor: str, seq_q: object, seq_k: object,
                  scale: float = 1.0) -> tuple[int, int] | None:
    """(lo, hi) where `tensor` is a constant whose every [seq_q, seq_k] slice keeps key j of query i exactly where
    lo <= j - i <= hi, every query keeping one key at least: additive, 0 there and at most MASK_FLOOR (times `scale`,
    what the graph multiplies the term by) elsewhere, or boolean, True there (ONNX Attention's attn_mask); else None.
    The static exports of decoder-style encoders (LLaMA, Qwen) hold the causal band (lo <= 1 - seq_q, hi = 0),
    ModernBERT's local layers a sliding window; a kernel that generates the band reads nothing and skips the key
    tiles outside it. Outside the band a finite floor of -50 or less leaves exp(-50) ~ 2e-22 of a weight where the
    kernel leaves 0."""
    if not isinstance(seq_q, int) or not isinstance(seq_k, int) or seq_k < 2 or scale <= 0.0:
        return None
    val = view.const_value(tensor)
    if val is None:
        return None
    a = np.asarray(val)
    if a.ndim < 2 or a.ndim > 4 or a.shape[-2:] != (seq_q, seq_k):
        return None
    if a.dtype == np.bool_:
        keep = a
    else:
        f = a.astype(np.float64) * scale
        keep = f == 0.0
        if not np.all(keep | (f <= MASK_FLOOR)):
            return None
    keep = keep.reshape(-1, seq_q, seq_k)
    if not np.all(keep == keep[:1]) or not keep[0].any(axis=1).all():
        return None
    offset = np.arange(seq_k)[None, :] - np.arange(seq_q)[:, None]
    lo, hi = int(offset[keep[0]].min()), int(offset[keep[0]].max())
    return (lo, hi) if np.array_equal(keep[0], (offset >= lo) & (offset <= hi)) else None


def band_attrs(view: GraphView, tensor: str, seq_q: object, seq_k: object, scale: float = 1.0) -> dict | None:
    """The node attributes of a constant band mask (constant_band): {"causal": True} for the causal one, {"window":
    (left, right)} for another; None where `tensor` is no band, or keeps every key (neutral_constant)."""
    found = constant_band(view, tensor, seq_q, seq_k, scale)
    if found is None:
        return None
    lo, hi = found
    left = -lo if lo > 1 - int(seq_q) else None  # None: every earlier key  # type: ignore[call-overload]
    right = hi if hi < int(seq_k) - 1 else None  # type: ignore[call-overload]
    if left is None and right is None:
        return None
    if left is None and right == 0:
        return {"causal": True}
    return {"window": (int(seq_k) if left is None else left, int(seq_k) if right is None else right)}


def neutral_constant(view: GraphView, tensor: str) -> bool:
    """`tensor` is a constant mask that masks nothing: all 0 (additive) or all True (ONNX Attention's boolean
    attn_mask). A static export without padding holds one (ModernBERT's global layers: the attention mask of a
    sequence of ones, folded); the kernel need not read it."""
    val = view.const_value(tensor)
    if val is None:
        return False
    a = np.asarray(val)
    return bool(np.all(a)) if a.dtype == np.bool_ else bool(np.all(a.astype(np.float64) == 0.0))


SCORE_OPS = ("Add", "Where", "Reshape", "Cast")
"""Ops between the scaled scores and the Softmax that keep them scores (the additive terms, Swin's window Reshapes)."""


def reaches_softmax(view: GraphView, tensor: str, depth: int = 6) -> bool:
    """`tensor` is read by one node only, and so on through SCORE_OPS, up to a Softmax over the last axis: it is
    attention scores."""
    for _ in range(depth):
        node = sole_reader(view, tensor)
        if node is None or tensor in view.graph_outputs:
            return False
        if is_op(node, "Softmax"):
            shape = view.shape(tensor)
            return int(node.attrs.get("axis", -1)) in (-1, len(shape) - 1 if shape else -1)
        if not is_op(node, *SCORE_OPS):
            return False
        tensor = node.outputs[0]
    return False


def walk_scores(view: GraphView, sm: Node) -> Scores | str:
    """Follow the Softmax's input up to the QKᵀ MatMul; a reason string when the chain is not attention."""
    s = Scores(qk=sm, softmax=sm, nodes={sm.id})
    tensor, reader, scaled = sm.inputs[0], sm, False
    after = 1.0  # the product of the scales between `tensor` and the Softmax
    while True:
        if tensor in view.graph_outputs or view.consumers.get(tensor, ()) != (reader.id,):
            return f"scores {tensor!r} are also read outside the attention chain"
        node = view.producer_of(tensor)
        if node is None:
            return "the Softmax input is a graph input, not a QKᵀ MatMul"
        if matmul_form(node) is not None:
            break
        if is_op(node, *PATH_OPS) and not scaled and (top := _window_mask(view, s, node)) is not None:
            s.nodes |= {node.id, view.producer_of(node.inputs[0]).id}  # type: ignore[union-attr]
            nxt, node = top.inputs[0], top
        elif is_op(node, *PATH_OPS):
            nxt = node.inputs[0]
            s.path.append(node.op_type)
        elif is_op(node, "Add", "Where"):
            ins = node.inputs[1:] if node.op_type == "Where" else node.inputs
            ways = [t for t in ins if leads_to_qk(view, t)]
            if not ways:
                return f"{node.op_type} {node.name!r} before the Softmax: no operand comes from a QKᵀ MatMul"
            if scaled and node.op_type == "Where":
                return f"the scale is applied after {node.op_type} {node.name!r} (mask/bias), not to QKᵀ"
            nxt = ways[0]
            if node.op_type == "Where":
                s.mask = True
                s.path.append("Where")
            else:
                term = next(t for t in ins if t != nxt)
                kind = additive_kind(view, term)
                s.mask, s.bias = s.mask or kind == "mask", s.bias or kind == "bias"
                if getattr(s, f"{kind}_tensor"):
                    s.path.append(f"Add({kind})")
                setattr(s, f"{kind}_tensor", term)
                setattr(s, f"{kind}_scale", after)  # (QKᵀ + term) * after: the term is scaled too
        elif is_op(node, "Mul", "Div"):
            found = scalar_operand(view, node)
            if found is None:
                return f"scale of {node.op_type} {node.name!r} on the scores is not a scalar constant"
            nxt, factor = found
            s.scale *= factor
            after *= factor
            scaled = True
        else:
            what = f"{node.op_type} {node.name!r}"
            return f"{what} between the scores and the Softmax is not a scale, mask or reshape"
        s.nodes.add(node.id)
        tensor, reader = nxt, node
    if is_projection(view, node):
        return f"{node.op_type} {node.name!r} before the Softmax has a constant 2-D B: a projection, not QKᵀ"
    s.qk = node
    s.k_rows = bool(matmul_form(node))
    s.nodes.add(node.id)
    s.q, s.k = (_prescale(view, s, t, node) for t in node.inputs)
    return s


def _window_mask(view: GraphView, s: Scores, back: Node) -> Node | None:
    """Swin's shifted-window mask: scores [B*nW, H, N, N] -> Reshape [B, nW, H, N, N] -> Add mask [1, nW, 1|H, N, N]
    (any rank-5 broadcast with a batch dim of 1) -> Reshape `back` to [B*nW, H, N, N]. The mask of window w is added
    to batch row b with b % nW == w: sets s.mask_tensor and s.mask_period (nW) and returns the first Reshape, or
    None when the chain is not that form (the walk then takes it op by op)."""
    add = view.producer_of(back.inputs[0])
    if s.mask_tensor or not is_op(back, "Reshape") or add is None or not is_op(add, "Add") \
            or view.consumers.get(add.outputs[0], ()) != (back.id,) or add.outputs[0] in view.graph_outputs:
        return None
    ways = [t for t in add.inputs if leads_to_qk(view, t)]
    top = view.producer_of(ways[0]) if len(ways) == 1 else None
    if top is None or not is_op(top, "Reshape") or view.consumers.get(top.outputs[0], ()) != (add.id,) \
            or top.outputs[0] in view.graph_outputs:
        return None
    term = next(t for t in add.inputs if t != ways[0])
    scores, win, out, mask = (view.shape(t) for t in (top.inputs[0], top.outputs[0], back.outputs[0], term))
    if scores is None or win is None or mask is None or len(scores) != 4 or len(win) != 5 or out != scores \
            or tuple(win[2:]) != tuple(scores[1:]) or not isinstance(win[1], int) or win[1] <= 1:
        return None
    padded = (1,) * (5 - len(mask)) + tuple(mask)
    if len(mask) > 5 or padded[0] != 1 or any(m not in (1, w) for m, w in zip(padded[1:], win[1:], strict=True)):
        return None
    if additive_kind(view, term) != "mask":
        return None
    s.mask, s.mask_tensor, s.mask_period = True, term, int(win[1])
    return top


def _prescale(view: GraphView, s: Scores, tensor: str, reader: Node) -> str:
    """Absorb Mul/Div by scalars applied to q or k right before the MatMul; returns what the chain reads."""
    while view.consumers.get(tensor, ()) == (reader.id,) and tensor not in view.graph_outputs:
        node = view.producer_of(tensor)
        found = scalar_operand(view, node) if node is not None else None
        if node is None or found is None:
            break
        s.nodes.add(node.id)
        s.scale *= found[1]
        tensor, reader = found[0], node
    return tensor


def _pass_through(view: GraphView, s: Scores, tensor: str) -> str:
    """Cast/Identity/Dropout (inference) on P are part of the chain."""
    while True:
        node = sole_reader(view, tensor)
        if node is None or not is_op(node, "Cast", "Identity", "Dropout") or len(node.outputs) != 1:
            return tensor
        if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2]:  # training_mode: must be off
            mode = view.const_value(node.inputs[2])
            if mode is None or bool(mode.reshape(-1)[0]):
                return tensor
        s.nodes.add(node.id)
        tensor = node.outputs[0]


def walk_probs(view: GraphView, s: Scores) -> Node | str:
    """From the Softmax down to the PV MatMul, through casts and torch's NaN guard Where(IsNaN(P), 0, P)."""
    probs = _pass_through(view, s, s.softmax.outputs[0])
    users = view.consumers_of(probs)
    if len(users) == 2 and probs not in view.graph_outputs:
        isnan = next((u for u in users if is_op(u, "IsNaN")), None)
        where = next((u for u in users if is_op(u, "Where")), None)
        if isnan and where and where.inputs[0] == isnan.outputs[0] and where.inputs[2] == probs \
                and view.consumers_of(isnan.outputs[0]) == (where,) \
                and const_close(view, where.inputs[1], 0.0):
            s.nodes |= {isnan.id, where.id}
            s.nan_guard = True
            probs = _pass_through(view, s, where.outputs[0])
    s.probs = probs
    users = view.consumers_of(probs)
    if probs in view.graph_outputs or len(users) != 1:
        return f"attention probabilities {probs!r} are also read outside (graph output or a second reader)"
    pv = users[0]
    form = matmul_form(pv)
    if form is None:
        return f"the probabilities go to {pv.op_type} {pv.name!r}, not to a MatMul with V"
    if form:
        return f"{pv.op_type} {pv.name!r} reads V transposed ([.., D, S]), which the kernels do not take"
    if pv.inputs[0] != probs:
        return f"second MatMul {pv.name!r} reads the scores as its B operand"
    return pv
