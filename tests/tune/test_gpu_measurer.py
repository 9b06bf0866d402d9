"""The GPU measurer: its compile step (nvcc, the ptxas report as error kinds) runs wherever nvcc is; launching,
checking and timing need a GPU with CuPy."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from onnx_gtco.families.conv.kernel import conv_problem
from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
from onnx_gtco.families.gemm.kernel import gemm_problem
from onnx_gtco.kernels.family import Problem
from onnx_gtco.tune.gpu import GpuMeasurer, gpu_available, shared_library
from onnx_gtco.tune.search import Measurement, analytical_guesses
from onnx_gtco.tune.tasks import Task, template_version

nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed to compile instances")
PROBLEM = gemm_problem("f16", 1, 197, 768, 768, bias=True, activation="gelu_erf")
CONFIG = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3, "VEC": 1}

_SPILL = """
__global__ void gtco_fake_stack(float* p, int i) {
    float a[256];
    for (int j = 0; j < 256; ++j) a[j] = p[j];
    p[0] = a[i];
}
extern "C" __attribute__((visibility("default"))) int gtco_fake(const void*, void*) { return 0; }
"""


@nvcc
def test_compile_step_gives_a_library_or_the_error_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path))
    inst = GEMM.instantiate(PROBLEM, CONFIG, "sm_90")
    lib = shared_library(inst)
    assert isinstance(lib, Path) and lib.is_file() and lib.stat().st_size > 0
    spill = replace(inst, name="fake_spill", symbol="gtco_fake", source=_SPILL)
    got = shared_library(spill)
    assert isinstance(got, Measurement) and got.error_kind == "resource" and "stack frame" in got.detail
    broken = replace(inst, name="fake_broken", source=inst.source + "\nthis is not C++;\n")
    got = shared_library(broken)
    assert isinstance(got, Measurement) and got.error_kind == "compile"


def _patchify_copy(batch: int) -> Problem:
    """ViT-B/16's patch embedding as families.conv.patchify's copy: x [N, 3, 224, 224] -> patches [N, 196, 768]."""
    from onnx import helper

    from onnx_gtco.families.elementwise.kernel import program_from_onnx

    shapes = {"s1": [batch, 3, 14, 16, 14, 16], "s2": [batch, 196, 768]}
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 4, 1, 3, 5]),
             helper.make_node("Reshape", ["b", "s2"], ["y"])]
    return program_from_onnx(nodes, {"x": [batch, 3, 224, 224]}, ["y"],
                             {k: np.array(v, np.int64) for k, v in shapes.items()}).problem("f16")


@nvcc
def test_an_elementwise_program_builds_as_a_measurer_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The elementwise family is selected by its binder, not kernels.select.FAMILIES: the measurer builds its
    programs all the same (the calibration row times the patchify copy)."""
    from onnx_gtco.tune.gpu import build_candidate, family_of

    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path))
    problem = _patchify_copy(1)
    task = Task(problem, "sm_90", template_version())
    config = family_of(problem).configs(problem, "sm_90")[0]
    built = build_candidate(task, config)
    assert built.failure is None and built.artifact is not None and Path(built.artifact.library).is_file()
    assert built.artifact.symbol.startswith("gtco_elementwise_sm90_f16_copy_n150528")


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("queued", [False, True], ids=["plain", "queued"])
def test_gpu_measurer_checks_and_times_an_elementwise_program(queued: bool) -> None:
    from onnx_gtco.tune.gpu import family_of

    m = GpuMeasurer(queued=queued)
    problem = _patchify_copy(2)
    got = m.measure(Task(problem, m.arch, template_version()), family_of(problem).configs(problem, m.arch)[0])
    assert got.error_kind is None and got.median_us and got.median_us > 0, got


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_gpu_measurer_times_checks_and_rejects_wrong_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    m = GpuMeasurer()
    task = Task(PROBLEM, m.arch, template_version())
    best = next(g for g in analytical_guesses(task) if g.get("impl", "mma") == "mma")  # the fault is in gemm.cuh
    good = m.measure(task, best)
    assert good.error_kind is None and good.median_us and good.median_us > 0 and good.runs >= 20
    assert m.environment()["gpu"] == m.device and m.environment()["driver"]
    # a kernel that adds the bias twice is a wrong answer, not a fast one
    from onnx_gtco.tune import gpu as gpu_mod

    real = gpu_mod.FAMILIES["gemm"]

    class Faulty(type(real)):  # type: ignore[misc]
        def instantiate(self, problem: Problem, config, arch: str):
            inst = real.instantiate(problem, config, arch)
            return replace(inst, name=inst.name + "_fault",
                           source="#define GTCO_GEMM_TEST_FAULT 1\n" + inst.source)

    monkeypatch.setitem(gpu_mod.FAMILIES, "gemm", Faulty())
    bad = m.measure(task, best)
    assert bad.error_kind == "wrong_answer", bad


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("problem", [
    conv_problem("f16", 2, 64, 28, 28, 128, 3, 3, stride=(2, 2), pads=(1, 1, 1, 1), batchnorm=True,
                 activation="relu"),
    conv_problem("f16", 2, 64, 28, 28, 64, 3, 3, pads=(1, 1, 1, 1), groups=64, bias=True),
], ids=["implicit_gemm_bn_relu", "depthwise_direct"])
def test_gpu_measurer_times_conv_configurations_and_rejects_wrong_answers(
        problem: Problem, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conv task's best analytical guess (an implicit-GEMM tile, or the direct kernel for the depthwise conv)
    builds, meets the fp64 reference and is timed through the family's own inputs and argument struct; a kernel
    whose window adds the padding instead of subtracting it is a wrong answer."""
    m = GpuMeasurer()
    task = Task(problem, m.arch, template_version())
    best = analytical_guesses(task)[0]
    good = m.measure(task, best)
    assert good.error_kind is None and good.median_us and good.median_us > 0 and good.runs >= 20, good
    from onnx_gtco.tune import gpu as gpu_mod

    real = gpu_mod.FAMILIES["conv"]

    class Faulty(type(real)):  # type: ignore[misc]
        def instantiate(self, problem: Problem, config, arch: str):
            inst = real.instantiate(problem, config, arch)
            return replace(inst, name=inst.name + "_fault", source="#define GTCO_CONV_TEST_FAULT 1\n" + inst.source)

    monkeypatch.setitem(gpu_mod.FAMILIES, "conv", Faulty())
    assert m.measure(task, best).error_kind == "wrong_answer"


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("problem", [
    gemm_problem("f16", 1, 197, 3072, 768, bias=True, activation="gelu_tanh"),
    gemm_problem("bf16", 4, 64, 256, 128, b_batched=True, trans_b=True, residual=True, out_dtype="f32"),
    gemm_problem("f32", 3, 50, 96, 64, bias=True, activation="relu", alpha=0.5),
], ids=["f16_bias_gelu", "bf16_batched_tb_res_of32", "f32_weight_batch_relu"])
def test_cublaslt_candidates_compute_the_reference(problem: Problem) -> None:
    m = GpuMeasurer()
    task = Task(problem, m.arch, template_version())
    got = m.measure(task, {"impl": "cublaslt", "RANK": 0})
    assert got.error_kind is None, got  # checked against the fp64 reference before it is timed
    assert got.median_us and got.median_us > 0


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_cutlass_candidates_compute_the_reference_and_a_faulty_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx_gtco.families.gemm import cutlass
    from onnx_gtco.tune import gpu as gpu_mod

    m = GpuMeasurer()
    if m.cc != 90:
        pytest.skip(f"{m.device}: the CUTLASS instances are sm_90a code, which 9.0 GPUs run")
    if isinstance(cutlass.include_dirs(), str):
        pytest.skip(str(cutlass.include_dirs()))
    task = Task(PROBLEM, m.arch, template_version())
    best = next(g for g in analytical_guesses(task) if g.get("impl") == "cutlass")  # the model's best CUTLASS guess
    good = m.measure(task, best)
    assert good.error_kind is None, good  # checked against the fp64 reference before it is timed
    assert good.median_us and good.median_us > 0 and good.runs >= 20
    real = gpu_mod.FAMILIES["gemm"]

    class Faulty(type(real)):  # type: ignore[misc]
        def instantiate(self, problem: Problem, config, arch: str):
            inst = real.instantiate(problem, config, arch)
            return replace(inst, name=inst.name + "_fault",
                           source=inst.source.replace("{{p.alpha}}", "{{2.0f * p.alpha}}"))

    monkeypatch.setitem(gpu_mod.FAMILIES, "gemm", Faulty())
    bad = m.measure(task, best)
    assert bad.error_kind == "wrong_answer", bad  # twice the product is a wrong answer, not a fast one
