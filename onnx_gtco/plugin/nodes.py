"""The fused `ai.gtco` nodes of a rewritten model, with their functions and what shape inference says of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from onnx_gtco.errors import ModelError
from onnx_gtco.ir.load import infer_shapes
from onnx_gtco.ir.view import TensorInfo as PlanTensor
from onnx_gtco.opspec import DOMAIN
from onnx_gtco.plugin.binding import FusedNode, Operand

DTYPE_NAMES = {
    TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16", TensorProto.DOUBLE: "f64",
    TensorProto.INT64: "i64", TensorProto.INT32: "i32", TensorProto.INT8: "i8", TensorProto.UINT8: "u8",
    TensorProto.BOOL: "bool", TensorProto.FLOAT8E4M3FN: "e4m3",
}


def _dtype(elem_type: int) -> str:
    return DTYPE_NAMES.get(elem_type, "")


def _shape(tt: onnx.TypeProto.Tensor) -> tuple[int | str, ...] | None:
    if not tt.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim)


def _attr(a: onnx.AttributeProto) -> Any:
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def fused_nodes(model: onnx.ModelProto, planned: Callable[[str], PlanTensor | None] | None = None
                ) -> list[FusedNode]:
    """Every node of domain ai.gtco in graph order, with its model-local function (matched by domain, op type and
    overload), attributes, and input and output Operands (dtype and shape; the value of inputs that are
    initializers or Constant outputs).

    `planned` gives each tensor's type as the plan knew it (pipeline: the plan's `GraphView.info`, over the loaded
    model's shape inference, whose names the rewrite keeps for every fused node's inputs and outputs); without it
    the types come from shape inference over `model`.

    Raises:
        ModelError: a fused node has no matching function, or shape inference fails.
    """
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    fused = [n for n in model.graph.node if n.domain == DOMAIN]
    if not fused:
        return []
    types: dict[str, tuple[str, tuple[int | str, ...] | None]] = {}  # tensor -> (dtype, shape)
    if planned is None:
        inferred = infer_shapes(model, model.graph.name or "model")
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            if vi.type.HasField("tensor_type"):
                tt = vi.type.tensor_type
                types[vi.name] = _dtype(tt.elem_type), _shape(tt)
    else:
        for n in fused:
            for t in (*n.input, *n.output):
                known = planned(t) if t else None
                if known is not None and known.dtype:
                    types[t] = _dtype(known.dtype), None if known.shape is None else tuple(
                        "?" if d is None else d for d in known.shape)
    values: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        types.setdefault(t.name, (_dtype(t.data_type), tuple(int(d) for d in t.dims)))
        if not external_data_helper.uses_external_data(t):  # weights left on disk are never read to bind a node
            values[t.name] = numpy_helper.to_array(t)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output:
            for a in n.attribute:
                if a.name == "value":
                    values[n.output[0]] = numpy_helper.to_array(a.t)

    def info(name: str) -> Operand:
        dtype, shape = types.get(name, ("", None))
        return Operand(name, dtype, shape, values.get(name))

    out = []
    for n in fused:
        fn = functions.get((n.domain, n.op_type, n.overload))
        if fn is None:
            raise ModelError(f"fused node {n.name!r} ({n.op_type}, overload {n.overload!r}) has no model-local "
                             "function")
        out.append(make_fused_node(n, fn, info))
    return out


def make_fused_node(node: onnx.NodeProto, function: onnx.FunctionProto,
                    info: Callable[[str], Operand]) -> FusedNode:
    """The FusedNode of `node` with its `function`, its attributes decoded and `info` of each named input and
    output (an absent optional input has an empty Operand)."""
    return FusedNode(node=node, function=function, attrs={a.name: _attr(a) for a in node.attribute},
                     inputs=tuple(info(t) if t else Operand("", "", None) for t in node.input),
                     outputs=tuple(info(t) for t in node.output))
