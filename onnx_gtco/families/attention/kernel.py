"""The attention kernel families of `plugins/families/attention/attention.cuh`.

- ``attention``: ``O = softmax(scale * Q Kᵀ + mask + bias) V`` (mask and bias times their own scales) in one
  kernel, FlashAttention-2 style (online softmax on the accumulator registers, K/V streamed through a cp.async ring).
  Any sequence length.
- ``bmm_softmax``: GTCO's fused BMM + softmax, ``P = softmax(scale * Q Kᵀ + mask + bias)`` written out. Two passes
  over the key tiles: the first keeps the online row max and sum, the second recomputes S and writes P. Any
  sequence length; the instance does not depend on seq_k.

Problem (both families): sizes ``batch`` (the product of the batch dims), ``heads``, ``seq_q``, ``seq_k``,
``head_dim``; flags ``kv_group`` (int, default 1: grouped-query attention, k and v hold heads / kv_group heads and
query head h reads key / value head h // kv_group, a run-time argument), ``scale`` (float), ``mask`` / ``bias``
(bool), ``causal`` (bool: key j > query i masked, upper-left aligned) and ``window`` ((left, right): key j of query
i kept only where i - left <= j <= i + right, sliding-window attention), both generated in the kernel (a band of
j - i, `band`), nothing read for them, the attention kernel walking only the key tiles the band reaches from a q
tile, ``mask_scale`` / ``bias_scale`` (floats
that multiply the mask and the bias, default 1: ``softmax((Q Kᵀ + M) * s)`` is ``softmax(s Q Kᵀ + s M)``; run-time
arguments, no part of the instance), ``mask_shape`` / ``bias_shape``
(4-tuples ``[B', H', Sq', Sk']`` with each dim 1 or full; B' may also divide batch, Swin's window mask; defaults
``(batch, 1, 1, seq_k)`` key padding and ``(1, heads, seq_q, seq_k)`` bias), ``q_layout``, ``k_layout`` and, for
attention, ``v_layout``, ``out_layout``.

Layouts (arrays as the kernel reads them; the batch dims flattened to one):
  bhsd [B, H, S, D]; bshd [B, S, H, D]; bshd_merged [B, S, H*D]; qkv_packed one [B, S, 3*H*D] array "qkv" for
  q, k and v; bhds [B, H, D, S] (Kᵀ, k only: gathered element by element, the slower path).
Inputs: "q", "k", "v" (or "qkv"), "mask", "bias"; outputs: attention "out", bmm_softmax "probs" [B, H, Sq, Sk].

Head dims: 32, 64, 80, 96, 128 and 256 run as they are; any smaller one (26, 40, 100, ...) runs padded, as the next
of those (26 as 32): the kernel reads its rows element by element (they need no 16-byte alignment), zero-fills the
dims past head_dim in shared memory, so they add nothing to Q Kᵀ and give O zero columns, and writes only the
head_dim columns (`kernel_head_dim`; PAD_D in attention.cuh). Between 128 and 256 only 256 itself runs. The register
budget, shared memory and instance name (``..._d26p32_...``) count the padded size.

dtype f16 / bf16: mma.m16n8k16; f32: TF32 (mma.m16n8k8 on operands rounded by cvt.rna, fp32 softmax and I/O), whose
reference multiplies the TF32-rounded q, k and v (P is rounded too in the kernel, not in the reference).

Fully masked rows (every score -inf) come out as zeros, not NaN; finite (-10000 style) masks behave like ONNX
Softmax. The reference follows the same rule.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from onnx_gtco.calibration import Constants, Hardware, LaunchConstants, param
from onnx_gtco.config import TARGETS, Target
from onnx_gtco.kernels.family import (
    ARCHS,
    Config,
    Field,
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
from onnx_gtco.opspec import FusedOp

HEAD_DIMS = (32, 64, 80, 96, 128, 256)
PAD_BELOW = 128
"""Head dims under this that are not in HEAD_DIMS run padded to the next one (kernel_head_dim)."""
WIDE_HEAD = 256
WIDE_HEAD_TILE = {"BQ": 64, "BKV": 32, "WARPS": 4}
"""The only tile of the attention family at head dim WIDE_HEAD: one m-tile per warp, whose 16 x 256 fp32 O accumulators
are 128 registers per thread. With 32-key tiles ptxas (CUDA 13.0) fits it into 255 registers without spills or a stack
frame on sm_80 and sm_90, f16 and f32 (TF32), with a mask, a bias and a gathered Kᵀ; BKV 64 and 128, 2 m-tiles per
warp, and BQ 128 on 8 warps (sm_80, mask + bias + Kᵀ) spill. The bmm_softmax family keeps no O and takes d256 under
its ordinary budget."""
LAYOUTS = ("bhsd", "bshd", "bshd_merged", "qkv_packed")
K_LAYOUTS = (*LAYOUTS, "bhds")
OUT_LAYOUTS = ("bhsd", "bshd", "bshd_merged")
PAD = 8  # elements of padding per shared-memory row (attention.cuh kPad)
MAX_CONFIGS = 6  # configs() proposes at most this many (the tuner explores from them)
ACC_REG_BUDGET = 112
"""Per-thread budget of live tile registers, `_acc_regs`: attention O + S tile fp32 accumulators, bmm_softmax the
S tile plus the Q fragments of the whole head dim. Fitted to ptxas -v (CUDA 13.0, sm_80 and sm_90) over every
config of the space x head dims 32/64/80/96/128 (and bmm_softmax's 256) x {mask+bias with gathered Kᵀ, mask,
plain}: nothing at or under 112 spills or has a stack frame; at 128 (attention d128 with BKV 128, bmm_softmax BQ 128
on 4 warps with BKV 128, or BKV 64 with d128) ptxas reaches 255 registers and spills. Attention at head dim 256 is
over it with any tile and takes WIDE_HEAD_TILE instead."""
_CTYPE = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}

_ARG_FIELDS = (  # gtco_attention_args, in declaration order: (name, kind)
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "ptr"), ("mask", "ptr"), ("bias", "ptr"),
    ("q_off", "i64"), ("k_off", "i64"), ("v_off", "i64"),
    ("q_sb", "i64"), ("q_sh", "i64"), ("q_ss", "i64"),
    ("k_sb", "i64"), ("k_sh", "i64"), ("k_ss", "i64"), ("k_sd", "i64"),
    ("v_sb", "i64"), ("v_sh", "i64"), ("v_ss", "i64"),
    ("o_sb", "i64"), ("o_sh", "i64"), ("o_ss", "i64"), ("o_sd", "i64"),
    ("m_sb", "i64"), ("m_sh", "i64"), ("m_sq", "i64"), ("m_sk", "i64"),
    ("bias_sb", "i64"), ("bias_sh", "i64"), ("bias_sq", "i64"), ("bias_sk", "i64"),
    ("batch", "i32"), ("heads", "i32"), ("seq_q", "i32"), ("seq_k", "i32"), ("head_dim", "i32"),
    ("m_bmod", "i32"), ("bias_bmod", "i32"),
    ("scale", "f32"), ("mask_scale", "f32"), ("bias_scale", "f32"),
    ("kv_group", "i32"), ("banded", "i32"), ("band_lo", "i32"), ("band_hi", "i32"),
)


def row_pad(dtype: str) -> int:
    """Padding of the Q, K and V shared rows (attention.cuh row_pad<T>): 8 elements, 4 for f32."""
    return 4 if dtype == "f32" else PAD


def elem_bytes(dtype: str) -> int:
    return 4 if dtype == "f32" else 2


def _dims(p: Problem) -> tuple[int, int, int, int, int]:
    return p.size("batch"), p.size("heads"), p.size("seq_q"), p.size("seq_k"), p.size("head_dim")


def kv_group(p: Problem) -> int:
    """Query heads per key / value head (flag kv_group: grouped-query attention, k and v hold heads / kv_group
    heads); 1 without."""
    return int(p.flag("kv_group", 1) or 1)


def kernel_head_dim(head_dim: int) -> int | None:
    """The head dim a kernel runs `head_dim` as: itself when it is one of HEAD_DIMS, the next of them for a smaller one
    under PAD_BELOW (zero-padded inside the kernel), else None (no kernel)."""
    if head_dim in HEAD_DIMS:
        return head_dim
    if 0 < head_dim < PAD_BELOW:
        return min(d for d in HEAD_DIMS if d > head_dim)
    return None


def _kd(p: Problem) -> int:
    """The (padded) head dim of a checked problem's kernel."""
    d = p.size("head_dim")
    return kernel_head_dim(d) or d


