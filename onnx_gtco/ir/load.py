"""Read and validate a model: parse, check, convert old opsets, fold constants, infer shapes (symbolic dims kept)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
from google.protobuf.message import DecodeError
from onnx import helper

from onnx_gtco.errors import ModelError, UnsupportedError

MIN_OPSET = 13
CONVERT_TO_OPSET = 17


def default_opset(model: onnx.ModelProto) -> int:
    """The model's opset of the default ("" or "ai.onnx") domain."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    raise ModelError("model imports no opset of the default ONNX domain")


def read_model(source: str | os.PathLike[str] | onnx.ModelProto) -> onnx.ModelProto:
    """Parse a path (external data resolved beside it) or take a ModelProto as it is.

    Raises:
        ModelError: missing, empty, truncated or non-ONNX file; missing external data.
    """
    if isinstance(source, onnx.ModelProto):
        return source
    path = Path(source)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, expected an .onnx file")
    if path.stat().st_size == 0:
        raise ModelError(f"{path}: file is empty")
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelError(f"{path}: not a valid ONNX protobuf ({type(e).__name__}: {e})") from None
    if not model.HasField("graph") or (len(model.graph.node) == 0 and len(model.graph.output) == 0):
        raise ModelError(f"{path}: parses as protobuf but holds no ONNX graph (truncated or not a model?)")
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        raise ModelError(f"{path}: external data could not be read: {e}") from None
    return model


def load_model(source: str | os.PathLike[str] | onnx.ModelProto) -> onnx.ModelProto:
    """Read, validate and normalise a model for planning.

    Returns a new ModelProto: checked, opset >= 13 (older opsets converted), constants folded, shapes inferred.

    Raises:
        ModelError: unreadable or invalid model, or an opset we cannot convert.
    """
    model = read_model(source)
    name = str(source) if not isinstance(source, onnx.ModelProto) else "model"
    try:
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as e:
            if "topologically sorted" not in str(e):
                raise
            # valid but out of order (onnxruntime's fp16 converter writes such graphs): sort it, then check again
            model = _toposorted(model, name)
            onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{name}: invalid ONNX model: {first}") from None
    model = _convert_opset(model, name)
    # Shapes first, so folding sees static extents (TorchScript exports compute reshape targets from Shape nodes);
    # fold, infer again (folding reveals more), fold what that exposes, and infer the final graph.
    for _ in range(2):
        model = _infer_shapes(model, name)
        model = _fold_constants(model)
    model = _infer_shapes(model, name)
    _order_depth_first(model)
    return model


def _toposorted(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The model with its main graph's nodes in topological order (onnx-graphsurgeon's sort)."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    try:
        graph.toposort()
    except Exception as e:  # graphsurgeon raises a plain exception on a cycle
        raise ModelError(f"{name}: invalid ONNX model: the graph cannot be sorted topologically ({e})") from None
    out = gs.export_onnx(graph)
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    return out


# Initializers with more elements than this are hidden from shape inference: their shapes are all it needs, and
# serialising the weights of a large model for each inference pass cost more than the rest of loading together.
_INFER_VALUE_LIMIT = 4096


def _infer_shapes(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Shape inference (symbolic dims kept, data propagation on) on a weightless copy; returns a new model."""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                                      functions=model.functions))
    graph = skeleton.graph
    graph.name = model.graph.name
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    declared = {v.name for v in model.graph.input}
    for t in model.graph.initializer:
        if int(np.prod(t.dims, dtype=np.int64)) <= _INFER_VALUE_LIMIT:
            graph.initializer.append(t)
        elif t.name not in declared:
            graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0]
        raise ModelError(f"{name}: shape inference failed: {first}") from None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    out.graph.value_info.extend(inferred.graph.value_info)
    del out.graph.output[:]
    out.graph.output.extend(inferred.graph.output)
    return out


def _order_depth_first(model: onnx.ModelProto) -> None:
    """Re-sort nodes in place: a depth-first post-order from the graph outputs.

    Every node then comes right after the producers it needs and before anything unrelated, so a layer's nodes are
    contiguous (MatMul next to its bias Add, the attention chain unbroken). The fusion DP's states are the frontiers
    of this order, so a local order keeps them few; exporters' orders (dynamo's especially) interleave layers.
    """
    nodes = list(model.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    done = [False] * len(nodes)
    order: list[int] = []

    def visit(root: int) -> None:
        stack = [(root, 0)]
        while stack:
            i, k = stack.pop()
            if done[i]:
                continue
            inputs = nodes[i].input
            while k < len(inputs) and (inputs[k] not in producer or done[producer[inputs[k]]]):
                k += 1
            if k == len(inputs):
                done[i] = True
                order.append(i)
            else:
                stack.append((i, k + 1))
                stack.append((producer[inputs[k]], 0))

    for out in model.graph.output:
        if out.name in producer:
            visit(producer[out.name])
    for i in range(len(nodes)):  # nodes no output needs (kept by the caller's choice) keep their place after
        visit(i)
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)


def _convert_opset(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise UnsupportedError(f"{name}: opset {opset} is newer than this onnx package supports ({newest})")
    if opset >= MIN_OPSET:
        return model
    try:
        converted = onnx.version_converter.convert_version(model, CONVERT_TO_OPSET)
        onnx.checker.check_model(converted)
    except Exception as e:  # the converter raises bare RuntimeErrors and more
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedError(
            f"{name}: opset {opset} < {MIN_OPSET} and onnx's version converter failed: {first}; "
            f"re-export the model with opset >= {MIN_OPSET}"
        ) from None
    return converted


def _fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constant subgraphs (shape arithmetic of static shapes) with onnx-graphsurgeon, then drop dead nodes."""
    import onnx_graphsurgeon as gs

    functions = list(model.functions)
    graph = gs.import_onnx(model)
    graph.fold_constants(error_ok=True).cleanup(remove_unused_graph_inputs=False).toposort()
    folded = gs.export_onnx(graph, do_type_check=False)
    folded.ir_version = model.ir_version
    del folded.functions[:]
    folded.functions.extend(functions)
    del folded.metadata_props[:]
    folded.metadata_props.extend(model.metadata_props)
    folded.producer_name, folded.producer_version = model.producer_name, model.producer_version
    return folded
