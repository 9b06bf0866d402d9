"""A GEMM task as one cuBLASLt matmul: the mapping the cuBLASLt implementation of the GEMM family runs
(plugins/families/gemm/cublaslt.h mirrors `describe` for the run-time sizes), its instances and its cost estimate.

cuBLASLt is column-major. A row-major ``Y[M, N] = A[M, K] @ B[K, N]`` is the column-major ``Yᵀ[N, M] = Bᵀ Aᵀ``,
and a row-major buffer read column-major *is* its transpose, so cuBLASLt's A is our B buffer and its B is our A
buffer, untransposed, with no copy:

    cuBLASLt A = B buffer: N x K, ld N (op N) — or, with trans_b (B stored [N, K]), K x N, ld K, op T
    cuBLASLt B = A buffer: K x M, ld K (op N)
    C = D = Y:   N x M, ld N

The epilogue adds a bias vector over the rows of D, which are our N (output features): CUBLASLT_EPILOGUE_BIAS,
RELU_BIAS, GELU_BIAS (RELU, GELU without a bias). cuBLASLt's GELU is the tanh form, so only a model's tanh GELU
maps onto it; the other activations do not. The residual enters through C with beta = 1, which cuBLASLt adds
*before* the epilogue's activation: ``D = act(alpha * op(A) op(B) + beta * C + bias)``; so a residual maps only
when there is no activation (``act(x) + r`` is not ``act(x + r)``). Whatever does not map is not offered:
`describe` returns the reason.

Batches: a weight GEMM (one B for the whole batch) folds the batch into the rows (M' = batch * M, one matmul); a
batched GEMM steps A, B and Y by their strided-batch offsets. fp32 runs as TF32 (CUBLAS_COMPUTE_32F_FAST_TF32, as
the generated kernels do); 16-bit inputs accumulate in fp32 (CUBLAS_COMPUTE_32F) and may write fp32 (out_dtype).
The heuristic's algorithm rank (0 = its first choice) is the tuning parameter RANK.

Where cuBLASLt cannot run at all (libcublasLt absent, no algorithm of that rank, a plan that cannot be made: the
instance returns GTCO_ELIBRARY), the library launches the node's generated mma instance instead
(onnx_gtco.plugin.device.mma_fallbacks, plugins/families/gemm/gemm_op.h run_gemm), so a vendor failure never fails a
session.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_gtco.calibration import Hardware
from onnx_gtco.cost.model import vendor_gemm_us
from onnx_gtco.errors import BuildError, HeaderError
from onnx_gtco.families.gemm.cublas_headers import cublaslt_include_dir, cuda_runtime_include_dir, installed_library
from onnx_gtco.kernels.family import ARCHS, Instance, Problem, from_storage, tf32_round
from onnx_gtco.patterns.activation import REFERENCE

IMPL = "cublaslt"
RANKS = (0, 1, 2, 3)
"""Heuristic results the tuner may pick (the C++ side asks cuBLASLt for RANK + 1 and fails when it has fewer)."""

_CUDA_TYPE = {"f16": "CUDA_R_16F", "bf16": "CUDA_R_16BF", "f32": "CUDA_R_32F"}
_EPILOGUES = {  # (bias, activation) -> cublasLtEpilogue_t
    (False, "none"): "CUBLASLT_EPILOGUE_DEFAULT", (True, "none"): "CUBLASLT_EPILOGUE_BIAS",
    (False, "relu"): "CUBLASLT_EPILOGUE_RELU", (True, "relu"): "CUBLASLT_EPILOGUE_RELU_BIAS",
    (False, "gelu_tanh"): "CUBLASLT_EPILOGUE_GELU", (True, "gelu_tanh"): "CUBLASLT_EPILOGUE_GELU_BIAS",
}
@dataclass(frozen=True)
class LtMatmul:
    """One cuBLASLt matmul in cuBLASLt's own (column-major) terms.

    Attributes:
        m, n, k: cuBLASLt's sizes: D is m x n (our N x M'), op(A) m x k, op(B) k x n.
        trans_a, trans_b: cuBLASLt's ops (CUBLASLT_MATMUL_DESC_TRANSA / TRANSB): op T when True.
        lda, ldb, ldc: leading dimensions of the stored A (rows m, or k when transposed), B (k x n) and C = D.
        batch: CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT.
        stride_a, stride_b, stride_c: STRIDED_BATCH_OFFSET of A, B and C = D, in elements.
        a_dtype, c_dtype, bias_dtype: the cudaDataType_t of A and B, of C and D, of the bias vector.
        compute: cublasComputeType_t; the scale type is always CUDA_R_32F.
        epilogue: cublasLtEpilogue_t.
        alpha, beta: the scales; beta is 1 when C carries the residual, else 0 (C is D, not read).
        operand_a, operand_b, operand_c: which array of the GEMM each of cuBLASLt's A, B, C is ("" for no C).
    """

    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    batch: int
    stride_a: int
    stride_b: int
    stride_c: int
    a_dtype: str
    c_dtype: str
    bias_dtype: str
    compute: str
    epilogue: str
    alpha: float
    beta: float
    operand_a: str = "b"
    operand_b: str = "a"
    operand_c: str = ""


def _sizes(problem: Problem) -> tuple[int, int, int, int, bool]:
    get = dict(problem.sizes).get
    return get("batch", 1), problem.size("M"), problem.size("N"), problem.size("K"), bool(get("b_batched", 0))


def unsupported(problem: Problem) -> str | None:
    """Why cuBLASLt cannot compute this GEMM group as one matmul, or None."""
    if problem.family != "gemm":
        return f"problem is for family {problem.family!r}, not gemm"
    if problem.dtype not in _CUDA_TYPE:
        return f"dtype {problem.dtype}: the cuBLASLt mapping takes f16, bf16 or f32 (TF32)"
    out = str(problem.flag("out_dtype", problem.dtype) or problem.dtype)
    if out not in (problem.dtype, "f32"):
        return f"out_dtype {out}: y is {problem.dtype} or f32"
    layout = [k for k in ("trans_a", "head_split", "head_merge") if problem.flag(k)]
    scales = [k for k in ("beta", "scale") if problem.flag(k) is not None and float(problem.flag(k)) != 1.0]
    for key in layout + scales:
        return f"{key}={problem.flag(key)!r}: not expressible by one cuBLASLt matmul with its epilogue"
    if problem.flag("layer_scale", False):
        return ("layer_scale: cuBLASLt's epilogues have no per-column scale after the activation (a device alpha "
                "vector scales the product before the bias and activation, and only with beta = 0: no residual)")
    if problem.flag("layernorm", False):
        return ("layernorm: cuBLASLt's epilogues have no row reduction (a LayerNorm of y's rows over N); the mma "
                "kernels fuse it")
    if problem.flag("gated", False):
        return ("gated: cuBLASLt's epilogues act on each column alone, not on the (gate, up) pairs of a gated MLP; "
                "the mma kernels fuse it")
    if problem.flag("fp8", False):
        return ("fp8: this mapping reads fp16 A and B; cuBLASLt's FP8 matmul wants A in E4M3 in memory too (a "
                "quantize step before it), not built yet: the mma kernels round A as they read it")
    act = str(problem.flag("activation", "none") or "none")
    if act not in {a for _, a in _EPILOGUES}:
        why = " (cuBLASLt's GELU is the tanh form)" if act == "gelu_erf" else ""
        return f"activation {act!r} has no cuBLASLt epilogue{why}"
    if act != "none" and problem.flag("residual", False):
        return (f"residual after {act}: cuBLASLt adds C (the residual, beta=1) before the epilogue's activation, "
                "so act(x) + residual is not expressible")
    missing = [key for key in ("M", "N", "K") if key not in dict(problem.sizes)]
    if missing:
        return f"problem lacks size {', '.join(missing)}"
    batch, m, n, k, _ = _sizes(problem)
    if min(batch, m, n, k) < 1:
        return f"sizes must be positive (batch={batch}, M={m}, N={n}, K={k})"
    return None


def check(problem: Problem, config: Mapping[str, object], arch: str) -> str | None:
    """GemmFamily.check for a configuration with impl "cublaslt": why it cannot run `problem` on `arch`, or None."""
    if arch not in ARCHS:
        return f"arch {arch!r}: choose one of {ARCHS}"
    extra = sorted(set(config) - {"impl", "RANK"})
    if extra:
        return f"a cuBLASLt configuration takes impl and RANK only, not {', '.join(extra)}"
    if config.get("RANK") not in RANKS:
        return f"RANK={config.get('RANK')} is outside {RANKS}"
    return unsupported(problem)


def describe(problem: Problem) -> LtMatmul | str:
    """The cuBLASLt matmul computing `problem` (see the module docstring), or why there is none."""
    why = unsupported(problem)
    if why is not None:
        return why
    batch, m, n, k, b_batched = _sizes(problem)
    trans_b = bool(problem.flag("trans_b", False))
    bias = bool(problem.flag("bias", False))
    residual = bool(problem.flag("residual", False))
    act = str(problem.flag("activation", "none") or "none")
    if not b_batched or batch == 1:  # one B: the batch is more rows of A and Y
        m, batch = m * batch, 1
    dt = problem.dtype
    return LtMatmul(
        m=n, n=m, k=k, trans_a=trans_b, trans_b=False,
        lda=k if trans_b else n, ldb=k, ldc=n, batch=batch,
        stride_a=k * n if batch > 1 else 0, stride_b=m * k if batch > 1 else 0, stride_c=m * n if batch > 1 else 0,
        a_dtype=_CUDA_TYPE[dt], c_dtype=_CUDA_TYPE[str(problem.flag("out_dtype", dt) or dt)],
        bias_dtype=_CUDA_TYPE[dt],
        compute="CUBLAS_COMPUTE_32F_FAST_TF32" if dt == "f32" else "CUBLAS_COMPUTE_32F",
        epilogue=_EPILOGUES[(bias, act)], alpha=float(problem.flag("alpha", 1.0)),
        beta=1.0 if residual else 0.0, operand_c="residual" if residual else "")


# ----------------------------------------------------------------------------------------------------------------
# What cuBLASLt computes from a descriptor, on the CPU: the mapping's numerical check.

def _col_major(buf: np.ndarray, offset: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The rows x cols column-major matrix at `offset` of a flat buffer with leading dimension ld."""
    if ld < rows:
        raise ValueError(f"leading dimension {ld} < rows {rows}")
    idx = offset + np.arange(rows)[:, None] + ld * np.arange(cols)[None, :]
    if idx.max() >= buf.size:
        raise ValueError(f"the {rows}x{cols} matrix at offset {offset}, ld {ld} runs past the buffer ({buf.size})")
    return buf[idx]


