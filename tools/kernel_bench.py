"""Run the kernels on a real GPU: check them against fp64 references and time every implementation beside cuBLASLt,
torch and ONNX Runtime.

    python tools/kernel_bench.py [--arch sm_90] [--set vit-b16,bert-base,setr,detr] [--out DIR] [--reps 50]
                                 [--max-configs K] [--impls mma,cutlass,cublaslt] [--no-compile]
                                 [--compile-budget-s S] [--time-budget-s S] [--quick] [--compile-only] [--list]

Shape sets (`--set`, default all; `--list` prints them with their candidates, no GPU, no nvcc):

* vit-b16: ViT-B/16 at 224 px (197 tokens) at batch 1, 8 and 64: qkv, proj, fc1, fc2, the head; attention,
  BMM+softmax and residual+LayerNorm; the patch embedding conv.
* bert-base: BERT-base at batch 1 (the suite's) and 128 and 512 tokens: q/k/v, attention out, FFN, the pooler;
  masked attention and LayerNorm.
* setr: the suite's SETR-Naive, a ViT-B/16 encoder at 384 px (577 tokens), batch 1; its patch embedding and the
  head's 1x1 convs.
* detr: the suite's DETR-R50 at 320 px (100 encoder tokens, 100 queries), batch 1: every encoder and decoder
  GEMM and the heads, the encoder's GEMMs and attention at the paper's 800x1333 (1050 tokens) too, and the ResNet-50
  backbone's convolutions (BatchNorm folded into weights and bias) and the input projection.

Every GEMM is fp16 in and out with fp32 accumulation; identical GEMMs of a model are one row with its count. Each
GEMM row times, on the same inputs (CUDA events, median of `reps` runs after a warm-up; the same inputs every run,
so L2 holds what fits, for every candidate and baseline alike):

* every implementation's configurations: "mma" the generated kernels (the family's offered configs), "cutlass" the
  CUTLASS 3.x sm_90a instances (kernels.cutlass.configs; sm_90 target and a 9.0 GPU only), "cublaslt" cuBLASLt
  through our glue (its heuristic's ranks), each capped by --max-configs, each instance built as the tuner's GPU
  measurer builds a trial (tune.gpu.shared_library) and checked against the fp64 reference (‖err‖/‖ref‖; a wrong
  answer, a failed build or launch is marked and never "best");
* tuned: the fastest correct candidate of all implementations, the choice a GPU tuning study makes among these
  candidates (the tuner seeds its study with the analytical model's best of each implementation, a subset of
  them); beside it the analytical pick, the candidate the analytical model (tune.search.predict_us) ranks first,
  and its measured time;
* cuBLASLt fused: our cuBLASLt instance of the whole group at the heuristic's first rank (a GELU(erf) group, which
  cuBLASLt cannot express, is priced by the same group with the tanh GELU, marked "tanh proxy");
* separate epilogue: torch's cuBLAS(Lt) matmul then the epilogue as separate torch ops, both as `a @ b + bias` and
  as `addmm` (the bias in cuBLASLt's epilogue), the faster of the two;
* torch.compile(mode="max-autotune") of that unfused function (skipped by --no-compile; the compiles run last, in
  what is left of --compile-budget-s and --time-budget-s).

Each conv row times F.conv2d (cuDNN, NCHW, cudnn.benchmark) plus its epilogue in torch, a one-node Conv model
(+ Add + Relu as the model has them) on ONNX Runtime's CUDA EP (wall-clock per synchronous run with I/O bound to the
device, so it includes ORT's per-run overhead) when onnxruntime-gpu is importable, and our conv kernel family's
configurations (fp16, bias and the row's activation and residual fused), each checked against its fp64 reference.
Attention, BMM+softmax and LayerNorm rows time the
family's configurations beside torch SDPA / unfused torch, as before.

Writes results.json and results.md into --out after every row, with the ratios baseline / ours (> 1: ours faster):
tuned / separate epilogue, CUTLASS best / cuBLASLt fused, cuDNN (torch and ORT) / our conv.
Needs torch with CUDA and nvcc.
`--compile-only` builds every instance and launches nothing (no torch, no GPU: how `tools/gpu_suite --dry-run`
exercises this step). `--time-budget-s` stops starting rows at that time and lists the rest as skipped, so a call
that must end under a machine's command limit still writes whole files.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onnx_gtco.errors import GtcoError  # noqa: E402
from onnx_gtco.kernels import cublaslt, cutlass  # noqa: E402
from onnx_gtco.kernels.attention import FAMILIES as ATTENTION_FAMILIES  # noqa: E402
from onnx_gtco.kernels.attention import make_problem  # noqa: E402
from onnx_gtco.kernels.conv import FAMILY as CONV  # noqa: E402
from onnx_gtco.kernels.conv import conv_problem  # noqa: E402
from onnx_gtco.kernels.family import (  # noqa: E402
    Instance,
    KernelFamily,
    Problem,
    c_args,
    entry_point,
    from_storage,
    rel_error,
)
from onnx_gtco.kernels.gemm import FAMILY as GEMM  # noqa: E402
from onnx_gtco.kernels.gemm import MAX_LN_N, gemm_problem  # noqa: E402
from onnx_gtco.kernels.layernorm import FAMILY as LAYERNORM  # noqa: E402
from onnx_gtco.tune.gpu import TOLERANCE, load_cublaslt, shared_library  # noqa: E402
from onnx_gtco.tune.search import OFFERED, Measurement, config_arch, offered, predict_us  # noqa: E402
from onnx_gtco.tune.tasks import Task, template_version  # noqa: E402

ATTN = {f.name: f for f in ATTENTION_FAMILIES}
TOL = TOLERANCE
IMPLS = ("mma", cutlass.IMPL, cublaslt.IMPL)
SETS = ("vit-b16", "bert-base", "setr", "detr")
CUTLASS_CONFIGS = 3
"""CUTLASS configurations per GEMM row (the first of kernels.cutlass.configs; about a minute of nvcc each)."""


# ------------------------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class ConvShape:
    """One 2-D convolution, NCHW, square kernel: y = act(conv(x, w) + bias + residual)."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    k: int
    stride: int = 1
    pad: int = 0
    act: str = "none"
    residual: bool = False

    @property
    def out_hw(self) -> tuple[int, int]:
        return tuple((x + 2 * self.pad - self.k) // self.stride + 1 for x in (self.h, self.w))  # type: ignore

    def describe(self) -> str:
        oh, ow = self.out_hw
        epi = "+bias" + ("+res" if self.residual else "") + (f"+{self.act}" if self.act != "none" else "")
        return (f"{self.n}x{self.cin}x{self.h}x{self.w} -> {self.cout}x{oh}x{ow} k{self.k} s{self.stride} "
                f"p{self.pad} {epi}")


@dataclass
class Case:
    """One row of the bench: a GEMM / attention / LayerNorm problem of a family, or a conv."""

    set: str
    label: str
    kind: str  # "gemm", "attention", "bmm_softmax", "layernorm", "conv"
    problem: Problem | None = None
    conv: ConvShape | None = None
    count: int = 1
    where: list[str] = field(default_factory=list)

    @property
    def family(self) -> KernelFamily | None:
        return {"gemm": GEMM, "layernorm": LAYERNORM, "conv": CONV, **ATTN}.get(self.kind)


def _gemm(m: int, n: int, k: int, epilogue: str) -> Problem:
    """An fp16 weight GEMM [m, k] @ [k, n]; epilogue "bias", "bias+gelu", "bias+relu", "bias+tanh", "bias+res",
    "bias+res+ln" (the LayerNorm of the rows fused: ln_y beside y)."""
    parts = epilogue.split("+")
    act = next((a for a in parts if a in ("gelu", "relu", "tanh")), "none")
    return gemm_problem("f16", 1, m, n, k, bias="bias" in parts, residual="res" in parts,
                        activation="gelu_erf" if act == "gelu" else act, layernorm="ln" in parts, epsilon=1e-6)


def _attn(fam: str, batch: int, heads: int, seq: int, head_dim: int, mask: bool = False) -> Problem:
    extra = {"v_layout": "bhsd", "out_layout": "bhsd"} if fam == "attention" else {}
    return make_problem(fam, "f16", batch=batch, heads=heads, seq_q=seq, head_dim=head_dim, mask=mask,
                        q_layout="bhsd", k_layout="bhsd", **extra)


def _ln(rows: int, hidden: int = 768) -> Problem:
    return Problem.make("layernorm", "f16", {"hidden": hidden, "rows": rows},
                        {"residual": True, "residual_out": True, "gamma": True, "beta": True, "epsilon": 1e-6})


def _encoder(tag: str, tokens: int, batch: int, layers: int, hidden: int, heads: int, mlp: int, split_qkv: bool,
             mask: bool) -> list[tuple[str, str, Problem, int]]:
    """(label, kind, problem, count) of a pre/post-LN transformer encoder's layers."""
    m = tokens * batch
    out = [(f"{tag} q/k/v", "gemm", _gemm(m, hidden, hidden, "bias"), 3 * layers)] if split_qkv else \
        [(f"{tag} qkv", "gemm", _gemm(m, 3 * hidden, hidden, "bias"), layers)]
    out += [(f"{tag} attn-out", "gemm", _gemm(m, hidden, hidden, "bias+res"), layers),
            (f"{tag} fc1", "gemm", _gemm(m, mlp, hidden, "bias+gelu"), layers),
            (f"{tag} fc2", "gemm", _gemm(m, hidden, mlp, "bias+res"), layers)]
    if hidden <= MAX_LN_N:  # the same GEMMs with the LayerNorm after them in the kernel (against GEMM, then LN)
        out += [(f"{tag} attn-out+layernorm", "gemm", _gemm(m, hidden, hidden, "bias+res+ln"), layers),
                (f"{tag} fc2+layernorm", "gemm", _gemm(m, hidden, mlp, "bias+res+ln"), layers)]
    hd = hidden // heads
    out += [(f"{tag} attention B{batch} H{heads} S{tokens} D{hd}{' +mask' if mask else ''}", "attention",
             _attn("attention", batch, heads, tokens, hd, mask), layers),
            (f"{tag} bmm_softmax B{batch} H{heads} S{tokens} D{hd}{' +mask' if mask else ''}", "bmm_softmax",
             _attn("bmm_softmax", batch, heads, tokens, hd, mask), layers),
            (f"{tag} residual+layernorm {m}x{hidden}", "layernorm", _ln(m, hidden), 2 * layers)]
    return out


def resnet50_convs(h: int, w: int, batch: int = 1) -> list[tuple[str, ConvShape]]:
    """(label, conv) of a timm ResNet-50 (stride in the 3x3 conv) on an h x w image, every conv in order, BatchNorm
    folded: the stem 7x7 s2 (+ReLU), then per bottleneck 1x1 (+ReLU), 3x3 (+ReLU), 1x1 (+residual +ReLU) and the
    first block's 1x1 downsample."""
    out = [("stem 7x7", ConvShape(batch, 3, h, w, 64, 7, 2, 3, "relu"))]
    h, w = (h + 1) // 2, (w + 1) // 2  # the stem
    h, w = (h + 1) // 2, (w + 1) // 2  # the 3x3 s2 max pool
    cin = 64
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), 1):
        for b in range(blocks):
            s = stride if b == 0 else 1
            oh, ow = (h - 1) // s + 1, (w - 1) // s + 1
            tag = f"layer{stage}"
            out.append((f"{tag} 1x1 reduce", ConvShape(batch, cin, h, w, width, 1, 1, 0, "relu")))
            out.append((f"{tag} 3x3", ConvShape(batch, width, h, w, width, 3, s, 1, "relu")))
            if b == 0:
                out.append((f"{tag} downsample", ConvShape(batch, cin, h, w, 4 * width, 1, s, 0)))
            out.append((f"{tag} 1x1 expand", ConvShape(batch, width, oh, ow, 4 * width, 1, 1, 0, "relu", True)))
            cin, h, w = 4 * width, oh, ow
    return out


