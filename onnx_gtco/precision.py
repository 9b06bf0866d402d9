"""Mixed precision inside optimize (`--precision fp16 | bf16`): the rewritten model's tensors in the half type.

The plan is made on the fp32 graph (the rules see exact constants); `convert` then turns the rewritten model into
one whose fused nodes compute in the half type on half tensors:

- **Fused nodes** read and write half tensors (op type `Gemm_f16`, `Attention_bf16`, ...), their weights stored
  in that type: what their device kernels take. The model-local function casts the half inputs to fp32, runs the
  group's original fp32 nodes and casts the outputs back. That is the kernels' computation (half operands, fp32
  accumulation, statistics and epilogues) up to the rounding of the intermediates a kernel keeps in the half type,
  and it runs on every execution provider: ORT's CPU EP has no bf16 kernels for most operators.
- **The unfused remainder** is converted by the rules of ONNX Runtime's float16 converter
  (`onnxruntime.transformers.float16`: its op block list, the inputs that stay float, `keep_io_types`), and what
  would lose range or precision stays fp32: reductions and normalisation statistics, Pow / Sqrt / Exp / Log,
  (Log)Softmax, and a node reading a small constant the half type cannot hold (BERT's epsilon 1e-12 is 0 in fp16).
  In bf16 only the operators that move data convert: ORT's CPU EP computes nothing else in bf16.
- **Graph inputs and outputs keep their dtypes**; Cast nodes sit wherever a tensor's producer and a consumer
  disagree, one per tensor and type. A float weight read in both types is stored in both. A float graph output a
  fused GEMM node without a residual writes is folded: the node writes it in fp32 itself (its kernel rounds the
  fp32 accumulator once, to fp32), no half copy and no Cast (ViT's classifier head writes `logits`). With a
  residual it is not: the kernel reads the residual in y's dtype, and the residual is a half tensor.
- Float weights convert with round-to-nearest-even, values past the half type's largest finite value clamped to it
  (as ORT's converter does). Weights left on disk by the loader (external data) stay fp32 behind a Cast.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper
from onnxruntime.transformers.float16 import ALWAYS_FLOAT_INPUTS, DEFAULT_OP_BLOCK_LIST

from onnx_gtco.errors import RewriteError
from onnx_gtco.ir.view import TensorInfo
from onnx_gtco.opspec import DOMAIN, decode_node, op_type, split_op_type

HALF_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
"""Precision -> the ONNX element type its tensors take."""
DTYPE_TAG = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16"}
_NUMPY = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16,
          TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn}

STATISTICS = frozenset({
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
    "ReduceProd", "Pow", "Sqrt", "Reciprocal", "Exp", "Log", "Softmax", "LogSoftmax", "LayerNormalization",
    "GroupNormalization", "InstanceNormalization", "LpNormalization", "MeanVarianceNormalization",
})
"""Operators whose results lose range or precision in a half type: they stay fp32 (beside ORT's block list)."""
OWN_DTYPE = frozenset({"EyeLike", "RandomNormal", "RandomNormalLike", "RandomUniform", "Multinomial", "Bernoulli",
                       "DequantizeLinear", "QuantizeLinear"})
"""Operators whose output dtype an attribute or another input fixes: they stay fp32."""
MOVES_DATA = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice",
                        "Gather", "Identity", "Shape"})
"""Operators that only move data: in bf16 these are the ones that convert (ORT's CPU EP has bf16 kernels for
them, and for almost no arithmetic)."""
SMALL_CONSTANT = 16
"""A constant input of at most this many elements is a scalar-like operand (an epsilon, a scale, a mask value):
when the half type cannot hold one of its values its node stays fp32. Larger ones are weights: rounded, clamped."""


