"""A Reshape between a GEMM and its activation moved after the activation, before planning, so that the GEMM's
epilogue applies it.

GPT-2's Conv1D (and every layer written as ``addmm(bias, x.view(-1, k), w).view(*lead, n)``) exports a 2-D Gemm, a
Reshape back to [B, S, N] and then the activation (GPT-2's tanh GELU as Pow, Mul, Add, Tanh, ...), which the GEMM
rule cannot take past the Reshape: the activation runs as a kernel of its own, reading and writing the 4x-wide MLP
activation once more. An activation of one tensor and scalar constants (patterns.find_activation) is elementwise, so
it commutes with any reshape:

    act(Reshape(y, s))  =  Reshape(act(y), s)

exactly. The activation's nodes are rewritten to read the Reshape's input (their outputs renamed), and one Reshape
of their result keeps the activation's output name, so its readers are unchanged.
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.find_activation import find_activation
from onnx_gtco.patterns.util import spliced

SUFFIX = ".rows"
"""Appended to the names of the activation's tensors computed before the Reshape."""


def _gemm_output(view: GraphView, tensor: str) -> bool:
    """`tensor` is a GEMM's result: a MatMul or Gemm output, or a constant bias added to one."""
    node = view.producer_of(tensor)
    if node is not None and is_op(node, "Add") and len(node.inputs) == 2:
        node = next((view.producer_of(t) for t in node.inputs if not view.is_constant(t)), None)
    return node is not None and is_op(node, "MatMul", "Gemm")


def _sinkable(view: GraphView, reshape: Node) -> tuple[str, frozenset[int], str] | None:
    """The activation after `reshape` that may move before it: (name, node ids, output), or None."""
    if not is_op(reshape, "Reshape") or not _gemm_output(view, reshape.inputs[0]):
        return None
    if view.shape(reshape.inputs[0]) is None:  # the activation's tensors take its shape (static dims or names)
        return None
    y = reshape.outputs[0]
    act = find_activation(view, y)
    if act is None or y in view.graph_outputs:
        return None
    if any(c.id not in act[1] for c in view.consumers_of(y)):  # the reshaped tensor is read by the activation alone
        return None
    return act


def sunk_reshapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """`model` with each Reshape between a GEMM's result and an activation of it moved after the activation (a copy;
    the model passed in is unchanged), and the activations' output names. A model without one is returned as it
    is."""
    view = GraphView(model)
    inserts: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    infos: list[onnx.ValueInfoProto] = []
    moved: list[str] = []
    for reshape in view.nodes:
        act = _sinkable(view, reshape)
        if act is None or reshape.id in removed or act[1] & removed:
            continue
        _, ids, out = act
        src, y = reshape.inputs[0], reshape.outputs[0]
        shape = list(view.shape(src) or ())
        renamed = {view.nodes[i].outputs[0]: view.nodes[i].outputs[0] + SUFFIX for i in ids}
        nodes = []
        for i in sorted(ids):
            n = view.nodes[i]
            proto = onnx.NodeProto()
            proto.CopyFrom(model.graph.node[i])
            proto.input[:] = [src if t == y else renamed.get(t, t) for t in n.inputs]
            proto.output[:] = [renamed[n.outputs[0]]]
            nodes.append(proto)
            info = view.info(n.outputs[0])
            if info is not None and info.dtype:
                infos.append(helper.make_tensor_value_info(renamed[n.outputs[0]], info.dtype, shape))
        nodes.append(helper.make_node("Reshape", [renamed[out], reshape.inputs[1]], [out],
                                      name=f"{reshape.name or y}.after_activation",
                                      **({"allowzero": reshape.attrs["allowzero"]} if "allowzero" in reshape.attrs
                                         else {})))
        inserts[max(ids)] = nodes  # after everything the activation reads
        removed |= ids | {reshape.id}
        moved.append(out)
    if not moved:
        return model, []
    # the inserted copies replace the nodes at their positions: the last of each activation's nodes goes with them
    return spliced(model, inserts, removed, (), infos), moved


__all__ = ["sunk_reshapes"]
