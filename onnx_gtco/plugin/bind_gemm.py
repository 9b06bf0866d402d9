"""Binders of the GEMM and QKV families: which input of a fused node is A, B, the bias, the residual, the weights.

The roles are read from the node's model-local function (the original MatMul / Gemm, bias Add, activation chain and
residual Add, canonically renamed: inputs x0.., outputs y0..), never guessed from the input order, and are cross-
checked against the node's attributes. The role order of each tuple is the C++ InRole / OutRole enums of
plugins/ort/gemm_op.h:

    gtco::Gemm  in:  A, B, BIAS, RESIDUAL                       out: Y
    gtco::Qkv   in:  A, W0, W1, W2, BIAS0, BIAS1, BIAS2         out: Y0, Y1, Y2

A decomposed activation's scalar constants (erf GELU's sqrt(2), 1, 0.5) are node inputs with no role: the binder
evaluates the chain on sample points with their values and checks it computes the activation the node names, which
the C++ side then computes itself. A node the C++ side cannot run gets a reason string instead of a Binding.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from onnx_gtco.patterns import _act
from onnx_gtco.plugin.binding import Binding, FusedNode

HEADER = "gemm_op.h"
DTYPES = ("f32", "f16", "bf16")                      # gtco::DType
ACTIVATIONS = ("none", "relu", "gelu_erf", "gelu_tanh", "silu", "quick_gelu", "sigmoid", "tanh", "relu6")
"""Activations gtco::ref::parse_act knows (plugins/cpu/gemm_ref.h), i.e. _act.REFERENCE's names and "none"."""

# Where the binder checks an activation chain: wider than _act's samples, so that Clip(0, 6) is not taken for Relu.
SAMPLES = np.linspace(-12.0, 12.0, 193)
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}   # the chain's constants are stored in the node's dtype

GEMM_IN = ("a", "b", "bias", "residual")              # gtco::Gemm::InRole
GEMM_OUT = ("y",)                                     # gtco::Gemm::OutRole
QKV_MAX_PROJ = 3                                      # gtco::Qkv::kMaxProj
QKV_IN = ("a", "w0", "w1", "w2", "bias0", "bias1", "bias2")   # gtco::Qkv::InRole
QKV_OUT = ("y0", "y1", "y2")                          # gtco::Qkv::OutRole


def _text(v: object) -> object:
    return v.decode() if isinstance(v, bytes) else v


class _Body:
    """The function body as a small dataflow graph over its canonical tensor names."""

    def __init__(self, fn: onnx.FunctionProto) -> None:
        self.nodes = list(fn.node)
        self.inputs = {t: i for i, t in enumerate(fn.input)}
        self.outputs = {t: i for i, t in enumerate(fn.output)}
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for t in n.input:
                if t:
                    self.readers.setdefault(t, []).append(n)

    def input_index(self, tensor: str) -> int | None:
        return self.inputs.get(tensor)

    def sole_reader(self, tensor: str) -> onnx.NodeProto | None:
        users = self.readers.get(tensor, [])
        if len(users) != 1 or tensor in self.outputs:
            return None
        return users[0]


def _other(node: onnx.NodeProto, tensor: str) -> str | None:
    """The other operand of a binary node that reads `tensor` once."""
    ins = [t for t in node.input if t]
    if len(ins) != 2 or ins.count(tensor) != 1:
        return None
    return ins[1] if ins[0] == tensor else ins[0]


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _check_activation(fused: FusedNode, body: _Body, nodes: list[onnx.NodeProto], x: str, out: str,
                      name: str) -> str | None:
    """None if `nodes` (in body order) compute activation `name` of x into `out`, else why not."""
    if name not in _act.REFERENCE:
        return f"activation {name!r} is not implemented by the C++ GEMM epilogue"
    env: dict[str, np.ndarray] = {x: SAMPLES}
    with np.errstate(all="ignore"):
        for n in nodes:
            args: list[np.ndarray | None] = []
            for t in n.input:
                if not t:
                    args.append(None)
                elif t in env:
                    args.append(env[t])
                elif (i := body.input_index(t)) is not None:
                    value = fused.inputs[i].value if i < len(fused.inputs) else None
                    if value is None or np.size(value) != 1:
                        return (f"activation node {n.op_type} reads node input {i} ({fused.node.input[i]!r}), "
                                "which is not a one-element constant")
                    args.append(np.asarray(value, dtype=np.float64).reshape(()))
                else:
                    return f"activation node {n.op_type} reads {t!r}, which the activation does not compute"
            view_node = types.SimpleNamespace(op_type=n.op_type, attrs=_attrs(n))
            val = _act._eval(view_node, args)  # type: ignore[arg-type]
            if val is None or len(n.output) != 1:
                return f"activation node {n.op_type} is not an elementwise op the binder can evaluate"
            env[n.output[0]] = np.broadcast_to(np.asarray(val, dtype=np.float64), SAMPLES.shape)
    if out not in env:
        return "the activation nodes do not compute the tensor the epilogue reads"
    tol = TOLERANCE.get(fused.dtype, 1e-5)
    want = _act.REFERENCE[name](SAMPLES)
    if not np.allclose(env[out], want, rtol=tol, atol=tol):
        diff = np.abs(env[out] - want)
        worst = float(SAMPLES[int(np.argmax(np.where(np.isnan(diff), np.inf, diff)))])
        return f"the activation nodes do not compute {name} (they differ from it at x={worst:g})"
    return None


