"""Conv glue: the conv binder and the CPU kernel (plugins/cpu/conv_ref.h through plugins/ort/conv_op.h) on the
shapes real models use (ViT's 16x16 / 16 patch embedding, a ResNet bottleneck with BatchNormalization and a strided
one with DETR's FrozenBatchNorm Mul / Add, depthwise and dilated convs, a 1-D conv), every node of each checked
against onnx's float64 reference evaluator of the same model on seeded inputs, in fp32 and fp16. The device path
too: an emulated build runs every groups == 1 conv on its implicit-GEMM instance (gtco/conv.cuh) against the same
reference, and a depthwise conv keeps its op type on its function, with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from plugin_helpers import Built, build_model

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.models import build
from onnx_gtco.patterns.conv import ConvPattern
from onnx_gtco.plan.candidates import collect, singletons
from onnx_gtco.plan.types import Candidate, Plan
from onnx_gtco.plugin.bind_conv import CONV
from onnx_gtco.plugin.binding import Binding
from onnx_gtco.plugin.library import build_library, library_info
from onnx_gtco.plugin.nodes import fused_nodes
from onnx_gtco.rewrite import rewrite
from onnx_gtco.runtime.check import make_inputs
from onnx_gtco.runtime.session import METADATA_KEY, make_session

CPU = ["CPUExecutionProvider"]
ULP = {TensorProto.FLOAT: 2.0 ** -23, TensorProto.FLOAT16: 2.0 ** -10}


class Net:
    """A float graph under construction: seeded weights, nodes named after their outputs."""

    def __init__(self, elem: int, seed: int = 0) -> None:
        self.elem, self.rng = elem, np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value.astype(helper.tensor_dtype_to_np_dtype(self.elem)), name))
        return name

    def weight(self, name: str, *shape: int, scale: float = 1.0) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        return self.const(name, self.rng.standard_normal(shape) * scale / np.sqrt(fan_in))

    def op(self, op_type: str, inputs: list[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def conv(self, x: str, name: str, c_in: int, c_out: int, k: int, *, bias: bool = False, **attrs: object) -> str:
        group = int(attrs.get("group", 1))  # type: ignore[call-overload]
        w = self.weight(f"{name}_w", c_out, c_in // group, *([k] * (2 if "1d" not in name else 1)))
        ins = [x, w] + ([self.weight(f"{name}_b", c_out)] if bias else [])
        return self.op("Conv", ins, name, **attrs)

    def bn(self, x: str, name: str, c: int) -> str:
        inputs = [self.const(f"{name}_g", self.rng.uniform(0.5, 1.5, c)), self.weight(f"{name}_b", c),
                  self.weight(f"{name}_m", c, scale=0.1), self.const(f"{name}_v", self.rng.uniform(0.5, 2.0, c))]
        return self.op("BatchNormalization", [x, *inputs], name, epsilon=1e-5)

    def frozen_bn(self, x: str, name: str, c: int) -> str:
        mul = self.op("Mul", [x, self.const(f"{name}_s", self.rng.uniform(0.5, 1.5, (1, c, 1, 1)))], f"{name}_mul")
        return self.op("Add", [mul, self.weight(f"{name}_t", 1, c, 1, 1)], f"{name}_add")

    def model(self, inputs: dict[str, list[int]], outputs: list[str]) -> onnx.ModelProto:
        io = [helper.make_tensor_value_info(n, self.elem, s) for n, s in inputs.items()]
        outs = [helper.make_tensor_value_info(n, self.elem, None) for n in outputs]
        graph = helper.make_graph(self.nodes, "convs", io, outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        return onnx.shape_inference.infer_shapes(model)


def conv_sites(elem: int, depthwise: bool = True) -> onnx.ModelProto:
    """The conv groups of ViT, ResNet-50 / DETR and depthwise models, each ending in a graph output (`depthwise`:
    with the depthwise conv, which has no device kernel)."""
    g, r = Net(elem), "Relu"
    patch = g.conv("img", "patch", 3, 8, 16, bias=True, kernel_shape=[16, 16], strides=[16, 16])
    stem = g.op(r, [g.bn(g.conv("img", "stem", 3, 16, 3, strides=[2, 2], pads=[1, 1, 1, 1]), "stem_bn", 16)], "s")
    # bottleneck, stride 1: 1x1 -> 3x3 -> 1x1, each BN (+ ReLU), the identity added before the last ReLU
    a = g.op(r, [g.bn(g.conv(stem, "b1", 16, 8, 1), "b1_bn", 8)], "b1_relu")
    a = g.op(r, [g.bn(g.conv(a, "b2", 8, 8, 3, pads=[1, 1, 1, 1]), "b2_bn", 8)], "b2_relu")
    a = g.op("Add", [g.bn(g.conv(a, "b3", 8, 16, 1), "b3_bn", 16), stem], "b3_res")
    block = g.op(r, [a], "block")
    # strided bottleneck with FrozenBatchNorm (Mul / Add) and a 1x1 stride-2 downsample on the residual path
    down = g.frozen_bn(g.conv(block, "down", 16, 32, 1, strides=[2, 2]), "down_bn", 32)
    d = g.op(r, [g.frozen_bn(g.conv(block, "d2", 16, 32, 3, strides=[2, 2], pads=[1, 1, 1, 1]), "d2_bn", 32)], "d2r")
    strided = g.op(r, [g.op("Add", [g.frozen_bn(g.conv(d, "d3", 32, 32, 1), "d3_bn", 32), down], "d3_res")], "sb")
    # depthwise 3x3 with dilation 2, bias, sigmoid; a 1-D conv with asymmetric pads and a bias Add
    dw = g.op("Sigmoid", [g.conv(block, "dw", 16, 16, 3, bias=True, group=16, dilations=[2, 2],
                                 pads=[2, 2, 2, 2])], "dws")
    one_d = g.op("Add", [g.conv("seq", "c1d", 4, 6, 3, strides=[2], pads=[1, 0]), g.weight("c1d_b", 1, 6, 1)], "c1a")
    if not depthwise:
        g.nodes = [n for n in g.nodes if n.output[0] not in ("dw", "dws")]
    outputs = [patch, strided, dw, one_d] if depthwise else [patch, strided, one_d]
    return g.model({"img": [2, 3, 32, 32], "seq": [2, 4, 11]}, outputs)


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph in float64 (weights widened exactly), for onnx's reference evaluator."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in (*m.graph.input, *m.graph.output):
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    del m.graph.value_info[:]
    return m


def longest_conv_groups(model: onnx.ModelProto) -> tuple[GraphView, Plan]:
    """A plan fusing each Conv with the longest epilogue the conv rule offers that no other group took (the
    optimizer's cost model may prefer an elementwise kernel for the epilogue; this exercises every form the rule
    has), the rest unfused, in an executable order."""
    view = GraphView(load_model(model))
    cands, _ = collect(view, [ConvPattern()], 48)
    taken: set[int] = set()
    groups: list[Candidate] = []
    for c in sorted(cands, key=lambda c: -len(c.nodes)):
        if not c.nodes & taken and not any(min(c.nodes) == min(g.nodes) for g in groups):
            groups.append(c)
            taken |= c.nodes
    groups += singletons(view, taken)
    group_of = {i: k for k, g in enumerate(groups) for i in g.nodes}
    deps = {k: {group_of[view.producer[t]] for i in g.nodes for t in view.nodes[i].inputs if t in view.producer} - {k}
            for k, g in enumerate(groups)}
    order: list[int] = []
    while len(order) < len(groups):
        order += [k for k in range(len(groups)) if k not in order and deps[k] <= set(order)]
    return view, Plan(tuple(groups[k] for k in order), 0.0)


def build_longest(model: onnx.ModelProto, out_dir: Path, emulated: bool = False) -> Built:
    """plugin_helpers.build_model with longest_conv_groups' plan in place of the optimizer's (`emulated`: the
    library's device kernels, run on the CPU EP through the emulation)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    original = out_dir / "original.onnx"
    onnx.save(model, str(original))
    rewritten, _ = rewrite(*longest_conv_groups(model))
    lib = build_library(rewritten, out_dir, cuda=False, emulated=emulated)
    rewritten.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
    onnx.save(rewritten, str(out_dir / "model.gtco.onnx"))
    return Built(original, out_dir / "model.gtco.onnx", lib)


@pytest.fixture(scope="module", params=[TensorProto.FLOAT, TensorProto.FLOAT16], ids=["f32", "f16"])
def sites(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Built, int]:
    return build_longest(conv_sites(request.param), tmp_path_factory.mktemp("conv")), request.param


def test_optimized_conv_sites_are_bound_and_match(tmp_path: Path) -> None:
    """The optimizer's own plan (conv groups and elementwise epilogues as its cost model chose) with the library."""
    built = build_model(conv_sites(TensorProto.FLOAT), tmp_path)
    assert "Conv_f32" in built.lib.op_types and not built.lib.skipped()
    feeds = make_inputs(onnx.load(str(built.original)), 0)
    ref = ort.InferenceSession(str(built.original), providers=CPU).run(None, feeds)
    got = make_session(built.rewritten, CPU, library=True).run(None, feeds)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_every_conv_group_is_bound(sites: tuple[Built, int]) -> None:
    built, elem = sites
    nodes = [n for n in fused_nodes(onnx.load(str(built.rewritten))) if n.family == "conv"]
    assert len(nodes) == 10 and not built.lib.skipped()
    assert built.lib.op_types == ["Conv_" + ("f32" if elem == TensorProto.FLOAT else "f16")]
    # every BatchNormalization, FrozenBatchNorm pair, activation and residual Add is inside a conv node
    original = onnx.load(str(built.original))
    assert not [n for n in onnx.load(str(built.rewritten)).graph.node if n.domain != "ai.gtco"]
    assert len(original.graph.node) > len(nodes)


@pytest.mark.parametrize("seed", [0, 1])
def test_conv_sites_match_a_float64_reference(sites: tuple[Built, int], seed: int) -> None:
    built, elem = sites
    original = onnx.load(str(built.original))
    feeds = make_inputs(original, seed)
    want = ReferenceEvaluator(as_float64(original)).run(None, {k: v.astype(np.float64) for k, v in feeds.items()})
    got = make_session(built.rewritten, CPU, library=True).run(None, feeds)
    for name, g, w in zip([o.name for o in original.graph.output], got, want, strict=True):
        assert g.dtype == helper.tensor_dtype_to_np_dtype(elem) and g.shape == w.shape, name
        # fp32: the accumulation order; fp16: each fused node rounds its output once (four nodes deep at most)
        tol = (64 if elem == TensorProto.FLOAT else 8) * ULP[elem] * max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g.astype(np.float64) - w).max())
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"
        assert float(np.abs(w).max()) > 0.1, name  # the reference is not trivially small


