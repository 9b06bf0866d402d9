"""Which kernel a fused node runs: the Problem its attributes describe, and the instance built for it.

A fused node (onnx_gtco.rewrite) carries what its kernel needs as attributes: GEMM sizes and epilogue, attention heads
and layouts, LayerNorm's hidden size, ... Read back through the one decoder (opspec.decode), `problem_for` turns
them into the kernel family's Problem, or says why
no kernel serves the node (the node then keeps running its model-local function). `select_instance` picks, for an
architecture, the configuration the estimate (each family's `estimate_us`, with the target GPU's fitted constants:
onnx_gtco.calibration) predicts fastest among the family's offered ones (`candidates`: for a GEMM the mma tiles,
on sm_90a CUTLASS's, and cuBLASLt where its epilogue maps); the tuner's configuration, where a task has one,
replaces that choice. The planner prices every fused group with the same selection and estimate.

Kernel dtype: the node's compute precision when it is fp16 / bf16, else the node's own I/O dtype. Every family has
fp32 kernels: with precision fp32 the Tensor Core families (gemm and qkv, attention, bmm_softmax) compute in TF32
(mma.m16n8k8 on operands rounded by cvt.rna to 10 mantissa bits; fp32 accumulation, softmax statistics and I/O:
what ORT's CUDA EP does for fp32 by default with use_tf32), the others (LayerNorm, softmax, elementwise) in plain
fp32.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Mapping
from pathlib import Path
from typing import Any

import onnx

from onnx_gtco import families
from onnx_gtco.calibration import Hardware, hardware_for_arch
from onnx_gtco.kernels.family import DTYPES, Implementation, Instance, KernelFamily, OpKernel, Problem
from onnx_gtco.opspec import FP8_DTYPE, FusedOp, decode_node

ALL_FAMILIES: dict[str, KernelFamily] = {k.name: k for part in families.parts("kernel") for k in part.KERNELS}
"""Every kernel family by name, from each family's kernel module (onnx_gtco.families)."""
FAMILIES: dict[str, KernelFamily] = {name: k for name, k in ALL_FAMILIES.items() if not k.per_group}
"""The kernel families a node's attributes select an instance of (the elementwise family is generated per group and
selected by its own binder; the conv family's Problem needs the input's shape, which its binder reads:
families.conv.bind)."""

OPS: dict[str, OpKernel] = {o.op: o for part in families.parts("kernel") for o in part.OPS}
"""Fused op family -> how its nodes reach their kernel family (each family kernel module's OPS)."""

IMPLEMENTATIONS: dict[str, Implementation] = {i.name: i for f in ALL_FAMILIES.values() for i in f.implementations}
"""Every family's library implementations (KernelFamily.implementations) by the name a configuration's "impl"
gives; the family's own generated kernels ("mma") are none of them."""


def implementation(config: Mapping[str, Any]) -> Implementation | None:
    """The library implementation a configuration names (its "impl"), or None for the family's own kernels."""
    return IMPLEMENTATIONS.get(str(config.get("impl", "mma")))


def fallible(instance: Instance) -> bool:
    """Whether `instance` can fail at run time where a generated kernel cannot, so its node keeps an mma fallback
    (Implementation.fallible: cuBLASLt's)."""
    impl = implementation(instance.config)
    return impl is not None and impl.fallible


def impl_include_dirs(instance: Instance, emulated: bool) -> list[Path]:
    """The folders `instance` compiles against beyond the device headers and its own include folders: its
    implementation's (Implementation.include_dirs: cuBLASLt's header, fetched on first use); BuildError naming what
    is missing."""
    impl = implementation(instance.config)
    return [] if impl is None or impl.include_dirs is None else list(impl.include_dirs(emulated))

_PRECISION_DTYPE = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}


def kernel_dtype(family: str, io_dtype: str, precision: str) -> str:
    """The dtype a kernel of `family` computes in: the precision when it is fp16 / bf16, else the node's I/O dtype
    (every family takes f16, bf16 and f32; f32 on the Tensor Core families is TF32)."""
    del family  # every family takes the same dtypes
    want = _PRECISION_DTYPE.get(precision, io_dtype)
    return want if want != "f32" else io_dtype


