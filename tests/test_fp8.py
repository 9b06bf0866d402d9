"""--precision fp8 (onnx_gtco.fp8): E4M3 GEMM operands with per-tensor scales from calibration, the per-GEMM error
budget, the model-local functions that say it, and the refusals."""

from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, fp8, models, optimize
from onnx_gtco.errors import GtcoError
from onnx_gtco.ir.load import default_opset
from onnx_gtco.opspec import DOMAIN, decode_node
from onnx_gtco.runtime.check import DEFAULT_MIN_COSINE, compare, inputs_npz, make_inputs


@pytest.fixture(scope="module")
def bert() -> onnx.ModelProto:
    return models.build("bert-tiny", seed=0)  # opset 17: an fp8 run converts it to 19


@pytest.fixture(scope="module")
def calibration(bert: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    return [make_inputs(bert, seed) for seed in range(4)]


@pytest.fixture(scope="module")
def result(bert: onnx.ModelProto, calibration: list[dict[str, np.ndarray]]):
    return optimize(bert, GtcoConfig(precision="fp8", target="h200", calibration_data=calibration))


def _session(model: onnx.ModelProto, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_round_e4m3_is_quantize_linear_saturating() -> None:
    """fp8.round_e4m3 (the error check's rounding) is onnxruntime's QuantizeLinear to E4M3 with saturate=1 (the
    functions' rounding), values past 448 and below the subnormals included."""
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * np.float32(100.0)
    x[:4] = [1000.0, -1000.0, 1e-4, -3e-3]
    zero = helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0])
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "zero"], ["q"], saturate=1),
         helper.make_node("DequantizeLinear", ["q", "s", "zero"], ["y"])], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4096])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "s"), zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    (got,) = _session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})
    np.testing.assert_array_equal(fp8.round_e4m3(x), got)
    assert fp8.round_e4m3(np.array([1000.0], np.float32))[0] == fp8.E4M3_MAX


def test_weight_gemms_take_e4m3_operands(result, bert: onnx.ModelProto) -> None:
    model = result.model
    assert default_opset(model) >= fp8.FP8_OPSET
    inits = {t.name: t for t in model.graph.initializer}
    gemms = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type.startswith("Gemm_")]
    report = result.report["fp8"]
    assert gemms and all(n.op_type == "Gemm_f8" for n in gemms)
    assert report["gemms_fp8"] == len(gemms) == len(report["gemms"])
    for n in gemms:
        op = decode_node(n)
        assert not isinstance(op, str) and op["precision"] == "fp8"
        b, scales = inits[n.input[op.inputs["b"]]], inits[n.input[op.inputs["scales"]]]
        assert b.data_type == TensorProto.FLOAT8E4M3FN
        assert op["trans_b"] and list(b.dims) == [op.int("n"), op.int("k")]  # K-major, as FP8 Tensor Cores read
        assert numpy_helper.to_array(scales).shape == (2,) and (numpy_helper.to_array(scales) > 0).all()
    # the half weights the E4M3 ones replace are gone: the file holds each weight once
    assert not any(t.data_type == TensorProto.FLOAT16 and t.name + ".e4m3" in inits for t in model.graph.initializer)
    errors = [g["error"] for g in report["gemms"]]
    assert all(0 < e < report["budget"] for e in errors)
    assert result.report["precision"] == "fp8"


def _one_gemm(result) -> tuple[onnx.ModelProto, dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A Gemm_f8 node of `result` with a bias alone in a model, seeded fp16 inputs, and numpy's answers: the E4M3
    GEMM (from the stored E4M3 weight and the node's scales, fp32 products) and the plain one."""
    model = result.model
    inits = {t.name: t for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "Gemm_f8" and decode_node(n)["bias"]
                and not decode_node(n)["residual"])
    op = decode_node(node)
    assert not isinstance(op, str) and op["activation"] == "none"
    m, k, n_cols = op.int("m"), op.int("k"), op.int("n")
    a = np.random.default_rng(1).standard_normal((1, m, k)).astype(np.float16) * np.float16(3)
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT16, [1, m, k])],
        [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT16, [1, m, n_cols])],
        [inits[t] for t in node.input if t in inits])
    one = helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(model.functions),
                            ir_version=model.ir_version)
    sa, sb = numpy_helper.to_array(inits[node.input[op.inputs["scales"]]])
    w = numpy_helper.to_array(inits[node.input[op.inputs["b"]]]).astype(np.float32) * sb
    w = w.T if op["trans_b"] else w
    qa = fp8.round_e4m3(a.astype(np.float32) / sa) * sa
    bias = numpy_helper.to_array(inits[node.input[op.inputs["bias"]]]).astype(np.float32)
    return one, {node.input[0]: a}, qa.astype(np.float64) @ w + bias, a.astype(np.float64) @ w + bias


def test_function_is_the_e4m3_gemm(result) -> None:
    """A Gemm_f8 node's function computes act(Q(a) Q(b) + bias) with Q the E4M3 rounding at the node's scales:
    the node alone, on seeded fp16 inputs; not the fp16 GEMM, whose difference the E4M3 rounding of a shows."""
    one, feeds, want, plain = _one_gemm(result)
    (got,) = _session(one, ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, feeds)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float16).astype(np.float32), rtol=2e-3,
                               atol=2e-3)
    assert np.abs(got - plain).max() > 10 * np.abs(got - want).max()


