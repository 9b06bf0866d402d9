"""Loading: paths and protos, old opsets converted, bad input refused with one clear message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_gtco.errors import ModelError, OpsetNotConvertedError, UnsupportedError
from onnx_gtco.ir.load import default_opset, load_model


def test_load_path_and_proto_agree(tmp_path: Path, mlp: onnx.ModelProto) -> None:
    p = tmp_path / "m.onnx"
    onnx.save(mlp, str(p))
    a, b = load_model(p), load_model(mlp)
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    shapes = {vi.name for vi in a.graph.value_info}
    assert {"m0", "a0", "r0", "m1"} <= shapes  # shape inference ran


def test_symbolic_dims_are_kept(make_mlp) -> None:
    m = load_model(make_mlp(rows="batch"))
    dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in m.graph.value_info}
    assert dims["r0"] == ["batch", 8]


def test_external_data_is_read(tmp_path: Path, mlp: onnx.ModelProto) -> None:
    ref = {t.name: onnx.numpy_helper.to_array(t) for t in mlp.graph.initializer}
    p = tmp_path / "ext.onnx"
    onnx.save(mlp, str(p), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.bin",
              size_threshold=0)
    assert (tmp_path / "ext.bin").exists()
    m = load_model(p)
    w = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    assert all(np.array_equal(w[k], ref[k]) for k in ref)


def test_missing_external_data_is_a_clear_error(tmp_path: Path, mlp: onnx.ModelProto) -> None:
    p = tmp_path / "ext.onnx"
    onnx.save(mlp, str(p), save_as_external_data=True, location="gone.bin", size_threshold=0)
    (tmp_path / "gone.bin").unlink()
    with pytest.raises(ModelError, match="external data"):
        load_model(p)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"\x08\x07\x12\x04abc", "holds no ONNX graph|not a valid ONNX"),
        (bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "not a valid ONNX|no ONNX graph"),
    ],
    ids=["empty", "non-model-protobuf", "random-bytes"],
)
def test_bad_files(tmp_path: Path, content: bytes, message: str) -> None:
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    with pytest.raises(ModelError, match=message):
        load_model(p)


def test_truncated_model(tmp_path: Path, mlp: onnx.ModelProto) -> None:
    data = mlp.SerializeToString()
    p = tmp_path / "cut.onnx"
    p.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelError):
        load_model(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such file"):
        load_model(tmp_path / "nope.onnx")


def test_invalid_graph_dangling_input(mlp: onnx.ModelProto) -> None:
    mlp.graph.node[2].input[0] = "does_not_exist"
    with pytest.raises(ModelError, match="invalid ONNX model"):
        load_model(mlp)


def test_old_opset_is_converted() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)
    assert default_opset(load_model(m)) == 17


def test_too_new_opset_is_refused() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", onnx.defs.onnx_opset_version() + 1)])
    with pytest.raises((UnsupportedError, ModelError)):
        load_model(m)


def _interleaved_branches(width: int = 4) -> onnx.ModelProto:
    """Two independent MatMul+Add+Relu branches, listed stage by stage (as dynamo does), not branch by branch."""
    rng = np.random.default_rng(7)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in [("wa", (width, width)), ("wb", (width, width)), ("ba", (width,)), ("bb", (width,))]]
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["ma"], name="a.mm"),
        helper.make_node("MatMul", ["x", "wb"], ["mb"], name="b.mm"),
        helper.make_node("Add", ["ma", "ba"], ["aa"], name="a.add"),
        helper.make_node("Add", ["mb", "bb"], ["ab"], name="b.add"),
        helper.make_node("Relu", ["aa"], ["ya"], name="a.relu"),
        helper.make_node("Relu", ["ab"], ["yb"], name="b.relu"),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, width]) for n in ("x", "ya", "yb")]
    graph = helper.make_graph(nodes, "branches", [vi[0]], vi[1:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_nodes_are_reordered_depth_first_from_the_outputs() -> None:
    m = load_model(_interleaved_branches())
    assert [n.name for n in m.graph.node] == ["a.mm", "a.add", "a.relu", "b.mm", "b.add", "b.relu"]
    onnx.checker.check_model(m)  # still a topological order


def test_shape_arithmetic_folds_to_constants() -> None:
    """TorchScript computes reshape targets from Shape nodes; with static shapes they must fold away."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),  # the shape of r is known only after inference
        helper.make_node("Shape", ["r"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["b"], name="batch", axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"], name="unsq"),
        helper.make_node("Concat", ["b1", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["r", "target"], ["y"], name="reshape"),
    ]
    inits = [onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
             onnx.numpy_helper.from_array(np.array([0], np.int64), "axes"),
             onnx.numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    graph = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r", "c"])], inits)
    m = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert [n.op_type for n in m.graph.node] == ["Relu", "Reshape"]
    y = next(v for v in m.graph.output if v.name == "y")
    assert [d.dim_value for d in y.type.tensor_type.shape.dim] == [3, 20]


def test_out_of_order_graph_is_sorted(mlp: onnx.ModelProto) -> None:
    """onnxruntime's fp16 converter writes valid graphs out of topological order: they load, sorted."""
    shuffled = onnx.ModelProto()
    shuffled.CopyFrom(mlp)
    nodes = list(shuffled.graph.node)
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(reversed(nodes))
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(shuffled)
    model = load_model(shuffled)
    assert sorted(n.name for n in model.graph.node) == sorted(n.name for n in mlp.graph.node)
    seen = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for n in model.graph.node:
        assert all(i in seen for i in n.input if i), n.name
        seen.update(n.output)


def test_cycle_is_a_clear_error(mlp: onnx.ModelProto) -> None:
    cyclic = onnx.ModelProto()
    cyclic.CopyFrom(mlp)
    fc0 = next(n for n in cyclic.graph.node if n.name == "fc0")
    fc0.input[0] = "y"  # fc0 now reads the last node's output
    cyclic.graph.input[0].name = "unused_x"
    with pytest.raises(ModelError, match="invalid ONNX model"):
        load_model(cyclic)


def test_model_of_other_domains_only_loads_as_it_is() -> None:
    """No default-domain opset (an ai.onnx.ml model): nothing to convert or fold; it loads, shapes inferred."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    g = helper.make_graph([helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml")], "ml", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)], ir_version=8)
    assert default_opset(m) is None
    loaded = load_model(m)
    assert [n.op_type for n in loaded.graph.node] == ["Binarizer"]
    assert [d.dim_value for d in loaded.graph.output[0].type.tensor_type.shape.dim] == [3, 4]


def test_shape_start_end_folds_to_its_slice() -> None:
    """Shape(start=1, end=-1) of a static [2, 5, 7, 3] tensor folds to [5, 7], not to the whole shape."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 7, 3])
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=-1),
             helper.make_node("Reshape", ["x", "s2"], ["y"]),
             helper.make_node("Concat", ["s", "minus1"], ["s2"], axis=0)]
    nodes = [nodes[0], nodes[2], nodes[1]]
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c"])],
                          [onnx.numpy_helper.from_array(np.array([-1], np.int64), "minus1")])
    m = load_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert [n.op_type for n in m.graph.node] == ["Reshape"]
    target = next(t for t in m.graph.initializer if t.name == m.graph.node[0].input[1])
    assert onnx.numpy_helper.to_array(target).tolist() == [5, 7, -1]
    assert [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim] == [5, 7, 6]


