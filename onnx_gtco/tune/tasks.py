"""Tuning tasks: identical fused groups of a rewritten model are one task, weighted by how often they occur.

Two fused nodes are the same task when their kernel Problem (family, dtype, sizes, flags), the target arch and the
template version (a digest of the kernel headers, so a kernel change starts new studies instead of reusing stale
times) agree. ViT-B/16 has 12 identical layers: its per-layer groups are tasks of weight 12 (GTCO §3.4.2).

Run-time sizes that the instance does not fix (GEMM rows, LayerNorm / softmax rows) are part of the task: they
decide which configuration is fastest. They come from the node's shapes, a symbolic dim counting as 1.

A conv node's attributes hold its kernel, strides and pads (or auto_pad) but not x's shape, so its Problem comes
from its binder (families.conv.bind, through plugin.device.bound_problem): the Problem the library builds, from the
same shapes (a SAME conv's pads those of x's size), with the binder's refusals (a 3-D conv) as the reasons it has no
task. ResNet-50's repeated bottlenecks are then tasks of their repeat counts, as ViT's layers are.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx

from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.select import ALL_FAMILIES, model_dtypes, node_problem, shaped
from onnx_gtco.kernels.toolchain import headers_digest
from onnx_gtco.opspec import split_op_type
from onnx_gtco.plugin.binders import binder_for
from onnx_gtco.plugin.binding import Operand
from onnx_gtco.plugin.device import bound_problem
from onnx_gtco.plugin.nodes import make_fused_node

if TYPE_CHECKING:
    from onnx_gtco.ir.view import GraphView

ShapeOf = Callable[[str], tuple | None]
"""A tensor's shape by name: ints, strings for symbolic dims ("" for an unknown one); None when unknown."""


@dataclass(frozen=True)
class Task:
    """One kernel to tune.

    Attributes:
        problem: the kernel Problem (with the run-time sizes of the model).
        arch: "sm_80" or "sm_90".
        version: template version (digest of plugins/include and plugins/emu).
        weight: occurrences in the model (the budget scheduler's weight).
        nodes: names of the fused nodes it serves.
    """

    problem: Problem
    arch: str
    version: str
    weight: int = 1
    nodes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        """Stable name of the task: the study name in the tuning storage."""
        text = repr((self.problem.family, self.problem.dtype, self.problem.sizes, self.problem.flags, self.arch,
                     self.version))
        return f"{self.problem.family}-{self.arch}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    @property
    def problem_key(self) -> str:
        """The task's key without the template version: what a shipped tuning record (tune.records) is filed
        under. A record outlives a change of the kernel headers (which starts new studies); whether its
        configuration still fits is checked when it is used."""
        text = repr((self.problem.family, self.problem.dtype, self.problem.sizes, self.problem.flags, self.arch))
        return f"{self.problem.family}-{self.arch}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def describe(self) -> str:
        sizes = ",".join(f"{k}={v}" for k, v in self.problem.sizes)
        return f"{self.problem.family} {self.problem.dtype} {sizes} on {self.arch} (x{self.weight})"


def template_version() -> str:
    return headers_digest()[:12]


def task_attrs(task: Task) -> dict[str, Any]:
    """The task as JSON (a study's "task" user attribute; task_from_attrs reads it back)."""
    return {"family": task.problem.family, "dtype": task.problem.dtype,
            "sizes": [list(s) for s in task.problem.sizes],
            "flags": [[k, list(v) if isinstance(v, tuple) else v] for k, v in task.problem.flags],
            "arch": task.arch, "version": task.version}


def task_from_attrs(attrs: Mapping[str, Any]) -> Task:
    """The Task a study's user attributes describe: its "task" (task_attrs) and its "weight" (default 1)."""
    a = attrs["task"]
    flags = {k: tuple(v) if isinstance(v, list) else v for k, v in a["flags"]}
    problem = Problem.make(a["family"], a["dtype"], {k: v for k, v in a["sizes"]}, flags)
    return Task(problem, a["arch"], a["version"], int(attrs.get("weight", 1)))


def node_task(node: onnx.NodeProto, shape_of: ShapeOf, arch: str, version: str,
              out_dtype: str | None = None, function: onnx.FunctionProto | None = None) -> Task | str:
    """The task of one fused node (weight 1), or why it has none. `shape_of` gives a tensor's shape (ints, or
    strings for symbolic dims; None when unknown): the run-time rows of a row-wise node come from its first
    input, a symbolic dim counting as 1, and a conv's whole Problem from x's and w's shapes (shaped_problem).
    `out_dtype`: the dtype of its output tensor where known (a half GEMM writing fp32 is another instance,
    kernels.select.with_out_dtype, so another task). `function`: the node's model-local function, whose Conv the
    conv binder checks the node's auto_pad attribute against (None: a body without one)."""
    if shaped(split_op_type(node.op_type)[0]):  # with_out_dtype changes GEMMs only
        problem = shaped_problem(node, shape_of, function)
    else:
        problem = node_problem(node, out_dtype)
    if isinstance(problem, str):
        return problem
    if ALL_FAMILIES[problem.family].rowwise:
        shape = shape_of(node.input[0]) if node.input else None
        dims = [d if isinstance(d, int) and d > 0 else 1 for d in (shape or ())]
        rows = max(1, math.prod(dims[:-1])) if dims else 1
        problem = Problem.make(problem.family, problem.dtype, dict(problem.sizes) | {"rows": rows},
                               dict(problem.flags))
    return Task(problem, arch, version, 1, (node.name,))


