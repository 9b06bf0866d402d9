"""Acceptance on a real fp16 export: ViT-B/16 converted with ORT's fp16 converter (as the README says) fuses the
bias and GELU into every fc1 GEMM, as it does in fp32.

torchscript writes the GELU as Div(x, 1.4142135) -> Erf -> Add 1 -> Mul -> Mul 0.5: in fp16 the constant is
1.4140625, which a fixed fp32 tolerance (1e-5) turned away, leaving a separate elementwise kernel after every fc1.
dynamo writes the Gelu op. The test reads the exports the zoo tests leave in the zoo cache (`tools/export_zoo.py`
writes them) and skips without them; it needs no torch.
"""

from __future__ import annotations

import warnings

import export_zoo as zoo
import onnx
import pytest
from onnx import helper
from pins import FUSED_FORMS

from onnx_gtco import GtcoConfig, optimize

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

GELU_OPS = ("Erf", "Gelu")


@pytest.mark.parametrize("exporter", zoo.EXPORTERS)
def test_fp16_vit_b_fuses_gelu_into_fc1(exporter: str, calibrated) -> None:
    # the fused epilogue is what this test is about: pinned where the estimate prefers it (at batch 1 the shipped
    # H200 estimate runs fc1 on cuBLASLt and the bias + GELU as an elementwise kernel of their own)
    calibrated("sm_90", **FUSED_FORMS)
    path = zoo.onnx_path(zoo.default_out_dir(), "vit-b16", exporter)
    if not path.is_file():
        pytest.skip(f"no {path.name} in {path.parent}: export it with tools/export_zoo.py (or run the zoo tests)")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    fp32 = onnx.load(str(path))
    gelus = sum(n.op_type in GELU_OPS for n in fp32.graph.node)
    assert gelus == 12  # one per block
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp16 = convert_float_to_float16(fp32, keep_io_types=True)
    rewritten = optimize(fp16, GtcoConfig(precision="fp16")).model

    assert not [n.name for n in rewritten.graph.node if n.op_type in GELU_OPS]  # no GELU left outside a fused node
    bodies = {(f.name, f.overload): f for f in rewritten.functions}
    with_gelu = []
    for node in rewritten.graph.node:
        body = bodies.get((node.op_type, node.overload))
        if node.domain != "ai.gtco" or body is None or not any(n.op_type in GELU_OPS for n in body.node):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert node.op_type == "Gemm_f16", node.name  # the GELU is a GEMM's epilogue, not an elementwise kernel
        assert attrs["activation"] == b"gelu_erf"
        assert attrs.get("bias") == 1, node.name  # the bias Add between the GEMM and the GELU is in it too
        assert [n.op_type for n in body.node if n.op_type in ("MatMul", "Gemm")] == ["MatMul"]
        with_gelu.append(node.name)
    assert len(with_gelu) == gelus
    if exporter == "torchscript":  # its node names say which linear layer a GEMM is
        assert all("/mlp/fc1/" in name for name in with_gelu), with_gelu
