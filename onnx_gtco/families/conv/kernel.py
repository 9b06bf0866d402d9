"""The convolution family: ``y = post_act(act((conv(x, w) + bias) * a + b) + residual)`` as an implicit GEMM on
Tensor Cores (plugins/families/conv/conv.cuh, over gemm.cuh's tiles, fragments and pipeline) for groups == 1, and as
a direct convolution on CUDA cores for grouped and depthwise convs (groups != 1).

M = N·OH·OW output pixels, N(gemm) = OC, K = C·KH·KW; A is gathered from the NCHW input by im2col addressing in
the loader (zero outside the input: padding, ragged M and K), B is the weight [OC, C·KH·KW] (gemm.cuh's TRANS_B
layout), y is written NCHW. a and b fold the node's per-channel constants: a = scale, b = shift, or with
"batchnorm" a = scale / sqrt(var + epsilon), b = shift - mean·a (plugins/families/conv/conv_ref.h's fold_affine).

dtype "f16" / "bf16": mma.m16n8k16, fp32 accumulation and epilogue. dtype "f32": TF32 (mma.m16n8k8 on operands
rounded by cvt.rna), as the GEMM family; `reference` then convolves the TF32-rounded x and w.

Problem sizes: "N", "C", "H", "W", "OC", "KH", "KW", "SH", "SW" (strides), "DH", "DW" (dilations), "PT", "PL",
"PB", "PR" (pads top, left, bottom, right). Flags: "groups" (absent: 1), "bias", "scale", "shift", "batchnorm"
(bools: which per-channel operands the node has), "epsilon" (a run-time argument), "activation", "residual",
"post_activation".

Grouped and depthwise convs: groups independent GEMMs of K = C/groups·KH·KW and OC/groups columns each (depthwise:
K = 9, N = 1), which a Tensor Core tile would run at a few percent of its columns, so they take the direct kernel
(conv.cuh's conv_direct_kernel): one thread per output element, consecutive threads on consecutive ox of one output
plane, an fp32 sum over the group's C/groups channels and the KH x KW taps, the same epilogue. Its f32 instances
compute plain fp32 products (no TF32), so `reference` rounds nothing for groups != 1.

Arrays of a run: "x" [N, C, H, W]; "w" [OC, C/groups, KH, KW]; "bias", "scale", "shift", "mean", "var" [OC] (or [1]: one
value); "residual" and "y" [N, OC, OH, OW]. The kernel is generic in every size (run-time arguments checked by the
launcher), so one built instance serves every conv with the same flags; the sizes choose the tile and VEC.

Config: GEMM's BM, BN, BK, WM, WN, STAGES, with WM·WN·32 threads a multiple of BM (each thread gathers one row of
A); "VEC" 1 loads the weights by 16-byte cp.async chunks (K a multiple of 8 halves / 4 floats), 0 element by
element (a 7x7 stem on 3 channels: K = 147). "DIRECT" 1 (groups != 1 only, and only there) is the direct kernel,
whose one parameter is "THREADS" per block (128 or 256); it ignores the GEMM keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from onnx_gtco.calibration import Constants, Hardware, LaunchConstants, param
from onnx_gtco.config import TARGETS
from onnx_gtco.families.gemm.kernel import (
    ACTIVATIONS,
    MAX_ACC_PER_THREAD,
    MAX_THREADS,
    SCALAR_LOADS,
    MmaConstants,
    chunk_elems,
    smem_bytes,
)
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
    tf32_round,
    to_storage,
)
from onnx_gtco.kernels.timing import crowding, grid, regs_per_thread, resident
from onnx_gtco.opspec import FusedOp
from onnx_gtco.patterns.activation import REFERENCE

_CTYPE = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
SIZES = ("N", "C", "H", "W", "OC", "KH", "KW", "SH", "SW", "DH", "DW", "PT", "PL", "PB", "PR")
CHANNEL_OPERANDS = ("bias", "scale", "shift", "mean", "var")
"""Per-output-channel operands, in ConvArgs order."""
_EPI_BITS = {"bias": 1, "scale": 2, "shift": 4, "batchnorm": 8, "residual": 16}  # gtco::ConvEpi


def out_hw(problem: Problem) -> tuple[int, int]:
    """(OH, OW) of ONNX Conv with explicit pads."""
    s = {k: problem.size(k) for k in SIZES}
    oh = (s["H"] + s["PT"] + s["PB"] - s["DH"] * (s["KH"] - 1) - 1) // s["SH"] + 1
    ow = (s["W"] + s["PL"] + s["PR"] - s["DW"] * (s["KW"] - 1) - 1) // s["SW"] + 1
    return oh, ow


def groups_of(problem: Problem) -> int:
    """The conv's groups (1 where the flag is absent)."""
    return int(problem.flag("groups", 1) or 1)


