"""Layout ops on real exports: Swin-T's window partition and reverse, rolls, head split and patch merging, and
SegFormer-B0's token/map reshapes fold into elementwise groups (kernels.elementwise layouts), so few nodes stay for
ONNX Runtime to run. test_zoo_optimize.py checks that the optimized models still match the originals."""

from __future__ import annotations

import collections
import pathlib

import onnx
import pytest

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.plugin.coverage import model_coverage

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

# What each export may leave unfused at most, and which op types those are. Swin-T (dynamo): the Reshapes between a
# GEMM and the LayerNorm plus residual that both read it, the head merge (Transpose + Reshape between two GEMMs:
# a copy, as costly fused as not), the patch embedding's NCHW -> NHWC Transpose before a LayerNorm and the final
# ReduceMean. SegFormer-B0: its token <-> map Reshape + Transpose pairs sit between a Conv and a LayerNorm or GEMM
# (they fold into those kernels' loads or stores, not into an elementwise group), the decoder's Resizes and Concat.
# Swin-T (torchscript): its window shapes fold to static extents when it loads; its attention's q/k/v still come
# from a Split + Squeeze per head group (dynamo writes Slices that fold), and Mul by the scale stays beside them.
BOUNDS = {
    ("swin-t", "dynamo"): (21, {"Reshape", "Transpose", "ReduceMean"}),
    ("swin-t", "torchscript"): (61, {"Reshape", "Transpose", "Squeeze", "Split", "Mul", "ReduceMean"}),
    ("segformer-b0", "dynamo"): (73, {"Reshape", "Transpose", "Resize", "Concat"}),
    ("segformer-b0", "torchscript"): (73, {"Reshape", "Transpose", "Resize", "Concat"}),
}


@pytest.mark.parametrize("case", [pytest.param(c, id="-".join(c)) for c in BOUNDS])
def test_layout_ops_fold(case: tuple[str, str], zoo_dir: pathlib.Path) -> None:
    import export_zoo

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
