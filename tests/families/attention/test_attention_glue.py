"""The attention families' ORT glue: the C++ reference, the binders, and the glue header compiling.

(a) plugins/families/attention/attention_ref.h (through tests/plugin/attention_ref_harness.cc, built with g++ and
called with     ctypes) against an fp64 numpy reference: ragged sequences, head dims 32/64/80, every layout, mask /
bias,     NaN semantics of fully masked rows (NaN, or zeros under the NaN guard), causal, bfloat16 storage.
(b) onnx_gtco/families/attention/bind.py on every Attention_* / BmmSoftmax_* node of the built-in ViT and BERT models
    (and small hand-built models for the NaN guard, bias and BmmSoftmax): each binds, and the binding is right:
    the node's own function, run by onnxruntime as a one-node model, equals the numpy reference and the C++
    reference fed per the roles. Doctored nodes get the specific reason.
(c) plugins/families/attention/attention_op.h compiles (g++ -fsyntax-only -Wall -Wextra -Werror) against the ORT C++
headers.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from pins import write_calibration

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.calibration import hardware
from onnx_gtco.config import CALIBRATION_DIR_ENV
from onnx_gtco.families.attention.bind import BINDERS, IN_ROLES, AttentionBinder
from onnx_gtco.families.attention.kernel import from_bhsd, layout_shape, to_bhsd
from onnx_gtco.kernels.toolchain import GLUE_INCLUDE_DIRS, cxx_build
from onnx_gtco.models import build
from onnx_gtco.plugin.binding import Binding, FusedNode
from onnx_gtco.plugin.headers import ort_include_dir
from onnx_gtco.plugin.nodes import fused_nodes

ROOT = Path(__file__).resolve().parents[3]
HARNESS = Path(__file__).with_name("attention_ref_harness.cc")
BINDER = {b.family: b for b in BINDERS}

# ---------------------------------------------------------------------------------------------------------------
# numpy reference (fp64, the unfused graph's semantics)


def np_probs(q: np.ndarray, k: np.ndarray, scale: float, mask: np.ndarray | None = None,
             bias: np.ndarray | None = None, causal: bool = False, nan_guard: bool = False,
             mask_scale: float = 1.0, bias_scale: float = 1.0) -> np.ndarray:
    """q [B,H,Sq,D], k [B,H,Sk,D] -> P [B,H,Sq,Sk]; rows with a NaN or an infinite max are NaN (0 if guarded)."""
    s = scale * np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64))
    with np.errstate(invalid="ignore"):
        for add, factor in ((mask, mask_scale), (bias, bias_scale)):
            if add is not None:
                s = s + factor * add.astype(np.float64)
        if causal:
            sq, sk = s.shape[-2:]
            s = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None], -np.inf, s)
        mx = s.max(-1, keepdims=True)
        bad = np.isnan(s).any(-1, keepdims=True) | ~np.isfinite(mx)
        e = np.exp(s - np.where(bad, 0.0, mx))
        p = np.where(bad, np.nan, e / e.sum(-1, keepdims=True))
    return np.where(np.isnan(p), 0.0, p) if nan_guard else p


def np_attention(q, k, v, scale, mask=None, bias=None, causal=False, nan_guard=False, mask_scale=1.0,
                 bias_scale=1.0) -> np.ndarray:
    p = np_probs(q, k, scale, mask, bias, causal, nan_guard, mask_scale, bias_scale)
    with np.errstate(invalid="ignore"):
        return np.einsum("bhqk,bhkd->bhqd", p, v.astype(np.float64))


# ---------------------------------------------------------------------------------------------------------------
# the C++ reference through the harness


@pytest.fixture(scope="module")
def ref_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("attn_ref") / "libattn_ref.so"
    cxx_build(HARNESS, out, include_dirs=GLUE_INCLUDE_DIRS,
              extra=("-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror"))
    lib = ctypes.CDLL(str(out))
    lib.gtco_attention_ref.restype = ctypes.c_int
    return lib


def _arr(x: np.ndarray | None):
    if x is None:
        return None, None, 0
    shape = (ctypes.c_int64 * max(1, x.ndim))(*x.shape)
    return x.ctypes.data_as(ctypes.c_void_p), shape, x.ndim


def run_ref(lib: ctypes.CDLL, *, q: np.ndarray, k: np.ndarray, v: np.ndarray | None, heads: int, head_dim: int,
            layouts: dict[str, str], scale: float, out_shape: tuple[int, ...], mask: np.ndarray | None = None,
            bias: np.ndarray | None = None, causal: bool = False, nan_guard: bool = False,
            dtype: str = "f32", mask_scale: float = 1.0, bias_scale: float = 1.0) -> np.ndarray:
    """Call the C++ reference; arrays in their layouts (float32, or bfloat16 when dtype == "bf16")."""
    st = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32

    def prep(x):
        return None if x is None else np.ascontiguousarray(np.asarray(x).astype(st))

    q, k, v, mask, bias = (prep(x) for x in (q, k, v, mask, bias))
    out = np.full(out_shape, np.nan, dtype=np.float32).astype(st)
    err = ctypes.create_string_buffer(256)
    args = [*_arr(q), *_arr(k), *_arr(v), *_arr(mask), *_arr(bias)]
    rc = lib.gtco_attention_ref(
        ctypes.c_int(1 if dtype == "bf16" else 0), ctypes.c_int(v is not None), *args,
        out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(heads), ctypes.c_int64(head_dim),
        layouts["q"].encode(), layouts["k"].encode(), layouts.get("v", "bhsd").encode(),
        layouts.get("out", "bhsd").encode(), ctypes.c_float(scale), ctypes.c_int(int(causal)),
        ctypes.c_int(int(nan_guard)), ctypes.c_float(mask_scale), ctypes.c_float(bias_scale), err,
        ctypes.c_int(len(err)))
    assert rc == 0, err.value.decode()
    return out.astype(np.float64)


# (a) ------------------------------------------------------------------------------------------------------------

LAYOUT_SETS = {
    "bhsd": {"q": "bhsd", "k": "bhsd", "v": "bhsd", "out": "bhsd"},
    "bshd": {"q": "bshd", "k": "bshd", "v": "bshd", "out": "bshd"},
    "merged": {"q": "bshd_merged", "k": "bshd_merged", "v": "bshd_merged", "out": "bshd_merged"},
    "packed": {"q": "qkv_packed", "k": "qkv_packed", "v": "qkv_packed", "out": "bshd_merged"},
    "mixed_kt": {"q": "bhsd", "k": "bhds", "v": "bshd", "out": "bshd_merged"},
}
SHAPES = [(197, 197, 64), (50, 197, 32), (197, 50, 80)]  # (seq_q, seq_k, head_dim)


def _operands(rng, lay, b, h, sq, sk, d):
    """Random operands in their layouts, and the same as [B,H,S,D]."""
    if lay["q"] == "qkv_packed":
        qkv = rng.standard_normal(layout_shape("qkv_packed", b, h, sq, d)).astype(np.float32)
        arrays = {"q": qkv, "k": qkv, "v": qkv}
    else:
        arrays = {r: rng.standard_normal(layout_shape(lay[r], b, h, sq if r == "q" else sk, d)).astype(np.float32)
                  for r in ("q", "k", "v")}
    bhsd = {r: to_bhsd(arrays[r].astype(np.float64), lay[r], b, h, sq if r == "q" else sk, d, i)
            for i, r in enumerate(("q", "k", "v"))}
    return arrays, bhsd


def _key_padding(b: int, sk: int, value: float = -10000.0) -> np.ndarray:
    mask = np.zeros((b, 1, 1, sk), np.float32)
    for i in range(b):
        mask[i, ..., sk - (1 + 7 * i) % max(1, sk // 3) - 1:] = value
    return mask


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"q{a}_k{b}_d{c}" for a, b, c in SHAPES])
@pytest.mark.parametrize("lay_name", list(LAYOUT_SETS))
def test_reference_matches_numpy(ref_lib, lay_name: str, shape: tuple[int, int, int], masked: bool) -> None:
    sq, sk, d = shape
    lay = LAYOUT_SETS[lay_name]
    if lay_name == "packed" and sq != sk:
        sq = sk  # one packed tensor holds q, k and v of one sequence
    b, h = 2, 3
    rng = np.random.default_rng(sq * 1000 + sk + d + len(lay_name) + masked)
    arrays, bhsd = _operands(rng, lay, b, h, sq, sk, d)
    mask = _key_padding(b, sk) if masked else None
    scale = 1.0 / math.sqrt(d)
    want = from_bhsd(np_attention(bhsd["q"], bhsd["k"], bhsd["v"], scale, mask), lay["out"])
    got = run_ref(ref_lib, q=arrays["q"], k=arrays["k"], v=arrays["v"], heads=h, head_dim=d, layouts=lay,
                  scale=scale, out_shape=want.shape, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # BmmSoftmax over the same q, k (its output is always [B,H,Sq,Sk])
    want_p = np_probs(bhsd["q"], bhsd["k"], scale, mask)
    got_p = run_ref(ref_lib, q=arrays["q"], k=arrays["k"], v=None, heads=h, head_dim=d,
                    layouts={"q": lay["q"], "k": lay["k"]}, scale=scale, out_shape=want_p.shape, mask=mask)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mask_shape", [(1, 1, 50, 64), (2, 3, 50, 64), (50, 64), (64,), (2, 1, 1, 64)])
def test_reference_mask_and_bias_broadcast(ref_lib, mask_shape: tuple[int, ...]) -> None:
    b, h, sq, sk, d = 2, 3, 50, 64, 32
    rng = np.random.default_rng(len(mask_shape))
    lay = LAYOUT_SETS["bhsd"]
    arrays, bhsd = _operands(rng, lay, b, h, sq, sk, d)
    mask = np.where(rng.random(mask_shape) < 0.2, -10000.0, 0.0).astype(np.float32)
    bias = rng.standard_normal((1, h, sq, sk)).astype(np.float32)
    want = np_attention(bhsd["q"], bhsd["k"], bhsd["v"], 0.3, mask, bias)
    got = run_ref(ref_lib, q=arrays["q"], k=arrays["k"], v=arrays["v"], heads=h, head_dim=d, layouts=lay,
                  scale=0.3, out_shape=want.shape, mask=mask, bias=bias)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nan_guard", [False, True], ids=["plain", "nan_guard"])
def test_reference_fully_masked_rows(ref_lib, nan_guard: bool) -> None:
    """-inf on every key of a row: ONNX Softmax gives NaN there; the guard Where(IsNaN(P), 0, P) gives zeros."""
    b, h, sq, sk, d = 2, 2, 9, 11, 32
    rng = np.random.default_rng(7)
    lay = LAYOUT_SETS["bshd"]
    arrays, bhsd = _operands(rng, lay, b, h, sq, sk, d)
    mask = np.zeros((b, 1, sq, sk), np.float32)
    mask[0, 0, 3, :] = -np.inf        # row 3 of batch 0 sees no key
    mask[1, 0, :, 5:] = -np.inf       # batch 1: keys 5.. masked, rows still valid
    want = from_bhsd(np_attention(bhsd["q"], bhsd["k"], bhsd["v"], 0.2, mask, nan_guard=nan_guard), "bshd")
    got = run_ref(ref_lib, q=arrays["q"], k=arrays["k"], v=arrays["v"], heads=h, head_dim=d, layouts=lay,
                  scale=0.2, out_shape=want.shape, mask=mask, nan_guard=nan_guard)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    dead = got[0, 3]  # bshd: [b, s, h, d]
    assert (np.all(dead == 0.0) if nan_guard else np.all(np.isnan(dead)))
    assert np.isfinite(np.delete(got, 3, axis=1)).all() and np.isfinite(got[1]).all()


def test_reference_causal_and_bf16(ref_lib) -> None:
    b, h, sq, sk, d = 1, 2, 33, 33, 64
    rng = np.random.default_rng(11)
    lay = LAYOUT_SETS["merged"]
    arrays, bhsd = _operands(rng, lay, b, h, sq, sk, d)
    want = from_bhsd(np_attention(bhsd["q"], bhsd["k"], bhsd["v"], 0.125, causal=True), "bshd_merged")
    got = run_ref(ref_lib, q=arrays["q"], k=arrays["k"], v=arrays["v"], heads=h, head_dim=d, layouts=lay,
                  scale=0.125, out_shape=want.shape, causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # bfloat16 storage: inputs rounded to bf16 first; P and O rounded to bf16 as the graph stores them
    rq = {r: arrays[r].astype(ml_dtypes.bfloat16).astype(np.float64) for r in arrays}
    bq = {r: to_bhsd(rq[r], "bshd_merged", b, h, sq, d) for r in rq}
    want16 = from_bhsd(np_attention(bq["q"], bq["k"], bq["v"], 0.125), "bshd_merged")
    got16 = run_ref(ref_lib, q=arrays["q"], k=arrays["k"], v=arrays["v"], heads=h, head_dim=d, layouts=lay,
                    scale=0.125, out_shape=want.shape, dtype="bf16")
    np.testing.assert_allclose(got16, want16, rtol=0.05, atol=0.02)
    assert not np.array_equal(got16, want16)  # really went through bf16 storage


# (b) ------------------------------------------------------------------------------------------------------------

def _attrs(fn: FusedNode) -> dict:
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in fn.attrs.items()}


def _concrete(shape: tuple, batch: int = 2) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else batch for d in shape)


def _run_function(model: onnx.ModelProto, fn: FusedNode, feeds: dict[int, np.ndarray]) -> np.ndarray:
    """The node alone, as a model with its function attached, run by onnxruntime (which inlines the function)."""
    inputs, inits = [], []
    for i, t in enumerate(fn.inputs):
        if i in feeds:
            inputs.append(helper.make_tensor_value_info(t.name, helper.np_dtype_to_tensor_dtype(feeds[i].dtype),
                                                        feeds[i].shape))
        else:
            assert t.value is not None, f"input {t.name} is neither a role nor a constant"
            inits.append(numpy_helper.from_array(np.asarray(t.value), t.name))
    out = fn.outputs[0]
    outputs = [helper.make_tensor_value_info(out.name, TensorProto.FLOAT,
                                             [d if isinstance(d, int) else None for d in out.shape])]
    graph = helper.make_graph([fn.node], "one", inputs, outputs, inits)
    one = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                            functions=[fn.function])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(one.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {fn.inputs[i].name: x for i, x in feeds.items()})[0]


def check_binding(model: onnx.ModelProto, fn: FusedNode, binding: Binding, lib: ctypes.CDLL, seed: int) -> None:
    """Evaluate the node's function on random role inputs; compare with numpy and the C++ reference per roles."""
    a = _attrs(fn)
    roles = dict(zip(IN_ROLES, binding.inputs, strict=True))
    with_v = fn.family == "attention"
    rng = np.random.default_rng(seed)
    feeds: dict[int, np.ndarray] = {}
    for role in ("q", "k", "v", "bias"):
        i = roles[role]
        if i >= 0 and i not in feeds:
            feeds[i] = rng.standard_normal(_concrete(fn.inputs[i].shape)).astype(np.float32)
    if roles["mask"] >= 0:
        shape = _concrete(fn.inputs[roles["mask"]].shape)
        mask = np.where(rng.random(shape) < 0.25, -10000.0, 0.0)
        if a.get("mask_scale", 1.0) != 1.0:  # moderate values too, where scaling the mask or not differs
            mask += rng.standard_normal(shape)
        feeds[roles["mask"]] = mask.astype(np.float32)
    got = _run_function(model, fn, feeds)

    h, d, scale = a["heads"], a["head_dim"], a["scale"]
    lay = {r: a[f"{r}_layout"] for r in ("q", "k", "v", "out") if f"{r}_layout" in a}
    b = feeds[roles["q"]].shape[0]
    seq = {"q": feeds[roles["q"]].shape[1 if lay["q"] != "bhsd" else 2]}
    kshape = feeds[roles["k"]].shape
    seq["k"] = kshape[3] if lay["k"] == "bhds" else kshape[1 if lay["k"] != "bhsd" else 2]
    bhsd = {r: to_bhsd(feeds[roles[r]].astype(np.float64), lay[r], b, h, seq["q" if r == "q" else "k"], d, w)
            for w, r in enumerate(("q", "k", "v")) if r in lay}
    mask = feeds.get(roles["mask"]) if roles["mask"] >= 0 else None
    bias = feeds.get(roles["bias"]) if roles["bias"] >= 0 else None
    guard, causal = bool(a.get("nan_guard", 0)), bool(a.get("causal", 0))
    scales = {"mask_scale": a.get("mask_scale", 1.0), "bias_scale": a.get("bias_scale", 1.0)}
    if with_v:
        want = from_bhsd(np_attention(bhsd["q"], bhsd["k"], bhsd["v"], scale, mask, bias, causal=causal,
                                      nan_guard=guard, **scales), lay["out"])
    else:
        want = np_probs(bhsd["q"], bhsd["k"], scale, mask, bias, nan_guard=guard, **scales)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    cpp = run_ref(lib, q=feeds[roles["q"]], k=feeds[roles["k"]], v=feeds[roles["v"]] if with_v else None,
                  heads=h, head_dim=d, layouts=lay, scale=scale, out_shape=got.shape, mask=mask, bias=bias,
                  causal=causal, nan_guard=guard, **scales)
    np.testing.assert_allclose(cpp, got, rtol=1e-4, atol=1e-5)


