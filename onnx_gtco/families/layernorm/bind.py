"""Binder of the LayerNorm family (op types Layernorm_*) for plugins/families/layernorm/layernorm_op.h.

Roles (C++ `gtco::LayerNorm::InRole` / `OutRole`, in opspec's order): inputs a (x, or the residual Add's first
addend), b (its second addend), gamma, beta; outputs y and sum (the residual sum, when the node outputs it). The
rule found them (families/layernorm/rule.py); the binder checks what the kernel takes: one dtype, equal residual
shapes, one gamma / beta value per normalised element.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_gtco.kernels.family import Problem
from onnx_gtco.opspec import SPECS, FusedOp
from onnx_gtco.plugin.binding import Binding, FusedNode, bind_roles, present, read


def _numel(shape: tuple[int | str, ...] | None) -> int | None:
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))


@dataclass(frozen=True)
class LayerNormBinder:
    family: str = "layernorm"
    header: str = "layernorm/layernorm_op.h"
    cpp_struct: str = "gtco::LayerNorm"

    @staticmethod
    def operand_flags(node: FusedNode, binding: Binding, problem: Problem) -> dict[str, bool]:
        """The residual's addend and sum, gamma and beta, where the node has them."""
        del node, problem
        return present(binding, (("residual", "in", 1), ("residual_out", "out", 1), ("gamma", "in", 2),
                                 ("beta", "in", 3)))

    def bind(self, node: FusedNode) -> Binding | str:
        op = read(node, self.family)
        if isinstance(op, str):
            return op
        need = {"a": True, "b": op["residual"]}
        if not op["affine"]:
            need |= {"gamma": False, "beta": False}
        spec = SPECS[self.family]
        bound = bind_roles(node, op, need, spec.roles, spec.outputs,  # type: ignore[arg-type]
                           outputs=1 + ("sum" in op.outputs))
        return bound if isinstance(bound, str) else self._check_operands(node, op) or bound

    @staticmethod
    def _check_operands(node: FusedNode, op: FusedOp) -> str | None:
        x_shape = node.inputs[op.inputs["a"]].shape
        axis = op["axis"]
        if not isinstance(axis, int) or axis >= 0:
            return f"axis attribute {axis!r} is not a negative int"
        if "b" in op.inputs:
            bs = node.inputs[op.inputs["b"]].shape
            if x_shape is not None and bs is not None and (len(bs) != len(x_shape) or any(
                    isinstance(p, int) and isinstance(q, int) and p != q for p, q in zip(x_shape, bs, strict=True))):
                return f"residual addends of shapes {x_shape} and {bs} broadcast; the kernel adds equal shapes only"
        hidden = _numel(x_shape[axis:]) if x_shape is not None and len(x_shape) >= -axis else None
        for what, role in (("scale", "gamma"), ("bias", "beta")):
            if role not in op.inputs:
                continue
            s = node.inputs[op.inputs[role]].shape
            n = _numel(s)
            if s is None or n is None:
                continue
            lead = s[:axis] if len(s) > -axis else ()
            if n != 1 and (any(d != 1 for d in lead) or (hidden is not None and n != hidden)):
                return (f"{what} of shape {list(s)} is not one value per normalised element of x "
                        f"{list(x_shape or ())}")
        return None


BINDERS = (LayerNormBinder(),)
