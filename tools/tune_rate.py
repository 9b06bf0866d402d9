"""How many tuning trials a minute the tuner gets through, without a GPU: a dry run of tune.driver.tune whose builds
are real (nvcc compiles of the trials' instances, as the GPU measurer's) or simulated (a sleep of S seconds, as a
build of S seconds on a core of its own), and whose measurements are the analytical model's time in the runner's
child process after a sleep of --measure-s seconds (GTCO_TUNE_TEST_DELAY_S, a measurement's cost).

    python tools/tune_rate.py [--model vit-b16] [--depth 1] [--precision fp16] [--arch sm_90] [--families gemm]
                              [--trials 4] [--jobs 1 2] [--build nvcc | --build sleep:7.5 [--cutlass-s 70]]
                              [--measure-s 0.5] [--mma-only] [--json OUT.json]

Each --jobs value is one run on its own fresh kernel cache and journal (so every build compiles), the same tasks
and budget; a line per run gives the trials, the wall time, the trials per minute and the builds' wall seconds.
`--jobs 1` is the serial tuner (one trial built, then measured, then the next); larger values keep that many
candidates building at once (tune.trials). `--build sleep:S --jobs 16` is a 16-core machine whose nvcc takes S s
per instance, and `--cutlass-s C` makes a CUTLASS candidate's simulated build take C s instead. `--mma-only` offers
the generated kernels only (no cuBLASLt or CUTLASS trials: a CUTLASS instance takes minutes of nvcc). Trials are
recorded with no GPU name, so `tune-records merge` never takes them for measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onnx_gtco import optimize  # noqa: E402
from onnx_gtco.config import TUNE_DELAY_ENV, GtcoConfig, tune_test_delay_s  # noqa: E402
from onnx_gtco.models import build as build_model  # noqa: E402
from onnx_gtco.tune import search  # noqa: E402
from onnx_gtco.tune.builder import Artifact, BuildResult, build_and_run  # noqa: E402
from onnx_gtco.tune.driver import tune  # noqa: E402
from onnx_gtco.tune.runner import LocalRunner  # noqa: E402
from onnx_gtco.tune.search import Measurement, predict_us  # noqa: E402
from onnx_gtco.tune.tasks import Task, model_tasks  # noqa: E402


class Predict:
    """The runner child's measurer: sleeps the measurement's cost, then gives the analytical model's time."""

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        delay = tune_test_delay_s()
        if delay > 0:
            time.sleep(delay)
        return Measurement(predict_us(task, config), runs=1)


class DryRun:
    """A measurer that builds apart (builder.SplitMeasurer): nvcc builds or sleeps, runs in a LocalRunner child."""

    name = "dry-run"
    device = "dry run"

    def __init__(self, build: str, cutlass_s: float | None = None) -> None:
        self.sleep_s = float(build.split(":", 1)[1]) if build.startswith("sleep:") else None
        self.cutlass_s = cutlass_s
        self.runner = LocalRunner(Predict)
        self.build_seconds: list[float] = []
        self.cutlass_builds = 0

    def build(self, task: Task, config: Mapping[str, Any]) -> BuildResult:
        start = time.perf_counter()
        cutlass = config.get("impl") == "cutlass"
        self.cutlass_builds += cutlass
        if self.sleep_s is not None:
            time.sleep(self.cutlass_s if cutlass and self.cutlass_s is not None else self.sleep_s)
            got = BuildResult(Artifact("simulated", "simulated"))
        else:
            from onnx_gtco.tune.gpu import build_candidate

            got = build_candidate(task, config)
        self.build_seconds.append(time.perf_counter() - start)
        return got

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        return self.runner.run(task, config, artifact)

    def measure(self, task: Task, config: Mapping[str, Any]) -> Measurement:
        return build_and_run(self, task, config)

    def environment(self) -> dict[str, str]:
        return {"measurer": self.name, "gpu": "", "driver": "", "toolchain": ""}


