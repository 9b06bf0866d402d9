"""Loading: paths and protos, old opsets converted, bad input refused with one clear message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_gtco.errors import ModelError, UnsupportedError
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
