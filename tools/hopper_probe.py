#!/usr/bin/env python3
"""Times Hopper's library paths beside their fp16 counterparts at the core models' shapes, with torch on the GPU:

- FP8 GEMMs: torch._scaled_mm (cuBLASLt; E4M3 A and B, per-tensor scales, fp32 accumulation, fp16 out with the
  bias in its epilogue) against fp16 torch.matmul plus the bias (cuBLAS), for the projections of ViT-B/16 at batch
  1 and 64 and BERT-base at 128 tokens; rows of M padded to a multiple of 16 (what _scaled_mm takes);
- fused attention: torch's scaled_dot_product_attention with its cuDNN backend against its flash and
  memory-efficient backends, at the same models' heads (BERT's with an additive key-padding mask).

These are the measurements the fitted estimate needs before it chooses between our fp16 kernels and FP8 GEMMs or
cuDNN's attention (onnx_gtco.fp8 writes the FP8 GEMM nodes; no device kernel of ours takes them yet). A case a
library refuses is a row with its reason, never a stop.

    tools/hopper_probe.py --out DIR [--budget-s S] [--reps N]

Writes DIR/results.json and DIR/results.md (the table the GPU suite's benchmarks.md includes). Exit status 0 when
the probe ran (cases may have been refused), 2 without a CUDA GPU or torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

E4M3_MAX = 448.0
GEMMS: tuple[tuple[str, int, int, int], ...] = tuple(
    (f"{model} {what}", m, k, n)
    for model, m in (("vit-b16 b1", 197), ("vit-b16 b64", 64 * 197), ("bert-base b1", 128))
    for what, k, n in (("qkv", 768, 2304), ("proj", 768, 768), ("fc1", 768, 3072), ("fc2", 3072, 768)))
"""(case, M, K, N) of each core model's projections: packed QKV, the attention's output, the MLP's two."""
ATTENTIONS: tuple[tuple[str, int, int, int, int, bool], ...] = (
    ("vit-b16 b1", 1, 12, 197, 64, False), ("vit-b16 b64", 64, 12, 197, 64, False),
    ("bert-base b1", 1, 12, 128, 64, True))
"""(case, batch, heads, tokens, head dim, key-padding mask) of each core model's attention."""


@dataclass
class Case:
    """One timed case: the library path and its fp16 counterpart, median microseconds per call (None: refused)."""

    kind: str
    case: str
    shape: str
    times_us: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    rel_error: float | None = None  # an FP8 GEMM's ||y8 - y16|| / ||y16||

    def ratio(self, num: str, den: str) -> float | None:
        a, b = self.times_us.get(num), self.times_us.get(den)
        return a / b if a and b else None


def time_us(fn: Callable[[], object], reps: int, sync: Callable[[], None], clock: Callable[[], float]) -> float:
    """Median microseconds per call of `fn` over 5 groups of `reps` calls after 10 warm-up calls, each group timed
    from `sync` to `sync` (`clock`: seconds)."""
    for _ in range(10):
        fn()
    sync()
    groups = []
    for _ in range(5):
        t0 = clock()
        for _ in range(reps):
            fn()
        sync()
        groups.append((clock() - t0) / reps * 1e6)
    return statistics.median(groups)


