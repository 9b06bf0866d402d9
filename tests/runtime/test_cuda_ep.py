"""The CUDA EP guard: a session that asked for CUDA and silently fell back to the CPU is an error, never a number."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import optimize
from onnx_gtco.bench.timing import time_ort
from onnx_gtco.errors import CheckError, CudaProviderError
from onnx_gtco.runtime import cuda_ep
from onnx_gtco.runtime.cuda_ep import (
    CUDA_EP,
    fused_nodes_of,
    load_cuda_libraries,
    node_runs,
    nvidia_lib_dirs,
    off_cuda,
    profile_events,
    profiled_options,
    require_cuda_ep,
    require_fused_on_cuda,
)


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


# --- where each fused node ran: ORT's profile -------------------------------------------------------------------

def _ln_softmax() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(x + r) -> LayerNormalization -> Softmax, and its rewrite: two ai.gtco nodes (Layernorm_f32, Softmax_f32)."""
    g = numpy_helper.from_array(np.linspace(0.5, 1.5, 16).astype(np.float32), "gamma")
    b = numpy_helper.from_array(np.linspace(-1, 1, 16).astype(np.float32), "beta")
    nodes = [helper.make_node("Add", ["x", "r"], ["s"], name="res"),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1),
             helper.make_node("Softmax", ["y"], ["z"], name="sm", axis=-1)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 16]) for n in ("x", "r", "z")]
    original = helper.make_model(helper.make_graph(nodes, "ln_softmax", io[:2], io[2:], [g, b]),
                                 opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return original, optimize(original).model


def _cpu_profile(model: onnx.ModelProto, tmp_path: Path) -> list[dict]:
    import onnxruntime as ort

    so = profiled_options(ort.SessionOptions(), tmp_path)
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    s.run(None, {k: np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32) for k in ("x", "r")})
    events = profile_events(s)
    assert not list(tmp_path.iterdir())  # the profile file is gone
    return events


def _run(node: str, op: str, provider: str, out: str = "float") -> dict:
    return {"cat": "Node", "name": f"{node}_kernel_time",
            "args": {"op_name": op, "provider": provider, "output_type_shape": [{out: [2]}]}}


def test_a_real_cpu_profile_names_every_fused_node(tmp_path: Path) -> None:
    """ORT's own profile of the rewritten model on the CPU EP (the functions inlined): each ai.gtco node is named,
    with the function's node that ran on the CPU."""
    _, rewritten = _ln_softmax()
    fused = fused_nodes_of(rewritten)
    assert {op for _, op in fused} == {"Layernorm_f32", "Softmax_f32"}
    runs = node_runs(_cpu_profile(rewritten, tmp_path))
    assert runs and {r.provider for r in runs} == {"CPUExecutionProvider"}
    assert all(r.node.startswith("_inlfunc_") for r in runs), runs
    problems = off_cuda(fused, runs)
    assert len(problems) == 2
    for (name, op), line in zip(fused, problems, strict=True):
        assert line.startswith(f"ai.gtco node {name!r} ({op}) ran as its function, whose node '_inlfunc_{op}_")
        assert line.endswith("ran on CPUExecutionProvider")
    with pytest.raises(CudaProviderError, match=r"check: not every fused node ran on the CUDAExecutionProvider: "
                                                r"ai.gtco node 'gtco/layernorm/res'"):
        require_fused_on_cuda(rewritten, _cpu_profile(rewritten, tmp_path), "check")


def test_synthetic_profiles(tmp_path: Path) -> None:
    _, rewritten = _ln_softmax()
    (ln, ln_op), (sm, sm_op) = fused_nodes_of(rewritten)
    real = _cpu_profile(rewritten, tmp_path)
    on_cuda = [{**e, "args": {**e["args"], "provider": CUDA_EP}} if e.get("cat") == "Node" else e for e in real]
    shape = _run("Shape_1", "Shape", "CPUExecutionProvider", out="int64")  # shape arithmetic stays on the CPU
    require_fused_on_cuda(rewritten, [*on_cuda, shape], "bench")
    # kernels: the registered one on the CUDA EP passes, a CPU kernel is named
    kernels = [_run(ln, ln_op, CUDA_EP), _run(sm, sm_op, "CPUExecutionProvider")]
    assert off_cuda([(ln, ln_op), (sm, sm_op)], node_runs(kernels)) == [
        f"ai.gtco node {sm!r} ({sm_op}) ran its kernel on CPUExecutionProvider"]
    # a function's node on the CPU beside others on the CUDA EP
    mixed = [*on_cuda, _run(f"_inlfunc_{sm_op}_n9", "Exp", "CPUExecutionProvider")]
    with pytest.raises(CudaProviderError, match=rf"ai.gtco node '{sm}' \({sm_op}\) ran as its function, whose "
                                                rf"node '_inlfunc_{sm_op}_n9' \(Exp\) ran on CPUExecutionProvider"):
        require_fused_on_cuda(rewritten, mixed, "bench")
    # no run names the nodes (ORT fused their functions' ops): fine while nothing else ran off the CUDA EP
    renamed = [_run("SkipLayerNorm_token_1", "SkipLayerNormalization", CUDA_EP), shape]
    require_fused_on_cuda(rewritten, renamed, "bench")
    stray = [*renamed, _run("MatMul_7", "MatMul", "CPUExecutionProvider")]
    problems = off_cuda(fused_nodes_of(rewritten), node_runs(stray))
    assert [p.split(" has no run")[0] for p in problems] == [f"ai.gtco node {ln!r} ({ln_op})",
                                                             f"ai.gtco node {sm!r} ({sm_op})"]
    assert all("'MatMul_7' (MatMul) ran on CPUExecutionProvider" in p for p in problems)


