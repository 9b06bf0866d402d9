"""The tuner's view of the one kernel-time estimate: a configuration's predicted time (the CPU measurer's answer
and the first guesses of every study) and its tiling over a run-time extent (the shape-generic tuner's
micro-kernels).

The estimate itself is each family's `estimate_us(problem, config, hw)` in its own module (kernels.gemm with
kernels.cutlass and kernels.cublaslt, kernels.attention, kernels.layernorm, kernels.softmax, kernels.conv,
kernels.elementwise), with the constants fitted per GPU (onnx_gtco.calibration): the same estimate the planner's DP
prices groups with and the build's default selection ranks configurations by, so the tuner never ranks by another
model. A task names its arch only; its hardware is the planning target's where that runs the arch (`hw`), else the
arch's data-sheet target.

Times are microseconds and deterministic: what the tuner measures in CI (no GPU) and what seeds a GPU study, never a
reported kernel time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from onnx_gtco.calibration import Hardware, hardware_for_arch
from onnx_gtco.kernels.attention import FAMILIES as ATTENTION_FAMILIES
from onnx_gtco.kernels.elementwise import FAMILY as ELEMENTWISE
from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.gemm import smem_bytes as gemm_smem
from onnx_gtco.kernels.select import FAMILIES
from onnx_gtco.kernels.timing import regs_per_thread, resident

FILL_FLOOR = 0.05  # a row-wise kernel's time stops dropping with fewer busy slots than this share: latency-bound


def estimate_us(problem: Problem, config: Mapping[str, object], arch: str, hw: Hardware | None = None) -> float:
    """The estimated time of `config` on `problem` for `arch` (its family's estimate_us on `hw`, by default the
    arch's hardware: hardware_for_arch), in microseconds.

    Raises:
        ValueError: no family of that name.
    """
    family = ELEMENTWISE if problem.family == ELEMENTWISE.name else FAMILIES.get(problem.family)
    if family is None:
        raise ValueError(f"no estimate for family {problem.family!r}")
    return float(family.estimate_us(problem, config, hw or hardware_for_arch(arch)))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Tiling:
    """How one configuration's blocks cover a problem along its run-time extent (`kernels.dynamic.extent_name`):
    the micro-kernel geometry of the shape-generic tuner (onnx_gtco.tune.shape_generic).

    Attributes:
        tile: the extent one block covers (gemm BM, attention BQ, row-wise ROWS).
        across: blocks per tile of the extent (the grid's other dims: batch x N tiles, batch x heads, 1).
        slots: blocks resident on the whole GPU at once (SMs x blocks per SM): one wave.
        saturation: blocks from which a wave costs as much as a full one (all the slots for the Tensor Core
            families; FILL_FLOOR of them for the row-wise kernels, whose waves are latency-bound).
        min_busy: blocks below which a wave gets no faster (one per SM for the Tensor Core families, whose lone
            blocks run at their SM's speed; none for the row-wise kernels).
    """

    tile: int
    across: int
    slots: int
    saturation: float
    min_busy: float


def tiling(problem: Problem, config: Mapping[str, int], arch: str) -> Tiling:
    """The Tiling of `config` on `problem` for `arch`, by the resource rules the estimates use
    (kernels.timing.resident).

    Raises:
        ValueError: the family has no run-time extent (elementwise; conv, whose tile would run over N·OH·OW and
            which the dynamic tuner leaves out: kernels.dynamic.extent_name).
    """
    target = hardware_for_arch(arch).target
    sms = target.sms
    c = config
    if problem.family == "gemm":
        cfg = {"VEC": 1, "SPLITK": 1, "EPI": 0, **c}
        threads = cfg["WM"] * cfg["WN"] * 32
        acc = (cfg["BM"] // cfg["WM"]) * (cfg["BN"] // cfg["WN"]) // 32
        per_sm = resident(target, gemm_smem(cfg, bool(problem.flag("trans_b", False)), problem.dtype), threads,
                          regs_per_thread(acc))
        slots = sms * per_sm
        across = problem.size("batch") * math.ceil(problem.size("N") / cfg["BN"]) * int(cfg["SPLITK"])
        return Tiling(cfg["BM"], across, slots, slots, sms)
    if problem.family in ("attention", "bmm_softmax"):
        family = next(f for f in ATTENTION_FAMILIES if f.name == problem.family)
        per_sm = resident(target, family._smem(problem, c), c["WARPS"] * 32,
                          regs_per_thread(family._acc_regs(problem, c)))
        slots = sms * per_sm
        return Tiling(c["BQ"], problem.size("batch") * problem.size("heads"), slots, slots, sms)
    if problem.family in ("layernorm", "softmax"):
        slots = sms * max(1, min(target.max_threads_per_sm // (c["THREADS"] * c["ROWS"]), 32))
        return Tiling(c["ROWS"], 1, slots, FILL_FLOOR * slots, 0.0)
    raise ValueError(f"{problem.family} kernels have no tiling over a run-time extent")


__all__ = ["FILL_FLOOR", "Tiling", "estimate_us", "tiling"]
