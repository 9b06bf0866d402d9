"""The custom-op library end to end on the CPU EP: bind, generate, build (cached), register, run, compare."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from plugin_helpers import (
    Built,
    build_model,
    decomposed_ln_model,
    ln_softmax_model,
)

from onnx_gtco import optimize
from onnx_gtco.cli import main
from onnx_gtco.errors import GtcoError
from onnx_gtco.families.layernorm.bind import LayerNormBinder
from onnx_gtco.kernels.family import Instance, Problem
from onnx_gtco.kernels.toolchain import BuildError
from onnx_gtco.plugin import headers
from onnx_gtco.plugin.binding import Binding, FusedNode
from onnx_gtco.plugin.library import bind_nodes, build_library, function_only_nodes, library_info
from onnx_gtco.plugin.nodes import fused_nodes
from onnx_gtco.runtime.check import compare, make_inputs
from onnx_gtco.runtime.session import LibraryError, make_session

CPU = ["CPUExecutionProvider"]


def ran_ops(path: Path, tmp: Path, feeds: dict[str, np.ndarray], library: bool | str) -> set[str]:
    """Op types of the kernels ORT ran (its profile), for the model at `path`."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "profile")
    s = make_session(path, CPU, library=library, sess_options=so)
    s.run(None, feeds)
    events = json.loads(Path(s.end_profiling()).read_text())
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


# --- the built-in ViT -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_vit_with_library_matches_original(vit: Built, seed: int) -> None:
    feeds = make_inputs(onnx.load(str(vit.original)), seed)
    ref = ort.InferenceSession(str(vit.original), providers=CPU).run(None, feeds)
    got = make_session(vit.rewritten, CPU, library=True).run(None, feeds)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_vit_library_registers_every_bound_family(vit: Built) -> None:
    nodes = fused_nodes(onnx.load(str(vit.rewritten)))
    served = [n for n in nodes if n.family in ("layernorm", "gemm", "attention", "conv", "elementwise")]
    assert any(n.family == "conv" for n in nodes)  # the patch embedding
    # Elementwise_f32: the patch embedding's flatten + transpose to tokens, a fused copy
    assert vit.lib.op_types == ["Attention_f32", "Conv_f32", "Elementwise_f32", "Gemm_f32", "Layernorm_f32"]
    info = library_info(vit.lib.path)
    assert info["op_types"] == vit.lib.op_types and info["cuda_op_types"] == []
    assert set(info["nodes"]) == {n.node.name for n in served}  # type: ignore[arg-type]
    assert vit.lib.skipped() == {}


def test_custom_kernel_runs_only_with_the_library(vit: Built, tmp_path: Path) -> None:
    feeds = make_inputs(onnx.load(str(vit.original)), 0)
    assert {"Layernorm_f32", "Conv_f32"} <= ran_ops(vit.rewritten, tmp_path, feeds, True)
    without = ran_ops(vit.rewritten, tmp_path, feeds, "auto")  # CPU session: auto does not register it
    assert not {"Layernorm_f32", "Conv_f32"} & without and {"LayerNormalization", "Conv"} <= without