MODELS = [
    ("vit-tiny", {}),
    ("vit-tiny", {"qkv": "split", "depth": 2}),
    ("vit-tiny", {"batch": "N", "depth": 2}),
    ("deit-b", {"depth": 1}),
    ("bert-tiny", {}),
    ("bert-tiny", {"qkv": "fused"}),
    ("bert-tiny", {"batch": "N", "mask_value": float(np.finfo(np.float32).min)}),
]
# what each model's attention nodes bind to, by node input name (suffix) per role
EXPECT = {
    "vit-tiny": {"q": "attn.qkv.add", "k": "attn.qkv.add", "v": "attn.qkv.add", "mask": None},
    # separate Q, K, V projections are packed into one GEMM whose output the attention reads (families/gemm/pack.py)
    "vit-tiny/split": {"q": "attn.q.matmul.qkv_packed.add", "k": "attn.q.matmul.qkv_packed.add",
                       "v": "attn.q.matmul.qkv_packed.add", "mask": None},
    "deit-b": {"q": "attn.qkv.add", "k": "attn.qkv.add", "v": "attn.qkv.add", "mask": None},
    "bert-tiny": {"q": "query.matmul.qkv_packed.add", "k": "query.matmul.qkv_packed.add",
                  "v": "query.matmul.qkv_packed.add", "mask": "extended_mask.fill"},
    "bert-tiny/fused": {"q": "qkv.add", "k": "qkv.add", "v": "qkv.add", "mask": "extended_mask.fill"},
}


