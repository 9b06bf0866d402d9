"""Command line: optimize | inspect | report | check | bench | demo | tune-worker | tune-records. Builds the
GtcoConfig; maps GtcoError to one line and exit 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnx_gtco.config import PRECISIONS, TARGETS, GtcoConfig
from onnx_gtco.errors import GtcoError, missing_package
from onnx_gtco.progress import NORMAL, QUIET, VERBOSE, verbosity
from onnx_gtco.progress import level as progress_level

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2

DESCRIPTION = """\
Make transformer models run faster in ONNX Runtime on NVIDIA GPUs. onnx-gtco finds the groups of nodes worth fusing
(a dynamic-programming search over a cost model), writes a rewritten model with one node per fused group and builds
a custom-op library with a Tensor Core kernel for each. The rewritten model still runs anywhere: every fused node is
also a model-local function holding the original nodes."""

EPILOG = """\
examples:
  onnx-gtco demo                                     the built-in ViT-tiny, optimized and checked
  onnx-gtco optimize model.onnx                      model.gtco.onnx, its library and its report
  onnx-gtco check model.onnx model.gtco.onnx         compare the outputs on seeded inputs
  onnx-gtco bench model.onnx --rewritten model.gtco.onnx
  onnx-gtco report model.gtco.onnx.report.json       the report as Markdown

'onnx-gtco COMMAND --help' lists a command's options. Errors are one line and exit 2."""


def _config(args: argparse.Namespace) -> GtcoConfig:
    return GtcoConfig.from_env(target=args.target, precision=args.precision, seed=getattr(args, "seed", None),
                               dynamic=_dynamic(getattr(args, "dynamic", None)),
                               patchify=getattr(args, "patchify", None),
                               calibration_data=getattr(args, "calibration_data", None),
                               fp8_budget=getattr(args, "fp8_budget", None))


def _dynamic(text: str | None) -> tuple | None:
    """--dynamic seq=1:512,batch=1:64 as GtcoConfig.dynamic; a malformed one is a GtcoError naming it."""
    from onnx_gtco.config import parse_dynamic

    if text is None:
        return None
    try:
        return parse_dynamic(text)
    except GtcoError as e:
        raise GtcoError(f"--dynamic {text!r}: {e}") from None


def _say_target(args: argparse.Namespace) -> None:
    """After a command that planned for a target the user did not name: which one, and why (on stderr, so an error
    before it stays one line)."""
    from onnx_gtco.config import target_note

    note = target_note(getattr(args, "target", None))
    if note and progress_level() > QUIET:
        print(f"onnx-gtco: note: {note}", file=sys.stderr)


def _model_arg(spec: str) -> Any:
    """A model argument: a file's path, else a built-in model built with seeded weights (models.resolve)."""
    from onnx_gtco import models

    source = models.resolve(spec)
    return spec if isinstance(source, Path) else models.build(source, seed=0)


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=sorted(TARGETS), default=None,
                   help="the GPU to plan and build for: a GPU (h200, h100, a100: its data sheet and, where one ships, "
                   "its calibration, the constants fitted to its measured kernel times) or an arch (sm_90, sm_80: its "
                   "data-sheet GPU); default: the local GPU (nvidia-smi), else sm_90; $GTCO_TARGET")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="compute precision of fused groups, fp32 accumulation always; fp8: E4M3 operands for the "
                   "GEMMs of weights (with --calibration-data), fp16 elsewhere (default fp32; $GTCO_PRECISION)")
    p.add_argument("--calibration-data", default=None, metavar="PATH|MODULE:READER",
                   help="--precision fp8's calibration samples (required there): a folder of .npz files or one .npz "
                   "(as check --save-inputs writes them), or MODULE:NAME / FILE.py:NAME naming an onnxruntime "
                   "CalibrationDataReader, an iterable of feed dicts or a function returning one (default: none)")
    p.add_argument("--fp8-budget", type=float, default=None, metavar="ERR",
                   help="--precision fp8: a GEMM whose relative error on E4M3 operands over the calibration samples "
                   "exceeds this stays fp16 (default 0.1)")
    p.add_argument("--no-patchify", dest="patchify", action="store_false", default=None,
                   help="keep every conv a conv (by default a conv whose stride equals its kernel, a ViT's patch "
                   "embedding, runs as a patchify copy and a GEMM where the estimate predicts that faster)")


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


