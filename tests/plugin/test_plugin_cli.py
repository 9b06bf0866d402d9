"""`onnx-gtco optimize` builds the library by default (beside the output, recorded in the metadata and the report);
--no-build skips it, --cuda requires nvcc, a failed build writes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from plugin_helpers import ln_softmax_model

from onnx_gtco.cli import main
from onnx_gtco.errors import OutputError
from onnx_gtco.pipeline import optimize_file
from onnx_gtco.plugin.headers import ort_include_dir
from onnx_gtco.runtime.session import METADATA_KEY


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    p = tmp_path / "m.onnx"
    onnx.save(ln_softmax_model(), str(p))
    return p


def _meta(path: Path) -> dict[str, str]:
    return {m.key: m.value for m in onnx.load(str(path)).metadata_props}


def test_optimize_builds_the_library_by_default(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["optimize", "--cpu", str(model_path)]) == 0
    out = model_path.with_name("m.gtco.onnx")
    name = _meta(out)[METADATA_KEY]
    assert (out.parent / name).is_file() and name.startswith("libgtco-")
    text = capsys.readouterr().out
    assert name in text and "registers Layernorm_f32, Softmax_f32" in text
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    assert report["library"]["file"] == name and report["library"]["skipped"] == {}
    assert main(["check", "--library", "--dim", "H=16", "--dim", "N=3", str(model_path), str(out)]) == 0


def test_default_build_without_nvcc_warns(model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("NVCC", str(model_path.parent / "no-nvcc"))
    assert main(["optimize", str(model_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: nvcc not found" in err and "CPU kernels only" in err
    assert METADATA_KEY in _meta(model_path.with_name("m.gtco.onnx"))


def test_explicit_cuda_without_nvcc_is_an_error(model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("NVCC", str(model_path.parent / "no-nvcc"))
    assert main(["optimize", "--cuda", str(model_path)]) == 2
    assert "nvcc not found" in capsys.readouterr().err
    assert sorted(p.name for p in model_path.parent.iterdir()) == ["m.onnx"]


def test_no_build_writes_no_library(model_path: Path) -> None:
    assert main(["optimize", "--no-build", str(model_path)]) == 0
    assert not list(model_path.parent.glob("*.so"))
    assert METADATA_KEY not in _meta(model_path.with_name("m.gtco.onnx"))


def test_failed_build_writes_nothing(model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(ort_include_dir()))
    monkeypatch.setenv("XDG_CACHE_HOME", str(model_path.parent / "cache"))
    monkeypatch.delenv("GTCO_CACHE_DIR", raising=False)  # it would win over XDG_CACHE_HOME
    monkeypatch.setenv("CXX", shutil.which("false") or "false")
    assert main(["optimize", "--cpu", str(model_path)]) == 2
    err = capsys.readouterr().err
    assert "building the custom-op library failed" in err and "--no-build" in err
    assert sorted(p.name for p in model_path.parent.iterdir() if p.is_file()) == ["m.onnx"]
    assert not [p for p in (model_path.parent / "cache").rglob("*") if p.is_file()]


def test_library_removed_when_writing_the_model_fails(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnx_gtco.pipeline as pipeline

    def fail(*_a: object, **_k: object) -> None:
        raise OutputError("disk full")

    monkeypatch.setattr(pipeline, "save_atomic", fail)
    with pytest.raises(OutputError):
        optimize_file(model_path, build="cpu")
    assert sorted(p.name for p in model_path.parent.iterdir()) == ["m.onnx"]


def test_python_api_builds_only_on_request(model_path: Path) -> None:
    result, out, _ = optimize_file(model_path)
    assert result.library is None and not list(out.parent.glob("*.so"))
    with pytest.raises(OutputError, match="build='gpu'"):
        optimize_file(model_path, build="gpu")
