"""plugins/emu/gtco_emu.h: the emulation reports kernel bugs it can see, and accepts legal corner cases."""

from __future__ import annotations

import subprocess

import pytest
from kernel_helpers import RUN_TIMEOUT_S, run_exe

SOURCE = "emu_checks.cu"


@pytest.fixture(scope="module")
def exe(emu_build):
    return emu_build(SOURCE)


def test_syncthreads_after_some_threads_exited(exe):
    run_exe(exe, "early_exit")


@pytest.mark.parametrize(("mode", "message"), [
    ("shuffle_after_exit", "warp collective after some lanes of the warp exited"),
    ("misaligned_ldmatrix", "ldmatrix: a row address is not 16-byte aligned shared memory"),
    ("divergent", "lanes of one warp are in different warp collectives"),
    ("too_much_shared", "GTCO_SHARED: shared memory exceeds GTCO_EMU_SMEM_BYTES"),
    ("deadlock", "deadlock in __syncthreads (did every thread reach it?)"),  # at once: no timeout to wait out
])
def test_bug_is_reported(exe, mode, message):
    proc = subprocess.run([str(exe), mode], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith(f"gtco-emu: error: {message} (block (0,0,0), thread (")
    assert proc.stderr.count("gtco-emu: error") == 1
