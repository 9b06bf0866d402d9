"""One Optuna study per task, in a storage every later run reuses: the tuning database.

A study is named by its task's key (tasks.Task.key) and keeps the task in its user attributes, so any process
with the storage URL can work on it. A trial suggests one value per tunable parameter of the family's space
(seeded TPE); a configuration the family's validity check rejects is a failed trial with error kind "invalid" and
the reason, recorded without measuring. Each study starts from the analytical model's best few configurations
(`enqueue_trial`). A measured trial records the median time, its spread, the error kind of a failed build or run
(ERROR_KINDS: compile / resource / runtime / wrong_answer / crash / timeout, with the detail in "error"), and the
measurer's environment (GPU, driver, toolchain). tune.trials runs the trials.

Storage: `--storage URL` > $GTCO_TUNE_STORAGE > SQLite in the user cache (cache_root()/tuning.db). Any Optuna RDB
URL works (PostgreSQL for a team; the dashboard opens it: `optuna-dashboard URL`); `journal:PATH` is Optuna's
journal storage, an append-only log file that several processes on one machine share (JournalFileBackend: a lock
file beside it) and that needs no SQL stack (sqlalchemy is never imported for it); `memory:NAME` an in-process
one for experiments and tests.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import optuna

from onnx_gtco.calibration import Hardware, hardware_for_arch
from onnx_gtco.config import TUNE_DELAY_ENV, TUNE_STORAGE_ENV, tune_storage_env, tune_test_delay_s
from onnx_gtco.errors import GtcoError, first_line, missing_package
from onnx_gtco.kernels.select import FAMILIES, IMPLEMENTATIONS
from onnx_gtco.kernels.toolchain import cache_root
from onnx_gtco.tune.analytical import estimate_us
from onnx_gtco.tune.tasks import Task, task_attrs

STORAGE_ENV = TUNE_STORAGE_ENV
DELAY_ENV = TUNE_DELAY_ENV  # seconds each analytical measurement sleeps (tests of workers only)
SEEDS = 3          # analytical guesses enqueued per study
HEARTBEAT_S = 2    # a running trial proves its worker alive this often
ERROR_KINDS = ("invalid", "compile", "resource", "runtime", "wrong_answer", "crash", "timeout")
"""Why a trial failed (its "error_kind" user attribute): its configuration fails the family's check (invalid), nvcc
fails (compile) or ptxas reports a spill, stack frame or no kernel (resource), the GPU cannot run its code or the
run reports an error (runtime), its answer is off the fp64 reference (wrong_answer), the measuring process dies
(crash: a segfault, an abort) or gives no answer in time and is killed (timeout)."""


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
JOURNAL_PREFIX = "journal:"
_MEMORY: dict[str, optuna.storages.InMemoryStorage] = {}


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """The storage a URL names (see the module docstring).

    An RDB URL gets heartbeats: a worker killed mid-trial leaves a RUNNING trial whose heartbeat stops; the next
    process to run a trial of that study marks it failed (finished trials are committed already) and enqueues its
    configuration again, once. A journal has no heartbeats: a killed worker's trial stays RUNNING and takes one
    slot of its task's budget.

    `memory:NAME` is Optuna's in-memory storage, one per name and process: nothing persists and no other process
    (no tune-worker) can join; for experiments and tests that only count trials.

    Raises:
        GtcoError: a journal path without a file name or in a folder that does not exist; a missing database driver.
    """
    if url.startswith(MEMORY_PREFIX):
        return _MEMORY.setdefault(url, optuna.storages.InMemoryStorage())
    if url.startswith(JOURNAL_PREFIX):
        return open_journal(url)
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


def open_journal(url: str) -> optuna.storages.JournalStorage:
    """`journal:PATH` as Optuna's JournalStorage over a JournalFileBackend at PATH (created when missing; its
    folder must exist). Opened afresh on every call: the storage replays the log, so a file another process
    appended to, or a new file at the same path, is read as it is now."""
    from optuna.storages.journal import JournalFileBackend

    text = url[len(JOURNAL_PREFIX):]
    if not text.strip():
        raise GtcoError(f"tuning storage {url!r}: give the journal file's path, e.g. journal:/data/trials.log")
    path = Path(text).expanduser()
    if path.is_dir():
        raise GtcoError(f"tuning storage {url!r}: {path} is a folder; give the journal file's path")
    if not path.parent.is_dir():
        raise GtcoError(f"tuning storage {url!r}: the folder {path.parent} does not exist")
    return optuna.storages.JournalStorage(JournalFileBackend(str(path.resolve())))


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
    `environment()` goes into every trial's record. A measurer that also splits a measurement into a build and a
    run (tune.builder.SplitMeasurer, as the GPU measurer does) has its builds run in parallel (tune.trials)."""

    name: str
    device: str

    def measure(self, task: Task, config: Mapping[str, int]) -> Measurement: ...

    def environment(self) -> dict[str, str]: ...


