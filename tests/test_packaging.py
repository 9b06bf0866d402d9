"""A wheel (what `pip install .` installs) ships the C++/CUDA sources that optimize compiles at run time, and works
alone: installed into a fresh venv with only its declared dependencies."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import onnx
import pytest

from onnx_gtco.kernels.toolchain import PLUGINS_DIR
from onnx_gtco.models import build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("onnx_gtco-*.whl")
    return path


@pytest.mark.slow
def test_wheel_ships_every_plugin_source(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.relative_to(ROOT / "plugins").as_posix() for p in (ROOT / "plugins").rglob("*") if p.is_file()]
    assert sources and not [s for s in sources if f"onnx_gtco/_plugins/{s}" not in names]
    assert {"onnx_gtco/plugin/library.py", "onnx_gtco/families/gemm/kernel.py"} <= names
    # the tuning records optimize reads (package data: empty until a GPU run's trials are merged into them)
    assert {"onnx_gtco/tune/records/sm_80.json", "onnx_gtco/tune/records/sm_90.json"} <= names


@pytest.mark.slow
def test_wheel_alone_in_a_fresh_venv_runs_a_model_with_symbolic_dims(wheel: Path, tmp_path: Path) -> None:
    """`pip install onnx_gtco-*.whl` into a venv without system packages pulls exactly the declared dependencies;
    optimize, inspect and check then run on a BERT whose inputs have symbolic batch and seq (the loader's symbolic
    shape inference needs sympy, which only a declared dependency brings here)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, clear=True)
    py = env_dir / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = tmp_path / "bert.onnx"
    onnx.save(build("bert-tiny", batch="batch", seq="seq", depth=1), str(model))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cli = str(env_dir / "bin" / "onnx-gtco")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([cli, *args], capture_output=True, text=True, timeout=600, check=False, env=env,
                              cwd=tmp_path)

    where = run("--version")
    assert where.returncode == 0 and where.stdout.startswith("onnx-gtco "), where.stderr
    opt = run("optimize", str(model), "--cpu")
    assert opt.returncode == 0, opt.stdout + opt.stderr
    assert "Traceback" not in opt.stderr
    rewritten = tmp_path / "bert.gtco.onnx"
    assert rewritten.is_file() and (tmp_path / "bert.gtco.onnx.report.json").is_file()
    dims = {d.dim_param for v in onnx.load(str(rewritten), load_external_data=False).graph.input
            for d in v.type.tensor_type.shape.dim}
    assert {"batch", "seq"} <= dims
    ins = run("inspect", str(model))
    assert ins.returncode == 0 and "Traceback" not in ins.stderr, ins.stderr
    chk = run("check", str(model), str(rewritten), "--dim", "batch=2", "--dim", "seq=24", "--library")
    assert chk.returncode == 0, chk.stdout + chk.stderr
    # the installed package is the wheel's, not this checkout
    site = subprocess.run([str(py), "-c", "import onnx_gtco; print(onnx_gtco.__file__)"], capture_output=True,
                          text=True, check=True, env=env, cwd=tmp_path).stdout
    assert str(env_dir) in site


def test_source_checkout_uses_its_plugins_folder() -> None:
    assert PLUGINS_DIR == ROOT / "plugins"
