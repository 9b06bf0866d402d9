"""The builder of tuning trials: candidates are built as many at a time as the machine has cores, apart from their
measurement (the builder half of the builder / runner split of TVM's meta_schedule).

A candidate's build is its measurer's `build(task, config)` (SplitMeasurer): the GPU measurer's instantiates the
configuration and compiles it with nvcc through the kernel cache (kernels.compile: an instance is compiled once per
machine, and the library build reuses it), then links it as a shared library to load. nvcc runs as a process of
its own, so threads give the builds real parallelism. A build that fails is data, never an exception: its
BuildResult carries the error kind ("compile", "resource", or "runtime" where the GPU cannot run the configuration's
code) and the detail, and the trial fails with them, unmeasured. An unexpected exception of a build is the
trial's "compile" failure with the exception's line, so one candidate cannot end the tuning run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from onnx_gtco.errors import first_line
from onnx_gtco.tune.search import Measurement
from onnx_gtco.tune.tasks import Task


@dataclass(frozen=True)
class Artifact:
    """What a build made: a shared library and the C entry point of the instance in it."""

    library: str
    symbol: str


@dataclass(frozen=True)
class BuildResult:
    """One candidate's build: its artifact, or the error kind and detail that fail its trial; the wall seconds it
    took (LocalBuilder sets them; a cache hit takes none to speak of)."""

    artifact: Artifact | None
    error_kind: str | None = None
    detail: str = ""
    seconds: float = 0.0

    @property
    def failure(self) -> Measurement | None:
        """The failed Measurement the trial records when the build failed, else None."""
        if self.artifact is not None and self.error_kind is None:
            return None
        return Measurement(None, error_kind=self.error_kind or "compile", detail=self.detail)


class SplitMeasurer(Protocol):
    """A measurer whose measurement is a build and a run: `build` is thread-safe and runs in parallel with the
    other builds in flight; `run` measures a built candidate, one at a time (the GPU measurer's in a child process,
    tune.runner). `measure(task, config)` is the two in a row."""

    name: str
    device: str

    def build(self, task: Task, config: Mapping[str, Any]) -> BuildResult: ...

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement: ...

    def measure(self, task: Task, config: Mapping[str, Any]) -> Measurement: ...

    def environment(self) -> dict[str, str]: ...


def build_and_run(measurer: SplitMeasurer, task: Task, config: Mapping[str, Any]) -> Measurement:
    """One trial's measurement by a SplitMeasurer: its build, then its run of what was built (a failed build is the
    trial's failed Measurement). What each SplitMeasurer's `measure` is."""
    built = measurer.build(task, config)
    if built.failure is not None or built.artifact is None:
        return built.failure or Measurement(None, error_kind="compile")
    return measurer.run(task, config, built.artifact)


def is_split(measurer: object) -> bool:
    """Whether `measurer` builds and runs apart (SplitMeasurer), so that its builds can run in parallel."""
    return callable(getattr(measurer, "build", None)) and callable(getattr(measurer, "run", None))


def default_jobs() -> int:
    """Builds at a time by default: one per core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


class LocalBuilder:
    """Builds candidates on this machine, `jobs` at a time (default: one per core)."""

    def __init__(self, jobs: int | None = None) -> None:
        if jobs is not None and jobs < 1:
            raise ValueError(f"jobs={jobs}: give at least 1 build at a time")
        self.jobs = jobs or default_jobs()

    @staticmethod
    def build_one(measurer: SplitMeasurer, task: Task, config: Mapping[str, Any]) -> BuildResult:
        """measurer.build of one candidate, timed (wall seconds); an exception is the candidate's failed build."""
        start = time.perf_counter()
        try:
            got = measurer.build(task, dict(config))
        except Exception as e:  # any build's failure is its trial's, not the run's
            got = BuildResult(None, "compile", f"{type(e).__name__}: {first_line(e)}")
        return replace(got, seconds=time.perf_counter() - start)

    def build(self, measurer: SplitMeasurer, candidates: Sequence[tuple[Task, Mapping[str, Any]]]
              ) -> list[BuildResult]:
        """build_one of each (task, config), `jobs` at a time; the results in the candidates' order."""
        if not candidates:
            return []
        with ThreadPoolExecutor(max_workers=min(self.jobs, len(candidates)), thread_name_prefix="gtco-build") as pool:
            return list(pool.map(lambda c: self.build_one(measurer, c[0], c[1]), candidates))


__all__ = ["Artifact", "BuildResult", "LocalBuilder", "SplitMeasurer", "default_jobs", "is_split"]
