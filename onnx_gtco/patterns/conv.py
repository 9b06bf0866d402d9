"""Convolution with its elementwise epilogue: bias, frozen BatchNorm, activation, residual Add."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns._act import find_activation
from onnx_gtco.patterns._epilogue import const_add, residual_add
from onnx_gtco.patterns._util import dims, sole_reader
from onnx_gtco.patterns.base import Match, Reject, is_op

MAX_AFFINE = 3  # per-channel Mul/Add steps (bias, FrozenBatchNorm's scale and shift)


class ConvPattern:
    """A Conv and the per-channel and elementwise ops a conv kernel applies before storing.

    Formula: ``y = post_act(act(conv(x, W) * a + b) + residual)``; a and b are per-channel constants (a bias
    Add, DETR's FrozenBatchNorm Mul/Add, or a BatchNormalization in inference form), each step optional.

        x -> Conv -> [Mul a] -> [Add b] -> [act] -> [Add residual] -> [post act] -> y

    Every prefix is a candidate. attrs: kernel, stride, pads, dilations, groups, bias, affine, activation,
    residual, post_activation.
    """

    name = "conv"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for node in view.nodes:
            if is_op(node, "Conv"):
                yield from self._site(view, node)

    def _site(self, view: GraphView, conv: Node) -> Iterator[Match | Reject]:
        attrs = self._attrs(view, conv)
        group, out = {conv.id}, conv.outputs[0]
        yield Match(frozenset(group), "conv", dict(attrs))
        for _ in range(MAX_AFFINE):
            step, why = self._affine(view, out)
            if why:
                yield Reject(self.name, conv.name, why)
            if step is None:
                break
            group.add(step.id)
            out = step.outputs[0]
            attrs["bias" if step.op_type == "Add" and not attrs["affine"] else "affine"] = True
            yield Match(frozenset(group), "conv", dict(attrs))
        act = find_activation(view, out)
        if act is not None:
            group |= act[1]
            out, attrs["activation"] = act[2], act[0]
            yield Match(frozenset(group), "conv", dict(attrs))
        res, why = residual_add(view, out, group)
        if why:
            yield Reject(self.name, conv.name, why)
        if res is None:
            return
        group.add(res.id)
        out, attrs["residual"] = res.outputs[0], True
        yield Match(frozenset(group), "conv", dict(attrs))
        post = find_activation(view, out)
        if post is not None:
            yield Match(frozenset(group | post[1]), "conv", attrs | {"post_activation": post[0]})

    @staticmethod
    def _affine(view: GraphView, out: str) -> tuple[Node | None, str | None]:
        bn = sole_reader(view, out)
        if is_op(bn, "BatchNormalization") and bn is not None and len(bn.outputs) == 1 \
                and all(view.is_constant(t) for t in bn.inputs[1:]):
            return bn, None
        node, why = const_add(view, out, 1, "Mul")
        if node is not None or why:
            return node, why
        return const_add(view, out, 1, "Add")

    @staticmethod
    def _attrs(view: GraphView, conv: Node) -> dict[str, Any]:
        w = dims(view, conv.inputs[1]) or ()
        kernel = tuple(int(k) for k in conv.attrs.get("kernel_shape", ())) or tuple(w[2:])
        n = len(kernel)
        return {
            "kernel": kernel,
            "stride": tuple(int(s) for s in conv.attrs.get("strides", (1,) * n)),
            "pads": tuple(int(p) for p in conv.attrs.get("pads", (0,) * 2 * n)),
            "dilations": tuple(int(d) for d in conv.attrs.get("dilations", (1,) * n)),
            "groups": int(conv.attrs.get("group", 1)),
            "bias": len(conv.inputs) > 2 and bool(conv.inputs[2]),
            "affine": False, "activation": "none", "residual": False, "post_activation": "none",
        }
