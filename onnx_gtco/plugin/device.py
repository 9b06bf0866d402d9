"""Which generated kernel instance each bound fused node launches on the device, or why it has none.

A node's Problem comes from its attributes (kernels.select.node_problem), or from its binder when the kernel is
generated per node (an Elementwise node's program, bind_elementwise.node_problem); the binding then fixes the
operand flags the instance is built with (a LayerNorm whose residual sum is read outside writes it, a GEMM with a
bias input adds it, an attention node with a mask input reads it), so the instance's own argument checks and the
node agree. One
instance per arch slot of the glue (gtco::kArchSlots): sm_80 for 8.x GPUs, sm_90 for 9.x, and sm_90a for 9.0
GPUs, the arch-specific slot (wgmma: the CUTLASS GEMMs, families.gemm.cutlass). A node has an sm_90a instance of its own
where `tuned` names a configuration for sm_90a (the tuner's or the caller's choice), or, untuned, where it is a GEMM
big enough for CUTLASS's 128x128 tiles to fill the GPU (`default_own_config`); otherwise that slot holds its sm_90
instance, so a 9.0 device runs what every 9.x runs and a model of small GEMMs compiles no CUTLASS kernel (each takes
30-60 s of nvcc). An emulated build (plugins/emu) has one device, an sm_80.

A slot whose instance is a cuBLASLt one (impl "cublaslt") also gets an mma fallback instance (mma_fallbacks), which
the glue launches where cuBLASLt cannot run (libcublasLt absent, no algorithm of the chosen rank), so a vendor
failure never fails the session.

A node gets no instance, with the reason, when its Problem has none (symbolic sizes the kernel is built for, a
causal mask, ...), or when its kernel dtype differs from its tensors' dtype: an fp32 model optimized with
--precision fp16 keeps fp32 tensors between its nodes, and the device kernels read and write their own dtype only
(no casts are fused in but one: a half GEMM whose output tensor is fp32, a graph output the conversion folded into
it, gets the instance with the output cast in its epilogue, kernels.select.with_out_dtype). An fp32 model optimized
with --precision fp32 gets fp32 instances of every family (TF32 on the Tensor Core ones).
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence

from onnx_gtco.calibration import Hardware, hardware_for_arch
from onnx_gtco.kernels.family import Instance, Problem
from onnx_gtco.kernels.select import (
    ALL_FAMILIES,
    FAMILIES,
    MMA_ONLY,
    Avoid,
    candidates,
    fallible,
    fastest,
    node_problem,
    select_instance,
    with_out_dtype,
)
from onnx_gtco.opspec import FP8_DTYPE
from onnx_gtco.plugin.binders import binder_for
from onnx_gtco.plugin.binding import Binding, FusedNode

ARCH_SLOTS = ("sm_80", "sm_90", "sm_90a")
"""gtco::kArchSlots, in slot order (gtco::arch_slot in plugins/ort/gtco_ort.h)."""
FALLBACK_SLOTS: Mapping[str, str] = {"sm_90a": "sm_90"}
"""An arch-specific slot -> the slot whose instance it holds for a node without a configuration of its own."""
EMULATED_ARCH = "sm_80"
"""The emulated device's arch (gtco_device_cc() returns 80 in an emulated build)."""

def _with_flags(problem: Problem, **flags: object) -> Problem:
    return Problem.make(problem.family, problem.dtype, dict(problem.sizes), {**dict(problem.flags), **flags})


def _node_problem(node: FusedNode) -> Problem | str:
    """The binder's own Problem when it has one (a kernel generated per node, as elementwise programs are), else the
    one the node's attributes describe."""
    binder = binder_for(node.family)
    own = getattr(binder, "problem", None)
    return own(node) if own is not None else node_problem(node.node)


def select_config(problem: Problem, arch: str, config: Mapping[str, int] | None = None, avoid: Avoid = (),
                  hw: Hardware | None = None, impls: Container[str] | None = None) -> Instance | str:
    """select_instance (with `config`, else the candidate the estimate predicts fastest on the arch's hardware, `hw`
    where it runs the arch: calibration.hardware_for_arch; none in `avoid`, which ptxas rejected, none of an
    implementation outside `impls`); a family generated per group (KernelFamily.per_group: the elementwise
    programs), which is not tuned and has one implementation, always gets its first valid configuration not in
    `avoid` (kernels.select chooses only among the families whose Problem a node's attributes describe)."""
    family = ALL_FAMILIES[problem.family]
    if not family.per_group:
        return select_instance(problem, arch, config, avoid, hw, impls)
    configs = family.configs(problem, arch)
    if not configs:
        return f"no valid {family.name} configuration for {arch} (every candidate failed its check)"
    for c in configs:
        inst = family.instantiate(problem, c, arch)
        if (inst.name, arch) not in avoid:
            return inst
    return f"each of the {len(configs)} valid {family.name} configurations for {arch} spills or needs a stack frame"


