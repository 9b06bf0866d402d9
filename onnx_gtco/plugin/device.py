"""Which generated kernel instance each bound fused node launches on the device, or why it has none.

A node's Problem comes from its attributes (kernels.select.node_problem), or from its binder when the kernel is
generated per node (an Elementwise node's program, bind_elementwise.node_problem); the binding then fixes the
operand flags the instance is built with (a LayerNorm whose residual sum is read outside writes it, a GEMM with a
bias input adds it, an attention node with a mask input reads it), so the instance's own argument checks and the
node agree. One
instance per arch slot of the glue (gtco::kArchSlots): sm_80 for 8.x GPUs, sm_90 for 9.x, and sm_90a for 9.0
GPUs, the arch-specific slot (wgmma: the CUTLASS GEMMs, kernels.cutlass). A node has an sm_90a instance of its own
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
from collections.abc import Mapping, Sequence

from onnx_gtco.config import TARGETS
from onnx_gtco.kernels.cublaslt import IMPL as CUBLASLT
from onnx_gtco.kernels.elementwise import FAMILY as ELEMENTWISE
from onnx_gtco.kernels.family import Instance, Problem
from onnx_gtco.kernels.gemm import FAMILY as GEMM
from onnx_gtco.kernels.select import Avoid, node_problem, select_instance, with_out_dtype
from onnx_gtco.plugin.binders import binder_for
from onnx_gtco.plugin.binding import Binding, FusedNode

ARCH_SLOTS = ("sm_80", "sm_90", "sm_90a")
"""gtco::kArchSlots, in slot order (gtco::arch_slot in plugins/ort/gtco_ort.h)."""
FALLBACK_SLOTS: Mapping[str, str] = {"sm_90a": "sm_90"}
"""An arch-specific slot -> the slot whose instance it holds for a node without a configuration of its own."""
EMULATED_ARCH = "sm_80"
"""The emulated device's arch (gtco_device_cc() returns 80 in an emulated build)."""

_ROLE_FLAGS: dict[str, tuple[tuple[str, str, int], ...]] = {
    # family -> (flag, "in"/"out", role index): the flag is whether the node has that operand
    "layernorm": (("residual", "in", 1), ("residual_out", "out", 1), ("gamma", "in", 2), ("beta", "in", 3)),
    "gemm": (("bias", "in", 2), ("residual", "in", 3), ("layer_scale", "in", 4)),
    "qkv": (("bias", "in", 4),),
    "attention": (("mask", "in", 3), ("bias", "in", 4)),
    "bmm_softmax": (("mask", "in", 3), ("bias", "in", 4)),
    "conv": (("bias", "in", 2), ("scale", "in", 3), ("shift", "in", 4), ("batchnorm", "in", 5), ("residual", "in", 7)),
}


def _with_flags(problem: Problem, **flags: object) -> Problem:
    return Problem.make(problem.family, problem.dtype, dict(problem.sizes), {**dict(problem.flags), **flags})


def _node_problem(node: FusedNode) -> Problem | str:
    """The binder's own Problem when it has one (a kernel generated per node, as elementwise programs are), else the
    one the node's attributes describe."""
    binder = binder_for(node.family)
    own = getattr(binder, "problem", None)
    return own(node) if own is not None else node_problem(node.node)


def select_config(problem: Problem, arch: str, config: Mapping[str, int] | None = None,
                  avoid: Avoid = ()) -> Instance | str:
    """select_instance (with `config`, else the family's first valid one not in `avoid`: instances ptxas rejected);
    the elementwise family, which is not tuned, always gets its first valid configuration not in `avoid`
    (kernels.select chooses only among the families whose Problem a node's attributes describe)."""
    if problem.family != ELEMENTWISE.name:
        return select_instance(problem, arch, config, avoid)
    configs = ELEMENTWISE.configs(problem, arch)
    if not configs:
        return f"no valid elementwise configuration for {arch} (every candidate failed its check)"
    for c in configs:
        inst = ELEMENTWISE.instantiate(problem, c, arch)
        if (inst.name, arch) not in avoid:
            return inst
    return f"each of the {len(configs)} valid elementwise configurations for {arch} spills or needs a stack frame"


def bound_problem(node: FusedNode, binding: Binding) -> Problem | str:
    """The node's Problem with the operand flags its binding fixes, or why it has none; no dtype check. The tuner
    (tune.tasks) takes a conv node's task from here, so the Problem it tunes is the one the library builds, also
    for a node planned on fp32 tensors that the precision conversion gives half ones (device_problem would refuse
    it on those fp32 tensors)."""
    problem = _node_problem(node)
    return problem if isinstance(problem, str) else _bound(problem, node, binding)


def _bound(problem: Problem, node: FusedNode, binding: Binding) -> Problem | str:
    flags = {}
    for flag, side, role in _ROLE_FLAGS.get(node.family, ()):
        roles = binding.inputs if side == "in" else binding.outputs
        flags[flag] = role < len(roles) and roles[role] >= 0
    if node.family == "gemm" and not flags.get("layer_scale"):
        flags.pop("layer_scale", None)  # a GEMM without it keeps the Problem (and tuning task) it always had
    rows = {"gemm": (("bias", 2), ("layer_scale", 4)), "qkv": (("bias", 4),)}.get(node.family, ())
    for role, index in rows:  # operands of one value per column
        if not flags.get(role):
            continue
        operand = node.inputs[binding.inputs[index]]
        n = problem.size("N") if node.family == "gemm" else None
        if operand.shape is not None and all(isinstance(d, int) for d in operand.shape):
            dims = [int(d) for d in operand.shape]
            if len(dims) == 0 or math.prod(dims[:-1]) != 1 or (n is not None and dims[-1] != n):
                return f"{role} of shape {dims}: the device kernel {'adds' if role == 'bias' else 'takes'} one row of N"
    return _with_flags(problem, **flags) if flags else problem