def test_close_to_fp32_under_every_optimization_level(result, bert: onnx.ModelProto) -> None:
    """The fp8 model keeps check's fp8 cosine against the fp32 original, and onnxruntime's graph optimizations do
    not change it (without explicit E4M3 zero points its QDQ propagation clipped the weights' negative values)."""
    feeds = make_inputs(bert, 11)
    plain = _session(result.model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, feeds)
    full = _session(result.model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, feeds)
    for x, y in zip(plain, full, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-3)
    diffs = compare(bert, result.model, inputs=[feeds, make_inputs(bert, 12)], min_cosine=DEFAULT_MIN_COSINE["fp8"])
    assert all(d.ok and d.cosine < 0.99999 for d in diffs), diffs  # within the cosine, and not fp32's numbers


def test_planted_low_amax_is_caught(bert: onnx.ModelProto, calibration: list[dict[str, np.ndarray]],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibration amax far below what the samples reach (planted: one A's amax / 100) saturates that GEMM's A:
    the error check keeps it fp16 and the report names it with its error; the others stay E4M3."""
    collect = fp8._amax
    planted: list[str] = []

    def low(*args, **kwargs):
        out = collect(*args, **kwargs)
        victim = sorted(out)[0]
        planted.append(victim)
        return {t: v / 100 if t == victim else v for t, v in out.items()}

    monkeypatch.setattr(fp8, "_amax", low)
    result = optimize(bert, GtcoConfig(precision="fp8", target="h200", calibration_data=calibration))
    gemms = result.report["fp8"]["gemms"]
    kept = [g for g in gemms if not g["fp8"]]
    assert planted and kept and all(g["error"] > result.report["fp8"]["budget"] for g in kept)
    assert {g["node"] for g in kept} == {n.name for n in result.model.graph.node
                                         if n.op_type == "Gemm_f16" and n.input[0] == planted[0]}
    assert "over the budget" in kept[0]["why"]
    assert any(g["fp8"] for g in gemms)
    assert {n.op_type for n in result.model.graph.node if n.domain == DOMAIN} >= {"Gemm_f8", "Gemm_f16"}


def test_calibration_sources(tmp_path: pathlib.Path, bert: onnx.ModelProto,
                             calibration: list[dict[str, np.ndarray]]) -> None:
    folder = tmp_path / "cal"
    folder.mkdir()
    (folder / "a.npz").write_bytes(inputs_npz(calibration[:2]))
    (folder / "b.npz").write_bytes(inputs_npz(calibration[2:3]))
    got = fp8.read_calibration(folder, bert)
    assert len(got) == 3 and all(np.array_equal(got[2][k], calibration[2][k]) for k in calibration[2])
    reader = tmp_path / "reader.py"
    reader.write_text("import numpy as np\n"
                      "def feed(k):\n"
                      "    ids = np.full((1, 128), k, np.int64)\n"
                      "    return {'input_ids': ids, 'attention_mask': np.ones((1, 128), np.int64)}\n"
                      "class Reader:\n"
                      "    def __init__(self):\n"
                      "        self.left = [feed(1)]\n"
                      "    def get_next(self):\n"
                      "        return self.left.pop() if self.left else None\n"
                      "def samples():\n"
                      "    return [feed(2), feed(3)]\n")
    assert [f["input_ids"][0, 0] for f in fp8.read_calibration(f"{reader}:Reader", bert)] == [1]
    assert [f["input_ids"][0, 0] for f in fp8.read_calibration(f"{reader}:samples", bert)] == [2, 3]
    with pytest.raises(fp8.CalibrationError, match=r"holds no \.npz"):
        fp8.read_calibration(_empty(tmp_path), bert)
    with pytest.raises(fp8.CalibrationError, match="has no 'nothing'"):
        fp8.read_calibration(f"{reader}:nothing", bert)
    with pytest.raises(fp8.CalibrationError, match=r"lacks input|not an input"):
        fp8.read_calibration([{"tokens": np.zeros((1, 128), np.int64)}], bert)
    with pytest.raises(fp8.CalibrationError, match="no such file"):
        fp8.read_calibration(tmp_path / "missing.npz", bert)


def _empty(tmp_path: pathlib.Path) -> pathlib.Path:
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty


def test_refusals(bert: onnx.ModelProto) -> None:
    with pytest.raises(GtcoError, match=r"FP8 Tensor Cores.*a100 is sm_80"):
        GtcoConfig(precision="fp8", target="a100", calibration_data=[{}])
    with pytest.raises(GtcoError, match="needs calibration data"):
        GtcoConfig(precision="fp8", target="h200")
    with pytest.raises(GtcoError, match="input 'sample0/input_ids' is float32, the model takes int64"):
        fp8.read_calibration([{"input_ids": np.zeros((1, 128), np.float32),
                               "attention_mask": np.ones((1, 128), np.int64)}], bert)


def test_fp8_nodes_have_device_kernels_on_every_slot(result) -> None:
    """Every Gemm_f8 node has a device kernel (the mma GEMM on E4M3 operands; CUTLASS and cuBLASLt refuse fp8, so
    sm_90a runs sm_90's), as the report's device entry says."""
    device = result.report["device"]
    assert not [w for w in device.get("without", []) if w["family"] == "gemm"], device.get("without")
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == fp8.E4M3_MAX


def test_the_libraries_compute_the_e4m3_gemm(result, bert: onnx.ModelProto, tmp_path: pathlib.Path) -> None:
    """The CPU library's Gemm_f8 kernel (gemm_ref.h: A rounded to E4M3 at s_a, B decoded, fp32 sums, alpha s_a s_b)
    and its device kernel (gemm.cuh FP8, emulated) are the E4M3 GEMM: one node against numpy; the whole model
    through the CPU library against its functions (the emulated kernels' whole-model run is MiniLM's, measured
    once: tests/families/gemm/test_gemm_fp8.py checks those kernels case by case)."""
    from cpu_session import cpu_session

    from onnx_gtco.plugin.library import build_library

    one, feeds, want, plain = _one_gemm(result)
    for d in ("one", "cpu"):
        (tmp_path / d).mkdir()
    lib = build_library(one, tmp_path / "one", cuda=False)
    assert lib.op_types == ["Gemm_f8"] and not lib.skipped()
    (tmp_path / "one-emu").mkdir()
    emu_one = build_library(one, tmp_path / "one-emu", cuda=False, emulated=True)
    assert emu_one.cuda_op_types == ["Gemm_f8"] and not emu_one.kernel_skips
    for library in (lib.path, emu_one.path):
        (got,) = cpu_session(one, library).run(None, feeds)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float16).astype(np.float32), rtol=2e-3,
                                   atol=2e-3)
        assert np.abs(got - plain).max() > 10 * np.abs(got - want).max()

    path = tmp_path / "model.gtco.onnx"
    onnx.save(result.model, str(path))
    lib = build_library(result.model, tmp_path / "cpu", cuda=False)
    assert "Gemm_f8" in lib.op_types and not lib.skipped()
    x = make_inputs(bert, 5)
    (fn,) = cpu_session(path).run(None, x)
    (got,) = cpu_session(path, lib.path).run(None, x)
    err = np.linalg.norm(got.astype(np.float64) - fn) / np.linalg.norm(fn)
    assert err < 3e-3, err  # fp16 kernels and fp32 sums in another order: 1.2e-3 measured


def test_round_e4m3_in_the_cpu_kernel_is_ml_dtypes(tmp_path: pathlib.Path) -> None:
    """gemm_ref.h's round_e4m3 and e4m3_to_float against ml_dtypes, bit for bit, over every E4M3 value, the ties
    between them and values past 448 (compiled with the library's compiler)."""
    import subprocess

    from onnx_gtco.kernels.toolchain import PLUGINS_DIR as root

    src = tmp_path / "t.cc"
    src.write_text('#include <cstdio>\n#include "gemm/gemm_ref.h"\nint main() { float x;\n'
                   'while (std::scanf("%f", &x) == 1) std::printf("%.9g\\n", gtco::ref::round_e4m3(x));\n'
                   'for (int v = 0; v < 256; ++v) std::printf("%.9g\\n", gtco::ref::e4m3_to_float(v)); }\n')
    exe = tmp_path / "t"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{root / 'families'}", f"-I{root / 'cpu'}", str(src), "-o",
                    str(exe)], check=True)
    values = np.array([float(v) for v in ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max * np.linspace(-1.2, 1.2, 9)]
                      + [float(b) for b in np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                         .astype(np.float32) if np.isfinite(b)], np.float32)
    ties = (values[:-1] + values[1:]) / 2
    x = np.concatenate([values, ties, np.random.default_rng(3).standard_normal(2000).astype(np.float32) * 50])
    out = subprocess.run([str(exe)], input="\n".join(f"{v:.9g}" for v in x), capture_output=True, text=True,
                         check=True).stdout.split()
    got = np.array([float(v) for v in out[:len(x)]], np.float32)
    np.testing.assert_array_equal(got, fp8.round_e4m3(x))
    decoded = np.array([float(v) for v in out[len(x):]], np.float32)
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(decoded, want)  # NaN compares equal in assert_array_equal


def test_replan_keeps_the_calibration(result, calibration: list[dict[str, np.ndarray]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan made again with measured kernel times (tuning) keeps each GEMM's amax and error: the calibrator and
    the error check do not run again for GEMMs of the same A and weight, and the model is the same."""
    from onnx_gtco.pipeline import replan

    def refuse(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(fp8, "_amax", refuse)
    monkeypatch.setattr(fp8, "_errors", refuse)
    again = replan(result, GtcoConfig(precision="fp8", target="h200", calibration_data=calibration), {})
    assert again.report["fp8"] == result.report["fp8"]
    assert again.model.SerializeToString(deterministic=True) == result.model.SerializeToString(deterministic=True)
