"""Tuning workers sharing one storage: a real PostgreSQL server on loopback (started here from the system's
binaries; .ci/run installs them), two worker processes splitting a model's tasks with no trial lost or measured
twice, and a worker killed with SIGKILL mid-trial losing nothing finished and resuming on restart."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import worker_quorum

from onnx_gtco import optimize
from onnx_gtco.config import GtcoConfig
from onnx_gtco.models import build
from onnx_gtco.tune.driver import tune
from onnx_gtco.tune.search import DELAY_ENV, AnalyticalMeasurer, open_storage, study_name
from onnx_gtco.tune.tasks import Task, model_tasks
from onnx_gtco.tune.worker import prepare


def _pg_bin() -> Path | None:
    for root in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (root / "initdb").is_file():
            return root
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A fresh database for this module: on the server .ci/run started ($GTCO_TEST_POSTGRES), else on a server
    started here on loopback (as the postgres user under root: postgres refuses to run as root). Its URL."""
    server = os.environ.get("GTCO_TEST_POSTGRES")
    if server:
        yield from _fresh_database(server)
        return
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed; .ci/run installs them")
    pytest.importorskip("psycopg2", reason="psycopg2 (the test extra) is needed to talk to PostgreSQL")
    root = Path(tempfile.mkdtemp(prefix="gtco-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    data = root / "data"
    run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True)  # noqa: E731
    run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")
    run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-o",
        f"-k {root} -p {port} -h 127.0.0.1", "start")
    try:
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "gtco")
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/gtco"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-w", "-m", "immediate", "stop"],
                       capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def _fresh_database(server: str) -> Iterator[str]:
    import psycopg2
    from sqlalchemy.engine import make_url

    url = make_url(server)
    name = f"gtco_test_{os.getpid()}_{int(time.time() * 1000)}"
    conn = psycopg2.connect(host=url.host, port=url.port, user=url.username, dbname=url.database or "postgres")
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.close()


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    model = optimize(build("vit-tiny", depth=2), GtcoConfig(precision="fp16")).model
    return model_tasks(model, "sm_90")[0]


def _worker(url: str, delay: float = 0.0, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**(env or os.environ), DELAY_ENV: str(delay)}
    return subprocess.Popen([sys.executable, "-m", "onnx_gtco", "tune-worker", "--storage", url, "--patience", "100"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _trials(url: str, tasks: list[Task]) -> list[optuna.trial.FrozenTrial]:
    store = open_storage(url)
    return [t for task in tasks for t in optuna.load_study(study_name=study_name(task, "analytical"),
                                                            storage=store).trials]


def test_two_workers_split_the_trials(postgres: str, tasks: list[Task], tmp_path: Path) -> None:
    per_task = 6
    prepare(tasks, per_task, postgres, "analytical")
    both = worker_quorum.env(tmp_path / "site", postgres, 2)  # each asks a trial before either measures one
    procs = [_worker(postgres, delay=0.05, env=both) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    trials = _trials(postgres, tasks)
    done = [t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)]
    assert len(done) == len(trials)  # nothing left running or waiting
    ran = [int(o[0].strip().split()[1]) for o in outs]  # "tune-worker: N trials"
    assert sum(ran) == len(done) and all(n > 0 for n in ran), ran  # split, none lost, none run twice
    workers = {t.user_attrs["worker"] for t in done}
    assert len(workers) == 2
    per_study: dict[str, int] = {}
    for task in tasks:
        n = len([t for t in _trials(postgres, [task])])
        per_study[task.key] = n
        assert per_task <= n <= per_task + 1, (task.describe(), n)  # two workers may both take the last slot
    print(f"2 workers: {ran} trials over {len(tasks)} tasks")


def test_killed_worker_loses_no_finished_trial(postgres: str, tasks: list[Task]) -> None:
    task = tasks[0]
    other = Task(task.problem, task.arch, task.version + "-kill", task.weight)  # a study of its own
    prepare([other], 8, postgres, "analytical")
    victim = _worker(postgres, delay=1.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        trials = _trials(postgres, [other])
        finished_ = [t for t in trials if t.state.is_finished()]
        if len(finished_) >= 2 and any(t.state == optuna.trial.TrialState.RUNNING for t in trials):
            break
        time.sleep(0.2)
    else:
        victim.kill()
        pytest.fail("the worker never had two finished trials and one running")
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    before = {t.number: t.value for t in _trials(postgres, [other]) if t.state.is_finished()}
    time.sleep(7)  # past the heartbeat's grace period: the killed trial is stale
    restart = _worker(postgres, delay=0.0)
    _, err = restart.communicate(timeout=600)
    assert restart.returncode == 0, err[-2000:]
    after = _trials(postgres, [other])
    kept = {t.number: t.value for t in after if t.number in before}
    assert kept == before  # every finished trial is still there, unchanged
    stale = [t for t in after if t.number not in before and t.state == optuna.trial.TrialState.FAIL
             and "error_kind" not in t.user_attrs]
    assert len(stale) == 1  # the trial it was running: failed by the heartbeat, not by a measurement
    assert all(t.state.is_finished() for t in after)
    assert len([t for t in after if t.state.is_finished()]) >= 8


def test_optimize_workers_option_uses_worker_processes(tmp_path: Path, postgres: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = optimize(build("vit-tiny", depth=1), GtcoConfig(precision="fp16")).model
    ts = model_tasks(model, "sm_80")[0]
    worker_quorum.hold(monkeypatch, postgres, 2, tmp_path / "site")  # it and its tune-worker ask before measuring
    results = tune(ts, trials=4, measurer=AnalyticalMeasurer(), storage=postgres, workers=2)
    trials = _trials(postgres, ts)
    assert all(r.trials >= 4 for r in results)
    assert len({t.user_attrs.get("worker") for t in trials}) == 2