def problem_for(op: FusedOp) -> Problem | str:
    """The kernel Problem of a fused node read through its spec (opspec.decode), or why there is none."""
    found = OPS.get(op.family)
    if found is None:
        return f"no {op.family} kernel family (the node runs its function)"
    if op.dtype == FP8_DTYPE and op.family == "gemm":  # E4M3 values held in halves: an f16 problem flagged fp8
        return found.problem(op, "f16")
    if op.dtype not in DTYPES:
        return (f"no device kernel takes {op.family} nodes of dtype {op.dtype} (the kernels compute in "
                f"{', '.join(DTYPES)}): the node runs its function on the GPU")
    return found.problem(op, kernel_dtype(op.family, op.dtype, str(op["precision"])))


def extent_attr(family: str) -> str | None:
    """The attribute of a `family` node whose factors make its run-time extent (OpKernel.extent_attr)."""
    found = OPS.get(family)
    return None if found is None else found.extent_attr


def shaped(family: str) -> bool:
    """Whether a `family` node's Problem needs its tensor shapes, which only its binder reads (OpKernel.shaped)."""
    found = OPS.get(family)
    return found is not None and found.shaped


Avoid = Container[tuple[str, str]]
"""(instance name, arch) pairs a selection must not return: instances ptxas rejected (a spill, a stack frame)."""


MMA_ONLY = frozenset({"mma"})
"""The implementations an emulated build runs (the generated kernels only: no cuBLASLt, no CUTLASS)."""


def candidates(problem: Problem, arch: str, avoid: Avoid = (), impls: Container[str] | None = None
               ) -> list[dict[str, Any]]:
    """The configurations a selection for `arch` chooses among, in the family's order: the family's offered ones
    (configs: on sm_90a a GEMM's CUTLASS instances) and a vendor library's (library_configs: for a GEMM on sm_80 /
    sm_90 cuBLASLt's first heuristic choice where its epilogue maps the group); none whose instance is in `avoid`, none
    of an implementation outside `impls` (None: every one)."""
    family = FAMILIES[problem.family]
    offered = [*family.configs(problem, arch), *family.library_configs(problem, arch)]
    if impls is not None:
        offered = [c for c in offered if str(c.get("impl", "mma")) in impls]
    return [c for c in offered if (family.instance_name(problem, c, arch), arch) not in avoid]


def fastest(problem: Problem, arch: str, configs: Iterable[Mapping[str, Any]], hw: Hardware | None = None
            ) -> tuple[dict[str, Any], float] | None:
    """The configuration of `configs` the estimate predicts fastest for `arch` on `hw` (by default the arch's
    hardware: calibration.hardware_for_arch), with its estimate; the first of equals; None for no configuration."""
    family = FAMILIES[problem.family]
    hw = hardware_for_arch(arch, hw)
    best: tuple[dict[str, Any], float] | None = None
    for c in configs:
        us = float(family.estimate_us(problem, c, hw))  # type: ignore[attr-defined]
        if best is None or us < best[1]:
            best = (dict(c), us)
    return best


def select_instance(problem: Problem, arch: str, config: Mapping[str, Any] | None = None, avoid: Avoid = (),
                    hw: Hardware | None = None, impls: Container[str] | None = None) -> Instance | str:
    """The instance of `problem` for `arch`: `config`, or else the candidate the estimate predicts fastest on `hw`
    (fastest over candidates; `avoid` and `impls` restrict them); or why there is none (the family's own check, or
    that ptxas rejected each one)."""
    family = FAMILIES[problem.family]
    if config is None:
        offered = candidates(problem, arch, impls=impls)
        if not offered:
            return no_config_reason(family, problem, arch)
        pick = fastest(problem, arch, candidates(problem, arch, avoid, impls), hw)
        if pick is None:
            return (f"each of the {len(offered)} valid {problem.family} configurations for {arch} spills or needs a "
                    "stack frame (ptxas)")
        config = pick[0]
    why = family.check(problem, config, arch)
    if why is not None:
        return f"{problem.family} config {dict(config)} for {arch}: {why}"
    if (family.instance_name(problem, config, arch), arch) in avoid:
        return f"{problem.family} config {dict(config)} for {arch} spills or needs a stack frame (ptxas)"
    return family.instantiate(problem, config, arch)


