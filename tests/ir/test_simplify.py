"""Loading folds shape arithmetic to its end and drops the layout ops that static shapes show to be no-ops; what
moves elements, and what depends on a symbolic dim, stays; the model computes what it did."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco.ir.load import load_model

X_SHAPE = [2, 3, 4]
INT64_MAX = np.iinfo(np.int64).max


def _i64(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto] = (), x_shape: list[int | str] = X_SHAPE,
           y_shape: list[int | str | None] | None = None) -> onnx.ModelProto:
    """x -> nodes -> t -> Relu -> y: the op under test has a reader, so it is not a graph output."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape if y_shape is None else y_shape)
    g = helper.make_graph([*nodes, helper.make_node("Relu", ["t"], ["y"])], "g", [x], [y], initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x})[0]


def _assert_same_results(original: onnx.ModelProto, loaded: onnx.ModelProto, shape: list[int] = X_SHAPE) -> None:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert np.array_equal(_run(loaded, x), _run(original, x))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _swin_pad(src: str = "x", out: str = "t", k: str = "") -> list[onnx.NodeProto]:
    """Swin's window padding as TorchScript exports it: pads = (window - extent % window) % window, from the
    tensor's own shape, through ConstantOfShape; zero for extents that are multiples of the window. Intermediate
    names end in `k`."""
    zero = helper.make_tensor("v", TensorProto.INT64, [1], [0])
    return [
        helper.make_node("Shape", [src], [f"shape{k}"]),
        helper.make_node("Gather", [f"shape{k}", "last"], [f"extent{k}"], axis=0),
        helper.make_node("Mod", [f"extent{k}", "window"], [f"rest{k}"]),
        helper.make_node("Sub", ["window", f"rest{k}"], [f"short{k}"]),
        helper.make_node("Mod", [f"short{k}", "window"], [f"pad_end{k}"]),
        helper.make_node("ConstantOfShape", ["five"], [f"zeros{k}"], value=zero),
        helper.make_node("Concat", [f"zeros{k}", f"pad_end{k}"], [f"pads{k}"], axis=0),
        helper.make_node("Pad", [src, f"pads{k}"], [out]),
    ]


SWIN_PAD_INITS = [_i64("last", [2]), _i64("window", [4]), _i64("five", [5])]

NO_OPS = {
    "slice-to-int64-max": ([helper.make_node("Slice", ["x", "s", "e", "a"], ["t"])],
                           [_i64("s", [0]), _i64("e", [INT64_MAX]), _i64("a", [1])]),
    "slice-to-extent": ([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["t"])],
                        [_i64("s", [0, 0]), _i64("e", [3, 4]), _i64("a", [1, 2]), _i64("st", [1, 1])]),
    "reshape-to-own-shape": ([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["t"])],
                             []),
    "reshape-minus-one": ([helper.make_node("Reshape", ["x", "s"], ["t"])], [_i64("s", [2, 3, -1])]),
    "squeeze-nothing": ([helper.make_node("Squeeze", ["x"], ["t"])], []),
    "unsqueeze-squeeze": ([helper.make_node("Unsqueeze", ["x", "a"], ["u"]), helper.make_node("Squeeze", ["u", "a"],
                                                                                              ["t"])],
                          [_i64("a", [0])]),
    "expand-to-own-shape": ([helper.make_node("Expand", ["x", "s"], ["t"])], [_i64("s", X_SHAPE)]),
    "identity": ([helper.make_node("Identity", ["x"], ["t"])], []),
    "cast-to-own-type": ([helper.make_node("Cast", ["x"], ["t"], to=TensorProto.FLOAT)], []),
    "concat-of-one": ([helper.make_node("Concat", ["x"], ["t"], axis=1)], []),
    "split-into-one": ([helper.make_node("Split", ["x"], ["t"], axis=1)], []),
    "transpose-identity": ([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 1, 2])], []),
}


@pytest.mark.parametrize("case", sorted(NO_OPS))
def test_no_op_layout_op_is_removed(case: str) -> None:
    nodes, inits = NO_OPS[case]
    original = _model(nodes, inits)
    loaded = load_model(original)
    assert _ops(loaded) == ["Relu"], case
    assert loaded.graph.node[0].input[0] == "x"
    _assert_same_results(original, loaded)


