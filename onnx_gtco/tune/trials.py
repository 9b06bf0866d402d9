"""Running tuning trials: ask a study for a trial, build it beside the others in flight, measure it, tell the study.

`run_trials(pick, measurer)` keeps a window of candidates in flight, one per build slot (LocalBuilder.jobs: one per
core), and runs until `pick` has nothing more to give:

1. ask: while a build slot is free, `pick` names the study and task the scheduler ranks first (given the trials
   already in flight); the study gives a trial (study.ask: an enqueued configuration first, as the study's
   analytical guesses and a dead worker's re-enqueued trial are) and its configuration is suggested. One the
   family's check rejects is told at once as failed with error kind "invalid", unmeasured.
2. build: a measurer that builds and runs apart (builder.SplitMeasurer: the GPU measurer) has the candidate built
   in a build slot (nvcc through the kernel cache); a failed build is its trial's failure (compile / resource /
   runtime), with the detail.
3. run and tell: each candidate is measured as soon as its build is done, one at a time (the GPU measurer's runs
   in a child process, runner.LocalRunner: a crash or a hang fails that trial only), while the other slots keep
   building, and its trial is told at once; the freed slot asks for the next trial. A round of one slot per core is
   thus always building: a slow build (a CUTLASS instance takes a minute of nvcc) holds its own slot only, never
   the measurements of the builds that finished beside it.

A measurer without a build step (the analytical model) has one slot and measures each candidate at once, in this
process: one trial after another, as the scheduler picks them.

While trials are in flight their heartbeats are recorded (a storage with heartbeats: RDB), so that a process killed
mid-run leaves trials that the next process fails and enqueues again; an exception (an interrupt) fails the trials
in flight, as Study.optimize would. Each trial records the command that ran it ("command") and, when built, its
build's wall time ("build_s").
"""

from __future__ import annotations

import math
import re
import shlex
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import optuna

from onnx_gtco.tune.builder import BuildResult, LocalBuilder, SplitMeasurer, is_split
from onnx_gtco.tune.search import Measurement, Measurer, check, record, suggest
from onnx_gtco.tune.tasks import Task

Progress = Callable[[Task, optuna.trial.FrozenTrial], None]
Pick = Callable[[Mapping[str, int]], "tuple[optuna.Study, Task] | None"]
"""The next trial's study and task, given the trials in flight per study name; None when there is none to run."""


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command this process runs, as a trial records it: `onnx-gtco ARGS` for the CLI (its script or
    `python -m onnx_gtco`), else the script's name and its arguments; a password in a URL is left out."""
    argv = list(sys.argv if argv is None else argv) or [""]
    first = Path(argv[0]).name
    head = "onnx-gtco" if first == "onnx-gtco" or argv[0].endswith(("onnx_gtco/__main__.py", "-m")) else first
    args = [re.sub(r"(://[^:/@\s]+):[^@\s]+@", r"\1:***@", a) for a in argv[1:]]
    return shlex.join([head, *args] if head else args)


@dataclass
class _Candidate:
    study: optuna.Study
    task: Task
    trial: optuna.Trial
    config: dict[str, Any] = field(default_factory=dict)
    told: bool = False


