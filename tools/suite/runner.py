"""Run the plan within the budget: the machine read, the bundle's environment taken, the preflight, then every row
in order, each started only when its expected time fits what is left, each saved the moment it ends, so a call
cut off loses at most the row in flight and `--resume` continues with the rows not yet ok."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from suite.common import PROG, ROOT, GtcoError, Step, probe, write_atomic
from suite.machine import (
    BUNDLE_ENV,
    BUNDLE_SETUP,
    VERSIONS_PROBE,
    bundle_env,
    gpu_info,
    nvcc_version,
    target_for,
    tree_version,
)
from suite.plan import Row
from suite.preflight import lines as preflight_lines
from suite.preflight import needs_for, preflight
from suite.render import render_markdown
from suite.rows import Context, record, run_row

STOPPING_PHASES = ("install", "smoke")
"""Phases whose failure on a GPU stops the run: nothing after them could measure anything."""


class Budget:
    """The run's time budget in seconds, counted from `start` (default: construction) on `clock`."""

    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s = minutes * 60.0
        self.clock = clock
        self.start = clock()

    def spent_s(self) -> float:
        """Seconds since the start."""
        return self.clock() - self.start

    def left_s(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.total_s - self.spent_s())

    def skip_reason(self, need_s: float) -> str | None:
        """Why a row expected to take `need_s` seconds does not start (more than is left), or None."""
        if self.left_s() >= need_s:
            return None
        return (f"budget: {self.left_s():.0f} s of {self.total_s / 60:.1f} min left, the row is expected to take "
                f"{need_s:.0f} s")


@dataclass
class Options:
    """What a run is asked to do (the command line, parsed)."""

    out: Path
    rows: Sequence[Row]
    dry_run: bool
    budget_min: float
    argv: Sequence[str]
    since: float | None = None
    tree: str | None = None
    arch: str | None = None
    tune_trials: int = 8
    workers: int = 1
    runs: int | None = None
    reps: int | None = None
    zoo_dir: Path | None = None
    site: Path | None = None
    wheels: Sequence[Path] = ()
    ort_include: Path | None = None
    resume: bool = False
    profile: bool = True
    storage: str | None = None
    export: Path | None = None
    """A folder that gets summary.json, benchmarks.md and EXPORT_ARCHIVE after every row (what comes back from a
    machine that returns a few files only), else None."""
    env_file: Path | None = None
    """The bundle's environment file (None: machine.BUNDLE_ENV)."""
    bundle_setup: Path | None = None
    """The carried bundle's setup script (None: machine.BUNDLE_SETUP)."""
    pdl: bool = True
    """False: every session runs without programmatic dependent launch ($GTCO_PDL=0 for every command)."""


EXPORT_ARCHIVE = "suite-files.tar.gz"
EXPORTED = ("logs/**/*", "bench/*/bench.json", "bench/*/bench.md", "models/*.report.json", "plugin/*.json",
            "plugin/bench/bench.json", "kernel-bench/*/results.json", "kernel-bench/*/results.md", "pytest-gpu.xml",
            "calibration/*.json", "calibration/chain/*.report.json", "calibration/chain/bench-pdl-*/bench.json",
            "tuning.db", "tuning.journal", "summary.json", "benchmarks.md")
"""What EXPORT_ARCHIVE holds of OUT (globs): every log and result file, the tuning storage; no model or export."""