def gemm_sizes(problem: Problem) -> tuple[int, int, int]:
    """The implicit GEMM's (M, N, K) = (N·OH·OW, OC, C·KH·KW)."""
    oh, ow = out_hw(problem)
    return (problem.size("N") * oh * ow, problem.size("OC"),
            problem.size("C") * problem.size("KH") * problem.size("KW"))


def _flags(problem: Problem) -> dict[str, Any]:
    return {"bias": bool(problem.flag("bias", False)), "scale": bool(problem.flag("scale", False)),
            "shift": bool(problem.flag("shift", False)), "batchnorm": bool(problem.flag("batchnorm", False)),
            "residual": bool(problem.flag("residual", False)),
            "activation": str(problem.flag("activation", "none") or "none"),
            "post_activation": str(problem.flag("post_activation", "none") or "none")}


def conv_problem(dtype: str, n: int, c: int, h: int, w: int, oc: int, kh: int, kw: int, *,
                 stride: tuple[int, int] = (1, 1), dilation: tuple[int, int] = (1, 1),
                 pads: tuple[int, int, int, int] = (0, 0, 0, 0), groups: int = 1, bias: bool = False,
                 scale: bool = False, shift: bool = False, batchnorm: bool = False, epsilon: float = 1e-5,
                 activation: str = "none", residual: bool = False, post_activation: str = "none") -> Problem:
    """A conv Problem from keyword arguments; pads as ONNX orders them (top, left, bottom, right)."""
    sizes = {"N": n, "C": c, "H": h, "W": w, "OC": oc, "KH": kh, "KW": kw, "SH": stride[0], "SW": stride[1],
             "DH": dilation[0], "DW": dilation[1], "PT": pads[0], "PL": pads[1], "PB": pads[2], "PR": pads[3]}
    flags: dict[str, Any] = {"bias": bias, "scale": scale or batchnorm, "shift": shift or batchnorm,
                             "batchnorm": batchnorm, "activation": activation, "residual": residual,
                             "post_activation": post_activation}
    if groups != 1:
        flags["groups"] = groups
    if batchnorm:
        flags["epsilon"] = float(epsilon)
    return Problem.make("conv", dtype, sizes, flags)


@dataclass(frozen=True)
class ConvConstants(Constants):
    """The constants of the implicit-GEMM conv's estimate (onnx_gtco.calibration: on the H200 fitted from ViT-B/16's
    patch embedding, 16x16 stride 16 on 3 channels, at batch 1 with 128x64 and 64x32 tiles and at batch 64 with
    128x128). The Tensor Core side reads the mma GEMM's constants."""

    GROUP: ClassVar[str] = "conv"
    gather_ns: float = param(236.0, 5.0, 2000.0, "ns", "what one element of A a thread gathers by im2col addressing "
                             "costs its k-tile: the loads go one by one through registers, each waiting for its "
                             "address's arithmetic and its L2 round trip")
    gather_gps: float = param(151.0, 5.0, 5000.0, "G elements/s", "the rate, all SMs together, at which the "
                              "blocks gather A elements (every N tile gathers A again)")


