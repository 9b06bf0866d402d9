"""Built-in models: valid, runnable, deterministic, in the asked forms, and equal to a numpy forward pass."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_gtco.models import BUILTIN, build

SMALL = {"depth": 1, "image": 32, "dim": 64, "heads": 2, "mlp": 128}
CASES = [  # (name, overrides): the full vit-tiny once, the others cut down to stay fast
    ("vit-tiny", {}),
    ("vit-b16", SMALL),
    ("deit-s", SMALL),
    ("deit-b", SMALL),
    ("bert-tiny", {}),
    ("bert-base", {"depth": 1, "vocab": 500, "seq": 16, "dim": 64, "heads": 4, "mlp": 128}),
]
_erf = np.vectorize(math.erf, otypes=[np.float64])


def feeds_for(model: onnx.ModelProto, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: normal pixels, ids within the tables, 0/1 masks with a padded tail, 0/1 token types."""
    rng = np.random.default_rng(seed)
    tables = {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    bound = {n.input[1]: tables[n.input[0]] for n in model.graph.node
             if n.op_type == "Gather" and n.input[0] in tables}
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
        elif vi.name == "attention_mask":
            mask = np.ones(shape, np.int64)
            for row in range(shape[0]):
                mask[row, shape[1] - 1 - row - shape[1] // 4:] = 0
            out[vi.name] = mask
        else:
            out[vi.name] = rng.integers(0, bound[vi.name], shape, dtype=np.int64)
    return out


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}


def ref_ln(x: np.ndarray, w: dict[str, np.ndarray], name: str, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    normed = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    return normed * w[f"{name}.weight"] + w[f"{name}.bias"]


def ref_gelu(x: np.ndarray, form: str) -> np.ndarray:
    if form == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def ref_attention(x: np.ndarray, w: dict[str, np.ndarray], p: str, heads: int, proj: tuple[str, ...],
                  mask: np.ndarray | None = None) -> np.ndarray:
    b, s, dim = x.shape
    if f"{p}.qkv.weight" in w:
        qkv = x @ w[f"{p}.qkv.weight"] + w[f"{p}.qkv.bias"]
        q, k, v = qkv.reshape(b, s, 3, heads, dim // heads).transpose(2, 0, 3, 1, 4)
    else:
        q, k, v = ((x @ w[f"{p}.{n}.weight"] + w[f"{p}.{n}.bias"]).reshape(b, s, heads, -1)
                   .transpose(0, 2, 1, 3) for n in proj)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dim // heads)
    if mask is not None:
        scores = scores + mask
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, dim)


def ref_vit(model: onnx.ModelProto, pixels: np.ndarray, heads: int, patch: int,
            gelu: str = "erf") -> np.ndarray:
    """ViT / DeiT logits in float64 from the model's own initializers."""
    w = weights(model)
    x = pixels.astype(np.float64)
    b, c, size, _ = x.shape
    g, dim = size // patch, w["pos_embed"].shape[-1]
    cols = x.reshape(b, c, g, patch, g, patch).transpose(0, 2, 4, 1, 3, 5).reshape(b, g * g, -1)
    x = cols @ w["patch_embed.proj.weight"].reshape(dim, -1).T + w["patch_embed.proj.bias"]
    tokens = [np.broadcast_to(w[t], (b, 1, dim)) for t in ("cls_token", "dist_token") if t in w]
    x = np.concatenate([*tokens, x], axis=1) + w["pos_embed"]
    depth = len({n.split(".")[1] for n in w if n.startswith("blocks.")})
    for i in range(depth):
        p = f"blocks.{i}"
        a = ref_attention(ref_ln(x, w, f"{p}.norm1", 1e-6), w, f"{p}.attn", heads, ("q", "k", "v"))
        x = x + a @ w[f"{p}.attn.proj.weight"] + w[f"{p}.attn.proj.bias"]
        h = ref_ln(x, w, f"{p}.norm2", 1e-6) @ w[f"{p}.mlp.fc1.weight"] + w[f"{p}.mlp.fc1.bias"]
        x = x + ref_gelu(h, gelu) @ w[f"{p}.mlp.fc2.weight"] + w[f"{p}.mlp.fc2.bias"]
    x = ref_ln(x, w, "norm", 1e-6)
    logits = [x[:, i] @ w[f"{h}.weight"].T + w[f"{h}.bias"]
              for i, h in enumerate(("head", "head_dist")) if f"{h}.weight" in w]
    return sum(logits) / len(logits)


def ref_bert(model: onnx.ModelProto, feeds: dict[str, np.ndarray], heads: int,
             depth: int) -> list[np.ndarray]:
    """BERT last_hidden_state and pooler_output in float64 from the model's own initializers."""
    w = weights(model)
    e, ids = "embeddings", feeds["input_ids"]
    types = feeds.get("token_type_ids", np.zeros_like(ids))
    x = w[f"{e}.word_embeddings.weight"][ids] + w[f"{e}.token_type_embeddings.weight"][types]
    x = ref_ln(x + w[f"{e}.position_embeddings.weight"][: ids.shape[1]], w, f"{e}.LayerNorm", 1e-12)
    mask = (1.0 - feeds["attention_mask"][:, None, None, :]) * -10000.0
    for i in range(depth):
        p = f"encoder.layer.{i}"
        a = ref_attention(x, w, f"{p}.attention.self", heads, ("query", "key", "value"), mask)
        a = a @ w[f"{p}.attention.output.dense.weight"] + w[f"{p}.attention.output.dense.bias"]
        x = ref_ln(a + x, w, f"{p}.attention.output.LayerNorm", 1e-12)
        h = ref_gelu(x @ w[f"{p}.intermediate.dense.weight"] + w[f"{p}.intermediate.dense.bias"], "erf")
        h = h @ w[f"{p}.output.dense.weight"] + w[f"{p}.output.dense.bias"]
        x = ref_ln(h + x, w, f"{p}.output.LayerNorm", 1e-12)
    return [x, np.tanh(x[:, 0] @ w["pooler.dense.weight"].T + w["pooler.dense.bias"])]


def ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize(("name", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_builtin_is_valid_and_runs(name: str, overrides: dict) -> None:
    model = build(name, **overrides)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17 and model.ir_version == 8
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    outs = run(model, feeds_for(model))
    for out, vi in zip(outs, model.graph.output, strict=True):
        assert list(out.shape) == [d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert np.isfinite(out).all() and out.std() > 1e-3


def test_builtin_names_and_full_vit_tiny_shape() -> None:
    assert set(BUILTIN) == {"vit-tiny", "vit-b16", "deit-s", "deit-b", "bert-tiny", "bert-base"}
    model = build("vit-tiny")
    pos = next(t for t in model.graph.initializer if t.name == "pos_embed")
    assert list(pos.dims) == [1, 197, 192]
    assert ops(model)["Softmax"] == 12 and "blocks.3.attn.qk" in {n.name for n in model.graph.node}
    deit_pos = next(t for t in build("deit-b", **SMALL).graph.initializer if t.name == "pos_embed")
    assert list(deit_pos.dims) == [1, 6, 64]  # 4 patches + cls + distillation token


VIT_FORMS = [
    ("vit-tiny", {}),
    ("vit-tiny", {"ln": "decomposed", "gelu": "tanh", "qkv": "split"}),
    ("vit-tiny", {"gelu": "op", "opset": 20}),
    ("deit-b", {"opset": 13, "ln": "decomposed"}),
]


@pytest.mark.parametrize(("name", "forms"), VIT_FORMS,
                         ids=["timm", "decomposed-tanh-split", "gelu-op", "deit-opset13"])
def test_vit_matches_numpy_reference(name: str, forms: dict) -> None:
    model = build(name, seed=3, batch=2, depth=2, image=48, dim=96, heads=3, mlp=192, **forms)
    pixels = feeds_for(model, seed=5)["pixel_values"]
    got = run(model, {"pixel_values": pixels})[0]
    want = ref_vit(model, pixels, heads=3, patch=16, gelu=forms.get("gelu", "erf"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qkv", ["split", "fused"])
def test_bert_matches_numpy_reference(qkv: str) -> None:
    model = build("bert-tiny", seed=4, batch=2, seq=24, qkv=qkv, token_types=True, pooler=True)
    feeds = feeds_for(model, batch=2, seed=6)
    assert (feeds["attention_mask"] == 0).any() and feeds["token_type_ids"].any()
    for got, want in zip(run(model, feeds), ref_bert(model, feeds, heads=2, depth=2), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("name", "overrides"),
                         [("vit-tiny", {"depth": 2}), ("deit-b", SMALL), ("bert-tiny", {})])
def test_seed_determines_the_bytes(name: str, overrides: dict) -> None:
    def blob(seed: int) -> bytes:
        return build(name, seed=seed, **overrides).SerializeToString()

    assert blob(7) == blob(7)
    assert blob(7) != blob(8)


def test_forms_give_the_expected_ops() -> None:
    small = {"depth": 2, "image": 32}
    timm = ops(build("vit-tiny", **small))
    assert timm["LayerNormalization"] == 5 and timm["Erf"] == 2 and "ReduceMean" not in timm
    assert timm["MatMul"] == 2 * (4 + 2) and timm["Gather"] == 2 * 3 + 1 and timm["Conv"] == 1
    assert ops(build("vit-tiny", ln="decomposed", **small))["ReduceMean"] == 2 * 5
    tanh = ops(build("vit-tiny", gelu="tanh", **small))
    assert tanh["Tanh"] == 2 and tanh["Pow"] == 2 and "Erf" not in tanh
    gelu_op = ops(build("vit-tiny", gelu="op", opset=20, **small))
    assert gelu_op["Gelu"] == 2 and "Erf" not in gelu_op
    bert = ops(build("bert-tiny"))
    assert "LayerNormalization" not in bert and bert["ReduceMean"] == 2 * 5 and bert["Div"] == 2 * 4 + 1
    assert bert["Softmax"] == 2 and bert["Unsqueeze"] == 1 and bert["Cast"] == 1


@pytest.mark.parametrize("qkv", ["fused", "split"])
def test_qkv_projections_read_the_norm_output(qkv: str) -> None:
    model = build("vit-tiny", depth=1, image=32, qkv=qkv)
    readers = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[0] == "blocks.0.norm1"]
    assert len(readers) == (1 if qkv == "fused" else 3)
    perms = {tuple(onnx.helper.get_attribute_value(a)) for n in model.graph.node if n.op_type == "Transpose"
             for a in n.attribute}
    assert ((2, 0, 3, 1, 4) in perms) == (qkv == "fused")
    assert ((0, 2, 3, 1) in perms) == (qkv == "split")


@pytest.mark.parametrize("name", ["vit-tiny", "deit-b", "bert-tiny"])
def test_symbolic_batch_runs_for_any_batch(name: str) -> None:
    overrides = SMALL if name != "bert-tiny" else {"depth": 1, "seq": 16}
    model = build(name, batch="N", **overrides)
    onnx.checker.check_model(model, full_check=True)
    ends = [*model.graph.input, *model.graph.output]
    assert all(vi.type.tensor_type.shape.dim[0].dim_param == "N" for vi in ends)
    three = feeds_for(model, batch=3)
    one = {k: v[:1] for k, v in three.items()}
    got3, got1 = run(model, three)[0], run(model, one)[0]
    assert got3.shape[0] == 3 and got1.shape[0] == 1
    np.testing.assert_allclose(got3[:1], got1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("forms", [{}, {"qkv": "fused", "token_types": True}])
def test_symbolic_sequence_matches_the_static_model(forms: dict) -> None:
    model = build("bert-tiny", batch="batch", seq="seq", depth=1, **forms)
    onnx.checker.check_model(model, full_check=True)
    ends = [*model.graph.input, *model.graph.output]
    assert all([d.dim_param for d in vi.type.tensor_type.shape.dim[:2]] == ["batch", "seq"] for vi in ends)
    assert {"Shape", "Slice"} <= {n.op_type for n in model.graph.node}  # position ids cut from the table
    for batch, seq in ((1, 1), (3, 7), (2, 128)):
        static = build("bert-tiny", batch=batch, seq=seq, depth=1, **forms)
        x = feeds_for(static, batch=batch)
        got, want = run(model, x)[0], run(static, x)[0]
        assert got.shape == (batch, seq, 128)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_symbolic_vit_tiny_depth_one() -> None:
    model = build("vit-tiny", depth=1, batch="N")
    for batch in (1, 3):
        assert run(model, feeds_for(model, batch=batch))[0].shape == (batch, 1000)


@pytest.mark.parametrize("opset", [13, 16, 17, 18, 21])
def test_opsets(opset: int) -> None:
    ln = "op" if opset >= 17 else "decomposed"
    for name in ("vit-tiny", "bert-tiny"):
        size = {"image": 32} if name == "vit-tiny" else {"seq": 16}
        model = build(name, depth=1, opset=opset, ln=ln, **size)
        onnx.checker.check_model(model, full_check=True)
        assert model.opset_import[0].version == opset
        assert all(np.isfinite(o).all() for o in run(model, feeds_for(model)))


@pytest.mark.parametrize(("name", "overrides", "words"), [
    ("gpt-2", {}, "unknown built-in"),
    ("vit-tiny", {"opset": 16}, "opset 17"),
    ("vit-tiny", {"gelu": "op"}, "opset 20"),
    ("vit-tiny", {"qkv": "packed"}, "qkv="),
    ("vit-tiny", {"dim": 100}, "heads"),
    ("vit-tiny", {"image": 40}, "multiple of patch"),
    ("bert-tiny", {"seq": 1024}, "max_positions"),
    ("bert-tiny", {"opset": 12}, "opset 12"),
    ("bert-tiny", {"batch": 0}, "batch"),
    ("bert-tiny", {"seq": ""}, "seq"),
])
def test_bad_arguments_raise(name: str, overrides: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        build(name, **overrides)
