"""Conv glue: the conv binder and the CPU kernel (plugins/families/conv/conv_ref.h through
plugins/families/conv/conv_op.h) on the shapes real models use (ViT's 16x16 / 16 patch embedding, a ResNet bottleneck
with BatchNormalization and a strided one with DETR's FrozenBatchNorm Mul / Add, depthwise and dilated convs, a 1-D
conv), every node of each checked against onnx's float64 reference evaluator of the same model on seeded inputs, in
fp32 and fp16. The device path too: an emulated build runs every conv on its instance (conv/conv.cuh: the implicit GEMM
for groups == 1, the direct kernel for the depthwise conv) against the same reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from pins import CONV_KERNELS
from plugin_helpers import Built, build_model

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.conv.bind import CONV
from onnx_gtco.families.conv.rule import ConvPattern
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.models import build
from onnx_gtco.plan.candidates import collect, singletons
from onnx_gtco.plan.types import Candidate, Plan
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


def conv_sites(elem: int) -> onnx.ModelProto:
    """The conv groups of ViT, ResNet-50 / DETR and depthwise models, each ending in a graph output."""
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
    return g.model({"img": [2, 3, 32, 32], "seq": [2, 4, 11]}, [patch, strided, dw, one_d])


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
    """The emulated build gives every conv group an instance, so the op type has its device kernel: the implicit
    GEMM for the nine groups == 1 convs (the patch embedding, the stem with BN, the bottlenecks with BN /
    FrozenBatchNorm, ReLU and the residual, the strided downsample, the 1-D conv), the direct kernel for the dilated
    depthwise conv with its bias and sigmoid; the outputs meet the float64 reference."""
    built = build_longest(conv_sites(elem), tmp_path, emulated=True)
    dt = "f32" if elem == TensorProto.FLOAT else "f16"
    assert built.lib.cuda_op_types == ["Conv_" + dt] and not built.lib.kernel_skips, built.lib.kernel_skips
    info = library_info(built.lib.path)
    names = [v[0] for v in info["instances"].values()]
    assert len(names) == 10 and all(n.startswith("conv_sm80_") for n in names), names
    assert [n for n in names if "_direct_" in n] == [f"conv_sm80_{dt}_direct_t256_bias_sigmoid"], names
    original = onnx.load(str(built.original))
    for seed in (0, 1):
        feeds = make_inputs(original, seed)
        want = ReferenceEvaluator(as_float64(original)).run(None, {k: v.astype(np.float64) for k, v in feeds.items()})
        got = make_session(built.rewritten, CPU, library=True).run(None, feeds)
        for name, g, w in zip([o.name for o in original.graph.output], got, want, strict=True):
            assert g.shape == w.shape and np.isfinite(g).all(), name
            assert rel_error(g, w) < DEVICE_TOL[elem], f"{name} seed {seed}: {rel_error(g, w):.3g}"


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


def one_conv_node(x_shape: list[int], **attrs: object) -> onnx.ModelProto:
    """x -> Conv(4 -> 4, 3 wide per spatial axis of x) -> Relu, rewritten into one conv node."""
    g = Net(TensorProto.FLOAT)
    y = g.op("Relu", [g.op("Conv", ["x", g.weight("w", 4, 4, *[3] * (len(x_shape) - 2))], "conv", **attrs)], "y")
    model, _ = rewrite(*longest_conv_groups(g.model({"x": x_shape}, [y])))
    return model


def test_binder_refuses_a_3d_conv() -> None:
    (node,) = fused_nodes(one_conv_node([1, 4, 4, 4, 4]))
    got = CONV.bind(node)
    assert isinstance(got, str) and "Conv_f32 node 'gtco/conv/conv'" in got
    assert got.endswith("a 3-D convolution; the kernel takes 1-D and 2-D ones")


def test_binder_refuses_a_same_conv_whose_node_lost_its_auto_pad() -> None:
    """A node without the auto_pad attribute (rewritten before the rule carried it) would pad as NOTSET, zero pads:
    the binder compares it with its function's Conv and refuses rather than let the kernel compute another conv."""
    model = one_conv_node([1, 4, 8, 8], auto_pad="SAME_LOWER", strides=[2, 2])
    (node,) = model.graph.node
    assert isinstance(CONV.bind(fused_nodes(model)[0]), Binding)
    del node.attribute[[a.name for a in node.attribute].index("auto_pad")]
    got = CONV.bind(fused_nodes(model)[0])
    assert isinstance(got, str) and "pads by auto_pad=SAME_LOWER but the node's auto_pad attribute says NOTSET" in got


