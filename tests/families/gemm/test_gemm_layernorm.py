"""GEMM + bias + residual + LayerNorm in one kernel (gemm.cuh's LN instances, gemm_problem(..., layernorm=True)):
y and ln_y through the CPU emulation against an fp64 reference, with whole-row blocks (BN >= N) and row panels
spread over several blocks (BN < N, the last block to arrive normalizes), in place (ln_y == y) and not; the planted
faults; `check`'s reasons; the launcher's checks; and ptxas resources of every configuration `configs` offers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from kernel_helpers import nvcc_missing

from onnx_gtco.families.gemm import cublaslt, cutlass
from onnx_gtco.families.gemm.kernel import FAMILY, MAX_LN_N, gemm_problem
from onnx_gtco.kernels.emulate import EmulationError, build_emulated, run_emulated
from onnx_gtco.kernels.family import Field, Instance, Problem, from_storage, rel_error, to_storage
from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.toolchain import DEVICE_INCLUDE_DIRS, nvcc_compile
from onnx_gtco.tune.analytical import estimate_us

# max |ln_y - ref| with ref the fp64 LayerNorm of the fp64 reference y rounded to the dtype (ln_y is O(1), up to
# about 10 at the tails). ln_y is rounded to the dtype (half an ulp: 4e-3 in f16 and 3e-2 in bf16 at 8..16), and the
# kernel's y may round to the neighbouring value where the reference's does not (fp32 vs fp64 sums), which moves
# ln_y by about one ulp of y over the row's std: measured 3.5e-3 (f16), 2.5e-2 (bf16) and 1.0e-6 (TF32, whose
# reference multiplies the same TF32-rounded operands).
LN_TOL = {"f16": 1e-2, "bf16": 6e-2, "f32": 1e-4}
# ln_y against the fp64 LayerNorm of the kernel's own y (the normalize step alone): half an ulp of the value (the
# rounding of ln_y) plus the fp32 statistics' slack. Measured: at most 0.50 ulp for f16 and bf16, 8e-7 for f32.
MANTISSA = {"f16": 10, "bf16": 7, "f32": 23}
LN_SELF_SLACK = {"f16": 1e-4, "bf16": 1e-4, "f32": 1e-5}
FAULT_MIN = 0.03  # a planted fault moves ln_y by more than this (past LN_TOL of f16, the dtype of the fault builds)
TOL = 2e-3  # y: ||y - ref|| / ||ref||, ref rounded to the dtype (as in test_gemm)
EMU_FLAGS = ("-O1",)

BIAS_RES = {"trans_b": False, "bias": True, "activation": "none", "residual": True}
# Emulated configurations, each run on N from one block per row panel to several: BN 64 (N = 64 whole rows, the
# rest over 4 to 16 blocks), BN 256 (N = 64 and 200 whole rows, N = 1024 over 4 blocks) and BN 128 with TF32.
CASES = [
    ("f16-bn64", {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}, "f16", BIAS_RES),
    ("bf16-bn256-es", {"BM": 64, "BN": 256, "BK": 32, "WM": 1, "WN": 4, "STAGES": 2, "EPI": 1}, "bf16",
     {**BIAS_RES, "trans_b": True, "activation": "gelu_erf"}),
    ("f32-bn128", {"BM": 64, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}, "f32",
     {**BIAS_RES, "trans_b": True}),
    ("f16-bn128-es-ls", {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4, "EPI": 1}, "f16",
     {**BIAS_RES, "layer_scale": True}),
]
# (batch, M, N, K): M not a multiple of BM (197, 37), N from 64 to MAX_LN_N, 200 = 25 chunks of 8 halves
SHAPES = [(1, 197, 64, 64), (2, 37, 200, 48), (1, 197, 768, 64), (1, 37, 1024, 40)]
FAULTS = {"wrong_mean": 5, "residual_skipped": 6}


def problem(dtype: str, shape: tuple[int, int, int, int], flags: dict, epsilon: float = 1e-5) -> Problem:
    batch, m, n, k = shape
    return gemm_problem(dtype, batch, m, n, k, b_batched=batch > 1, layernorm=True, epsilon=epsilon, **flags)


def instance(config: dict, dtype: str, flags: dict) -> Instance:
    """The sm_80 instance (its source depends on the config, dtype and flags, not on the sizes)."""
    return FAMILY.instantiate(problem(dtype, (1, 64, 64, 64), flags), config, "sm_80")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """key -> (instance, emulated library) of this file's instances, each built on first use (parallel test workers
    build what their tests need, not every instance each)."""
    out = tmp_path_factory.mktemp("gemm_ln_emu")
    builds: dict[str, tuple[Instance, tuple[str, ...]]] = {
        key: (instance(config, dtype, flags), EMU_FLAGS) for key, config, dtype, flags in CASES}
    _, config, dtype, flags = CASES[0]
    for fault, code in FAULTS.items():
        builds[fault] = (instance(config, dtype, flags), (*EMU_FLAGS, f"-DGTCO_GEMM_TEST_FAULT={code}"))
    builds["plain"] = (FAMILY.instantiate(gemm_problem(dtype, 1, 64, 64, 64, **flags), config, "sm_80"), EMU_FLAGS)
    built: dict[str, tuple[Instance, Path]] = {}

    class Libs:
        def __getitem__(self, key: str) -> tuple[Instance, Path]:
            if key not in built:
                inst, extra = builds[key]
                built[key] = inst, build_emulated(inst, out / key, extra)
            return built[key]

    return Libs()


def fields(prob: Problem, arrays: dict[str, np.ndarray], **changes) -> list[Field]:
    return [dataclasses.replace(f, value=changes.get(f.name, f.value)) for f in FAMILY.args_fields(prob, arrays)]


def run(inst: Instance, lib: Path, prob: Problem, inputs: dict[str, np.ndarray], *, in_place: bool = False,
        calls: int = 1) -> dict[str, np.ndarray]:
    """y and ln_y (float64) of an emulated run; in place: ln_y written over y (then only "ln_y" is returned)."""
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    if in_place:
        del arrays["ln_y"]
        out = run_emulated(lib, inst.symbol, fields(prob, arrays, ln_y="y"), arrays, ["y"], calls=calls)
        return {"ln_y": from_storage(out["y"], prob.dtype)}
    out = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y", "ln_y"], calls=calls)
    return {k: from_storage(v, prob.dtype) for k, v in out.items()}


def layernorm64(y: np.ndarray, prob: Problem, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The fp64 LayerNorm of a y as stored (the kernel's own)."""
    gamma, beta = (from_storage(inputs[k], prob.dtype) for k in ("gamma", "beta"))
    mean = y.mean(-1, keepdims=True)
    return (y - mean) / np.sqrt(((y - mean) ** 2).mean(-1, keepdims=True) + float(prob.flag("epsilon"))) * gamma + beta


