"""The Elementwise family's plugin op: binder, per-node host functions in the glue, CPU and emulated device kernels.

Small hand-built models, each fused into one Elementwise node by optimize: a GELU (erf) with its bias, a bias and a
broadcast residual, a Where over a comparison and a bool mask, a node with two outputs, and a spread of the other
supported ops. The library's CPU-EP kernel (the node's generated host function) must match the node's model-local
function; the emulated build runs fp16 versions through the sm_80 instances against the fp32 originals.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import cpu_session
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import optimize
from onnx_gtco.families.elementwise.bind import ElementwiseBinder
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.plugin.binding import Binding
from onnx_gtco.plugin.coverage import candidate_node
from onnx_gtco.plugin.library import LibraryResult, bind_nodes, build_library, generate_glue, library_info
from onnx_gtco.plugin.nodes import fused_nodes

h = helper.make_node


def _model(name: str, nodes: list[onnx.NodeProto], inputs: dict[str, tuple[int, list[int | str]]],
           outputs: dict[str, list[int | str]], consts: dict[str, np.ndarray], elem: int,
           ints: dict[str, list[int]] | None = None) -> onnx.ModelProto:
    """A model whose float tensors are `elem` (inputs given as (element type or 0 for `elem`, shape)); `ints`: int64
    initializers (shapes, axes, pads, slice bounds)."""
    dt = helper.tensor_dtype_to_np_dtype(elem)
    inits = [numpy_helper.from_array(np.asarray(v, dt), k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in (ints or {}).items()]
    ins = [helper.make_tensor_value_info(k, t or elem, s) for k, (t, s) in inputs.items()]
    outs = [helper.make_tensor_value_info(k, elem, s) for k, s in outputs.items()]
    graph = helper.make_graph(nodes, name, ins, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def gelu(elem: int = TensorProto.FLOAT, batch: int | str = 2) -> onnx.ModelProto:
    """(x + bias) -> Div sqrt2 -> Erf -> Add 1 -> Mul -> Mul 0.5: GELU with its bias, the scalars folded in."""
    nodes = [h("Add", ["x", "bias"], ["a"], name="addb"), h("Div", ["a", "s2"], ["d"], name="div"),
             h("Erf", ["d"], ["e"], name="erf"), h("Add", ["e", "one"], ["e1"], name="add1"),
             h("Mul", ["a", "e1"], ["m"], name="mul"), h("Mul", ["m", "half"], ["y"], name="half")]
    consts = {"bias": np.linspace(-1, 1, 16), "s2": np.sqrt(2.0), "one": 1.0, "half": 0.5}
    return _model("gelu", nodes, {"x": (0, [batch, 3, 16])}, {"y": [batch, 3, 16]}, consts, elem)


def residual(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """(x + bias[16]) * scale[4, 1] + r[1, 4, 16]: operands broadcast along different axes."""
    nodes = [h("Add", ["x", "bias"], ["a"], name="addb"), h("Mul", ["a", "scale"], ["m"], name="scale"),
             h("Add", ["m", "r"], ["y"], name="res")]
    return _model("residual", nodes, {"x": (0, [3, 4, 16]), "r": (0, [1, 4, 16]), "scale": (0, [4, 1])},
                  {"y": [3, 4, 16]}, {"bias": np.linspace(-1, 1, 16)}, elem)


def where(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Where(x > t and mask, x * 2, x - 1): a comparison, a bool input, And, Where."""
    nodes = [h("Greater", ["x", "t"], ["g"], name="gt"), h("And", ["g", "mask"], ["c"], name="and"),
             h("Mul", ["x", "two"], ["x2"], name="mul"), h("Sub", ["x", "one"], ["x1"], name="sub"),
             h("Where", ["c", "x2", "x1"], ["y"], name="where")]
    return _model("where", nodes, {"x": (0, [2, 5, 8]), "t": (0, [8]), "mask": (TensorProto.BOOL, [2, 1, 8])},
                  {"y": [2, 5, 8]}, {"two": 2.0, "one": 1.0}, elem)


