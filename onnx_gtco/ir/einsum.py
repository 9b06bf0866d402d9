"""Einsum equations that are a (batched) matrix product: what tf2onnx writes for attention's Q Kᵀ and P V.

    "bhqd,bhkd->bhqk"   Q Kᵀ: A [.., M, K] times B given as [.., N, K] (trans_b)
    "bhqk,bhkd->bhqd"   P V:  A [.., M, K] times B [.., K, N]

Any letters; the batch letters lead in the same order in both operands and the output (a shared "..." prefix is
batch too), the last two are (m, k) or (k, m) for A, (k, n) or (n, k) for B and (m, n) for the output, k summed
away. Anything else (broadcast or reordered batch letters, traces, diagonals, outer products, more operands) is no
matrix product here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchedMatMul:
    """An Einsum read as ``A @ B`` over its batch dims: the operands' last two axes as they are stored."""

    rank: int      # letters per operand (batch letters + 2), not counting a "..." prefix
    trans_a: bool  # A is stored [.., K, M]
    trans_b: bool  # B is stored [.., N, K]


def two_operand_terms(equation: str | bytes | None) -> tuple[str, str, str] | None:
    """The letters of an explicit two-operand Einsum `equation` (spaces dropped): (a, b, output), else None."""
    if equation is None:
        return None
    eq = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    if eq.count("->") != 1:
        return None
    ins, out = eq.split("->")
    operands = ins.split(",")
    return (operands[0], operands[1], out) if len(operands) == 2 else None


def batched_matmul(equation: str | bytes | None) -> BatchedMatMul | None:
    """The matrix product an Einsum `equation` computes, or None when it is not one."""
    found = two_operand_terms(equation)
    if found is None:
        return None
    terms = list(found)
    dots = [t.startswith("...") for t in terms]
    if any(dots) and not all(dots):
        return None
    a, b, y = (t[3:] if d else t for t, d in zip(terms, dots, strict=True))
    if not all(t.isalpha() and len(set(t)) == len(t) for t in (a, b, y)) or not len(a) == len(b) == len(y) >= 2:
        return None
    batch = y[:-2]
    if a[:-2] != batch or b[:-2] != batch:
        return None
    m, n = y[-2], y[-1]
    ka = set(a[-2:]) - {m}
    if len(ka) != 1 or m not in a[-2:]:
        return None
    k = ka.pop()
    if k in y or set(b[-2:]) != {k, n}:
        return None
    return BatchedMatMul(rank=len(y), trans_a=a[-2:] == k + m, trans_b=b[-2:] == n + k)
