"""Q, K and V projections packed into one GEMM before planning (families/gemm/pack.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_gtco.families.gemm.pack import pack_qkv
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.models import build
from onnx_gtco.patterns import rules
from onnx_gtco.plan.candidates import collect


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {i.name: rng.integers(0, 900, [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.int64)
            for i in model.graph.input}


@pytest.mark.parametrize("ln", ["decomposed", "op"])
def test_bert_projections_become_one_gemm_and_the_model_computes_the_same(ln: str) -> None:
    model = load_model(build("bert-tiny", ln=ln))
    packed, packings = pack_qkv(model)
    assert len(packings) == 2  # one per layer
    assert packings[0].outputs == tuple(
        f"encoder.layer.0.attention.self.{r}.add" for r in ("query", "key", "value"))
    onnx.checker.check_model(packed, full_check=True)
    before = {n.op_type for n in model.graph.node}
    assert "Split" not in before and sum(n.op_type == "Split" for n in packed.graph.node) == 2
    assert len(packed.graph.node) == len(model.graph.node) - 2 * 3  # 6 nodes -> MatMul, Add, Split per layer
    names = {t.name for t in packed.graph.initializer}
    assert not any(".self.query.weight" in n for n in names)  # the separate weights are gone
    feeds = _feeds(model)
    for a, b in zip(_run(model, feeds), _run(packed, feeds), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert pack_qkv(packed)[1] == []  # nothing left to pack
    assert len(model.graph.node) == len(load_model(build("bert-tiny", ln=ln)).graph.node)  # input untouched


def test_the_attention_then_reads_the_packed_tensor() -> None:
    packed, _ = pack_qkv(load_model(build("bert-tiny")))
    view = GraphView(packed)
    cands, _ = collect(view, rules(), 48)
    att = [c for c in cands if c.family == "attention" and c.attr("q_layout") == "qkv_packed"]
    assert len(att) == 2
    roles = dict(att[0].roles)
    assert roles["q"] == roles["k"] == roles["v"] == "encoder.layer.0.attention.self.query.matmul.qkv_packed.add"
    gemm = [c for c in cands if c.family == "gemm" and c.attr("n") == 3 * 128 and c.attr("bias")]
    assert len(gemm) == 2
    assert not [c for c in cands if c.family == "qkv"]


def test_fused_qkv_exports_and_other_projection_groups_are_left_alone(kit) -> None:
    model = load_model(build("bert-tiny", qkv="fused"))
    assert pack_qkv(model)[1] == []
    # three projections of one input that an attention does not read as q, k and v (a concatenation here)
    g = kit.graph()
    g.input("x", [1, 6, 16])
    for n in "qkv":
        g.op("MatMul", ["x", g.weight(f"w{n}", 16, 16)], f"{n}_mm")
    g.op("Concat", ["q_mm", "k_mm", "v_mm"], "meet", axis=-1)
    g.output("meet")
    m = load_model(g.model())
    out, packings = pack_qkv(m)
    assert packings == [] and out is m


def test_a_projection_with_a_broadcast_scalar_bias_is_not_packed() -> None:
    model = load_model(build("bert-tiny"))
    for t in model.graph.initializer:
        if t.name == "encoder.layer.0.attention.self.key.bias":
            t.CopyFrom(onnx.numpy_helper.from_array(np.array([0.5], np.float32), t.name))
    packed, packings = pack_qkv(model)
    assert [p.first for p in packings] == ["encoder.layer.1.attention.self.query.matmul"]
    onnx.checker.check_model(packed, full_check=True)
    feeds = _feeds(model)
    for a, b in zip(_run(model, feeds), _run(packed, feeds), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
