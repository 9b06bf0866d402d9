"""Tuning as a step of `optimize`: tune a rewritten model's tasks (or only look them up) and hand the build the
configuration of every node whose task the storage or the shipped tuning records (tune.records) know.

The storage is consulted when tuning was asked for, when a storage was named, or when the default SQLite file
exists; a plain `optimize` on a machine that never tuned opens nothing, and takes the shipped records only
(shipped_model). Per task, `choose` takes a configuration a GPU measured in the storage, else the task's shipped
record where it still fits, else the analytical model's pick from the storage, else the family's default; the
report's task entries say which ("source") and why a record was not used ("record_unused").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from onnx_gtco.calibration import Hardware
from onnx_gtco.config import tune_storage_env
from onnx_gtco.kernels.select import ALL_FAMILIES
from onnx_gtco.progress import detail, stage
from onnx_gtco.tune import records
from onnx_gtco.tune.driver import TaskResult, best_configs, impl_bests, tune
from onnx_gtco.tune.search import AnalyticalMeasurer, Measurer, config_arch, offered, storage_url
from onnx_gtco.tune.tasks import ShapeOf, Task, model_tasks

Tuned = dict[str, dict[str, dict[str, Any]]]
"""node name -> arch slot -> configuration (a GEMM won by CUTLASS: its sm_90a slot and, where another implementation
was measured, the best of those for sm_90)."""


def _default_db() -> Path:
    from onnx_gtco.kernels.toolchain import cache_root

    return cache_root() / "tuning.db"


def wanted(trials: int, storage: str | None) -> bool:
    """Whether optimize should open the tuning storage at all."""
    return trials > 0 or bool(storage) or bool(tune_storage_env()) or _default_db().is_file()


def redact(url: str) -> str:
    """The URL without its password, for reports and logs. A journal's or in-memory storage's has none (and the
    SQL stack is not imported for them)."""
    from onnx_gtco.tune.search import JOURNAL_PREFIX, MEMORY_PREFIX

    if url.startswith((MEMORY_PREFIX, JOURNAL_PREFIX)):
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def measured_costs(report: dict[str, Any]) -> dict[str, float]:
    """Task key -> best kernel time from a tuning report, when its measurer measured real kernels (the analytical
    model's times are predictions, which the planner's own cost model already makes)."""
    if report.get("measurer") == AnalyticalMeasurer.name:
        return {}
    return {e["task"]: float(e["best_us"]) for e in report["tasks"] if e.get("best_us") is not None}


def pick_measurer(hw: Hardware | None = None) -> Measurer:
    """The GPU measurer when CuPy sees a CUDA device, else the estimate on `hw` (the planning target's hardware)."""
    from onnx_gtco.tune.gpu import GpuMeasurer, gpu_available

    return GpuMeasurer() if gpu_available() else AnalyticalMeasurer(hw)


def tune_model(model: onnx.ModelProto, arch: str, trials: int, storage: str | None = None,
               measurer: Measurer | None = None, patience: int = 20, workers: int = 1,
               progress: Callable[[TaskResult], None] | None = None, shape_of: ShapeOf | None = None,
               shipped: bool = True, records_dir: str | Path | None = None, hw: Hardware | None = None
               ) -> tuple[dict[str, Any], Tuned]:
    """Tune the model's tasks for `arch` up to `trials` finished trials each (0: only look up), then return the
    report's "tuning" entry and the configuration per node (choose: the storage's, a shipped record's where
    `shipped`, from `records_dir` or records.records_dir()). The measurer defaults to pick_measurer() (closed
    again here); a GPU measurer tunes for its GPU's arch instead of `arch`. `shape_of` gives the fused nodes'
    input shapes: the plan's (tasks.view_shapes) where the caller has it, else the model's value_info
    (tasks.model_shapes)."""
    own = measurer is None
    measurer = measurer or pick_measurer(hw)
    try:
        arch = getattr(measurer, "arch", arch)  # a GPU measurer tunes for the GPU it has
        url = storage_url(storage)
        tasks, skipped = model_tasks(model, arch, shape_of)
        results = _tune_shown(tasks, trials, measurer, url, patience, workers, progress) if trials > 0 else []
        best = best_configs(tasks, measurer.device, url)
        by_impl = impl_bests(tasks, measurer.device, url)
        recs = records.load(arch, records_dir) if shipped else {}
    finally:
        if own and callable(getattr(measurer, "close", None)):
            measurer.close()  # type: ignore[attr-defined]
    tuned: Tuned = {}
    by_key = {r.task.key: r for r in results}
    timing = "analytical" if measurer.name == AnalyticalMeasurer.name else "measured"
    entries = []
    for t in tasks:
        choice = choose(t, best.get(t.key), timing == "measured", recs.get(t.problem_key))
        if choice.config is not None:
            for node in t.nodes:
                tuned[node] = slots(t, choice.config, by_impl.get(t.key, {}) if choice.stored else {})
        r = by_key.get(t.key)
        entry = r.to_json() if r else {"task": t.key, "describe": t.describe(), "weight": t.weight, "measured": 0}
        if t.key in best:
            entry["best_config"], entry["best_us"] = best[t.key]
        times = {impl: us for impl, (_, us) in by_impl.get(t.key, {}).items()}
        entry |= implementations(t, best.get(t.key), times, timing)
        entry |= choice.to_json()
        entries.append(entry)
    predicted = sum(t.weight * best[t.key][1] for t in tasks if t.key in best)
    report = {"storage": redact(url), "measurer": measurer.name, "device": measurer.device, "arch": arch,
              "trials_per_task": trials, "measured": sum(r.measured for r in results),
              "tasks_found": len(best), "tasks": entries, "untuned": skipped,
              "kernel_time_us": round(predicted, 3) if best else None,
              "records": str(records.path_for(arch, records_dir)) if shipped else "not used (--no-shipped-records)"}
    return report, tuned


def shipped_model(model: onnx.ModelProto, arch: str, shape_of: ShapeOf | None = None,
                  records_dir: str | Path | None = None) -> tuple[dict[str, Any] | None, Tuned]:
    """The configurations the shipped records (records.load) give the model's tasks for `arch`, with no tuning
    storage: the report's "tuning" entry and the configuration per node; (None, {}) when no record is of a task
    of the model (the report then has no tuning entry)."""
    recs = records.load(arch, records_dir)
    tasks, skipped = model_tasks(model, arch, shape_of) if recs else ([], {})
    if not any(t.problem_key in recs for t in tasks):
        return None, {}
    tuned: Tuned = {}
    entries = []
    for t in tasks:
        choice = choose(t, None, False, recs.get(t.problem_key))
        if choice.config is not None:
            for node in t.nodes:
                tuned[node] = slots(t, choice.config, {})
        entries.append({"task": t.key, "describe": t.describe(), "weight": t.weight, "measured": 0,
                        "nodes": list(t.nodes)} | choice.to_json())
    report = {"storage": None, "measurer": None, "device": None, "arch": arch, "trials_per_task": 0, "measured": 0,
              "tasks_found": 0, "tasks": entries, "untuned": skipped, "kernel_time_us": None,
              "records": str(records.path_for(arch, records_dir))}
    return report, tuned


TUNED, ANALYTICAL_PICK, DEFAULT = "tuned", "tuned (analytical model)", "default"
"""The sources of a task's configuration besides a shipped record (records.Record.label)."""


@dataclass(frozen=True)
class Choice:
    """The configuration the library builds for a task's nodes (None: the family's default), where it came from,
    the record it came from, and why the task's shipped record was not used (when it has one)."""

    config: dict[str, Any] | None
    source: str
    stored: bool = False
    record: records.Record | None = None
    record_unused: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "config": self.config}
        if self.record is not None:
            out["record"] = {k: v for k, v in self.record.to_json().items() if k not in ("config", "describe")}
        if self.record_unused is not None:
            out["record_unused"] = self.record_unused
        return out


