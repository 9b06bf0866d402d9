"""RMSNorm: ``y = x / sqrt(mean(x²) + eps) [* gamma]`` over the trailing axes, in the forms exports write it, with
the residual Add before it where there is one.

    decomposed (LLaMA, Qwen, Mistral, T5):
        [a + b] -> x -> Pow 2 | Mul(x, x) -> ReduceMean -> Add eps -> Sqrt -> Reciprocal -> Mul(x, .)
                                                                           \\-> Div(1, .) -> Mul(x, .)
                                                                           \\-> Div(x, .)
                     -> [Mul gamma]
    RMSNormalization (ONNX opset 23): X, scale; axis, epsilon
    SkipSimplifiedLayerNormalization (onnxruntime's com.microsoft): input, skip, gamma -> output, [sum]

attrs: epsilon, axis (negative), hidden, residual, form (which of the three), affine. A chain whose x is itself a
deviation from a mean (x' - ReduceMean(x')) is LayerNorm's second half: LayerNorm's rule takes it whole.
"""

from __future__ import annotations

from collections.abc import Iterator

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, Reject, is_op, other_input
from onnx_gtco.patterns.util import (
    chain_break,
    const_close,
    const_scalar,
    dims,
    prod,
    read_only_by,
    reduced_axes,
    sole_reader,
    squared,
    with_residual,
)

DECOMPOSED, ONNX_OP, ORT_SKIP = "decomposed", "RMSNormalization", "SkipSimplifiedLayerNormalization"
"""The forms (the `form` attribute)."""
MS_DOMAIN = "com.microsoft"
WHAT = "decomposed RMSNorm"


class RmsNormPattern:
    """RMSNorm over the trailing axes, as one op or as exporters decompose it (the module docstring)."""

    name = "rmsnorm"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for node in view.nodes:
            if is_op(node, "RMSNormalization"):
                yield from self._onnx_op(view, node)
            elif node.op_type == ORT_SKIP and node.domain == MS_DOMAIN:
                yield from self._ort_skip(view, node)
            elif is_op(node, "ReduceMean"):
                yield from self._decomposed(view, node)

    def _onnx_op(self, view: GraphView, node: Node) -> Iterator[Match | Reject]:
        shape = dims(view, node.inputs[0])
        if shape is None:
            yield Reject(self.name, node.name, "RMSNormalization over an input of unknown rank")
            return
        axis = int(node.attrs.get("axis", -1))
        axis = axis - len(shape) if axis >= 0 else axis
        attrs = {"epsilon": float(node.attrs.get("epsilon", 1e-5)), "axis": axis, "hidden": prod(shape[axis:]),
                 "form": ONNX_OP, "affine": True}
        yield from with_residual(view, self.name, {node.id}, node.inputs[0], node.outputs[0], attrs,
                                 {"gamma": node.inputs[1]})

    def _ort_skip(self, view: GraphView, node: Node) -> Iterator[Match | Reject]:
        if len(node.inputs) > 3 and node.inputs[3]:
            yield Reject(self.name, node.name, "SkipSimplifiedLayerNormalization with a bias input (the kernel adds "
                         "the skip only)")
            return
        stats = [o for o in node.outputs[1:3] if o and (view.consumers_of(o) or o in view.graph_outputs)]
        if stats:
            yield Reject(self.name, node.name, f"SkipSimplifiedLayerNormalization's statistics {stats} are read")
            return
        a, b = node.inputs[0], node.inputs[1]
        shape = dims(view, a)
        if shape is None or dims(view, b) != shape:
            yield Reject(self.name, node.name, "input and skip of unknown or different shapes (the kernel adds equal "
                         "shapes only)")
            return
        attrs = {"epsilon": float(node.attrs.get("epsilon", 1e-5)), "axis": -1, "hidden": shape[-1] if shape else "?",
                 "form": ORT_SKIP, "affine": True, "residual": True}
        outputs = {"y": node.outputs[0]}
        if len(node.outputs) > 3 and node.outputs[3]:
            outputs["sum"] = node.outputs[3]
        yield Match(frozenset({node.id}), "rmsnorm", attrs, {"a": a, "b": b, "gamma": node.inputs[2]}, outputs)

    def _decomposed(self, view: GraphView, rm: Node) -> Iterator[Match | Reject]:
        sq = view.producer_of(rm.inputs[0])
        x = squared(view, sq)
        if x is None or sq is None:
            return  # a plain mean (pooling, LayerNorm's mean), not a near miss
        if _is_deviation(view, x):
            return  # LayerNorm's variance: its rule takes the whole chain
        found = _chain(view, rm, sq, x)
        if isinstance(found, str):
            yield Reject(self.name, rm.name, found)
            return
        ids, eps, out = found
        operands: dict[str, str] = {}
        nxt = sole_reader(view, out)
        if is_op(nxt, "Mul") and nxt is not None and view.is_constant(other_input(nxt, out) or ""):
            ids.add(nxt.id)
            operands["gamma"] = other_input(nxt, out) or ""
            out = nxt.outputs[0]
        shape = dims(view, x) or ()
        axes = reduced_axes(view, rm) or (-1,)
        attrs = {"epsilon": eps, "axis": -len(axes), "hidden": prod(shape[-len(axes):]) if shape else "?",
                 "form": DECOMPOSED, "affine": bool(operands)}
        yield from with_residual(view, self.name, ids, x, out, attrs, operands)