def ln_error(got: np.ndarray, prob: Problem, inputs: dict[str, np.ndarray]) -> float:
    """max |ln_y - ref|, ref the fp64 reference (the LayerNorm of the fp64 y rounded to the dtype)."""
    ref = FAMILY.reference(prob, inputs)["ln_y"]
    assert got.shape == ref.shape
    assert not np.isnan(got).any(), f"{np.count_nonzero(np.isnan(got))} NaN in ln_y (unwritten or poison read)"
    return float(np.abs(got - ref).max())


def assert_close(got: dict[str, np.ndarray], prob: Problem, inputs: dict[str, np.ndarray], *,
                 full: bool = True) -> float:
    """y as in test_gemm; ln_y within half an ulp (and LN_SELF_SLACK) of the fp64 LayerNorm of the kernel's own y
    (the normalize step alone), and with `full` within LN_TOL of the reference. Returns the ln_y error against the
    reference."""
    err = ln_error(got["ln_y"], prob, inputs)
    if "y" in got:
        ref = FAMILY.reference(prob, inputs)["y"]
        y_err = rel_error(got["y"], from_storage(to_storage(ref, prob.dtype), prob.dtype))
        assert not np.isnan(got["y"]).any() and y_err < TOL, f"{prob}: y rel err {y_err:.3g}"
        want = layernorm64(got["y"], prob, inputs)
        half_ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - MANTISSA[prob.dtype] - 1)
        excess = np.abs(got["ln_y"] - want) - half_ulp
        assert excess.max() < LN_SELF_SLACK[prob.dtype], (
            f"{prob}: max |ln_y - LN(y)| - ulp/2 {excess.max():.3g} (|ln_y - LN(y)| up to "
            f"{np.abs(got['ln_y'] - want).max():.3g})")
    assert not full or err < LN_TOL[prob.dtype], f"{prob}: max |ln_y - ref| {err:.3g}"
    return err