def two_outputs(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """s = x + r; y1 = Relu(s); y2 = Sigmoid(s) * s: one node, two outputs."""
    nodes = [h("Add", ["x", "r"], ["s"], name="add"), h("Relu", ["s"], ["y1"], name="relu"),
             h("Sigmoid", ["s"], ["sg"], name="sig"), h("Mul", ["sg", "s"], ["y2"], name="swish")]
    return _model("two_outputs", nodes, {"x": (0, [4, 24]), "r": (0, [4, 24])}, {"y1": [4, 24], "y2": [4, 24]},
                  {}, elem)


def assorted(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Tanh, LeakyRelu, Elu, Softplus, HardSigmoid, Clip, Abs, Sqrt, Pow, Neg, Exp, Max, Min, Floor, Sin, Cos."""
    nodes = [h("Tanh", ["x"], ["a"], name="tanh"), h("LeakyRelu", ["a"], ["b"], name="lrelu", alpha=0.2),
             h("Elu", ["b"], ["c"], name="elu", alpha=0.7), h("Softplus", ["c"], ["d"], name="softplus"),
             h("HardSigmoid", ["x"], ["e"], name="hsig", alpha=0.3, beta=0.4),
             h("Clip", ["x", "lo", "hi"], ["f"], name="clip"), h("Abs", ["f"], ["g"], name="abs"),
             h("Sqrt", ["g"], ["s"], name="sqrt"), h("Pow", ["s", "p"], ["q"], name="pow"),
             h("Neg", ["q"], ["n"], name="neg"), h("Exp", ["n"], ["ex"], name="exp"),
             h("Max", ["d", "e"], ["mx"], name="max"), h("Min", ["mx", "ex"], ["mn"], name="min"),
             h("Sin", ["x"], ["si"], name="sin"), h("Cos", ["x"], ["co"], name="cos"),
             h("Floor", ["r"], ["fl"], name="floor"), h("Add", ["si", "co"], ["sc"], name="addsc"),
             h("Add", ["mn", "sc"], ["t"], name="add"), h("Add", ["t", "fl"], ["y"], name="addfl")]
    return _model("assorted", nodes, {"x": (0, [6, 32]), "r": (0, [32])}, {"y": [6, 32]},
                  {"lo": -0.5, "hi": 1.5, "p": 3.0}, elem)


def window_partition(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Pad of zeros -> Reshape -> Transpose -> Reshape (Swin's window partition): layout ops alone, a copy kernel
    whose last Reshape (no view of the transposed input) is where it writes densely."""
    nodes = [h("Pad", ["x", "pads"], ["p"], name="pad"), h("Reshape", ["p", "split"], ["r"], name="split"),
             h("Transpose", ["r"], ["t"], name="perm", perm=[0, 1, 3, 2, 4, 5]),
             h("Reshape", ["t", "merge"], ["y"], name="merge")]
    ints = {"pads": [0] * 8, "split": [1, 2, 3, 2, 3, 4], "merge": [4, 9, 4]}
    return _model("window_partition", nodes, {"x": (0, [1, 6, 6, 4])}, {"y": [4, 9, 4]}, {}, elem, ints)


def window_reverse(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Window reverse (Reshape -> Transpose -> Reshape) + shortcut, * gamma[4]: the Add computes in the transposed
    6-d shape and reads the shortcut and gamma through the same reshape."""
    nodes = [h("Reshape", ["w", "split"], ["r"], name="split"),
             h("Transpose", ["r"], ["t"], name="perm", perm=[0, 1, 3, 2, 4, 5]),
             h("Reshape", ["t", "merge"], ["m"], name="merge"), h("Add", ["m", "s"], ["a"], name="res"),
             h("Mul", ["a", "gamma"], ["y"], name="gamma")]
    ints = {"split": [1, 2, 2, 3, 3, 4], "merge": [1, 6, 6, 4]}
    return _model("window_reverse", nodes, {"w": (0, [4, 9, 4]), "s": (0, [1, 6, 6, 4])}, {"y": [1, 6, 6, 4]},
                  {"gamma": np.linspace(0.5, 1.5, 4)}, elem, ints)


def head_split(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """qkv [1, 5, 3, 2, 8] -> Transpose -> Slice/Squeeze per part (an offset view each) -> q * scale, k^T (stored
    transposed) and v as is."""
    nodes = [h("Transpose", ["qkv"], ["t"], name="perm", perm=[2, 0, 3, 1, 4]),
             h("Slice", ["t", "zero", "one", "axis0"], ["qs"], name="sq"),
             h("Squeeze", ["qs", "axis0"], ["q"], name="q"), h("Mul", ["q", "scale"], ["y1"], name="scale"),
             h("Slice", ["t", "one", "two", "axis0"], ["ks"], name="sk"),
             h("Squeeze", ["ks", "axis0"], ["k"], name="k"),
             h("Transpose", ["k"], ["y2"], name="kt", perm=[0, 1, 3, 2]),
             h("Slice", ["t", "two", "three", "axis0"], ["vs"], name="sv"),
             h("Squeeze", ["vs", "axis0"], ["y3"], name="v")]
    ints = {"zero": [0], "one": [1], "two": [2], "three": [3], "axis0": [0]}
    return _model("head_split", nodes, {"qkv": (0, [1, 5, 3, 2, 8])},
                  {"y1": [1, 2, 5, 8], "y2": [1, 2, 8, 5], "y3": [1, 2, 5, 8]}, {"scale": 0.35}, elem, ints)


def strided(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Slice with steps 2 (patch merging's x[:, 1::2, 0::2]) -> + bias[3] -> Relu."""
    nodes = [h("Slice", ["x", "starts", "ends", "axes", "steps"], ["s"], name="slice"),
             h("Add", ["s", "bias"], ["a"], name="bias"), h("Relu", ["a"], ["y"], name="relu")]
    ints = {"starts": [1, 0], "ends": [8, 8], "axes": [1, 2], "steps": [2, 2]}
    return _model("strided", nodes, {"x": (0, [2, 8, 8, 3])}, {"y": [2, 4, 4, 3]}, {"bias": [0.1, -0.2, 0.3]},
                  elem, ints)


MODELS: dict[str, Callable[..., onnx.ModelProto]] = {
    "gelu": gelu, "residual": residual, "where": where, "two_outputs": two_outputs, "assorted": assorted,
    "window_partition": window_partition, "window_reverse": window_reverse, "head_split": head_split,
    "strided": strided}
LAYOUT_MODELS = ("window_partition", "window_reverse", "head_split", "strided")


def feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in tt.shape.dim]
        if tt.elem_type == TensorProto.BOOL:
            out[vi.name] = rng.random(shape) < 0.5
        else:
            out[vi.name] = (rng.standard_normal(shape) * 2).astype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
    return out


def ran_ops(sess: ort.InferenceSession) -> set[str]:
    events = json.loads(Path(sess.end_profiling()).read_text())
    return {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}


def elementwise_types(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node if n.domain == "ai.gtco" and n.op_type.startswith("Elementwise_")}


# --- (a) the CPU-EP kernel: the generated host function against the node's function ------------------------------

@pytest.fixture(scope="module")
def cpu_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[onnx.ModelProto, LibraryResult]]:
    out = {}
    for name, make in MODELS.items():
        rewritten = optimize(make()).model
        out[name] = rewritten, build_library(rewritten, tmp_path_factory.mktemp(f"ew_{name}"), cuda=False)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_cpu_kernel_matches_function(name: str, cpu_libs, tmp_path: Path) -> None:
    rewritten, lib = cpu_libs[name]
    assert elementwise_types(rewritten) == {"Elementwise_f32"}, [n.op_type for n in rewritten.graph.node]
    assert "Elementwise_f32" in lib.op_types, lib.skipped()
    assert not lib.skipped(), lib.skipped()
    for seed in (0, 1, 2):
        x = feeds(rewritten, seed)
        want = cpu_session(rewritten, register="none").run(None, x)  # the model-local function
        got = cpu_session(rewritten, lib.path).run(None, x)
        assert len(got) == len(want)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{name} seed {seed}")
    sess = cpu_session(rewritten, lib.path, profile=tmp_path)
    sess.run(None, feeds(rewritten, 0))
    assert "Elementwise_f32" in ran_ops(sess)  # the custom op ran (a registered op type hides the function)
    sess = cpu_session(rewritten, lib.path, register="none", profile=tmp_path)
    sess.run(None, feeds(rewritten, 0))
    assert "Elementwise_f32" not in ran_ops(sess)  # the function's own ops ran


def test_binding_roles_and_glue(cpu_libs) -> None:
    """Scalar constants are folded (no role); the bias initializer is an operand; outputs map one to one."""
    rewritten, _ = cpu_libs["gelu"]
    (node,) = fused_nodes(rewritten)
    binding = ElementwiseBinder().bind(node)
    assert isinstance(binding, Binding)
    names = [node.inputs[i].name for i in binding.inputs]
    assert names == ["x", "bias"] and binding.outputs == (0,)
    blocks, host = ElementwiseBinder().glue(node, binding)
    assert host.startswith("&gtco_elementwise_node_") and "static void gtco_elementwise_host_f32_" in blocks[0]
    # x [2, 3, 16] walks the iteration shape collapsed to (6, 16); the bias broadcasts along its outer dim
    assert "erff(" in blocks[0] and "Shape<6, 16>" in blocks[0]
    assert "In<T, 16, 1>,  // x[0]" in blocks[0] and "In<T, 0, 1>  // x[1]" in blocks[0]
    two, _ = cpu_libs["two_outputs"]
    (node,) = fused_nodes(two)
    binding = ElementwiseBinder().bind(node)
    assert isinstance(binding, Binding) and sorted(binding.outputs) == [0, 1]


def test_nodes_of_one_program_share_its_host_function(tmp_path: Path) -> None:
    """Two GELU groups of the same shapes: two node descriptors in the glue, one host function."""
    one = gelu()
    graph = one.graph
    second = [onnx.NodeProto.FromString(n.SerializeToString()) for n in graph.node]
    for n in second:
        n.name += "_2"
        n.input[:] = [{"x": "z"}.get(t, t if t in ("bias", "s2", "one", "half") else t + "_2") for t in n.input]
        n.output[:] = [t + "_2" for t in n.output]
    graph.node.extend(second)
    graph.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3, 16]))
    graph.output.append(helper.make_tensor_value_info("y_2", TensorProto.FLOAT, [2, 3, 16]))
    rewritten = optimize(one).model
    nodes = fused_nodes(rewritten)
    assert len(nodes) == 2 and {n.family for n in nodes} == {"elementwise"}
    results, binders = bind_nodes(nodes)
    source, op_types, _ = generate_glue(nodes, results, binders, {})
    assert op_types == ["Elementwise_f32"]
    assert source.count("static void gtco_elementwise_host_f32_") == 1
    assert source.count("static const gtco::ElementwiseNode gtco_elementwise_node_") == 2
    lib = build_library(rewritten, tmp_path, cuda=False)
    x = feeds(rewritten, 0)
    want = cpu_session(rewritten, register="none").run(None, x)
    for w, g in zip(want, cpu_session(rewritten, lib.path).run(None, x), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# --- (b) the emulated device path: fp16 nodes through the sm_80 instances -----------------------------------------

@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[onnx.ModelProto, LibraryResult]]:
    out = {}
    for name in ("gelu", "residual", "where", "two_outputs", *LAYOUT_MODELS):
        rewritten = optimize(MODELS[name](TensorProto.FLOAT16)).model
        lib = build_library(rewritten, tmp_path_factory.mktemp(f"ew_emu_{name}"), cuda=False, emulated=True)
        out[name] = rewritten, lib
    return out


