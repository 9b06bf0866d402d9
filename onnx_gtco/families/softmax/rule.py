"""A Softmax over the last axis on its own: a row-wise kernel (used where no attention chain surrounds it)."""

from __future__ import annotations

from collections.abc import Iterator

from onnx_gtco.ir.view import GraphView
from onnx_gtco.patterns.base import Match, Reject, is_op
from onnx_gtco.patterns.util import dims, prod


class SoftmaxPattern:
    """One Softmax node over the last axis, as its own "softmax" kernel.

    Formula: ``y[r, :] = exp(x[r, :] - max x[r, :]) / sum exp(x[r, :] - max x[r, :])`` for every row r.

        x [rows..., cols] -> Softmax(axis=-1) -> y

    attrs: axis (-1), rows (product of the leading dims), cols.
    """

    name = "softmax"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for node in view.nodes:
            if not is_op(node, "Softmax"):
                continue
            shape = dims(view, node.inputs[0])
            axis = int(node.attrs.get("axis", -1))
            if not shape:
                if axis != -1:
                    yield Reject(self.name, node.name, f"Softmax axis {axis} on an input of unknown rank")
                    continue
                shape = ("?", "?")
            if axis % len(shape) != len(shape) - 1:
                yield Reject(self.name, node.name, f"Softmax axis {axis} is not the last axis")
                continue
            attrs = {"axis": -1, "rows": prod(shape[:-1]), "cols": shape[-1]}
            yield Match(frozenset([node.id]), "softmax", attrs, {"x": node.inputs[0]}, {"y": node.outputs[0]})


RULES = (SoftmaxPattern(),)