def emulate(d: LtMatmul, a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None,
            bias: np.ndarray | None = None, tf32: bool = False) -> np.ndarray:
    """D as cuBLASLt computes it from the descriptor: the flat buffers (float64 values) read column-major at the
    descriptor's leading dimensions, batch strides and ops; D (flat, ld = ldc, batch stride stride_c) in float64.
    `tf32` rounds A and B to TF32 first (CUBLAS_COMPUTE_32F_FAST_TF32)."""
    a, b = np.ravel(a), np.ravel(b)
    if tf32:
        a, b = (tf32_round(x.astype(np.float32)).astype(np.float64) for x in (a, b))
    act = {"RELU": "relu", "GELU": "gelu_tanh"}.get(d.epilogue.removeprefix("CUBLASLT_EPILOGUE_").split("_")[0])
    out = np.zeros(d.ldc * d.n + d.stride_c * (d.batch - 1))
    for e in range(d.batch):
        op_a = _col_major(a, e * d.stride_a, *((d.k, d.m) if d.trans_a else (d.m, d.k)), d.lda)
        op_b = _col_major(b, e * d.stride_b, *((d.n, d.k) if d.trans_b else (d.k, d.n)), d.ldb)
        acc = d.alpha * ((op_a.T if d.trans_a else op_a) @ (op_b.T if d.trans_b else op_b))
        if d.beta:
            if c is None:
                raise ValueError("beta != 0 but no C buffer")
            acc = acc + d.beta * _col_major(np.ravel(c), e * d.stride_c, d.m, d.n, d.ldc)
        if "BIAS" in d.epilogue:
            if bias is None:
                raise ValueError(f"{d.epilogue} but no bias vector")
            acc = acc + np.ravel(bias)[: d.m, None]
        if act is not None:
            acc = REFERENCE[act](acc)
        idx = e * d.stride_c + np.arange(d.m)[:, None] + d.ldc * np.arange(d.n)[None, :]
        out[idx] = acc
    return out