def _dtype_reason(fused: FusedNode, roles: dict[str, int], dtype: str) -> str | None:
    for role, i in roles.items():
        got = fused.inputs[i].dtype if i < len(fused.inputs) else ""
        if got and got != dtype:
            return f"input {role} ({fused.node.input[i]!r}) is {got}; the {dtype} kernel takes {dtype} only"
    return None


@dataclass(frozen=True)
class GemmBinder:
    """`Gemm_*` nodes: y = act(alpha * A @ op(B) + beta * bias) + residual."""

    family: str = "gemm"
    header: str = HEADER
    cpp_struct: str = "gtco::Gemm"

    def bind(self, node: FusedNode) -> Binding | str:
        why = self._bind(node)
        if isinstance(why, str):
            return f"{node.node.op_type} node {node.node.name!r}: {why}"
        return why

    def _bind(self, node: FusedNode) -> Binding | str:
        dtype = node.dtype
        if dtype not in DTYPES:
            return f"dtype {dtype!r}: the C++ GEMM takes {', '.join(DTYPES)}"
        fn, at = node.function, {k: _text(v) for k, v in node.attrs.items()}
        body = _Body(fn)
        if len(fn.output) != 1:
            return (f"the group has {len(fn.output)} outputs (an intermediate is read outside it); the C++ GEMM "
                    "writes only the final one")
        mms = [n for n in body.nodes if n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx")]
        if len(mms) != 1:
            return f"the function has {len(mms)} MatMul/Gemm nodes, not one"
        mm = mms[0]
        used = {id(mm)}
        roles: dict[str, int] = {}
        for role, t in (("a", mm.input[0]), ("b", mm.input[1])):
            i = body.input_index(t)
            if i is None:
                return f"{mm.op_type} operand {role.upper()} is computed inside the group"
            roles[role] = i
        # Gemm's own attributes must be what the node says (the C++ side reads the node's)
        if mm.op_type == "Gemm":
            ga = _attrs(mm)
            own = {"trans_a": int(ga.get("transA", 0)), "trans_b": int(ga.get("transB", 0)),
                   "alpha": float(ga.get("alpha", 1.0)), "beta": float(ga.get("beta", 1.0))}
            if len(mm.input) > 2 and mm.input[2]:
                c = body.input_index(mm.input[2])
                if c is None:
                    return "Gemm's C operand is computed inside the group"
                roles["bias"] = c
        else:
            own = {"trans_a": 0, "trans_b": 0, "alpha": 1.0, "beta": 1.0}
        for key, value in own.items():
            node_value = type(value)(at.get(key, 0 if key.startswith("trans") else 1.0))
            if not np.isclose(node_value, value):
                return f"the node attribute {key}={node_value} differs from its {mm.op_type}'s {value}"
        cur = mm.output[0]
        # bias Add after the product (a Gemm's C is the bias already)
        if at.get("bias", 0):
            nxt = body.sole_reader(cur)
            o = _other(nxt, cur) if nxt is not None and nxt.op_type == "Add" else None
            if o is not None and body.input_index(o) is not None:
                if "bias" in roles:
                    return "a Gemm with C and a bias Add has two biases; the C++ GEMM takes one"
                if own["beta"] != 1.0:
                    return f"the Gemm has beta={own['beta']} but no C; the C++ GEMM would scale the bias Add by it"
                roles["bias"] = body.input_index(o)  # type: ignore[assignment]
                used.add(id(nxt))
                cur = nxt.output[0]  # type: ignore[union-attr]
            elif "bias" not in roles:
                return "the node attribute bias=1 but no bias Add follows the MatMul"
        elif "bias" in roles:
            return "the node attribute bias=0 but its Gemm has a C operand"
        # residual Add: the node that writes y0
        y = fn.output[0]
        act_out = y
        if at.get("residual", 0):
            last = body.producer.get(y)
            o = None if last is None or last.op_type != "Add" else next(
                (t for t in last.input if body.input_index(t) is not None), None)
            if last is None or o is None or id(last) in used:
                return "the node attribute residual=1 but the group does not end in an Add of a node input"
            inner = _other(last, o)
            if inner is None or inner in body.inputs:
                return "the residual Add does not add a node input to the epilogue's result"
            roles["residual"] = body.input_index(o)  # type: ignore[assignment]
            used.add(id(last))
            act_out = inner
        # the rest is the activation
        act_nodes = [n for n in body.nodes if id(n) not in used]
        act = str(at.get("activation", "none"))
        if act not in ACTIVATIONS:
            return f"activation {act!r} is not implemented by the C++ GEMM epilogue"
        if act == "none":
            if act_nodes:
                ops = ", ".join(n.op_type for n in act_nodes)
                return f"the node attribute activation='none' but the group has more nodes ({ops})"
            if act_out != cur:
                return "the epilogue's nodes do not form one chain from the MatMul to the output"
        else:
            if not act_nodes:
                return f"the node attribute activation={act!r} but the group has no activation nodes"
            why = _check_activation(node, body, act_nodes, cur, act_out, act)
            if why is not None:
                return why
        why = _dtype_reason(node, roles, dtype)
        if why is not None:
            return why
        ins = tuple(roles.get(r, -1) for r in GEMM_IN)
        return Binding(inputs=ins, outputs=(0,))


@dataclass(frozen=True)
class QkvBinder:
    """`Qkv_*` nodes: y_p = A @ W_p (+ bias_p), p < 3, one A."""

    family: str = "qkv"
    header: str = HEADER
    cpp_struct: str = "gtco::Qkv"

    def bind(self, node: FusedNode) -> Binding | str:
        why = self._bind(node)
        if isinstance(why, str):
            return f"{node.node.op_type} node {node.node.name!r}: {why}"
        return why

    def _bind(self, node: FusedNode) -> Binding | str:
        dtype = node.dtype
        if dtype not in DTYPES:
            return f"dtype {dtype!r}: the C++ QKV GEMM takes {', '.join(DTYPES)}"
        fn, at = node.function, {k: _text(v) for k, v in node.attrs.items()}
        body = _Body(fn)
        n_proj = len(fn.output)
        if n_proj > QKV_MAX_PROJ:
            return f"{n_proj} projections; the C++ QKV GEMM takes at most {QKV_MAX_PROJ}"
        has_bias = bool(at.get("bias", 0))
        a_index: int | None = None
        ws: list[int] = []
        biases: list[int] = []
        used: set[int] = set()
        for y in fn.output:
            last = body.producer.get(y)
            if last is None:
                return f"output {y} is not computed by the group"
            mm = last
            if has_bias:
                if last.op_type != "Add":
                    return "the node attribute bias=1 but an output is not a bias Add"
                mm_out = next((t for t in last.input if t in body.producer), None)
                b = _other(last, mm_out) if mm_out else None
                if mm_out is None or b is None or body.input_index(b) is None:
                    return "a bias Add does not add a node input to a MatMul's result"
                mm = body.producer[mm_out]
                if body.sole_reader(mm_out) is not last:
                    return "a projection's MatMul result is read twice"
                biases.append(body.input_index(b))  # type: ignore[arg-type]
                used.add(id(last))
            if mm.op_type != "MatMul":
                return f"output {y} is computed by {mm.op_type}, not a projection MatMul"
            a, w = body.input_index(mm.input[0]), body.input_index(mm.input[1])
            if a is None or w is None:
                return "a projection MatMul reads a tensor computed inside the group"
            if a_index is not None and a != a_index:
                return "the projections do not share their A operand"
            a_index = a
            ws.append(w)
            used.add(id(mm))
        extra = [n.op_type for n in body.nodes if id(n) not in used]
        if extra:
            return f"the group has nodes besides the projections and their biases: {', '.join(extra)}"
        if a_index is None:
            return "the group has no projections"
        ns = at.get("ns")
        if ns is not None and len(ns) != n_proj:  # type: ignore[arg-type]
            return f"the node attribute ns={list(ns)} lists {len(ns)} projections, the group has {n_proj}"  # type: ignore[arg-type]
        if ns is not None:
            for p, w in enumerate(ws):
                shape = node.inputs[w].shape if w < len(node.inputs) else None
                if shape is not None and len(shape) == 2 and isinstance(shape[1], int) and shape[1] != ns[p]:  # type: ignore[index]
                    return (f"the node attribute ns={list(ns)} is not in output order: weight {p} has N={shape[1]}")  # type: ignore[arg-type]
        roles = {"a": a_index} | {f"w{p}": w for p, w in enumerate(ws)} | {f"bias{p}": b for p, b in enumerate(biases)}
        why = _dtype_reason(node, roles, dtype)
        if why is not None:
            return why
        return Binding(inputs=tuple(roles.get(r, -1) for r in QKV_IN),
                       outputs=tuple(p if p < n_proj else -1 for p in range(len(QKV_OUT))))


GEMM = GemmBinder()
QKV = QkvBinder()
BINDERS = (GEMM, QKV)
"""The binders this module provides, one per family."""