def _layouts(p: Problem) -> dict[str, str]:
    out = {"q": p.flag("q_layout", "bhsd"), "k": p.flag("k_layout", "bhsd")}
    if p.family == "attention":
        out |= {"v": p.flag("v_layout", "bhsd"), "out": p.flag("out_layout", "bhsd")}
    return out


def layout_shape(layout: str, b: int, h: int, s: int, d: int) -> tuple[int, ...]:
    """Array shape of one operand in `layout` (qkv_packed: the whole packed array)."""
    return {"bhsd": (b, h, s, d), "bshd": (b, s, h, d), "bshd_merged": (b, s, h * d),
            "qkv_packed": (b, s, 3 * h * d), "bhds": (b, h, d, s)}[layout]


def layout_strides(layout: str, b: int, h: int, s: int, d: int, which: int = 0) -> tuple[int, ...]:
    """(offset, batch, head, seq, dim) element strides of an operand; `which` picks q/k/v (0/1/2) of qkv_packed."""
    del b
    if layout == "bhsd":
        return 0, h * s * d, s * d, d, 1
    if layout in ("bshd", "bshd_merged"):
        return 0, s * h * d, d, h * d, 1
    if layout == "qkv_packed":
        return which * h * d, s * 3 * h * d, d, 3 * h * d, 1
    if layout == "bhds":
        return 0, h * d * s, d * s, 1, s
    raise ValueError(f"unknown layout {layout!r}")


