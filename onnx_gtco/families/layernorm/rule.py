"""LayerNorm: the LayerNormalization op or its decomposed form, optionally with the residual Add before it."""

from __future__ import annotations

from collections.abc import Iterator

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, Reject, is_op, other_input
from onnx_gtco.patterns.util import (
    chain_break,
    const_scalar,
    dims,
    prod,
    read_only_by,
    reduced_axes,
    sole_reader,
    squared,
    with_residual,
)

WHAT = "decomposed LayerNorm"


class LayerNormPattern:
    """LayerNorm over the trailing axes, as one op or as exporters decompose it.

    Formula: ``y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta`` over the trailing axes, x = a + b when
    the residual Add feeding it is included (its sum is usually read elsewhere too: then the group has
    two outputs).

        [a + b] -> x -> ReduceMean -> Sub(x, mean) -> Pow 2 | Mul(d, d) -> ReduceMean -> Add eps -> Sqrt
                              \\-> d --------------------------------------> Div | Reciprocal+Mul
                                                                            -> [Mul gamma] -> [Add beta]

    The Sub may be one node read twice, or two nodes computing x - mean. attrs: epsilon, axis (negative),
    hidden, residual, decomposed, affine.
    """

    name = "layernorm"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for node in view.nodes:
            if is_op(node, "LayerNormalization"):
                shape = dims(view, node.inputs[0]) or ()
                axis = int(node.attrs.get("axis", -1))
                axis = axis - len(shape) if axis >= 0 else axis
                attrs = {"epsilon": float(node.attrs.get("epsilon", 1e-5)), "axis": axis,
                         "hidden": prod(shape[axis:]) if shape else "?", "decomposed": False, "affine": True}
                affine = dict(zip(("gamma", "beta"), node.inputs[1:3], strict=False))
                yield from with_residual(view, "layernorm", {node.id}, node.inputs[0], node.outputs[0], attrs,
                                         {k: v for k, v in affine.items() if v})
            elif is_op(node, "ReduceMean"):
                yield from self._decomposed(view, node)

    def _decomposed(self, view: GraphView, rm: Node) -> Iterator[Match | Reject]:
        x, mean = rm.inputs[0], rm.outputs[0]
        subs = [c for c in view.consumers_of(mean) if is_op(c, "Sub") and c.inputs == (x, mean)]
        if not subs:
            return  # a plain mean (pooling), not a near miss
        found = self._chain(view, rm, subs)
        if isinstance(found, str):
            yield Reject(self.name, rm.name, found)
            return
        ids, eps, out = found
        operands: dict[str, str] = {}
        for op, role in (("Mul", "gamma"), ("Add", "beta")):
            nxt = sole_reader(view, out)
            if is_op(nxt, op) and nxt is not None and view.is_constant(other_input(nxt, out) or ""):
                ids.add(nxt.id)
                operands[role] = other_input(nxt, out) or ""
                out = nxt.outputs[0]
        shape = dims(view, x) or ()
        axes = reduced_axes(view, rm) or (-1,)
        attrs = {"epsilon": eps, "axis": -len(axes), "hidden": prod(shape[-len(axes):]) if shape else "?",
                 "decomposed": True, "affine": bool(operands)}
        yield from with_residual(view, "layernorm", ids, x, out, attrs, operands)

    @staticmethod
    def _chain(view: GraphView, rm: Node, subs: list[Node]) -> tuple[set[int], float, str] | str:
        r = len(view.shape(rm.inputs[0]) or ())
        axes = reduced_axes(view, rm)
        if not r or axes is None or sorted(a % r for a in axes) != list(range(r - len(axes), r)):
            return f"ReduceMean {rm.name!r} over axes {axes} is not over the trailing axes"
        devs = {s.outputs[0] for s in subs}
        sq = next((c for d in devs for c in view.consumers_of(d) if squared(view, c) == d), None)
        if sq is None:
            return "x - mean is not squared (no Pow 2 or Mul by itself)"
        rm2 = sole_reader(view, sq.outputs[0])
        axes2 = reduced_axes(view, rm2) if is_op(rm2, "ReduceMean") and rm2 is not None else None
        if rm2 is None or axes2 is None or sorted(a % r for a in axes2) != sorted(a % r for a in axes):
            return chain_break(view, sq.outputs[0], WHAT, "the squared deviation is not averaged over the same axes")
        var = rm2.outputs[0]
        add = sole_reader(view, var)
        eps = const_scalar(view, other_input(add, var) or "") if is_op(add, "Add") and add else None
        sqrt = sole_reader(view, add.outputs[0]) if add is not None and eps is not None else None
        if add is None or eps is None or not is_op(sqrt, "Sqrt") or sqrt is None:
            leak = add.outputs[0] if add is not None and eps is not None else var
            return chain_break(view, leak, WHAT, "the variance is not followed by Add eps (scalar constant) -> Sqrt")
        ids = {rm.id, sq.id, rm2.id, add.id, sqrt.id} | {s.id for s in subs}
        std = sqrt.outputs[0]
        div = sole_reader(view, std)
        if is_op(div, "Reciprocal") and div is not None:
            ids.add(div.id)
            std = div.outputs[0]
            div = sole_reader(view, std)
            ok = is_op(div, "Mul")
        else:
            ok = is_op(div, "Div") and div is not None and div.inputs[1] == std
        if not ok or div is None or not any(t in devs for t in div.inputs):
            return chain_break(view, std, WHAT, "x - mean is not divided by the standard deviation")
        ids.add(div.id)
        leaks = [view.nodes[i] for i in sorted(ids - {div.id}) if not read_only_by(view, view.nodes[i], ids)]
        if leaks:
            return chain_break(view, leaks[0].outputs[0], WHAT, "")
        return ids, float(eps), div.outputs[0]


RULES = (LayerNormPattern(),)