def cmd_tune_records(args: argparse.Namespace) -> int:
    from onnx_gtco.config import ARCH_GPUS as archs
    from onnx_gtco.tune import records

    if args.action == "merge":
        if not args.storage:
            raise GtcoError("tune-records merge: give the storage to merge from with --storage URL")
        if args.records_dir is not None and not Path(args.records_dir).is_dir():
            raise GtcoError(f"tune-records: --records-dir {args.records_dir}: no such folder")
        print("\n".join(records.merge(args.storage, args.records_dir).lines()))
        return EXIT_OK
    for arch in sorted(archs):
        recs = records.load(arch, args.records_dir)
        print(f"{records.path_for(arch, args.records_dir)}: {len(recs)} records")
        for r in sorted(recs.values(), key=lambda r: r.describe):
            config = " ".join(f"{k}={v}" for k, v in r.config.items())
            print(f"  {r.describe}: {r.median_us:.3f} us, {config} ({r.gpu}, {r.date})")
    return EXIT_OK


def cmd_calibration(args: argparse.Namespace) -> int:
    from onnx_gtco import calibration
    from onnx_gtco.tune import fit

    records = fit.load_records(args.records or None) if args.records or args.action != "show" else None
    if args.runs and records is not None:
        records = records.only(args.runs)
        if not records.kernels:
            raise GtcoError(f"calibration: no record of runs {', '.join(args.runs)}")
    target = args.target or (records.target if records is not None else None)
    if args.action == "show":
        hw = calibration.hardware(target or "h200")
        print(json.dumps(hw.describe(), indent=1))
        for group in fit.GROUPS:
            values = hw.constants(group)
            print(f"{group.GROUP}:")
            for f in calibration.fields_of(group):
                fitted = hw.calibration is not None and f.name in hw.calibration.constants.get(group.GROUP, {})
                print(f"  {f.name:<16} {getattr(values, f.name):>12.6g} {f.metadata['unit']:<28} "
                      f"{'fitted' if fitted else 'default'}")
        return EXIT_OK
    assert records is not None
    if args.action == "backtest":
        cal = calibration.load_calibration(target, args.calibration_dir) if target else None
        hw = calibration.Hardware(calibration.hardware(target).target, cal)
        kernels, models = fit.backtest(records, hw)
        print(f"{records.gpu}: {len(kernels)} kernel and {len(models)} model records against "
              f"{cal.path if cal else 'the estimate defaults (no calibration)'}")
        for r in (*kernels, *models):
            flag = "  proxy" if r.proxy else ""
            print(f"{r.ratio:7.3f}  {r.measured_us:10.1f} us measured  {r.predicted_us:10.1f} predicted  "
                  f"{r.what}{flag}")
        for kind, e in fit.errors(records, kernels, models).items():
            print(f"{kind:<7} {e['rows']} rows: furthest {e['worst_ratio']:.3f}x, rms log {e['rms_log']:.3f}")
        return EXIT_OK
    result = fit.fit(records, target, command=" ".join(["onnx-gtco", "calibration", *sys.argv[2:]]))
    out = Path(args.output) if args.output else calibration.calibration_path(result.calibration.target,
                                                                              args.calibration_dir or
                                                                              calibration.SHIPPED_DIR)
    fit.write_calibration(result.calibration, out)
    print(f"wrote {out}: {len(result.fitted)} constants fitted to {len(result.kernels)} kernel and "
          f"{len(result.models)} model records of {records.gpu}")
    for kind, e in result.calibration.fitted["error"].items():
        print(f"  {kind:<7} {e['rows']} rows: furthest {e['worst_ratio']:.3f}x, rms log {e['rms_log']:.3f}")
    if result.at_bound:
        print(f"  at a bound: {', '.join(result.at_bound)}")
    return EXIT_OK


