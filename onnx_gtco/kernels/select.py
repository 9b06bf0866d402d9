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
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

import onnx

from onnx_gtco.calibration import Hardware, hardware_for_arch
from onnx_gtco.kernels import cublaslt
from onnx_gtco.kernels.attention import FAMILIES as ATTENTION_FAMILIES
from onnx_gtco.kernels.attention import make_problem
from onnx_gtco.kernels.conv import FAMILY as CONV
from onnx_gtco.kernels.family import ARCHS, Instance, KernelFamily, Problem
from onnx_gtco.kernels.gemm import FAMILY as GEMM
from onnx_gtco.kernels.gemm import gemm_problem
from onnx_gtco.kernels.layernorm import FAMILY as LAYERNORM
from onnx_gtco.kernels.softmax import FAMILY as SOFTMAX
from onnx_gtco.opspec import FusedOp, decode_node

FAMILIES: dict[str, KernelFamily] = {
    "gemm": GEMM, "layernorm": LAYERNORM, "softmax": SOFTMAX, "conv": CONV, **{f.name: f for f in ATTENTION_FAMILIES},
}
"""Kernel families by name (the elementwise family is generated per group and selected by its own binder; the
conv family's Problem needs the input's shape, which its binder reads: plugin.bind_conv)."""

CONV_NEEDS_SHAPES = "a conv's kernel Problem needs its input's shape (the binder gives it: plugin.bind_conv)"
"""problem_for's answer for a conv node: its attributes hold the kernel, strides, pads and dilations but not x's
shape. The conv binder builds the Problem from the shapes instead, for the library (plugin.device) and for the
tuner's tasks (tune.tasks.shaped_problem) alike; model_instances, which reads attributes only, skips conv nodes
with this reason."""

_PRECISION_DTYPE = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}


def kernel_dtype(family: str, io_dtype: str, precision: str) -> str:
    """The dtype a kernel of `family` computes in: the precision when it is fp16 / bf16, else the node's I/O dtype
    (every family takes f16, bf16 and f32; f32 on the Tensor Core families is TF32)."""
    del family  # every family takes the same dtypes
    want = _PRECISION_DTYPE.get(precision, io_dtype)
    return want if want != "f32" else io_dtype


def _batch(dims: Sequence[Any]) -> int | None:
    """Product of batch dims; None when one is symbolic."""
    if any(not isinstance(d, int) for d in dims):
        return None
    return math.prod(dims)


def problem_for(op: FusedOp) -> Problem | str:
    """The kernel Problem of a fused node read through its spec (opspec.decode), or why there is none."""
    family, precision = op.family, str(op["precision"])
    kernel_family = "gemm" if family == "qkv" else family
    if kernel_family not in FAMILIES:
        return f"no {family} kernel family (the node runs its function)"
    if kernel_family == "conv":
        return CONV_NEEDS_SHAPES
    dtype = kernel_dtype(kernel_family, op.dtype, precision)
    if kernel_family == "gemm":
        return _gemm(dtype, op)
    if kernel_family in ("attention", "bmm_softmax"):
        return _attention(kernel_family, dtype, op)
    if kernel_family == "layernorm":
        hidden = op.int("hidden")
        if hidden is None:
            return "LayerNorm over a symbolic hidden size (the kernel is built per hidden size)"
        residual, affine = op["residual"], op["affine"]
        return Problem.make("layernorm", dtype, {"hidden": hidden, "rows": 1}, {
            "residual": residual, "residual_out": residual, "gamma": affine, "beta": affine,
            "epsilon": op["epsilon"]})
    cols = op.int("cols")
    if cols is None:
        return "softmax over a symbolic row length (the kernel is built per row length)"
    return Problem.make("softmax", dtype, {"rows": op.int("rows") or 1, "cols": cols}, {"scale": None, "mask": False})


