"""Chains and trees of elementwise ops (with the metadata-only reshapes between them) run as one kernel."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from onnx import TensorProto, helper

from onnx_gtco.ir.elementwise import program_from_onnx, runtime_spec_from_onnx
from onnx_gtco.ir.labels import Label, label
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, Reject, is_op
from onnx_gtco.patterns.util import FLOAT_TYPES, convex

QUANTIZED_TYPES = (TensorProto.INT8, TensorProto.UINT8)  # integer chains of these are data, not shape arithmetic
VIEW_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten")  # injective and free: may sit inside a chain
LAYOUT_OPS = ("Transpose", "Slice", "Pad", "Concat")  # injective index maps: folded into the load of a group input


MAX_SHARED_READERS = 4
"""A node whose result more members than this read (BERT's attention mask, read by every layer) joins none of their
groups, which read it as an input: joined, one group would span every layer, and the plan's states grow with it."""


class ElementwisePattern:
    """Maximal connected groups of elementwise nodes, split where a group would not be convex, and pairs.

    Formula: ``y = f_n(... f_2(f_1(x_1, ...), ...) ...)``: one read of each input, one write of each output.

        mask -> Unsqueeze -> Cast -> Sub(1, .) -> Mul(., -10000) -> additive mask    (BERT's mask prep)
        a -> Add(b) -> Div -> Erf -> Add 1 -> Mul -> Mul 0.5                        (a GELU with its bias)

    Reshape/Unsqueeze/Squeeze/Flatten join a group anywhere (a reshape that is no view of its operand is free where
    the group writes it: the kernel writes densely); Transpose, Slice and Pad (of zeros) join where they read a
    group input through layout ops only, never a computed value: they fold into that input's load as an index map
    (families.elementwise.kernel Layout). A group of layout ops alone is a copy kernel (window partition, head split); a
    group of view ops alone is not proposed (they are free). Each producer -> consumer pair of elementwise nodes
    inside a larger group is proposed too, so the planner can still fuse what is left when a GEMM or LayerNorm
    takes part of the group.
    attrs: ops (op types in topological order).
    """

    name = "elementwise"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for comp in self._components(view):
            parts = self._convex_parts(view, comp)
            if len(parts) > 1:
                yield Reject(self.name, view.nodes[comp[0]].name, f"{len(comp)} connected elementwise nodes "
                             f"split into {len(parts)} convex groups: a path leaves them and comes back")
            for part in parts:
                part = self._trim(view, part)
                if len(part) < 2:
                    continue
                moves = any(not self._ew(view.nodes[i]) for i in part)
                if moves and (why := unfoldable(view, part)):
                    # its layout ops or trailing reshapes do not fold (a roll of a reshape that is no view, a
                    # symbolic shape): the group without them, as elementwise groups were before layout ops joined
                    yield Reject(self.name, view.nodes[min(part)].name, f"layout ops of {len(part)} nodes left "
                                 f"out: {why}")
                    for sub in self._folding_rest(view, part):
                        yield from self._proposals(view, sub)
                    continue
                yield from self._proposals(view, part)

    def _folding_rest(self, view: GraphView, part: frozenset[int]) -> list[frozenset[int]]:
        """The convex groups of `part` whose layout ops fold, for a part whose own do not: the first of part less
        the view ops whose result is read outside too (free in ONNX Runtime, but a result of another shape than the
        group's, which the kernel cannot write: a rotary's cos table unsqueezed once for every layer) and what they
        view in the part (a group of its own), that less its Transposes and Pads (a rotary embedding's roll over
        symbolic dims after its head-split Transpose), and part less every layout op, whose groups all fold."""
        # views of a computed value that move its broadcast axes (a partial rotary's cos table viewed in blocks of
        # the head: rotary_blocks.py) left to ONNX Runtime: what they view is a group of its own (the table, once),
        # which the rest reads through the view as an input
        regrouping = {i for i in part if self._regrouping_view(view, part, i)}
        if regrouping:
            subs = []
            for sub in self._convex_parts(view, sorted(part - regrouping)):
                sub = self._ends_computing(view, sub)
                unfolded = any(not self._ew(view.nodes[i]) for i in sub) and unfoldable(view, sub)
                subs += self._folding_rest(view, sub) if unfolded else [sub]
            return subs
        # views read outside, and what in the part they view: a group of its own (the table, once)
        escaping = {i for i in part if self._escaping_view(view, part, i)}
        upstream = set(escaping)
        todo = list(escaping)
        while todo:
            for p in view.preds[todo.pop()] & part:
                if p not in upstream:
                    upstream.add(p)
                    todo.append(p)
        shared = [i for i in part if i not in upstream]
        whole = {i for i in part if self._layout(view.nodes[i]) and view.nodes[i].op_type in ("Transpose", "Pad")}
        unmoved = [i for i in shared if i not in whole]
        rest = sorted(i for i in part if not self._layout(view.nodes[i]))
        tables = sorted(upstream - escaping)
        unmoved_tables = [i for i in tables if i not in whole]
        for ids, above in ((shared, tables), (unmoved, unmoved_tables)):
            if not any(self._layout(view.nodes[i]) for i in (*ids, *above)):
                continue
            subs = [self._ends_computing(view, sub) for sub in (*self._convex_parts(view, ids),
                                                                 *self._convex_parts(view, above))]
            if not any(any(not self._ew(view.nodes[i]) for i in sub) and unfoldable(view, sub) for sub in subs):
                return subs
        return [self._ends_computing(view, sub) for sub in self._convex_parts(view, rest)]

    @staticmethod
    def _escaping_view(view: GraphView, part: frozenset[int], i: int) -> bool:
        """Node i of `part` is a view op whose result is also read outside the part."""
        node = view.nodes[i]
        return node.domain == "" and node.op_type in VIEW_OPS and any(
            o in view.graph_outputs or any(c.id not in part for c in view.consumers_of(o)) for o in node.outputs)

    def _regrouping_view(self, view: GraphView, part: frozenset[int], i: int) -> bool:
        """Node i of `part` is a view op of a value computed in the part that does more than add or drop leading 1s,
        and an op of the part broadcasts its result (a computed value reshaped so is read only as it is:
        ir/elementwise.py)."""
        node = view.nodes[i]
        out = view.shape(node.outputs[0])
        if node.domain != "" or node.op_type not in VIEW_OPS or not any(
                c.id in part and self._ew(c) and view.shape(c.outputs[0]) != out
                for c in view.consumers_of(node.outputs[0])):  # broadcast after the view
            return False
        src = view.producer.get(node.inputs[0]) if node.inputs else None
        while src in part and view.nodes[src].domain == "" and view.nodes[src].op_type in VIEW_OPS:
            src = view.producer.get(view.nodes[src].inputs[0])
        before = view.shape(node.inputs[0])
        if src not in part or not self._ew(view.nodes[src]) or before is None or out is None:  # type: ignore[index]
            return False
        strip = lambda s: tuple(s[next((k for k, d in enumerate(s) if d != 1), len(s)):])  # noqa: E731
        return strip(before) != strip(out)

    def _ends_computing(self, view: GraphView, part: frozenset[int]) -> frozenset[int]:
        """Drop view ops that end the group, and view ops that begin it whose result is read outside too: its outputs
        are then elementwise results. (A group that has lost the ops after a shared view, ModernBERT's packed-qkv
        Reshape whose V slice now ends outside, would otherwise write that view, of another shape than its results:
        the view is free in ONNX Runtime and the group reads it instead.)"""
        ids = set(part)
        changed = True
        while changed:
            changed = False
            for i in sorted(ids, reverse=True):
                if not self._ew(view.nodes[i]) and not (view.succs[i] & ids):
                    ids.discard(i)
                    changed = True
                elif not self._ew(view.nodes[i]) and not (view.preds[i] & ids) and view.succs[i] & ids \
                        and self._escaping_view(view, frozenset(ids), i):
                    ids.discard(i)
                    changed = True
        return frozenset(ids)

    def _proposals(self, view: GraphView, part: frozenset[int]) -> Iterator[Match | Reject]:
        """The group, and each producer -> consumer pair of elementwise nodes in it (integer-only groups: none)."""
        if len(part) < 2:
            return
        if not _computes_floats(view, part):
            quantized = _quantized_output(view, part)
            if quantized is not None:  # other integer-only groups are shape arithmetic: nothing to report
                yield Reject(self.name, view.nodes[min(part)].name, f"{len(part)} elementwise nodes compute "
                             f"only integers ({quantized}): no fused kernel for quantized elementwise chains")
            return
        yield self._match(view, part)
        if len(part) == 2:
            return
        yield from self._without_a_sink(view, part)
        for i in sorted(part):
            for j in sorted(view.succs[i] & part):  # j reads i
                pair = frozenset([i, j])
                if self._ew(view.nodes[i]) and self._ew(view.nodes[j]) and convex(view, pair):
                    yield self._match(view, pair)

    def _without_a_sink(self, view: GraphView, part: frozenset[int]) -> Iterator[Match]:
        """The group less a scale that ends it (a Mul or Div by a constant scalar, which the attention or GEMM after
        it takes as its own scale), where the group folds layout ops into its loads and more than a pair is left: a
        rotary embedding's group whose last Mul is the attention's query scale keeps its loads and layout ops in one
        kernel, where only its pairs would be left (without layout ops, the pairs and the whole group suffice); and
        the group less the view ops that end it, which another family may read through (grouped-query attention's
        repeat of a rotary embedding's K starts with an Unsqueeze)."""
        if not any(self._layout(view.nodes[i]) for i in part):
            return
        computing = self._ends_computing(view, part)  # less the view ops that end it (an Unsqueeze another family's
        if computing != part and len(computing) > 2 and convex(view, computing):  # group reads through, a GQA repeat)
            yield self._match(view, computing)
        for i in sorted(part):
            node = view.nodes[i]
            if not is_op(node, "Mul", "Div") or view.succs[i] & part or len(node.inputs) != 2:
                continue
            if view.scalar(node.inputs[1]) is None and (node.op_type == "Div" or view.scalar(node.inputs[0]) is None):
                continue
            rest = self._ends_computing(view, part - {i})
            if len(rest) > 2 and convex(view, rest) and any(self._ew(view.nodes[j]) for j in rest):
                yield self._match(view, rest)

    @staticmethod
    def _ew(node: Node) -> bool:
        return label(node.op_type, node.domain) == Label.ELEMENTWISE and node.op_type != "Identity"

    def _member(self, node: Node) -> bool:
        return self._ew(node) or (node.domain == "" and node.op_type in (*VIEW_OPS, *LAYOUT_OPS))

    def _joins(self, view: GraphView, node: Node) -> bool:
        """A member whose operands other than its data are constants (a Concat: the two halves of a torch.roll)."""
        if not self._member(node):
            return False
        if self._ew(node):
            return True
        if node.op_type == "Concat":
            return is_roll(view, node)
        return all(view.is_constant(t) for t in node.inputs[1:] if t)

    @staticmethod
    def _layout(node: Node) -> bool:
        return node.domain == "" and node.op_type in LAYOUT_OPS

    def _moves(self, node: Node) -> bool:
        """Whether a group of view and layout ops with `node` moves elements (else it is free as it is)."""
        return self._ew(node) or self._layout(node)

    def _components(self, view: GraphView) -> list[list[int]]:
        parent = {n.id: n.id for n in view.nodes if self._joins(view, n)}

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for j in parent:
            for i in self._feeds(view, view.nodes[j]):
                if i in parent and len(view.succs[i] & parent.keys()) <= MAX_SHARED_READERS:
                    parent[find(i)] = find(j)
        comps: dict[int, list[int]] = {}
        for i in sorted(parent):
            comps.setdefault(find(i), []).append(i)
        return [c for c in comps.values() if len(c) >= 2 and any(self._moves(view.nodes[i]) for i in c)]

    def _feeds(self, view: GraphView, node: Node) -> set[int]:
        """Producers of the tensors `node` computes on (a view or layout op's shape, axes or pads do not count). A
        layout op, and a view op on the way to one, does not join the elementwise node it reads: it folds into the
        load of a group input, so that result is an input of its group, not a value computed in it."""
        if node.op_type == "Concat" and node.domain == "":
            return {view.producer[t] for t in node.inputs if t in view.producer}
        if node.op_type in (*VIEW_OPS, *LAYOUT_OPS) and node.domain == "":
            src = view.producer.get(node.inputs[0]) if node.inputs else None
            if src is not None and self._ew(view.nodes[src]) and self._leads_to_layout(view, node):
                return set()
            return {src} if src is not None else set()
        return {view.producer[t] for t in node.inputs if t in view.producer}

    def _leads_to_layout(self, view: GraphView, node: Node) -> bool:
        """Whether `node` is a layout op or reaches one through view ops."""
        todo, seen = [node.id], set()
        while todo:
            n = view.nodes[todo.pop()]
            if self._layout(n):
                return True
            if n.id in seen or not (n.domain == "" and n.op_type in VIEW_OPS):
                continue
            seen.add(n.id)
            todo += [c.id for o in n.outputs for c in view.consumers_of(o)]
        return False

    def _folds(self, view: GraphView, ids: set[int]) -> bool:
        """No layout op of `ids` reads, through view and layout ops of `ids`, an elementwise result of `ids`."""
        for i in ids:
            node = view.nodes[i]
            if not self._layout(node):
                continue
            while node.inputs and view.producer.get(node.inputs[0]) in ids:
                node = view.nodes[view.producer[node.inputs[0]]]
                if self._ew(node):
                    return False
        return True

    def _convex_parts(self, view: GraphView, comp: list[int]) -> list[frozenset[int]]:
        """Grow groups in topological order; a node joins the groups it reads from if they stay convex."""
        groups: list[set[int]] = []
        for i in comp:
            feeds = self._feeds(view, view.nodes[i])
            near = [g for g in groups if feeds & g]
            merged = set().union(*near) | {i} if near else {i}
            if near and convex(view, merged) and self._folds(view, merged):
                groups = [g for g in groups if g not in near] + [merged]
                continue
            home = next((g for g in near if convex(view, g | {i}) and self._folds(view, g | {i})), None)
            if home is not None:
                home.add(i)
            else:
                groups.append({i})
        return [frozenset(g) for g in groups]

    def _trim(self, view: GraphView, part: frozenset[int]) -> frozenset[int]:
        """Drop layout ops that end the group and lead to no elementwise node (a copy of a whole tensor that only
        moves elements is kept when some op in it moves them; a lone view op is free as it is)."""
        ids = set(part)
        if not any(self._moves(view.nodes[i]) for i in ids):
            return frozenset()
        return frozenset(ids)

    @staticmethod
    def _match(view: GraphView, ids: frozenset[int]) -> Match:
        return Match(ids, "elementwise", {"ops": tuple(view.nodes[i].op_type for i in sorted(ids))})


def unfoldable(view: GraphView, ids: frozenset[int]) -> str | None:
    """Why the node set has no elementwise program (ir.elementwise.program_from_onnx over its static shapes,
    runtime_spec_from_onnx over named symbolic dims), so no kernel, or None: the layout ops of a group fold only where
    their index maps compose, and over symbolic dims only where each input is read whole (transposed, rolled)."""
    nodes = [helper.make_node(view.nodes[i].op_type, view.nodes[i].inputs, view.nodes[i].outputs,
                              name=view.nodes[i].name, domain=view.nodes[i].domain, **view.nodes[i].attrs)
             for i in sorted(ids)]
    inputs, constants = [], {}
    for t in view.external_inputs(ids):
        value, info = view.const_value(t), view.info(t)
        if value is not None:
            constants[t] = value
            if value.size == 1:
                continue
        shape = view.shape(t)
        if info is None or shape is None or not all(isinstance(d, int) or (isinstance(d, str) and d != "?")
                                                    for d in shape):
            return f"{t!r} has no static shape and no named symbolic dims"
        kind = {TensorProto.BOOL: "bool", TensorProto.INT32: "i32", TensorProto.INT64: "i64"}.get(info.dtype, "float")
        inputs.append((t, tuple(shape), kind))
    symbolic = any(isinstance(d, str) for _, s, _ in inputs for d in s)
    try:
        # over symbolic dims: the program of the kernel for run-time shapes (inputs broadcast, transposed, rolled)
        (runtime_spec_from_onnx if symbolic else program_from_onnx)(
            nodes, inputs, list(view.external_outputs(ids)), constants)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return str(e)
    return None


def slice_axis(view: GraphView, node: Node) -> tuple[str, int, int, int, int] | None:
    """(data tensor, axis, start, end, step) of a Slice of one axis with constant bounds and a positive step,
    clamped (a Slice without axes takes axis 0, without steps step 1); else None."""
    if not is_op(node, "Slice") or len(node.inputs) < 3:
        return None
    names = (*node.inputs[1:5], "", "")[:4]
    starts, ends, axes, steps = (view.const_value(t) if t else np.array([d])
                                 for t, d in zip(names, (0, 0, 0, 1), strict=True))
    shape = view.shape(node.inputs[0])
    if any(v is None or v.size != 1 for v in (starts, ends, axes, steps)) or shape is None:
        return None  # a bound that is no constant, or more than one axis
    axis, step = int(axes.reshape(-1)[0]) % len(shape), int(steps.reshape(-1)[0])  # type: ignore[union-attr]
    if step <= 0 or not isinstance(shape[axis], int):
        return None
    lo, hi, _ = slice(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]), step).indices(shape[axis])  # type: ignore[union-attr]
    return node.inputs[0], axis, lo, hi, step


