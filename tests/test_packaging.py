"""A wheel (what `pip install .` installs) ships the C++/CUDA sources that optimize compiles at run time."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from onnx_gtco.kernels.toolchain import PLUGINS_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_every_plugin_source(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("onnx_gtco-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.relative_to(ROOT / "plugins").as_posix() for p in (ROOT / "plugins").rglob("*") if p.is_file()]
    assert sources and not [s for s in sources if f"onnx_gtco/_plugins/{s}" not in names]
    assert {"onnx_gtco/plugin/library.py", "onnx_gtco/kernels/gemm.py"} <= names


def test_source_checkout_uses_its_plugins_folder() -> None:
    assert PLUGINS_DIR == ROOT / "plugins"