@pytest.mark.parametrize("name", ["gelu", "residual", "where", "two_outputs", *LAYOUT_MODELS])
def test_emulated_device_kernel_matches_fp32_original(name: str, emulated, tmp_path: Path) -> None:
    rewritten, lib = emulated[name]
    assert elementwise_types(rewritten) == {"Elementwise_f16"}
    assert lib.cuda_op_types == ["Elementwise_f16"], (lib.skipped(), lib.kernel_skips)
    info = library_info(lib.path)
    assert info["emulated"] is True
    assert all(len(v) == 1 and v[0].startswith("elementwise_sm80_f16_") for v in info["instances"].values())
    original = MODELS[name]()
    for seed in (0, 1):
        x32 = feeds(original, seed)
        x16 = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in x32.items()}
        want = cpu_session(original).run(None, x32)
        got = cpu_session(rewritten, lib.path).run(None, x16)
        for w, g in zip(want, got, strict=True):
            assert g.dtype == np.float16 and g.shape == w.shape and np.isfinite(g).all()
            err = rel_error(g.astype(np.float32), w)
            assert err < 5e-3, f"{name} seed {seed}: ‖err‖/‖ref‖ = {err:.2e}"
    sess = cpu_session(rewritten, lib.path, profile=tmp_path)
    sess.run(None, {k: v.astype(np.float16) if v.dtype == np.float32 else v
                    for k, v in feeds(original, 0).items()})
    assert "Elementwise_f16" in ran_ops(sess)  # in an emulated build the device kernel is the only one registered


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed for the CUDA build")
def test_cuda_build_compiles_the_instances_and_runs_the_host_function_on_cpu(tmp_path: Path) -> None:
    """nvcc builds the node's instance for sm_80 and sm_90 without spills; a CPU session runs the host function."""
    rewritten = optimize(two_outputs(TensorProto.FLOAT16)).model
    lib = build_library(rewritten, tmp_path, cuda=True)
    assert lib.cuda_op_types == ["Elementwise_f16"], lib.kernel_skips
    assert {k["arch"] for k in lib.kernels} == {"sm_80", "sm_90"}
    for k in lib.kernels:
        for r in k["kernels"]:
            assert r["spill_store_bytes"] == 0 and r["stack_frame_bytes"] == 0, k
    x = {k: v.astype(np.float16) for k, v in feeds(rewritten, 0).items()}
    want = cpu_session(rewritten, register="none").run(None, x)
    for w, g in zip(want, cpu_session(rewritten, lib.path).run(None, x), strict=True):
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=2e-3, atol=2e-3)


