"""One Optuna study per task, in a storage every later run reuses: the tuning database.

A study is named by its task's key (tasks.Task.key) and keeps the task in its user attributes, so any process
with the storage URL can work on it. A trial suggests one value per tunable parameter of the family's space
(seeded TPE); a configuration the family's validity check rejects is a failed trial with error kind "invalid" and
the reason, recorded without measuring. Each study starts from the analytical model's best few configurations
(`enqueue_trial`). A measured trial records the median time, its spread, the error kind of a failed run
(compile / resource / runtime / wrong_answer / timeout), and the measurer's environment (GPU, driver, toolchain).

Storage: `--storage URL` > $GTCO_TUNE_STORAGE > SQLite in the user cache (cache_root()/tuning.db). Any Optuna RDB
URL works (PostgreSQL for a team); the dashboard opens it: `optuna-dashboard URL`.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import optuna

from onnx_gtco.config import TUNE_DELAY_ENV, TUNE_STORAGE_ENV, tune_storage_env, tune_test_delay_s
from onnx_gtco.errors import GtcoError, first_line, missing_package
from onnx_gtco.kernels import cublaslt
from onnx_gtco.kernels.select import FAMILIES
from onnx_gtco.kernels.toolchain import cache_root
from onnx_gtco.tune.analytical import estimate_us
from onnx_gtco.tune.tasks import Task

STORAGE_ENV = TUNE_STORAGE_ENV
DELAY_ENV = TUNE_DELAY_ENV  # seconds each analytical measurement sleeps (tests of workers only)
SEEDS = 3          # analytical guesses enqueued per study
HEARTBEAT_S = 2    # a running trial proves its worker alive this often
ERROR_KINDS = ("invalid", "compile", "resource", "runtime", "wrong_answer", "timeout")


def storage_url(explicit: str | None = None) -> str:
    """The tuning storage: `explicit`, else $GTCO_TUNE_STORAGE, else SQLite in the user cache."""
    if explicit:
        return explicit
    from_env = tune_storage_env()
    if from_env:
        return from_env
    path = cache_root() / "tuning.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


MEMORY_PREFIX = "memory:"
_MEMORY: dict[str, optuna.storages.InMemoryStorage] = {}


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An RDB storage with heartbeats: a worker killed mid-trial leaves a RUNNING trial whose heartbeat stops; the
    next process to run a trial of that study marks it failed (finished trials are committed already) and
    enqueues its configuration again, once.

    `memory:NAME` is Optuna's in-memory storage, one per name and process: nothing persists and no other process
    (no tune-worker) can join; for experiments and tests that only count trials."""
    if url.startswith(MEMORY_PREFIX):
        return _MEMORY.setdefault(url, optuna.storages.InMemoryStorage())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=HEARTBEAT_S, grace_period=3 * HEARTBEAT_S,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
        except ImportError as e:  # the database driver of the URL's scheme (psycopg2 for postgresql://), which
            # optuna re-raises as its own ImportError
            missing = next((getattr(x, "name", None) for x in (e, e.__cause__, e.__context__)
                            if isinstance(x, ModuleNotFoundError) and x.name), None)
            what = f"the tuning storage {url.split(':')[0]}://"
            if missing:
                raise missing_package(missing, what) from None
            raise GtcoError(f"{what}: {first_line(e)}") from None


@dataclass(frozen=True)
class Measurement:
    """What one run of a configuration gave: a time, or the error kind that made the trial fail."""

    median_us: float | None
    spread_us: float = 0.0
    error_kind: str | None = None
    detail: str = ""
    runs: int = 0


class Measurer(Protocol):
    """Times one configuration of a task. `device` names what it measures on (the study is per device);
    `environment()` goes into every trial's record."""

    name: str
    device: str

    def measure(self, task: Task, config: Mapping[str, int]) -> Measurement: ...

    def environment(self) -> dict[str, str]: ...


