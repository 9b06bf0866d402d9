"""The registry of binders: pattern family -> the Binder that maps its nodes onto a C++ op struct.

A family with no binder here keeps running its model-local function (the library does not register its op types).
"""

from __future__ import annotations

from onnx_gtco.plugin import bind_attention, bind_conv, bind_gemm
from onnx_gtco.plugin.bind_elementwise import ElementwiseBinder
from onnx_gtco.plugin.bind_layernorm import LayerNormBinder
from onnx_gtco.plugin.bind_softmax import SoftmaxBinder
from onnx_gtco.plugin.binding import Binder

BINDERS: dict[str, Binder] = {
    b.family: b for b in (LayerNormBinder(), SoftmaxBinder(), ElementwiseBinder(), *bind_gemm.BINDERS,
                          *bind_attention.BINDERS, *bind_conv.BINDERS)}


def binder_for(family: str) -> Binder | None:
    return BINDERS.get(family)
