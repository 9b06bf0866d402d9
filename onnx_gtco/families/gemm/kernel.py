"""The GEMM / batched-GEMM family: ``y = act(alpha * A @ B + bias) * layer_scale + residual`` on Tensor Cores
(plugins/families/gemm/gemm.cuh).

dtype "f16" / "bf16": mma.m16n8k16 on 16-bit operands. dtype "f32": TF32, mma.m16n8k8 on operands rounded from fp32
by cvt.rna (10 mantissa bits), fp32 I/O and accumulation; `reference` is then the fp64 product of the
TF32-rounded operands (`tf32_round`), which is what the kernel computes up to fp32 summation.

Problem sizes: "batch", "M", "N", "K", "b_batched" (1: one B per batch entry, 0: one B shared by the batch, a
weight GEMM). Flags: "trans_b" (B is [N, K]), "bias" (bias [N]), "activation" (a name of
onnx_gtco.patterns.activation.REFERENCE, or "none"), "layer_scale" (LayerScale: y's column n times layer_scale[n]
after the activation, before the residual; DINOv2, CaiT, DeiT-III), "residual" (residual like y), "alpha" (the
scale, a run-time argument; absent = 1), "out_dtype" ("f32": y and the residual are fp32, the output cast fused
into the epilogue; absent = the input dtype), "layernorm" with "epsilon" (LayerNorm of y's rows fused: y is written
as before, rounded to the dtype, and ln_y = (y - mean) / sqrt(var + epsilon) * gamma + beta from that rounded y, fp32
statistics; N <= MAX_LN_N, VEC = 1, no split-K, no out_dtype; absent = no LayerNorm).

Arrays of a run: "a" [batch, M, K]; "b" [batch, K, N] / [K, N] (or [.., N, K] with trans_b); "bias" and
"layer_scale" [N]; "residual" and "y" [batch, M, N]; with layernorm "gamma" and "beta" [N] and "ln_y" [batch, M, N]
(which may be the same buffer as y: in place). The kernel is generic in the sizes (they are runtime arguments
checked by the launcher), so one built instance serves every shape with the same flags.

Config "VEC" (optional, default 1) picks the global->shared copy: 1 is the cp.async pipeline with 16-byte chunks,
which needs K and N multiples of a chunk, 8 elements (f16 / bf16) or 4 (f32) (`check` rejects other shapes with
that reason); 0 is the slower fallback
with element-wise predicated loads for any K and N (attention's QKᵀ and PV with 197 tokens). `configs` offers
VEC = 1 where it applies and VEC = 0 otherwise.

Config "SPLITK" (optional, default 1): split-K into that many slices of the k-tiles, grid z = batch x SPLITK, the
last block of each tile summing the fp32 partials from a workspace in split order (deterministic) and running the
epilogue; for few output tiles over a long K. Config "EPI" (optional, default 0): 1 stages the epilogue through
shared memory (a BM x (BN + 8) fp32 tile over the ring) so that bias, residual and y move as 16-byte chunks of
whole rows; VEC = 1 only. Both keep the arithmetic: results are bit-identical to SPLITK = 1 / EPI = 0 up to the
split's fp32 summation order.

Config "impl" (optional, default "mma") picks the implementation: "mma" is gemm.cuh above; "cutlass" a CUTLASS 3.x
Hopper instance for the sm_90a slot (onnx_gtco.families.gemm.cutlass, its own config keys), offered by `configs` for
sm_90a. Every implementation exports the same entry point and computes the same reference; CUTLASS and cuBLASLt
have no layer_scale and no LayerNorm in their epilogues, and their checks refuse such problems (the mma kernels
take them).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from onnx_gtco.calibration import Constants, Hardware, LaunchConstants, hardware_for_arch, param
from onnx_gtco.config import TARGETS, Target
from onnx_gtco.families.gemm import cublaslt, cutlass
from onnx_gtco.families.gemm.rule import MAX_LN_N  # the rule proposes what the kernel takes: one bound
from onnx_gtco.families.layernorm.kernel import normalize_rows
from onnx_gtco.kernels.family import (
    ARCHS,
    Config,
    Field,
    Implementation,
    Instance,
    KernelFamily,
    OpKernel,
    Problem,
    from_storage,
    np_dtype,
    static_product,
    tf32_round,
    to_storage,
)
from onnx_gtco.kernels.timing import Tiling, crowding, grid, regs_per_thread, resident
from onnx_gtco.opspec import FP8_DTYPE, FusedOp
from onnx_gtco.patterns.activation import REFERENCE
from onnx_gtco.precision import round_e4m3, to_e4m3

# Activation name -> gtco::Act enumerator in gemm.cuh.
ACTIVATIONS: dict[str, str] = {
    "none": "kNone", "relu": "kRelu", "gelu_erf": "kGeluErf", "gelu_tanh": "kGeluTanh", "silu": "kSilu",
    "quick_gelu": "kQuickGelu", "sigmoid": "kSigmoid", "tanh": "kTanh", "relu6": "kRelu6",
}
_CTYPE = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
_STATIC_SMEM_MAX = 48 * 1024
MAX_ACC_PER_THREAD = 128  # fp32 accumulators per thread: a 64x64 warp tile; larger ones cannot stay in registers
MAX_THREADS = 1024


def chunk_elems(dtype: str) -> int:
    """Elements of one 16-byte cp.async chunk (GemmTile::kChunk): K and N of a VEC=1 instance are multiples of it."""
    return 4 if dtype == "f32" else 8


EPI_PAD = 8
"""fp32 padding of a row of the staged epilogue tile (GemmSmem::kEpiStride = BN + 8)."""
SPLITS = (1, 2, 4, 8, 16)
"""SPLITK values of the space (gemm.cuh takes 1..16)."""
MIN_KTILES_PER_SPLIT = 4
"""configs() splits K no finer than this many k-tiles per slice: fewer would not fill the cp.async pipeline."""
_FILL_TILE: dict[str, int] = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4}
"""The tile configs() tries first for a problem that 128x128 tiles leave mostly idle (a 4-stage pipeline: a
split's few k-tiles leave it no time to fill a shallower one)."""
SPLIT_WORKSPACE_MAX = 64 << 20
"""Bytes of split-K workspace `check` allows a configuration: the buffer stays allocated per device and stream for
the process, and a split of a problem that needs more has tiles enough to fill the GPU without it."""


def split_workspace_bytes(config: Config, batch: int, m: int, n: int) -> int:
    """The split-K workspace of one launch as launch_gemm sizes it: a counter per output tile (rounded up to 256
    bytes), then SPLITK fp32 partial tiles per output tile; 0 without split-K."""
    splits = int(config.get("SPLITK", 1))
    if splits <= 1:
        return 0
    tiles = batch * math.ceil(m / config["BM"]) * math.ceil(n / config["BN"])
    return math.ceil(tiles * 4 / 256) * 256 + tiles * splits * config["BM"] * config["BN"] * 4


def smem_bytes(config: Config, trans_b: bool, dtype: str = "f16", fp8: bool = False) -> int:
    """Shared memory of one block: STAGES ring slots of the A tile and the B tile, rows padded as GemmTile pads
    them (8 elements for 16-bit types; fp32: 4 floats for k-contiguous rows, 8 for the rows of a [K, N] B); with
    EPI = 1 at least the staged fp32 epilogue tile, BM rows of BN + 8 floats, which reuses the ring
    (GemmSmem::kBytes)."""
    return max(_ring_bytes(config, trans_b, dtype, fp8), epilogue_tile_bytes(config))


def epilogue_tile_bytes(config: Config) -> int:
    """Shared memory of the staged fp32 epilogue tile (BM rows of BN + EPI_PAD floats) with EPI = 1, else 0."""
    return config["BM"] * (config["BN"] + EPI_PAD) * 4 if config.get("EPI", 0) else 0


def _ring_bytes(config: Config, trans_b: bool, dtype: str, fp8: bool = False) -> int:
    bm, bn, bk, stages = config["BM"], config["BN"], config["BK"], config["STAGES"]
    if fp8:  # fp16 A rows, B rows of BK E4M3 bytes padded by 16 (GemmTile FP8)
        return stages * (bm * (bk + 8) * 2 + bn * (bk + 16))
    tf32 = dtype == "f32"
    a_pad = 4 if tf32 else 8
    b_pad = 4 if tf32 and trans_b else 8
    a_stage = bm * (bk + a_pad)
    b_stage = bn * (bk + b_pad) if trans_b else bk * (bn + b_pad)
    return stages * (a_stage + b_stage) * (4 if tf32 else 2)


IMPLS: dict[str, str] = {"cutlass": "onnx_gtco.families.gemm.cutlass"}
"""Implementations besides "mma" -> their module (check, configs, instantiate, ARCH)."""


def _impl(config: Config) -> ModuleType | None:
    """The module of config["impl"], None for "mma" (KeyError for an unknown one: check names it)."""
    impl = config.get("impl", "mma")
    return None if impl == "mma" else importlib.import_module(IMPLS[str(impl)])


def _flags(problem: Problem) -> tuple[bool, bool, str, bool]:
    return (bool(problem.flag("trans_b", False)), bool(problem.flag("bias", False)),
            str(problem.flag("activation", "none") or "none"), bool(problem.flag("residual", False)))


def _fp8(problem: Problem) -> bool:
    """An fp8 GEMM (gemm.cuh FP8, onnx_gtco.fp8): B K-major E4M3 bytes, A fp16 rounded to E4M3 at a_scale as it is
    read, alpha carrying both scales."""
    return bool(problem.flag("fp8", False))


def _a_scale(problem: Problem) -> float:
    """An fp8 GEMM's A scale (GemmArgs.a_scale): the flag's (1 by default; a node's comes with it at run time)."""
    return float(problem.flag("a_scale", 1.0))


def _layer_scale(problem: Problem) -> bool:
    return bool(problem.flag("layer_scale", False))


def _layernorm(problem: Problem) -> bool:
    return bool(problem.flag("layernorm", False))


def _gated(problem: Problem) -> bool:
    """A gated MLP's GEMM (gemm.cuh GATED): B's columns interleave gate and up, y [.., N / 2] = act(gate) * up."""
    return bool(problem.flag("gated", False))


def _y_cols(problem: Problem) -> int:
    """y's columns: N, or N / 2 for a gated GEMM."""
    n = problem.size("N")
    return n // 2 if _gated(problem) else n


def _epsilon(problem: Problem) -> float:
    return float(problem.flag("epsilon", 1e-5) or 0.0)


def _out_dtype(problem: Problem) -> str:
    """y's (and the residual's) dtype: the input dtype, or "f32" with the output cast fused in."""
    return str(problem.flag("out_dtype", problem.dtype) or problem.dtype)


def _sizes(problem: Problem) -> tuple[int, int, int, int, bool]:
    def get(key: str, default: int | None = None) -> int:
        try:
            return problem.size(key)
        except KeyError:
            if default is None:
                raise
            return default
    return get("batch", 1), get("M"), get("N"), get("K"), bool(get("b_batched", 0))


@dataclass(frozen=True)
class MmaConstants(Constants):
    """The constants of `mma_estimate_us` (onnx_gtco.calibration: fitted per GPU from measured mma GEMM kernels; on
    the H200 from ViT-B/16 and BERT-base's GEMMs: 128x64, 64x64 and 128x128 tiles, split-K 1 to 8, 1 to 12608
    rows)."""

    GROUP: ClassVar[str] = "gemm.mma"
    warp_peak_frac: float = param(0.0406, 0.003, 0.5, "of an SM's Tensor Core peak", "the rate of one warp's chain "
                                  "of ldmatrix and mma.sync over a k-tile, alone on its SM: the kernel's mainloop is "
                                  "bound by this latency chain long before the Tensor Cores' peak")
    share_exp: float = param(0.59, 0.0, 1.0, "", "how the warps of an SM share it: past one warp per "
                             "sub-partition, w warps make each chain (w / 4) ** (1 - share_exp) times longer "
                             "(kernels.timing.crowding; 0: not at all, 1: for free)")
    l2_frac: float = param(1.2, 0.2, 4.0, "x DRAM bandwidth", "the rate, all SMs together, at which the cp.async "
                           "pipelines bring operand tiles from L2 (a k-tile slower than this is bound by it)")
    epilogue_ns: float = param(48.2, 0.0, 500.0, "ns", "epilogue time per output element a thread writes (bias, "
                               "residual, cast and store straight from the fragments)")
    act_cost: float = param(0.85, 0.0, 10.0, "x a plain epilogue", "what an activation (erf or tanh GELU, SiLU, "
                            "...) adds to the epilogue")
    splitk_us: float = param(3.61, 0.0, 30.0, "us", "split-K's fixed cost: the slices' arrival at the tile counter "
                             "and the last block's extra pass")
    splitk_sm_gbps: float = param(157.0, 10.0, 3000.0, "GB/s", "the rate at which the last block of a split tile "
                                  "reads the other slices' fp32 partial tiles (one SM's share of L2)")
    ln_sm_gbps: float = param(100.0, 10.0, 3000.0, "GB/s", "the rate at which the last block of a row panel reads "
                              "its y back and writes the LayerNorm (one SM alone; unmeasured until the GPU suite's "
                              "calibration row times the fused pair)")


SCALAR_LOADS = 4.0
"""What element-wise loads (VEC = 0) cost against 16-byte ones, per byte: an assumption."""
_CHEAP_ACTS = frozenset({"relu", "relu6"})


def mma_estimate_us(problem: Problem, config: Config, hw: Hardware) -> float:
    """The estimated time of the mma kernel (gemm.cuh) `config` on `problem` on `hw`, in microseconds:

    * blocks = batch x M tiles x N tiles x SPLITK, each of ceil(K-tiles / SPLITK) k-tiles; an SM holds as many as
      its shared memory, threads and registers allow (kernels.timing.resident), and the grid runs in waves;
    * a k-tile takes the longer of a warp's mma chain over its warp tile (warp_peak_frac of the SM's peak; warps
      crowding an SM slow each other: kernels.timing.crowding) and its operand tiles (the valid rows of A and BN
      columns of B) at the concurrent blocks' share of l2_frac x the DRAM bandwidth;
    * after its k-tiles a block writes its valid outputs (epilogue_ns per element of a thread, more with a residual,
      an activation, fp32 outputs; half with the staged epilogue, EPI = 1);
    * split-K adds its fixed cost and the last block's read of the partial tiles; a fused LayerNorm the row panel's
      read-back and write at one SM's rate; every kernel the launch floor."""
    t = hw.target
    c = hw.constants(MmaConstants)
    cfg = {**GemmFamily.optional, **config}
    batch, m, n, k, _ = _sizes(problem)
    trans_b, _, act, res = _flags(problem)
    bm, bn, bk, wm, wn = cfg["BM"], cfg["BN"], cfg["BK"], cfg["WM"], cfg["WN"]
    splits = int(cfg["SPLITK"])
    m_tiles, n_tiles = math.ceil(m / bm), math.ceil(n / bn)
    blocks = batch * m_tiles * n_tiles * splits
    k_tiles = math.ceil(math.ceil(k / bk) / splits)
    threads = wm * wn * 32
    warp_m, warp_n = bm // wm, bn // wn
    smem = smem_bytes(cfg, trans_b, problem.dtype, _fp8(problem))
    per_sm = resident(t, smem, threads, regs_per_thread(warp_m * warp_n // 32))
    g = grid(t, blocks, per_sm)
    tf32 = problem.dtype == "f32"
    elem = 4 if tf32 else 2
    rows = min(bm, m / m_tiles)  # the valid rows of an average M tile
    b_elem = 1 if _fp8(problem) else elem  # fp8: B's E4M3 bytes (the A rounding's ALU time is not modelled)
    tile_bytes = (rows * elem + bn * b_elem) * bk * (1.0 if cfg["VEC"] else SCALAR_LOADS)
    peak_sm = (t.tf32_tflops if tf32 else t.tc_tflops) * 1e6 / t.sms  # FLOP per us
    chain = 2.0 * warp_m * warp_n * bk / (c.warp_peak_frac * peak_sm) * crowding(g.per_sm * wm * wn, c.share_exp)
    operands = tile_bytes * min(g.blocks, g.slots) / (c.l2_frac * t.dram_gbps * 1e3)
    act_factor = 0.0 if act == "none" else c.act_cost * (0.2 if act in _CHEAP_ACTS else 1.0)
    out_scale = _BYTES_OF[_out_dtype(problem)] / 2
    epilogue = (c.epilogue_ns * 1e-3 * rows * bn / threads * (1.0 + res + act_factor) * out_scale
                * (0.5 if cfg["EPI"] else 1.0))
    block = k_tiles * max(chain, operands) + epilogue * g.per_sm
    time = hw.constants(LaunchConstants).floor_us + g.waves * block
    if splits > 1:
        time += c.splitk_us + splits * bm * bn * 4 / (c.splitk_sm_gbps * 1e3)
    if _layernorm(problem):
        time += 2.0 * min(bm, m) * n * elem / (c.ln_sm_gbps * 1e3)
    return time


_BYTES_OF = {"f16": 2, "bf16": 2, "f32": 4}


def _cublaslt_offered(problem: Problem, arch: str) -> str | None:
    """Why a trial may not pick cuBLASLt for `problem` (its mapping cannot express the group), or None."""
    return FAMILY.check(problem, {"impl": cublaslt.IMPL, "RANK": cublaslt.RANKS[0]}, arch)


def _cutlass_offered(problem: Problem, arch: str) -> str | None:
    """Why a trial may not pick CUTLASS: a task for another target than cutlass.TARGET (its instances are sm_90a
    code, which runs on 9.0 GPUs only), the nvidia-cutlass headers missing, a group its mapping cannot express, or
    no configuration passing its check; None where it may."""
    if arch != cutlass.TARGET:
        return (f"the CUTLASS GEMMs are {cutlass.ARCH} code, run on 9.0 GPUs only: tasks for {cutlass.TARGET} offer "
                f"them, this one is for {arch}")
    headers = cutlass.include_dirs()
    if isinstance(headers, str):
        return headers
    why = cutlass.unsupported(problem)
    if why is not None:
        return why
    if not cutlass.configs(problem, cutlass.ARCH):
        return "no CUTLASS configuration passes its check for this problem"
    return None


@functools.cache
def _cutlass_ranked(problem: Problem, hw: Hardware | None = None) -> tuple[dict[str, Any], ...]:
    """Every valid CUTLASS configuration of `problem` with the heuristic raster order, best first by the estimate on
    `hw` where it runs cutlass.TARGET (a few thousand combinations; the estimate and the check take microseconds
    each). The estimate does not see the raster order, so the others would only repeat each time; a study's sampler
    tries them."""
    space = {**cutlass.SPACE, "RASTER": ("heuristic",)}
    valid = (c for c in (dict(zip(space, v, strict=True)) for v in itertools.product(*space.values()))
             if cutlass.check(problem, c, cutlass.ARCH) is None)
    hw = hardware_for_arch(cutlass.TARGET, hw)
    return tuple(sorted(valid, key=lambda c: FAMILY.estimate_us(problem, {"impl": cutlass.IMPL, **c}, hw)))


IMPLEMENTATIONS = (
    Implementation(cublaslt.IMPL, {"RANK": cublaslt.RANKS}, _cublaslt_offered, label="cuBLASLt",
                   proxy="ONNX Runtime's cuBLAS kernels", fallible=True, own_kernels=False,
                   emulated=True, include_dirs=cublaslt.include_dirs, prepare=cublaslt.load,
                   last_error=cublaslt.last_error),
    Implementation(cutlass.IMPL, cutlass.SPACE, _cutlass_offered, _cutlass_ranked, {cutlass.TARGET: cutlass.ARCH},
                   cutlass.version, label="CUTLASS"),
)
"""The GEMM's library implementations, in the order a tuning study offers them: cuBLASLt's matmul with its fused
epilogue (sm_80 / sm_90) and CUTLASS's Hopper GEMMs (sm_90a)."""


class GemmFamily(KernelFamily):
    """Tiled Tensor Core GEMM with a STAGES-deep cp.async pipeline and a fused bias / activation / LayerScale /
    residual epilogue."""
    extent = "M"
    row_term = True
    arch_specific = True
    fp32_output = True

    name = "gemm"
    title = "GEMM"
    space: Mapping[str, tuple[int, ...]] = {
        "BM": (64, 128, 256),
        "BN": (64, 128, 256),
        "BK": (32, 64),
        "WM": (1, 2, 4, 8),
        "WN": (1, 2, 4, 8),
        "STAGES": (2, 3, 4),
        "VEC": (1, 0),
        "SPLITK": SPLITS,
        "EPI": (0, 1),
    }
    optional: Mapping[str, int] = {"VEC": 1, "SPLITK": 1, "EPI": 0}
    """Parameters a config may leave out, with their defaults."""

    implementations = IMPLEMENTATIONS
    impls: tuple[str, ...] = ("mma", cublaslt.IMPL)
    """Implementations a configuration's "impl" names (absent: "mma", these generated kernels); another one's
    configuration carries its own parameters and is checked and instantiated by its module."""

    def tiling(self, problem: Problem, config: Config, target: Target) -> Tiling:
        """BM rows of A a block, across the batch and N's tiles (and the split-K slices)."""
        cfg = {"VEC": 1, "SPLITK": 1, "EPI": 0, **config}
        threads = cfg["WM"] * cfg["WN"] * 32
        acc = (cfg["BM"] // cfg["WM"]) * (cfg["BN"] // cfg["WN"]) // 32
        smem = smem_bytes(cfg, bool(problem.flag("trans_b", False)), problem.dtype, _fp8(problem))
        per_sm = resident(target, smem, threads, regs_per_thread(acc))
        slots = target.sms * per_sm
        across = problem.size("batch") * math.ceil(problem.size("N") / cfg["BN"]) * int(cfg["SPLITK"])
        return Tiling(cfg["BM"], across, slots, slots, target.sms)

    def library_configs(self, problem: Problem, arch: str) -> list[dict[str, Any]]:
        """cuBLASLt's first heuristic choice on sm_80 / sm_90, where its epilogue maps the group."""
        if arch in ARCHS and cublaslt.unsupported(problem) is None:
            return [{"impl": cublaslt.IMPL, "RANK": 0}]
        return []

    def space_for(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        """The parameters a tuning trial of `problem` suggests (tune.search.search_space): the space, with VEC and
        EPI fixed at 0 where K or N is no multiple of a 16-byte chunk (attention's 197-long rows), where every
        VEC = 1 or EPI = 1 trial would be refused and spend the task's trials."""
        space = dict(self.space)
        try:
            ch = chunk_elems(problem.dtype)
            if problem.size("K") % ch or problem.size("N") % ch:
                space["VEC"] = space["EPI"] = (0,)
        except KeyError:
            pass  # check names the missing size
        return space

    def estimate_us(self, problem: Problem, config: Config, hw: Hardware) -> float:
        """The estimated time of a valid `config` on `problem` on `hw`: its implementation's estimate (mma:
        mma_estimate_us; CUTLASS: families.gemm.cutlass.estimate_us; cuBLASLt: families.gemm.cublaslt.estimate_us)."""
        impl = config.get("impl", "mma")
        if impl == cublaslt.IMPL:
            return cublaslt.estimate_us(problem, hw)
        if impl != "mma":
            return float(_impl(config).estimate_us(problem, config, hw))  # type: ignore[union-attr]
        return mma_estimate_us(problem, {k: v for k, v in config.items() if k != "impl"}, hw)

    # ---------------------------------------------------------------------------------------------------------
    def check(self, problem: Problem, config: Config, arch: str) -> str | None:
        impl = config.get("impl", "mma")
        if impl == cublaslt.IMPL:
            return cublaslt.check(problem, config, arch)
        if impl != "mma":
            if impl not in IMPLS:
                return f"impl {impl!r}: choose one of {', '.join((*self.impls, *IMPLS))}"
            return _impl(config).check(problem, config, arch)  # type: ignore[union-attr]
        config = {k: v for k, v in config.items() if k != "impl"}
        if problem.family != self.name:
            return f"problem is for family {problem.family!r}, not {self.name!r}"
        if arch not in ARCHS:
            return f"arch {arch!r}: choose one of {ARCHS}"
        if problem.dtype not in _CTYPE:
            return f"dtype {problem.dtype}: the GEMM kernels take f16, bf16 or f32 (TF32)"
        missing = [k for k in self.space if k not in config and k not in self.optional]
        if missing:
            return f"config lacks {', '.join(missing)}"
        config = {**self.optional, **config}
        for key, allowed in self.space.items():
            if config[key] not in allowed:
                return f"{key}={config[key]} is outside the space {allowed}"
        try:
            batch, m, n, k, _ = _sizes(problem)
        except KeyError as e:
            return f"problem lacks size {e.args[0]}"
        if _out_dtype(problem) not in (problem.dtype, "f32"):
            return f"out_dtype {_out_dtype(problem)}: y is {problem.dtype} or f32 (the output cast)"
        trans_b, _, act, res = _flags(problem)
        if act not in ACTIVATIONS:
            return f"activation {act!r} is not fused by the GEMM epilogue (have: {', '.join(ACTIVATIONS)})"
        if min(batch, m, n, k) < 1:
            return f"sizes must be positive (batch={batch}, M={m}, N={n}, K={k})"
        ch = chunk_elems(problem.dtype)
        if config["VEC"] and (k % ch or n % ch):
            return (f"K={k}, N={n}: VEC=1 (cp.async with 16-byte chunks of {ch} elements) needs K % {ch} == 0 and "
                    f"N % {ch} == 0; use VEC=0 (element-wise loads)")
        splits = config["SPLITK"]
        if batch * splits > 65535:
            return f"batch={batch} x SPLITK={splits} exceeds the grid's z limit 65535"
        if splits > 1 and splits > math.ceil(k / config["BK"]):
            return f"SPLITK={splits} exceeds the {math.ceil(k / config['BK'])} k-tiles of K={k} (BK={config['BK']})"
        if splits > 1 and (ws := split_workspace_bytes(config, batch, m, n)) > SPLIT_WORKSPACE_MAX:
            return (f"SPLITK={splits}: a split-K workspace of {ws / 2**20:.0f} MiB for M={m}, N={n} (batch {batch}) "
                    f"exceeds {SPLIT_WORKSPACE_MAX >> 20} MiB")
        if _layernorm(problem):
            if splits > 1:
                return (f"SPLITK={splits}: the fused LayerNorm reads whole rows of y after the epilogue; split-K's "
                        f"partial tiles are summed first (use SPLITK=1)")
            if _out_dtype(problem) != problem.dtype:
                return (f"out_dtype {_out_dtype(problem)}: the fused LayerNorm writes y and ln_y in the input dtype "
                        f"{problem.dtype}")
            if n > MAX_LN_N:
                return f"N={n}: the fused LayerNorm holds a row in one warp's registers, N <= {MAX_LN_N}"
            if not config["VEC"]:
                return f"VEC=0: the fused LayerNorm moves 16-byte chunks of rows (N % {ch} == 0, VEC=1)"
        if _gated(problem):
            if n % 2:
                return f"N={n}: a gated GEMM's B interleaves (gate, up) column pairs, so N is even"
            if config["EPI"] or res or _layer_scale(problem) or _layernorm(problem):
                return ("a gated GEMM writes act(gate) * up from the direct epilogue (EPI=0), without a residual, "
                        "LayerScale or LayerNorm")
        if _fp8(problem):
            if problem.dtype != "f16" or not trans_b:
                return f"fp8: E4M3 operands held in halves (dtype f16, not {problem.dtype}) with a K-major B (trans_b)"
            if not config["VEC"] or k % 16:
                return f"fp8: B's E4M3 rows move in 16-byte chunks (VEC=1, K % 16 == 0; K={k})"
        if config["EPI"] and not config["VEC"]:
            return "EPI=1 (the epilogue staged through shared memory, 16-byte chunks of y) needs VEC=1"
        bm, bn, bk, wm, wn = config["BM"], config["BN"], config["BK"], config["WM"], config["WN"]
        if bm % (16 * wm) or bn % (8 * wn):
            return (f"warp layout {wm}x{wn} does not divide the {bm}x{bn} tile into warp tiles that are multiples "
                    f"of 16x8 (warp tile {bm / wm:g}x{bn / wn:g})")
        if bk % 16:
            return f"BK={bk} is not a multiple of the mma k (16)"
        threads = wm * wn * 32
        if threads > MAX_THREADS:
            return f"{threads} threads per block (WM*WN*32) exceed {MAX_THREADS}"
        acc = (bm // wm) * (bn // wn) // 32
        if acc > MAX_ACC_PER_THREAD:
            return (f"warp tile {bm // wm}x{bn // wn} needs {acc} fp32 accumulators per thread "
                    f"(> {MAX_ACC_PER_THREAD}: would spill registers)")
        if config["EPI"]:
            chunks = bm * bn // chunk_elems(_out_dtype(problem))
            if chunks % threads:
                return (f"EPI=1: the {chunks} 16-byte chunks of a {bm}x{bn} tile do not divide among {threads} "
                        f"threads")
        smem = smem_bytes(config, trans_b, problem.dtype, _fp8(problem))
        limit = TARGETS[arch].smem_kib * 1024
        if smem > limit:
            return f"shared memory {smem} B ({smem / 1024:g} KiB) exceeds the {arch} limit of {limit // 1024} KiB"
        return None

    # ---------------------------------------------------------------------------------------------------------
    def configs(self, problem: Problem, arch: str) -> list[dict[str, int]]:
        """Big 8-warp tiles for big problems, smaller tiles when the big ones would not fill the GPU; on sm_90a the
        CUTLASS instances.

        Where 128x128 tiles would not fill the SMs (a batch-1 transformer's GEMMs: 128 to 200 rows), the first
        configuration is the one of _FILL_TILE (64x64), 128x64 and 128x128, each split over K as far as one wave
        and MIN_KTILES_PER_SPLIT allow, that runs the most blocks: on an H200 BERT-base's 128-row GEMMs ran 12 to 48
        blocks of 128x64 for 132 SMs, 13 to 16 us each, three times cuBLAS's time.

        Beside the 64x32 warp tiles, 64x64 ones (128x128 on 4 warps, 128x256 and 256x128 on 8), which halve the
        shared-memory reads per mma; each big tile also with the epilogue staged through shared memory (EPI = 1).
        Where even 64x64 tiles would leave half the SMs idle and K is long, split-K comes first: the largest SPLITK
        that keeps one wave and at least MIN_KTILES_PER_SPLIT k-tiles per slice (not for M = 1, which also stands
        for a symbolic row count whose run-time size may fill the GPU alone)."""
        own = [(impl, module) for impl, module in ((i, importlib.import_module(m)) for i, m in IMPLS.items())
               if module.ARCH == arch]
        if own:
            return [{"impl": impl, **c} for impl, module in own for c in module.configs(problem, arch)]
        if arch not in ARCHS:
            return []  # check rejects every configuration for it
        big = [
            {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 4, "STAGES": 4},
            {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4},
            {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 4, "STAGES": 3},
            {"BM": 128, "BN": 256, "BK": 32, "WM": 2, "WN": 4, "STAGES": 3},
            {"BM": 256, "BN": 128, "BK": 32, "WM": 4, "WN": 2, "STAGES": 3},
            {"BM": 128, "BN": 128, "BK": 64, "WM": 2, "WN": 4, "STAGES": 3},
            {"BM": 128, "BN": 128, "BK": 64, "WM": 2, "WN": 2, "STAGES": 3},
        ]
        big = [v for c in big for v in (c, {**c, "EPI": 1})]
        small = [
            {"BM": 128, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4},
            {"BM": 64, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4},
            {"BM": 64, "BN": 64, "BK": 64, "WM": 2, "WN": 2, "STAGES": 3},
            {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 2},
        ]
        sms = TARGETS[arch].sms
        try:
            batch, m, n, k, _ = _sizes(problem)
        except KeyError:
            batch = m = n = k = 0
        tiles = batch * math.ceil(m / 128) * math.ceil(n / 128)
        lead: list[tuple[int, dict[str, int]]] = []
        if tiles < sms and m > 1:
            for c in (_FILL_TILE, small[0], big[0]):
                t = batch * math.ceil(m / c["BM"]) * math.ceil(n / c["BN"])
                ktiles = math.ceil(k / c["BK"])
                fits = [s for s in SPLITS if s > 1 and t * s <= sms and ktiles >= s * MIN_KTILES_PER_SPLIT]
                lead.append((t * max(fits), {**c, "SPLITK": max(fits)}) if fits else (t, c))
            lead.sort(key=lambda bc: -bc[0])  # stable: the smaller tile first among equals
        order = big + small if tiles >= sms else [c for _, c in lead] + small + big
        try:
            ch = chunk_elems(problem.dtype)
            vec = int(problem.size("K") % ch == 0 and problem.size("N") % ch == 0)
        except KeyError:
            vec = 1
        order = [{**c, "VEC": vec} for c in order]
        if _layernorm(problem):  # no split-K (the tuner's analytical model ranks them with the normalize step)
            order = [{k: v for k, v in c.items() if k != "SPLITK"} for c in order]
        seen: set[tuple[tuple[str, int], ...]] = set()
        unique = [c for c in order if (key := tuple(sorted(c.items()))) not in seen and not seen.add(key)]
        return [c for c in unique if self.check(problem, c, arch) is None]

    # ---------------------------------------------------------------------------------------------------------
    def instance_name(self, problem: Problem, config: Config, arch: str) -> str:
        if config.get("impl") == cublaslt.IMPL:
            return cublaslt.instance(problem, int(config["RANK"]), arch).name
        impl = _impl(config)
        if impl is not None:
            return str(impl.instance_name(problem, config, flag_suffix(problem)))
        parts = [self.name, arch.replace("_", ""), problem.dtype,
                 f"{config['BM']}x{config['BN']}x{config['BK']}", f"w{config['WM']}x{config['WN']}",
                 f"s{config['STAGES']}"]
        if not config.get("VEC", 1):
            parts.append("sc")
        if config.get("SPLITK", 1) > 1:
            parts.append(f"sk{config['SPLITK']}")
        if config.get("EPI", 0):
            parts.append("es")
        return "_".join(parts) + (f"_{flag_suffix(problem)}" if flag_suffix(problem) else "")

    def instantiate(self, problem: Problem, config: Config, arch: str) -> Instance:
        why = self.check(problem, config, arch)
        if why is not None:
            raise ValueError(why)
        if config.get("impl") == cublaslt.IMPL:
            return cublaslt.instance(problem, int(config["RANK"]), arch)
        impl = _impl(config)
        if impl is not None:
            return impl.instantiate(problem, config, arch, flag_suffix(problem))  # type: ignore[no-any-return]
        trans_b, bias, act, res = _flags(problem)
        scale = _layer_scale(problem)
        name = self.instance_name(problem, config, arch)
        symbol = f"gtco_{name}"
        c = config
        b = "true" if trans_b else "false"
        targs = (f"{_CTYPE[problem.dtype]}, {c['BM']}, {c['BN']}, {c['BK']}, {c['WM']}, {c['WN']}, {c['STAGES']}, "
                 f"/*TRANS_B=*/{b}, /*HAS_BIAS=*/{str(bias).lower()}, gtco::Act::{ACTIVATIONS[act]}, "
                 f"/*HAS_RES=*/{str(res).lower()}, /*VEC=*/{'true' if c.get('VEC', 1) else 'false'}")
        splits, epi = int(c.get("SPLITK", 1)), bool(c.get("EPI", 0))
        ln, gated, fp8 = _layernorm(problem), _gated(problem), _fp8(problem)
        if _out_dtype(problem) != problem.dtype or splits > 1 or epi or scale or ln or gated or fp8:
            targs += f", /*TOut=*/{'float' if _out_dtype(problem) != problem.dtype else _CTYPE[problem.dtype]}"
        if splits > 1 or epi or scale or ln or gated or fp8:
            targs += f", /*SPLITK=*/{splits}, /*EPI_SMEM=*/{str(epi).lower()}"
        if scale or ln or gated or fp8:
            targs += f", /*HAS_SCALE=*/{str(scale).lower()}"
        if ln or gated or fp8:
            targs += f", /*LN=*/{str(ln).lower()}"
        if gated or fp8:
            targs += f", /*GATED=*/{str(gated).lower()}"
        if fp8:
            targs += ", /*FP8=*/true"
        source = (
            f"// Generated by onnx_gtco.families.gemm.kernel: {name}\n"
            f"// y = {act}(A @ B{'^T' if trans_b else ''}{' + bias' if bias else ''})"
            f"{' * up (gated: B interleaves gate and up columns)' if gated else ''}"
            f"{' * layer_scale' if scale else ''}{' + residual' if res else ''}"
            f"{'; ln_y = LayerNorm(y) * gamma + beta' if ln else ''}"
            f"{'; A rounded to E4M3 at a_scale, B E4M3' if fp8 else ''}"
            f"; tile {c['BM']}x{c['BN']}x{c['BK']}, warps {c['WM']}x{c['WN']}, {c['STAGES']} stages"
            f"{f', split-K {splits}' if splits > 1 else ''}{', staged epilogue' if epi else ''}, {arch}\n"
            f"#include \"gemm/gemm.cuh\"\n"
            f"\n"
            f"GTCO_EXPORT int {symbol}(const GemmArgs* args, void* stream) {{\n"
            f"    return gtco::launch_gemm<{targs}>(args, stream);\n"
            f"}}\n")
        return Instance(name=name, symbol=symbol, source=source, problem=problem,
                        config={**self.optional, **config}, arch=arch,
                        smem_bytes=smem_bytes(config, trans_b, problem.dtype, fp8))

    # ---------------------------------------------------------------------------------------------------------
    def input_shapes(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        batch, m, n, k, b_batched = _sizes(problem)
        trans_b, bias, _, res = _flags(problem)
        b_shape = (n, k) if trans_b else (k, n)
        shapes: dict[str, tuple[int, ...]] = {"a": (batch, m, k), "b": ((batch, *b_shape) if b_batched else b_shape)}
        if bias:
            shapes["bias"] = (n,)
        if _layer_scale(problem):
            shapes["layer_scale"] = (n,)
        if res:
            shapes["residual"] = (batch, m, n)
        if _layernorm(problem):
            shapes["gamma"] = (n,)
            shapes["beta"] = (n,)
        return shapes

    def args_fields(self, problem: Problem, arrays: Mapping[str, np.ndarray]) -> list[Field]:
        batch, m, n, k, b_batched = _sizes(problem)
        _, bias, _, res = _flags(problem)
        ln = _layernorm(problem)
        return [
            Field("a", "ptr", "a"),
            Field("b", "ptr", "b"),
            Field("bias", "ptr", "bias" if bias else ""),
            Field("residual", "ptr", "residual" if res else ""),
            Field("y", "ptr", "y"),
            Field("batch", "i64", batch),
            Field("m", "i64", m),
            Field("n", "i64", n),
            Field("k", "i64", k),
            Field("stride_a", "i64", m * k),
            Field("stride_b", "i64", k * n if b_batched else 0),
            Field("stride_y", "i64", m * _y_cols(problem)),
            Field("alpha", "f32", float(problem.flag("alpha", 1.0))),
            Field("layer_scale", "ptr", "layer_scale" if _layer_scale(problem) else ""),
            Field("ln_gamma", "ptr", "gamma" if ln else ""),
            Field("ln_beta", "ptr", "beta" if ln else ""),
            Field("ln_y", "ptr", "ln_y" if ln else ""),
            Field("ln_eps", "f32", _epsilon(problem) if ln else 0.0),
            Field("a_scale", "f32", _a_scale(problem) if _fp8(problem) else 0.0),
        ]

    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        batch, m, n, _, _ = _sizes(problem)
        out = {"y": ((batch, m, _y_cols(problem)), _out_dtype(problem))}
        if _layernorm(problem):
            out["ln_y"] = ((batch, m, n), problem.dtype)
        return out

    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        _, _, _, _, b_batched = _sizes(problem)
        trans_b, bias, act, res = _flags(problem)
        dt = problem.dtype
        a = from_storage(np.asarray(inputs["a"]), dt)
        b = from_storage(np.asarray(inputs["b"]), dt)
        if _fp8(problem):  # A rounded to E4M3 at its scale, B's bytes E4M3 values
            a = round_e4m3((a / np.float32(_a_scale(problem))).astype(np.float32)).astype(np.float64)
            b = np.asarray(inputs["b"]).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        if dt == "f32":  # the Tensor Core multiplies TF32 operands
            a, b = (tf32_round(x).astype(np.float64) for x in (a, b))
        if trans_b:
            b = np.swapaxes(b, -1, -2)
        y = float(np.float32(problem.flag("alpha", 1.0))) * np.matmul(a, b)  # [batch, M, K] @ [K, N] or [batch, K, N]
        if bias:
            y = y + from_storage(np.asarray(inputs["bias"]), dt)
        if _gated(problem):  # (gate, up) column pairs
            return {"y": REFERENCE[act](y[..., 0::2]) * y[..., 1::2]}
        if act != "none":
            y = REFERENCE[act](y)
        if _layer_scale(problem):
            y = y * from_storage(np.asarray(inputs["layer_scale"]), dt)
        if res:
            y = y + from_storage(np.asarray(inputs["residual"]), _out_dtype(problem))
        del b_batched
        if not _layernorm(problem):
            return {"y": y}
        # the LayerNorm reads y as stored (rounded to the dtype), as an unfused GEMM then LayerNorm does
        gamma, beta = (from_storage(np.asarray(inputs[k]), dt) for k in ("gamma", "beta"))
        ln_y = normalize_rows(from_storage(to_storage(y, dt), dt), _epsilon(problem), gamma, beta)
        return {"y": y, "ln_y": ln_y}

    def random_inputs(self, problem: Problem, seed: int) -> dict[str, np.ndarray]:
        """Standard normal A, B scaled by 1/sqrt(K) (so A @ B is O(1)), bias, layer_scale and residual at 0.5
        scale; LayerNorm's gamma 1 + 0.25 N(0, 1) and beta 0.25 N(0, 1)."""
        rng = np.random.default_rng(seed)
        _, _, _, k, _ = _sizes(problem)
        out: dict[str, np.ndarray] = {}
        for key, shape in self.input_shapes(problem).items():
            x = rng.standard_normal(shape)
            if key == "b":
                x = x / math.sqrt(k)
            elif key in ("bias", "residual", "layer_scale"):
                x = 0.5 * x
            elif key == "gamma":
                x = 1.0 + 0.25 * x
            elif key == "beta":
                x = 0.25 * x
            if key == "b" and _fp8(problem):  # E4M3 bytes of values of O(1): A @ B is O(sqrt(K))
                out[key] = to_e4m3(x.astype(np.float32) * math.sqrt(k)).view(np.uint8)
                continue
            out[key] = to_storage(x.astype(np.float32), _out_dtype(problem) if key == "residual" else problem.dtype)
        return out

    def allocate_outputs(self, problem: Problem) -> dict[str, np.ndarray]:
        """Preallocated outputs, filled with a NaN pattern so that an element the kernel never writes shows."""
        out = {}
        for key, (shape, dt) in self.outputs(problem).items():
            out[key] = np.full(shape, 0xFFFF, np.uint16).view(np_dtype(dt)) if dt != "f32" else np.full(
                shape, np.nan, np.float32)
        return out


def flag_suffix(problem: Problem) -> str:
    """`tb_bias_gelu_erf_ls_res_of32`: the epilogue and layout part of every GEMM instance name ("" for none)."""
    trans_b, bias, act, res = _flags(problem)
    parts = ["tb"] if trans_b else []
    if bias:
        parts.append("bias")
    if act != "none":
        parts.append(act)
    if _layer_scale(problem):
        parts.append("ls")
    if res:
        parts.append("res")
    if _out_dtype(problem) != problem.dtype:
        parts.append("of32")
    if _layernorm(problem):
        parts.append("ln")
    if _gated(problem):
        parts.append("gated")
    if _fp8(problem):
        parts.append("e4m3")
    return "_".join(parts)


def gemm_problem(dtype: str, batch: int, m: int, n: int, k: int, *, b_batched: bool = False, trans_b: bool = False,
                 bias: bool = False, activation: str = "none", residual: bool = False, alpha: float = 1.0,
                 out_dtype: str | None = None, layer_scale: bool = False, layernorm: bool = False,
                 epsilon: float = 1e-5, gated: bool = False, fp8: bool = False, a_scale: float = 1.0) -> Problem:
    """A GEMM Problem from keyword arguments (alpha, a run-time argument of the instance, is a flag only when not 1;
    layer_scale, gated, and layernorm with its epsilon, only when set, so problems without them stay what they
    were). `gated`: N counts the interleaved gate and up columns, y has N / 2."""
    flags: dict[str, Any] = {"trans_b": trans_b, "bias": bias, "activation": activation, "residual": residual}
    if layer_scale:
        flags["layer_scale"] = True
    if gated:
        flags["gated"] = True
    if fp8:
        flags["fp8"] = True
        if a_scale != 1.0:
            flags["a_scale"] = float(a_scale)
    if layernorm:
        flags["layernorm"] = True
        flags["epsilon"] = float(epsilon)
    if alpha != 1.0:
        flags["alpha"] = float(alpha)
    if out_dtype is not None and out_dtype != dtype:
        flags["out_dtype"] = out_dtype
    return Problem.make("gemm", dtype, {"batch": batch, "M": m, "N": n, "K": k, "b_batched": int(b_batched)}, flags)


FAMILY = GemmFamily()


def op_problem(op: FusedOp, dtype: str) -> Problem | str:
    """The Problem of a gemm or qkv node (OpKernel.problem), or why none."""
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
    batch = static_product(batch_dims)
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
                        epsilon=float(op.attrs.get("epsilon", 1e-5)), gated=bool(op.attrs.get("gated")),
                        fp8=op.dtype == FP8_DTYPE)


KERNELS = (FAMILY,)
OPS = (OpKernel("gemm", "gemm", op_problem, extent_attr="m"), OpKernel("qkv", "gemm", op_problem, extent_attr="m"))


CONSTANTS = (MmaConstants, cutlass.CutlassConstants)
"""The groups of constants of this family's estimates, which `onnx-gtco calibration fit` fits per GPU (tune/fit.py)."""
