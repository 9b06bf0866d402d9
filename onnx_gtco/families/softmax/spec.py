"""The softmax family's fused op."""

from __future__ import annotations

from onnx_gtco.opspec import DIM, INT, Attr, OpSpec

SPECS = (OpSpec("softmax", ("x",), ("y",), (Attr("axis", INT, -1), Attr("rows", DIM), Attr("cols", DIM))),)
