"""Tune a set of tasks against the tuning storage: the scheduler picks the task, the study picks the configuration.

`tune(tasks, trials=N, storage=URL, measurer=...)` gives every task up to N finished trials in all (the storage
counts, whatever process ran them: a task that already has N is not measured again), stops a task early when its
best has not improved for `patience` trials, and returns what each task reached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from onnx_gtco.tune.scheduler import Curve, Policy, stopped
from onnx_gtco.tune.search import (
    MEMORY_PREFIX,
    Measurer,
    best,
    best_trials_by_impl,
    finished,
    open_storage,
    storage_url,
    study_for,
    study_name,
    times,
    to_config,
)
from onnx_gtco.tune.tasks import Task


@dataclass(frozen=True)
class TaskResult:
    """One task after tuning.

    Attributes:
        task: the task.
        trials: finished trials in the storage (all processes, all runs).
        measured: trials this call ran.
        best_config / best_us: the fastest configuration and its median time (None: no trial succeeded).
        first_us: time of the first successful trial (the analytical model's top guess).
        trials_to_90: finished trials until one came within 90% of the best (best / t >= 0.9).
        seconds_to_90: wall time from the study's first trial to that one.
        stop: why the task took no more trials.
    """

    task: Task
    trials: int
    measured: int
    best_config: dict[str, int] | None
    best_us: float | None
    first_us: float | None
    trials_to_90: int | None
    seconds_to_90: float | None
    stop: str

    @property
    def speedup(self) -> float | None:
        return self.first_us / self.best_us if self.first_us and self.best_us else None

    def to_json(self) -> dict[str, object]:
        return {"task": self.task.key, "describe": self.task.describe(), "weight": self.task.weight,
                "trials": self.trials, "measured": self.measured, "best_config": self.best_config,
                "best_us": self.best_us, "first_us": self.first_us, "speedup_over_first": self.speedup,
                "trials_to_90": self.trials_to_90, "seconds_to_90": self.seconds_to_90, "stop": self.stop}


def _result(task: Task, study: optuna.Study, measured: int, stop: str) -> TaskResult:
    done = sorted(finished(study), key=lambda t: t.number)
    b = best(study)
    ok = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE]
    to90 = secs = None
    if b is not None:
        for i, t in enumerate(done):
            if t.state == optuna.trial.TrialState.COMPLETE and b.value / t.value >= 0.9:
                to90 = i + 1
                start = done[0].datetime_start
                if start is not None and t.datetime_complete is not None:
                    secs = (t.datetime_complete - start).total_seconds()
                break
    return TaskResult(task, len(done), measured, to_config(b.params) if b else None, b.value if b else None,
                      ok[0].value if ok else None, to90, secs, stop)


def tune(tasks: Sequence[Task], *, trials: int, measurer: Measurer, storage: str | None = None,
         patience: int = 20, seed: int = 0, workers: int = 1, targets: Mapping[str, float] | None = None,
         jobs: int | None = None, progress: Callable[[TaskResult], None] | None = None) -> list[TaskResult]:
    """Tune `tasks` (see the module docstring; `targets`: task key -> a time in us at which the task stops): their
    studies get the budget, then this process and `workers` - 1
    tune-worker processes (analytical measurer only) run trials until every task has stopped. A measurer that
    builds apart (the GPU measurer) has `jobs` candidates building at once in this process (default: one per
    core), each measured as its build finishes (tune.trials). `progress` is called after each trial this process
    runs."""
    from onnx_gtco.tune.worker import prepare, spawn, work

    if trials < 0:
        raise ValueError(f"trials must be >= 0, got {trials}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are recorded with their reasons
    url = storage_url(storage)
    prepare(list(tasks), trials, url, measurer.device, seed, targets)
    store = open_storage(url)
    studies = {t.key: study_for(t, store, measurer.device, seed, getattr(measurer, "hw", None)) for t in tasks}
    before = {k: len(finished(s)) for k, s in studies.items()}
    by_key = {t.key: t for t in tasks}
    keys = set(studies)
    if workers > 1 and measurer.name != "analytical":
        raise ValueError("extra worker processes measure with the analytical model only")
    if workers > 1 and url.startswith(MEMORY_PREFIX):
        raise ValueError(f"{url}: an in-memory storage cannot be shared with worker processes")
    procs = spawn(url, workers - 1, keys, patience) if workers > 1 else []

    def report(task: Task, record: optuna.trial.FrozenTrial) -> None:
        del record
        if progress is not None:
            progress(_result(by_key[task.key], studies[task.key], len(finished(studies[task.key])) -
                             before[task.key], ""))

    try:
        work(url, measurer, keys=keys, patience=patience, jobs=jobs, progress=report)
    finally:
        errors = []
        for p in procs:
            _, err = p.communicate()
            if p.returncode != 0:
                errors.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
    if errors:
        raise RuntimeError(f"tune-worker failed: {errors[0]}")
    policy = Policy(limit=trials, patience=patience)
    out = []
    for t in tasks:
        s = studies[t.key]
        curve = Curve(t.weight, times(s), (targets or {}).get(t.key))
        out.append(_result(t, s, len(finished(s)) - before[t.key], stopped(curve, policy) or ""))
    return out


def best_configs(tasks: Sequence[Task], device: str, storage: str | None = None
                 ) -> dict[str, tuple[dict[str, int], float]]:
    """task key -> (best configuration, its time on `device`) for the tasks the storage has a successful trial of;
    no measuring. Tasks without a study are skipped."""
    store = open_storage(storage_url(storage))
    names = {s.study_name for s in optuna.get_all_study_summaries(store)}
    out = {}
    for t in tasks:
        if study_name(t, device) not in names:
            continue
        b = best(optuna.load_study(study_name=study_name(t, device), storage=store))
        if b is not None and b.value is not None and math.isfinite(b.value):
            out[t.key] = (to_config(b.params), float(b.value))
    return out


def impl_bests(tasks: Sequence[Task], device: str, storage: str | None = None
               ) -> dict[str, dict[str, tuple[dict[str, Any], float]]]:
    """task key -> implementation -> its fastest configuration and time on `device` (search.best_trials_by_impl),
    for the tasks the storage has a study of; no measuring."""
    store = open_storage(storage_url(storage))
    names = {s.study_name for s in optuna.get_all_study_summaries(store)}
    return {t.key: {impl: (to_config(trial.params), float(trial.value))
                    for impl, trial in best_trials_by_impl(
                        optuna.load_study(study_name=study_name(t, device), storage=store)).items()}
            for t in tasks if study_name(t, device) in names}


def impl_times(tasks: Sequence[Task], device: str, storage: str | None = None) -> dict[str, dict[str, float]]:
    """task key -> implementation -> its fastest time on `device` (search.best_by_impl), for the tasks the storage
    has a study of; no measuring."""
    return {key: {impl: us for impl, (_, us) in per.items()} for key, per in impl_bests(tasks, device, storage).items()}


__all__ = ["TaskResult", "best_configs", "impl_bests", "impl_times", "tune"]
