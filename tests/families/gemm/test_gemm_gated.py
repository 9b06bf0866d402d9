"""The gated GEMM (gemm.cuh GATED: a SwiGLU / GeGLU MLP's gate and up projections as one GEMM over interleaved
columns, y = act(gate) * up): numerics through the CPU emulation against the fp64 reference at every dtype, with a
bias, split-K and the element-wise loads of ragged sizes; what `check` refuses; the launcher's argument checks;
ptxas without spills for the configurations offered for a LLaMA-style MLP."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from kernel_helpers import assert_compiles_without_spills, nvcc_missing

from onnx_gtco.families.gemm.cublaslt import unsupported as lt_unsupported
from onnx_gtco.families.gemm.cutlass import unsupported as cutlass_unsupported
from onnx_gtco.families.gemm.kernel import FAMILY, gemm_problem
from onnx_gtco.kernels.emulate import EmulationError, build_emulated, run_emulated
from onnx_gtco.kernels.family import Field, from_storage, rel_error, to_storage

TOL = 2e-3  # against the fp64 reference rounded to the output dtype
EMU_FLAGS = ("-O1",)
E1 = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 2, "VEC": 1}
E2 = {"BM": 128, "BN": 64, "BK": 64, "WM": 2, "WN": 2, "STAGES": 3, "VEC": 1}

# (id, config, dtype, flags, (batch, M, N, K, b_batched)): N counts the interleaved gate and up columns
CASES = [
    ("silu-f16", E1, "f16", {"activation": "silu"}, (1, 197, 96, 64, False)),
    ("silu-bias-bf16", E2, "bf16", {"activation": "silu", "bias": True}, (2, 40, 128, 96, False)),
    ("gelu-f32", E1, "f32", {"activation": "gelu_erf"}, (1, 72, 64, 48, False)),
    ("gelu-tanh-tb-f16", E2, "f16", {"activation": "gelu_tanh", "trans_b": True}, (1, 64, 80, 40, False)),
    ("silu-splitk-f16", {**E1, "SPLITK": 4}, "f16", {"activation": "silu"}, (1, 40, 64, 512, False)),
    ("silu-scalar-f16", {**E1, "VEC": 0}, "f16", {"activation": "silu"}, (1, 33, 46, 30, False)),
]


def problem(dtype: str, shape: tuple[int, int, int, int, bool], flags: dict):
    batch, m, n, k, b_batched = shape
    return gemm_problem(dtype, batch, m, n, k, b_batched=b_batched, gated=True, **flags)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gated_emu")

    def build(case):
        key, config, dtype, flags, shape = case
        inst = FAMILY.instantiate(problem(dtype, shape, flags), config, "sm_80")
        return key, (inst, build_emulated(inst, out / key, EMU_FLAGS))

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, CASES))


@pytest.mark.parametrize(("key", "config", "dtype", "flags", "shape"), CASES, ids=[c[0] for c in CASES])
def test_gated_gemm_matches_the_fp64_reference(libs, key, config, dtype, flags, shape):
    inst, lib = libs[key]
    prob = problem(dtype, shape, flags)
    inputs = FAMILY.random_inputs(prob, seed=3)
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    assert arrays["y"].shape == (shape[0], shape[1], shape[2] // 2)
    got = from_storage(run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"])["y"], dtype)
    assert not np.isnan(got).any(), "outputs left unwritten"
    ref = FAMILY.reference(prob, inputs)["y"]
    if flags == {"activation": "silu"}:  # the pairs by hand: act(gate) * up of the interleaved columns
        h = from_storage(inputs["a"], dtype).astype(np.float64) @ from_storage(inputs["b"], dtype).astype(np.float64)
        gate, up = h[..., 0::2], h[..., 1::2]
        np.testing.assert_allclose(ref, gate / (1.0 + np.exp(-gate)) * up, rtol=1e-3 if dtype == "f32" else 1e-9,
                                   atol=1e-3 if dtype == "f32" else 1e-9)
    err = rel_error(got, from_storage(to_storage(ref, dtype), dtype))
    assert err < TOL, f"{key}: rel err {err:.3g}"


def test_the_launcher_refuses_an_odd_n(libs):
    """The element-wise instance takes any N but an odd one, which would split a (gate, up) pair."""
    inst, lib = libs["silu-scalar-f16"]
    prob = problem("f16", (1, 33, 46, 30, False), {"activation": "silu"})
    arrays = {**FAMILY.random_inputs(prob, 0), **FAMILY.allocate_outputs(prob)}
    run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"])  # N = 46 runs
    fields = [Field(f.name, f.kind, 45) if f.name == "n" else f for f in FAMILY.args_fields(prob, arrays)]
    with pytest.raises(EmulationError, match="error code 1"):
        run_emulated(lib, inst.symbol, fields, arrays, ["y"])


@pytest.mark.parametrize(("flags", "config", "words"), [
    ({"residual": True}, E1, "without a residual"),
    ({"layer_scale": True}, E1, "LayerScale"),
    ({}, {**E1, "EPI": 1}, "direct epilogue"),
])
def test_check_refuses_what_the_gated_epilogue_does_not_take(flags, config, words):
    prob = problem("f16", (1, 64, 128, 64, False), {"activation": "silu", **flags})
    why = FAMILY.check(prob, config, "sm_80")
    assert why is not None and words in why


def test_an_odd_n_and_the_library_implementations_are_refused():
    assert FAMILY.check(problem("f16", (1, 64, 136, 64, False), {"activation": "silu"}), E1, "sm_80") is None
    odd = problem("f16", (1, 64, 127, 64, False), {"activation": "silu"})
    assert "even" in (FAMILY.check(odd, {**E1, "VEC": 0}, "sm_80") or "")
    prob = problem("f16", (1, 128, 1024, 256, False), {"activation": "silu"})
    assert "gated" in (lt_unsupported(prob) or "") and "gated" in (cutlass_unsupported(prob) or "")
    assert FAMILY.configs(prob, "sm_90") and all(not c.get("EPI") for c in FAMILY.configs(prob, "sm_90"))


# A LLaMA-style MLP at 128 tokens: hidden 256 -> 2 x 512 interleaved, and a 4096 -> 2 x 11008 one
NVCC_PROBLEMS = {"small": problem("f16", (1, 128, 1024, 256, False), {"activation": "silu"}),
                 "wide": problem("bf16", (1, 128, 22016, 4096, False), {"activation": "silu"}),
                 "tf32": problem("f32", (1, 128, 1024, 256, False), {"activation": "gelu_erf"})}
NVCC_CASES = [(key, arch, FAMILY.configs(prob, arch)[0]) for key, prob in NVCC_PROBLEMS.items()
              for arch in ("sm_80", "sm_90")]
"""The configuration each problem's selection takes first, per arch (the GEMM's own ptxas tests cover the tiles)."""


@pytest.mark.skipif(nvcc_missing(), reason="needs nvcc")
def test_offered_configurations_compile_without_spills(tmp_path):
    assert_compiles_without_spills(FAMILY, NVCC_PROBLEMS, NVCC_CASES, tmp_path)
