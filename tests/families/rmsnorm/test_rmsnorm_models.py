"""RMSNorm in whole models: LLaMA-style and T5-style encoders and the op forms, optimized at fp32, fp16 and bf16,
every norm inside a fused Rmsnorm node with a device kernel, and each rewritten model equal to its original through
its functions (no library), the CPU library and the emulated device kernels (build_library(emulated=True): the same
instance sources a CUDA build compiles, on the CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from cpu_session import assert_close_through_built_libraries, assert_close_through_library
from rms_models import forms_model, llama_block, simplified_model, t5_block

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.opspec import SPECS
from onnx_gtco.plugin.coverage import model_coverage

BOUND = {"fp32": 2e-3, "fp16": 5e-3, "bf16": 3e-2}
"""‖err‖/‖ref‖ against the fp32 original: fp32 is TF32 on the GEMMs and attention; bf16 keeps 8 mantissa bits."""

MODELS = {
    "llama": lambda: llama_block(layers=2),
    "llama-reciprocal": lambda: llama_block(layers=1, reciprocal=True, seed=4),
    "t5": t5_block,
    "forms": forms_model,
    "simplified": simplified_model,
}
NORMS = {"llama": 5, "llama-reciprocal": 3, "t5": 3, "forms": 3, "simplified": 1}
"""RMSNorms each model holds: every one is a fused Rmsnorm node, but for onnxruntime's own
SkipSimplifiedLayerNormalization, which the planner may leave to onnxruntime where its estimate of that kernel is
the cheaper (the report then says so)."""
ORT_OWN = "SkipSimplifiedLayerNormalization"


def _optimized(name: str, precision: str) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    original = MODELS[name]()
    result = optimize(original, GtcoConfig(precision=precision))
    return original, result.model, result.report


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_norm_is_fused_with_a_kernel_and_the_functions_compute_the_original(tmp_path: Path, name: str,
                                                                                  precision: str) -> None:
    original, rewritten, report = _optimized(name, precision)
    norms = [n for n in rewritten.graph.node if n.domain == "ai.gtco" and n.op_type.startswith("Rmsnorm_")]
    left = [n.name for n in rewritten.graph.node if n.op_type == ORT_OWN]
    assert len(norms) + len(left) == NORMS[name]
    assert all(any(c["anchor"] == n and "cheaper cover: unfused" in c["reason"] for c in report["not_chosen"])
               for n in left), report["not_chosen"]
    assert not any(n.op_type in ("Pow", "ReduceMean", "Sqrt", "RMSNormalization") for n in rewritten.graph.node)
    coverage = model_coverage(rewritten)
    assert coverage.error is None
    assert {n: c.reason for n, c in coverage.nodes.items() if not c.archs} == {}
    assert_close_through_library(original, rewritten, None, tmp_path, BOUND[precision], f"{name} {precision} functions")


LIBRARY_CASES = [("forms", "fp32"), ("forms", "fp16"), ("forms", "bf16"), ("simplified", "fp32"), ("llama", "fp16"),
                 ("t5", "bf16")]
"""The source forms at each precision (forms: RMSNormalization, SkipSimplifiedLayerNormalization and the decomposed
one, whose instances onnxruntime's SimplifiedLayerNormalization, written out by the loader, shares), and the two
encoders at one each: the kernels' numerics at every dtype are test_rmsnorm_kernel's."""


@pytest.mark.slow
@pytest.mark.parametrize(("name", "precision"), LIBRARY_CASES, ids=[f"{n}-{p}" for n, p in LIBRARY_CASES])
def test_the_cpu_library_and_the_emulated_kernels_compute_the_original(tmp_path: Path, name: str,
                                                                       precision: str) -> None:
    original, rewritten, _ = _optimized(name, precision)
    assert_close_through_built_libraries(original, rewritten, tmp_path, BOUND[precision], f"{name} {precision}",
                                         "Rmsnorm_")


def test_the_cpp_op_takes_the_specs_roles() -> None:
    """gtco::RmsNorm is LayerNorm's op without the mean: its roles are the first of LayerNorm's InRole / OutRole."""
    root = Path(__file__).resolve().parents[3] / "plugins" / "families"
    assert "struct RmsNorm : NormGlue<false>" in (root / "rmsnorm" / "rmsnorm_op.h").read_text()
    glue = (root / "layernorm" / "layernorm_op.h").read_text()
    for enum, want in (("InRole", SPECS["rmsnorm"].roles), ("OutRole", SPECS["rmsnorm"].outputs)):
        found = re.search(rf"enum {enum} \{{([^}}]*)\}}", glue[glue.index("struct NormGlue {"):])
        assert found is not None
        names = [re.sub(r"^(IN|OUT)_", "", e.split("=")[0].strip()).lower() for e in found.group(1).split(",")]
        assert tuple(names[:len(want)]) == want
