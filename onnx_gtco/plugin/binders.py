"""The binders: fused op family -> the Binder that maps its nodes onto a C++ op struct, from each family's bind
module (onnx_gtco.families).

A family with no binder keeps running its model-local function (the library does not register its op types).
"""

from __future__ import annotations

import functools

from onnx_gtco import families
from onnx_gtco.plugin.binding import Binder


@functools.cache
def binders() -> dict[str, Binder]:
    """Every family's binders (its bind module's BINDERS) by the fused op family they bind."""
    return {b.family: b for part in families.parts("bind") for b in part.BINDERS}


def binder_for(family: str) -> Binder | None:
    return binders().get(family)