DEVICE_TOL = {TensorProto.FLOAT: 2e-3, TensorProto.FLOAT16: 5e-3}
"""‖err‖ / ‖ref‖ of the emulated device kernels against float64: TF32 operands at fp32, fp16 rounding per node."""


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["tf32", "f16"])
def test_emulated_device_convs_match_a_float64_reference(elem: int, tmp_path: Path) -> None:
    """Without the depthwise conv every conv group has groups == 1: the emulated build gives each its implicit-GEMM
    instance (the patch embedding, the stem with BN, the bottlenecks with BN / FrozenBatchNorm, ReLU and the
    residual, the strided downsample, the 1-D conv) and the outputs meet the float64 reference."""
    built = build_longest(conv_sites(elem, depthwise=False), tmp_path, emulated=True)
    conv_type = "Conv_" + ("f32" if elem == TensorProto.FLOAT else "f16")
    assert built.lib.cuda_op_types == [conv_type] and not built.lib.kernel_skips, built.lib.kernel_skips
    info = library_info(built.lib.path)
    assert len(info["instances"]) == 9 and all(v[0].startswith("conv_sm80_") for v in info["instances"].values())
    original = onnx.load(str(built.original))
    for seed in (0, 1):
        feeds = make_inputs(original, seed)
        want = ReferenceEvaluator(as_float64(original)).run(None, {k: v.astype(np.float64) for k, v in feeds.items()})
        got = make_session(built.rewritten, CPU, library=True).run(None, feeds)
        for name, g, w in zip([o.name for o in original.graph.output], got, want, strict=True):
            assert g.shape == w.shape and np.isfinite(g).all(), name
            assert rel_error(g, w) < DEVICE_TOL[elem], f"{name} seed {seed}: {rel_error(g, w):.3g}"


