"""Invariants of the analytical cost model."""

from __future__ import annotations

import math

import onnx
import pytest
from onnx import TensorProto, helper

from onnx_gtco.calibration import LaunchConstants, hardware
from onnx_gtco.config import GtcoConfig
from onnx_gtco.cost.model import Estimate, OrtConstants, VendorGemmConstants, cost_fn, estimate, node_flops
from onnx_gtco.ir.labels import Label, label
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.plan.types import Candidate


def _single(i: int) -> Candidate:
    return Candidate(frozenset([i]), "unfused", "single")


def test_matmul_flops(mlp: onnx.ModelProto) -> None:
    view = GraphView(load_model(mlp))
    assert node_flops(view, view.nodes[0]) == (2.0 * 4 * 8 * 8, 0.0)
    assert node_flops(view, view.nodes[1]) == (0.0, 32.0)


def test_symbolic_dims_count_as_one(make_mlp) -> None:
    """A dynamic batch must not zero the FLOPs (the report's fused share would read 0%)."""
    view = GraphView(load_model(make_mlp(rows="batch")))
    assert node_flops(view, view.nodes[0]) == (2.0 * 1 * 8 * 8, 0.0)
    assert estimate(view, _single(0)).dram_bytes == 4 * (8 + 64 + 8)


def test_fusing_never_adds_dram_bytes_or_launches(mlp: onnx.ModelProto) -> None:
    view = GraphView(load_model(mlp))
    for ids in ([0, 1], [0, 1, 2], [3, 4], [0, 1, 2, 3, 4]):
        fused = estimate(view, Candidate(frozenset(ids), "gemm", "t"))
        parts = [estimate(view, _single(i)) for i in ids]
        assert fused.dram_bytes < sum(p.dram_bytes for p in parts)
        assert fused.launches == 1 < sum(p.launches for p in parts)
        assert fused.mm_flops == sum(p.mm_flops for p in parts)


def test_ort_matmuls_are_priced_as_the_vendor_gemm_at_the_precision_s_peak() -> None:
    hw = hardware("h200")
    c, launch = hw.constants(VendorGemmConstants), hw.constants(LaunchConstants)
    heavy = Estimate(mm_flops=1e12, other_flops=0, dram_bytes=1e6, launches=1)
    t32, t16 = heavy.ort_us(hw, "fp32"), heavy.ort_us(hw, "fp16")
    assert t32 == pytest.approx(1e12 / (hw.target.tf32_tflops * 1e6 * c.mma_frac) + launch.floor_us + c.extra_us)
    assert t16 < t32
    # elementwise work never gets Tensor Core throughput
    ew = Estimate(mm_flops=0, other_flops=1e12, dram_bytes=0, launches=1)
    assert ew.ort_us(hw, "fp16") == pytest.approx(1e12 / (hw.target.cuda_tflops * 1e6) + launch.floor_us
                                                  + hw.constants(OrtConstants).extra_us)
    assert Estimate(launches=0).ort_us(hw) == 0.0


def test_memory_bound_group_is_priced_by_the_fitted_bandwidth() -> None:
    hw = hardware("a100")  # no calibration: the defaults over the data sheet
    c = hw.constants(OrtConstants)
    e = Estimate(mm_flops=0, other_flops=1e3, dram_bytes=2.039e9, launches=1)
    assert e.ort_us(hw, "fp32") == pytest.approx(1e3 / c.bw_frac + hw.constants(LaunchConstants).floor_us
                                                 + c.extra_us)  # 2.039 GB at 2039 GB/s = 1 ms at full rate


def test_a_fused_group_costs_its_kernel_estimate_and_the_graph_gap_per_launch(mlp: onnx.ModelProto) -> None:
    view = GraphView(load_model(mlp))
    config = GtcoConfig(target="h200")
    gap = hardware("h200").constants(LaunchConstants).graph_gap_us
    fused = Candidate(frozenset([0, 1]), "gemm", "t")
    cost = cost_fn(view, config, lambda c: 7.0 if c.nodes == fused.nodes else None)
    assert cost(fused) == pytest.approx(7.0 + gap)
    # a fused group with no device kernel costs its nodes unfused (a hair less: the tie-break)
    other = Candidate(frozenset([3, 4]), "gemm", "t")
    assert cost(other) == pytest.approx(cost(_single(3)) + cost(_single(4)), rel=1e-6)
    assert cost(other) < cost(_single(3)) + cost(_single(4))


