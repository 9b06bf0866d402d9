"""Running tuning trials: candidates are built in parallel (one build slot per core), each measured in a child
process as its build finishes, so that a candidate which aborts, segfaults, raises or hangs fails its own trial
(with the error kind and the detail) and the task still finishes with its other trials, and a slow build holds
its own slot only. The stand-in measurer here builds by sleeping and measures with the analytical model; the child
misbehaves on the configurations it is told to."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import optuna
import pytest

from onnx_gtco.families.gemm.kernel import gemm_problem
from onnx_gtco.tune.builder import Artifact, BuildResult, LocalBuilder, build_and_run
from onnx_gtco.tune.driver import tune
from onnx_gtco.tune.runner import LocalRunner, exit_reason
from onnx_gtco.tune.scheduler import Curve, Policy, next_round, next_task
from onnx_gtco.tune.search import Measurement, analytical_guesses, open_storage, predict_us, study_name
from onnx_gtco.tune.tasks import Task, template_version
from onnx_gtco.tune.trials import command_line


def _key(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


class Child:
    """The child's measurer: the analytical model, except for the configurations `bad` names (by _key), which
    abort the process, segfault, raise as a CUDA fault would, or hang."""

    def __init__(self, bad: Mapping[str, str]) -> None:
        self.bad = dict(bad)

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        what = self.bad.get(artifact.symbol)
        if what == "abort":
            os.abort()
        if what == "segfault":
            ctypes.string_at(0)
        if what == "raise":
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        if what == "hang":
            time.sleep(3600)
        return Measurement(predict_us(task, config), runs=1)


class StandIn:
    """A measurer that builds apart (SplitMeasurer): a build sleeps `build_s` and is counted while in flight, the
    configurations in `broken` fail to build (or raise, for "raise"), and runs go to a LocalRunner child (Child).
    With `gather`, the first builds wait (up to `timeout_s`) until `gather` of them are in flight at once: a driver
    that builds side by side gets there whatever the machine's load, one that builds one at a time never does."""

    name = "stand-in"
    device = "stand-in GPU"

    def __init__(self, bad: Mapping[str, str] | None = None, broken: Mapping[str, str] | None = None,
                 build_s: float = 0.0, timeout_s: float = 60.0, gather: int = 0) -> None:
        self.runner = LocalRunner(functools.partial(Child, dict(bad or {})), timeout_s=timeout_s)
        self.broken = dict(broken or {})
        self.build_s, self.gather, self.timeout_s = build_s, gather, timeout_s
        self.lock = threading.Condition()
        self.in_flight = self.most_in_flight = self.builds = 0

    def build(self, task: Task, config: Mapping[str, Any]) -> BuildResult:
        with self.lock:
            self.in_flight += 1
            self.builds += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.lock.notify_all()
            if not self.lock.wait_for(lambda: self.most_in_flight >= self.gather, timeout=self.timeout_s):
                self.gather = 0  # never gathered: the rest go straight on (the test's count says so)
        try:
            time.sleep(self.build_s)
            why = self.broken.get(_key(config))
            if why == "raise":
                raise OSError("nvcc vanished")
            if why is not None:
                return BuildResult(None, "compile", why)
            return BuildResult(Artifact("stand-in.so", _key(config)))
        finally:
            with self.lock:
                self.in_flight -= 1

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        return self.runner.run(task, config, artifact)

    def measure(self, task: Task, config: Mapping[str, Any]) -> Measurement:
        return build_and_run(self, task, config)

    def environment(self) -> dict[str, str]:
        return {"measurer": self.name, "gpu": self.device}


def _task(n: int = 768) -> Task:
    return Task(gemm_problem("f16", 1, 197, n, 768, bias=True, activation="gelu_erf"), "sm_80", template_version())


def _trials(url: str, task: Task, device: str = StandIn.device) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=study_name(task, device), storage=open_storage(url))
    return sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)


def _failed(trials: list[optuna.trial.FrozenTrial], kind: str | None = None) -> list[optuna.trial.FrozenTrial]:
    """The failed trials of error kind `kind`, or (None) those that failed when built or measured: not the ones
    the family's check rejected (error kind "invalid"), which TPE's sampled configurations may be."""
    return [t for t in trials if t.state == optuna.trial.TrialState.FAIL
            and (t.user_attrs.get("error_kind") == kind if kind else t.user_attrs.get("error_kind") != "invalid")]


