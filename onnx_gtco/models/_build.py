"""Shared pieces of the built-in models: a graph builder and the exporter-shaped layers both families use."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

MIN_OPSET, MAX_OPSET = 13, 21
LN_FORMS = ("op", "decomposed")
GELU_FORMS = ("erf", "tanh", "op")
QKV_FORMS = ("split", "fused")
INIT_STD = 0.02


def check_forms(opset: int, ln: str, gelu: str, qkv: str) -> None:
    """Raise ValueError for an unknown form or one the opset lacks the op for."""
    for what, value, allowed in (("ln", ln, LN_FORMS), ("gelu", gelu, GELU_FORMS), ("qkv", qkv, QKV_FORMS)):
        if value not in allowed:
            raise ValueError(f"{what}={value!r}: choose one of {', '.join(map(repr, allowed))}")
    if ln == "op" and opset < 17:
        raise ValueError(f"ln='op' needs LayerNormalization (opset 17); opset {opset} needs ln='decomposed'")
    if gelu == "op" and opset < 20:
        raise ValueError(f"gelu='op' needs the Gelu op (opset 20); opset {opset} has none")


def check_dims(dim: int, heads: int, **positive: int) -> None:
    """Raise ValueError unless every size is positive and the width splits evenly into heads."""
    for key, value in {"dim": dim, "heads": heads, **positive}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive int, not {value!r}")
    if dim % heads:
        raise ValueError(f"dim {dim} does not split into {heads} heads")


class Builder:
    """Collects the nodes, initializers, inputs and outputs of one model; every name is checked unique.

    Node names are dotted module paths ("blocks.3.attn.qk"); each node's single output tensor carries the
    node's name, initializers are "<module>.weight" / "<module>.bias" / "<node>.<role>" for constants.
    """

    def __init__(self, name: str, *, seed: int, opset: int, batch: int | str) -> None:
        if not MIN_OPSET <= opset <= MAX_OPSET:
            raise ValueError(f"opset {opset} is outside the supported {MIN_OPSET}..{MAX_OPSET}")
        valid = (isinstance(batch, int) and batch >= 1) or (isinstance(batch, str) and batch != "")
        if isinstance(batch, bool) or not valid:
            raise ValueError(f"batch must be a positive int or a dim name, not {batch!r}")
        self.name, self.opset, self.batch = name, opset, batch
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()

    @property
    def reshape_batch(self) -> int:
        """The batch entry of a Reshape target: the size when static, 0 (copy the input's) when symbolic."""
        return self.batch if isinstance(self.batch, int) else 0

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"duplicate tensor or node name {name!r}")
        self._names.add(name)
        return name

    def input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        """Declare a graph input."""
        self.inputs.append(helper.make_tensor_value_info(self._claim(name), elem_type, list(shape)))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence[int | str]) -> None:
        """Declare a node output (already added under `name`) as a graph output with its full shape."""
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    def param(self, name: str, shape: Sequence[int], *, mean: float = 0.0, std: float = INIT_STD) -> str:
        """A float32 weight drawn from normal(mean, std) with the model's generator."""
        value = mean + std * self.rng.standard_normal(tuple(shape))
        return self.const(name, value.astype(np.float32))

    def const(self, name: str, value: Any, dtype: type = np.float32) -> str:
        """An initializer holding `value` (float32 unless `dtype` says otherwise; 0-d for a scalar)."""
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), self._claim(name)))
        return name

    def op(self, op_type: str, inputs: Sequence[str], name: str, *, out: str | None = None,
           **attrs: Any) -> str:
        """Add a node named `name`; its one output is the tensor `out` (default: `name`), which it returns."""
        out = out if out is not None else name
        self._claim(name)
        if out != name:
            self._claim(out)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def reshape(self, x: str, name: str, rest: Sequence[int]) -> str:
        """Reshape to [batch, *rest] through a shape initializer `<name>.shape`."""
        shape = self.const(f"{name}.shape", [self.reshape_batch, *rest], np.int64)
        return self.op("Reshape", [x, shape], name)

    def reduce_mean(self, x: str, name: str) -> str:
        """ReduceMean over the last axis, keepdims; axes an attribute before opset 18 and an input from it."""
        if self.opset < 18:
            return self.op("ReduceMean", [x], name, axes=[-1], keepdims=1)
        return self.op("ReduceMean", [x, self.const(f"{name}.axes", [-1], np.int64)], name, keepdims=1)

    def model(self, doc: str) -> onnx.ModelProto:
        """The finished model: opset `self.opset`, IR version 8 or the lowest the opset needs."""
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        opsets = [helper.make_opsetid("", self.opset)]
        ir = max(8, helper.find_min_ir_version_for(opsets))
        return helper.make_model(graph, opset_imports=opsets, ir_version=ir,
                                 producer_name="onnx_gtco.models", doc_string=doc)


def linear(b: Builder, x: str, name: str, d_in: int, d_out: int) -> str:
    """nn.Linear on a 3-D input as TorchScript exports it: MatMul by the [in, out] weight, Add(bias, .)."""
    w = b.param(f"{name}.weight", (d_in, d_out))
    bias = b.param(f"{name}.bias", (d_out,))
    mm = b.op("MatMul", [x, w], f"{name}.matmul")
    return b.op("Add", [bias, mm], f"{name}.add")


