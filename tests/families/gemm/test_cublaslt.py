"""The mapping of a GEMM group onto one cuBLASLt matmul (onnx_gtco.families.gemm.cublaslt): layouts, leading dimensions,
batch strides, epilogue choice and what is refused, checked against the GEMM family's reference by emulating,
on the CPU, what cuBLASLt computes from the descriptor."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest

from onnx_gtco.families.gemm import cublaslt
from onnx_gtco.families.gemm.kernel import FAMILY, gemm_problem
from onnx_gtco.kernels.family import Problem

# distinct, non-square sizes so that a swapped size or leading dimension shows
BATCH, M, N, K = 3, 5, 12, 7


def _problem(**kw: object) -> Problem:
    args = {"dtype": "f16", "batch": 1, "m": M, "n": N, "k": K} | kw
    return gemm_problem(**args)  # type: ignore[arg-type]


def test_weight_gemm_layout_is_the_transposed_product() -> None:
    d = cublaslt.describe(_problem(batch=BATCH))  # one B shared by the batch: folded into the rows
    assert isinstance(d, cublaslt.LtMatmul)
    assert (d.m, d.n, d.k) == (N, BATCH * M, K)
    assert (d.trans_a, d.trans_b) == (False, False)
    assert (d.lda, d.ldb, d.ldc) == (N, K, N)
    assert (d.batch, d.stride_a, d.stride_b, d.stride_c) == (1, 0, 0, 0)
    assert (d.operand_a, d.operand_b, d.operand_c) == ("b", "a", "")
    assert (d.a_dtype, d.c_dtype, d.compute) == ("CUDA_R_16F", "CUDA_R_16F", "CUBLAS_COMPUTE_32F")
    assert (d.epilogue, d.alpha, d.beta) == ("CUBLASLT_EPILOGUE_DEFAULT", 1.0, 0.0)


def test_transposed_b_reads_k_major_rows() -> None:
    d = cublaslt.describe(_problem(trans_b=True))
    assert isinstance(d, cublaslt.LtMatmul)
    assert d.trans_a and not d.trans_b
    assert (d.lda, d.ldb, d.ldc) == (K, K, N)


def test_batched_gemm_steps_every_operand() -> None:
    d = cublaslt.describe(_problem(batch=BATCH, b_batched=True, dtype="bf16", out_dtype="f32", alpha=0.125))
    assert isinstance(d, cublaslt.LtMatmul)
    assert (d.m, d.n, d.k, d.batch) == (N, M, K, BATCH)
    assert (d.stride_a, d.stride_b, d.stride_c) == (K * N, M * K, M * N)
    assert (d.a_dtype, d.c_dtype, d.bias_dtype) == ("CUDA_R_16BF", "CUDA_R_32F", "CUDA_R_16BF")
    assert d.alpha == 0.125


@pytest.mark.parametrize(("bias", "act", "epilogue"), [
    (False, "none", "CUBLASLT_EPILOGUE_DEFAULT"), (True, "none", "CUBLASLT_EPILOGUE_BIAS"),
    (False, "relu", "CUBLASLT_EPILOGUE_RELU"), (True, "relu", "CUBLASLT_EPILOGUE_RELU_BIAS"),
    (False, "gelu_tanh", "CUBLASLT_EPILOGUE_GELU"), (True, "gelu_tanh", "CUBLASLT_EPILOGUE_GELU_BIAS"),
])
def test_epilogue_choice(bias: bool, act: str, epilogue: str) -> None:
    d = cublaslt.describe(_problem(bias=bias, activation=act))
    assert isinstance(d, cublaslt.LtMatmul)
    assert d.epilogue == epilogue


def test_residual_goes_through_c_with_beta_one() -> None:
    d = cublaslt.describe(_problem(bias=True, residual=True))
    assert isinstance(d, cublaslt.LtMatmul)
    assert (d.operand_c, d.beta, d.epilogue) == ("residual", 1.0, "CUBLASLT_EPILOGUE_BIAS")


def test_fp32_is_tf32() -> None:
    d = cublaslt.describe(_problem(dtype="f32"))
    assert isinstance(d, cublaslt.LtMatmul)
    assert (d.a_dtype, d.compute) == ("CUDA_R_32F", "CUBLAS_COMPUTE_32F_FAST_TF32")


@pytest.mark.parametrize(("problem", "reason"), [
    (_problem(activation="gelu_erf"), "tanh form"),
    (_problem(activation="silu"), "'silu' has no cuBLASLt epilogue"),
    (_problem(activation="relu", residual=True), "act(x) + residual"),
    (Problem.make("gemm", "f16", {"batch": 1, "M": M, "N": N, "K": K}, {"layer_scale": True}),
     "layer_scale: cuBLASLt's epilogues have no per-column scale"),
    (Problem.make("gemm", "f16", {"batch": 1, "M": M, "N": N, "K": K}, {"trans_a": True}), "trans_a"),
    (Problem.make("gemm", "f16", {"batch": 1, "M": M, "N": N, "K": K}, {"head_split": 12}), "head_split"),
    (Problem.make("gemm", "f16", {"batch": 1, "M": M, "N": N, "K": K, "b_batched": 0}, {"out_dtype": "bf16"}),
     "out_dtype bf16"),
    (Problem.make("softmax", "f16", {"rows": 4, "cols": 8}), "not gemm"),
    (Problem.make("gemm", "f16", {"batch": 1, "M": M, "N": N}), "lacks size K"),
])
def test_inexpressible_groups_are_refused_with_the_reason(problem: Problem, reason: str) -> None:
    why = cublaslt.describe(problem)
    assert isinstance(why, str)
    assert reason in why
    with pytest.raises(ValueError, match=re.escape(why)):
        cublaslt.instance(problem, 0, "sm_90")


def _mappable() -> list[Problem]:
    out = []
    for dtype, trans_b, (batch, b_batched), bias, act, res, of32 in itertools.product(
            ("f16", "bf16", "f32"), (False, True), ((1, False), (BATCH, False), (BATCH, True)), (False, True),
            ("none", "relu", "gelu_tanh"), (False, True), (False, True)):
        if (res and act != "none") or (of32 and dtype == "f32"):
            continue
        out.append(gemm_problem(dtype, batch, M, N, K, b_batched=b_batched, trans_b=trans_b, bias=bias,
                                activation=act, residual=res, alpha=0.5 if bias else 1.0,
                                out_dtype="f32" if of32 else None))
    return out


@pytest.mark.parametrize("problem", _mappable(), ids=lambda p: cublaslt.instance(p, 0, "sm_80").name)
def test_descriptor_computes_the_groups_reference(problem: Problem) -> None:
    inputs = FAMILY.random_inputs(problem, seed=7)
    want = FAMILY.reference(problem, inputs)["y"]
    got = cublaslt.emulate_problem(problem, inputs)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("broken", [
    {"trans_a": False}, {"lda": N}, {"operand_a": "a", "operand_b": "b"}, {"ldb": M}, {"stride_b": M * K - 1},
])
def test_the_emulation_catches_a_wrong_descriptor(broken: dict) -> None:
    problem = _problem(batch=BATCH, b_batched=True, trans_b=True, bias=True)
    inputs = FAMILY.random_inputs(problem, seed=3)
    want = FAMILY.reference(problem, inputs)["y"]
    d = cublaslt.describe(problem)
    assert isinstance(d, cublaslt.LtMatmul)
    bad = dataclasses.replace(d, **broken)
    arr = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    try:
        got = cublaslt.emulate(bad, arr[bad.operand_a], arr[bad.operand_b], bias=arr["bias"]).reshape(want.shape)
    except (ValueError, IndexError):
        return  # a layout that does not even fit the buffers
    assert not np.allclose(got, want, atol=1e-3)


def test_instance_source_carries_the_mapping() -> None:
    p = _problem(dtype="bf16", trans_b=True, bias=True, activation="gelu_tanh", out_dtype="f32")
    inst = cublaslt.instance(p, 2, "sm_90")
    assert inst.name == "cublaslt_sm90_bf16_r2_tb_bias_gelu_tanh_of32"
    assert inst.symbol == "gtco_" + inst.name
    assert f"GTCO_EXPORT int {inst.symbol}(const GemmArgs* args, void* stream)" in inst.source
    for part in ("CUDA_R_16BF", "CUDA_R_32F", "CUBLASLT_EPILOGUE_GELU_BIAS", "/*trans_b=*/true", "/*rank=*/2"):
        assert part in inst.source
    assert inst.config == {"impl": "cublaslt", "RANK": 2}
    with pytest.raises(ValueError, match="RANK=9"):
        cublaslt.instance(p, 9, "sm_90")


def test_estimate_is_the_vendor_gemm_fitted_to_cublas() -> None:
    """A small GEMM costs cuBLAS's fixed time (its kernel's setup and tail, fitted to ORT's cuBLAS kernels on the
    H200: 3.5-5.9 us at batch 1), a big one its FLOPs at the fitted share of the Tensor Core peak."""
    from onnx_gtco.calibration import LaunchConstants, hardware
    from onnx_gtco.cost.model import VendorGemmConstants

    hw = hardware("h200")
    c, floor = hw.constants(VendorGemmConstants), hw.constants(LaunchConstants).floor_us
    small, big = _problem(m=64, n=64, k=64), _problem(m=4096, n=4096, k=4096)
    assert floor + c.extra_us < cublaslt.estimate_us(small, hw) < floor + c.extra_us + 0.1
    flops = 2.0 * 4096**3
    assert cublaslt.estimate_us(big, hw) == pytest.approx(
        flops / (hw.target.tc_tflops * 1e6 * c.mma_frac) + floor + c.extra_us)