class AnalyticalMeasurer:
    """The estimate as a measurer (each family's estimate_us, the one the planner and the build rank by):
    deterministic, no GPU; runs the whole tuning path in CI. `hw`: the planning target's hardware (its calibration),
    for the tasks of the arch it runs; None: each task's arch's data-sheet target. Its studies are per hardware
    (`device`: "analytical" for an arch's data-sheet target, "analytical-h200" for a named GPU), so predictions for
    two GPUs never mix."""

    name = "analytical"

    def __init__(self, hw: Hardware | None = None) -> None:
        self.calls = 0
        self.hw = hw
        named = hw is not None and hw.name not in (hw.arch, "sm_80", "sm_90")
        self.device = f"analytical-{hw.name}" if named and hw is not None else "analytical"

    def measure(self, task: Task, config: Mapping[str, int]) -> Measurement:
        self.calls += 1
        delay = tune_test_delay_s()
        if delay > 0:  # test hook: a measurement that takes time, so tests can kill a worker mid-trial
            time.sleep(delay)
        return Measurement(predict_us(task, config, self.hw), 0.0, runs=1)

    def environment(self) -> dict[str, str]:
        return {"measurer": self.name, "gpu": "none (analytical model)", "driver": "", "toolchain": ""}


def search_space(task: Task) -> dict[str, list[int]]:
    """Parameter -> the values a trial may suggest: the family's tunable space plus its optional parameters (VEC
    both ways around its default, the others fixed at theirs), or, for a family whose parameters depend on the
    problem (the conv family: the direct kernel's for grouped convs, the implicit GEMM's otherwise; the GEMM family:
    no 16-byte loads or staged epilogue where K or N is not a multiple of a chunk), exactly its
    `space_for(problem)`."""
    family = FAMILIES.get(task.problem.family)
    if family is None:
        raise ValueError(f"no kernel family {task.problem.family!r} to tune")
    space_for = getattr(family, "space_for", None)
    if space_for is not None:
        return {k: list(v) for k, v in space_for(task.problem).items()}
    space = {k: list(v) for k, v in family.space.items()}
    for k, v in getattr(family, "optional", {}).items():
        space.setdefault(k, sorted({int(v), 0, 1}) if k == "VEC" else [int(v)])
    return space


