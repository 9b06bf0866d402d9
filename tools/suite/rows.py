"""How each kind of row runs: every command a subprocess with its log in OUT/logs/ and a timeout no later than the
row's deadline; a row never raises for its own failures, it returns its record with the reason."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from suite import calibration
from suite.common import ROOT, GtcoError, Step, probe, run_command, skipped
from suite.machine import run_install, target_arch
from suite.plan import ModelSpec, Row

SMOKE_COSINE = 0.999
"""The smoke check's bound on the probe's fp16 output against the fp32 original's (cosine similarity), with CUDA
graph replay; `onnx-gtco check` holds it to the fp16 tolerances without."""
MEMCHECK_S = 60.0
"""compute-sanitizer memcheck over the probe's check gets at most this long (it is not run where it cannot work)."""
KERNEL_MAX_CONFIGS = 3
"""Configurations per implementation a kernels row times (the family's first ones: what the tuner seeds with)."""
CALIBRATION_RESERVE_S = 25.0
"""Seconds of the calibration row kept after its measurements for the fit, the backtest and the comparison (each a
few seconds) and a measurement cut off at its timeout."""

_BUILD = r"""
import json, os, sys
import onnx
a = json.loads(sys.argv[1])
from onnx_gtco.models import build
model = build(a["builtin"], batch=a["batch"], **a["overrides"])
onnx.save(model, a["path"] + ".tmp")
os.replace(a["path"] + ".tmp", a["path"])
print("ok")
"""

_ZOO_MISSING = r"""
import importlib.util, json, sys
sys.path.insert(0, "tools")
import export_zoo
print(json.dumps([m for m in export_zoo.ZOO_DEPS if importlib.util.find_spec(m) is None]))
"""


@dataclass
class Context:
    """What every row of one run shares."""

    out: Path
    env: dict[str, str]
    dry_run: bool
    target: str | None
    tune_trials: int
    workers: int
    runs: int | None
    reps: int | None
    zoo_dir: Path
    storage: str
    profile: bool = False
    wheels: Sequence[Path] = ()
    site: Path | None = None
    zoo_missing: list[str] | None = field(default=None, repr=False)
    machine: dict[str, Any] = field(default_factory=dict)
    """The env step's reading of the machine (GPU, driver, CUDA, the commit, versions): the records' provenance."""

    @property
    def provider(self) -> str:
        """The bench's provider: cpu in a dry run, else cuda."""
        return "cpu" if self.dry_run else "cuda"

    @property
    def arch(self) -> str | None:
        """The arch of the run's target (machine.target_arch: "h200" -> "sm_90"), what kernel_bench's --arch takes."""
        return None if self.target is None else target_arch(self.target)

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]


def record(row: Row) -> dict[str, Any]:
    """A row's summary entry before it runs."""
    m = row.model
    return {"id": row.id, "phase": row.phase, "kind": row.kind, "model": m.name if m else None,
            "label": m.label if m else None, "batch": row.batch, "dims": dict(row.dims),
            "stands_in_for": row.stands_in_for, "tuned": row.tune, "baselines": list(row.baselines),
            "estimate_s": row.estimate_s, "status": "ok", "reason": "", "seconds": 0.0, "steps": []}


def run_row(ctx: Context, row: Row, deadline: float) -> dict[str, Any]:
    """Run `row` before the monotonic time `deadline`; its record (status ok, failed or skipped, with the reason)."""
    rec = record(row)
    t0 = time.monotonic()
    if row.no_stand_in:
        rec["status"], rec["reason"] = "skipped", f"no CPU stand-in: {row.no_stand_in}"
        return rec
    runner: Callable[[Context, Row, float, dict[str, Any]], None] = {
        "install": _install, "smoke": _smoke, "calibration": _calibration, "bench": _bench, "kernels": _kernels,
        "probe": _probe, "tests": _tests}[row.kind]
    runner(ctx, row, deadline, rec)
    rec["seconds"] = round(time.monotonic() - t0, 2)
    return rec


def _add(rec: dict[str, Any], step: Step) -> bool:
    """Append a step to the row's record; False (and the row failed with the reason) when it did not succeed."""
    rec["steps"].append(step.as_json())
    if step.status != "ok":
        rec["status"] = "failed" if step.status == "failed" else step.status
        rec["reason"] = f"{step.name.split(': ')[-1]}: {step.reason}"
        return False
    return True


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


