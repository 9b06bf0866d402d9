"""Paths and runners shared by the kernel tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from onnx_gtco.kernels.toolchain import DEVICE_INCLUDE_DIRS

ROOT = Path(__file__).resolve().parents[1]
INCLUDES = DEVICE_INCLUDE_DIRS  # plugins/include and plugins/families
KERNELS = Path(__file__).resolve().parent / "kernels"  # the emulated test kernels (.cu)
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


def ptxas_of_cases(family: Any, problems: Mapping[str, Any], cases: Sequence[tuple[str, str, dict]], out: Path,
                   jobs: int = 2) -> dict[int, tuple[Any, list]]:
    """Compile each (problem key, arch, config) case of `family` with nvcc, `jobs` at a time (the CI machine has 2
    cores): case index -> (instance, its ptxas records)."""
    from onnx_gtco.kernels.ptxas import parse_ptxas
    from onnx_gtco.kernels.toolchain import nvcc_compile

    def compile_one(i: int) -> tuple[Any, list]:
        key, arch, config = cases[i]
        inst = family.instantiate(problems[key], config, arch)
        src = out / f"{inst.name}.cu"
        src.write_text(inst.source)
        result = nvcc_compile(src, out / f"{inst.name}.o", arch, include_dirs=INCLUDES, timeout_s=300)
        return inst, parse_ptxas(result.stderr)

    with ThreadPoolExecutor(jobs) as pool:
        return dict(enumerate(pool.map(compile_one, range(len(cases)))))


def assert_compiles_without_spills(family: Any, problems: Mapping[str, Any], cases: Sequence[tuple[str, str, dict]],
                                   out: Path) -> None:
    """Every (problem key, arch, config) case compiles with ptxas reporting its kernels, none spilling or keeping a
    stack frame."""
    for inst, kernels in ptxas_of_cases(family, problems, cases, out, 2).values():
        assert kernels, f"{inst.name}: ptxas reported no kernel"
        for k in kernels:
            assert not k.spills and not k.stack_frame_bytes, f"{inst.name}: {k}"
