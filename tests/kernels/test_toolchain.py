"""onnx_gtco.kernels.toolchain: finding compilers and reporting their failures."""

from __future__ import annotations

import shutil

import pytest

from onnx_gtco.errors import GtcoError
from onnx_gtco.kernels.toolchain import BuildError, cxx_build, find_cxx, find_nvcc, nvcc_compile


def test_nvcc_override_to_missing_path(monkeypatch, tmp_path):
    monkeypatch.setenv("NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(BuildError, match=r"nvcc not found \(set NVCC or install the CUDA toolkit\)") as e:
        find_nvcc()
    assert "no-such-nvcc" in str(e.value)
    with pytest.raises(BuildError, match="nvcc not found"):
        nvcc_compile(tmp_path / "k.cu", tmp_path / "k.o")


def test_nvcc_missing_from_path(monkeypatch, tmp_path):
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildError, match=r"^nvcc not found \(set NVCC or install the CUDA toolkit\)$"):
        find_nvcc()


def test_cxx_override_to_missing_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(BuildError, match=r"g\+\+ not found \(set CXX or install g\+\+\)"):
        find_cxx()


def test_build_error_is_a_gtco_error():
    assert issubclass(BuildError, GtcoError)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found on PATH")
def test_compile_error_names_source_and_first_error(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    src = tmp_path / "broken.cc"
    src.write_text("int main() { return undefined_name; }\n")
    with pytest.raises(BuildError) as e:
        cxx_build(src, tmp_path / "broken")
    msg = str(e.value)
    assert "broken.cc" in msg and "undefined_name" in msg and msg.startswith("g++ failed on ")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found on PATH")
def test_compile_success(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    src = tmp_path / "ok.cc"
    src.write_text("int main() { return 0; }\n")
    result = cxx_build(src, tmp_path / "ok")
    assert (tmp_path / "ok").exists() and result.command[0].endswith("g++") and result.seconds > 0