@dataclass
class Conversion:
    """What `convert` did to a model.

    Attributes:
        model: the converted model.
        precision: "fp16" or "bf16".
        fused: fused nodes now computing on half tensors.
        converted: unfused nodes converted.
        kept: op type -> (count, reason) of the unfused nodes left in fp32 that touch float tensors.
        casts: Cast nodes added.
        outputs_folded: float graph outputs a fused node writes in fp32 itself (no Cast after it).
        dtypes: every float tensor whose dtype or name is new -> its ONNX element type now.
        source: a tensor name the conversion made (a cast, a half copy of a weight, a renamed graph output) -> the
            tensor whose shape it has.
    """

    model: onnx.ModelProto
    precision: str
    fused: int = 0
    converted: int = 0
    kept: dict[str, tuple[int, str]] = field(default_factory=dict)
    casts: int = 0
    outputs_folded: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)

    def info(self, planned: Callable[[str], TensorInfo | None]) -> Callable[[str], TensorInfo | None]:
        """`planned` (a tensor's type as the plan knew it, over the fp32 model) with this conversion's dtypes and
        names: the types of the converted model's tensors."""

        def info(name: str) -> TensorInfo | None:
            base = planned(self.source.get(name, name))
            if base is None:
                return None
            return TensorInfo(name, self.dtypes.get(name, base.dtype), base.shape)

        return info

    def shape_of(self, shape_of: Callable[[str], tuple | None]) -> Callable[[str], tuple | None]:
        """A shape lookup of the fp32 model (tune.tasks.view_shapes) extended to the names the conversion made."""
        return lambda name: shape_of(self.source.get(name, name))

    def to_json(self) -> dict[str, object]:
        return {
            "precision": self.precision, "fused_nodes": self.fused, "converted_nodes": self.converted,
            "casts_added": self.casts,
            "outputs_folded": self.outputs_folded,
            "kept_fp32": [{"op_type": op, "count": n, "reason": why} for op, (n, why) in sorted(self.kept.items())],
        }


def to_half(values: np.ndarray, dtype: int) -> np.ndarray:
    """fp32 values in the half (or E4M3) type `dtype`: round to nearest even, clamped to the largest finite value."""
    np_type = _NUMPY[dtype]
    big = float(ml_dtypes.finfo(np_type).max)
    return np.clip(values.astype(np.float32), -big, big).astype(np_type)


