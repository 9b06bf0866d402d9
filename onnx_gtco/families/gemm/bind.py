"""Binders of the GEMM and QKV families for plugins/families/gemm/gemm_op.h (C++ roles: the InRole / OutRole enums
there).

    gtco::Gemm  in:  A, B, BIAS, RESIDUAL, LAYER_SCALE, GAMMA, BETA, SCALES      out: Y, NORM
    gtco::Qkv   in:  A, W0, W1, W2, BIAS0, BIAS1, BIAS2         out: Y0, Y1, Y2

The rule found the roles (families/gemm/rule.py, families/gemm/qkv_rule.py) and the rewrite wrote them in order
(opspec); what only the binder knows is what the C++ side computes: its dtypes, its activations, at most three
projections.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx_gtco.families.gemm.spec import QKV_PROJECTIONS
from onnx_gtco.kernels.family import Problem
from onnx_gtco.opspec import FP8_DTYPE, SPECS
from onnx_gtco.plugin.binding import Binding, FusedNode, bind_roles, one_row, present, read

HEADER = "gemm/gemm_op.h"
FP8_DTYPES = {"io_dtype": "f16", "role_dtypes": {"b": "e4m3", "scales": "f32"}}
"""A `Gemm_f8` node's dtypes (onnx_gtco.fp8): fp16 I/O, its B E4M3, its scales [s_a, s_b] fp32."""
ACTIVATIONS = ("none", "relu", "gelu_erf", "gelu_tanh", "silu", "quick_gelu", "sigmoid", "tanh", "relu6")
"""Activations gtco::ref::parse_act knows (plugins/families/gemm/gemm_ref.h)."""

GEMM_IN, GEMM_OUT = SPECS["gemm"].roles, SPECS["gemm"].outputs       # gtco::Gemm::InRole / OutRole
QKV_IN, QKV_OUT = SPECS["qkv"].roles, SPECS["qkv"].outputs          # gtco::Qkv::InRole / OutRole


@dataclass(frozen=True)
class GemmBinder:
    """`Gemm_*` nodes: y = act(alpha * A @ op(B) + beta * bias) * layer_scale + residual; with layernorm, also
    norm = LayerNorm(y) * gamma + beta over each row (y then a node output only where the model reads it)."""

    family: str = "gemm"
    header: str = HEADER
    cpp_struct: str = "gtco::Gemm"

    @staticmethod
    def operand_flags(node: FusedNode, binding: Binding, problem: Problem) -> dict[str, bool] | str:
        """The bias, residual and LayerScale the node has (a GEMM without LayerScale keeps the Problem, and the
        tuning task, it always had), each per-column operand one row of N."""
        flags = present(binding, (("bias", "in", 2), ("residual", "in", 3), ("layer_scale", "in", 4)))
        if not flags["layer_scale"]:
            del flags["layer_scale"]
        for role, index in (("bias", 2), ("layer_scale", 4)):
            why = one_row(node, binding, role, index, problem.size("N")) if flags.get(role) else None
            if why is not None:
                return why
        return flags

    @staticmethod
    def extent_dims(node: FusedNode, binding: Binding) -> tuple[tuple[int, int], ...]:
        """A's rows: the leading dims, or for a batched GEMM its row dim alone."""
        first = binding.inputs[0]
        rank = len(node.inputs[first].shape or ())
        if node.attrs.get("batch"):
            return ((first, rank - 2),) if rank >= 2 else ()
        return tuple((first, a) for a in range(rank - 1))

    def bind(self, node: FusedNode) -> Binding | str:
        op = read(node, self.family)
        if isinstance(op, str):
            why: Binding | str = op
        elif op["activation"] not in ACTIVATIONS:
            why = f"activation {op['activation']!r} is not implemented by the C++ GEMM epilogue"
        else:
            # a half GEMM may write fp32 (a graph output folded into it): the cast in its epilogue; not with a
            # residual, which the kernel reads in y's dtype
            ln = bool(op["layernorm"])
            out_dtypes = ("f32",) if not op["residual"] and not ln else ()
            fp8 = op.dtype == FP8_DTYPE
            need = {"a": True, "b": True, "bias": op["bias"], "residual": op["residual"],
                    "layer_scale": op["layer_scale"], "gamma": ln, "beta": ln, "scales": fp8}
            why = bind_roles(node, op, need, GEMM_IN, GEMM_OUT, outputs=2 if ln else 1,  # type: ignore[arg-type]
                             out_dtypes=out_dtypes, **(FP8_DTYPES if fp8 else {}))  # type: ignore[arg-type]
            if not isinstance(why, str) and ln and "norm" not in op.outputs:
                why = "a LayerNorm GEMM without its norm output"
            elif not isinstance(why, str) and not ln and "y" not in op.outputs:
                why = "a GEMM without its y output"
        return f"{node.node.op_type} node {node.node.name!r}: {why}" if isinstance(why, str) else why


@dataclass(frozen=True)
class QkvBinder:
    """`Qkv_*` nodes: y_p = A @ W_p (+ bias_p), p < 3, one A."""

    family: str = "qkv"
    header: str = HEADER
    cpp_struct: str = "gtco::Qkv"

    @staticmethod
    def operand_flags(node: FusedNode, binding: Binding, problem: Problem) -> dict[str, bool] | str:
        """Whether the projections have biases, each one row."""
        del problem
        flags = present(binding, (("bias", "in", 4),))
        why = one_row(node, binding, "bias", 4, None) if flags["bias"] else None
        return flags if why is None else why

    def bind(self, node: FusedNode) -> Binding | str:
        op = read(node, self.family)
        if isinstance(op, str):
            why: Binding | str = op
        elif not 0 < len(op["ns"]) <= QKV_PROJECTIONS:
            why = f"{len(op['ns'])} projections; the C++ QKV GEMM takes at most {QKV_PROJECTIONS}"
        else:
            n = len(op["ns"])
            need = {"a": True} | {f"w{p}": p < n for p in range(QKV_PROJECTIONS)}
            need |= {f"bias{p}": op["bias"] and p < n for p in range(QKV_PROJECTIONS)}
            why = bind_roles(node, op, need, QKV_IN, QKV_OUT, outputs=n)  # type: ignore[arg-type]
        return f"{node.node.op_type} node {node.node.name!r}: {why}" if isinstance(why, str) else why


GEMM = GemmBinder()
QKV = QkvBinder()
BINDERS = (GEMM, QKV)
"""The binders this module provides, one per family."""
