"""The library builds from the plan's facts (optimize_file passes the plan's view and ranges): what it reads that
way agrees with what shape inference over the written model and its `gtco.dynamic` metadata say."""

from __future__ import annotations

import pytest

from onnx_gtco.config import GtcoConfig, model_ranges
from onnx_gtco.models import BUILTIN, build
from onnx_gtco.pipeline import optimize
from onnx_gtco.plugin.nodes import fused_nodes


def _facts(nodes):
    return [(n.node.name, [(t.name, t.dtype, t.shape, None if t.value is None else t.value.tobytes())
                           for t in (*n.inputs, *n.outputs)]) for n in nodes]


@pytest.mark.parametrize(("name", "batch"), [*((n, 1) for n in sorted(BUILTIN)), ("vit-tiny", "batch"),
                                             ("bert-tiny", "batch")])
def test_plan_facts_agree_with_the_written_model(name, batch):
    result = optimize(build(name, batch=batch), GtcoConfig())
    inferred = fused_nodes(result.model)
    planned = fused_nodes(result.model, result.view.info)
    assert inferred, f"{name}: no fused nodes to compare"
    assert _facts(planned) == _facts(inferred)
    assert all(t.dtype for n in planned for t in (*n.inputs, *n.outputs)), "a fused tensor without a planned type"
    assert (result.dynamic.bounds() if result.dynamic else {}) == model_ranges(result.model)
    assert bool(result.dynamic) == (batch != 1)
