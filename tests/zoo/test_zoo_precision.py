"""Acceptance on real exports: every zoo model, from both torch exporters, optimized from fp32 with `--precision fp16`
and with `--precision bf16` (onnx_gtco.precision converts it): graph inputs and outputs keep their dtypes, the file
is about half the fp32 size, every fused node has sm_80 and sm_90 device kernels but the named families without one
(the report gives the reason per node), and the model passes `check` against the fp32 original with check's
defaults for its precision, through the fused nodes' functions on the CPU EP."""

from __future__ import annotations

import pathlib

import onnx
import pytest

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.plugin.device import ARCH_SLOTS
from onnx_gtco.runtime.check import compare, default_tolerances

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

WITHOUT_KERNEL = {"conv": "no conv kernel family (the node runs its function)"}
"""Families with no device kernel yet, and the reason the report gives."""
SYMBOLIC_SHAPES = {("swin-t", "torchscript")}
"""Exports whose fused nodes keep run-time shape arithmetic (Swin's window partition computed by Shape / Gather /
Concat nodes, so head_dim, N and K are symbolic and most kernels, built per size, cannot serve them): every node
without a kernel names why, and the conversion and check hold as for the others."""


def _io(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return [(v.name, v.type.tensor_type.elem_type) for v in (*model.graph.input, *model.graph.output)]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_from_fp32(zoo_case: tuple[str, str], zoo_onnx: pathlib.Path, precision: str) -> None:
    original = onnx.load(str(zoo_onnx))
    result = optimize(original, GtcoConfig(precision=precision))
    assert _io(result.model) == _io(original)
    ratio = result.model.ByteSize() / original.ByteSize()
    assert 0.45 < ratio < 0.56, f"{zoo_case}: {ratio:.3f} of the fp32 size"

    device = result.report["device"]
    groups = result.report["groups"]
    if tuple(zoo_case) in SYMBOLIC_SHAPES:
        assert all(g["device_kernels"] == list(ARCH_SLOTS) or g["device_reason"] for g in groups)
        assert any("symbolic" in (g["device_reason"] or "") for g in groups)  # still the reason: drop it when not
        groups = []
    exceptions = [g for g in groups if g["family"] in WITHOUT_KERNEL]
    if groups:
        assert device["with_kernels"] == {arch: len(groups) - len(exceptions) for arch in ARCH_SLOTS}, device["without"]
    for g in groups:
        if g["family"] in WITHOUT_KERNEL:
            assert g["device_reason"] == WITHOUT_KERNEL[g["family"]], g
        else:
            assert g["device_kernels"] == list(ARCH_SLOTS), g

    rtol, atol, why = default_tolerances(result.model)
    assert precision in why
    diffs = compare(original, result.model, "cpu", rtol, atol)
    assert all(d.ok for d in diffs), [(d.name, d.ok) for d in diffs]