def export_files(out: Path, dest: Path) -> None:
    """Copy OUT/summary.json and OUT/benchmarks.md into `dest` and pack EXPORTED into dest/EXPORT_ARCHIVE, each
    replaced atomically."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "benchmarks.md"):
        write_atomic(dest / name, (out / name).read_text())
    tmp = dest / f".{EXPORT_ARCHIVE}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for pattern in EXPORTED:
            for f in sorted(out.glob(pattern)):
                if f.is_file():
                    tar.add(f, arcname=str(f.relative_to(out)))
    os.replace(tmp, dest / EXPORT_ARCHIVE)


def storage_url(out: Path) -> str:
    """The run's tuning storage: an Optuna journal in OUT/tuning.journal (no SQL stack needed on the machine; it
    comes back in the export archive, and `onnx-gtco tune-records merge --storage journal:PATH` turns its measured
    trials into shipped tuning records)."""
    return f"journal:{(out / 'tuning.journal').resolve()}"


def earlier_run(out: Path, dry_run: bool) -> tuple[dict[str, dict[str, Any]], str]:
    """What `--resume` keeps of the run in `out`: its ok rows by id, and its date.

    Raises:
        GtcoError: OUT/summary.json is unreadable, or from a run of the other kind (dry or not).
    """
    try:
        prev = json.loads((out / "summary.json").read_text())
        kind, date = bool(prev["suite"]["dry_run"]), str(prev["suite"]["date"])
        rows = {r["id"]: {**r, "resumed": True} for r in prev["rows"] if r["status"] == "ok"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GtcoError(f"--resume: {out / 'summary.json'} is not a summary this suite wrote ({e})") from None
    if kind != dry_run:
        raise GtcoError(f"--resume: {out} holds a {'dry' if kind else 'GPU'} run; this one is "
                        f"{'dry' if dry_run else 'on the GPU'}")
    return rows, date


def read_machine(opts: Options, env: dict[str, str]) -> tuple[Step, dict[str, Any]]:
    """The env step: GPU (name, driver, arch, clocks), its onnx-gtco target, CUDA, the checkout's commit, versions."""
    t0 = time.monotonic()
    gpu = None if opts.dry_run else gpu_info()
    arch = opts.arch or (gpu["arch"] if gpu else "sm_90" if opts.dry_run else None)
    target = target_for(arch, gpu["name"] if gpu else "") if arch else None
    info: dict[str, Any] = {"gpu": gpu, "arch": arch, "target": target,
                            "cuda": nvcc_version(), "tree": opts.tree or tree_version(),
                            "python": sys.version.split()[0]}
    try:
        info["versions"] = probe(VERSIONS_PROBE, None, env)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        info["versions"] = {}
        return Step("env", "failed", f"reading package versions: {e}", round(time.monotonic() - t0, 2)), info
    if not opts.dry_run and gpu is None:
        return Step("env", "failed", "nvidia-smi found no GPU (use --dry-run on a machine without one)",
                    round(time.monotonic() - t0, 2)), info
    if info["target"] is None:
        return Step("env", "failed", f"no onnx-gtco target for {arch} (it plans for sm_80 and sm_90)",
                    round(time.monotonic() - t0, 2)), info
    return Step("env", "ok", "", round(time.monotonic() - t0, 2), None, {"target": info["target"]}), info


