"""Binder of the Softmax family (op types Softmax_*) for plugins/families/softmax/softmax_op.h: input x, output y, the
last axis (families/softmax/rule.py found it; opspec wrote the roles)."""

from __future__ import annotations

from dataclasses import dataclass

from onnx_gtco.opspec import SPECS
from onnx_gtco.plugin.binding import Binding, FusedNode, bind_roles, read

IN_ROLES, OUT_ROLES = SPECS["softmax"].roles, SPECS["softmax"].outputs   # gtco::Softmax::InRole / OutRole


@dataclass(frozen=True)
class SoftmaxBinder:
    family: str = "softmax"
    header: str = "softmax/softmax_op.h"
    cpp_struct: str = "gtco::Softmax"

    def bind(self, node: FusedNode) -> Binding | str:
        op = read(node, self.family)
        if isinstance(op, str):
            return op
        if op["axis"] != -1:
            return f"Softmax axis {op['axis']} is not the last axis"
        return bind_roles(node, op, {"x": True}, IN_ROLES, OUT_ROLES)  # type: ignore[arg-type]


BINDERS = (SoftmaxBinder(),)
