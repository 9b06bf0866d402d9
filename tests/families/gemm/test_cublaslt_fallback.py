"""The run-time fallback from a cuBLASLt GEMM instance to the generated mma kernel, end to end on the CPU.

A small fp16 GEMM model's node is tuned to cuBLASLt and built into an emulated library (build_library(...,
emulated=True)): the cuBLASLt instance compiles for the emulation against cublasLt.h, beside its mma fallback. A
CPU session (in a child process, so that what it loads stays out of this one) then runs the node with a cuBLASLt
that fails:

* absent: no libcublasLt in the process (an emulated build never takes one from the library path), so the dlsym
  table's error is the reason;
* no algorithm: a stand-in libcublasLt built here with g++, with the real library's soname, whose nine functions
  succeed except that the heuristic returns no algorithm, loaded RTLD_GLOBAL before the session.

Each time the outputs match a float64 reference on seeded random inputs, the reason is noted once (ORT's logger,
stderr), and, with the stand-in, the node stops calling cuBLASLt once it has fallen back, also when the first calls
come from several threads at once; a QKV node's three projections all take the fallback after the first one's
failure. A node without a fallback (one with a dispatch table) keeps failing with cuBLASLt's reason. mma_fallbacks'
choice is checked on its own, without a build.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from plugin_helpers import relu_gemm_model

from onnx_gtco import optimize
from onnx_gtco.config import CUBLASLT_INCLUDE_ENV
from onnx_gtco.errors import BuildError, HeaderError
from onnx_gtco.families.gemm.cublas_headers import cublaslt_include_dir, cuda_runtime_include_dir
from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
from onnx_gtco.families.gemm.kernel import gemm_problem
from onnx_gtco.kernels.family import Instance, rel_error
from onnx_gtco.kernels.select import MMA_ONLY, candidates, fastest, select_instance
from onnx_gtco.kernels.toolchain import find_cxx
from onnx_gtco.plugin.device import device_problem, mma_fallbacks
from onnx_gtco.plugin.library import NO_DISPATCH_FALLBACK, LibraryResult, bind_node, build_library, library_info
from onnx_gtco.plugin.nodes import fused_nodes

M, K, N = 37, 64, 72  # a ragged M: the fallback's edge tiles run too
LT = {"impl": "cublaslt", "RANK": 0}
CONCURRENT = 3  # the first calls, from this many threads at once
SEQUENTIAL = 2  # then these, one after another


def _model(rows: int | str = M) -> onnx.ModelProto:
    return relu_gemm_model(rows, K, N)


def _reference(x: np.ndarray) -> np.ndarray:
    """The model's output in float64 from its fp16 operands."""
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in _model().graph.initializer}
    return np.maximum(x.astype(np.float64) @ inits["W"] + inits["b"], 0.0)


def _qkv_model() -> onnx.ModelProto:
    """Z = (X @ W0 + b0 + X @ W1 + b1) * (X @ W2 + b2), fp16: the three projections of X become one Qkv_f16 node
    (they meet before another weight GEMM), which launches its instance once per projection."""
    rng = np.random.default_rng(1)
    inits, nodes = [], []
    for i in range(3):
        inits.append(numpy_helper.from_array((rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float16), f"W{i}"))
        inits.append(numpy_helper.from_array((0.5 * rng.standard_normal(N)).astype(np.float16), f"b{i}"))
        nodes += [helper.make_node("MatMul", ["X", f"W{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"], name=f"add{i}")]
    nodes += [helper.make_node("Add", ["y0", "y1"], ["s"], name="sum"),
              helper.make_node("Mul", ["s", "y2"], ["Z"], name="mul")]
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("X", TensorProto.FLOAT16, [M, K])],
                              [helper.make_tensor_value_info("Z", TensorProto.FLOAT16, [M, N])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _qkv_reference(x: np.ndarray) -> np.ndarray:
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in _qkv_model().graph.initializer}
    y = [x.astype(np.float64) @ inits[f"W{i}"] + inits[f"b{i}"] for i in range(3)]
    return (y[0] + y[1]) * y[2]


@pytest.fixture(scope="module")
def lt_include() -> list[Path]:
    """cublasLt.h's folder and CUDA's runtime headers' (what the emulated instance and the stand-in compile with)."""
    try:
        lt = cublaslt_include_dir()
        return list(dict.fromkeys([lt, cuda_runtime_include_dir(lt)]))
    except HeaderError as e:
        pytest.skip(f"the cuBLASLt header could not be obtained: {e}")


