"""Binder of the RMSNorm family (op types Rmsnorm_*) for plugins/families/rmsnorm/rmsnorm_op.h: LayerNorm's
(families.layernorm.bind) on RMSNorm's roles, a, b, gamma; out y, sum (the C++ op is LayerNorm's without the mean,
`gtco::RmsNorm`)."""

from __future__ import annotations

from dataclasses import dataclass

from onnx_gtco.families.layernorm.bind import LayerNormBinder


@dataclass(frozen=True)
class RmsNormBinder(LayerNormBinder):
    family: str = "rmsnorm"
    header: str = "rmsnorm/rmsnorm_op.h"
    cpp_struct: str = "gtco::RmsNorm"


BINDERS = (RmsNormBinder(),)
