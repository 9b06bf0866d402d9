"""RMSNorm kernel family: LayerNorm's kernel without the mean (families.layernorm.kernel, `center` False;
plugins/families/layernorm/layernorm.cuh with CENTER false): one pass over rows held in registers, the optional
residual add (and its sum as a second output), optional gamma, the mean square in fp32.

Problem: as LayerNorm's, family "rmsnorm", beta always off. Config, checks, configurations and estimate are
LayerNorm's. The estimate keeps LayerNorm's fitted constants (RowwiseConstants): no RMSNorm kernel has been timed on
a GPU, and its one reduction is costed as LayerNorm's two.
"""

from __future__ import annotations

from onnx_gtco.families.layernorm.kernel import LayerNormFamily
from onnx_gtco.kernels.family import OpKernel, Problem
from onnx_gtco.opspec import FusedOp


class RmsNormFamily(LayerNormFamily):
    """LayerNorm's kernel without centering: y = x / sqrt(mean(x²) + eps) [* gamma]."""

    name = "rmsnorm"
    center = False

    @staticmethod
    def _flags(problem: Problem) -> tuple[bool, bool, bool, bool]:
        """(residual, residual_out, gamma, beta) as LayerNorm reads them; RMSNorm has no beta."""
        res, res_out, gamma, _ = LayerNormFamily._flags(problem)
        return res, res_out, gamma, False


FAMILY = RmsNormFamily()


def op_problem(op: FusedOp, dtype: str) -> Problem | str:
    """The Problem of an rmsnorm node (OpKernel.problem; its rows are a run-time size), or why none."""
    hidden = op.int("hidden")
    if hidden is None:
        return "RMSNorm over a symbolic hidden size (the kernel is built per hidden size)"
    residual = op["residual"]
    return Problem.make("rmsnorm", dtype, {"hidden": hidden, "rows": 1}, {
        "residual": residual, "residual_out": residual, "gamma": op["affine"], "beta": False,
        "epsilon": op["epsilon"]})


KERNELS = (FAMILY,)
OPS = (OpKernel("rmsnorm", "rmsnorm", op_problem),)
