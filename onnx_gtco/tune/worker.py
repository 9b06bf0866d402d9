"""Tuning workers: any number of processes, on one machine or many, working through the studies of one storage.

A study knows its task (user attribute "task") and its budget (user attribute "trials", the per-task total that
the last `optimize --tune-trials N` asked for). A worker runs trials (trials.run_trials) until no study of its
measurer's device is open: whenever a build slot is free (one per core, `jobs`, for a measurer that builds and runs
apart, the GPU measurer; a single one for the analytical model, which has nothing to build), it takes a trial of the
open study the scheduler ranks first, counting the trials in flight (scheduler.next_round). Optuna's RDB and journal
storages give every trial its own number and pop an enqueued configuration for one worker only, so no trial is
measured twice; each trial is told as soon as it is measured, so a worker killed mid-run loses only its trials in
flight, which an RDB storage's heartbeat marks stale (failed) and re-enqueues for whoever runs next (a journal has
no heartbeats: they stay RUNNING).

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

from onnx_gtco.tune.builder import LocalBuilder
from onnx_gtco.tune.scheduler import Curve, Policy, next_round, stopped
from onnx_gtco.tune.search import Measurer, open_storage, study_for, study_name, times
from onnx_gtco.tune.tasks import Task, task_from_attrs
from onnx_gtco.tune.trials import run_trials


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
         jobs: int | None = None, progress: Callable[[Task, optuna.trial.FrozenTrial], None] | None = None) -> int:
    """Run trials of the storage's open studies of `measurer.device` (only those named in `keys`, when
    given) until none is open; returns how many trials this worker ran. `jobs`: candidates built at a time for a
    measurer that builds apart (default: one per core; trials.run_trials)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    store = open_storage(storage)
    suffix = f"@{measurer.device}"
    studies: list[_Open] = []
    for summary in optuna.get_all_study_summaries(store, include_best_trial=False):
        name = summary.study_name
        if not name.endswith(suffix) or "task" not in summary.user_attrs or "trials" not in summary.user_attrs:
            continue
        task = task_from_attrs(summary.user_attrs)
        if study_name(task, measurer.device) != name or (keys is not None and task.key not in keys):
            continue  # another template version's study (its key no longer matches), or not asked for
        study = optuna.load_study(study_name=name, storage=store)
        target = summary.user_attrs.get("target_us")
        studies.append(_Open(study, task, Curve(task.weight, target=None if target is None else float(target)),
                             int(summary.user_attrs["trials"])))
    name = f"{os.uname().nodename}:{os.getpid()}"

    def pick(flying: Mapping[str, int]) -> tuple[optuna.Study, Task] | None:
        """The study the scheduler ranks first, its curves read afresh (other workers add trials), or None."""
        running = []
        for o in studies:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                # a dead worker's trial must not hold its slot: fail it (and re-enqueue it) before counting
                optuna.storages.fail_stale_trials(o.study)
            o.curve.times = times(o.study)
            running.append(_running(o.study))  # this process's trials in flight among them
        open_ = [(o, o.limit - len(o.curve.times) - r) for o, r in zip(studies, running, strict=True)
                 if stopped(o.curve, Policy(limit=o.limit, patience=patience)) is None]
        picks = next_round([o.curve for o, _ in open_], Policy(limit=10**9, patience=patience), 1,
                           [room for _, room in open_], [flying.get(o.study.study_name, 0) for o, _ in open_])
        return (open_[picks[0]][0].study, open_[picks[0]][0].task) if picks else None

    return run_trials(pick, measurer, builder=LocalBuilder(jobs), worker=name, progress=progress)


def spawn(storage: str, count: int, keys: set[str], patience: int) -> list[subprocess.Popen]:
    """Start `count` tune-worker processes on the storage (for optimize --workers)."""
    cmd = [sys.executable, "-m", "onnx_gtco", "tune-worker", "--storage", storage, "--patience", str(patience),
           *(f"--task={k}" for k in sorted(keys))]
    return [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(count)]


__all__ = ["prepare", "spawn", "work"]
