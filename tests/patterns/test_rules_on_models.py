"""Over whole models: every attention block matches, every matrix product lands in some candidate."""

from __future__ import annotations

import pytest

from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView

NONE = {"attention": [], "bmm_softmax": [], "matmul": []}


@pytest.mark.parametrize("name", ["vit-tiny", "bert-tiny"])
def test_built_in_models(kit, name: str) -> None:
    from onnx_gtco import models

    view = GraphView(load_model(models.build(name, depth=2)))
    cands, _ = kit.collect(view)
    assert any(n.op_type == "Softmax" for n in view.nodes)
    assert kit.uncovered(view, cands) == NONE


@pytest.mark.parametrize(("name", "forms", "act", "q_layout"), [
    ("vit-tiny", {"ln": "decomposed", "gelu": "tanh", "qkv": "split", "opset": 13, "batch": "N"}, "gelu_tanh",
     "bshd_merged"),
    ("vit-tiny", {"ln": "op", "gelu": "op", "qkv": "fused", "opset": 20}, "gelu_erf", "qkv_packed"),
    ("bert-tiny", {"ln": "op", "gelu": "erf", "qkv": "fused", "opset": 17, "batch": "N"}, "gelu_erf",
     "qkv_packed"),
])
def test_built_in_model_forms(kit, name: str, forms: dict, act: str, q_layout: str) -> None:
    from onnx_gtco import models

    view = GraphView(load_model(models.build(name, depth=2, **forms)))
    cands, _ = kit.collect(view)
    assert kit.uncovered(view, cands) == NONE
    assert sum(c.attr("activation") == act for c in cands if c.family == "gemm") == 2
    assert sum(c.attr("q_layout") == q_layout for c in cands if c.family == "attention") == 2
    assert sum(c.family == "layernorm" and not c.attr("residual") for c in cands) == 5
