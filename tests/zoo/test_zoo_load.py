"""Loading real exports: every zoo model has static shapes, so its shape arithmetic folds away entirely (TorchScript
computes Swin's window padding and partition shapes from Shape / Gather / Mod chains; they fold through the Pads they
feed). That the loaded model computes what the export does is test_zoo_optimize's check: the rewritten model's
functions hold the loaded model's nodes, run against the export on the same inputs."""

from __future__ import annotations

import pathlib

import onnx
import pytest

from onnx_gtco.ir.load import load_model

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

SHAPE_ARITHMETIC = {"Shape", "Size", "ConstantOfShape", "Mod", "Range"}


def _static(model: onnx.ModelProto) -> bool:
    return all(d.HasField("dim_value") for v in model.graph.input for d in v.type.tensor_type.shape.dim)


def test_static_export_loads_without_shape_arithmetic(zoo_case: tuple[str, str], zoo_onnx: pathlib.Path) -> None:
    original = onnx.load(str(zoo_onnx))
    assert _static(original), f"{zoo_case}: the zoo exports have static input shapes"
    loaded = load_model(original)

    left = sorted({n.op_type for n in loaded.graph.node} & SHAPE_ARITHMETIC)
    assert not left, f"{zoo_case}: shape arithmetic survives loading: {left}"
    constants = {t.name for t in loaded.graph.initializer}
    foldable = [n.name for n in loaded.graph.node if all(not i or i in constants for i in n.input)]
    assert not foldable, f"{zoo_case}: nodes of constant inputs only survive loading: {foldable[:8]}"
