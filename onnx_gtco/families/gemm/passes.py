"""The GEMM family's passes: an Einsum that is a matrix product up to permutations written as a MatMul between
Transposes and Reshapes (families/gemm/einsum.py); a Reshape between a GEMM and its activation moved after it, so that
the epilogue applies the activation (families/gemm/row_view.py); a block's Q, K and V projections packed into one
GEMM that the attention reads packed (families/gemm/pack.py; GtcoConfig.pack_qkv); a gated MLP's two projections as
one GEMM (families/gemm/gated.py; GtcoConfig.pack_gated)."""

from __future__ import annotations

from typing import Any

import onnx

from onnx_gtco.calibration import Hardware
from onnx_gtco.config import GtcoConfig
from onnx_gtco.families.gemm.einsum import einsum_matmuls
from onnx_gtco.families.gemm.gated import pack_gated
from onnx_gtco.families.gemm.pack import pack_qkv
from onnx_gtco.families.gemm.row_view import sunk_reshapes
from onnx_gtco.plan.types import GraphPass


def einsum(model: onnx.ModelProto, config: GtcoConfig,
           hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with every Einsum that is a matrix product up to permutations a MatMul between Transposes and Reshapes
    (equal up to the order of its sums); nothing to report."""
    del config, hw
    model, _ = einsum_matmuls(model)
    return model, []


def sink(model: onnx.ModelProto, config: GtcoConfig, hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with every Reshape between a GEMM's result and its activation after the activation (exact: the
    activation is elementwise); nothing to report."""
    del config, hw
    model, _ = sunk_reshapes(model)
    return model, []


def pack(model: onnx.ModelProto, config: GtcoConfig, hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with every packable Q/K/V projection group one MatMul (+ Add) and a Split; nothing to report."""
    del config, hw
    model, _ = pack_qkv(model)
    return model, []


def gate(model: onnx.ModelProto, config: GtcoConfig, hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with every gated MLP's gate and up projections one GEMM over their interleaved weights and two step-2
    Slices; nothing to report (the fused node says it: gated)."""
    del config, hw
    model, _ = pack_gated(model)
    return model, []


PASSES = (GraphPass("einsum_matmul", 0, lambda config: True, einsum,
                    "an Einsum that is a matrix product up to permutations as a MatMul, families/gemm/einsum.py"),
          GraphPass("sink_reshape", 1, lambda config: True, sink,
                    "a Reshape between a GEMM and its activation moved after it, families/gemm/row_view.py"),
          GraphPass("pack_qkv", 1, lambda config: bool(config.pack_qkv), pack,
                    "each block's Q, K and V projections as one GEMM, families/gemm/pack.py"),
          GraphPass("pack_gated", 2, lambda config: bool(config.pack_gated), gate,
                    "a gated MLP's gate and up projections as one GEMM, families/gemm/gated.py"))
"""The GEMM family's passes (GraphPass): the Einsums as MatMuls first, then the Reshape sinking and the QKV packing,
after the patchify rewrite (its GEMMs are no projections), then the gated MLPs' packing."""


__all__ = ["PASSES", "einsum", "gate", "pack", "sink"]