SPACE_SCAN_LIMIT = 4096
"""no_config_reason checks at most this many configurations of a family's space."""


def no_config_reason(family: KernelFamily, problem: Problem, arch: str) -> str:
    """Why `family` offers no configuration for `problem` on `arch`: the reason its check gives most often over the
    family's space (a problem it cannot compute gives the same one for every configuration: a head dim, a dtype, a
    layout), e.g. "no valid attention configuration for sm_90: head_dim 256 is not supported"."""
    keys = list(family.space)
    counts: dict[str, int] = {}
    for vals in itertools.islice(itertools.product(*family.space.values()), SPACE_SCAN_LIMIT):
        why = family.check(problem, dict(zip(keys, vals, strict=True)), arch)
        if why is not None:
            counts[why] = counts.get(why, 0) + 1
    common = max(counts, key=counts.__getitem__) if counts else "every candidate failed its check"
    return f"no valid {problem.family} configuration for {arch}: {common}"


def node_problem(node: onnx.NodeProto, out_dtype: str | None = None) -> Problem | str:
    """problem_for a fused `ai.gtco` node of a rewritten model; `out_dtype`, its output's dtype where known
    (with_out_dtype)."""
    op = decode_node(node)
    if isinstance(op, str):
        return op
    problem = problem_for(op)
    return problem if isinstance(problem, str) or out_dtype is None else with_out_dtype(problem, op.dtype, out_dtype)


def with_out_dtype(problem: Problem, io_dtype: str, out_dtype: str) -> Problem:
    """`problem` of a node of I/O dtype `io_dtype` (its op type's) whose output tensor is `out_dtype`: a half GEMM
    on half tensors writing fp32 (a graph output the conversion folded into it, onnx_gtco.precision) gets the
    flag out_dtype="f32", the output cast in its epilogue, where its family has that form (KernelFamily.fp32_output:
    the GEMM); every other problem is unchanged."""
    family = ALL_FAMILIES.get(problem.family)
    io_dtype = "f16" if io_dtype == FP8_DTYPE else io_dtype  # an fp8 GEMM's I/O is fp16
    if family is not None and family.fp32_output and problem.dtype == io_dtype != "f32" and out_dtype == "f32":
        return Problem.make(problem.family, problem.dtype, dict(problem.sizes),
                            {**dict(problem.flags), "out_dtype": "f32"})
    return problem


_ELEM_DTYPE = {onnx.TensorProto.FLOAT: "f32", onnx.TensorProto.FLOAT16: "f16", onnx.TensorProto.BFLOAT16: "bf16"}


def model_dtypes(model: onnx.ModelProto) -> dict[str, str]:
    """Float tensor name -> its dtype ("f32", "f16", "bf16") as a model's outputs and value_info declare it."""
    return {vi.name: _ELEM_DTYPE[vi.type.tensor_type.elem_type] for vi in (*model.graph.value_info,
                                                                           *model.graph.output)
            if vi.type.tensor_type.elem_type in _ELEM_DTYPE}


def model_instances(model: onnx.ModelProto, archs: Iterable[str], impls: Container[str] | None = None
                    ) -> tuple[list[Instance], dict[str, str]]:
    """The instances a rewritten model's fused nodes select for each arch (distinct by name and arch), of the
    implementations in `impls` (None: every one; MMA_ONLY: the generated kernels, which are also what a cuBLASLt
    node falls back to), and the reason per node name that selected none."""
    found: dict[tuple[str, str], Instance] = {}
    skipped: dict[str, str] = {}
    out_dtypes = model_dtypes(model)
    for node in model.graph.node:
        if node.domain != "ai.gtco":
            continue
        problem = node_problem(node, out_dtypes.get(node.output[0]) if node.output else None)
        if isinstance(problem, str):
            skipped[node.name] = problem
            continue
        for arch in archs:
            inst = select_instance(problem, arch, impls=impls)
            if isinstance(inst, str):
                skipped[node.name] = inst
            else:
                found.setdefault((inst.name, arch), inst)
    return list(found.values()), skipped
