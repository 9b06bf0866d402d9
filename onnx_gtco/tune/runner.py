"""The runner of tuning trials: built candidates are measured one after another in a child process, so that what
a candidate does to its process ends its own trial only (the runner half of TVM meta_schedule's builder / runner
split).

The child is started with multiprocessing's spawn method (a fresh interpreter: no CUDA state is inherited), makes
its measurer with the factory it is given (the GPU measurer: CuPy and a CUDA context of its own), says it is
ready, then measures one candidate per request (`measurer.run(task, config, artifact)`) and sends the Measurement
back. What the candidate does to the child becomes the trial's error kind, with the detail:

- the child dies (a segfault, an abort, the driver killing it): "crash", with the signal or exit status;
- no answer within `timeout_s` (a kernel that never finishes): "timeout"; the child is killed;
- the measurement raises (a CUDA error such as an illegal address, reported at the next synchronization):
  "runtime", with the exception's line.

The child's stdout and stderr go to a log file whose last lines join the detail of a crash or timeout (a fault
handler prints the Python stack of a fatal signal there). After any failed measurement the child is retired and
the next candidate gets a fresh one: an illegal address is sticky, leaving the CUDA context unusable for every later
launch, and a fresh process starts with a clean one. A child that cannot start at all (no CuPy, no GPU) is a
GtcoError, since no candidate could be measured.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from onnx_gtco.errors import GtcoError, first_line
from onnx_gtco.tune.builder import Artifact
from onnx_gtco.tune.search import Measurement
from onnx_gtco.tune.tasks import Task

RUN_TIMEOUT_S = 60.0     # one measurement: launches, the fp64 reference check and >= 20 timed runs take seconds
START_TIMEOUT_S = 300.0  # the child's imports and its measurer (CuPy, the CUDA context)
LOG_TAIL_CHARS = 1500


class ChildMeasurer(Protocol):
    """What the runner's child measures with: a built candidate in, a Measurement out."""

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement: ...


def exit_reason(code: int | None) -> str:
    """A process's exit status in words: "killed by SIGSEGV", "exit status 3"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class LocalRunner:
    """Measures built candidates in a child process on this machine (see the module docstring).

    Args:
        factory: a picklable callable (a module-level function or class, or a functools.partial of one) that
            makes the child's measurer.
        timeout_s: the longest one measurement may take before the child is killed.
        start_timeout_s: the longest the child may take to start and make its measurer.
    """

    def __init__(self, factory: Callable[[], ChildMeasurer], timeout_s: float = RUN_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got {timeout_s} and {start_timeout_s}")
        self.factory = factory
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.started = 0  # child processes started so far
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._log: Path | None = None

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        """Measure one built candidate in the child (started on first use, and again after a failure)."""
        if self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send((task, dict(config), artifact))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return self._crashed()
        if not self._conn.poll(self.timeout_s):
            tail = self._stop(kill=True)
            return Measurement(None, error_kind="timeout",
                               detail=f"no result within {self.timeout_s:g} s; the measuring process was killed{tail}")
        try:
            _, m = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            return self._crashed()
        if m.error_kind is not None:  # the run may have left the child's CUDA context unusable: retire it
            self._stop()
        return m

    def close(self) -> None:
        """Stop the child, if one runs (the next run starts another)."""
        self._stop()

    def __enter__(self) -> LocalRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _crashed(self) -> Measurement:
        proc = self._proc
        if proc is not None:
            proc.join(timeout=10)
        reason = exit_reason(proc.exitcode if proc is not None else None)
        tail = self._stop(kill=True)
        return Measurement(None, error_kind="crash", detail=f"the measuring process died ({reason}){tail}")

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        fd, log = tempfile.mkstemp(prefix="gtco-measure-", suffix=".log")
        os.close(fd)
        self._log = Path(log)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.factory, log), daemon=True, name="gtco-measure")
        proc.start()
        child.close()  # the parent's copy: the child's death is then an EOF on `parent`
        self._proc, self._conn = proc, parent
        self.started += 1
        if not parent.poll(self.start_timeout_s):
            tail = self._stop(kill=True)
            raise GtcoError(f"the measuring process did not start within {self.start_timeout_s:g} s{tail}")
        try:
            kind, text = parent.recv()
        except (EOFError, ConnectionResetError, OSError):
            proc.join(timeout=10)
            reason = exit_reason(proc.exitcode)
            tail = self._stop(kill=True)
            raise GtcoError(f"the measuring process died while starting ({reason}){tail}") from None
        if kind != "ready":
            self._stop(kill=True)
            raise GtcoError(f"the measuring process could not start: {text}")

    def _stop(self, kill: bool = False) -> str:
        """Stop the child (asked to leave, else killed) and remove its log; returns the log's tail for a detail."""
        proc, conn, log = self._proc, self._conn, self._log
        self._proc = self._conn = self._log = None
        if proc is not None and proc.is_alive():
            if not kill and conn is not None:
                try:
                    conn.send(None)
                except OSError:
                    pass
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        if conn is not None:
            conn.close()
        tail = ""
        if log is not None:
            try:
                text = log.read_text(errors="replace").strip()
            except OSError:
                text = ""
            log.unlink(missing_ok=True)
            if text:
                tail = f"; its last output: {text[-LOG_TAIL_CHARS:]}"
        return tail


def _serve(conn: Connection, factory: Callable[[], ChildMeasurer], log: str) -> None:
    """The child: output to `log`, a fault handler for fatal signals, the measurer, then one measurement per
    request until the parent sends None or goes away."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable()
    try:
        measurer = factory()
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {first_line(e)}"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        task, config, artifact = request
        try:
            m = measurer.run(task, config, artifact)
        except Exception as e:  # e.g. a CUDA error raised at a synchronization: the trial's, with its line
            m = Measurement(None, error_kind="runtime", detail=f"{type(e).__name__}: {first_line(e)}")
        conn.send(("done", m))


__all__ = ["RUN_TIMEOUT_S", "ChildMeasurer", "LocalRunner", "exit_reason"]