# ------------------------------------------------------------------------------------------------------ install


def _install(ctx: Context, row: Row, deadline: float, rec: dict[str, Any]) -> None:
    site = ctx.site or ctx.out / "site"
    step = run_install(list(ctx.wheels), site, ctx.out, ctx.env, _left(deadline))
    rec["steps"].append(step.as_json())
    rec["detail"] = step.detail
    if step.status != "ok":
        rec["status"], rec["reason"] = step.status, step.reason


# ------------------------------------------------------------------------------------------------------ models


def build_builtin(ctx: Context, spec: ModelSpec, batch: int, path: Path, timeout_s: float, name: str) -> Step:
    """Write a built-in model, fp32, at `batch` to `path`, in a subprocess (the steps' Python and packages)."""
    args = {"builtin": spec.builtin, "batch": batch, "overrides": spec.overrides, "path": str(path)}
    return run_command(name, ctx.python("-c", _BUILD, json.dumps(args)), env=ctx.env, timeout_s=timeout_s,
                       log=ctx.logs / f"{name.replace(': ', '.').replace('/', '-')}.log")


def zoo_missing(ctx: Context) -> list[str]:
    """The zoo exporter's dependencies the steps' Python cannot import (asked once per run)."""
    if ctx.zoo_missing is None:
        try:
            ctx.zoo_missing = list(probe(_ZOO_MISSING, None, ctx.env))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            ctx.zoo_missing = [f"(the check failed: {e})"]
    return ctx.zoo_missing


def zoo_stem(spec: ModelSpec, batch: int) -> str:
    assert spec.zoo is not None
    return spec.zoo if batch == 1 else f"{spec.zoo}.b{batch}"


def zoo_files(ctx: Context, spec: ModelSpec, batch: int) -> dict[str, Path]:
    """Where tools/export_zoo.py writes a zoo model's TorchScript export, its ORT form and its torch.export program
    at `batch`."""
    stem = zoo_stem(spec, batch)
    return {"torchscript": ctx.zoo_dir / f"{stem}.torchscript.onnx", "ort": ctx.zoo_dir / f"{stem}.ort.onnx",
            "program": ctx.zoo_dir / f"{stem}.pt2"}


def export_cmd(ctx: Context, row: Row) -> list[str]:
    """tools/export_zoo.py for what the row needs: the TorchScript export (or the ORT form where that is the
    model), the ORT form for ORT's transformer optimizer, the torch.export program for torch.compile."""
    spec = row.model
    assert spec is not None and spec.zoo is not None
    forms = ["ort"] if spec.ort_form_is_model else ["torchscript"]
    if spec.ort_form and "ort-transformers-fp16" in row.baselines and "ort" not in forms:
        forms.append("ort")
    cmd = ctx.python(str(ROOT / "tools" / "export_zoo.py"), "--out", str(ctx.zoo_dir), "--models", spec.zoo,
                     "--exporters", ",".join(forms), "--batch", str(row.batch))
    return cmd + (["--programs"] if "torch-compile" in row.baselines else [])


def optimize_cmd(ctx: Context, row: Row, model: Path, out: Path) -> list[str]:
    """`onnx-gtco optimize` at fp16, tuning into the run's storage for a tune row; on a GPU it builds the library
    (`--cuda`), in a dry run none (the bench's CPU path runs the model-local functions)."""
    trials = ctx.tune_trials if row.tune else 0
    cmd = ctx.python("-m", "onnx_gtco", "optimize", str(model), "-o", str(out), "--target", str(ctx.target),
                     "--precision", "fp16", "--tune-trials", str(trials), "--workers", str(ctx.workers),
                     "--storage", ctx.storage)
    cmd += ["--dynamic", row.dynamic] if row.dynamic else []
    return [*cmd, "--no-build" if ctx.dry_run else "--cuda"]


