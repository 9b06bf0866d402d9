"""Defaults that fit the model and the machine, built-in names wherever a model path goes, and misuse answered in one
line with exit 2 and nothing left on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from onnx_gtco import config
from onnx_gtco.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("onnx-gtco: note:")]
    assert len(lines) == 1 and lines[0].startswith("onnx-gtco: error: "), err
    return lines[0]


def test_bench_takes_the_models_own_batch(tmp_path: Path, make_mlp, capsys: pytest.CaptureFixture[str]) -> None:
    """A model exported with a fixed batch of 2 benches at 2 without --batch (it used to fail asking for a
    symbolic batch)."""
    path = tmp_path / "mlp2.onnx"
    onnx.save(make_mlp(rows=2), str(path))
    out = tmp_path / "bench"
    assert main(["bench", str(path), "--provider", "cpu", "--baselines", "ort-fp32", "--quick", "--runs", "3",
                 "--warmup", "1", "--out", str(out)]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert [b["batch"] for b in doc["batches"]] == [2]
    assert " --batch 2 " in doc["command"]
    assert "batch 2: the model's own" in capsys.readouterr().err
    assert main(["bench", str(path), "--provider", "cpu", "--baselines", "ort-fp32", "--quick", "--runs", "3",
                 "--batch", "3", "--out", str(out)]) == 2
    assert "fixed batch of 2" in _one_error_line(capsys.readouterr().err)


@pytest.fixture
def fake_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An nvidia-smi on PATH that reports a GPU of the given compute capability."""
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def install(cap: str) -> None:
        smi = bindir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho {cap}\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.delenv("GTCO_TARGET", raising=False)
        config.local_gpu.cache_clear()

    yield install
    config.local_gpu.cache_clear()


@pytest.mark.parametrize(("cap", "target"), [("8.6", "sm_80"), ("8.9", "sm_80"), ("9.0", "sm_90"), ("8.0", "sm_80")])
def test_target_follows_the_local_gpu_and_says_so(cap: str, target: str, fake_gpu, tmp_path: Path, mlp,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake_gpu(cap)
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp, str(path))
    assert main(["optimize", str(path), "--no-build"]) == 0
    arch = "sm_" + cap.replace(".", "")
    assert f"onnx-gtco: note: the local GPU is {arch}: planning for {target}" in capsys.readouterr().err
    report = json.loads(path.with_name("mlp.gtco.onnx.report.json").read_text())
    assert report["target"] == target


def test_explicit_target_wins_and_an_unknown_gpu_gets_the_default(fake_gpu, tmp_path: Path, mlp,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake_gpu("7.5")
    assert config.default_target() == ("sm_90", "the local GPU is sm_75, which has no kernels of its own: planning "
                                                "for sm_90 (pass --target to choose)")
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp, str(path))
    assert main(["inspect", str(path), "--target", "sm_80"]) == 0
    cap = capsys.readouterr()
    assert "note:" not in cap.err and "sm_80" in cap.out
    fake_gpu("9.0")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every device hidden: no GPU, whatever nvidia-smi says
    try:
        config.local_gpu.cache_clear()
        assert config.default_target()[1].startswith("no GPU visible")
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]


def test_builtin_names_work_wherever_a_model_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "bert-tiny"]) == 0
    assert "bert-tiny" in capsys.readouterr().out
    assert main(["optimize", "bert-tiny", "--no-build"]) == 0
    assert (tmp_path / "bert-tiny.gtco.onnx").is_file() and (tmp_path / "bert-tiny.gtco.onnx.report.json").is_file()
    assert main(["check", "bert-tiny", "bert-tiny.gtco.onnx"]) == 0
    assert "1 of 1 outputs within" in capsys.readouterr().out
    assert main(["inspect", "vit-huge"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "vit-huge: neither a file nor a built-in model (no such file; built-in: vit-tiny" in line


def test_demo_with_an_unknown_model_is_one_line_and_leaves_no_folder(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--model", "vit-huge", "--out", str(out)]) == 2
    assert "demo --model vit-huge: not a built-in model" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_a_closed_output_pipe_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """`onnx-gtco inspect ... | head`: the reader is gone before the plan is printed."""
    proc = subprocess.Popen([sys.executable, "-m", "onnx_gtco", "inspect", "vit-tiny", "--target", "sm_90"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 2
    assert "Traceback" not in err
    assert _one_error_line(err) == "onnx-gtco: error: the output pipe was closed before everything was written"


@pytest.mark.parametrize(("line", "target", "calibrated"), [
    ("NVIDIA H200, 9.0", "h200", True), ("NVIDIA H100 80GB HBM3, 9.0", "h100", False),
    ("NVIDIA A100-SXM4-80GB, 8.0", "a100", False), ("NVIDIA GH200 480GB, 9.0", "sm_90", False),
    ("NVIDIA L40S, 8.9", "sm_80", False)])
def test_the_target_is_the_local_gpu_by_name_and_the_report_names_its_calibration(
        line: str, target: str, calibrated: bool, fake_gpu, tmp_path: Path, mlp,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An H200 is planned with the H200's data sheet and calibration, not the sm_90 arch's H100 data sheet; a GPU the
    planner does not know by name gets its arch's target."""
    fake_gpu(line)
    assert config.default_target()[0] == target
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp, str(path))
    assert main(["optimize", str(path), "--no-build"]) == 0
    err = capsys.readouterr().err
    assert f"planning for {target}" in err and line.split(",")[0] in err
    report = json.loads(path.with_name("mlp.gtco.onnx.report.json").read_text())
    assert report["target"] == target
    assert bool(report["estimate"]["calibration"]) is calibrated
    if calibrated:
        assert report["estimate"]["calibration"]["gpu"] == "NVIDIA H200"
    else:
        assert f"no calibration of {target}" in report["estimate"]["note"]
