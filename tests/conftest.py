"""Shared fixtures: seeds and small hand-built models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pins import CONV_KERNELS, FUSED_FORMS, pinned_calibration, write_calibration
from rule_kit import Kit


def mlp_model(rows: int | str = 4, width: int = 8, seed: int = 0) -> onnx.ModelProto:
    """x -> MatMul+Add -> Relu -> MatMul+Add -> y: the smallest model with two GEMM groups."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), f"w{i}") for i in (0, 1)]
    inits += [numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b{i}") for i in (0, 1)]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"], name="fc0"),
        helper.make_node("Add", ["m0", "b0"], ["a0"], name="fc0.bias"),
        helper.make_node("Relu", ["a0"], ["r0"], name="act"),
        helper.make_node("MatMul", ["r0", "w1"], ["m1"], name="fc1"),
        helper.make_node("Add", ["m1", "b1"], ["y"], name="fc1.bias"),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def mlp() -> onnx.ModelProto:
    return mlp_model()


@pytest.fixture
def make_mlp():
    """The mlp builder itself, for tests that need other shapes (e.g. a symbolic batch)."""
    return mlp_model


@pytest.fixture
def scan8() -> onnx.ModelProto:
    """An opset-8 running sum over Scan-8 (onnx's backend case test_scan_sum): init [1, 2], xs [1, 3, 2] ->
    final [1, 2], ys [1, 3, 2]. onnx's version converter drops Scan-8's batch axis from the graph's inputs and
    outputs, so it cannot bring this model forward faithfully."""
    vi = helper.make_tensor_value_info
    f = TensorProto.FLOAT
    body = helper.make_graph([helper.make_node("Add", ["s", "x_t"], ["s2"]),
                              helper.make_node("Identity", ["s2"], ["y_t"])], "body",
                             [vi("s", f, [2]), vi("x_t", f, [2])], [vi("s2", f, [2]), vi("y_t", f, [2])])
    scan = helper.make_node("Scan", ["", "init", "xs"], ["final", "ys"], num_scan_inputs=1, body=body)
    graph = helper.make_graph([scan], "scan8", [vi("init", f, [1, 2]), vi("xs", f, [1, 3, 2])],
                              [vi("final", f, [1, 2]), vi("ys", f, [1, 3, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def fused_forms(tmp_path_factory: pytest.TempPathFactory):
    """FUSED_FORMS (and CONV_KERNELS) for the sm_90 target, for a whole module (its module-scoped fixtures plan with
    it)."""
    with pinned_calibration(tmp_path_factory.mktemp("fused-forms"), "sm_90", **{**FUSED_FORMS, **CONV_KERNELS}):
        yield


@pytest.fixture
def conv_kernels(tmp_path_factory: pytest.TempPathFactory):
    """CONV_KERNELS for the sm_80 and sm_90 targets, for one test: tests of the conv family's kernels, whose plans
    must not turn on whether the estimate puts a conv on our kernel or on ONNX Runtime's."""
    folder = tmp_path_factory.mktemp("conv-kernels")
    write_calibration(folder, "sm_80", **CONV_KERNELS)
    with pinned_calibration(folder, "sm_90", **CONV_KERNELS):
        yield


@pytest.fixture
def calibrated(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """`calibrated(target, **groups)`: the target's shipped calibration (an empty one where none ships) with the
    given constants changed, in a folder $GTCO_CALIBRATION_DIR names for the rest of the test: a plan that must
    not turn on the estimate's current values (a test of binding, say) pins the choice it needs, and a test of a
    choice shows it follows the estimate."""
    from onnx_gtco.calibration import hardware
    from onnx_gtco.config import CALIBRATION_DIR_ENV

    folder = tmp_path_factory.mktemp("calibration")

    def apply(target: str, **groups: dict) -> None:
        write_calibration(folder, target, **groups)
        monkeypatch.setenv(CALIBRATION_DIR_ENV, str(folder))
        hardware.cache_clear()

    yield apply
    hardware.cache_clear()


@pytest.fixture
def kit() -> Kit:
    """The rule tests' graph builder and rule runners (tests/rule_kit.py)."""
    return Kit()