def to_bhsd(x: np.ndarray, layout: str, b: int, h: int, s: int, d: int, which: int = 0) -> np.ndarray:
    """An operand in `layout` -> [B, H, S, D]."""
    if layout == "bhsd":
        return x
    if layout in ("bshd", "bshd_merged"):
        return x.reshape(b, s, h, d).transpose(0, 2, 1, 3)
    if layout == "qkv_packed":
        return x.reshape(b, s, 3, h, d)[:, :, which].transpose(0, 2, 1, 3)
    if layout == "bhds":
        return x.transpose(0, 1, 3, 2)
    raise ValueError(f"unknown layout {layout!r}")


def from_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    """[B, H, S, D] -> the array of `layout` (output layouts only)."""
    b, h, s, d = x.shape
    if layout == "bhsd":
        return x
    if layout == "bshd":
        return x.transpose(0, 2, 1, 3)
    if layout == "bshd_merged":
        return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)
    raise ValueError(f"unknown output layout {layout!r}")


def addend_shape(p: Problem, which: str) -> tuple[int, int, int, int]:
    b, h, sq, sk, _ = _dims(p)
    default = (b, 1, 1, sk) if which == "mask" else (1, h, sq, sk)
    return tuple(int(x) for x in p.flag(f"{which}_shape", default))  # type: ignore[return-value]


def _addend_problem(p: Problem, which: str) -> str | None:
    b, h, sq, sk, _ = _dims(p)
    shape = addend_shape(p, which)
    if len(shape) != 4:
        return f"{which} must be 4-D [B', H', Sq', Sk'], got {shape}"
    if shape[0] != 1 and b % shape[0] != 0:
        return f"{which} batch dim {shape[0]} neither 1 nor a divisor of batch {b}"
    for got, full, name in zip(shape[1:], (h, sq, sk), ("heads", "seq_q", "seq_k"), strict=True):
        if got not in (1, full):
            return f"{which} dim {got} neither 1 nor {name} {full}"
    return None


def _addend_fields(arr: np.ndarray | None, b: int) -> tuple[tuple[int, ...], int]:
    """(strides of [B', H', Sq', Sk'] with 0 for broadcast dims, bmod)."""
    if arr is None:
        return (0, 0, 0, 0), 1
    shape = arr.shape
    contiguous = [int(np.prod(shape[i + 1:])) for i in range(4)]
    strides = tuple(0 if n == 1 else st for n, st in zip(shape, contiguous, strict=True))
    bmod = shape[0] if shape[0] > 1 else 1
    del b
    return strides, bmod


FAR = 1 << 30
"""A band edge past any sequence the kernels take (attention_op.h kFar): no limit on that side."""


def band(problem: Problem) -> tuple[int, int] | None:
    """(lo, hi) of a causal or sliding-window problem: key j of query i is kept only where lo <= j - i <= hi
    (gtco_attention_args band_lo / band_hi); None for neither."""
    window, causal = problem.flag("window", None), bool(problem.flag("causal", False))
    if not window and not causal:
        return None
    lo, hi = (-min(int(window[0]), FAR), min(int(window[1]), FAR)) if window else (-FAR, FAR)
    return lo, min(hi, 0) if causal else hi


