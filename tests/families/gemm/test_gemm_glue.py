"""GEMM / QKV glue: the C++ reference (plugins/families/gemm/gemm_ref.h) against fp64 numpy, the binders against the
built-in models' fused nodes (roles checked by evaluating them against the node's own function in onnxruntime), and the
ORT glue header (plugins/families/gemm/gemm_op.h) compiling with g++ -Wall -Wextra."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.gemm.bind import (
    ACTIVATIONS,
    GEMM,
    GEMM_IN,
    GEMM_OUT,
    QKV,
    QKV_IN,
    QKV_OUT,
    GemmBinder,
    QkvBinder,
)
from onnx_gtco.ir.load import load_model
from onnx_gtco.kernels.toolchain import GLUE_INCLUDE_DIRS, cxx_build
from onnx_gtco.models import build
from onnx_gtco.patterns.find_activation import REFERENCE
from onnx_gtco.pipeline import plan_model
from onnx_gtco.plugin.binding import Binding, FusedNode, Operand
from onnx_gtco.plugin.coverage import candidate_node
from onnx_gtco.plugin.headers import ort_include_dir
from onnx_gtco.plugin.nodes import fused_nodes as plugin_fused_nodes

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def _fused_forms(fused_forms: None) -> None:
    """The fused forms these tests bind (epilogues, LayerScale, LayerNorm and the QKV node inside their GEMMs),
    whatever the estimate's current constants would choose (conftest.FUSED_FORMS)."""
HARNESS = Path(__file__).with_name("gemm_ref_harness.cc")
_DT = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16", TensorProto.INT64: "i64"}


# --- the C++ reference through ctypes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("gemm_ref") / "libgemm_ref.so"
    cxx_build(HARNESS, out, include_dirs=GLUE_INCLUDE_DIRS,
              extra=("-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror"))
    return ctypes.CDLL(str(out))


def to_bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def c_gemm(lib: ctypes.CDLL, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None,
           res: np.ndarray | None = None, layer_scale: np.ndarray | None = None, *, trans_a: bool = False,
           trans_b: bool = False, alpha: float = 1.0, beta: float = 1.0, act: str = "none",
           dtype: str = "f32") -> np.ndarray:
    """Run gtco::ref::gemm; raises ValueError with the planner's message."""
    conv = (lambda t: np.ascontiguousarray(t, dtype=np.float32)) if dtype == "f32" else to_bf16
    arrays = [None if t is None else conv(t) for t in (a, b, bias, res, layer_scale)]
    ptr = [None if t is None else t.ctypes.data_as(ctypes.c_void_p) for t in arrays]
    shapes = [np.asarray(t.shape if t is not None else (), dtype=np.int64) for t in (a, b, bias, layer_scale)]
    sp = [s.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)) for s in shapes]
    cap = 1 << 22
    y = np.zeros(cap, dtype=np.float32 if dtype == "f32" else np.uint16)
    y_shape = np.zeros(8, dtype=np.int64)
    y_rank = ctypes.c_int(0)
    err = ctypes.create_string_buffer(1024)
    f = lib.gtco_test_gemm
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float,
                  ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                  ctypes.c_int]
    rc = f(0 if dtype == "f32" else 1, ptr[0], sp[0], a.ndim, ptr[1], sp[1], b.ndim, ptr[2], sp[2],
           -1 if bias is None else bias.ndim, ptr[4], sp[3], -1 if layer_scale is None else layer_scale.ndim, ptr[3],
           int(trans_a), int(trans_b), alpha, beta, act.encode(),
           y.ctypes.data_as(ctypes.c_void_p), cap, y_shape.ctypes.data_as(ctypes.c_void_p), ctypes.byref(y_rank),
           err, len(err))
    if rc != 0:
        raise ValueError(err.value.decode())
    shape = tuple(int(d) for d in y_shape[: y_rank.value])
    out = y[: int(np.prod(shape, dtype=np.int64))].reshape(shape)
    return out if dtype == "f32" else from_bf16(out)


