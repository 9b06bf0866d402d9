"""Tuning on the CPU: tasks and their weights, Optuna studies in a SQLite storage with the analytical measurer,
reuse of a warm database, the budget scheduler on synthetic curves."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import onnx
import optuna
import pytest

from onnx_gtco import optimize
from onnx_gtco.config import GtcoConfig
from onnx_gtco.models import build
from onnx_gtco.tune.driver import best_configs, tune
from onnx_gtco.tune.scheduler import Curve, Policy, next_task, stopped
from onnx_gtco.tune.search import (
    AnalyticalMeasurer,
    Measurement,
    analytical_guesses,
    open_storage,
    storage_url,
    study_name,
)
from onnx_gtco.tune.tasks import Task, model_tasks


def rewritten(name: str, depth: int) -> onnx.ModelProto:
    return optimize(build(name, depth=depth), GtcoConfig(precision="fp16")).model


@pytest.fixture(scope="module")
def vit_b() -> onnx.ModelProto:
    return rewritten("vit-b16", 3)


def test_identical_groups_are_one_task_weighted_by_occurrences(vit_b: onnx.ModelProto) -> None:
    tasks, skipped = model_tasks(vit_b, "sm_90")
    # elementwise nodes are no task (they are untuned): the patch embedding's patchify copy among them; its GEMM
    # (the conv as the estimate prefers it, families/conv/patchify.py) is one
    assert {n.split("/")[1] for n in skipped} == {"elementwise"}, skipped
    assert not [t for t in tasks if t.problem.family == "conv"]
    (patch,) = [t for t in tasks if t.problem.family == "gemm" and t.problem.size("M") == 14 * 14]
    assert patch.weight == 1 and [patch.problem.size(k) for k in ("N", "K")] == [768, 3 * 16 * 16]
    per_layer = [t for t in tasks if t.problem.family in ("attention", "gemm") and t.weight == 3]
    assert len({t.problem.family for t in per_layer}) == 2, [t.describe() for t in tasks]
    assert sum(t.weight for t in tasks) == sum(1 for n in vit_b.graph.node if n.domain == "ai.gtco") - len(skipped)
    assert len({t.key for t in tasks}) == len(tasks)
    ln = next(t for t in tasks if t.problem.family == "layernorm")
    assert ln.problem.size("rows") == 197  # the run-time rows are part of the task
    assert model_tasks(vit_b, "sm_80")[0][0].key != tasks[0].key  # the arch is part of the key


def test_default_storage_is_sqlite_in_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    assert storage_url() == f"sqlite:///{tmp_path / 'cache' / 'tuning.db'}"
    monkeypatch.setenv("GTCO_TUNE_STORAGE", "sqlite:///elsewhere.db")
    assert storage_url() == "sqlite:///elsewhere.db" and storage_url("postgresql://h/db") == "postgresql://h/db"


def test_tuning_records_trials_and_a_warm_database_measures_nothing(vit_b: onnx.ModelProto, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path))  # no --storage: the default SQLite file
    tasks = model_tasks(vit_b, "sm_90")[0]
    cold = AnalyticalMeasurer()
    results = tune(tasks, trials=12, measurer=cold, patience=8)
    assert (tmp_path / "tuning.db").is_file()
    assert all(r.trials == r.measured and 0 < r.trials <= 12 for r in results)
    assert all(r.best_us is not None and r.best_us <= r.first_us for r in results)
    assert all(r.stop in ("trial limit", "early stop") for r in results)
    assert all(r.trials_to_90 is not None and r.trials_to_90 <= r.trials for r in results)
    # invalid configurations are failed trials with the reason, never measured
    store = open_storage(storage_url())
    trials = [t for task in tasks
              for t in optuna.load_study(study_name=study_name(task, "analytical"), storage=store).trials]
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert cold.calls == len(complete)
    assert all(t.user_attrs["error_kind"] == "invalid" and t.user_attrs["error"] for t in failed)
    assert all(t.user_attrs["measurer"] == "analytical" and "median_us" in t.user_attrs for t in complete)
    # a second run with the same budget finds every task done: zero measurements, the same answers
    warm = AnalyticalMeasurer()
    again = tune(tasks, trials=12, measurer=warm, patience=8)
    assert warm.calls == 0
    assert [r.best_config for r in again] == [r.best_config for r in results]
    best = best_configs(tasks, "analytical")
    assert set(best) == {t.key for t in tasks}


def test_a_second_model_reuses_the_shared_tasks(vit_b: onnx.ModelProto, tmp_path: Path) -> None:
    """A ViT-B fine-tuned for 10 classes after the 1000-class one: every task but the head's is found tuned."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    vit_tasks = model_tasks(vit_b, "sm_90")[0]
    tune(vit_tasks, trials=6, measurer=AnalyticalMeasurer(), storage=url)
    other = optimize(build("vit-b16", depth=3, classes=10), GtcoConfig(precision="fp16")).model
    other_tasks = model_tasks(other, "sm_90")[0]
    shared = {t.key for t in other_tasks} & {t.key for t in vit_tasks}
    assert shared and len(shared) < len(other_tasks)  # the head's N differs
    meas = AnalyticalMeasurer()
    results = tune(other_tasks, trials=6, measurer=meas, storage=url)
    assert all(r.measured == 0 for r in results if r.task.key in shared)
    assert all(r.measured > 0 for r in results if r.task.key not in shared)
    print(f"ViT-B/10 after ViT-B/1000: {len(shared)} of {len(other_tasks)} tasks reused, {meas.calls} measurements")