def _sets() -> dict[str, list[tuple[str, str, Any, int]]]:
    """Shape set -> its rows as (label, kind, problem or ConvShape, count), before merging identical ones."""
    vit: list[tuple[str, str, Any, int]] = []
    for b in (1, 8, 64):
        vit += _encoder(f"vit-b16 b{b}", 197, b, 12, 768, 12, 3072, split_qkv=False, mask=False)
        vit.append((f"vit-b16 b{b} head", "gemm", _gemm(b, 1000, 768, "bias"), 1))
        vit.append((f"vit-b16 b{b} patch-embed", "conv", ConvShape(b, 3, 224, 224, 768, 16, 16, 0), 1))
    bert: list[tuple[str, str, Any, int]] = []
    for s in (128, 512):
        bert += _encoder(f"bert-base b1 s{s}", s, 1, 12, 768, 12, 3072, split_qkv=True, mask=True)
        bert.append((f"bert-base b1 s{s} pooler", "gemm", _gemm(1, 768, 768, "bias+tanh"), 1))
    setr = _encoder("setr b1", 577, 1, 12, 768, 12, 3072, split_qkv=False, mask=False)
    setr += [("setr patch-embed", "conv", ConvShape(1, 3, 384, 384, 768, 16, 16, 0), 1),
             ("setr head 1x1", "conv", ConvShape(1, 768, 24, 24, 256, 1, 1, 0, "relu"), 1),
             ("setr classifier 1x1", "conv", ConvShape(1, 256, 24, 24, 150, 1, 1, 0), 1)]
    detr: list[tuple[str, str, Any, int]] = []
    hw, q, d, ffn = (320 // 32) ** 2, 100, 256, 2048
    detr += [("detr enc q/k/v", "gemm", _gemm(hw, d, d, "bias"), 18),
             ("detr enc out", "gemm", _gemm(hw, d, d, "bias+res"), 6),
             ("detr enc fc1", "gemm", _gemm(hw, ffn, d, "bias+relu"), 6),
             ("detr enc fc2", "gemm", _gemm(hw, d, ffn, "bias+res"), 6),
             ("detr dec self q/k/v", "gemm", _gemm(q, d, d, "bias"), 18),
             ("detr dec self out", "gemm", _gemm(q, d, d, "bias+res"), 6),
             ("detr dec cross q", "gemm", _gemm(q, d, d, "bias"), 6),
             ("detr dec cross k/v", "gemm", _gemm(hw, d, d, "bias"), 12),
             ("detr dec cross out", "gemm", _gemm(q, d, d, "bias+res"), 6),
             ("detr dec fc1", "gemm", _gemm(q, ffn, d, "bias+relu"), 6),
             ("detr dec fc2", "gemm", _gemm(q, d, ffn, "bias+res"), 6),
             ("detr class head", "gemm", _gemm(q, 92, d, "bias"), 1),
             ("detr bbox mlp", "gemm", _gemm(q, d, d, "bias+relu"), 2),
             ("detr bbox out", "gemm", _gemm(q, 4, d, "bias"), 1),
             (f"detr attention B1 H8 S{hw} D32 +mask", "attention", _attn("attention", 1, 8, hw, 32, True), 12),
             (f"detr bmm_softmax B1 H8 S{hw} D32 +mask", "bmm_softmax", _attn("bmm_softmax", 1, 8, hw, 32, True),
              12)]
    paper = 25 * 42  # 800x1333 -> a 25x42 feature map
    detr += [(f"detr@800 enc {label}", "gemm", _gemm(paper, n, k, epi), 6 * c)
             for label, n, k, epi, c in (("q/k/v", d, d, "bias", 3), ("out", d, d, "bias+res", 1),
                                         ("fc1", ffn, d, "bias+relu", 1), ("fc2", d, ffn, "bias+res", 1))]
    detr.append((f"detr@800 attention B1 H8 S{paper} D32 +mask", "attention",
                 _attn("attention", 1, 8, paper, 32, True), 6))
    detr += [(f"detr backbone {label}", "conv", conv, 1) for label, conv in resnet50_convs(320, 320)]
    detr.append(("detr input-projection 1x1", "conv", ConvShape(1, 2048, 10, 10, 256, 1, 1, 0), 1))
    return {"vit-b16": vit, "bert-base": bert, "setr": setr, "detr": detr}


def cases(sets: Iterable[str] = SETS, quick: bool = False) -> list[Case]:
    """The rows of the named shape sets, identical problems (and convs) of a set merged into one row with the summed
    count and every label it stands for. `quick`: the first three GEMM rows only."""
    all_sets = _sets()
    out: list[Case] = []
    for name in sets:
        merged: dict[Any, Case] = {}
        for label, kind, what, count in all_sets[name]:
            key = (kind, what)
            if key in merged:
                merged[key].count += count
                merged[key].where.append(label)
                continue
            shape = what.describe() if kind == "conv" else _describe(what)
            merged[key] = Case(name, f"{label} {shape}".strip(), kind, conv_of(what) if kind == "conv" else what,
                               what if kind == "conv" else None, count, [label])
        out += merged.values()
    if quick:
        out = [c for c in out if c.kind == "gemm"][:3]
    return out


def _describe(p: Problem) -> str:
    if p.family == "gemm":
        epi = "+".join(x for x in ("bias" if p.flag("bias") else "", str(p.flag("activation", "none")).replace(
            "none", ""), "res" if p.flag("residual") else "") if x)
        return f"{p.size('M')}x{p.size('N')}x{p.size('K')}" + (f" +{epi}" if epi else "")
    return ""


# ------------------------------------------------------------------------------------------------------ candidates


def task_of(p: Problem, arch: str) -> Task:
    return Task(p, arch, template_version())


def gemm_candidates(p: Problem, arch: str, max_configs: int | None, impls: Iterable[str] = IMPLS
                    ) -> dict[str, list[dict[str, Any]] | str]:
    """Each GEMM implementation -> the configurations the bench times on `p` for target `arch`, or why none
    (tune.search.offered's reason, the tuner's own): mma the family's offered configs, cutlass the first
    CUTLASS_CONFIGS of kernels.cutlass.configs (sm_90 only), cublaslt the heuristic's ranks; each capped by
    `max_configs`."""
    cap = max_configs
    why = offered(task_of(p, arch))
    out: dict[str, list[dict[str, Any]] | str] = {}
    for impl in IMPLS:
        if impl not in impls:
            out[impl] = "not selected (--impls)"
        elif impl == "mma":
            out[impl] = [c for c in GEMM.configs(p, arch) if c.get("impl", "mma") == "mma"][:cap] or \
                "no generated configuration passes its check"
        elif why.get(impl) != OFFERED:
            out[impl] = why.get(impl) or f"{impl} is not offered"
        elif impl == cutlass.IMPL:
            out[impl] = [{"impl": impl, **c} for c in cutlass.configs(p, cutlass.ARCH)][:min(cap or CUTLASS_CONFIGS,
                                                                                            CUTLASS_CONFIGS)]
        else:
            out[impl] = [{"impl": impl, "RANK": r} for r in cublaslt.RANKS][:cap]
    return out


def fused_cublaslt(p: Problem) -> tuple[Problem, str] | str:
    """The problem the "cuBLASLt fused" baseline runs for `p`: `p` itself, or for a GELU(erf) group the same group
    with the tanh GELU (cuBLASLt's GELU epilogue; the same cost) with the note "tanh proxy"; or why there is none."""
    if cublaslt.unsupported(p) is None:
        return p, ""
    if p.flag("activation") == "gelu_erf":
        proxy = Problem.make(p.family, p.dtype, dict(p.sizes), dict(p.flags) | {"activation": "gelu_tanh"})
        if cublaslt.unsupported(proxy) is None:
            return proxy, "tanh proxy"
    return str(cublaslt.unsupported(p))


def conv_of(c: ConvShape) -> Problem:
    """The conv kernel family's Problem of a bench conv: fp16, its bias, activation and residual fused."""
    return conv_problem("f16", c.n, c.cin, c.h, c.w, c.cout, c.k, c.k, stride=(c.stride, c.stride),
                        pads=(c.pad,) * 4, bias=True, activation=c.act, residual=c.residual)


def case_instances(case: Case, arch: str, max_configs: int | None, impls: Iterable[str]) -> list[Instance]:
    """The instances a row times (each built for the arch its configuration runs on)."""
    fam = case.family
    if fam is None or case.problem is None:
        return []
    p = case.problem
    if case.kind != "gemm":
        return [fam.instantiate(p, c, arch) for c in fam.configs(p, arch)[:max_configs]]
    task = task_of(p, arch)
    out = [GEMM.instantiate(p, c, config_arch(task, c))
           for cfgs in gemm_candidates(p, arch, max_configs, impls).values() if isinstance(cfgs, list) for c in cfgs]
    fused = fused_cublaslt(p)
    if cublaslt.IMPL in impls and not isinstance(fused, str) and fused[1]:
        out.append(cublaslt.instance(fused[0], 0, arch))
    return out


def listing(todo: list[Case], arch: str, max_configs: int | None, impls: Iterable[str] = IMPLS) -> list[dict]:
    """Per row: its set, label, kind, count, what it stands for and its candidates (implementation -> instance
    names, or why none), the baselines it is timed against. No GPU, no nvcc."""
    impls = tuple(impls)
    rows = []
    for case in todo:
        cands: dict[str, list[str] | str] = {}
        base: list[str] = []
        if case.kind == "gemm":
            p = case.problem
            assert p is not None
            task = task_of(p, arch)
            for impl, cfgs in gemm_candidates(p, arch, max_configs, impls).items():
                cands[impl] = cfgs if isinstance(cfgs, str) else [
                    GEMM.instance_name(p, c, config_arch(task, c)) for c in cfgs]
            fused = fused_cublaslt(p)
            base = [f"cublaslt fused{' (tanh proxy)' if not isinstance(fused, str) and fused[1] else ''}"
                    if not isinstance(fused, str) else f"cublaslt fused: none ({fused})",
                    "torch matmul + epilogue", "torch addmm + epilogue", "torch.compile max-autotune"]
            if p.flag("layernorm"):
                base = [*base[:1], *(f"{b} + layer_norm" for b in base[1:])]
        elif case.kind == "conv":
            cands["ours"] = [i.name for i in case_instances(case, arch, max_configs, ("mma",))]
            base = ["torch conv2d (cuDNN) + epilogue", "ORT CUDA EP Conv (when onnxruntime-gpu is importable)"]
        else:
            fam, p = case.family, case.problem
            assert fam is not None and p is not None
            cands["mma"] = [fam.instantiate(p, c, arch).name for c in fam.configs(p, arch)[:max_configs]]
            base = list(_baseline_names(case))
        rows.append({"set": case.set, "case": case.label, "kind": case.kind, "count": case.count,
                     "where": case.where, "candidates": cands, "baselines": base})
    return rows


def _baseline_names(case: Case) -> tuple[str, ...]:
    if case.kind == "attention":
        return ("torch unfused", "torch SDPA")
    if case.kind == "bmm_softmax":
        return ("torch unfused",)
    return ("torch add+layer_norm",)


def print_listing(rows: list[dict], arch: str) -> None:
    print(f"Kernel bench shapes for {arch}: {len(rows)} rows")
    for r in rows:
        print(f"[{r['set']}] {r['case']} (x{r['count']}, {r['kind']})")
        for impl, c in r["candidates"].items():
            print(f"    {impl:<9} " + (f"skipped: {c}" if isinstance(c, str) else f"{len(c)}: " + ", ".join(c)))
        print(f"    baselines: {'; '.join(r['baselines'])}")


# ------------------------------------------------------------------------------------------------------ build


def build_all(insts: Mapping[str, Instance], jobs: int) -> dict[str, Path | str]:
    """Each instance as a shared library (tune.gpu.shared_library: kernels.compile's cached, spill-checked nvcc
    build, linked), or why it did not build."""
    def one(inst: Instance) -> Path | str:
        try:
            lib = shared_library(inst)
        except GtcoError as e:  # a header that could not be fetched, a missing nvcc
            return f"{type(e).__name__}: {e}"
        return f"{lib.error_kind}: {lib.detail[-600:]}" if isinstance(lib, Measurement) else lib
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return dict(zip(insts, pool.map(one, insts.values()), strict=True))


# ------------------------------------------------------------------------------------------------------ timing


def _median_us(fn: Callable[[], object], reps: int, torch) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def to_torch(x: np.ndarray, dtype: str, torch):
    """Storage array (float16, float32, or uint16 for bf16) -> CUDA tensor of the kernel dtype."""
    if dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def to_numpy(t, dtype: str, torch) -> np.ndarray:
    """CUDA tensor -> storage array (float16, float32, or uint16 for bf16)."""
    if dtype == "bf16":
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    return t.detach().cpu().numpy()


def _torch_dtype(dt: str, torch):
    return {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dt]


def _err(t, want: np.ndarray, dtype: str, torch) -> float:
    return rel_error(from_storage(to_numpy(t, dtype, torch), dtype), want)


class Runner:
    """Launches built instances of one problem on one set of device inputs and checks and times them."""

    def __init__(self, fam: KernelFamily, p: Problem, reps: int, torch, seed: int = 5) -> None:
        self.fam, self.p, self.reps, self.torch = fam, p, reps, torch
        self.inputs = fam.random_inputs(p, seed=seed)
        out_dt = {k: dt for k, (_, dt) in fam.outputs(p).items()}
        res_dt = out_dt.get("y", p.dtype)
        self.dev = {k: to_torch(v, res_dt if k == "residual" else p.dtype, torch) for k, v in self.inputs.items()}
        self.outs = {k: torch.full(shape, float("nan"), dtype=_torch_dtype(dt, torch), device="cuda")
                     for k, (shape, dt) in fam.outputs(p).items()}
        self.out_dt = out_dt
        self.ref = fam.reference(p, self.inputs)
        self.stream = torch.cuda.current_stream().cuda_stream

    def time(self, inst: Instance, lib: Path | str) -> dict:
        """One candidate's row: built, launched, checked against the fp64 reference, and timed when correct."""
        row: dict[str, Any] = {"instance": inst.name, "impl": str(inst.config.get("impl", "mma")),
                               "config": dict(inst.config), "ok": False, "us": None, "rel_err": None}
        if isinstance(lib, str):
            row["error"] = f"build: {lib}"
            return row
        if inst.config.get("impl") == cublaslt.IMPL:
            load_cublaslt()
        arrays = dict(self.inputs) | {k: np.empty(tuple(v.shape), np.float16) for k, v in self.outs.items()}
        def address(name: str) -> int | None:
            t = self.outs.get(name, self.dev.get(name))
            return None if t is None else int(t.data_ptr())

        args = c_args(self.fam.args_fields(self.p, arrays), address)
        fn = entry_point(str(lib), inst.symbol, args)
        for t in self.outs.values():
            t.fill_(float("nan"))
        code = fn(ctypes.byref(args), self.stream)
        self.torch.cuda.synchronize()
        row["code"] = code
        errs = {k: _err(t, self.ref[k], self.out_dt[k], self.torch) for k, t in self.outs.items()}
        row["rel_err"] = max(errs.values()) if errs else None
        row["ok"] = code == 0 and all(math.isfinite(e) and e < TOL[self.p.dtype] for e in errs.values())
        if code != 0:
            row["error"] = f"returned {code}"
        elif not row["ok"]:
            row["error"] = f"wrong answer: ‖err‖/‖ref‖ {row['rel_err']:.3g} (tolerance {TOL[self.p.dtype]:g})"
        else:
            row["us"] = _median_us(lambda: fn(ctypes.byref(args), self.stream), self.reps, self.torch)
        return row

    def baseline(self, name: str, fn: Callable[[], Any], want: np.ndarray | None = None) -> dict:
        """A torch baseline's row: its answer checked (against `want`, default the problem's reference), timed."""
        y = fn()
        self.torch.cuda.synchronize()
        err = _err(y, self.ref["y"] if want is None else want, self.out_dt.get("y", self.p.dtype), self.torch) \
            if "y" in self.ref or want is not None else None
        ok = err is None or (math.isfinite(err) and err < TOL[self.p.dtype])
        return {"name": name, "rel_err": err, "ok": ok, "us": _median_us(fn, self.reps, self.torch),
                **({} if ok else {"error": f"wrong answer: ‖err‖/‖ref‖ {err:.3g}"})}


def _torch_epilogue(p: Problem, torch) -> Callable:
    """`act(y + bias) + residual` as separate torch ops (ACTIVATIONS of the GEMM family that torch names)."""
    F = torch.nn.functional
    act = str(p.flag("activation", "none"))
    acts = {"none": lambda y: y, "relu": F.relu, "gelu_erf": F.gelu,
            "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
            "silu": F.silu}
    return acts[act]


def gemm_baselines(p: Problem, r: Runner, torch) -> dict[str, Callable[[], Any]]:
    """The unfused torch forms of a GEMM row, on the Runner's inputs."""
    a, b = r.dev["a"].reshape(-1, r.dev["a"].shape[-1]), r.dev["b"]
    if p.flag("trans_b"):
        b = b.t()
    bias, res = r.dev.get("bias"), r.dev.get("residual")
    act = _torch_epilogue(p, torch)
    shape = r.outs["y"].shape
    if p.flag("layernorm"):  # then torch's layer_norm: the unfused pair (checked against y, which it returns)
        gamma, beta, eps = r.dev["gamma"], r.dev["beta"], float(p.flag("epsilon", 1e-5))
        ln = torch.nn.functional.layer_norm
        plain = gemm_baselines(Problem.make(p.family, p.dtype, dict(p.sizes),
                                            {k: v for k, v in p.flags if k not in ("layernorm", "epsilon")}), r, torch)

        def then_ln(f: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                y = f()
                ln(y, (y.shape[-1],), gamma, beta, eps)
                return y
            return run
        return {f"{name} + layer_norm": then_ln(f) for name, f in plain.items()}

    def matmul():
        y = a @ b
        if bias is not None:
            y = y + bias
        y = act(y)
        return (y + res.reshape(y.shape) if res is not None else y).reshape(shape)

    def addmm():
        y = act(torch.addmm(bias, a, b) if bias is not None else a @ b)
        return (y + res.reshape(y.shape) if res is not None else y).reshape(shape)
    return {"torch matmul + epilogue": matmul, "torch addmm + epilogue": addmm}


def run_gemm_case(case: Case, arch: str, libs: Mapping[str, Path | str], reps: int, torch, max_configs: int | None,
                  impls: Iterable[str], cc: int) -> dict:
    p = case.problem
    assert p is not None
    r = Runner(GEMM, p, reps, torch)
    task = task_of(p, arch)
    rows, skipped = [], {}
    for impl, cfgs in gemm_candidates(p, arch, max_configs, impls).items():
        if isinstance(cfgs, str):
            skipped[impl] = cfgs
            continue
        if impl == cutlass.IMPL and cc != 90:
            skipped[impl] = f"{cutlass.ARCH} code runs on 9.0 GPUs only (this one is {cc // 10}.{cc % 10})"
            continue
        for c in cfgs:
            inst = GEMM.instantiate(p, c, config_arch(task, c))
            row = r.time(inst, libs[inst.name])
            row["predicted_us"] = predict_us(task, c)
            rows.append(row)
    good = [x for x in rows if x["ok"]]
    best = {impl: min((x for x in good if x["impl"] == impl), key=lambda x: x["us"], default=None)
            for impl in IMPLS}
    tuned = min(good, key=lambda x: x["us"], default=None)
    pick = min(rows, key=lambda x: x["predicted_us"], default=None)
    base = {name: r.baseline(name, fn) for name, fn in gemm_baselines(p, r, torch).items()}
    sep = [x for x in base.values() if x["ok"]]
    separate = min(sep, key=lambda x: x["us"]) if sep else None
    fused = fused_cublaslt(p)
    fused_row: dict[str, Any] | None
    if isinstance(fused, str):
        fused_row = {"ok": False, "us": None, "error": fused}
    elif cublaslt.IMPL not in impls:
        fused_row = {"ok": False, "us": None, "error": "not selected (--impls)"}
    elif not fused[1]:
        fused_row = next((x for x in rows if x["impl"] == cublaslt.IMPL and x["config"].get("RANK") == 0),
                         {"ok": False, "us": None, "error": "rank 0 not timed"})
        fused_row = dict(fused_row, note="")
    else:
        inst = cublaslt.instance(fused[0], 0, arch)
        fused_row = Runner(GEMM, fused[0], reps, torch).time(inst, libs[inst.name]) | {"note": fused[1]}
    out = {"set": case.set, "case": case.label, "kind": "gemm", "count": case.count, "where": case.where,
           "rows": rows, "skipped": skipped,
           "best": {k: (v["instance"], v["us"]) if v else None for k, v in best.items()},
           "tuned": {"instance": tuned["instance"], "impl": tuned["impl"], "us": tuned["us"]} if tuned else None,
           "analytical_pick": ({"instance": pick["instance"], "impl": pick["impl"], "us": pick["us"],
                                "ok": pick["ok"]} if pick else None),
           "baselines": base, "separate": ({"name": separate["name"], "us": separate["us"]} if separate else None),
           "cublaslt_fused": fused_row, "compile": None,
           "all_ok": all(x["ok"] for x in rows) and all(x["ok"] for x in base.values())}
    out["ratios"] = ratios(out)
    return out


def ratios(res: dict) -> dict[str, float | None]:
    """baseline / ours (> 1: ours faster): tuned vs the separate epilogue, CUTLASS vs cuBLASLt fused, tuned vs
    torch.compile."""
    def div(a: Any, b: Any) -> float | None:
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None
    tuned = (res.get("tuned") or {}).get("us")
    cut = (res.get("best") or {}).get(cutlass.IMPL)
    fused = res.get("cublaslt_fused") or {}
    comp = res.get("compile") or {}
    return {"tuned_vs_separate": div((res.get("separate") or {}).get("us"), tuned),
            "cutlass_vs_cublaslt_fused": div(fused.get("us") if fused.get("ok") else None, cut[1] if cut else None),
            "tuned_vs_compile": div(comp.get("us") if comp.get("ok") else None, tuned)}


def run_family_case(case: Case, arch: str, libs: Mapping[str, Path | str], reps: int, torch,
                    max_configs: int | None) -> dict:
    """An attention / BMM+softmax / LayerNorm row: the family's configurations beside torch."""
    fam, p = case.family, case.problem
    assert fam is not None and p is not None
    r = Runner(fam, p, reps, torch)
    rows = [r.time(inst, libs[inst.name]) for inst in case_instances(case, arch, max_configs, ("mma",))]
    base = {name: {"name": name, "us": _median_us(fn, reps, torch), "ok": True}
            for name, fn in family_baselines(fam, p, r.dev, torch).items()}
    good = [x for x in rows if x["ok"]]
    best = min(good, key=lambda x: x["us"], default=None)
    return {"set": case.set, "case": case.label, "kind": case.kind, "count": case.count, "where": case.where,
            "rows": rows, "best": {"mma": (best["instance"], best["us"]) if best else None},
            "tuned": {"instance": best["instance"], "impl": "mma", "us": best["us"]} if best else None,
            "baselines": base, "all_ok": all(x["ok"] for x in rows)}


def family_baselines(fam: KernelFamily, p: Problem, dev: dict, torch) -> dict[str, Callable[[], object]]:
    F = torch.nn.functional
    if fam.name in ATTN:
        q, k, v = dev["q"], dev["k"], dev.get("v")
        scale = float(p.flag("scale"))
        mask = dev.get("mask")
        m4 = None if mask is None else mask.reshape(mask.shape[0], 1, 1, -1) if mask.dim() != 4 else mask

        def unfused():
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            if m4 is not None:
                s = s + m4
            pr = torch.softmax(s.float(), -1).to(q.dtype)
            return pr if v is None else torch.matmul(pr, v)
        out = {"torch unfused": unfused}
        if fam.name == "attention":
            out["torch SDPA"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m4, scale=scale)
        return out
    x, res = dev["x"], dev["residual"]
    g, bt = dev["gamma"], dev["beta"]
    return {"torch add+layer_norm": lambda: F.layer_norm(x + res, (x.shape[-1],), g, bt, 1e-6)}


# ------------------------------------------------------------------------------------------------------ conv


def conv_reference(c: ConvShape, x: np.ndarray, w: np.ndarray, bias: np.ndarray, res: np.ndarray | None
                   ) -> np.ndarray:
    """act(conv(x, w) + bias + res) in float64 numpy (im2col)."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (c.pad, c.pad), (c.pad, c.pad)))
    win = np.lib.stride_tricks.sliding_window_view(x, (c.k, c.k), axis=(2, 3))[:, :, ::c.stride, ::c.stride]
    oh, ow = c.out_hw
    win = win[:, :, :oh, :ow]  # n, cin, oh, ow, k, k
    y = np.einsum("nchwij,ocij->nohw", win, w.astype(np.float64), optimize=True)
    y = y + bias.astype(np.float64)[None, :, None, None]
    if res is not None:
        y = y + res.astype(np.float64)
    return np.maximum(y, 0.0) if c.act == "relu" else y


def conv_inputs(c: ConvShape, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    oh, ow = c.out_hw
    out = {"x": rng.standard_normal((c.n, c.cin, c.h, c.w)).astype(np.float16),
           "w": (rng.standard_normal((c.cout, c.cin, c.k, c.k)) / math.sqrt(c.cin * c.k * c.k)).astype(np.float16),
           "bias": (0.5 * rng.standard_normal(c.cout)).astype(np.float16)}
    if c.residual:
        out["residual"] = (0.5 * rng.standard_normal((c.n, c.cout, oh, ow))).astype(np.float16)
    return out


def conv_onnx_model(c: ConvShape) -> Any:
    """The conv as ONNX Runtime sees it in the model: Conv (weights and bias as initializers) [+ Add] [+ Relu], fp16."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    ins = conv_inputs(c)
    oh, ow = c.out_hw
    epilogue = [("Add", "residual")] * c.residual + [("Relu", None)] * (c.act == "relu")
    names = ["conv"] + [f"t{i}" for i in range(len(epilogue))]
    names[-1] = "y"
    nodes = [helper.make_node("Conv", ["x", "w", "bias"], [names[0]], kernel_shape=[c.k, c.k],
                              strides=[c.stride] * 2, pads=[c.pad] * 4)]
    for i, (op, other) in enumerate(epilogue):
        nodes.append(helper.make_node(op, [names[i], *([other] if other else [])], [names[i + 1]]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [c.n, c.cin, c.h, c.w])]
    if c.residual:
        inputs.append(helper.make_tensor_value_info("residual", TensorProto.FLOAT16, [c.n, c.cout, oh, ow]))
    graph = helper.make_graph(nodes, "conv", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [c.n, c.cout, oh, ow])],
                              [numpy_helper.from_array(ins["w"], "w"), numpy_helper.from_array(ins["bias"], "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def ort_cuda_reason() -> str | None:
    """Why ONNX Runtime's CUDA EP cannot run here, or None."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        return f"onnxruntime is not importable ({e})"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"
    return None


def time_ort_conv(c: ConvShape, dev: Mapping[str, Any], out, reps: int, torch) -> float:
    """Median wall-clock µs of one synchronous run of the one-node Conv model on ORT's CUDA EP, inputs and output
    bound to the torch tensors (no host copy)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(conv_onnx_model(c).SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"device_id": torch.cuda.current_device(),
                                                                      "cudnn_conv_algo_search": "EXHAUSTIVE"})])
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"the session fell back to {sess.get_providers()}")
    io = sess.io_binding()
    for name in ("x", "residual"):
        if name in dev:
            t = dev[name]
            io.bind_input(name, "cuda", torch.cuda.current_device(), np.float16, list(t.shape), t.data_ptr())
    io.bind_output("y", "cuda", torch.cuda.current_device(), np.float16, list(out.shape), out.data_ptr())
    torch.cuda.synchronize()
    for _ in range(5):
        sess.run_with_iobinding(io)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_conv_case(case: Case, arch: str, libs: Mapping[str, Path | str], reps: int, torch,
                  max_configs: int | None) -> dict:
    """A conv row: our conv family's configurations (each checked against its fp64 reference) beside cuDNN through
    torch and through ORT's CUDA EP, on inputs of the same shapes."""
    c = case.conv
    assert c is not None and case.problem is not None
    F = torch.nn.functional
    host = conv_inputs(c)
    dev = {k: torch.from_numpy(v).cuda() for k, v in host.items()}
    want = conv_reference(c, host["x"], host["w"], host["bias"], host.get("residual"))

    def cudnn():
        y = F.conv2d(dev["x"], dev["w"], dev["bias"], stride=c.stride, padding=c.pad)
        if c.residual:
            y = y + dev["residual"]
        return F.relu(y) if c.act == "relu" else y
    base: dict[str, dict] = {}
    y = cudnn()
    torch.cuda.synchronize()
    err = rel_error(y.double().cpu().numpy(), want)
    ok = math.isfinite(err) and err < TOL["f16"]
    base["torch cuDNN"] = {"name": "torch cuDNN", "rel_err": err, "ok": ok, "us": _median_us(cudnn, reps, torch)}
    why = ort_cuda_reason()
    if why is None:
        out = torch.full_like(y, float("nan"))
        try:
            us = time_ort_conv(c, dev, out, reps, torch)
            e = rel_error(out.double().cpu().numpy(), want)
            base["ORT cuDNN"] = {"name": "ORT cuDNN", "rel_err": e, "ok": math.isfinite(e) and e < TOL["f16"],
                                 "us": us, "note": "wall-clock per synchronous run"}
        except Exception as ex:  # an ORT failure is that baseline's, not the row's
            base["ORT cuDNN"] = {"name": "ORT cuDNN", "ok": False, "us": None, "error": f"{type(ex).__name__}: {ex}"}
    else:
        base["ORT cuDNN"] = {"name": "ORT cuDNN", "ok": False, "us": None, "skipped": why}
    r = Runner(CONV, case.problem, reps, torch)
    rows = [r.time(inst, libs[inst.name]) for inst in case_instances(case, arch, max_configs, ("mma",))]
    best = min((x for x in rows if x["ok"]), key=lambda x: x["us"], default=None)
    ours: dict[str, Any] = {"instance": best["instance"], "us": best["us"]} if best else {
        "skipped": "no configuration of the conv family ran correctly (see its rows)"}

    def ratio(name: str) -> float | None:
        us = base.get(name, {}).get("us")
        return us / best["us"] if best and us else None
    return {"set": case.set, "case": case.label, "kind": "conv", "count": case.count, "where": case.where,
            "conv": vars(c), "rows": rows, "ours": ours, "baselines": base,
            "ratios": {"ours_vs_cudnn_ort": ratio("ORT cuDNN"), "ours_vs_cudnn_torch": ratio("torch cuDNN")},
            "all_ok": all(x["ok"] for x in rows) and all(b["ok"] or b.get("skipped") for b in base.values())}


