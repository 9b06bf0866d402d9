"""Shape arithmetic folded with onnxscript's optimizer and the layout ops that static shapes show to be no-ops removed.

onnx-graphsurgeon folds what is constant given the shapes the model's value_info holds; a shape that only becomes
known once an upstream fold is done (Swin's window padding: the pads come from Mod arithmetic, and the Pad's output
shape feeds the next block's Shape nodes) costs it one round of shape inference per link of the chain. onnxscript's
constant folder infers each node's shape as it folds, so one pass runs such a chain to its end.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
import onnxscript.optimizer

from onnx_gtco.ir.elementwise import contiguous_strides, reshape_strides

# onnxscript's default limits (elements): an op with a larger constant input is not evaluated, a larger result is
# not stored (onnx-graphsurgeon, which runs after, folds those)
_INPUT_SIZE_LIMIT = 8192
_OUTPUT_SIZE_LIMIT = 512 * 512
_MAX_PASSES = 4
_DEFAULT_DOMAINS = ("", "ai.onnx")


def simplify(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its constant subgraphs folded (node by node, shapes inferred as it goes) and its no-op layout
    ops removed; graph inputs, outputs and their names are kept, and so are the names of the nodes that stay.
    Returns a new model.

    Where a value of the graph depends on a symbolic dim, what computes it stays.
    """
    graph_model = ir.serde.deserialize_model(model)
    names = {node: node.name for node in ir.traversal.RecursiveGraphIterator(graph_model.graph)}
    folder_log = logging.getLogger("onnxscript.optimizer._constant_folding")
    level = folder_log.level
    folder_log.setLevel(logging.ERROR)  # it warns of each op onnx's reference evaluator fails on, and goes on
    try:
        for _ in range(_MAX_PASSES):
            folded = onnxscript.optimizer.fold_constants(
                graph_model, onnx_shape_inference=True, input_size_limit=_INPUT_SIZE_LIMIT,
                output_size_limit=_OUTPUT_SIZE_LIMIT, should_fold=_small_constant_of_shape)
            removed = _RemoveNoOpLayout()(graph_model)
            ir_passes.RemoveUnusedNodesPass()(graph_model)
            if not (folded.modified or removed.modified):
                break
    finally:
        folder_log.setLevel(level)
    for node in ir.traversal.RecursiveGraphIterator(graph_model.graph):  # the folder names the nodes it visits
        node.name = names.get(node, node.name)
    return ir.serde.serialize_model(graph_model)


def _small_constant_of_shape(node: ir.Node) -> bool | None:
    """ConstantOfShape of a known small shape is folded (onnxscript keeps every ConstantOfShape by default, and
    TorchScript's pad arithmetic runs through one); otherwise onnxscript's default rules decide."""
    if node.op_type != "ConstantOfShape" or node.domain not in _DEFAULT_DOMAINS or not node.inputs:
        return None
    shape = node.inputs[0].const_value if node.inputs[0] is not None else None
    if shape is None:
        return None
    return int(np.prod(shape.numpy(), dtype=np.int64)) <= _OUTPUT_SIZE_LIMIT or None


def _static_dims(value: ir.Value | None) -> tuple[int, ...] | None:
    """A value's shape where every dim is a known integer, else None."""
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape.dims):
        return None
    return tuple(value.shape.dims)


def _const(node: ir.Node, index: int) -> np.ndarray | None:
    """The constant value of a node's input `index`, or None (absent or computed at run time)."""
    if index >= len(node.inputs) or node.inputs[index] is None or node.inputs[index].const_value is None:
        return None
    return node.inputs[index].const_value.numpy()


def _same_shape(node: ir.Node) -> bool:
    """The node's only output has its first input's static shape and element type."""
    if len(node.outputs) != 1 or not node.inputs or node.inputs[0] is None:
        return False
    src, dst = node.inputs[0], node.outputs[0]
    shape = _static_dims(src)
    return shape is not None and shape == _static_dims(dst) and src.dtype is not None and src.dtype == dst.dtype