def np_gemm(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None, res: np.ndarray | None = None,
            layer_scale: np.ndarray | None = None, *, trans_a: bool = False, trans_b: bool = False,
            alpha: float = 1.0, beta: float = 1.0, act: str = "none") -> np.ndarray:
    """fp64 numpy: act(alpha * A @ op(B) + beta * bias) * layer_scale + res, with _act.REFERENCE's activations."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    y = alpha * np.matmul(a64.T if trans_a else a64, b64.T if trans_b else b64)
    if bias is not None:
        y = y + beta * np.asarray(bias, np.float64)
    if act != "none":
        y = REFERENCE[act](y)
    if layer_scale is not None:
        y = y * np.asarray(layer_scale, np.float64)
    if res is not None:
        y = y + np.asarray(res, np.float64)
    return y


def close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_activation_names_are_act_references() -> None:
    assert set(ACTIVATIONS) == set(REFERENCE) | {"none"}


@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if a != "none"])
def test_activation_matches_numpy(lib: ctypes.CDLL, act: str) -> None:
    x = np.linspace(-12.0, 12.0, 1001).astype(np.float32)
    y = np.zeros_like(x)
    f = lib.gtco_test_activate
    f.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    assert f(act.encode(), x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p), x.size) == 0
    np.testing.assert_allclose(y, REFERENCE[act](x.astype(np.float64)), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize(("bias", "residual"), [(False, False), (True, False), (False, True), (True, True)])
def test_weight_gemm_epilogue(lib: ctypes.CDLL, act: str, bias: bool, residual: bool) -> None:
    rng = np.random.default_rng(hash((act, bias, residual)) % 2**32)
    a, b = rand(rng, 2, 197, 33), rand(rng, 33, 77)          # A's leading dims fold into M = 394
    bv = rand(rng, 77) if bias else None
    rv = rand(rng, 2, 197, 77) if residual else None
    close(c_gemm(lib, a, b, bv, rv, act=act), np_gemm(a, b, bv, rv, act=act))


SHAPE_CASES = {
    # name: (A, B, bias, residual?, kwargs)
    "2d": ((197, 33), (33, 77), (77,), True, {}),
    "batched": ((2, 3, 19, 33), (2, 3, 33, 77), (1, 77), True, {}),
    "broadcast_b": ((2, 3, 19, 33), (3, 33, 77), (77,), False, {}),
    "broadcast_both": ((3, 1, 19, 33), (1, 4, 33, 77), None, True, {}),
    "broadcast_a": ((19, 33), (5, 33, 77), (), False, {}),
    "rank_mismatch": ((1, 19, 33), (4, 1, 33, 77), (1, 1, 77), False, {}),
    "gemm_trans_b": ((197, 33), (77, 33), (77,), False, {"trans_b": True}),
    "rows_trans_b": ((2, 19, 33), (77, 33), (77,), True, {"trans_b": True}),  # a K-major weight (fp8's)
    "gemm_trans_a_alpha_beta": ((33, 197), (33, 77), (1, 77), True, {"trans_a": True, "alpha": 0.5, "beta": 2.0}),
    "gemm_both_col_bias": ((33, 197), (77, 33), (197, 1), False, {"trans_a": True, "trans_b": True}),
    "gemm_full_bias": ((197, 33), (33, 77), (197, 77), False, {"alpha": -1.5}),
    "scalar_bias": ((197, 33), (33, 77), (1,), False, {"beta": 0.25}),
    "batched_row_bias": ((2, 19, 33), (2, 33, 77), (19, 77), False, {}),
    "k1": ((5, 1), (1, 7), (7,), False, {}),
    "empty_m": ((0, 33), (33, 77), (77,), False, {}),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
@pytest.mark.parametrize("act", ["none", "gelu_erf"])
def test_gemm_shapes(lib: ctypes.CDLL, case: str, act: str) -> None:
    sa, sb, sbias, has_res, kw = SHAPE_CASES[case]
    rng = np.random.default_rng(len(case))
    a, b = rand(rng, *sa), rand(rng, *sb)
    bias = None if sbias is None else rand(rng, *sbias)
    want_shape = np_gemm(a, b, bias, **kw).shape
    res = rand(rng, *want_shape) if has_res else None
    close(c_gemm(lib, a, b, bias, res, act=act, **kw), np_gemm(a, b, bias, res, act=act, **kw))


@pytest.mark.parametrize("act", ["none", "gelu_tanh", "silu"])
def test_bf16_storage(lib: ctypes.CDLL, act: str) -> None:
    rng = np.random.default_rng(7)
    a, b, bias, res = rand(rng, 2, 61, 33), rand(rng, 33, 77), rand(rng, 77), rand(rng, 2, 61, 77)
    q = [from_bf16(to_bf16(t)) for t in (a, b, bias, res)]   # what the kernel sees
    got = c_gemm(lib, a, b, bias, res, act=act, dtype="bf16")
    want = np_gemm(*q, act=act)
    np.testing.assert_allclose(got, want, rtol=8e-3, atol=8e-3 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_layer_scale_after_the_activation_before_the_residual(lib: ctypes.CDLL, dtype: str) -> None:
    """LayerScale: one factor per column between the activation and the residual ([N] or [1, 1, N])."""
    rng = np.random.default_rng(17)
    a, b, bias, res = rand(rng, 2, 61, 33), rand(rng, 33, 77), rand(rng, 77), rand(rng, 2, 61, 77)
    for gamma in (rand(rng, 77), rand(rng, 1, 1, 77)):
        got = c_gemm(lib, a, b, bias, res, gamma, act="gelu_erf", dtype=dtype)
        if dtype == "f32":
            close(got, np_gemm(a, b, bias, res, gamma, act="gelu_erf"))
        else:
            q = [from_bf16(to_bf16(t)) for t in (a, b, bias, res, gamma)]
            want = np_gemm(*q, act="gelu_erf")
            np.testing.assert_allclose(got, want, rtol=8e-3, atol=8e-3 * float(np.max(np.abs(want))))
        assert np.max(np.abs(got - np_gemm(a, b, bias, res, act="gelu_erf"))) > 0.1  # the factors matter
    for shape in ((76,), (2, 77), (61, 77)):
        with pytest.raises(ValueError, match=r"layer_scale \[[0-9,]+\] is not one value per column"):
            c_gemm(lib, a, b, bias, res, rand(rng, *shape))


@pytest.mark.parametrize(("sa", "sb", "sbias", "kw", "message"), [
    ((19, 33), (32, 77), None, {}, "disagree on K: 33 vs 32"),
    ((33,), (33, 77), None, {}, "rank >= 2"),
    ((2, 19, 33), (3, 33, 77), None, {}, "batch dims do not broadcast"),
    ((3, 19, 33), (33, 77), None, {"trans_a": True}, "needs both 2-D"),
    ((3, 19, 33), (3, 77, 33), None, {"trans_b": True}, "needs both 2-D"),
    ((19, 33), (33, 77), (76,), {}, "bias [76] does not broadcast"),
    ((19, 33), (33, 77), (2, 1, 77), {}, "bias [2,1,77] does not broadcast"),
    ((2, 19, 33), (33, 77), (19, 77), {}, "column of M=38"),          # folded rows: no per-row bias
])
def test_plan_errors(lib: ctypes.CDLL, sa: tuple, sb: tuple, sbias: tuple | None, kw: dict, message: str) -> None:
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match=None) as e:
        c_gemm(lib, rand(rng, *sa), rand(rng, *sb), None if sbias is None else rand(rng, *sbias), **kw)
    assert message in str(e.value)


# --- binders on optimized models --------------------------------------------------------------------------------

def fused_nodes(model: onnx.ModelProto, result, prefixes: tuple[str, ...] = ("Gemm_", "Qkv_")) -> list[FusedNode]:
    """FusedNode of every ai.gtco node whose op type starts with one of `prefixes`, as the library builder sees it."""
    del result
    return [n for n in plugin_fused_nodes(model) if n.node.op_type.startswith(prefixes)]


def binder_for(node: FusedNode) -> GemmBinder | QkvBinder:
    return {"gemm": GEMM, "qkv": QKV}[node.family]


def feed(node: FusedNode, rng: np.random.Generator, sym: int = 2) -> list[np.ndarray]:
    """The node's inputs: constants' values, random data (symbolic dims -> `sym`) for the rest."""
    vals = []
    for t in node.inputs:
        if t.value is not None:
            vals.append(np.asarray(t.value))
            continue
        assert t.shape is not None and t.dtype == "f32", t
        vals.append(rand(rng, *(d if isinstance(d, int) else sym for d in t.shape)))
    return vals


def run_function(node: FusedNode, values: list[np.ndarray]) -> list[np.ndarray]:
    """The node's model-local function run by onnxruntime (no library registered: ORT inlines it)."""
    fn = node.function
    names = [f"in{i}" for i in range(len(values))]
    outs = [f"out{i}" for i in range(len(node.outputs))]
    n = helper.make_node(node.node.op_type, names, outs, domain="ai.gtco")
    n.overload = node.node.overload
    n.attribute.extend(node.node.attribute)
    graph = helper.make_graph(
        [n], "one", [helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                     for nm, v in zip(names, values, strict=True)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    onnx_opset = next((o.version for o in fn.opset_import if o.domain == ""), 20)  # the body's (ReduceMean axes)
    opsets = [helper.make_opsetid("", onnx_opset), helper.make_opsetid("ai.gtco", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10, functions=[fn])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, values, strict=True)))