# --- (c) run-time shapes the node was not built for ---------------------------------------------------------------

def _symbolic_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for vi in [*model.graph.input, *model.graph.output]:  # let a wrong size through to the kernel
        vi.type.tensor_type.shape.dim[-1].dim_param = "W"
    return model


def test_wrong_shape_names_the_op(cpu_libs) -> None:
    rewritten, lib = cpu_libs["two_outputs"]
    model = _symbolic_inputs(rewritten)
    x = {k: v[:, :20].copy() for k, v in feeds(rewritten, 0).items()}
    with pytest.raises(Exception, match=r"Elementwise_f32 node '[^']+': inputs float \[4,20\], float \[4,20\]; the "
                                        r"kernel was built for float \[4,24\], float \[4,24\]"):
        cpu_session(model, lib.path).run(None, x)


def test_wrong_shape_names_the_op_on_the_device_path(emulated) -> None:
    rewritten, lib = emulated["two_outputs"]
    model = _symbolic_inputs(rewritten)
    x = {k: v[:, :20].astype(np.float16) for k, v in feeds(rewritten, 0).items()}
    with pytest.raises(Exception, match=r"Elementwise_f16 node '[^']+': inputs float16 \[4,20\], float16 \[4,20\]; "
                                        r"the kernel was built for float16 \[4,24\]"):
        cpu_session(model, lib.path).run(None, x)


