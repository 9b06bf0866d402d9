"""The kernels a rewritten model selects (kernels.select) compile for sm_80 and sm_90 without spills
(kernels.compile), and a spilling or stack-using kernel is an error naming it."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from kernel_helpers import nvcc_missing

from onnx_gtco.config import GtcoConfig
from onnx_gtco.families.conv.kernel import NEEDS_SHAPES
from onnx_gtco.kernels.compile import compile_instance, compile_instances
from onnx_gtco.kernels.family import Instance, Problem
from onnx_gtco.kernels.select import (
    MMA_ONLY,
    model_instances,
    node_problem,
    problem_for,
    select_instance,
)
from onnx_gtco.kernels.toolchain import BuildError
from onnx_gtco.models import build
from onnx_gtco.opspec import decode, op_type, split_op_type
from onnx_gtco.pipeline import optimize

ARCHS = ("sm_80", "sm_90")
NEEDS_NVCC = pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")

_REWRITTEN: dict[tuple[str, str], onnx.ModelProto] = {}


def rewritten(name: str, precision: str) -> onnx.ModelProto:
    if (name, precision) not in _REWRITTEN:
        _REWRITTEN[(name, precision)] = optimize(build(name), GtcoConfig(precision=precision)).model
    return _REWRITTEN[(name, precision)]


@pytest.mark.parametrize(("op_type", "want"), [
    ("Gemm_f16", ("gemm", "f16")), ("BmmSoftmax_bf16", ("bmm_softmax", "bf16")),
    ("Layernorm_f32", ("layernorm", "f32")), ("Qkv_f32", ("qkv", "f32")),
])
def test_split_op_type(op_type, want):
    assert split_op_type(op_type) == want


@pytest.mark.parametrize(("name", "families"), [
    ("vit-b16", {"gemm", "attention", "layernorm"}),
    ("bert-base", {"gemm", "attention", "layernorm"}),
])
def test_fp16_models_select_a_kernel_for_every_tensor_core_group(name, families):
    model = rewritten(name, "fp16")
    instances, skipped = model_instances(model, ARCHS, MMA_ONLY)  # the generated kernels (cuBLASLt's fallbacks)
    assert {i.problem.family for i in instances} >= families
    assert {i.arch for i in instances} == set(ARCHS)
    # only elementwise chains (selected by their binder) and the patch-embedding conv (its Problem needs x's shape,
    # which the binder reads: families.conv.bind) have no Problem from their attributes
    assert all(r.startswith(("no elementwise", NEEDS_SHAPES)) for r in skipped.values()), skipped
    fused = [n for n in model.graph.node if n.domain == "ai.gtco"]
    assert len(skipped) < len(fused)
    names = [(i.name, i.arch) for i in instances]
    assert len(names) == len(set(names))
    assert all(i.name.startswith(f"{i.problem.family}_{i.arch.replace('_', '')}_f16") for i in instances)


def test_fp32_precision_gives_tensor_core_groups_tf32_kernels():
    model = rewritten("vit-tiny", "fp32")
    nodes = [n for n in model.graph.node if n.op_type in ("Gemm_f32", "Attention_f32")]
    assert {n.op_type for n in nodes} == {"Gemm_f32", "Attention_f32"}
    for node in nodes:
        problem = node_problem(node)
        assert isinstance(problem, Problem) and problem.dtype == "f32", problem
        inst = select_instance(problem, "sm_80", impls=MMA_ONLY)  # the generated kernel (cuBLASLt's: TF32 compute)
        assert not isinstance(inst, str) and "<float, " in inst.source
    ln = next(n for n in model.graph.node if n.op_type == "Layernorm_f32")
    problem = node_problem(ln)
    assert isinstance(problem, Problem) and problem.dtype == "f32" and problem.size("hidden") == 192


def _problem(family: str, dtype: str, attrs: dict) -> Problem | str:
    op = decode(op_type(family, dtype), attrs)
    return op if isinstance(op, str) else problem_for(op)


def test_problem_for_reasons_name_the_obstacle():
    assert "symbolic hidden" in _problem("layernorm", "f16", {"hidden": "?", "precision": "fp16"})
    assert "transposed A" in _problem("gemm", "f16", {"m": 4, "n": 8, "k": 8, "trans_a": 1})
    assert _problem("conv", "f16", {}) == NEEDS_SHAPES
    ok = _problem("gemm", "f32", {"m": 197, "n": 3072, "k": 768, "bias": 1, "activation": b"gelu_erf",
                                     "precision": b"bf16"})
    assert isinstance(ok, Problem) and ok.dtype == "bf16" and ok.flag("activation") == "gelu_erf"


@NEEDS_NVCC
@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize(("name", "precision"), [("vit-b16", "fp16"), ("bert-base", "bf16"), ("deit-s", "fp16")])
def test_builtin_model_kernels_compile_without_spills(name, precision):
    instances, _ = model_instances(rewritten(name, precision), ARCHS, MMA_ONLY)
    # the user's kernel cache, which the library builds and the zoo's kernel tests share: an entry keeps its ptxas
    # report, and a cached kernel is checked against it again (kernels.compile.check_resources)
    compiled = compile_instances(instances)  # raises on a compile error, a spill or a stack frame
    assert len(compiled) == len(instances)
    for c in compiled:
        assert c.object_path.stat().st_size > 0 and c.kernels
        for k in c.kernels:
            assert k.arch == c.instance.arch
            assert 0 < k.registers <= 255 and not k.spills and k.stack_frame_bytes == 0
        assert c.summary()["instance"] == c.instance.name
    again = compile_instances(instances[:1])
    assert again[0].cached and again[0].kernels == compiled[0].kernels


SPILLER = r"""
#include "gtco/launch.cuh"
__global__ void gtco_test_spiller(const float* x, float* y, int n) {
    float local[512];  // indexed at run time: lives on the stack
    for (int i = 0; i < 512; ++i) local[i] = x[(i * 7 + threadIdx.x) % n];
    y[threadIdx.x] = local[(threadIdx.x * 13) % n % 512];
}
"""


@NEEDS_NVCC
@pytest.mark.nvcc
def test_stack_frame_is_an_error_naming_the_instance(tmp_path):
    problem = Problem.make("softmax", "f16", {"rows": 1, "cols": 1})
    inst = Instance(name="softmax_sm80_f16_test_spiller", symbol="gtco_test_spiller", source=SPILLER,
                    problem=problem, config={"THREADS": 32}, arch="sm_80", smem_bytes=0)
    with pytest.raises(BuildError, match=r"softmax_sm80_f16_test_spiller \(THREADS=32\) for sm_80: .*stack frame"):
        compile_instance(inst, tmp_path)
    assert not list(Path(tmp_path).glob("*.o")), "a rejected kernel must not be cached"


def test_a_qkv_node_chooses_its_tiles_for_one_projection():
    """The C++ QKV op launches its instance once per projection with that projection's N, so the Problem (tiles,
    split-K, workspace) is the widest projection's, not the packed output's: BERT-base's 3 x 768 at 128 rows chose
    unsplit 128x64 tiles for N = 2304 and ran 12 blocks a launch on an H200."""
    attrs = {"m": 128, "k": 768, "ns": [768, 768, 768], "n_out": 2304, "bias": 1, "precision": "fp16"}
    qkv = _problem("qkv", "f16", attrs)
    assert isinstance(qkv, Problem) and qkv.size("N") == 768 and qkv.size("M") == 128
    gemm = _problem("gemm", "f16", {"m": 128, "k": 768, "n": 768, "bias": 1, "precision": "fp16"})
    assert select_instance(qkv, "sm_90").config == select_instance(gemm, "sm_90").config
    mma = select_instance(qkv, "sm_90", impls=MMA_ONLY)  # among the generated kernels too: 768 columns' tiles
    assert not isinstance(mma, str) and mma.config == select_instance(gemm, "sm_90", impls=MMA_ONLY).config
    assert mma.config["BM"] * mma.config["BN"] <= 64 * 64 or mma.config.get("SPLITK", 1) > 1  # more than 12 blocks
    uneven = _problem("qkv", "f16", {**attrs, "ns": [768, 256, 256], "n_out": 1280})
    assert isinstance(uneven, Problem) and uneven.size("N") == 768


@NEEDS_NVCC
@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-base"])
def test_builtin_fp32_libraries_build_only_kernels_ptxas_accepts(tmp_path, name):
    """TF32 is the register-hungry precision (fp32 operands and accumulators): a CUDA build of a full-size built-in
    model at precision fp32, BERT-base with symbolic batch and sequence and its mask, has every fused node on a
    device kernel for sm_80 and sm_90 with none spilling or using a stack frame: a configuration ptxas rejects is
    passed over for the family's next (the library's `rejected`), never built. (ViT-B/16's fp32 GEMMs are BERT-base's
    but for their rows, 197 per image against a run-time row count; `name` may be any built-in model.)"""
    from onnx_gtco.plugin.library import build_library

    model = build(name, batch="batch", seq="seq") if name == "bert-base" else build(name)
    rewritten = optimize(model, GtcoConfig(precision="fp32", target="sm_90")).model
    lib = build_library(rewritten, tmp_path, cuda=True)
    assert not lib.function_only and not lib.kernel_skips, (lib.function_only, lib.kernel_skips)
    assert {k["arch"] for k in lib.kernels} >= {"sm_80", "sm_90"}
    for k in lib.kernels:
        for r in k["kernels"]:
            assert r["spill_store_bytes"] == r["spill_load_bytes"] == r["stack_frame_bytes"] == 0, k["instance"]
    used = {k["instance"] for k in lib.kernels}
    assert not used & {key.split(" (")[0] for key in lib.rejected}
