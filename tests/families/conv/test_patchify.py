"""Patch-embedding convs rewritten as a patchify copy and a GEMM before planning (families/conv/patchify.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, external_data_helper, helper, numpy_helper
from pins import CONV_KERNELS

from onnx_gtco.config import GtcoConfig
from onnx_gtco.families.conv.patchify import PatchConv, patchify_convs
from onnx_gtco.ir import load as load_mod
from onnx_gtco.ir.export import save_atomic
from onnx_gtco.ir.load import infer_shapes, load_model
from onnx_gtco.models import build
from onnx_gtco.pipeline import Planned, plan_model

RTOL = ATOL = 1e-5
"""fp32: the GEMM sums a patch's C·KH·KW products in another order than the conv does (K <= 1024 here, values of
order 1); the rewrite itself moves no value."""


def _run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(model: onnx.ModelProto, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = rng.standard_normal(shape).astype(dtype)
    return out


def _assert_same_outputs(a: onnx.ModelProto, b: onnx.ModelProto | Path, rtol: float = RTOL, atol: float = ATOL,
                         feeds: dict[str, np.ndarray] | None = None) -> None:
    feeds = feeds or _feeds(a)
    assert all(np.abs(v).max() > 0.5 for v in feeds.values())  # not zeros: every product counts
    for x, y in zip(_run(a, feeds), _run(b, feeds), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(y, x, rtol=rtol, atol=atol)


def _assert_well_formed(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    """Checked and strictly inferable (so topologically sorted, and its value_info agrees with onnx's inference),
    the outputs as they were, every tensor a node makes typed with a static shape, new names unique, and every
    initializer read."""
    onnx.checker.check_model(after, full_check=True)
    assert list(after.graph.output) == list(before.graph.output)
    assert list(after.graph.input) == list(before.graph.input)
    made = [o for n in after.graph.node for o in n.output]
    assert len(made) == len(set(made))
    assert len({n.name for n in after.graph.node}) == len(after.graph.node)
    inits = [t.name for t in after.graph.initializer]
    assert len(inits) == len(set(inits)) and not set(inits) & set(made)
    read = {t for n in after.graph.node for t in n.input}
    assert [t for t in inits if t not in read] == []  # no orphan (the old weight where nothing else reads it)
    outputs = {o.name for o in after.graph.output}
    infos = {v.name: v for v in after.graph.value_info}
    assert sorted(infos) == sorted(t for t in made if t not in outputs)  # nothing left to infer, nothing stale
    inferred = {v.name: v.type for v in infer_shapes(after, "patched", strict=True).graph.value_info}
    for name, info in infos.items():
        assert info.type == inferred[name], name
        assert all(d.HasField("dim_value") for d in info.type.tensor_type.shape.dim), name


def _conv_model(kit, n: int, c: int, h: int, w: int, oc: int, kernel: tuple[int, ...], *, bias: bool = True,
                reader: str = "", dtype: int = TensorProto.FLOAT, weight_input: bool = False,
                **attrs: object) -> onnx.ModelProto:
    """x -> Conv (stride = kernel unless attrs say) -> y, loaded; `reader` "relu": y -> Relu -> out; "tokens": the
    ViT's y -> Reshape [N, OC, OH·OW] -> Transpose (0, 2, 1) -> Add pos -> out."""
    g = kit.graph()
    spatial = [h, w][: len(kernel)] if len(kernel) <= 2 else [h] * len(kernel)
    g.input("x", [n, c, *spatial], dtype)
    if weight_input:
        g.input("w", [oc, c // int(attrs.get("group", 1)), *kernel], dtype)
    else:
        g.const("w", (g.rng.standard_normal((oc, c // int(attrs.get("group", 1)), *kernel)) * 0.1).astype(
            helper.tensor_dtype_to_np_dtype(dtype)))
    inputs = ["x", "w"]
    if bias:
        inputs.append(g.const("b", g.rng.standard_normal(oc).astype(helper.tensor_dtype_to_np_dtype(dtype))))
    attrs = {"kernel_shape": list(kernel), "strides": list(kernel), **attrs}
    g.op("Conv", inputs, "conv", **attrs)
    if reader == "relu":
        g.op("Relu", ["conv"], "relu")
        g.output("relu")
    elif reader == "tokens":
        oh, ow = h // kernel[0], w // kernel[1]
        g.op("Reshape", ["conv", g.const("flat", np.array([n, oc, oh * ow], np.int64))], "flatten")  # flatten(2)
        g.op("Transpose", ["flatten"], "tokens", perm=[0, 2, 1])
        g.op("Add", ["tokens", g.weight("pos", 1, oh * ow, oc)], "pos_add")
        g.output("pos_add")
    else:
        g.output("conv")
    return load_model(g.model())


QUALIFYING = [  # n, c, h, w, oc, kernel, bias, attrs
    pytest.param(1, 3, 224, 224, 32, (16, 16), True, {}, id="vit-patch-b1"),
    pytest.param(3, 3, 230, 230, 24, (16, 16), False, {}, id="ragged-b3-nobias"),
    pytest.param(1, 5, 230, 224, 16, (16, 16), True, {"pads": [0, 0, 0, 0]}, id="ragged-h-only"),
    pytest.param(3, 8, 12, 10, 24, (4, 2), True, {"dilations": [1, 1], "group": 1}, id="kernel-4x2-b3"),
    pytest.param(1, 4, 13, 9, 7, (4, 2), False, {"auto_pad": "VALID"}, id="kernel-4x2-ragged-valid"),
    pytest.param(3, 16, 8, 8, 12, (1, 1), True, {}, id="pointwise-1x1"),
]


@pytest.mark.parametrize(("n", "c", "h", "w", "oc", "kernel", "bias", "attrs"), QUALIFYING)
@pytest.mark.parametrize("reader", ["", "relu", "tokens"])
def test_a_qualifying_conv_becomes_patchify_and_gemm_and_computes_the_same(
        kit, n: int, c: int, h: int, w: int, oc: int, kernel: tuple[int, int], bias: bool, attrs: dict,
        reader: str) -> None:
    model = _conv_model(kit, n, c, h, w, oc, kernel, bias=bias, reader=reader, **attrs)
    before = model.SerializeToString()
    out, convs = patchify_convs(model)
    assert model.SerializeToString() == before  # the input is not modified
    oh, ow = h // kernel[0], w // kernel[1]
    assert convs == [PatchConv("conv", n, c, h, w, oc, *kernel, TensorProto.FLOAT, bias, nchw_copy=reader != "tokens")]
    pc = convs[0]
    assert (pc.oh, pc.ow, pc.sliced) == (oh, ow, bool(h % kernel[0] or w % kernel[1]))
    assert (pc.gemm_m, pc.gemm_n, pc.gemm_k) == (n * oh * ow, oc, c * kernel[0] * kernel[1])
    assert pc.patchify_elems == n * oh * ow * c * kernel[0] * kernel[1]
    assert pc.nchw_elems == (0 if reader == "tokens" else n * oc * oh * ow)
    ops = [nd.op_type for nd in out.graph.node]
    gemm = ["MatMul", "Add"] if bias else ["MatMul"]
    patchify = ["Slice"] * pc.sliced + ["Reshape", "Transpose", "Reshape"]
    nchw = ["Reshape", "Transpose"]
    tail = {"": nchw, "relu": [*nchw, "Relu"], "tokens": ["Add"]}[reader]  # the tokens chain collapsed
    assert ops == patchify + gemm + tail
    weights = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert "w" not in weights  # the conv's weight, read by nothing else, is gone
    w_orig = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    np.testing.assert_array_equal(weights["conv.patchify.weight"], w_orig.reshape(oc, -1).T)
    producer = {o: nd for nd in out.graph.node for o in nd.output}
    if reader != "tokens":
        assert producer["conv"].op_type == "Transpose"  # the conv's output keeps its name for its readers
    else:
        assert "conv" not in producer and producer["pos_add"].input[0] == ("conv.patchify.add" if bias
                                                                            else "conv.patchify.matmul")
    _assert_well_formed(model, out)
    _assert_same_outputs(model, out)


def test_float16_conv_is_rewritten_too(kit) -> None:
    model = _conv_model(kit, 2, 3, 34, 32, 16, (8, 8), dtype=TensorProto.FLOAT16, reader="relu")
    out, convs = patchify_convs(model)
    assert [c.dtype for c in convs] == [TensorProto.FLOAT16]
    _assert_well_formed(model, out)
    # fp16 outputs of order 1: a few units in the last place (2^-10) apart where the sums round differently
    _assert_same_outputs(model, out, rtol=4e-3, atol=4e-3)


LEFT_ALONE = [  # n, c, h, w, oc, kernel, attrs, weight_input
    pytest.param(1, 3, 32, 32, 8, (4, 4), {"pads": [1, 1, 1, 1]}, False, id="padding"),
    pytest.param(1, 3, 32, 32, 8, (4, 4), {"auto_pad": "SAME_UPPER"}, False, id="auto-pad-same"),
    pytest.param(1, 3, 32, 32, 8, (3, 3), {"strides": [2, 2]}, False, id="stride-not-kernel"),
    pytest.param(1, 3, 32, 32, 8, (4, 4), {"strides": [4, 2]}, False, id="stride-one-axis-off"),
    pytest.param(1, 3, 32, 32, 8, (2, 2), {"dilations": [2, 2]}, False, id="dilation"),
    pytest.param(1, 4, 32, 32, 8, (4, 4), {"group": 2}, False, id="groups"),
    pytest.param(1, 3, 32, 32, 8, (4, 4), {}, True, id="weight-is-an-input"),
    pytest.param(1, 4, 32, 0, 8, (4,), {}, False, id="conv-1d"),
    pytest.param(1, 2, 8, 0, 4, (2, 2, 2), {}, False, id="conv-3d"),
]


@pytest.mark.parametrize(("n", "c", "h", "w", "oc", "kernel", "attrs", "weight_input"), LEFT_ALONE)
def test_convs_that_do_not_qualify_are_left_alone(kit, n: int, c: int, h: int, w: int, oc: int,
                                                  kernel: tuple[int, ...], attrs: dict, weight_input: bool) -> None:
    model = _conv_model(kit, n, c, h, w, oc, kernel, reader="relu", weight_input=weight_input, **attrs)
    assert [nd.op_type for nd in model.graph.node] == ["Conv", "Relu"]
    seen: list[PatchConv] = []
    out, convs = patchify_convs(model, decide=lambda pc: seen.append(pc) or True)
    assert out is model and convs == [] and seen == []


@pytest.mark.parametrize(("name", "shape"), [("w", [8, 3, 4, 4]), ("b", [8])])
def test_a_weight_or_bias_an_input_can_override_is_not_constant(kit, name: str, shape: list[int]) -> None:
    model = _conv_model(kit, 1, 3, 32, 32, 8, (4, 4))
    assert len(patchify_convs(model)[1]) == 1
    model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
    assert patchify_convs(model) == (model, [])


def test_a_symbolic_batch_is_left_alone(kit) -> None:
    g = kit.graph()
    g.input("x", ["N", 3, 32, 32])
    g.op("Conv", ["x", g.weight("w", 8, 3, 4, 4)], "conv", kernel_shape=[4, 4], strides=[4, 4])
    g.output("conv")
    model = load_model(g.model())
    assert patchify_convs(model) == (model, [])


def _two_convs(kit) -> onnx.ModelProto:
    """Two patch convs of one input, their outputs added."""
    g = kit.graph()
    g.input("x", [2, 3, 32, 32])
    for name in ("a", "b"):
        g.op("Conv", ["x", g.weight(f"{name}.w", 8, 3, 8, 8), g.weight(f"{name}.b", 8)], name,
             kernel_shape=[8, 8], strides=[8, 8])
    g.op("Add", ["a", "b"], "sum")
    g.output("sum")
    return load_model(g.model())


def test_decide_says_which_convs_are_rewritten(kit) -> None:
    model = _two_convs(kit)
    before = model.SerializeToString()
    asked: list[str] = []

    def never(pc: PatchConv) -> bool:
        asked.append(pc.name)
        return False

    out, convs = patchify_convs(model, decide=never)
    assert out is model and convs == [] and asked == ["a", "b"]
    assert model.SerializeToString() == before

    out, convs = patchify_convs(model, decide=lambda pc: pc.name == "b")
    assert [c.name for c in convs] == ["b"]
    assert [nd.op_type for nd in out.graph.node].count("Conv") == 1
    assert next(nd for nd in out.graph.node if nd.op_type == "Conv").name == "a"
    assert {t.name for t in out.graph.initializer} >= {"a.w", "a.b", "b.b", "b.patchify.weight"} \
        and "b.w" not in {t.name for t in out.graph.initializer}
    _assert_well_formed(model, out)
    _assert_same_outputs(model, out)


def test_a_weight_other_nodes_read_stays_and_new_names_shun_taken_ones(kit) -> None:
    g = kit.graph()
    g.input("x", [1, 3, 16, 16])
    w = g.weight("w", 4, 3, 4, 4)
    g.op("Conv", ["x", w], "conv", kernel_shape=[4, 4], strides=[4, 4])
    g.op("Relu", ["conv"], "conv.patchify.matmul")  # the name the GEMM's output would take
    g.op("Conv", ["x", w], "padded", kernel_shape=[4, 4], strides=[4, 4], pads=[1, 1, 1, 1])  # another reader
    g.output("conv.patchify.matmul", "padded")
    model = load_model(g.model())
    out, convs = patchify_convs(model)
    assert len(convs) == 1
    matmul = next(nd for nd in out.graph.node if nd.op_type == "MatMul")
    assert matmul.output[0] == "conv.patchify.matmul_1"
    assert "w" in {t.name for t in out.graph.initializer}
    _assert_well_formed(model, out)
    _assert_same_outputs(model, out)


def test_a_weight_the_loader_left_on_disk_is_read_there_and_the_rest_stays_on_disk(kit, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    model = _conv_model(kit, 1, 3, 20, 20, 8, (4, 4), reader="relu")
    path = tmp_path / "conv.onnx"
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(model)  # saving moves the copy's weights out
    onnx.save_model(on_disk, str(path), save_as_external_data=True, location="conv.data", size_threshold=0)
    monkeypatch.setattr(load_mod, "EXTERNAL_IN_MEMORY_LIMIT", 0)  # as for a model of over 1 GB of weights
    monkeypatch.setattr(load_mod, "ON_DISK_MIN_BYTES", 1)
    loaded = load_model(path)
    assert all(external_data_helper.uses_external_data(t) for t in loaded.graph.initializer if t.name in ("w", "b"))
    out, convs = patchify_convs(loaded)
    assert len(convs) == 1
    bias = next(t for t in out.graph.initializer if t.name == "b")
    assert external_data_helper.uses_external_data(bias)  # still on disk, and still found there (basepath kept)
    assert load_mod.external_entries(bias)["basepath"] == str(tmp_path.resolve())
    saved = save_atomic(out, tmp_path / "conv.patched.onnx")  # copies what is on disk
    _assert_same_outputs(model, saved)


def _patch_groups(result: Planned) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The plan's groups (family, node names) of the patch embedding: every group before the tokens' Concat; and
    the op types of the nodes that feed the Concat."""
    view, plan = result.view, result.plan
    concat = next(nd for nd in view.nodes if nd.name == "tokens.concat")
    groups = [(c.family, sorted(view.nodes[i].name for i in c.nodes)) for c in plan.groups if max(c.nodes) < concat.id]
    feeds = [view.producer_of(t).op_type for t in concat.inputs if view.producer_of(t) is not None]
    return groups, feeds


def test_vit_patch_embedding_becomes_a_layout_group_and_a_gemm_and_the_model_computes_the_same(calibrated) -> None:
    calibrated("sm_90", **CONV_KERNELS)  # the conv planned on our conv kernel, not left to ONNX Runtime
    model = load_model(build("vit-tiny"))
    out, convs = patchify_convs(model)
    assert convs == [PatchConv("patch_embed.proj", 1, 3, 224, 224, 192, 16, 16, TensorProto.FLOAT, True,
                               nchw_copy=False)]
    assert (convs[0].gemm_m, convs[0].gemm_n, convs[0].gemm_k) == (196, 192, 768)
    assert len(out.graph.node) == len(model.graph.node) + 2  # Conv, Reshape, Transpose -> 3 + MatMul, Add
    _assert_well_formed(model, out)
    _assert_same_outputs(model, out)

    config = GtcoConfig(precision="fp32", patchify=False)  # the planner's own patchify is tested in the pipeline's
    before, before_feeds = _patch_groups(plan_model(model, config))
    assert before == [
        ("conv", ["patch_embed.proj"]),
        ("elementwise", ["patch_embed.flatten", "patch_embed.transpose"]),
    ]
    assert before_feeds == ["Transpose"]  # the cls token is a constant the loader folded
    after, after_feeds = _patch_groups(plan_model(out, config))
    assert after == [
        ("elementwise", ["patch_embed.proj.patchify.patches", "patch_embed.proj.patchify.permute",
                         "patch_embed.proj.patchify.split"]),
        ("gemm", ["patch_embed.proj.patchify.add", "patch_embed.proj.patchify.matmul"]),
    ]
    assert after_feeds == ["Add"]  # the tokens read the GEMM's bias Add: no Transpose or Flatten between
    planned = plan_model(out, config)
    view, cands = planned.view, planned.candidates
    gemm = next(c for c in cands if c.family == "gemm" and "patch_embed.proj.patchify.matmul" in
                {view.nodes[i].name for i in c.nodes} and c.attr("bias"))
    assert (gemm.attr("m"), gemm.attr("n"), gemm.attr("k")) == (196, 192, 768)
    assert not [c for c in cands if c.family == "conv"]


def test_where_the_simplification_fails_the_rewrite_stands_with_its_restore(kit, monkeypatch) -> None:
    import onnx_gtco.ir.simplify as simplify_mod

    def fails(model: onnx.ModelProto) -> onnx.ModelProto:
        raise RuntimeError("the folder failed")

    model = _conv_model(kit, 2, 3, 34, 32, 16, (8, 8), reader="tokens")
    monkeypatch.setattr(simplify_mod, "simplify", fails)
    out, convs = patchify_convs(model)
    assert [c.nchw_copy for c in convs] == [True]  # the tokens chain did not collapse, and the decision knows it
    assert [nd.op_type for nd in out.graph.node] == [
        "Slice", "Reshape", "Transpose", "Reshape", "MatMul", "Add", "Reshape", "Transpose", "Reshape", "Transpose",
        "Add"]
    _assert_well_formed(model, out)
    _assert_same_outputs(model, out)


def test_an_opset_without_slice_inputs_is_left_alone(kit) -> None:
    g = kit.graph()
    g.input("x", [1, 3, 32, 32])
    g.op("Conv", ["x", g.weight("w", 8, 3, 4, 4)], "conv", kernel_shape=[4, 4], strides=[4, 4])
    g.output("conv")
    model = g.model(opset=9)  # as written, not loaded (load_model would convert it to opset 17)
    assert patchify_convs(model) == (model, [])
    assert len(patchify_convs(load_model(model))[1]) == 1


def test_a_ragged_patchify_with_its_slice_is_one_layout_group_before_the_gemm(kit) -> None:
    model = _conv_model(kit, 2, 3, 230, 227, 48, (16, 16), reader="tokens")
    out, _ = patchify_convs(model)
    planned = plan_model(out, GtcoConfig(precision="fp32", patchify=False))
    view, cands, plan = planned.view, planned.candidates, planned.plan
    groups = [(c.family, sorted(view.nodes[i].name for i in c.nodes)) for c in plan.groups]
    assert groups[0] == ("elementwise", ["conv.patchify.patches", "conv.patchify.permute", "conv.patchify.slice",
                                         "conv.patchify.split"])
    # the bias Add may go with the position Add after it instead (the DP weighs one elementwise pass over both)
    assert groups[1][0] == "gemm" and "conv.patchify.matmul" in groups[1][1]
    assert not [c for c in cands if c.family == "conv"]