def device_problem(node: FusedNode, binding: Binding) -> Problem | str:
    """The Problem of the instance `node` launches, or why it launches none."""
    problem = _node_problem(node)
    if isinstance(problem, str):
        return problem
    if problem.dtype != node.dtype:
        precision = node.attrs.get("precision", "?")
        precision = precision.decode() if isinstance(precision, bytes) else precision
        return (f"computes in {problem.dtype} (precision {precision}) on {node.dtype} tensors; the device kernels "
                f"read and write their own dtype only (give the model {problem.dtype} tensors)")
    problem = _bound(problem, node, binding)
    if isinstance(problem, str):
        return problem
    out = binding.outputs[0] if binding.outputs else -1
    return with_out_dtype(problem, node.dtype, node.outputs[out].dtype) if 0 <= out < len(node.outputs) else problem


def default_own_config(problem: Problem, arch: str, avoid: Avoid = ()) -> Mapping[str, object] | None:
    """The configuration an arch-specific slot builds for `problem` when none is tuned, or None (the slot then holds
    its fallback slot's instance): on sm_90a the first CUTLASS configuration of a GEMM that 128x128 tiles fill the
    GPU with (a Hopper wgmma / TMA mainloop), where the CUTLASS headers are installed.

    Why: on an H200 the sm_80-style mma.sync GEMMs of ViT-B/16 at batch 64 ran at 230-300 TFLOP/s, 85% of the
    model's kernel time; a warp-specialized wgmma mainloop is what reaches the chip's 750+. Smaller GEMMs keep the
    sm_90 instance (a persistent 128x128 CUTLASS tile would leave most SMs idle) and no build compiles CUTLASS (30-60
    s of nvcc an instance) for a model without such GEMMs."""
    if arch != "sm_90a" or problem.family != "gemm":
        return None
    try:
        tiles = problem.size("batch") * math.ceil(problem.size("M") / 128) * math.ceil(problem.size("N") / 128)
    except KeyError:
        return None
    if tiles < TARGETS["sm_90"].sms:
        return None
    configs = [c for c in GEMM.configs(problem, arch) if c.get("impl") == "cutlass"
               and (GEMM.instance_name(problem, c, arch), arch) not in avoid]
    return configs[0] if configs else None


def device_instances(node: FusedNode, binding: Binding, archs: Sequence[str],
                     tuned: Mapping[str, Mapping[str, int]] | None = None, avoid: Avoid = ()
                     ) -> tuple[Instance, ...] | str:
    """The node's instance for each of `archs`, or why it has none. `tuned` maps an arch to the configuration the
    tuner found best for the node's task; one that does not fit the node's problem, or that ptxas rejected (`avoid`),
    falls back to the default, the family's first configuration not in `avoid`."""
    problem = device_problem(node, binding)
    if isinstance(problem, str):
        return problem
    tuned = tuned or {}
    out = []
    for arch in archs:
        config = tuned.get(arch)
        fallback = FALLBACK_SLOTS.get(arch)
        if fallback is not None:  # its own instance where asked for (or by default) and fitting, else the fallback's
            config = config or default_own_config(problem, arch, avoid)
            inst = select_config(problem, arch, config, avoid) if config else "no configuration"
            if isinstance(inst, str):
                arch, config = fallback, tuned.get(fallback)
            else:
                out.append(inst)
                continue
        inst = select_config(problem, arch, config, avoid)
        if isinstance(inst, str) and config:  # a tuned config that does not fit this node: the default
            inst = select_config(problem, arch, avoid=avoid)
        if isinstance(inst, str):
            return inst
        out.append(inst)
    return tuple(out)


def mma_fallbacks(instances: Sequence[Instance], avoid: Avoid = ()) -> tuple[Instance | str | None, ...]:
    """Per arch slot of a node's chosen `instances` (device_instances' answer), the generated mma GEMM instance that
    slot's cuBLASLt instance falls back to at run time, or why it has none; None where the slot's instance is not a
    cuBLASLt one (it needs no fallback).

    Why: a cuBLASLt instance can fail where a generated kernel cannot: libcublasLt absent from the machine, its
    heuristic offering no algorithm of the chosen rank for the run-time alignment, a plan that cannot be made
    (GTCO_ELIBRARY). The glue then launches the fallback on the same arguments (plugins/ort/gemm_op.h run_gemm),
    so a vendor failure never fails the session. The fallback computes the cuBLASLt instance's own Problem (the
    node's epilogue, output dtype) on that instance's arch: the family's first valid configuration without an
    "impl" (or with impl "mma"), whatever else the family offers first, whose instance ptxas did not reject
    (`avoid`)."""
    out: list[Instance | str | None] = []
    for inst in instances:
        if inst.config.get("impl") != CUBLASLT:
            out.append(None)
            continue
        problem, arch = inst.problem, inst.arch
        configs = [c for c in GEMM.configs(problem, arch) if c.get("impl", "mma") == "mma"]
        usable = [c for c in configs if (GEMM.instance_name(problem, c, arch), arch) not in avoid]
        if usable:
            out.append(GEMM.instantiate(problem, usable[0], arch))
        elif configs:
            out.append(f"each of the {len(configs)} valid mma GEMM configurations for {arch} spills or needs a stack "
                       "frame (ptxas)")
        else:
            out.append(f"no valid mma GEMM configuration for {arch} computes {inst.name}'s problem")
    return tuple(out)


__all__ = ["ARCH_SLOTS", "EMULATED_ARCH", "FALLBACK_SLOTS", "bound_problem", "default_own_config", "device_instances",
           "device_problem", "mma_fallbacks", "select_config"]
