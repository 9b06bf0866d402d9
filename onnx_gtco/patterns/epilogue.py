"""Epilogue steps GEMM and Conv groups share: a broadcast bias Add and a same-shape residual Add (and GEMM's
LayerScale Mul)."""

from __future__ import annotations

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op, other_input
from onnx_gtco.patterns.util import sole_reader


def broadcasts_along(view: GraphView, const: str, out: str, axis: int) -> bool:
    """`const` holds one value, or one value per index of `out`'s `axis` and size-1 dims elsewhere."""
    val = view.const_value(const)
    shape = view.shape(out)
    if val is None or shape is None:
        return False
    if val.size == 1:
        return True
    ax = axis % len(shape)
    if val.ndim > len(shape) or shape[ax] != val.size:
        return False
    # align val's dims to the right of out's
    for i, d in enumerate(val.shape):
        pos = len(shape) - val.ndim + i
        if d != 1 and pos != ax:
            return False
    return True


def const_add(view: GraphView, tensor: str, axis: int, op: str = "Add") -> tuple[Node | None, str | None]:
    """The sole reader of `tensor` if it is an Add (or `op`) of a constant broadcast along `axis`.

    Returns (node, None) on a match, (None, reason) for a constant with the wrong shape (a near miss), and
    (None, None) when the reader is something else.
    """
    add = sole_reader(view, tensor)
    if not is_op(add, op):
        return None, None
    assert add is not None
    other = other_input(add, tensor)
    if other is None or not view.is_constant(other):
        return None, None
    if not broadcasts_along(view, other, tensor, axis):
        shape = view.shape(other)
        return None, f"{op} {add.name!r} of constant shape {shape} does not broadcast along axis {axis}"
    return add, None


def layer_scale(view: GraphView, tensor: str, n: object) -> Node | None:
    """The sole reader of `tensor` if it is a Mul by a constant of one value per column of the last axis, `n` of them
    (LayerScale's gamma: [n], or [1, .., 1, n]); None otherwise (a scalar Mul is no LayerScale)."""
    mul, _ = const_add(view, tensor, -1, op="Mul")
    if mul is None:
        return None
    val = view.const_value(other_input(mul, tensor) or "")
    return mul if val is not None and isinstance(n, int) and n > 1 and val.size == n else None


def residual_add(view: GraphView, tensor: str, group: set[int]) -> tuple[Node | None, str | None]:
    """The sole reader of `tensor` if it adds a same-shape tensor from outside `group`; or why not."""
    add = sole_reader(view, tensor)
    if not is_op(add, "Add"):
        return None, None
    assert add is not None
    other = other_input(add, tensor)
    if other is None or view.is_constant(other):
        return None, None
    made_by = view.producer.get(other)
    if made_by is not None and made_by in group:
        return None, f"residual Add {add.name!r} reads a tensor of the group twice"
    mine, theirs = view.shape(tensor), view.shape(other)
    if mine is None or theirs is None or mine != theirs:
        return None, f"residual Add {add.name!r} operand shape {theirs} differs from the output shape {mine}"
    return add, None
