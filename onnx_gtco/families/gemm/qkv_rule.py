"""Horizontal fusion: several weight GEMMs that read the same input run as one wider GEMM (Q, K, V)."""

from __future__ import annotations

from collections.abc import Iterator

from onnx_gtco.families.gemm.spec import QKV_PROJECTIONS
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, Reject, is_op, other_input
from onnx_gtco.patterns.epilogue import const_add
from onnx_gtco.patterns.util import dim, dims, prod

MAX_REACH = 2000  # nodes a search for where projections meet may visit


class QkvPattern:
    """MatMuls that share their A operand and have constant 2-D weights, each with an optional bias Add.

    Formula: ``[y_1 | ... | y_j] = A @ [W_1 | ... | W_j] (+ [b_1 | ... | b_j])`` -- one GEMM with N = sum(N_i)
    whose output columns are scattered back to the j outputs.

              A
           /  |  \\
        MM_q MM_k MM_v      (constant W_i of shape [K, N_i])
         |    |    |
        [+b] [+b] [+b]

    Only MatMuls whose results meet before passing through another weight GEMM group together (one
    block's Q, K, V; not the K projections of one encoder memory by six decoder layers, a group spanning
    the whole decoder that widens the planner's search past reach). Proposed per group: without biases,
    and with their biases when every one has one. attrs: n_out (sum of N), k, ns (tuple of N_i in node
    order), bias, m.
    """

    name = "qkv"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        seen: set[str] = set()
        for node in view.nodes:
            if not is_op(node, "MatMul") or node.inputs[0] in seen:
                continue
            a = node.inputs[0]
            seen.add(a)
            mms = [c for c in view.consumers_of(a) if self._weight_gemm(view, c, a)]
            blocks = _blocks(view, mms)
            if len(mms) >= 2 and len(blocks) > 1:
                why = (f"{len(mms)} MatMuls read {a!r} but their results meet before another weight GEMM "
                       f"only in {len(blocks)} groups (e.g. different layers)")
                yield Reject(self.name, mms[0].name, why)
            for block in blocks:
                if len(block) >= 2:
                    yield from self._group(view, a, block)

    def _group(self, view: GraphView, a: str, mms: list[Node]) -> Iterator[Match | Reject]:
        ns = tuple(dim(view, mm.inputs[1], 1) for mm in mms)
        rows = prod((dims(view, a) or ("?", "?"))[:-1])
        attrs = {"k": dim(view, a, -1), "m": rows, "ns": ns, "n_out": _sum(ns), "bias": False}
        ids = frozenset(mm.id for mm in mms)
        roles = {"a": a, **{f"w{p}": mm.inputs[1] for p, mm in enumerate(mms)}} if len(mms) <= QKV_PROJECTIONS else {}
        outs = {f"y{p}": mm.outputs[0] for p, mm in enumerate(mms)} if roles else {}
        yield Match(ids, "qkv", dict(attrs), roles, outs)
        biases = [const_add(view, mm.outputs[0], -1)[0] for mm in mms]
        if all(b is not None for b in biases):
            if roles:
                roles = roles | {f"bias{p}": other_input(b, mm.outputs[0]) or ""  # type: ignore[union-attr]
                                 for p, (b, mm) in enumerate(zip(biases, mms, strict=True))}
                outs = {f"y{p}": b.outputs[0] for p, b in enumerate(biases)}  # type: ignore[union-attr]
            yield Match(ids | {b.id for b in biases if b is not None}, "qkv", attrs | {"bias": True}, roles, outs)
        elif any(b is not None for b in biases):
            why = "only some of the MatMuls have a bias Add: fused without biases"
            yield Reject(self.name, mms[0].name, why)

    @staticmethod
    def _weight_gemm(view: GraphView, node: Node, a: str) -> bool:
        if not is_op(node, "MatMul") or node.inputs[0] != a or not view.is_constant(node.inputs[1]):
            return False
        shape = view.shape(node.inputs[1])
        return shape is not None and len(shape) == 2


def _reach(view: GraphView, start: int) -> set[int]:
    """Nodes below `start` up to and including the next weight GEMMs (shape arithmetic does not count)."""
    seen, frontier = {start}, [start]
    while frontier and len(seen) < MAX_REACH:
        frontier = [j for i in frontier for j in view.succs[i]
                    if j not in seen and view.nodes[j].op_type not in ("Shape", "Size")]
        seen.update(frontier)
        frontier = [j for j in frontier if not _is_weight_gemm(view, view.nodes[j])]
    return seen


def _is_weight_gemm(view: GraphView, node: Node) -> bool:
    return is_op(node, "Gemm", "MatMul") and view.is_constant(node.inputs[1])


def _blocks(view: GraphView, mms: list[Node]) -> list[list[Node]]:
    """MatMuls whose results meet before any further weight GEMM: one block's Q, K, V (at QKᵀ, PV), a gated
    MLP's gate and up; not the projections of one encoder memory by every decoder layer."""
    blocks: list[tuple[list[Node], set[int]]] = []
    for mm in mms:
        near = _reach(view, mm.id)
        home = next((b for b in blocks if b[1] & near), None)
        if home is None:
            blocks.append(([mm], near))
        else:
            home[0].append(mm)
            home[1].intersection_update(near)
    return [b[0] for b in blocks]


def _sum(ns: tuple[int | str, ...]) -> int | str:
    if all(isinstance(n, int) for n in ns):
        return sum(ns)  # type: ignore[arg-type]
    return "+".join(str(n) for n in ns)
