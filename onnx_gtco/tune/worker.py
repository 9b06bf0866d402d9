"""Tuning workers: any number of processes, on one machine or many, working through the studies of one storage.

A study knows its task (user attribute "task") and its budget (user attribute "trials", the per-task total that
the last `optimize --tune-trials N` asked for). A worker repeatedly takes the open study the scheduler ranks first
among those of its measurer's device and runs one trial of it, until no study of that device is open. Optuna's RDB
storage gives every trial its own number and pops an enqueued configuration for one worker only, so no trial is
measured twice; a finished trial is committed before the next starts, so a worker killed mid-trial loses only the
trial it was running, which the heartbeat marks stale (failed) and re-enqueues for whoever runs next.

`optimize --workers K` starts K - 1 `onnx-gtco tune-worker` processes beside its own loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import optuna

from onnx_gtco.kernels.family import Problem
from onnx_gtco.tune.scheduler import Curve, Policy, next_task, stopped
from onnx_gtco.tune.search import Measurer, open_storage, run_trial, study_for, study_name, times
from onnx_gtco.tune.tasks import Task


def task_of(attrs: dict) -> Task:
    """The Task a study's "task" user attribute describes."""
    a = attrs["task"]
    flags = {k: tuple(v) if isinstance(v, list) else v for k, v in a["flags"]}
    problem = Problem.make(a["family"], a["dtype"], {k: v for k, v in a["sizes"]}, flags)
    return Task(problem, a["arch"], a["version"], int(attrs.get("weight", 1)))


def prepare(tasks: list[Task], trials: int, storage: str, device: str, seed: int = 0,
            targets: Mapping[str, float] | None = None) -> None:
    """Create (or update) the studies of `tasks` with their budget, weight and optional target time (task key ->
    microseconds: the task stops once its best reaches it), so that workers can take them."""
    store = open_storage(storage)
    for t in tasks:
        s = study_for(t, store, device, seed)
        s.set_user_attr("trials", int(trials))
        s.set_user_attr("weight", int(t.weight))
        if targets and t.key in targets:
            s.set_user_attr("target_us", float(targets[t.key]))


@dataclass
class _Open:
    study: optuna.Study
    task: Task
    curve: Curve
    limit: int


def _running(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)))


def work(storage: str, measurer: Measurer, *, keys: set[str] | None = None, patience: int = 20,
         progress: Callable[[Task, optuna.trial.FrozenTrial], None] | None = None) -> int:
    """Run trials of the storage's open studies of `measurer.device` (only those named in `keys`, when given)
    until none is open; returns how many trials this worker ran."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    store = open_storage(storage)
    suffix = f"@{measurer.device}"
    studies: list[_Open] = []
    for summary in optuna.get_all_study_summaries(store, include_best_trial=False):
        name = summary.study_name
        if not name.endswith(suffix) or "task" not in summary.user_attrs or "trials" not in summary.user_attrs:
            continue
        task = task_of(summary.user_attrs)
        if study_name(task, measurer.device) != name or (keys is not None and task.key not in keys):
            continue  # another template version's study (its key no longer matches), or not asked for
        study = optuna.load_study(study_name=name, storage=store)
        target = summary.user_attrs.get("target_us")
        studies.append(_Open(study, task, Curve(task.weight, target=None if target is None else float(target)),
                             int(summary.user_attrs["trials"])))
    ran = 0
    while True:
        for o in studies:  # other workers add trials: refresh every curve
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                # a dead worker's trial must not hold its slot: fail it (and re-enqueue it) before counting
                optuna.storages.fail_stale_trials(o.study)
            o.curve.times = times(o.study)
        open_ = [o for o in studies
                 if stopped(o.curve, Policy(limit=o.limit, patience=patience)) is None
                 and len(o.curve.times) + _running(o.study) < o.limit]
        if not open_:
            return ran
        i = next_task([o.curve for o in open_], Policy(limit=10**9, patience=patience))
        if i is None:
            return ran
        o = open_[i]
        record = run_trial(o.study, o.task, measurer, worker=f"{os.uname().nodename}:{os.getpid()}")
        ran += 1
        if progress is not None:
            progress(o.task, record)


def spawn(storage: str, count: int, keys: set[str], patience: int) -> list[subprocess.Popen]:
    """Start `count` tune-worker processes on the storage (for optimize --workers)."""
    cmd = [sys.executable, "-m", "onnx_gtco", "tune-worker", "--storage", storage, "--patience", str(patience),
           *(f"--task={k}" for k in sorted(keys))]
    return [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(count)]


__all__ = ["prepare", "spawn", "task_of", "work"]