def bench_cmd(ctx: Context, row: Row, model: Path, rewritten: Path, out: Path,
              files: dict[str, Path] | None = None) -> list[str]:
    """`onnx-gtco bench` of one row: ours (`--rewritten`) beside the row's baselines, the row's dims bound; given
    the zoo files, torch.compile runs the model's own torch.export program and ORT's transformer optimizer the
    model's ORT form. A dry run times a few runs (`--quick`)."""
    spec = row.model
    assert spec is not None
    cmd = ctx.python("-m", "onnx_gtco", "bench", str(model), "--rewritten", str(rewritten), "--provider",
                     ctx.provider, "--batch", str(row.batch), "--precision", "fp16", "--target", str(ctx.target),
                     "--out", str(out), "--baselines", *row.baselines)
    cmd += [a for k, v in row.dims for a in ("--dim", f"{k}={v}")]
    files = files or {}
    if "torch-compile" in row.baselines and files.get("program") and files["program"].is_file():
        cmd += ["--torch-program", str(files["program"])]
    if spec.ort_form and "ort-transformers-fp16" in row.baselines:
        if not spec.ort_form_is_model and files.get("ort") is not None:
            cmd += ["--ort-model", str(files["ort"])]
        cmd += ["--model-type", str(spec.ort_form["model_type"]), "--num-heads", str(spec.ort_form["num_heads"]),
                "--hidden-size", str(spec.ort_form["hidden_size"])]
    cmd += ["--profile"] if ctx.profile and not ctx.dry_run else []
    cmd += ["--quick"] if ctx.dry_run else []
    return cmd + (["--runs", str(ctx.runs)] if ctx.runs else [])


def read_bench(path: Path, batch: int) -> dict[str, Any]:
    """The entry for `batch` in a bench.json (the bench's own dict: variants, ours_over, roofline).

    Raises:
        GtcoError: no such file, not JSON, or no entry for the batch.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GtcoError(f"{path}: unreadable bench result ({e})") from None
    for entry in data.get("batches", []):
        if entry.get("batch") == batch:
            return entry
    raise GtcoError(f"{path}: no result for batch {batch}")


def _bench(ctx: Context, row: Row, deadline: float, rec: dict[str, Any]) -> None:
    """Prepare (export or build), optimize (tuning on a tune row) and bench one row."""
    spec = row.model
    assert spec is not None
    models = ctx.out / "models"
    models.mkdir(exist_ok=True)
    rewritten = models / f"{row.stem}.gtco.onnx"
    bench_out = ctx.out / "bench" / row.stem
    files: dict[str, Path] = {}
    if spec.zoo:
        missing = zoo_missing(ctx)
        if missing:
            rec["status"] = "skipped"
            rec["reason"] = (f"export: needs {', '.join(missing)} (not importable; carry the wheels with --wheels, "
                             "or pip install -r requirements-zoo.txt)")
            return
        files = zoo_files(ctx, spec, row.batch)
        model = files["ort"] if spec.ort_form_is_model else files["torchscript"]
        step = run_command(f"{row.id}: export", export_cmd(ctx, row), env=ctx.env, timeout_s=_left(deadline),
                           log=ctx.logs / f"{row.stem}.export.log")
    else:
        model = models / f"{spec.name}.b{row.batch}.onnx"
        step = build_builtin(ctx, spec, row.batch, model, _left(deadline), f"{row.id}: prepare")
    if not _add(rec, step):
        return
    step = run_command(f"{row.id}: optimize", optimize_cmd(ctx, row, model, rewritten), env=ctx.env,
                       timeout_s=_left(deadline), log=ctx.logs / f"{row.stem}.optimize.log")
    if not _add(rec, step):
        return
    report = rewritten.with_name(rewritten.name + ".report.json")
    rec["report"] = str(report)
    with_library_note(rec, report)
    step = run_command(f"{row.id}: bench", bench_cmd(ctx, row, model, rewritten, bench_out, files), env=ctx.env,
                       timeout_s=_left(deadline), log=ctx.logs / f"{row.stem}.bench.log")
    if step.status == "ok":
        try:
            entry = read_bench(bench_out / "bench.json", row.batch)
        except GtcoError as e:
            step.status, step.reason = "failed", str(e)
        else:
            rec.update({k: v for k, v in entry.items() if k != "batch"})
            rec["bench_json"] = str(bench_out / "bench.json")
    _add(rec, step)


def with_library_note(rec: dict[str, Any], report: Path) -> None:
    """What the row's optimize built, from its report: fused groups, kernels compiled, tuning (never raises)."""
    try:
        r = json.loads(report.read_text())
    except (OSError, ValueError):
        return
    lib = r.get("library") or {}
    tuning = r.get("tuning") or {}
    rec["optimize"] = {"groups_fused": r.get("groups_fused"), "nodes": [r.get("nodes_before"), r.get("nodes_after")],
                       "kernels": len(lib.get("kernels") or ()),
                       "cutlass": sum("cutlass" in str(k.get("instance")) for k in lib.get("kernels") or ()),
                       "tuning": {k: tuning[k] for k in ("measurer", "trials_per_task", "measured", "tasks_found")
                                  if k in tuning}}