def choose(task: Task, stored: tuple[dict[str, Any], float] | None, measured: bool,
           record: records.Record | None) -> Choice:
    """A task's configuration: the storage's best where a GPU measured it ("tuned"); else its shipped record
    where the record's configuration still fits (records.fits); else the storage's best by the analytical model;
    else the family's default. A record that is not used says why."""
    if stored is not None and measured:
        return Choice(stored[0], TUNED, stored=True,
                      record_unused=None if record is None else f"{record.label()}: a configuration tuned on this "
                      "machine's GPU comes first")
    unused = None
    if record is not None:
        why = records.fits(task, record.config)
        if why is None:
            return Choice(dict(record.config), record.label(), record=record)
        unused = f"{record.label()}: {why}; the {'analytical model' if stored else 'default'} configuration instead"
    if stored is not None:
        return Choice(stored[0], ANALYTICAL_PICK, stored=True, record_unused=unused)
    return Choice(None, DEFAULT, record_unused=unused)


def slots(task: Task, best: dict[str, Any], bests: Mapping[str, tuple[dict[str, Any], float]]
          ) -> dict[str, dict[str, Any]]:
    """The library's arch slot -> the configuration a node of `task` gets there: the task's best for its arch; where
    that is a CUTLASS configuration (sm_90a code, built for the sm_90a slot that 9.0 GPUs pick), the sm_90 slot,
    which other 9.x GPUs run, gets the best of the other implementations (none measured: its default)."""
    arch = config_arch(task, best)
    if arch == task.arch:
        return {arch: best}
    others = [v for impl, v in bests.items() if impl != best.get("impl")]
    rest = min(others, key=lambda v: v[1])[0] if others else None
    return {arch: best, **({task.arch: rest} if rest is not None else {})}