def cmd_optimize(args: argparse.Namespace) -> int:
    from onnx_gtco import report
    from onnx_gtco.errors import BuildError
    from onnx_gtco.pipeline import optimize_file

    model = _model_arg(args.model)
    output = args.output or (None if isinstance(model, str) else f"{args.model}.gtco.onnx")
    try:
        result, out, rep = optimize_file(model, output, args.report, _config(args), build=args.build,
                                         tune_trials=args.tune_trials, storage=args.storage, workers=args.workers,
                                         markdown=True if args.report_md == "" else args.report_md or False,
                                         shipped_records=args.shipped_records)
    except BuildError as e:
        raise GtcoError(f"building the custom-op library failed: {e} (pass --no-build to write the model without "
                        "its library; it then runs its model-local functions)") from None
    for w in result.warnings:
        print(f"onnx-gtco: warning: {w}", file=sys.stderr)
    _say_target(args)
    print(report.summary(result.report))
    print(f"wrote      {out}\nreport     {rep}")
    if args.report_md is not None:
        print(f"markdown   {args.report_md or out.with_name(out.name + '.report.md')}")
    if result.library is not None:
        print(f"built      {result.library.path} ({result.library.how()})")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from onnx_gtco import report
    from onnx_gtco.pipeline import optimize

    result = optimize(_model_arg(args.model), _config(args))
    _say_target(args)
    if args.json:
        sys.stdout.write(report.to_json(result.report))
        return EXIT_OK
    print(report.summary(result.report))
    print(f"\n{'group':<58} {'family':<12} {'nodes':>5} {'predicted us':>12} {'unfused us':>10}  kernel")
    for g in result.report["groups"]:
        kernel = (g.get("kernel") or {}).get("instance", "(its function)" if g.get("device_reason") else "")
        print(f"{g['name'][:58]:<58} {g['family']:<12} {len(g['nodes']):>5} {g['predicted_us']:>12.2f} "
              f"{g['predicted_unfused_us']:>10.2f}  {kernel}")
    print(f"(times predicted by {report.estimate_words(result.report)}, per group with its launches' graph gaps; "
          "not measured)")
    for r in result.report["rejected"]:
        print(f"rejected  {r['pattern']:<12} at {r['anchor']}: {r['reason']}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from onnx_gtco import report_md
    from onnx_gtco.ir.export import writable_parent, write_bytes_atomic, write_text_atomic

    doc = report_md.load_report(args.report)
    for out in filter(None, (args.output, args.png)):  # before writing either
        writable_parent(out)
    text = report_md.render(doc)
    png = report_md.png_bytes(doc) if args.png else None  # both rendered before anything is written
    if not args.output:
        sys.stdout.write(text)
    else:
        write_text_atomic(text, args.output)
    if png is not None:
        try:
            write_bytes_atomic(png, args.png)
        except BaseException:
            if args.output:  # all or nothing: no Markdown without the chart asked for with it
                Path(args.output).unlink(missing_ok=True)
            raise
    wrote = [f"wrote      {p} ({what})" for what, p in (("markdown", args.output), ("chart", args.png)) if p]
    if wrote:
        print("\n".join(wrote), file=sys.stdout if args.output else sys.stderr)
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
    from onnx_gtco.runtime.check import compare, default_min_cosine, format_diffs, resolve_agreement, resolve_tolerances

    rewritten = _model_arg(args.rewritten)
    rtol, atol, source = resolve_tolerances(args.rtol, args.atol, rewritten)
    agreement, agreement_source = resolve_agreement(args.agreement, rewritten)
    min_cosine, cosine_source = args.min_cosine, "given"
    if min_cosine is None and args.rtol is None and args.atol is None:
        min_cosine, cosine_source = default_min_cosine(rewritten)
    if args.load_inputs is not None:
        unused = [flag for flag, v in (("--samples", args.samples), ("--seed", args.seed), ("--dim", args.dim))
                  if v is not None]
        if unused:
            raise GtcoError(f"--load-inputs gives the inputs, so {' and '.join(unused)} would be unused; drop "
                            f"{'it' if len(unused) == 1 else 'them'}")
    samples = 1 if args.samples is None else args.samples
    seed = 0 if args.seed is None else args.seed
    if samples < 1:
        raise GtcoError(f"--samples must be at least 1, got {samples}")
    if seed < 0:
        raise GtcoError(f"--seed must be >= 0, got {seed}")
    diffs = compare(_model_arg(args.original), rewritten, args.provider, rtol, atol, samples, seed,
                    _dims(args.dim or []), library=args.library, inputs=args.load_inputs, save_inputs=args.save_inputs,
                    agreement=agreement, min_cosine=min_cosine)
    if args.library:
        print("rewritten model run with its custom-op library registered (the plugin's kernels)")
    print(format_diffs(diffs))
    if args.save_inputs is not None:
        print(f"wrote      {args.save_inputs} (the inputs used)")
    bad = [d.name for d in diffs if not d.ok]
    within = f"{rtol.describe('rtol')} {atol.describe('atol')}"
    if min_cosine is not None:  # the cosine judges the float outputs
        within, source = f"cosine >= {min_cosine:g}", cosine_source
    if any(d.exact for d in diffs):  # integer outputs: the agreement they were judged by, and where it comes from
        same = agreement_source in (source, source.replace("defaults", "default", 1))
        within += f" {agreement.describe('agreement')}" if same else \
            f" ({source}), {agreement.describe('agreement')} for integer outputs"
        source = source if same else agreement_source
    print(f"{len(diffs) - len(bad)} of {len(diffs)} outputs within {within} ({source})")
    return EXIT_MISMATCH if bad else EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    import onnx

    from onnx_gtco import models, report
    from onnx_gtco.ir.export import save_atomic
    from onnx_gtco.pipeline import optimize_file
    from onnx_gtco.runtime.check import compare, format_diffs, resolve_agreement, resolve_tolerances

    if args.model not in models.BUILTIN:
        raise GtcoError(f"demo --model {args.model}: not a built-in model; choose one of {', '.join(models.BUILTIN)}")
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
    rtol, atol, source = resolve_tolerances(None, None, out)
    agreement, _ = resolve_agreement(None, out)
    for library, what in ((False, "function fallback: no library"), (True, "the custom-op library's CPU kernels")):
        diffs = compare(src, out, "cpu", rtol, atol, 1, 0, library=library, agreement=agreement)
        print(f"check: rewritten vs original on the CPU EP ({what}, seeded random inputs), "
              f"{rtol.describe('rtol')} {atol.describe('atol')} ({source})")
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
                        batches=tuple(args.batch) if args.batch else None, precision=args.precision, target=args.target,
                        baselines=tuple(n for a in args.baselines for n in a.split(",") if n) if args.baselines
                        else BenchOptions.baselines,
                        runs=args.runs, warmup=args.warmup, quick=args.quick, model_type=args.model_type,
                        ort_model=args.ort_model, num_heads=args.num_heads, hidden_size=args.hidden_size,
                        dims=_dims(args.dim), seed=args.seed, remeasure_peaks=args.remeasure_peaks,
                        profile=args.profile, out=str(out_dir))
    opts = dataclasses.replace(opts, command=opts.as_command())
    opts.validate()
    doc = run_bench(opts)
    _say_target(args)
    table = format_table(doc)
    print(table)
    for path in write_outputs(doc, table, out_dir):
        print(f"wrote      {path}")
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    from onnx_gtco.models import BUILTIN
    from onnx_gtco.pipeline import __version__

    model_help = "an .onnx file, or a built-in model's name: " + ", ".join(BUILTIN)
    ap = argparse.ArgumentParser(prog="onnx-gtco", description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"onnx-gtco {__version__}")
    ap.add_argument("--debug", action="store_true", help="print tracebacks on errors (default: one line)")
    _add_verbosity(ap, top=True)
    subs = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    commands = (
        ("optimize", "fuse a model; writes MODEL.gtco.onnx and its report", _optimize_args),
        ("tune-worker", "run tuning trials of a shared storage's open studies until none is open", _tune_worker_args),
        ("tune-records", "merge a tuning storage's measured trials into the tuning records, or list them",
         _tune_records_args),
        ("calibration", "fit the kernel-time estimate's constants to measured kernel records, check them, or show them",
         _calibration_args),
        ("inspect", "print the fusion plan without writing anything", _inspect_args),
        ("report", "render an optimize report (JSON) as Markdown, and a PNG of time per family", _report_args),
        ("check", "compare a rewritten model with its original on seeded random inputs", _check_args),
        ("demo", "build a built-in model (ViT-tiny by default), optimize it, check it, print the report", _demo_args),
        ("bench", "time the model's baselines and ours on the same inputs; table, JSON, PNG", _bench_args),
    )
    for name, summary, add_args in commands:
        add_args(subs.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + "."), model_help)
    for p in subs.choices.values():  # also after the command: onnx-gtco optimize -v model.onnx
        _add_verbosity(p, top=False)
    return ap