def _gemm_case(torch, name: str, m: int, k: int, n: int, reps: int) -> Case:
    case = Case("gemm", name, f"M={m} K={k} N={n}")
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = -(-m // 16) * 16
    a = torch.randn(rows, k, device=dev, generator=gen, dtype=torch.float16)
    w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.float16) / k ** 0.5
    bias = torch.randn(n, device=dev, generator=gen, dtype=torch.float16)
    sync, clock = torch.cuda.synchronize, time.perf_counter
    case.times_us["fp16"] = time_us(lambda: torch.addmm(bias, a, w.t()), reps, sync, clock)
    try:
        sa = (a.abs().max().float() / E4M3_MAX).reshape(())
        sb = (w.abs().max().float() / E4M3_MAX).reshape(())
        a8 = (a.float() / sa).to(torch.float8_e4m3fn)
        w8 = (w.float() / sb).to(torch.float8_e4m3fn)

        def fp8() -> object:
            return torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float16)

        got = fp8()
        got = got[0] if isinstance(got, tuple) else got
        ref = torch.addmm(bias, a, w.t()).float()
        case.rel_error = float((got.float() - ref).norm() / ref.norm())
        case.times_us["fp8"] = time_us(fp8, reps, sync, clock)
    except Exception as e:  # a library refusing the case: its reason, one line
        case.times_us["fp8"] = None
        case.errors["fp8"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return case


def _attention_case(torch, name: str, b: int, h: int, s: int, d: int, masked: bool, reps: int) -> Case:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    case = Case("attention", name, f"B={b} H={h} S={s} D={d}" + (" mask" if masked else ""))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.float16) for _ in range(3))
    mask = None
    if masked:
        keep = torch.arange(s, device="cuda")[None, :] < torch.tensor([s * 3 // 4], device="cuda")[:, None]
        mask = torch.zeros(b, 1, 1, s, device="cuda", dtype=torch.float16).masked_fill(~keep[:, None, None, :],
                                                                                       float("-inf"))
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend) -> object:
            with sdpa_kernel(backend):
                return sdpa(q, k, v, attn_mask=mask)
        try:
            case.times_us[label] = time_us(run, reps, torch.cuda.synchronize, time.perf_counter)
        except Exception as e:  # this backend refuses the case (the flash backend takes no mask)
            case.times_us[label] = None
            case.errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return case


def markdown(cases: Sequence[Case], device: str) -> str:
    """The results as two tables, GEMMs then attention, each case's times and ratio, refusals with their reason."""
    def us(v: float | None) -> str:
        return f"{v:.1f}" if isinstance(v, (int, float)) else "-"

    def ratio(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "-"

    out = [f"Library paths on {device} (tools/hopper_probe.py; median µs per call, torch's launch overhead "
           "included):", "", "| GEMM | shape | fp16 cuBLAS µs | FP8 cuBLASLt µs | FP8 / fp16 | FP8 rel. error |",
           "|---|---|---:|---:|---:|---:|"]
    for c in (c for c in cases if c.kind == "gemm"):
        err = c.rel_error
        out.append(f"| {c.case} | {c.shape} | {us(c.times_us.get('fp16'))} | {us(c.times_us.get('fp8'))} | "
                   f"{ratio(c.ratio('fp8', 'fp16'))} | {f'{err:.3g}' if err is not None else '-'} |")
    out += ["", "| attention | shape | cuDNN µs | flash µs | efficient µs | cuDNN / best other |",
            "|---|---|---:|---:|---:|---:|"]
    for c in (c for c in cases if c.kind == "attention"):
        others = [t for k, t in c.times_us.items() if k != "cudnn" and t]
        best = min(others) if others else None
        cu = c.times_us.get("cudnn")
        out.append(f"| {c.case} | {c.shape} | {us(cu)} | {us(c.times_us.get('flash'))} | "
                   f"{us(c.times_us.get('efficient'))} | {ratio(cu / best if cu and best else None)} |")
    refused = [f"- {c.case} ({c.kind}) {k}: {why}" for c in cases for k, why in c.errors.items()]
    return "\n".join(out + (["", "Refused:", *refused] if refused else [])) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="tools/hopper_probe.py")
    ap.add_argument("--out", required=True, type=Path, help="folder for results.json and results.md")
    ap.add_argument("--budget-s", type=float, default=120.0, help="no case starts after this many seconds "
                    "(default 120)")
    ap.add_argument("--reps", type=int, default=20, help="calls per timed group (default 20)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("hopper_probe: torch is not importable", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("hopper_probe: no CUDA GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    t0 = time.monotonic()
    cases: list[Case] = []
    jobs: list[Callable[[], Case]] = [
        *(lambda g=g: _gemm_case(torch, *g, args.reps) for g in GEMMS),
        *(lambda a=a: _attention_case(torch, *a, args.reps) for a in ATTENTIONS)]
    skipped = 0
    for job in jobs:
        if time.monotonic() - t0 > args.budget_s:
            skipped += 1
            continue
        cases.append(job())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "skipped_for_time": skipped,
         "cases": [asdict(c) for c in cases]}, indent=1))
    (args.out / "results.md").write_text(markdown(cases, device) + (
        f"\n{skipped} cases not run: past the budget of {args.budget_s:g} s.\n" if skipped else ""))
    print(markdown(cases, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
