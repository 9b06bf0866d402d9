"""The conv family's fused op."""

from __future__ import annotations

from onnx_gtco.opspec import BOOL, EPILOGUE, FLOAT, INT, INTS, STR, Attr, OpSpec

SPECS = (
    # y = post_act(act(affine(conv(x, w) + bias)) + residual); affine: v * scale + shift, or with batchnorm
    # (v - mean) * scale / sqrt(var + epsilon) + shift (families/conv/rule.py); auto_pad: ONNX Conv's (SAME_* pads
    # depend on x's spatial size, so the kernels compute them from x's shape and `pads` is zero then)
    OpSpec("conv", ("x", "w", "bias", "scale", "shift", "mean", "var", "residual"), ("y",),
           (Attr("kernel", INTS), Attr("stride", INTS), Attr("pads", INTS), Attr("dilations", INTS),
            Attr("auto_pad", STR, "NOTSET"), Attr("groups", INT, 1), *EPILOGUE, Attr("scale", BOOL, False),
            Attr("shift", BOOL, False), Attr("batchnorm", BOOL, False), Attr("epsilon", FLOAT, 1e-5),
            Attr("affine", BOOL, False), Attr("post_activation", STR, "none"))),
)