def run_time_problem(problem: Problem, node: FusedNode | None) -> Problem:
    """`problem` with the run-time sizes a node's attributes leave out: a row-wise node's rows, from its first
    input's shape (a symbolic dim counting as 1, as the tuner's tasks count it: tune.tasks.node_task)."""
    if node is None or not ALL_FAMILIES[problem.family].rowwise or not node.inputs or node.inputs[0].shape is None:
        return problem
    dims = [d if isinstance(d, int) and d > 0 else 1 for d in node.inputs[0].shape]
    rows = max(1, math.prod(dims[:-1])) if dims else 1
    return Problem.make(problem.family, problem.dtype, dict(problem.sizes) | {"rows": rows}, dict(problem.flags))


def estimate_instance(inst: Instance, hw: Hardware | None = None, node: FusedNode | None = None) -> float:
    """The estimated time of one launch of `inst` (its family's estimate_us on its arch's hardware: `hw` where that
    runs the arch), for `node`'s run-time sizes where given (run_time_problem)."""
    family = ALL_FAMILIES[inst.problem.family]
    problem = run_time_problem(inst.problem, node)
    return float(family.estimate_us(problem, inst.config, hardware_for_arch(inst.arch, hw)))  # type: ignore[attr-defined]


def bound_problem(node: FusedNode, binding: Binding) -> Problem | str:
    """The node's Problem with the operand flags its binding fixes, or why it has none; no dtype check. The tuner
    (tune.tasks) takes a conv node's task from here, so the Problem it tunes is the one the library builds, also
    for a node planned on fp32 tensors that the precision conversion gives half ones (device_problem would refuse
    it on those fp32 tensors)."""
    problem = _node_problem(node)
    return problem if isinstance(problem, str) else _bound(problem, node, binding)


def _bound(problem: Problem, node: FusedNode, binding: Binding) -> Problem | str:
    """`problem` with the flags the binding's operands fix (the binder's `operand_flags`), or why the device
    kernel cannot take those operands."""
    binder = binder_for(node.family)
    operand_flags = getattr(binder, "operand_flags", None)
    flags = operand_flags(node, binding, problem) if operand_flags is not None else {}
    if isinstance(flags, str):
        return flags
    return _with_flags(problem, **flags) if flags else problem


def device_problem(node: FusedNode, binding: Binding) -> Problem | str:
    """The Problem of the instance `node` launches, or why it launches none."""
    problem = _node_problem(node)
    if isinstance(problem, str):
        return problem
    if problem.dtype != node.dtype and not (node.dtype == FP8_DTYPE and problem.flag("fp8", False)):
        precision = node.attrs.get("precision", "?")
        precision = precision.decode() if isinstance(precision, bytes) else precision
        return (f"computes in {problem.dtype} (precision {precision}) on {node.dtype} tensors; the device kernels "
                f"read and write their own dtype only (give the model {problem.dtype} tensors)")
    problem = _bound(problem, node, binding)
    if isinstance(problem, str):
        return problem
    out = binding.outputs[0] if binding.outputs else -1
    return with_out_dtype(problem, node.dtype, node.outputs[out].dtype) if 0 <= out < len(node.outputs) else problem


def slot_estimate(problem: Problem, hw: Hardware) -> tuple[dict[str, object], float] | None:
    """The configuration a GPU of the target `hw` would run for `problem` by default, with its estimate: the fastest
    candidate of its slot (target_slot: on a 9.0 GPU the better of sm_90a's own and the sm_90 fallback), or None
    where the family offers none."""
    best = fastest(problem, hw.arch, candidates(problem, hw.arch), hw)
    if hw.arch in FALLBACK_SLOTS.values():
        own = next((a for a, f in FALLBACK_SLOTS.items() if f == hw.arch), None)
        mine = fastest(problem, own, candidates(problem, own), hw) if own else None
        if mine is not None and (best is None or mine[1] < best[1]):
            best = mine
    return best