def test_depthwise_conv_keeps_its_function_with_the_reason(tmp_path: Path) -> None:
    """A depthwise conv has no device instance (groups == 1 only), so its op type registers no device kernel and
    every conv node of the model keeps its function on a CUDA session; the reasons say which node and why."""
    built = build_longest(conv_sites(TensorProto.FLOAT), tmp_path, emulated=True)
    skips = built.lib.kernel_skips
    assert built.lib.cuda_op_types == [] and len(skips) == 10
    assert skips["gtco/conv/dw"].startswith("groups=16: the conv kernel is an implicit GEMM for groups == 1")
    assert all(why.startswith("op type Conv_f32 has no device kernel: node 'gtco/conv/dw' groups=16")
               for node, why in skips.items() if node != "gtco/conv/dw")


def test_fp32_sites_match_onnxruntime(sites: tuple[Built, int]) -> None:
    built, elem = sites
    if elem != TensorProto.FLOAT:
        pytest.skip("onnxruntime's CPU EP has no float16 Conv to compare with; the float64 test covers fp16")
    feeds = make_inputs(onnx.load(str(built.original)), 3)
    ref = ort.InferenceSession(str(built.original), providers=CPU).run(None, feeds)
    got = make_session(built.rewritten, CPU, library=True).run(None, feeds)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_binder_maps_roles_onto_the_cpp_enum(sites: tuple[Built, int]) -> None:
    built, _ = sites
    nodes = {n.node.name: n for n in fused_nodes(onnx.load(str(built.rewritten))) if n.family == "conv"}
    for node in nodes.values():
        b = CONV.bind(node)
        assert isinstance(b, Binding), b
        names = [node.node.input[i] if i >= 0 else None for i in b.inputs]
        conv = next(n for n in node.function.node if n.op_type == "Conv")
        fn_in = dict(zip(node.function.input, node.node.input, strict=True))
        assert names[:2] == [fn_in[conv.input[0]], fn_in[conv.input[1]]]
        assert (names[2] is not None) == (len(conv.input) > 2 or node.op["bias"])
        assert (names[5] is not None) == (names[6] is not None) == node.op["batchnorm"]
    assert sum(n.op["batchnorm"] for n in nodes.values()) == 4
    assert sum(n.op["scale"] and not n.op["batchnorm"] for n in nodes.values()) == 3
    assert sum(n.op["residual"] for n in nodes.values()) == 2