@pytest.mark.parametrize(("what", "kind", "reason"), [
    ("abort", "crash", "killed by SIGABRT"),
    ("segfault", "crash", "killed by SIGSEGV"),
    ("raise", "runtime", "cudaErrorIllegalAddress"),
])
def test_a_candidate_that_kills_its_process_fails_its_trial_only(what: str, kind: str, reason: str) -> None:
    task = _task()
    guesses = analytical_guesses(task)
    victim = guesses[1]  # the study's second trial (its guesses are enqueued first)
    meas = StandIn(bad={_key(victim): what})
    url = f"memory:crash-{what}"
    try:
        (result,) = tune([task], trials=6, measurer=meas, storage=url, patience=50, jobs=3)
    finally:
        meas.runner.close()
    trials = _trials(url, task)
    assert result.trials == 6 == len(trials) and result.stop == "trial limit"
    assert all(t.state.is_finished() for t in trials)
    (bad,) = _failed(trials)
    assert bad.params == victim and bad.user_attrs["error_kind"] == kind and reason in bad.user_attrs["error"]
    if what == "abort":  # the child's fault handler wrote the Python stack of the signal to its log
        assert "Fatal Python error: Aborted" in bad.user_attrs["error"]
    ok = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(ok) == 6 - len(_failed(trials, "invalid")) - 1
    assert all(t.value == pytest.approx(predict_us(task, t.params)) for t in ok)
    assert result.best_config != victim
    assert meas.runner.started == 2  # the faulted child was replaced for the trials after it


def test_a_hanging_candidate_is_killed_at_its_timeout() -> None:
    task = _task()
    victim = analytical_guesses(task)[0]
    meas = StandIn(bad={_key(victim): "hang"}, timeout_s=3.0)
    url = "memory:hang"
    start = time.monotonic()
    try:
        (result,) = tune([task], trials=4, measurer=meas, storage=url, patience=50, jobs=2)
    finally:
        meas.runner.close()
    assert time.monotonic() - start < 60  # not the hour the candidate sleeps
    trials = _trials(url, task)
    (bad,) = _failed(trials)
    assert bad.params == victim and bad.user_attrs["error_kind"] == "timeout"
    assert "no result within 3 s; the measuring process was killed" in bad.user_attrs["error"]
    ok = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert result.trials == 4 and len(ok) == 3 - len(_failed(trials, "invalid"))


def test_builds_run_in_parallel_and_a_failed_build_is_a_failed_trial() -> None:
    tasks = [_task(768), _task(3072)]
    first, second = analytical_guesses(tasks[0])[:2]
    meas = StandIn(broken={_key(first): "ptxas error: too many resources", _key(second): "raise"}, build_s=0.4,
                   gather=4)
    url = "memory:parallel-builds"
    try:
        results = tune(tasks, trials=4, measurer=meas, storage=url, patience=50, jobs=4)
    finally:
        meas.runner.close()
    assert meas.most_in_flight == 4  # 4 build slots, all busy at once: builds side by side, not one after another
    assert all(r.trials == 4 for r in results)
    both = [t for task in tasks for t in _trials(url, task)]
    assert meas.builds == len(both) - len(_failed(both, "invalid"))  # every valid candidate, once
    trials = _trials(url, tasks[0])
    by_params = {_key(t.params): t for t in trials}
    broken, raised = by_params[_key(first)], by_params[_key(second)]
    assert broken.state == raised.state == optuna.trial.TrialState.FAIL
    assert broken.user_attrs["error_kind"] == "compile" and broken.user_attrs["error"] == "ptxas error: too many " \
        "resources"
    assert raised.user_attrs["error_kind"] == "compile" and raised.user_attrs["error"] == "OSError: nvcc vanished"
    assert all(t.user_attrs["build_s"] >= 0.4 for t in trials if t.user_attrs.get("error_kind") != "invalid")
    assert all(t.user_attrs["command"] == command_line() for t in trials)


class HeldBuild(StandIn):
    """Builds `held` until `quick` other trials of the study are told COMPLETE (or `deadline_s` passes): a slow
    build (a CUTLASS instance, at scale) whose length is set by what happens beside it, not by the clock, so that
    a loaded machine cannot make the quick ones look serialized behind it."""

    def __init__(self, held: Mapping[str, Any], url: str, task: Task, quick: int, deadline_s: float) -> None:
        super().__init__(build_s=0.1)
        self.held, self.url, self.task, self.quick, self.deadline_s = _key(held), url, task, quick, deadline_s
        self.held_s = 0.0

    def build(self, task: Task, config: Mapping[str, Any]) -> BuildResult:
        if _key(config) != self.held:
            return super().build(task, config)
        start = time.monotonic()
        while time.monotonic() - start < self.deadline_s:
            done = [t for t in _trials(self.url, self.task) if t.state == optuna.trial.TrialState.COMPLETE]
            if len(done) >= self.quick:
                break
            time.sleep(0.05)
        self.held_s = time.monotonic() - start
        return BuildResult(Artifact("stand-in.so", self.held))


