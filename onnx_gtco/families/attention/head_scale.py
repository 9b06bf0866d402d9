"""A per-head scale of the attention scores moved onto the queries, before planning, so that the attention kernel's
one scalar scale suffices.

Swin V2's cosine attention scales the scores of head h by its own learned temperature: ``(q̂ k̂ᵀ) * t`` with t a
constant [H, 1, 1] (exp of a clamped parameter, folded when the model loads), where the attention kernels take one
scale for every head. t varies over the batch and head dims only, so it commutes with the product over the last two:

    (q̂ k̂ᵀ) * t  =  (q̂ * t) k̂ᵀ

(equal up to rounding: fp32 rounds the product of the scaled operand instead of the scaled product). The Mul then
reads q̂ [.., H, S, D] (a kernel of its own, or the elementwise group that normalizes q) and the scores reach the
Softmax through the MatMul and the additive terms alone, which the attention rule fuses. The Mul's output name is
kept by the MatMul, so the scores' readers are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from onnx_gtco.families.attention.scores import reaches_softmax
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import sole_reader, spliced


@dataclass(frozen=True)
class HeadScale:
    """One per-head scale: the Mul of `matmul`'s product by the constant `scale`."""

    matmul: Node
    mul: Node
    scale: str


def _head_scale_at(view: GraphView, mul: Node) -> HeadScale | None:
    if not is_op(mul, "Mul") or len(mul.inputs) != 2:
        return None
    for product, scale in (mul.inputs, mul.inputs[::-1]):
        mm = view.producer_of(product)
        value = view.const_value(scale)
        if mm is None or not is_op(mm, "MatMul") or value is None or np.asarray(value).size <= 1:
            continue
        a, out = view.shape(mm.inputs[0]), view.shape(product)
        s = tuple(np.asarray(value).shape)
        if a is None or out is None or len(s) > len(out) or len(a) != len(out) or view.is_constant(mm.inputs[0]):
            continue
        if sole_reader(view, product) is not mul or product in view.graph_outputs:
            continue
        lead = (1,) * (len(out) - len(s)) + s
        # varies over the batch / head dims only, each of them one value or the product's (and q's) own
        if lead[-2:] != (1, 1) or any(x not in (1, o) or (x != 1 and a[i] != o)
                                      for i, (x, o) in enumerate(zip(lead[:-2], out[:-2], strict=True))):
            continue
        if reaches_softmax(view, mul.outputs[0]):
            return HeadScale(mm, mul, scale)
    return None


def head_scales(view: GraphView) -> list[HeadScale]:
    """Every per-head scale of attention scores in the graph, in node order."""
    return [h for node in view.nodes if (h := _head_scale_at(view, node)) is not None]


def scaled_queries(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[HeadScale]]:
    """`model` with each per-head scale of attention scores applied to the queries instead (a copy; the model passed in
    is unchanged), and what was moved. A model without one is returned as it is."""
    view = GraphView(model)
    found = head_scales(view)
    if not found:
        return model, []
    replace: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    infos: list[onnx.ValueInfoProto] = []
    for h in found:
        q = h.matmul.inputs[0]
        scaled = f"{q}.head_scaled.{h.mul.name or h.mul.outputs[0]}"
        matmul = helper.make_node("MatMul", [scaled, h.matmul.inputs[1]], [h.mul.outputs[0]],
                                  name=h.matmul.name or f"{h.mul.outputs[0]}.matmul")
        replace[h.matmul.id] = [helper.make_node("Mul", [q, h.scale], [scaled], name=f"{h.mul.name}.on_q"), matmul]
        removed.update((h.matmul.id, h.mul.id))
        info = view.info(q)
        if info is not None and info.shape is not None:
            infos.append(helper.make_tensor_value_info(scaled, info.dtype, list(info.shape)))
    return spliced(model, replace, removed, (), infos), found


__all__ = ["HeadScale", "head_scales", "scaled_queries"]
