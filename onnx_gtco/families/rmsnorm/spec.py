"""The RMSNorm family's fused op."""

from __future__ import annotations

from onnx_gtco.opspec import BOOL, DIM, FLOAT, INT, STR, Attr, OpSpec

SPECS = (
    # y = (a [+ b]) / sqrt(mean((a [+ b])²) + eps) [* gamma] over the trailing axes from `axis`; sum = a + b when read
    # outside; form: the source form (rule.py: decomposed, RMSNormalization, SkipSimplifiedLayerNormalization)
    OpSpec("rmsnorm", ("a", "b", "gamma"), ("y", "sum"),
           (Attr("epsilon", FLOAT, 1e-5), Attr("axis", INT, -1), Attr("hidden", DIM), Attr("residual", BOOL, False),
            Attr("form", STR, "decomposed"), Attr("affine", BOOL, True))),
)