def _whole_slice(node: ir.Node) -> bool:
    """Slice with positive steps whose output keeps the input's shape: it takes every element, in order."""
    steps = _const(node, 4)
    steps_known = len(node.inputs) <= 4 or node.inputs[4] is None or steps is not None
    return steps_known and (steps is None or bool((steps > 0).all())) and _same_shape(node)


def _identity_transpose(node: ir.Node) -> bool:
    """Transpose whose perm keeps every axis in place."""
    perm = node.attributes.get("perm")
    return perm is not None and list(perm.as_ints()) == sorted(perm.as_ints()) and _same_shape(node)


def _single_input(node: ir.Node) -> bool:
    """Concat of one input, Split into one output, of the input's shape."""
    return len(node.inputs) == 1 and len(node.outputs) == 1 and _same_shape(node)


# Ops that keep the elements in row-major order and only relabel the shape: a chain of them that ends at the shape
# it started from is a no-op as a whole.
_ROW_MAJOR = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})

# A Pad of zero pads stays: it is the elementwise node that Swin's window partition (Reshape, Transpose) joins to
# run as one fused copy; without it those layout ops would run unfused.
_NO_OP_WHEN: dict[str, Callable[[ir.Node], bool]] = {
    "Expand": _same_shape,
    "Slice": _whole_slice,
    "Transpose": _identity_transpose,
    "Concat": _single_input,
    "Split": _single_input,
}


def _row_major_chain(node: ir.Node) -> list[ir.Value]:
    """The values a chain of _ROW_MAJOR ops ending in `node` passes through: its input, the input of that input's
    producer where that is a _ROW_MAJOR op too, and so on up to the chain's start."""
    chain = []
    value = node.inputs[0] if node.inputs else None
    while value is not None:
        chain.append(value)
        producer = value.producer()
        if producer is None or producer.op_type not in _ROW_MAJOR or producer.domain not in _DEFAULT_DOMAINS:
            break
        value = producer.inputs[0] if producer.inputs else None
    return chain


def _row_major_source(node: ir.Node) -> ir.Value | None:
    """The value of the chain ending in `node` that has the node's static output shape and type (Unsqueeze then
    Squeeze, Reshape to the shape the tensor has): the chain from there is a no-op."""
    out = node.outputs[0]
    target = _static_dims(out)
    if target is None:
        return None
    return next((v for v in _row_major_chain(node) if _static_dims(v) == target and v.dtype == out.dtype), None)


def _collapse_reshape(graph: ir.Graph, node: ir.Node, names: set[str]) -> bool:
    """Make a Reshape at the end of a chain of _ROW_MAJOR ops read the chain's start, with its static output shape
    as the target (TorchScript writes Swin's window partition as Reshape after Reshape); the ops it skips go where
    nothing else reads them. False where the Reshape is no such chain's end or its output shape is not static."""
    target = _static_dims(node.outputs[0])
    chain = _row_major_chain(node) if node.op_type == "Reshape" and node.domain in _DEFAULT_DOMAINS else []
    if target is None or not all(d > 0 for d in target) or len(chain) < 2:
        return False  # a 0 in a target copies the input's dim (allowzero=0): only positive extents are written
    k = 0
    while f"{node.outputs[0].name}_shape_{k}" in names:
        k += 1
    name = f"{node.outputs[0].name}_shape_{k}"
    names.add(name)
    shape = ir.Value(name=name, const_value=ir.tensor(np.array(target, dtype=np.int64), name=name),
                     type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([len(target)]))
    graph.register_initializer(shape)
    node.replace_input_with(0, chain[-1])
    node.replace_input_with(1, shape)
    return True


# Ops that reorder elements by an index map alone; with _ROW_MAJOR ops, a chain of them whose map is the identity is a
# no-op as a whole (SegFormer's tokens -> map -> tokens: Reshape, Transpose, Reshape, Transpose).
_REORDER = _ROW_MAJOR | {"Transpose"}