def test_einsum_that_is_a_matmul_counts_matmul_flops() -> None:
    """tf2onnx's Einsum("bhqd,bhkd->bhqk") is Q Kᵀ on Tensor Cores (2 x out x D); another equation stays a CUDA-core
    op of one FLOP per output element."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 8, 4]) for n in "qk"]
    g = helper.make_graph([
        helper.make_node("Einsum", ["q", "k"], ["s"], name="qk", equation="bhqd,bhkd->bhqk"),
        helper.make_node("Einsum", ["q", "k"], ["t"], name="other", equation="bhqd,bhkd->bhqdk"),
    ], "g", ins, [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 2, 8, 8]),
                  helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 2, 8, 4, 8])])
    view = GraphView(load_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])))
    assert node_flops(view, view.nodes[0]) == (2.0 * (2 * 8 * 8) * 4, 0.0)
    assert node_flops(view, view.nodes[1]) == (0.0, 2.0 * 8 * 4 * 8)


def test_reshape_and_shape_arithmetic_are_free() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])  # symbolic: Shape is not folded
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    g = helper.make_graph([
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Reshape", ["x", "t"], ["y"], name="reshape"),
    ], "g", [x], [y, helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor("t", TensorProto.INT64, [2], [3, 4])])
    view = GraphView(load_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])))
    cost = cost_fn(view, GtcoConfig())
    assert [cost(_single(i)) for i in range(len(view))] == [0.0, 0.0]


def test_a_fused_copy_does_not_read_its_shape_operand() -> None:
    """Reshape + Transpose fused (an elementwise copy) costs what the Transpose costs alone: the Reshape's target is
    compiled into the kernel, so the group's DRAM bytes are its data in and out, not the int64 shape too."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2048])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 32])
    g = helper.make_graph([
        helper.make_node("Reshape", ["x", "s"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("Relu", ["t"], ["y"], name="relu"),
    ], "g", [x], [y], [helper.make_tensor("s", TensorProto.INT64, [3], [1, 32, 64])])
    view = GraphView(load_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])))
    assert [n.op_type for n in view.nodes] == ["Reshape", "Transpose", "Relu"]
    copy = estimate(view, Candidate(frozenset([0, 1]), "elementwise", "elementwise"))
    assert copy.dram_bytes == estimate(view, _single(1)).dram_bytes == 2 * 4 * 32 * 64
    assert estimate(view, _single(0)) == Estimate()


def test_oversized_group_is_forbidden(mlp: onnx.ModelProto) -> None:
    view = GraphView(load_model(mlp))
    cost = cost_fn(view, GtcoConfig(max_group_size=2))
    assert cost(Candidate(frozenset([0, 1, 2]), "gemm", "t")) == math.inf
    assert cost(Candidate(frozenset([0, 1]), "gemm", "t")) < math.inf


@pytest.mark.parametrize(
    ("op", "expected"),
    [("MatMul", Label.COMPLEX), ("Gemm", Label.COMPLEX), ("Add", Label.ELEMENTWISE), ("Erf", Label.ELEMENTWISE),
     ("Transpose", Label.INJECTIVE), ("Reshape", Label.INJECTIVE), ("ReduceMean", Label.REDUCTION),
     ("Softmax", Label.OPAQUE), ("NonMaxSuppression", Label.OPAQUE), ("TotallyUnknownOp", Label.OPAQUE)],
)
def test_labels(op: str, expected: Label) -> None:
    assert label(op) is expected


def test_custom_domain_ops_are_opaque() -> None:
    assert label("MatMul", "com.example") is Label.OPAQUE