@pytest.mark.parametrize(("x_shape", "attrs", "pads"), [
    ([1, 4, 16, 16], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (0, 0, 1, 1)),  # total 1, odd unit at the end
    ([1, 4, 16, 16], {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, (1, 1, 0, 0)),  # ... at the beginning
    ([1, 4, 16, 15], {"auto_pad": "SAME_UPPER", "strides": [2, 2], "dilations": [2, 2]}, (1, 2, 2, 2)),
    ([1, 4, 8, 8], {"auto_pad": "VALID"}, (0, 0, 0, 0)),
    ([1, 4, 9], {"auto_pad": "SAME_LOWER", "strides": [2]}, (0, 1, 0, 1)),  # 1-D: runs as H = KH = 1
])
def test_device_problem_pads_as_onnx_auto_pad_says(x_shape: list[int], attrs: dict[str, object],
                                                   pads: tuple[int, ...]) -> None:
    """The device Problem (the tile's choice, the tuner's task) has the pads ORT pads by: (top, left, bottom,
    right), total = (ceil(in / s) - 1) * s + (k - 1) * d + 1 - in."""
    (node,) = fused_nodes(one_conv_node(x_shape, **attrs))
    problem = CONV.problem(node)
    assert not isinstance(problem, str), problem
    assert tuple(problem.size(k) for k in ("PT", "PL", "PB", "PR")) == pads


def same_sites(elem: int, spatial: tuple[int | str, int | str], length: int | str) -> onnx.ModelProto:
    """TF-exported convs, padded by auto_pad, with odd total pads beside an explicit-pad conv: SAME_UPPER 3x3 / 2 and
    SAME_LOWER 4x4 / 1 on img, then a dilated SAME_UPPER 3x3 / 2 (bias, ReLU) and a depthwise SAME_LOWER 3x3 / 2
    (the direct kernel), a VALID 3x3, a 3x3 with pads 1 and a 1-D SAME_UPPER 4 / 2 conv on seq. On img 16x16 the
    first pads (0, 0, 1, 1), the second (2, 2, 1, 1), the dilated one (1, 1, 2, 2), the depthwise one (1, 1, 0, 0);
    seq 11: (1, 2)."""
    g = Net(elem, seed=3)
    up = g.conv("img", "up", 3, 8, 3, strides=[2, 2], auto_pad="SAME_UPPER")
    low = g.conv("img", "low", 3, 8, 4, auto_pad="SAME_LOWER")
    dil = g.op("Relu", [g.conv(up, "dil", 8, 8, 3, bias=True, strides=[2, 2], dilations=[2, 2],
                               auto_pad="SAME_UPPER")], "dil_relu")
    dw = g.conv(low, "dw", 8, 8, 3, group=8, strides=[2, 2], auto_pad="SAME_LOWER")
    valid = g.conv("img", "valid", 3, 4, 3, auto_pad="VALID")
    plain = g.op("Relu", [g.conv("img", "plain", 3, 4, 3, pads=[1, 1, 1, 1])], "plain_relu")
    one_d = g.conv("seq", "s1d", 4, 6, 4, strides=[2], auto_pad="SAME_UPPER")
    return g.model({"img": [2, 3, *spatial], "seq": [2, 4, length]}, [dil, dw, valid, plain, one_d])


SAME_MODELS = {"static": ((16, 16), 11), "symbolic": (("H", "W"), "L")}
SAME_RUNS = {"static": [{}], "symbolic": [{"H": 16, "W": 16, "L": 11}, {"H": 15, "W": 13, "L": 8}]}
"""The spatial sizes each model runs at: a symbolic one at the static sizes and at odd ones, where the pads differ
(15 / 2 pads 2 in all with a 3x3 kernel, 16 / 2 pads 1), which only a run-time computation gets right."""


@pytest.mark.parametrize("emulated", [False, True], ids=["cpu", "emulated"])
@pytest.mark.parametrize("dims", list(SAME_MODELS))
def test_same_convs_get_the_kernels_and_match_onnxruntime(dims: str, emulated: bool, tmp_path: Path) -> None:
    """One SAME conv used to send every conv of the model back to its function (registration is per op type):
    now every conv node binds, the op type has its device kernel beside the explicit-pad conv (`emulated`: the
    implicit GEMM, the direct kernel for the depthwise one, run through the emulation), and the outputs meet ORT
    running the original model, at each run's spatial sizes."""
    built = build_longest(same_sites(TensorProto.FLOAT, *SAME_MODELS[dims]), tmp_path, emulated=emulated)
    assert built.lib.op_types == ["Conv_f32"] and not built.lib.skipped(), built.lib.skipped()
    assert len([n for n in fused_nodes(onnx.load(str(built.rewritten))) if n.family == "conv"]) == 7
    if emulated:
        assert built.lib.cuda_op_types == ["Conv_f32"] and not built.lib.kernel_skips, built.lib.kernel_skips
        names = [v[0] for v in library_info(built.lib.path)["instances"].values()]
        assert len(names) == 7 and len([n for n in names if "_direct_" in n]) == 1, names
    original = onnx.load(str(built.original))
    names = [o.name for o in original.graph.output]
    undilated = without_dilated_same(original)
    for run in SAME_RUNS[dims]:
        for seed in (0, 1):
            feeds = make_inputs(original, seed, run)
            got = dict(zip(names, make_session(built.rewritten, CPU, library=True).run(None, feeds), strict=True))
            f64 = ReferenceEvaluator(as_float64(original)).run(None, {k: v.astype(np.float64)
                                                                      for k, v in feeds.items()})
            sess = ort.InferenceSession(undilated.SerializeToString(), providers=CPU)
            ref = dict(zip([o.name for o in undilated.graph.output], sess.run(None, feeds), strict=True))
            for name, want in [*zip(names, f64, strict=True), *ref.items()]:
                g, where = got[name], f"{name} at {run or 'its sizes'}, seed {seed}"
                assert g.shape == want.shape and float(np.abs(want).max()) > 0.1, where
                if emulated:  # TF32 operands
                    assert rel_error(g, want) < DEVICE_TOL[TensorProto.FLOAT], where
                else:
                    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5, err_msg=where)
            assert len(ref) == len(names) - 1


def without_dilated_same(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` less its dilated SAME conv and that conv's output: ORT's Conv refuses a dilation with auto_pad SAME_*
    ("Dilation not supported"), which ONNX defines and onnx's reference evaluator computes; it checks that one."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [n for n in m.graph.node if not n.output[0].startswith("dil")]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    outs = [o for o in m.graph.output if not o.name.startswith("dil")]
    del m.graph.output[:]
    m.graph.output.extend(outs)
    return m


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_converted_vit_patch_embedding_runs_the_half_conv(precision: str, tmp_path: Path, calibrated) -> None:
    """An fp32 ViT optimized at fp16 / bf16: its patch-embedding conv node reads and writes half tensors (its
    function casts around an fp32 Conv); the library's half conv kernel serves it, with the whole model within
    the conversion's tolerance of the fp32 original, as close to it as the model-local functions are."""
    original = build("vit-tiny", depth=1, image=64, seed=0)
    calibrated("sm_90", **CONV_KERNELS)  # on our conv kernel
    result = optimize(original, GtcoConfig(precision=precision, patchify=False))  # the conv, not its GEMM form
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