@pytest.mark.parametrize(("name", "overrides"), MODELS, ids=[f"{n}-{'-'.join(map(str, o.values())) or 'default'}"
                                                             for n, o in MODELS])
def test_binders_on_builtin_models(ref_lib, name: str, overrides: dict) -> None:
    model = build(name, seed=0, **overrides)
    result = optimize(model, GtcoConfig())
    nodes = [fn for fn in fused_nodes(result.model) if fn.family in BINDER]
    depth = overrides.get("depth", 12 if name.startswith(("vit", "deit")) else 2)
    assert len(nodes) == depth, [fn.node.op_type for fn in nodes]
    key = name + ("/" + overrides["qkv"] if overrides.get("qkv") in ("split", "fused") else "")
    expect = EXPECT[key]
    checked = set()
    for fn in nodes:
        binding = BINDER[fn.family].bind(fn)
        assert isinstance(binding, Binding), f"{fn.node.name}: {binding}"
        assert binding.outputs == (0,)
        for role, suffix in expect.items():
            i = binding.inputs[IN_ROLES.index(role)]
            if suffix is None:
                assert i == -1, (fn.node.name, role)
            else:
                assert fn.node.input[i].endswith(suffix), (fn.node.name, role, fn.node.input[i])
        assert binding.inputs[IN_ROLES.index("bias")] == -1
        sig = (fn.node.overload, repr(sorted(_attrs(fn).items())))
        if sig not in checked:  # identical blocks: evaluate one of each
            checked.add(sig)
            check_binding(result.model, fn, binding, ref_lib, seed=len(checked))


