"""Legal models in forms other tools write, all of which onnxruntime loads and runs: the default domain imported as
`ai.onnx`, LayerNormalization below opset 17 (onnxruntime's contrib op), com.microsoft nodes without an import for
that domain. Each loads, fuses where the rules apply, writes a model onnx.checker passes, and runs equal to the
original in onnxruntime through its model-local functions and through the library's CPU kernels (`optimize --cpu`,
then `check` and `check --library`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco.cli import main
from onnx_gtco.errors import RewriteError, UnsupportedError
from onnx_gtco.ir.export import validate
from onnx_gtco.ir.load import load_model

F, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _gemm_ln(opset: int, *, alias: bool = False) -> onnx.ModelProto:
    """x [4, 16] -> MatMul + Add -> LayerNormalization(gamma, beta) -> y [4, 32], at `opset` of the default domain
    (imported as `ai.onnx` with `alias`, its nodes then of domain `ai.onnx` too)."""
    rng = np.random.default_rng(opset)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.25).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, 32).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "beta")]
    domain = "ai.onnx" if alias else ""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc", domain=domain),
             helper.make_node("Add", ["m", "b"], ["a"], name="fc.bias", domain=domain),
             helper.make_node("LayerNormalization", ["a", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5,
                              domain=domain)]
    graph = helper.make_graph(nodes, "gemm_ln", [helper.make_tensor_value_info("x", F, [4, 16])],
                              [helper.make_tensor_value_info("y", F, [4, 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, opset)], ir_version=8)


def _ms_gelu() -> onnx.ModelProto:
    """x -> MatMul + Add -> com.microsoft FastGelu -> com.microsoft BiasGelu(c) -> y, importing only the default
    domain (onnxruntime imports com.microsoft itself, at its opset 1)."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.25).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "c")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
             helper.make_node("Add", ["m", "b"], ["a"], name="fc.bias"),
             helper.make_node("FastGelu", ["a"], ["g"], name="gelu", domain="com.microsoft"),
             helper.make_node("BiasGelu", ["g", "c"], ["y"], name="bias_gelu", domain="com.microsoft")]
    graph = helper.make_graph(nodes, "ms_gelu", [helper.make_tensor_value_info("x", F, [4, 16])],
                              [helper.make_tensor_value_info("y", F, [4, 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _optimize_and_check(model: onnx.ModelProto, d: Path, capsys: pytest.CaptureFixture[str]
                        ) -> tuple[onnx.ModelProto, dict]:
    """onnxruntime runs `model`; `optimize --cpu` writes a model onnx.checker passes (full check) and a library;
    `check` (its functions) and `check --library` (the library's CPU kernels) pass at fp32's tolerances. Returns
    the rewritten model and its report."""
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 16)).astype(
        helper.tensor_dtype_to_np_dtype(model.graph.input[0].type.tensor_type.elem_type))}
    _run(model, feeds)  # the premise: onnxruntime loads and runs it
    src, out = d / "m.onnx", d / "m.gtco.onnx"
    onnx.save(model, str(src))
    assert main(["optimize", "--cpu", str(src)]) == 0, capsys.readouterr().err
    onnx.checker.check_model(str(out), full_check=True)
    for extra in ([], ["--library"]):
        capsys.readouterr()
        assert main(["check", *extra, str(src), str(out)]) == 0, capsys.readouterr().out
        assert capsys.readouterr().out.splitlines()[-1].startswith("1 of 1 outputs within")
    rewritten = onnx.load(str(out))
    return rewritten, json.loads(out.with_name(out.name + ".report.json").read_text())


def _fused(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.domain == "ai.gtco"]


def test_default_domain_under_its_alias(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ORT's test generators import the default domain as `ai.onnx`: the rewrite copied that import into the fused
    nodes' functions, whose nodes are of domain "", and onnx.checker failed at the end."""
    rewritten, _ = _optimize_and_check(_gemm_ln(17, alias=True), tmp_path, capsys)
    assert _fused(rewritten) == ["Gemm_f32", "Layernorm_f32"]
    imports = [(o.domain, o.version) for o in rewritten.opset_import]
    imports += [(o.domain, o.version) for f in rewritten.functions for o in f.opset_import]
    assert ("", 17) in imports and all(d != "ai.onnx" for d, _ in imports), imports
    assert all(n.domain != "ai.onnx" for n in rewritten.graph.node)
    assert all(n.domain != "ai.onnx" for f in rewritten.functions for n in f.node)


@pytest.mark.parametrize("opset", [13, 14, 15, 16])
def test_layernormalization_below_opset_17(opset: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tf2onnx and ORT's optimizer write LayerNormalization at opsets 13-16, which ORT runs as its contrib op (same
    inputs, outputs, attributes and defaults as ONNX's from opset 17): the model is converted to opset 17 and fuses
    as the opset-17 model does."""
    rewritten, report = _optimize_and_check(_gemm_ln(opset), tmp_path, capsys)
    assert [(o.domain, o.version) for o in rewritten.opset_import if o.domain == ""] == [("", 17)]
    at17 = main(["optimize", "--no-build", str(_save(_gemm_ln(17), tmp_path / "at17.onnx"))])
    assert at17 == 0
    capsys.readouterr()
    reference = json.loads((tmp_path / "at17.gtco.onnx.report.json").read_text())
    assert [(g["family"], g["nodes"]) for g in report["groups"]] == \
        [(g["family"], g["nodes"]) for g in reference["groups"]] == [("gemm", ["fc", "fc.bias"]), ("layernorm", ["ln"])]
    assert _fused(rewritten) == ["Gemm_f32", "Layernorm_f32"]


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _mixed_ln() -> onnx.ModelProto:
    """fp16 x [4, 16] -> LayerNormalization with fp32 Scale and B -> fp32 y, at opset 16: onnxruntime's contrib op
    takes that mix and computes Y in Scale's type. (x is the graph's input: an fp16 op before it would differ
    between the two by how ORT's CPU EP runs fp16 ops, in fp32 with the rounding between them dropped or not.)"""
    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "beta")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(nodes, "mixed_ln", [helper.make_tensor_value_info("x", F16, [4, 16])],
                              [helper.make_tensor_value_info("y", F, [4, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)


def test_contrib_layernormalization_with_fp32_scale_on_fp16(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """ORT's contrib LayerNormalization takes an fp16 X with fp32 Scale and B and gives an fp32 Y; ONNX's wants one
    type: the loader casts X to fp32 before it, which is what the contrib kernel computes."""
    model = _mixed_ln()
    loaded = load_model(model)
    ln = next(n for n in loaded.graph.node if n.op_type == "LayerNormalization")
    cast = next(n for n in loaded.graph.node if n.output[0] == ln.input[0])
    assert cast.op_type == "Cast" and helper.get_attribute_value(cast.attribute[0]) == F
    rewritten, _ = _optimize_and_check(model, tmp_path, capsys)
    assert "Layernorm_f32" in _fused(rewritten)


def test_com_microsoft_nodes_without_an_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ORT imports every domain it knows that a model leaves out; onnx.checker refused such a model as invalid.
    The loader imports com.microsoft at ORT's opset for it, and its nodes stay as they are (opaque)."""
    src = _ms_gelu()
    rewritten, _ = _optimize_and_check(src, tmp_path, capsys)
    assert ("com.microsoft", 1) in [(o.domain, o.version) for o in rewritten.opset_import]
    kept = [n for n in rewritten.graph.node if n.domain == "com.microsoft"]
    assert [n.SerializeToString(deterministic=True) for n in kept] == \
        [n.SerializeToString(deterministic=True) for n in src.graph.node[2:]]
    assert _fused(rewritten) == ["Gemm_f32"]


def test_default_domain_imported_twice_takes_the_last_import() -> None:
    """A model importing both "" and `ai.onnx`: ORT reads the default domain at the last one. ReduceSum's axes is
    an attribute at opset 11 and an input from 13, so only the right opset makes this model valid."""
    x = helper.make_tensor_value_info("x", F, [2, 4])
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], axes=[1], keepdims=0)], "g", [x],
                              [helper.make_tensor_value_info("y", F, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx", 13), helper.make_opsetid("", 11)],
                              ir_version=8)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)}
    loaded = load_model(model)
    assert [(o.domain, o.version) for o in loaded.opset_import] == [("", 17)]  # opset 11, converted
    np.testing.assert_allclose(_run(loaded, feeds)[0], _run(model, feeds)[0], rtol=1e-6)


def test_contrib_layernormalization_the_converter_cannot_keep_is_refused(scan8: onnx.ModelProto) -> None:
    """The opset-8 Scan the version converter turns into another model, with a LayerNormalization after it: at
    its own opset onnx refuses the LayerNormalization, so the model cannot pass through unfused either."""
    model = onnx.ModelProto()
    model.CopyFrom(scan8)
    model.graph.node.append(helper.make_node("LayerNormalization", ["ys"], ["n"], axis=-1))
    model.graph.output.append(helper.make_tensor_value_info("n", F, [1, 3, 2]))
    with pytest.raises(UnsupportedError, match=r"^model: LayerNormalization at opset 8 \(onnxruntime's contrib op\) "
                       r"needs the model at opset 17, and onnx's version converter changed the graph's inputs or "
                       r"outputs \(.*\); re-export the model with opset >= 17$"):
        load_model(model)


@pytest.mark.parametrize(("op", "message"), [
    ("ScaledTanh", r"op ScaledTanh has no ONNX definition at opset 17: onnxruntime runs ScaledTanh as its own op, "
     r"which onnx cannot check or convert; export the model with standard ONNX ops in its place \(a current "
     r"exporter, without onnxruntime's graph optimizations\)"),
    ("LayerNormalisation", r"op LayerNormalisation has no ONNX definition at opset 17, nor does onnxruntime know it "
     r"\(a misspelt op, or a custom op without its domain\); correct the op's name, or give a custom op's node the "
     r"domain its library registers"),
])
def test_unknown_default_domain_op_is_refused_saying_what_fixes_it(op: str, message: str) -> None:
    x = helper.make_tensor_value_info("x", F, [2, 4])
    graph = helper.make_graph([helper.make_node(op, ["x", "s"], ["y"], axis=-1)], "g",
                              [x, helper.make_tensor_value_info("s", F, [4])],
                              [helper.make_tensor_value_info("y", F, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(UnsupportedError, match=f"^model: {message}$"):
        load_model(model)


def test_checker_error_names_the_default_domain() -> None:
    """onnx.checker names a node's domain in "No Opset registered for domain ", and the default domain's name is
    empty: the one-line error says which domain it is."""
    fn = helper.make_function("ai.gtco", "F", ["x0"], ["y0"], [helper.make_node("Relu", ["x0"], ["y0"])],
                              opset_imports=[helper.make_opsetid("ai.onnx", 17)])
    x, y = (helper.make_tensor_value_info(n, F, [2]) for n in ("x", "y"))
    graph = helper.make_graph([helper.make_node("F", ["x"], ["y"], domain="ai.gtco")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.gtco", 1)],
                              functions=[fn], ir_version=10)
    with pytest.raises(RewriteError) as e:
        validate(model)
    assert re.fullmatch(r"rewritten model fails onnx.checker: No Opset registered for domain '' \(the default ONNX "
                        r"domain\)", str(e.value)), str(e.value)
