"""What the kernel families' time estimates share: how many blocks of a configuration an SM holds, in how many
waves a grid runs, and a warp-tile's register need.

Each family's `estimate_us(problem, config, hw)` lives in its own module, beside its configurations and checks
(families.gemm.kernel, families.attention.kernel, ...), with its constants (onnx_gtco.calibration: fitted per GPU, or
their defaults). These helpers are the resource rules they have in common; they read only the data sheet
(config.Target), never a fitted constant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from onnx_gtco.config import Target

REGS_PER_SM = 65536
MAX_REGS = 255
REG_OVERHEAD = 64
"""Registers a thread of our Tensor Core kernels holds besides its fp32 accumulators (addresses, loop state,
operand fragments): an estimate; ptxas's report of a built instance is the truth."""
MAX_BLOCKS_PER_SM = 32


def regs_per_thread(accumulators: int) -> int:
    """The registers a thread needs for `accumulators` fp32 accumulators and the rest (REG_OVERHEAD)."""
    return min(MAX_REGS, accumulators + REG_OVERHEAD)


def resident(target: Target, smem_bytes: int, threads: int, regs: int = 0) -> int:
    """Blocks of one configuration an SM holds at once: its shared memory, threads and registers (`regs` per
    thread; 0: not limiting) allow."""
    by_smem = (target.smem_kib * 1024) // max(smem_bytes, 1)
    by_threads = target.max_threads_per_sm // max(threads, 1)
    by_regs = REGS_PER_SM // max(threads * regs, 1) if regs else MAX_BLOCKS_PER_SM
    return max(1, min(by_smem, by_threads, by_regs, MAX_BLOCKS_PER_SM))


@dataclass(frozen=True)
class Grid:
    """How a grid of blocks runs on a GPU.

    Attributes:
        blocks: the grid's blocks.
        slots: blocks the whole GPU holds at once (SMs x resident).
        waves: rounds of at most `slots` blocks (a partial last one counts whole: its blocks take as long).
        per_sm: blocks sharing one SM in the fullest round.
    """

    blocks: int
    slots: int
    waves: int
    per_sm: int


WARPS_PER_PARTITION_SET = 4
"""An SM's four sub-partitions (warp schedulers, each with its Tensor Core): up to four warps of mma chains run
side by side; more share them."""


def crowding(warps_per_sm: int, share_exp: float) -> float:
    """How much longer a warp's chain of dependent mma / ldmatrix steps takes when `warps_per_sm` warps are busy on
    its SM: 1 up to one warp per sub-partition, then (warps / 4) ** (1 - share_exp) (share_exp 1: latency hidden for
    free, 0: the sub-partitions' issue is saturated)."""
    return max(1.0, warps_per_sm / WARPS_PER_PARTITION_SET) ** (1.0 - share_exp)


def grid(target: Target, blocks: int, per_sm_max: int) -> Grid:
    """The Grid of `blocks` blocks of which an SM holds `per_sm_max` (resident)."""
    slots = target.sms * per_sm_max
    blocks = max(1, blocks)
    busy = min(blocks, slots)
    return Grid(blocks, slots, math.ceil(blocks / slots), math.ceil(busy / target.sms))


__all__ = ["MAX_REGS", "REG_OVERHEAD", "WARPS_PER_PARTITION_SET", "Grid", "crowding", "grid", "regs_per_thread",
           "resident"]


FILL_FLOOR = 0.05  # a row-wise kernel's time stops dropping with fewer busy slots than this share: latency-bound


@dataclass(frozen=True)
class Tiling:
    """How one configuration's blocks cover a problem along its run-time extent (`KernelFamily.extent`):
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


def rowwise_tiling(target: Target, config: Mapping[str, int]) -> Tiling:
    """The Tiling of a row-wise kernel (THREADS threads over ROWS rows a block): memory-bound, its waves
    latency-bound below FILL_FLOOR of the slots."""
    slots = target.sms * max(1, min(target.max_threads_per_sm // (config["THREADS"] * config["ROWS"]), 32))
    return Tiling(config["ROWS"], 1, slots, FILL_FLOOR * slots, 0.0)