def test_inlined_nodes_belong_to_the_longest_op_type() -> None:
    runs = node_runs([_run("a", "Gemm_f16", CUDA_EP),
                      _run("_inlfunc_Gemm_f16_of32_n0", "MatMul", "CPUExecutionProvider")])
    problems = off_cuda([("a", "Gemm_f16"), ("b", "Gemm_f16_of32")], runs)
    assert len(problems) == 1 and problems[0].startswith("ai.gtco node 'b' (Gemm_f16_of32) ran as its function")
    assert off_cuda([("a", "Gemm_f16")], node_runs([_run("_inlfunc_Gemm_f16_of32_n0", "MatMul", CUDA_EP)])) == []


NO_CUDA_EP = pytest.mark.skipif("CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers(),
                                reason="tests the answer of an onnxruntime without the CUDA EP")


@NO_CUDA_EP
def test_asking_for_cuda_without_the_ep_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from onnx_gtco.cli import main
    from onnx_gtco.runtime.check import compare
    from onnx_gtco.runtime.session import make_session

    original, rewritten = _ln_softmax()
    path = tmp_path / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    with pytest.raises(CudaProviderError, match=r"CUDAExecutionProvider was asked for, but this onnxruntime .* has "
                                                r"none .*install onnxruntime-gpu"):
        make_session(path, [CUDA_EP, "CPUExecutionProvider"])
    with pytest.raises(CheckError, match="CUDAExecutionProvider is not available in this onnxruntime"):
        compare(original, rewritten, provider="cuda")
    assert main(["bench", "vit-tiny", "--provider", "cuda", "--out", str(tmp_path / "o")]) == 2
    assert "CUDAExecutionProvider is not available" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_check_on_cuda_refuses_fused_nodes_that_ran_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """check --provider cuda profiles the rewritten model's runs: here "cuda" names the CPU EP (what a fallback
    that slipped past the provider check would do), and the fused nodes are named instead of a comparison."""
    from onnx_gtco.runtime import check

    monkeypatch.setitem(check.PROVIDERS, "cuda", "CPUExecutionProvider")
    monkeypatch.setattr(check, "require_cuda_ep", lambda session, what: session)
    original, rewritten = _ln_softmax()
    with pytest.raises(CudaProviderError, match=r"check --provider cuda: not every fused node ran on the "
                                                r"CUDAExecutionProvider: ai.gtco node 'gtco/layernorm/res'"):
        check.compare(original, rewritten, provider="cuda")
    assert all(d.ok for d in check.compare(original, rewritten, provider="cpu"))


def test_bench_ours_fails_naming_the_node_before_any_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "gtco" variant on "cuda" proves placement on a profiled run first: a fused node off the CUDA EP makes it
    "failed", naming the node, and nothing is timed."""
    import onnxruntime as ort

    import onnx_gtco.runtime.session
    from onnx_gtco.bench import variants

    original, rewritten = _ln_softmax()
    path, src = tmp_path / "model.gtco.onnx", tmp_path / "model.onnx"
    onnx.save(rewritten, str(path))
    onnx.save(original, str(src))

    def cpu_session(p, providers, library="auto", sess_options=None):  # a CUDA request that ran on the CPU
        return ort.InferenceSession(str(p), sess_options, providers=["CPUExecutionProvider"])

    def never(*args, **kwargs):
        raise AssertionError("timed before the placement was proven")

    monkeypatch.setattr(onnx_gtco.runtime.session, "make_session", cpu_session)
    monkeypatch.setattr(variants, "time_ort", never)
    feeds = {k: np.ones((2, 16), np.float32) for k in ("x", "r")}
    ctx = variants.Context(original, src, tmp_path, "cuda", "fp32", "sm_90", "bert", feeds,
                           variants.reference_outputs(src, feeds), runs=1, warmup=0, rewritten=path)
    result = variants.run_variant(variants.OURS, ctx)
    assert result.status == "failed" and result.timed is None
    assert "ai.gtco node 'gtco/layernorm/res' (Layernorm_f32) ran as its function" in result.reason
