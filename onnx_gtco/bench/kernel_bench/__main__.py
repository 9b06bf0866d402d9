"""python -m onnx_gtco.bench.kernel_bench: the command line (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from onnx_gtco.bench import kernel_bench
from onnx_gtco.bench.kernel_bench.candidates import build_all, case_instances, listing, print_listing
from onnx_gtco.bench.kernel_bench.conv import run_conv_case
from onnx_gtco.bench.kernel_bench.markdown import markdown
from onnx_gtco.bench.kernel_bench.measure import compile_gemm, ratios, run_family_case, run_gemm_case
from onnx_gtco.bench.kernel_bench.shapes import CUTLASS_CONFIGS, IMPLS, SETS, cases
from onnx_gtco.kernels.family import (
    Instance,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m onnx_gtco.bench.kernel_bench",
                                 description=kernel_bench.__doc__.splitlines()[0])
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