def _build(out: Path, rows: int | str = M, dispatch: bool = False, qkv: bool = False
           ) -> tuple[Path, LibraryResult, str]:
    """The model (`qkv`: _qkv_model's) optimized and saved in `out`, its emulated library with the GEMM (or QKV)
    node tuned to cuBLASLt (and with `dispatch`, a symbolic row count given a one-entry cuBLASLt dispatch table),
    and the node's name."""
    rewritten = optimize(_qkv_model() if qkv else _model(rows)).model
    op = "Qkv" if qkv else "Gemm"
    gemm = next(n.name for n in rewritten.graph.node if n.domain == "ai.gtco" and n.op_type.startswith(op))
    table = {gemm: {"sm_80": [(None, LT)]}} if dispatch else None
    lib = build_library(rewritten, out, cuda=False, emulated=True, tuned={gemm: {"sm_80": LT}}, dispatch=table)
    path = out / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    return path, lib, gemm


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, lt_include: list[Path]) -> tuple[Path, LibraryResult, str]:
    return _build(tmp_path_factory.mktemp("lt_fallback"))


_STANDIN = r"""
// A stand-in libcublasLt whose heuristic finds no algorithm: the nine functions gemm/cublaslt.h resolves, each
// succeeding, except that cublasLtMatmulAlgoGetHeuristic returns no result. Its calls are counted.
#include <cublasLt.h>

#include <atomic>

static std::atomic<int> heuristic_calls{0}, matmul_calls{0};
static char handle_storage;
static cublasLtMatmulDescOpaque_t desc_storage;
static cublasLtMatrixLayoutOpaque_t layout_storage;
static cublasLtMatmulPreferenceOpaque_t pref_storage;

extern "C" {
cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
    *h = reinterpret_cast<cublasLtHandle_t>(&handle_storage);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t, cudaDataType_t) {
    *d = &desc_storage;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void*,
                                              size_t) {
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType, uint64_t, uint64_t, int64_t) {
    *l = &layout_storage;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t, cublasLtMatrixLayoutAttribute_t, const void*,
                                                size_t) {
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
    *p = &pref_storage;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t,
                                                    const void*, size_t) {
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                              cublasLtMatmulPreference_t, int, cublasLtMatmulHeuristicResult_t[],
                                              int* returned) {
    heuristic_calls.fetch_add(1);
    *returned = 0;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*,
                              cublasLtMatrixLayout_t, const void*, cublasLtMatrixLayout_t, const void*, const void*,
                              cublasLtMatrixLayout_t, void*, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t*,
                              void*, size_t, cudaStream_t) {
    matmul_calls.fetch_add(1);
    return CUBLAS_STATUS_NOT_SUPPORTED;
}
__attribute__((visibility("default"))) int gtco_test_heuristic_calls() { return heuristic_calls.load(); }
__attribute__((visibility("default"))) int gtco_test_matmul_calls() { return matmul_calls.load(); }
}
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory, lt_include: list[Path]) -> Path:
    """The stand-in libcublasLt, named and with the soname libcublasLt.so.<major> of the header's cuBLAS, so that
    gemm/cublaslt.h's dlopen(RTLD_NOLOAD) of that name finds it once it is loaded."""
    major = re.search(r"#define CUBLAS_VER_MAJOR (\d+)", (lt_include[0] / "cublas_api.h").read_text())
    assert major is not None, "cublas_api.h defines no CUBLAS_VER_MAJOR"
    out = tmp_path_factory.mktemp("standin")
    src = out / "standin.cc"
    src.write_text(_STANDIN)
    name = f"libcublasLt.so.{major.group(1)}"
    subprocess.run([find_cxx(), "-std=c++17", "-O1", "-shared", "-fPIC", *(f"-I{d}" for d in lt_include),
                    f"-Wl,-soname,{name}", str(src), "-o", str(out / name)], check=True, capture_output=True,
                   text=True, timeout=300)
    return out / name


_RUN = r"""
import ctypes, json, sys, threading
import numpy as np
import onnxruntime as ort

model, lib, standin, inputs, outputs = sys.argv[1:6]
concurrent = int(sys.argv[6])
counts = None
if standin:
    counts = ctypes.CDLL(standin, mode=ctypes.RTLD_GLOBAL)
so = ort.SessionOptions()
so.add_session_config_entry("gtco.register", "all")  # a CPU session: the emulated device kernels
so.register_custom_ops_library(lib)
sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
xs = dict(np.load(inputs))
ys, errors = {}, []

def run(key):
    try:
        ys[key] = sess.run(None, {"X": xs[key]})[0]
    except Exception as e:  # the node's error, reported to the test
        errors.append(str(e))

keys = sorted(xs)
threads = [threading.Thread(target=run, args=(k,)) for k in keys[:concurrent]]
for t in threads:
    t.start()
for t in threads:
    t.join()
calls = {"after_concurrent": counts.gtco_test_heuristic_calls() if counts else None}
for k in keys[concurrent:]:
    run(k)
if counts:
    calls.update(after_all=counts.gtco_test_heuristic_calls(), matmul=counts.gtco_test_matmul_calls())
np.savez(outputs, **ys)
print(json.dumps({"errors": errors, "calls": calls}))
"""