def shifted(inputs: dict[str, np.ndarray], dtype: str, by: float = 16.0) -> dict[str, np.ndarray]:
    """The residual moved by `by`: rows with a large mean, as a transformer's residual stream has."""
    res = from_storage(inputs["residual"], dtype) + by
    return {**inputs, "residual": to_storage(res.astype(np.float32), dtype)}


# ---------------------------------------------------------------------------------------------------------------
# Numerics in the emulation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "config", "dtype", "flags"), CASES, ids=[c[0] for c in CASES])
def test_gemm_layernorm_matches_fp64_reference(libs, key, config, dtype, flags):
    """Every shape, y and ln_y apart and in place (ln_y over y, bit-identical); panels spread over blocks launched
    twice (the panel counters the first launch leaves must be zero again: else no block normalizes and ln_y stays
    NaN); and rows with a large mean (the centered variance)."""
    inst, lib = libs[key]
    assert inst.name.endswith("_ln") and "/*LN=*/true" in inst.source
    errs = []
    for i, shape in enumerate(SHAPES):
        prob = problem(dtype, shape, flags)
        inputs = FAMILY.random_inputs(prob, seed=i)
        several = shape[2] > config["BN"]
        got = run(inst, lib, prob, inputs, calls=2 if several else 1)
        errs.append(assert_close(got, prob, inputs))
        in_place = run(inst, lib, prob, inputs, in_place=True, calls=2 if several else 1)
        errs.append(assert_close(in_place, prob, inputs))
        assert np.array_equal(in_place["ln_y"], got["ln_y"])
    # y near 16: one ulp of it (which the kernel's fp32 and the reference's fp64 sums may round apart) is a visible
    # step of ln_y, so ln_y is held to the LayerNorm of the kernel's own y only
    prob = problem(dtype, SHAPES[1], flags, epsilon=1e-3)
    inputs = shifted(FAMILY.random_inputs(prob, seed=9), dtype)
    assert_close(run(inst, lib, prob, inputs), prob, inputs, full=False)
    print(f"{key}: max |ln_y - ref| {max(errs):.3g}")


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_layernorm_faults_are_caught(libs, fault):
    """A mean divided by N + 1 (off by mean / (N + 1): rows with a large mean show it) and statistics that leave the
    residual out: ln_y far from the reference, whole rows in one block and panels over several."""
    inst, lib = libs[fault]
    for shape in (SHAPES[0], SHAPES[1]):
        prob = problem("f16", shape, BIAS_RES)
        inputs = shifted(FAMILY.random_inputs(prob, seed=3), "f16")
        got = run(inst, lib, prob, inputs)
        assert ln_error(got["ln_y"], prob, inputs) > FAULT_MIN
        with pytest.raises(AssertionError, match="ln_y - LN"):
            assert_close(got, prob, inputs, full=False)


def test_reference_normalizes_the_rounded_y():
    """The reference's LayerNorm reads y rounded to the dtype, as an unfused GEMM then LayerNorm does: each row of
    ln_y has mean(beta)-like statistics and the values follow from the rounded y."""
    prob = problem("bf16", (2, 5, 64, 32), BIAS_RES, epsilon=1e-3)
    inputs = FAMILY.random_inputs(prob, seed=1)
    assert set(inputs) == {"a", "b", "bias", "residual", "gamma", "beta"}
    gamma, beta = (from_storage(inputs[k], "bf16") for k in ("gamma", "beta"))
    assert 0.1 < float(np.std(gamma)) < 0.4 and abs(float(np.mean(gamma)) - 1) < 0.15
    ref = FAMILY.reference(prob, inputs)
    v = from_storage(to_storage(ref["y"], "bf16"), "bf16")
    norm = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-3)
    np.testing.assert_allclose(ref["ln_y"], norm * gamma + beta, rtol=1e-12, atol=1e-12)
    assert FAMILY.outputs(prob) == {"y": ((2, 5, 64), "bf16"), "ln_y": ((2, 5, 64), "bf16")}