def own_config(problem: Problem, arch: str, fallback: Instance | None, avoid: Avoid = (), hw: Hardware | None = None,
               impls: Container[str] | None = None) -> Mapping[str, object] | None:
    """The configuration an arch-specific slot (sm_90a) builds for `problem` when none is tuned, or None (the slot
    then holds its fallback slot's instance, `fallback`): its own configuration the estimate predicts fastest
    (CUTLASS's wgmma / TMA GEMMs) where that beats the fallback's instance on the same hardware, so a model of
    GEMMs that the fallback runs faster compiles no CUTLASS kernel (30-60 s of nvcc an instance)."""
    if arch not in FALLBACK_SLOTS or not ALL_FAMILIES[problem.family].arch_specific:
        return None
    pick = fastest(problem, arch, candidates(problem, arch, avoid, impls), hw)
    if pick is None:
        return None
    if fallback is not None and estimate_instance(fallback, hw) <= pick[1]:
        return None
    return pick[0]


def device_instances(node: FusedNode, binding: Binding, archs: Sequence[str],
                     tuned: Mapping[str, Mapping[str, int]] | None = None, avoid: Avoid = (),
                     hw: Hardware | None = None, impls: Container[str] | None = None) -> tuple[Instance, ...] | str:
    """The node's instance for each of `archs`, or why it has none. `tuned` maps an arch to the configuration the
    tuner found best for the node's task; one that does not fit the node's problem, or that ptxas rejected (`avoid`),
    falls back to the default: the candidate the estimate predicts fastest (on `hw`, the planning target, for the
    slots it runs; else on each arch's data-sheet target), of the implementations in `impls` (None: every one; an
    emulated build runs the generated kernels only)."""
    problem = device_problem(node, binding)
    if isinstance(problem, str):
        return problem
    tuned = tuned or {}
    out: list[Instance] = []
    for arch in archs:
        config = tuned.get(arch)
        fallback = FALLBACK_SLOTS.get(arch)
        if fallback is not None:  # its own instance where asked for (or by default) and fitting, else the fallback's
            held = out[archs.index(fallback)] if fallback in archs[:len(out)] else None
            config = config or own_config(problem, arch, held, avoid, hw, impls)
            inst = select_config(problem, arch, config, avoid) if config else "no configuration"
            if isinstance(inst, str):
                if held is not None and not tuned.get(fallback):
                    out.append(held)
                    continue
                arch, config = fallback, tuned.get(fallback)
            else:
                out.append(inst)
                continue
        inst = select_config(problem, arch, config, avoid, hw, impls)
        if isinstance(inst, str) and config:  # a tuned config that does not fit this node: the default
            inst = select_config(problem, arch, avoid=avoid, hw=hw, impls=impls)
        if isinstance(inst, str):
            return inst
        out.append(inst)
    return tuple(out)


def mma_fallbacks(instances: Sequence[Instance], avoid: Avoid = (), hw: Hardware | None = None
                  ) -> tuple[Instance | str | None, ...]:
    """Per arch slot of a node's chosen `instances` (device_instances' answer), the family's generated (mma) instance
    that slot's library instance falls back to at run time, or why it has none; None where the slot's instance
    cannot fail (it needs no fallback: select.fallible, Implementation.fallible).

    Why: a cuBLASLt instance can fail where a generated kernel cannot: libcublasLt absent from the machine, its
    heuristic offering no algorithm of the chosen rank for the run-time alignment, a plan that cannot be made
    (GTCO_ELIBRARY). The glue then launches the fallback on the same arguments (plugins/families/gemm/gemm_op.h
    run_gemm), so a vendor failure never fails the session. The fallback computes the cuBLASLt instance's own Problem
    (the node's epilogue, output dtype) on that instance's arch: the mma configuration the estimate predicts fastest on
    `hw` (the planning target where it runs the arch), whose instance ptxas did not reject (`avoid`)."""
    out: list[Instance | str | None] = []
    for inst in instances:
        if not fallible(inst):
            out.append(None)
            continue
        problem, arch = inst.problem, inst.arch
        offered = candidates(problem, arch, impls=MMA_ONLY)
        pick = fastest(problem, arch, candidates(problem, arch, avoid, MMA_ONLY), hw)
        if pick is not None:
            out.append(FAMILIES[problem.family].instantiate(problem, pick[0], arch))
        elif offered:
            out.append(f"each of the {len(offered)} valid mma {problem.family.upper()} configurations for {arch} "
                       "spills or needs a stack frame (ptxas)")
        else:
            out.append(f"no valid mma {problem.family.upper()} configuration for {arch} computes {inst.name}'s "
                       "problem")
    return tuple(out)


__all__ = ["ARCH_SLOTS", "EMULATED_ARCH", "FALLBACK_SLOTS", "bound_problem", "device_instances", "device_problem",
           "estimate_instance", "mma_fallbacks", "own_config", "run_time_problem", "select_config", "slot_estimate"]