def shaped_problem(node: onnx.NodeProto, shape_of: ShapeOf, function: onnx.FunctionProto | None = None
                   ) -> Problem | str:
    """The Problem the library builds for a node whose Problem needs shapes (kernels.select.shaped)
    (plugin.device.bound_problem of its binding), from the tensor shapes `shape_of` gives, or the binder's reason for
    refusing the node. Tensor dtypes are left unknown: a node planned on fp32 tensors (pipeline.measured_time) is the
    task of the half node the precision conversion makes of it, as node_problem's GEMM tasks are."""
    binder = binder_for(split_op_type(node.op_type)[0])
    if binder is None:
        return f"no binder for {node.op_type} (the node runs its function)"
    fused = make_fused_node(node, function or onnx.FunctionProto(), lambda t: Operand(t, "", shape_of(t)))
    binding = binder.bind(fused)
    return binding if isinstance(binding, str) else bound_problem(fused, binding)


def tensor_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Tensor name -> its shape as the model declares it (ints, dim names for symbolic dims): the graph's inputs,
    value_info, outputs and initializers."""
    out: dict[str, tuple] = {}
    for vi in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)
    for init in model.graph.initializer:
        out[init.name] = tuple(init.dims)
    return out


def model_shapes(model: onnx.ModelProto) -> ShapeOf:
    """The shapes a model's value_info, inputs, outputs and initializers record (a rewritten model read back)."""
    return tensor_shapes(model).get


def view_shapes(view: GraphView) -> ShapeOf:
    """The shapes of the plan's view (the loaded model's shape inference), as model_shapes gives them from the
    rewritten model: its value_info is the loaded model's, less the tensors inside fused groups."""

    def shape_of(name: str) -> tuple | None:
        info = view.info(name)
        if info is None or info.shape is None:
            return None
        return tuple("" if d is None else d for d in info.shape)

    return shape_of


def fused_node_tasks(model: onnx.ModelProto, arch: str, shape_of: ShapeOf | None = None
                     ) -> Iterator[tuple[onnx.NodeProto, Task | str]]:
    """Each fused node of a rewritten model with its task for `arch` (weight 1), or why it has none. `shape_of`
    (default: model_shapes(model)) gives the shapes of the nodes' inputs."""
    shape_of = shape_of or model_shapes(model)
    version = template_version()
    dtypes = model_dtypes(model)
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    for node in model.graph.node:
        if node.domain == "ai.gtco":
            yield node, node_task(node, shape_of, arch, version, dtypes.get(node.output[0]) if node.output else None,
                                  functions.get((node.domain, node.op_type, node.overload)))


def model_tasks(model: onnx.ModelProto, arch: str, shape_of: ShapeOf | None = None
                ) -> tuple[list[Task], dict[str, str]]:
    """The tasks of a rewritten model's fused nodes for `arch`, heaviest first, and why the others have none.
    `shape_of` as for fused_node_tasks."""
    found: dict[str, Task] = {}
    skipped: dict[str, str] = {}
    for node, task in fused_node_tasks(model, arch, shape_of):
        if isinstance(task, str):
            skipped[node.name] = task
            continue
        prev = found.get(task.key)
        found[task.key] = task if prev is None else Task(task.problem, arch, task.version, prev.weight + 1,
                                                         prev.nodes + task.nodes)
    tasks = sorted(found.values(), key=lambda t: (-t.weight, t.key))
    return tasks, skipped


def merge(tasks: Iterable[Task]) -> list[Task]:
    """Tasks of several models as one list: the same task's weights add up."""
    out: dict[str, Task] = {}
    for t in tasks:
        prev = out.get(t.key)
        out[t.key] = t if prev is None else Task(t.problem, t.arch, t.version, prev.weight + t.weight,
                                                 prev.nodes + t.nodes)
    return sorted(out.values(), key=lambda t: (-t.weight, t.key))


__all__ = ["ShapeOf", "Task", "fused_node_tasks", "merge", "model_shapes", "model_tasks",
           "node_task", "shaped_problem", "task_attrs", "task_from_attrs", "template_version", "tensor_shapes",
           "view_shapes"]
