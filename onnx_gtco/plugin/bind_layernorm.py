"""Binder of the LayerNorm family (op types Layernorm_*) for plugins/ort/layernorm_op.h.

The node's function is one of the group shapes of onnx_gtco/patterns/layernorm.py:

    [Add(a, b) ->] x -> LayerNormalization(x, gamma[, beta]) -> y
    [Add(a, b) ->] x -> ReduceMean -> Sub -> Pow 2 | Mul -> ReduceMean -> Add eps -> Sqrt -> Div | Reciprocal+Mul
                     -> [Mul gamma] -> [Add beta] -> y

Roles (C++ `gtco::LayerNorm::InRole` / `OutRole`): inputs a (x, or the residual Add's first addend), b (its second
addend), gamma, beta; outputs y and sum (the residual sum, when the node outputs it). Every role operand must be a
node input (or output) as it is; anything else gives a reason and the node keeps its function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from onnx_gtco.plugin.binding import Binding, FusedNode, TensorInfo

IN_ROLES = ("a", "b", "gamma", "beta")   # IN_A, IN_B, IN_GAMMA, IN_BETA in layernorm_op.h
OUT_ROLES = ("y", "sum")                 # OUT_Y, OUT_SUM
DTYPES = ("f32", "f16", "bf16")
_DECOMPOSED_OPS = {"ReduceMean", "Sub", "Pow", "Mul", "Add", "Sqrt", "Div", "Reciprocal", "Constant"}


class _Unbound(Exception):
    """A reason the node cannot be bound (the message)."""


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _numel(shape: tuple[int | str, ...] | None) -> int | None:
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))


@dataclass(frozen=True)
class LayerNormBinder:
    """Roles of a Layernorm_* node from its function body."""

    family: str = "layernorm"
    header: str = "layernorm_op.h"
    cpp_struct: str = "gtco::LayerNorm"

    def bind(self, node: FusedNode) -> Binding | str:
        try:
            return self._bind(node)
        except _Unbound as e:
            return str(e)

    def _bind(self, node: FusedNode) -> Binding:
        if node.dtype not in DTYPES:
            raise _Unbound(f"dtype {node.dtype}: the kernel takes {', '.join(DTYPES)}")
        fn = node.function
        f_in = {t: i for i, t in enumerate(fn.input)}
        f_out = {t: i for i, t in enumerate(fn.output)}
        producer = {t: n for n in fn.node for t in n.output if t}
        body = [n for n in fn.node if n.op_type != "Constant"]
        for n in fn.node:
            if n.domain not in ("", "ai.onnx"):
                raise _Unbound(f"{n.op_type} {n.name!r} of domain {n.domain!r} in the body")

        def node_input(t: str, what: str) -> int:
            if t not in f_in:
                src = producer.get(t)
                raise _Unbound(f"{what} {t!r} is computed in the body"
                               + (f" by {src.op_type} {src.name!r}" if src is not None else "")
                               + ", not a node input")
            return f_in[t]

        lns = [n for n in body if n.op_type == "LayerNormalization"]
        if lns:
            if len(lns) != 1:
                raise _Unbound(f"the body has {len(lns)} LayerNormalization nodes")
            ln = lns[0]
            extra = [t for t in ln.output[1:] if t]
            if extra:
                raise _Unbound(f"LayerNormalization {ln.name!r} also outputs mean / inverse std {extra}")
            x, y = ln.input[0], ln.output[0]
            gamma = ln.input[1] if len(ln.input) > 1 and ln.input[1] else None
            beta = ln.input[2] if len(ln.input) > 2 and ln.input[2] else None
            rest = [n for n in body if n is not ln]
        else:
            x, y, gamma, beta, rest = self._decomposed(body, producer)
        # residual Add
        a = b = None
        add = producer.get(x)
        sum_out = -1
        if x in f_in:
            a = f_in[x]
        elif add is not None and add.op_type == "Add" and add in rest:
            a = node_input(add.input[0], "residual addend")
            b = node_input(add.input[1], "residual addend")
            rest = [n for n in rest if n is not add]
            sum_out = f_out.get(x, -1)
        else:
            raise _Unbound(f"the normalised tensor {x!r} is neither a node input nor a residual Add of two")
        if rest:
            raise _Unbound(f"the body has nodes the kernel does not compute: "
                           f"{', '.join(f'{n.op_type} {n.name!r}' for n in rest[:3])}")
        if y not in f_out:
            raise _Unbound(f"the normalised output {y!r} is not a node output")
        others = [t for t in fn.output if t not in (y, x)]
        if others:
            raise _Unbound(f"the node also outputs intermediates {others} (read outside the group)")
        g = node_input(gamma, "scale") if gamma else -1
        bt = node_input(beta, "bias") if beta else -1
        self._check_operands(node, a, b, g, bt)
        ins = (a, -1 if b is None else b, g, bt)
        return Binding(inputs=ins, outputs=(f_out[y], sum_out))

    @staticmethod
    def _decomposed(body: list[onnx.NodeProto], producer: dict[str, onnx.NodeProto]
                    ) -> tuple[str, str, str | None, str | None, list[onnx.NodeProto]]:
        """x, y, gamma, beta and the nodes outside the normalisation chain, for the decomposed form."""
        bad = [n for n in body if n.op_type not in _DECOMPOSED_OPS]
        if bad:
            raise _Unbound(f"{bad[0].op_type} {bad[0].name!r} is not part of a LayerNorm")
        rms = [n for n in body if n.op_type == "ReduceMean"]
        if len(rms) != 2:
            raise _Unbound(f"the body has {len(rms)} ReduceMean nodes, not the decomposed LayerNorm's two")
        first = next((n for n in rms if producer.get(n.input[0]) is None
                      or producer[n.input[0]].op_type not in ("Pow", "Mul")), None)
        if first is None:
            raise _Unbound("no ReduceMean of x found in the body")
        x = first.input[0]
        # The chain's nodes: everything reachable from x except the residual Add that may produce x.
        chain: list[onnx.NodeProto] = []
        reach = {x}
        for n in body:  # function bodies are topologically sorted
            if any(t in reach for t in n.input):
                chain.append(n)
                reach.update(t for t in n.output if t)
        users: dict[str, list[onnx.NodeProto]] = {}
        for n in chain:
            for t in n.input:
                users.setdefault(t, []).append(n)
        sinks = [t for n in chain for t in n.output if t and t not in users]
        if len(sinks) != 1:
            raise _Unbound(f"the normalisation chain ends in {len(sinks)} tensors, not one")
        y = sinks[0]
        # affine tail: [Mul gamma] [Add beta] after the Div / Reciprocal-Mul of the deviation
        gamma = beta = None
        t = y
        n = producer[t]
        if n.op_type == "Add" and not _in_core(n, x, producer):
            beta = next(i for i in n.input if i not in reach)
            t = next(i for i in n.input if i in reach)
            n = producer[t]
        if n.op_type == "Mul" and not _in_core(n, x, producer):
            gamma = next(i for i in n.input if i not in reach)
        return x, y, gamma, beta, [m for m in body if m not in chain]

    @staticmethod
    def _check_operands(node: FusedNode, a: int, b: int | None, g: int, bt: int) -> None:
        infos: list[tuple[str, TensorInfo]] = [("x", node.inputs[a])]
        if b is not None:
            infos.append(("residual addend", node.inputs[b]))
        infos += [(w, node.inputs[i]) for w, i in (("scale", g), ("bias", bt)) if i >= 0]
        for what, info in infos:
            if info.dtype and info.dtype != node.dtype:
                raise _Unbound(f"{what} {info.name!r} is {info.dtype}; the {node.node.op_type} kernel takes "
                               f"{node.dtype} only")
        x_shape = node.inputs[a].shape
        axis = node.attrs.get("axis", -1)
        if not isinstance(axis, int) or axis >= 0:
            raise _Unbound(f"axis attribute {axis!r} is not a negative int")
        if b is not None:
            bs = node.inputs[b].shape
            if x_shape is not None and bs is not None and (len(bs) != len(x_shape) or any(
                    isinstance(p, int) and isinstance(q, int) and p != q for p, q in zip(x_shape, bs, strict=True))):
                raise _Unbound(f"residual addends of shapes {x_shape} and {bs} broadcast; the kernel adds equal "
                               "shapes only")
        hidden = _numel(x_shape[axis:]) if x_shape is not None and len(x_shape) >= -axis else None
        for what, i in (("scale", g), ("bias", bt)):
            if i < 0:
                continue
            s = node.inputs[i].shape
            n = _numel(s)
            if s is None or n is None:
                continue
            lead = s[:axis] if len(s) > -axis else ()
            if n != 1 and (any(d != 1 for d in lead) or (hidden is not None and n != hidden)):
                raise _Unbound(f"{what} of shape {list(s)} is not one value per normalised element of x "
                               f"{list(x_shape or ())}")


def _in_core(n: onnx.NodeProto, x: str, producer: dict[str, onnx.NodeProto]) -> bool:
    """n is part of the mean / variance core (a Mul of the deviation by 1/std, or the Add of eps): one of its
    inputs comes from a Sqrt / Reciprocal / ReduceMean."""
    del x
    for t in n.input:
        p = producer.get(t)
        if p is not None and p.op_type in ("Sqrt", "Reciprocal", "ReduceMean"):
            return True
    return False
