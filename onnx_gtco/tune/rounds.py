"""A tuning round: ask the studies for a batch of trials, build the batch at once, then measure and tell each trial.

1. ask: one trial per pick (study.ask; an enqueued configuration first, as the study's analytical guesses and a
   dead worker's re-enqueued trial are), its configuration suggested; one the family's check rejects is told at
   once as failed with error kind "invalid", unmeasured.
2. build: a measurer that builds and runs apart (builder.SplitMeasurer: the GPU measurer) has every remaining
   candidate built by the LocalBuilder, as many at a time as there are cores; a failed build is its trial's
   failure (compile / resource / runtime), with the detail.
3. run and tell: the built candidates are measured one by one (the GPU measurer's runs in a child process,
   runner.LocalRunner: a crash or a hang fails that trial only), and each trial is told its time or its failure
   as soon as it has one. A measurer without a build step measures each candidate here, in this process.

While the round runs, its trials' heartbeats are recorded (a storage with heartbeats: RDB), so that a process
killed mid-round leaves trials that the next process fails and enqueues again; an exception (an interrupt) fails
the round's trials it has not told, as Study.optimize would. Each trial records the command that ran it
("command") and, when built, its build's wall time ("build_s").
"""

from __future__ import annotations

import math
import re
import shlex
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import optuna

from onnx_gtco.tune.builder import LocalBuilder, SplitMeasurer, is_split
from onnx_gtco.tune.search import Measurement, Measurer, check, record, suggest
from onnx_gtco.tune.tasks import Task

Progress = Callable[[Task, optuna.trial.FrozenTrial], None]


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


def run_round(picks: Sequence[tuple[optuna.Study, Task]], measurer: Measurer, *,
              builder: LocalBuilder | None = None, worker: str = "", progress: Progress | None = None
              ) -> list[optuna.trial.FrozenTrial]:
    """One round (see the module docstring) of one trial per (study, task) in `picks` (a study may appear more
    than once); returns the finished trials in the order they were told. `builder` defaults to a LocalBuilder
    with one build per core; `progress` is called after each trial is told."""
    asked: list[_Candidate] = []
    done: list[optuna.trial.FrozenTrial] = []
    command = command_line()

    def tell(c: _Candidate, value: float) -> None:
        frozen = (c.study.tell(c.trial, state=optuna.trial.TrialState.FAIL) if math.isnan(value)
                  else c.study.tell(c.trial, value))
        c.told = True
        done.append(frozen)
        if progress is not None:
            progress(c.task, frozen)

    try:
        for study, task in picks:
            with warnings.catch_warnings():  # this round records its trials' heartbeats itself (_heartbeats)
                warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used", UserWarning)
                trial = study.ask()
            c = _Candidate(study, task, trial)
            asked.append(c)
            if worker:
                c.trial.set_user_attr("worker", worker)
            c.trial.set_user_attr("command", command)
            c.config = suggest(c.trial, task)
            why = check(task, c.config)
            if why is not None:
                tell(c, record(c.trial, measurer, Measurement(None, error_kind="invalid", detail=why)))
        live = [c for c in asked if not c.told]
        with _heartbeats(live):
            if is_split(measurer):
                split = cast(SplitMeasurer, measurer)
                builds = (builder or LocalBuilder()).build(split, [(c.task, c.config) for c in live])
                for c, b in zip(live, builds, strict=True):
                    c.trial.set_user_attr("build_s", round(b.seconds, 3))
                    failure = b.failure
                    m = failure if failure is not None or b.artifact is None else split.run(c.task, c.config,
                                                                                           b.artifact)
                    tell(c, record(c.trial, measurer, m))
            else:
                for c in live:
                    tell(c, record(c.trial, measurer, measurer.measure(c.task, c.config)))
    except BaseException:
        for c in asked:
            if not c.told:
                c.study.tell(c.trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        raise
    return done


def run_trial(study: optuna.Study, task: Task, measurer: Measurer, worker: str = "") -> optuna.trial.FrozenTrial:
    """One trial of `study`: a round of one (suggest a configuration, reject it unmeasured when invalid, else build
    and measure it). A failed trial's user attributes say why (error_kind, error)."""
    return run_round([(study, task)], measurer, builder=LocalBuilder(1), worker=worker)[0]


@contextmanager
def _heartbeats(candidates: Sequence[_Candidate]) -> Iterator[None]:
    """Record the candidates' heartbeats every interval while the block runs, where their storage keeps them
    (Study.optimize does so for the one trial it runs; ask and tell leave it to the caller)."""
    beats = []
    for c in candidates:
        storage = c.study._storage  # the study's storage: Optuna keeps no public handle on it
        interval = storage.get_heartbeat_interval() if hasattr(storage, "record_heartbeat") else None
        if interval:
            beats.append((storage, c.trial._trial_id, interval))
    if not beats:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            for storage, trial_id, _ in beats:
                storage.record_heartbeat(trial_id)
            if stop.wait(min(i for _, _, i in beats)):
                return

    thread = threading.Thread(target=beat, name="gtco-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


__all__ = ["command_line", "run_round", "run_trial"]
