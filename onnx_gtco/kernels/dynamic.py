"""The run-time extent of a dynamic-shape node: the one size its kernel's tiles run over that changes with the input
shape, and the Problem at a given value of it.

A model with symbolic dims (`batch`, `seq`) is optimized once; each bound node then dispatches at run time on one
extent, which its kernel family names (`KernelFamily.extent`): a GEMM's ``M``, the rows of A (a symbolic batch and
sequence fold into them); attention's ``seq_q``, the query length (the batch goes to the grid, not into a tile); a
row-wise kernel's ``rows``; None for a family that does not dispatch on size (elementwise, conv). The family's
`at_extent` gives its Problem at a value of it (attention's key length follows its query length in self-attention).
"""

from __future__ import annotations

from onnx_gtco.kernels.family import KernelFamily, Problem
from onnx_gtco.kernels.select import ALL_FAMILIES, OPS


def _kernel_family(family: str) -> KernelFamily | None:
    """The kernel family of `family`: a kernel family's name, or a fused op's whose nodes run one."""
    op = OPS.get(family)
    return ALL_FAMILIES.get(op.kernel if op is not None else family)


def extent_name(family: str) -> str | None:
    """The Problem size that `family`'s tiles run over and that varies with the input shape (its kernel family's
    `extent`), or None when the family does not dispatch on size (elementwise, conv and unknown families)."""
    kernel = _kernel_family(family)
    return None if kernel is None else kernel.extent


def with_extent(problem: Problem, n: int) -> Problem:
    """`problem` with its run-time extent (`extent_name(problem.family)`) set to `n` (its kernel family's
    `at_extent`).

    Raises:
        ValueError: n < 1, or the family has no run-time extent.
    """
    key = extent_name(problem.family)
    kernel = _kernel_family(problem.family)
    if key is None or kernel is None:
        raise ValueError(f"{problem.family} kernels have no run-time extent to dispatch on")
    if n < 1:
        raise ValueError(f"{key}={n}: a run-time extent is at least 1")
    return kernel.at_extent(problem, n)