def test_check_cli_with_library(vit: Built, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--library", str(vit.original), str(vit.rewritten)]) == 0
    assert "custom-op library registered" in capsys.readouterr().out
    diffs = compare(vit.original, vit.rewritten, library=True, samples=2)
    assert all(d.ok for d in diffs)


# --- a small LayerNorm + Softmax model ----------------------------------------------------------------------------

def test_small_model_softmax_and_layernorm(small: Built, tmp_path: Path) -> None:
    assert small.lib.op_types == ["Layernorm_f32", "Softmax_f32"] and not small.lib.skipped()
    rng = np.random.default_rng(3)
    feeds = {k: rng.standard_normal((5, 16)).astype(np.float32) for k in ("x", "r")}
    ref = ort.InferenceSession(str(small.original), providers=CPU).run(None, feeds)[0]
    got = make_session(small.rewritten, CPU, library=True).run(None, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert {"Layernorm_f32", "Softmax_f32"} <= ran_ops(small.rewritten, tmp_path, feeds, True)


def test_float16_nodes(tmp_path: Path) -> None:
    built = build_model(ln_softmax_model(elem=onnx.TensorProto.FLOAT16), tmp_path)
    assert built.lib.op_types == ["Layernorm_f16", "Softmax_f16"]
    rng = np.random.default_rng(4)
    feeds = {k: rng.standard_normal((5, 16)).astype(np.float16) for k in ("x", "r")}
    ref = ort.InferenceSession(str(built.original), providers=CPU).run(None, feeds)[0]
    got = make_session(built.rewritten, CPU, library=True).run(None, feeds)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("reciprocal", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_decomposed_layernorm(reciprocal: bool, affine: bool, tmp_path: Path) -> None:
    built = build_model(decomposed_ln_model(reciprocal=reciprocal, affine=affine), tmp_path)
    (res,) = built.lib.nodes
    assert res.binding is not None and res.binding.inputs[1] == -1  # no residual addend
    assert (res.binding.inputs[2] >= 0) == affine and (res.binding.inputs[3] >= 0) == affine
    feeds = {"x": np.random.default_rng(5).standard_normal((3, 4, 16)).astype(np.float32) * 3 + 1}
    ref = ort.InferenceSession(str(built.original), providers=CPU).run(None, feeds)[0]
    got = make_session(built.rewritten, CPU, library=True).run(None, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert "Layernorm_f32" in ran_ops(built.rewritten, tmp_path, feeds, True)


def test_bert_tiny_decomposed_layernorm_with_library(tmp_path: Path) -> None:
    from onnx_gtco.models import build

    built = build_model(build("bert-tiny", seed=0), tmp_path)
    # Elementwise_f32: the attention mask's int64 -> float preparation (static shapes here)
    # no Qkv_f32: a block's Q, K and V projections are one Gemm_f32 (families/gemm/pack.py)
    assert built.lib.op_types == ["Attention_f32", "Elementwise_f32", "Gemm_f32", "Layernorm_f32"]
    assert all(d.ok for d in compare(built.original, built.rewritten, library=True, samples=2))
    feeds = make_inputs(onnx.load(str(built.original)), 0)
    assert "Layernorm_f32" in ran_ops(built.rewritten, tmp_path, feeds, True)


def test_wrong_shape_is_an_ort_error_naming_op_and_shapes(small: Built) -> None:
    s = make_session(small.rewritten, CPU, library=True)
    x = np.ones((2, 8), np.float32)
    with pytest.raises(Exception, match=r"Layernorm_f32 node 'gtco/layernorm/res'.*\[16\].*8 normalised.*\[2,8\]"):
        s.run(None, {"x": x, "r": x})
    with pytest.raises(Exception, match=r"Layernorm_f32 .*residual addends have shapes \[2,16\] and \[3,16\]"):
        s.run(None, {"x": np.ones((2, 16), np.float32), "r": np.ones((3, 16), np.float32)})
    # the session survives the errors
    out = s.run(None, {"x": np.ones((2, 16), np.float32), "r": np.zeros((2, 16), np.float32)})[0]
    assert out.shape == (2, 16)


def test_one_unbindable_node_runs_its_function_and_its_siblings_keep_their_bindings() -> None:
    nodes = fused_nodes(optimize(ln_softmax_model()).model)
    ln = next(n for n in nodes if n.family == "layernorm")
    broken_node = onnx.NodeProto()
    broken_node.CopyFrom(ln.node)
    broken_node.name = "broken"
    f16 = tuple(dataclasses.replace(i, dtype="f16") if k == len(ln.inputs) - 1 else i
                for k, i in enumerate(ln.inputs))  # its last operand is float16: no f32 kernel takes it
    broken = FusedNode(broken_node, ln.function, ln.attrs, f16, ln.outputs)
    assert "is f16; the Layernorm_f32 kernel takes f32 only" in str(LayerNormBinder().bind(broken))
    results, binders = bind_nodes([ln, broken, *[n for n in nodes if n is not ln]])
    by = {r.node: r for r in results}
    assert "Layernorm_f32" in binders and "Softmax_f32" in binders
    assert isinstance(by[ln.node.name].binding, Binding) and by[ln.node.name].reason is None
    assert by["broken"].binding is None and "the Layernorm_f32 kernel takes f32 only" in str(by["broken"].reason)
    assert isinstance(by["gtco/softmax/sm"].binding, Binding)
    # the build moves the unbindable node to an op type the library does not register: it runs its function
    assert function_only_nodes(results, None) == {"broken": by["broken"].reason}


# --- build: cache, errors, atomicity ------------------------------------------------------------------------------

def test_rebuild_is_a_cache_hit(small: Built, tmp_path: Path) -> None:
    model = onnx.load(str(small.rewritten))
    again = build_library(model, small.lib.path.parent, cuda=False)
    assert again.path == small.lib.path and again.cached and not again.created
    elsewhere = build_library(model, tmp_path, cuda=False)  # from the per-user cache: no compiler runs
    assert elsewhere.cached and elsewhere.created and elsewhere.name == small.lib.name
    assert elsewhere.path.read_bytes() == small.lib.path.read_bytes()


def test_bad_ort_include_dir_is_a_clear_error(small: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(tmp_path))
    with pytest.raises(GtcoError, match=r"ORT_INCLUDE_DIR=.* has no onnxruntime_cxx_api.h"):
        headers.ort_include_dir()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildError, match="ORT_INCLUDE_DIR"):
        build_library(onnx.load(str(small.rewritten)), out, cuda=False)
    assert not list(out.iterdir())


def test_a_cuda_build_without_the_ort_headers_fails_before_any_kernel_compiles(
        small: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without network the headers are found, or not, before the first nvcc: the build used to fail
    only after every kernel had compiled."""
    from onnx_gtco.plugin import library

    monkeypatch.setenv("ORT_INCLUDE_DIR", str(tmp_path))
    monkeypatch.setattr(library, "compile_instances", lambda *a, **k: pytest.fail("a kernel compiled first"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildError, match="ORT_INCLUDE_DIR"):
        build_library(onnx.load(str(small.rewritten)), out, cuda=True)
    assert not list(out.iterdir())


def test_ort_include_dir_override_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = headers.ort_include_dir()
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(real))
    assert headers.ort_include_dir() == real


def test_header_cache_is_filled_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORT_INCLUDE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GTCO_CACHE_DIR", raising=False)  # it would win over XDG_CACHE_HOME

    def offline(*_a: object, **_k: object) -> object:
        raise OSError("network is unreachable")

    monkeypatch.setattr(headers.urllib.request, "urlopen", offline)
    with pytest.raises(headers.HeaderError, match=r"deb\.debian\.org"):
        headers.ort_include_dir()
    root = tmp_path / "onnx-gtco" / "ort-headers"
    assert not root.exists() or not any(root.iterdir())


def test_failed_build_leaves_nothing(small: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(headers.ort_include_dir()))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_CACHE_DIR", raising=False)  # it would win over XDG_CACHE_HOME
    monkeypatch.setenv("CXX", shutil.which("false") or "false")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildError, match="glue of op types Layernorm_f32, Softmax_f32"):
        build_library(onnx.load(str(small.rewritten)), out, cuda=False)
    assert not list(out.iterdir())
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_missing_library_file_is_a_clear_error(small: Built, tmp_path: Path) -> None:
    moved = tmp_path / small.rewritten.name
    shutil.copy(small.rewritten, moved)  # the library stays behind
    with pytest.raises(LibraryError, match=r"custom-op library .*libgtco-.*\.so .*does not exist"):
        make_session(moved, CPU, library=True)
    make_session(moved, CPU, library="auto")  # CPU: the functions run, the library is not needed
    make_session(moved, CPU, library=False)


# --- CUDA objects (nvcc; no GPU needed to build) --------------------------------------------------------------------

@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="nvcc not installed")
def test_cuda_build_links_cudart_statically(tmp_path: Path) -> None:
    built = build_model(ln_softmax_model(), tmp_path, cuda=True)
    # the hidden size is symbolic: the row-wise kernels are built per size, so no op type has device kernels
    assert built.lib.cuda and built.lib.cuda_op_types == []
    assert all("symbolic" in why for why in built.lib.kernel_skips.values()) and built.lib.kernel_skips
    dyn = subprocess.run(["readelf", "-d", str(built.lib.path)], capture_output=True, text=True, check=True).stdout
    assert "libcudart" not in dyn
    syms = subprocess.run(["nm", "-D", "--defined-only", str(built.lib.path)], capture_output=True, text=True,
                          check=True).stdout
    assert "gtco_cuda_device_count" in syms and "gtco_device_cc" in syms and "RegisterCustomOps" in syms
    # the CPU kernels still run from the CUDA build
    feeds = {k: np.ones((2, 16), np.float32) for k in ("x", "r")}
    make_session(built.rewritten, CPU, library=True).run(None, feeds)


def test_cuda_build_without_nvcc_is_an_error(small: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(BuildError, match="nvcc not found"):
        build_library(onnx.load(str(small.rewritten)), tmp_path, cuda=True)
    assert not list(tmp_path.glob("*.so"))


_SPILL_KERNEL = """
__global__ void gtco_fake_stack(float* p, int i) {
    float a[256];
    for (int j = 0; j < 256; ++j) a[j] = p[j];
    p[0] = a[i];
}
extern "C" __attribute__((visibility("default"))) int gtco_fake_softmax(const void*, void*) { return 0; }
"""


@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="nvcc not installed")
def test_cuda_build_registers_fixed_size_kernels_and_refuses_a_spill(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    built = build_model(ln_softmax_model(hidden=16), tmp_path / "good", cuda=True)
    assert built.lib.cuda_op_types == ["Layernorm_f32", "Softmax_f32"] == built.lib.op_types
    assert library_info(built.lib.path)["cuda_op_types"] == ["Layernorm_f32", "Softmax_f32"]
    assert {(k["instance"].split("_")[0], k["arch"]) for k in built.lib.kernels} == {
        (f, a) for f in ("layernorm", "softmax") for a in ("sm_80", "sm_90")}
    feeds = {k: np.ones((2, 16), np.float32) for k in ("x", "r")}
    make_session(built.rewritten, CPU, library=True).run(None, feeds)  # CPU EP: the CPU kernel of the op type runs

    from onnx_gtco.plugin import device

    def spilling(problem: Problem, arch: str, config: object = None, avoid: object = (), *_: object) -> Instance | str:
        if ("fake_spill", arch) in avoid:  # type: ignore[operator]
            return f"each valid {problem.family} configuration for {arch} spills (ptxas)"
        return Instance("fake_spill", "gtco_fake_softmax", _SPILL_KERNEL, problem, arch=arch)

    # the only configuration spills: the build rejects it, the nodes keep their functions on the device (no CUDA
    # kernel is registered) and their CPU kernels, and the report says why
    monkeypatch.setattr(device, "select_instance", spilling)
    lib = build_library(optimize(ln_softmax_model(hidden=16)).model, tmp_path / "good", cuda=True)
    assert lib.cuda_op_types == [] and lib.op_types == ["Layernorm_f32", "Softmax_f32"]
    assert set(lib.rejected) == {"fake_spill (sm_80)", "fake_spill (sm_90)"}
    assert all(re.search(r"fake_spill \(\) for sm_\d0: ptxas reports .* B stack frame", why)
               for why in lib.rejected.values())
    assert lib.kernel_skips and all("spills" in why for why in lib.kernel_skips.values())
    assert not lib.kernels and not lib.function_only

    # a selection that returns an instance it was told to avoid is an error, not an endless loop
    monkeypatch.setattr(device, "select_instance", lambda p, a, c=None, avoid=(), *_: Instance(
        "fake_spill", "gtco_fake_softmax", _SPILL_KERNEL, p, arch=a))
    out = tmp_path / "spill"
    out.mkdir()
    with pytest.raises(BuildError, match=r"fake_spill \(\) for sm_\d0: ptxas reports .*\(selected again"):
        build_library(optimize(ln_softmax_model(hidden=16)).model, out, cuda=True)
    assert not list(out.iterdir())


def test_unwritable_cache_builds_in_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(headers.ort_include_dir()))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache cannot be created under a file
    monkeypatch.delenv("GTCO_CACHE_DIR", raising=False)  # it would win over XDG_CACHE_HOME
    out = tmp_path / "out"
    out.mkdir()
    lib = build_library(optimize(ln_softmax_model()).model, out, cuda=False)
    assert lib.created and not lib.cached and [p.name for p in out.iterdir()] == [lib.name]


def profiled_ops(session: ort.InferenceSession) -> set[str]:
    """Op types of the kernels a session with profiling on ran."""
    events = json.loads(Path(session.end_profiling()).read_text())
    return {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}


def test_register_modes(small: Built, tmp_path: Path) -> None:
    """A plain register_custom_ops_library (no config entry) registers only op types with CUDA kernels (none in a
    CPU build): the functions run. gtco.register=all registers the CPU-only ones too; anything else is an error."""
    feeds = {k: np.ones((2, 16), np.float32) for k in ("x", "r")}
    for mode, want in ((None, False), ("cuda", False), ("all", True), ("none", False)):
        so = ort.SessionOptions()
        if mode is not None:
            so.add_session_config_entry("gtco.register", mode)
        so.register_custom_ops_library(str(small.lib.path))
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / f"p{mode}")
        s = ort.InferenceSession(str(small.rewritten), so, providers=CPU)
        s.run(None, feeds)
        ops = profiled_ops(s)
        assert ("Layernorm_f32" in ops) == want and ("Softmax_f32" in ops) == want, mode
    for bad in ("yes", "1", "0"):
        so = ort.SessionOptions()
        so.add_session_config_entry("gtco.register", bad)
        with pytest.raises(Exception, match=rf"gtco\.register={bad} is not a mode; use cuda .* all .* or none"):
            so.register_custom_ops_library(str(small.lib.path))


def test_pdl_switch(small: Built) -> None:
    """gtco.pdl=0 / 1 register op objects of their own (sessions of one process may differ) and compute the same;
    another value is an error naming the two."""
    feeds = {k: np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16) for k in ("x", "r")}
    outs = []
    for pdl in ("0", "1", "0"):
        so = ort.SessionOptions()
        so.add_session_config_entry("gtco.register", "all")
        so.add_session_config_entry("gtco.pdl", pdl)
        so.register_custom_ops_library(str(small.lib.path))
        outs.append(ort.InferenceSession(str(small.rewritten), so, providers=CPU).run(None, feeds)[0])
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    so = ort.SessionOptions()
    so.add_session_config_entry("gtco.pdl", "on")
    with pytest.raises(Exception, match=r"gtco\.pdl=on is not a setting; use 1 .* or 0"):
        so.register_custom_ops_library(str(small.lib.path))


def test_make_session_takes_gtco_pdl_from_the_environment(small: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """$GTCO_PDL sets gtco.pdl in the sessions make_session creates, unless the caller's options set it; another
    value is an error naming the variable."""
    from onnx_gtco.errors import LibraryError
    from onnx_gtco.runtime.session import PDL_KEY, make_session

    monkeypatch.setenv("GTCO_PDL", "0")
    so = ort.SessionOptions()
    make_session(small.rewritten, CPU, library=True, sess_options=so)
    assert so.get_session_config_entry(PDL_KEY) == "0"
    so = ort.SessionOptions()
    so.add_session_config_entry(PDL_KEY, "1")  # the caller's own setting wins
    make_session(small.rewritten, CPU, library=True, sess_options=so)
    assert so.get_session_config_entry(PDL_KEY) == "1"
    monkeypatch.setenv("GTCO_PDL", "yes")
    with pytest.raises(LibraryError, match=r"\$GTCO_PDL='yes'"):
        make_session(small.rewritten, CPU, library=True)
    monkeypatch.delenv("GTCO_PDL")
    so = ort.SessionOptions()
    make_session(small.rewritten, CPU, library=True, sess_options=so)
    with pytest.raises(RuntimeError):  # unset: the library's default
        so.get_session_config_entry(PDL_KEY)


def test_make_session_register_mode() -> None:
    """make_session asks for every CPU kernel only on a session without the CUDA EP."""
    from onnx_gtco.runtime.session import REGISTER_MODES, register_mode

    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    assert register_mode(True, [cpu]) == "all"
    assert register_mode(True, [(cuda, {"enable_cuda_graph": "1"}), cpu]) == "cuda"
    assert register_mode("auto", [cuda, cpu]) == "cuda"
    assert {register_mode(True, [cpu]), register_mode("auto", [cuda])} <= set(REGISTER_MODES)


def readme_python_block(after: str) -> str:
    """The first python block of the README after the text `after`."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    m = re.search(re.escape(after) + r".*?```python\n(.*?)```", text, re.S)
    assert m, f"README has no python block after {after!r}"
    return m.group(1)


def test_readme_plain_ort_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's plain-ORT snippet, run as written (paths and feeds filled in) on an emulated build, registers
    the op types with device kernels and its outputs match the original's."""
    original = ln_softmax_model(hidden=16)
    rewritten = optimize(original).model
    lib = build_library(rewritten, tmp_path, cuda=False, emulated=True)
    assert {"Layernorm_f32", "Softmax_f32"} <= set(lib.cuda_op_types), lib.kernel_skips
    path = tmp_path / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    code = readme_python_block("or with plain ONNX Runtime")
    assert "libgtco-<hash>.so" in code and "model.gtco.onnx" in code and "gtco.register" not in code
    code = code.replace("libgtco-<hash>.so", str(lib.path)).replace("model.gtco.onnx", str(path))
    feeds = make_inputs(original, 0, {"N": 3})
    plain = ort.SessionOptions

    class Profiled(plain):  # the snippet's session, profiled
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = str(tmp_path / "readme")

    monkeypatch.setattr(ort, "SessionOptions", Profiled)
    ns: dict[str, object] = {"feeds": feeds}
    exec(compile(code, "README.md", "exec"), ns)
    monkeypatch.setattr(ort, "SessionOptions", plain)
    want = ort.InferenceSession(original.SerializeToString(), providers=CPU).run(None, feeds)
    for w, g in zip(want, ns["outputs"], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert {"Layernorm_f32", "Softmax_f32"} <= profiled_ops(ns["session"])


def test_auto_registers_only_for_available_cuda() -> None:
    from onnx_gtco.runtime.session import _wants_library

    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    assert _wants_library("auto", [cuda, cpu], [cuda, cpu])
    assert _wants_library("auto", [(cuda, {"device_id": 0})], [cuda, cpu])
    assert not _wants_library("auto", [cuda, cpu], [cpu])  # requested but not in this onnxruntime
    assert not _wants_library("auto", [cpu], [cuda, cpu])
    assert _wants_library(True, [cpu], [cpu]) and not _wants_library(False, [cuda], [cuda])
    with pytest.raises(ValueError, match="library='yes'"):
        _wants_library("yes", [cpu], [cpu])
