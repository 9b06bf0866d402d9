"""The activations a fused epilogue may name (a GEMM's or a conv's "activation" attribute), by what they compute.

`REFERENCE` maps each name to its fp64 numpy function: the fusion rules recognise an activation subgraph by
evaluating it against these (patterns.find_activation), and the kernel families' references compute with them.
"""

from __future__ import annotations

from onnx_gtco.patterns.find_activation import REFERENCE

__all__ = ["REFERENCE"]