def run_suite(opts: Options) -> dict[str, Any]:
    """Run the plan (see the module docstring), writing OUT/summary.json and OUT/benchmarks.md as it goes; returns
    the summary."""
    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    site = (opts.site or out / "site").resolve()
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if opts.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if not opts.pdl:
        env["GTCO_PDL"] = "0"
    budget = Budget(opts.budget_min)
    if opts.since is not None:  # the set-up before the suite counts against the budget
        budget.start -= max(0.0, time.time() - opts.since)
    kept, resumed_from = earlier_run(out, opts.dry_run) if opts.resume else ({}, None)
    storage = opts.storage or storage_url(out)
    summary: dict[str, Any] = {
        "suite": {"command": shlex.join([PROG, *opts.argv]), "date": datetime.datetime.now(datetime.timezone.utc)
                  .strftime("%Y-%m-%d %H:%M UTC"), "dry_run": opts.dry_run, "budget_min": opts.budget_min,
                  "elapsed_s": 0.0, "tune_trials": opts.tune_trials, "storage": storage, "exit": None,
                  "resumed_from": resumed_from},
        "out": str(out), "env": {}, "steps": [], "stop": None, "rows": []}

    def save() -> None:
        summary["suite"]["elapsed_s"] = round(budget.spent_s(), 1)
        write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
        write_atomic(out / "benchmarks.md", render_markdown(summary))
        if opts.export is not None:
            export_files(out, opts.export)

    def say(name: str, status: str, seconds: float, reason: str) -> None:
        print(f"{name:<32} {status:<8} {seconds:7.1f} s  {reason}", flush=True)

    def stop(why: str) -> None:
        if not summary["stop"]:
            summary["stop"] = why

    bundle = bundle_env(env, opts.dry_run, opts.bundle_setup or BUNDLE_SETUP, opts.env_file or BUNDLE_ENV)
    summary["steps"].append(bundle.as_json())
    say("bundle", bundle.status, bundle.seconds, bundle.reason)
    if bundle.status == "failed":
        stop(f"bundle failed, nothing after it ran: {bundle.reason}")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["GTCO_TUNE_STORAGE"] = storage
    if opts.ort_include is not None:
        env["ORT_INCLUDE_DIR"] = str(opts.ort_include.resolve())
    step, summary["env"] = read_machine(opts, env)
    summary["steps"].append(step.as_json())
    say("env", step.status, step.seconds, step.reason)
    if step.status == "failed":
        stop(f"env failed, nothing after it ran: {step.reason}")
    target = summary["env"].get("target")
    wheels_first = any(r.kind == "install" for r in opts.rows)
    if not summary["stop"] and not wheels_first:  # with wheels to install, the preflight follows the install
        check_needs(opts, env, target, storage, summary, stop, say)
    save()
    ctx = Context(out, env, opts.dry_run, target, opts.tune_trials, opts.workers, opts.runs, opts.reps,
                  (opts.zoo_dir or out / "zoo").resolve(), storage, opts.profile and not opts.dry_run,
                  list(opts.wheels), site, machine=summary["env"])
    for row in opts.rows:
        if row.id in kept:
            if kept[row.id].get("pdl") == "off":  # the smoke row found the device kernels wrong with PDL
                env["GTCO_PDL"] = "0"
            env.update(kept[row.id].get("sets_env") or {})  # the calibration row's refit, for every later row
            summary["rows"].append(kept[row.id])
            say(row.id, "ok", 0.0, f"(kept from the run of {resumed_from})")
            save()
            continue
        why = summary["stop"] or budget.skip_reason(row.estimate_s)
        if why:
            rec = record(row) | {"status": "skipped", "reason": why}
        else:
            rec = run_row(ctx, row, time.monotonic() + budget.left_s())
        summary["rows"].append(rec)
        say(row.id, rec["status"], rec["seconds"], rec["reason"])
        if rec["status"] == "failed" and row.phase in STOPPING_PHASES and not opts.dry_run:
            stop(f"{row.id} failed, nothing after it ran: {rec['reason']}")
        if row.kind == "install" and rec["status"] != "failed" and not summary["stop"]:
            check_needs(opts, env, target, storage, summary, stop, say)
        save()
    failed = [s for s in summary["steps"] if s["status"] == "failed"] + \
        [r for r in summary["rows"] if r["status"] == "failed"]
    summary["suite"]["exit"] = 1 if failed or summary["stop"] else 0
    save()
    return summary


def check_needs(opts: Options, env: dict[str, str], target: str | None, storage: str, summary: dict[str, Any],
                stop: Callable[[str], None], say: Callable[[str, str, float, str], None]) -> None:
    """The preflight step, its lines printed; a missing piece stops the run."""
    step = preflight(needs_for(opts.dry_run, target, storage.startswith(("sqlite", "postgresql", "mysql")),
                               calibration=any(r.kind == "calibration" for r in opts.rows)), env)
    summary["steps"].append(step.as_json())
    say("preflight", step.status, step.seconds, step.reason)
    for line in preflight_lines(step):
        print(line, flush=True)
    if step.status == "failed":
        stop(f"preflight failed, nothing after it ran: {step.reason}")


__all__ = ["Budget", "Options", "earlier_run", "run_suite", "storage_url"]
