"""Rewrite: fused nodes in ai.gtco with model-local functions that keep the model runnable anywhere."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from onnx_gtco.errors import RewriteError
from onnx_gtco.ir.export import save_atomic, validate
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.opspec import DOMAIN, op_type
from onnx_gtco.plan.types import Candidate, Plan, freeze_attrs
from onnx_gtco.rewrite import rewrite


def _plan(view: GraphView, groups: list[tuple[list[int], str, dict]]) -> Plan:
    covered = {i for ids, _, _ in groups for i in ids}
    cands = [Candidate(frozenset(ids), fam, "test", freeze_attrs(attrs)) for ids, fam, attrs in groups]
    cands += [Candidate(frozenset([i]), "unfused", "single") for i in range(len(view)) if i not in covered]
    return Plan(tuple(sorted(cands, key=lambda c: min(c.nodes))), 0.0)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_groups_become_gtco_nodes_with_functions(mlp: onnx.ModelProto) -> None:
    view = GraphView(load_model(mlp))
    attrs = {"bias": True, "activation": "none", "batch": (4, "S"), "alpha": 0.5}
    new, names = rewrite(view, _plan(view, [([0, 1], "gemm", attrs), ([3, 4], "gemm", attrs)]), "fp16")
    validate(new)
    assert [n.op_type for n in new.graph.node] == ["Gemm_f32", "Relu", "Gemm_f32"]
    assert all(n.domain == DOMAIN for n in new.graph.node if n.op_type == "Gemm_f32")
    assert names == ["gtco/gemm/fc0", "gtco/gemm/fc1"]
    assert len(new.functions) == 1, "identical groups share one canonical function"
    fn = new.functions[0]
    assert (fn.domain, fn.name) == (DOMAIN, "Gemm_f32") and fn.overload == new.graph.node[0].overload
    assert [n.op_type for n in fn.node] == ["MatMul", "Add"]
    assert new.ir_version >= 10
    node_attrs = {a.name: helper.get_attribute_value(a) for a in new.graph.node[0].attribute}
    assert node_attrs == {"activation": b"none", "alpha": 0.5, "batch": [b"4", b"S"], "bias": 1,
                          "precision": b"fp16", "roles": [], "out_roles": []}  # this plan names no roles
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(new, {"x": x})[0], _run(mlp, {"x": x})[0], rtol=1e-6, atol=1e-6)


def test_intermediate_used_outside_becomes_an_output(mlp: onnx.ModelProto) -> None:
    mlp.graph.output.append(helper.make_tensor_value_info("a0", onnx.TensorProto.FLOAT, [4, 8]))
    view = GraphView(load_model(mlp))
    new, _ = rewrite(view, _plan(view, [([0, 1, 2], "gemm", {})]))
    validate(new)
    fused = new.graph.node[0]
    assert list(fused.output) == ["a0", "r0"]
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    for got, ref in zip(_run(new, {"x": x}), _run(mlp, {"x": x}), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_different_bodies_get_different_overloads(mlp: onnx.ModelProto) -> None:
    view = GraphView(load_model(mlp))
    new, _ = rewrite(view, _plan(view, [([0, 1, 2], "gemm", {}), ([3, 4], "gemm", {})]))
    validate(new)
    assert len({f.overload for f in new.functions}) == 2
    assert {f.name for f in new.functions} == {"Gemm_f32"}


def test_rewrite_is_byte_deterministic(mlp: onnx.ModelProto) -> None:
    outs = []
    for _ in range(2):
        view = GraphView(load_model(mlp))
        new, _ = rewrite(view, _plan(view, [([0, 1], "gemm", {"bias": True})]))
        outs.append(new.SerializeToString(deterministic=True))
    assert outs[0] == outs[1]


def test_op_type_names_family_and_dtype() -> None:
    assert op_type("bmm_softmax", "f16") == "BmmSoftmax_f16"
    assert op_type("attention", "bf16") == "Attention_bf16"


def test_save_atomic_leaves_nothing_on_failure(tmp_path, mlp: onnx.ModelProto) -> None:
    from onnx_gtco.errors import OutputError

    with pytest.raises(OutputError, match="does not exist"):
        save_atomic(mlp, tmp_path / "missing" / "m.onnx")
    out = save_atomic(mlp, tmp_path / "m.onnx")
    assert onnx.load(str(out)).graph.name == "mlp"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_atomic_writes_get_the_mode_open_would_give(tmp_path, mlp: onnx.ModelProto) -> None:
    """Reports, bench files and models are readable by whoever may read the folder, as with a plain open(), not
    private to the writer as mkstemp leaves its files."""
    import os

    from onnx_gtco.ir.export import write_bytes_atomic, write_text_atomic

    old = os.umask(0o027)
    try:
        paths = [save_atomic(mlp, tmp_path / "m.onnx"), write_text_atomic("{}\n", tmp_path / "r.json"),
                 write_bytes_atomic(b"\x89PNG", tmp_path / "b.png")]
    finally:
        os.umask(old)
    assert [p.stat().st_mode & 0o777 for p in paths] == [0o640] * 3
    assert (tmp_path / "r.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.png", "m.onnx", "r.json"]


def test_an_attribute_outside_the_family_spec_is_refused(mlp: onnx.ModelProto) -> None:
    view = GraphView(load_model(mlp))
    with pytest.raises(RewriteError, match="attribute 'heads' is not in its spec"):
        rewrite(view, _plan(view, [([0, 1], "gemm", {"heads": 2})]))