# ------------------------------------------------------------------------------------------------------ smoke


def _smoke(ctx: Context, row: Row, deadline: float, rec: dict[str, Any]) -> None:
    """The plugin of a one-block ViT built for the device's target, then checked three ways: `onnx-gtco check`
    with the library (on the CUDA EP every fused node must run there, ORT's profile says), a bench run of it with
    CUDA graph replay (it must capture and agree with the fp32 original), and compute-sanitizer memcheck over the
    check where the tool works."""
    if ctx.target is None:
        rec["status"], rec["reason"] = "failed", "no onnx-gtco target for this GPU (it plans for sm_80 and sm_90)"
        return
    d = ctx.out / "plugin"
    d.mkdir(exist_ok=True)
    probe_model, rewritten = d / "probe.onnx", d / "probe.gtco.onnx"
    spec = ModelSpec("probe", "ViT-tiny, 1 block", builtin="vit-tiny", overrides={"depth": 1})
    if not _add(rec, build_builtin(ctx, spec, 1, probe_model, _left(deadline), "smoke: prepare")):
        return
    cmd = ctx.python("-m", "onnx_gtco", "optimize", str(probe_model), "-o", str(rewritten), "--target",
                     ctx.target, "--precision", "fp16", "--cpu" if ctx.dry_run else "--cuda")
    step = run_command("smoke: plugin", cmd, env=ctx.env, timeout_s=_left(deadline), log=ctx.logs / "plugin.log")
    if step.status == "ok":
        lib = json.loads(rewritten.with_name(rewritten.name + ".report.json").read_text()).get("library") or {}
        step.detail = {"target": ctx.target, "op_types": len(lib.get("op_types") or ()),
                       "cuda_op_types": len(lib.get("cuda_op_types") or ()), "kernels": len(lib.get("kernels") or ())}
        if not ctx.dry_run and not step.detail["kernels"]:
            step.status = "failed"
            step.reason = f"the library has no device kernels (kernel_skips: {lib.get('kernel_skips') or {}})"[:400]
    if not _add(rec, step):
        return
    check = ctx.python("-m", "onnx_gtco", "check", str(probe_model), str(rewritten), "--provider", ctx.provider,
                       "--samples", "2", "--library")
    if not _add(rec, _check_pdl_or_not(ctx, check, deadline, rec)):
        return
    if not _add(rec, _graph_check(ctx, probe_model, rewritten, deadline)):
        return
    mem = _memcheck(ctx, check, deadline)
    rec["steps"].append(mem.as_json())
    if mem.status == "failed":
        rec["status"], rec["reason"] = "failed", f"memcheck: {mem.reason}"


def _check_pdl_or_not(ctx: Context, check: list[str], deadline: float, rec: dict[str, Any]) -> Step:
    """The smoke check; where it fails on a GPU with programmatic dependent launch on (the library's default on
    sm_90, never measured before), the same check without it: when that passes, every later command of the run
    gets GTCO_PDL=0 (and a resumed run too: the row records `pdl: off`), so one PDL bug costs the run no rows."""
    step = run_command("smoke: check", check, env=ctx.env, timeout_s=_left(deadline), log=ctx.logs / "smoke-check.log")
    if step.status != "failed" or ctx.dry_run or ctx.env.get("GTCO_PDL") == "0":
        return step
    rec["steps"].append(step.as_json())
    again = run_command("smoke: check without PDL", check, env={**ctx.env, "GTCO_PDL": "0"},
                        timeout_s=_left(deadline), log=ctx.logs / "smoke-check-nopdl.log")
    if again.status == "ok":
        ctx.env["GTCO_PDL"] = "0"
        rec["pdl"] = "off"
        again.reason = f"with PDL the check failed ({step.reason}); without it, it passes: the run goes on without PDL"
    return again