def _optimize_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("model", help=model_help)
    p.add_argument("-o", "--output", default=None,
                   help="output model (default MODEL.gtco.onnx beside MODEL; for a built-in name, in this folder)")
    p.add_argument("--report", default=None, help="report path (default OUTPUT.report.json)")
    p.add_argument("--report-md", nargs="?", const="", default=None, metavar="PATH",
                   help="also write the report as Markdown (default path OUTPUT.report.md; onnx-gtco report renders "
                   "a JSON report later)")
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
                   "already is not measured again); without a GPU measurer the analytical model measures "
                   "(default 0: no tuning)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage of the tuning records (default $GTCO_TUNE_STORAGE, else SQLite in the user "
                   "cache); any Optuna RDB URL, e.g. postgresql://user@host/db (browse it with optuna-dashboard "
                   "URL), or journal:PATH, a log file that processes on one machine share, with no SQL stack")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="tune with K processes sharing the storage (K - 1 tune-worker processes beside this one; "
                   "default 1)")
    p.add_argument("--no-shipped-records", dest="shipped_records", action="store_false",
                   help="ignore the tuning records shipped with onnx-gtco (measured configurations per kernel "
                   "problem, or those in $GTCO_TUNE_RECORDS_DIR); by default a task without a configuration a GPU "
                   "measured in the storage takes its record's")
    _add_dynamic_arg(p)
    _add_plan_args(p)
    p.set_defaults(func=cmd_optimize)


