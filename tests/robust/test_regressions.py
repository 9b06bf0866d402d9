"""Minimal models of what the robustness tests found, one named test each, built inline.

Most run the original and the optimized model in onnxruntime's CPU EP on seeded inputs and compare them; a few
check the step that broke (loading, the final check) directly.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.errors import RewriteError
from onnx_gtco.ir.export import validate
from onnx_gtco.ir.load import load_model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_shape_with_start_end_keeps_its_slice() -> None:
    """Found by the onnx backend node tests (test_attention_*_expanded, test_shape_start_*, ...): a Shape node with
    start/end attributes (opset 15) of a static input was folded into the whole shape, so the optimized model
    scaled x by its whole shape [2, 4, 3] where the original scales it by 4."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=-2, end=-1),
             helper.make_node("Cast", ["s"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "f"], ["y"])]
    graph = helper.make_graph(nodes, "shape_slice", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)}
    ref = _run(model, feeds)
    got = _run(optimize(model, GtcoConfig()).model, feeds)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)


def _check_same(model: onnx.ModelProto, feeds: dict[str, object]) -> onnx.ModelProto:
    """Optimize `model`, run both in onnxruntime on `feeds` and compare every output; returns the optimized model."""
    onnx.checker.check_model(model, full_check=False)
    out = optimize(model, GtcoConfig()).model
    onnx.checker.check_model(out)
    for ref, got in zip(_run(model, feeds), _run(out, feeds), strict=True):
        np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64),
                                   rtol=1e-6, atol=1e-6)
    return out


def _outer_scope_if() -> onnx.ModelProto:
    """y = If(c) reading t = Sigmoid(x) from the outer scope in its then-branch; z = Neg(t) is the second output, so a
    depth-first order from the outputs that sees only node inputs places Sigmoid after the If."""
    f = TensorProto.FLOAT
    then_g = helper.make_graph([helper.make_node("Add", ["t", "t"], ["ty"])], "then", [],
                               [helper.make_tensor_value_info("ty", f, [2, 3])])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["ey"])], "else", [],
                               [helper.make_tensor_value_info("ey", f, [2, 3])])
    nodes = [helper.make_node("Sigmoid", ["x"], ["t"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Neg", ["t"], ["z"])]
    graph = helper.make_graph(nodes, "outer_scope_if",
                              [helper.make_tensor_value_info("x", f, [2, 3]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", f, [2, 3]),
                               helper.make_tensor_value_info("z", f, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("cond", [True, False])
def test_if_branch_reading_an_outer_tensor_keeps_its_producer_first(cond: bool) -> None:
    """Found by test_affine_grid_*_expanded: the loader's depth-first order ignored what If branches read from the
    outer scope, and put their producer after the If (an invalid model)."""
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32), "c": np.array(cond)}
    _check_same(_outer_scope_if(), feeds)


def test_model_without_default_domain_opset_passes_through() -> None:
    """Found by test_ai_onnx_ml_*: a model importing only ai.onnx.ml (no default-domain opset) was refused; it has
    nothing to fuse and passes through."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    graph = helper.make_graph([helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold=0.25)],
                              "ml_only", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)], ir_version=8)
    out = _check_same(model, {"x": np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)})
    assert [n.op_type for n in out.graph.node] == ["Binarizer"]


def test_fold_failure_keeps_the_model_unfolded() -> None:
    """Found by test_identity_opt / test_if_opt / test_loop16_seq_none: onnx-graphsurgeon's constant folding raises
    on optional and sequence values; loading keeps such a model unfolded instead of failing."""
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [5]))
    opt = helper.make_value_info("o", helper.make_optional_type_proto(seq))
    graph = helper.make_graph([helper.make_node("Identity", ["o"], ["p"])], "identity_opt", [opt],
                              [helper.make_value_info("p", helper.make_optional_type_proto(seq))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)
    value = [np.random.default_rng(3).standard_normal(5).astype(np.float32) for _ in range(2)]
    out = optimize(model, GtcoConfig()).model
    got = _run(out, {"o": value})[0]
    assert len(got) == 2 and all(np.array_equal(g, v) for g, v in zip(got, value, strict=True))


def test_if_branch_reading_an_outer_tensor_loads_in_order() -> None:
    """The loader's half of the If regression above: its depth-first order keeps the outer tensor's producer first."""
    onnx.checker.check_model(load_model(_outer_scope_if()))


def _mvn() -> onnx.ModelProto:
    """MeanVarianceNormalization at opset 13: a valid model (onnxruntime runs it) that onnx's strict shape inference
    fails on, inside the op's own function body."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3, 3, 1])
    graph = helper.make_graph([helper.make_node("MeanVarianceNormalization", ["x"], ["y"])], "mvn", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3, 3, 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_strict_inference_failure_of_the_input_is_not_the_rewrites() -> None:
    """Found by test_mvn: the rewritten model's check raised onnx's raw InferenceError. It is a RewriteError now,
    and a model whose loaded form fails strict inference too is held to the plain check."""
    model = load_model(_mvn())
    with pytest.raises(RewriteError, match="shape inference"):
        validate(model)
    validate(model, loaded=model)


def test_model_failing_strict_inference_passes_through() -> None:
    """test_mvn end to end: optimize passes the model through and it still matches."""
    _check_same(_mvn(), {"x": np.random.default_rng(4).standard_normal((3, 3, 3, 1)).astype(np.float32)})
