"""Command line: optimize | inspect | check | bench | demo | tune-worker. Builds the GtcoConfig; maps GtcoError to one
line and exit 2."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnx_gtco.config import PRECISIONS, TARGETS, GtcoConfig
from onnx_gtco.errors import GtcoError, missing_package
from onnx_gtco.progress import NORMAL, QUIET, VERBOSE, verbosity

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


def _config(args: argparse.Namespace) -> GtcoConfig:
    return GtcoConfig.from_env(target=args.target, precision=args.precision, seed=getattr(args, "seed", None),
                               dynamic=_dynamic(getattr(args, "dynamic", None)))


def _dynamic(text: str | None) -> tuple | None:
    """--dynamic seq=1:512,batch=1:64 as GtcoConfig.dynamic; a malformed one is a GtcoError naming it."""
    from onnx_gtco.config import parse_dynamic

    if text is None:
        return None
    try:
        return parse_dynamic(text)
    except GtcoError as e:
        raise GtcoError(f"--dynamic {text!r}: {e}") from None


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=sorted(TARGETS), default=None, help="GPU target (default sm_90)")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="compute precision of fused groups")


def _add_dynamic_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dynamic", default=None, metavar="DIM=LO:HI,...",
                   help="ranges of the model's symbolic dims, e.g. seq=1:512,batch=1:64 (default: the model's "
                   "gtco.dynamic metadata, else 1:512); with --tune-trials, tunes shape-generic micro-kernels")


def cmd_tune_worker(args: argparse.Namespace) -> int:
    from onnx_gtco.tune.apply import pick_measurer
    from onnx_gtco.tune.worker import work

    def line(task: Any, record: Any) -> None:
        print(f"trial {record.number:>4}  {task.describe()}  {record.value}", file=sys.stderr)

    ran = work(args.storage, pick_measurer(), keys=set(args.task) if args.task else None,
               patience=args.patience, progress=line)
    print(f"tune-worker: {ran} trials")
    return EXIT_OK


def cmd_optimize(args: argparse.Namespace) -> int:
    from onnx_gtco import report
    from onnx_gtco.kernels.toolchain import BuildError
    from onnx_gtco.pipeline import optimize_file

    try:
        result, out, rep = optimize_file(args.model, args.output, args.report, _config(args), build=args.build,
                                         tune_trials=args.tune_trials, storage=args.storage, workers=args.workers)
    except BuildError as e:
        raise GtcoError(f"building the custom-op library failed: {e} (pass --no-build to write the model without "
                        "its library; it then runs its model-local functions)") from None
    for w in result.warnings:
        print(f"onnx-gtco: warning: {w}", file=sys.stderr)
    print(report.summary(result.report))
    print(f"wrote      {out}\nreport     {rep}")
    if result.library is not None:
        print(f"built      {result.library.path} ({result.library.how()})")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from onnx_gtco import report
    from onnx_gtco.pipeline import optimize

    result = optimize(args.model, _config(args))
    if args.json:
        sys.stdout.write(report.to_json(result.report))
        return EXIT_OK
    print(report.summary(result.report))
    print(f"\n{'group':<58} {'family':<12} {'nodes':>5} {'predicted us':>12} {'unfused us':>10}")
    for g in result.report["groups"]:
        print(f"{g['name'][:58]:<58} {g['family']:<12} {len(g['nodes']):>5} {g['predicted_us']:>12.2f} "
              f"{g['predicted_unfused_us']:>10.2f}")
    print("(times predicted by the analytical cost model, not measured)")
    for r in result.report["rejected"]:
        print(f"rejected  {r['pattern']:<12} at {r['anchor']}: {r['reason']}")
    return EXIT_OK


def _dims(items: Sequence[str]) -> dict[str, int]:
    out = {}
    for it in items:
        name, _, val = it.partition("=")
        if not name or not val.isdigit():
            raise GtcoError(f"--dim expects NAME=INT, got {it!r}")
        out[name] = int(val)
    return out


def cmd_check(args: argparse.Namespace) -> int:
    from onnx_gtco.runtime.check import compare, format_diffs

    diffs = compare(args.original, args.rewritten, args.provider, args.rtol, args.atol, args.samples, args.seed,
                    _dims(args.dim), library=args.library)
    if args.library:
        print("rewritten model run with its custom-op library registered (the plugin's kernels)")
    print(format_diffs(diffs))
    bad = [d.name for d in diffs if not d.ok]
    print(f"{len(diffs) - len(bad)} of {len(diffs)} outputs within rtol={args.rtol:g} atol={args.atol:g}")
    return EXIT_MISMATCH if bad else EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    import onnx

    from onnx_gtco import models, report
    from onnx_gtco.ir.export import save_atomic
    from onnx_gtco.pipeline import optimize_file
    from onnx_gtco.runtime.check import compare, format_diffs

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"{args.model}.onnx"
    print(f"building   built-in model {args.model} (seeded weights) -> {src}")
    save_atomic(models.build(args.model, seed=0), src)
    result, out, rep = optimize_file(src, None, None, _config(args), build="auto")
    for w in result.warnings:
        print(f"onnx-gtco: warning: {w}", file=sys.stderr)
    print(report.summary(result.report))
    print(f"wrote      {out}\nreport     {rep}\n")
    ok = True
    for library, what in ((False, "function fallback: no library"), (True, "the custom-op library's CPU kernels")):
        diffs = compare(src, out, "cpu", 1e-4, 1e-5, 1, 0, library=library)
        print(f"check: rewritten vs original on the CPU EP ({what}, seeded random inputs)")
        print(format_diffs(diffs) + "\n")
        ok = ok and all(d.ok for d in diffs)
    print("demo " + ("passed" if ok else "FAILED") + f": {len(onnx.load(str(out)).functions)} local functions "
          "keep the model runnable on any ONNX Runtime without the plugin")
    return EXIT_OK if ok else EXIT_MISMATCH


def cmd_bench(args: argparse.Namespace) -> int:
    import dataclasses

    from onnx_gtco.bench import BenchOptions, format_table, run_bench, write_outputs

    out_dir = Path(args.out)
    opts = BenchOptions(model=args.model, rewritten=args.rewritten, torch_program=args.torch_program,
                        provider=args.provider,
                        batches=tuple(args.batch), precision=args.precision, target=args.target,
                        baselines=tuple(n for a in args.baselines for n in a.split(",") if n) if args.baselines
                        else BenchOptions.baselines,
                        runs=args.runs, warmup=args.warmup, quick=args.quick, model_type=args.model_type,
                        dims=_dims(args.dim), seed=args.seed, remeasure_peaks=args.remeasure_peaks, out=str(out_dir))
    opts = dataclasses.replace(opts, command=opts.as_command())
    opts.validate()
    doc = run_bench(opts)
    table = format_table(doc)
    print(table)
    for path in write_outputs(doc, table, out_dir):
        print(f"wrote      {path}")
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    from onnx_gtco.pipeline import __version__

    ap = argparse.ArgumentParser(prog="onnx-gtco", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--version", action="version", version=f"onnx-gtco {__version__}")
    ap.add_argument("--debug", action="store_true", help="print tracebacks on errors")
    _add_verbosity(ap, top=True)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("optimize", help="fuse a model; writes MODEL.gtco.onnx and its report")
    p.add_argument("model")
    p.add_argument("-o", "--output", default=None, help="output model (default MODEL.gtco.onnx)")
    p.add_argument("--report", default=None, help="report path (default OUTPUT.report.json)")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--no-build", dest="build", action="store_const", const=None, default="auto",
                   help="do not build the custom-op library (the model then runs its model-local functions)")
    b.add_argument("--cuda", dest="build", action="store_const", const="cuda",
                   help="require the CUDA objects in the library (error when nvcc is missing); by default they "
                   "are built when nvcc is found, with a warning otherwise")
    b.add_argument("--cpu", dest="build", action="store_const", const="cpu",
                   help="build the library with the CPU kernels only, even when nvcc is found")
    p.add_argument("--tune-trials", type=int, default=0, metavar="N",
                   help="tune each kernel task up to N finished trials in the tuning storage (a task that has N "
                   "already is not measured again); without a GPU measurer the analytical model measures")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage of the tuning records (default $GTCO_TUNE_STORAGE, else SQLite in the user "
                   "cache); any Optuna RDB URL, e.g. postgresql://user@host/db; browse it with optuna-dashboard URL")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="tune with K processes sharing the storage (K - 1 tune-worker processes beside this one)")
    _add_dynamic_arg(p)
    _add_plan_args(p)
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser("tune-worker", help="run tuning trials of a shared storage's open studies until none is open")
    p.add_argument("--storage", required=True, metavar="URL", help="the Optuna storage the studies are in")
    p.add_argument("--patience", type=int, default=20, help="early stop a task after this many trials without gain")
    p.add_argument("--task", action="append", default=None, metavar="KEY", help="only this task (repeatable)")
    p.set_defaults(func=cmd_tune_worker)

    p = sub.add_parser("inspect", help="print the fusion plan without writing anything")
    p.add_argument("model")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    _add_dynamic_arg(p)
    _add_plan_args(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("check", help="compare a rewritten model with its original on seeded random inputs")
    p.add_argument("original")
    p.add_argument("rewritten")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", action="append", default=[], metavar="NAME=INT", help="value of a symbolic dim")
    p.add_argument("--library", action="store_true",
                   help="register the rewritten model's custom-op library (metadata gtco.library), so its kernels "
                   "run instead of the model-local functions; default: the functions run")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("demo", help="build the built-in ViT-tiny, optimize it, check it, print the report")
    p.add_argument("--model", default="vit-tiny")
    p.add_argument("--out", default="gtco-demo", help="folder for the demo's files (default ./gtco-demo)")
    _add_plan_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="time the model's baselines and ours on the same inputs; table, JSON, PNG")
    p.add_argument("model", help="an .onnx file or a built-in model name (vit-tiny, bert-tiny, ...)")
    p.add_argument("--rewritten", default=None, metavar="R",
                   help="time this optimized model as ours (its library beside it); default: optimize MODEL")
    p.add_argument("--torch-program", default=None, metavar="PT2",
                   help="the model's torch.export program (torch.export.save), which the torch-compile baseline "
                   "compiles; it takes MODEL's inputs in order (default: convert MODEL with onnx2torch)")
    p.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[1], metavar="N",
                   help="batch sizes (a file model's symbolic batch dim is bound to each; default 1)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="what ours is optimized with (default fp16 on cuda, fp32 on cpu)")
    p.add_argument("--target", choices=sorted(TARGETS), default=None, help="GPU target ours is planned for")
    p.add_argument("--baselines", nargs="+", default=None, metavar="NAME",
                   help="among ort-fp32 ort-fp16 ort-transformers-fp16 torch-compile tensorrt, space or comma "
                   "separated (default: all)")
    p.add_argument("--runs", type=int, default=100, help="timed runs per variant (>= 100; default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before timing (default 10)")
    p.add_argument("--quick", action="store_true", help="allow --runs below 100 (smoke tests, not for reporting)")
    p.add_argument("--remeasure-peaks", action="store_true",
                   help="keep only this run's matmul and copy peaks (else the best of every run on this device)")
    p.add_argument("--model-type", default=None,
                   help="model type for ORT's transformer optimizer (default: bert for token ids, vit for images)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=INT", help="size of a symbolic input dim")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--out", default=".", help="folder for bench.json, bench.md and bench.png (default .)")
    p.set_defaults(func=cmd_bench)
    for p in sub.choices.values():  # also after the command: onnx-gtco optimize -v model.onnx
        _add_verbosity(p, top=False)
    return ap


def _add_verbosity(p: argparse.ArgumentParser, top: bool) -> None:
    """-q / -v: progress bars on a terminal by default; -q nothing; -v also one line per stage with its seconds.
    A command's own -q / -v leaves the top-level one alone unless given (default SUPPRESS)."""
    g = p.add_mutually_exclusive_group()
    default: dict[str, Any] = {"default": NORMAL} if top else {"default": argparse.SUPPRESS}
    g.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=QUIET, **default,
                   help="no progress on stderr (errors and warnings still are)")
    g.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=VERBOSE, **default,
                   help="one line per stage with its seconds on stderr, also when stderr is not a terminal")


def _quiet_onnxruntime() -> None:
    """ORT's graph optimizer warns about every node it cannot simplify while graph-surgeon folds constants with it;
    the command prints what matters itself. --debug keeps ORT's warnings."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.debug:
        _quiet_onnxruntime()
    try:
        try:
            with verbosity(args.verbosity):
                return int(args.func(args))
        except ModuleNotFoundError as e:  # an optional package a feature imports lazily: one line, never a traceback
            if args.debug or not e.name:
                raise
            raise missing_package(e.name, f"onnx-gtco {args.cmd}") from None
    except GtcoError as e:
        if args.debug:
            traceback.print_exc()
        print(f"onnx-gtco: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("onnx-gtco: interrupted", file=sys.stderr)
        return EXIT_ERROR