Arrays = dict[str, np.ndarray]


def _session(tmp: Path, model: Path, lib: Path, standin: Path | None = None, rows: int = M,
             calls: tuple[int, int] = (CONCURRENT, SEQUENTIAL)) -> tuple[dict, Arrays, Arrays, str]:
    """Run `model` with `lib` in a child process on seeded inputs: the first calls[0] from as many threads at once,
    then calls[1] one by one. Returns its report (errors, the stand-in's call counts), the inputs, the outputs and
    its stderr."""
    xs = {f"x{s}": np.random.default_rng(s).standard_normal((rows, K)).astype(np.float16) for s in range(sum(calls))}
    np.savez(tmp / "inputs.npz", **xs)
    argv = [str(model), str(lib), str(standin or ""), str(tmp / "inputs.npz"), str(tmp / "outputs.npz"), str(calls[0])]
    proc = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report, xs, dict(np.load(tmp / "outputs.npz")), proc.stderr


def _notes(stderr: str, node: str) -> list[str]:
    """The lines of `stderr` that note `node`'s fallback (ORT's logger writes its warnings there)."""
    return [line for line in stderr.splitlines()
            if f"node '{node}': cuBLASLt instance" in line and "the node runs its mma fallback" in line]


def _check_outputs(xs: Arrays, ys: Arrays, reference: Callable[[np.ndarray], np.ndarray] = _reference) -> None:
    assert sorted(ys) == sorted(xs)
    for key, x in xs.items():
        want = reference(x)
        assert np.abs(want).max() > 0.5  # random inputs, not a trivially zero output
        assert ys[key].dtype == np.float16 and ys[key].shape == want.shape
        assert rel_error(ys[key], want) < 5e-3, key


def test_the_library_lists_the_fallback(built: tuple[Path, LibraryResult, str]) -> None:
    model, lib, gemm = built
    node = next(n for n in fused_nodes(onnx.load(str(model))) if n.node.name == gemm)
    binding = bind_node(node)
    assert not isinstance(binding, str)
    problem = device_problem(node, binding)
    assert not isinstance(problem, str)
    # the family's first mma configuration for the node's own problem (its bias and ReLU in the epilogue)
    want = GEMM.instantiate(problem, GEMM.configs(problem, "sm_80")[0], "sm_80")
    assert want.name.startswith("gemm_sm80_f16_") and want.name.endswith("_bias_relu")
    info = library_info(lib.path)
    assert info["instances"][gemm] == ["cublaslt_sm80_f16_r0_bias_relu"]  # type: ignore[index]
    assert info["fallback"] == {gemm: [want.name]}
    assert lib.fallbacks == {gemm: {"sm_80": want.name}} and lib.fallback_skips == {}
    assert lib.to_json()["fallbacks"] == {gemm: {"sm_80": want.name}}


def test_absent_libcublaslt_falls_back(built: tuple[Path, LibraryResult, str], tmp_path: Path) -> None:
    model, lib, gemm = built
    report, xs, ys, stderr = _session(tmp_path, model, lib.path)
    assert report["errors"] == []
    _check_outputs(xs, ys)
    (note,) = _notes(stderr, gemm)  # once, although the first calls came from several threads
    assert "cublaslt_sm80_f16_r0_bias_relu cannot run (libcublasLt.so." in note
    assert "is not loaded in this process" in note
    assert f"the node runs its mma fallback {lib.fallbacks[gemm]['sm_80']} from now on" in note


def test_no_algorithm_falls_back_and_stops_asking(built: tuple[Path, LibraryResult, str], standin: Path,
                                                  tmp_path: Path) -> None:
    model, lib, gemm = built
    report, xs, ys, stderr = _session(tmp_path, model, lib.path, standin)
    assert report["errors"] == []
    _check_outputs(xs, ys)
    (note,) = _notes(stderr, gemm)
    assert "the heuristic offers 0 algorithm(s) for this problem; rank 0 was chosen" in note
    assert lib.fallbacks[gemm]["sm_80"] in note
    calls = report["calls"]
    # the first calls asked cuBLASLt (each thread that got there before the flag was set); none after that
    assert 1 <= calls["after_concurrent"] <= CONCURRENT
    assert calls["after_all"] == calls["after_concurrent"] and calls["matmul"] == 0


