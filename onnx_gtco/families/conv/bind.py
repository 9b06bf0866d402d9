"""Binder of the Conv family for plugins/families/conv/conv_op.h (C++ roles: the InRole / OutRole enums of gtco::Conv).

    gtco::Conv  in:  X, W, BIAS, SCALE, SHIFT, MEAN, VAR, RESIDUAL        out: Y

The rule found the roles (families/conv/rule.py) and the rewrite wrote them in order (opspec); what only the binder
knows is what the C++ side computes: 1-D and 2-D convolutions with explicit pads or ONNX's auto_pad (SAME_* pads
depend on x's spatial size: conv_op.h computes them from x's shape on every run and passes them to the device kernel
as run-time ConvArgs, so a symbolic height or width is served), the GEMM epilogue's activations.

The device kernel (families.conv.kernel, an implicit GEMM) is generic in every size, but its Problem, which picks the
tile and the weight loads, needs x's and w's shapes, which a node's attributes do not hold: `problem` reads them from
shape inference (plugin.device uses it in place of kernels.select.node_problem, and the tuner's conv tasks come
from it through plugin.device.bound_problem: tune.tasks.shaped_problem). A symbolic batch stands as 1 and a
symbolic height or width as SPATIAL_STAND_IN, for the choice only. groups != 1 (grouped and depthwise convs) gets
the family's direct kernel; C is w's dim 1 times groups (w is [OC, C/groups, KH, KW]).
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx_gtco.families.conv.kernel import conv_problem
from onnx_gtco.families.gemm.bind import ACTIVATIONS
from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.select import kernel_dtype
from onnx_gtco.opspec import SPECS
from onnx_gtco.plugin.binding import Binding, FusedNode, bind_roles, present, read

HEADER = "conv/conv_op.h"
CONV_IN, CONV_OUT = SPECS["conv"].roles, SPECS["conv"].outputs       # gtco::Conv::InRole / OutRole
SPATIAL_RANKS = (1, 2)
"""Spatial ranks gtco::ref::plan_conv takes (x [N, C, W] or [N, C, H, W])."""
SPATIAL_STAND_IN = 64
"""Height / width a symbolic spatial dim stands as when choosing the device instance's tile."""
AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")
"""ONNX Conv's auto_pad values, all of which gtco::ref::plan_conv takes (ref::parse_auto_pad): SAME_* pads from x's
shape on every run, so a symbolic height or width is served too."""


def same_pads(auto_pad: str, spatial: list[int], kernel: list[int], strides: list[int], dilations: list[int],
              pads: list[int]) -> list[int]:
    """The explicit pads (begins, then ends) ONNX Conv pads by: `pads` for NOTSET, zeros for VALID, and for SAME_*
    those making the output ceil(in / stride), the odd unit at the end (UPPER) or the beginning (LOWER), as
    gtco::ref::same_pad computes them at run time."""
    if auto_pad == "NOTSET":
        return list(pads)
    begins, ends = [0] * len(spatial), [0] * len(spatial)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        for i, (size, k, s, d) in enumerate(zip(spatial, kernel, strides, dilations, strict=True)):
            total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
            begins[i] = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            ends[i] = total - begins[i]
    return begins + ends


def _auto_pad(node: FusedNode, auto_pad: str) -> str | None:
    """Why the node's auto_pad attribute cannot be served: a value ONNX Conv does not have, or one that differs from
    its function's Conv (a model rewritten before the attribute existed has NOTSET for a SAME conv, whose pads the
    kernel would then get wrong), else None."""
    if auto_pad not in AUTO_PADS:
        return f"auto_pad={auto_pad} is not one of ONNX Conv's {', '.join(AUTO_PADS)}"
    for n in node.function.node:
        if n.op_type == "Conv":
            own = next((a.s.decode() for a in n.attribute if a.name == "auto_pad"), "NOTSET")
            if own != auto_pad:
                return (f"Conv {n.name!r} pads by auto_pad={own} but the node's auto_pad attribute says {auto_pad} "
                        "(a model rewritten by an older onnx-gtco: rewrite it again)")
    return None