def reference_from_roles(node: FusedNode, binding: Binding, values: list[np.ndarray],
                         lib: ctypes.CDLL | None = None) -> list[np.ndarray]:
    """What the C++ glue computes from the inputs the binding hands it: numpy fp64, or the C++ reference."""
    at = {k: v.decode() if isinstance(v, bytes) else v for k, v in node.attrs.items()}

    def role(names: tuple[str, ...], r: str) -> np.ndarray | None:
        i = binding.inputs[names.index(r)]
        return None if i < 0 else values[i]

    if node.family == "gemm":
        kw = {"trans_a": bool(at.get("trans_a", 0)), "trans_b": bool(at.get("trans_b", 0)),
              "alpha": float(at.get("alpha", 1.0)), "beta": float(at.get("beta", 1.0)), "act": at["activation"]}
        args = [role(GEMM_IN, r) for r in GEMM_IN[:5]]
        y = (np_gemm if lib is None else lambda *a, **k: c_gemm(lib, *a, **k))(*args, **kw)  # type: ignore[misc]
        outs = {"y": y}
        if at.get("layernorm"):  # the LayerNorm of y's rows, fp64 (norm)
            mean = y.mean(axis=-1, keepdims=True)
            var = ((y - mean) ** 2).mean(axis=-1, keepdims=True)
            outs["norm"] = ((y - mean) / np.sqrt(var + float(at.get("epsilon", 1e-5))) * role(GEMM_IN, "gamma")
                            + role(GEMM_IN, "beta"))
        return [outs[r] for r, i in sorted(zip(GEMM_OUT, binding.outputs, strict=True), key=lambda ri: ri[1])
                if i >= 0]
    a = role(QKV_IN, "a")
    outs = []
    for p in range(len(QKV_OUT)):
        if binding.outputs[p] < 0:
            continue
        w, b = role(QKV_IN, f"w{p}"), role(QKV_IN, f"bias{p}")
        outs.append(np_gemm(a, w, b) if lib is None else c_gemm(lib, a, w, b))  # type: ignore[arg-type]
    return outs