MOVES_ELEMENTS = {
    # the shape stays, the elements move: none of these is a no-op
    "pad-then-crop": ([helper.make_node("Pad", ["x", "pads"], ["t"])], [_i64("pads", [0, 0, 1, 0, 0, -1])]),
    "slice-reversed": ([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["t"])],
                       [_i64("s", [-1]), _i64("e", [-INT64_MAX]), _i64("a", [2]), _i64("st", [-1])]),
    "transpose-of-equal-extents": ([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1])], []),
}


@pytest.mark.parametrize("case", sorted(MOVES_ELEMENTS))
def test_layout_op_that_moves_elements_stays(case: str) -> None:
    nodes, inits = MOVES_ELEMENTS[case]
    shape = [2, 4, 4]
    original = _model(nodes, inits, x_shape=shape)
    loaded = load_model(original)
    assert _ops(loaded) == [nodes[-1].op_type, "Relu"], case
    _assert_same_results(original, loaded, shape)


def test_zero_computed_pads_fold_and_the_pad_stays() -> None:
    """The Swin pad arithmetic on an extent that is a multiple of the window folds to zero pads; the Pad stays, as
    the elementwise node Swin's window partition joins to run fused."""
    original = _model(_swin_pad(), SWIN_PAD_INITS)
    loaded = load_model(original)
    assert _ops(loaded) == ["Pad", "Relu"]
    pads = next(t for t in loaded.graph.initializer if t.name == loaded.graph.node[0].input[1])
    assert numpy_helper.to_array(pads).tolist() == [0] * 6
    _assert_same_results(original, loaded)


def test_nonzero_computed_pads_fold_to_a_constant() -> None:
    """The Swin pad arithmetic on an extent that is no multiple of the window: the pads fold, the Pad stays."""
    original = _model(_swin_pad(), SWIN_PAD_INITS, x_shape=[2, 3, 5], y_shape=[2, 3, 8])
    loaded = load_model(original)
    assert _ops(loaded) == ["Pad", "Relu"]
    pads = next(t for t in loaded.graph.initializer if t.name == loaded.graph.node[0].input[1])
    assert numpy_helper.to_array(pads).tolist() == [0, 0, 0, 0, 0, 3]
    _assert_same_results(original, loaded, [2, 3, 5])


def test_shape_arithmetic_of_a_symbolic_dim_stays() -> None:
    """The pads of a symbolic extent are computed at run time: the chain stays, and computes what it did."""
    original = _model(_swin_pad(), SWIN_PAD_INITS, x_shape=[2, 3, "n"], y_shape=[2, 3, None])
    loaded = load_model(original)
    assert {"Shape", "Mod", "Pad"} <= set(_ops(loaded))
    for n in (4, 5, 7):
        _assert_same_results(original, loaded, [2, 3, n])


