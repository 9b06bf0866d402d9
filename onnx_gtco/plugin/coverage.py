"""Which fused nodes get a device kernel, decided without compiling anything.

A fused node runs a device kernel when its family's binder binds it and plugin.device finds it an instance for every
arch slot of the CUDA build (select_device; decided per node: a node without one runs its function, its siblings of
the same op type keep theirs). That
is a property of the node and of the kernel families, not of the toolchain: it needs neither nvcc nor a GPU, and
holds for a model written with --no-build too. The library builder and this module ask the same functions
(library.bind_nodes, library.select_device), so the report says what a CUDA build of the model registers.

- `model_coverage(model)`: every fused node of a rewritten model, with the arch slots it has device kernels for or
  why it has none (the report's `device` entry).
- `candidate_coverage(view, precision)`: the same question for a candidate group before any rewrite (the planner
  costs a group without a device kernel as the nodes its function runs), node by node: what an op type's other
  nodes decide is known only once the model is rewritten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from onnx_gtco.calibration import Hardware, hardware
from onnx_gtco.errors import GtcoError
from onnx_gtco.ir.view import GraphView
from onnx_gtco.ir.view import TensorInfo as PlanTensor
from onnx_gtco.kernels.family import Instance, Problem
from onnx_gtco.opspec import DOMAIN, decode_node, op_type, split_op_type
from onnx_gtco.plan.types import Candidate
from onnx_gtco.plugin.binding import Binding, FusedNode, Operand
from onnx_gtco.plugin.device import ARCH_SLOTS, device_instances, device_problem, estimate_instance
from onnx_gtco.plugin.library import bind_node, bind_nodes, select_device
from onnx_gtco.plugin.nodes import DTYPE_NAMES, fused_nodes, make_fused_node
from onnx_gtco.precision import DTYPE_TAG, HALF_TYPES, to_half
from onnx_gtco.rewrite import fused_node, group_function


@dataclass(frozen=True)
class Coverage:
    """Where one fused node runs on the GPU.

    Attributes:
        archs: the arch slots (device.ARCH_SLOTS) it has a device kernel for.
        reason: why it has none (None when `archs` is not empty).
        kernel: the instance the planning target's slot runs (target_slot), where it has one: its name and
            configuration (the same selection the build makes).
        us: that instance's estimated time per launch on the planning target (its family's estimate_us).
    """

    archs: tuple[str, ...] = ()
    reason: str | None = None
    kernel: tuple[str, dict[str, object]] | None = None
    us: float | None = None

    def on(self, arch: str) -> bool:
        return arch in self.archs


def target_slot(hw: Hardware, archs: Sequence[str] = ARCH_SLOTS) -> str:
    """The arch slot a GPU of the target runs (gtco::arch_slot): a 9.0 GPU (H100, H200) the arch-specific sm_90a
    where the build has it, else its arch's."""
    return "sm_90a" if hw.arch == "sm_90" and "sm_90a" in archs else hw.arch


@dataclass(frozen=True)
class ModelCoverage:
    """The Coverage of every fused node of a rewritten model.

    Attributes:
        archs: the arch slots asked about.
        nodes: fused node name -> its Coverage.
        error: why the nodes could not be read (then `nodes` is empty), else None.
    """

    archs: tuple[str, ...]
    nodes: dict[str, Coverage]
    error: str | None = None


def model_coverage(model: onnx.ModelProto, archs: Sequence[str] = ARCH_SLOTS,
                   planned: Callable[[str], PlanTensor | None] | None = None, hw: Hardware | None = None
                   ) -> ModelCoverage:
    """Every fused node of `model` with its Coverage in a CUDA build for `archs` (what build_library(model, out,
    cuda=True) registers for the CUDA EP), without compiling. `planned`: the tensors' types as the plan knows them
    (plugin.nodes.fused_nodes). A model whose fused nodes cannot be read (a node without its function, shape
    inference failing) has `error` set instead."""
    slots = tuple(archs)
    try:
        nodes = fused_nodes(model, planned)
    except GtcoError as e:
        return ModelCoverage(slots, {}, str(e))
    results, _ = bind_nodes(nodes)
    found, why = select_device(nodes, results, slots, hw=hw)
    return ModelCoverage(slots, {r.node: Coverage(slots) if r.node in found else Coverage((), r.reason or why[r.node])
                                 for r in results})