def _graph_check(ctx: Context, model: Path, rewritten: Path, deadline: float) -> Step:
    """A short bench of the probe against ORT fp32: ours must run (on a GPU with CUDA graph replay) and agree with
    the fp32 original (cosine >= SMOKE_COSINE)."""
    out = ctx.out / "plugin" / "bench"
    cmd = ctx.python("-m", "onnx_gtco", "bench", str(model), "--rewritten", str(rewritten), "--provider",
                     ctx.provider, "--batch", "1", "--precision", "fp16", "--target", str(ctx.target), "--out",
                     str(out), "--baselines", "ort-fp32", "--quick", "--runs", "10", "--warmup", "3")
    step = run_command("smoke: cuda graph", cmd, env=ctx.env, timeout_s=_left(deadline),
                       log=ctx.logs / "smoke-graph.log")
    if step.status != "ok":
        return step
    try:
        ours = next(v for v in read_bench(out / "bench.json", 1)["variants"] if v["name"] == "gtco")
    except (GtcoError, StopIteration) as e:
        return Step(step.name, "failed", f"no gtco result in the bench ({e})", step.seconds, step.log)
    step.detail = {"cuda_graph": ours.get("cuda_graph"), "cosine": ours.get("cosine"),
                   "max_abs_err": ours.get("max_abs_err")}
    if ours["status"] != "ok":
        step.status, step.reason = "failed", f"gtco {ours['status']}: {ours.get('reason')}"
    elif not ctx.dry_run and not ours.get("cuda_graph"):
        step.status, step.reason = "failed", f"no CUDA graph replay: {ours.get('note') or 'no reason given'}"
    elif (ours.get("cosine") or 0.0) < SMOKE_COSINE:
        step.status, step.reason = "failed", f"outputs off: cosine {ours.get('cosine')} < {SMOKE_COSINE}"
    return step


def _memcheck(ctx: Context, check: list[str], deadline: float) -> Step:
    """compute-sanitizer memcheck over the probe's check (every family of the probe: GEMM, attention, LayerNorm,
    conv, elementwise): failed on a memory error; skipped in a dry run, without the tool, where the machine does not
    support it (gVisor) or when it does not finish in MEMCHECK_S."""
    if ctx.dry_run:
        return skipped("smoke: memcheck", "dry run (no GPU)")
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return skipped("smoke: memcheck", "compute-sanitizer is not on PATH")
    log = ctx.logs / "smoke-memcheck.log"
    timeout = min(MEMCHECK_S, _left(deadline))
    step = run_command("smoke: memcheck", [tool, "--tool", "memcheck", "--error-exitcode", "99", "--print-limit",
                                           "5", *check], env=ctx.env, timeout_s=timeout, log=log)
    text = log.read_text(errors="replace") if log.is_file() else ""
    if step.status == "ok":
        return step
    if "timed out" in step.reason:
        return skipped("smoke: memcheck", f"did not finish in {timeout:.0f} s")
    if "exit 99" in step.reason:
        errors = [ln.strip(" =") for ln in text.splitlines() if "Invalid" in ln or "Error" in ln]
        return Step(step.name, "failed", (errors[0] if errors else step.reason)[:400], step.seconds, step.log)
    return skipped("smoke: memcheck", f"the tool does not work here: {step.reason}"[:400])


# ------------------------------------------------------------------------------------------------------ calibration


