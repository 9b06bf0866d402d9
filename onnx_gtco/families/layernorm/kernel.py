"""LayerNorm kernel family (plugins/families/layernorm/layernorm.cuh): one pass over rows held in registers, optional
residual add (and its sum as a second output), optional gamma / beta, fp32 statistics (mean, then the centered sum
of squares).

Problem: sizes hidden (elements per row, the normalized trailing axes flattened) and rows (for outputs and test
inputs; the kernel takes rows at run time). flags: residual (x = a + b), residual_out (write a + b too; default
= residual), gamma / beta (default True; affine=False turns both off), epsilon (default 1e-5).

Config: THREADS per row (32..256), VEC elements per access (1..8, at most 16 bytes; hidden % VEC == 0 is
required: check() rejects other VEC and configs() falls back to the widest that divides, down to scalar),
ROWS per block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from onnx_gtco.calibration import Constants, Hardware, LaunchConstants, param
from onnx_gtco.config import Target
from onnx_gtco.kernels.family import (
    ARCHS,
    DTYPES,
    Config,
    Field,
    Instance,
    KernelFamily,
    OpKernel,
    Problem,
    from_storage,
    to_storage,
)
from onnx_gtco.kernels.timing import Tiling, rowwise_tiling
from onnx_gtco.opspec import FusedOp

C_TYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
ITEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
MAX_ELEMS_PER_THREAD = 64  # fp32 registers a thread holds for its part of a row (more would spill)
MAX_BLOCK_THREADS = 1024


def arch_tag(arch: str) -> str:
    """"sm_80" -> "sm80" (for instance names)."""
    return arch.replace("_", "")


def cbool(b: bool) -> str:
    return "true" if b else "false"


def normalize_rows(x: np.ndarray, eps: float, gamma: np.ndarray | None = None, beta: np.ndarray | None = None,
                   center: bool = True) -> np.ndarray:
    """The fp64 reference LayerNorm over the last axis: (x - mean) / sqrt(var + eps) [* gamma] [+ beta]; without
    `center` RMSNorm: x / sqrt(mean(x²) + eps) [* gamma] [+ beta]."""
    mean = x.mean(axis=-1, keepdims=True) if center else np.zeros_like(x[..., :1])
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def rowwise_check(family: str, problem: Problem, config: Config, arch: str, length: int, what: str) -> str | None:
    """The checks the row-wise families (layernorm, softmax) share; `length` is the row length named `what`."""
    if problem.family != family:
        return f"problem is for family {problem.family!r}, not {family!r}"
    if problem.dtype not in DTYPES:
        return f"dtype {problem.dtype!r} is not one of {DTYPES}"
    if arch not in ARCHS:
        return f"arch {arch!r} is not one of {ARCHS}"
    try:
        threads, vec, rows = int(config["THREADS"]), int(config["VEC"]), int(config["ROWS"])
    except KeyError as e:
        return f"config lacks {e.args[0]}"
    if threads <= 0 or threads % 32 or vec not in (1, 2, 4, 8) or rows <= 0:
        return f"THREADS={threads} (whole warps), VEC={vec} (1, 2, 4, 8), ROWS={rows} (> 0) are not valid"
    if length <= 0:
        return f"{what} {length} must be positive"
    if vec * ITEM_BYTES[problem.dtype] > 16:
        return (f"VEC={vec} {problem.dtype} elements are {vec * ITEM_BYTES[problem.dtype]} bytes, "
                "over one 16-byte access")
    if length % vec:
        return f"{what} {length} is not a multiple of VEC={vec} (rows would start misaligned): use a smaller VEC"
    if threads * rows > MAX_BLOCK_THREADS:
        return f"THREADS*ROWS = {threads * rows} threads per block, over {MAX_BLOCK_THREADS}"
    nv = length // vec
    items = -(-nv // threads)
    if items * vec > MAX_ELEMS_PER_THREAD:
        return (f"{what} {length} over {threads} threads is {items * vec} elements per thread in registers, over "
                f"{MAX_ELEMS_PER_THREAD}: use more THREADS")
    if nv <= threads - 32:
        return f"{what} {length} with VEC={vec} has {nv} vectors: at least one warp of THREADS={threads} would idle"
    return None


@dataclass(frozen=True)
class RowwiseConstants(Constants):
    """The constants of the row-wise families' estimate (LayerNorm, softmax; onnx_gtco.calibration: fitted per GPU
    from measured LayerNorm kernels, on the H200 at 128, 197 and 12608 rows of 768, with and without the residual;
    softmax, unmeasured, takes the same)."""

    GROUP: ClassVar[str] = "rowwise"
    pass_us: float = param(1.05, 0.0, 20.0, "us", "a row's pass beyond the launch floor: the reductions' round "
                           "trips (mean, then the centered sum of squares)")
    stream_us: float = param(0.267, 0.0, 5.0, "us", "what each tensor a row reads or writes adds where latency, not "
                             "bandwidth, bounds the kernel (few rows)")
    bw_frac: float = param(0.893, 0.05, 1.5, "of DRAM bandwidth", "the rate at which many rows stream")


def rowwise_estimate_us(problem: Problem, config: Config, hw: Hardware, length: int, rows: int,
                        streams: int) -> float:
    """The estimated time of a row-wise kernel over `rows` rows of `length` elements that reads and writes `streams`
    tensors of that shape, on `hw` (RowwiseConstants): the launch floor, a pass, each stream's latency, and the
    bytes at the fitted share of the DRAM bandwidth (less with accesses under 16 bytes, VEC)."""
    t, c = hw.target, hw.constants(RowwiseConstants)
    elem = ITEM_BYTES[problem.dtype]
    width = min(1.0, int(config.get("VEC", 1)) * elem / 16) ** 0.5  # 16-byte accesses reach the bandwidth
    moved = streams * max(rows, 1) * length * elem
    return (hw.constants(LaunchConstants).floor_us + c.pass_us + streams * c.stream_us
            + moved / (t.dram_gbps * 1e3 * c.bw_frac * width))


def rowwise_configs(family: KernelFamily, problem: Problem, arch: str, length: int) -> list[dict[str, int]]:
    """Valid configs, best first: the widest vector, about 8 elements per thread, ~128 threads per block."""
    out = []
    for vec in (8, 4, 2, 1):
        for threads in family.space["THREADS"]:
            for rows in family.space["ROWS"]:
                cfg = {"THREADS": threads, "VEC": vec, "ROWS": rows}
                if family.check(problem, cfg, arch) is None:
                    out.append(cfg)
    if not out:
        return out

    def key(c: dict[str, int]) -> tuple[float, ...]:
        per_thread = -(-length // (c["THREADS"] * c["VEC"])) * c["VEC"]
        block = c["THREADS"] * c["ROWS"]
        return (-c["VEC"], abs(np.log2(per_thread) - 3), abs(np.log2(block) - 7), c["ROWS"])

    return sorted(out, key=key)[:8]


class LayerNormFamily(KernelFamily):
    """LayerNorm; with `center` False the same kernel without the mean, which is RMSNorm (families.rmsnorm)."""

    extent = "rows"
    rowwise = True
    center = True

    def tiling(self, problem: Problem, config: Config, target: Target) -> Tiling:
        """ROWS rows a block (kernels.timing.rowwise_tiling)."""
        del problem
        return rowwise_tiling(target, config)

    name = "layernorm"
    space: Mapping[str, tuple[int, ...]] = {"THREADS": (32, 64, 128, 256), "VEC": (1, 2, 4, 8), "ROWS": (1, 2, 4, 8)}

    @staticmethod
    def _flags(problem: Problem) -> tuple[bool, bool, bool, bool]:
        res = bool(problem.flag("residual", False))
        res_out = bool(problem.flag("residual_out", res)) and res
        affine = problem.flag("affine", True)
        gamma = bool(problem.flag("gamma", affine))
        beta = bool(problem.flag("beta", affine))
        return res, res_out, gamma, beta

    def check(self, problem: Problem, config: Config, arch: str) -> str | None:
        try:
            hidden = problem.size("hidden")
        except KeyError:
            return "problem has no size 'hidden'"
        return rowwise_check(self.name, problem, config, arch, hidden, "hidden")

    def configs(self, problem: Problem, arch: str) -> list[dict[str, int]]:
        return rowwise_configs(self, problem, arch, problem.size("hidden"))

    def estimate_us(self, problem: Problem, config: Config, hw: Hardware) -> float:
        """rowwise_estimate_us over the rows: x and y, the residual and the sum where the problem has them (gamma
        and beta are one row, in cache)."""
        res, res_out, _, _ = self._flags(problem)
        return rowwise_estimate_us(problem, config, hw, problem.size("hidden"), problem.size("rows"),
                                   2 + int(res) + int(res_out))

    def instantiate(self, problem: Problem, config: Config, arch: str) -> Instance:
        why = self.check(problem, config, arch)
        if why is not None:
            raise ValueError(f"{self.name}: {why}")
        hidden = problem.size("hidden")
        t, v, r = int(config["THREADS"]), int(config["VEC"]), int(config["ROWS"])
        res, res_out, gamma, beta = self._flags(problem)
        name = f"{self.name}_{arch_tag(arch)}_{problem.dtype}_h{hidden}_t{t}_v{v}_r{r}"
        name += ("_res" + ("_sum" if res_out else "")) if res else ""
        name += ("" if gamma else "_nogamma") + ("" if beta else "_nobeta")
        symbol = f"gtco_{name}"
        source = (
            f"// {name}: generated by {type(self).__module__}\n"
            '#include "layernorm/layernorm.cuh"\n\n'
            f"GTCO_EXPORT int {symbol}(const GtcoLayerNormArgs* args, void* stream) {{\n"
            f"    return gtco::layernorm_launch<{C_TYPES[problem.dtype]}, {hidden}, {t}, {v}, {r}, {cbool(res)}, "
            f"{cbool(res_out)}, {cbool(gamma)}, {cbool(beta)}{'' if self.center else ', false'}>(args, stream);\n"
            "}\n")
        smem = 2 * r * (t // 32) * 4
        return Instance(name, symbol, source, problem, dict(config), arch, smem)

    def args_fields(self, problem: Problem, arrays: Mapping[str, np.ndarray]) -> list[Field]:
        res, res_out, gamma, beta = self._flags(problem)
        hidden = problem.size("hidden")
        eps = float(problem.flag("epsilon", 1e-5))
        return [Field("x", "ptr", "x"), Field("residual", "ptr", "residual" if res else ""),
                Field("gamma", "ptr", "gamma" if gamma else ""), Field("beta", "ptr", "beta" if beta else ""),
                Field("y", "ptr", "y"), Field("sum", "ptr", "sum" if res_out else ""),
                Field("rows", "i64", int(arrays["x"].size) // hidden), Field("hidden", "i32", hidden),
                Field("eps", "f32", eps)]

    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        shape = (problem.size("rows"), problem.size("hidden"))
        out = {"y": (shape, problem.dtype)}
        if self._flags(problem)[1]:
            out["sum"] = (shape, problem.dtype)
        return out

    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        res, res_out, gamma, beta = self._flags(problem)
        hidden = problem.size("hidden")
        dt = problem.dtype
        x = from_storage(inputs["x"], dt).reshape(-1, hidden)
        if res:
            x = x + from_storage(inputs["residual"], dt).reshape(-1, hidden)
        y = normalize_rows(x, float(np.float32(problem.flag("epsilon", 1e-5))),
                           from_storage(inputs["gamma"], dt).reshape(1, hidden) if gamma else None,
                           from_storage(inputs["beta"], dt).reshape(1, hidden) if beta else None, self.center)
        out = {"y": y}
        if res_out:
            out["sum"] = x
        return out

    def random_inputs(self, problem: Problem, seed: int) -> dict[str, np.ndarray]:
        res, _, gamma, beta = self._flags(problem)
        rows, hidden = problem.size("rows"), problem.size("hidden")
        rng = np.random.default_rng(seed)
        offset = float(problem.flag("test_offset", 0.0))  # tests: rows with a large mean
        x = rng.standard_normal((rows, hidden)) + rng.standard_normal((rows, 1)) * 0.5 + offset
        out = {"x": to_storage(x, problem.dtype)}
        if res:
            out["residual"] = to_storage(rng.standard_normal((rows, hidden)), problem.dtype)
        if gamma:
            out["gamma"] = to_storage(1.0 + 0.25 * rng.standard_normal(hidden), problem.dtype)
        if beta:
            out["beta"] = to_storage(0.25 * rng.standard_normal(hidden), problem.dtype)
        return out


FAMILY = LayerNormFamily()


def op_problem(op: FusedOp, dtype: str) -> Problem | str:
    """The Problem of a layernorm node (OpKernel.problem; its rows are a run-time size), or why none."""
    hidden = op.int("hidden")
    if hidden is None:
        return "LayerNorm over a symbolic hidden size (the kernel is built per hidden size)"
    residual, affine = op["residual"], op["affine"]
    return Problem.make("layernorm", dtype, {"hidden": hidden, "rows": 1}, {
        "residual": residual, "residual_out": residual, "gamma": affine, "beta": affine,
        "epsilon": op["epsilon"]})


KERNELS = (FAMILY,)
OPS = (OpKernel("layernorm", "layernorm", op_problem),)


CONSTANTS = (RowwiseConstants,)
"""The groups of constants of this family's estimates, which `onnx-gtco calibration fit` fits per GPU (tune/fit.py)."""
