"""Helpers the fusion rules share: readers of a tensor, dims as attrs, static values of small subgraphs, and the
tolerance a constant is compared with."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, is_op

AttrDim = int | str
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
"""The tensor types fused groups compute on."""


def sole_reader(view: GraphView, tensor: str) -> Node | None:
    """The only node reading `tensor`, if exactly one does and `tensor` is not a graph output."""
    if tensor in view.graph_outputs:
        return None
    users = view.consumers_of(tensor)
    return users[0] if len(users) == 1 else None


def read_only_by(view: GraphView, node: Node, group: set[int] | frozenset[int]) -> bool:
    """Every output of `node` is read only by nodes in `group` (and none is a graph output)."""
    for o in node.outputs:
        if not o:
            continue
        if o in view.graph_outputs or any(c not in group for c in view.consumers.get(o, ())):
            return False
    return True


def convex(view: GraphView, ids: set[int] | frozenset[int]) -> bool:
    """No path leaves `ids` and comes back (plan.candidates' rule; it imports this package, so a copy)."""
    mask = sum(1 << i for i in ids)
    below = above = 0
    for i in ids:
        below |= view.desc_mask[i]
        above |= view.anc_mask[i]
    return (below & above & ~mask) == 0


def dims(view: GraphView, tensor: str) -> tuple[AttrDim, ...] | None:
    """Shape as attr values: ints where static, the dim's name where symbolic, "?" where unknown."""
    shape = view.shape(tensor)
    if shape is None:
        return None
    return tuple(d if isinstance(d, int | str) else "?" for d in shape)


def dim(view: GraphView, tensor: str, axis: int) -> AttrDim:
    shape = dims(view, tensor)
    if shape is None or not -len(shape) <= axis < len(shape):
        return "?"
    return shape[axis]


def prod(values: Iterable[AttrDim]) -> AttrDim:
    """Product of dims: an int if all are static, else e.g. "batch*128"."""
    vals = list(values)
    if all(isinstance(v, int) for v in vals):
        return int(np.prod(vals, dtype=np.int64)) if vals else 1
    return "*".join(str(v) for v in vals)


def rank(view: GraphView, tensor: str) -> int | None:
    shape = view.shape(tensor)
    return None if shape is None else len(shape)


# --- static values of small subgraphs (shape arithmetic the loader did not fold) -------------------------

_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Sqrt": np.sqrt, "Reciprocal": lambda a: 1.0 / a, "Neg": np.negative, "Identity": lambda a: a,
    "Exp": np.exp, "Log": np.log, "Abs": np.abs,
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Pow": np.power,
    "Div": lambda a, b: a // b if a.dtype.kind in "iu" and b.dtype.kind in "iu" else a / b,
}


def static_value(view: GraphView, tensor: str, depth: int = 16) -> np.ndarray | None:
    """The value of `tensor` if it follows from constants and static shapes alone, else None.

    Covers what exporters emit to compute an attention scale from a runtime shape
    (Shape -> Slice/Gather -> Cast -> Sqrt -> Div -> Sqrt) when the loader left it unfolded.
    """
    val = view.const_value(tensor)
    if val is not None:
        return val
    node = view.producer_of(tensor)
    if node is None or depth <= 0 or node.domain != "" or len(node.outputs) != 1:
        return None
    op = node.op_type
    if op == "Shape":
        shape = view.shape(node.inputs[0])
        if shape is None:
            return None
        lo, hi = node.attrs.get("start", 0), node.attrs.get("end", len(shape))
        part = shape[lo:hi]
        return np.array(part, dtype=np.int64) if all(isinstance(d, int) for d in part) else None
    try:
        if op in ("Slice", "Gather"):
            part = _shape_part(view, node, depth)
            if part is not None:
                return part
        args = [static_value(view, t, depth - 1) if t else None for t in node.inputs]
        if any(a is None for a in args[:1]) or (op in _BINARY and args[1] is None):
            return None
        return _apply(op, node, args)
    except (ValueError, IndexError, TypeError, KeyError, ArithmeticError):
        return None


def _shape_part(view: GraphView, node: Node, depth: int) -> np.ndarray | None:
    """Slice/Gather of a Shape whose selected dims are static, though others are not (e.g. q.shape[-1])."""
    src = view.producer_of(node.inputs[0])
    if not is_op(src, "Shape") or src is None:
        return None
    shape = view.shape(src.inputs[0])
    if shape is None:
        return None
    dims_ = list(shape)[src.attrs.get("start", 0):src.attrs.get("end", len(shape))]
    idx = [static_value(view, t, depth - 1) if t else None for t in node.inputs[1:]]
    if any(i is None for i in idx[:2 if node.op_type == "Slice" else 1]):
        return None
    if node.op_type == "Gather":
        picked = [dims_[int(i)] for i in np.atleast_1d(idx[0])]  # type: ignore[arg-type]
    else:
        axes = idx[2] if len(idx) > 2 and idx[2] is not None else None
        if axes is not None and int(np.atleast_1d(axes)[0]) != 0:
            return None
        step = int(idx[3][0]) if len(idx) > 3 and idx[3] is not None else 1
        picked = dims_[int(idx[0][0]):int(idx[1][0]):step]  # type: ignore[index]
    if not all(isinstance(d, int) for d in picked):
        return None
    out = np.array(picked, dtype=np.int64)
    return out.reshape(()) if node.op_type == "Gather" and np.ndim(idx[0]) == 0 else out


