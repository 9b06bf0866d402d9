"""Partial and interleaved rotary embeddings over blocks of the head (families/elementwise/rotary_blocks.py): the
rewrite gives the original's bits, leaves what it cannot block alone, and lets each rotary run as one elementwise
kernel before the attention, over static and symbolic dims, equal to the original through the CPU library and the
emulated kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cpu_session import assert_close_through_built_libraries
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.families.elementwise.rotary_blocks import block_rotaries, blocked_rotaries
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.plugin.coverage import model_coverage

B, H, S = 2, 4, 16


def _ints(name: str, *v: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(v, np.int64), name)


def rotary_model(forms: dict[str, str], rotated: int, width: int = 32, *, attention: bool = False,
                 symbolic: bool = False) -> onnx.ModelProto:
    """q (and k) [B, H, S, width], each rotated over its first `rotated` dims in the form forms[x]: "half" (GPT-NeoX,
    Phi: Concat(-x1[..., r/2:], x1[..., :r/2])) or "pairs" (GPT-J: the interleaved rotate-every-two, Reshape of
    Concat(Unsqueeze(-x1[..., 1::2]), Unsqueeze(x1[..., 0::2])))), the rest passed through by a Concat when
    rotated < width. cos and sin [1, 1, S, rotated] are computed from angles, a constant or (`symbolic`, batch and
    seq named) an input [seq, rotated]. With `attention`, softmax(q_rot k_rotᵀ / √width) v after them."""
    r, d = rotated, width
    inits = [_ints("zero", 0), _ints("r", r), _ints("end", 2**62), _ints("last", -1), _ints("lead", 0, 1),
             _ints("half", r // 2), _ints("one", 1), _ints("two", 2), _ints("rows", 0, 0, 0, r),
             numpy_helper.from_array(np.float32(d ** -0.5), "scale")]
    if not symbolic:
        angles = np.outer(np.arange(S), 1.0 / 10000 ** (np.arange(r) // 2 * 2 / r)).astype(np.float32)
        inits.append(numpy_helper.from_array(angles, "angles"))
    nodes = [helper.make_node("Cos", ["angles"], ["cos2"]), helper.make_node("Sin", ["angles"], ["sin2"]),
             helper.make_node("Unsqueeze", ["cos2", "lead"], ["cos"]),
             helper.make_node("Unsqueeze", ["sin2", "lead"], ["sin"])]

    def rope(x: str) -> str:
        x1 = x
        if r < d:
            nodes.append(helper.make_node("Slice", [x, "zero", "r", "last"], [f"{x}_1"]))
            x1 = f"{x}_1"
        if forms[x] == "half":
            nodes.extend([helper.make_node("Slice", [x1, "zero", "half", "last"], [f"{x}_lo"]),
                          helper.make_node("Slice", [x1, "half", "end", "last"], [f"{x}_hi"]),
                          helper.make_node("Neg", [f"{x}_hi"], [f"{x}_n"]),
                          helper.make_node("Concat", [f"{x}_n", f"{x}_lo"], [f"{x}_r"], axis=-1)])
        else:
            nodes.extend([helper.make_node("Slice", [x1, "zero", "end", "last", "two"], [f"{x}_even"]),
                          helper.make_node("Slice", [x1, "one", "end", "last", "two"], [f"{x}_odd"]),
                          helper.make_node("Neg", [f"{x}_odd"], [f"{x}_n"]),
                          helper.make_node("Unsqueeze", [f"{x}_n", "last"], [f"{x}_nu"]),
                          helper.make_node("Unsqueeze", [f"{x}_even", "last"], [f"{x}_eu"]),
                          helper.make_node("Concat", [f"{x}_nu", f"{x}_eu"], [f"{x}_st"], axis=-1),
                          helper.make_node("Reshape", [f"{x}_st", "rows"], [f"{x}_r"])])
        nodes.extend([helper.make_node("Mul", [x1, "cos"], [f"{x}_c"]),
                      helper.make_node("Mul", [f"{x}_r", "sin"], [f"{x}_s"]),
                      helper.make_node("Add", [f"{x}_c", f"{x}_s"], [f"{x}_rot" if r < d else f"{x}_out"])])
        if r < d:
            nodes.extend([helper.make_node("Slice", [x, "r", "end", "last"], [f"{x}_pass"]),
                          helper.make_node("Concat", [f"{x}_rot", f"{x}_pass"], [f"{x}_out"], axis=-1)])
        return f"{x}_out"

    outputs = [rope(x) for x in forms]
    if attention:
        q, k = outputs
        nodes.extend([helper.make_node("Mul", [q, "scale"], ["qs"]),
                      helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
                      helper.make_node("MatMul", ["qs", "kt"], ["scores"]),
                      helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
                      helper.make_node("MatMul", ["probs", "v"], ["out"])])
        outputs = ["out"]
    shape = ["batch", H, "seq", d] if symbolic else [B, H, S, d]
    inputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)
              for x in (*forms, *(("v",) if attention else ()))]
    if symbolic:
        inputs.append(helper.make_tensor_value_info("angles", TensorProto.FLOAT, ["seq", r]))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape) for o in outputs]
    graph = helper.make_graph(nodes, "rope", inputs, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # each op as written
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


MIXED = {"q": "half", "k": "pairs"}


@pytest.mark.parametrize("forms, rotated", [({"q": "half"}, 16), ({"q": "pairs"}, 16), ({"q": "pairs"}, 32),
                                            ({"q": "half"}, 8)],
                         ids=["partial-half", "partial-pairs", "full-pairs", "quarter-half"])
def test_the_blocked_rotary_gives_the_same_bits(forms: dict[str, str], rotated: int) -> None:
    model = load_model(rotary_model(forms, rotated))
    rewritten, found = blocked_rotaries(model)
    assert [(b.rotated, b.width, b.half) for b in found] == [
        (rotated, 32, rotated // 2 if forms["q"] == "half" else None)]
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Neg" not in ops and ops.count("Where") == (rotated < 32), ops
    onnx.checker.check_model(rewritten, full_check=True)
    q = np.random.default_rng(3).standard_normal((B, H, S, 32)).astype(np.float32)
    np.testing.assert_array_equal(_run(rewritten, {"q": q})[0], _run(model, {"q": q})[0])


@pytest.mark.parametrize("forms, rotated, width", [({"q": "half"}, 32, 48), ({"q": "half"}, 32, 32)],
                         ids=["rotated-part-not-dividing-the-head", "full-rotate-half"])
def test_what_is_not_blocked_is_left_alone(forms: dict[str, str], rotated: int, width: int) -> None:
    """A rotated part that does not divide the head (Phi-2: 32 of 80) has no blocked form; a full rotate-half needs
    none (the signed roll, rotate.py)."""
    model = load_model(rotary_model(forms, rotated, width))
    assert block_rotaries(GraphView(model)) == []
    assert blocked_rotaries(model) == (model, [])


def _fused_ops(model: onnx.ModelProto) -> dict[str, list[str]]:
    funcs = {f.name: [n.op_type for n in f.node] for f in model.functions}
    return {n.name: funcs[n.op_type] for n in model.graph.node if n.domain == "ai.gtco"}


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_each_rotary_is_one_elementwise_kernel_before_the_attention(symbolic: bool) -> None:
    """Before, the partial rotary's Concat and the interleave moved computed values: their Slices, Negs, Concats
    and Reshapes ran in ONNX Runtime between kernels. Now q's and k's rotaries each are (or share) one elementwise
    kernel, their cos / sin tables a group of their own where they are computed in the graph, the attention one
    kernel, and nothing of the rotaries is left to launch."""
    result = optimize(rotary_model(MIXED, 16, attention=True, symbolic=symbolic), GtcoConfig(precision="fp16"))
    fused = _fused_ops(result.model)
    ropes = [ops for ops in fused.values() if "Where" in ops]
    assert ropes and sum(ops.count("Where") for ops in ropes) == 2, fused
    assert sum(name.startswith("Attention") for name in (n.op_type for n in result.model.graph.node)) == 1
    left = [n.op_type for n in result.model.graph.node if n.domain != "ai.gtco"]
    assert not set(left) & {"Slice", "Concat", "Neg", "Where", "Mul", "Add", "Softmax"}, left
    coverage = model_coverage(result.model)
    assert {n: c.reason for n, c in coverage.nodes.items() if not c.archs} == {}


@pytest.mark.slow
@pytest.mark.parametrize("symbolic, precision", [(False, "fp16"), (True, "fp32")], ids=["static-fp16", "symbolic-fp32"])
def test_the_cpu_library_and_the_emulated_kernels_compute_the_original(tmp_path: Path, symbolic: bool,
                                                                       precision: str) -> None:
    original = rotary_model(MIXED, 16, attention=True, symbolic=symbolic)
    rewritten = optimize(original, GtcoConfig(precision=precision)).model
    sizes = ({"batch": 2, "seq": 16}, {"batch": 1, "seq": 5}) if symbolic else ({},)
    assert_close_through_built_libraries(original, rewritten, tmp_path, 5e-3 if precision == "fp16" else 2e-3,
                                         f"blocked rotary {precision}", "Elementwise_", sizes=sizes)
