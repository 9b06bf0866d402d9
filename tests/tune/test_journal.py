"""The journal storage (`journal:PATH`, Optuna's JournalStorage over one log file): a round trip that a second run
finds done, worker processes sharing the file, the same forms through $GTCO_TUNE_STORAGE, and no SQL stack: a
tuning run with a journal never imports sqlalchemy (a GPU bundle may leave it out)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import optuna
import pytest
import worker_quorum

from onnx_gtco import optimize
from onnx_gtco.cli import main
from onnx_gtco.config import GtcoConfig
from onnx_gtco.errors import GtcoError
from onnx_gtco.models import build
from onnx_gtco.tune.driver import best_configs, tune
from onnx_gtco.tune.search import AnalyticalMeasurer, open_storage, storage_url, study_name
from onnx_gtco.tune.tasks import Task, model_tasks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return model_tasks(optimize(build("vit-tiny", depth=1), GtcoConfig(precision="fp16")).model, "sm_90")[0]


def _trials(url: str, tasks: list[Task]) -> list[optuna.trial.FrozenTrial]:
    store = open_storage(url)
    return [t for task in tasks
            for t in optuna.load_study(study_name=study_name(task, "analytical"), storage=store).trials]


def test_a_journal_keeps_the_trials_and_a_second_run_measures_nothing(tmp_path: Path, tasks: list[Task]) -> None:
    url = f"journal:{tmp_path / 'trials.log'}"
    cold = AnalyticalMeasurer()
    results = tune(tasks, trials=5, measurer=cold, storage=url)
    assert (tmp_path / "trials.log").stat().st_size > 0
    assert all(r.trials == r.measured and 0 < r.trials <= 5 for r in results)
    assert isinstance(open_storage(url), optuna.storages.JournalStorage)
    done = [t for t in _trials(url, tasks) if t.state == optuna.trial.TrialState.COMPLETE]
    assert cold.calls == len(done) and all(t.user_attrs["measurer"] == "analytical" for t in done)
    warm = AnalyticalMeasurer()  # a new process would read the same file: every task has its trials
    again = tune(tasks, trials=5, measurer=warm, storage=url)
    assert warm.calls == 0 and [r.best_config for r in again] == [r.best_config for r in results]
    assert set(best_configs(tasks, "analytical", url)) == {t.key for t in tasks}


def test_workers_share_a_journal(tmp_path: Path, tasks: list[Task], monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"journal:{tmp_path / 'shared.log'}"
    worker_quorum.hold(monkeypatch, url, 2, tmp_path / "site")  # both processes ask a trial before either measures one
    results = tune(tasks, trials=6, measurer=AnalyticalMeasurer(), storage=url, workers=2)
    trials = _trials(url, tasks)
    assert all(t.state.is_finished() for t in trials)
    assert all(6 <= r.trials <= 7 for r in results), [r.trials for r in results]  # both may take the last slot
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # this process and one tune-worker
    for task in tasks:
        numbers = [t.number for t in _trials(url, [task])]
        assert sorted(numbers) == list(range(len(numbers)))  # no trial lost or run twice


_BLOCKER = '''
import importlib.abc, os, sys

class _NoSql(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "sqlalchemy" or name.startswith("sqlalchemy."):
            with open(os.environ["GTCO_TEST_SQL_LOG"], "a") as f:
                f.write(f"{os.getpid()} {name}\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoSql())
'''


def test_tuning_with_a_journal_never_imports_sqlalchemy(tmp_path: Path) -> None:
    """optimize --tune-trials with two workers and the journal named by $GTCO_TUNE_STORAGE, in processes (this one's
    child and its tune-worker) where importing sqlalchemy fails and is logged: it finishes, nothing tried."""
    log = tmp_path / "sql.log"
    journal = tmp_path / "trials.log"
    # both processes ask a trial before either measures one (worker_quorum), so each is seen working the journal
    env = {**worker_quorum.env(tmp_path / "site", f"journal:{journal}", 2, before=textwrap.dedent(_BLOCKER)),
           "GTCO_TEST_SQL_LOG": str(log), "GTCO_TUNE_STORAGE": f"journal:{journal}",
           "GTCO_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] += os.pathsep + str(ROOT)
    probe = subprocess.run([sys.executable, "-c", "import sqlalchemy"], env=env, capture_output=True, text=True,
                           check=False)
    assert probe.returncode != 0 and log.read_text().split()[1] == "sqlalchemy"  # the blocker works
    log.unlink()
    out = tmp_path / "v.onnx"
    proc = subprocess.run([sys.executable, "-m", "onnx_gtco", "optimize", "vit-tiny", "-o", str(out), "--no-build",
                           "--precision", "fp16", "--tune-trials", "3", "--workers", "2"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not log.exists(), log.read_text()
    report = json.loads(out.with_name(out.name + ".report.json").read_text())["tuning"]
    assert report["storage"] == f"journal:{journal}" and report["tasks_found"] == len(report["tasks"]) > 0
    store = open_storage(f"journal:{journal}")
    trials = [t for s in optuna.get_all_study_summaries(store) for t in
              optuna.load_study(study_name=s.study_name, storage=store).trials]
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # the optimize process and its tune-worker


def test_journal_urls_that_cannot_work_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    for url, why in (("journal:", "give the journal file's path"), (f"journal:{tmp_path}", "is a folder"),
                     (f"journal:{missing / 't.log'}", f"the folder {missing} does not exist")):
        with pytest.raises(GtcoError, match=re.escape(why)):
            open_storage(url)
    monkeypatch.setenv("GTCO_TUNE_STORAGE", f"journal:{tmp_path / 'env.log'}")
    assert storage_url() == f"journal:{tmp_path / 'env.log'}"
    src = tmp_path / "m.onnx"
    onnx.save(build("vit-tiny", depth=1), str(src))
    assert main(["optimize", str(src), "--no-build", "--storage", f"journal:{tmp_path / 'no' / 't.log'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert not (tmp_path / "m.gtco.onnx").exists()
