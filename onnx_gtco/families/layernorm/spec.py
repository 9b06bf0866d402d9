"""The LayerNorm family's fused op."""

from __future__ import annotations

from onnx_gtco.opspec import BOOL, DIM, FLOAT, INT, Attr, OpSpec

SPECS = (
    # y = LayerNorm(a [+ b]) * gamma + beta; sum = a + b when read outside
    OpSpec("layernorm", ("a", "b", "gamma", "beta"), ("y", "sum"),
           (Attr("epsilon", FLOAT, 1e-5), Attr("axis", INT, -1), Attr("hidden", DIM), Attr("residual", BOOL, False),
            Attr("decomposed", BOOL, False), Attr("affine", BOOL, True))),
)
