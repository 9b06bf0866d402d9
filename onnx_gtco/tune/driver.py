"""Tune a set of tasks against the tuning storage: the scheduler picks the task, the study picks the configuration.

`tune(tasks, trials=N, storage=URL, measurer=...)` gives every task up to N finished trials in all (the storage
counts, whatever process ran them: a task that already has N is not measured again), stops a task early when its
best has not improved for `patience` trials, and returns what each task reached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna

from onnx_gtco.tune.scheduler import Curve, Policy, next_task, stopped
from onnx_gtco.tune.search import (
    Measurer,
    best,
    finished,
    open_storage,
    run_trial,
    storage_url,
    study_for,
    study_name,
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


def _curve(study: optuna.Study, weight: float) -> Curve:
    done = sorted(finished(study), key=lambda t: t.number)
    return Curve(weight, [t.value if t.state == optuna.trial.TrialState.COMPLETE else None for t in done])


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
    return TaskResult(task, len(done), measured, dict(b.params) if b else None, b.value if b else None,
                      ok[0].value if ok else None, to90, secs, stop)


def tune(tasks: Sequence[Task], *, trials: int, measurer: Measurer, storage: str | None = None,
         patience: int = 20, seed: int = 0,
         progress: Callable[[TaskResult], None] | None = None) -> list[TaskResult]:
    """Tune `tasks` (see the module docstring). `progress` is called after every measured trial."""
    if trials < 0:
        raise ValueError(f"trials must be >= 0, got {trials}")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are recorded with their reasons
    store = open_storage(storage_url(storage))
    policy = Policy(limit=trials, patience=patience)
    studies = [study_for(t, store, measurer.device, seed) for t in tasks]
    curves = [_curve(s, t.weight) for s, t in zip(studies, tasks, strict=True)]
    measured = [0] * len(tasks)
    while (i := next_task(curves, policy)) is not None:
        record = run_trial(studies[i], tasks[i], measurer)
        measured[i] += 1
        curves[i].times.append(record.value if record.state == optuna.trial.TrialState.COMPLETE else None)
        if progress is not None:
            progress(_result(tasks[i], studies[i], measured[i], ""))
    return [_result(t, s, m, stopped(c, policy) or "") for t, s, m, c in zip(tasks, studies, measured, curves,
                                                                              strict=True)]


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
            out[t.key] = (dict(b.params), float(b.value))
    return out


__all__ = ["TaskResult", "best_configs", "tune"]