def with_defaults(task: Task, config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` (the family's own kernels) on exactly the task's search-space keys, each optional parameter it
    leaves out at the family's default: the parameters of a trial that runs it. An enqueued trial missing a key
    would have the sampler pick that key's value, and measure another configuration than the one named."""
    optional = getattr(FAMILIES[task.problem.family], "optional", {})
    return {k: config[k] if k in config else optional[k] for k in search_space(task)
            if k in config or k in optional}


IMPL_SPACES: dict[str, dict[str, list[Any]]] = {n: {k: list(v) for k, v in i.space.items()}
                                               for n, i in IMPLEMENTATIONS.items()}
"""The parameters of each implementation other than the family's own kernels ("mma")."""
OFFERED = "offered"


def config_arch(task: Task, config: Mapping[str, Any]) -> str:
    """The arch a configuration of `task` is checked and built for: its implementation's (Implementation.arch_for: a
    CUTLASS configuration of a task for sm_90 is built for sm_90a, the slot the library picks on 9.0 devices, the H100
    and H200 that sm_90 models), else the task's."""
    impl = IMPLEMENTATIONS.get(str(config.get("impl", "mma")))
    return impl.arch_for.get(task.arch, task.arch) if impl is not None else task.arch


def offered(task: Task) -> dict[str, str]:
    """Each library implementation of the task's family (KernelFamily.implementations) -> "offered", or why a trial
    may not pick it (Implementation.offered: cuBLASLt where its mapping cannot express the group; CUTLASS on a task
    for another target than sm_90, without the nvidia-cutlass headers, or where its mapping cannot express the
    group). Empty for a family with its own kernels only."""
    return {i.name: i.offered(task.problem, task.arch) or OFFERED
            for i in FAMILIES[task.problem.family].implementations}


def impls(task: Task) -> list[str]:
    """The implementations a trial of `task` may pick: "mma" (the family's generated kernels), then each library
    implementation that `offered` offers."""
    return ["mma", *(i for i, why in offered(task).items() if why == OFFERED)]


def suggest(trial: optuna.Trial, task: Task) -> dict[str, Any]:
    """A trial's configuration: with several implementations, "impl" first, then that implementation's parameters
    (a conditional space); with the family's kernels only, their parameters (no "impl")."""
    choices = impls(task)
    if len(choices) == 1:
        return {k: trial.suggest_categorical(k, v) for k, v in search_space(task).items()}
    impl = trial.suggest_categorical("impl", choices)
    if impl == "mma":
        return {"impl": impl, **{k: trial.suggest_categorical(k, v) for k, v in search_space(task).items()}}
    names = param_names(task, impl)
    return {"impl": impl, **{k: trial.suggest_categorical(names[k], v) for k, v in IMPL_SPACES[impl].items()}}


def param_names(task: Task, impl: str) -> dict[str, str]:
    """An implementation's config key -> its parameter name in the study: the key, but `impl`_KEY where the family's
    own kernels have a parameter of that name (CUTLASS's STAGES beside the mma kernels' STAGES: one name in a study
    has one value space)."""
    own = search_space(task)
    return {k: f"{impl}_{k}" if impl != "mma" and k in own else k for k in IMPL_SPACES.get(impl, own)}


def to_params(task: Task, config: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration as the study's parameters (param_names), e.g. for enqueue_trial."""
    impl = str(config.get("impl", "mma"))
    if impl == "mma":
        return dict(config)
    names = param_names(task, impl)
    return {names.get(k, k): v for k, v in config.items()}


def to_config(params: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's parameters as the configuration they name (the inverse of to_params)."""
    impl = str(params.get("impl", "mma"))
    if impl == "mma":
        return dict(params)
    prefix = f"{impl}_"
    return {k.removeprefix(prefix): v for k, v in params.items()}


def check(task: Task, config: Mapping[str, Any]) -> str | None:
    """Why `config` cannot run `task` (the family's check, for the arch the configuration is built for), or None."""
    return FAMILIES[task.problem.family].check(task.problem, dict(config), config_arch(task, config))


def predict_us(task: Task, config: Mapping[str, Any], hw: Hardware | None = None) -> float:
    """The estimate of a valid `config` of `task` on `hw` where it runs the task's arch (else the arch's data-sheet
    target)."""
    return estimate_us(task.problem, config, config_arch(task, config), hardware_for_arch(task.arch, hw))


def analytical_guesses(task: Task, n: int = SEEDS, hw: Hardware | None = None) -> list[dict[str, Any]]:
    """Valid configurations ranked by the analytical model, best first: the best of each implementation (so every
    implementation is measured), then the next best of any up to `n`. The family's kernels offer their rule-of-thumb
    configurations (family.configs); a library implementation its ranked ones (Implementation.ranked: CUTLASS its
    whole valid space), else every point of its space (cuBLASLt every rank)."""
    family = FAMILIES[task.problem.family]
    choices = impls(task)
    per_impl: list[list[dict[str, Any]]] = []
    for impl in choices:
        lib = IMPLEMENTATIONS.get(impl)
        if lib is None:
            configs: list[dict[str, Any]] = [with_defaults(task, c) for c in family.configs(task.problem, task.arch)]
        elif lib.ranked is not None:
            configs = [dict(c) for c in lib.ranked(task.problem, hw)[:n]]
        else:
            configs = [{k: v for k, v in zip(IMPL_SPACES[impl], values, strict=True)}
                       for values in itertools.product(*IMPL_SPACES[impl].values())]
        if len(choices) > 1:
            configs = [{"impl": impl, **c} for c in configs]
        per_impl.append(sorted(configs, key=lambda c: predict_us(task, c, hw)))
    firsts = [r[0] for r in per_impl if r]
    rest = sorted((c for r in per_impl for c in r[1:]), key=lambda c: predict_us(task, c, hw))
    picked = firsts[:n] + rest[:max(0, n - len(firsts))]
    return sorted(picked, key=lambda c: predict_us(task, c, hw))


def study_name(task: Task, device: str) -> str:
    """A study per task and device: times measured on one GPU (or by the analytical model) never mix with
    another's. A task that offers a versioned library implementation (Implementation.version: CUTLASS, the
    nvidia-cutlass package's) has a study per version: its trials time that version's instances, and a study's
    "impl" choices cannot change once it has trials (Optuna's categorical space is fixed), so installing the
    package, or another version, starts a new study."""
    offers = impls(task)
    tag = "".join(f"+{i.name}-{i.version()}" for i in FAMILIES[task.problem.family].implementations
                  if i.version is not None and i.name in offers)
    return f"{task.key}{tag}@{device}"


def study_for(task: Task, storage: optuna.storages.BaseStorage | str, device: str, seed: int = 0,
              hw: Hardware | None = None) -> optuna.Study:
    """The task's study on `device` (created on first use, with the estimate's best guesses on `hw` enqueued)."""
    study = optuna.create_study(study_name=study_name(task, device), storage=storage, direction="minimize",
                                load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))
    if "task" not in study.user_attrs:
        study.set_user_attr("task", task_attrs(task))
        study.set_user_attr("describe", task.describe())
        for config in analytical_guesses(task, hw=hw):
            study.enqueue_trial(to_params(task, config), skip_if_exists=True)
    return study


def record(trial: optuna.Trial, measurer: Measurer, m: Measurement) -> float:
    """Record a measurement on `trial`: the measurer's environment, runs, median and spread, or why it failed
    (error_kind, error). Returns the trial's value: the median, or NaN (a failed trial) on a failure."""
    for k, v in measurer.environment().items():
        trial.set_user_attr(k, v)
    trial.set_user_attr("runs", m.runs)
    if m.error_kind is not None or m.median_us is None:
        trial.set_user_attr("error_kind", m.error_kind or "runtime")
        trial.set_user_attr("error", m.detail)
        return math.nan
    trial.set_user_attr("median_us", m.median_us)
    trial.set_user_attr("spread_us", m.spread_us)
    return m.median_us


def measure_into(trial: optuna.Trial, measurer: Measurer, task: Task, config: Mapping[str, int]) -> float:
    """Measure `config` of `task` and record it on `trial` (record). Returns the trial's value: the median, or NaN
    (Optuna's FAIL) on a failure."""
    return record(trial, measurer, measurer.measure(task, dict(config)))


def optimize_once(study: optuna.Study, objective: Callable[[optuna.Trial], float]) -> None:
    """One trial of `objective` through Study.optimize (which keeps the trial's heartbeat)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Optuna warns about every NaN it records as a failure
        study.optimize(objective, n_trials=1, gc_after_trial=False)


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return study.get_trials(deepcopy=False, states=states)


def times(study: optuna.Study) -> list[float | None]:
    """The finished trials' times in trial order, None for a failed one: the scheduler's curve of the study."""
    done = sorted(finished(study), key=lambda t: t.number)
    return [t.value if t.state == optuna.trial.TrialState.COMPLETE else None for t in done]


def best_trials_by_impl(study: optuna.Study) -> dict[str, optuna.trial.FrozenTrial]:
    """The fastest successful trial of each implementation the study measured ("mma" for a trial without "impl")."""
    out: dict[str, optuna.trial.FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        impl = str(t.params.get("impl", "mma"))
        if t.value is not None and math.isfinite(t.value) and (impl not in out or t.value < out[impl].value):
            out[impl] = t
    return out


def best_by_impl(study: optuna.Study) -> dict[str, float]:
    """The fastest successful time of each implementation the study measured ("mma" for a trial without "impl")."""
    return {impl: float(t.value) for impl, t in best_trials_by_impl(study).items()}


def best(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return min(done, key=lambda t: (t.value, t.number)) if done else None


__all__ = ["ERROR_KINDS", "IMPL_SPACES", "OFFERED", "STORAGE_ENV", "AnalyticalMeasurer", "Measurement", "Measurer",
           "analytical_guesses", "best", "best_by_impl", "best_trials_by_impl", "check", "config_arch", "finished",
           "impls", "measure_into", "offered", "open_journal", "open_storage", "optimize_once", "param_names",
           "predict_us", "record", "search_space", "storage_url", "study_for", "study_name", "suggest", "times",
           "to_config", "to_params", "with_defaults"]