E4M3_MAX = 448.0
"""E4M3's (FN: no infinities) largest finite value: fp8's scales map a tensor's amax onto it (onnx_gtco.fp8)."""


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """fp32 values as E4M3 (ml_dtypes.float8_e4m3fn), rounded to nearest even and saturated to +-448 (ONNX
    QuantizeLinear with saturate=1)."""
    return to_half(np.asarray(x), TensorProto.FLOAT8E4M3FN)


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to E4M3 as to_e4m3 does, as fp32."""
    return to_e4m3(x).astype(np.float32)


def _half_tensor(t: onnx.TensorProto, dtype: int, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(to_half(numpy_helper.to_array(t), dtype), name)


def _holds(values: np.ndarray, dtype: int) -> bool:
    """Whether every value of a small constant survives in `dtype`: no nonzero value below its smallest normal
    number, none past its largest finite one."""
    info = ml_dtypes.finfo(_NUMPY[dtype])
    a = np.abs(values.astype(np.float64))
    a = a[np.isfinite(a) & (a != 0)]
    return not a.size or (a.min() >= float(info.smallest_normal) and a.max() <= float(info.max))


def _subgraphs(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def convert(model: onnx.ModelProto, precision: str, dtype_of: Callable[[str], int | None]) -> Conversion:
    """The rewritten model `model` (fp32 tensors, fused nodes recorded with `precision`) converted as the module
    docstring says. `dtype_of` gives each tensor's ONNX element type in `model` (None when unknown: such a tensor
    is left as it is).

    Raises:
        RewriteError: `precision` is not a half type; a fused node has no model-local function.
    """
    if precision not in HALF_TYPES:
        raise RewriteError(f"precision {precision!r}: the conversion is for {', '.join(HALF_TYPES)}")
    converter = _Converter(model, precision, dtype_of)
    converter.choose_nodes()
    converter.place_tensors()
    converter.write_nodes()
    return converter.finish()


class _Converter:
    """convert's steps over one model: 1. which nodes compute in the half type, 2. each float tensor's dtype as
    produced, 3. the nodes reading each input in the dtype they want, 4. the model."""

    def __init__(self, model: onnx.ModelProto, precision: str, dtype_of: Callable[[str], int | None]) -> None:
        self.model, self.dtype_of = model, dtype_of
        self.half = HALF_TYPES[precision]
        self.tag = DTYPE_TAG[self.half]
        self.graph = graph = model.graph
        self.conv = Conversion(model, precision)
        self.initializers = {t.name: t for t in graph.initializer}
        self.constants: dict[str, onnx.NodeProto] = {
            n.output[0]: n for n in graph.node
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output and self.is_float(n.output[0])
            and any(a.name == "value" for a in n.attribute)}
        self.outputs = {o.name for o in graph.output}
        self.low: list[bool] = []
        self.folded: set[str] = set()
        self.home: dict[str, int] = {}
        self.new_inits: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.alias: dict[tuple[str, int], str] = {}
        self.copies: set[str] = set()  # half copies of weights, initializers of their own
        self.new_functions: dict[tuple[str, str], onnx.FunctionProto] = {}
        self.used_functions: set[tuple[str, str, str]] = set()

    def is_float(self, t: str) -> bool:
        return bool(t) and self.dtype_of(t) == TensorProto.FLOAT

    def const_value(self, t: str) -> np.ndarray | None:
        if t in self.initializers and not external_data_helper.uses_external_data(self.initializers[t]):
            return numpy_helper.to_array(self.initializers[t])
        if t in self.constants:
            return numpy_helper.to_array(next(a.t for a in self.constants[t].attribute if a.name == "value"))
        return None

    def unholdable(self, t: str) -> bool:
        """Whether `t` is a small constant (an epsilon, a scale, a mask value) the half type cannot hold."""
        v = self.const_value(t) if self.is_float(t) else None
        return v is not None and v.size <= SMALL_CONSTANT and not _holds(v, self.half)

    def half_constant(self, value_of: str, name: str, node_name: str) -> onnx.NodeProto:
        """A Constant node `name` holding the value of the constant `value_of` in the half type."""
        value = self.const_value(value_of)
        assert value is not None
        return helper.make_node("Constant", [], [name], name=node_name,
                                value=numpy_helper.from_array(to_half(value, self.half), name))

    # 1. Which nodes compute in the half type: None, or why the node stays fp32.
    def keep_reason(self, n: onnx.NodeProto) -> str | None:
        if n.domain == DOMAIN:  # a fused node of a group that was not fp32 already computes in its own dtype
            return None if split_op_type(n.op_type)[1] == DTYPE_TAG[TensorProto.FLOAT] else "not an fp32 group"
        if _subgraphs(n):
            return "has a subgraph"
        if n.domain not in ("", "ai.onnx"):
            return f"operator of domain {n.domain}"
        if n.op_type in DEFAULT_OP_BLOCK_LIST:
            return "in ONNX Runtime's float16 op block list"
        if n.op_type in STATISTICS:
            return f"loses range or precision in {self.tag}"
        if n.op_type in OWN_DTYPE:
            return "its output dtype is fixed by an attribute or input"
        if self.half == TensorProto.BFLOAT16 and n.op_type not in MOVES_DATA:
            return "computes in fp32 in a bf16 model (ONNX Runtime's CPU EP has no bf16 kernel for it)"
        held = [t for t in n.input if self.unholdable(t)]
        return f"reads a constant {self.tag} cannot hold ({held[0]})" if held else None

    def choose_nodes(self) -> None:
        graph, conv = self.graph, self.conv
        touches = [any(self.is_float(t) for t in (*n.input, *n.output)) for n in graph.node]
        for n, floats in zip(graph.node, touches, strict=True):
            if n.output and n.output[0] in self.constants:
                self.low.append(False)  # a Constant: its value is converted with the weights below
                continue
            why = self.keep_reason(n) if floats else "no float tensors"
            self.low.append(why is None)
            if why is not None and floats:
                count, _ = conv.kept.get(n.op_type, (0, why))
                conv.kept[n.op_type] = (count + 1, why)
        self.folded = {o for n, is_low in zip(graph.node, self.low, strict=True) for o in n.output
                       if self.folds(n, is_low, o)}

    def wants(self, n: onnx.NodeProto, is_low: bool, i: int) -> int:
        """The dtype node `n` reads its float input `i` in."""
        if not is_low:
            return TensorProto.FLOAT
        if n.domain != DOMAIN and i in ALWAYS_FLOAT_INPUTS.get(n.op_type, []):
            return TensorProto.FLOAT
        if n.domain == DOMAIN and i not in _kernel_inputs(n):
            return TensorProto.FLOAT  # what the kernel does not read (a constant its attributes carry) stays exact
        # a fused node's epsilon or mask value its function reads: kept exact
        return TensorProto.FLOAT if self.unholdable(n.input[i]) else self.half

    def folds(self, n: onnx.NodeProto, is_low: bool, o: str) -> bool:
        """Whether the fused node `n` writes its float graph output `o` in fp32 itself: its op says it can
        (OpSpec.fp32_output: a GEMM without a residual, whose kernel has an fp32-output form; with a residual the
        residual would have to be fp32 too)."""
        if not (is_low and n.domain == DOMAIN and o in self.outputs and self.is_float(o)):
            return False
        op = decode_node(n)
        return not isinstance(op, str) and op.spec.fp32_output is not None and op.spec.fp32_output(op.attrs)

    # 2. Each float tensor's dtype as produced ("home"); weights read only in the half type convert in place.
    def place_tensors(self) -> None:
        graph, half, home = self.graph, self.half, self.home
        readers: dict[str, set[int]] = {}
        for n, is_low in zip(graph.node, self.low, strict=True):
            for i, t in enumerate(n.input):
                if self.is_float(t):
                    readers.setdefault(t, set()).add(self.wants(n, is_low, i))
        for t in self.outputs:
            if self.is_float(t):
                readers.setdefault(t, set()).add(TensorProto.FLOAT)
        for v in graph.input:
            if self.is_float(v.name):
                home[v.name] = TensorProto.FLOAT
        for t in graph.initializer:
            if t.data_type != TensorProto.FLOAT or t.name in home:
                self.new_inits.append(t)
                continue
            want = readers.get(t.name, set())
            on_disk = external_data_helper.uses_external_data(t)
            if want == {half} and not on_disk:
                self.new_inits.append(_half_tensor(t, half, t.name))
                home[t.name] = half
            else:
                self.new_inits.append(t)
                home[t.name] = TensorProto.FLOAT
        for t in self.constants:
            home[t] = half if readers.get(t, set()) == {half} else TensorProto.FLOAT
        for n, is_low in zip(graph.node, self.low, strict=True):
            for o in n.output:
                if self.is_float(o) and o not in home:
                    home[o] = half if is_low and o not in self.folded else TensorProto.FLOAT

    # 3. The nodes, in order, reading each input in the dtype they want (a Cast, or a half copy of a weight).
    def new_name(self, t: str, dtype: int) -> str:
        name = f"{t}.{DTYPE_TAG[dtype]}"
        self.conv.source[name] = t
        self.conv.dtypes[name] = dtype
        return name

    def read(self, t: str, dtype: int) -> str:
        if self.home.get(t, dtype) == dtype:
            return t
        key = (t, dtype)
        if key not in self.alias:
            name = self.new_name(t, dtype)
            init = self.initializers.get(t)
            if dtype == self.half and init is not None and not external_data_helper.uses_external_data(init):
                self.new_inits.append(_half_tensor(init, self.half, name))
                self.copies.add(name)
            elif dtype == self.half and t in self.constants:
                self.nodes.append(self.half_constant(t, name, f"gtco/const/{name}"))
            else:
                self.nodes.append(helper.make_node("Cast", [t], [name], name=f"gtco/cast/{name}", to=dtype))
                self.conv.casts += 1
            self.alias[key] = name
        return self.alias[key]

    def write_nodes(self) -> None:
        functions = {(f.domain, f.name, f.overload): f for f in self.model.functions}
        for n, is_low in zip(self.graph.node, self.low, strict=True):
            if n.output and n.output[0] in self.constants:
                self.nodes.append(self.half_constant(n.output[0], n.output[0], n.name)
                                  if self.home[n.output[0]] == self.half else n)
                continue
            out = onnx.NodeProto()
            out.CopyFrom(n)
            for i, t in enumerate(n.input):
                if self.is_float(t):
                    out.input[i] = self.read(t, self.wants(n, is_low, i))
            after = self.write_low(n, out, functions) if is_low else []
            if not is_low and n.domain == DOMAIN:
                self.used_functions.add((n.domain, n.op_type, n.overload))
            self.nodes.append(out)
            self.nodes.extend(after)

    def write_low(self, n: onnx.NodeProto, out: onnx.NodeProto,
                  functions: dict[tuple[str, str, str], onnx.FunctionProto]) -> list[onnx.NodeProto]:
        """`out`, the copy of a node computing in the half type, made so; the Casts of its graph outputs after it."""
        conv, half = self.conv, self.half
        after: list[onnx.NodeProto] = []
        for j, o in enumerate(n.output):
            if o in self.folded:  # the node writes the fp32 graph output itself
                conv.outputs_folded += 1
            elif o in self.outputs and self.is_float(o):  # a graph output keeps its dtype: the node writes a half copy
                out.output[j] = renamed = self.new_name(o, half)
                self.home[renamed] = half
                self.home[o] = TensorProto.FLOAT
                self.alias[(o, half)] = renamed
                after.append(helper.make_node("Cast", [renamed], [o], name=f"gtco/cast/{o}", to=TensorProto.FLOAT))
                conv.casts += 1
        if n.domain == DOMAIN:
            key = (n.domain, n.op_type, n.overload)
            if key not in functions:
                raise RewriteError(f"fused node {n.name!r} ({n.op_type}) has no model-local function")
            fn = _half_function(functions[key], [self.is_float(t) and self.wants(n, True, i) == half
                                                 for i, t in enumerate(n.input)],
                                [self.is_float(t) and t not in self.folded for t in n.output], half,
                                list(self.model.opset_import))
            self.new_functions.setdefault((fn.name, fn.overload), fn)
            out.op_type, out.overload = fn.name, fn.overload
            conv.fused += 1
            return after
        conv.converted += 1
        if n.op_type == "Cast":
            for a in out.attribute:
                if a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = half
        if n.op_type == "ConstantOfShape":
            for a in out.attribute:
                if a.name == "value" and a.t.data_type == TensorProto.FLOAT:
                    a.t.CopyFrom(_half_tensor(a.t, half, a.t.name))
        return after

    # 4. The model: value_info in the new dtypes, the fused nodes' new functions beside the ones still used.
    def finish(self) -> Conversion:
        graph, conv, model = self.graph, self.conv, self.model
        for t, dtype in self.home.items():
            if dtype != TensorProto.FLOAT:
                conv.dtypes.setdefault(t, dtype)
        shapes = {vi.name: vi for vi in [*graph.input, *graph.value_info, *graph.output]}
        value_info = []
        for vi in graph.value_info:
            v = onnx.ValueInfoProto()
            v.CopyFrom(vi)
            if vi.name in self.home and v.type.HasField("tensor_type"):
                v.type.tensor_type.elem_type = self.home[vi.name]
            value_info.append(v)
        for name, src in conv.source.items():
            if src in shapes and name not in self.copies:
                v = onnx.ValueInfoProto()
                v.CopyFrom(shapes[src])
                v.name = name
                v.type.tensor_type.elem_type = conv.dtypes[name]
                value_info.append(v)
        fused_names = {(f.domain, f.name, f.overload) for f in model.functions if f.domain == DOMAIN}
        kept_functions = [f for f in model.functions
                          if (f.domain, f.name, f.overload) not in fused_names or
                          (f.domain, f.name, f.overload) in self.used_functions]
        new_graph = helper.make_graph(self.nodes, graph.name, list(graph.input), list(graph.output), self.new_inits,
                                      value_info=value_info, sparse_initializer=list(graph.sparse_initializer))
        new_graph.doc_string = graph.doc_string
        out_model = onnx.ModelProto()
        out_model.CopyFrom(model)
        out_model.graph.CopyFrom(new_graph)
        del out_model.functions[:]
        out_model.functions.extend([*kept_functions, *(self.new_functions[k] for k in sorted(self.new_functions))])
        conv.model = out_model
        return conv


def _kernel_inputs(n: onnx.NodeProto) -> frozenset[int]:
    """The inputs a fused node's kernel reads: its roles' (every input of a family without roles)."""
    op = decode_node(n)
    if not isinstance(op, str) and op.inputs:
        return frozenset(op.inputs.values())
    return frozenset(range(len(n.input)))


def _half_function(fn: onnx.FunctionProto, half_in: list[bool], half_out: list[bool], half: int,
                   opsets: list[onnx.OperatorSetIdProto]) -> onnx.FunctionProto:
    """The function of a fused node on half tensors: its half inputs cast to fp32, the fp32 body, the float
    outputs of `half_out` cast to the half type (the others, folded graph outputs, stay fp32). Named by the node's
    new op type; the overload hashes the new body."""
    family, _ = split_op_type(fn.name)
    cast_in = {x: f"{x}_f32" for x, f in zip(fn.input, half_in, strict=True) if f}
    cast_out = {y: f"{y}_f32" for y, f in zip(fn.output, half_out, strict=True) if f}
    body = [helper.make_node("Cast", [x], [name], name=f"cast_{x}", to=TensorProto.FLOAT)
            for x, name in cast_in.items()]
    # ONNX Runtime's LayerNormFusion (1.30) takes a Cast from fp16 straight into ReduceMean as a half-precision
    # LayerNorm and pairs it with the fp32 scale it folds from the Cast of a weight: an ill-typed node, and the
    # session fails to load. A Max(x, x) between the two (the identity) keeps the fallback loadable.
    statistics_inputs = {t for node in fn.node if node.op_type == "ReduceMean" for t in node.input[:1]}
    for x in [x for x in cast_in if x in statistics_inputs]:
        guarded = f"{cast_in[x]}_guard"
        body += [helper.make_node("Max", [cast_in[x], cast_in[x]], [guarded], name=f"guard_{x}")]
        cast_in[x] = guarded
    for node in fn.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        for i, t in enumerate(n.input):
            n.input[i] = cast_in.get(t, cast_out.get(t, t))
        for i, t in enumerate(n.output):
            n.output[i] = cast_out.get(t, t)
        body.append(n)
    body += [helper.make_node("Cast", [name], [y], name=f"cast_{y}", to=half) for y, name in cast_out.items()]
    imports = list(fn.opset_import)
    if not any(o.domain in ("", "ai.onnx") for o in imports):
        imports.append(next(o for o in opsets if o.domain in ("", "ai.onnx")))
    new = helper.make_function(DOMAIN, op_type(family, DTYPE_TAG[half]), list(fn.input), list(fn.output), body,
                               opset_imports=imports, attributes=list(fn.attribute))
    new.overload = "v" + hashlib.sha256(new.SerializeToString(deterministic=True)).hexdigest()[:12]
    return new


__all__ = ["E4M3_MAX", "HALF_TYPES", "Conversion", "convert", "round_e4m3", "to_e4m3", "to_half"]
