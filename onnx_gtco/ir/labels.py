"""GTCO's operator patterns (thesis §3.3, TVM's fusion rules): one explicit table, unknown ops are opaque."""

from __future__ import annotations

from enum import Enum


class Label(str, Enum):
    ELEMENTWISE = "elementwise"
    INJECTIVE = "injective"
    REDUCTION = "reduction"
    COMPLEX = "complex-out-fusable"
    OPAQUE = "opaque"


_ELEMENTWISE = """
Abs Acos Acosh Add And Asin Asinh Atan Atanh BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Cast CastLike
Ceil Celu Clip Cos Cosh Div Elu Equal Erf Exp Floor Gelu Greater GreaterOrEqual HardSigmoid HardSwish Identity
IsInf IsNaN LeakyRelu Less LessOrEqual Log Max Mean Min Mish Mod Mul Neg Not Or PRelu Pow Reciprocal Relu Round
Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Sub Sum Tan Tanh ThresholdedRelu Where Xor
"""
_INJECTIVE = """
Concat DepthToSpace Expand Flatten Gather GatherElements GatherND Pad Reshape Slice SpaceToDepth Split Squeeze
Tile Transpose Unsqueeze
"""
_REDUCTION = """
ArgMax ArgMin GlobalAveragePool GlobalMaxPool ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum ReduceSumSquare
"""
# complex-out-fusable: the output of these can absorb an elementwise epilogue; LayerNormalization is a one-node
# form of GTCO's decomposed LayerNorm (reduction + elementwise) and takes an elementwise prologue (residual add).
_COMPLEX = """
Conv ConvTranspose Gemm LayerNormalization MatMul
"""

TABLE: dict[str, Label] = {}
for _names, _label in (
    (_ELEMENTWISE, Label.ELEMENTWISE),
    (_INJECTIVE, Label.INJECTIVE),
    (_REDUCTION, Label.REDUCTION),
    (_COMPLEX, Label.COMPLEX),
):
    for _op in _names.split():
        TABLE[_op] = _label
# Softmax starts opaque (GTCO §3.3); attention patterns fuse it anyway, as GTCO's BMM+softmax sketch does.
TABLE["Softmax"] = Label.OPAQUE


def label(op_type: str, domain: str = "") -> Label:
    """The fusion pattern of an op; ops outside the default domain, and unknown ops, are opaque."""
    if domain not in ("", "ai.onnx"):
        return Label.OPAQUE
    return TABLE.get(op_type, Label.OPAQUE)
