"""Tuning workers that meet before they measure, so that a test of several workers sharing one storage asserts what
they did, not who won a race: each process's first analytical measurement waits until trials of `count` distinct
workers (the "worker" attribute run_trials sets when it asks a trial) are in the storage. A worker that asked its
trial holds it RUNNING while it waits, so the others find room; one that never comes leaves the wait after
`DEADLINE_S`, and the test's count of workers then fails with the names it found.

In this process and the worker processes it starts: `hold(monkeypatch, url, count, site)`. In worker processes
alone: `env(...)` gives the environment whose sitecustomize installs the hold (and can first run other start-up
code, such as an import blocker).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from onnx_gtco.tune.search import AnalyticalMeasurer, open_storage

if TYPE_CHECKING:
    import pytest

DEADLINE_S = 120.0
_HERE = Path(__file__).resolve().parent


def workers_in(url: str, since: datetime) -> set[str]:
    """The workers that asked a trial since `since` in any study of the storage."""
    store = open_storage(url)
    return {t.user_attrs["worker"] for s in optuna.get_all_study_summaries(store, include_best_trial=False)
            for t in optuna.load_study(study_name=s.study_name, storage=store).get_trials(deepcopy=False)
            if "worker" in t.user_attrs and t.datetime_start is not None and t.datetime_start >= since}


def _held_measure(url: str, count: int, since: datetime) -> Any:
    plain = AnalyticalMeasurer.measure
    met = False

    def measure(self: AnalyticalMeasurer, task: Any, config: Any) -> Any:
        nonlocal met
        deadline = time.monotonic() + DEADLINE_S
        while not met and time.monotonic() < deadline:
            met = len(workers_in(url, since)) >= count
            if not met:
                time.sleep(0.05)
        met = True  # met, or waited out: later measurements go straight on
        return plain(self, task, config)

    return measure


def hold(monkeypatch: pytest.MonkeyPatch, url: str, count: int, site: Path) -> None:
    """The hold in this process, and in the worker processes it starts (their environment: `env`'s variables)."""
    since = datetime.now()
    monkeypatch.setattr(AnalyticalMeasurer, "measure", _held_measure(url, count, since))
    for key, value in _variables(site, url, count, "", since).items():
        monkeypatch.setenv(key, value)


def install() -> None:
    """For a worker process's sitecustomize: hold as $GTCO_TEST_QUORUM ("COUNT SINCE URL") says."""
    count, since, url = os.environ["GTCO_TEST_QUORUM"].split(" ", 2)
    AnalyticalMeasurer.measure = _held_measure(url, int(count), datetime.fromisoformat(since))  # type: ignore


def env(site: Path, url: str, count: int, before: str = "") -> dict[str, str]:
    """The environment for worker processes: a sitecustomize in `site` that runs `before`, then installs the hold
    (counting trials asked from now on)."""
    return {**os.environ, **_variables(site, url, count, before, datetime.now())}


def _variables(site: Path, url: str, count: int, before: str, since: datetime) -> dict[str, str]:
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"{before}\nimport sys\nsys.path.insert(0, {str(_HERE)!r})\nimport worker_quorum\nworker_quorum.install()\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "GTCO_TEST_QUORUM": f"{count} {since.isoformat()} {url}"}
