"""Hopper GEMMs built from CUTLASS 3.x (the GEMM family's `impl` "cutlass"): thin instantiations over the headers of
the pinned `nvidia-cutlass` package (the `cutlass` extra), for the sm_90a arch slot only.

Each instance is one translation unit rendered from plugins/families/gemm/cutlass_gemm.cu.j2: TMA loads and wgmma from
the collective builders, a warp-specialized cooperative or ping-pong mainloop, a persistent tile scheduler
(data-parallel or stream-K), and the GEMM family's epilogue ``y = act(alpha * A @ B + bias) + residual`` with the
output cast as an epilogue visitor tree (`epilogue_tree`). It exports the same entry point as the "mma" instances,
``int gtco_<name>(const GemmArgs*, void* stream)``, so the glue and the tuner call either alike; the GEMM family's
reference, inputs and argument struct are shared.

What the mapping does not express is a reason, never a silent fallback (`unsupported`): activations without a
CUTLASS functor (quick_gelu, relu6), TF32 with a [K, N] B (wgmma reads tf32 operands K-major only), sizes whose rows
are not 16-byte multiples (TMA), GEMM problem flags it does not know (a layout beyond dense row-major A, y and
residual: the head-split / head-merge layouts have no flag in the GEMM problem yet).

The tuner offers this implementation on GEMM tasks for TARGET (sm_90), building its trials for the sm_90a slot;
`estimate_us` prices a configuration tile by tile from the constants fitted to the measured CUTLASS kernels
(`CutlassConstants`; onnx_gtco.calibration), for the planner, the build's default choice and the tuner alike.

Config (all keys required but "impl", which selects this module from the GEMM family):
    TILE_M, TILE_N, TILE_K  CTA tile; TILE_K * element size a multiple of the 128-byte swizzle
    CLUSTER_M, CLUSTER_N    thread-block cluster (TMA multicast), at most 2 CTAs
    SCHEDULE                "cooperative" (two consumer warp groups share a tile, TILE_M % 128 == 0) or
                            "pingpong" (each consumer warp group owns a tile, TILE_M <= 128)
    STAGES                  mainloop stages; 0: as many as fit beside the epilogue's shared memory
    RASTER                  tile order of the persistent scheduler: "heuristic", "m" or "n"
    TILE_SCHEDULER          "persistent" (data-parallel) or "streamk" (stream-K for the tail wave; cooperative only)
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from onnx_gtco.calibration import Constants, Hardware, LaunchConstants, param
from onnx_gtco.config import TARGETS
from onnx_gtco.kernels.family import Config, Instance, Problem
from onnx_gtco.kernels.render import render

ARCH = "sm_90a"
"""The only arch: wgmma and setmaxnreg need the arch-specific target, whose cubin runs on 9.0 devices only."""
TARGET = "sm_90"
"""The config.TARGETS entry (the H100-SXM5) whose hardware runs the sm_90a instances: tuning tasks for it offer
the CUTLASS implementation, built for its sm_90a slot (plugin.device.FALLBACK_SLOTS), and the cost model reads its
SMs, peaks and bandwidth."""
IMPL = "cutlass"
PACKAGE = "nvidia-cutlass"
TEMPLATE = "families/gemm/cutlass_gemm.cu.j2"
NVCC_FLAGS = ("--expt-relaxed-constexpr",)
MAX_ACC_PER_THREAD = 128  # fp32 accumulators per consumer thread beyond which the tile cannot stay in registers
EPILOGUE_SMEM_BOUND = 32 * 1024  # shared memory the TMA epilogue keeps beside the mainloop's stages (an upper bound)

SPACE: Mapping[str, tuple[Any, ...]] = {
    "TILE_M": (64, 128, 256),
    "TILE_N": (64, 128, 256),
    "TILE_K": (32, 64, 128),
    "CLUSTER_M": (1, 2),
    "CLUSTER_N": (1, 2),
    "SCHEDULE": ("cooperative", "pingpong"),
    "STAGES": (0, 2, 3, 4, 5, 6, 7),
    "RASTER": ("heuristic", "m", "n"),
    "TILE_SCHEDULER": ("persistent", "streamk"),
}

ELEMENTS = {"f16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "f32": "float"}
_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
ACTIVATIONS: Mapping[str, str] = {
    "relu": "cutlass::epilogue::thread::ReLu",
    "gelu_erf": "cutlass::epilogue::thread::GELU",
    "gelu_tanh": "cutlass::epilogue::thread::GELU_taylor",  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "silu": "cutlass::epilogue::thread::SiLu",
    "sigmoid": "cutlass::epilogue::thread::Sigmoid",
    "tanh": "cutlass::epilogue::thread::Tanh",
}
"""GEMM activation -> the CUTLASS functor the epilogue applies in fp32."""
_FLAGS = frozenset({"trans_b", "bias", "activation", "residual", "alpha", "out_dtype", "layer_scale", "layernorm",
                    "epsilon"})
_SCHEDULES = {
    "cooperative": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                    "cutlass::epilogue::TmaWarpSpecializedCooperative", "coop"),
    "pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong", "cutlass::epilogue::TmaWarpSpecialized", "pp"),
}
_TILE_SCHEDULERS = {"persistent": ("cutlass::gemm::PersistentScheduler", "dp"),
                    "streamk": ("cutlass::gemm::StreamKScheduler", "sk")}
_RASTER = {"heuristic": "Raster::Heuristic", "m": "Raster::AlongM", "n": "Raster::AlongN"}


# ------------------------------------------------------------------------------------------------------------------
# The installed headers


@functools.cache
def include_dirs() -> tuple[Path, ...] | str:
    """The CUTLASS / CuTe include folders of the installed `nvidia-cutlass` (include and tools/util/include), or
    why there are none."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return f"{PACKAGE} is not installed (pip install 'onnx-gtco[cutlass]'): it carries the CUTLASS headers"
    source = Path(next(iter(spec.submodule_search_locations))) / "source"
    dirs = (source / "include", source / "tools" / "util" / "include")
    for d, probe in zip(dirs, ("cutlass/gemm/kernel/gemm_universal.hpp", "cutlass/util/packed_stride.hpp"),
                        strict=True):
        if not (d / probe).is_file():
            return f"{PACKAGE} at {source.parent} lacks {probe} under {d}"
    return dirs