class ConvFamily(KernelFamily):
    """Implicit-GEMM convolution over gemm.cuh's Tensor Core tiles (groups == 1), direct convolution on CUDA cores
    (grouped and depthwise), with the conv group's epilogue fused."""

    name = "conv"
    title = "Conv"
    task_columns = (("conv", "conv", {}),
                    ("kernel", "impl", {"implicit_gemm": "implicit GEMM (Tensor Cores)",
                                        "direct": "direct (CUDA cores)"}))
    space: Mapping[str, tuple[int, ...]] = {
        "BM": (64, 128, 256),
        "BN": (32, 64, 128),
        "BK": (32, 64),
        "WM": (1, 2, 4, 8),
        "WN": (1, 2, 4),
        "STAGES": (2, 3, 4),
        "VEC": (1, 0),
        "DIRECT": (0, 1),
        "THREADS": (128, 256),
    }
    optional: Mapping[str, int] = {"VEC": 1, "DIRECT": 0, "THREADS": 128}
    DIRECT_KEYS = ("DIRECT", "THREADS")
    """The direct kernel's parameters; the others are the implicit GEMM's."""

    def task_summary(self, problem: Problem, best: Config | None) -> dict[str, Any]:
        """Which kernel won ("impl": "implicit_gemm", the Tensor Core tile, or "direct", the CUDA-core kernel of
        grouped convs; None without a successful trial) and the conv's shape ("conv": summary)."""
        impl = None if best is None else "direct" if best.get("DIRECT") else "implicit_gemm"
        return {"impl": impl, "conv": summary(problem)}

    def space_for(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        """The parameters a tuning trial of `problem` suggests (tune.search.search_space): the direct kernel's,
        DIRECT fixed at 1, for groups != 1, the implicit GEMM's tile and VEC for groups == 1. Each kernel's keys
        only, so that a trial never mixes the two (the other kernel's keys would be ignored, and name a
        configuration that is not the one built) and never picks the kernel `check` refuses for the groups. VEC
        is 0 only where K (C·KH·KW) is no multiple of a 16-byte chunk (a 7x7 stem on 3 channels): every VEC = 1
        trial would be refused there, spending the task's trials."""
        if groups_of(problem) != 1:
            return {"DIRECT": (1,), "THREADS": self.space["THREADS"]}
        space = {k: v for k, v in self.space.items() if k not in self.DIRECT_KEYS}
        try:
            if gemm_sizes(problem)[2] % chunk_elems(problem.dtype):
                space["VEC"] = (0,)
        except KeyError:
            pass  # check names the missing size
        return space

    def check(self, problem: Problem, config: Config, arch: str) -> str | None:
        if problem.family != self.name:
            return f"problem is for family {problem.family!r}, not {self.name!r}"
        if arch not in ARCHS:
            return f"arch {arch!r}: choose one of {ARCHS}"
        if problem.dtype not in _CTYPE:
            return f"dtype {problem.dtype}: the conv kernels take f16, bf16 or f32 (TF32)"
        try:
            sizes = {k: problem.size(k) for k in SIZES}
        except KeyError as e:
            return f"problem lacks size {e.args[0]}"
        if min(sizes[k] for k in ("N", "C", "H", "W", "OC", "KH", "KW", "SH", "SW", "DH", "DW")) < 1:
            return f"sizes must be positive ({sizes})"
        if min(sizes[k] for k in ("PT", "PL", "PB", "PR")) < 0:
            return "pads must not be negative"
        groups = groups_of(problem)
        if groups < 1 or sizes["C"] % groups or sizes["OC"] % groups:
            return f"groups={groups} does not divide C={sizes['C']} and OC={sizes['OC']}"
        oh, ow = out_hw(problem)
        if oh < 1 or ow < 1:
            return "the dilated kernel is larger than the padded input"
        flags = _flags(problem)
        for key in ("activation", "post_activation"):
            if flags[key] not in ACTIVATIONS:
                return f"{key} {flags[key]!r} is not fused by the conv epilogue (have: {', '.join(ACTIVATIONS)})"
        if flags["batchnorm"] and not (flags["scale"] and flags["shift"]):
            return "batchnorm needs scale and shift (with mean and var)"
        direct = {**self.optional, **config}["DIRECT"]
        if direct not in self.space["DIRECT"]:
            return f"DIRECT={direct} is outside the space {self.space['DIRECT']}"
        if direct:
            return self._check_direct(problem, {**self.optional, **config}, groups)
        if groups != 1:
            return (f"groups={groups}: the implicit GEMM runs groups == 1 only (a grouped or depthwise conv is "
                    f"{groups} GEMMs of OC/groups columns each, a few percent of a tile's work); use the direct "
                    "kernel (DIRECT=1)")
        missing = [k for k in self.space if k not in config and k not in self.optional]
        if missing:
            return f"config lacks {', '.join(missing)}"
        config = {**self.optional, **config}
        for key, allowed in self.space.items():
            if config[key] not in allowed:
                return f"{key}={config[key]} is outside the space {allowed}"
        m, n, k = gemm_sizes(problem)
        if max(m + 256, k + 64, n + 128) >= 2 ** 31:
            return f"M={m}, K={k} or N={n} past the kernel's 32-bit index math"
        ch = chunk_elems(problem.dtype)
        if config["VEC"] and k % ch:
            return (f"K={k} (C·KH·KW): VEC=1 (cp.async weight chunks of {ch} elements) needs K % {ch} == 0; use "
                    "VEC=0 (element-wise weight loads)")
        bm, bn, bk, wm, wn = config["BM"], config["BN"], config["BK"], config["WM"], config["WN"]
        if bm % (16 * wm) or bn % (8 * wn):
            return (f"warp layout {wm}x{wn} does not divide the {bm}x{bn} tile into warp tiles that are multiples "
                    f"of 16x8 (warp tile {bm / wm:g}x{bn / wn:g})")
        threads = wm * wn * 32
        if threads > MAX_THREADS:
            return f"{threads} threads per block (WM*WN*32) exceed {MAX_THREADS}"
        if threads % bm or bk % (threads // bm):
            return (f"{threads} threads for BM={bm}: the A gather gives each thread one row, so the threads must be "
                    f"a multiple of BM (and BK of threads / BM)")
        if bk // (threads // bm) > 32:
            return f"{bk // (threads // bm)} A elements per thread staged in registers (> 32: would spill)"
        acc = (bm // wm) * (bn // wn) // 32
        if acc > MAX_ACC_PER_THREAD:
            return f"warp tile {bm // wm}x{bn // wn} needs {acc} fp32 accumulators per thread (> {MAX_ACC_PER_THREAD})"
        smem = smem_bytes(config, True, problem.dtype)
        limit = TARGETS[arch].smem_kib * 1024
        if smem > limit:
            return f"shared memory {smem} B ({smem / 1024:g} KiB) exceeds the {arch} limit of {limit // 1024} KiB"
        if math.ceil(n / bn) > 65535:
            return f"OC={n}: {math.ceil(n / bn)} column tiles exceed the grid's y limit 65535"
        return None

    def _check_direct(self, problem: Problem, config: Config, groups: int) -> str | None:
        """The direct kernel's side of `check` (sizes, flags and groups' divisibility already checked)."""
        if groups == 1:
            return ("DIRECT=1 with groups == 1: the direct kernel is for grouped and depthwise convs; a groups == 1 "
                    "conv is one implicit GEMM on Tensor Cores (DIRECT=0)")
        if config["THREADS"] not in self.space["THREADS"]:
            return f"THREADS={config['THREADS']} is outside the space {self.space['THREADS']}"
        oh, ow = out_hw(problem)
        total = problem.size("N") * problem.size("OC") * oh * ow
        if total + config["THREADS"] >= 2 ** 31:
            return f"{total} output elements past the direct kernel's 32-bit index math"
        return None

    def configs(self, problem: Problem, arch: str) -> list[dict[str, int]]:
        """8-warp 128x128 tiles for big convs, 4-warp 128x64 / 64x64 ones when the big ones would not fill the GPU
        or OC is small (a 64-channel ResNet stage wastes half a 128-wide tile); where 128x128 tiles would not fill
        the GPU, the biggest small tile that does comes first, else the one with the most blocks (ViT-B/16's patch
        embedding at batch 1, 196 x 768: 24 blocks of 128x64 took 182 us on an H200, twice cuDNN's time).
        Grouped and depthwise convs: the direct kernel, 256 threads a block, then 128."""
        if arch not in ARCHS:
            return []
        if groups_of(problem) != 1:
            direct = [{"DIRECT": 1, "THREADS": t} for t in (256, 128)]
            return [c for c in direct if self.check(problem, c, arch) is None]
        big = [
            {"BM": 128, "BN": 128, "BK": 32, "WM": 4, "WN": 2, "STAGES": 3},
            {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 4, "STAGES": 4},
        ]
        small = [
            {"BM": 128, "BN": 64, "BK": 32, "WM": 4, "WN": 1, "STAGES": 3},
            {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3},
            {"BM": 64, "BN": 32, "BK": 32, "WM": 2, "WN": 2, "STAGES": 2},
        ]
        try:
            m, n, k = gemm_sizes(problem)
            tiles = math.ceil(m / 128) * math.ceil(n / 128)
            vec = int(k % chunk_elems(problem.dtype) == 0)
        except KeyError:
            m, n, tiles, vec = 0, 128, 0, 1
        sms = TARGETS[arch].sms
        if tiles >= sms:
            order = big + small if n > 64 else small + big
        else:  # 128x128 tiles would not fill the GPU: the biggest small tile that does, else the one with most blocks
            def rank(c: dict[str, int]) -> tuple[bool, int]:
                blocks = math.ceil(m / c["BM"]) * math.ceil(n / c["BN"])
                return (blocks < sms, -c["BM"] * c["BN"] if blocks >= sms else -blocks)

            order = sorted(small, key=rank) + big
        return [c for c in ({**c, "VEC": vec} for c in order) if self.check(problem, c, arch) is None]

    def estimate_us(self, problem: Problem, config: Config, hw: Hardware) -> float:
        """The estimated time of a valid `config` on `problem` on `hw`. Implicit GEMM (ConvConstants, and the mma
        GEMM's MmaConstants for its Tensor Core side): each block's k-tiles take the longest of its threads' A gather
        (gather_ns per element a thread loads, BM x BK / threads of them) and its warps' mma chain; the grid runs in
        waves of resident blocks, or at the GPU's gather rate where that bounds it (every N tile gathers A again);
        then the epilogue and the launch floor. Direct (groups != 1): its fp32 FMAs at the CUDA-core peak or its
        bytes at the DRAM bandwidth, whichever is slower, over the busy share of the last wave (unmeasured)."""
        t = hw.target
        c = {**self.optional, **config}
        floor = hw.constants(LaunchConstants).floor_us
        elem = 4 if problem.dtype == "f32" else 2
        if c["DIRECT"]:
            oh, ow = out_hw(problem)
            groups = groups_of(problem)
            n, ch, oc = problem.size("N"), problem.size("C"), problem.size("OC")
            outputs = n * oc * oh * ow
            flops = 2.0 * outputs * (ch // groups) * problem.size("KH") * problem.size("KW")
            moved = elem * (n * ch * problem.size("H") * problem.size("W")
                            + oc * (ch // groups) * problem.size("KH") * problem.size("KW")
                            + (2 + int(bool(problem.flag("residual", False)))) * outputs)
            g = grid(t, math.ceil(outputs / c["THREADS"]), resident(t, 0, c["THREADS"]))
            fill = g.blocks / (g.waves * g.slots)
            return floor + max(flops / (t.cuda_tflops * 1e6), moved / (t.dram_gbps * 1e3)) / max(fill, 0.05)
        k_c, mma = hw.constants(ConvConstants), hw.constants(MmaConstants)
        m, n, k = gemm_sizes(problem)
        bm, bn, bk, wm, wn = c["BM"], c["BN"], c["BK"], c["WM"], c["WN"]
        threads = wm * wn * 32
        n_tiles = math.ceil(n / bn)
        blocks = math.ceil(m / bm) * n_tiles
        k_tiles = math.ceil(k / bk)
        warp_m, warp_n = bm // wm, bn // wn
        g = grid(t, blocks, resident(t, smem_bytes(c, True, problem.dtype), threads,
                                      regs_per_thread(warp_m * warp_n // 32)))
        peak_sm = (t.tf32_tflops if problem.dtype == "f32" else t.tc_tflops) * 1e6 / t.sms
        chain = (2.0 * warp_m * warp_n * bk / (mma.warp_peak_frac * peak_sm)
                 * crowding(g.per_sm * wm * wn, mma.share_exp))
        gather = k_c.gather_ns * 1e-3 * bm * bk / threads
        weights = (bn * bk * elem * (1.0 if c["VEC"] else SCALAR_LOADS) * min(g.blocks, g.slots)
                   / (mma.l2_frac * t.dram_gbps * 1e3))  # B's tile, as the GEMM's operands
        epilogue = mma.epilogue_ns * 1e-3 * bm * bn / threads * (1.0 + bool(problem.flag("residual", False)))
        waves = g.waves * (k_tiles * max(gather, chain, weights) + epilogue * g.per_sm)
        rate = m * k * n_tiles / (k_c.gather_gps * 1e3)
        return floor + max(waves, rate)

    def instance_name(self, problem: Problem, config: Config, arch: str) -> str:
        c = {**self.optional, **config}
        suffix = flag_suffix(problem)
        if c["DIRECT"]:
            name = "_".join([self.name, arch.replace("_", ""), problem.dtype, "direct", f"t{c['THREADS']}"])
            return name + (f"_{suffix}" if suffix else "")
        parts = [self.name, arch.replace("_", ""), problem.dtype, f"{c['BM']}x{c['BN']}x{c['BK']}",
                 f"w{c['WM']}x{c['WN']}", f"s{c['STAGES']}"]
        if not c["VEC"]:
            parts.append("sc")
        return "_".join(parts) + (f"_{suffix}" if suffix else "")

    def instantiate(self, problem: Problem, config: Config, arch: str) -> Instance:
        why = self.check(problem, config, arch)
        if why is not None:
            raise ValueError(why)
        c = {**self.optional, **config}
        f = _flags(problem)
        epi = sum(bit for key, bit in _EPI_BITS.items() if f[key])
        name = self.instance_name(problem, c, arch)
        symbol = f"gtco_{name}"
        acts = (f"gtco::Act::{ACTIVATIONS[f['activation']]}, gtco::Act::{ACTIVATIONS[f['post_activation']]}")
        if c["DIRECT"]:
            c = {"DIRECT": 1, "THREADS": c["THREADS"]}
            source = (
                f"// Generated by onnx_gtco.families.conv.kernel: {name}\n"
                f"// y = {f['post_activation']}({f['activation']}(affine(conv(x, w){' + bias' if f['bias'] else ''}))"
                f"{' + residual' if f['residual'] else ''}); direct (grouped), {c['THREADS']} threads, {arch}\n"
                f"#include \"conv/conv.cuh\"\n"
                f"\n"
                f"GTCO_EXPORT int {symbol}(const ConvArgs* args, void* stream) {{\n"
                f"    return gtco::launch_conv_direct<{_CTYPE[problem.dtype]}, {c['THREADS']}, /*EPI=*/{epi}, {acts}>"
                f"(args, stream);\n"
                f"}}\n")
            return Instance(name=name, symbol=symbol, source=source, problem=problem, config=c, arch=arch,
                            smem_bytes=0)
        c = {k: v for k, v in c.items() if k not in ("DIRECT", "THREADS")}  # the direct kernel's keys
        targs = (f"{_CTYPE[problem.dtype]}, {c['BM']}, {c['BN']}, {c['BK']}, {c['WM']}, {c['WN']}, {c['STAGES']}, "
                 f"/*EPI=*/{epi}, gtco::Act::{ACTIVATIONS[f['activation']]}, "
                 f"gtco::Act::{ACTIVATIONS[f['post_activation']]}, /*VEC=*/{'true' if c['VEC'] else 'false'}")
        source = (
            f"// Generated by onnx_gtco.families.conv.kernel: {name}\n"
            f"// y = {f['post_activation']}({f['activation']}(affine(conv(x, w){' + bias' if f['bias'] else ''}))"
            f"{' + residual' if f['residual'] else ''}); implicit GEMM, tile {c['BM']}x{c['BN']}x{c['BK']}, "
            f"warps {c['WM']}x{c['WN']}, {c['STAGES']} stages, {arch}\n"
            f"#include \"conv/conv.cuh\"\n"
            f"\n"
            f"GTCO_EXPORT int {symbol}(const ConvArgs* args, void* stream) {{\n"
            f"    return gtco::launch_conv<{targs}>(args, stream);\n"
            f"}}\n")
        return Instance(name=name, symbol=symbol, source=source, problem=problem, config=c, arch=arch,
                        smem_bytes=smem_bytes(c, True, problem.dtype))

    # ---------------------------------------------------------------------------------------------------------
    def input_shapes(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        s = {k: problem.size(k) for k in SIZES}
        f = _flags(problem)
        oh, ow = out_hw(problem)
        shapes: dict[str, tuple[int, ...]] = {"x": (s["N"], s["C"], s["H"], s["W"]),
                                              "w": (s["OC"], s["C"] // groups_of(problem), s["KH"], s["KW"])}
        for key in CHANNEL_OPERANDS:
            if f["batchnorm"] if key in ("mean", "var") else f[key]:
                shapes[key] = (s["OC"],)
        if f["residual"]:
            shapes["residual"] = (s["N"], s["OC"], oh, ow)
        return shapes

    def args_fields(self, problem: Problem, arrays: Mapping[str, np.ndarray]) -> list[Field]:
        s = {k: problem.size(k) for k in SIZES}
        oh, ow = out_hw(problem)
        present = self.input_shapes(problem)
        fields = [Field("x", "ptr", "x"), Field("w", "ptr", "w")]
        fields += [Field(k, "ptr", k if k in present else "") for k in CHANNEL_OPERANDS]
        fields += [Field("residual", "ptr", "residual" if "residual" in present else ""), Field("y", "ptr", "y")]
        fields += [Field(name, "i64", v) for name, v in (
            ("n", s["N"]), ("c", s["C"]), ("in_h", s["H"]), ("in_w", s["W"]), ("oc", s["OC"]), ("kh", s["KH"]),
            ("kw", s["KW"]), ("oh", oh), ("ow", ow), ("stride_h", s["SH"]), ("stride_w", s["SW"]),
            ("pad_t", s["PT"]), ("pad_l", s["PL"]), ("dil_h", s["DH"]), ("dil_w", s["DW"]),
            ("groups", groups_of(problem)))]
        fields += [Field(f"{k}_step", "i64", int(k in present and np.asarray(arrays[k]).size > 1))
                   for k in CHANNEL_OPERANDS]
        fields.append(Field("epsilon", "f32", float(problem.flag("epsilon", 1e-5))))
        return fields

    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        oh, ow = out_hw(problem)
        return {"y": ((problem.size("N"), problem.size("OC"), oh, ow), problem.dtype)}

    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        s = {k: problem.size(k) for k in SIZES}
        f = _flags(problem)
        dt = problem.dtype
        x = from_storage(np.asarray(inputs["x"]), dt)
        w = from_storage(np.asarray(inputs["w"]), dt)
        groups = groups_of(problem)
        if dt == "f32" and groups == 1:  # the Tensor Core multiplies TF32 operands (the direct kernel fp32 ones)
            x, w = (tf32_round(v).astype(np.float64) for v in (x, w))
        oh, ow = out_hw(problem)
        xp = np.pad(x, ((0, 0), (0, 0), (s["PT"], s["PB"]), (s["PL"], s["PR"])))
        cg, ocg = s["C"] // groups, s["OC"] // groups
        y = np.zeros((s["N"], s["OC"], oh, ow))
        for ky in range(s["KH"]):
            for kx in range(s["KW"]):
                y0, x0 = ky * s["DH"], kx * s["DW"]
                win = xp[:, :, y0:y0 + s["SH"] * (oh - 1) + 1:s["SH"], x0:x0 + s["SW"] * (ow - 1) + 1:s["SW"]]
                for g in range(groups):
                    y[:, g * ocg:(g + 1) * ocg] += np.einsum(
                        "nchw,oc->nohw", win[:, g * cg:(g + 1) * cg], w[g * ocg:(g + 1) * ocg, :, ky, kx])

        def chan(key: str, default: float) -> np.ndarray:
            if key not in inputs:
                return np.full((1, 1, 1), default)
            v = from_storage(np.asarray(inputs[key]), dt).reshape(-1)
            return np.broadcast_to(v, (s["OC"],)).reshape(-1, 1, 1)

        y = y + chan("bias", 0.0)
        scale, shift = chan("scale", 1.0), chan("shift", 0.0)
        if f["batchnorm"]:
            eps = float(np.float32(problem.flag("epsilon", 1e-5)))
            a = scale / np.sqrt(chan("var", 1.0) + eps)
            y = y * a + (shift - chan("mean", 0.0) * a)
        else:
            y = y * scale + shift
        if f["activation"] != "none":
            y = REFERENCE[f["activation"]](y)
        if f["residual"]:
            y = y + from_storage(np.asarray(inputs["residual"]), dt)
        if f["post_activation"] != "none":
            y = REFERENCE[f["post_activation"]](y)
        return {"y": y}

    def random_inputs(self, problem: Problem, seed: int) -> dict[str, np.ndarray]:
        """Standard normal x, w scaled by 1/sqrt(K) (so conv(x, w) is O(1)); bias, shift, mean and residual at
        0.5 scale; scale in [0.5, 1.5], var in [0.5, 2] (positive, as BatchNormalization's)."""
        rng = np.random.default_rng(seed)
        k = gemm_sizes(problem)[2] // groups_of(problem)  # the sum's length: C/groups·KH·KW
        out: dict[str, np.ndarray] = {}
        for key, shape in self.input_shapes(problem).items():
            if key == "scale":
                v = rng.uniform(0.5, 1.5, shape)
            elif key == "var":
                v = rng.uniform(0.5, 2.0, shape)
            else:
                v = rng.standard_normal(shape)
                v = v / math.sqrt(k) if key == "w" else v * (0.5 if key != "x" else 1.0)
            out[key] = to_storage(v.astype(np.float32), problem.dtype)
        return out

    def allocate_outputs(self, problem: Problem) -> dict[str, np.ndarray]:
        """Preallocated outputs, filled with a NaN pattern so that an element the kernel never writes shows."""
        out = {}
        for key, (shape, dt) in self.outputs(problem).items():
            out[key] = (np.full(shape, np.nan, np.float32) if dt == "f32"
                        else np.full(shape, 0xFFFF, np.uint16).view(np_dtype(dt)))
        return out


def summary(problem: Problem) -> str:
    """The conv's shape in a line, for reports: `x 1x3x224x224, w 768x3x16x16, stride 16x16`, then pads,
    dilation and groups where they are not the defaults."""
    s = {k: problem.size(k) for k in SIZES}
    groups = groups_of(problem)
    parts = [f"x {s['N']}x{s['C']}x{s['H']}x{s['W']}", f"w {s['OC']}x{s['C'] // groups}x{s['KH']}x{s['KW']}"]
    if (s["SH"], s["SW"]) != (1, 1):
        parts.append(f"stride {s['SH']}x{s['SW']}")
    if any(s[k] for k in ("PT", "PL", "PB", "PR")):
        parts.append(f"pads {s['PT']},{s['PL']},{s['PB']},{s['PR']}")
    if (s["DH"], s["DW"]) != (1, 1):
        parts.append(f"dilation {s['DH']}x{s['DW']}")
    if groups != 1:
        parts.append(f"groups {groups}")
    return ", ".join(parts)


def flag_suffix(problem: Problem) -> str:
    """`bias_bn_relu_res_post_relu`: the epilogue part of every conv instance name ("" for none)."""
    f = _flags(problem)
    parts = [k for k in ("bias",) if f[k]]
    if f["batchnorm"]:
        parts.append("bn")
    else:
        parts += [k for k in ("scale", "shift") if f[k]]
    if f["activation"] != "none":
        parts.append(f["activation"])
    if f["residual"]:
        parts.append("res")
    if f["post_activation"] != "none":
        parts += ["post", f["post_activation"]]
    return "_".join(parts)


FAMILY = ConvFamily()


NEEDS_SHAPES = "a conv's kernel Problem needs its input's shape (the binder gives it: families.conv.bind)"
"""A conv node's answer to kernels.select.problem_for: its attributes hold the kernel, strides, pads and dilations
but not x's shape. The conv binder builds the Problem from the shapes instead, for the library (plugin.device) and
for the tuner's tasks (tune.tasks.shaped_problem) alike; model_instances, which reads attributes only, skips conv
nodes with this reason."""


def op_problem(op: FusedOp, dtype: str) -> str:
    """A conv node's Problem needs shapes (NEEDS_SHAPES)."""
    del op, dtype
    return NEEDS_SHAPES


KERNELS = (FAMILY,)
OPS = (OpKernel("conv", "conv", op_problem, shaped=True),)


CONSTANTS = (ConvConstants,)
"""The groups of constants of this family's estimates, which `onnx-gtco calibration fit` fits per GPU (tune/fit.py)."""
