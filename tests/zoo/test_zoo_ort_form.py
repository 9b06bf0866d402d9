"""The zoo's ORT form of BERT-base: ORT's transformer optimizer fuses its attention, and the optimized model computes
what the zoo's bert-base does (the bench's ort-transformers-fp16 baseline times that optimized model)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import export_zoo as zoo  # tools/export_zoo.py, put on sys.modules by conftest.py (imports without torch)
import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="zoo tests need torch: pip install -r requirements-zoo.txt")
ort = pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.zoo, pytest.mark.slow, pytest.mark.xdist_group("zoo")]

RTOL = 1e-3
ATOL = 1e-4
TEST_SEED = 1


def _run(model: str | bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_only_bert_base_has_an_ort_form(tmp_path: pathlib.Path) -> None:
    assert zoo.ORT_MODELS == ("bert-base",) and set(zoo.ORT_OPTIMIZER_ARGS) == set(zoo.ORT_MODELS)
    with pytest.raises(ValueError, match="vit-b16 has no ORT form"):
        zoo.export("vit-b16", zoo.ORT_FORM, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_ort_optimizer_fuses_the_ort_form_and_keeps_its_outputs(
    zoo_dir: pathlib.Path, torch_outputs: Callable[[str, int], dict[str, Any]]
) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    path = zoo.export("bert-base", zoo.ORT_FORM, zoo_dir)
    assert path == zoo_dir / "bert-base.ort.onnx"
    meta = zoo.read_sidecar(path)
    assert meta is not None and meta["exporter"] == zoo.ORT_FORM and meta["opset"] == zoo.TORCHSCRIPT_OPSET
    args = meta["ort_optimizer_args"]
    assert args == zoo.ORT_OPTIMIZER_ARGS["bert-base"]
    model = onnx.load(str(path))
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims == {i.name: ["batch", "sequence"] for i in zoo.SPECS["bert-base"].inputs}

    optimized = optimize_model(str(path), **args)  # the default opt_level, as the bench runs it
    fused = optimized.get_fused_operator_statistics()
    assert fused["Attention"] + fused["MultiHeadAttention"] >= 12, fused
    assert fused["SkipLayerNormalization"] == 24, fused
    attention = [n for n in optimized.model.graph.node if n.op_type in ("Attention", "MultiHeadAttention")]
    assert len(attention) == fused["Attention"] + fused["MultiHeadAttention"]
    assert not [n for n in optimized.model.graph.node if n.op_type == "Softmax"]  # every attention was fused
    fused_bytes = optimized.model.SerializeToString()

    # The zoo's inputs (a padded tail in the mask): the optimized model computes what the zoo's bert-base torch
    # module computes (the SDPA one: the weights are the same, only the attention implementation differs).
    feeds = zoo.make_inputs("bert-base", seed=TEST_SEED)
    assert feeds["attention_mask"][0, 0] == 1 and feeds["attention_mask"][0, -1] == 0
    want = torch_outputs("bert-base", TEST_SEED)
    got = _run(fused_bytes, feeds)
    assert [o.name for o in optimized.model.graph.output] == list(want)
    for (key, expected), out in zip(want.items(), got, strict=True):
        assert out.shape == expected.shape, key
        np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL, err_msg=f"optimized ORT form, {key}")

    # Its batch and sequence are dynamic: two rows of 64 tokens, the optimized model against the export itself.
    rng = np.random.default_rng(TEST_SEED)
    short = {k: np.repeat(v[:, :64], 2, axis=0) for k, v in feeds.items()}
    short["input_ids"] = rng.integers(0, 30522, size=(2, 64), dtype=np.int64)
    short["attention_mask"][1, 40:] = 0
    for key, out, expected in zip(want, _run(fused_bytes, short), _run(str(path), short), strict=True):
        assert out.shape[:1] == (2,) and out.shape == expected.shape, key
        np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL, err_msg=f"batch 2 x 64 tokens, {key}")


def test_bench_times_ort_transformers_on_the_ort_form(zoo_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The bench's ort-transformers-fp16 on the zoo's bert-base with its ORT form (what tools/gpu_suite runs, here on
    the CPU EP): its note lists the 12 fused Attention and its outputs match the zoo export's within fp16 error."""
    from onnx_gtco.bench import variants
    from onnx_gtco.bench.run import bind_dims, check_ort_model
    from onnx_gtco.runtime.check import make_inputs

    src = zoo.export("bert-base", "torchscript", zoo_dir)
    ort_form = zoo.export("bert-base", zoo.ORT_FORM, zoo_dir)
    model = bind_dims(onnx.load(str(src)), 1, {}, src.name)
    check_ort_model(onnx.load(str(ort_form), load_external_data=False), model, ort_form.name)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    feeds = make_inputs(model, 0)
    args = zoo.ORT_OPTIMIZER_ARGS["bert-base"]
    ctx = variants.Context(model, path, tmp_path, "cpu", "fp32", "sm_90", args["model_type"], feeds,
                           variants.reference_outputs(path, feeds), 3, 1, ort_model=ort_form,
                           num_heads=args["num_heads"], hidden_size=args["hidden_size"])
    r = variants.run_variant("ort-transformers-fp16", ctx)
    assert r.status == "ok", r.reason
    assert r.note.startswith("optimize_model(model_type='bert', num_heads=12, hidden_size=768) of bert-base.ort.onnx "
                             "then fp16; fused ops: Attention 12, "), r.note
    assert r.accuracy is not None and r.accuracy.cosine > 0.9999 and r.accuracy.max_abs_err < 0.05, r.accuracy
