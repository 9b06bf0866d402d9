"""The attention family's passes: a per-head scale of the scores (Swin V2's cosine attention) moved onto the queries,
so that the kernel's one scalar scale suffices (families/attention/head_scale.py), and two constant masks added one
after the other summed into one, so that its one mask suffices (families/attention/mask_sum.py)."""

from __future__ import annotations

from typing import Any

import onnx

from onnx_gtco.calibration import Hardware
from onnx_gtco.config import GtcoConfig
from onnx_gtco.families.attention.head_scale import scaled_queries
from onnx_gtco.families.attention.mask_sum import summed_masks
from onnx_gtco.plan.types import GraphPass


def head_scale(model: onnx.ModelProto, config: GtcoConfig,
               hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with every per-head scale of attention scores applied to the queries (equal up to rounding); nothing
    to report."""
    del config, hw
    model, _ = scaled_queries(model)
    return model, []


def mask_sum(model: onnx.ModelProto, config: GtcoConfig,
             hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with every two constant masks added one after the other to attention scores one Add of their sum
    (exact on the kept keys); nothing to report."""
    del config, hw
    model, _ = summed_masks(model)
    return model, []


PASSES = (GraphPass("head_scale", 4, lambda config: True, head_scale,
                    "a per-head scale of attention scores moved onto the queries, families/attention/head_scale.py"),
          GraphPass("mask_sum", 5, lambda config: True, mask_sum,
                    "two constant masks added one after the other to attention scores summed into one, "
                    "families/attention/mask_sum.py"))
"""The attention family's passes (GraphPass), after the other families' rewrites."""


__all__ = ["PASSES", "head_scale", "mask_sum"]