class AnalyticalMeasurer:
    """The analytical model as a measurer: deterministic, no GPU; runs the whole tuning path in CI."""

    name = "analytical"
    device = "analytical"

    def __init__(self) -> None:
        self.calls = 0

    def measure(self, task: Task, config: Mapping[str, int]) -> Measurement:
        self.calls += 1
        delay = tune_test_delay_s()
        if delay > 0:  # test hook: a measurement that takes time, so tests can kill a worker mid-trial
            time.sleep(delay)
        return Measurement(estimate_us(task.problem, config, task.arch), 0.0, runs=1)

    def environment(self) -> dict[str, str]:
        return {"measurer": self.name, "gpu": "none (analytical model)", "driver": "", "toolchain": ""}


def search_space(task: Task) -> dict[str, list[int]]:
    """Parameter -> the values a trial may suggest: the family's tunable space plus its optional parameters (VEC
    both ways around its default, the others fixed at theirs)."""
    family = FAMILIES.get(task.problem.family)
    if family is None:
        raise ValueError(f"no kernel family {task.problem.family!r} to tune")
    space = {k: list(v) for k, v in family.space.items()}
    for k, v in getattr(family, "optional", {}).items():
        space.setdefault(k, sorted({int(v), 0, 1}) if k == "VEC" else [int(v)])
    return space


IMPL_SPACES: dict[str, dict[str, list[int]]] = {cublaslt.IMPL: {"RANK": list(cublaslt.RANKS)}}
"""The parameters of each implementation other than the family's own kernels ("mma")."""


def impls(task: Task) -> list[str]:
    """The implementations a trial of `task` may pick: "mma" (the family's generated kernels), then each library
    implementation of the family (GemmFamily.impls) that can compute the task's problem."""
    family = FAMILIES[task.problem.family]
    others = [i for i in getattr(family, "impls", ()) if i in IMPL_SPACES]
    return ["mma", *(i for i in others if family.check(
        task.problem, {"impl": i, **{k: v[0] for k, v in IMPL_SPACES[i].items()}}, task.arch) is None)]


def suggest(trial: optuna.Trial, task: Task) -> dict[str, Any]:
    """A trial's configuration: with several implementations, "impl" first, then that implementation's parameters
    (a conditional space); with the family's kernels only, their parameters (no "impl")."""
    choices = impls(task)
    if len(choices) == 1:
        return {k: trial.suggest_categorical(k, v) for k, v in search_space(task).items()}
    impl = trial.suggest_categorical("impl", choices)
    space = search_space(task) if impl == "mma" else IMPL_SPACES[impl]
    return {"impl": impl, **{k: trial.suggest_categorical(k, v) for k, v in space.items()}}


def analytical_guesses(task: Task, n: int = SEEDS) -> list[dict[str, Any]]:
    """Valid configurations ranked by the analytical model, best first: the best of each implementation (so every
    implementation is measured), then the next best of any up to `n`."""
    family = FAMILIES[task.problem.family]
    keys = list(search_space(task))
    choices = impls(task)
    per_impl: list[list[dict[str, Any]]] = []
    for impl in choices:
        if impl == "mma":
            configs: list[dict[str, Any]] = [{k: c[k] for k in keys if k in c}
                                             for c in family.configs(task.problem, task.arch)]
        else:
            configs = [{k: v for k, v in zip(IMPL_SPACES[impl], values, strict=True)}
                       for values in itertools.product(*IMPL_SPACES[impl].values())]
        if len(choices) > 1:
            configs = [{"impl": impl, **c} for c in configs]
        per_impl.append(sorted(configs, key=lambda c: estimate_us(task.problem, c, task.arch)))
    firsts = [r[0] for r in per_impl if r]
    rest = sorted((c for r in per_impl for c in r[1:]), key=lambda c: estimate_us(task.problem, c, task.arch))
    picked = firsts[:n] + rest[:max(0, n - len(firsts))]
    return sorted(picked, key=lambda c: estimate_us(task.problem, c, task.arch))


def study_name(task: Task, device: str) -> str:
    """A study per task and device: times measured on one GPU (or by the analytical model) never mix with
    another's."""
    return f"{task.key}@{device}"


