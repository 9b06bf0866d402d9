"""optimize --precision fp16 | bf16 converts the model (onnx_gtco.precision): planned on fp32, fused nodes on half
tensors with their weights in the half type, the unfused remainder by ONNX Runtime's float16 converter's rules,
graph inputs and outputs in their dtypes. Compared with the fp32 original (the higher-precision reference) on
seeded inputs, through the fused nodes' functions and through the emulated device kernels."""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import run
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco.config import GtcoConfig
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.toolchain import DEVICE_INCLUDE_DIRS, nvcc_compile
from onnx_gtco.models import build
from onnx_gtco.opspec import DOMAIN, split_op_type
from onnx_gtco.pipeline import optimize
from onnx_gtco.plugin.library import CUDA_ARCHS, bind_nodes, build_library, select_device
from onnx_gtco.plugin.nodes import fused_nodes
from onnx_gtco.precision import MOVES_DATA, convert, to_half
from onnx_gtco.report import summary
from onnx_gtco.runtime.check import compare, default_tolerances, make_inputs

TOLERANCE = {"fp16": 5e-3, "bf16": 2e-2}
"""‖err‖ / ‖ref‖ against the fp32 original (issue acceptance)."""
HALF = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
WITHOUT_KERNEL: set[str] = set()
"""Fused op families with no device kernel: none (conv has its implicit GEMM, and a direct kernel for grouped and
depthwise convs)."""

SMALL = {
    "vit-tiny": lambda: build("vit-tiny", depth=2, image=64, seed=0),
    "bert-tiny": lambda: build("bert-tiny", depth=2, seq=24, seed=0),
}