def one_run(tasks: list[Task], trials: int, jobs: int, build: str, cutlass_s: float | None) -> dict[str, Any]:
    """Tune `tasks` with the dry run on a fresh kernel cache and journal; what it took."""
    work = Path(tempfile.mkdtemp(prefix="gtco-tune-rate-"))
    old_cache = os.environ.get("GTCO_CACHE_DIR")
    os.environ["GTCO_CACHE_DIR"] = str(work / "cache")
    meas = DryRun(build, cutlass_s)
    try:
        start = time.perf_counter()
        results = tune(tasks, trials=trials, measurer=meas, storage=f"journal:{work / 'trials.log'}", patience=10**6,
                       jobs=jobs)
        wall = time.perf_counter() - start
    finally:
        meas.runner.close()
        if old_cache is None:
            os.environ.pop("GTCO_CACHE_DIR", None)
        else:
            os.environ["GTCO_CACHE_DIR"] = old_cache
        shutil.rmtree(work, ignore_errors=True)
    ran = sum(r.measured for r in results)
    return {"jobs": jobs, "build": build, "cutlass_s": cutlass_s, "measure_s": tune_test_delay_s(),
            "tasks": len(tasks), "trials": ran, "builds": len(meas.build_seconds),
            "cutlass_builds": meas.cutlass_builds, "wall_s": round(wall, 2),
            "trials_per_min": round(60 * ran / wall, 2) if wall > 0 else None,
            "build_s_median": round(statistics.median(meas.build_seconds), 2) if meas.build_seconds else None,
            "build_s_sum": round(sum(meas.build_seconds), 2), "children_started": meas.runner.started}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit-b16", help="built-in model whose tasks are tuned (default vit-b16)")
    ap.add_argument("--depth", type=int, default=1, help="encoder layers of the built-in model (default 1)")
    ap.add_argument("--precision", default="fp16", help="precision it is optimized with (default fp16)")
    ap.add_argument("--arch", default="sm_90", help="the tasks' arch, what nvcc builds for (default sm_90)")
    ap.add_argument("--families", default="gemm", help="comma-separated kernel families to tune (default gemm; "
                    "'all' for every task)")
    ap.add_argument("--trials", type=int, default=4, help="trials per task (default 4)")
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="builds at a time, one run each "
                    "(default 1 2)")
    ap.add_argument("--build", default="nvcc", help="nvcc (real builds), or sleep:S (a build of S seconds; "
                    "default nvcc)")
    ap.add_argument("--cutlass-s", type=float, default=None, help="with sleep:S, a CUTLASS candidate's build takes "
                    "this many seconds (default: S too)")
    ap.add_argument("--measure-s", type=float, default=0.5, help="seconds one measurement takes in the child "
                    "(default 0.5)")
    ap.add_argument("--mma-only", action="store_true", help="offer the generated kernels only (default: every "
                    "implementation the tasks offer)")
    ap.add_argument("--json", default=None, help="also write the runs as JSON here (default: not written)")
    args = ap.parse_args(argv)
    if args.build != "nvcc" and not args.build.startswith("sleep:"):
        ap.error(f"--build {args.build!r}: nvcc or sleep:SECONDS")
    if args.mma_only:  # the studies then have no "impl" parameter: the generated kernels' configurations only
        search.offered = lambda task: {}
    os.environ[TUNE_DELAY_ENV] = str(args.measure_s)  # the runner's child inherits it
    model = optimize(build_model(args.model, depth=args.depth), GtcoConfig(precision=args.precision)).model
    tasks = model_tasks(model, args.arch)[0]
    if args.families != "all":
        tasks = [t for t in tasks if t.problem.family in args.families.split(",")]
    if not tasks:
        ap.error(f"no task of families {args.families} in {args.model}")
    cut = f" (CUTLASS {args.cutlass_s:g} s)" if args.cutlass_s is not None else ""
    print(f"{len(tasks)} tasks of {args.model} (depth {args.depth}) for {args.arch}, {args.trials} trials each, "
          f"build {args.build}{cut}, measurement {args.measure_s:g} s, {os.cpu_count()} cores here", flush=True)
    runs = []
    for jobs in args.jobs:
        r = one_run(tasks, args.trials, jobs, args.build, args.cutlass_s)
        runs.append(r)
        print(f"jobs {jobs:>2}: {r['trials']} trials ({r['builds']} built, {r['cutlass_builds']} CUTLASS) in "
              f"{r['wall_s']:.1f} s = {r['trials_per_min']:.1f} trials/min; builds {r['build_s_median']} s median, "
              f"{r['build_s_sum']:.1f} s in all; {r['children_started']} measuring process(es)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