def implementations(task: Task, best: tuple[dict[str, Any], float] | None, times: Mapping[str, float],
                    timing: str) -> dict[str, Any]:
    """What a report entry says of a task's implementations, for a family with library implementations
    (KernelFamily.implementations: the GEMM's): which one won ("impl": "mma", "cublaslt", "cutlass") with its
    configuration and time (the entry's best_config and best_us), each library's best time beside it ("cublaslt_us",
    "cutlass_us"; None where none ran: not offered, or every trial failed) and whether it was offered ("cublaslt",
    "cutlass": "offered" or why not); for a family that says more of its tasks (KernelFamily.task_summary: the conv's
    winning kernel and shape), that; then whether the times were "measured" or "analytical" (the model's ranking, no
    GPU) and the nodes it serves. Empty for a family with neither."""
    family = ALL_FAMILIES[task.problem.family]
    entry = family.task_summary(task.problem, best[0] if best else None)
    if family.implementations:
        why = offered(task)
        entry = {"impl": str(best[0].get("impl", "mma")) if best else None, **entry}
        for impl in family.implementations:
            entry[f"{impl.name}_us"] = times.get(impl.name)
            entry[impl.name] = why.get(impl.name, "not offered")
    if not entry:
        return {}
    return {**entry, "timing": timing, "nodes": list(task.nodes)}


def _tune_shown(tasks: list[Task], trials: int, measurer: Measurer, url: str, patience: int, workers: int,
                progress: Callable[[TaskResult], None] | None) -> list[TaskResult]:
    """driver.tune in a "tune" stage: its bar counts this process's trials; at -v, one line per task with its
    trials and its best time, which is "predicted" when the measurer is the analytical model."""
    with stage("tune", total=len(tasks) * trials, unit="trial") as st:
        def each(r: TaskResult) -> None:
            st.step(r.task.describe()[:48])
            if progress is not None:
                progress(r)

        results = tune(tasks, trials=trials, measurer=measurer, storage=url, patience=patience, workers=workers,
                       progress=each)
        kind = "predicted" if isinstance(measurer, AnalyticalMeasurer) else "measured"
        for r in results:
            best = f"best {r.best_us:.2f} us {kind}" if r.best_us is not None else "no valid configuration"
            gain = f", {r.speedup:.2f}x over its first trial" if r.speedup else ""
            detail(f"tune     {r.task.describe()}: {r.trials} trials, {best}{gain}")
        st.note = (f"{len(tasks)} tasks, {sum(r.measured for r in results)} trials run here, times {kind} "
                   f"({measurer.name} measurer)")
    return results


__all__ = ["Choice", "Tuned", "choose", "implementations", "measured_costs", "pick_measurer", "redact", "shipped_model",
           "slots", "tune_model", "wanted"]
