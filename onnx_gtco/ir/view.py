"""A read-only view of a topologically sorted ONNX graph, the only thing planning looks at."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

Dim = int | str | None  # int: static extent, str: symbolic name, None: unknown


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs in a node's attributes (If branches, Loop and Scan bodies)."""
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def outer_scope_inputs(node: onnx.NodeProto) -> list[str]:
    """The names a node's subgraphs (nested ones included) read from the scope around the node, in first-use order:
    dependencies of the node that its input list does not show."""
    out: dict[str, None] = {}

    def walk(graph: onnx.GraphProto, outer_defined: set[str]) -> None:
        defined = set(outer_defined) | {v.name for v in graph.input} | {t.name for t in graph.initializer}
        defined |= {s.values.name for s in graph.sparse_initializer}
        for n in graph.node:
            for t in n.input:
                if t and t not in defined:
                    out.setdefault(t, None)
            for sub in subgraphs(n):
                walk(sub, defined)
            defined.update(n.output)

    for sub in subgraphs(node):
        walk(sub, set())
    return list(out)


@dataclass(frozen=True)
class TensorInfo:
    """Type of one tensor: ONNX element type and shape (None when the rank is unknown)."""

    name: str
    dtype: int
    shape: tuple[Dim, ...] | None

    @property
    def numel(self) -> int | None:
        """Element count when every dim is static, else None."""
        if self.shape is None or not all(isinstance(d, int) for d in self.shape):
            return None
        return int(np.prod(self.shape, dtype=np.int64))  # type: ignore[arg-type]

    @property
    def itemsize(self) -> int:
        if self.dtype == 0:
            return 4
        return int(np.dtype(helper.tensor_dtype_to_np_dtype(self.dtype)).itemsize)


@dataclass(frozen=True)
class Node:
    """One ONNX node: its index in topological order, and what it reads and writes."""

    id: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]

    def __hash__(self) -> int:
        return self.id


def _shape(type_proto: onnx.TypeProto) -> tuple[int, tuple[Dim, ...] | None]:
    if not type_proto.HasField("tensor_type"):
        return 0, None
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return tt.elem_type, None
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tt.elem_type, tuple(dims)


