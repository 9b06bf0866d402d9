"""The planner's own rewrites before the rules match: each family's passes (its `passes` module's PASSES,
plan.types.GraphPass), which price their choices with the library's selection and estimate (plugin.device)."""

from __future__ import annotations

import functools

from onnx_gtco import families
from onnx_gtco.plan.types import GraphPass


@functools.cache
def graph_passes() -> tuple[GraphPass, ...]:
    """Every family's passes in the order they run (GraphPass.order; ties in the registry's order)."""
    return tuple(sorted((p for part in families.parts("passes") for p in part.PASSES), key=lambda p: p.order))


__all__ = ["graph_passes"]
