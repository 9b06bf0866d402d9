"""An analytical time of one kernel configuration on one problem: the tuner's CPU measurer and its first guesses.

ALCOP (thesis ch.5, Table 5.1) models a tiled, pipelined kernel by its waves of blocks, the work of one block and
how much of its load latency the pipeline hides. We keep that shape, per family:

* Tensor Core tiles (gemm, attention, bmm_softmax): blocks = tiles of the output; blocks resident per SM from
  shared memory and threads; waves = ceil(blocks / (SMs * resident)). A block's time is its MMA work at the SM's
  share of the Tensor Core peak, derated for small warp tiles (less operand reuse per ldmatrix) and padded edges,
  plus its global loads at the SM's share of the bandwidth, of which a STAGES-deep pipeline hides all but
  1 / STAGES (a resident second block hides more). Scalar loads (VEC = 0) cost 4x. A GEMM's split-K slices are
  blocks of their own, and its epilogue's bytes count double when written straight from the fragments (see _gemm).
* A cuBLASLt GEMM (impl "cublaslt"): its roofline time at kernels.cublaslt.EFFICIENCY of the peak, an assumption
  (the library's kernels are not ours to model tile by tile); it ranks the library against the generated kernels
  where no GPU measures both.
* A CUTLASS GEMM (impl "cutlass", sm_90a instances on the sm_90 target's hardware): kernels.cutlass.estimate_us,
  tile by tile from the assumptions in kernels.cutlass.ASSUMED: a mainloop at a share of the Tensor Core peak or
  bound by its operand tiles' L2 traffic (cluster multicast halves one operand's), the epilogue after it
  (cooperative) or hidden behind the other warp group's mainloop (ping-pong), waves of persistent CTAs over the
  SMs with the last one partly idle, or stream-K splitting the tail as CUTLASS's heuristic does.
* Row-wise families (layernorm, softmax) and elementwise: DRAM bytes at bandwidth, derated for narrow accesses
  (VEC), too few threads in flight and partial waves.
* Conv, groups == 1: the implicit GEMM as a GEMM tile on (M, N, K) = kernels.conv.gemm_sizes, as above, but its
  A tile is gathered element by element through registers (im2col addressing; conv.cuh), whatever VEC says, so
  A's bytes always cost the scalar rate (4x) and only B's follow VEC. That makes A traffic dearer than B's, which
  favours tiles wide in N (fewer re-reads of A per output); it is what separates the conv's ranking from a
  GEMM's. Strides and dilations are not priced: consecutive threads own consecutive output pixels, so a unit-
  stride gather coalesces across the warp, and the taps a strided window skips are read by the same thread's
  next columns out of L1; the model keeps DRAM-rate operand tiles, as for GEMMs.
* Conv, groups != 1 (DIRECT=1): one thread per output element on CUDA cores: its fp32 FMAs at the CUDA-core peak
  or its unique DRAM bytes (x, w, y, residual; a window's re-reads hit L1), whichever is slower, derated by the
  last wave's idle block slots (THREADS sets the block size, so the granularity of that tail).

Times are microseconds, deterministic, and only rank configurations: they are what the tuner measures in CI (no
GPU) and what seeds a GPU study, never a reported kernel time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from onnx_gtco.config import TARGETS
from onnx_gtco.kernels import cublaslt, cutlass
from onnx_gtco.kernels.attention import kernel_head_dim
from onnx_gtco.kernels.conv import gemm_sizes
from onnx_gtco.kernels.conv import out_hw as conv_out_hw
from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.gemm import epilogue_tile_bytes

# The hardware facts (SMs, threads per SM, peaks, bandwidth, shared memory) are config.TARGETS'. LAUNCH_US is this
# model's own per-kernel term, the same for every target (Target.launch_us is the planner's): it only shifts every
# configuration of a problem alike.
LAUNCH_US = 3.0
FILL_FLOOR = 0.05  # a row-wise kernel's time stops dropping with fewer busy slots than this share: latency-bound
_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
SCALAR = 4.0  # the cost of element-wise loads against 16-byte ones (a GEMM's VEC=0, a conv's A gather)


def _resident(smem_bytes: int, threads: int, arch: str) -> int:
    t = TARGETS[arch]
    by_smem = (t.smem_kib * 1024) // max(smem_bytes, 1)
    return max(1, min(by_smem, t.max_threads_per_sm // max(threads, 1), 32))


def _tiled_us(arch: str, blocks: int, threads: int, smem: int, flops_per_block: float, bytes_per_block: float,
              stages: int, reuse: float, vec: bool) -> float:
    t = TARGETS[arch]
    sms = t.sms
    resident = _resident(smem, threads, arch)
    waves = math.ceil(blocks / (sms * resident))
    concurrent = min(blocks, sms * resident)
    per_sm = max(1.0, concurrent / sms)  # blocks sharing one SM's peak in a full wave
    mma_us = flops_per_block * per_sm / (t.tc_tflops * 1e6 / sms) / reuse
    load_us = bytes_per_block * per_sm / (t.dram_gbps * 1e3 / sms) * (1.0 if vec else SCALAR)
    exposed = load_us / stages / (2.0 if resident > 1 else 1.0)
    return waves * (max(mma_us, load_us) + exposed) + LAUNCH_US


def _gemm_smem(c: Mapping[str, int]) -> int:
    return max(c["STAGES"] * (c["BM"] + c["BN"]) * (c["BK"] + 8) * 2, epilogue_tile_bytes(c))


def _head_dim(p: Problem) -> int:
    """The head dim the kernel computes with: a padded one's (26 runs as 32) costs what that one costs."""
    d = p.size("head_dim")
    return kernel_head_dim(d) or d