# ------------------------------------------------------------------------------------------------------ torch.compile


def compile_gemm(case: Case, reps: int, torch) -> dict:
    """torch.compile(mode="max-autotune") of the row's unfused torch function, its answer checked, timed."""
    import torch._dynamo

    p = case.problem
    assert p is not None
    torch._dynamo.reset()
    r = Runner(GEMM, p, reps, torch)
    bias, res_t = r.dev.get("bias"), r.dev.get("residual")
    act = _torch_epilogue(p, torch)
    a, b = r.dev["a"].reshape(-1, r.dev["a"].shape[-1]), r.dev["b"]
    if p.flag("trans_b"):
        b = b.t()

    ln = (r.dev["gamma"], r.dev["beta"], float(p.flag("epsilon", 1e-5))) if p.flag("layernorm") else None

    def fn(a, b, bias, res):
        y = a @ b
        if bias is not None:
            y = y + bias
        y = act(y)
        y = y + res if res is not None else y
        if ln is None:
            return y, y
        return y, torch.nn.functional.layer_norm(y, (y.shape[-1],), ln[0], ln[1], ln[2])  # the pair, compiled
    compiled = torch.compile(fn, mode="max-autotune", dynamic=False, fullgraph=True)
    res2 = None if res_t is None else res_t.reshape(a.shape[0], -1)
    t0 = time.monotonic()
    y = compiled(a, b, bias, res2)[0]
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    err = _err(y.reshape(r.outs["y"].shape), r.ref["y"], "f16", torch)
    ok = math.isfinite(err) and err < TOL["f16"]
    us = _median_us(lambda: compiled(a, b, bias, res2), reps, torch)
    name = "torch.compile max-autotune" + (" + layer_norm" if ln is not None else "")
    return {"name": name, "us": us, "rel_err": err, "ok": ok,
            "compile_s": round(seconds, 1), **({} if ok else {"error": f"wrong answer: ‖err‖/‖ref‖ {err:.3g}"})}