def candidate_node(view: GraphView, cand: Candidate, precision: str) -> FusedNode:
    """The FusedNode a fused candidate becomes: its `ai.gtco` node (rewrite.fused_node), a function holding its
    nodes under the names the rewrite gives them (x<i> inputs, y<j> outputs, t<k> the rest), and what the loaded
    model's shape inference and constants say of its inputs and outputs. In a half precision, as the conversion
    makes it (onnx_gtco.precision): the half op type, and the fp32 tensors its kernel reads and writes in the half
    type."""
    node = fused_node(view, cand, precision)
    half = HALF_TYPES.get(precision)
    family, dtype = split_op_type(node.op_type)
    converts = half is not None and dtype == "f32"
    if converts:
        node.op_type = op_type(family, DTYPE_TAG[half])
        op = decode_node(node)
        read = set(op.inputs.values()) if not isinstance(op, str) and op.inputs else set(range(len(node.input)))
        halves = {t for i, t in enumerate(node.input) if i in read} | set(node.output)
    function = group_function(view, cand, node.op_type, tuple(node.input), tuple(node.output),
                              [a.name for a in node.attribute],
                              [o for o in view.model.opset_import if o.domain != DOMAIN])
    inits = {t.name: t for t in view.model.graph.initializer}

    def info(t: str) -> Operand:
        got = _info(view, inits, t)
        if not converts or t not in halves or got.dtype != "f32":
            return got
        value = None if got.value is None else to_half(got.value, half)  # type: ignore[arg-type]
        return Operand(t, DTYPE_TAG[half], got.shape, value)  # type: ignore[index]

    return make_fused_node(node, function, info)


def _info(view: GraphView, inits: dict[str, onnx.TensorProto], tensor: str) -> Operand:
    """plugin.nodes.fused_nodes's Operand of a tensor, from the view: dtype, shape (a symbolic dim by its name,
    an unknown one as "?") and the value of an initializer held in memory or of a Constant's `value`."""
    ti = view.info(tensor)
    shape = None if ti is None or ti.shape is None else tuple(
        d if isinstance(d, int) else (d or "?") for d in ti.shape)
    dtype = DTYPE_NAMES.get(ti.dtype, "") if ti is not None else ""
    return Operand(tensor, dtype, shape, _value(view, inits, tensor))


def _value(view: GraphView, inits: dict[str, onnx.TensorProto], tensor: str) -> np.ndarray | None:
    init = inits.get(tensor)
    if init is not None:
        return None if external_data_helper.uses_external_data(init) else numpy_helper.to_array(init)
    producer = view.producer_of(tensor)
    if producer is not None and producer.op_type == "Constant" and producer.domain == "" and "value" in producer.attrs:
        return numpy_helper.to_array(producer.attrs["value"])
    return None


def candidate_coverage(view: GraphView, precision: str, archs: Sequence[str] = ARCH_SLOTS,
                       hw: Hardware | None = None) -> Callable[[Candidate], Coverage]:
    """Candidate -> the Coverage its fused node would have on its own (bound by its binder, an instance for each
    of `archs`, selected as the build selects them for the planning target `hw`), with the instance of the
    target's slot and its estimate on `hw` (by default the data-sheet target of sm_90); an unfused candidate has
    none. Answers are cached per candidate, and the selection per device problem (a transformer's layers repeat
    the same problems)."""
    slots = tuple(archs)
    hw = hw or hardware("sm_90")
    slot = target_slot(hw, slots)
    seen: dict[Candidate, Coverage] = {}
    selected: dict[Problem, tuple[Instance, ...] | str] = {}

    def instances(node: FusedNode, bound: Binding) -> tuple[Instance, ...] | str:
        problem = device_problem(node, bound)
        if isinstance(problem, str):
            return problem
        if problem not in selected:
            selected[problem] = device_instances(node, bound, slots, hw=hw)
        return selected[problem]

    def coverage(cand: Candidate) -> Coverage:
        if not cand.fused:
            return Coverage((), "not fused")
        if cand not in seen:
            node = candidate_node(view, cand, precision)
            bound = bind_node(node)
            got = bound if isinstance(bound, str) else instances(node, bound)
            if isinstance(got, str):
                seen[cand] = Coverage((), got)
            elif slot in slots:
                inst = got[slots.index(slot)]
                seen[cand] = Coverage(slots, None, (inst.name, dict(inst.config)), estimate_instance(inst, hw, node))
            else:
                seen[cand] = Coverage(slots)
        return seen[cand]

    return coverage


__all__ = ["Coverage", "ModelCoverage", "candidate_coverage", "candidate_node", "model_coverage",
           "target_slot"]
