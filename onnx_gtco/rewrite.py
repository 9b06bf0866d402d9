"""Apply a Plan: each fused group becomes one `ai.gtco` node plus a model-local function of its original nodes.

The function body is canonicalised (tensors and nodes renamed by position), so identical groups, e.g. the twelve
attention blocks of ViT-B, share one FunctionProto; its `overload` is a hash of the body. Without the plugin, ORT
and every other runtime inline the function, so the rewritten model computes what the original did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import onnx
from onnx import helper

from onnx_gtco.errors import RewriteError
from onnx_gtco.ir.view import GraphView
from onnx_gtco.opspec import DOMAIN, SPECS, op_type
from onnx_gtco.plan.candidates import FLOAT_TYPES, group_dtype
from onnx_gtco.plan.types import Candidate, Plan

MIN_IR_VERSION = 10  # node/function `overload` needs IR 10


def fused_node(view: GraphView, cand: Candidate, precision: str) -> onnx.NodeProto:
    """The `ai.gtco` node a fused candidate becomes (its function's overload is set by rewrite): inputs and outputs
    in its family's role order, attributes through the family's encoder (opspec)."""
    spec = SPECS.get(cand.family)
    if spec is None:
        raise RewriteError(f"fused family {cand.family!r} has no opspec.OpSpec")
    inputs, roles = spec.order(dict(cand.roles), view.external_inputs(cand.nodes))
    outputs, out_roles = spec.order(dict(cand.outputs), view.external_outputs(cand.nodes), outputs=True)
    dtype = FLOAT_TYPES[group_dtype(view, cand.nodes)]  # type: ignore[index]
    first = view.nodes[min(cand.nodes)].name
    node = helper.make_node(op_type(cand.family, dtype), inputs, outputs, name=f"gtco/{cand.family}/{first}",
                            domain=DOMAIN)
    node.attribute.extend(spec.encode(dict(cand.attrs), precision, roles, out_roles))
    return node


def group_function(
    view: GraphView, cand: Candidate, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
    attr_names: Iterable[str], opsets: list[onnx.OperatorSetIdProto],
) -> onnx.FunctionProto:
    """The model-local function of a fused group: its nodes in order, renamed by position (x<i> inputs, y<j>
    outputs, t<k> the rest), the opsets they use, and an overload hashing the body (identical groups share one)."""
    rename: dict[str, str] = {t: f"x{i}" for i, t in enumerate(inputs)}
    rename.update({t: f"y{i}" for i, t in enumerate(outputs)})
    body: list[onnx.NodeProto] = []
    for k, i in enumerate(sorted(cand.nodes)):
        src = view.model.graph.node[i]
        node = onnx.NodeProto()
        node.CopyFrom(src)
        node.name = f"n{k}"
        for j, t in enumerate(src.input):
            node.input[j] = rename.get(t, t) if t else ""
        for j, t in enumerate(src.output):
            if t and t not in rename:
                rename[t] = f"t{len(rename)}"
            node.output[j] = rename.get(t, "") if t else ""
        node.ClearField("doc_string")
        body.append(node)
    used = {n.domain for n in body}
    fn = helper.make_function(
        DOMAIN, name, [f"x{i}" for i in range(len(inputs))], [f"y{i}" for i in range(len(outputs))], body,
        opset_imports=[o for o in opsets if o.domain in used],  # the loader spells the default domain ""
        attributes=sorted(attr_names),
    )
    fn.overload = "v" + hashlib.sha256(fn.SerializeToString(deterministic=True)).hexdigest()[:12]
    return fn


def rewrite(view: GraphView, plan: Plan, precision: str = "fp32") -> tuple[onnx.ModelProto, list[str]]:
    """The rewritten model, and the name given to each fused group's node (plan order, fused groups only).

    Args:
        view: view of the loaded (checked, shape-inferred) model the plan was made for.
        plan: the DP's plan; its groups cover every node once, in an executable order.
        precision: compute precision recorded on every fused node.
    """
    src = view.model
    graph = src.graph
    opsets = [o for o in src.opset_import if o.domain != DOMAIN]
    nodes: list[onnx.NodeProto] = []
    functions: dict[tuple[str, str], onnx.FunctionProto] = {}
    names: list[str] = []
    hidden: set[str] = set()
    for cand in plan.groups:
        if not cand.fused:
            nodes.append(graph.node[next(iter(cand.nodes))])
            continue
        node = fused_node(view, cand, precision)
        fname, inputs, outputs = node.op_type, tuple(node.input), tuple(node.output)
        fn = group_function(view, cand, fname, inputs, outputs, [a.name for a in node.attribute], opsets)
        functions.setdefault((fname, fn.overload), fn)
        node.overload = fn.overload
        nodes.append(node)
        names.append(node.name)
        hidden.update(o for i in cand.nodes for o in view.nodes[i].outputs if o and o not in outputs)
    new_graph = helper.make_graph(
        nodes, graph.name, list(graph.input), list(graph.output), list(graph.initializer),
        value_info=[vi for vi in graph.value_info if vi.name not in hidden],
        sparse_initializer=list(graph.sparse_initializer),
    )
    new_graph.doc_string = graph.doc_string
    model = helper.make_model(
        new_graph, opset_imports=[*opsets, helper.make_opsetid(DOMAIN, 1)],
        ir_version=max(src.ir_version, MIN_IR_VERSION),
        functions=[*src.functions, *(functions[k] for k in sorted(functions))],
        producer_name=src.producer_name, producer_version=src.producer_version,
    )
    model.model_version = src.model_version
    model.doc_string = src.doc_string
    model.metadata_props.extend(src.metadata_props)
    return model, names