def emulate_problem(problem: Problem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The GEMM family's output y [batch, M, N] as cuBLASLt computes it through `describe` (a ValueError when the
    problem does not map)."""
    d = describe(problem)
    if isinstance(d, str):
        raise ValueError(d)
    out_dt = str(problem.flag("out_dtype", problem.dtype) or problem.dtype)
    arr = {key: from_storage(np.asarray(v), out_dt if key == "residual" else problem.dtype)
           for key, v in inputs.items()}
    y = emulate(d, arr[d.operand_a], arr[d.operand_b], arr.get(d.operand_c), arr.get("bias"),
                tf32=problem.dtype == "f32")
    batch, m, n, _, _ = _sizes(problem)
    return y.reshape(batch, m, n)


# ----------------------------------------------------------------------------------------------------------------
# Instances and cost

def instance(problem: Problem, rank: int, arch: str) -> Instance:
    """The generated entry point running `problem` through cuBLASLt with the heuristic's algorithm `rank`: the
    GEMM instance ABI (``int sym(const GemmArgs*, void* stream)``), so the node table, the dispatch and the tuner
    call it as any GEMM instance.

    Raises:
        ValueError: the problem does not map onto cuBLASLt, or the rank is outside RANKS.
    """
    d = describe(problem)
    if isinstance(d, str):
        raise ValueError(d)
    if rank not in RANKS:
        raise ValueError(f"RANK={rank} is outside {RANKS}")
    act = str(problem.flag("activation", "none") or "none")
    parts = [IMPL, arch.replace("_", ""), problem.dtype, f"r{rank}"]
    parts += [p for p, on in (("tb", d.trans_a), ("bias", "BIAS" in d.epilogue), (act, act != "none"),
                              ("res", d.beta != 0.0), ("of32", d.c_dtype != d.a_dtype)) if on]
    name = "_".join(parts)
    symbol = f"gtco_{name}"
    spec = (f"{{/*dtype=*/{d.a_dtype}, /*out=*/{d.c_dtype}, /*bias=*/{d.bias_dtype}, /*compute=*/{d.compute}, "
            f"/*epilogue=*/{d.epilogue}, /*trans_b=*/{'true' if d.trans_a else 'false'}, "
            f"/*residual=*/{'true' if d.beta else 'false'}, /*rank=*/{rank}}}")
    source = (f"// Generated by onnx_gtco.families.gemm.cublaslt: {name}\n"
              f"#include \"gemm/cublaslt.h\"\n\n"
              f"GTCO_EXPORT int {symbol}(const GemmArgs* args, void* stream) {{\n"
              f"    static constexpr gtco::lt::Spec kSpec{spec};\n"
              f"    return gtco::lt::run(kSpec, *args, stream);\n"
              f"}}\n")
    return Instance(name=name, symbol=symbol, source=source, problem=problem,
                    config={"impl": IMPL, "RANK": rank}, arch=arch)  # type: ignore[dict-item]


def estimate_us(problem: Problem, hw: Hardware) -> float:
    """Estimated time of the matmul on `hw`: the vendor GEMM estimate (cost.model.vendor_gemm_us, whose constants
    are fitted to cuBLAS kernels: until a record of ours measures these instances, ONNX Runtime's own cuBLAS
    kernels of the same GEMMs stand in for them, marked as a proxy in the records and the calibration) over the
    matmul's FLOPs and the bytes it moves (A, B, y and the residual)."""
    batch, m, n, k, b_batched = _sizes(problem)
    elem = 4 if problem.dtype == "f32" else 2
    out = 4 if str(problem.flag("out_dtype", problem.dtype) or problem.dtype) == "f32" else elem
    moved = (elem * (batch * m * k + (batch if b_batched else 1) * k * n)
             + out * batch * m * n * (2 if problem.flag("residual", False) else 1))
    return vendor_gemm_us(2.0 * batch * m * n * k, moved, problem.dtype == "f32", hw)