# ---------------------------------------------------------------------------------------------------------------
# The launcher's argument checks (GTCO_EBADSHAPE = 1)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("what", "changes"), [
    ("gamma missing", {"ln_gamma": ""}),
    ("beta missing", {"ln_beta": ""}),
    ("ln_y missing", {"ln_y": ""}),
    ("N above MAX_LN_N", {"n": MAX_LN_N + 8}),
])
def test_launcher_rejects_bad_layernorm_arguments(libs, what, changes):
    inst, lib = libs[CASES[0][0]]
    prob = problem("f16", (1, 37, MAX_LN_N + 8, 32), CASES[0][3])
    arrays = {**FAMILY.random_inputs(prob, 0), **FAMILY.allocate_outputs(prob)}
    if "n" not in changes:
        changes = {**changes, "n": 64}
    with pytest.raises(EmulationError, match="returned error code 1"):
        run_emulated(lib, inst.symbol, fields(prob, arrays, **changes), arrays, ["y"])


def test_layernorm_arguments_to_an_instance_without_one_are_refused(libs):
    inst, lib = libs["plain"]
    prob = problem("f16", (1, 37, 64, 32), CASES[0][3])
    arrays = {**FAMILY.random_inputs(prob, 0), **FAMILY.allocate_outputs(prob)}
    with pytest.raises(EmulationError, match="returned error code 1"):
        run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"])
    plain = gemm_problem("f16", 1, 37, 64, 32, **CASES[0][3])
    assert not {"layernorm", "epsilon"} & dict(plain.flags).keys()
    arrays = {**FAMILY.random_inputs(plain, 0), **FAMILY.allocate_outputs(plain)}
    names = [f.name for f in FAMILY.args_fields(plain, arrays)]
    assert names[-5:] == ["ln_gamma", "ln_beta", "ln_y", "ln_eps", "a_scale"]
    got = run_emulated(lib, inst.symbol, FAMILY.args_fields(plain, arrays), arrays, ["y"])["y"]
    assert not np.isnan(from_storage(got, "f16")).any()


# ---------------------------------------------------------------------------------------------------------------
# check, configs, instantiate, the other implementations, the analytical model
# ---------------------------------------------------------------------------------------------------------------
POST_LN = gemm_problem("f16", 1, 197 * 8, 768, 3072, bias=True, residual=True, layernorm=True)
E = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}


@pytest.mark.parametrize(("prob", "config", "words"), [
    (POST_LN, {**E, "SPLITK": 2}, "SPLITK=2"),
    (gemm_problem("f16", 1, 197, 1032, 768, residual=True, layernorm=True), E, "N <= 1024"),
    (gemm_problem("f16", 1, 197, 768, 768, residual=True, layernorm=True, out_dtype="f32"), E, "out_dtype f32"),
    (gemm_problem("f16", 1, 197, 768, 768, residual=True, layernorm=True), {**E, "VEC": 0}, "VEC=0"),
    (gemm_problem("f16", 1, 197, 196, 768, residual=True, layernorm=True), E, "N % 8"),
])
def test_check_reasons(prob, config, words):
    why = FAMILY.check(prob, config, "sm_80")
    assert why is not None and words in why, why
    with pytest.raises(ValueError, match=words.split()[0]):
        FAMILY.instantiate(prob, config, "sm_80")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_configs_are_valid_without_split_k_and_the_model_prices_each(arch):
    fc2_b1 = gemm_problem("f16", 1, 197, 768, 3072, bias=True, residual=True, layernorm=True)
    for prob in (POST_LN, fc2_b1):
        configs = FAMILY.configs(prob, arch)
        assert len(configs) >= 6 and all(FAMILY.check(prob, c, arch) is None for c in configs)
        assert all(c.get("SPLITK", 1) == 1 for c in configs)
        times = [estimate_us(prob, c, arch) for c in configs]  # the tuner's analytical pick ranks them
        assert all(t > 0 for t in times) and len(set(times)) > 1
    assert FAMILY.configs(gemm_problem("f16", 1, 197, 2048, 768, layernorm=True), arch) == []


