"""The run-time extent of a dynamic-shape node: the one size its kernel's tiles run over that changes with the input
shape, and the Problem at a given value of it.

A model with symbolic dims (`batch`, `seq`) is optimized once; each bound node then dispatches at run time on one
extent, chosen per kernel family:

- gemm / qkv: ``M``, the rows of A (a symbolic batch and sequence fold into them);
- attention / bmm_softmax: ``seq_q``, the query length (the batch goes to the grid, not into a tile);
- layernorm / softmax: ``rows``;
- anything else (elementwise, ...): None, no dispatch on size.

Self-attention: when a Problem has ``seq_k == seq_q`` (the optimizer stands both symbolic lengths as the same value,
see `onnx_gtco.kernels.select`), ``seq_k`` follows ``seq_q`` in `with_extent`; a Problem with a different static
``seq_k`` (cross-attention over a fixed memory) keeps it. Static ``mask_shape`` / ``bias_shape`` flags follow the
same way: a full ``Sq'`` / ``Sk'`` dim takes the new length, a broadcast 1 stays 1.
"""

from __future__ import annotations

import dataclasses

from onnx_gtco.kernels.family import Problem

EXTENTS: dict[str, str] = {
    "gemm": "M", "qkv": "M",
    "attention": "seq_q", "bmm_softmax": "seq_q",
    "layernorm": "rows", "softmax": "rows",
}
"""Family (pattern or kernel family name) -> the Problem size its dispatch runs over."""


def extent_name(family: str) -> str | None:
    """The Problem size that `family`'s tiles run over and that varies with the input shape, or None when the family
    does not dispatch on size (elementwise and unknown families)."""
    return EXTENTS.get(family)


def _with_sizes(problem: Problem, new: dict[str, int]) -> Problem:
    sizes = tuple((k, int(new.get(k, v))) for k, v in problem.sizes)
    return dataclasses.replace(problem, sizes=sizes)


def with_extent(problem: Problem, n: int) -> Problem:
    """`problem` with its run-time extent (`extent_name(problem.family)`) set to `n`.

    Raises:
        ValueError: n < 1, or the family has no run-time extent.
    """
    key = extent_name(problem.family)
    if key is None:
        raise ValueError(f"{problem.family} kernels have no run-time extent to dispatch on")
    if n < 1:
        raise ValueError(f"{key}={n}: a run-time extent is at least 1")
    if key != "seq_q":
        return _with_sizes(problem, {key: n})
    sq, sk = problem.size("seq_q"), problem.size("seq_k")
    follows = sk == sq
    new = {"seq_q": n, "seq_k": n} if follows else {"seq_q": n}
    flags = []
    for name, value in problem.flags:
        if name in ("mask_shape", "bias_shape") and value is not None:
            b, h, q, k = (int(v) for v in value)
            q = n if q == sq and q != 1 else q
            k = n if follows and k == sk and k != 1 else k
            value = (b, h, q, k)
        flags.append((name, value))
    return dataclasses.replace(_with_sizes(problem, new), flags=tuple(flags))