def test_no_op_writing_a_graph_output_keeps_the_output() -> None:
    """A no-op whose output is a graph output stays: the output keeps its name and dtype."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, X_SHAPE)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, X_SHAPE)
    g = helper.make_graph([helper.make_node("Slice", ["x", "s", "e", "a"], ["y"])], "g", [x], [y],
                          initializer=[_i64("s", [0]), _i64("e", [INT64_MAX]), _i64("a", [1])])
    loaded = load_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert [(o.name, o.type.tensor_type.elem_type) for o in loaded.graph.output] == [("y", TensorProto.FLOAT)]
    assert [(n.op_type, list(n.output)) for n in loaded.graph.node] == [("Slice", ["y"])]


def test_chained_shape_arithmetic_folds_in_one_load() -> None:
    """Pads computed from the shape of an earlier Pad's output, a chain of them (Swin's blocks): each link is
    known only once the one before is folded, and loading folds them all."""
    nodes, src = [], "x"
    for k in range(6):
        nodes += [*_swin_pad(src, f"p{k}", str(k)), helper.make_node("Relu", [f"p{k}"], [f"r{k}"])]
        src = f"r{k}"
    nodes.append(helper.make_node("Identity", [src], ["t"]))
    original = _model(nodes, SWIN_PAD_INITS, x_shape=[2, 3, 5], y_shape=[2, 3, 8])
    loaded = load_model(original)
    assert _ops(loaded) == [*["Pad", "Relu"] * 6, "Relu"], _ops(loaded)  # 5 padded to 8 by the first
    _assert_same_results(original, loaded, [2, 3, 5])


def test_chain_of_reshapes_collapses_to_one() -> None:
    """Reshape after Unsqueeze after Reshape (TorchScript's window partition): the last reads the chain's start, with
    its static output shape as the target; a step of the chain another node reads stays for that reader."""
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]),
             helper.make_node("Unsqueeze", ["a", "ax"], ["b"]),
             helper.make_node("Reshape", ["b", "s2"], ["t"]),
             helper.make_node("Reshape", ["x", "s1"], ["c"]),
             helper.make_node("Reshape", ["c", "s2"], ["d"]),
             helper.make_node("Neg", ["c"], ["e"])]
    inits = [_i64("s1", [6, 4]), _i64("ax", [0]), _i64("s2", [3, -1])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, X_SHAPE)
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 8] if n != "e" else [6, 4]) for n in "yde"]
    g = helper.make_graph([*nodes, helper.make_node("Relu", ["t"], ["y"])], "g", [x], outs, initializer=inits)
    original = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    loaded = load_model(original)
    reshapes = {n.output[0]: n for n in loaded.graph.node if n.op_type == "Reshape"}
    consts = {t.name: numpy_helper.to_array(t).tolist() for t in loaded.graph.initializer}
    assert reshapes["t"].input[0] == "x" and consts[reshapes["t"].input[1]] == [3, 8]
    assert reshapes["d"].input[0] == "x" and consts[reshapes["d"].input[1]] == [3, 8]
    assert reshapes["c"].input[0] == "x"  # Neg reads it
    assert "Unsqueeze" not in _ops(loaded)
    feed = {"x": np.random.default_rng(0).standard_normal(X_SHAPE).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y", "d", "e"], feed)
           for m in (original, loaded)]
    assert all(np.array_equal(a, b) for a, b in zip(*run, strict=True))


def _tokens_map_tokens(perm: list[int]) -> onnx.ModelProto:
    """SegFormer's stage end, x [B, H*W, C] -> Reshape [B, H, W, C] -> Transpose `perm` (the NCHW map another node
    reads) -> Reshape [B, C, H*W] -> Transpose [B, H*W, C] (the decoder's tokens) -> Relu."""
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["m"]),
             helper.make_node("Transpose", ["m"], ["map"], perm=perm),
             helper.make_node("Reshape", ["map", "s2"], ["f"]),
             helper.make_node("Transpose", ["f"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Neg", ["map"], ["e"])]
    inits = [_i64("s1", [2, 2, 3, 4]), _i64("s2", [2, 4, 6])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 4])
    map_shape = [[2, 2, 3, 4][p] for p in perm]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 4]),
            helper.make_tensor_value_info("e", TensorProto.FLOAT, map_shape)]
    g = helper.make_graph([*nodes, helper.make_node("Relu", ["t"], ["y"])], "g", [x], outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _same_outputs(original: onnx.ModelProto, loaded: onnx.ModelProto) -> None:
    feed = {"x": np.random.default_rng(0).standard_normal([2, 6, 4]).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y", "e"], feed)
           for m in (original, loaded)]
    assert all(np.array_equal(a, b) for a, b in zip(*run, strict=True))


def test_reshape_transpose_chain_that_gives_back_its_start_is_removed() -> None:
    """tokens -> map -> tokens is the identity: the tokens' reader reads the chain's start; the map stays for its own
    reader."""
    original = _tokens_map_tokens([0, 3, 1, 2])
    loaded = load_model(original)
    relu = next(n for n in loaded.graph.node if n.op_type == "Relu")
    assert relu.input[0] == "x"
    assert sorted(_ops(loaded)) == ["Neg", "Relu", "Reshape", "Transpose"]
    _same_outputs(original, loaded)


def test_reshape_transpose_chain_that_moves_elements_stays() -> None:
    """The same chain through a map of another axis order ends in the start's shape, but its elements moved."""
    original = _tokens_map_tokens([0, 3, 2, 1])
    loaded = load_model(original)
    assert sorted(_ops(loaded)) == ["Neg", "Relu", "Reshape", "Reshape", "Transpose", "Transpose"]
    _same_outputs(original, loaded)