# ------------------------------------------------------------------------------------------------------ report


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _base_cell(b: dict | None) -> str:
    if not b:
        return "-"
    if b.get("us") is not None and b.get("ok"):
        return _us(b["us"])
    return "wrong" if b.get("us") is not None or str(b.get("error", "")).startswith("wrong") else "-"


def markdown(results: list[dict], device: str, notes: list[str] | None = None) -> str:
    lines = [f"Device: {device}. Median µs of CUDA-event timings (ORT: wall-clock per run); ratio = baseline / ours "
             "(> 1: ours faster). tuned = the fastest correct candidate of all implementations (what a GPU tuning "
             "study picks among them); separate = the faster of torch matmul or addmm + the epilogue as separate "
             "ops; err = the largest ‖err‖/‖ref‖ against fp64 of our candidates (a wrong one is excluded from best).",
             ""]
    gemm = [r for r in results if r.get("kind") == "gemm"]
    if gemm:
        lines += ["| set | GEMM (M x N x K, epilogue) | x | mma best | cutlass best | cublaslt best | tuned (impl) | "
                  "analytical pick | cuBLASLt fused | separate | max-autotune | tuned / separate | "
                  "cutlass / cuBLASLt fused | tuned / max-autotune | err | ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in gemm:
            if r.get("error") or r.get("skipped_reason"):
                lines.append(f"| {r['set']} | {r['case']} | {r.get('count', 1)} | "
                             f"{r.get('error') or 'skipped: ' + r['skipped_reason']} |" + " |" * 12)
                continue
            best = r["best"]
            cells = []
            for impl in IMPLS:
                cells.append(_us(best[impl][1]) if best.get(impl) else
                             ("skip" if impl in r["skipped"] else "-"))
            t = r["tuned"]
            pick = r["analytical_pick"]
            fused = r["cublaslt_fused"]
            fused_cell = (_us(fused["us"]) + (f" ({fused['note']})" if fused.get("note") else "")
                          if fused.get("ok") else "-")
            comp = r.get("compile") or {}
            comp_cell = _us(comp["us"]) if comp.get("ok") else ("wrong" if comp.get("us") else
                                                                 comp.get("skipped", "-")[:24] if comp else "-")
            errs = [x["rel_err"] for x in r["rows"] if isinstance(x.get("rel_err"), float)]
            n_ok = sum(x["ok"] for x in r["rows"])
            ra = r["ratios"]
            lines.append(
                f"| {r['set']} | {r['case']} | {r['count']} | {' | '.join(cells)} | "
                f"{_us(t['us']) + ' (' + t['impl'] + ')' if t else '-'} | "
                f"{(_us(pick['us']) if pick['ok'] else 'failed') + ' (' + pick['impl'] + ')' if pick else '-'} | "
                f"{fused_cell} | {_us((r['separate'] or {}).get('us'))} | {comp_cell} | "
                f"{_x(ra['tuned_vs_separate'])} | {_x(ra['cutlass_vs_cublaslt_fused'])} | "
                f"{_x(ra['tuned_vs_compile'])} | {max(errs):.1e} | {n_ok}/{len(r['rows'])} |"
                if errs else
                f"| {r['set']} | {r['case']} | {r['count']} | {' | '.join(cells)} | - | - | {fused_cell} | "
                f"{_us((r['separate'] or {}).get('us'))} | {comp_cell} | - | - | - | - | 0/{len(r['rows'])} |")
        skipped = {(impl, why) for r in gemm for impl, why in (r.get("skipped") or {}).items()}
        if skipped:
            lines += ["", "Implementations not timed on some rows:"]
            lines += [f"- {impl}: {why}" for impl, why in sorted(skipped)]
        wrong = [(r["case"], x["instance"], x.get("error")) for r in gemm for x in r["rows"] if not x["ok"]]
        if wrong:
            lines += ["", "Candidates that failed (excluded from best):"]
            lines += [f"- {case}: `{inst}`: {err}" for case, inst, err in wrong]
    conv = [r for r in results if r.get("kind") == "conv"]
    if conv:
        lines += ["", "| set | conv (N x C x H x W -> K x OH x OW) | x | torch cuDNN | ORT cuDNN | ours | "
                  "cuDNN (torch) / ours | cuDNN (ORT) / ours | torch err |", "|---|---|---|---|---|---|---|---|---|"]
        for r in conv:
            if r.get("error") or r.get("skipped_reason"):
                lines.append(f"| {r['set']} | {r['case']} | {r.get('count', 1)} | "
                             f"{r.get('error') or 'skipped: ' + r['skipped_reason']} |" + " |" * 5)
                continue
            b = r["baselines"]
            ort_b = b.get("ORT cuDNN") or {}
            tb = b.get("torch cuDNN") or {}
            ours = r.get("ours") or {}
            err = f"{tb['rel_err']:.1e}" if isinstance(tb.get("rel_err"), float) else "-"
            lines.append(f"| {r['set']} | {r['case']} | {r['count']} | {_base_cell(tb)} | "
                         f"{'skip' if ort_b.get('skipped') else _base_cell(ort_b)} | "
                         f"{'skip' if ours.get('skipped') else _us(ours.get('us'))} | "
                         f"{_x(r['ratios'].get('ours_vs_cudnn_torch'))} | {_x(r['ratios']['ours_vs_cudnn_ort'])} | "
                         f"{err} |")
        why = {(r.get("ours") or {}).get("skipped") for r in conv} - {None}
        why_ort = {((r.get("baselines") or {}).get("ORT cuDNN") or {}).get("skipped") for r in conv} - {None}
        lines += [""] + [f"- ours skipped: {w}" for w in sorted(why)] + [f"- ORT skipped: {w}" for w in sorted(why_ort)]
        wrong = [(r["case"], x["instance"], x.get("error")) for r in conv for x in r.get("rows", []) if not x["ok"]]
        lines += [f"- {case}: `{inst}` failed (excluded from ours): {err}" for case, inst, err in wrong]
    other = [r for r in results if r.get("kind") not in ("gemm", "conv")]
    if other:
        lines += ["", "| set | case | x | ours: best config | ours µs (default / best) | baseline µs | ratio vs each | "
                  "configs ok |", "|---|---|---|---|---|---|---|---|"]
        for r in other:
            if r.get("error") or r.get("skipped_reason"):
                lines.append(f"| {r['set']} | {r['case']} | {r.get('count', 1)} | "
                             f"{r.get('error') or 'skipped: ' + r['skipped_reason']} |" + " |" * 5)
                continue
            best = (r.get("best") or {}).get("mma")
            default = r["rows"][0]["us"] if r["rows"] else None
            base = ", ".join(f"{k} {_us(v['us'])}" for k, v in r["baselines"].items())
            ratio = ", ".join(f"{k} {v['us'] / best[1]:.2f}x" for k, v in r["baselines"].items()) if best else "-"
            n_ok = sum(x["ok"] for x in r["rows"])
            lines.append(f"| {r['set']} | {r['case']} | {r['count']} | `{best[0] if best else '-'}` | "
                         f"{_us(default)} / {_us(best[1] if best else None)} | {base} | {ratio} | "
                         f"{n_ok}/{len(r['rows'])} |")
    lines += [""] + [f"- {n}" for n in notes or ()]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90", choices=("sm_80", "sm_90"),
                    help="the onnx-gtco target (sm_90 adds the CUTLASS sm_90a instances)")
    ap.add_argument("--set", default=",".join(SETS),
                    help=f"comma-separated shape sets (default all: {','.join(SETS)})")
    ap.add_argument("--out", default="kernel-bench")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="the first three GEMM rows only")
    ap.add_argument("--max-configs", type=int, default=None, metavar="K",
                    help="only the first K configurations of each implementation per row (default: all; CUTLASS at "
                         f"most {CUTLASS_CONFIGS})")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help=f"GEMM implementations to time (default {','.join(IMPLS)})")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile(mode='max-autotune')")
    ap.add_argument("--compile-budget-s", type=float, default=300.0,
                    help="seconds for the torch.compile max-autotune pass, which runs last (default 300)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no row after this many seconds; the rest are listed as skipped")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="nvcc processes at a time")
    ap.add_argument("--compile-only", action="store_true",
                    help="build the instances, launch nothing (no torch or GPU needed)")
    ap.add_argument("--list", action="store_true",
                    help="print every row and its candidates per implementation and exit (no GPU, no nvcc)")
    args = ap.parse_args(argv)
    if args.max_configs is not None and args.max_configs < 1:
        ap.error("--max-configs must be >= 1")
    args.sets = [s.strip() for s in args.set.split(",") if s.strip()]
    bad = [s for s in args.sets if s not in SETS]
    if bad or not args.sets:
        ap.error(f"--set {args.set!r}: choose from {','.join(SETS)}")
    args.impl_list = tuple(i.strip() for i in args.impls.split(",") if i.strip())
    if not args.impl_list or any(i not in IMPLS for i in args.impl_list):
        ap.error(f"--impls {args.impls!r}: choose from {','.join(IMPLS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    todo = cases(args.sets, args.quick)
    if args.list:
        print_listing(listing(todo, args.arch, args.max_configs, args.impl_list), args.arch)
        return 0
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    insts: dict[str, Instance] = {}
    for case in todo:
        for inst in case_instances(case, args.arch, args.max_configs, args.impl_list):
            insts[inst.name] = inst
    libs = build_all(insts, args.jobs)
    build_s = time.monotonic() - t_start
    failed = {k: v for k, v in libs.items() if isinstance(v, str)}
    print(f"built {len(libs) - len(failed)} of {len(libs)} instances in {build_s:.0f} s", flush=True)
    for name, why in failed.items():
        print(f"  {name}: {why.splitlines()[0] if why else ''}", flush=True)
    head = {"arch": args.arch, "sets": args.sets, "build_seconds": round(build_s, 1),
            "built": sorted(k for k, v in libs.items() if not isinstance(v, str)),
            "build_failed": failed, "cases": [c.label for c in todo]}
    if args.compile_only:
        (out / "results.json").write_text(json.dumps({"device": None, "compile_only": True, **head, "results": []},
                                                     indent=1))
        (out / "results.md").write_text(f"Compiled {len(libs) - len(failed)} of {len(libs)} instances for "
                                        f"{args.arch} in {build_s:.0f} s; none launched (--compile-only).\n")
        return 1 if failed else 0
    import torch

    torch.backends.cudnn.benchmark = True
    device = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    deadline = t_start + args.time_budget_s if args.time_budget_s else math.inf
    results: list[dict] = []
    notes: list[str] = []

    def save() -> None:
        (out / "results.json").write_text(json.dumps({"device": device, "compute_capability": cc,
                                                      "compile_only": False, **head, "notes": notes,
                                                      "results": results}, indent=1, default=str))
        (out / "results.md").write_text(markdown(results, device, notes))

    for case in todo:
        if time.monotonic() > deadline:
            results.append({"set": case.set, "case": case.label, "kind": case.kind, "count": case.count,
                            "rows": [], "all_ok": True, "skipped_reason": "--time-budget-s spent"})
            continue
        try:
            if case.kind == "gemm":
                r = run_gemm_case(case, args.arch, libs, args.reps, torch, args.max_configs, args.impl_list, cc)
            elif case.kind == "conv":
                r = run_conv_case(case, args.arch, libs, args.reps, torch, args.max_configs)
            else:
                r = run_family_case(case, args.arch, libs, args.reps, torch, args.max_configs)
        except Exception as e:  # one broken row must not hide the others' numbers
            print(f"{case.label}: {type(e).__name__}: {e}", flush=True)
            r = {"set": case.set, "case": case.label, "kind": case.kind, "count": case.count, "rows": [],
                 "all_ok": False, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        print(json.dumps({k: r.get(k) for k in ("case", "tuned", "separate", "ratios", "all_ok", "error")},
                         default=str), flush=True)
        save()
    # torch.compile max-autotune last: its compiles take the longest, and the other numbers are written already
    compile_deadline = min(deadline, time.monotonic() + args.compile_budget_s)
    for case, r in zip(todo, results, strict=True):
        if case.kind != "gemm" or r.get("error") or r.get("skipped_reason"):
            continue
        if args.no_compile:
            r["compile"] = {"skipped": "--no-compile"}
        elif time.monotonic() > compile_deadline:
            r["compile"] = {"skipped": "compile budget spent"}
        else:
            try:
                r["compile"] = compile_gemm(case, args.reps, torch)
            except Exception as e:  # inductor failing on one shape is that baseline's failure only
                r["compile"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        r["ratios"] = ratios(r)
        save()
    notes.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; "
                 f"{len(libs) - len(failed)} instances built in {build_s:.0f} s")
    save()
    print(markdown(results, device, notes))
    return 0 if all(r["all_ok"] for r in results) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