def test_folded_model_failing_the_check_is_not_used(mlp: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> None:
    """Folding is an optimization: a folded model that onnx.checker rejects (onnx-graphsurgeon's flattening of
    constant If conditions lost a tensor in test_affine_grid_2d_align_corners_expanded) is dropped, the model loads
    unfolded."""
    import onnx_gtco.ir.load as load_mod

    fold = load_mod._fold_constants
    dropped = []

    def dropping_a_node(model: onnx.ModelProto) -> onnx.ModelProto:
        out = fold(model)
        if not dropped:  # once: folding runs in rounds until one removes no node
            dropped.append(out.graph.node.pop(0))
        return out

    monkeypatch.setattr(load_mod, "_fold_constants", dropping_a_node)
    m = load_model(mlp)
    onnx.checker.check_model(m, full_check=True)
    assert sorted(n.name for n in m.graph.node) == sorted(n.name for n in mlp.graph.node)


def test_old_opset_whose_conversion_changes_the_inputs_is_not_converted(scan8: onnx.ModelProto) -> None:
    """onnx's converter drops Scan-8's batch axis from the graph's inputs: the converted model is not the same
    model, so the loader refuses to plan it and hands back the checked original (optimize passes that through)."""
    onnx.checker.check_model(scan8)
    with pytest.raises(OpsetNotConvertedError, match="changed the graph's inputs or outputs") as info:
        load_model(scan8)
    assert info.value.model.SerializeToString() == scan8.SerializeToString()


def test_model_onnx_cannot_infer_strictly_keeps_its_folding() -> None:
    """MeanVarianceNormalization fails onnx's strict shape inference in its own function body; the Shape beside it
    folds anyway (the folded model fails strict inference exactly as the unfolded one does)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 1])
    nodes = [helper.make_node("MeanVarianceNormalization", ["x"], ["n"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["n", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(m, strict_mode=True)
    assert [n.op_type for n in load_model(m).graph.node] == ["MeanVarianceNormalization", "Reshape"]


def _simplified_ln(dtype: int, *, opset: int = 17, axis: int = -1, inv_out: bool = False,
                   stash: int | None = None) -> onnx.ModelProto:
    """x [2, 3, 8] -> onnxruntime's SimplifiedLayerNormalization(x, scale) -> y (and its inv_std_var)."""
    np_t = helper.tensor_dtype_to_np_dtype(dtype)
    scale = onnx.numpy_helper.from_array((1 + 0.25 * np.random.default_rng(0).standard_normal(8)).astype(np_t), "s")
    attrs = {"axis": axis, "epsilon": 1e-6} | ({"stash_type": stash} if stash is not None else {})
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y", *(["inv"] if inv_out else [])],
                            name="sln", **attrs)
    outs = [helper.make_tensor_value_info("y", dtype, [2, 3, 8])]
    outs += [helper.make_tensor_value_info("inv", TensorProto.FLOAT, [2, 3, 1])] if inv_out else []
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", dtype, [2, 3, 8])], outs, [scale])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize(("dtype", "opset", "tol"), [(TensorProto.FLOAT, 17, 1e-6), (TensorProto.FLOAT, 18, 1e-6),
                                                     (TensorProto.FLOAT16, 17, 1e-3)])
def test_simplified_layernormalization_is_written_out_in_standard_ops(dtype: int, opset: int, tol: float) -> None:
    """onnxruntime's RMSNorm op of the default domain, which onnx has no definition of, loads as the standard ops that
    compute it, and computes what onnxruntime's own kernel does (its inv_std_var output too)."""
    import onnxruntime as ort

    model = _simplified_ln(dtype, opset=opset, inv_out=True)
    loaded = load_model(model)
    assert "SimplifiedLayerNormalization" not in {n.op_type for n in loaded.graph.node}
    assert {"ReduceMean", "Sqrt", "Reciprocal"} <= {n.op_type for n in loaded.graph.node}
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(helper.tensor_dtype_to_np_dtype(dtype))
    want, got = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
                 for m in (model, loaded))
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol)


def test_simplified_layernormalization_it_cannot_write_out_is_refused() -> None:
    with pytest.raises(UnsupportedError, match=r"^model: SimplifiedLayerNormalization 'sln': stash_type 10 "):
        load_model(_simplified_ln(TensorProto.FLOAT, stash=10))
    model = _simplified_ln(TensorProto.FLOAT, axis=2)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(UnsupportedError, match=r"axis 2 over an input of unknown rank"):
        load_model(model)