def _attention_smem(p: Problem, c: Mapping[str, int]) -> int:
    kv_tiles = c["STAGES"] * c["BKV"] * (1 if p.family == "bmm_softmax" else 2)
    return (c["BQ"] + kv_tiles) * (_head_dim(p) + 8) * 2


def _rowwise_resident(c: Mapping[str, int], arch: str) -> int:
    return max(1, min(TARGETS[arch].max_threads_per_sm // (c["THREADS"] * c["ROWS"]), 32))


def _mma_block(c: Mapping[str, int], k_pad: int) -> tuple[float, int, float]:
    """A Tensor Core block's operand reuse (derated for warp tiles under 64x64), its k extent (`k_pad`, whole
    k-tiles) and its FLOPs: the terms a GEMM tile and an implicit-GEMM conv tile share."""
    warp_tile = (c["BM"] // c["WM"]) * (c["BN"] // c["WN"])
    return min(1.0, (warp_tile / (64 * 64)) ** 0.25), k_pad, 2.0 * c["BM"] * c["BN"] * k_pad


def _gemm(p: Problem, c: Mapping[str, int], arch: str) -> float:
    """SPLITK slices multiply the blocks and divide each one's k-tiles; every slice writes its fp32 partial tile and
    the last reads the others' (2 x BM x BN x 4 bytes per block, amortized). A LayerScale adds its BN factors per
    tile; a fused LayerNorm the normalize step's traffic, each row panel's BM x N values of y read back and ln_y
    written (and gamma and beta), spread over the panel's blocks (the last of them does it). The epilogue's y and
    residual traffic is counted once per tile: straight from the fragments (EPI = 0) each 32-byte sector is written
    half by one access and half by another, so it costs twice what the staged 16-byte chunks (EPI = 1) cost."""
    batch, m, n, k = p.size("batch"), p.size("M"), p.size("N"), p.size("K")
    bm, bn, bk, wm, wn, stages = c["BM"], c["BN"], c["BK"], c["WM"], c["WN"], c["STAGES"]
    splits = int(c.get("SPLITK", 1))
    blocks = batch * math.ceil(m / bm) * math.ceil(n / bn) * splits
    smem = _gemm_smem(c)
    reuse, k_pad, flops = _mma_block(c, math.ceil(math.ceil(k / bk) / splits) * bk)
    loads = (bm + bn) * k_pad * _BYTES[p.dtype]
    if splits > 1:
        loads += 2 * bm * bn * 4
    out_bytes = _BYTES[str(p.flag("out_dtype", p.dtype) or p.dtype)]
    epilogue = bm * bn * out_bytes * (2 if p.flag("residual", False) else 1) / splits
    loads += epilogue * (1 if c.get("EPI", 0) else 2)
    if p.flag("layer_scale", False):  # LayerScale: one factor per column of the tile
        loads += bn * _BYTES[p.dtype] / splits
    if p.flag("layernorm", False):  # the panel's BM x N values of y read back and ln_y written, per tile of it
        loads += 2 * bm * n * _BYTES[p.dtype] / math.ceil(n / bn) + 2 * n * _BYTES[p.dtype]
    return _tiled_us(arch, blocks, wm * wn * 32, smem, flops, loads, stages, reuse, bool(c.get("VEC", 1)))


def _attention(p: Problem, c: Mapping[str, int], arch: str) -> float:
    b, h, sq, sk = (p.size(k) for k in ("batch", "heads", "seq_q", "seq_k"))
    d = _head_dim(p)
    bq, bkv, warps, stages = c["BQ"], c["BKV"], c["WARPS"], c["STAGES"]
    blocks = b * h * math.ceil(sq / bq)
    sk_pad = math.ceil(sk / bkv) * bkv
    passes = 2 if p.family == "bmm_softmax" else 1
    smem = _attention_smem(p, c)
    rows_per_warp = bq // warps
    reuse = min(1.0, (rows_per_warp * bkv / (16 * 128)) ** 0.25)
    flops = 2.0 * bq * sk_pad * d * (2 if p.family == "attention" else passes)
    loads = sk_pad * d * _BYTES[p.dtype] * (2 if p.family == "attention" else passes)
    padded = d != p.size("head_dim")  # a padded head's rows are read element by element
    return _tiled_us(arch, blocks, warps * 32, smem, flops, loads, stages, reuse, not padded)


def _rowwise(p: Problem, c: Mapping[str, int], arch: str) -> float:
    if p.family == "layernorm":
        cols = p.size("hidden")
        rows = max(p.size("rows"), 1)
        streams = 2 + int(bool(p.flag("residual", False))) + int(bool(p.flag("residual_out", False)))
    else:
        cols, rows = p.size("cols"), max(p.size("rows"), 1)
        streams = 2
    elem = _BYTES[p.dtype]
    threads, vec, rows_per_block = c["THREADS"], c["VEC"], c["ROWS"]
    blocks = math.ceil(rows / rows_per_block)
    sms = TARGETS[arch].sms
    resident = _rowwise_resident(c, arch)
    waves = math.ceil(blocks / (sms * resident))
    fill = blocks / (waves * sms * resident)
    width = min(1.0, vec * elem / 16) ** 0.5  # 16-byte accesses reach the bandwidth; narrower ones fall short
    idle = max(0.0, 1.0 - cols / (threads * vec))  # lanes with no element in a row that is short for the block
    bytes_total = streams * rows * cols * elem
    return (bytes_total / (TARGETS[arch].dram_gbps * 1e3) / (width * max(fill, FILL_FLOOR) * (1.0 - 0.5 * idle))
            + LAUNCH_US)


def _elementwise(p: Problem, c: Mapping[str, int], arch: str) -> float:
    n = math.prod(v for k, v in p.sizes if k.startswith("d"))
    streams = len(p.flag("inputs", ())) + len(p.flag("outputs", ()))
    threads, vec = c["THREADS"], c["VEC"]
    blocks = math.ceil(n / (threads * vec))
    t = TARGETS[arch]
    sms, per_sm = t.sms, max(1, t.max_threads_per_sm // threads)
    waves = math.ceil(blocks / (sms * per_sm))
    fill = blocks / (waves * sms * per_sm)
    width = min(1.0, vec * _BYTES[p.dtype] / 16) ** 0.5
    return streams * n * _BYTES[p.dtype] / (t.dram_gbps * 1e3) / (width * max(fill, 0.05)) + LAUNCH_US


def _conv(p: Problem, c: Mapping[str, int], arch: str) -> float:
    if c.get("DIRECT"):
        return _conv_direct(p, c, arch)
    m, n, k = gemm_sizes(p)
    bm, bn, bk, wm, wn, stages = c["BM"], c["BN"], c["BK"], c["WM"], c["WN"], c["STAGES"]
    blocks = math.ceil(m / bm) * math.ceil(n / bn)
    reuse, k_pad, flops = _mma_block(c, math.ceil(k / bk) * bk)
    loads = (bm * SCALAR + bn * (1.0 if c.get("VEC", 1) else SCALAR)) * k_pad * _BYTES[p.dtype]
    return _tiled_us(arch, blocks, wm * wn * 32, _gemm_smem(c), flops, loads, stages, reuse, True)


def _conv_direct(p: Problem, c: Mapping[str, int], arch: str) -> float:
    t = TARGETS[arch]
    oh, ow = conv_out_hw(p)
    groups = int(p.flag("groups", 1) or 1)
    n, ch, oc = p.size("N"), p.size("C"), p.size("OC")
    outputs = n * oc * oh * ow
    flops = 2.0 * outputs * (ch // groups) * p.size("KH") * p.size("KW")
    streams = 2 + int(bool(p.flag("residual", False)))  # y, residual: outputs-sized
    elems = n * ch * p.size("H") * p.size("W") + oc * (ch // groups) * p.size("KH") * p.size("KW") + streams * outputs
    threads = c["THREADS"]
    blocks = math.ceil(outputs / threads)
    resident = max(1, min(t.max_threads_per_sm // threads, 32))
    waves = math.ceil(blocks / (t.sms * resident))
    fill = blocks / (waves * t.sms * resident)
    busy_us = max(flops / (t.cuda_tflops * 1e6), elems * _BYTES[p.dtype] / (t.dram_gbps * 1e3))
    return busy_us / max(fill, FILL_FLOOR) + LAUNCH_US


_MODELS = {"gemm": _gemm, "conv": _conv, "attention": _attention, "bmm_softmax": _attention, "layernorm": _rowwise,
           "softmax": _rowwise, "elementwise": _elementwise}


@dataclass(frozen=True)
class Tiling:
    """How one configuration's blocks cover a problem along its run-time extent (`kernels.dynamic.extent_name`):
    the micro-kernel geometry of the shape-generic tuner (onnx_gtco.tune.dynamic).

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
    """The Tiling of `config` on `problem` for `arch`, by the same resource rules as estimate_us.

    Raises:
        ValueError: the family has no run-time extent (elementwise; conv, whose tile would run over N·OH·OW and
            which the dynamic tuner leaves out: kernels.dynamic.extent_name).
    """
    sms = TARGETS[arch].sms
    c = config
    if problem.family == "gemm":
        slots = sms * _resident(_gemm_smem(c), c["WM"] * c["WN"] * 32, arch)
        across = problem.size("batch") * math.ceil(problem.size("N") / c["BN"]) * int(c.get("SPLITK", 1))
        return Tiling(c["BM"], across, slots, slots, sms)
    if problem.family in ("attention", "bmm_softmax"):
        slots = sms * _resident(_attention_smem(problem, c), c["WARPS"] * 32, arch)
        return Tiling(c["BQ"], problem.size("batch") * problem.size("heads"), slots, slots, sms)
    if problem.family in ("layernorm", "softmax"):
        slots = sms * _rowwise_resident(c, arch)
        return Tiling(c["ROWS"], 1, slots, FILL_FLOOR * slots, 0.0)
    raise ValueError(f"{problem.family} kernels have no tiling over a run-time extent")


def estimate_us(problem: Problem, config: Mapping[str, int], arch: str) -> float:
    """Predicted time of `config` on `problem` for `arch`, in microseconds (see the module docstring). A cuBLASLt
    configuration (impl "cublaslt") is the roofline at an assumed efficiency (kernels.cublaslt.estimate_us); a
    CUTLASS one (impl "cutlass", for cutlass.TARGET or its sm_90a slot) is priced tile by tile on that target's
    hardware from assumed efficiencies (kernels.cutlass.estimate_us)."""
    if config.get("impl") == cublaslt.IMPL:
        return cublaslt.estimate_us(problem, arch, LAUNCH_US)
    if config.get("impl") == cutlass.IMPL:
        if arch not in (cutlass.TARGET, cutlass.ARCH):
            raise ValueError(f"a CUTLASS configuration runs on {cutlass.TARGET} ({cutlass.ARCH}) only, not {arch}")
        return cutlass.estimate_us(problem, config, LAUNCH_US)
    try:
        model = _MODELS[problem.family]
    except KeyError:
        raise ValueError(f"no analytical model for family {problem.family!r}") from None
    return float(model(problem, config, arch))


__all__ = ["FILL_FLOOR", "Tiling", "estimate_us", "tiling"]