def _calibration(ctx: Context, row: Row, deadline: float, rec: dict[str, Any]) -> None:
    """tools/calibrate.py measure into OUT/calibration (records.json: on a GPU our instances timed, in a dry run the
    estimate's stand-ins), then `onnx-gtco calibration fit` of the shipped records of the same GPU and these into
    OUT/calibration/<target>.json, its backtest, and tools/calibrate.py compare (each record priced by the shipped
    calibration and by the refit). A fit that succeeds is in force for every later command of the run
    ($GTCO_CALIBRATION_DIR, recorded as the row's `sets_env` so that --resume restores it); a failed one leaves the
    shipped calibration in force and the row failed, saying so. A case that failed is listed, not the row's failure.
    The measurement starts no case past the row's expected time less CALIBRATION_RESERVE_S."""
    if ctx.target is None:
        rec["status"], rec["reason"] = "failed", "no onnx-gtco target for this GPU"
        return
    d = ctx.out / "calibration"
    d.mkdir(exist_ok=True)
    records, refit = d / "records.json", d / f"{ctx.target}.json"
    for stale in (records, refit, d / "measure.json", d / "compare.json"):  # an earlier try's, never mixed in
        stale.unlink(missing_ok=True)
    env = {k: v for k, v in ctx.env.items() if k != calibration.ENV}  # measured against the shipped calibration
    left = _left(deadline)
    budget = max(30.0, min(row.estimate_s, left) - CALIBRATION_RESERVE_S)
    cmd = ctx.python(str(ROOT / "tools" / "calibrate.py"), "measure", "--target", ctx.target, "--out", str(d),
                     "--time-budget-s", f"{budget:.0f}", "--provenance",
                     json.dumps(calibration.provenance(ctx.machine, ctx.dry_run)))
    cmd += ["--stand-in", "--jobs", "2"] if ctx.dry_run else []
    step = run_command("calibration: measure", cmd, env=env, timeout_s=min(left, budget + CALIBRATION_RESERVE_S),
                       log=ctx.logs / "calibration-measure.log")
    measure = calibration.read_json(d / "measure.json") or {}
    step.detail = {k: measure[k] for k in ("timed", "models", "seconds") if k in measure}
    step.detail.update({"cut": len(measure.get("cut") or ()), "failed": len(measure.get("failed") or ())})
    rec["steps"].append(step.as_json())
    if not measure.get("timed"):
        rec["status"] = "failed"
        rec["reason"] = (f"measure: {step.reason or 'no kernel record'}; the shipped calibration stays in force")
        return
    try:
        inputs, which = calibration.fit_inputs(records)
    except ValueError as e:
        rec["status"], rec["reason"] = "failed", f"fit: {e}; the shipped calibration stays in force"
        return
    fit = run_command("calibration: fit", ctx.python("-m", "onnx_gtco", "calibration", "fit", *map(str, inputs),
                                                     "-o", str(refit)),
                      env=env, timeout_s=_left(deadline), log=ctx.logs / "calibration-fit.log")
    fit.detail = {"records": which}
    rec["steps"].append(fit.as_json())
    why_not = "" if fit.status == "ok" and refit.is_file() else f"the fit failed: {fit.reason or 'no file written'}"
    if not why_not:
        back = run_command("calibration: backtest", ctx.python("-m", "onnx_gtco", "calibration", "backtest",
                                                               str(records), "--calibration-dir", str(d)),
                           env=env, timeout_s=_left(deadline), log=ctx.logs / "calibration-backtest.log")
        rec["steps"].append(back.as_json())
    cmp = ctx.python(str(ROOT / "tools" / "calibrate.py"), "compare", "--target", ctx.target, "--records",
                     str(records), "-o", str(d / "compare.json"))
    cmp += [] if why_not else ["--refit", str(d)]
    compared = run_command("calibration: compare", cmp, env=env, timeout_s=_left(deadline),
                           log=ctx.logs / "calibration-compare.log")
    rec["steps"].append(compared.as_json())
    rec["calibration"] = calibration.summary(measure, calibration.read_json(d / "compare.json"),
                                             None if why_not else str(refit), why_not)
    if why_not:
        rec["status"], rec["reason"] = "failed", f"{why_not}; the shipped calibration stays in force"
        return
    rec["sets_env"] = {calibration.ENV: str(d)}
    ctx.env.update(rec["sets_env"])
    notes = [f"measure: {step.reason} (the refit uses the {measure['timed']} records written before)"
             if step.status != "ok" else "",  # cut off after writing records: the refit stands on them
             *(f"{s['name'].split(': ')[-1]}: {s['reason']} (the refit is in force all the same)"
               for s in rec["steps"][2:] if s["status"] != "ok")]
    rec["reason"] = "; ".join(n for n in notes if n)


# ------------------------------------------------------------------------------------------------------ kernels