def test_instance_name_source_and_plain_instances_unchanged():
    cfg = {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}
    inst = FAMILY.instantiate(POST_LN, cfg, "sm_80")
    assert inst.name == "gemm_sm80_f16_128x128x32_w2x2_s3_bias_res_ln"
    assert "/*HAS_SCALE=*/false, /*LN=*/true>" in inst.source
    plain = FAMILY.instantiate(gemm_problem("f16", 1, 197 * 8, 768, 3072, bias=True, residual=True), cfg, "sm_80")
    assert "/*LN=*/" not in plain.source and "/*TOut=*/" not in plain.source  # renders as before the LN mode
    assert POST_LN.flag("epsilon") == 1e-5
    assert gemm_problem("f16", 1, 8, 64, 64, layernorm=True, epsilon=1e-6).flag("epsilon") == 1e-6


def test_cutlass_and_cublaslt_refuse_layernorm():
    for module in (cutlass, cublaslt):
        why = module.unsupported(POST_LN)
        assert why is not None and why.startswith("layernorm"), why


def test_analytical_model_counts_the_normalize_step():
    plain = gemm_problem("f16", 1, 197 * 8, 768, 3072, bias=True, residual=True)
    for cfg in ({**E, "BN": 128}, {"BM": 128, "BN": 256, "BK": 32, "WM": 2, "WN": 4, "STAGES": 3}):
        assert estimate_us(POST_LN, cfg, "sm_80") > estimate_us(plain, cfg, "sm_80")


# ---------------------------------------------------------------------------------------------------------------
# nvcc / ptxas: every configuration offered for N = 768 and 1024, each dtype and arch; one nvcc per dtype and arch
# (the instance does not depend on N, so the two N share their instances)
# ---------------------------------------------------------------------------------------------------------------
PTXAS_GROUPS = [(dtype, arch) for dtype in ("f16", "bf16", "f32") for arch in ("sm_80", "sm_90")]


def _group_instances(dtype: str, arch: str) -> list[Instance]:
    out: dict[str, Instance] = {}
    for n in (768, 1024):
        prob = gemm_problem(dtype, 1, 197 * 8, n, 3072, trans_b=True, bias=True, residual=True, layernorm=True)
        for config in FAMILY.configs(prob, arch):
            inst = FAMILY.instantiate(prob, config, arch)
            out.setdefault(inst.name, inst)
    return list(out.values())


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory):
    """report(dtype, arch) -> (instances, ptxas records): one translation unit of all the group's instances, compiled
    on first use (so that parallel test workers split the groups instead of each compiling all of them)."""
    out = tmp_path_factory.mktemp("gemm_ln_nvcc")
    cache: dict[tuple[str, str], tuple[list[Instance], list]] = {}

    def report(dtype: str, arch: str) -> tuple[list[Instance], list]:
        if (dtype, arch) not in cache:
            insts = _group_instances(dtype, arch)
            src = out / f"ln_{dtype}_{arch}.cu"
            src.write_text("\n".join(inst.source for inst in insts))
            result = nvcc_compile(src, src.with_suffix(".o"), arch, include_dirs=DEVICE_INCLUDE_DIRS, timeout_s=600)
            cache[(dtype, arch)] = insts, parse_ptxas(result.stderr)
        return cache[(dtype, arch)]

    return report


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize(("dtype", "arch"), PTXAS_GROUPS, ids=[f"{d}-{a}" for d, a in PTXAS_GROUPS])
def test_ptxas_no_spills(ptxas_reports, dtype, arch):
    insts, kernels = ptxas_reports(dtype, arch)
    gemms = [k for k in kernels if "gemm_kernel" in k.name]
    assert len(insts) >= 6 and len(gemms) == len(insts), (len(insts), kernels)
    for k in gemms:
        assert k.arch == arch and 0 < k.registers <= 255, k
        assert not k.spills and k.stack_frame_bytes == 0, k
