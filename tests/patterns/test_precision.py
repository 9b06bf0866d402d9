"""Half-precision exports fuse like fp32 ones: rules compare constants with the tolerance of their type.

fp16 and bf16 round the constants an exporter writes (sqrt(2) becomes 1.4140625 in both); a rule that compared them
with fp32's 1e-5 left an fp16 model's bias+GELU outside the GEMM. Here the built-in models, converted to fp16 (ORT's
converter, as the README says) and to bf16, must give the rules' exact fp32 matches, and a constant further off
than its type's rounding must still not match.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from onnx_gtco import models
from onnx_gtco.config import GtcoConfig
from onnx_gtco.families.gemm.rule import GemmPattern
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.patterns.find_activation import find_activation
from onnx_gtco.patterns.util import close, const_close, tolerance
from onnx_gtco.pipeline import plan_model

HALF = {"fp16": (TensorProto.FLOAT16, np.float16), "bf16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16)}


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's converter with fp32 inputs and outputs (it adds a Cast after each input and before each output)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_float_to_float16(model, keep_io_types=True)


FP32_ONLY = ("Conv",)  # ONNX's Conv takes bfloat16 from opset 22 only: it stays fp32 between Casts, as in AMP exports


def to_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float tensor, constant and Cast target becomes bfloat16 (ORT's converter knows only fp16), node names
    unchanged; a FP32_ONLY node keeps its fp32 weights and reads and writes through Casts."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    keep = {t for n in graph.node if n.op_type in FP32_ONLY for t in n.input[1:]}
    keep |= {n.input[1] for n in graph.node if n.op_type == "Pow"}  # Pow before opset 15 has no bfloat16 exponent

    def retype(t: onnx.TensorProto) -> None:
        if t.data_type == TensorProto.FLOAT and t.name not in keep:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(ml_dtypes.bfloat16), t.name))

    for t in graph.initializer:
        retype(t)
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.BFLOAT16
    nodes = []
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                retype(a.t)
            elif node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.BFLOAT16
        if node.op_type in FP32_ONLY:
            x, y = node.input[0], node.output[0]
            nodes.append(onnx.helper.make_node("Cast", [x], [f"{x}.fp32"], f"{node.name}.in", to=TensorProto.FLOAT))
            node.input[0], node.output[0] = f"{x}.fp32", f"{y}.fp32"
            nodes += [node, onnx.helper.make_node("Cast", [f"{y}.fp32"], [y], f"{node.name}.out",
                                                  to=TensorProto.BFLOAT16)]
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return out


CONVERT = {"fp16": to_fp16, "bf16": to_bf16}


def signature(view: GraphView, cands) -> set[tuple]:
    """Each candidate as its node names, family and attributes other than floats (epsilon and scale are values the
    model computes with, rounded to its type): activation, layouts, residual, mask, ..."""
    out = set()
    for c in cands:
        names = frozenset(view.nodes[i].name for i in c.nodes)
        attrs = tuple((k, v) for k, v in c.attrs if not isinstance(v, float))
        out.add((names, c.family, attrs))
    return out


def rules_and_plan(model: onnx.ModelProto, precision: str = "fp32") -> tuple[set[tuple], set[tuple], GraphView]:
    """The rules' candidates and the plan of `model` planned at `precision`: the fp32 model planned at the half
    precision prices the same half kernels as the half model planned as it is (its tensors' dtype is its
    kernels'). Without the patchify rewrite: the bf16 conversion keeps the conv in fp32 between Casts, and a Cast
    in the patch embedding's token chain keeps its NCHW restore from collapsing, a difference of the graphs, not of
    the rules."""
    planned = plan_model(load_model(model), GtcoConfig(precision=precision, patchify=False))
    view, cands, plan = planned.view, planned.candidates, planned.plan
    fused = {(frozenset(view.nodes[i].name for i in g.nodes), g.family, g.attr("activation"))
             for g in plan.fused_groups}
    return signature(view, cands), fused, view


FORMS = [
    ("vit-tiny", {}),
    ("vit-tiny", {"ln": "decomposed", "gelu": "tanh", "qkv": "split", "opset": 13, "batch": "N"}),
    ("vit-tiny", {"ln": "op", "gelu": "op", "qkv": "fused", "opset": 20}),
    ("bert-tiny", {}),
    ("bert-tiny", {"ln": "op", "gelu": "erf", "qkv": "fused", "opset": 17, "batch": "N"}),
]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize(("name", "forms"), FORMS, ids=[f"{n}-{'-'.join(map(str, f.values())) or 'default'}"
                                                        for n, f in FORMS])
def test_built_in_models_match_like_fp32(name: str, forms: dict, precision: str) -> None:
    """The rules find the fp32 model's candidates, with their families and (non-float) attributes, in the half model
    too. The only differences come from the Casts ORT's converter adds at the graph's inputs and outputs: a group
    may take one in (BERT's last LayerNorm tail with the output's Cast), and then stands for the fp32 group."""
    model = models.build(name, depth=2, **forms)
    ref, ref_plan, ref_view = rules_and_plan(model, precision)
    half, half_plan, _ = rules_and_plan(CONVERT[precision](model))
    original = {n.name for n in ref_view.nodes}
    extra = half - ref
    # each takes in a node the fp32 model does not have, or is a GEMM + LayerNorm whose LayerNorm writes a graph
    # output in the fp32 model (never merged there) and feeds the converter's output Cast in the half one
    assert all(c[0] - original or dict(c[2]).get("layernorm") for c in extra)
    for names, family, _ in ref - half:
        assert any(e[1] == family and e[0] & original == names for e in extra), (sorted(names), family)
    acts = {dict(c[2])["activation"] for c in ref if c[1] == "gemm"} - {"none"}
    assert len(acts) == 1  # the model's GELU, which the half model's rules name alike (checked above)
    # the plan fuses the GELU into its GEMM in both
    gelu_gemms = [g for g in ref_plan if g[1] == "gemm" and g[2] in acts]
    assert len(gelu_gemms) == 2
    assert set(gelu_gemms) <= half_plan


def test_vit_plan_is_the_fp32_plan() -> None:
    """Where no cost ties decide (the BERT mask's two 2-node groups cost the same), the half ViT's plan is the fp32
    one, group for group."""
    model = models.build("vit-tiny", depth=2)
    for precision, convert in CONVERT.items():
        assert rules_and_plan(convert(model))[1] == rules_and_plan(model, precision)[1]


# --- the tolerance itself, and a constant off by more than it -----------------------------------------------

def test_tolerance_is_the_rounding_error_of_the_type() -> None:
    assert tolerance(TensorProto.FLOAT) == tolerance(TensorProto.DOUBLE) == 1e-5  # the fp32 floor
    assert tolerance(0) == 1e-5  # an unknown type counts as float
    assert tolerance(TensorProto.FLOAT16) == 2.0**-11
    assert tolerance(TensorProto.BFLOAT16) == 2.0**-8
    assert tolerance(TensorProto.INT64) == 0.0
    sqrt2 = math.sqrt(2.0)
    for dtype, np_type in HALF.values():
        rounded = float(np.asarray(sqrt2).astype(np_type))
        assert rounded == 1.4140625
        assert close(rounded, sqrt2, dtype)
        assert not close(rounded, sqrt2, TensorProto.FLOAT)  # 1.1e-4 off: what fp32's tolerance rejected
    assert not close(float(np.float16(1.42)), sqrt2, TensorProto.FLOAT16)  # 4.0e-3 off, past fp16's 4.9e-4
    assert close(0.0, 0.0, TensorProto.FLOAT16) and not close(1e-8, 0.0, TensorProto.FLOAT16)  # zero stays exact


def gelu_linear(kit, precision: str, sqrt2: float, form: str = "erf"):
    """x @ W + b -> GELU (erf form dividing by `sqrt2`, or tanh form), everything in `precision`."""
    dtype, np_type = HALF.get(precision, (TensorProto.FLOAT, np.float32))
    g = kit.graph()
    g.input("x", [4, 8], dtype)
    g.op("MatMul", ["x", g.const("w", (g.rng.standard_normal((8, 16)) * 0.1).astype(np_type))], "mm")
    x = g.op("Add", [g.const("b", np.zeros(16, np_type)), "mm"], "bias")
    c = {k: g.const(k, np.asarray(v).astype(np_type)) for k, v in (
        ("half", 0.5), ("one", 1.0), ("sqrt2", sqrt2), ("three", 3.0), ("k0", 0.044715),
        ("k1", math.sqrt(2.0 / math.pi)))}
    if form == "erf":
        steps = [("Div", [x, c["sqrt2"]]), ("Erf", ["a0"]), ("Add", ["a1", c["one"]]), ("Mul", [x, "a2"]),
                 ("Mul", ["a3", c["half"]])]
    else:
        steps = [("Pow", [x, c["three"]]), ("Mul", ["a0", c["k0"]]), ("Add", [x, "a1"]), ("Mul", ["a2", c["k1"]]),
                 ("Tanh", ["a3"]), ("Add", ["a4", c["one"]]), ("Mul", [x, c["half"]]), ("Mul", ["a6", "a5"])]
    for i, (op, ins) in enumerate(steps):
        g.op(op, ins, f"a{i}")
    g.output(f"a{len(steps) - 1}")
    return g.view()


@pytest.mark.parametrize(("precision", "sqrt2", "found"), [
    ("fp16", math.sqrt(2.0), "gelu_erf"),  # stored as 1.4140625
    ("fp16", 1.4150390625, "gelu_erf"),  # the next fp16 value: within fp16's rounding of the activation
    ("fp16", 1.42, None),  # 1.419921875, 6 fp16 ulps off sqrt(2): GELU moves by 1.1e-3, past fp16's 4.9e-4
    ("fp32", 1.4140625, None),  # the fp16 value in an fp32 model: 1.1e-4 off, past fp32's 1e-5
    ("bf16", math.sqrt(2.0), "gelu_erf"),
    ("bf16", 1.5, None),  # 8 bf16 ulps off
])
def test_activation_constant_within_the_tolerance_of_its_type(kit, precision: str, sqrt2: float,
                                                              found: str | None) -> None:
    view = gelu_linear(kit, precision, sqrt2)
    act = find_activation(view, "bias")
    assert (act[0] if act else None) == found
    assert next(m for m in GemmPattern().match(view) if len(m.nodes) > 2 or found is None).attrs["activation"] \
        == (found or "none")


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_tanh_gelu_is_named_by_the_nearer_reference(kit, precision: str) -> None:
    """The erf and tanh GELUs differ by 4.7e-4, inside bf16's tolerance (and nearly fp16's): the half types'
    rounded tanh form (bf16: 3.0e-4 off its reference, 5.0e-4 off erf's) is still "gelu_tanh"."""
    view = gelu_linear(kit, precision, math.sqrt(2.0), form="tanh")
    assert find_activation(view, "bias")[0] == "gelu_tanh"
    assert find_activation(gelu_linear(kit, precision, math.sqrt(2.0)), "bias")[0] == "gelu_erf"


def test_pow_two_of_a_decomposed_layernorm_is_compared_in_its_type(kit) -> None:
    """const_close reads the constant's type: 2 in bf16 is exact; bf16's next value 2.015625 is not 2, nor is an
    fp32 2.00004 (2e-5 off, past fp32's 1e-5)."""
    g = kit.graph()
    g.input("x", [4, 8], TensorProto.BFLOAT16)
    exponents = {"two": np.asarray(2.0).astype(ml_dtypes.bfloat16),
                 "next": np.asarray(2.015625).astype(ml_dtypes.bfloat16), "f32": np.float32(2.00004)}
    for name, value in exponents.items():
        g.op("Pow", ["x", g.const(name, value)], f"pow_{name}")
        g.output(f"pow_{name}")
    view = g.view()
    assert const_close(view, "two", 2.0)
    assert not const_close(view, "next", 2.0)
    assert not const_close(view, "f32", 2.0)
