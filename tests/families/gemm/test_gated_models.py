"""Gated MLPs (SwiGLU, GeGLU) in models: the packing pass (families/gemm/gated.py) that makes the gate and up
projections one MatMul over interleaved weights, what it leaves alone, and the fused Gemm node it gives, run through
its function, the CPU library and the emulated device kernels against the original."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import assert_close_through_built_libraries, assert_close_through_library
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.gemm.gated import pack_gated
from onnx_gtco.ir.load import load_model
from onnx_gtco.plugin.coverage import model_coverage

BOUND = {"fp32": 2e-3, "fp16": 5e-3, "bf16": 3e-2}
HIDDEN, MLP = 64, 96


def mlp_model(act: str = "silu", *, up_read_twice: bool = False, up_width: int = MLP, seed: int = 0
              ) -> onnx.ModelProto:
    """x [2, 8, HIDDEN] -> act(x @ Wg) * (x @ Wu) @ Wd + x: a gated MLP block (act: silu as x * Sigmoid(x),
    gelu_erf as 0.5 x (1 + erf(x / sqrt 2)), or softplus, which no GEMM epilogue applies)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((0.1 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in (("wg", (HIDDEN, MLP)), ("wu", (HIDDEN, up_width)), ("wd", (MLP, HIDDEN)))]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n)
              for n, v in (("half", 0.5), ("one", 1.0), ("sqrt2", np.sqrt(2.0)))]
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
             helper.make_node("MatMul", ["x", "wu"], ["u"], name="up")]
    if act == "silu":
        nodes += [helper.make_node("Sigmoid", ["g"], ["s"], name="sig"), helper.make_node("Mul", ["g", "s"], ["a"])]
    elif act == "gelu_erf":
        nodes += [helper.make_node("Div", ["g", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["g", "e1"], ["ge"]),
                  helper.make_node("Mul", ["ge", "half"], ["a"])]
    else:
        nodes += [helper.make_node("Softplus", ["g"], ["a"])]
    nodes += [helper.make_node("Mul", ["a", "u"], ["h"], name="product"),
              helper.make_node("MatMul", ["h", "wd"], ["dn"], name="down"),
              helper.make_node("Add", ["dn", "x"], ["y"], name="residual")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, HIDDEN])]
    if up_read_twice:
        outputs.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, [2, 8, up_width]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, HIDDEN])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x})[0]


@pytest.mark.parametrize("act", ["silu", "gelu_erf"])
def test_packing_makes_one_matmul_over_interleaved_weights_and_keeps_the_model(act: str) -> None:
    model = load_model(mlp_model(act))
    packed, pairs = pack_gated(model)
    assert [(p.gate.name, p.up.name, p.activation) for p in pairs] == [("gate", "up", act)]
    mms = [n for n in packed.graph.node if n.op_type == "MatMul"]
    assert len(mms) == 2 and sum(n.op_type == "Slice" for n in packed.graph.node) == 2
    weight = next(numpy_helper.to_array(t) for t in packed.graph.initializer if t.name == mms[0].input[1])
    wg, wu = (numpy_helper.to_array(t) for t in model.graph.initializer if t.name in ("wg", "wu"))
    np.testing.assert_array_equal(weight[:, 0::2], wg)
    np.testing.assert_array_equal(weight[:, 1::2], wu)
    onnx.checker.check_model(packed, full_check=True)
    x = np.random.default_rng(1).standard_normal((2, 8, HIDDEN)).astype(np.float32)
    np.testing.assert_allclose(_run(packed, x), _run(model, x), rtol=1e-5, atol=1e-5)
    assert pack_gated(packed) == (packed, [])  # nothing left to pack


@pytest.mark.parametrize("model", [mlp_model("softplus"), mlp_model(up_read_twice=True), mlp_model(up_width=80)],
                         ids=["activation-no-epilogue-applies", "up-read-elsewhere", "widths-differ"])
def test_what_is_not_a_packable_gated_mlp_stays(model: onnx.ModelProto) -> None:
    loaded = load_model(model)
    assert pack_gated(loaded) == (loaded, [])


def _gated_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "ai.gtco" and n.op_type.startswith("Gemm_")
            and any(a.name == "gated" and a.i for a in n.attribute)]


def test_a_gated_mlp_is_one_gemm_node_with_a_device_kernel_and_one_launch_less() -> None:
    packed = optimize(mlp_model(), GtcoConfig(precision="fp16"))
    plain = optimize(mlp_model(), GtcoConfig(precision="fp16", pack_gated=False))
    (node,) = _gated_nodes(packed.model)
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["activation"] == b"silu"
    assert not _gated_nodes(plain.model)
    coverage = model_coverage(packed.model)
    assert coverage.nodes[node.name].archs, coverage.nodes[node.name].reason
    assert packed.report["launches"]["ours"] < plain.report["launches"]["ours"]
    assert packed.report["predicted_us_after"] < plain.report["predicted_us_after"]


@pytest.mark.slow
@pytest.mark.parametrize(("act", "precision"), [("silu", "fp32"), ("gelu_erf", "bf16")])  # fp16: the RMSNorm LLaMA test
def test_the_function_the_cpu_library_and_the_emulated_kernels_compute_the_original(tmp_path: Path, act: str,
                                                                                    precision: str) -> None:
    original = mlp_model(act, seed=3)
    rewritten = optimize(original, GtcoConfig(precision=precision)).model
    assert len(_gated_nodes(rewritten)) == 1
    assert_close_through_library(original, rewritten, None, tmp_path, BOUND[precision], f"{act} functions")
    assert_close_through_built_libraries(original, rewritten, tmp_path, BOUND[precision], f"{act} {precision}",
                                         "Gemm_")