def _is_deviation(view: GraphView, x: str) -> bool:
    """x = x' - ReduceMean(x'): a LayerNorm's centered rows."""
    sub = view.producer_of(x)
    if not is_op(sub, "Sub") or sub is None:
        return False
    mean = view.producer_of(sub.inputs[1])
    return is_op(mean, "ReduceMean") and mean is not None and mean.inputs[0] == sub.inputs[0]


def _chain(view: GraphView, rm: Node, sq: Node, x: str) -> tuple[set[int], float, str] | str:
    """(node ids, epsilon, the normalized tensor) of the chain from x² through x * rstd, or why it breaks."""
    r = len(view.shape(x) or ())
    axes = reduced_axes(view, rm)
    if not r or axes is None or sorted(a % r for a in axes) != list(range(r - len(axes), r)):
        return f"ReduceMean {rm.name!r} over axes {axes} is not over the trailing axes"
    ms = rm.outputs[0]
    add = sole_reader(view, ms)
    eps = const_scalar(view, other_input(add, ms) or "") if is_op(add, "Add") and add else None
    sqrt = sole_reader(view, add.outputs[0]) if add is not None and eps is not None else None
    if add is None or eps is None or not is_op(sqrt, "Sqrt") or sqrt is None:
        return chain_break(view, ms, WHAT, "the mean square is not followed by Add eps (scalar constant) -> Sqrt")
    ids = {sq.id, rm.id, add.id, sqrt.id}
    std = sqrt.outputs[0]
    nxt = sole_reader(view, std)
    if nxt is not None and (is_op(nxt, "Reciprocal") or (
            is_op(nxt, "Div") and nxt.inputs[1] == std and const_close(view, nxt.inputs[0], 1.0))):
        ids.add(nxt.id)
        rstd = nxt.outputs[0]
        mul = sole_reader(view, rstd)
        if not is_op(mul, "Mul") or mul is None or other_input(mul, rstd) != x:
            return chain_break(view, rstd, WHAT, "x is not multiplied by 1 / sqrt(mean(x²) + eps)")
        last = mul
    elif nxt is not None and is_op(nxt, "Div") and nxt.inputs == (x, std):
        last = nxt
    else:
        return chain_break(view, std, WHAT, "x is not divided by sqrt(mean(x²) + eps)")
    ids.add(last.id)
    leaks = [view.nodes[i] for i in sorted(ids - {last.id}) if not read_only_by(view, view.nodes[i], ids)]
    if leaks:
        return chain_break(view, leaks[0].outputs[0], WHAT, "")
    return ids, float(eps), last.outputs[0]


RULES = (RmsNormPattern(),)
