"""A model's custom-op library with a GEMM node whose tuned configuration is cuBLASLt: it builds for sm_80 and sm_90
with the node's cuBLASLt instances and their mma fallbacks, links without libcublasLt, and (on a GPU with the CUDA
EP) computes the model through cuBLASLt, without falling back. tests/families/gemm/test_cublaslt_fallback.py runs the
fallback itself, on the CPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from plugin_helpers import relu_gemm_model

from onnx_gtco import optimize
from onnx_gtco.errors import HeaderError
from onnx_gtco.families.gemm.cublas_headers import cublaslt_include_dir
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.plugin.library import LibraryResult, build_library, library_info
from onnx_gtco.runtime.session import METADATA_KEY, make_session

M, K, N = 96, 64, 128
LT = {"impl": "cublaslt", "RANK": 0}


def _model() -> onnx.ModelProto:
    return relu_gemm_model(M, K, N)


def _build(tmp_path: Path) -> tuple[onnx.ModelProto, LibraryResult, str]:
    try:
        cublaslt_include_dir()
    except HeaderError as e:
        pytest.skip(f"the cuBLASLt header could not be obtained: {e}")
    rewritten = optimize(_model()).model
    gemm = next(n.name for n in rewritten.graph.node if n.domain == "ai.gtco" and n.op_type.startswith("Gemm"))
    lib = build_library(rewritten, tmp_path, cuda=True, tuned={gemm: {"sm_80": LT, "sm_90": LT}})
    return rewritten, lib, gemm


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed for the CUDA build")
def test_tuned_cublaslt_node_builds_into_the_library(tmp_path: Path) -> None:
    _, lib, gemm = _build(tmp_path)
    names = library_info(lib.path)["instances"][gemm]  # type: ignore[index]
    # the sm_90a slot holds the sm_90 instance (sm_90a builds CUTLASS instances only where one is tuned for it)
    assert names == ["cublaslt_sm80_f16_r0_bias_relu", *["cublaslt_sm90_f16_r0_bias_relu"] * 2], names
    # each slot's mma fallback, compiled with the others (the sm_90a slot's is the sm_90 one, as its instance is)
    fallback = library_info(lib.path)["fallback"][gemm]  # type: ignore[index]
    assert [f.split("_")[:3] for f in fallback] == [["gemm", "sm80", "f16"], *[["gemm", "sm90", "f16"]] * 2]
    assert fallback[1] == fallback[2] and all(f.endswith("_bias_relu") for f in fallback), fallback
    assert lib.fallbacks == {gemm: dict(zip(("sm_80", "sm_90", "sm_90a"), fallback, strict=True))}
    assert {(k["instance"], k["arch"]) for k in lib.kernels} >= {(fallback[0], "sm_80"), (fallback[1], "sm_90")}
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", "--dyn-syms", "-W", str(lib.path)], capture_output=True,
                             text=True, check=True).stdout
    assert "gtco_cublaslt_error" in dynamic and "libcublas" not in dynamic.lower()


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu with the CUDA EP and an NVIDIA GPU")
def test_cuda_session_runs_the_cublaslt_node(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    rewritten, lib, _ = _build(tmp_path)
    rewritten.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
    path = tmp_path / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    sess = make_session(path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    original = ort.InferenceSession(_model().SerializeToString(), providers=["CPUExecutionProvider"])
    for seed in (0, 1):
        x = {"X": np.random.default_rng(seed).standard_normal((M, K)).astype(np.float16)}
        want = original.run(None, x)[0].astype(np.float64)
        got = sess.run(None, x)[0].astype(np.float64)
        assert np.abs(want).max() > 0.1 and rel_error(got, want) < 5e-3
    # cuBLASLt ran: with the CUDA EP's libcublasLt loaded, the node never fell back to its mma instance
    assert "the node runs its mma fallback" not in capfd.readouterr().err
