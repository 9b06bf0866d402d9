"""Layout ops on real exports: Swin-T's window partition and reverse, rolls, head split and patch merging, and
SegFormer-B0's token/map reshapes fold into elementwise groups (families.elementwise.kernel layouts), so few nodes stay
for ONNX Runtime to run. test_zoo_optimize.py checks that the optimized models still match the originals."""

from __future__ import annotations

import collections
import pathlib

import onnx
import pytest
from pins import CONV_KERNELS

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.plugin.coverage import model_coverage

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

# What each export may leave unfused at most, and which op types those are. Swin-T (both exports; TorchScript's
# window shapes fold to static extents when it loads): the Reshapes between a GEMM and the LayerNorm plus residual
# that both read it, the patch embedding's NCHW -> NHWC Transpose before a LayerNorm and the final ReduceMean (every
# block's head split and merge is in its attention node, the shifted windows' too). SegFormer-B0 (both exports): the
# decoder's Resizes and their Concat. Its token <-> map Reshape + Transpose pairs between a Conv and a LayerNorm or
# GEMM run as elementwise copy nodes; where the decoder reads a stage's map back as tokens (the LayerNorm's tokens,
# Reshape, Transpose to the map, Reshape, Transpose: the identity) loading drops that chain, and its GEMM reads the
# LayerNorm's output.
BOUNDS = {
    ("swin-t", "dynamo"): (11, {"Reshape", "Transpose", "ReduceMean"}),
    ("swin-t", "torchscript"): (11, {"Reshape", "Transpose", "ReduceMean"}),
    ("segformer-b0", "dynamo"): (5, {"Resize", "Concat"}),
    ("segformer-b0", "torchscript"): (5, {"Resize", "Concat"}),
}


@pytest.mark.parametrize("case", [pytest.param(c, id="-".join(c)) for c in BOUNDS])
def test_layout_ops_fold(case: tuple[str, str], zoo_dir: pathlib.Path, calibrated) -> None:
    import export_zoo

    if case[0] == "segformer-b0":
        # its convs and the copies between them are the planner's to price: with the shipped estimate ONNX Runtime's
        # conv (the vendor GEMM's estimate, unmeasured) and its transposes (our copies' strided reads are slow on the
        # H200) win, and the layout ops stay unfused. Pinned here: our conv kernel and a gathering copy made cheap
        calibrated("sm_90", **CONV_KERNELS, elementwise={"gather_frac": 1.0})
    path = export_zoo.export(*case, zoo_dir)  # the cached export, made here when no test case asked for it
    model = optimize(onnx.load(str(path)), GtcoConfig()).model
    unfused = collections.Counter(n.op_type for n in model.graph.node if n.domain != "ai.gtco")
    most, allowed = BOUNDS[case]
    assert sum(unfused.values()) <= most, unfused
    assert set(unfused) <= allowed, unfused
    # every elementwise node the layout ops joined has its kernel (none runs its function for want of one)
    coverage = model_coverage(model)
    assert coverage.error is None, coverage.error
    elementwise = [n.name for n in model.graph.node if n.op_type.startswith("Elementwise_")]
    assert elementwise
    missing = {k: v.reason for k, v in coverage.nodes.items() if k in elementwise and not v.archs}
    assert not missing, missing


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_swin_shifted_windows_run_on_the_attention_kernel(exporter: str, zoo_dir: pathlib.Path) -> None:
    """Swin-T's 12 blocks are attention nodes with device kernels: the 7 plain windows and the 5 shifted ones, whose
    shift mask [1, nW, 1, 49, 49] is read at batch row b % nW (nW 64, 16, 4, 4, 4 in stages 1-3)."""
    import export_zoo

    path = export_zoo.export("swin-t", exporter, zoo_dir)
    model = optimize(onnx.load(str(path)), GtcoConfig()).model
    attention = {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                 for n in model.graph.node if n.op_type.startswith("Attention_")}
    assert not [n.op_type for n in model.graph.node if n.op_type.startswith(("Softmax_", "BmmSoftmax_"))]
    periods = [a.get("mask_period", 0) for a in attention.values()]
    assert len(attention) == 12 and sorted(p for p in periods if p) == [4, 4, 4, 16, 64], periods
    assert all(a["mask"] == bool(a.get("mask_period")) and a["bias"] for a in attention.values())
    coverage = model_coverage(model)
    assert coverage.error is None, coverage.error
    missing = {k: v.reason for k, v in coverage.nodes.items()
               if k in attention and set(v.archs) != {"sm_80", "sm_90", "sm_90a"}}
    assert not missing, missing