# --- (d) nodes the binder refuses keep their function, with the reason ---------------------------------------------

def test_refused_nodes_keep_their_function(tmp_path: Path) -> None:
    """A dim with neither a size nor a name (two of them need not be equal) gets no kernel: its node keeps its
    function, with the reason."""
    original = gelu(batch=None)
    rewritten = optimize(original).model
    lib = build_library(rewritten, tmp_path, cuda=False)
    refused = {r.node: r.reason for r in lib.nodes if r.binding is None}
    assert refused and all("unnamed dims" in str(why) and "'?'" in str(why) for why in refused.values()), lib.nodes
    x = feeds(rewritten, 0)
    want = cpu_session(original).run(None, x)[0]
    np.testing.assert_allclose(cpu_session(rewritten, lib.path).run(None, x)[0], want, rtol=1e-5, atol=1e-6)


# --- (e) symbolic dims: one kernel for every size they take (families/elementwise/kernel.py RuntimeProgram) -------

def rotary_mix(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """q * cos + r * sin over q, r [N, 4, S, 6] and cos, sin [1, 1, S, 6] (a rotary embedding after its roll), then
    a SiLU of the result with a bias [6]: two symbols, inputs broadcast along different dims."""
    nodes = [h("Mul", ["q", "cos"], ["a"], name="mc"), h("Mul", ["r", "sin"], ["b"], name="ms"),
             h("Add", ["a", "b"], ["c"], name="add"), h("Add", ["c", "bias"], ["d"], name="addb"),
             h("Sigmoid", ["d"], ["e"], name="sigmoid"), h("Mul", ["d", "e"], ["y"], name="silu")]
    return _model("rotary_mix", nodes, {"q": (0, ["N", 4, "S", 6]), "cos": (0, [1, 1, "S", 6]),
                                         "r": (0, ["N", 4, "S", 6]), "sin": (0, [1, 1, "S", 6])},
                  {"y": ["N", 4, "S", 6]}, {"bias": np.linspace(-1, 1, 6)}, elem)


def _rotary_mix_fp64(x: dict[str, np.ndarray]) -> np.ndarray:
    v = {k: a.astype(np.float64) for k, a in x.items()}
    d = v["q"] * v["cos"] + v["r"] * v["sin"] + np.linspace(-1, 1, 6).astype(x["q"].dtype)
    return d / (1 + np.exp(-d))


def transposed_mix(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Transpose(x [N, 6, S]) * w [6] + r [N, S, 6]: x read across its innermost dim (a Transpose over symbolic
    dims folded into the load, one element at a time), r and the output dense."""
    nodes = [h("Transpose", ["x"], ["xt"], name="t", perm=[0, 2, 1]), h("Mul", ["xt", "w"], ["a"], name="mw"),
             h("Add", ["a", "r"], ["y"], name="add")]
    return _model("transposed_mix", nodes, {"x": (0, ["N", 6, "S"]), "r": (0, ["N", "S", 6])}, {"y": ["N", "S", 6]},
                  {"w": np.linspace(-1, 1, 6)}, elem)


def _transposed_mix_fp64(x: dict[str, np.ndarray]) -> np.ndarray:
    v = {k: a.astype(np.float64) for k, a in x.items()}
    return v["x"].transpose(0, 2, 1) * np.linspace(-1, 1, 6).astype(x["x"].dtype) + v["r"]


def _symbolic_feeds(name: str, rng: np.random.Generator, n: int, s: int) -> dict[str, np.ndarray]:
    if name == "rotary":
        return {"q": rng.standard_normal((n, 4, s, 6)), "r": rng.standard_normal((n, 4, s, 6)),
                "cos": rng.standard_normal((1, 1, s, 6)), "sin": rng.standard_normal((1, 1, s, 6))}
    return {"x": rng.standard_normal((n, 6, s)), "r": rng.standard_normal((n, s, 6))}


@pytest.mark.parametrize(("name", "elem"), [("rotary", TensorProto.FLOAT), ("rotary", TensorProto.FLOAT16),
                                           ("transposed", TensorProto.FLOAT16)], ids=["rotary-f32", "rotary-f16",
                                                                                       "transposed-f16"])
def test_symbolic_dims_take_one_kernel_at_every_size(tmp_path: Path, name: str, elem: int) -> None:
    """A group over symbolic batch and sequence dims is one Elementwise node whose CPU and emulated device kernels
    (built once) compute it at every size: sizes of 1 and sizes whose innermost run is no multiple of the vector
    width included, against an fp64 reference."""
    model, want_of = {"rotary": (rotary_mix, _rotary_mix_fp64), "transposed": (transposed_mix, _transposed_mix_fp64)
                      }[name]
    rewritten = optimize(model(elem)).model
    assert len(elementwise_types(rewritten)) == 1 and len(rewritten.graph.node) == 1, rewritten.graph.node
    dt = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(3)
    for emulated in (False, True):
        out = tmp_path / f"emu{int(emulated)}"
        out.mkdir()
        lib = build_library(rewritten, out, cuda=False, emulated=emulated)
        assert [(r.node, r.reason) for r in lib.nodes if r.reason] == []
        assert not emulated or lib.cuda_op_types == sorted(elementwise_types(rewritten)), lib.cuda_op_types
        sess = cpu_session(rewritten, lib.path)
        for n, s in ((1, 1), (3, 5), (2, 128)):
            x = {k: v.astype(dt) for k, v in _symbolic_feeds(name, rng, n, s).items()}
            got = sess.run(None, x)[0]
            want = want_of(x)
            assert got.shape == want.shape and got.dtype == dt
            err = rel_error(got.astype(np.float64), want)
            assert err < (1e-6 if elem == TensorProto.FLOAT else 2e-3), (emulated, n, s, err)


def test_symbolic_dims_of_unequal_sizes_are_refused_by_name(tmp_path: Path) -> None:
    """Two inputs naming one symbol with different sizes in a call: the node says which symbol's sizes it was built
    to share, not a wrong answer."""
    rewritten = optimize(rotary_mix()).model
    lib = build_library(rewritten, tmp_path, cuda=False)
    rng = np.random.default_rng(0)
    x = {"q": rng.standard_normal((2, 4, 3, 6)), "r": rng.standard_normal((1, 4, 3, 6)),
         "cos": rng.standard_normal((1, 1, 3, 6)), "sin": rng.standard_normal((1, 1, 3, 6))}
    with pytest.raises(Exception, match=r"Elementwise_f32 node '[^']+': inputs float \[2,4,3,6\], float "
                                        r"\[1,1,3,6\], float \[1,4,3,6\].*built for float \[N,4,S,6\].*each "
                                        r"named dim one size in a call"):
        cpu_session(rewritten, lib.path).run(None, {k: v.astype(np.float32) for k, v in x.items()})


def test_binder_reasons() -> None:
    """Every refusal is a reason string, never an exception."""
    binder = ElementwiseBinder()
    # an f32 input on an f16 node (onnxruntime's converter leaves such input casts in fused groups)
    nodes = [h("Cast", ["x"], ["c"], name="cast", to=TensorProto.FLOAT16), h("Relu", ["c"], ["r"], name="relu"),
             h("Add", ["r", "b"], ["y"], name="add")]
    m = _model("mixed", nodes, {"x": (TensorProto.FLOAT, [2, 8]), "b": (0, [2, 8])}, {"y": [2, 8]}, {},
               TensorProto.FLOAT16)
    # the planner leaves the Cast out of the group it fuses (a group with it has no kernel): ask the binder about the
    # candidate that holds it, as the planner did
    result = optimize(m)
    with_cast = [c for c in result.candidates if c.family == "elementwise" and
                 any(result.view.nodes[i].op_type == "Cast" for i in c.nodes)]
    reasons = [binder.bind(candidate_node(result.view, c, "fp32")) for c in with_cast]
    assert reasons and all(isinstance(r, str) for r in reasons), reasons
    assert any("is f32; the Elementwise_f16 kernel reads float inputs as f16" in r for r in reasons), reasons
    # nine operands: more than the kernel's eight inputs
    names = [f"x{i}" for i in range(9)]
    nodes = [h("Sum", names, ["s"], name="sum"), h("Relu", ["s"], ["y"], name="relu")]
    m = _model("wide", nodes, {k: (0, [4, 8]) for k in names}, {"y": [4, 8]}, {}, TensorProto.FLOAT)
    reasons = [binder.bind(n) for n in fused_nodes(optimize(m).model) if n.family == "elementwise"]
    assert reasons and all(isinstance(r, str) and "at most 8" in r for r in reasons), reasons


@pytest.mark.parametrize("name", LAYOUT_MODELS)
def test_layout_ops_fold_into_one_node(name: str) -> None:
    """Every layout op of the chain joins the one Elementwise node (none is left for ORT to run)."""
    rewritten = optimize(MODELS[name]()).model
    assert [n.op_type for n in rewritten.graph.node] == ["Elementwise_f32"], [n.op_type for n in rewritten.graph.node]
    (node,) = fused_nodes(rewritten)
    assert isinstance(ElementwiseBinder().bind(node), Binding), ElementwiseBinder().bind(node)


@pytest.mark.parametrize("name", LAYOUT_MODELS)
def test_layout_chain_optimized_to_fp16_runs_its_kernel(name: str, tmp_path: Path) -> None:
    """An fp32 model optimized with --precision fp16: the node's function widens its half inputs and narrows its
    outputs with Casts around the layout chain; the program reads through them (a load converts, a store rounds), so
    the chain still folds into one emulated device kernel, which matches the fp32 original."""
    from onnx_gtco.config import GtcoConfig

    original = MODELS[name]()
    result = optimize(original, GtcoConfig(precision="fp16"))
    assert elementwise_types(result.model) == {"Elementwise_f16"}
    lib = build_library(result.model, tmp_path, cuda=False, emulated=True, planned=result.planned())
    assert lib.cuda_op_types == ["Elementwise_f16"], (lib.skipped(), lib.kernel_skips)
    for seed in (0, 1):
        x = feeds(original, seed)
        want = cpu_session(original).run(None, x)
        got = cpu_session(result.model, lib.path).run(None, x)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape and np.isfinite(g).all()
            err = rel_error(g.astype(np.float32), w)
            assert 0 < err < 5e-3, f"{name} seed {seed}: ‖err‖/‖ref‖ = {err:.2e}"