def test_bad_operands_are_errors_naming_the_node(sites: tuple[Built, int]) -> None:
    built, elem = sites
    if elem != TensorProto.FLOAT:
        pytest.skip("one dtype suffices for the operand checks")
    model = onnx.load(str(built.rewritten))
    node = next(n for n in model.graph.node if n.op_type == "Conv_f32" and "groups" in [a.name for a in n.attribute])
    next(a for a in node.attribute if a.name == "groups").i = 3  # 16 channels do not split into 3 groups
    path = built.rewritten.with_name("bad.onnx")  # beside its library
    onnx.save(model, str(path))
    with pytest.raises(Exception, match=rf"Conv_f32 node '{node.name}'.*3 groups do not split x's channels"):
        make_session(path, CPU, library=True).run(None, make_inputs(onnx.load(str(built.original)), 0))


@pytest.mark.parametrize(("attrs", "x_shape", "why"), [
    ({"auto_pad": "SAME_UPPER"}, [1, 4, 8, 8], "pads by auto_pad=SAME_UPPER; the kernel takes explicit pads"),
    ({}, [1, 4, 4, 4, 4], "a 3-D convolution; the kernel takes 1-D and 2-D ones"),
])
def test_binder_refuses_what_the_kernel_does_not_compute(attrs: dict[str, object], x_shape: list[int],
                                                         why: str) -> None:
    g = Net(TensorProto.FLOAT)
    y = g.op("Relu", [g.op("Conv", ["x", g.weight("w", 4, 4, *[3] * (len(x_shape) - 2))], "conv", **attrs)], "y")
    model, _ = rewrite(*longest_conv_groups(g.model({"x": x_shape}, [y])))
    (node,) = fused_nodes(model)
    got = CONV.bind(node)
    assert isinstance(got, str) and got.endswith(why) and "Conv_f32 node 'gtco/conv/conv'" in got


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_converted_vit_patch_embedding_runs_the_half_conv(precision: str, tmp_path: Path) -> None:
    """An fp32 ViT optimized at fp16 / bf16: its patch-embedding conv node reads and writes half tensors (its
    function casts around an fp32 Conv); the library's half conv kernel serves it, with the whole model within
    the conversion's tolerance of the fp32 original, as close to it as the model-local functions are."""
    original = build("vit-tiny", depth=1, image=64, seed=0)
    result = optimize(original, GtcoConfig(precision=precision))
    path = tmp_path / "model.gtco.onnx"
    onnx.save(result.model, str(path))
    lib = build_library(result.model, tmp_path, cuda=False, planned=result.planned())
    conv_type = "Conv_" + {"fp16": "f16", "bf16": "bf16"}[precision]
    assert conv_type in lib.op_types and not lib.skipped()
    feeds = make_inputs(original, 0)
    want = ort.InferenceSession(original.SerializeToString(), providers=CPU).run(None, feeds)[0]
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib.path))
    got = ort.InferenceSession(str(path), so, providers=CPU).run(None, feeds)[0]
    functions = ort.InferenceSession(str(path), providers=CPU).run(None, feeds)[0]
    tol = {"fp16": 5e-3, "bf16": 2e-2}[precision]
    assert rel_error(got, want) < tol and rel_error(got, want) < 2 * rel_error(functions, want) + tol / 10