def layer_scale_model(d: int = 48, tokens: int = 17, seed: int = 0) -> onnx.ModelProto:
    """One ViT MLP with LayerScale (DINOv2, CaiT): y = x + gamma * fc2(gelu(fc1(x))), gamma [d] and fc2 + bias."""
    rng = np.random.default_rng(seed)
    inits = [_init(rng, "w1", d, 4 * d), _init(rng, "b1", 4 * d), _init(rng, "w2", 4 * d, d), _init(rng, "b2", d),
             _init(rng, "gamma", d), _scalar("half", 0.5), _scalar("one", 1.0), _scalar("sqrt2", 1.4142135)]
    nodes = [mk("MatMul", ["x", "w1"], ["h"]), mk("Add", ["h", "b1"], ["hb"]), mk("Div", ["hb", "sqrt2"], ["g0"]),
             mk("Erf", ["g0"], ["g1"]), mk("Add", ["g1", "one"], ["g2"]), mk("Mul", ["hb", "g2"], ["g3"]),
             mk("Mul", ["g3", "half"], ["g4"]), mk("MatMul", ["g4", "w2"], ["o"]), mk("Add", ["o", "b2"], ["ob"]),
             mk("Mul", ["gamma", "ob"], ["ls"]), mk("Add", ["x", "ls"], ["y"])]
    for n in nodes:
        n.name = f"ls.{n.output[0]}"  # names of their own beside the synthetic model's in one library
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "layer_scale", [helper.make_tensor_value_info("x", f, [2, tokens, d])],
                              [helper.make_tensor_value_info("y", f, [2, tokens, d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_layer_scale_binds_as_the_fifth_role(lib: ctypes.CDLL) -> None:
    """fc2 + bias, gamma and the residual are one Gemm node; its roles compute its function (numpy and the C++
    reference fed per the roles)."""
    result = optimize(layer_scale_model(), GtcoConfig(target="sm_90"))
    nodes = {n.node.name: n for n in fused_nodes(result.model, result)}
    assert len(nodes) == 2 and len(result.model.graph.node) == 2
    fc2 = next(n for n in nodes.values() if n.attrs.get("layer_scale"))
    binding = GEMM.bind(fc2)
    assert binding == Binding(inputs=(0, 1, 2, 3, 4, -1, -1, -1), outputs=(0, -1))
    assert [fc2.node.input[i] for i in binding.inputs if i >= 0] == ["g4", "w2", "b2", "x", "gamma"]
    values = feed(fc2, np.random.default_rng(2))
    want = run_function(fc2, values)
    for got in (reference_from_roles(fc2, binding, values), reference_from_roles(fc2, binding, values, lib)):
        close(np.asarray(got[0], np.float64), want[0].astype(np.float64), rtol=1e-4)
    why = GEMM.bind(_fused([mk("MatMul", ["x0", "x1"], ["t"]), mk("Mul", ["t", "x2"], ["y0"])], 2, 1,
                           GEMM_ATTRS | AB | {"layer_scale": 1}))
    assert isinstance(why, str) and "layer_scale is not a node input" in why


MODELS = {
    "vit-tiny": ("vit-tiny", {}),
    "bert-tiny": ("bert-tiny", {}),
    "vit-gelu_tanh-symbolic": ("vit-tiny", {"depth": 1, "gelu": "tanh", "batch": "N"}),
    "vit-gelu_op-split_qkv": ("vit-tiny", {"depth": 1, "gelu": "op", "opset": 20, "qkv": "split"}),
    "deit-b-distilled": ("deit-b", {"depth": 1, "dim": 192, "heads": 3, "mlp": 384}),
    "bert-fused_qkv-ln_op": ("bert-tiny", {"depth": 1, "qkv": "fused", "ln": "op"}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def optimized(request: pytest.FixtureRequest):
    name, kw = MODELS[request.param]
    result = optimize(build(name, seed=0, **kw), GtcoConfig(pack_qkv=False))  # BERT keeps its QKV nodes
    return request.param, result


def test_builtin_nodes_bind_and_roles_compute_the_function(optimized, lib: ctypes.CDLL) -> None:
    label, result = optimized
    nodes = fused_nodes(result.model, result)
    assert nodes, label
    rng = np.random.default_rng(0)
    checked: set[str] = set()
    for node in nodes:
        binding = binder_for(node).bind(node)
        assert isinstance(binding, Binding), binding          # every GEMM / QKV of the built-in models binds
        n_in, n_out = (len(GEMM_IN), len(GEMM_OUT)) if node.family == "gemm" else (len(QKV_IN), len(QKV_OUT))
        assert len(binding.inputs) == n_in and len(binding.outputs) == n_out
        assert all(-1 <= i < len(node.node.input) for i in binding.inputs)
        assert sorted(i for i in binding.outputs if i >= 0) == list(range(len(node.node.output)))
        if node.node.overload in checked:     # the roles come from the function body: once per body suffices
            continue
        checked.add(node.node.overload)
        values = feed(node, rng)
        want = run_function(node, values)
        for got in (reference_from_roles(node, binding, values), reference_from_roles(node, binding, values, lib)):
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                close(np.asarray(g, np.float64), w.astype(np.float64), rtol=1e-4)
    assert checked


def test_builtin_role_layout() -> None:
    """The two shapes of group the transformers have, spelled out: fc1 (bias + GELU) and attention's output
    projection (bias + residual), and BERT's Q/K/V."""
    result = optimize(build("vit-tiny", depth=1, seed=0), GtcoConfig())
    nodes = {n.node.name: n for n in fused_nodes(result.model, result)}
    fc1 = nodes["gtco/gemm/blocks.0.mlp.fc1.matmul"]
    # sqrt2 / one / half: no role
    assert GEMM.bind(fc1) == Binding(inputs=(0, 1, 2, -1, -1, -1, -1, -1), outputs=(0, -1))
    proj = nodes["gtco/gemm/blocks.0.attn.proj.matmul"]  # with norm2: the sum read on, and its LayerNorm
    assert proj.attrs.get("layernorm") == 1
    assert GEMM.bind(proj) == Binding(inputs=(0, 1, 2, 3, -1, 4, 5, -1), outputs=(0, 1))
    head = nodes["gtco/gemm/head"]                                            # ONNX Gemm, transB, C
    assert GEMM.bind(head) == Binding(inputs=(0, 1, 2, -1, -1, -1, -1, -1), outputs=(0, -1))
    result = optimize(build("bert-tiny", depth=1, seed=0), GtcoConfig(pack_qkv=False))
    (qkv,) = [n for n in fused_nodes(result.model, result) if n.family == "qkv"]
    assert QKV.bind(qkv) == Binding(inputs=(0, 1, 2, 3, 4, 5, 6), outputs=(0, 1, 2))  # the roles in opspec order


# --- synthetic groups: forms the built-in models lack, and the reasons -------------------------------------------

def _init(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(rand(rng, *shape), name)


def _scalar(name: str, v: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(v, dtype=np.float32), name)


def synthetic_model(clip: bool = True) -> onnx.ModelProto:
    """Gemm groups of every other form: folded 3-D A + quick_gelu + residual, Gemm transA/transB/alpha/beta + Relu,
    batched MatMul with a broadcast B + SiLU, Clip(0, 6) (left out with clip=False), Tanh, Sigmoid."""
    rng = np.random.default_rng(0)
    m, k, n = 197, 64, 96
    mk = helper.make_node
    inits = [_init(rng, "w1", k, n), _init(rng, "b1", n), _scalar("c1702", 1.702),
             _init(rng, "w2", n, k), _init(rng, "c2", n),
             _init(rng, "w4", k, n), _init(rng, "b4", 1, n), _scalar("lo", 0.0), _scalar("hi", 6.0),
             _init(rng, "w5", k, n), _init(rng, "w6", k, n), _init(rng, "b6", n)]
    nodes = [
        # quick_gelu(x @ w1 + b1) + r, A 3-D (rows fold)
        mk("MatMul", ["x", "w1"], ["m1"]), mk("Add", ["m1", "b1"], ["a1"]), mk("Mul", ["a1", "c1702"], ["q1"]),
        mk("Sigmoid", ["q1"], ["s1"]), mk("Mul", ["a1", "s1"], ["g1"]), mk("Add", ["r", "g1"], ["y1"]),
        # relu(0.5 * xtᵀ @ w2ᵀ + 2 * c2)
        mk("Gemm", ["xt", "w2", "c2"], ["m2"], transA=1, transB=1, alpha=0.5, beta=2.0), mk("Relu", ["m2"], ["y2"]),
        # silu(p @ q), batched with a broadcast B
        mk("MatMul", ["p", "q"], ["m3"]), mk("Sigmoid", ["m3"], ["s3"]), mk("Mul", ["s3", "m3"], ["y3"]),
        # Clip(x @ w4 + b4, 0, 6): relu6
        mk("MatMul", ["x", "w4"], ["m4"]), mk("Add", ["b4", "m4"], ["a4"]), mk("Clip", ["a4", "lo", "hi"], ["y4"]),
        # tanh(x @ w5)
        mk("MatMul", ["x", "w5"], ["m5"]), mk("Tanh", ["m5"], ["y5"]),
        # sigmoid(x2 @ w6 + b6)
        mk("MatMul", ["x2", "w6"], ["m6"]), mk("Add", ["m6", "b6"], ["a6"]), mk("Sigmoid", ["a6"], ["y6"]),
    ]
    if not clip:
        nodes = [n for n in nodes if n.output[0] not in ("m4", "a4", "y4")]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", f, [2, m, k]), helper.make_tensor_value_info("r", f, [2, m, n]),
              helper.make_tensor_value_info("xt", f, [k, m]), helper.make_tensor_value_info("p", f, [2, 3, m, k]),
              helper.make_tensor_value_info("q", f, [3, k, n]), helper.make_tensor_value_info("x2", f, [m, k])]
    outputs = [helper.make_tensor_value_info(f"y{i}", f, None) for i in range(1, 7) if clip or i != 4]
    model = helper.make_model(helper.make_graph(nodes, "synthetic", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def test_synthetic_forms_bind_and_compute(lib: ctypes.CDLL) -> None:
    result = optimize(synthetic_model(), GtcoConfig())
    nodes = fused_nodes(result.model, result)
    acts = {}
    rng = np.random.default_rng(1)
    for node in nodes:
        binding = GEMM.bind(node)
        act = node.attrs["activation"]
        if "Clip" in {n.op_type for n in node.function.node}:
            assert act == "relu6"  # not "relu": the two agree only on x <= 6
        assert isinstance(binding, Binding), binding
        acts[act] = binding
        values = feed(node, rng)
        want = run_function(node, values)
        for got in (reference_from_roles(node, binding, values), reference_from_roles(node, binding, values, lib)):
            close(np.asarray(got[0], np.float64), want[0].astype(np.float64), rtol=1e-4)
    assert set(acts) == {"quick_gelu", "relu", "silu", "relu6", "tanh", "sigmoid"}
    assert acts["quick_gelu"].inputs == (0, 1, 2, 3, -1, -1, -1, -1)    # c1702 (input 4, after the roles) has no role


def _fused(nodes: list[onnx.NodeProto], n_in: int, n_out: int, attrs: dict, op_type: str = "Gemm_f32",
           values: dict[int, np.ndarray] | None = None) -> FusedNode:
    """A fused node as the rewrite writes it: `attrs` carries its roles (opspec's `roles` / `out_roles`)."""
    fn = helper.make_function("ai.gtco", op_type, [f"x{i}" for i in range(n_in)], [f"y{i}" for i in range(n_out)],
                              nodes, opset_imports=[helper.make_opsetid("", 17)], attributes=sorted(attrs))
    node = helper.make_node(op_type, [f"i{i}" for i in range(n_in)], [f"o{i}" for i in range(n_out)],
                            name="gtco/test", domain="ai.gtco", **attrs)
    values = values or {}
    ins = tuple(Operand(f"i{i}", "f32", None, values.get(i)) for i in range(n_in))
    outs = tuple(Operand(f"o{i}", "f32", None) for i in range(n_out))
    return FusedNode(node, fn, {a.name: helper.get_attribute_value(a) for a in node.attribute}, ins, outs)


GEMM_ATTRS = {"activation": "none", "bias": 0, "residual": 0, "trans_b": 0, "precision": "fp32"}
mk = helper.make_node


MM = [mk("MatMul", ["x0", "x1"], ["y0"])]
AB = {"roles": ["a", "b"], "out_roles": ["y"]}


@pytest.mark.parametrize(("n_in", "n_out", "attrs", "reason"), [
    pytest.param(2, 1, AB | {"activation": "mish"}, "activation 'mish' is not implemented", id="unknown-activation"),
    pytest.param(2, 2, AB | {"activation": "relu"}, "2 outputs", id="exposed-intermediate"),
    pytest.param(2, 1, AB | {"bias": 1}, "bias is not a node input", id="bias-missing"),
    pytest.param(3, 1, {"roles": ["a", "b", "bias"], "out_roles": ["y"]},
                 "bias is a node input its attributes rule out", id="bias-not-declared"),
    pytest.param(2, 1, {"roles": ["a"], "out_roles": ["y"]}, "b is not a node input", id="b-computed-inside"),
])
def test_gemm_reasons(n_in: int, n_out: int, attrs: dict, reason: str) -> None:
    why = GEMM.bind(_fused(MM, n_in, n_out, GEMM_ATTRS | attrs))
    assert isinstance(why, str) and reason in why and "Gemm_f32 node 'gtco/test'" in why, why


def _gemm_model(gemm: onnx.NodeProto) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    f = TensorProto.FLOAT
    inits = [_init(rng, "w", 8, 16), _init(rng, "c", 16), _init(rng, "b", 16)]
    nodes = [gemm, helper.make_node("Add", ["t", "b"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [4, 8])],
                                               [helper.make_tensor_value_info("y", f, [4, 16])], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("gemm", "rule"), [
    pytest.param(mk("Gemm", ["x", "w", "c"], ["t"]), "a Gemm's C and a bias Add are two biases", id="c-and-bias-add"),
    pytest.param(mk("Gemm", ["x", "w"], ["t"], beta=0.5), "beta=0.5 would scale the Add's bias", id="beta-without-c"),
])
def test_gemm_with_two_biases_keeps_its_function(gemm: onnx.NodeProto, rule: str) -> None:
    """The rule gives such a group no bias role ({rule}), so the binder refuses it: the kernel takes one bias. (The
    group as the rule proposes it, whichever cover the DP then picks.)"""
    del rule
    planned = plan_model(load_model(_gemm_model(gemm)), GtcoConfig())
    cand = next(c for c in planned.candidates if c.family == "gemm" and len(c.nodes) == 2)
    node = candidate_node(planned.view, cand, "fp32")
    assert node.attrs["bias"] == 1 and len(node.function.node) == 2
    why = GEMM.bind(node)
    assert isinstance(why, str) and "bias is not a node input" in why, why


def test_gemm_act_op_and_residual_bind() -> None:
    nodes = [mk("MatMul", ["x0", "x1"], ["t"]), mk("Add", ["x2", "t"], ["u"]), mk("Gelu", ["u"], ["v"]),
             mk("Add", ["v", "x3"], ["y0"])]
    roles = {"roles": ["a", "b", "bias", "residual"], "out_roles": ["y"]}
    got = GEMM.bind(_fused(nodes, 4, 1, GEMM_ATTRS | roles | {"activation": "gelu_erf", "bias": 1, "residual": 1}))
    assert got == Binding(inputs=(0, 1, 2, 3, -1, -1, -1, -1), outputs=(0, -1))


def test_qkv_reasons() -> None:
    attrs = {"bias": 0, "k": 8, "m": 4, "n_out": 32, "ns": [8, 8, 8, 8], "precision": "fp32"}
    four = [mk("MatMul", ["x0", f"x{i + 1}"], [f"y{i}"]) for i in range(4)]
    why = QKV.bind(_fused(four, 5, 4, attrs, op_type="Qkv_f32"))
    assert isinstance(why, str) and "4 projections" in why
    two = {"ns": [8, 8], "roles": ["a", "w0"], "out_roles": ["y0", "y1"]}
    why = QKV.bind(_fused(four[:2], 3, 2, attrs | two, op_type="Qkv_f32"))
    assert isinstance(why, str) and "w1 is not a node input" in why
    # the roles name the inputs and outputs, whatever their order
    swapped = {"ns": [8, 8], "roles": ["a", "w1", "w0"], "out_roles": ["y1", "y0"]}
    got = QKV.bind(_fused(four[:2], 3, 2, attrs | swapped, op_type="Qkv_f32"))
    assert got == Binding(inputs=(0, 2, 1, -1, -1, -1, -1), outputs=(1, 0, -1))


# --- the ORT glue header compiles --------------------------------------------------------------------------------

GLUE_TU = """
#include "gemm/gemm_op.h"
namespace gtco {
const NodeSpec kNodes[] = {
    {"Gemm_f32", "g", 4, 1, {0, 1, 2, 3, -1, -1, -1, -1}, {0, -1, -1, -1, -1, -1, -1, -1},
     {nullptr, nullptr}, {nullptr, nullptr}, nullptr},
    {"Qkv_f32", "q", 7, 3, {0, 1, 3, 5, 2, 4, 6, -1}, {0, 1, 2, -1, -1, -1, -1, -1},
     {nullptr, nullptr}, {nullptr, nullptr}, nullptr},
};
const size_t kNodeCount = 2;
template struct FusedKernel<Gemm, DType::f32, false>;
template struct FusedKernel<Gemm, DType::f16, false>;
template struct FusedKernel<Gemm, DType::bf16, false>;
template struct FusedKernel<Gemm, DType::f8, false>;
template struct FusedKernel<Gemm, DType::f8, true>;
template struct FusedKernel<Gemm, DType::f16, true>;
template struct FusedKernel<Qkv, DType::f32, false>;
template struct FusedKernel<Qkv, DType::f16, false>;
template struct FusedKernel<Qkv, DType::bf16, false>;
template struct FusedKernel<Qkv, DType::bf16, true>;
static_assert(Gemm::IN_A == 0 && Gemm::IN_B == 1 && Gemm::IN_BIAS == 2 && Gemm::IN_RESIDUAL == 3 &&
              Gemm::IN_LAYER_SCALE == 4 && Gemm::IN_GAMMA == 5 && Gemm::IN_BETA == 6 && Gemm::IN_SCALES == 7, "roles");
static_assert(Qkv::IN_W0 == 1 && Qkv::IN_BIAS0 == 4 && Qkv::kMaxProj == 3, "roles");
}  // namespace gtco
"""


def test_glue_header_compiles(tmp_path: Path) -> None:
    inc = ort_include_dir()
    assert len(GEMM_IN) == 8 and len(QKV_IN) == 7     # the static_asserts above spell out the same order
    src = tmp_path / "gemm_glue.cc"
    src.write_text(GLUE_TU)
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
           *(f"-I{d}" for d in GLUE_INCLUDE_DIRS), f"-I{inc}", str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


# --- the glue run by onnxruntime: a one-family library for the built-in models' GEMM / QKV nodes ----------------

LIB_TU = """
#include "gemm/gemm_op.h"
namespace gtco {
const NodeSpec kNodes[] = {
%(rows)s
};
const size_t kNodeCount = sizeof(kNodes) / sizeof(kNodes[0]);
const char* const kLibraryInfo = "{}";
void add_ops(Ort::CustomOpDomain& domain, bool) {
    static FusedOp<Gemm, DType::f32, false> gemm("Gemm_f32");
    static FusedOp<Qkv, DType::f32, false> qkv("Qkv_f32");
    domain.Add(&gemm);
    domain.Add(&qkv);
}
}  // namespace gtco
#include "register.inc"
"""


def node_row(node: FusedNode, binding: Binding) -> str:
    def pad(xs: tuple[int, ...]) -> str:
        return "{" + ", ".join(str(x) for x in (*xs, *([-1] * (8 - len(xs))))) + "}"
    return (f'    {{"{node.node.op_type}", "{node.node.name}", {len(node.node.input)}, {len(node.node.output)}, '
            f"{pad(binding.inputs)}, {pad(binding.outputs)}, {{nullptr, nullptr}}, {{nullptr, nullptr}}, nullptr}},")


@pytest.fixture(scope="module")
def glue_models(tmp_path_factory: pytest.TempPathFactory):
    """Optimized models (ViT with a symbolic batch, BERT with Q/K/V, the synthetic forms, a LayerScale MLP) and a
    library built for their nodes."""
    inc = ort_include_dir()
    models, rows, nodes = [], [], {}
    own = {"synthetic": synthetic_model, "layer_scale": layer_scale_model}
    for name, kw in (("vit-tiny", {"depth": 1, "batch": "N"}), ("bert-tiny", {"depth": 1}), ("synthetic", {}),
                     ("layer_scale", {})):
        src = own[name]() if name in own else build(name, seed=0, **kw)
        result = optimize(src, GtcoConfig(pack_qkv=False))  # BERT keeps its QKV node
        for node in fused_nodes(result.model, result):
            binding = binder_for(node).bind(node)
            assert isinstance(binding, Binding), binding
            rows.append(node_row(node, binding))
            nodes[node.node.name] = node
        models.append((name, src, result.model))
    tmp = tmp_path_factory.mktemp("gemm_glue")
    cc = tmp / "gtco_gemm.cc"
    cc.write_text(LIB_TU % {"rows": "\n".join(rows)})
    so = tmp / "libgtco_gemm.so"
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall",
           "-Wextra", *(f"-I{d}" for d in GLUE_INCLUDE_DIRS), f"-I{inc}", str(cc),
           "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return so, models, nodes


def session(model: onnx.ModelProto, library: Path | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if library is not None:
        so.add_session_config_entry("gtco.register", "all")  # its CPU kernels (it has no CUDA ones)
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def model_feed(model: onnx.ModelProto, rng: np.random.Generator, batch: int = 2) -> dict[str, np.ndarray]:
    out = {}
    inits = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim]
        if tt.elem_type == TensorProto.FLOAT:
            out[vi.name] = rand(rng, *shape)
        else:
            hi = 2 if "mask" in vi.name else 100
            out[vi.name] = rng.integers(0, hi, size=shape).astype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
    return out


def test_glue_runs_in_onnxruntime(glue_models) -> None:
    """The library's Gemm_f32 / Qkv_f32 kernels replace the nodes' functions and give the unfused outputs."""
    so_path, models, _ = glue_models
    rng = np.random.default_rng(5)
    for _name, src, fused in models:
        feed_ = model_feed(src, rng)
        want = session(src, None).run(None, feed_)
        sess = session(fused, so_path)
        got = sess.run(None, feed_)
        for g, w in zip(got, want, strict=True):
            close(g.astype(np.float64), w.astype(np.float64), rtol=1e-4)


FC1, PROJ, QKV_NODE = ("gtco/gemm/blocks.0.mlp.fc1.matmul", "gtco/gemm/blocks.0.attn.proj.matmul",
                       "gtco/qkv/encoder.layer.0.attention.self.query.matmul")
BERT_OUT = "gtco/gemm/encoder.layer.0.output.dense.matmul"


@pytest.mark.parametrize(("name", "index", "shape", "dtype", "message"), [
    (FC1, 0, (2, 197, 191), np.float32, r"A \[2,197,191\] and B \[192,768\] disagree on K: 191 vs 192"),
    (FC1, 0, (2, 197, 192), np.float64, r"input A of type double \[2,197,192\]; this kernel takes float only"),
    (FC1, 2, (767,), np.float32, r"bias \[767\] does not broadcast over the output \[2,197,768\]"),
    (PROJ, 3, (2, 197, 191), np.float32, r"residual \[2,197,191\] differs from the output shape \[2,197,192\]"),
    (BERT_OUT, 0, (1, 127, 512), np.float32, r"A \[1,127,512\] and B \[512,128\] give m=127; the kernel was built "
                                            r"for m=128"),
    (QKV_NODE, 2, (128, 127), np.float32, r"A \[1,128,128\] and W1 \[128,127\] give n=127; the kernel was built "
                                          r"for n=128"),
    (QKV_NODE, 0, (1, 128), np.float32, r"A \[1,128\] and W0 \[128,128\] give m=1; the kernel was built for m=128"),
])
def test_glue_rejects_bad_inputs(glue_models, name: str, index: int, shape: tuple, dtype: type,
                                 message: str) -> None:
    """The kernel (not the function: ORT runs the library's op) checks each call's shapes and dtypes."""
    so_path, _, nodes = glue_models
    node = nodes[name]
    rng = np.random.default_rng(9)
    values = feed(node, rng)
    values[index] = rand(rng, *shape).astype(dtype)
    with pytest.raises(Exception, match=f"{node.node.op_type} node '{name}': {message}"):
        one_node(node, values, so_path)
    assert one_node(node, feed(node, rng), so_path)       # the same node with good inputs runs


def one_node(node: FusedNode, values: list[np.ndarray], library: Path | None) -> list[np.ndarray]:
    n = onnx.NodeProto()
    n.CopyFrom(node.node)
    names = [f"in{i}" for i in range(len(values))]
    del n.input[:]
    n.input.extend(names)
    graph = helper.make_graph(
        [n], "one", [helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                     for nm, v in zip(names, values, strict=True)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in n.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.gtco", 1)],
                              ir_version=10, functions=[node.function])
    return session(model, library).run(None, dict(zip(names, values, strict=True)))
