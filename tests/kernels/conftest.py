"""Fixtures for the kernel tests: cached builds of the emulated test kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernel_helpers import INCLUDES, KERNELS

from onnx_gtco.kernels.toolchain import cxx_build


@pytest.fixture(scope="session")
def emu_build(tmp_path_factory):
    """build(source, *defines) -> path of an executable built with -DGTCO_EMULATE, once per (source, defines)."""
    cache: dict[tuple[str, ...], Path] = {}
    out_dir = tmp_path_factory.mktemp("emu")

    def build(source: str, *defines: str) -> Path:
        key = (source, *defines)
        if key not in cache:
            exe = out_dir / "_".join(k.replace("=", "") for k in (Path(source).stem, *defines))
            cxx_build(KERNELS / source, exe, include_dirs=INCLUDES, defines=["GTCO_EMULATE", *defines])
            cache[key] = exe
        return cache[key]

    return build