def _tune_worker_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("--storage", required=True, metavar="URL",
                   help="the Optuna storage the studies are in (an RDB URL or journal:PATH, as optimize takes it)")
    p.add_argument("--patience", type=int, default=20,
                   help="early stop a task after this many trials without gain (default 20)")
    p.add_argument("--task", action="append", default=None, metavar="KEY",
                   help="only this task (repeatable; default: every open task)")
    p.set_defaults(func=cmd_tune_worker)


def _tune_records_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("action", choices=["merge", "list"],
                   help="merge: add the storage's fastest GPU-measured configuration of each kernel problem to the "
                   "records files, keeping the faster record per arch and problem; list: print the records")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="the Optuna storage to merge from (an RDB URL or journal:PATH; required for merge; no "
                   "default)")
    p.add_argument("--records-dir", default=None, metavar="DIR",
                   help="the folder of the records files <arch>.json (default $GTCO_TUNE_RECORDS_DIR, else the "
                   "ones shipped in the package, onnx_gtco/tune/records)")
    p.set_defaults(func=cmd_tune_records)


def _calibration_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("action", choices=["fit", "backtest", "show"],
                   help="fit: least squares of the constants to the records, written as the target's calibration "
                   "file; backtest: every record's prediction against its measurement; show: a target's constants "
                   "and where each comes from")
    p.add_argument("records", nargs="*", metavar="RECORDS",
                   help="records files or folders of them (default: the shipped onnx_gtco/calibration/records)")
    p.add_argument("--target", choices=sorted(TARGETS), default=None,
                   help="the target the records calibrate (default: the records' own)")
    p.add_argument("--runs", nargs="+", default=None, metavar="RUN",
                   help="only the records of these runs (e.g. run1: fit on one run, backtest the other; default: every "
                   "run)")
    p.add_argument("-o", "--output", default=None,
                   help="fit: the calibration file to write (default <target>.json in --calibration-dir, else the "
                   "package's)")
    p.add_argument("--calibration-dir", default=None, metavar="DIR",
                   help="where fit writes and backtest reads <target>.json (default: $GTCO_CALIBRATION_DIR, else "
                   "the package's)")
    p.set_defaults(func=cmd_calibration)


