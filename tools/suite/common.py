"""What every part of the suite shares: the Step record, commands run with a timeout into their log, atomic writes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROG = "tools/gpu_suite"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    from onnx_gtco.errors import GtcoError
except ImportError:  # onnx-gtco's own dependencies (optuna, onnx-graphsurgeon) may come with the install step

    class GtcoError(Exception):  # type: ignore[no-redef]
        """A usage error of the suite (onnx_gtco.errors.GtcoError where the package imports)."""


@dataclass
class Step:
    """The outcome of one step: status "ok", "failed" or "skipped", the reason when not ok, and what it found."""

    name: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    log: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The step as a JSON-ready dict."""
        return dataclasses.asdict(self)


def skipped(name: str, reason: str) -> Step:
    return Step(name, "skipped", reason)


def last_line(text: str) -> str:
    """The last non-empty line of `text`, at most 400 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


def run_command(name: str, cmd: Sequence[str], *, env: dict[str, str], timeout_s: float, log: Path,
                cwd: Path = ROOT) -> Step:
    """Run one command in its own process group with its output in `log`; on timeout the whole group is killed.

    Returns:
        Step "ok" on exit 0, else "failed" with the timeout or the log's last line as the reason.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log.open("w", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = round(time.monotonic() - t0, 2)
    rel = str(log)
    if code is None:
        return Step(name, "failed", f"timed out after {timeout_s:.0f} s", seconds, rel)
    if code != 0:
        why = last_line(log.read_text(encoding="utf-8", errors="replace"))
        return Step(name, "failed", f"exit {code}: {why}", seconds, rel)
    return Step(name, "ok", "", seconds, rel)


def probe(code: str, args: Any, env: dict[str, str], timeout_s: float = 120.0) -> Any:
    """Run a Python snippet in the steps' environment; it reads json.loads(sys.argv[1]) and prints one JSON value.

    Raises:
        RuntimeError: the snippet failed (its last line of stderr); subprocess.TimeoutExpired.
    """
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(last_line(proc.stderr) or f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_atomic(path: Path, text: str) -> None:
    """Write a text file so that a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            mask = os.umask(0o022)
            os.umask(mask)
            os.fchmod(f.fileno(), 0o666 & ~mask)  # the mode open() would give, not mkstemp's 0o600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def tool_output(cmd: Sequence[str], timeout_s: float = 30.0) -> str | None:
    """A tool's stdout, or None when it is missing or fails."""
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None