def test_every_qkv_projection_takes_the_fallback(lt_include: list[Path], standin: Path, tmp_path: Path) -> None:
    """A QKV node launches its instance once per projection: the first projection's failure switches the node, and
    the other two launch the fallback directly (the heuristic is asked once in all)."""
    model, lib, qkv = _build(tmp_path, qkv=True)
    assert lib.fallbacks[qkv]["sm_80"].startswith("gemm_sm80_f16_")
    report, xs, ys, stderr = _session(tmp_path, model, lib.path, standin, calls=(1, 1))
    assert report["errors"] == []
    _check_outputs(xs, ys, _qkv_reference)
    (note,) = _notes(stderr, qkv)
    assert "Qkv_f16 node" in note and "cublaslt_sm80_f16_r0" in note and "cannot run" in note
    assert report["calls"] == {"after_concurrent": 1, "after_all": 1, "matmul": 0}


def test_a_node_without_fallback_keeps_cublaslts_error(lt_include: list[Path], tmp_path: Path) -> None:
    """A dynamic node's dispatch entries keep no fallback: cuBLASLt's reason is the node's error, as before."""
    model, lib, gemm = _build(tmp_path, rows="rows", dispatch=True)
    assert lib.fallbacks == {} and lib.fallback_skips == {gemm: {"sm_80": NO_DISPATCH_FALLBACK}}
    assert library_info(lib.path)["fallback"] == {}
    report, _, ys, stderr = _session(tmp_path, model, lib.path, rows=5, calls=(1, 1))
    assert ys == {} and len(report["errors"]) == 2
    for err in report["errors"]:
        assert f"node '{gemm}': cuBLASLt instance cublaslt_sm80_f16_r0_bias_relu on A [5,64]" in err
        assert "is not loaded in this process" in err
    assert _notes(stderr, gemm) == []


def test_mma_fallbacks_choose_the_fastest_usable_mma_configuration() -> None:
    problem = gemm_problem("f16", 1, 256, 512, 128, bias=True, activation="relu")
    lt80 = select_instance(problem, "sm_80", LT)
    lt90 = select_instance(problem, "sm_90", {"impl": "cublaslt", "RANK": 2})
    mma80 = select_instance(problem, "sm_80", impls=MMA_ONLY)
    assert not isinstance(lt80, str) and not isinstance(lt90, str) and not isinstance(mma80, str)
    got = mma_fallbacks([lt80, mma80, lt90])

    def ranked(arch: str, avoid: object = ()) -> list[str]:  # the mma configurations, the estimate's fastest first
        configs = candidates(problem, arch, avoid, MMA_ONLY)  # type: ignore[arg-type]
        pick = fastest(problem, arch, configs)
        assert pick is not None
        return [GEMM.instance_name(problem, pick[0], arch)]

    first80, first90 = ranked("sm_80")[0], ranked("sm_90")[0]
    assert got[1] is None  # an mma slot needs none
    assert isinstance(got[0], Instance) and got[0].name == first80 and got[0].arch == "sm_80"
    assert isinstance(got[2], Instance) and got[2].name == first90 and got[2].arch == "sm_90"
    assert got[0].problem == lt80.problem  # the cuBLASLt instance's own problem: bias and ReLU in the epilogue
    # ptxas rejected the first: the next fastest; every one: why not
    avoid = {(got[0].name, "sm_80")}
    (second,) = mma_fallbacks([lt80], avoid)
    assert isinstance(second, Instance) and second.name == ranked("sm_80", avoid)[0] != got[0].name
    names80 = [GEMM.instance_name(problem, c, "sm_80") for c in candidates(problem, "sm_80", impls=MMA_ONLY)]
    every = {(name, "sm_80") for name in names80}
    (why,) = mma_fallbacks([lt80], every)
    assert isinstance(why, str) and "valid mma GEMM configurations for sm_80 spills" in why


def test_an_emulated_cublaslt_build_without_the_header_is_a_clear_error(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated build keeps a tuned cuBLASLt configuration, so it needs cublasLt.h as the CUDA build does, and
    says so before compiling anything."""
    empty = tmp_path / "no-header"
    empty.mkdir()
    monkeypatch.setenv(CUBLASLT_INCLUDE_ENV, str(empty))
    with pytest.raises(BuildError, match=rf"{CUBLASLT_INCLUDE_ENV}=.* has no cublasLt.h"):
        _build(tmp_path)
    assert not list(tmp_path.glob("libgtco-*.so"))
