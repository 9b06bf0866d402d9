"""What the fusion-rule tests share: a tiny graph builder, and running rules by node name (the `kit` fixture,
tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.patterns import rules
from onnx_gtco.patterns.base import Match, Pattern
from onnx_gtco.plan.candidates import collect
from onnx_gtco.plan.types import Candidate, Reject


class Builder:
    """Builds a small float32 graph; every node output is named after its node, so tests speak in names."""

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[str] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)

    def input(self, name: str, shape: list[int | str], dtype: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def const(self, name: str, value: Any) -> str:
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def weight(self, name: str, *shape: int) -> str:
        return self.const(name, self.rng.standard_normal(shape).astype(np.float32) * 0.1)

    def op(self, op_type: str, inputs: list[str], name: str, outputs: int = 1, **attrs: Any) -> str:
        """Adds a node named `name`; its outputs are `name` (and `name:1`, ... when there are several)."""
        outs = [name] + [f"{name}:{i}" for i in range(1, outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return name

    def output(self, *names: str) -> None:
        self.outputs.extend(names)

    def model(self, opset: int = 17) -> onnx.ModelProto:
        """The model; graph output types are taken from shape inference."""
        outs = [helper.make_empty_tensor_value_info(o) for o in self.outputs]
        graph = helper.make_graph(self.nodes, "g", self.inputs, outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
        for out in model.graph.output:
            out.type.CopyFrom(inferred[out.name].type)
        return model

    def view(self, opset: int = 17) -> GraphView:
        return GraphView(load_model(self.model(opset)))


class Kit:
    """What the rule tests share: a graph builder and ways to run rules and read results by node name."""

    graph = Builder

    @staticmethod
    def names(view: GraphView, ids: frozenset[int]) -> set[str]:
        return {view.nodes[i].name for i in ids}

    @staticmethod
    def run(pattern: Pattern, view: GraphView) -> tuple[list[Match], list[Reject]]:
        """A rule's matches and rejects, in the order it yields them."""
        out = list(pattern.match(view))
        return [m for m in out if isinstance(m, Match)], [r for r in out if isinstance(r, Reject)]

    @classmethod
    def groups(cls, view: GraphView, found: list[Match] | list[Candidate], family: str | None = None
               ) -> list[set[str]]:
        """Node-name sets of matches or candidates (of one family), in the order they came."""
        return [cls.names(view, m.nodes) for m in found if family is None or m.family == family]

    @staticmethod
    def collect(view: GraphView, max_size: int = 48) -> tuple[list[Candidate], list[Reject]]:
        """All registered rules through the legality checks, as the pipeline runs them."""
        return collect(view, rules(), max_size)


    @staticmethod
    def uncovered(view: GraphView, cands: list[Candidate]) -> dict[str, list[str]]:
        """Softmaxes outside every "attention" / "bmm_softmax" candidate, and MatMul/Gemm/Conv in none."""
        out: dict[str, list[str]] = {}
        softmaxes = [n for n in view.nodes if n.op_type == "Softmax"]
        for family in ("attention", "bmm_softmax"):
            inside = set().union(*(c.nodes for c in cands if c.family == family))
            out[family] = [n.name for n in softmaxes if n.id not in inside]
        fused = set().union(*(c.nodes for c in cands))
        heavy = [n for n in view.nodes if n.op_type in ("MatMul", "Gemm", "Conv")]
        out["matmul"] = [n.name for n in heavy if n.id not in fused]
        return out