class GraphView:
    """Immutable planning view of `model.graph`, which must already be topologically sorted and shape-inferred.

    Node ids are positions in topological order. Edges go from producer to consumer; graph inputs and
    initializers have no producer.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        graph = model.graph
        self.nodes: tuple[Node, ...] = tuple(
            Node(
                i,
                n.name or f"{n.op_type}_{i}",
                n.op_type,
                "" if n.domain == "ai.onnx" else n.domain,
                tuple(n.input),
                tuple(n.output),
                {a.name: helper.get_attribute_value(a) for a in n.attribute},
            )
            for i, n in enumerate(graph.node)
        )
        self.graph_inputs: tuple[str, ...] = tuple(v.name for v in graph.input)
        self.graph_outputs: frozenset[str] = frozenset(v.name for v in graph.output)
        self._initializers = {t.name: t for t in graph.initializer}
        self.tensors: dict[str, TensorInfo] = {}
        for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
            dtype, shape = _shape(vi.type)
            self.tensors[vi.name] = TensorInfo(vi.name, dtype, shape)
        for t in graph.initializer:
            self.tensors[t.name] = TensorInfo(t.name, t.data_type, tuple(int(d) for d in t.dims))
        # what If / Loop / Scan bodies read from the graph around them: dependencies their input lists do not show
        self.outer_reads: tuple[tuple[str, ...], ...] = tuple(tuple(outer_scope_inputs(n)) for n in graph.node)
        self.producer: dict[str, int] = {}
        consumers: dict[str, list[int]] = {}
        for node in self.nodes:
            for o in node.outputs:
                if o:
                    self.producer[o] = node.id
            for t in (*node.inputs, *self.outer_reads[node.id]):
                if t:
                    consumers.setdefault(t, []).append(node.id)
        self.consumers: dict[str, tuple[int, ...]] = {k: tuple(dict.fromkeys(v)) for k, v in consumers.items()}
        self._constants: dict[str, np.ndarray] = {}
        for node in self.nodes:
            if node.op_type == "Constant" and node.domain == "":
                self._record_constant(node)

    def _record_constant(self, node: Node) -> None:
        for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
            if key in node.attrs:
                val = node.attrs[key]
                arr = numpy_helper.to_array(val) if isinstance(val, onnx.TensorProto) else np.asarray(val)
                self._constants[node.outputs[0]] = arr
                self.tensors.setdefault(
                    node.outputs[0],
                    TensorInfo(node.outputs[0], helper.np_dtype_to_tensor_dtype(arr.dtype), tuple(arr.shape)),
                )

    def __len__(self) -> int:
        return len(self.nodes)

    # --- tensors -------------------------------------------------------------------------------------
    def info(self, tensor: str) -> TensorInfo | None:
        return self.tensors.get(tensor)

    def shape(self, tensor: str) -> tuple[Dim, ...] | None:
        ti = self.tensors.get(tensor)
        return None if ti is None else ti.shape

    def is_initializer(self, tensor: str) -> bool:
        return tensor in self._initializers

    def is_constant(self, tensor: str) -> bool:
        """True for initializers and outputs of Constant nodes."""
        return tensor in self._initializers or tensor in self._constants

    def const_value(self, tensor: str) -> np.ndarray | None:
        """The value of an initializer or Constant output, else None."""
        if tensor in self._constants:
            return self._constants[tensor]
        if tensor in self._initializers:
            arr = numpy_helper.to_array(self._initializers[tensor])
            self._constants[tensor] = arr
            return arr
        return None

    def scalar(self, tensor: str) -> float | None:
        """The value of a constant with exactly one element, else None."""
        val = self.const_value(tensor)
        if val is None or val.size != 1:
            return None
        return float(val.reshape(-1)[0])

    # --- nodes and edges -----------------------------------------------------------------------------
    def producer_of(self, tensor: str) -> Node | None:
        pid = self.producer.get(tensor)
        return None if pid is None else self.nodes[pid]

    def consumers_of(self, tensor: str) -> tuple[Node, ...]:
        return tuple(self.nodes[i] for i in self.consumers.get(tensor, ()))

    @cached_property
    def preds(self) -> tuple[frozenset[int], ...]:
        return tuple(
            frozenset(self.producer[t] for t in (*n.inputs, *self.outer_reads[n.id]) if t in self.producer)
            for n in self.nodes
        )

    @cached_property
    def succs(self) -> tuple[frozenset[int], ...]:
        out: list[set[int]] = [set() for _ in self.nodes]
        for n in self.nodes:
            for p in self.preds[n.id]:
                out[p].add(n.id)
        return tuple(frozenset(s) for s in out)

    @cached_property
    def succ_mask(self) -> tuple[int, ...]:
        """Successors of each node as a bitmask over node ids."""
        return tuple(sum(1 << s for s in ss) for ss in self.succs)

    @cached_property
    def desc_mask(self) -> tuple[int, ...]:
        """Strict descendants of each node as a bitmask (nodes are in topological order)."""
        out = [0] * len(self.nodes)
        for i in range(len(self.nodes) - 1, -1, -1):
            m = 0
            for s in self.succs[i]:
                m |= (1 << s) | out[s]
            out[i] = m
        return tuple(out)

    @cached_property
    def anc_mask(self) -> tuple[int, ...]:
        """Strict ancestors of each node as a bitmask."""
        out = [0] * len(self.nodes)
        for i in range(len(self.nodes)):
            m = 0
            for p in self.preds[i]:
                m |= (1 << p) | out[p]
            out[i] = m
        return tuple(out)

    def external_inputs(self, ids: frozenset[int]) -> tuple[str, ...]:
        """Tensors a node set reads that it does not produce, in first-use order (no empty names)."""
        made = {o for i in ids for o in self.nodes[i].outputs if o}
        seen: dict[str, None] = {}
        for i in sorted(ids):
            for t in self.nodes[i].inputs:
                if t and t not in made:
                    seen.setdefault(t, None)
        return tuple(seen)

    def external_outputs(self, ids: frozenset[int]) -> tuple[str, ...]:
        """Tensors a node set produces that are graph outputs or read by a node outside it."""
        out: list[str] = []
        for i in sorted(ids):
            for o in self.nodes[i].outputs:
                if not o:
                    continue
                if o in self.graph_outputs or any(c not in ids for c in self.consumers.get(o, ())):
                    out.append(o)
        return tuple(out)
