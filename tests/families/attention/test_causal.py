"""Causal attention: the constant causal mask of a static export (LLaMA, Qwen through torch.onnx.export at a fixed
length; an additive [1, 1, S, S] mask before the Softmax, or ONNX Attention's boolean attn_mask) is recognized by
the rule, the node becomes causal and no kernel reads the mask; near misses keep reading it. The kernels' numerics
are test_attention's (CAUSAL_CASES), the whole LLaMA-style encoder's test_rmsnorm_models's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from cpu_session import assert_close_through_built_libraries

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.attention.rule import AttentionPattern
from onnx_gtco.ir.load import load_model
from onnx_gtco.pipeline import plan_model
from onnx_gtco.plan.types import Candidate, Plan
from onnx_gtco.plugin.coverage import model_coverage
from onnx_gtco.rewrite import rewrite

RULE = AttentionPattern()
S = 8


def _lower() -> np.ndarray:
    return np.arange(S)[None, :] <= np.arange(S)[:, None]


def additive(lower: np.ndarray, floor: float) -> np.ndarray:
    return np.where(lower, 0.0, floor).astype(np.float32).reshape(1, 1, S, S)


def scores_graph(kit, mask: np.ndarray, after: float | None = None):
    """softmax(q kᵀ / sqrt(4) + mask [* after]) v over [1, 2, S, 4] operands, the mask a constant."""
    g = kit.graph()
    for n in "qkv":
        g.input(n, [1, 2, S, 4])
    g.op("Transpose", ["k"], "kt", perm=[0, 1, 3, 2])
    g.op("MatMul", ["q", "kt"], "qk")
    g.op("Div", ["qk", g.const("sqrt_d", np.float32(2.0))], "scaled")
    g.op("Add", ["scaled", g.const("mask", mask)], "masked")
    scores = "masked"
    if after is not None:
        scores = g.op("Mul", ["masked", g.const("after", np.float32(after))], "after_mask")
    g.op("Softmax", [scores], "probs", axis=-1)
    g.op("MatMul", ["probs", "v"], "out")
    g.output("out")
    return g


@pytest.mark.parametrize(("mask", "after", "causal"), [
    (additive(_lower(), -np.inf), None, True),
    (additive(_lower(), float(np.finfo(np.float32).min)), None, True),
    (additive(_lower(), -100.0), 0.5, True),  # (QKᵀ + M) * 0.5: -50 above the diagonal, still nothing of a weight
    (additive(_lower(), -100.0), 0.01, False),  # -1 above the diagonal: a weight, the mask must be read
    (additive(np.tril(np.ones((S, S), bool), -1) | (np.arange(S)[:, None] == 0), -np.inf), None, False),  # strict
    (np.concatenate([additive(_lower(), -np.inf), additive(_lower().T, -np.inf)]), None, False),  # batch 2: not all
    (np.broadcast_to(additive(_lower(), -1e4), (1, 2, S, S)).copy(), None, True),  # per head, every head causal
])
def test_a_constant_causal_mask_makes_the_node_causal(kit, mask: np.ndarray, after: float | None,
                                                      causal: bool) -> None:
    view = scores_graph(kit, mask, after).view()
    matches, rejects = kit.run(RULE, view)
    assert rejects == [] and [m.family for m in matches] == ["bmm_softmax", "attention", "attention"]
    for m in matches:
        assert bool(m.attrs.get("causal")) is causal and m.attrs["mask"] is True
        assert ("mask" in m.roles) is not causal


def test_a_constant_mask_of_zeros_is_not_read(kit) -> None:
    """A static export without padding folds its attention mask into zeros (ModernBERT's global layers): the node
    has no mask (nor causal) and no kernel reads it; a mask with one masked key stays read."""
    for mask, read in ((np.zeros((1, 1, 1, S), np.float32), False),
                       (np.where(np.arange(S) == S - 1, -1e4, 0.0).astype(np.float32).reshape(1, 1, 1, S), True)):
        matches, _ = kit.run(RULE, scores_graph(kit, mask).view())
        for m in matches:
            assert (m.attrs["mask"], "mask" in m.roles, bool(m.attrs.get("causal"))) == (read, read, False)


def test_an_onnx_attention_boolean_causal_mask_makes_the_node_causal(kit) -> None:
    """Opset 23's Attention with the boolean attn_mask a static dynamo export writes (True: attend) is causal and
    reads no mask; a boolean mask that is not causal stays its mask input, one of all True is no mask."""
    for mask, causal in ((_lower(), True), (~_lower() | np.eye(S, dtype=bool), False), (np.ones((S, S), bool), None)):
        g = kit.graph()
        for n in "qkv":
            g.input(n, [1, 2, S, 4])
        g.op("Attention", ["q", "k", "v", g.const("le", mask.reshape(1, 1, S, S))], "attn", scale=0.5)
        g.output("attn")
        matches, _ = kit.run(RULE, g.view(opset=23))
        (m,) = matches
        if causal is None:  # all True: masks nothing, read by nothing
            assert (m.attrs["causal"], m.attrs["mask"], "mask" in m.roles) == (False, False, False)
        else:
            assert (m.attrs["causal"], "mask" in m.roles) == (causal, not causal)


def llama_sdpa(opset: int, seq: int = 16, hidden: int = 32, heads: int = 2) -> onnx.ModelProto:
    """One attention block of a static export: projections, head split, the causal mask as an ONNX Attention
    attn_mask (opset 23, boolean) or an additive constant before the Softmax (opset 18), head merge, output
    projection."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    d = hidden // heads
    lower = np.arange(seq)[None, :] <= np.arange(seq)[:, None]
    inits = [numpy_helper.from_array((0.2 * rng.standard_normal((hidden, hidden))).astype(np.float32), f"w{n}")
             for n in "qkvo"]
    inits += [numpy_helper.from_array(np.array([1, seq, heads, d], np.int64), "split"),
              numpy_helper.from_array(np.array([1, seq, hidden], np.int64), "merged")]
    nodes = []
    for n in "qkv":
        nodes += [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}p"]),
                  helper.make_node("Reshape", [f"{n}p", "split"], [f"{n}s"]),
                  helper.make_node("Transpose", [f"{n}s"], [f"{n}h"], perm=[0, 2, 1, 3])]
    if opset >= 23:
        inits.append(numpy_helper.from_array(lower.reshape(1, 1, seq, seq), "le"))
        nodes.append(helper.make_node("Attention", ["qh", "kh", "vh", "le"], ["o"], scale=1.0 / math.sqrt(d)))
    else:
        inits += [numpy_helper.from_array(np.where(lower, 0.0, -np.inf).astype(np.float32).reshape(1, 1, seq, seq),
                                          "mask"),
                  numpy_helper.from_array(np.float32(1.0 / math.sqrt(d)), "scale")]
        nodes += [helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["qh", "kt"], ["qk"]),
                  helper.make_node("Mul", ["qk", "scale"], ["qks"]),
                  helper.make_node("Add", ["qks", "mask"], ["qkm"]),
                  helper.make_node("Softmax", ["qkm"], ["p"], axis=-1),
                  helper.make_node("MatMul", ["p", "vh"], ["o"])]
    nodes += [helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merged"], ["om"]),
              helper.make_node("MatMul", ["om", "wo"], ["y"])]
    graph = helper.make_graph(nodes, "sdpa", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


@pytest.mark.slow
def test_a_static_export_runs_causal_kernels_equal_to_the_original(tmp_path: Path) -> None:
    """The additive form's attention is a causal fused node with a device kernel, and the CPU library and the emulated
    kernels give the original's output."""
    original = llama_sdpa(18)
    rewritten = optimize(original, GtcoConfig(precision="fp16")).model
    (att,) = [n for n in rewritten.graph.node if n.op_type.startswith("Attention_")]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in att.attribute}
    assert attrs["causal"] == 1 and b"mask" not in attrs["roles"] and "mask" in att.input  # for its function
    coverage = model_coverage(rewritten)
    assert coverage.error is None and {n: c.reason for n, c in coverage.nodes.items() if not c.archs} == {}
    assert_close_through_built_libraries(original, rewritten, tmp_path, 5e-3, "causal fp16", "Attention_")


