"""Hypothesis strategies for random valid ONNX models built from the motifs the fusion rules look for.

A model is a random DAG of motifs (a linear layer with its epilogue, a Gemm on flattened rows, attention with or
without its head split, LayerNorm as one op or decomposed, a scaled and masked Softmax, elementwise chains with
broadcasts, layout round trips, Concat/Split, a mean-centring), each reading tensors that earlier motifs wrote or
new graph inputs, so inputs are shared and motifs connect. Graph outputs are every tensor nobody reads plus a random
choice of tensors from inside the motifs (the intermediates a fused group would have to keep as outputs).

Every model is float32 with static shapes, optionally a symbolic batch dim on its inputs, opset 17, 18 or 20, and
comes with seeded feeds (standard normal floats, never zeros; additive masks of 0 / -1e4 and boolean masks that
leave every row at least one visible key). `cases()` draws one model, `merged()` puts several into one model as
disjoint subgraphs (one custom-op library for all of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

FLOAT = TensorProto.FLOAT
Shape = tuple[int, ...]


@dataclass
class Case:
    """One random model with the feeds to run it and the motifs it was built from."""

    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    motifs: list[str] = field(default_factory=list)

    def __repr__(self) -> str:  # what hypothesis prints for a failing example: the model as ONNX text
        return f"Case(motifs={self.motifs}, feeds={ {k: v.shape for k, v in self.feeds.items()} })\n" \
               f"{onnx.printer.to_text(self.model)}"

    def _repr_pretty_(self, p, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


class Builder:
    """Accumulates nodes, initializers and graph inputs with the static shape of every float tensor made."""

    def __init__(self, draw: Callable, opset: int, batch: int, seq: int, heads: int, head_dim: int,
                 symbolic_batch: bool, seed: int, prefix: str = "") -> None:
        self.draw, self.opset = draw, opset
        self.b, self.s, self.nh, self.hd = batch, seq, heads, head_dim
        self.h = heads * head_dim
        self.symbolic_batch = symbolic_batch
        self.rng = np.random.default_rng(seed)
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.shapes: dict[str, Shape] = {}
        self.pool: list[str] = []  # float tensors later motifs may read
        self.inner: list[str] = []  # intermediates of motifs: candidates for graph outputs
        self.read: set[str] = set()
        self.motifs: list[str] = []
        self._n = 0

    # --- names, inputs, constants, nodes ---------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{self.prefix}{hint}{self._n}"

    def input(self, shape: Shape, hint: str = "x", value: np.ndarray | None = None) -> str:
        """A new float graph input (standard normal unless `value`), batch dim symbolic when the model says so."""
        name = self.fresh(hint)
        dims: list[int | str] = list(shape)
        if self.symbolic_batch and shape and shape[0] == self.b and hint != "mask":
            dims[0] = "N"
        arr = value if value is not None else self.rng.standard_normal(shape).astype(np.float32)
        self.inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), dims))
        self.feeds[name] = arr
        if arr.dtype == np.float32:
            self.shapes[name] = tuple(shape)
        return name

    def const(self, value: np.ndarray | float, hint: str = "c") -> str:
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(arr, name))
        if arr.dtype == np.float32:
            self.shapes[name] = tuple(arr.shape)
        return name

    def weight(self, k: int, n: int) -> str:
        return self.const(self.rng.standard_normal((k, n)) / math.sqrt(k), "w")

    def op(self, op_type: str, inputs: list[str], shape: Shape | None, n_out: int = 1, **attrs) -> list[str]:
        """Append a node; its float outputs of `shape` (None: not float, or shapes given later) are recorded."""
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(f"n_{op_type}_"), **attrs))
        self.read.update(t for t in inputs if t)
        if shape is not None:
            for o in outs:
                self.shapes[o] = shape
        return outs

    def op1(self, op_type: str, inputs: list[str], shape: Shape | None, **attrs) -> str:
        return self.op(op_type, inputs, shape, **attrs)[0]

    def ints(self, values: list[int]) -> str:
        return self.const(np.array(values, dtype=np.int64), "shape")

    # --- tensors of the pool ---------------------------------------------------------------------------------
    @property
    def act_shape(self) -> Shape:
        return (self.b, self.s, self.h)

    def pick(self, shape: Shape | None = None) -> str:
        """A pool tensor of `shape` (default [B, S, H]) or, sometimes or when there is none, a new input."""
        shape = shape or self.act_shape
        have = [t for t in self.pool if self.shapes.get(t) == shape]
        if have and self.draw(st.integers(0, 3)) > 0:
            return self.draw(st.sampled_from(have))
        return self.input(shape)

    def keep(self, tensor: str, inner: Sequence[str] = ()) -> str:
        """Offer `tensor` to later motifs and `inner` (intermediates) as possible graph outputs."""
        self.pool.append(tensor)
        self.inner.extend(t for t in inner if t in self.shapes)
        return tensor

    def reduce_mean(self, x: str, shape: Shape, axes: list[int]) -> str:
        out = tuple(1 if i - len(shape) in axes or i in axes else d for i, d in enumerate(shape))
        if self.opset >= 18:
            return self.op1("ReduceMean", [x, self.ints(axes)], out, keepdims=1)
        return self.op1("ReduceMean", [x], out, axes=axes, keepdims=1)

    def model(self, max_leaks: int = 3) -> onnx.ModelProto:
        """The graph: outputs are the tensors nobody reads plus up to `max_leaks` drawn intermediates."""
        sinks = [t for t in self.pool if t not in self.read]
        chosen = self.draw(st.lists(st.sampled_from(self.inner), max_size=max_leaks, unique=True)) \
            if self.inner and max_leaks else []
        outs = list(dict.fromkeys(sinks + [t for t in chosen if t not in self.feeds]))
        if not outs:
            outs = [self.pool[-1]]
        declared = [helper.make_tensor_value_info(o, FLOAT, [None if i == 0 and self.symbolic_batch else d
                                                             for i, d in enumerate(self.shapes[o])])
                    for o in outs]
        graph = helper.make_graph(self.nodes, "random", self.inputs, declared, self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8)


# --- activations, written the ways exporters write them -------------------------------------------------------

def activation(g: Builder, x: str, shape: Shape) -> tuple[str, str]:
    """Apply a drawn activation (or none) to x; returns (output, name)."""
    kind = g.draw(st.sampled_from(["none", "relu", "gelu_erf", "gelu_erf2", "gelu_tanh", "silu", "tanh",
                                   "sigmoid", "quick_gelu", "relu6", "gelu_op"]))
    if kind == "gelu_op" and g.opset < 20:
        kind = "gelu_erf"
    if kind == "none":
        return x, kind
    if kind in ("relu", "tanh", "sigmoid"):
        return g.op1(kind.capitalize(), [x], shape), kind
    if kind == "relu6":
        return g.op1("Clip", [x, g.const(np.float32(0.0)), g.const(np.float32(6.0))], shape), kind
    if kind == "gelu_op":
        return g.op1("Gelu", [x], shape, approximate=g.draw(st.sampled_from(["none", "tanh"]))), kind
    if kind == "gelu_erf":  # x * 0.5 * (1 + erf(x / sqrt 2))
        e = g.op1("Erf", [g.op1("Div", [x, g.const(np.float32(1.4142135))], shape)], shape)
        e1 = g.op1("Add", [e, g.const(np.float32(1.0))], shape)
        return g.op1("Mul", [g.op1("Mul", [x, g.const(np.float32(0.5))], shape), e1], shape), kind
    if kind == "gelu_erf2":  # 0.5 * x * (1 + erf(x * 0.7071))
        e = g.op1("Erf", [g.op1("Mul", [x, g.const(np.float32(0.70710678))], shape)], shape)
        e1 = g.op1("Add", [g.const(np.float32(1.0)), e], shape)
        return g.op1("Mul", [g.op1("Mul", [g.const(np.float32(0.5)), x], shape), e1], shape), "gelu_erf"
    if kind == "gelu_tanh":
        cube = g.op1("Pow", [x, g.const(np.float32(3.0))], shape) if g.draw(st.booleans()) else \
            g.op1("Mul", [g.op1("Mul", [x, x], shape), x], shape)
        inner = g.op1("Add", [x, g.op1("Mul", [cube, g.const(np.float32(0.044715))], shape)], shape)
        t = g.op1("Tanh", [g.op1("Mul", [inner, g.const(np.float32(0.7978846))], shape)], shape)
        half = g.op1("Mul", [x, g.const(np.float32(0.5))], shape)
        return g.op1("Mul", [half, g.op1("Add", [t, g.const(np.float32(1.0))], shape)], shape), kind
    scale = 1.702 if kind == "quick_gelu" else 1.0
    z = g.op1("Mul", [x, g.const(np.float32(scale))], shape) if kind == "quick_gelu" else x
    return g.op1("Mul", [x, g.op1("Sigmoid", [z], shape)], shape), kind


def bias_add(g: Builder, x: str, shape: Shape) -> str:
    """x + b with b broadcast along the last axis, a scalar, or (a near miss) along the rows."""
    n = shape[-1]
    kind = g.draw(st.sampled_from(["vec", "vec", "row", "rank", "scalar", "rows"]))
    value = {"vec": (n,), "row": (1, n), "rank": (1,) * (len(shape) - 1) + (n,), "scalar": (),
             "rows": (*shape[-2:-1], 1)}[kind]
    b = g.const(g.rng.uniform(-1, 1, value).astype(np.float32), "b")
    ins = [x, b] if g.draw(st.booleans()) else [b, x]
    return g.op1("Add", ins, shape)


# --- motifs ----------------------------------------------------------------------------------------------------

def linear(g: Builder) -> str:
    """MatMul(x, W) [+ bias] [-> activation] [-> MatMul back] [+ residual]."""
    x = g.pick()
    n = g.draw(st.sampled_from([g.h, 2 * g.h, 3, 5]))
    shape = (g.b, g.s, n)
    y = g.op1("MatMul", [x, g.weight(g.h, n)], shape)
    inner = [y]
    if g.draw(st.integers(0, 3)):
        y = bias_add(g, y, shape)
        inner.append(y)
    y, _ = activation(g, y, shape)
    inner.append(y)
    if n != g.h and g.draw(st.booleans()):
        shape = g.act_shape
        y = g.op1("MatMul", [y, g.weight(n, g.h)], shape)
        if g.draw(st.booleans()):
            y = bias_add(g, y, shape)
        inner.append(y)
    if g.draw(st.booleans()):
        r = x if shape == g.act_shape and g.draw(st.booleans()) else g.pick(shape)
        y = g.op1("Add", [y, r] if g.draw(st.booleans()) else [r, y], shape)
    if shape != g.act_shape:
        y = g.op1("MatMul", [y, g.weight(n, g.h)], g.act_shape)
    return g.keep(y, inner[:-1])


def gemm(g: Builder) -> str:
    """Rows flattened to [B*S, H] -> Gemm (transA / transB, alpha, beta, bias C) [-> act] -> back to [B, S, N]."""
    x = g.pick()
    m, n = g.b * g.s, g.draw(st.sampled_from([g.h, 4, 6]))
    flat = g.op1("Reshape", [x, g.ints([-1, g.h])], (m, g.h))
    trans_a, trans_b = g.draw(st.booleans()), g.draw(st.booleans())
    a = g.op1("Transpose", [flat], (g.h, m), perm=[1, 0]) if trans_a else flat
    w = g.const(g.rng.standard_normal((n, g.h) if trans_b else (g.h, n)) / math.sqrt(g.h), "w")
    ins = [a, w]
    if g.draw(st.booleans()):
        ins.append(g.const(g.rng.uniform(-1, 1, g.draw(st.sampled_from([(n,), (1, n)]))).astype(np.float32)))
    attrs = {"transA": int(trans_a), "transB": int(trans_b)}
    if g.draw(st.integers(0, 3)) == 0:
        attrs["alpha"] = g.draw(st.sampled_from([0.5, 2.0]))
    if len(ins) == 3 and g.draw(st.integers(0, 3)) == 0:
        attrs["beta"] = g.draw(st.sampled_from([0.5, 2.0]))
    y = g.op1("Gemm", ins, (m, n), **attrs)
    z, _ = activation(g, y, (m, n))
    out = g.op1("Reshape", [z, g.ints([-1, g.s, n])], (g.b, g.s, n))
    if n != g.h:
        out = g.op1("MatMul", [out, g.weight(n, g.h)], g.act_shape)
    return g.keep(out, [y, z])


def split_heads(g: Builder, t: str, key: bool) -> str:
    """[B, S, H] -> [B, nh, S, hd] (or kᵀ [B, nh, hd, S] for a key), as exporters write the head split."""
    four = g.op1("Reshape", [t, g.ints([0, 0, g.nh, g.hd] if g.draw(st.booleans()) else
                                       [g.b, g.s, g.nh, g.hd])], (g.b, g.s, g.nh, g.hd))
    if not key:
        return g.op1("Transpose", [four], (g.b, g.nh, g.s, g.hd), perm=[0, 2, 1, 3])
    if g.draw(st.booleans()):
        return g.op1("Transpose", [four], (g.b, g.nh, g.hd, g.s), perm=[0, 2, 3, 1])
    kh = g.op1("Transpose", [four], (g.b, g.nh, g.s, g.hd), perm=[0, 2, 1, 3])
    return g.op1("Transpose", [kh], (g.b, g.nh, g.hd, g.s), perm=[0, 1, 3, 2])


def projections(g: Builder, x: str) -> tuple[str, str, str]:
    """q, k, v of x: three MatMuls (+ biases) reading x, or one packed [B, S, 3H] MatMul unbound by Split."""
    if g.draw(st.integers(0, 3)) == 0:
        qkv = g.op1("MatMul", [x, g.weight(g.h, 3 * g.h)], (g.b, g.s, 3 * g.h))
        five = g.op1("Reshape", [qkv, g.ints([0, 0, 3, g.nh, g.hd])], (g.b, g.s, 3, g.nh, g.hd))
        t = g.op1("Transpose", [five], (3, g.b, g.nh, g.s, g.hd), perm=[2, 0, 3, 1, 4])
        parts = g.op("Split", [t, g.ints([1, 1, 1])], (1, g.b, g.nh, g.s, g.hd), n_out=3, axis=0)
        q, k, v = (g.op1("Squeeze", [p, g.ints([0])], (g.b, g.nh, g.s, g.hd)) for p in parts)
        kt = g.op1("Transpose", [k], (g.b, g.nh, g.hd, g.s), perm=[0, 1, 3, 2])
        return q, kt, v
    biased = g.draw(st.integers(0, 2))  # 0: none, 1: all, 2: some
    outs = []
    for i, role in enumerate("qkv"):
        t = g.op1("MatMul", [x, g.weight(g.h, g.h)], g.act_shape)
        if biased == 1 or (biased == 2 and i == 0):
            t = bias_add(g, t, g.act_shape)
        outs.append(split_heads(g, t, role == "k"))
    return outs[0], outs[1], outs[2]


def mask_input(g: Builder, shape: Shape, boolean: bool) -> str:
    """A mask over the keys, key 0 always visible: bool (True = visible) or additive float (0 / -1e4)."""
    keep = g.rng.random(shape) < 0.7
    keep[..., 0] = True
    value = keep if boolean else np.where(keep, 0.0, -1e4).astype(np.float32)
    return g.input(shape, "mask", value)


def attention(g: Builder) -> str:
    """softmax(scale * q kᵀ + mask + bias) v with the head split and merge, or on [B, S, H] without heads."""
    x = g.pick()
    headed = g.draw(st.integers(0, 4)) > 0
    if headed:
        q, kt, v = projections(g, x)
        scores_shape = (g.b, g.nh, g.s, g.s)
    else:
        q = g.op1("MatMul", [x, g.weight(g.h, g.h)], g.act_shape)
        kt = g.op1("Transpose", [g.pick()], (g.b, g.h, g.s), perm=[0, 2, 1])
        v = g.pick()
        scores_shape = (g.b, g.s, g.s)
    d = g.hd if headed else g.h
    how = g.draw(st.sampled_from(["div", "mul", "pre", "none", "mul_left"]))
    if how == "pre":
        f = g.const(np.float32(d ** -0.25))
        q = g.op1("Mul", [q, f], g.shapes[q])
        kt = g.op1("Mul", [kt, g.const(np.float32(d ** -0.25))], g.shapes[kt])
    s = g.op1("MatMul", [q, kt], scores_shape)
    inner = [s]
    if how == "div":
        s = g.op1("Div", [s, g.const(np.float32(math.sqrt(d)))], scores_shape)
    elif how == "mul":
        s = g.op1("Mul", [s, g.const(np.float32(1 / math.sqrt(d)))], scores_shape)
    elif how == "mul_left":
        s = g.op1("Mul", [g.const(np.float32(1 / math.sqrt(d))), s], scores_shape)
    mask = g.draw(st.sampled_from(["none", "input", "input_full", "causal", "where", "bias"]))
    lead = (g.b,) + (1,) * (len(scores_shape) - 2)
    if mask == "input":
        s = g.op1("Add", [s, mask_input(g, (*lead, g.s), False)], scores_shape)
    elif mask == "input_full":
        s = g.op1("Add", [mask_input(g, (g.b,) + (1,) * (len(scores_shape) - 3) + (g.s, g.s), False), s],
                  scores_shape)
    elif mask == "causal":
        c = np.triu(np.full((g.s, g.s), -1e4, np.float32), 1)
        s = g.op1("Add", [s, g.const(c.reshape((1,) * (len(scores_shape) - 2) + (g.s, g.s)))], scores_shape)
    elif mask == "where":
        s = g.op1("Where", [mask_input(g, (*lead, g.s), True), s, g.const(np.float32(-1e4))], scores_shape)
    elif mask == "bias":
        bias = g.rng.uniform(-1, 1, (1, *scores_shape[1:])).astype(np.float32)
        s = g.op1("Add", [s, g.const(bias)], scores_shape)
    inner.append(s)
    axis = -1 if g.draw(st.integers(0, 5)) else g.draw(st.sampled_from([1, len(scores_shape) - 1]))
    p = g.op1("Softmax", [s], scores_shape, axis=axis)
    inner.append(p)
    if g.draw(st.integers(0, 4)) == 0:
        nan = g.op1("IsNaN", [p], None)
        p = g.op1("Where", [nan, g.const(np.float32(0.0)), p], scores_shape)
    o = g.op1("MatMul", [p, v], g.shapes[q] if headed else g.act_shape)
    inner.append(o)
    if headed:
        o = g.op1("Transpose", [o], (g.b, g.s, g.nh, g.hd), perm=[0, 2, 1, 3])
        o = g.op1("Reshape", [o, g.ints([0, 0, g.h])], g.act_shape)
    if g.draw(st.booleans()):
        o = g.op1("MatMul", [o, g.weight(g.h, g.h)], g.act_shape)
        if g.draw(st.booleans()):
            o = g.op1("Add", [bias_add(g, o, g.act_shape), x], g.act_shape)
    return g.keep(o, inner)


def layernorm(g: Builder) -> str:
    """[a + b ->] LayerNormalization, or its decomposition (ReduceMean .. Sqrt .. Div [* gamma] [+ beta])."""
    x = g.pick()
    if g.draw(st.booleans()):
        x = g.op1("Add", [x, g.pick()], g.act_shape)
    shape, h = g.act_shape, g.h
    eps = g.draw(st.sampled_from([1e-5, 1e-6, 1e-12]))
    gamma = g.const(g.rng.uniform(0.5, 1.5, h).astype(np.float32), "gamma")
    beta = g.const(g.rng.uniform(-1, 1, h).astype(np.float32), "beta")
    if g.draw(st.booleans()):
        y = g.op1("LayerNormalization", [x, gamma, beta], shape, axis=-1, epsilon=eps)
        return g.keep(y, [x])
    mean = g.reduce_mean(x, shape, [-1])
    d = g.op1("Sub", [x, mean], shape)
    d2 = g.op1("Sub", [x, mean], shape) if g.draw(st.integers(0, 3)) == 0 else d
    sq = g.op1("Pow", [d, g.const(np.float32(2.0))], shape) if g.draw(st.booleans()) else \
        g.op1("Mul", [d, d], shape)
    var = g.reduce_mean(sq, shape, [-1])
    std = g.op1("Sqrt", [g.op1("Add", [var, g.const(np.float32(eps))], g.shapes[var])], g.shapes[var])
    if g.draw(st.booleans()):
        n = g.op1("Mul", [g.op1("Reciprocal", [std], g.shapes[std]), d2], shape)
    else:
        n = g.op1("Div", [d2, std], shape)
    inner = [mean, d, var, n]
    if g.draw(st.integers(0, 3)):
        n = g.op1("Mul", [n, gamma] if g.draw(st.booleans()) else [gamma, n], shape)
        if g.draw(st.integers(0, 3)):
            n = g.op1("Add", [n, beta], shape)
    return g.keep(n, inner)


def softmax(g: Builder) -> str:
    """Softmax of a (scaled, masked) tensor over a drawn axis."""
    x = g.pick()
    if g.draw(st.booleans()):
        x = g.op1("Mul", [x, g.const(np.float32(g.draw(st.sampled_from([0.125, 0.5, 2.0]))))], g.act_shape)
    if g.draw(st.booleans()):
        x = g.op1("Add", [x, mask_input(g, (g.b, 1, g.h), False)], g.act_shape)
    axis = g.draw(st.sampled_from([-1, -1, -1, 1, 2, 0]))
    return g.keep(g.op1("Softmax", [x], g.act_shape, axis=axis), [x])


def _operand(g: Builder, shape: Shape) -> str:
    """A second operand broadcasting to `shape`: a constant or input of a broadcast shape, or a pool tensor."""
    kind = g.draw(st.sampled_from(["scalar", "last", "mid", "lead", "full", "pool"]))
    if kind == "pool":
        return g.pick(shape)
    b_shape = {"scalar": (), "last": shape[-1:], "mid": (1, shape[1], 1), "lead": (shape[0], 1, 1),
               "full": shape}[kind]
    value = g.rng.uniform(0.5, 1.5, b_shape) * g.rng.choice([-1.0, 1.0], b_shape)
    if kind in ("lead", "full") and g.draw(st.booleans()):
        return g.input(b_shape, "e", value.astype(np.float32))
    return g.const(value.astype(np.float32), "e")


def elementwise(g: Builder) -> str:
    """A chain of 1 to 6 elementwise ops with broadcast operands; divisors stay away from zero."""
    shape = g.act_shape
    x = g.pick()
    inner = []
    for _ in range(g.draw(st.integers(1, 6))):
        op = g.draw(st.sampled_from(["Add", "Sub", "Mul", "Div", "Max", "Min", "Relu", "Tanh", "Sigmoid", "Erf",
                                     "Neg", "Abs", "Sqrt", "Exp", "Pow", "Where", "Cast16", "Cast64",
                                     "Unsqueeze"]))
        if op in ("Add", "Sub", "Mul", "Max", "Min"):
            other = _operand(g, shape)
            x = g.op1(op, [x, other] if g.draw(st.booleans()) else [other, x], shape)
        elif op == "Div":  # x / (|e| + 0.5)
            e = g.op1("Add", [g.op1("Abs", [_operand(g, shape)], None), g.const(np.float32(0.5))], None)
            x = g.op1("Div", [x, e], shape)
        elif op in ("Relu", "Tanh", "Sigmoid", "Erf", "Neg", "Abs"):
            x = g.op1(op, [x], shape)
        elif op == "Sqrt":  # sqrt(|x| + 0.1)
            x = g.op1("Sqrt", [g.op1("Add", [g.op1("Abs", [x], shape), g.const(np.float32(0.1))], shape)], shape)
        elif op == "Exp":  # exp(tanh x)
            x = g.op1("Exp", [g.op1("Tanh", [x], shape)], shape)
        elif op == "Pow":
            x = g.op1("Pow", [x, g.const(np.float32(2.0))], shape)
        elif op == "Where":
            cond = g.op1("Greater", [x, _operand(g, shape)], None)
            x = g.op1("Where", [cond, x, _operand(g, shape)], shape)
        elif op in ("Cast16", "Cast64"):
            to = TensorProto.FLOAT16 if op == "Cast16" else TensorProto.DOUBLE
            x = g.op1("Cast", [g.op1("Cast", [x], None, to=to)], shape, to=FLOAT)
        else:  # a free reshape inside the chain: [B, S, H] -> [B, S, 1, H] -> op -> back
            u = g.op1("Unsqueeze", [x, g.ints([2])], (g.b, g.s, 1, g.h))
            t = g.op1("Mul", [u, g.const(np.float32(0.75))], (g.b, g.s, 1, g.h))
            x = g.op1("Squeeze", [t, g.ints([2])], shape)
        inner.append(x)
    return g.keep(x, inner[:-1])


def layout(g: Builder) -> str:
    """Layout round trips around elementwise work: Transpose, Reshape, Concat + Split, Slice."""
    x = g.pick()
    shape = g.act_shape
    kind = g.draw(st.sampled_from(["transpose", "reshape", "concat_split", "slice"]))
    if kind == "transpose":
        perm = g.draw(st.permutations([0, 1, 2]))
        t_shape = tuple(shape[p] for p in perm)
        t = g.op1("Transpose", [x], t_shape, perm=list(perm))
        t = g.op1("Add", [t, _operand(g, t_shape)], t_shape)
        inv = [perm.index(i) for i in range(3)]
        y = g.op1("Transpose", [t], shape, perm=inv)
        return g.keep(y, [t])
    if kind == "reshape":
        flat = (g.b, g.s * g.h)
        t = g.op1("Reshape", [x, g.ints([0, -1])], flat)
        t = g.op1("Mul", [t, g.const(g.rng.uniform(0.5, 1.5, (g.s * g.h,)).astype(np.float32))], flat)
        y = g.op1("Reshape", [t, g.ints([-1, g.s, g.h])], shape)
        return g.keep(y, [t])
    other = g.pick()
    wide = (g.b, g.s, 2 * g.h)
    c = g.op1("Concat", [x, other], wide, axis=-1)
    c = g.op1("Tanh", [c], wide)
    if kind == "slice":
        y = g.op1("Slice", [c, g.ints([g.h]), g.ints([2 * g.h]), g.ints([2])], shape)
        return g.keep(y, [c])
    a, b = g.op("Split", [c, g.ints([g.h, g.h])], shape, n_out=2, axis=2)
    return g.keep(g.op1("Mul", [a, b], shape), [a, b])


def centre(g: Builder) -> str:
    """x - mean(x) over the last axis: the start of a LayerNorm decomposition that stops there (a near miss)."""
    x = g.pick()
    mean = g.reduce_mean(x, g.act_shape, [-1])
    return g.keep(g.op1("Sub", [x, mean], g.act_shape), [mean])


OPSETS = (17, 18, 20)
MOTIFS: dict[str, Callable[[Builder], str]] = {
    "linear": linear, "gemm": gemm, "attention": attention, "layernorm": layernorm, "softmax": softmax,
    "elementwise": elementwise, "layout": layout, "centre": centre,
}


def _build(draw: Callable, prefix: str = "", max_motifs: int = 5, opset: int | None = None,
           symbolic: bool = True) -> Builder:
    heads, head_dim = draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([1, 2, 4, 8]))
    opset = opset or draw(st.sampled_from(OPSETS))
    g = Builder(draw, opset=opset, batch=draw(st.integers(1, 3)),
                seq=draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8])), heads=heads, head_dim=head_dim,
                symbolic_batch=symbolic and draw(st.integers(0, 3)) == 0, seed=draw(st.integers(0, 2**31 - 1)),
                prefix=prefix)
    names = draw(st.lists(st.sampled_from(sorted(MOTIFS)), min_size=1, max_size=max_motifs))
    for name in names:
        MOTIFS[name](g)
    g.motifs = names
    return g


@st.composite
def cases(draw: Callable, max_motifs: int = 5) -> Case:
    """One random model (1 to `max_motifs` motifs) with its feeds."""
    g = _build(draw, max_motifs=max_motifs)
    return Case(g.model(), g.feeds, g.motifs)


@st.composite
def merged(draw: Callable, min_graphs: int = 2, max_graphs: int = 6, max_motifs: int = 4, symbolic: bool = True,
           max_leaks: int = 3) -> Case:
    """Several random graphs side by side in one model (names prefixed g0_, g1_, ...; one drawn opset).

    `symbolic=False` keeps every dim static and `max_leaks` bounds the intermediates taken as outputs of each
    graph: both keep more fused nodes within what the custom-op library binds."""
    nodes, inputs, outputs, inits, feeds, motifs = [], [], [], [], {}, []
    opset = draw(st.sampled_from(OPSETS))
    for i in range(draw(st.integers(min_graphs, max_graphs))):
        g = _build(draw, prefix=f"g{i}_", max_motifs=max_motifs, opset=opset, symbolic=symbolic)
        m = g.model(max_leaks)
        nodes += m.graph.node
        inputs += m.graph.input
        outputs += m.graph.output
        inits += m.graph.initializer
        feeds.update(g.feeds)
        motifs += [f"g{i}:{n}" for n in g.motifs]
    graph = helper.make_graph(nodes, "merged", inputs, outputs, inits)
    return Case(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), feeds,
                motifs)
