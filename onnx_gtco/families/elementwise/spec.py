"""The elementwise family's fused op: the group's elementwise program over its inputs in order."""

from __future__ import annotations

from onnx_gtco.opspec import STRS, Attr, OpSpec

SPECS = (OpSpec("elementwise", None, None, (Attr("ops", STRS, ()),)),)