def _inspect_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("model", help=model_help)
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    _add_dynamic_arg(p)
    _add_plan_args(p)
    p.set_defaults(func=cmd_inspect)


def _report_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("report", help="the JSON report optimize wrote (MODEL.gtco.onnx.report.json)")
    p.add_argument("-o", "--output", default=None, metavar="OUT.md", help="write the Markdown here (default stdout)")
    p.add_argument("--png", default=None, metavar="OUT.png",
                   help="also write a bar chart of the predicted (or measured) time per family, before and after "
                   "(default: no chart)")
    p.set_defaults(func=cmd_report)


def _check_args(p: argparse.ArgumentParser, model_help: str) -> None:
    from onnx_gtco.runtime.check import defaults_text

    p.add_argument("original", help="the original model (" + model_help + ")")
    p.add_argument("rewritten", help="the rewritten model optimize wrote")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu", help="ORT execution provider (default cpu)")
    p.add_argument("--rtol", nargs="+", action="extend", default=None, metavar="NAME:TOL",
                   help="relative tolerance: a bare number for every output and/or NAME:TOL for one output, e.g. "
                   "--rtol 1e-3 logits:1e-2; a float output passes when |new - ref| <= atol + rtol*|ref| "
                   f"everywhere (default by the rewritten model's gtco.precision: {defaults_text('rtol')})")
    p.add_argument("--atol", nargs="+", action="extend", default=None, metavar="NAME:TOL",
                   help="absolute tolerance, given like --rtol, e.g. --atol 1e-5 logits:1e-2 (default by the "
                   f"rewritten model's gtco.precision: {defaults_text('atol')})")
    p.add_argument("--agreement", nargs="+", action="extend", default=None, metavar="NAME:SHARE",
                   help="the share of an integer output's elements (class ids, token ids, masks) that must equal "
                   "the original's, from 0 to 1, given like --rtol, e.g. --agreement 0.995 classes:0.98; integer "
                   "outputs are judged by this, not by tolerances (default by the rewritten model's "
                   f"gtco.precision: {defaults_text('agreement')})")
    p.add_argument("--min-cosine", type=float, default=None, metavar="COS",
                   help="judge float outputs by their worst cosine similarity to the original's instead of --rtol / "
                   "--atol (default: fp8 models 0.98 unless --rtol or --atol is given; others by the tolerances)")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="number of seeded input sets, seeds SEED..SEED+N-1; at least 1 (default 1)")
    p.add_argument("--seed", type=int, default=None, help="seed of the first input set, >= 0 (default 0)")
    p.add_argument("--dim", action="append", default=None, metavar="NAME=INT",
                   help="value of a symbolic input dim (repeatable; default 1)")
    p.add_argument("--save-inputs", default=None, metavar="FILE.npz",
                   help="write the inputs used to an .npz, once both models ran on them: one sample keys each "
                   "array by its input's name, several by sample<K>/<name> (K from 0); --load-inputs reads it "
                   "back (default: not written)")
    p.add_argument("--load-inputs", default=None, metavar="FILE.npz",
                   help="compare on these inputs instead of seeded ones (an .npz as --save-inputs writes it, or "
                   "one array per input name for a single sample); each input's dtype and rank must be the "
                   "model's; excludes --samples, --seed and --dim (default: seeded inputs)")
    p.add_argument("--library", action="store_true",
                   help="register the rewritten model's custom-op library (metadata gtco.library), so its kernels "
                   "run instead of the model-local functions; default: the functions run")
    p.set_defaults(func=cmd_check)