def _apply(op: str, node: Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    a = args[0]
    assert a is not None
    if op in _UNARY:
        return _UNARY[op](a)
    if op in _BINARY:
        return _BINARY[op](a, args[1])
    if op == "Cast":
        return a.astype(helper.tensor_dtype_to_np_dtype(node.attrs["to"]))
    if op in ("Unsqueeze", "Squeeze", "Reshape"):
        if op == "Reshape" and args[1] is not None:
            return a.reshape(args[1].astype(np.int64))
        axes = args[1] if len(args) > 1 and args[1] is not None else node.attrs.get("axes")
        if op == "Unsqueeze":
            return np.expand_dims(a, tuple(int(x) for x in np.atleast_1d(axes)))
        return np.squeeze(a, None if axes is None else tuple(int(x) for x in np.atleast_1d(axes)))
    if op == "Gather" and args[1] is not None:
        return np.take(a, args[1].astype(np.int64), axis=node.attrs.get("axis", 0))
    if op == "Concat" and all(x is not None for x in args):
        return np.concatenate(args, axis=node.attrs.get("axis", 0))  # type: ignore[arg-type]
    if op == "Slice" and a.ndim == 1 and args[1] is not None and args[2] is not None:
        step = int(args[4][0]) if len(args) > 4 and args[4] is not None else 1
        return a[int(args[1][0]):int(args[2][0]):step]
    return None


# --- comparing constants with the values a rule expects ----------------------------------------------------

# Machine epsilon of each ONNX float type: the gap between 1 and the next value of the type, i.e. one ulp at 1.
# A constant rounded to the type is off by at most half an ulp of its value (relative, eps / 2).
EPS: dict[int, float] = {
    TensorProto.DOUBLE: 2.0**-52, TensorProto.FLOAT: 2.0**-23, TensorProto.FLOAT16: 2.0**-10,
    TensorProto.BFLOAT16: 2.0**-7,
}
# never looser than this: fp32 exports write decimals such as 0.7071 or 1.4142 for 1/sqrt(2) and sqrt(2) (off by
# 1e-5 relative), which fp32's own rounding error (6e-8) would reject
FLOOR = 1e-5
_INTEGER_TYPES = frozenset((
    TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8, TensorProto.UINT16,
    TensorProto.UINT32, TensorProto.UINT64, TensorProto.BOOL,
))


def tolerance(dtype: int) -> float:
    """Relative tolerance for a value of ONNX element type `dtype` (an unknown type counts as float): the type's
    rounding error, half an ulp at 1 (fp16 4.9e-4, bf16 3.9e-3), at least FLOOR (so 1e-5 for fp32); 0 for integers.

    A constant rounded to the type is off by at most this much, relative. An activation evaluated from constants
    so rounded stays within it of the exact function too (GELU moves by less than 0.3 times a relative change of
    its constant): fp16's sqrt(2) = 1.4140625 moves GELU by 2.8e-5 times 1 + |GELU|, while 1.42 (1.419921875,
    6 ulps off) moves it by 1.1e-3 times that, past fp16's 4.9e-4.
    """
    if dtype in _INTEGER_TYPES:
        return 0.0
    return max(FLOOR, EPS.get(dtype, EPS[TensorProto.FLOAT]) / 2)


def coarsest(dtypes: Iterable[int]) -> int:
    """The float type with the largest tolerance among `dtypes` (FLOAT when none is a float type)."""
    floats = [d for d in dtypes if d in EPS]
    return max(floats, key=EPS.__getitem__, default=TensorProto.FLOAT)


def tensor_dtype(view: GraphView, tensor: str) -> int:
    """The ONNX element type of `tensor`: from its type info, else from its static value; 0 when unknown."""
    info = view.info(tensor)
    if info is not None and info.dtype:
        return info.dtype
    val = static_value(view, tensor)
    return 0 if val is None else helper.np_dtype_to_tensor_dtype(val.dtype)


def close(value: float, expected: float, dtype: int) -> bool:
    """`value`, held in ONNX type `dtype`, is `expected` within the type's relative tolerance (0 stays exact)."""
    return abs(value - expected) <= tolerance(dtype) * abs(expected)


def const_close(view: GraphView, tensor: str, expected: float) -> bool:
    """`tensor` holds one value known before run time, and it is `expected` within its type's tolerance."""
    val = const_scalar(view, tensor)
    return val is not None and close(val, expected, tensor_dtype(view, tensor))


def const_scalar(view: GraphView, tensor: str) -> float | None:
    """A tensor holding exactly one value known before run time (constant or static shape arithmetic)."""
    val = static_value(view, tensor)
    if val is None or val.size != 1 or not (val.dtype.kind in "fiu" or is_bfloat16(val.dtype)):
        return None
    return float(val.reshape(-1)[0])


def is_bfloat16(dtype: np.dtype) -> bool:
    """numpy reads bfloat16 tensors as ml_dtypes' bfloat16, whose kind is "V" (not "f"), so kind checks miss it."""
    return dtype.kind == "V" and dtype.name == "bfloat16"


def absorb_up(
    view: GraphView, group: set[int], heads: Iterable[str], step: Callable[[Node, str], Iterable[str] | None]
) -> set[int]:
    """Grow `group` upwards from the tensors `heads` until nothing more may join; returns the nodes added.

    `step(node, head)` says whether the producer `node` of `head` may join (None: no) and, if so, which of its
    inputs to keep walking from. A node joins only once every tensor it writes is read inside the group,
    so several branches that meet at one node (q, k, v leaving one Split) pull it in together.
    """
    added: set[int] = set()
    pending = list(dict.fromkeys(heads))
    changed = True
    while changed:
        changed = False
        for head in list(pending):
            node = view.producer_of(head)
            if node is None or node.id in group:
                pending.remove(head)
                continue
            nxt = step(node, head)
            if nxt is None:
                pending.remove(head)
                continue
            if not read_only_by(view, node, group):
                continue
            group.add(node.id)
            added.add(node.id)
            pending = [h for h in pending if h not in node.outputs] + [t for t in nxt if t]
            changed = True
            break
    return added


def chain_break(view: GraphView, tensor: str, what: str, reason: str) -> str:
    """Why a rule's chain of nodes (a `what`, e.g. "decomposed LayerNorm") broke at `tensor`: `reason`, unless the
    chain broke because `tensor` is also read outside it (or no reason is given)."""
    if tensor in view.graph_outputs or len(view.consumers_of(tensor)) > 1 or not reason:
        return f"intermediate {tensor!r} of the {what} is also read outside it"
    return reason


def reduced_axes(view: GraphView, node: Node) -> tuple[int, ...] | None:
    """The axes a Reduce* node reduces (attribute before opset 18, input after; no axes reduce them all), or None
    where they are not known before run time."""
    axes: tuple[int, ...] = ()
    if "axes" in node.attrs:
        axes = tuple(int(a) for a in node.attrs["axes"])
    elif len(node.inputs) > 1 and node.inputs[1]:
        val = static_value(view, node.inputs[1])
        if val is None:
            return None
        axes = tuple(int(a) for a in val.reshape(-1))
    if axes or node.attrs.get("noop_with_empty_axes", 0):
        return axes or None
    r = len(view.shape(node.inputs[0]) or ())
    return tuple(range(r)) if r else None


def with_residual(view: GraphView, family: str, ids: set[int], x: str, y: str, attrs: dict[str, Any],
                  roles: dict[str, str]) -> Iterator[Match]:
    """A normalisation's matches: the group `ids` on x (role a, the other `roles` beside it) writing y, and where x
    is an Add of two tensors of x's shape, the one with that Add (roles a and b its addends, x a second output, "sum",
    where it is read outside)."""
    yield Match(frozenset(ids), family, attrs | {"residual": False}, {"a": x, **roles}, {"y": y})
    add = view.producer_of(x)
    shape = view.shape(x)
    if is_op(add, "Add") and add is not None and shape is not None \
            and all(view.shape(t) == shape for t in add.inputs):
        yield Match(frozenset(ids | {add.id}), family, attrs | {"residual": True},
                    {"a": add.inputs[0], "b": add.inputs[1], **roles}, {"y": y, "sum": x})


def squared(view: GraphView, node: Node | None) -> str | None:
    """x where `node` computes x ** 2 (Pow by 2, or Mul of x by itself), else None."""
    if is_op(node, "Pow") and node is not None and const_close(view, node.inputs[1], 2.0):
        return node.inputs[0]
    if is_op(node, "Mul") and node is not None and node.inputs[0] == node.inputs[1]:
        return node.inputs[0]
    return None


def spliced(model: onnx.ModelProto, inserts: Mapping[int, Sequence[onnx.NodeProto]], removed: Collection[int],
            initializers: Sequence[onnx.TensorProto] = (), value_info: Sequence[onnx.ValueInfoProto] = ()
            ) -> onnx.ModelProto:
    """A copy of `model` (its graph's nodes numbered as a GraphView numbers them) with `inserts[i]` placed before node
    i, the nodes of `removed` left out, the initializers nothing reads any more dropped, and `initializers` and
    `value_info` added: what a rewrite before planning writes (the QKV and gated packings, rotate-half)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    kept: list[onnx.NodeProto] = []
    for i, node in enumerate(model.graph.node):
        kept.extend(inserts.get(i, ()))
        if i not in removed:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    still_read = {t for n in graph.node for t in n.input} | {o.name for o in graph.output}
    inits = [t for t in graph.initializer if t.name in still_read]
    del graph.initializer[:]
    graph.initializer.extend([*inits, *initializers])
    graph.value_info.extend(value_info)
    return out
