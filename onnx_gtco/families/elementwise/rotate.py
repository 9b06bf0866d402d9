"""Rotate-half (rotary embeddings' `rotate_half` in LLaMA, Qwen, Mistral, GPT-NeoX) rewritten before planning as a
roll of the tensor times a constant sign, which the elementwise family folds into one load.

The exporters write ``rotate_half(x) = Concat(-x[..., h:], x[..., :h])`` along the last axis (h = d / 2): two Slices
of one tensor, a Neg of the second and a Concat. A Concat of two slices of one tensor is a torch.roll, an index map
the elementwise kernels fold into the tensor's load (ir/elementwise.py); the Neg between them is what keeps it
apart. Negation commutes with the copy, so the same values are

    Concat(x[..., h:], x[..., :h]) * s,   s = [-1] * (d - h) + [1] * h   (one value per index of the last axis)

exactly (a sign flip rounds nothing), and the rotary embedding ``x * cos + rotate_half(x) * sin`` becomes one
elementwise group over x, cos and sin instead of five launches per tensor. The Concat's output keeps its name, so its
readers are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_gtco.families.elementwise.rule import slice_range
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import sole_reader, spliced


@dataclass(frozen=True)
class RotateHalf:
    """One rotate-half: the Concat, the Neg and the two Slices of `source` along its last axis, split at `half`."""

    concat: Node
    neg: Node
    source: str
    half: int
    width: int


def rotate_half_sign(width: int, half: int, dtype: int) -> np.ndarray:
    """The sign of each index of a rotate-half written as a roll, ``Concat(x[..., h:], x[..., :h]) * s``: -1 on the
    width - half indices that were negated, 1 on the rest (dtype: the ONNX element type)."""
    return np.concatenate([-np.ones(width - half), np.ones(half)]).astype(helper.tensor_dtype_to_np_dtype(dtype))


def _rotate_half_at(view: GraphView, concat: Node) -> RotateHalf | None:
    if not is_op(concat, "Concat") or len(concat.inputs) != 2:
        return None
    shape = view.shape(concat.outputs[0])
    axis = int(concat.attrs.get("axis", 0))
    if shape is None or axis not in (-1, len(shape) - 1):
        return None
    neg = view.producer_of(concat.inputs[0])
    if neg is None or not is_op(neg, "Neg") or sole_reader(view, neg.outputs[0]) is not concat:
        return None
    parts = [view.producer_of(t) for t in (neg.inputs[0], concat.inputs[1])]
    high, low = (slice_range(view, p) if p is not None else None for p in parts)
    if high is None or low is None or high[:2] != low[:2] or high[1] != len(shape) - 1:
        return None
    source, _, h, end = high
    width = view.shape(source)[-1]  # type: ignore[index]
    if low[2:] != (0, h) or end != width or not 0 < h < width:
        return None
    return RotateHalf(concat, neg, source, h, width)


def rotate_halves(view: GraphView) -> list[RotateHalf]:
    """Every rotate-half of the graph, in node order."""
    return [r for node in view.nodes if (r := _rotate_half_at(view, node)) is not None]


def signed_rolls(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[RotateHalf]]:
    """`model` with each rotate-half a Concat of its two Slices (a roll) times a constant sign vector (a copy; the
    model passed in is unchanged), and what was rewritten. A model without one is returned as it is."""
    view = GraphView(model)
    found = rotate_halves(view)
    if not found:
        return model, []
    replace: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    signs: dict[tuple[int, int, int], str] = {}
    new_inits: list[onnx.TensorProto] = []
    new_infos: list[onnx.ValueInfoProto] = []
    for r in found:
        info = view.info(r.concat.outputs[0])
        dtype = info.dtype if info is not None else onnx.TensorProto.FLOAT
        key = (r.width, r.half, dtype)
        if key not in signs:
            sign = rotate_half_sign(r.width, r.half, dtype)
            signs[key] = f"{r.concat.name or r.concat.outputs[0]}.rotate_half_sign"
            new_inits.append(numpy_helper.from_array(sign, signs[key]))
        rolled = f"{r.concat.outputs[0]}.rolled"
        nodes = [helper.make_node("Concat", [r.neg.inputs[0], r.concat.inputs[1]], [rolled],
                                  name=f"{r.concat.name}.roll", axis=-1),
                 helper.make_node("Mul", [rolled, signs[key]], [r.concat.outputs[0]], name=f"{r.concat.name}.sign")]
        if info is not None and info.shape is not None:
            new_infos.append(helper.make_tensor_value_info(rolled, dtype, list(info.shape)))
        removed.update((r.neg.id, r.concat.id))
        replace[r.concat.id] = nodes
    return spliced(model, replace, removed, new_inits, new_infos), found


__all__ = ["RotateHalf", "rotate_half_sign", "rotate_halves", "signed_rolls"]
