"""The fp8 GEMM (gemm.cuh FP8; onnx_gtco.fp8's Gemm_f8 nodes): A read in fp16 and rounded to E4M3 at its scale, B
K-major E4M3 bytes, both held in halves on the f16 mma, alpha carrying the scales. Numerics through the CPU
emulation against the fp64 reference of the same rounding, with a bias and activation, split-K, the staged epilogue,
LayerNorm and the fp32-output cast; the E4M3 conversions bit for bit against ml_dtypes; what `check` and the library
implementations refuse; ptxas without spills for the configurations offered at BERT-base's shapes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from kernel_helpers import assert_compiles_without_spills, nvcc_missing

from onnx_gtco.families.gemm.cublaslt import unsupported as lt_unsupported
from onnx_gtco.families.gemm.cutlass import unsupported as cutlass_unsupported
from onnx_gtco.families.gemm.kernel import FAMILY, gemm_problem
from onnx_gtco.kernels.emulate import EmulationError, build_emulated, run_emulated
from onnx_gtco.kernels.family import Field, from_storage, rel_error, to_storage
from onnx_gtco.precision import round_e4m3

TOL = 2e-3  # against the fp64 reference of the same E4M3 operands, rounded to the output dtype
EMU_FLAGS = ("-O1",)
E1 = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 2, "VEC": 1}
E2 = {"BM": 128, "BN": 64, "BK": 64, "WM": 2, "WN": 2, "STAGES": 3, "VEC": 1}

# (id, config, flags, (batch, M, N, K)): every case K-major (trans_b) with E4M3 B
CASES = [
    ("plain", E1, {}, (1, 197, 96, 64)),
    ("bias-gelu-scaled-staged-f32", {**E2, "EPI": 1},
     {"bias": True, "activation": "gelu_erf", "a_scale": 0.0625, "alpha": 0.5, "out_dtype": "f32"}, (2, 40, 128, 96)),
    ("splitk-res", {**E1, "SPLITK": 4}, {"residual": True, "a_scale": 4.0}, (1, 40, 64, 512)),
    ("layernorm", E1, {"bias": True, "residual": True, "layernorm": True}, (1, 50, 128, 96)),
]


def problem(shape: tuple[int, int, int, int], flags: dict):
    batch, m, n, k = shape
    return gemm_problem("f16", batch, m, n, k, trans_b=True, fp8=True, **flags)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_emu")

    def build(case):
        key, config, flags, shape = case
        inst = FAMILY.instantiate(problem(shape, flags), config, "sm_90")
        return key, (inst, build_emulated(inst, out / key, EMU_FLAGS))

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, CASES))


@pytest.mark.parametrize(("key", "config", "flags", "shape"), CASES, ids=[c[0] for c in CASES])
def test_fp8_gemm_matches_the_fp64_reference(libs, key, config, flags, shape):
    inst, lib = libs[key]
    prob = problem(shape, flags)
    inputs = FAMILY.random_inputs(prob, seed=5)
    assert inputs["b"].dtype == np.uint8 and inputs["b"].shape == (shape[2], shape[3])
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    outs = ["y", "ln_y"] if flags.get("layernorm") else ["y"]
    got = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, outs)
    ref = FAMILY.reference(prob, inputs)
    a = from_storage(inputs["a"], "f16").astype(np.float32)
    scale = np.float32(flags.get("a_scale", 1.0))
    b = inputs["b"].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    product = round_e4m3(a / scale).astype(np.float64) @ b.T  # the reference's product, by hand
    if flags == {}:
        np.testing.assert_allclose(ref["y"], product, rtol=1e-12, atol=1e-12)
    for name in outs:
        dt = "f32" if name == "y" and flags.get("out_dtype") == "f32" else "f16"
        out = from_storage(got[name], dt)
        assert not np.isnan(out).any(), "outputs left unwritten"
        err = rel_error(out, from_storage(to_storage(ref[name], dt), dt))
        assert err < TOL, f"{key} {name}: rel err {err:.3g}"
    # the rounding of A shows: the unrounded product is further off than the tolerance
    plain = float(flags.get("alpha", 1.0)) * (a.astype(np.float64) / scale) @ b.T
    if flags == {}:
        assert rel_error(from_storage(got["y"], "f16"), plain) > 5 * TOL


def test_the_launcher_refuses_a_missing_scale_and_ragged_k(libs):
    inst, lib = libs["plain"]
    prob = problem((1, 197, 96, 64), {})
    arrays = {**FAMILY.random_inputs(prob, 0), **FAMILY.allocate_outputs(prob)}
    run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"])
    no_scale = [Field(f.name, f.kind, 0.0) if f.name == "a_scale" else f for f in FAMILY.args_fields(prob, arrays)]
    with pytest.raises(EmulationError, match="error code 1"):
        run_emulated(lib, inst.symbol, no_scale, arrays, ["y"])


def test_check_and_the_libraries_refuse_what_the_fp8_path_does_not_take():
    assert "K-major" in (FAMILY.check(gemm_problem("f16", 1, 64, 64, 64, fp8=True), E1, "sm_90") or "")
    assert "f16" in (FAMILY.check(gemm_problem("bf16", 1, 64, 64, 64, trans_b=True, fp8=True), E1, "sm_90") or "")
    assert "16-byte" in (FAMILY.check(problem((1, 64, 64, 72), {}), {**E1, "VEC": 0}, "sm_90") or "")
    prob = problem((1, 128, 768, 768), {"bias": True})
    assert "fp8" in (lt_unsupported(prob) or "") and "fp8" in (cutlass_unsupported(prob) or "")
    assert FAMILY.configs(prob, "sm_90a") or FAMILY.configs(prob, "sm_90")


NVCC_PROBLEMS = {"qkv": problem((1, 128, 2304, 768), {"bias": True}),
                 "fc1": problem((64, 197, 3072, 768), {"bias": True, "activation": "gelu_erf"})}
NVCC_CASES = [(key, "sm_90", FAMILY.configs(prob, "sm_90")[0]) for key, prob in NVCC_PROBLEMS.items()]
"""The configuration BERT-base's and ViT-B/16's projections take first on sm_90."""


@pytest.mark.skipif(nvcc_missing(), reason="needs nvcc")
def test_offered_configurations_compile_without_spills(tmp_path):
    assert_compiles_without_spills(FAMILY, NVCC_PROBLEMS, NVCC_CASES, tmp_path)