def study_for(task: Task, storage: optuna.storages.BaseStorage | str, device: str, seed: int = 0) -> optuna.Study:
    """The task's study on `device` (created on first use, with the analytical guesses enqueued)."""
    study = optuna.create_study(study_name=study_name(task, device), storage=storage, direction="minimize",
                                load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))
    if "task" not in study.user_attrs:
        study.set_user_attr("task", {"family": task.problem.family, "dtype": task.problem.dtype,
                                     "sizes": [list(s) for s in task.problem.sizes],
                                     "flags": [[k, _jsonable(v)] for k, v in task.problem.flags],
                                     "arch": task.arch, "version": task.version})
        study.set_user_attr("describe", task.describe())
        for config in analytical_guesses(task):
            study.enqueue_trial(config, skip_if_exists=True)
    return study


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def measure_into(trial: optuna.Trial, measurer: Measurer, task: Task, config: Mapping[str, int]) -> float:
    """Measure `config` of `task` and record it on `trial`: the measurer's environment, runs, median and spread, or
    why it failed (error_kind, error). Returns the trial's value: the median, or NaN (Optuna's FAIL) on a failure."""
    for k, v in measurer.environment().items():
        trial.set_user_attr(k, v)
    m = measurer.measure(task, dict(config))
    trial.set_user_attr("runs", m.runs)
    if m.error_kind is not None or m.median_us is None:
        trial.set_user_attr("error_kind", m.error_kind or "runtime")
        trial.set_user_attr("error", m.detail)
        return math.nan
    trial.set_user_attr("median_us", m.median_us)
    trial.set_user_attr("spread_us", m.spread_us)
    return m.median_us


def optimize_once(study: optuna.Study, objective: Callable[[optuna.Trial], float]) -> None:
    """One trial of `objective` through Study.optimize (which keeps the trial's heartbeat)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Optuna warns about every NaN it records as a failure
        study.optimize(objective, n_trials=1, gc_after_trial=False)


def run_trial(study: optuna.Study, task: Task, measurer: Measurer, worker: str = "") -> optuna.trial.FrozenTrial:
    """Run one trial (through Study.optimize, which keeps its heartbeat): suggest a configuration, reject it
    unmeasured when invalid, else measure it. A failed trial returns NaN, which Optuna records as FAIL; the user
    attributes say why (error_kind, error)."""
    numbers: list[int] = []

    def objective(trial: optuna.Trial) -> float:
        numbers.append(trial.number)
        if worker:
            trial.set_user_attr("worker", worker)
        config = suggest(trial, task)
        why = FAMILIES[task.problem.family].check(task.problem, config, task.arch)
        if why is not None:
            for k, v in measurer.environment().items():
                trial.set_user_attr(k, v)
            trial.set_user_attr("error_kind", "invalid")
            trial.set_user_attr("error", why)
            return math.nan
        return measure_into(trial, measurer, task, config)

    optimize_once(study, objective)
    return next(t for t in reversed(study.get_trials(deepcopy=False)) if t.number == numbers[0])


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return study.get_trials(deepcopy=False, states=states)


def times(study: optuna.Study) -> list[float | None]:
    """The finished trials' times in trial order, None for a failed one: the scheduler's curve of the study."""
    done = sorted(finished(study), key=lambda t: t.number)
    return [t.value if t.state == optuna.trial.TrialState.COMPLETE else None for t in done]


def best_by_impl(study: optuna.Study) -> dict[str, float]:
    """The fastest successful time of each implementation the study measured ("mma" for a trial without "impl")."""
    out: dict[str, float] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        impl = str(t.params.get("impl", "mma"))
        if t.value is not None and math.isfinite(t.value):
            out[impl] = min(out.get(impl, math.inf), float(t.value))
    return out


def best(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return min(done, key=lambda t: (t.value, t.number)) if done else None


__all__ = ["ERROR_KINDS", "IMPL_SPACES", "STORAGE_ENV", "AnalyticalMeasurer", "Measurement", "Measurer",
           "analytical_guesses", "best", "best_by_impl", "finished", "impls", "open_storage", "run_trial",
           "search_space", "storage_url", "study_for", "study_name", "suggest", "times"]
