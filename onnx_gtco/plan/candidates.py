"""Turn rule matches into legal candidates: convex, bounded, typed; everything else becomes a Reject."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from onnx import TensorProto

from onnx_gtco.ir.view import GraphView
from onnx_gtco.patterns.base import Match, Pattern
from onnx_gtco.plan.types import Candidate, Reject, freeze_attrs

# Dtypes a fused kernel computes on; anything else (float64, int8, ...) stays unfused with the reason reported.
FLOAT_TYPES = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16"}


def is_convex(view: GraphView, ids: frozenset[int]) -> bool:
    """No path leaves the group and comes back into it."""
    mask = sum(1 << i for i in ids)
    below = 0
    above = 0
    for i in ids:
        below |= view.desc_mask[i]
        above |= view.anc_mask[i]
    return (below & above & ~mask) == 0


def group_dtype(view: GraphView, ids: frozenset[int]) -> int | None:
    """The float dtype the group's heavy tensors use, taken from its first float output; None if none."""
    for i in sorted(ids):
        for o in view.nodes[i].outputs:
            ti = view.info(o)
            if ti is not None and ti.dtype in FLOAT_TYPES:
                return ti.dtype
    return None


def check(view: GraphView, m: Match, pattern: str, max_size: int) -> Candidate | Reject:
    """Legality of one match; the Reject says which rule failed."""
    anchor = view.nodes[min(m.nodes)].name
    if len(m.nodes) > max_size:
        return Reject(pattern, anchor, f"{len(m.nodes)} nodes > max group size {max_size}")
    if not is_convex(view, m.nodes):
        return Reject(pattern, anchor, "not convex: a path leaves the group and re-enters it")
    if not view.external_outputs(m.nodes):
        return Reject(pattern, anchor, "group has no output")
    for i in m.nodes:
        n = view.nodes[i]
        for t in (*n.inputs, *n.outputs):
            ti = view.info(t) if t else None
            if ti is not None and ti.dtype in (TensorProto.DOUBLE, TensorProto.INT8, TensorProto.UINT8) \
                    and not view.is_constant(t):
                name = TensorProto.DataType.Name(ti.dtype).lower()
                return Reject(pattern, anchor, f"tensor {t!r} of node {n.name!r} is {name}: no fused kernel for it")
    if group_dtype(view, m.nodes) is None:
        return Reject(pattern, anchor, "no float16/bfloat16/float32 output: nothing for a float kernel to compute")
    return Candidate(m.nodes, m.family, pattern, freeze_attrs(m.attrs), tuple(sorted(m.roles.items())),
                     tuple(sorted(m.outputs.items())))


def collect(
    view: GraphView, patterns: Sequence[Pattern], max_size: int
) -> tuple[list[Candidate], list[Reject]]:
    """Run every rule; dedupe identical node sets (first rule in registry order wins)."""
    cands: dict[frozenset[int], Candidate] = {}
    rejects: list[Reject] = []
    for pat in patterns:
        for r in pat.match(view):
            if isinstance(r, Reject):
                rejects.append(r)
                continue
            res = check(view, r, pat.name, max_size)
            if isinstance(res, Reject):
                rejects.append(res)
            elif res.nodes not in cands:
                cands[res.nodes] = res
    return list(cands.values()), rejects


def singletons(view: GraphView, skip: Iterable[int] = ()) -> list[Candidate]:
    """A node left as it is: every node may always run alone."""
    skipped = set(skip)
    return [
        Candidate(frozenset([n.id]), "unfused", n.op_type) for n in view.nodes if n.id not in skipped
    ]
