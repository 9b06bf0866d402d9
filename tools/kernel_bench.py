"""Run the generated kernels on a real GPU: check them against fp64 references and time them beside cuBLAS / torch.

    python tools/kernel_bench.py [--arch sm_90] [--out DIR] [--reps 50] [--quick] [--max-configs K] [--compile-only]

For each shape (ViT-B/16, SETR-style ViT-L at 577 tokens, DETR's encoder) and kernel family, every configuration the
family offers is compiled with nvcc into a shared library, called through its C entry point on CUDA tensors, checked
against the family's fp64 reference (‖err‖/‖ref‖, NaN never), and timed with CUDA events: median of `reps` runs after
a warm-up. Baselines on the same inputs in the same process: cuBLAS through torch (matmul / addmm, plus the
unfused epilogue), torch SDPA (flash / memory-efficient backends), torch softmax and layer_norm. Writes results.json
and a Markdown table (results.md) into --out. Needs torch with CUDA and nvcc; no ONNX Runtime. `--compile-only` builds
the instances and launches nothing (no torch, no GPU: how `tools/gpu_suite --dry-run` exercises this step).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onnx_gtco.kernels.attention import FAMILIES as ATTENTION_FAMILIES  # noqa: E402
from onnx_gtco.kernels.attention import make_problem  # noqa: E402
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
from onnx_gtco.kernels.gemm import gemm_problem  # noqa: E402
from onnx_gtco.kernels.layernorm import FAMILY as LAYERNORM  # noqa: E402

ATTN = {f.name: f for f in ATTENTION_FAMILIES}
TOL = {"f16": 2e-3, "bf16": 8e-3}


def cases(quick: bool) -> list[tuple[str, KernelFamily, Problem]]:
    """(label, family, problem): the projection GEMMs and attention of ViT-B/16 (batch 32), SETR (ViT-L, 577
    tokens, batch 8) and DETR's encoder (d=256, 8 heads, 1050 tokens, batch 4), and ViT-B's LayerNorm."""
    vit_m, setr_m = 32 * 197, 8 * 577
    out = [
        ("vit-b qkv  6304x2304x768 +bias", GEMM, gemm_problem("f16", 1, vit_m, 2304, 768, bias=True)),
        ("vit-b fc1  6304x3072x768 +bias+gelu", GEMM,
         gemm_problem("f16", 1, vit_m, 3072, 768, bias=True, activation="gelu_erf")),
        ("vit-b fc2  6304x768x3072 +bias+res", GEMM,
         gemm_problem("f16", 1, vit_m, 768, 3072, bias=True, residual=True)),
        ("setr fc1   4616x4096x1024 +bias+gelu", GEMM,
         gemm_problem("f16", 1, setr_m, 4096, 1024, bias=True, activation="gelu_erf")),
        ("detr ffn1  4200x2048x256 +bias+relu", GEMM,
         gemm_problem("f16", 1, 4 * 1050, 2048, 256, bias=True, activation="relu")),
    ]
    for fam in ("attention", "bmm_softmax"):
        out += [
            (f"vit-b {fam} B32 H12 S197 D64", ATTN[fam],
             make_problem(fam, "f16", batch=32, heads=12, seq_q=197, head_dim=64, q_layout="bhsd", k_layout="bhsd",
                          **({"v_layout": "bhsd", "out_layout": "bhsd"} if fam == "attention" else {}))),
            (f"setr {fam} B8 H16 S577 D64", ATTN[fam],
             make_problem(fam, "f16", batch=8, heads=16, seq_q=577, head_dim=64, q_layout="bhsd", k_layout="bhsd",
                          **({"v_layout": "bhsd", "out_layout": "bhsd"} if fam == "attention" else {}))),
            (f"detr {fam} B4 H8 S1050 D32 +mask", ATTN[fam],
             make_problem(fam, "f16", batch=4, heads=8, seq_q=1050, head_dim=32, mask=True, q_layout="bhsd",
                          k_layout="bhsd",
                          **({"v_layout": "bhsd", "out_layout": "bhsd"} if fam == "attention" else {}))),
        ]
    out.append(("vit-b layernorm+res 6304x768", LAYERNORM, _ln_problem(vit_m)))
    return out[:3] if quick else out


def _ln_problem(rows: int) -> Problem:
    return Problem.make("layernorm", "f16", {"hidden": 768, "rows": rows},
                        {"residual": True, "residual_out": True, "gamma": True, "beta": True, "epsilon": 1e-6})


def build(inst: Instance, out_dir: Path) -> Path:
    """nvcc the instance into a shared library (dynamic cudart: the GPU machine has it)."""
    src = out_dir / f"{inst.name}.cu"
    lib = out_dir / f"lib{inst.name}.so"
    src.write_text(inst.source)
    cmd = [os.environ.get("NVCC", "nvcc"), f"-arch={inst.arch}", "-std=c++17", "-O3", "-shared", "-Xcompiler",
           "-fPIC", f"-I{ROOT / 'plugins' / 'include'}", str(src), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{inst.name}: nvcc failed:\n{proc.stderr[-3000:]}")
    return lib


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
    """Storage array (float16, or uint16 for bf16) -> CUDA tensor of the kernel dtype."""
    if dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def to_numpy(t, dtype: str, torch) -> np.ndarray:
    """CUDA tensor -> storage array (float16, or uint16 for bf16)."""
    if dtype == "bf16":
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


def baselines(label: str, fam: KernelFamily, p: Problem, dev: dict, torch) -> dict[str, Callable[[], object]]:
    """Same-inputs torch baselines for one case."""
    F = torch.nn.functional
    if fam is GEMM:
        a, b = dev["a"].reshape(-1, dev["a"].shape[-1]), dev["b"]
        bias = dev.get("bias")
        act = p.flag("activation", "none")
        res = dev.get("residual")

        def unfused():
            y = torch.addmm(bias, a, b) if bias is not None else a @ b
            if act == "gelu_erf":
                y = F.gelu(y)
            elif act == "relu":
                y = F.relu(y)
            if res is not None:
                y = y + res.reshape(y.shape)
            return y
        return {"cuBLAS matmul": lambda: a @ b, "torch unfused": unfused}
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
    x, r = dev["x"], dev["residual"]
    g, bt = dev["gamma"], dev["beta"]
    return {"torch add+layer_norm": lambda: F.layer_norm(x + r, (x.shape[-1],), g, bt, 1e-6)}


def run_case(label: str, fam: KernelFamily, p: Problem, arch: str, libs: dict[str, Path], reps: int, torch,
             max_configs: int | None = None) -> dict:
    inputs = fam.random_inputs(p, seed=5)
    dev = {k: to_torch(v, p.dtype, torch) for k, v in inputs.items()}
    outs = {name: torch.full(shape, float("nan"), dtype=torch.float16 if dt == "f16" else torch.bfloat16,
                             device="cuda") for name, (shape, dt) in fam.outputs(p).items()}
    arrays = dict(inputs) | {k: np.empty(tuple(v.shape), np.float16) for k, v in outs.items()}
    ref = fam.reference(p, inputs)
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for cfg in fam.configs(p, arch)[:max_configs]:
        inst = fam.instantiate(p, cfg, arch)
        fields = fam.args_fields(p, arrays)
        def address(name: str) -> int | None:
            t = outs.get(name) if name in outs else dev.get(name)
            return t.data_ptr() if t is not None else None

        args = c_args(fields, address)
        fn = entry_point(str(libs[inst.name]), inst.symbol, args)
        for t in outs.values():
            t.fill_(float("nan"))
        code = fn(ctypes.byref(args), stream)
        torch.cuda.synchronize()
        errs = {}
        for name, t in outs.items():
            got = from_storage(to_numpy(t, p.dtype, torch), p.dtype)
            errs[name] = (rel_error(got, ref[name]), int(np.isnan(got).sum()))
        ok = code == 0 and all(e < TOL[p.dtype] and n == 0 for e, n in errs.values())
        us = _median_us(lambda fn=fn, args=args: fn(ctypes.byref(args), stream), reps, torch) if ok else None
        rows.append({"instance": inst.name, "config": dict(inst.config), "code": code, "ok": ok,
                     "rel_err": {k: e for k, (e, _) in errs.items()}, "nan": {k: n for k, (_, n) in errs.items()},
                     "us": us})
    base = {name: _median_us(fn, reps, torch) for name, fn in baselines(label, fam, p, dev, torch).items()}
    good = [r for r in rows if r["ok"]]
    best = min(good, key=lambda r: r["us"]) if good else None
    return {"case": label, "family": fam.name, "rows": rows, "baselines_us": base,
            "best": best["instance"] if best else None, "best_us": best["us"] if best else None,
            "default_us": rows[0]["us"] if rows else None, "all_ok": all(r["ok"] for r in rows)}


def markdown(results: list[dict], device: str) -> str:
    lines = [f"Device: {device}. Times are medians of CUDA-event timings (µs); ratio = baseline / ours (> 1: ours "
             "faster).", "",
             "| case | ours: best config | ours µs (default / best) | baseline µs | ratio vs each | configs ok |",
             "|---|---|---|---|---|---|"]
    for r in results:
        base = ", ".join(f"{k} {v:.1f}" for k, v in r["baselines_us"].items())
        ratio = ", ".join(f"{k} {v / r['best_us']:.2f}x" for k, v in r["baselines_us"].items()) if r["best_us"] else "-"
        n_ok = sum(x["ok"] for x in r["rows"])
        d = f"{r['default_us']:.1f}" if r["default_us"] else "-"
        b = f"{r['best_us']:.1f}" if r["best_us"] else "-"
        lines.append(f"| {r['case']} | `{r['best']}` | {d} / {b} | {base} | {ratio} | {n_ok}/{len(r['rows'])} |")
    return "\n".join(lines) + "\n"


def instances(todo: list[tuple[str, KernelFamily, Problem]], arch: str, max_configs: int | None
              ) -> dict[str, Instance]:
    """Every instance the cases need, by name: each case's offered configurations (its first `max_configs`)."""
    out: dict[str, Instance] = {}
    for _, fam, p in todo:
        for cfg in fam.configs(p, arch)[:max_configs]:
            i = fam.instantiate(p, cfg, arch)
            out[i.name] = i
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="kernel-bench")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="the first three cases only")
    ap.add_argument("--max-configs", type=int, default=None, metavar="K",
                    help="only the first K configurations of each case (default: all)")
    ap.add_argument("--compile-only", action="store_true",
                    help="build the instances, launch nothing (no torch or GPU needed)")
    args = ap.parse_args(argv)
    if args.max_configs is not None and args.max_configs < 1:
        ap.error("--max-configs must be >= 1")

    out = Path(args.out)
    (out / "build").mkdir(parents=True, exist_ok=True)
    todo = cases(args.quick)
    insts = instances(todo, args.arch, args.max_configs)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        libs = dict(zip(insts, pool.map(lambda i: build(i, out / "build"), insts.values()), strict=True))
    build_s = time.monotonic() - t0
    print(f"built {len(libs)} instances in {build_s:.0f} s", flush=True)
    if args.compile_only:
        (out / "results.json").write_text(json.dumps(
            {"device": None, "arch": args.arch, "compile_only": True, "build_seconds": round(build_s, 1),
             "built": sorted(libs), "cases": [label for label, _, _ in todo], "results": []}, indent=1))
        (out / "results.md").write_text(f"Compiled {len(libs)} instances for {args.arch} in {build_s:.0f} s; "
                                        "none launched (--compile-only).\n")
        return 0
    import torch

    results = []
    device = torch.cuda.get_device_name()
    for label, fam, p in todo:
        try:
            r = run_case(label, fam, p, args.arch, libs, args.reps, torch, args.max_configs)
        except Exception as e:  # one broken case must not hide the others' numbers
            print(f"{label}: {type(e).__name__}: {e}", flush=True)
            r = {"case": label, "family": fam.name, "rows": [], "baselines_us": {}, "best": None, "best_us": None,
                 "default_us": None, "all_ok": False, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        print(json.dumps({k: r[k] for k in ("case", "best", "best_us", "default_us", "baselines_us", "all_ok")}),
              flush=True)
        (out / "results.json").write_text(json.dumps({"device": device, "arch": args.arch, "compile_only": False,
                                                      "build_seconds": round(build_s, 1), "results": results},
                                                     indent=1))
        (out / "results.md").write_text(markdown(results, device))
    print(markdown(results, device))
    return 0 if all(r["all_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
