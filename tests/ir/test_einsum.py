"""onnx_gtco.ir.einsum: which Einsum equations are a batched matrix product, and how its operands are stored; the
answer checked against numpy's einsum on random operands."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_gtco.ir.einsum import BatchedMatMul, batched_matmul


@pytest.mark.parametrize(("equation", "form"), [
    ("bhqd,bhkd->bhqk", BatchedMatMul(4, False, True)),     # tf2onnx's Q Kᵀ
    ("bhqk,bhkd->bhqd", BatchedMatMul(4, False, False)),    # and P V
    ("abcd,abed->abce", BatchedMatMul(4, False, True)),
    ("bhdq,bhdk->bhqk", BatchedMatMul(4, True, False)),
    ("ij,jk->ik", BatchedMatMul(2, False, False)),
    ("...qd,...kd->...qk", BatchedMatMul(2, False, True)),
    (b"b q d , b k d -> b q k", BatchedMatMul(3, False, True)),
])
def test_matrix_products_and_their_operand_order(equation: str | bytes, form: BatchedMatMul) -> None:
    got = batched_matmul(equation)
    assert got == form
    eq = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "").replace("...", "z")
    rng = np.random.default_rng(0)
    sizes = {c: 2 + i for i, c in enumerate(sorted(set(eq) - set(",->")))}
    a_t, b_t = eq.split("->")[0].split(",")
    a, b = (rng.standard_normal([sizes[c] for c in t]) for t in (a_t, b_t))
    want = np.einsum(eq, a, b)
    a2 = np.swapaxes(a, -1, -2) if got.trans_a else a
    b2 = np.swapaxes(b, -1, -2) if got.trans_b else b
    np.testing.assert_allclose(a2 @ b2, want)


@pytest.mark.parametrize("equation", [
    "bhqd,bhkd->bhkq",     # the product transposed
    "bhqd,hbkd->bhqk",     # batch letters reordered
    "bhqd,bhke->bhqk",     # nothing summed
    "bqd,bkd->bq",         # a reduction too
    "ii->i", "bhqd,bhkd", "bhqd,bhkd,bhkd->bhqk", "...qd,bkd->bqk", "bhqd,bhkd->bhqq", None,
])
def test_other_equations_are_no_matrix_product(equation: str | None) -> None:
    assert batched_matmul(equation) is None
