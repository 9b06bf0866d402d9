"""Small encoders in the forms RMSNorm takes in real exports, built with onnx.helper (seeded random weights):

- `llama_block`: LLaMA / Qwen / Mistral: pre-norm blocks of a decomposed RMSNorm (Pow, ReduceMean, Add eps, Sqrt,
  Div(1, .) or Reciprocal, Mul x, Mul weight: the TorchScript and dynamo exporters' two spellings), scaled attention
  (with the constant causal mask of a static export, or none), a SwiGLU MLP, residual Adds, a final RMSNorm.
- `t5_block`: T5's encoder: the same norm (Reciprocal spelling), unscaled scores plus a relative-position bias, a
  ReLU MLP.
- `forms_model`: the other source forms in one graph at opset 23: ONNX's RMSNormalization, onnxruntime's
  SkipSimplifiedLayerNormalization (com.microsoft) with its sum read on, a decomposed norm without a weight.
- `simplified_model`: onnxruntime's SimplifiedLayerNormalization (its optimizer's RMSNorm, default domain) after a
  residual Add, which the loader writes out in standard ops.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Graph:
    def __init__(self, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def const(self, value: np.ndarray, name: str | None = None) -> str:
        self.count += 1
        name = name or f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, *shape: int, scale: float = 0.1, offset: float = 0.0) -> str:
        return self.const((offset + scale * self.rng.standard_normal(shape)).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, domain: str = "", **attrs: object) -> str:
        self.count += 1
        name = f"{op_type.lower()}{self.count}"
        outs = [name] + [f"{name}:{i}" for i in range(1, outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain, **attrs))
        return name

    def rmsnorm(self, x: str, hidden: int, *, reciprocal: bool, weight: bool = True, opset: int = 17) -> str:
        sq = self.op("Pow", [x, self.const(np.float32(2.0))])
        if opset >= 18:
            ms = self.op("ReduceMean", [sq, self.const(np.array([-1], np.int64))], keepdims=1)
        else:
            ms = self.op("ReduceMean", [sq], axes=[-1], keepdims=1)
        std = self.op("Sqrt", [self.op("Add", [ms, self.const(np.float32(1e-6))])])
        rstd = self.op("Reciprocal", [std]) if reciprocal else self.op("Div", [self.const(np.float32(1.0)), std])
        y = self.op("Mul", [x, rstd])
        return self.op("Mul", [self.weight(hidden, offset=1.0), y]) if weight else y

    def attention(self, x: str, hidden: int, heads: int, seq: int, *, scale: bool, bias: str | None = None) -> str:
        d = hidden // heads
        split = self.const(np.array([0, seq, heads, d], np.int64))

        def proj(perm: list[int]) -> str:
            return self.op("Transpose", [self.op("Reshape", [self.op("MatMul", [x, self.weight(hidden, hidden)]),
                                                             split])], perm=perm)

        q, kt, v = proj([0, 2, 1, 3]), proj([0, 2, 3, 1]), proj([0, 2, 1, 3])
        s = self.op("MatMul", [q, kt])
        if scale:
            s = self.op("Mul", [s, self.const(np.float32(1.0 / np.sqrt(d)))])
        if bias is not None:
            s = self.op("Add", [s, bias])
        o = self.op("MatMul", [self.op("Softmax", [s], axis=-1), v])
        merged = self.op("Reshape", [self.op("Transpose", [o], perm=[0, 2, 1, 3]),
                                     self.const(np.array([0, seq, hidden], np.int64))])
        return self.op("MatMul", [merged, self.weight(hidden, hidden)])

    def model(self, inputs: list[tuple[str, list[int | str]]], outputs: list[str], opset: int,
              ms: bool = False, known: tuple[str, ...] = ()) -> onnx.ModelProto:
        """The model; `known`: tensors of the inputs' shape that onnx's shape inference cannot see through (the
        outputs of onnxruntime's own ops), declared in value_info as an exporter or ORT's optimizer does."""
        ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, inputs[0][1]) for o in outputs]
        graph = helper.make_graph(self.nodes, "rms", ins, outs, self.inits,
                                  value_info=[helper.make_tensor_value_info(k, TensorProto.FLOAT, inputs[0][1])
                                              for k in known])
        opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
        model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
        return model


def causal_mask(seq: int, floor: float) -> np.ndarray:
    """The additive causal mask [1, 1, seq, seq] a static export holds: 0 on and below the diagonal, `floor` (-inf, or
    the dtype's lowest value) above it."""
    upper = np.arange(seq)[None, :] > np.arange(seq)[:, None]
    return np.where(upper, np.float32(floor), np.float32(0.0)).reshape(1, 1, seq, seq).astype(np.float32)


def llama_block(*, layers: int = 1, hidden: int = 64, heads: int = 4, seq: int = 8, mlp: int = 96,
                reciprocal: bool = False, seed: int = 0, mask_floor: float | None = None) -> onnx.ModelProto:
    """mask_floor: the attention adds the constant causal mask of that floor (a static export), or none."""
    g = _Graph(seed)
    x = "x"
    mask = g.const(causal_mask(seq, mask_floor), "causal_mask") if mask_floor is not None else None
    for _ in range(layers):
        x = g.op("Add", [x, g.attention(g.rmsnorm(x, hidden, reciprocal=reciprocal), hidden, heads, seq, scale=True,
                                        bias=mask)])
        n = g.rmsnorm(x, hidden, reciprocal=reciprocal)
        gate = g.op("MatMul", [n, g.weight(hidden, mlp)])
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
        up = g.op("MatMul", [n, g.weight(hidden, mlp)])
        x = g.op("Add", [x, g.op("MatMul", [g.op("Mul", [silu, up]), g.weight(mlp, hidden)])])
    y = g.rmsnorm(x, hidden, reciprocal=reciprocal)
    return g.model([("x", [2, seq, hidden])], [y], 17)


def t5_block(*, hidden: int = 64, heads: int = 4, seq: int = 8, mlp: int = 128, seed: int = 1) -> onnx.ModelProto:
    g = _Graph(seed)
    bias = g.weight(1, heads, seq, seq, scale=0.5)
    x = g.op("Add", ["x", g.attention(g.rmsnorm("x", hidden, reciprocal=True), hidden, heads, seq, scale=False,
                                      bias=bias)])
    n = g.rmsnorm(x, hidden, reciprocal=True)
    h = g.op("Relu", [g.op("MatMul", [n, g.weight(hidden, mlp)])])
    x = g.op("Add", [x, g.op("MatMul", [h, g.weight(mlp, hidden)])])
    return g.model([("x", [2, seq, hidden])], [g.rmsnorm(x, hidden, reciprocal=True)], 17)


def forms_model(*, hidden: int = 64, seq: int = 8, seed: int = 2) -> onnx.ModelProto:
    """x, r -> RMSNormalization(x + r) -> y1; SkipSimplifiedLayerNormalization(y1, x) -> y2 and its sum s2;
    a decomposed, weightless norm of s2 -> y3 (outputs y1 * 1, y2, y3)."""
    g = _Graph(seed)
    s1 = g.op("Add", ["x", "r"])
    y1 = g.op("RMSNormalization", [s1, g.weight(hidden, offset=1.0)], axis=-1, epsilon=1e-5)
    skip = g.op("SkipSimplifiedLayerNormalization", [y1, "x", g.weight(hidden, offset=1.0)], outputs=4,
                domain="com.microsoft", epsilon=1e-6)
    g.nodes[-1].output[1] = g.nodes[-1].output[2] = ""
    y3 = g.rmsnorm(f"{skip}:3", hidden, reciprocal=False, weight=False, opset=23)
    out = g.op("Mul", [y3, g.op("Add", [s1, skip])])
    return g.model([("x", [2, seq, hidden]), ("r", [2, seq, hidden])], [out], 23, ms=True,
                   known=(skip, f"{skip}:3"))


def simplified_model(*, hidden: int = 64, seq: int = 8, seed: int = 3) -> onnx.ModelProto:
    g = _Graph(seed)
    s = g.op("Add", ["x", "r"])
    y = g.op("SimplifiedLayerNormalization", [s, g.weight(hidden, offset=1.0)], axis=-1, epsilon=1e-6)
    out = g.op("MatMul", [g.op("Add", [y, s]), g.weight(hidden, hidden)])
    return g.model([("x", [2, seq, hidden]), ("r", [2, seq, hidden])], [out], 17, known=(y,))
