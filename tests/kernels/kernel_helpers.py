"""Paths and runners shared by the kernel tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = ROOT / "plugins" / "include"
KERNELS = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 60



def nvcc_missing() -> bool:
    return shutil.which(os.environ.get("NVCC") or "nvcc") is None


def run_exe(exe: Path, *args: object) -> subprocess.CompletedProcess[str]:
    """Run a test executable; a non-zero exit fails the test with its stderr."""
    proc = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"{exe.name} {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}")
    return proc
