"""A weight GEMM and the LayerNorm over its rows as one group (families/gemm/rule.py GemmLayerNormPattern)."""

from __future__ import annotations

import pytest

from onnx_gtco.families.gemm.rule import MAX_LN_N, GemmLayerNormPattern

RULE = GemmLayerNormPattern()


def block(kit, *, n: int = 16, post: bool = True, extra_reader: bool = False, beta: bool = True):
    g = kit.graph()
    g.input("x", [1, 6, 32])
    g.input("res", [1, 6, n])
    g.op("MatMul", ["x", g.weight("w", 32, n)], "mm")
    g.op("Add", ["mm", g.weight("b", n)], "bias")
    g.op("Add", ["bias", "res"], "sum")  # the LayerNorm's residual Add (post-LN) or the GEMM's (pre-LN)
    ins = ["sum", g.weight("gamma", n)] + ([g.weight("beta", n)] if beta else [])
    g.op("LayerNormalization", ins, "ln", axis=-1, epsilon=1e-6)
    g.op("Relu", ["ln"], "next")  # the normalized rows feed the next GEMM (a graph output is never merged)
    outs = ["next"]
    if not post:  # pre-LN: the sum is read on (the next residual)
        g.op("Relu", ["sum"], "next_residual_reader")
        outs.append("next_residual_reader")
    if extra_reader:
        g.op("Relu", ["bias"], "bias_reader")
        outs.append("bias_reader")
    g.output(*outs)
    return g.view()


def test_post_ln_merges_the_layernorm_residual_into_the_gemm(kit) -> None:
    view = block(kit, post=True)
    matches, _ = kit.run(RULE, view)
    groups = kit.groups(view, matches)
    assert {"mm", "bias", "sum", "ln"} in groups
    m = next(m for m in matches if kit.names(view, m.nodes) == {"mm", "bias", "sum", "ln"})
    assert m.family == "gemm"
    assert m.attrs["layernorm"] is True and m.attrs["epsilon"] == pytest.approx(1e-6) and m.attrs["residual"]
    assert {"gamma", "beta", "residual"} <= set(m.roles) and m.outputs["norm"] == "ln"


def test_pre_ln_keeps_the_sum_as_an_output(kit) -> None:
    view = block(kit, post=False)
    matches, _ = kit.run(RULE, view)
    m = next(m for m in matches if kit.names(view, m.nodes) == {"mm", "bias", "sum", "ln"})
    assert m.outputs == {"y": "sum", "norm": "ln"}


def test_no_merge_when_the_gemm_result_is_read_elsewhere_or_too_wide_or_without_beta(kit) -> None:
    view = block(kit, extra_reader=True)
    matches, _ = kit.run(RULE, view)
    # the GEMM with its bias alone is read by another node: only the GEMM + residual form remains mergeable
    assert all("sum" in kit.names(view, m.nodes) for m in matches)
    assert all(m.attrs["residual"] for m in matches)
    assert kit.run(RULE, block(kit, n=MAX_LN_N + 8))[0] == []
    assert kit.run(RULE, block(kit, beta=False))[0] == []


def test_no_merge_when_the_layernorm_output_is_a_graph_output(kit) -> None:
    g = kit.graph()
    g.input("x", [1, 6, 32])
    g.op("MatMul", ["x", g.weight("w", 32, 16)], "mm")
    g.op("LayerNormalization", ["mm", g.weight("gamma", 16), g.weight("beta", 16)], "ln", axis=-1)
    g.output("ln")
    assert kit.run(RULE, g.view())[0] == []
