"""The CUDA EP guard: a session that asked for CUDA and silently fell back to the CPU is an error, never a number."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnx_gtco.bench.timing import time_ort
from onnx_gtco.errors import CudaProviderError
from onnx_gtco.runtime import cuda_ep
from onnx_gtco.runtime.cuda_ep import load_cuda_libraries, nvidia_lib_dirs, require_cuda_ep


class _Session:
    def __init__(self, providers: list[str]) -> None:
        self.providers = providers

    def get_providers(self) -> list[str]:
        return self.providers


def test_fallback_to_cpu_is_an_error_naming_the_providers():
    with pytest.raises(CudaProviderError, match=r"bench: onnxruntime created no CUDAExecutionProvider .*"
                                                r"runs on CPUExecutionProvider\)"):
        require_cuda_ep(_Session(["CPUExecutionProvider"]), "bench")
    s = _Session(["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert require_cuda_ep(s, "bench") is s


def test_timing_refuses_a_cuda_run_that_fell_back(monkeypatch):
    """time_ort on "cuda" with a session ORT gave only the CPU EP: both tries (with and without CUDA graphs) refuse."""
    import onnxruntime as ort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    made = []

    def make(cuda_graph: bool):
        made.append(cuda_graph)
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    with pytest.raises(CudaProviderError, match="the timed session"):
        time_ort(make, {"x": np.ones(2, np.float32)}, "cuda", {"y": (2,)}, runs=1, warmup=0)
    assert made == [True, False]


def test_lib_dirs_of_every_site_folder(tmp_path, monkeypatch):
    """nvidia/*/lib folders are found in each site folder holding part of the namespace package (a venv's and
    torch's, say), and only folders."""
    for site, pkg in (("a", "cu13"), ("b", "cudnn")):
        (tmp_path / site / "nvidia" / pkg / "lib").mkdir(parents=True)
    (tmp_path / "b" / "nvidia" / "cudnn" / "include").mkdir()
    (tmp_path / "b" / "nvidia" / "README").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "a"), str(tmp_path / "b")])
    for mod in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, mod)
    site_a, site_b = tmp_path / "a" / "nvidia", tmp_path / "b" / "nvidia"
    assert nvidia_lib_dirs() == [site_a / "cu13" / "lib", site_b / "cudnn" / "lib"]


def test_preload_is_a_noop_without_the_cuda_ep(monkeypatch):
    import onnxruntime as ort

    calls = []
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    monkeypatch.setattr(ort, "preload_dlls", lambda **kw: calls.append(kw), raising=False)
    load_cuda_libraries.cache_clear()
    try:
        assert load_cuda_libraries() == ()
    finally:
        load_cuda_libraries.cache_clear()
    assert calls == []


def test_preload_asks_onnxruntime_per_wheel_folder(tmp_path, monkeypatch):
    import onnxruntime as ort

    cu = tmp_path / "cu13" / "lib"
    dnn = tmp_path / "cudnn" / "lib"
    other = tmp_path / "nccl" / "lib"
    for d, f in ((cu, "libcublasLt.so.13"), (dnn, "libcudnn.so.9"), (other, "libnccl.so.2")):
        d.mkdir(parents=True)
        (d / f).write_bytes(b"")
    calls = []
    monkeypatch.setattr(cuda_ep, "nvidia_lib_dirs", lambda: [cu, dnn, other])
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "preload_dlls", lambda **kw: calls.append(kw), raising=False)
    load_cuda_libraries.cache_clear()
    try:
        assert load_cuda_libraries() == (str(cu), str(dnn))
    finally:
        load_cuda_libraries.cache_clear()
    assert calls == [{"cuda": True, "cudnn": False, "msvc": False, "directory": str(cu)},
                     {"cuda": False, "cudnn": True, "msvc": False, "directory": str(dnn)}]