@functools.cache
def version() -> str:
    """The installed nvidia-cutlass version (written into every instance, so a new version rebuilds them)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ------------------------------------------------------------------------------------------------------------------
# The mapping: a GEMM problem and a config -> template parameters, or why not


def _flags(problem: Problem) -> tuple[bool, bool, str, bool, str]:
    """trans_b, bias, activation, residual, out dtype."""
    return (bool(problem.flag("trans_b", False)), bool(problem.flag("bias", False)),
            str(problem.flag("activation", "none") or "none"), bool(problem.flag("residual", False)),
            str(problem.flag("out_dtype", problem.dtype) or problem.dtype))


def unsupported(problem: Problem) -> str | None:
    """Why the CUTLASS epilogue and mainloop cannot compute `problem` at all (whatever the config), or None."""
    if problem.family != "gemm":
        return f"problem is for family {problem.family!r}, not 'gemm'"
    if problem.dtype not in ELEMENTS:
        return f"dtype {problem.dtype}: the CUTLASS GEMMs take f16, bf16 or f32 (TF32)"
    unknown = sorted(k for k, _ in problem.flags if k not in _FLAGS)
    if unknown:
        return (f"GEMM flag(s) {', '.join(unknown)} are not expressed by the CUTLASS instantiation (it reads dense "
                f"row-major A, y and residual)")
    trans_b, _, act, _, out_dtype = _flags(problem)
    if problem.flag("layer_scale", False):
        return ("layer_scale: the epilogue tree here has no per-column scale between the activation and the residual "
                "(the mma kernels take it)")
    if problem.flag("layernorm", False):
        return ("layernorm: the epilogue here has no row reduction over N (a LayerNorm of y's rows); the mma kernels "
                "fuse it")
    if act != "none" and act not in ACTIVATIONS:
        return (f"activation {act!r} has no CUTLASS epilogue functor in the mapping (have: none, "
                f"{', '.join(ACTIVATIONS)})")
    if out_dtype not in (problem.dtype, "f32"):
        return f"out_dtype {out_dtype}: y is {problem.dtype} or f32 (the output cast)"
    if problem.dtype == "f32" and not trans_b:
        return "TF32 with a [K, N] B: wgmma reads tf32 operands K-major only (a [N, K] B, trans_b)"
    align = 16 // _BYTES[problem.dtype]
    for key in ("K", "N"):
        try:
            extent = problem.size(key)
        except KeyError:
            return f"problem lacks size {key}"
        if extent % align:
            return f"{key}={extent}: TMA needs rows of 16-byte multiples ({key} % {align} == 0 for {problem.dtype})"
    return None


def check(problem: Problem, config: Config, arch: str) -> str | None:
    """None when `config` builds a CUTLASS instance for `problem` on `arch`, else the reason it cannot."""
    if arch != ARCH:
        return f"arch {arch!r}: the CUTLASS GEMMs are built for {ARCH} only (wgmma)"
    why = unsupported(problem)
    if why is not None:
        return why
    missing = [k for k in SPACE if k not in config]
    if missing:
        return f"config lacks {', '.join(missing)}"
    for key, allowed in SPACE.items():
        if config[key] not in allowed:
            return f"{key}={config[key]!r} is outside the space {allowed}"
    return _check_shape(problem, config)


def _check_shape(problem: Problem, c: Config) -> str | None:
    tm, tn, tk, nbytes = c["TILE_M"], c["TILE_N"], c["TILE_K"], _BYTES[problem.dtype]
    if tk * nbytes % 128:
        return f"TILE_K={tk}: {tk * nbytes} B rows of {problem.dtype} are not a multiple of the 128-byte swizzle"
    coop = c["SCHEDULE"] == "cooperative"
    if coop and tm % 128:
        return f"TILE_M={tm}: the cooperative schedule splits the tile's M over two warp groups of 64 rows"
    if not coop and tm > 128:
        return f"TILE_M={tm}: a ping-pong warp group owns a whole tile, at most 128 rows"
    acc = tm * tn // (256 if coop else 128)
    if acc > MAX_ACC_PER_THREAD:
        return f"tile {tm}x{tn}: {acc} fp32 accumulators per consumer thread (> {MAX_ACC_PER_THREAD}) would spill"
    if c["CLUSTER_M"] * c["CLUSTER_N"] > 2:
        return f"cluster {c['CLUSTER_M']}x{c['CLUSTER_N']}: at most 2 CTAs"
    if c["TILE_SCHEDULER"] == "streamk" and not coop:
        return "stream-K needs the cooperative schedule (CUTLASS's ping-pong kernel has no stream-K)"
    stages = c["STAGES"]
    smem = stages * (tm + tn) * tk * nbytes + EPILOGUE_SMEM_BOUND
    limit = TARGETS[TARGET].smem_kib * 1024
    if stages and smem > limit:
        return (f"{stages} stages of {tm}x{tk} + {tn}x{tk} tiles and the epilogue need about {smem // 1024} KiB "
                f"(> {limit // 1024} KiB)")
    return None


def epilogue_tree(problem: Problem) -> dict[str, Any]:
    """The epilogue visitor tree of `problem` as plain data (the template writes its types and arguments):
    ``alpha * acc (+ bias)`` in fp32, then the activation, then ``+ residual`` (C, in y's dtype); the root node
    converts to y's dtype."""
    _, bias, act, residual, out_dtype = _flags(problem)
    out = ELEMENTS[out_dtype]
    scaled: dict[str, Any] = {"op": "cutlass::homogeneous_multiply_add" if bias else "cutlass::multiplies",
                              "out": "float",
                              "children": [{"leaf": "alpha"}, {"leaf": "acc"}, *([{"leaf": "bias"}] if bias else [])]}
    node = scaled
    if act != "none":
        node = {"op": ACTIVATIONS[act], "out": "float", "children": [node]}
    if residual:
        node = {"op": "cutlass::plus", "out": "float", "children": [node, {"leaf": "src"}]}
    node["out"] = out
    return node


def template_params(problem: Problem, config: Config) -> dict[str, Any]:
    """Everything the template needs but the name: plain strings and numbers."""
    trans_b, bias, act, residual, out_dtype = _flags(problem)
    mainloop, epilogue, _ = _SCHEDULES[config["SCHEDULE"]]
    formula = f"alpha * A @ B{'^T' if trans_b else ''}{' + bias' if bias else ''}"
    if act != "none":
        formula = f"{act}({formula})"
    return {
        "element": ELEMENTS[problem.dtype],
        "element_d": ELEMENTS[out_dtype],
        "element_c": ELEMENTS[out_dtype] if residual else "void",
        # B [N, K] (trans_b) is K-major: CUTLASS's column-major B; B [K, N] is N-major: its row-major B
        "layout_b": "cutlass::layout::ColumnMajor" if trans_b else "cutlass::layout::RowMajor",
        "tile": (config["TILE_M"], config["TILE_N"], config["TILE_K"]),
        "cluster": (config["CLUSTER_M"], config["CLUSTER_N"]),
        "schedule": config["SCHEDULE"],
        "mainloop_schedule": mainloop,
        "epilogue_schedule": epilogue,
        "stages": int(config["STAGES"]),
        "tile_scheduler": config["TILE_SCHEDULER"],
        "tile_scheduler_type": _TILE_SCHEDULERS[config["TILE_SCHEDULER"]][0],
        "raster": config["RASTER"],
        "raster_order": _RASTER[config["RASTER"]],
        "bias": bias,
        "residual": residual,
        "evt": epilogue_tree(problem),
        "formula": f"y = {formula}{' + residual' if residual else ''} -> {out_dtype}",
    }


def instance_name(problem: Problem, config: Config, suffix: str) -> str:
    """`gemm_sm90a_cutlass_f16_128x128x64_c1x1_coop_sauto_rh_sk` + the GEMM family's flag suffix (`suffix`)."""
    c = config
    stages = f"s{c['STAGES']}" if c["STAGES"] else "sauto"
    parts = ["gemm", ARCH.replace("_", ""), "cutlass", problem.dtype, f"{c['TILE_M']}x{c['TILE_N']}x{c['TILE_K']}",
             f"c{c['CLUSTER_M']}x{c['CLUSTER_N']}", _SCHEDULES[c["SCHEDULE"]][2], stages, f"r{c['RASTER'][0]}",
             _TILE_SCHEDULERS[c["TILE_SCHEDULER"]][1]]
    return "_".join(parts) + (f"_{suffix}" if suffix else "")


def instantiate(problem: Problem, config: Config, arch: str, suffix: str) -> Instance:
    """The instance's source; ValueError with check()'s reason for an invalid config, or saying that the package
    is missing."""
    why, dirs = check(problem, config, arch), include_dirs()
    if why is None and isinstance(dirs, str):
        why = dirs
    if why is not None or isinstance(dirs, str):
        raise ValueError(why)
    name = instance_name(problem, config, suffix)
    symbol = f"gtco_{name}"
    source = render(TEMPLATE, name=name, symbol=symbol, arch=arch, cutlass_version=version(),
                    **template_params(problem, config))
    return Instance(name=name, symbol=symbol, source=source, problem=problem, config={"impl": "cutlass", **config},
                    arch=arch, include_dirs=tuple(str(d) for d in dirs), nvcc_flags=NVCC_FLAGS)


def configs(problem: Problem, arch: str) -> list[dict[str, Any]]:
    """Valid configs, best first by rule of thumb: stream-K first when the data-parallel tiles would leave most of
    the last wave idle, else the persistent 128x128 cooperative tile; none when the package is missing."""
    if isinstance(include_dirs(), str) or arch != ARCH or unsupported(problem) is not None:
        return []
    tk = 128 // _BYTES[problem.dtype]
    base = {"TILE_K": tk, "CLUSTER_M": 1, "CLUSTER_N": 1, "STAGES": 0, "RASTER": "heuristic",
            "TILE_SCHEDULER": "persistent", "SCHEDULE": "cooperative"}
    cands = [
        {**base, "TILE_M": 128, "TILE_N": 128},
        {**base, "TILE_M": 128, "TILE_N": 128, "TILE_SCHEDULER": "streamk"},
        {**base, "TILE_M": 64, "TILE_N": 128, "SCHEDULE": "pingpong"},
        {**base, "TILE_M": 128, "TILE_N": 256},
        {**base, "TILE_M": 256, "TILE_N": 128},
        {**base, "TILE_M": 128, "TILE_N": 128, "CLUSTER_M": 2},
    ]
    try:
        tiles = problem.size("batch") * math.ceil(problem.size("M") / 128) * math.ceil(problem.size("N") / 128)
    except KeyError:
        tiles = 0
    sms = TARGETS[TARGET].sms
    if tiles and tiles % sms and tiles % sms < sms // 2:  # a mostly idle last wave: stream-K splits its K
        cands.insert(0, cands.pop(1))
    return [c for c in cands if check(problem, c, arch) is None]


# ------------------------------------------------------------------------------------------------------------------
# The estimate of an instance's time (the one estimate the planner, the build's selection and the tuner read)


@dataclass(frozen=True)
class CutlassConstants(Constants):
    """The constants of `estimate_us` (onnx_gtco.calibration: fitted per GPU from measured CUTLASS kernels, on the
    H200 from ViT-B/16's four projection GEMMs at batch 64, 128x128x64 cooperative persistent tiles)."""

    GROUP: ClassVar[str] = "gemm.cutlass"
    mainloop_frac: float = param(0.868, 0.1, 1.0, "of the Tensor Core peak", "the share of an SM's peak a "
                                 "warp-specialized TMA / wgmma mainloop sustains on one tile, its pipeline's fill "
                                 "and drain included")
    l2_frac: float = param(2.5, 0.2, 6.0, "x DRAM bandwidth", "the rate, all SMs together, at which TMA brings "
                           "operand tiles from L2 (a mainloop slower than this is bound by its operands); not fitted: "
                           "the measured 128x128 tiles were bound by their Tensor Core work (at 4.8 TB/s x 2.5 they "
                           "stay so, at 1.2x they would not), so no record tells its value", fit=False)
    epilogue_frac: float = param(0.464, 0.05, 2.0, "of DRAM bandwidth", "the rate, all SMs together, at which "
                                 "epilogues write their tiles (and read the residual)")
    act_cost: float = param(1.08, 0.0, 10.0, "x a plain epilogue", "what an activation (GELU, tanh, ...) adds to an "
                            "epilogue")
    extra_us: float = param(3.0, 0.0, 20.0, "us", "what a kernel takes beyond the launch floor however few tiles it "
                            "has (the persistent scheduler's and TMA descriptors' setup, the first stages' fill, the "
                            "last tile's drain); not fitted: the measured grids were 5 to 18 waves long, where it does "
                            "not show. Its default is the vendor GEMM's fitted extra time (cuBLAS's sm_90 kernels are "
                            "the same TMA / wgmma design), until the GPU suite's calibration row times CUTLASS at a "
                            "few tiles", fit=False)


MIN_ITERS_PER_SK_UNIT = 8
"""CUTLASS's stream-K rule (PersistentTileSchedulerSm90StreamKParams::min_iters_per_sk_unit_), not an assumption:
a tile of at most this many K iterations is never split, and a stream-K unit takes at least this many."""
_CHEAP_ACTS = frozenset({"relu"})


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def estimate_us(problem: Problem, config: Config, hw: Hardware) -> float:
    """Estimated time of a valid `config` on `problem` (microseconds) on `hw` (an sm_90 GPU), from its
    CutlassConstants and the launch floor:

    * one tile on one SM: its mainloop is the slower of its MMA work at `mainloop_frac` of the SM's share of the
      peak and its operand tiles at the SM's share of `l2_frac` x the DRAM bandwidth; its epilogue writes the tile
      (and reads the residual) at the SM's share of `epilogue_frac` x the DRAM bandwidth, `act_cost` more with an
      activation. Cooperative: the epilogue follows the mainloop. Ping-pong: it hides behind the other warp group's
      next mainloop, but for each CTA's last tile.
    * the grid: one persistent CTA per SM (whole clusters); tiles rounded up to whole clusters. The data-parallel
      scheduler runs ceil(tiles / CTAs) waves, its last one partly idle (wave quantization). Stream-K follows
      CUTLASS's heuristic: where the last wave is less than half full and a tile has more than
      MIN_ITERS_PER_SK_UNIT K iterations, the last two waves' tiles are split by K iterations over the CTAs, each
      split tile paying one fp32 partial tile written and read through the workspace.
    * the pipeline's fill (a CTA's first MMA waits for its first stage's operands) and the launch floor.

    Measured so far: 128x128x64 cooperative data-parallel tiles with 5 to 18 waves (docs/benchmarks.md); the
    model's structure, not a measurement, carries it to other tiles, schedules and small grids. It does not see the
    raster order nor the stage count beyond what fits (`check`)."""
    t = hw.target
    c = hw.constants(CutlassConstants)
    sizes = dict(problem.sizes)
    batch, m, n, k = sizes.get("batch", 1), sizes["M"], sizes["N"], sizes["K"]
    rows, groups = (m, batch) if sizes.get("b_batched", 0) else (batch * m, 1)  # a weight GEMM folds its batch
    tm, tn, tk = config["TILE_M"], config["TILE_N"], config["TILE_K"]
    cm, cn = config["CLUSTER_M"], config["CLUSTER_N"]
    _, _, act, residual, out_dtype = _flags(problem)
    elem = _BYTES[problem.dtype]

    k_iters = math.ceil(k / tk)
    peak = (t.tf32_tflops if problem.dtype == "f32" else t.tc_tflops) * 1e6 / t.sms  # FLOP per us, one SM
    compute = 2.0 * tm * tn * tk * k_iters / (peak * c.mainloop_frac)
    l2_per_sm = c.l2_frac * t.dram_gbps * 1e3 / t.sms  # bytes per us
    load = (tm / cn + tn / cm) * tk * k_iters * elem / l2_per_sm
    mainloop = max(compute, load)
    act_factor = 1.0 + (0.0 if act == "none" else c.act_cost * (0.2 if act in _CHEAP_ACTS else 1.0))
    epilogue = (tm * tn * _BYTES[out_dtype] * (2 if residual else 1) / (c.epilogue_frac * t.dram_gbps * 1e3 / t.sms)
                * act_factor)
    hidden = config["SCHEDULE"] == "pingpong"
    between = max(0.0, epilogue - mainloop) if hidden else epilogue  # epilogue cost between a CTA's tiles

    cluster = cm * cn
    tiles = groups * _round_up(math.ceil(rows / tm), cm) * _round_up(math.ceil(n / tn), cn)
    ctas = t.sms // cluster * cluster
    full, tail = divmod(tiles, ctas)
    dp_waves = max(full - 1, 0)
    units = min(ctas, (tiles - dp_waves * ctas) * k_iters // MIN_ITERS_PER_SK_UNIT // cluster * cluster)
    if (config["TILE_SCHEDULER"] == "streamk" and tail and k_iters > MIN_ITERS_PER_SK_UNIT and 2 * tail < ctas
            and units):
        share = (tiles - dp_waves * ctas) / units  # tiles' worth of K iterations per stream-K unit
        fixup = 2 * tm * tn * 4 / l2_per_sm if share % 1 else 0.0  # a split tile's fp32 partials, out and in
        body = dp_waves * (mainloop + between) + share * mainloop + fixup + epilogue
    else:
        waves = math.ceil(tiles / ctas)
        body = waves * mainloop + (waves - 1) * between + epilogue
    fill = load / k_iters  # the first stage's operands, before the first MMA
    return body + fill + c.extra_us + hw.constants(LaunchConstants).floor_us


__all__ = ["ARCH", "IMPL", "MIN_ITERS_PER_SK_UNIT", "SPACE", "TARGET", "CutlassConstants", "check",
           "configs", "epilogue_tree", "estimate_us", "include_dirs", "instance_name", "instantiate", "template_params",
           "unsupported", "version"]