def band_key_tiles(seq_q: int, seq_k: int, bq: int, bkv: int, lo: int, hi: int) -> float:
    """The key tiles a banded attention block walks, on average over its q tiles: q tile i walks the tiles of keys
    q0 + lo .. last row + hi (attention.cuh attention_kernel)."""
    tiles = []
    for q0 in range(0, seq_q, bq):
        first, end = max(0, q0 + lo), min(seq_k, min(q0 + bq, seq_q) - 1 + hi + 1)
        tiles.append(max(0, math.ceil(end / bkv) - first // bkv) if end > first else 0)
    return sum(tiles) / len(tiles)


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with max subtraction; rows with every score -inf give zeros."""
    mx = np.max(s, axis=-1, keepdims=True)
    dead = ~np.isfinite(mx)
    e = np.exp(s - np.where(dead, 0.0, mx))
    total = e.sum(-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


@dataclass(frozen=True)
class AttentionConstants(Constants):
    """The constants of the attention and BMM + softmax estimates (onnx_gtco.calibration: fitted per GPU from
    measured attention kernels; on the H200 from ViT-B/16's (197 tokens, batch 1 and 64) and BERT-base's (128 tokens,
    masked) heads of 64)."""

    GROUP: ClassVar[str] = "attention"
    warp_peak_frac: float = param(0.057, 0.003, 0.5, "of an SM's Tensor Core peak", "the rate of one warp's chain "
                                  "over a key tile (S = Q Kᵀ, the online softmax, O += P V), alone on its SM")
    share_exp: float = param(0.0, 0.0, 1.0, "", "how the warps of an SM share it: past one warp per "
                             "sub-partition, w warps make each chain (w / 4) ** (1 - share_exp) times longer "
                             "(kernels.timing.crowding; 0: not at all, 1: for free)")
    l2_frac: float = param(1.2, 0.2, 4.0, "x DRAM bandwidth", "the rate, all SMs together, at which the blocks "
                           "bring K and V tiles from L2")
    block_us: float = param(3.35, 0.0, 20.0, "us", "a block's work besides its key tiles: loading its Q tile, the "
                            "final normalization and storing O")


class _AttentionBase(KernelFamily):
    space = MappingProxyType({"BQ": (64, 128), "BKV": (32, 64, 128), "WARPS": (4, 8), "STAGES": (2, 3)})
    extent = "seq_q"
    grows_with_extent = True

    def block_work(self, problem: Problem, config: Config, n: np.ndarray, follows: bool) -> np.ndarray:
        """The keys a block walks, in BKV tiles: the extent in self-attention (`follows`), else the fixed seq_k."""
        seq_k = n if follows else np.full_like(n, problem.size("seq_k"))
        return np.ceil(seq_k / config["BKV"]) * config["BKV"]

    def tiling(self, problem: Problem, config: Config, target: Target) -> Tiling:
        """BQ queries a block, across the batch and the heads."""
        per_sm = resident(target, self._smem(problem, config), config["WARPS"] * 32,
                          regs_per_thread(self._acc_regs(problem, config)))
        slots = target.sms * per_sm
        return Tiling(config["BQ"], problem.size("batch") * problem.size("heads"), slots, slots, target.sms)

    def at_extent(self, problem: Problem, n: int) -> Problem:
        """`problem` at query length `n`. Self-attention: when the Problem has ``seq_k == seq_q`` (the optimizer
        stands both symbolic lengths as the same value, kernels.select), ``seq_k`` follows ``seq_q``; a Problem with
        another static ``seq_k`` (cross-attention over a fixed memory) keeps it. Static ``mask_shape`` /
        ``bias_shape`` flags follow the same way: a full ``Sq'`` / ``Sk'`` dim takes the new length, a broadcast 1
        stays 1."""
        sq, sk = problem.size("seq_q"), problem.size("seq_k")
        follows = sk == sq
        flags = []
        for name, value in problem.flags:
            if name in ("mask_shape", "bias_shape") and value is not None:
                b, h, q, k = (int(v) for v in value)
                q = n if q == sq and q != 1 else q
                k = n if follows and k == sk and k != 1 else k
                value = (b, h, q, k)
            flags.append((name, value))
        sized = problem.with_sizes({"seq_q": n, "seq_k": n} if follows else {"seq_q": n})
        return dataclasses.replace(sized, flags=tuple(flags))

    def estimate_us(self, problem: Problem, config: Config, hw: Hardware) -> float:
        """The estimated time of a valid `config` on `problem` on `hw` (AttentionConstants): blocks of BQ query rows
        per (batch, head), resident by shared memory, threads and registers; each runs its key tiles (BKV keys, one
        pass for attention, two for BMM + softmax) at the slower of a warp's mma chain over its rows and the K / V
        tiles' traffic, then its fixed work (block_us; BMM + softmax also writes P at the DRAM rate); the launch
        floor. A padded head dim costs what its kernel's head dim costs. A banded (causal, sliding-window) attention
        block walks the mean of its q tiles' key tiles (band_key_tiles): not fitted, no banded kernel has been
        measured."""
        t, c = hw.target, hw.constants(AttentionConstants)
        b, h, sq, sk, _ = _dims(problem)
        d = _kd(problem)
        bq, bkv, warps = config["BQ"], config["BKV"], config["WARPS"]
        size = elem_bytes(problem.dtype)
        blocks = b * h * math.ceil(sq / bq)
        bounds = band(problem) if self.name == "attention" else None
        key_tiles = band_key_tiles(sq, sk, bq, bkv, *bounds) if bounds else math.ceil(sk / bkv)
        threads = warps * 32
        per_sm = resident(t, self._smem(problem, config), threads, regs_per_thread(self._acc_regs(problem, config)))
        g = grid(t, blocks, per_sm)
        passes = 2 if self.name == "bmm_softmax" else 1
        products = 1 if self.name == "bmm_softmax" else 2  # S = Q Kᵀ, and O += P V for attention
        peak_sm = (t.tf32_tflops if problem.dtype == "f32" else t.tc_tflops) * 1e6 / t.sms
        chain = (2.0 * (bq // warps) * bkv * d * products / (c.warp_peak_frac * peak_sm)
                 * crowding(g.per_sm * warps, c.share_exp))
        tile_bytes = bkv * d * size * products + (bkv * size if problem.flag("mask", False) else 0)
        operands = tile_bytes * min(g.blocks, g.slots) / (c.l2_frac * t.dram_gbps * 1e3)
        block = passes * key_tiles * max(chain, operands) + c.block_us
        if self.name == "bmm_softmax":  # P, one row of seq_k per query row, at the block's share of DRAM
            block += bq * sk * size * min(g.blocks, g.slots) / (t.dram_gbps * 1e3)
        return hw.constants(LaunchConstants).floor_us + g.waves * block

    # ---- shared pieces -------------------------------------------------------------------------------------------
    def _smem(self, problem: Problem, config: Config) -> int:
        raise NotImplementedError

    def _acc_regs(self, problem: Problem, config: Config) -> int:
        raise NotImplementedError

    def _check_problem(self, problem: Problem) -> str | None:
        if problem.family != self.name:
            return f"problem is for family {problem.family!r}, not {self.name!r}"
        if problem.dtype not in _CTYPE:
            return f"dtype {problem.dtype}: the kernels take f16, bf16 or f32 (TF32)"
        try:
            b, h, sq, sk, d = _dims(problem)
        except KeyError as e:
            return str(e)
        if kernel_head_dim(d) is None:
            return (f"head_dim {d} not supported (supported: {', '.join(map(str, HEAD_DIMS))}, and any head dim under "
                    f"{PAD_BELOW} padded to the next of them)")
        if min(b, h, sq, sk) <= 0:
            return f"empty problem (batch {b}, heads {h}, seq_q {sq}, seq_k {sk})"
        if b * h > 65535:
            return f"batch * heads = {b * h} exceeds the 65535 grid rows"
        lay = _layouts(problem)
        group = kv_group(problem)
        if group < 1 or h % group:
            return f"kv_group {group} does not divide heads {h} (query heads per key / value head)"
        if group > 1 and lay["q"] == "qkv_packed":
            return "qkv_packed holds as many key / value heads as query heads (kv_group 1)"
        if lay["q"] not in LAYOUTS:
            return f"q_layout {lay['q']!r} not supported (supported: {', '.join(LAYOUTS)})"
        if lay["k"] not in K_LAYOUTS:
            return f"k_layout {lay['k']!r} not supported (supported: {', '.join(K_LAYOUTS)})"
        if "v" in lay and lay["v"] not in LAYOUTS:
            return f"v_layout {lay['v']!r} not supported (supported: {', '.join(LAYOUTS)})"
        if "out" in lay and lay["out"] not in OUT_LAYOUTS:
            return f"out_layout {lay['out']!r} not supported (supported: {', '.join(OUT_LAYOUTS)})"
        packed = [k for k, v in lay.items() if v == "qkv_packed"]
        if packed and set(packed) != ({"q", "k", "v"} if "v" in lay else {"q", "k"}):
            return f"qkv_packed must be used by all of q, k{', v' if 'v' in lay else ''} (got it for {packed})"
        for which in ("mask", "bias"):
            if problem.flag(which, False) and (why := _addend_problem(problem, which)):
                return why
        window = problem.flag("window", None)
        if window and (len(window) != 2 or min(int(w) for w in window) < 0):
            return f"window {tuple(window)} is not (left, right) of two counts >= 0"
        return None

    def check(self, problem: Problem, config: Config, arch: str) -> str | None:
        if arch not in ARCHS:
            return f"arch {arch!r}: choose one of {ARCHS}"
        if why := self._check_problem(problem):
            return why
        for key, allowed in self.space.items():
            if config.get(key) not in allowed:
                return f"{key}={config.get(key)} not in the space {allowed}"
        bq, warps = config["BQ"], config["WARPS"]
        if bq % (16 * warps):
            return f"BQ={bq} does not give each of {warps} warps whole 16-row m-tiles"
        if self.name == "attention" and _kd(problem) == WIDE_HEAD:
            tile = {k: config[k] for k in WIDE_HEAD_TILE}
            if tile != WIDE_HEAD_TILE:
                return (f"head_dim {WIDE_HEAD} takes only the tile {WIDE_HEAD_TILE} (its O accumulators are 128 "
                        f"registers per thread; other tiles spill), not {tile}")
        regs = self._acc_regs(problem, config)
        if regs > ACC_REG_BUDGET and not (self.name == "attention" and _kd(problem) == WIDE_HEAD):
            return (f"{regs} fp32 accumulator registers per thread exceed the budget of {ACC_REG_BUDGET} "
                    f"(would spill)")
        smem, limit = self._smem(problem, config), TARGETS[arch].smem_kib * 1024
        if smem > limit:
            return f"shared memory {smem} B exceeds the {arch} limit of {limit} B per block"
        return None

    def configs(self, problem: Problem, arch: str) -> list[dict[str, int]]:
        """Valid configs, best first: least padding waste in q and k tiles, then enough blocks to fill the GPU
        (about 2 per SM), then larger tiles, fewer stages for shared memory, 4 warps before 8."""
        keys = list(self.space)
        valid = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*self.space.values())]
        valid = [c for c in valid if self.check(problem, c, arch) is None]
        if not valid:  # an invalid problem, or an arch without kernels
            return []
        b, h, sq, sk, _ = _dims(problem) if self._check_problem(problem) is None else (1, 1, 1, 1, 1)
        sms = TARGETS[arch].sms

        def rank(c: dict[str, int]) -> tuple[float, ...]:
            q_tiles, k_tiles = math.ceil(sq / c["BQ"]), math.ceil(sk / c["BKV"])
            waste = (q_tiles * c["BQ"] - sq) / sq + (k_tiles * c["BKV"] - sk) / sk
            blocks = q_tiles * b * h
            starved = max(0.0, 1.0 - blocks / (2 * sms))
            return (round(waste + starved, 2), -c["BKV"], -c["BQ"], c["STAGES"] != 2, c["WARPS"])

        return sorted(valid, key=rank)[:MAX_CONFIGS]

    def _tag(self, problem: Problem, config: Config, arch: str, extra: str = "") -> str:
        d, kd = problem.size("head_dim"), _kd(problem)
        if kd != d:
            extra = f"p{kd}{extra}"
        tags = "".join(f"_{t}" for t in ("mask", "bias") if problem.flag(t, False)) + ("_band" if band(problem) else "")
        kt = "_kt" if _layouts(problem)["k"] == "bhds" else ""
        return (f"{self.name}_{arch.replace('_', '')}_{problem.dtype}_d{d}{extra}_q{config['BQ']}_kv{config['BKV']}"
                f"_w{config['WARPS']}_s{config['STAGES']}{kt}{tags}")

    def _source(self, name: str, call: str) -> str:
        return (f"// Generated by onnx_gtco.families.attention.kernel: {name}\n"
                f'#include "attention/attention.cuh"\n\n'
                f"GTCO_EXPORT int gtco_{name}(const gtco_attention_args* args, void* stream) {{\n"
                f"    return {call}(args, stream);\n}}\n")

    def _template_args(self, problem: Problem, config: Config) -> str:
        return (f"{_CTYPE[problem.dtype]}, {_kd(problem)}, {config['BQ']}, {config['BKV']}, "
                f"{config['WARPS']}, {config['STAGES']}")

    def _flags_args(self, problem: Problem) -> str:
        """K_TRANS, MASK, BIAS, then PAD_D (true for a padded head dim) and BAND (causal or a window), each left at its
        default (false) when it and what follows it are."""
        kt = _layouts(problem)["k"] == "bhds"
        flags = [kt, problem.flag("mask", False), problem.flag("bias", False)]
        pad, banded = _kd(problem) != problem.size("head_dim"), band(problem) is not None
        if pad or banded:
            flags.append(pad)
        if banded:
            flags.append(True)
        return ", ".join("true" if f else "false" for f in flags)

    # ---- run-time arguments ------------------------------------------------------------------------------------
    def _input_names(self, problem: Problem) -> list[str]:
        lay = _layouts(problem)
        names = ["qkv"] if lay["q"] == "qkv_packed" else ["q", "k"] + (["v"] if "v" in lay else [])
        return names + [w for w in ("mask", "bias") if problem.flag(w, False)]

    launch = ""
    """The launch function template of the family's kernel in attention/attention.cuh."""

    def instantiate(self, problem: Problem, config: Config, arch: str) -> Instance:
        if why := self.check(problem, config, arch):
            raise ValueError(f"{self.name}: {why}")
        name = self._tag(problem, config, arch)
        call = f"gtco::{self.launch}<{self._template_args(problem, config)}, {self._flags_args(problem)}>"
        return Instance(name, f"gtco_{name}", self._source(name, call), problem, dict(config), arch,
                        self._smem(problem, config))

    def _out_name(self) -> str:
        raise NotImplementedError

    def _out_strides(self, problem: Problem) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def args_fields(self, problem: Problem, arrays: Mapping[str, np.ndarray]) -> list[Field]:
        b, h, sq, sk, d = _dims(problem)
        lay = _layouts(problem)
        packed = lay["q"] == "qkv_packed"
        vals: dict[str, Any] = {"q": "qkv" if packed else "q", "k": "qkv" if packed else "k",
                                "v": ("qkv" if packed else "v") if "v" in lay else "",
                                "out": self._out_name(), "mask": "", "bias": ""}
        group = kv_group(problem)
        for which, (name, seq) in enumerate((("q", sq), ("k", sk), ("v", sk))):
            if name not in lay:
                vals |= {f"{name}_off": 0, f"{name}_sb": 0, f"{name}_sh": 0, f"{name}_ss": 0}
                continue
            off, sb, sh, ss, sd = layout_strides(lay[name], b, h if name == "q" else h // group, seq, d, which)
            vals |= {f"{name}_off": off, f"{name}_sb": sb, f"{name}_sh": sh, f"{name}_ss": ss}
            if name == "k":
                vals["k_sd"] = sd
        vals |= dict(zip(("o_sb", "o_sh", "o_ss", "o_sd"), self._out_strides(problem), strict=True))
        for which, prefix in (("mask", "m"), ("bias", "bias")):
            arr = arrays.get(which) if problem.flag(which, False) else None
            if arr is not None:
                vals[which] = which
            strides, bmod = _addend_fields(arr, b)
            vals |= dict(zip((f"{prefix}_sb", f"{prefix}_sh", f"{prefix}_sq", f"{prefix}_sk"), strides, strict=True))
            vals[f"{prefix}_bmod"] = bmod
        bounds = band(problem)
        lo, hi = bounds or (0, 0)
        vals |= {"batch": b, "heads": h, "seq_q": sq, "seq_k": sk, "head_dim": d,
                 "scale": float(problem.flag("scale", 1.0 / math.sqrt(d))),
                 "mask_scale": float(problem.flag("mask_scale", 1.0)),
                 "bias_scale": float(problem.flag("bias_scale", 1.0)), "kv_group": group,
                 "banded": int(bounds is not None), "band_lo": lo, "band_hi": hi}
        return [Field(name, kind, vals[name]) for name, kind in _ARG_FIELDS]

    # ---- numerics ----------------------------------------------------------------------------------------------
    def _qkv64(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """q, k (and v) as float64 [b, h, s, d]; f32 ones rounded to TF32 first, as the kernels' mma reads them."""
        b, h, sq, sk, d = _dims(problem)
        lay = _layouts(problem)
        names = ("q", "k", "v") if "v" in lay else ("q", "k")
        out = []
        for which, name in enumerate(names):
            src = inputs["qkv"] if lay[name] == "qkv_packed" else inputs[name]
            if problem.dtype == "f32":
                src = tf32_round(src)
            seq, heads = (sq, h) if name == "q" else (sk, h // kv_group(problem))
            x = to_bhsd(from_storage(src, problem.dtype), lay[name], b, heads, seq, d, which)
            out.append(np.repeat(x, h // heads, axis=1))  # GQA: each key / value head serves kv_group query heads
        return out

    def _probs64(self, problem: Problem, inputs: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray
                 ) -> np.ndarray:
        b, d = problem.size("batch"), problem.size("head_dim")
        s = float(problem.flag("scale", 1.0 / math.sqrt(d))) * np.einsum("bhqd,bhkd->bhqk", q, k)
        for which in ("mask", "bias"):
            if problem.flag(which, False):
                add = from_storage(inputs[which], problem.dtype)
                if add.shape[0] not in (1, b):  # Swin: [nW, ...] over batch = (B / nW, nW)
                    add = np.tile(add, (b // add.shape[0], 1, 1, 1))
                with np.errstate(invalid="ignore"):
                    s = s + float(problem.flag(f"{which}_scale", 1.0)) * add
        if (bounds := band(problem)) is not None:
            sq, sk = s.shape[-2:]
            offset = np.arange(sk)[None, :] - np.arange(sq)[:, None]
            s = np.where((offset < bounds[0]) | (offset > bounds[1]), -np.inf, s)
        return _softmax_rows(s)

    def random_inputs(self, problem: Problem, seed: int) -> dict[str, np.ndarray]:
        """q, k, v ~ N(0, 1); mask 0 / -10000 key padding (batch i pads its last 1 + 3i mod (seq_k / 4) keys,
        never all); bias ~ N(0, 1) (a relative position bias)."""
        rng = np.random.default_rng(seed)
        b, h, sq, sk, d = _dims(problem)
        lay = _layouts(problem)
        dt = problem.dtype
        out: dict[str, np.ndarray] = {}
        if lay["q"] == "qkv_packed":
            out["qkv"] = to_storage(rng.standard_normal(layout_shape("qkv_packed", b, h, sq, d)), dt)
        else:
            for name in [n for n in ("q", "k", "v") if n in lay]:
                seq, heads = (sq, h) if name == "q" else (sk, h // kv_group(problem))
                out[name] = to_storage(rng.standard_normal(layout_shape(lay[name], b, heads, seq, d)), dt)
        if problem.flag("mask", False):
            shape = addend_shape(problem, "mask")
            mask = np.zeros(shape)
            for i in range(shape[0]):
                pad = 1 + (3 * i) % max(1, sk // 4) if shape[-1] > 1 else 0
                if pad:
                    mask[i, ..., shape[-1] - pad:] = -10000.0
            out["mask"] = to_storage(mask, dt)
        if problem.flag("bias", False):
            out["bias"] = to_storage(rng.standard_normal(addend_shape(problem, "bias")), dt)
        return out


class AttentionFamily(_AttentionBase):
    """Fused attention, FlashAttention-2 style (attention.cuh attention_kernel)."""

    name = "attention"
    launch = "attention_launch"

    def _smem(self, problem: Problem, config: Config) -> int:
        d, bq, bkv, st = _kd(problem), config["BQ"], config["BKV"], config["STAGES"]
        rs, size = d + row_pad(problem.dtype), elem_bytes(problem.dtype)
        k_elems = d * (bkv + PAD) if _layouts(problem)["k"] == "bhds" else bkv * rs
        return size * (bq * rs + st * (k_elems + bkv * rs))

    def _acc_regs(self, problem: Problem, config: Config) -> int:
        mt, d = config["BQ"] // (16 * config["WARPS"]), _kd(problem)
        # O: D/8 n-tiles x 4, S: BKV/8 x 4; f32 (TF32) keeps one register per Q element of its A fragments (twice
        # f16's), of which ptxas holds about a quarter live: fitted to ptxas (d64 with 2 m-tiles and d128 with one
        # stay under 255 registers with no spill, d80 with 2 m-tiles is left out)
        return mt * (d // 2 + config["BKV"] // 2 + (d // 8 if problem.dtype == "f32" else 0))

    def _out_name(self) -> str:
        return "out"

    def _out_strides(self, problem: Problem) -> tuple[int, int, int, int]:
        b, h, sq, _, d = _dims(problem)
        _, sb, sh, ss, sd = layout_strides(_layouts(problem)["out"], b, h, sq, d)
        return sb, sh, ss, sd

    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        b, h, sq, _, d = _dims(problem)
        return {"out": (layout_shape(_layouts(problem)["out"], b, h, sq, d), problem.dtype)}

    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        q, k, v = self._qkv64(problem, inputs)
        p = self._probs64(problem, inputs, q, k)
        return {"out": from_bhsd(np.einsum("bhqk,bhkd->bhqd", p, v), _layouts(problem)["out"])}


class BmmSoftmaxFamily(_AttentionBase):
    """GTCO's fused BMM + softmax (attention.cuh bmm_softmax_kernel): two passes over the key tiles (row max and sum
    online, then S recomputed and P written), so any seq_k runs with one S tile in registers."""

    name = "bmm_softmax"
    launch = "bmm_softmax_launch"

    def _smem(self, problem: Problem, config: Config) -> int:
        d, bq, bkv, st = _kd(problem), config["BQ"], config["BKV"], config["STAGES"]
        rs, size = d + row_pad(problem.dtype), elem_bytes(problem.dtype)
        k_elems = d * (bkv + PAD) if _layouts(problem)["k"] == "bhds" else bkv * rs
        return size * (bq * rs + st * k_elems)

    def _acc_regs(self, problem: Problem, config: Config) -> int:
        mt, d = config["BQ"] // (16 * config["WARPS"]), _kd(problem)
        # one S tile (BKV/8 n-tiles x 4 per m-tile, whatever seq_k is) and the Q A-fragments of D/16 k-steps x 4;
        # f32 (TF32) holds D/8 x 4 of those (one tf32 element per register) and, fitted to ptxas, half as much again
        # per S register (d64 with a 128-key tile spills 8 bytes at the f16 weights)
        if problem.dtype == "f32":
            return mt * (3 * config["BKV"] // 4 + d // 2)
        return mt * (config["BKV"] // 2 + d // 4)

    def _out_name(self) -> str:
        return "probs"

    def _out_strides(self, problem: Problem) -> tuple[int, int, int, int]:
        _, h, sq, sk, _ = _dims(problem)
        return h * sq * sk, sq * sk, sk, 1

    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        b, h, sq, sk, _ = _dims(problem)
        return {"probs": ((b, h, sq, sk), problem.dtype)}

    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        q, k = self._qkv64(problem, inputs)
        return {"probs": self._probs64(problem, inputs, q, k)}


def make_problem(family: str, dtype: str, *, batch: int, heads: int, seq_q: int, seq_k: int | None = None,
                 head_dim: int, **flags: Any) -> Problem:
    """A Problem for either family; flags: scale, mask, bias, causal, window, mask_shape, bias_shape and the layouts."""
    flags.setdefault("scale", 1.0 / math.sqrt(head_dim))
    return Problem.make(family, dtype, {"batch": batch, "heads": heads, "seq_q": seq_q,
                                        "seq_k": seq_q if seq_k is None else seq_k, "head_dim": head_dim}, flags)


def output_dtype_array(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A preallocated output of the kernel's storage type, filled with NaN so unwritten elements show."""
    return to_storage(np.full(shape, np.nan), dtype).astype(np_dtype(dtype))


FAMILIES = (AttentionFamily(), BmmSoftmaxFamily())


def is_banded(op: FusedOp) -> bool:
    """The node is causal or has a window: the kernel generates that mask (a BAND instance)."""
    return bool(op["causal"] or op["window"])


def reads_mask(op: FusedOp) -> bool:
    """The node's kernel reads a mask input: a banded node's mask attribute is 1 whether or not it also has one
    (attention_op.h), so there the node's roles say."""
    return "mask" in op.inputs if is_banded(op) else bool(op["mask"])


def op_problem(op: FusedOp, dtype: str) -> Problem | str:
    """The Problem of an attention or bmm_softmax node (OpKernel.problem), or why none."""
    family = op.family
    heads, head_dim = op.int("heads"), op.int("head_dim")
    if heads is None or head_dim is None:
        return "attention with a symbolic head count or head size"
    seq_q, seq_k = op.int("seq_q"), op.int("seq_k")
    # batch and sequence lengths are run-time sizes of both kernels: a symbolic one stands as 1 when choosing tiles
    batch = static_product(op["batch_dims"] or (1,)) or 1
    flags: dict[str, Any] = {
        "scale": op["scale"] if op["scale"] is not None else 1.0 / math.sqrt(head_dim),
        "mask": reads_mask(op),
        **({"causal": True} if op["causal"] else {}),
        **({"window": tuple(int(w) for w in op["window"])} if op["window"] else {}),
        "bias": op["bias"], "q_layout": op["q_layout"], "k_layout": op["k_layout"],
        **{f"{t}_scale": float(op[f"{t}_scale"]) for t in ("mask", "bias") if float(op[f"{t}_scale"]) != 1.0},
    }
    if family == "attention":
        flags["v_layout"] = op["v_layout"]
        flags["out_layout"] = op["out_layout"]
    kv_heads = op.int("kv_heads")
    if kv_heads is not None and kv_heads != heads:
        if kv_heads <= 0 or heads % kv_heads:
            return f"kv_heads {kv_heads} does not divide heads {heads}"
        flags["kv_group"] = heads // kv_heads
    return make_problem(family, dtype, batch=batch, heads=heads, seq_q=seq_q or seq_k or 1, seq_k=seq_k or seq_q or 1,
                        head_dim=head_dim, **flags)


KERNELS = FAMILIES
OPS = (OpKernel("attention", "attention", op_problem, extent_attr="seq_q"),
       OpKernel("bmm_softmax", "bmm_softmax", op_problem, extent_attr="seq_q"))


CONSTANTS = (AttentionConstants,)
"""The groups of constants of this family's estimates, which `onnx-gtco calibration fit` fits per GPU (tune/fit.py)."""
