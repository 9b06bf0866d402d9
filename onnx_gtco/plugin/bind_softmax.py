"""Binder of the Softmax family (op types Softmax_*) for plugins/ort/softmax_op.h.

The node's function is one Softmax over the last axis (onnx_gtco/patterns/softmax.py). Roles (C++
`gtco::Softmax::InRole` / `OutRole`): input x, output y.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from onnx_gtco.plugin.binding import Binding, FusedNode

IN_ROLES = ("x",)
OUT_ROLES = ("y",)
DTYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class SoftmaxBinder:
    """Roles of a Softmax_* node from its function body."""

    family: str = "softmax"
    header: str = "softmax_op.h"
    cpp_struct: str = "gtco::Softmax"

    def bind(self, node: FusedNode) -> Binding | str:
        if node.dtype not in DTYPES:
            return f"dtype {node.dtype}: the kernel takes {', '.join(DTYPES)}"
        fn = node.function
        ops = [n for n in fn.node if n.op_type != "Constant"]
        if len(ops) != 1 or ops[0].op_type != "Softmax" or ops[0].domain not in ("", "ai.onnx"):
            return f"the body is {[n.op_type for n in ops]}, not one Softmax"
        sm = ops[0]
        opset = next((o.version for o in fn.opset_import if o.domain in ("", "ai.onnx")), 0)
        x_info = node.inputs[list(fn.input).index(sm.input[0])] if sm.input[0] in fn.input else None
        if x_info is None or sm.output[0] not in fn.output:
            return "the Softmax does not read a node input and write a node output"
        rank = len(x_info.shape) if x_info.shape is not None else None
        axis = next((onnx.helper.get_attribute_value(a) for a in sm.attribute if a.name == "axis"), None)
        if axis is None:
            axis = -1 if opset >= 13 else 1
        if opset < 13 and not (rank is not None and axis % rank == rank - 1):
            return (f"Softmax of opset {opset} with axis {axis} flattens the trailing axes "
                    f"(input rank {rank}); the kernel normalises the last axis only")
        if axis != -1 and (rank is None or axis % rank != rank - 1):
            return f"Softmax axis {axis} is not the last axis of an input of rank {rank}"
        if x_info.dtype and x_info.dtype != node.dtype:
            return f"input {x_info.name!r} is {x_info.dtype}; the {node.node.op_type} kernel takes {node.dtype}"
        if len(fn.output) != 1:
            return f"the node has {len(fn.output)} outputs; the kernel writes one"
        return Binding(inputs=(list(fn.input).index(sm.input[0]),), outputs=(list(fn.output).index(sm.output[0]),))