def slice_range(view: GraphView, node: Node) -> tuple[str, int, int, int] | None:
    """(data tensor, axis, start, end) of a Slice of one axis with step 1 and constant bounds (axes given), clamped;
    else None."""
    found = slice_axis(view, node) if len(node.inputs) >= 4 else None
    return found[:4] if found is not None and found[4] == 1 else None


def is_roll(view: GraphView, node: Node) -> bool:
    """Concat([x[k:n], x[0:k]]) along one axis of x: torch.roll as exporters write it (families.elementwise.kernel
    folds it into the load as a roll of that dim)."""
    if node.op_type != "Concat" or node.domain != "" or len(node.inputs) != 2:
        return False
    parts = [view.producer_of(t) for t in node.inputs]
    if any(p is None for p in parts):
        return False
    a, b = (slice_range(view, p) for p in parts)
    if a is None or b is None or a[0] != b[0] or a[1] != b[1]:
        return False
    shape = view.shape(a[0])
    n = shape[a[1]]
    axis = int(node.attrs.get("axis", 0)) % len(shape)
    return b[2] == 0 and a[2] == b[3] and a[3] == n and 0 < b[3] < n and axis == a[1]


def _quantized_output(view: GraphView, ids: frozenset[int]) -> str | None:
    """The lower-case name of the first int8/uint8 tensor the group writes (topological order), or None."""
    for i in sorted(ids):
        for o in view.nodes[i].outputs:
            ti = view.info(o)
            if ti is not None and ti.dtype in QUANTIZED_TYPES:
                return TensorProto.DataType.Name(ti.dtype).lower()
    return None


def _computes_floats(view: GraphView, ids: frozenset[int]) -> bool:
    """Some node writes a float tensor (integer-only groups are shape arithmetic, left to the host)."""
    for i in ids:
        for o in view.nodes[i].outputs:
            ti = view.info(o)
            if ti is not None and ti.dtype in FLOAT_TYPES:
                return True
    return False


RULES = (ElementwisePattern(),)