def small_model(*, guard: bool = False, probs_out: bool = False, mask: bool = False, bias: bool = False,
                k_transposed: bool = True, seq: int = 13, heads: int = 2, head_dim: int = 32,
                dtype: type = np.float32, einsum: bool = False, scale_after: bool = False) -> onnx.ModelProto:
    """q, k, v [1,H,S,D] (k [1,H,D,S] unless k_transposed) -> softmax(QKᵀ*s [+mask] [+bias]) [guarded] V;
    probs_out also returns P (then the group is a BmmSoftmax). einsum: both products are tf2onnx's Einsums
    ("bhqd,bhkd->bhqk" on k as it is, "bhqk,bhkd->bhqd"). scale_after: softmax((QKᵀ [+mask] [+bias]) * s), the
    scale after the additive terms (which it scales too)."""
    b, h, s, d = 1, heads, seq, head_dim
    k_transposed = k_transposed and not einsum
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    ins = [helper.make_tensor_value_info(n, et, [b, h, d, s] if n == "k" and not k_transposed and not einsum
                                         else [b, h, s, d]) for n in "qkv"]
    inits = [numpy_helper.from_array(np.array(0.25, dtype), "sc"),
             numpy_helper.from_array(np.array(0.0, dtype), "zero")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])] if k_transposed else []
    qk = (helper.make_node("Einsum", ["q", "k"], ["s0"], equation="bhqd,bhkd->bhqk") if einsum else
          helper.make_node("MatMul", ["q", "kt" if k_transposed else "k"], ["s0"]))
    nodes.append(qk)
    scores = "s0"
    if not scale_after:
        nodes.append(helper.make_node("Mul", ["s0", "sc"], ["s1"]))
        scores = "s1"
    if mask:
        ins.append(helper.make_tensor_value_info("mask", et, [b, 1, s, s]))
        nodes.append(helper.make_node("Add", [scores, "mask"], ["s2"]))
        scores = "s2"
    if bias:
        rng = np.random.default_rng(3)
        inits.append(numpy_helper.from_array(rng.standard_normal((1, h, s, s)).astype(dtype), "rel_bias"))
        nodes.append(helper.make_node("Add", [scores, "rel_bias"], ["s3"]))
        scores = "s3"
    if scale_after:
        nodes.append(helper.make_node("Mul", [scores, "sc"], ["s4"]))
        scores = "s4"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=-1))
    probs = "p"
    if guard:
        nodes += [helper.make_node("IsNaN", ["p"], ["isn"]), helper.make_node("Where", ["isn", "zero", "p"], ["pg"])]
        probs = "pg"
    nodes.append(helper.make_node("Einsum", [probs, "v"], ["o"], equation="bhqk,bhkd->bhqd") if einsum else
                 helper.make_node("MatMul", [probs, "v"], ["o"]))
    outs = [helper.make_tensor_value_info("o", et, [b, h, s, d])]
    if probs_out:
        outs.append(helper.make_tensor_value_info("p", et, [b, h, s, s]))
    graph = helper.make_graph(nodes, "small", ins, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


SWIN = {"images": 2, "windows": 4, "heads": 2, "tokens": 16, "head_dim": 32}


def swin_window_mask(windows: int, tokens: int, seed: int = 7) -> np.ndarray:
    """A shift mask [1, nW, 1, N, N] of 0 / -100 (Swin's values), different per window, no row fully masked."""
    m = np.where(np.random.default_rng(seed).random((1, windows, 1, tokens, tokens)) < 0.4, -100.0, 0.0)
    idx = np.arange(tokens)
    m[..., idx, idx] = 0.0  # every token sees itself
    return m


def swin_model(*, dtype: type = np.float32, seed: int = 3, probs_out: bool = False, **dims: int) -> onnx.ModelProto:
    """Swin's shifted-window attention as timm exports it: q, k, v [B*nW, H, N, D]; q * s @ kᵀ + relative position
    bias [1, H, N, N] -> Reshape [B, nW, H, N, N] + shift mask [1, nW, 1, N, N] -> Reshape back -> Softmax -> @ v
    (probs_out also returns P: then the group is a BmmSoftmax)."""
    d = SWIN | dims
    b, nw, h, n, hd = d["images"], d["windows"], d["heads"], d["tokens"], d["head_dim"]
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(seed)
    ins = [helper.make_tensor_value_info(x, et, [b * nw, h, n, hd]) for x in "qkv"]
    inits = [numpy_helper.from_array(np.array(hd ** -0.5, dtype), "sc"),
             numpy_helper.from_array(rng.standard_normal((1, h, n, n)).astype(dtype), "rel_bias"),
             numpy_helper.from_array(swin_window_mask(nw, n).astype(dtype), "shift_mask"),
             numpy_helper.from_array(np.array([b, nw, h, n, n], np.int64), "to_win"),
             numpy_helper.from_array(np.array([b * nw, h, n, n], np.int64), "from_win")]
    nodes = [helper.make_node("Mul", ["q", "sc"], ["qs"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qs", "kt"], ["s0"]),
             helper.make_node("Add", ["s0", "rel_bias"], ["s1"]),
             helper.make_node("Reshape", ["s1", "to_win"], ["s2"]),
             helper.make_node("Add", ["s2", "shift_mask"], ["s3"]),
             helper.make_node("Reshape", ["s3", "from_win"], ["s4"]),
             helper.make_node("Softmax", ["s4"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    outs = [helper.make_tensor_value_info("o", et, [b * nw, h, n, hd])]
    if probs_out:
        outs.append(helper.make_tensor_value_info("p", et, [b * nw, h, n, n]))
    graph = helper.make_graph(nodes, "swin_window", ins, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def swin_reference(model: onnx.ModelProto, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """swin_model in float64 numpy: the window mask tiled over the images (batch row b reads window b % nW)."""
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    mask = inits["shift_mask"][0]  # [nW, 1, N, N]
    mask = np.tile(mask, (q.shape[0] // mask.shape[0], 1, 1, 1))
    return np_attention(q, k, v, float(inits["sc"]), mask, inits["rel_bias"])


def test_swin_shifted_windows_bind_as_one_attention_node(ref_lib) -> None:
    """The shifted-window chain is one Attention node whose mask (the 5-D shift mask) is read at row b % nW; its
    function equals the float64 reference, and the binder refuses a period that does not divide the batch."""
    model = swin_model()
    result = optimize(model, GtcoConfig())
    nodes = [fn for fn in fused_nodes(result.model) if fn.family in BINDER]
    assert [fn.family for fn in nodes] == ["attention"]
    fn = nodes[0]
    a = _attrs(fn)
    assert (a["mask_period"], a["mask"], a["bias"], a.get("scores_path", [])) == (4, 1, 1, [])
    binding = BINDER["attention"].bind(fn)
    assert isinstance(binding, Binding), binding
    names = {r: fn.node.input[i] if i >= 0 else None for r, i in zip(IN_ROLES, binding.inputs, strict=True)}
    assert (names["mask"], names["bias"]) == ("shift_mask", "rel_bias")
    rng = np.random.default_rng(11)
    feeds = {binding.inputs[IN_ROLES.index(r)]: rng.standard_normal((8, 2, 16, 32)).astype(np.float32) for r in "qkv"}
    got = _run_function(result.model, fn, feeds)
    want = swin_reference(model, *(feeds[binding.inputs[IN_ROLES.index(r)]].astype(np.float64) for r in "qkv"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    odd = replace(fn, attrs={**fn.attrs, "mask_period": 3})
    assert BINDER["attention"].bind(odd) == "mask_period 3 does not divide the batch 8"


@pytest.mark.parametrize("kw", [{"guard": True, "mask": True}, {"bias": True, "mask": True},
                                {"probs_out": True, "mask": True}, {"probs_out": True, "bias": True},
                                {"k_transposed": False, "seq": 50, "head_dim": 80},
                                {"einsum": True, "mask": True}, {"einsum": True, "probs_out": True, "bias": True},
                                {"scale_after": True, "mask": True, "bias": True},
                                {"scale_after": True, "mask": True, "probs_out": True}],
                         ids=["guard_mask", "mask_bias", "bmm_mask", "bmm_bias", "k_untransposed", "einsum",
                              "einsum_bmm", "scale_after_mask", "scale_after_mask_bmm"])
def test_binders_on_small_models(ref_lib, kw: dict) -> None:
    model = small_model(**kw)
    result = optimize(model, GtcoConfig())
    nodes = [fn for fn in fused_nodes(result.model) if fn.family in BINDER]
    assert len(nodes) == 1
    fn = nodes[0]
    assert fn.family == ("bmm_softmax" if kw.get("probs_out") else "attention")
    binding = BINDER[fn.family].bind(fn)
    assert isinstance(binding, Binding), binding
    roles = dict(zip(IN_ROLES, binding.inputs, strict=True))
    names = {r: fn.node.input[i] if i >= 0 else None for r, i in roles.items()}
    assert names["q"] == "q" and names["mask"] == ("mask" if kw.get("mask") else None)
    assert names["bias"] == ("rel_bias" if kw.get("bias") else None)
    assert names["v"] == (None if kw.get("probs_out") else "v")
    assert names["k"] in ("k", "kt")
    assert _attrs(fn).get("nan_guard", 0) == int(kw.get("guard", False))
    after = 0.25 if kw.get("scale_after") else 1.0  # small_model's scale, applied after the mask (and the bias)
    assert (_attrs(fn).get("mask_scale", 1.0), _attrs(fn).get("bias_scale", 1.0)) == (
        after if kw.get("mask") else 1.0, after if kw.get("bias") else 1.0)
    check_binding(result.model, fn, binding, ref_lib, seed=5)


def test_nan_guard_binding_matches_graph_on_fully_masked_rows(ref_lib) -> None:
    """The function (ONNX Softmax + guard) and the C++ reference agree on rows whose every key is -inf."""
    model = small_model(guard=True, mask=True)
    result = optimize(model, GtcoConfig())
    fn = next(f for f in fused_nodes(result.model) if f.family == "attention")
    binding = BINDER["attention"].bind(fn)
    assert isinstance(binding, Binding), binding
    roles = dict(zip(IN_ROLES, binding.inputs, strict=True))
    rng = np.random.default_rng(0)
    feeds = {roles[r]: rng.standard_normal((1, 2, 13, 32)).astype(np.float32) for r in ("q", "k", "v")}
    mask = np.zeros((1, 1, 13, 13), np.float32)
    mask[0, 0, 4] = -np.inf
    feeds[roles["mask"]] = mask
    got = _run_function(result.model, fn, feeds)
    assert np.all(got[0, :, 4] == 0.0) and np.isfinite(got).all()
    cpp = run_ref(ref_lib, q=feeds[roles["q"]], k=feeds[roles["k"]], v=feeds[roles["v"]], heads=2, head_dim=32,
                  layouts={"q": "bhsd", "k": _attrs(fn)["k_layout"], "v": "bhsd", "out": "bhsd"}, scale=0.25,
                  out_shape=got.shape, mask=mask, nan_guard=True)
    np.testing.assert_allclose(cpp, got, rtol=1e-4, atol=1e-5)


def onnx_attention_model(*, causal: bool = False, merged: bool = False, mask: bool = False, sq: int = 16,
                         sk: int = 16, heads: int = 2, head_dim: int = 32, kv_heads: int | None = None,
                         scale: float | None = None) -> onnx.ModelProto:
    """One ONNX Attention op (opset 23): q/k/v [1,H,S,D], or [1,S,H*D] with q_num_heads/kv_num_heads (merged)."""
    kvh = kv_heads or heads

    def shape(s: int, h: int) -> list[int]:
        return [1, s, h * head_dim] if merged else [1, h, s, head_dim]

    ins = [helper.make_tensor_value_info("q", TensorProto.FLOAT, shape(sq, heads)),
           helper.make_tensor_value_info("k", TensorProto.FLOAT, shape(sk, kvh)),
           helper.make_tensor_value_info("v", TensorProto.FLOAT, shape(sk, kvh))]
    names = ["q", "k", "v"]
    if mask:
        ins.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, sq, sk]))
        names.append("mask")
    attrs: dict = {"is_causal": int(causal)}
    if merged:
        attrs |= {"q_num_heads": heads, "kv_num_heads": kvh}
    if scale is not None:
        attrs["scale"] = scale
    node = helper.make_node("Attention", names, ["o"], **attrs)
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, shape(sq, heads))
    graph = helper.make_graph([node], "onnx_attention", ins, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


ONNX_ATTENTION = {
    "plain": {},
    "causal": {"causal": True},
    "causal_cross": {"causal": True, "sq": 9, "sk": 20, "scale": 0.3},
    "merged_cross": {"merged": True, "sq": 50, "sk": 31, "head_dim": 80},
    "mask": {"mask": True},
    "gqa": {"kv_heads": 1, "heads": 4},
}
ONNX_ATTENTION_REASONS = {"gqa": "heads"}


def test_onnx_attention_with_a_run_time_mask_gives_zeros_for_fully_masked_rows(ref_lib, calibrated) -> None:
    """ONNX's Attention op gives zeros for a row whose every key attn_mask takes out (as onnxruntime does): the
    node is guarded (nan_guard), so the C++ reference gives the same zeros where it would give NaN unguarded."""
    calibrated("sm_90", vendor_gemm={"extra_us": 100.0})
    result = optimize(onnx_attention_model(mask=True, sq=13, sk=13), GtcoConfig())
    fn = next(f for f in fused_nodes(result.model) if f.family == "attention")
    roles = dict(zip(IN_ROLES, BINDER["attention"].bind(fn).inputs, strict=True))  # type: ignore[union-attr]
    rng = np.random.default_rng(1)
    feeds = {roles[r]: rng.standard_normal((1, 2, 13, 32)).astype(np.float32) for r in ("q", "k", "v")}
    mask = rng.standard_normal((1, 1, 13, 13)).astype(np.float32)
    mask[0, 0, 4] = -np.inf
    feeds[roles["mask"]] = mask
    got = _run_function(result.model, fn, feeds)
    assert np.all(got[0, :, 4] == 0.0) and np.isfinite(got).all()
    args = {r: feeds[roles[r]] for r in ("q", "k", "v")}
    cpp = run_ref(ref_lib, **args, heads=2, head_dim=32, layouts=dict.fromkeys(("q", "k", "v", "out"), "bhsd"),
                  scale=32 ** -0.5, out_shape=got.shape, mask=mask, nan_guard=True)
    np.testing.assert_allclose(cpp, got, rtol=1e-4, atol=1e-5)
    unguarded = run_ref(ref_lib, **args, heads=2, head_dim=32, layouts=dict.fromkeys(("q", "k", "v", "out"), "bhsd"),
                        scale=32 ** -0.5, out_shape=got.shape, mask=mask)
    assert np.isnan(unguarded[0, :, 4]).all()


@pytest.mark.parametrize("case", list(ONNX_ATTENTION))
def test_binder_on_onnx_attention_op(ref_lib, case: str, calibrated) -> None:
    # ORT's own Attention priced dear (the vendor GEMM's estimate stands in for it), so that the node fuses at
    # these small shapes and the binder is what is tested
    calibrated("sm_90", vendor_gemm={"extra_us": 100.0})
    model = onnx_attention_model(**ONNX_ATTENTION[case])
    try:
        result = optimize(model, GtcoConfig())
    except Exception as e:  # an optimizer without opset-23 Attention support
        pytest.skip(f"optimize does not take an opset-23 Attention model: {e}")
    nodes = [fn for fn in fused_nodes(result.model) if fn.family in BINDER]
    assert nodes, "the optimizer did not fuse the ONNX Attention op"
    fn = nodes[0]
    binding = BINDER[fn.family].bind(fn)
    if case in ONNX_ATTENTION_REASONS:
        assert isinstance(binding, str) and ONNX_ATTENTION_REASONS[case] in binding, binding
        return
    assert isinstance(binding, Binding), binding
    assert [fn.node.input[i] for i in binding.inputs[:3]] == ["q", "k", "v"]
    # a run-time attn_mask is read as the additive mask it is; a row it masks throughout gives zeros, as the op
    # defines (the node's nan_guard)
    assert [fn.node.input[i] if i >= 0 else None for i in binding.inputs[3:]] == [
        "mask" if case == "mask" else None, None]
    assert bool(fn.attrs.get("nan_guard", 0)) == (case == "mask")
    check_binding(result.model, fn, binding, ref_lib, seed=9)


# doctored nodes: the binder must refuse, saying why


@pytest.fixture(scope="module")
def vit_node() -> FusedNode:
    result = optimize(build("vit-tiny", depth=1, seed=0), GtcoConfig())
    return next(fn for fn in fused_nodes(result.model) if fn.family == "attention")


@pytest.fixture(scope="module")
def bert_node() -> FusedNode:
    result = optimize(build("bert-tiny", depth=1, seed=0), GtcoConfig())
    return next(fn for fn in fused_nodes(result.model) if fn.family == "attention")


def test_binder_refuses_inconsistent_attributes(vit_node: FusedNode, bert_node: FusedNode) -> None:
    b = BINDER["attention"]
    why = b.bind(replace(bert_node, attrs={**bert_node.attrs, "mask": 0}))
    assert isinstance(why, str) and "mask is a node input its attributes rule out" in why, why
    why = b.bind(replace(bert_node, attrs={**bert_node.attrs, "roles": ["q", "k", "v"]}))
    assert isinstance(why, str) and "mask is not a node input" in why, why
    why = b.bind(replace(vit_node, attrs={**vit_node.attrs, "scores_path": ["Reshape", "Reshape"]}))
    assert isinstance(why, str) and "Reshape, Reshape between QKᵀ and the Softmax" in why, why
    why = b.bind(replace(vit_node, attrs={**vit_node.attrs, "heads": b"?"}))
    assert isinstance(why, str) and "heads" in why, why
    why = b.bind(replace(vit_node, attrs={**vit_node.attrs, "batch_dims": [2, 1]}))
    assert isinstance(why, str) and "batch_dims" in why, why
    why = b.bind(replace(vit_node, attrs={**vit_node.attrs, "out_layout": b"bhds"}))
    assert isinstance(why, str) and "out_layout" in why, why
    why = BINDER["bmm_softmax"].bind(vit_node)
    assert isinstance(why, str) and "family" in why, why


def test_binder_refuses_wrong_mask_shape_and_dtype(bert_node: FusedNode) -> None:
    i = next(i for i, t in enumerate(bert_node.inputs) if t.name == "extended_mask.fill")
    ins = list(bert_node.inputs)
    ins[i] = replace(ins[i], shape=(1, 1, 7, 128))
    why = BINDER["attention"].bind(replace(bert_node, inputs=tuple(ins)))
    assert isinstance(why, str) and "does not broadcast" in why, why
    ins[i] = replace(bert_node.inputs[i], dtype="f16")
    why = BINDER["attention"].bind(replace(bert_node, inputs=tuple(ins)))
    assert isinstance(why, str) and "is f16" in why, why


def test_binder_protocol_fields() -> None:
    att, bmm = BINDER["attention"], BINDER["bmm_softmax"]
    assert (att.header, att.cpp_struct) == ("attention/attention_op.h", "gtco::Attention")
    assert (bmm.header, bmm.cpp_struct) == ("attention/attention_op.h", "gtco::BmmSoftmax")
    assert IN_ROLES == ("q", "k", "v", "mask", "bias")
    text = (ROOT / "plugins" / "families" / "attention" / "attention_op.h").read_text()
    assert "enum InRole { IN_Q = 0, IN_K = 1, IN_V = 2, IN_MASK = 3, IN_BIAS = 4 };" in text
    assert "using Attention = AttentionGlue<true>;" in text and "using BmmSoftmax = AttentionGlue<false>;" in text
    with pytest.raises(ValueError):
        AttentionBinder("gemm")


# (c) ------------------------------------------------------------------------------------------------------------


def _ort_include() -> Path:
    """ORT's C/C++ API headers, fetched once by the library builder (onnx_gtco.plugin.headers)."""
    return ort_include_dir()


def test_glue_header_compiles(tmp_path: Path) -> None:
    inc = _ort_include()
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "tu.cc"
    inst = "\n".join(f"template struct FusedOp<{f}, DType::{d}, {c}>;\n"
                     f"template struct FusedKernel<{f}, DType::{d}, {c}>;"
                     for f in ("Attention", "BmmSoftmax") for d in ("f32", "f16", "bf16") for c in ("false", "true"))
    src.write_text(
        '#include "attention/attention_op.h"\nnamespace gtco {\n'
        'const NodeSpec kNodes[] = {{"Attention_f32", "n", 1, 1, {0, 0, 0, -1, -1, -1, -1, -1}, '
        '{0, -1, -1, -1, -1, -1, -1, -1}, {nullptr, nullptr}, {nullptr, nullptr}, nullptr}};\n'
        'const size_t kNodeCount = 1;\n' + inst +
        '\nvoid add_ops(Ort::CustomOpDomain& d, bool) {\n'
        '    static FusedOp<Attention, DType::f32, false> a("Attention_f32");\n    d.Add(&a);\n}'
        '\nconst char* const kLibraryInfo = "{}";\n}  // namespace gtco\n#include "register.inc"\n')
    proc = subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                           *(f"-I{d}" for d in GLUE_INCLUDE_DIRS), f"-I{inc}", str(src)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


# (d) ------------------------------------------------------------------------------------------------------------
# The glue itself in onnxruntime: a library built from attention_op.h with a hand-written node table (what the
# library builder generates), registered in a session; the custom kernel (not the function) runs the node.

E2E = {  # name -> (model builder, family)
    "bert": (lambda: build("bert-tiny", depth=1, batch="N", seed=0), "attention"),
    "vit": (lambda: build("vit-tiny", depth=1, seed=0), "attention"),
    "bmm": (lambda: small_model(probs_out=True, mask=True, bias=True), "bmm_softmax"),
    "guard": (lambda: small_model(guard=True, mask=True, k_transposed=False), "attention"),
    "f16": (lambda: small_model(mask=True, bias=True, seq=40, head_dim=64, dtype=np.float16), "attention"),
    "einsum": (lambda: small_model(einsum=True, mask=True, bias=True, seq=21), "attention"),
    "scale_after": (lambda: small_model(scale_after=True, mask=True, bias=True, seq=21), "attention"),
    "onnx_causal": (lambda: onnx_attention_model(causal=True, merged=True, sq=9, sk=20, head_dim=64), "attention"),
    "swin": (swin_model, "attention"),
    "swin_bmm": (lambda: swin_model(probs_out=True), "bmm_softmax"),
}


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory):
    inc = _ort_include()
    cases, rows = {}, []
    for name, (make, family) in E2E.items():
        with pytest.MonkeyPatch.context() as mp:
            if name.startswith("onnx_"):  # ORT's own Attention priced dear, so that the op fuses at this small shape
                folder = tmp_path_factory.mktemp("calibration")
                write_calibration(folder, "sm_90", vendor_gemm={"extra_us": 100.0})
                mp.setenv(CALIBRATION_DIR_ENV, str(folder))
            hardware.cache_clear()
            result = optimize(make(), GtcoConfig(pack_qkv=False))  # BERT's q, k, v as three bshd_merged inputs
        hardware.cache_clear()
        fn = next(f for f in fused_nodes(result.model) if f.family == family)
        binding = BINDER[family].bind(fn)
        assert isinstance(binding, Binding), binding
        cases[name] = (result.model, fn, binding)
        pad = [*binding.inputs, *[-1] * 8][:8], [*binding.outputs, *[-1] * 8][:8]
        rows.append(f'{{"{fn.node.op_type}", "{fn.node.name}", {len(fn.node.input)}, {len(fn.node.output)}, '
                    f'{{{", ".join(map(str, pad[0]))}}}, {{{", ".join(map(str, pad[1]))}}}, '
                    '{nullptr, nullptr}, {nullptr, nullptr}, nullptr}')
    src = tmp_path_factory.mktemp("attn_e2e") / "lib.cc"
    src.write_text(
        '#include "attention/attention_op.h"\nnamespace gtco {\nconst NodeSpec kNodes[] = {\n' + ",\n".join(rows) +
        f"}};\nconst size_t kNodeCount = {len(rows)};\n"
        "void add_ops(Ort::CustomOpDomain& d, bool) {\n"
        '    static FusedOp<Attention, DType::f32, false> a("Attention_f32");\n'
        '    static FusedOp<BmmSoftmax, DType::f32, false> b("BmmSoftmax_f32");\n'
        '    static FusedOp<Attention, DType::f16, false> c("Attention_f16");\n'
        "    d.Add(&a);\n    d.Add(&b);\n    d.Add(&c);\n}\n"
        'const char* const kLibraryInfo = "{}";\n}  // namespace gtco\n#include "register.inc"\n')
    lib = src.with_name("libgtco_attn_test.so")
    cxx_build(src, lib, include_dirs=[*GLUE_INCLUDE_DIRS, inc],
              extra=("-O1", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"),
              timeout_s=300)
    return lib, cases


def _one_node_session(model: onnx.ModelProto, fn: FusedNode, feeds: dict[int, np.ndarray], lib: Path | None,
                      free_shapes: bool = False):
    inputs, inits = [], []
    for i, t in enumerate(fn.inputs):
        if i in feeds:
            shape = [d if isinstance(d, int) else None for d in t.shape] if t.shape is not None else None
            if free_shapes:  # inputs of any shape: what the kernel is fed reaches its checks
                shape = [None] * feeds[i].ndim
            et = helper.np_dtype_to_tensor_dtype(feeds[i].dtype)
            inputs.append(helper.make_tensor_value_info(t.name, et, shape))
        else:
            inits.append(numpy_helper.from_array(np.asarray(t.value), t.name))
    out = fn.outputs[0]
    et = TensorProto.FLOAT16 if fn.dtype == "f16" else TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info(out.name, et, [d if isinstance(d, int) else None for d in out.shape])]
    one = helper.make_model(helper.make_graph([fn.node], "one", inputs, outputs, inits),
                            opset_imports=list(model.opset_import), ir_version=model.ir_version,
                            functions=[fn.function])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if lib is not None:
        so.add_session_config_entry("gtco.register", "all")  # the CPU kernels too
        so.register_custom_ops_library(str(lib))
    sess = ort.InferenceSession(one.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, {fn.inputs[i].name: x for i, x in feeds.items()})[0]


def _feeds(fn: FusedNode, binding: Binding, rng, batch: int = 2) -> dict[int, np.ndarray]:
    roles = dict(zip(IN_ROLES, binding.inputs, strict=True))
    feeds = {}
    for role in ("q", "k", "v", "mask", "bias"):
        i = roles[role]
        if i >= 0 and i not in feeds:
            shape = _concrete(fn.inputs[i].shape, batch)
            x = rng.standard_normal(shape)
            if role == "mask":
                x = np.where(x < -0.8, -np.inf if fn.attrs.get("nan_guard") else -10000.0, 0.0)
            feeds[i] = x.astype(np.float16 if fn.dtype == "f16" else np.float32)
    return feeds


@pytest.mark.parametrize("name", list(E2E))
def test_custom_kernel_in_onnxruntime_matches_function(e2e, name: str) -> None:
    lib, cases = e2e
    model, fn, binding = cases[name]
    feeds = _feeds(fn, binding, np.random.default_rng(len(name)))
    if name == "guard":  # a row with every key masked: NaN out of Softmax, zeros after the guard
        i = binding.inputs[IN_ROLES.index("mask")]
        feeds[i][..., 2, :] = -np.inf
    want = _one_node_session(model, fn, feeds, None)()
    got = _one_node_session(model, fn, feeds, lib)()
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = {"rtol": 2e-2, "atol": 2e-3} if fn.dtype == "f16" else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **tol)
    if name == "guard":
        assert np.all(got[0, :, 2] == 0.0)


def test_custom_kernel_reports_bad_shapes(e2e) -> None:
    lib, cases = e2e
    model, fn, binding = cases["bert"]  # batch is symbolic: the kernel sees what it is fed
    feeds = _feeds(fn, binding, np.random.default_rng(0), batch=2)
    mask_i = binding.inputs[IN_ROLES.index("mask")]
    feeds[mask_i] = np.zeros((3, 1, 1, 128), np.float32)  # batch 3 against q's 2
    run = _one_node_session(model, fn, feeds, lib)
    with pytest.raises(Exception, match=r"Attention_f32 node 'gtco/attention/[^']+': mask \[3,1,1,128\] does not "
                                        r"broadcast to the scores \[2,2,128,128\]"):
        run()
    feeds = _feeds(fn, binding, np.random.default_rng(0), batch=2)
    k_i = binding.inputs[IN_ROLES.index("k")]
    feeds[k_i] = np.zeros((2, 128, 100), np.float32)  # not H*D wide
    with pytest.raises(Exception, match=r"input k \[2,128,100\] does not fit bshd_merged \[B,S,128\]"):
        _one_node_session(model, fn, feeds, lib, free_shapes=True)()
    feeds = _feeds(fn, binding, np.random.default_rng(0), batch=2)
    v_i = binding.inputs[IN_ROLES.index("v")]
    feeds[k_i], feeds[v_i] = feeds[k_i][:, :100], feeds[v_i][:, :100]  # seq_k 100 against the node's seq_k=128
    with pytest.raises(Exception, match=r"give seq_k=100; the node says seq_k=128"):
        _one_node_session(model, fn, feeds, lib, free_shapes=True)()
    feeds[k_i] = feeds[k_i][:, :90]  # k and v disagree
    with pytest.raises(Exception, match=r"k and v have different sequence lengths: q \[2,128,128\], k \[2,90,128\]"):
        _one_node_session(model, fn, feeds, lib, free_shapes=True)()


def test_swin_custom_kernel_reads_the_window_mask_per_row(e2e) -> None:
    """The CPU kernel of the shifted-window node matches the float64 reference (each batch row adds the mask of
    window b % nW), and a mask that does not fit the period is refused by the kernel, naming both."""
    lib, cases = e2e
    model, fn, binding = cases["swin"]
    roles = dict(zip(IN_ROLES, binding.inputs, strict=True))
    rng = np.random.default_rng(5)
    feeds = {roles[r]: rng.standard_normal((8, 2, 16, 32)).astype(np.float32) for r in "qkv"}
    got = _one_node_session(model, fn, feeds, lib)()
    want = swin_reference(model, *(feeds[roles[r]].astype(np.float64) for r in "qkv"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    feeds[roles["mask"]] = swin_window_mask(3, 16).astype(np.float32)
    with pytest.raises(Exception, match=r"mask \[1,3,1,16,16\] with mask_period=4 does not broadcast to "
                                        r"\[1, 4, 2, 16, 16\]"):
        _one_node_session(model, fn, feeds, lib, free_shapes=True)()


def test_scale_after_the_mask_scales_it_in_the_custom_kernel(e2e) -> None:
    """softmax((QKᵀ + mask + bias) * s) V with a mask of moderate values (an ALiBi-like term, where scaling it or not
    matters): the library's kernel gives what the function gives, and a kernel that added the mask unscaled would
    not (the float64 reference of that reading is far off)."""
    lib, cases = e2e
    model, fn, binding = cases["scale_after"]
    roles = dict(zip(IN_ROLES, binding.inputs, strict=True))
    rng = np.random.default_rng(3)
    feeds = {roles[r]: rng.standard_normal((1, 2, 21, 32)).astype(np.float32) for r in "qkv"}
    feeds[roles["mask"]] = (4.0 * rng.standard_normal((1, 1, 21, 21))).astype(np.float32)
    want = _one_node_session(model, fn, feeds, None)()
    got = _one_node_session(model, fn, feeds, lib)()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    q, k, v = (feeds[roles[r]].astype(np.float64) for r in "qkv")
    unscaled = np_attention(q, k, v, 0.25, feeds[roles["mask"]], inits["rel_bias"])
    assert np.max(np.abs(unscaled - want)) > 0.05
