"""Head split and merge around an attention core: the layout ops a fused kernel folds into its indexing."""

from __future__ import annotations

import math

from onnx_gtco.families.attention.scores import scalar_operand
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import absorb_up, dim, rank, sole_reader, static_value

VIEW_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Flatten")
MAX_MERGE = 3
Perm = tuple[int, ...] | None  # branch = transpose(source, P); None once a reshape or unbind is passed

# permutations of the last three axes from a branch's source to the core operand, by what the source is
_NAMES = {
    "q": {(0, 1, 2): "bhsd", (1, 0, 2): "bshd"},  # core operand [.., H, S, D] (q, v, and PV's output)
    "k": {(0, 2, 1): "bhsd", (1, 2, 0): "bshd", (0, 1, 2): "bhds"},  # core operand kᵀ [.., H, D, S]
}


def _leading_reshape(view: GraphView, node: Node) -> bool:
    """A Reshape that only merges or splits the leading dims of a tensor of rank >= 3 (the batch and the heads:
    [B, H, S, D] <-> [B*H, S, D], as exporters write a 4-D matmul as a 3-D one), its last two dims unchanged."""
    if not is_op(node, "Reshape"):
        return False
    shape, out = view.shape(node.inputs[0]), view.shape(node.outputs[0])
    if shape is None or out is None or min(len(shape), len(out)) < 3 or tuple(shape[-2:]) != tuple(out[-2:]):
        return False
    lead_in, lead_out = shape[:-2], out[:-2]
    if not all(isinstance(x, int) for x in (*lead_in, *lead_out)):
        return tuple(lead_in) == tuple(lead_out)
    return math.prod(lead_in) == math.prod(lead_out)  # type: ignore[arg-type]


def kv_repeat(view: GraphView, node: Node) -> int | None:
    """The repeat of grouped-query attention's K or V that `node` is part of: an Expand of the head-repeat axis,
    [B, Hkv, 1, S, D] -> [B, Hkv, rep, S, D] (transformers' repeat_kv, after an Unsqueeze of axis 2), or the Reshape
    of such an Expand's result that merges its leading dims ([B, Hkv * rep, S, D], or [B * Hkv * rep, S, D]); rep
    (> 1), or None for any other node."""
    if is_op(node, "Reshape"):
        src = view.producer_of(node.inputs[0])
        rep = kv_repeat(view, src) if src is not None and is_op(src, "Expand") else None
        return rep if rep is not None and _leading_reshape(view, node) else None
    if not is_op(node, "Expand"):
        return None
    shape, out = view.shape(node.inputs[0]), view.shape(node.outputs[0])
    if shape is None or out is None or len(shape) != 5 or len(out) != 5 or shape[2] != 1:
        return None
    rep = out[2]
    same = all(out[i] == shape[i] for i in (0, 1, 3, 4))
    return rep if same and isinstance(rep, int) and rep > 1 else None


def _kv_unsqueeze(view: GraphView, node: Node) -> bool:
    """An Unsqueeze of axis 2 feeding a kv_repeat Expand (the repeat's new axis)."""
    if not is_op(node, "Unsqueeze"):
        return False
    readers = view.consumers_of(node.outputs[0])
    return len(readers) == 1 and kv_repeat(view, readers[0]) is not None


def layout_step(view: GraphView, node: Node) -> tuple[str, ...] | None:
    """Layout-only producers (reshape, permute, unbind of a packed qkv, grouped-query attention's repeat of K and V):
    keep walking from the data input."""
    if is_op(node, *VIEW_OPS, "Split") or (is_op(node, "Expand") and kv_repeat(view, node)):
        return (node.inputs[0],)
    if is_op(node, "Gather"):
        idx = static_value(view, node.inputs[1])
        return (node.inputs[0],) if idx is not None and idx.size == 1 else None
    if is_op(node, "Slice") and all(static_value(view, t) is not None for t in node.inputs[1:] if t):
        return (node.inputs[0],)
    return None


def scale_step(view: GraphView, node: Node) -> tuple[str, ...] | None:
    """Layout ops, and on q and k also a Mul/Div by a scalar (it becomes part of the applied scale)."""
    found = scalar_operand(view, node)
    return (found[0],) if found is not None else layout_step(view, node)


