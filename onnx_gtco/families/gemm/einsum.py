"""Einsums that are a matrix product up to a permutation of their axes, rewritten before planning as the MatMul they
compute between Transposes and Reshapes, so that the GEMM and attention rules read them as they read exporters'
MatMuls.

tf2onnx writes a BERT layer's projections as ``Einsum("abc,cde->abde", x, W)`` (W [C, H, D]), its attention as
``Einsum("aecd,abcd->acbe", k, q)`` and ``Einsum("acbe,aecd->abcd", p, v)`` over [B, S, H, D] tensors, and the output
projection as ``Einsum("abcd,cde->abe", o, W)``; SAM's decomposed relative position writes
``Einsum("bhwc,hkc->bhwk", q, R)``. Each two-operand equation whose letters are batch letters (in both operands and
the output), free letters of one operand (in it and the output) and summed letters (in both operands only) is

    Y = permute(reshape(permute(A, [batch, m, k]) @ permute(B, [batch, k, n]), [batch, m, n]), out)

with the operands swapped where the output names B's free letters first (so that the scores of tf2onnx's attention
are a MatMul of q and kᵀ with no Transpose after it). A constant operand is permuted and reshaped once, into a new
initializer; with no batch letters and a constant B, A keeps its free letters as leading dims (the MatMul broadcasts
over them). Transposes and Reshapes that change nothing are not written. The values are the Einsum's up to the order
of its sums. Equations the attention rule already reads (onnx_gtco.ir.einsum.batched_matmul), and any other form (a
letter summed within one operand, nothing summed, broadcast batch dims, "...", one or three operands, symbolic dims),
are left as they are, and so is a product that is neither a projection (a constant operand, no batch letters) nor
attention's scores or P V (SAM's relative-position terms: ONNX Runtime runs the Einsum as one kernel, where the
MatMul would bring Transposes and Reshapes of its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_gtco.ir.einsum import batched_matmul, two_operand_terms
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import spliced


@dataclass(frozen=True)
class EinsumProduct:
    """An Einsum `node` as A @ B: `a` and `b` its operands (swapped where the output names B's free letters first),
    their letters, the batch, free (m of A, n of B) and summed (k) letters, and each letter's size."""

    node: Node
    a: str
    b: str
    a_letters: str
    b_letters: str
    out: str
    batch: str
    m: str
    n: str
    k: str
    size: dict[str, int]  # each letter's size


def einsum_product(view: GraphView, node: Node) -> EinsumProduct | None:
    """`node` read as a matrix product up to permutations, or None (see the module docstring)."""
    if not is_op(node, "Einsum") or len(node.inputs) != 2 or batched_matmul(node.attrs.get("equation")) is not None:
        return None
    found = two_operand_terms(node.attrs.get("equation"))
    if found is None or not all(t.isalpha() and len(set(t)) == len(t) for t in found):
        return None  # also "...": no letter
    la, lb, out = found
    terms = (la, lb)
    shapes = [view.shape(t) for t in node.inputs]
    if any(s is None or len(s) != len(t) or not all(isinstance(d, int) for d in s)
           for s, t in zip(shapes, terms, strict=True)):
        return None
    size: dict[str, int] = {}
    for letters, shape in zip(terms, shapes, strict=True):
        for c, d in zip(letters, shape, strict=True):  # type: ignore[arg-type]
            if size.setdefault(c, int(d)) != int(d):
                return None  # broadcast along a letter
    if set(out) - set(la) - set(lb) or (set(la) ^ set(lb)) - set(out):
        return None  # a letter of the output no operand has, or one summed within one operand
    batch = "".join(c for c in out if c in la and c in lb)
    m = "".join(c for c in out if c in la and c not in lb)
    n = "".join(c for c in out if c in lb and c not in la)
    k = "".join(c for c in la if c in lb and c not in out)
    if not k:
        return None  # nothing summed: an outer or elementwise product, no matrix product
    a, b = node.inputs
    free = [c for c in out if c not in batch]
    if n and m and free[0] in n:  # the output names B's free letters first: B @ A needs no Transpose after
        a, b, la, lb, m, n = b, a, lb, la, n, m
    return EinsumProduct(node, a, b, la, lb, out, batch, m, n, k, size)


_TO_SOFTMAX = ("Add", "Sub", "Mul", "Div", "Where", "Reshape", "Cast")
_FROM_SOFTMAX = ("Where", "Cast", "Reshape", "Identity")


def _feeds_a_gemm_or_an_attention(view: GraphView, e: EinsumProduct) -> bool:
    """A projection (a constant operand and no batch letters: a weight GEMM), or the product is attention's scores
    (it reaches a Softmax through additive terms and scales) or its P V (an operand comes from a Softmax): the
    products the GEMM and attention rules fuse. Any other (SAM's relative-position terms, per-head products with a
    constant table; small products of computed tensors) stays an Einsum, which ONNX Runtime runs as one kernel where
    the MatMul would bring Transposes and Reshapes of its own (SAM: predicted 146 -> 159 us with them rewritten)."""
    if not e.batch and any(view.const_value(t) is not None for t in (e.a, e.b)):
        return True
    tensor = e.node.outputs[0]
    for _ in range(6):
        readers = view.consumers_of(tensor)
        if len(readers) != 1 or tensor in view.graph_outputs:
            break
        if is_op(readers[0], "Softmax"):
            return True
        if not is_op(readers[0], *_TO_SOFTMAX):
            break
        tensor = readers[0].outputs[0]
    for tensor in (e.a, e.b):
        for _ in range(4):
            node = view.producer_of(tensor)
            if node is None:
                break
            if is_op(node, "Softmax"):
                return True
            if not is_op(node, *_FROM_SOFTMAX):
                break
            tensor = node.inputs[1] if is_op(node, "Where") and len(node.inputs) == 3 else node.inputs[0]
    return False


def _perm(letters: str, order: str) -> list[int]:
    return [letters.index(c) for c in order]


def _rewrite(view: GraphView, e: EinsumProduct, dtype: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto],
                                                                   list[onnx.ValueInfoProto]]:
    """The nodes writing the Einsum's output as a MatMul, their constants and the shapes of their tensors."""
    p = f"{e.node.outputs[0]}.einsum"
    size = e.size
    dims = [size[c] for c in e.batch]
    prod = lambda letters: math.prod(size[c] for c in letters)  # noqa: E731
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    infos: list[onnx.ValueInfoProto] = []
    b_const = view.const_value(e.b)
    keep_m = not e.batch and b_const is not None  # A's free letters stay leading dims, broadcast by the MatMul

    def operand(name: str, letters: str, order: str, shape: list[int], tag: str) -> str:
        value = view.const_value(name)
        perm = _perm(letters, order)
        if value is not None:  # permuted and reshaped once
            inits.append(numpy_helper.from_array(np.ascontiguousarray(value.transpose(perm)).reshape(shape),
                                                 f"{p}.{tag}"))
            return f"{p}.{tag}"
        cur = name
        if perm != list(range(len(perm))):
            nodes.append(helper.make_node("Transpose", [cur], [f"{p}.{tag}_t"], name=f"{p}.{tag}_t", perm=perm))
            infos.append(helper.make_tensor_value_info(f"{p}.{tag}_t", dtype, [size[c] for c in order]))
            cur = f"{p}.{tag}_t"
        if [size[c] for c in order] != shape:
            inits.append(numpy_helper.from_array(np.array(shape, np.int64), f"{p}.{tag}_shape"))
            nodes.append(helper.make_node("Reshape", [cur, f"{p}.{tag}_shape"], [f"{p}.{tag}_r"], name=f"{p}.{tag}_r"))
            infos.append(helper.make_tensor_value_info(f"{p}.{tag}_r", dtype, shape))
            cur = f"{p}.{tag}_r"
        return cur

    a_shape = [size[c] for c in e.m] + [prod(e.k)] if keep_m else [*dims, prod(e.m), prod(e.k)]
    a = operand(e.a, e.a_letters, e.batch + e.m + e.k, a_shape, "a")
    b = operand(e.b, e.b_letters, e.batch + e.k + e.n, [*dims, prod(e.k), prod(e.n)], "b")
    product = [*(a_shape[:-1]), prod(e.n)]
    natural = e.batch + e.m + e.n  # the letters of the product once its dims are split
    out = e.node.outputs[0]
    split = [size[c] for c in natural]
    last = out if split == product and natural == e.out else f"{p}.product"
    nodes.append(helper.make_node("MatMul", [a, b], [last], name=f"{p}.matmul"))
    if last != out:
        infos.append(helper.make_tensor_value_info(last, dtype, product))
        cur = last
        if split != product:
            target = out if natural == e.out else f"{p}.split"
            inits.append(numpy_helper.from_array(np.array(split, np.int64), f"{p}.split_shape"))
            nodes.append(helper.make_node("Reshape", [cur, f"{p}.split_shape"], [target], name=f"{p}.split"))
            if target != out:
                infos.append(helper.make_tensor_value_info(target, dtype, split))
            cur = target
        if natural != e.out:
            nodes.append(helper.make_node("Transpose", [cur], [out], name=f"{p}.out", perm=_perm(natural, e.out)))
    return nodes, inits, infos


def einsum_matmuls(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """`model` with every Einsum that is a matrix product up to permutations written as one MatMul between
    Transposes and Reshapes (a copy; the model passed in is unchanged), and how many were rewritten."""
    view = GraphView(model)
    replace: dict[int, list[onnx.NodeProto]] = {}
    inits: list[onnx.TensorProto] = []
    infos: list[onnx.ValueInfoProto] = []
    for node in view.nodes:
        e = einsum_product(view, node)
        e = e if e is not None and _feeds_a_gemm_or_an_attention(view, e) else None
        info = view.info(node.outputs[0]) if e is not None else None
        if e is None or info is None or info.dtype not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                           onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE):
            continue
        nodes, consts, shapes = _rewrite(view, e, info.dtype)
        replace[node.id] = nodes
        inits += consts
        infos += shapes
    if not replace:
        return model, 0
    return spliced(model, replace, set(replace), inits, infos), len(replace)


__all__ = ["EinsumProduct", "einsum_matmuls", "einsum_product"]