# ----------------------------------------------------------------------------------------------------------------
# Building and running an instance

def include_dirs(emulated: bool) -> list[Path]:
    """The folders an instance compiles against beyond the device headers: cublasLt.h's (fetched on first use; nvcc
    brings CUDA's own headers) and, for the emulation's g++, CUDA's runtime headers that cublasLt.h includes; a
    BuildError saying what is missing."""
    try:
        lt = cublaslt_include_dir()
        runtime = cuda_runtime_include_dir(lt) if emulated else lt
    except HeaderError as e:
        raise BuildError(str(e)) from None
    return [lt] if runtime == lt else [lt, runtime]


def load() -> None:
    """Load libcublasLt globally, as ONNX Runtime's CUDA EP does, from the nvidia-cublas package where installed (an
    instance finds it loaded; without it the instance reports that it is absent)."""
    lib = installed_library()
    if lib is not None:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def last_error(library: str) -> str:
    """What the instances of the shared library `library` said of their last failure (gemm/cublaslt.h's
    gtco_cublaslt_error): ": why", or "" when nothing."""
    fn = ctypes.CDLL(library).gtco_cublaslt_error
    fn.restype = ctypes.c_char_p
    why = fn().decode()
    return f": {why}" if why else ""


__all__ = ["IMPL", "RANKS", "LtMatmul", "check", "describe", "emulate", "emulate_problem", "estimate_us",
           "include_dirs", "instance", "last_error", "load", "unsupported"]