def _permute(view: GraphView, perm: Perm, node: Node, up: bool) -> Perm:
    """The permutation past `node`, in the core operand's axes: a Reshape that only merges or splits the leading
    dims (_leading_reshape, grouped-query attention's repeat of K and V: kv_repeat and its Unsqueeze) keeps it, a
    Transpose of a tensor whose leading dims are merged acts on the trailing axes it moves."""
    if perm is None or node.op_type in ("Mul", "Div", "Identity"):
        return perm
    if kv_repeat(view, node) or _kv_unsqueeze(view, node) or _leading_reshape(view, node):
        return perm
    if node.op_type != "Transpose":
        return None
    p = [int(i) for i in node.attrs.get("perm") or range(len(perm) - 1, -1, -1)]
    if 3 <= len(p) < len(perm) and p[0] == 0:  # [B*H, a, b]: the merged batch and heads stay in front
        k = len(perm) - len(p) + 1
        p = [*range(k), *(i + k - 1 for i in p[1:])]
    if len(p) != len(perm):
        return None
    return tuple(p[i] for i in perm) if up else tuple(perm[i] for i in p)


def layout(view: GraphView, src: str, perm: Perm, core_rank: int, role: str, width: int | None = None,
           heads: object = None) -> str:
    """Name the layout a kernel reads a branch in (or writes the output in).

    "bhsd", "bhds", "bshd", "bshd_merged" (heads folded into the last dim, `width` = H*D wide when known) or
    "other". `role` is "q" (q, v and the output: core [.., H, S, D]) or "k" (core kᵀ [.., H, D, S]). A source one
    rank under the core with a permutation (its batch and heads merged, [B*H, S, D]) is bshd_merged where `heads`
    is 1 and it holds the rows as they are (then [B, S, D] is both), else no layout a kernel reads.
    """
    if perm is not None and heads == 1 and rank(view, src) == len(perm) - 1 and len(perm) >= 3:
        lead = len(perm) - 3
        rows = _NAMES[role].get(tuple(p - lead for p in perm[lead:])) == "bhsd"
        last = dim(view, src, -1)
        fits = width is None or not isinstance(last, int) or last == width
        return "bshd_merged" if rows and fits and all(perm[i] == i for i in range(lead)) else "other"
    if perm is None:
        r, last = rank(view, src), dim(view, src, -1)
        narrow = isinstance(last, int) and width is not None and last != width
        merged = r is not None and r == core_rank - 1 and not narrow
        return "bshd_merged" if merged else "other"
    lead = len(perm) - 3
    if lead < 0 or any(perm[i] != i for i in range(lead)) or rank(view, src) not in (None, len(perm)):
        return "other"
    return _NAMES[role].get(tuple(p - lead for p in perm[lead:]), "other")


def _walk_up(
    view: GraphView, group: set[int], base: frozenset[int], tensor: str
) -> list[tuple[Node, str, Perm]]:
    """The branch's nodes outside `base`, from the core upwards, each with the source and P once it is in."""
    r = rank(view, tensor)
    perm: Perm = tuple(range(r)) if r is not None else None
    out: list[tuple[Node, str, Perm]] = []
    node = view.producer_of(tensor)
    while node is not None and node.id in group and node.id not in base:
        nxt = scale_step(view, node)
        if nxt is None:
            break
        perm = _permute(view, perm, node, up=True)
        tensor = nxt[0]
        out.append((node, tensor, perm))
        node = view.producer_of(tensor)
    return out