def layer_norm(b: Builder, x: str, name: str, dim: int, form: str, eps: float, *,
               out: str | None = None) -> str:
    """LayerNorm over the last axis: the opset-17 op, or the ReduceMean ... Sqrt, Div chain of old exports."""
    gamma = b.param(f"{name}.weight", (dim,), mean=1.0)
    beta = b.param(f"{name}.bias", (dim,))
    if form == "op":
        return b.op("LayerNormalization", [x, gamma, beta], name, out=out, axis=-1, epsilon=eps)
    mean = b.reduce_mean(x, f"{name}.mean")
    diff = b.op("Sub", [x, mean], f"{name}.sub")
    sq = b.op("Pow", [diff, b.const(f"{name}.exponent", 2.0)], f"{name}.pow")
    var = b.reduce_mean(sq, f"{name}.var")
    std = b.op("Sqrt", [b.op("Add", [var, b.const(f"{name}.eps", eps)], f"{name}.add_eps")], f"{name}.sqrt")
    normed = b.op("Div", [diff, std], f"{name}.div")
    scaled = b.op("Mul", [normed, gamma], f"{name}.mul")
    return b.op("Add", [scaled, beta], f"{name}.add", out=out)


def gelu_act(b: Builder, x: str, name: str, form: str) -> str:
    """GELU: the erf form torch exports, the tanh approximation with Pow, or the opset-20 Gelu op."""
    if form == "op":
        return b.op("Gelu", [x], name)
    if form == "erf":
        t = b.op("Div", [x, b.const(f"{name}.sqrt2", 1.4142135)], f"{name}.div")
        t = b.op("Erf", [t], f"{name}.erf")
    else:
        cube = b.op("Pow", [x, b.const(f"{name}.three", 3.0)], f"{name}.pow")
        t = b.op("Mul", [cube, b.const(f"{name}.coef", 0.044715)], f"{name}.mul_coef")
        t = b.op("Add", [x, t], f"{name}.add_x")
        t = b.op("Mul", [t, b.const(f"{name}.sqrt_2_pi", math.sqrt(2.0 / math.pi))], f"{name}.mul_scale")
        t = b.op("Tanh", [t], f"{name}.tanh")
    t = b.op("Add", [t, b.const(f"{name}.one", 1.0)], f"{name}.add_one")
    t = b.op("Mul", [x, t], f"{name}.mul")
    return b.op("Mul", [t, b.const(f"{name}.half", 0.5)], f"{name}.mul_half")


def attention_core(b: Builder, x: str, name: str, *, seq: int, dim: int, heads: int, qkv: str, scale_op: str,
                   mask: str | None = None, proj: tuple[str, str, str] = ("q", "k", "v")) -> str:
    """Self-attention from the normed input to the merged heads [B, S, dim], before the output projection; `seq`
    is -1 for a symbolic sequence length (the Reshapes infer it).

    qkv="split": three MatMul+Add reading `x`, each Reshape [B,S,H,D] -> Transpose (k to [B,H,D,S]).
    qkv="fused": one MatMul+Add to 3*dim -> Reshape [B,S,3,H,D] -> Transpose [2,0,3,1,4] -> Gather 0/1/2, and
    k.transpose(-2, -1) as Transpose [0,1,3,2] (timm). Then MatMul(q, kᵀ) -> Mul 1/sqrt(D) or Div sqrt(D)
    -> [Add mask] -> Softmax -> MatMul(p, v) -> Transpose [0,2,1,3] -> Reshape [B,S,dim].
    """
    hd = dim // heads
    if qkv == "split":
        q, k, v = (linear(b, x, f"{name}.{p}", dim, dim) for p in proj)
        q, k, v = (b.reshape(t, f"{name}.{p}.split_heads", [seq, heads, hd])
                   for t, p in zip((q, k, v), proj, strict=True))
        q = b.op("Transpose", [q], f"{name}.{proj[0]}.permute", perm=[0, 2, 1, 3])
        kt = b.op("Transpose", [k], f"{name}.{proj[1]}.permute", perm=[0, 2, 3, 1])
        v = b.op("Transpose", [v], f"{name}.{proj[2]}.permute", perm=[0, 2, 1, 3])
    else:
        packed = linear(b, x, f"{name}.qkv", dim, 3 * dim)
        packed = b.reshape(packed, f"{name}.qkv.split_heads", [seq, 3, heads, hd])
        packed = b.op("Transpose", [packed], f"{name}.qkv.permute", perm=[2, 0, 3, 1, 4])
        q, k, v = (b.op("Gather", [packed, b.const(f"{name}.{p}.index", i, np.int64)], f"{name}.{p}.unbind",
                        axis=0) for i, p in enumerate(proj))
        kt = b.op("Transpose", [k], f"{name}.{proj[1]}.transpose", perm=[0, 1, 3, 2])
    scores = b.op("MatMul", [q, kt], f"{name}.qk")
    if scale_op == "Mul":
        scores = b.op("Mul", [scores, b.const(f"{name}.scale.value", 1.0 / math.sqrt(hd))], f"{name}.scale")
    else:
        scores = b.op("Div", [scores, b.const(f"{name}.scale.value", math.sqrt(hd))], f"{name}.scale")
    if mask is not None:
        scores = b.op("Add", [scores, mask], f"{name}.mask")
    probs = b.op("Softmax", [scores], f"{name}.softmax", axis=-1)
    ctx = b.op("MatMul", [probs, v], f"{name}.pv")
    ctx = b.op("Transpose", [ctx], f"{name}.merge_permute", perm=[0, 2, 1, 3])
    return b.reshape(ctx, f"{name}.merge_heads", [seq, dim])