@pytest.mark.slow
def test_an_onnx_attention_with_a_causal_attn_mask_has_a_kernel_that_computes_it(tmp_path: Path) -> None:
    """Opset 23's Attention with a boolean causal attn_mask had no kernel (the kernels take no boolean mask); as a
    causal node it has one, and run through it (fp32: TF32 Tensor Cores) it gives the op's output. Whether a plan
    takes it over ORT's own Attention is the estimate's call, so the node is fused here by a plan of its own."""
    original = llama_sdpa(23)
    config = GtcoConfig(precision="fp32")
    planned = plan_model(load_model(original), config)
    cand = max((c for c in planned.candidates if c.family == "attention"), key=lambda c: len(c.nodes))
    assert cand.attr("causal") is True and "mask" not in dict(cand.roles) and planned.coverage(cand).on(config.arch)
    singles = [Candidate(frozenset([i]), "unfused", "single") for i in range(len(planned.view))
               if i not in cand.nodes]
    plan = Plan(tuple(sorted([cand, *singles], key=lambda c: min(c.nodes))), 0.0)
    rewritten, _ = rewrite(planned.view, plan, "fp32")
    assert [n.op_type for n in rewritten.graph.node].count("Attention_f32") == 1
    assert_close_through_built_libraries(original, rewritten, tmp_path, 2e-3, "causal opset 23", "Attention_")
