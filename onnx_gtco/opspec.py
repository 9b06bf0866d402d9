"""What a fused op is, defined once: its domain and op-type naming (the contract per kernel family follows).

A fused node's op type names its kernel family and I/O dtype: `Attention_f16`, `BmmSoftmax_f32`, `Gemm_bf16`.
"""

from __future__ import annotations

DOMAIN = "ai.gtco"


def op_type(family: str, dtype: str) -> str:
    """`attention`, `f16` -> `Attention_f16`: the op type names the kernel family and I/O dtype."""
    return "".join(p.capitalize() for p in family.split("_")) + "_" + dtype


def split_op_type(op_type: str) -> tuple[str, str]:
    """`BmmSoftmax_f16` -> ("bmm_softmax", "f16"): the inverse of op_type."""
    head, _, dtype = op_type.rpartition("_")
    family = "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(head))
    return family, dtype
