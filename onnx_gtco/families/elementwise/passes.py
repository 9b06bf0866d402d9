"""The elementwise family's pass: rotary embeddings in forms the elementwise kernels run as one kernel: a partial or
interleaved rotary over a blocked view of the head (families/elementwise/rotary_blocks.py), rotate-half as a roll
times a constant sign, which they fold into one load (families/elementwise/rotate.py)."""

from __future__ import annotations

from typing import Any

import onnx

from onnx_gtco.calibration import Hardware
from onnx_gtco.config import GtcoConfig
from onnx_gtco.families.elementwise.rotary_blocks import blocked_rotaries
from onnx_gtco.families.elementwise.rotate import signed_rolls
from onnx_gtco.plan.types import GraphPass


def roll(model: onnx.ModelProto, config: GtcoConfig, hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with every partial or interleaved rotary in its blocked form, then every rotate-half a signed roll
    (both exact: the same products and sums, a sign flip rounds nothing); nothing to report."""
    del config, hw
    model, _ = blocked_rotaries(model)
    model, _ = signed_rolls(model)
    return model, []


PASSES = (GraphPass("rotate_half", 3, lambda config: True, roll,
                    "partial and interleaved rotary embeddings over blocks of the head, families/elementwise/"
                    "rotary_blocks.py; rotate-half as a roll times a sign, families/elementwise/rotate.py"),)
"""The elementwise family's passes (GraphPass): rotate-half, after the GEMM family's packings."""


__all__ = ["PASSES", "roll"]