def run_trials(pick: Pick, measurer: Measurer, *, builder: LocalBuilder | None = None, worker: str = "",
               progress: Progress | None = None) -> int:
    """Run trials (see the module docstring) until `pick` gives none and none is in flight; returns how many were
    told. `builder` defaults to a LocalBuilder with one build slot per core; `progress` is called after each trial
    is told."""
    split = is_split(measurer)
    builder = builder or LocalBuilder()
    slots = builder.jobs if split else 1
    command = command_line()
    flying: dict[Future[BuildResult], _Candidate] = {}
    untold: dict[int, _Candidate] = {}  # the trials asked and not yet told, by id()
    beats = _Heartbeats()
    pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="gtco-build") if split else None
    told = 0

    def tell(c: _Candidate, m: Measurement) -> None:
        nonlocal told
        value = record(c.trial, measurer, m)
        frozen = (c.study.tell(c.trial, state=optuna.trial.TrialState.FAIL) if math.isnan(value)
                  else c.study.tell(c.trial, value))
        c.told = True
        untold.pop(id(c), None)
        beats.discard(c)
        told += 1
        if progress is not None:
            progress(c.task, frozen)

    def ask(study: optuna.Study, task: Task) -> _Candidate:
        with warnings.catch_warnings():  # the trials' heartbeats are recorded here (_Heartbeats)
            warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used", UserWarning)
            trial = study.ask()
        c = _Candidate(study, task, trial)
        untold[id(c)] = c
        beats.add(c)
        if worker:
            trial.set_user_attr("worker", worker)
        trial.set_user_attr("command", command)
        c.config = suggest(trial, task)
        return c

    done_ok = False
    try:
        while True:
            while len(flying) < slots:  # fill the free build slots
                got = pick(Counter(c.study.study_name for c in flying.values()))
                if got is None:
                    break
                c = ask(*got)
                why = check(c.task, c.config)
                if why is not None:
                    tell(c, Measurement(None, error_kind="invalid", detail=why))
                elif pool is None:  # nothing to build: measure it now
                    tell(c, measurer.measure(c.task, c.config))
                else:
                    flying[pool.submit(builder.build_one, cast(SplitMeasurer, measurer), c.task, c.config)] = c
            if not flying:
                done_ok = True
                return told
            done, _ = wait(list(flying), return_when=FIRST_COMPLETED)
            f = min(done, key=lambda f: flying[f].trial.number)  # one measurement, then the freed slot refills
            c = flying.pop(f)
            built = f.result()
            c.trial.set_user_attr("build_s", round(built.seconds, 3))
            failure = built.failure
            if failure is not None or built.artifact is None:
                tell(c, failure or Measurement(None, error_kind="compile"))
            else:
                tell(c, cast(SplitMeasurer, measurer).run(c.task, c.config, built.artifact))
    except BaseException:
        for c in list(untold.values()):
            c.study.tell(c.trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        raise
    finally:
        beats.stop()
        if pool is not None:  # after an error, builds still running finish in the background; nothing waits
            pool.shutdown(wait=done_ok, cancel_futures=True)


def run_trial(study: optuna.Study, task: Task, measurer: Measurer, worker: str = "") -> optuna.trial.FrozenTrial:
    """One trial of `study` (suggest a configuration, reject it unmeasured when invalid, else build and measure
    it). A failed trial's user attributes say why (error_kind, error)."""
    given: list[bool] = []
    out: list[optuna.trial.FrozenTrial] = []

    def once(flying: Mapping[str, int]) -> tuple[optuna.Study, Task] | None:
        if given:
            return None
        given.append(True)
        return study, task

    run_trials(once, measurer, builder=LocalBuilder(1), worker=worker, progress=lambda t, frozen: out.append(frozen))
    return out[0]


class _Heartbeats:
    """Records the heartbeats of the trials in flight every interval, where their storage keeps them (Study.optimize
    does so for the one trial it runs; ask and tell leave it to the caller)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trials: dict[int, tuple[Any, int]] = {}
        self._interval: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, c: _Candidate) -> None:
        storage = c.study._storage  # the study's storage: Optuna keeps no public handle on it
        interval = storage.get_heartbeat_interval() if hasattr(storage, "record_heartbeat") else None
        if not interval:
            return
        trial_id = c.trial._trial_id
        storage.record_heartbeat(trial_id)
        with self._lock:
            self._trials[trial_id] = (storage, trial_id)
            self._interval = min(self._interval or interval, interval)
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="gtco-heartbeat", daemon=True)
            self._thread.start()

    def discard(self, c: _Candidate) -> None:
        with self._lock:
            self._trials.pop(c.trial._trial_id, None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval or 1.0):
            with self._lock:
                trials = list(self._trials.values())
            for storage, trial_id in trials:
                storage.record_heartbeat(trial_id)


__all__ = ["Pick", "command_line", "run_trial", "run_trials"]