@dataclass(frozen=True)
class ConvBinder:
    """`Conv_*` nodes: y = post_act(act(affine(conv(x, w) + bias)) + residual)."""

    family: str = "conv"
    header: str = HEADER
    cpp_struct: str = "gtco::Conv"

    @staticmethod
    def operand_flags(node: FusedNode, binding: Binding, problem: Problem) -> dict[str, bool]:
        """The epilogue's operands the node has."""
        del node, problem
        return present(binding, (("bias", "in", 2), ("scale", "in", 3), ("shift", "in", 4), ("batchnorm", "in", 5),
                                 ("residual", "in", 7)))

    def bind(self, node: FusedNode) -> Binding | str:
        op = read(node, self.family)
        if isinstance(op, str):
            why: Binding | str = op
        elif bad := [a for a in (op["activation"], op["post_activation"]) if a not in ACTIVATIONS]:
            why = f"activation {bad[0]!r} is not implemented by the C++ conv epilogue"
        elif len(op["kernel"] or ()) not in SPATIAL_RANKS:
            why = f"a {len(op['kernel'] or ())}-D convolution; the kernel takes 1-D and 2-D ones"
        elif (pad := _auto_pad(node, str(op["auto_pad"]))) is not None:
            why = pad
        else:
            bn = op["batchnorm"]
            need = {"x": True, "w": True, "bias": op["bias"], "scale": op["scale"], "shift": op["shift"],
                    "mean": bn, "var": bn, "residual": op["residual"]}
            why = bind_roles(node, op, need, CONV_IN, CONV_OUT)  # type: ignore[arg-type]
        return f"{node.node.op_type} node {node.node.name!r}: {why}" if isinstance(why, str) else why

    def problem(self, node: FusedNode) -> Problem | str:
        """The device kernel's Problem (operand flags as the attributes say; plugin.device fixes them from the
        binding), or why the node has no device kernel."""
        op = read(node, self.family)
        if isinstance(op, str):
            return op
        groups = int(op["groups"] or 1)
        x, w = (node.inputs[op.inputs[r]].shape if r in op.inputs else None for r in ("x", "w"))
        if x is None or w is None or len(x) != len(w) or len(x) not in (3, 4):
            return f"x {x} or w {w} has no known rank 3 or 4 (the device kernel's tile needs it)"
        if not all(isinstance(d, int) for d in w):
            return f"w {list(w)} has a symbolic dim (the weight's shape picks the kernel's weight loads)"
        sp = len(x) - 2
        strides, dil = list(op["stride"] or [1] * sp), list(op["dilations"] or [1] * sp)
        spatial = [d if isinstance(d, int) else SPATIAL_STAND_IN for d in x[2:]]
        # SAME_* pads as for this x (the stand-in's where symbolic: the run computes the real ones, conv_op.h)
        pads = same_pads(str(op["auto_pad"]), spatial, [int(k) for k in w[2:]], strides, dil,
                         list(op["pads"] or [0] * (2 * sp)))
        if sp == 1:  # a 1-D conv runs as H = KH = 1
            spatial, pads, strides, dil = [1, *spatial], [0, pads[0], 0, pads[1]], [1, *strides], [1, *dil]
            kernel = [1, int(w[2])]
        else:
            kernel = [int(w[2]), int(w[3])]
        n = x[0] if isinstance(x[0], int) else 1
        dtype = kernel_dtype(self.family, op.dtype, str(op["precision"]))
        return conv_problem(dtype, n, int(w[1]) * groups, spatial[0], spatial[1], int(w[0]), kernel[0], kernel[1],
                            stride=(strides[0], strides[1]), dilation=(dil[0], dil[1]),
                            pads=(pads[0], pads[1], pads[2], pads[3]), groups=groups, bias=bool(op["bias"]),
                            scale=bool(op["scale"]), shift=bool(op["shift"]), batchnorm=bool(op["batchnorm"]),
                            epsilon=float(op["epsilon"]), activation=str(op["activation"] or "none"),
                            residual=bool(op["residual"]), post_activation=str(op["post_activation"] or "none"))


CONV = ConvBinder()
BINDERS = (CONV,)
"""The binders this module provides, one per family."""
