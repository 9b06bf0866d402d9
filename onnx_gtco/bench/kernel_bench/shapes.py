"""The kernel bench's shape sets: the GEMM, attention, LayerNorm and conv problems of each model, one case each."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from onnx_gtco.families.attention.kernel import FAMILIES as ATTENTION_FAMILIES
from onnx_gtco.families.attention.kernel import make_problem
from onnx_gtco.families.conv.kernel import FAMILY as CONV
from onnx_gtco.families.conv.kernel import conv_problem
from onnx_gtco.families.gemm import cublaslt, cutlass
from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
from onnx_gtco.families.gemm.kernel import MAX_LN_N, gemm_problem
from onnx_gtco.families.layernorm.kernel import FAMILY as LAYERNORM
from onnx_gtco.kernels.family import (
    KernelFamily,
    Problem,
)
from onnx_gtco.tune.gpu import TOLERANCE

ATTN = {f.name: f for f in ATTENTION_FAMILIES}
TOL = TOLERANCE
IMPLS = ("mma", cutlass.IMPL, cublaslt.IMPL)
SETS = ("vit-b16", "bert-base", "setr", "detr")
CUTLASS_CONFIGS = 3
"""CUTLASS configurations per GEMM row (the first of families.gemm.cutlass.configs; about a minute of nvcc each)."""


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


def conv_of(c: ConvShape) -> Problem:
    """The conv kernel family's Problem of a bench conv: fp16, its bias, activation and residual fused."""
    return conv_problem("f16", c.n, c.cin, c.h, c.w, c.cout, c.k, c.k, stride=(c.stride, c.stride),
                        pads=(c.pad,) * 4, bias=True, activation=c.act, residual=c.residual)