def test_a_slow_build_holds_its_own_slot_only() -> None:
    """A build that lasts until three quick ones are told beside it: it ends before its deadline only if the quick
    ones are measured and told while it builds, and their freed slot takes new trials meanwhile. A driver that
    waited for every build of a round would hold it to the deadline with fewer than three told. The deadline only
    bounds that failure, so it is far above what the quick trials take on a loaded machine (beside the rest of the
    suite on 2 cores, three of them were once not told within 60 s: their measurements start a fresh interpreter).
    """
    task = _task()
    slow = analytical_guesses(task)[0]
    url = "memory:slow-build"
    meas = HeldBuild(slow, url, task, quick=3, deadline_s=600.0)
    try:
        tune([task], trials=10, measurer=meas, storage=url, patience=50, jobs=2)
    finally:
        meas.runner.close()
    trials = _trials(url, task)
    (late,) = [t for t in trials if t.params == slow]
    built = [t for t in trials if t.number != late.number and "build_s" in t.user_attrs]
    before = [t for t in built if t.datetime_complete < late.datetime_complete]
    assert meas.held_s < meas.deadline_s, [(t.number, t.user_attrs["build_s"]) for t in built]
    assert len(before) >= 3, [(t.number, t.user_attrs["build_s"]) for t in built]  # told while the slow one built
    assert late.state == optuna.trial.TrialState.COMPLETE and late.user_attrs["build_s"] >= meas.held_s - 0.01


class Interrupted(StandIn):
    """Interrupted (as by Ctrl-C) when it is to measure the configuration `stop_at`."""

    def __init__(self, stop_at: Mapping[str, Any]) -> None:
        super().__init__(build_s=0.2)
        self.stop_at = _key(stop_at)

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        if artifact.symbol == self.stop_at:
            raise KeyboardInterrupt
        return super().run(task, config, artifact)


def test_an_interrupt_fails_the_trials_in_flight_and_leaves_none_running() -> None:
    task = _task()
    meas = Interrupted(analytical_guesses(task)[1])
    url = "memory:interrupted"
    try:
        with pytest.raises(KeyboardInterrupt):
            tune([task], trials=8, measurer=meas, storage=url, patience=50, jobs=3)
    finally:
        meas.runner.close()
    trials = _trials(url, task)
    assert trials and all(t.state.is_finished() for t in trials)  # none left RUNNING to hold a slot
    cut = [t for t in trials if t.state == optuna.trial.TrialState.FAIL and "error_kind" not in t.user_attrs]
    assert cut and any(t.params == analytical_guesses(task)[1] for t in cut)


def test_a_runner_child_that_cannot_start_is_one_clear_error() -> None:
    from onnx_gtco.errors import GtcoError

    with pytest.raises(GtcoError, match="the measuring process could not start: ZeroDivisionError"):
        LocalRunner(functools.partial(divmod, 1, 0)).run(_task(), {}, Artifact("x", "y"))


def test_exit_reasons_in_words() -> None:
    assert exit_reason(-6) == "killed by SIGABRT" and exit_reason(3) == "exit status 3"


def test_command_line_names_the_cli_and_hides_passwords() -> None:
    argv = ["/venv/bin/onnx-gtco", "optimize", "m.onnx", "--storage", "postgresql://me:secret@db/tune"]
    assert command_line(argv) == "onnx-gtco optimize m.onnx --storage 'postgresql://me:***@db/tune'"
    assert command_line(["tools/tune_rate.py", "--jobs", "2"]) == "tune_rate.py --jobs 2"


def test_next_round_is_next_task_for_one_and_counts_the_trials_in_flight() -> None:
    policy = Policy(limit=10, patience=100)
    curves = [Curve(1, [5.0, 4.0]), Curve(3, [9.0, 9.0, 8.0]), Curve(2, [])]
    assert next_round(curves, policy, 1) == [next_task(curves, policy)]
    # the unmeasured task gets one trial first; the round's others go by weight x gain, each pick lowering its
    # task's priority (ranked here as next_task would with that pick's trial finished without gain)
    picks = next_round(curves, policy, 6)
    assert picks[0] == 2 and 2 not in picks[1:] and len(picks) == 6
    shadow = [Curve(c.weight, list(c.times)) for c in curves[:2]]
    for i in picks[1:]:
        assert i == next_task(shadow, policy)
        shadow[i].times.append(None)
    # unmeasured tasks share a round, heaviest first; no task gets more than its room
    fresh = [Curve(1), Curve(4), Curve(2)]
    assert next_round(fresh, policy, 5) == [1, 2, 0, 1, 2]
    assert next_round(fresh, policy, 5, room=[0, 1, 1]) == [1, 2]
    assert next_round([Curve(1, [1.0] * 10)], policy, 3) == []  # at its limit
    # trials already in flight count as picks made: the unmeasured task with one in flight waits behind the others
    assert next_round(curves, policy, 1, pending=[0, 0, 1]) == [1]
    assert next_round(fresh, policy, 1, room=[0, 0, 1], pending=[0, 1, 0]) == [2]


def test_a_builder_refuses_zero_jobs() -> None:
    with pytest.raises(ValueError, match="jobs=0"):
        LocalBuilder(0)