def io_types(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return [(v.name, v.type.tensor_type.elem_type) for v in (*model.graph.input, *model.graph.output)]


@pytest.fixture(scope="module", params=[(m, p) for m in SMALL for p in ("fp16", "bf16")], ids=lambda x: "-".join(x))
def converted(request: pytest.FixtureRequest):
    name, precision = request.param
    original = SMALL[name]()
    return name, precision, original, optimize(original, GtcoConfig(precision=precision))


def test_io_dtypes_kept_weights_halved(converted):
    name, precision, original, result = converted
    model = result.model
    assert io_types(model) == io_types(original)
    fused = [n for n in model.graph.node if n.domain == DOMAIN]
    assert fused and all(split_op_type(n.op_type)[1] == {"fp16": "f16", "bf16": "bf16"}[precision] for n in fused)
    size, before = len(model.SerializeToString()), len(original.SerializeToString())
    assert 0.45 < size / before < 0.56, f"{name} {precision}: {size} bytes of {before}"
    weights = {t.name: t for t in model.graph.initializer}
    for n in fused:  # every float weight a fused node reads is stored in the half type
        for t in n.input:
            if t in weights and weights[t].data_type in (TensorProto.FLOAT, *HALF.values()) and weights[t].dims:
                assert weights[t].data_type == HALF[precision], (n.name, t)
    assert result.report["conversion"]["fused_nodes"] == len(fused)
    inits = {t.name for t in model.graph.initializer}
    constants = {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    casts = [n for n in model.graph.node if n.op_type == "Cast" and n.name.startswith("gtco/cast/")]
    assert not [n.name for n in casts if n.input[0] in inits | constants]  # weights are stored in the type read
    line = next(x for x in summary(result.report).splitlines() if x.startswith("converted"))
    assert f"{precision}: {len(fused)} fused and" in line


def test_functions_match_fp32_original(converted):
    """Without the library, the fused nodes run their functions (half inputs cast to fp32, the original nodes):
    the rewritten model is the fp32 one up to the rounding of the tensors between nodes."""
    name, precision, original, result = converted
    x = make_inputs(original, 0)
    for ref, got in zip(run(original, x), run(result.model, x), strict=True):
        assert got.dtype == ref.dtype
        assert rel_error(got, ref) < TOLERANCE[precision], name


def test_every_fused_node_has_device_instances(converted):
    """sm_80 and sm_90 instances for every fused node but the named families without a kernel yet, read through
    the plan's types (what optimize_file's build uses) and through shape inference of the written model alike."""
    result = converted[3]
    for planned in (result.planned(), None):
        nodes = fused_nodes(result.model, planned)
        results, _ = bind_nodes(nodes)
        device, skips = select_device(nodes, results, CUDA_ARCHS)
        missing = {n.node.name: skips.get(n.node.name) for n in nodes if n.node.name not in device}
        assert all(n.family in WITHOUT_KERNEL for n in nodes if n.node.name in missing), missing
        assert len(device) >= len(nodes) - sum(n.family in WITHOUT_KERNEL for n in nodes)
        assert all(len(insts) == len(CUDA_ARCHS) for insts in device.values())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_emulated_kernels_match_fp32_original(precision, tmp_path):
    """The converted model through the emulated device kernels (every fused node that has one runs its kernel on
    the CPU EP) matches the fp32 original."""
    original = build("bert-tiny", depth=1, seq=24, seed=0)
    result = optimize(original, GtcoConfig(precision=precision))
    lib = build_library(result.model, tmp_path, cuda=False, emulated=True, planned=result.planned())
    assert set(lib.cuda_op_types) == {n.op_type for n in result.model.graph.node if n.domain == DOMAIN}
    path = tmp_path / "model.gtco.onnx"
    onnx.save(result.model, str(path))
    x = make_inputs(original, 1)
    for ref, got in zip(run(original, x), run(path, x, lib.path), strict=True):
        assert rel_error(got, ref) < TOLERANCE[precision]


def _vit_head(precision: str = "fp16"):
    original = build("vit-tiny", depth=1, image=64, seed=0)
    result = optimize(original, GtcoConfig(precision=precision))
    head = next(n for n in result.model.graph.node if "logits" in n.output)
    return original, result, head


def test_gemm_head_writes_fp32_logits():
    """The classifier head (a fused GEMM without a residual) writes the fp32 graph output itself: no Cast before
    `logits`, its function casts its inputs to fp32 and not its output back; the model checks and matches the
    fp32 original through the functions."""
    original, result, head = _vit_head()
    model = result.model
    assert head.domain == DOMAIN and head.op_type == "Gemm_f16"
    assert not any(n.op_type == "Cast" and "logits" in n.output for n in model.graph.node)
    assert all(not t.startswith("logits.") for n in model.graph.node for t in (*n.input, *n.output))
    fn = next(f for f in model.functions if (f.name, f.overload) == (head.op_type, head.overload))
    assert [n.op_type for n in fn.node if n.output[0] in fn.output] == ["Gemm"]  # no Cast back to fp16
    assert result.report["conversion"]["outputs_folded"] == 1
    assert io_types(model) == io_types(original)
    onnx.checker.check_model(model, full_check=True)
    rtol, atol, _ = default_tolerances(model)
    assert all(d.ok for d in compare(original, model, "cpu", rtol, atol))
    x = make_inputs(original, 1)
    assert rel_error(run(model, x)[0], run(original, x)[0]) < TOLERANCE["fp16"]


def test_gemm_head_fp32_logits_on_the_kernels(tmp_path):
    """The head GEMM writing fp32 `logits` binds, with sm_80 and sm_90 instances that write float (out_dtype f32);
    through the CPU reference kernels and the emulated device kernels the model matches the fp32 original."""
    original, result, head = _vit_head()
    nodes = fused_nodes(result.model, result.planned())
    results, _ = bind_nodes(nodes)
    device, skips = select_device(nodes, results, CUDA_ARCHS)
    assert head.name in device, skips
    assert all(i.name.endswith("_of32") and i.problem.flag("out_dtype") == "f32" for i in device[head.name])
    assert all(i.problem.flag("out_dtype") is None for n, insts in device.items() if n != head.name for i in insts)
    path = tmp_path / "model.gtco.onnx"
    onnx.save(result.model, str(path))
    x = make_inputs(original, 1)
    ref = run(original, x)[0]
    for kind, kwargs in (("cpu", {}), ("emulated", {"emulated": True})):
        (tmp_path / kind).mkdir()
        lib = build_library(result.model, tmp_path / kind, cuda=False, planned=result.planned(), **kwargs)
        assert "Gemm_f16" in lib.op_types
        got = run(path, x, lib.path)[0]
        assert got.dtype == np.float32 and rel_error(got, ref) < TOLERANCE["fp16"], kind


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which(os.environ.get("NVCC") or "nvcc") is None, reason="nvcc not found on PATH")
def test_gemm_head_fp32_instance_compiles(tmp_path):
    """nvcc builds the head's sm_90 instance (the output cast in its epilogue): no spills, no stack."""
    _, result, head = _vit_head()
    nodes = fused_nodes(result.model, result.planned())
    results, _ = bind_nodes(nodes)
    device, _ = select_device(nodes, results, CUDA_ARCHS)
    inst = next(i for i in device[head.name] if i.arch == "sm_90")
    assert "TOut=*/float" in inst.source
    src = tmp_path / f"{inst.name}.cu"
    src.write_text(inst.source)
    report = nvcc_compile(src, tmp_path / f"{inst.name}.o", inst.arch, include_dirs=DEVICE_INCLUDE_DIRS, timeout_s=300)
    (k,) = [k for k in parse_ptxas(report.stderr) if "gemm_kernel" in k.name]
    assert k.arch == "sm_90" and 0 < k.registers <= 255, k
    assert not k.spills and k.stack_frame_bytes == 0, k


# --- the conversion's rules, on small graphs ---------------------------------------------------------------------

def _model(nodes, inputs, outputs, inits=(), value_info=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def _dtypes(model: onnx.ModelProto):
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.value_info,
                                                            *model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types.get


def _vi(name: str, shape=(4, 8)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def test_small_epsilon_keeps_its_node_fp32():
    """BERT's epsilon 1e-12 is 0 in fp16: the Add that reads it stays fp32, with the reason; in bf16 it fits."""
    eps = numpy_helper.from_array(np.array(1e-12, np.float32), "eps")
    nodes = [helper.make_node("Add", ["x", "eps"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    m = _model(nodes, [_vi("x")], [_vi("y")], [eps])
    conv = convert(m, "fp16", _dtypes(m))
    add = next(n for n in conv.model.graph.node if n.op_type == "Add")
    assert list(add.input) == ["x", "eps"]
    assert "cannot hold" in conv.kept["Add"][1]
    assert conv.converted == 1  # the Relu
    onnx.checker.check_model(conv.model, full_check=True)
    x = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(conv.model, x)[0], np.maximum(x["x"] + 1e-12, 0), rtol=1e-3, atol=1e-3)


def test_block_list_statistics_and_shared_weights():
    """ReduceMean stays fp32 (statistics), TopK stays fp32 (ORT's block list); a weight both an fp32 node and a
    half node read is stored in both types; Cast(to=FLOAT) inside the half region casts to the half type."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32), "w")
    k = numpy_helper.from_array(np.array([2], np.int64), "k")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["m"]),
        helper.make_node("ReduceMean", ["w"], ["r"], keepdims=1),
        helper.make_node("Cast", ["m"], ["c"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["c", "r"], ["a"]),
        helper.make_node("TopK", ["a", "k"], ["y", "idx"]),
    ]
    m = _model(nodes, [_vi("x")], [_vi("y", (4, 2))], [w, k])
    conv = convert(m, "fp16", _dtypes(m))
    kinds = {t.name: t.data_type for t in conv.model.graph.initializer}
    assert kinds["w"] == TensorProto.FLOAT and kinds["w.f16"] == TensorProto.FLOAT16
    assert set(conv.kept) == {"ReduceMean", "TopK"}
    cast = next(n for n in conv.model.graph.node if n.name == "" and n.op_type == "Cast")
    assert cast.attribute[0].i == TensorProto.FLOAT16
    onnx.checker.check_model(conv.model, full_check=True)
    assert io_types(conv.model) == io_types(m)
    x = {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)}
    assert rel_error(run(conv.model, x)[0], run(m, x)[0]) < 5e-3


def test_to_half_rounds_and_clamps():
    v = np.array([1.0 + 2 ** -11, 1e6, -1e6, 1e-9], np.float32)
    h = to_half(v, TensorProto.FLOAT16)
    assert h.dtype == np.float16 and list(h[:3]) == [1.0, 65504.0, -65504.0]
    b = to_half(np.array([1.0 + 2 ** -8 + 2 ** -20], np.float32), TensorProto.BFLOAT16)
    assert float(b[0]) == 1.0 + 2 ** -7  # bf16 has 7 mantissa bits: rounds to nearest


@pytest.mark.parametrize("op", sorted(MOVES_DATA))
def test_data_movement_ops_run_in_bf16_on_the_cpu_ep(op):
    """In bf16 these are the operators that convert: ORT's CPU EP must have a bf16 kernel for each."""
    i64 = lambda *v: numpy_helper.from_array(np.array(v, np.int64), f"c{len(v)}")  # noqa: E731
    extra = {"Reshape": [i64(32)], "Squeeze": [i64(0)], "Unsqueeze": [i64(0)], "Slice": [i64(0), i64(2)],
             "Gather": [numpy_helper.from_array(np.array([0, 1], np.int64), "idx")]}.get(op, [])
    inputs = ["x", "x"] if op == "Concat" else ["x"]
    attrs = {"Concat": {"axis": 0}, "Split": {"axis": 0, "num_outputs": 2}}.get(op, {})
    if op == "Slice":
        extra = [numpy_helper.from_array(np.array([0], np.int64), "s0"),
                 numpy_helper.from_array(np.array([2], np.int64), "s1")]
    shape = [1, 4, 8] if op == "Squeeze" else [4, 8]
    out_type = TensorProto.INT64 if op in ("Shape", "Size") else TensorProto.BFLOAT16
    outputs = ["y", "y2"] if op == "Split" else ["y"]
    node = helper.make_node(op, inputs + [t.name for t in extra], outputs, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, shape)],
                          [helper.make_tensor_value_info(o, out_type, None) for o in outputs], extra)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 10
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["vit-b16", "deit-s", "bert-base"])  # deit-b: vit-b16 with another head
def test_full_size_builtins_convert_with_kernels_and_pass_check(name: str, precision: str) -> None:
    """The full-size built-in models: dtypes kept, half the size, device kernels on every fused node, and
    check's defaults for the precision met against the fp32 original (through the functions)."""
    original = build(name, seed=0)
    result = optimize(original, GtcoConfig(precision=precision))
    assert io_types(result.model) == io_types(original)
    assert 0.45 < result.model.ByteSize() / original.ByteSize() < 0.56
    for g in result.report["groups"]:
        assert g["device_kernels"] == list(CUDA_ARCHS) or g["family"] in WITHOUT_KERNEL, g
    rtol, atol, _ = default_tolerances(result.model)
    assert all(d.ok for d in compare(original, result.model, "cpu", rtol, atol))