def test_study_starts_from_the_analytical_guesses(vit_b: onnx.ModelProto, tmp_path: Path) -> None:
    task = next(t for t in model_tasks(vit_b, "sm_80")[0] if t.problem.family == "gemm")
    guesses = analytical_guesses(task)
    assert len(guesses) == 3
    tune([task], trials=3, measurer=AnalyticalMeasurer(), storage=f"sqlite:///{tmp_path / 'g.db'}")
    study = optuna.load_study(study_name=study_name(task, "analytical"),
                              storage=open_storage(f"sqlite:///{tmp_path / 'g.db'}"))
    assert [t.params for t in sorted(study.trials, key=lambda t: t.number)] == guesses


class Synthetic:
    """A measurer whose time per task follows a given curve of the trial count (the config is ignored)."""

    name = "synthetic"
    device = "synthetic"

    def __init__(self, curves: Mapping[str, object]) -> None:
        self.curves = curves
        self.counts: dict[str, int] = {}

    def measure(self, task: Task, config: Mapping[str, int]) -> Measurement:
        n = self.counts[task.key] = self.counts.get(task.key, 0) + 1
        return Measurement(self.curves[task.key](n), runs=1)  # type: ignore[operator]

    def environment(self) -> dict[str, str]:
        return {"measurer": self.name}


def test_scheduler_gives_the_heaviest_task_the_most_trials() -> None:
    policy = Policy(limit=200, patience=1000)
    curves = [Curve(w) for w in (1, 8, 3)]
    improving = [lambda n: 100 / (1 + 0.1 * n)] * 3  # same shape, so weight decides
    for _ in range(120):
        i = next_task(curves, policy)
        assert i is not None
        curves[i].times.append(improving[i](len(curves[i].times)))
    counts = [len(c.times) for c in curves]
    assert counts[1] == max(counts) and counts[1] > counts[2] > counts[0], counts


def test_early_stopping_fires_on_a_flat_curve() -> None:
    policy = Policy(limit=100, patience=10)
    flat = Curve(5.0, [10.0] * 11)  # the first sets the best, ten more do not improve it
    assert stopped(flat, policy) == "early stop"
    assert stopped(Curve(5.0, [10.0] * 10), policy) is None
    improving = Curve(5.0, [10.0 - i for i in range(10)])
    assert stopped(improving, policy) is None
    failing = Curve(1.0, [None] * 10)
    assert stopped(failing, policy) == "early stop" and math.isinf(failing.best)


def test_tune_with_synthetic_curves(vit_b: onnx.ModelProto, tmp_path: Path) -> None:
    """End to end through Optuna: a flat task stops early, an improving heavy one takes the budget."""
    tasks = model_tasks(vit_b, "sm_90")[0][:2]
    heavy, light = sorted(tasks, key=lambda t: -t.weight)
    meas = Synthetic({heavy.key: lambda n: 100.0 / n, light.key: lambda n: 50.0})
    results = {r.task.key: r for r in tune(tasks, trials=40, measurer=meas, patience=10,
                                          storage=f"sqlite:///{tmp_path / 's.db'}")}
    assert results[light.key].stop == "early stop"
    assert results[heavy.key].measured > results[light.key].measured


def test_a_task_stops_at_its_target(vit_b: onnx.ModelProto, tmp_path: Path) -> None:
    task = model_tasks(vit_b, "sm_90")[0][0]
    meas = Synthetic({task.key: lambda n: 100.0 / n})
    (r,) = tune([task], trials=50, measurer=meas, patience=50, targets={task.key: 20.0},
                storage=f"sqlite:///{tmp_path / 't.db'}")
    assert r.stop == "target reached" and r.best_us is not None and r.best_us <= 20.0 and r.trials < 50
