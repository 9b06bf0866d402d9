"""Horizontal fusion of the projections that share their input."""

from __future__ import annotations

from onnx_gtco.families.gemm.qkv_rule import QkvPattern

RULE = QkvPattern()


def projections(kit, biases: str = "qkv"):
    g = kit.graph()
    g.input("x", [1, 6, 16])
    for n, width in (("q", 16), ("k", 16), ("v", 8)):
        g.op("MatMul", ["x", g.weight(f"w{n}", 16, width)], f"{n}_mm")
        if n in biases:
            g.op("Add", [f"{n}_mm", g.weight(f"b{n}", width)], f"{n}_bias")
    g.op("MatMul", ["x", g.weight("w3d", 2, 16, 4)], "batched_weight")  # not a 2-D weight: left out
    g.op("Relu", ["x"], "other_reader")
    g.op("Concat", [f"{n}_bias" if n in biases else f"{n}_mm" for n in "qkv"], "meet", axis=-1)
    g.output("meet", "batched_weight", "other_reader")
    return g.view()


def test_all_projections_with_and_without_biases(kit) -> None:
    view = projections(kit)
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    mms = {"q_mm", "k_mm", "v_mm"}
    assert kit.groups(view, matches) == [mms, mms | {"q_bias", "k_bias", "v_bias"}]
    assert matches[0].attrs == {"k": 16, "m": 6, "ns": (16, 16, 8), "n_out": 40, "bias": False}
    assert matches[1].attrs["bias"] is True


def test_only_some_biases_is_a_near_miss(kit) -> None:
    view = projections(kit, biases="qk")
    matches, rejects = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"q_mm", "k_mm", "v_mm"}]
    assert rejects[0].reason == "only some of the MatMuls have a bias Add: fused without biases"


def test_collect_keeps_them(kit) -> None:
    view = projections(kit)
    cands, _ = kit.collect(view)
    assert sum(c.family == "qkv" for c in cands) == 2


def test_projections_of_one_input_by_far_apart_layers_are_not_grouped(kit) -> None:
    """Like DETR's decoder layers each projecting the encoder memory: the results meet only much later."""
    g = kit.graph()
    g.input("memory", [1, 6, 16])
    g.op("MatMul", ["memory", g.weight("w0", 16, 16)], "layer0_k")
    g.op("MatMul", ["memory", g.weight("w1", 16, 16)], "layer1_k")
    g.op("Relu", ["layer0_k"], "layer0_attention")
    g.op("MatMul", ["layer0_attention", g.weight("wo", 16, 16)], "layer0_out_proj")
    g.op("Add", ["layer0_out_proj", "layer1_k"], "meet")
    g.output("meet")
    view = g.view()
    matches, rejects = kit.run(RULE, view)
    assert matches == []
    assert rejects[0].reason == (
        "2 MatMuls read 'memory' but their results meet before another weight GEMM only in 2 groups "
        "(e.g. different layers)")