def _reordering_chain(node: ir.Node) -> tuple[list[ir.Node], list[ir.Value]]:
    """The _REORDER ops of a chain ending in `node` (last first) and the value each reads, up to the chain's start or
    the first value of no static shape."""
    nodes: list[ir.Node] = []
    values: list[ir.Value] = []
    while node.op_type in _REORDER and node.domain in _DEFAULT_DOMAINS and len(node.outputs) == 1 and node.inputs:
        value = node.inputs[0]
        if value is None or _static_dims(value) is None:
            break
        nodes.append(node)
        values.append(value)
        producer = value.producer()
        if producer is None:
            break
        node = producer
    return nodes, values


def _keeps_order(src: tuple[int, ...], chain: list[ir.Node]) -> bool:
    """Whether the chain of _REORDER ops (in order) reads a dense tensor of shape `src` into its output in row-major
    order: the view it makes (strides over the source, as numpy's no-copy reshape rule follows them) is dense."""
    shape, strides = src, list(contiguous_strides(src))
    for node in chain:
        if node.op_type == "Transpose":
            perm = node.attributes.get("perm")
            order = [int(p) % len(shape) for p in perm.as_ints()] if perm is not None else \
                list(range(len(shape)))[::-1]
            shape, strides = tuple(shape[p] for p in order), [strides[p] for p in order]
            continue
        new = _static_dims(node.outputs[0])
        if new is None or math.prod(new) != math.prod(shape):
            return False
        moved = reshape_strides(shape, strides, new)
        if moved is None:
            return False
        shape, strides = new, moved
    return all(st == want for d, st, want in zip(shape, strides, contiguous_strides(shape), strict=True) if d != 1)


def _reordering_source(node: ir.Node) -> ir.Value | None:
    """The start of a chain of _REORDER ops with a Transpose, ending in `node`, that gives back the start's shape,
    type and element order (a map that is the identity), or None."""
    out = node.outputs[0]
    target = _static_dims(out)
    nodes, values = _reordering_chain(node)
    if target is None or not any(n.op_type == "Transpose" for n in nodes):
        return None
    for k in range(len(values) - 1, -1, -1):  # the longest chain first
        chain = nodes[: k + 1][::-1]
        if _static_dims(values[k]) == target and values[k].dtype == out.dtype \
                and any(n.op_type == "Transpose" for n in chain) and _keeps_order(target, chain):
            return values[k]
    return None


def _no_op_source(node: ir.Node) -> ir.Value | None:
    """The value a no-op layout node passes on unchanged, or None where the node is no no-op (or not known to be)."""
    if node.domain not in _DEFAULT_DOMAINS or len(node.outputs) != 1 or node.outputs[0].is_graph_output():
        return None
    if node.op_type in _ROW_MAJOR:
        return _row_major_source(node) or _reordering_source(node)
    test = _NO_OP_WHEN.get(node.op_type)
    if test is not None and test(node):
        return node.inputs[0]
    return _reordering_source(node) if node.op_type == "Transpose" else None


class _RemoveNoOpLayout(ir.passes.InPlacePass):
    """Drop layout ops of the main graph that static shapes show to be no-ops: their readers read the value they
    pass on instead. One whose output is a graph output stays (the output keeps its name). A Reshape ending a chain
    of reshapes reads the chain's start."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = {v.name for v in (*graph.inputs, *graph.initializers.values())}
        names |= {v.name for node in graph for v in node.outputs}
        modified = False
        for node in graph:
            source = _no_op_source(node)
            if source is not None and node.outputs[0].uses():
                node.outputs[0].replace_all_uses_with(source)
                modified = True
            elif source is None and _collapse_reshape(graph, node, names):
                modified = True
        return ir.passes.PassResult(model, modified=modified)
