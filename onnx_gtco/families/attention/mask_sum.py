"""Two constant masks added one after the other to attention scores summed into one, before planning, so that the
attention kernel's one mask suffices.

Hugging Face's Swin V2 adds its shifted-window mask twice between the window Reshapes (``scores + m + m``). Each mask
is 0 where a key is kept and large and negative (-100) where it is not, so the sum is one such mask, and

    (s + m1) + m2  =  s + (m1 + m2)

exactly where both are 0 (the kept keys: s is unchanged either way) and masked either way elsewhere (at most -100,
whose exp is 4e-44 of the row's weight). Only masks of that form are summed; a bias is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_gtco.families.attention.scores import additive_kind, reaches_softmax
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import sole_reader, spliced


def _constant_term(view: GraphView, add: Node) -> tuple[str, str] | None:
    """(the other operand, the constant mask) of an Add of a constant mask (0 / <= MASK_FLOOR), else None."""
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return None
    for x, c in (add.inputs, add.inputs[::-1]):
        if view.is_constant(c) and not view.is_constant(x) and view.const_value(c) is not None \
                and additive_kind(view, c) == "mask":
            return x, c
    return None


def summed_masks(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """`model` with each Add of a constant mask right after another (the inner one read by the outer alone) on
    attention scores one Add of their sum (a copy; the model passed in is unchanged), and how many were summed."""
    view = GraphView(model)
    replace: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    inits: list[onnx.TensorProto] = []
    for outer in view.nodes:
        out_term = _constant_term(view, outer)
        inner = view.producer_of(out_term[0]) if out_term else None
        in_term = _constant_term(view, inner) if inner is not None else None
        if out_term is None or inner is None or in_term is None or inner.id in removed or outer.id in removed \
                or sole_reader(view, inner.outputs[0]) is not outer or inner.outputs[0] in view.graph_outputs \
                or not reaches_softmax(view, outer.outputs[0]):
            continue
        a, b = (np.asarray(view.const_value(t)) for t in (in_term[1], out_term[1]))
        if a.dtype != b.dtype:
            continue
        total = a + b
        name = f"{outer.name or outer.outputs[0]}.mask_sum"
        inits.append(numpy_helper.from_array(total, name))
        replace[outer.id] = [helper.make_node("Add", [in_term[0], name], [outer.outputs[0]], name=outer.name)]
        removed.update((inner.id, outer.id))
    if not replace:
        return model, 0
    return spliced(model, replace, removed, inits), len(replace)


__all__ = ["summed_masks"]
