"""Convolution with its elementwise epilogue: bias, frozen BatchNorm, activation, residual Add."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, Reject, is_op, other_input
from onnx_gtco.patterns.epilogue import const_add, residual_add
from onnx_gtco.patterns.find_activation import find_activation
from onnx_gtco.patterns.util import dims, sole_reader

MAX_AFFINE = 3  # per-channel Mul/Add steps (bias, FrozenBatchNorm's scale and shift)


class ConvPattern:
    """A Conv and the per-channel and elementwise ops a conv kernel applies before storing.

    Formula: ``y = post_act(act(affine(conv(x, w) + bias)) + residual)``, each step optional, where affine is
    ``v * scale + shift`` (DETR's FrozenBatchNorm Mul/Add, either alone) or a BatchNormalization in inference form,
    ``(v - mean) * scale / sqrt(var + epsilon) + shift``; bias, scale, shift, mean and var are per-channel
    constants (or one value), bias being the Conv's own or an Add of a constant straight after it.

        x -> Conv -> [Add bias] -> [Mul scale] -> [Add shift] -> [act] -> [Add residual] -> [post act] -> y
                                -> [BatchNormalization]

    Every prefix is a candidate; the affine steps stop at one that does not continue this order (a second Mul, a
    BatchNormalization after a Mul). Roles: x, w, bias, scale, shift, mean, var, residual; output y. attrs: kernel,
    stride, pads, dilations, groups, bias, scale, shift, batchnorm, epsilon, affine (any of the three), activation,
    residual, post_activation, auto_pad (the Conv's: SAME_UPPER / SAME_LOWER pads depend on x's spatial size, which
    the kernels read on every run; the binder computes them for the device Problem from the static shape).
    """

    name = "conv"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for node in view.nodes:
            if is_op(node, "Conv"):
                yield from self._site(view, node)

    def _site(self, view: GraphView, conv: Node) -> Iterator[Match | Reject]:
        attrs = self._attrs(view, conv)
        roles = {"x": conv.inputs[0], "w": conv.inputs[1]} | ({"bias": conv.inputs[2]} if attrs["bias"] else {})
        group, out = {conv.id}, conv.outputs[0]

        def match() -> Match:
            return Match(frozenset(group), "conv", dict(attrs), dict(roles), {"y": out})

        yield match()
        for _ in range(MAX_AFFINE):
            step, why = self._affine(view, out)
            if why:
                yield Reject(self.name, conv.name, why)
            if step is None or not self._takes(step, roles, out, attrs):
                break
            group.add(step.id)
            out = step.outputs[0]
            yield match()
        act = find_activation(view, out)
        if act is not None:
            group |= act[1]
            out, attrs["activation"] = act[2], act[0]
            yield match()
        res, why = residual_add(view, out, group)
        if why:
            yield Reject(self.name, conv.name, why)
        if res is None:
            return
        group.add(res.id)
        roles["residual"] = other_input(res, out) or ""
        out, attrs["residual"] = res.outputs[0], True
        yield match()
        post = find_activation(view, out)
        if post is not None:
            group |= post[1]
            out, attrs["post_activation"] = post[2], post[0]
            yield match()

    @staticmethod
    def _takes(step: Node, roles: dict[str, str], out: str, attrs: dict[str, Any]) -> bool:
        """Whether the affine `step` (reading `out`) continues bias -> scale -> shift or bias -> BatchNormalization;
        if so its constants take their roles and attrs."""
        if step.op_type == "BatchNormalization":
            if roles.keys() & {"scale", "shift"}:
                return False
            roles.update(zip(("scale", "shift", "mean", "var"), step.inputs[1:5], strict=True))
            attrs.update(scale=True, shift=True, batchnorm=True, affine=True,
                         epsilon=float(step.attrs.get("epsilon", 1e-5)))
            return True
        const = other_input(step, out) or ""
        if step.op_type == "Mul":
            role = "scale" if not roles.keys() & {"scale", "shift"} else None
        else:
            role = "bias" if not roles.keys() & {"bias", "scale", "shift"} else "shift"
            role = None if role in roles else role
        if role is None:
            return False
        roles[role] = const
        attrs[role] = True
        attrs["affine"] = attrs["affine"] or role != "bias"
        return True

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
        auto_pad = conv.attrs.get("auto_pad", "NOTSET")
        return {
            "kernel": kernel,
            "stride": tuple(int(s) for s in conv.attrs.get("strides", (1,) * n)),
            "pads": tuple(int(p) for p in conv.attrs.get("pads", (0,) * 2 * n)),
            "dilations": tuple(int(d) for d in conv.attrs.get("dilations", (1,) * n)),
            "auto_pad": auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad),
            "groups": int(conv.attrs.get("group", 1)),
            "bias": len(conv.inputs) > 2 and bool(conv.inputs[2]),
            "scale": False, "shift": False, "batchnorm": False, "epsilon": None,
            "affine": False, "activation": "none", "residual": False, "post_activation": "none",
        }


RULES = (ConvPattern(),)
