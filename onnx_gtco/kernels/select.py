"""Which kernel a fused node runs: the Problem its attributes describe, and the instance built for it.

A fused node (onnx_gtco.rewrite) carries what its kernel needs as attributes: GEMM sizes and epilogue, attention heads
and layouts, LayerNorm's hidden size, ... `problem_for` turns them into the kernel family's Problem, or says why
no kernel serves the node (the node then keeps running its model-local function). `select_instance` picks the
family's first valid configuration for an architecture; the tuner (a later stage) replaces that choice.

Kernel dtype: the node's compute precision when it is fp16 / bf16, else the node's own I/O dtype. The Tensor Core
families (gemm, attention, bmm_softmax) have no fp32 kernel, so an fp32 node with fp32 precision gets a reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx
from onnx import helper

from onnx_gtco.kernels.attention import FAMILIES as ATTENTION_FAMILIES
from onnx_gtco.kernels.attention import make_problem
from onnx_gtco.kernels.family import Instance, KernelFamily, Problem
from onnx_gtco.kernels.gemm import FAMILY as GEMM
from onnx_gtco.kernels.gemm import gemm_problem
from onnx_gtco.kernels.layernorm import FAMILY as LAYERNORM
from onnx_gtco.kernels.softmax import FAMILY as SOFTMAX
from onnx_gtco.opspec import split_op_type

FAMILIES: dict[str, KernelFamily] = {
    "gemm": GEMM, "layernorm": LAYERNORM, "softmax": SOFTMAX, **{f.name: f for f in ATTENTION_FAMILIES},
}
"""Kernel families by name (the elementwise family is generated per group and selected by its own binder)."""

_PRECISION_DTYPE = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}
_TENSOR_CORE = {"gemm", "attention", "bmm_softmax"}


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def kernel_dtype(family: str, io_dtype: str, precision: str) -> str | None:
    """The dtype the kernel computes in, or None when no kernel of `family` takes it."""
    want = _PRECISION_DTYPE.get(precision, io_dtype)
    dtype = want if want != "f32" else io_dtype
    if family in _TENSOR_CORE and dtype not in ("f16", "bf16"):
        return None
    return dtype


def _int(attrs: Mapping[str, Any], key: str) -> int | None:
    """An integer attribute; None when absent or symbolic (the optimizer writes "?" or a dim name then)."""
    v = _text(attrs.get(key))
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _batch(dims: Sequence[Any]) -> int | None:
    """Product of batch dims; None when one is symbolic."""
    vals = [_text(d) for d in dims]
    if any(not isinstance(d, int) for d in vals):
        return None
    return math.prod(vals)


def problem_for(family: str, io_dtype: str, attrs: Mapping[str, Any]) -> Problem | str:
    """The kernel Problem of a fused node of `family` with I/O dtype `io_dtype`, or why there is none.

    Args:
        family: the pattern family (`gemm`, `qkv`, `attention`, `bmm_softmax`, `layernorm`, `softmax`, ...).
        io_dtype: the node's I/O dtype: "f32", "f16" or "bf16" (the suffix of its op type).
        attrs: the node's attributes (onnx.helper.get_attribute_value; bytes or str for strings).
    """
    precision = str(_text(attrs.get("precision", "fp32")))
    kernel_family = "gemm" if family == "qkv" else family
    if kernel_family not in FAMILIES:
        return f"no {family} kernel family (the node runs its function)"
    dtype = kernel_dtype(kernel_family, io_dtype, precision)
    if dtype is None:
        return (f"{family} runs on Tensor Cores in fp16 or bf16; this node is {io_dtype} with precision {precision} "
                f"(optimize with --precision fp16 or bf16)")
    if kernel_family == "gemm":
        return _gemm(family, dtype, attrs)
    if kernel_family in ("attention", "bmm_softmax"):
        return _attention(kernel_family, dtype, attrs)
    if kernel_family == "layernorm":
        hidden = _int(attrs, "hidden")
        if hidden is None:
            return "LayerNorm over a symbolic hidden size (the kernel is built per hidden size)"
        residual = bool(_int(attrs, "residual"))
        affine = bool(_int(attrs, "affine") if "affine" in attrs else 1)
        return Problem.make("layernorm", dtype, {"hidden": hidden, "rows": 1}, {
            "residual": residual, "residual_out": residual, "gamma": affine, "beta": affine,
            "epsilon": float(attrs.get("epsilon", 1e-5))})
    cols = _int(attrs, "cols")
    if cols is None:
        return "softmax over a symbolic row length (the kernel is built per row length)"
    rows = _int(attrs, "rows") or 1
    return Problem.make("softmax", dtype, {"rows": rows, "cols": cols}, {"scale": None, "mask": False})


def _gemm(family: str, dtype: str, attrs: Mapping[str, Any]) -> Problem | str:
    if _int(attrs, "trans_a"):
        return "GEMM with a transposed A (the kernel reads A row-major)"
    if _int(attrs, "bias") and "beta" in attrs and float(attrs["beta"]) != 1.0:
        return f"GEMM with beta={float(attrs['beta']):g} on its bias (the epilogue has no scale yet)"
    m, n, k = _int(attrs, "m"), _int(attrs, "n_out" if family == "qkv" else "n"), _int(attrs, "k")
    batch_dims = attrs.get("batch", ())
    batch = _batch(batch_dims)
    if batch is None:
        return f"batched GEMM over symbolic batch dims {[_text(d) for d in batch_dims]}"
    # symbolic M (a dynamic batch folded into the rows) is a runtime size: 1 stands for it when choosing tiles
    m = 1 if m is None else m
    if n is None or k is None:
        return "GEMM with a symbolic N or K (the weight's shape must be known)"
    activation = str(_text(attrs.get("activation", "none")) or "none")
    return gemm_problem(dtype, batch, m, n, k, b_batched=batch > 1 or bool(batch_dims),
                        trans_b=bool(_int(attrs, "trans_b")), bias=bool(_int(attrs, "bias")),
                        activation=activation, residual=bool(_int(attrs, "residual")),
                        alpha=float(attrs.get("alpha", 1.0)))


def _attention(family: str, dtype: str, attrs: Mapping[str, Any]) -> Problem | str:
    if _int(attrs, "causal"):
        return "causal attention (the kernel has no causal mask yet)"
    heads, head_dim = _int(attrs, "heads"), _int(attrs, "head_dim")
    if heads is None or head_dim is None:
        return "attention with a symbolic head count or head size"
    seq_q, seq_k = _int(attrs, "seq_q"), _int(attrs, "seq_k")
    # batch and sequence lengths are run-time sizes of both kernels: a symbolic one stands as 1 when choosing tiles
    batch = _batch(attrs.get("batch_dims", (1,))) or 1
    flags: dict[str, Any] = {
        "scale": float(attrs.get("scale", 1.0 / math.sqrt(head_dim))),
        "mask": bool(_int(attrs, "mask")), "bias": bool(_int(attrs, "bias")),
        "q_layout": str(_text(attrs.get("q_layout", "bhsd"))), "k_layout": str(_text(attrs.get("k_layout", "bhds"))),
    }
    if family == "attention":
        flags["v_layout"] = str(_text(attrs.get("v_layout", "bhsd")))
        flags["out_layout"] = str(_text(attrs.get("out_layout", "bhsd")))
    return make_problem(family, dtype, batch=batch, heads=heads, seq_q=seq_q or seq_k or 1, seq_k=seq_k or seq_q or 1,
                        head_dim=head_dim, **flags)


def select_instance(problem: Problem, arch: str, config: Mapping[str, int] | None = None) -> Instance | str:
    """The instance of `problem` for `arch`: `config`, or else the family's first valid configuration."""
    family = FAMILIES[problem.family]
    if config is None:
        configs = family.configs(problem, arch)
        if not configs:
            return f"no valid {problem.family} configuration for {arch} (every candidate failed its check)"
        config = configs[0]
    why = family.check(problem, config, arch)
    if why is not None:
        return f"{problem.family} config {dict(config)} for {arch}: {why}"
    return family.instantiate(problem, config, arch)


def node_problem(node: onnx.NodeProto) -> Problem | str:
    """problem_for a fused `ai.gtco` node of a rewritten model."""
    family, dtype = split_op_type(node.op_type)
    return problem_for(family, dtype, {a.name: helper.get_attribute_value(a) for a in node.attribute})


def model_instances(model: onnx.ModelProto, archs: Iterable[str]) -> tuple[list[Instance], dict[str, str]]:
    """The instances a rewritten model's fused nodes select for each arch (distinct by name and arch), and the
    reason per node name that selected none."""
    found: dict[tuple[str, str], Instance] = {}
    skipped: dict[str, str] = {}
    for node in model.graph.node:
        if node.domain != "ai.gtco":
            continue
        problem = node_problem(node)
        if isinstance(problem, str):
            skipped[node.name] = problem
            continue
        for arch in archs:
            inst = select_instance(problem, arch)
            if isinstance(inst, str):
                skipped[node.name] = inst
            else:
                found.setdefault((inst.name, arch), inst)
    return list(found.values()), skipped