def split_heads(view: GraphView, group: set[int], base: frozenset[int], ins: dict[str, str], core_rank: int,
                width: int | None, k_rows: bool = False) -> tuple[float, dict[str, str], dict[str, str], int]:
    """Pull the head split of q, k, v (keys of `ins`, values the core's operands) into `group`.

    Each branch keeps the longest prefix whose source has a nameable layout; q, k and v read from one
    tensor is "qkv_packed". `k_rows`: the core reads k as [.., S, D] (an Einsum), not as kᵀ. Returns the scale
    factor absorbed on q and k, the layout per branch, the tensor each branch reads (its source) and the query heads
    per key / value head (grouped-query attention's repeat of k and v folded in: kv_repeat; 1 without).
    """
    for role in ("q", "k"):
        absorb_up(view, group, [ins[role]], lambda n, _t: scale_step(view, n))
    absorb_up(view, group, [ins["v"]], lambda n, _t: layout_step(view, n))
    walks = {role: _walk_up(view, group, base, t) for role, t in ins.items()}
    srcs = {role: w[-1][1] if w else ins[role] for role, w in walks.items()}
    # the packed tensor is read where it is [B, S, 3 * H * D]: a Reshape above that merges B and S (GPT-2's addmm on
    # the rows, [B * S, 3 * H * D]) stays outside (free in ONNX Runtime), as no packed layout reads merged rows
    while srcs["q"] == srcs["k"] == srcs["v"] and all(walks.values()) \
            and rank(view, srcs["q"]) not in (None, core_rank - 1) and is_op(walks["q"][-1][0], "Reshape"):
        group.discard(walks["q"][-1][0].id)
        walks = {role: w[:-1] for role, w in walks.items()}
        srcs = {role: w[-1][1] if w else ins[role] for role, w in walks.items()}
    if srcs["q"] == srcs["k"] == srcs["v"] and walks["q"]:
        names = dict.fromkeys(ins, "qkv_packed")
        rep = 1
    else:
        names = {}

        def trim(role: str, limit: int) -> None:
            """Keep the longest prefix of the branch's first `limit` steps whose source has a name."""
            keep, names[role] = _named_prefix(view, walks[role][:limit], ins[role], core_rank,
                                              "k" if role == "k" and not k_rows else "q",
                                              width if role in ("q", "k") else None)
            group.difference_update(n.id for n, _, _ in walks[role][keep:])
            walks[role] = walks[role][:keep]

        for role in walks:
            trim(role, len(walks[role]))
        reps = {role: next((r for n, _, _ in walks[role] if (r := kv_repeat(view, n))), 1) for role in ("k", "v")
                if role in walks}
        rep = next(iter(reps.values())) if len(set(reps.values())) == 1 else 1
        if len(set(reps.values())) > 1:  # k and v do not repeat alike: neither keeps its repeat, each stops below it
            for role in reps:
                trim(role, next((i for i, (n, _, _) in enumerate(walks[role]) if kv_repeat(view, n)),
                                len(walks[role])))
    factor = 1.0
    for role in ("q", "k"):
        for node, _, _ in walks[role]:
            found = scalar_operand(view, node)
            factor *= found[1] if found is not None else 1.0
    return factor, names, {role: w[-1][1] if w else ins[role] for role, w in walks.items()}, rep


def _named_prefix(view: GraphView, walk: list[tuple[Node, str, Perm]], core: str, core_rank: int, kind: str,
                  width: int | None) -> tuple[int, str]:
    """How many steps of a branch's walk to keep (the longest prefix whose source has a layout name) and that name;
    0 and the core operand's own name where none has. A source inside K's or V's grouped-query repeat ([B, Hkv, rep,
    S, D]) is never one."""
    name = layout(view, core, tuple(range(core_rank)), core_rank, kind)
    core_heads = dim(view, core, -3)
    keep = 0
    for i, (_, src, perm) in enumerate(walk, 1):
        if (rank(view, src) or 0) > core_rank:
            continue
        found = layout(view, src, perm, core_rank, kind, width, core_heads)
        if found != "other":
            keep, name = i, found
    return keep, name


def merge_heads(view: GraphView, group: set[int], out: str, core_rank: int) -> tuple[str, str]:
    """Pull the head merge after PV (Transpose[0,2,1,3] -> Reshape[B,S,H*D]) into `group`; returns its layout
    and the tensor it writes.

    Stops at the longest prefix whose output layout has a name.
    """
    perm: Perm = tuple(range(core_rank))
    taken: list[int] = []
    best, name, written = 0, "bhsd", out
    for _ in range(MAX_MERGE):
        node = sole_reader(view, out)
        if not is_op(node, "Transpose", "Reshape") or node is None:
            break
        perm = _permute(view, perm, node, up=False)
        out = node.outputs[0]
        taken.append(node.id)
        kind = layout(view, out, perm, core_rank, "q")
        if kind != "other":
            best, name, written = len(taken), kind, out
    group.update(taken[:best])
    return name, written
