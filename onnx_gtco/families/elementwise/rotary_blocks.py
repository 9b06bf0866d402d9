"""Partial and interleaved rotary embeddings (GPT-NeoX, Phi, StableLM, GPT-J, EVA-02) rewritten before planning as one
elementwise expression over a blocked view of the head, which the elementwise family runs as one kernel.

A partial rotary rotates the first r of the head's D dims and passes the rest through; the exporters write

    Concat(x1 * cos + R(x1) * sin, x[..., r:])   with x1 = x[..., :r], cos and sin [..., r]

where R is rotate-half, ``Concat(-x1[..., h:], x1[..., :h])``, or GPT-J's interleaved rotate-every-two,
``Reshape(Concat(Unsqueeze(-x1[..., 1::2], -1), Unsqueeze(x1[..., 0::2], -1)), [..., r])``. Neither reaches an
elementwise kernel as written: the Concat of a computed part and a slice, and the interleave, move the elements of
computed values. Viewed in blocks of r (D = blocks * r), the same values are

    xb = Reshape(x, [..., D / r, r])            (interleaved: [..., D / r, r / 2, 2])
    yb = Where(block == 0, xb * cb + roll(xb) * sign * sb, xb)
    y  = Reshape(yb, [..., D])

with cb, sb the tables reshaped to [..., 1, r] (interleaved [..., 1, r / 2, 2]), roll the swap of the last axis's two
halves (a Concat of two slices of one tensor, which the elementwise kernels fold into the load; interleaved: the two
elements of each pair) and sign -1 on the part that was negated: the same products and sum, in the same order, and
the pass-through part selected as it is, so the values are bit for bit those of the original. A full interleaved
rotary (r = D) is the one block, without the Where. Full rotate-half needs none of this (families/elementwise/
rotate.py). A partial rotary whose r does not divide D (Phi-2: r = 32 of D = 80) is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_gtco.families.elementwise.rotate import rotate_half_sign
from onnx_gtco.families.elementwise.rule import slice_axis
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import spliced


@dataclass(frozen=True)
class _Slice:
    data: str
    axis: int  # non-negative
    lo: int
    hi: int
    step: int
    node: Node


@dataclass(frozen=True)
class BlockRotary:
    """One partial or interleaved rotary embedding: `out` (the node writing its result: the partial's Concat, or a
    full interleaved rotary's Add) computes rotary(x[..., :rotated]) over `source`'s last axis of `width`, with
    `cos` and `sin` tables [..., rotated]; `half`: rotate-half's split (None: interleaved pairs); `nodes`: the node
    ids of the matched expression."""

    out: Node
    source: str
    width: int
    rotated: int
    half: int | None
    cos: str
    sin: str
    nodes: frozenset[int]


def _last_axis(view: GraphView, tensor: str, axis: int) -> bool:
    shape = view.shape(tensor)
    return shape is not None and len(shape) > 0 and axis % len(shape) == len(shape) - 1


def _slice_of(view: GraphView, tensor: str) -> _Slice | None:
    """The Slice writing `tensor` when it takes one axis with constant bounds and a positive step."""
    node = view.producer_of(tensor)
    found = slice_axis(view, node) if node is not None else None
    return _Slice(*found, node) if found is not None else None  # type: ignore[arg-type]


def _unsqueezed_last(view: GraphView, tensor: str) -> str | None:
    """The input of an Unsqueeze writing `tensor` that appends one trailing axis."""
    node = view.producer_of(tensor)
    if node is None or not is_op(node, "Unsqueeze"):
        return None
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        value = view.const_value(node.inputs[1])
        axes = None if value is None else [int(v) for v in value.reshape(-1)]
    out = view.shape(tensor)
    if axes is None or out is None or len(axes) != 1 or int(axes[0]) % len(out) != len(out) - 1:
        return None
    return node.inputs[0]


def _rotation(view: GraphView, tensor: str) -> tuple[str, int | None, set[int]] | None:
    """(x1, half, nodes) where `tensor` is rotate-half of x1 split at half, or rotate-every-two of x1 (half None)."""
    node = view.producer_of(tensor)
    if node is None:
        return None
    if is_op(node, "Concat") and len(node.inputs) == 2 and _last_axis(view, tensor, int(node.attrs.get("axis", 0))):
        neg = view.producer_of(node.inputs[0])
        if neg is None or not is_op(neg, "Neg"):
            return None
        high, low = _slice_of(view, neg.inputs[0]), _slice_of(view, node.inputs[1])
        if high is None or low is None or high.data != low.data or high.step != 1 or low.step != 1:
            return None
        shape = view.shape(high.data)
        width = shape[-1] if shape else None
        if high.axis != len(shape) - 1 or low.axis != high.axis or low.lo != 0 or high.lo != low.hi \
                or high.hi != width or not 0 < low.hi < width:  # type: ignore[arg-type,operator]
            return None
        return high.data, low.hi, {node.id, neg.id, high.node.id, low.node.id}
    if not is_op(node, "Reshape", "Flatten"):
        return None
    cat = view.producer_of(node.inputs[0])
    if cat is None or not is_op(cat, "Concat") or len(cat.inputs) != 2 \
            or not _last_axis(view, cat.outputs[0], int(cat.attrs.get("axis", 0))):
        return None
    parts = [_unsqueezed_last(view, t) for t in cat.inputs]
    if parts[0] is None or parts[1] is None:
        return None
    neg = view.producer_of(parts[0])
    if neg is None or not is_op(neg, "Neg"):
        return None
    odd, even = _slice_of(view, neg.inputs[0]), _slice_of(view, parts[1])
    if odd is None or even is None or odd.data != even.data:
        return None
    src, out = view.shape(odd.data), view.shape(tensor)
    width = src[-1] if src else None
    if not isinstance(width, int) or width % 2 or out is None or tuple(out) != tuple(src):  # type: ignore[arg-type]
        return None
    if odd.axis != len(src) - 1 or even.axis != odd.axis or (odd.lo, odd.hi, odd.step) != (1, width, 2) \
            or (even.lo, even.step) != (0, 2) or even.hi < width - 1:  # type: ignore[arg-type]
        return None
    ids = {node.id, cat.id, neg.id, odd.node.id, even.node.id}
    ids |= {p.id for t in cat.inputs if (p := view.producer_of(t)) is not None}
    return odd.data, None, ids


def _rotary(view: GraphView, add: Node) -> tuple[str, str, str, int | None, set[int]] | None:
    """(x1, cos, sin, half, nodes) of ``x1 * cos + R(x1) * sin`` written by the Add `add` (operands in any order)."""
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return None
    muls = [view.producer_of(t) for t in add.inputs]
    if any(m is None or not is_op(m, "Mul") or len(m.inputs) != 2 for m in muls):
        return None
    for plain, rotated in (muls, muls[::-1]):
        for r_in, sin in (rotated.inputs, rotated.inputs[::-1]):  # type: ignore[union-attr]
            found = _rotation(view, r_in)
            if found is None or found[0] not in plain.inputs:  # type: ignore[union-attr]
                continue
            x1, half, ids = found
            cos = plain.inputs[1] if plain.inputs[0] == x1 else plain.inputs[0]  # type: ignore[union-attr]
            width, rank = view.shape(x1)[-1], len(view.shape(x1))  # type: ignore[index,arg-type]
            if any((s := view.shape(t)) is None or not s or s[-1] != width or len(s) > rank for t in (cos, sin)):
                continue
            return x1, cos, sin, half, ids | {add.id, plain.id, rotated.id}  # type: ignore[union-attr]
    return None


def block_rotaries(view: GraphView) -> list[BlockRotary]:
    """Every partial rotary whose rotated part divides the head, and every full interleaved rotary, in node order."""
    found: list[BlockRotary] = []
    taken: set[int] = set()
    for node in view.nodes:  # partial: Concat(rotary(x[..., :r]), x[..., r:])
        if not is_op(node, "Concat") or len(node.inputs) != 2 \
                or not _last_axis(view, node.outputs[0], int(node.attrs.get("axis", 0))):
            continue
        add, rest = view.producer_of(node.inputs[0]), _slice_of(view, node.inputs[1])
        rot = _rotary(view, add) if add is not None and rest is not None else None
        head = _slice_of(view, rot[0]) if rot is not None else None
        if rot is None or head is None or rest is None or head.data != rest.data or head.step != 1 or rest.step != 1:
            continue
        shape = view.shape(rest.data)
        width, r = shape[-1], head.hi  # type: ignore[index]
        if head.axis != rest.axis or rest.axis != len(shape) - 1 or head.lo != 0 or rest.lo != r  \
                or rest.hi != width or not 0 < r < width or width % r or (rot[3] is None and r % 2):  # type: ignore[arg-type,operator]
            continue
        found.append(BlockRotary(node, rest.data, width, r, rot[3], rot[1], rot[2],
                                 frozenset(rot[4] | {node.id, head.node.id, rest.node.id})))
        taken |= rot[4]
    for node in view.nodes:  # full interleaved: the rotary's Add itself
        if node.id in taken or not is_op(node, "Add"):
            continue
        rot = _rotary(view, node)
        if rot is None or rot[3] is not None:
            continue
        width = view.shape(rot[0])[-1]  # type: ignore[index]
        found.append(BlockRotary(node, rot[0], width, width, None, rot[1], rot[2], frozenset(rot[4])))  # type: ignore[arg-type]
    return sorted(found, key=lambda b: b.out.id)


def _dims(shape: Iterable[Any]) -> list[Any]:
    return [d if isinstance(d, (int, str)) else None for d in shape]


def _broadcast(a: list[Any], b: list[Any]) -> list[Any]:
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + a, [1] * (n - len(b)) + b
    return [y if x == 1 else x for x, y in zip(a, b, strict=True)]


def _rewrite(view: GraphView, b: BlockRotary, dtype: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto],
                                                                      list[onnx.ValueInfoProto]]:
    """The nodes writing `b.out`'s output in the blocked form, their constants and the shapes of their tensors."""
    p = f"{b.out.outputs[0]}.rotary"
    xs, cs = _dims(view.shape(b.source) or ()), _dims(view.shape(b.cos) or ())
    blocks, r = b.width // b.rotated, b.rotated
    inner = [r] if b.half is not None else [r // 2, 2]
    half, last = (b.half, r) if b.half is not None else (1, 2)
    sign = rotate_half_sign(last, half, dtype)
    bshape = [*xs[:-1], blocks, *inner]
    tshape = [*cs[:-1], 1, *inner]
    inits = [numpy_helper.from_array(np.array([0] * (len(xs) - 1) + [blocks, *inner], np.int64), f"{p}.blocked"),
             numpy_helper.from_array(np.array([0] * (len(cs) - 1) + [1, *inner], np.int64), f"{p}.table"),
             numpy_helper.from_array(np.array([0] * (len(xs) - 1) + [b.width], np.int64), f"{p}.merged"),
             numpy_helper.from_array(np.array([half], np.int64), f"{p}.half"),
             numpy_helper.from_array(np.array([last], np.int64), f"{p}.end"),
             numpy_helper.from_array(np.array([0], np.int64), f"{p}.zero"),
             numpy_helper.from_array(np.array([-1], np.int64), f"{p}.axis"),
             numpy_helper.from_array(sign, f"{p}.sign")]
    out = b.out.outputs[0]
    nodes = [
        helper.make_node("Reshape", [b.source, f"{p}.blocked"], [f"{p}.x"], name=f"{p}.x"),
        helper.make_node("Reshape", [b.cos, f"{p}.table"], [f"{p}.cos"], name=f"{p}.cos"),
        helper.make_node("Reshape", [b.sin, f"{p}.table"], [f"{p}.sin"], name=f"{p}.sin"),
        helper.make_node("Slice", [f"{p}.x", f"{p}.half", f"{p}.end", f"{p}.axis"], [f"{p}.high"], name=f"{p}.high"),
        helper.make_node("Slice", [f"{p}.x", f"{p}.zero", f"{p}.half", f"{p}.axis"], [f"{p}.low"], name=f"{p}.low"),
        helper.make_node("Concat", [f"{p}.high", f"{p}.low"], [f"{p}.roll"], name=f"{p}.roll", axis=-1),
        helper.make_node("Mul", [f"{p}.roll", f"{p}.sign"], [f"{p}.signed"], name=f"{p}.signed"),
        helper.make_node("Mul", [f"{p}.x", f"{p}.cos"], [f"{p}.xcos"], name=f"{p}.xcos"),
        helper.make_node("Mul", [f"{p}.signed", f"{p}.sin"], [f"{p}.rsin"], name=f"{p}.rsin"),
        helper.make_node("Add", [f"{p}.xcos", f"{p}.rsin"], [f"{p}.sum"], name=f"{p}.sum"),
    ]
    rot = f"{p}.sum"
    if blocks > 1:  # the blocks after the first pass through
        mask = np.zeros([blocks] + [1] * len(inner), bool)
        mask[0] = True
        inits.append(numpy_helper.from_array(mask, f"{p}.first"))
        nodes.append(helper.make_node("Where", [f"{p}.first", rot, f"{p}.x"], [f"{p}.kept"], name=f"{p}.kept"))
        rot = f"{p}.kept"
    nodes.append(helper.make_node("Reshape", [rot, f"{p}.merged"], [out], name=f"{p}.out"))
    full = _broadcast(bshape, tshape)
    shapes = {"x": bshape, "cos": tshape, "sin": tshape, "high": [*bshape[:-1], last - half],
              "low": [*bshape[:-1], half], "roll": bshape, "signed": bshape, "xcos": full, "rsin": full, "sum": full,
              **({"kept": full} if blocks > 1 else {})}
    infos = [helper.make_tensor_value_info(f"{p}.{k}", dtype, v) for k, v in shapes.items()]
    return nodes, inits, infos


def _dead(view: GraphView, candidates: frozenset[int], removed: set[int]) -> set[int]:
    """The nodes of `candidates` that nothing reads once `removed` is gone (graph outputs are read). One pass from the
    last node back suffices: every reader comes after what it reads."""
    gone = set(removed)
    for i in sorted(candidates - gone, reverse=True):
        if not any(o in view.graph_outputs or any(c.id not in gone for c in view.consumers_of(o))
                   for o in view.nodes[i].outputs if o):
            gone.add(i)
    return gone


def blocked_rotaries(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[BlockRotary]]:
    """`model` with every partial rotary whose rotated part divides the head, and every full interleaved rotary, in
    the blocked form (a copy; the model passed in is unchanged), and what was rewritten. A model without one is
    returned as it is."""
    view = GraphView(model)
    found = block_rotaries(view)
    if not found:
        return model, []
    replace: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    inits: list[onnx.TensorProto] = []
    infos: list[onnx.ValueInfoProto] = []
    for b in found:
        info = view.info(b.out.outputs[0])
        dtype = info.dtype if info is not None and info.dtype else onnx.TensorProto.FLOAT
        nodes, consts, shapes = _rewrite(view, b, dtype)
        replace[b.out.id] = nodes
        inits += consts
        infos += shapes
        removed.add(b.out.id)
    removed = _dead(view, frozenset().union(*(b.nodes for b in found)), removed)
    return spliced(model, replace, removed, inits, infos), found


__all__ = ["BlockRotary", "block_rotaries", "blocked_rotaries"]