def _demo_args(p: argparse.ArgumentParser, model_help: str) -> None:
    from onnx_gtco.models import BUILTIN

    p.add_argument("--model", default="vit-tiny", metavar="NAME",
                   help="the built-in model to build, optimize and check (default vit-tiny; one of "
                   f"{', '.join(BUILTIN)})")
    p.add_argument("--out", default="gtco-demo", help="folder for the demo's files (default ./gtco-demo)")
    _add_plan_args(p)
    p.set_defaults(func=cmd_demo)


def _bench_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("model", help=model_help)
    p.add_argument("--rewritten", default=None, metavar="R",
                   help="time this optimized model as ours (its library beside it); default: optimize MODEL")
    p.add_argument("--torch-program", default=None, metavar="PT2",
                   help="the model's torch.export program (torch.export.save), which the torch-compile baseline "
                   "compiles; it takes MODEL's inputs in order (default: convert MODEL with onnx2torch)")
    p.add_argument("--provider", choices=["cuda", "cpu"], default="cuda",
                   help="ORT execution provider of every variant (default cuda)")
    p.add_argument("--batch", type=int, nargs="+", default=None, metavar="N",
                   help="batch sizes (a file model's symbolic batch dim is bound to each; default: the model's own "
                   "batch, 1 when it is symbolic)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="what ours is optimized with (default fp16 on cuda, fp32 on cpu)")
    p.add_argument("--target", choices=sorted(TARGETS), default=None,
                   help="the GPU ours is planned for (a GPU or an arch, as optimize's; default: the local GPU, else "
                   "sm_90)")
    p.add_argument("--baselines", nargs="+", default=None, metavar="NAME",
                   help="among ort-fp32 ort-fp16 ort-transformers-fp16 torch-compile tensorrt, space or comma "
                   "separated (default: all)")
    p.add_argument("--runs", type=int, default=100, help="timed runs per variant (>= 100; default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before timing (default 10)")
    p.add_argument("--quick", action="store_true", help="allow --runs below 100 (smoke tests, not for reporting)")
    p.add_argument("--profile", action="store_true",
                   help="on cuda, profile a few runs of each variant: its top kernels by GPU time (needs torch)")
    p.add_argument("--remeasure-peaks", action="store_true",
                   help="keep only this run's matmul and copy peaks (else the best of every run on this device)")
    p.add_argument("--model-type", default=None,
                   help="model type for ORT's transformer optimizer (default: bert for token ids, vit for images)")
    p.add_argument("--ort-model", default=None, metavar="ORT",
                   help="the file ORT's transformer optimizer gets instead of MODEL (ort-transformers-fp16): the same "
                   "model in the graph form its fusions match, with MODEL's inputs and outputs (e.g. "
                   "tools/export_zoo.py --exporters ort); default: MODEL")
    p.add_argument("--num-heads", type=int, default=0, metavar="N",
                   help="num_heads for ORT's transformer optimizer (default 0: read from the graph)")
    p.add_argument("--hidden-size", type=int, default=0, metavar="N",
                   help="hidden_size for ORT's transformer optimizer (default 0: read from the graph)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=INT",
                   help="size of a symbolic input dim other than the batch (repeatable; no default: required for "
                   "each such dim)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--out", default=".", help="folder for bench.json, bench.md and bench.png (default .)")
    p.set_defaults(func=cmd_bench)


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
    except BrokenPipeError:  # `onnx-gtco inspect ... | head`: the reader left; later writes to stdout go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("onnx-gtco: error: the output pipe was closed before everything was written", file=sys.stderr)
        return EXIT_ERROR