def _probe(ctx: Context, row: Row, deadline: float, rec: dict[str, Any]) -> None:
    """tools/hopper_probe.py into OUT/hopper-probe: FP8 GEMMs and cuDNN's attention beside their fp16 counterparts
    at the core models' shapes, within the row's time."""
    out = ctx.out / "hopper-probe"
    left = _left(deadline)
    cmd = ctx.python(str(ROOT / "tools" / "hopper_probe.py"), "--out", str(out), "--budget-s",
                     f"{max(10.0, left - 20.0):.0f}")
    step = run_command(f"{row.id}: probe", cmd, env=ctx.env, timeout_s=left, log=ctx.logs / f"{row.stem}.log")
    if _add(rec, step):
        rec["probe"] = {"results": str(out / "results.json"), "md": str(out / "results.md")}


def _kernels(ctx: Context, row: Row, deadline: float, rec: dict[str, Any]) -> None:
    """The kernel bench (onnx_gtco.bench.kernel_bench) for one shape set into OUT/kernel-bench/<set>: on a GPU the
    first configurations of each implementation timed beside cuBLASLt, torch and ORT (no torch.compile: the extra
    rows time it), within the row's time; a dry run compiles three instances and launches none."""
    if ctx.target is None:
        rec["status"], rec["reason"] = "failed", "no onnx-gtco target for this GPU"
        return
    if shutil.which(os.environ.get("NVCC", "nvcc")) is None:
        rec["status"], rec["reason"] = "skipped", "nvcc not found"
        return
    assert row.kernel_set is not None
    out = ctx.out / "kernel-bench" / row.kernel_set
    cmd = ctx.python("-m", "onnx_gtco.bench.kernel_bench", "--arch", str(ctx.arch), "--set", row.kernel_set,
                     "--out", str(out))
    left = _left(deadline)
    if ctx.dry_run:
        cmd += ["--compile-only", "--quick", "--max-configs", "1", "--impls", "mma"]
    else:
        cmd += ["--no-compile", "--max-configs", str(KERNEL_MAX_CONFIGS), "--time-budget-s",
                f"{max(30.0, left - 60.0):.0f}"]
    cmd += ["--reps", str(ctx.reps)] if ctx.reps else []
    step = run_command(f"{row.id}: kernel bench", cmd, env=ctx.env, timeout_s=left,
                       log=ctx.logs / f"{row.stem}.log")
    try:
        res = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        res = None
    if res is not None:
        rows = res.get("results") or []
        bad = [r["case"] for r in rows if not r.get("all_ok")]
        rec["kernel_bench"] = {"results": str(out / "results.json"), "md": str(out / "results.md"),
                               "compile_only": bool(res.get("compile_only")), "cases": len(rows or res.get("cases")
                                                                                         or ()),
                               "built": len(res.get("built") or ()), "cases_all_ok": len(rows) - len(bad)}
        if step.status == "failed" and bad and "timed out" not in step.reason:
            step.reason = f"{len(bad)} of {len(rows)} cases had a candidate fail: {bad[0]}, ...; " + step.reason
    _add(rec, step)


def junit_counts(path: Path) -> dict[str, int]:
    """tests / passed / failed / errors / skipped summed over a JUnit XML file's test suites.

    Raises:
        GtcoError: the file is missing or not JUnit XML.
    """
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise GtcoError(f"{path}: no JUnit XML ({e})") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"tests": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"]}


def _tests(ctx: Context, row: Row, deadline: float, rec: dict[str, Any], tests: Path = ROOT / "tests") -> None:
    """`pytest -m gpu` over the tests, JUnit XML into OUT/pytest-gpu.xml (in a dry run they collect and skip:
    a collection error anywhere fails the row)."""
    xml = ctx.out / "pytest-gpu.xml"
    cmd = ctx.python("-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                     f"--junitxml={xml}", str(tests))
    step = run_command(f"{row.id}: pytest", cmd, env=ctx.env, timeout_s=_left(deadline), log=ctx.logs / "gpu-tests.log")
    with contextlib.suppress(GtcoError):
        step.detail = junit_counts(xml)
    if step.status == "failed" and step.detail.get("tests") == 0 and "exit 5" in step.reason:
        step.status, step.reason = "ok", "no test is marked gpu"
    rec["tests"] = step.detail
    _add(rec, step)


__all__ = ["Context", "bench_cmd", "export_cmd", "optimize_cmd", "read_bench", "record", "run_row", "zoo_files"]
