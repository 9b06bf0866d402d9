"""Binder of the Conv family for plugins/ort/conv_op.h (C++ roles: the InRole / OutRole enums of gtco::Conv).

    gtco::Conv  in:  X, W, BIAS, SCALE, SHIFT, MEAN, VAR, RESIDUAL        out: Y

The rule found the roles (patterns/conv.py) and the rewrite wrote them in order (opspec); what only the binder
knows is what the C++ side computes: 1-D and 2-D convolutions with explicit pads, the GEMM epilogue's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx_gtco.opspec import SPECS
from onnx_gtco.plugin.bind_gemm import ACTIVATIONS
from onnx_gtco.plugin.binding import Binding, FusedNode, bind_roles, read

HEADER = "conv_op.h"
CONV_IN, CONV_OUT = SPECS["conv"].roles, SPECS["conv"].outputs       # gtco::Conv::InRole / OutRole
SPATIAL_RANKS = (1, 2)
"""Spatial ranks gtco::ref::plan_conv takes (x [N, C, W] or [N, C, H, W])."""
PADDINGS = (b"NOTSET", b"VALID")
"""Conv auto_pad values whose pads the rule's attributes state (SAME_* pads depend on the input size)."""


def _auto_pad(node: FusedNode) -> str | None:
    """Why the function's Conv pads by auto_pad in a way the node's pads attribute does not state, else None."""
    for n in node.function.node:
        for a in n.attribute:
            if n.op_type == "Conv" and a.name == "auto_pad" and a.s not in PADDINGS:
                return f"Conv {n.name!r} pads by auto_pad={a.s.decode()}; the kernel takes explicit pads"
    return None


@dataclass(frozen=True)
class ConvBinder:
    """`Conv_*` nodes: y = post_act(act(affine(conv(x, w) + bias)) + residual)."""

    family: str = "conv"
    header: str = HEADER
    cpp_struct: str = "gtco::Conv"

    def bind(self, node: FusedNode) -> Binding | str:
        op = read(node, self.family)
        if isinstance(op, str):
            why: Binding | str = op
        elif bad := [a for a in (op["activation"], op["post_activation"]) if a not in ACTIVATIONS]:
            why = f"activation {bad[0]!r} is not implemented by the C++ conv epilogue"
        elif len(op["kernel"] or ()) not in SPATIAL_RANKS:
            why = f"a {len(op['kernel'] or ())}-D convolution; the kernel takes 1-D and 2-D ones"
        elif (pad := _auto_pad(node)) is not None:
            why = pad
        else:
            bn = op["batchnorm"]
            need = {"x": True, "w": True, "bias": op["bias"], "scale": op["scale"], "shift": op["shift"],
                    "mean": bn, "var": bn, "residual": op["residual"]}
            why = bind_roles(node, op, need, CONV_IN, CONV_OUT)  # type: ignore[arg-type]
        return f"{node.node.op_type} node {node.node.name!r}: {why}" if isinstance(why, str) else why


CONV = ConvBinder()
BINDERS = (CONV,)
"""The binders this module provides, one per family."""