def _gemm(dtype: str, op: FusedOp) -> Problem | str:
    beta = float(op.attrs.get("beta", 1.0))  # qkv has no trans_a, alpha or beta: the defaults
    if op.attrs.get("trans_a"):
        return "GEMM with a transposed A (the kernel reads A row-major)"
    if op["bias"] and beta != 1.0:
        return f"GEMM with beta={beta:g} on its bias (the epilogue has no scale yet)"
    m, n, k = op.int("m"), op.int("n"), op.int("k")
    if op.family == "qkv":  # the C++ QKV op launches the instance once per projection, each with its own N: the
        ns = op["ns"] or ()  # tiles are chosen, and the split-K workspace sized, for the widest such launch
        n = max(ns) if ns and all(isinstance(x, int) for x in ns) else op.int("n_out")
    batch_dims = op.attrs.get("batch", ())
    batch = _batch(batch_dims)
    if batch is None:
        return f"batched GEMM over symbolic batch dims {list(batch_dims)}"
    # symbolic M (a dynamic batch folded into the rows) is a runtime size: 1 stands for it when choosing tiles
    m = 1 if m is None else m
    if n is None or k is None:
        return "GEMM with a symbolic N or K (the weight's shape must be known)"
    return gemm_problem(dtype, batch, m, n, k, b_batched=batch > 1 or bool(batch_dims),
                        trans_b=bool(op.attrs.get("trans_b")), bias=bool(op["bias"]),
                        activation=str(op.attrs.get("activation") or "none"),
                        residual=bool(op.attrs.get("residual")), alpha=float(op.attrs.get("alpha", 1.0)),
                        layer_scale=bool(op.attrs.get("layer_scale")), layernorm=bool(op.attrs.get("layernorm")),
                        epsilon=float(op.attrs.get("epsilon", 1e-5)))


def _attention(family: str, dtype: str, op: FusedOp) -> Problem | str:
    if op["causal"]:
        return "causal attention (the kernel has no causal mask yet)"
    heads, head_dim = op.int("heads"), op.int("head_dim")
    if heads is None or head_dim is None:
        return "attention with a symbolic head count or head size"
    seq_q, seq_k = op.int("seq_q"), op.int("seq_k")
    # batch and sequence lengths are run-time sizes of both kernels: a symbolic one stands as 1 when choosing tiles
    batch = _batch(op["batch_dims"] or (1,)) or 1
    flags: dict[str, Any] = {
        "scale": op["scale"] if op["scale"] is not None else 1.0 / math.sqrt(head_dim),
        "mask": op["mask"], "bias": op["bias"], "q_layout": op["q_layout"], "k_layout": op["k_layout"],
        **{f"{t}_scale": float(op[f"{t}_scale"]) for t in ("mask", "bias") if float(op[f"{t}_scale"]) != 1.0},
    }
    if family == "attention":
        flags["v_layout"] = op["v_layout"]
        flags["out_layout"] = op["out_layout"]
    return make_problem(family, dtype, batch=batch, heads=heads, seq_q=seq_q or seq_k or 1, seq_k=seq_k or seq_q or 1,
                        head_dim=head_dim, **flags)


Avoid = Container[tuple[str, str]]
"""(instance name, arch) pairs a selection must not return: instances ptxas rejected (a spill, a stack frame)."""


MMA_ONLY = frozenset({"mma"})
"""The implementations an emulated build runs (the generated kernels only: no cuBLASLt, no CUTLASS)."""


def candidates(problem: Problem, arch: str, avoid: Avoid = (), impls: Container[str] | None = None
               ) -> list[dict[str, Any]]:
    """The configurations a selection for `arch` chooses among, in the family's order: the family's offered ones
    (configs: on sm_90a a GEMM's CUTLASS instances), and for a GEMM on sm_80 / sm_90 cuBLASLt's first heuristic
    choice where its epilogue maps the group; none whose instance is in `avoid`, none of an implementation outside
    `impls` (None: every one)."""
    family = FAMILIES[problem.family]
    offered = list(family.configs(problem, arch))
    if problem.family == "gemm" and arch in ARCHS and cublaslt.unsupported(problem) is None:
        offered.append({"impl": cublaslt.IMPL, "RANK": 0})
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
    GEMM flag out_dtype="f32", the output cast in its epilogue; every other problem is unchanged."""
    if problem.family == "gemm" and problem.dtype == io_dtype != "f32" and out_dtype == "f32":
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
