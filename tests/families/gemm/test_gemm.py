"""The GEMM family (plugins/families/gemm/gemm.cuh, onnx_gtco/families/gemm/kernel.py): numerics through the CPU
emulation against an fp64 reference, `check`'s reasons, the launcher's argument checks, and nvcc/ptxas resources."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from kernel_helpers import nvcc_missing, ptxas_of_cases

from onnx_gtco.config import TARGETS
from onnx_gtco.families.gemm.kernel import (
    _FILL_TILE,
    ACTIVATIONS,
    FAMILY,
    MIN_KTILES_PER_SPLIT,
    gemm_problem,
    smem_bytes,
    split_workspace_bytes,
    tf32_round,
)
from onnx_gtco.kernels.emulate import EmulationError, build_emulated, run_emulated
from onnx_gtco.kernels.family import Field, Instance, Problem, from_storage, rel_error, to_storage
from onnx_gtco.patterns import find_activation
from onnx_gtco.tune.analytical import estimate_us

TOL = 2e-3           # ||y - ref|| / ||ref||, ref in fp64 from the same rounded inputs, rounded to the output dtype
RAW_TOL = {"f16": 2e-3, "bf16": 4e-3,  # against the unrounded fp64 reference (bf16 output rounding is ~1.5e-3)
           "f32": 1e-5}  # TF32: the reference multiplies the TF32-rounded operands, so only fp32 summation differs
TF32_TOL = 2e-3      # TF32 against the fp64 product of the unrounded fp32 operands (measured ~2.3e-4 at K = 64)
JOBS = 2             # parallel builds (the CI machine has 2 cores)
EMU_FLAGS = ("-O1",)  # compiles faster than -O2; the emulation's time goes to thread synchronisation anyway

# Emulated configurations: small blocks (64..256 threads), every STAGES, both BK, warp tiles 32x32 .. 64x64.
E1 = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 2}   # 4 warps, warp tile 32x32
E2 = {"BM": 128, "BN": 64, "BK": 64, "WM": 2, "WN": 2, "STAGES": 3}  # 4 warps, warp tile 64x32, BK 64
E3 = {"BM": 64, "BN": 128, "BK": 32, "WM": 1, "WN": 2, "STAGES": 4}  # 2 warps, warp tile 64x64 (128 acc/thread)
E4 = {"BM": 64, "BN": 64, "BK": 32, "WM": 1, "WN": 8, "STAGES": 3}   # 8 warps, warp tile 64x8: odd NI, .x2 B loads

# (batch, M, N, K, b_batched): ragged M (197, 40, 72), N and K not multiples of the tile, B shared by the batch
# or per batch entry. Each grid entry runs one of the two sets; every config and dtype meets M = 197.
SHAPES_A = [(1, 197, 96, 64, False), (3, 40, 24, 48, True)]
SHAPES_B = [(3, 40, 24, 48, False), (2, 72, 40, 56, True)]

# (id, config, dtype, flags): each dtype sees both B layouts and every config; epilogues vary.
GRID = [
    ("e1-f16", E1, "f16", {"trans_b": False, "bias": True, "activation": "gelu_erf", "residual": True}, SHAPES_A),
    ("e1-bf16", E1, "bf16", {"trans_b": True, "bias": True, "activation": "gelu_tanh", "residual": False}, SHAPES_B),
    ("e2-f16", E2, "f16", {"trans_b": True, "bias": True, "activation": "relu", "residual": True}, SHAPES_B),
    ("e2-bf16", E2, "bf16", {"trans_b": False, "bias": False, "activation": "none", "residual": True}, SHAPES_A),
    ("e3-f16", E3, "f16", {"trans_b": False, "bias": True, "activation": "silu", "residual": False}, SHAPES_A),
    ("e3-bf16", E3, "bf16", {"trans_b": True, "bias": True, "activation": "gelu_erf", "residual": True}, SHAPES_B),
    # f32 (TF32): A and [N, K] B through ldmatrix on 4-float rows, [K, N] B through 32-bit shared loads
    ("e1-f32", E1, "f32", {"trans_b": False, "bias": True, "activation": "gelu_erf", "residual": True}, SHAPES_A),
    ("e3-f32", E3, "f32", {"trans_b": True, "bias": True, "activation": "silu", "residual": False}, SHAPES_B),
]
ODD_NI = [
    ("e4-f16", E4, "f16", {"trans_b": True, "bias": True, "activation": "none", "residual": True}),
    ("e4-bf16", E4, "bf16", {"trans_b": False, "bias": False, "activation": "relu", "residual": False}),
    ("e4-f32", E4, "f32", {"trans_b": True, "bias": True, "activation": "none", "residual": True}),
]
OTHER_ACTS = ["quick_gelu", "sigmoid", "tanh", "relu6"]
# VEC=0 (element-wise loads): K and N that are not multiples of 8, as in attention's QKᵀ / PV with 197 tokens.
SCALAR = [
    ("sc-f16", {**E1, "STAGES": 3, "VEC": 0}, "f16", {"trans_b": True, "bias": False, "activation": "none",
                                                      "residual": False}, (2, 45, 37, 29, True)),
    ("sc-bf16", {**E1, "VEC": 0}, "bf16", {"trans_b": False, "bias": True, "activation": "relu",
                                           "residual": True}, (2, 45, 29, 37, True)),
    ("sc-f32", {**E1, "VEC": 0}, "f32", {"trans_b": False, "bias": True, "activation": "none",
                                         "residual": True}, (2, 45, 29, 37, True)),
]
FULL = {"trans_b": False, "bias": True, "activation": "gelu_erf", "residual": True}
# Split-K (SPLITK) and the staged epilogue (EPI): K long and ragged (7 k-tiles over 4 splits: 1, 2, 2, 2), M and N
# ragged, several batch entries (a counter per tile of each), and the fused output cast (fp32 y of a half GEMM).
SPLIT_SHAPES = [(2, 72, 40, 200, True), (1, 197, 96, 520, False)]
SPLIT = [
    ("sk4-f16", {**_FILL_TILE, "SPLITK": 4}, "f16", FULL),  # what configs() puts first for BERT's 128-row GEMMs
    ("sk2-es-bf16", {**E2, "SPLITK": 2, "EPI": 1}, "bf16", {"trans_b": True, "bias": True, "activation": "none",
                                                            "residual": True, "out_dtype": "f32"}),
    ("sk8-es-f32", {**E3, "SPLITK": 8, "EPI": 1}, "f32", {"trans_b": False, "bias": True, "activation": "silu",
                                                          "residual": True}),
    ("es-f16", {**E1, "EPI": 1}, "f16", FULL),
    ("es-f32", {**E4, "EPI": 1}, "f32", {"trans_b": True, "bias": False, "activation": "relu", "residual": True}),
]
# LayerScale (y = act(A @ B + bias) * gamma + residual, gamma one factor per column) in each epilogue path: straight
# from the fragments (VEC 1 and the element-wise VEC 0 with an odd N), staged through shared memory with split-K, and
# with the fused fp32 output cast.
LAYER_SCALE = [
    ("ls-f16", E1, "f16", {**FULL, "layer_scale": True}, (2, 72, 40, 56, False)),
    ("ls-sc-bf16", {**E1, "VEC": 0}, "bf16", {"trans_b": True, "bias": False, "activation": "none",
                                              "residual": True, "layer_scale": True}, (2, 45, 37, 29, True)),
    ("ls-sk-es-f32", {**E3, "SPLITK": 2, "EPI": 1}, "f32", {"trans_b": False, "bias": True, "activation": "silu",
                                                           "residual": True, "layer_scale": True},
     (1, 197, 96, 200, False)),
    ("ls-of32-f16", E2, "f16", {"trans_b": True, "bias": True, "activation": "gelu_tanh", "residual": False,
                                "layer_scale": True, "out_dtype": "f32"}, (1, 40, 24, 48, False)),
]
FAULTS = {"bias_twice": "GTCO_GEMM_TEST_FAULT=1", "wait_too_few": "GTCO_GEMM_TEST_FAULT=2"}
TF32_FAULTS = {"no_tf32_rounding": "GTCO_GEMM_TEST_FAULT=3"}


def problem(dtype: str, shape: tuple[int, int, int, int, bool], flags: dict) -> Problem:
    batch, m, n, k, b_batched = shape
    return gemm_problem(dtype, batch, m, n, k, b_batched=b_batched, **flags)


def instance(config: dict, dtype: str, flags: dict) -> Instance:
    """The sm_80 instance; its source depends on the config, dtype and flags, not on the sizes (K = 512 leaves
    every SPLITK of the space k-tiles to split)."""
    return FAMILY.instantiate(problem(dtype, (1, 64, 64, 512, False), flags), config, "sm_80")


def _all_builds() -> dict[tuple, tuple[Instance, tuple[str, ...]]]:
    builds: dict[tuple, tuple[Instance, tuple[str, ...]]] = {}
    for _, config, dtype, flags, *_ in GRID + ODD_NI:
        builds[("grid", dtype, tuple(config.items()), tuple(flags.items()))] = (instance(config, dtype, flags), ())
    for key, config, dtype, flags in SPLIT:
        builds[("split", key)] = (instance(config, dtype, flags), ())
    builds[("split", "es-f16-direct")] = (instance(E1, "f16", FULL), ())
    builds[("fault", "counters_kept")] = (instance({**E1, "SPLITK": 4}, "f16", FULL),
                                          (*EMU_FLAGS, "-DGTCO_GEMM_TEST_FAULT=4"))
    for act in OTHER_ACTS:
        flags = {**FULL, "activation": act, "residual": False}
        builds[("act", act)] = (instance(E1, "f16", flags), ())
    for key, config, dtype, flags, _ in SCALAR:
        builds[("scalar", key)] = (instance(config, dtype, flags), ())
    for key, config, dtype, flags, _ in LAYER_SCALE:
        builds[("ls", key)] = (instance(config, dtype, flags), ())
    for fault, define in FAULTS.items():
        builds[("fault", fault)] = (instance(E1, "f16", FULL), (*EMU_FLAGS, f"-D{define}"))
    for fault, define in TF32_FAULTS.items():
        builds[("fault", fault)] = (instance(E1, "f32", FULL), (*EMU_FLAGS, f"-D{define}"))
    return builds


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """Every emulated instance of this file, built once, two at a time: key -> (instance, library path)."""
    out = tmp_path_factory.mktemp("gemm_emu")
    builds = _all_builds()

    def build(item):
        key, (inst, extra) = item
        return key, inst, build_emulated(inst, out / "_".join(map(str, key[:2])), extra or EMU_FLAGS)

    with ThreadPoolExecutor(JOBS) as pool:
        return {key: (inst, lib) for key, inst, lib in pool.map(build, builds.items())}


def run(inst: Instance, lib: Path, prob: Problem, seed: int = 0, calls: int = 1
        ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Run an emulated instance on seeded inputs of `prob` (`calls` launches in one process, y refilled with NaN
    before each): (the last launch's y as float64, the inputs)."""
    inputs = FAMILY.random_inputs(prob, seed)
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    out = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"], calls=calls)
    return from_storage(out["y"], str(prob.flag("out_dtype", prob.dtype) or prob.dtype)), inputs


def assert_close(got: np.ndarray, prob: Problem, inputs: dict[str, np.ndarray]) -> None:
    ref = FAMILY.reference(prob, inputs)["y"]
    assert got.shape == ref.shape
    assert not np.isnan(got).any(), f"{np.count_nonzero(np.isnan(got))} NaN outputs (unwritten or poison read)"
    out_dtype = str(prob.flag("out_dtype", prob.dtype) or prob.dtype)
    rounded = from_storage(to_storage(ref, out_dtype), out_dtype)
    err, raw = rel_error(got, rounded), rel_error(got, ref)
    assert err < TOL and raw < RAW_TOL[out_dtype], f"{prob}: rel err {err:.3g} (rounded ref), {raw:.3g} (fp64)"


# ---------------------------------------------------------------------------------------------------------------
# Numerics in the emulation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("config", "dtype", "flags", "shapes"), [g[1:] for g in GRID], ids=[g[0] for g in GRID])
def test_grid_matches_fp64_reference(libs, config, dtype, flags, shapes):
    inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
    for i, shape in enumerate(shapes):
        prob = problem(dtype, shape, flags)
        got, inputs = run(inst, lib, prob, seed=i)
        assert_close(got, prob, inputs)


@pytest.mark.parametrize(("config", "dtype", "flags"), [g[1:] for g in ODD_NI], ids=[g[0] for g in ODD_NI])
def test_narrow_warp_tile(libs, config, dtype, flags):
    """A 64x8 warp tile loads its single B fragment with ldmatrix.x2 (.trans for [K, N] B)."""
    inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
    prob = problem(dtype, (2, 40, 24, 48, True), flags)
    got, inputs = run(inst, lib, prob, seed=7)
    assert_close(got, prob, inputs)


@pytest.mark.parametrize("act", OTHER_ACTS)
def test_other_activations(libs, act):
    inst, lib = libs[("act", act)]
    prob = problem("f16", (1, 40, 24, 48, False), {**FULL, "activation": act, "residual": False})
    got, inputs = run(inst, lib, prob, seed=8)
    assert_close(got, prob, inputs)


@pytest.mark.parametrize(("key", "config", "dtype", "flags", "shape"), SCALAR, ids=[s[0] for s in SCALAR])
def test_scalar_fallback_any_k_n(libs, key, config, dtype, flags, shape):
    inst, lib = libs[("scalar", key)]
    assert inst.name.endswith(("_sc_tb", "_sc_bias_relu_res", "_sc_bias_res"))
    prob = problem(dtype, shape, flags)
    got, inputs = run(inst, lib, prob, seed=9)
    assert_close(got, prob, inputs)


@pytest.mark.parametrize(("key", "config", "dtype", "flags"), SPLIT, ids=[s[0] for s in SPLIT])
def test_split_k_and_staged_epilogue_match_fp64_reference(libs, key, config, dtype, flags):
    """Two launches in one process: the second finds the tile counters the first left zeroed (a counter left
    behind would leave the second launch's y unwritten: NaN) and gives the same bits (a deterministic sum)."""
    inst, lib = libs[("split", key)]
    for i, shape in enumerate(SPLIT_SHAPES):
        prob = problem(dtype, shape, flags)
        got, inputs = run(inst, lib, prob, seed=20 + i, calls=2)
        assert_close(got, prob, inputs)
        once, _ = run(inst, lib, prob, seed=20 + i)
        assert np.array_equal(got, once)


@pytest.mark.parametrize(("key", "config", "dtype", "flags", "shape"), LAYER_SCALE, ids=[s[0] for s in LAYER_SCALE])
def test_layer_scale_epilogue_matches_fp64_reference(libs, key, config, dtype, flags, shape):
    """The per-column factor after the activation and before the residual, in every epilogue path; the reference
    without it is far from the kernel's answer (a kernel that dropped it would fail)."""
    inst, lib = libs[("ls", key)]
    assert "_ls" in inst.name and "HAS_SCALE=*/true" in inst.source
    prob = problem(dtype, shape, flags)
    got, inputs = run(inst, lib, prob, seed=40, calls=2 if config.get("SPLITK", 1) > 1 else 1)
    assert_close(got, prob, inputs)
    plain = dataclasses.replace(prob, flags=tuple((k, v) for k, v in prob.flags if k != "layer_scale"))
    assert rel_error(got, FAMILY.reference(plain, inputs)["y"]) > 0.1


def test_layer_scale_pointer_must_match_the_instance(libs):
    """An instance built with LayerScale refuses a call without its factors, and one without it refuses factors."""
    inst, lib = libs[("ls", "ls-f16")]
    prob = problem("f16", (1, 40, 24, 48, False), {**FULL, "layer_scale": True})
    arrays = {**FAMILY.random_inputs(prob, 0), **FAMILY.allocate_outputs(prob)}
    with pytest.raises(EmulationError, match="returned error code 1"):
        run_emulated(lib, inst.symbol, _fields_with(prob, arrays, layer_scale=""), arrays, ["y"])
    plain_inst, plain_lib = libs[("grid", "f16", tuple(E1.items()), tuple(GRID[0][3].items()))]
    plain = problem("f16", (1, 40, 24, 48, False), GRID[0][3])
    arrays = {**FAMILY.random_inputs(plain, 0), **FAMILY.allocate_outputs(plain), "layer_scale": arrays["layer_scale"]}
    with pytest.raises(EmulationError, match="returned error code 1"):
        run_emulated(plain_lib, plain_inst.symbol, _fields_with(plain, arrays, layer_scale="layer_scale"), arrays,
                     ["y"])


def test_staged_epilogue_is_bit_identical_to_the_direct_one(libs):
    staged, lib_s = libs[("split", "es-f16")]
    direct, lib_d = libs[("split", "es-f16-direct")]
    assert staged.name.endswith("_es_bias_gelu_erf_res") and "EPI_SMEM=*/true" in staged.source
    prob = problem("f16", (2, 72, 40, 200, True), FULL)
    a, _ = run(staged, lib_s, prob, seed=30)
    b, _ = run(direct, lib_d, prob, seed=30)
    assert not np.isnan(a).any() and np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# The tests can fail
# ---------------------------------------------------------------------------------------------------------------
def test_split_k_counters_left_behind_are_caught(libs):
    """A split-K instance that does not reset its tile counters: the first launch is right, the second finds
    counters past SPLITK - 1, no block of a tile counts itself last, and y stays unwritten."""
    inst, lib = libs[("fault", "counters_kept")]
    prob = problem("f16", (2, 72, 40, 200, True), FULL)
    first, inputs = run(inst, lib, prob, seed=31)
    assert_close(first, prob, inputs)
    second, _ = run(inst, lib, prob, seed=31, calls=2)
    assert np.isnan(second).all()


def test_bias_added_twice_is_caught(libs):
    inst, lib = libs[("fault", "bias_twice")]
    prob = problem("f16", (1, 40, 24, 48, False), FULL)
    got, inputs = run(inst, lib, prob, seed=10)
    ref = FAMILY.reference(prob, inputs)["y"]
    assert rel_error(got, ref) > 0.05
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(got, prob, inputs)


def test_reading_a_stage_before_its_wait_is_caught(libs):
    """One cp.async group too few in the wait: the stage is read before its copy lands, i.e. poison (NaN)."""
    inst, lib = libs[("fault", "wait_too_few")]
    prob = problem("f16", (1, 40, 24, 48, False), FULL)
    got, _ = run(inst, lib, prob, seed=11)
    assert np.isnan(got).any()


def test_wrong_activation_in_reference_is_caught(libs):
    config, dtype, flags, _ = GRID[0][1:]
    inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
    prob = problem(dtype, (1, 40, 24, 48, False), flags)
    got, inputs = run(inst, lib, prob, seed=12)
    assert_close(got, prob, inputs)
    wrong = dataclasses.replace(prob, flags=tuple((k, "relu" if k == "activation" else v) for k, v in prob.flags))
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(got, wrong, inputs)


# ---------------------------------------------------------------------------------------------------------------
# The launcher's argument checks (GTCO_EBADSHAPE = 1)
# ---------------------------------------------------------------------------------------------------------------
def _fields_with(prob: Problem, arrays, **changes) -> list[Field]:
    return [dataclasses.replace(f, value=changes.get(f.name, f.value)) for f in FAMILY.args_fields(prob, arrays)]


@pytest.mark.parametrize(("what", "changes"), [
    ("K not a multiple of 8", {"k": 44}),
    ("N not a multiple of 8", {"n": 20}),
    ("bias missing for a bias instance", {"bias": ""}),
    ("residual given to an instance without one", {}),
    ("overlapping batch entries of A", {"stride_a": 8}),
])
def test_launcher_rejects_bad_arguments(libs, what, changes):
    config, dtype, flags, _ = GRID[2][1:]  # E2 f16: bias, relu, residual
    inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
    prob = problem(dtype, (2, 40, 24, 48, False), flags)
    arrays = {**FAMILY.random_inputs(prob, 0), **FAMILY.allocate_outputs(prob)}
    if what.startswith("residual"):
        config, dtype, flags, _ = GRID[1][1:]  # E1 bf16: no residual
        inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
        prob = problem(dtype, (2, 40, 24, 48, False), flags)
        arrays = {**FAMILY.random_inputs(prob, 0), **FAMILY.allocate_outputs(prob)}
        arrays["residual"] = arrays["y"].copy()
        changes = {"residual": "residual"}
    with pytest.raises(EmulationError, match="returned error code 1"):
        run_emulated(lib, inst.symbol, _fields_with(prob, arrays, **changes), arrays, ["y"])


# ---------------------------------------------------------------------------------------------------------------
# check, configs, instantiate
# ---------------------------------------------------------------------------------------------------------------
VIT = gemm_problem("f16", 1, 197 * 8, 3072, 768, bias=True, activation="gelu_erf")


def test_check_shared_memory_depends_on_arch():
    big = {"BM": 256, "BN": 256, "BK": 64, "WM": 4, "WN": 4, "STAGES": 3}
    assert smem_bytes(big, False) > 163 * 1024
    why = FAMILY.check(VIT, big, "sm_80")
    assert why is not None and "shared memory" in why and "sm_80" in why and "163 KiB" in why
    assert FAMILY.check(VIT, big, "sm_90") is None


def test_check_rejects_warp_layout_that_does_not_divide_the_tile():
    why = FAMILY.check(VIT, {"BM": 64, "BN": 128, "BK": 32, "WM": 8, "WN": 1, "STAGES": 3}, "sm_80")
    assert why is not None and "warp layout 8x1" in why and "16x8" in why


def test_check_rejects_misaligned_k_for_cp_async_and_accepts_the_fallback():
    prob = gemm_problem("f16", 1, 197, 768, 100)
    why = FAMILY.check(prob, E1, "sm_80")
    assert why is not None and "K % 8" in why and "K=100" in why
    assert FAMILY.check(prob, {**E1, "VEC": 0}, "sm_80") is None
    with pytest.raises(ValueError, match="K % 8"):
        FAMILY.instantiate(prob, E1, "sm_80")
    # an fp32 chunk is 4 floats: K = 100 streams through cp.async, K = 102 does not
    assert FAMILY.check(gemm_problem("f32", 1, 197, 768, 100), E1, "sm_80") is None
    why = FAMILY.check(gemm_problem("f32", 1, 197, 768, 102), E1, "sm_80")
    assert why is not None and "K % 4" in why


@pytest.mark.parametrize(("config", "dtype", "words"), [
    ({"BM": 128, "BN": 128, "BK": 32, "WM": 1, "WN": 2, "STAGES": 3}, "f16", "256 fp32 accumulators"),
    ({"BM": 256, "BN": 256, "BK": 32, "WM": 8, "WN": 8, "STAGES": 2}, "f16", "2048 threads"),
    ({"BM": 128, "BN": 128, "BK": 48, "WM": 2, "WN": 2, "STAGES": 3}, "f16", "outside the space"),
    (E1, "i64", "f16, bf16 or f32"),
    ({**E1, "SPLITK": 32}, "f16", "outside the space"),
    ({**E1, "VEC": 0, "EPI": 1}, "f16", "EPI=1"),
    ({"BM": 64, "BN": 64, "BK": 32, "WM": 4, "WN": 8, "STAGES": 2, "EPI": 1}, "f16", "do not divide among 1024"),
])
def test_check_other_reasons(config, dtype, words):
    prob = dataclasses.replace(VIT, dtype=dtype)
    why = FAMILY.check(prob, config, "sm_80")
    assert why is not None and words in why


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_configs_are_valid_and_varied(arch):
    configs = FAMILY.configs(VIT, arch)
    assert len(configs) >= 6
    assert all(FAMILY.check(VIT, c, arch) is None for c in configs)
    assert {c["STAGES"] for c in configs} == {2, 3, 4}
    assert configs[0]["BM"] * configs[0]["BN"] == 128 * 128  # 13 x 24 tiles of 128x128 fill the GPU
    small = gemm_problem("f16", 1, 197, 768, 768)
    assert FAMILY.configs(small, arch)[0]["BM"] * FAMILY.configs(small, arch)[0]["BN"] < 128 * 128
    attn = gemm_problem("f16", 96, 197, 197, 64, b_batched=True, trans_b=True)
    assert all(c["VEC"] == 0 for c in FAMILY.configs(attn, arch)) and FAMILY.configs(attn, arch)


def test_check_rejects_more_splits_than_k_tiles():
    prob = gemm_problem("f16", 1, 197, 768, 96)  # 3 k-tiles of 32
    assert FAMILY.check(prob, {**E1, "SPLITK": 2}, "sm_80") is None
    why = FAMILY.check(prob, {**E1, "SPLITK": 4}, "sm_80")
    assert why is not None and "SPLITK=4" in why and "3 k-tiles" in why
    why = FAMILY.check(gemm_problem("f16", 5000, 64, 64, 512, b_batched=True), {**E1, "SPLITK": 16}, "sm_80")
    assert why is not None and "65535" in why
    # ViT-B fc1 at batch 64: 99 x 24 tiles of 128x128; 16 partial tiles each would be 2.3 GiB of workspace
    big = gemm_problem("f16", 1, 197 * 64, 3072, 768)
    cfg = {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 4, "STAGES": 3}
    assert split_workspace_bytes({**cfg, "SPLITK": 16}, 1, 197 * 64, 3072) > 2 << 30
    why = FAMILY.check(big, {**cfg, "SPLITK": 16}, "sm_80")
    assert why is not None and "workspace" in why and "64 MiB" in why
    assert FAMILY.check(gemm_problem("f16", 1, 197, 768, 3072), {**cfg, "SPLITK": 8}, "sm_80") is None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_configs_offer_64x64_warp_tiles_staged_epilogues_and_split_k_where_tiles_are_few(arch):
    warp_tiles = {(c["BM"] // c["WM"], c["BN"] // c["WN"]) for c in FAMILY.configs(VIT, arch)}
    assert (64, 64) in warp_tiles and (64, 32) in warp_tiles
    assert any(c.get("EPI") for c in FAMILY.configs(VIT, arch))
    assert not any(c.get("SPLITK", 1) > 1 for c in FAMILY.configs(VIT, arch))  # 13 x 24 tiles fill the GPU
    # ViT-B fc2 at batch 1: 2 x 12 tiles of 128x64 over 96 k-tiles; split-K comes first, one wave, >= 4 k-tiles each
    fc2 = gemm_problem("f16", 1, 197, 768, 3072, bias=True, residual=True)
    first = FAMILY.configs(fc2, arch)[0]
    tiles = math.ceil(197 / first["BM"]) * math.ceil(768 / first["BN"])
    assert first["SPLITK"] > 1 and tiles * first["SPLITK"] <= TARGETS[arch].sms
    assert math.ceil(3072 / first["BK"]) >= 4 * first["SPLITK"]
    # M = 1 also stands for a symbolic row count: never split by default
    assert not any(c.get("SPLITK", 1) > 1 for c in FAMILY.configs(gemm_problem("f16", 1, 1, 768, 3072), arch))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize(("m", "n", "k"), [(128, 768, 768), (128, 3072, 768), (128, 768, 3072), (197, 768, 768),
                                           (197, 3072, 768), (197, 768, 3072)])
def test_a_batch_one_transformer_gemm_gets_the_config_with_the_most_blocks(arch, m, n, k):
    """BERT-base (128 tokens) and ViT-B (197) at batch 1: 128x128 tiles leave most of the SMs idle, so the first
    configuration is the 64x64 tile, split over K where that still fits one wave, unless a bigger tile runs as many
    blocks; measured on an H200, 12-48 blocks of 128x64 took 13-16 us a GEMM, three times cuBLAS."""
    prob = gemm_problem("f16", 1, m, n, k, bias=True)
    sms = TARGETS[arch].sms
    configs = FAMILY.configs(prob, arch)
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)  # no configuration twice

    def blocks(c):
        return math.ceil(m / c["BM"]) * math.ceil(n / c["BN"]) * c.get("SPLITK", 1)

    first = configs[0]
    assert (first["BM"], first["BN"]) == (_FILL_TILE["BM"], _FILL_TILE["BN"]) and first["STAGES"] == 4
    tiles = math.ceil(m / 64) * math.ceil(n / 64)
    assert blocks(first) >= min(tiles, sms) and (first.get("SPLITK", 1) == 1 or blocks(first) <= sms)
    assert all(blocks(first) >= blocks(c) for c in configs if blocks(c) <= max(sms, tiles))
    assert math.ceil(k / first["BK"]) >= MIN_KTILES_PER_SPLIT * first.get("SPLITK", 1)


def test_analytical_model_prefers_split_k_on_few_tiles_and_not_on_many():
    fc2 = gemm_problem("f16", 1, 197, 768, 3072, bias=True, residual=True)
    c = {"BM": 128, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4}
    assert estimate_us(fc2, {**c, "SPLITK": 4}, "sm_80") < 0.5 * estimate_us(fc2, c, "sm_80")
    assert estimate_us(VIT, {**c, "SPLITK": 4}, "sm_80") > estimate_us(VIT, c, "sm_80")
    assert estimate_us(VIT, {**c, "EPI": 1}, "sm_80") < estimate_us(VIT, c, "sm_80")


def test_instance_name_and_source():
    prob = gemm_problem("f16", 1, 197, 768, 768, trans_b=False, bias=True, activation="gelu_erf", residual=True)
    inst = FAMILY.instantiate(prob, {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}, "sm_80")
    assert inst.name == "gemm_sm80_f16_128x128x32_w2x2_s3_bias_gelu_erf_res"
    assert inst.symbol == "gtco_" + inst.name
    assert '#include "gemm/gemm.cuh"' in inst.source and f"int {inst.symbol}(const GemmArgs* args" in inst.source
    assert inst.smem_bytes == 3 * (128 * 40 + 32 * 136) * 2
    # fp32: A rows padded by 4 floats, [K, N] B rows by 8, [N, K] B rows by 4 (GemmTile::kAPad / kBPad)
    cfg = {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}
    f32 = FAMILY.instantiate(dataclasses.replace(prob, dtype="f32"), cfg, "sm_80")
    assert f32.name == "gemm_sm80_f32_128x128x32_w2x2_s3_bias_gelu_erf_res" and "launch_gemm<float, " in f32.source
    assert f32.smem_bytes == 3 * (128 * 36 + 32 * 136) * 4
    assert smem_bytes(cfg, True, "f32") == 3 * (128 * 36 + 128 * 36) * 4
    assert set(ACTIVATIONS) == {"none", *find_activation.REFERENCE}


def test_random_inputs_are_seeded_and_nonzero():
    prob = gemm_problem("bf16", 2, 40, 24, 48, b_batched=True, trans_b=True, bias=True, residual=True)
    x, y = FAMILY.random_inputs(prob, 3), FAMILY.random_inputs(prob, 3)
    assert x.keys() == {"a", "b", "bias", "residual"}
    assert x["b"].shape == (2, 24, 48)
    for key in x:
        np.testing.assert_array_equal(x[key], y[key])
        assert np.count_nonzero(x[key]) == x[key].size
    ref = FAMILY.reference(prob, x)["y"]
    assert 0.3 < float(np.std(ref)) < 3.0


# ---------------------------------------------------------------------------------------------------------------
# nvcc / ptxas: no spills, no stack, for the default configs and ViT-B shapes
# ---------------------------------------------------------------------------------------------------------------
NVCC_PROBLEMS = {
    # ViT-B MLP fc1 (batch 8): [1576, 768] @ [768, 3072] + bias, GELU
    "vit_fc1": gemm_problem("f16", 1, 197 * 8, 3072, 768, bias=True, activation="gelu_erf"),
    # ViT-B qkv as nn.Linear ([N, K] weight), bf16
    "vit_qkv": gemm_problem("bf16", 1, 197 * 8, 2304, 768, trans_b=True, bias=True),
    # ViT-B attention proj / fc2 with the residual add
    "vit_proj": gemm_problem("f16", 1, 197 * 8, 768, 768, bias=True, residual=True),
    # attention QKᵀ (12 heads x batch 8, 197 tokens): the VEC=0 fallback
    "attn_qk": gemm_problem("f16", 96, 197, 197, 64, b_batched=True, trans_b=True),
    # the last projection of an fp16 graph with fp32 outputs: the output cast fused, fp32 residual
    "proj_of32": gemm_problem("f16", 1, 197 * 8, 768, 768, bias=True, residual=True, out_dtype="f32"),
    # fp32 (TF32): ViT-B fc1 with a [K, N] weight (32-bit shared loads of B), qkv with an [N, K] one (ldmatrix)
    "vit_fc1_f32": gemm_problem("f32", 1, 197 * 8, 3072, 768, bias=True, activation="gelu_erf"),
    "vit_qkv_f32": gemm_problem("f32", 1, 197 * 8, 2304, 768, trans_b=True, bias=True, residual=True),
    # ViT-B fc2 at batch 1 (few tiles, long K): split-K
    "vit_fc2_b1": gemm_problem("f16", 1, 197, 768, 3072, trans_b=True, bias=True, residual=True),
    "vit_fc2_b1_f32": gemm_problem("f32", 1, 197, 768, 3072, trans_b=True, bias=True, residual=True),
    # DINOv2 / CaiT fc2 with LayerScale between the bias and the residual
    "ls_fc2": gemm_problem("f16", 1, 197 * 8, 768, 3072, bias=True, layer_scale=True, residual=True),
    "ls_fc2_f32": gemm_problem("f32", 1, 197, 768, 3072, trans_b=True, bias=True, layer_scale=True, residual=True),
}


def _nvcc_cases() -> list[tuple[str, str, dict]]:
    # every configuration offered for ViT-B fc1 on sm_80 (64x32 and 64x64 warp tiles, staged epilogues), the first
    # two on sm_90 (the same code for another arch)
    cases = [("vit_fc1", "sm_80", c) for c in FAMILY.configs(NVCC_PROBLEMS["vit_fc1"], "sm_80")]
    cases += [("vit_fc1", "sm_90", c) for c in FAMILY.configs(NVCC_PROBLEMS["vit_fc1"], "sm_90")[:2]]
    for key in ("vit_qkv", "vit_proj", "attn_qk", "proj_of32", "vit_fc1_f32", "vit_qkv_f32"):
        cases += [(key, arch, c) for arch in ("sm_80", "sm_90") for c in FAMILY.configs(NVCC_PROBLEMS[key], arch)[:1]]
    # the most fp32 accumulators per thread (a 64x64 warp tile: 128) at the largest fp32 shared memory sm_80 takes
    cases.append(("vit_qkv_f32", "sm_80", {"BM": 128, "BN": 256, "BK": 32, "WM": 2, "WN": 4, "STAGES": 3, "VEC": 1}))
    # split-K's partial-sum store and reduction beside 128 accumulators, with and without the staged epilogue, and
    # the split-K configuration offered first for fc2 at batch 1
    for key in ("vit_fc2_b1_f32", "vit_fc2_b1"):
        for epi in (0, 1):
            cases.append((key, "sm_80", {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3, "VEC": 1,
                                         "SPLITK": 8, "EPI": epi}))
    cases += [("vit_fc2_b1", arch, FAMILY.configs(NVCC_PROBLEMS["vit_fc2_b1"], arch)[0]) for arch in ("sm_80", "sm_90")]
    # LayerScale: every configuration offered on sm_80, the first two on sm_90, and the 128-accumulator fp32 split-K
    # tile with the staged epilogue
    cases += [("ls_fc2", "sm_80", c) for c in FAMILY.configs(NVCC_PROBLEMS["ls_fc2"], "sm_80")]
    cases += [("ls_fc2", "sm_90", c) for c in FAMILY.configs(NVCC_PROBLEMS["ls_fc2"], "sm_90")[:2]]
    cases += [("ls_fc2_f32", arch, FAMILY.configs(NVCC_PROBLEMS["ls_fc2_f32"], arch)[0]) for arch in ("sm_80", "sm_90")]
    cases.append(("ls_fc2_f32", "sm_80", {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3, "VEC": 1,
                                          "SPLITK": 8, "EPI": 1}))
    return cases


NVCC_CASES = _nvcc_cases()


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory):
    """Compile every case (two nvcc at a time): case index -> (instance, ptxas records)."""
    out = tmp_path_factory.mktemp("gemm_nvcc")

    return ptxas_of_cases(FAMILY, NVCC_PROBLEMS, NVCC_CASES, out, JOBS)


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("case", range(len(NVCC_CASES)),
                         ids=[f"{k}-{a}-{c['BM']}x{c['BN']}x{c['BK']}w{c['WM']}x{c['WN']}s{c['STAGES']}v{c['VEC']}"
                              f"k{c.get('SPLITK', 1)}e{c.get('EPI', 0)}" for k, a, c in NVCC_CASES])
def test_ptxas_no_spills(ptxas_reports, case):
    inst, kernels = ptxas_reports[case]
    gemms = [k for k in kernels if "gemm_kernel" in k.name]
    assert len(gemms) == 1, kernels
    k = gemms[0]
    assert k.arch == inst.arch
    assert 0 < k.registers <= 255, k
    assert not k.spills and k.stack_frame_bytes == 0, k
    if inst.smem_bytes <= 48 * 1024:  # static shared memory; above 48 KiB it is dynamic and ptxas does not count it
        assert k.smem_bytes == inst.smem_bytes, (k, inst.smem_bytes)
    else:
        assert k.smem_bytes == 0, k


def test_alpha_is_a_run_time_argument(libs):
    """ONNX Gemm's alpha scales A @ B before the bias: the same instance serves any alpha (GemmArgs.alpha)."""
    _, config, dtype, flags, shapes = GRID[0]
    inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
    shape = shapes[0]
    plain = problem(dtype, shape, flags)
    scaled = problem(dtype, shape, {**flags, "alpha": 0.125})
    assert FAMILY.instantiate(scaled, config, "sm_80").source == inst.source
    got, inputs = run(inst, lib, scaled, seed=3)
    assert_close(got, scaled, inputs)
    unscaled, _ = run(inst, lib, plain, seed=3)
    assert rel_error(got, unscaled) > 0.1  # the argument really reached the epilogue


# ---------------------------------------------------------------------------------------------------------------
# f32: TF32 products, fp32 accumulation and I/O
# ---------------------------------------------------------------------------------------------------------------
def exact_f32_reference(prob: Problem, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The fp64 result of the unrounded fp32 operands: what an fp32 GEMM would compute without TF32."""
    ref = FAMILY.reference(dataclasses.replace(prob, dtype="f16"), {  # f16 reference code path: no TF32 rounding
        k: v.astype(np.float64) for k, v in inputs.items()})["y"]
    return ref


def wide_range_inputs(prob: Problem, seed: int) -> dict[str, np.ndarray]:
    """random_inputs with A scaled by 2^20 and B by 2^-20: the same products, operands far outside fp16's range
    (A overflows it, B falls into its subnormals), well inside fp32's and TF32's."""
    inputs = FAMILY.random_inputs(prob, seed)
    inputs["a"] = (inputs["a"] * np.float32(2.0**20)).astype(np.float32)
    inputs["b"] = (inputs["b"] * np.float32(2.0**-20)).astype(np.float32)
    return inputs


@pytest.mark.parametrize("key", ["e1-f32", "e3-f32"])
def test_tf32_matches_the_fp32_product(libs, key):
    """TF32 against the fp64 product of the unrounded fp32 operands: within 2e-3, and visibly not exact (the
    operands were rounded to 10 mantissa bits, not multiplied in full fp32)."""
    _, config, dtype, flags, shapes = next(g for g in GRID if g[0] == key)
    inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
    for i, shape in enumerate(shapes):
        prob = problem(dtype, shape, flags)
        got, inputs = run(inst, lib, prob, seed=20 + i)
        assert got.dtype == np.float64 and not np.isnan(got).any()
        exact = exact_f32_reference(prob, inputs)
        err_exact = rel_error(got, exact)
        err_tf32 = rel_error(got, FAMILY.reference(prob, inputs)["y"])
        assert err_exact < TF32_TOL and err_tf32 < RAW_TOL["f32"], (err_exact, err_tf32)
        assert err_exact > 2e-5, err_exact  # fp32 products would be ~1e-7 from the exact result


def test_tf32_is_not_computed_in_f16(libs):
    """Operands outside fp16's range (A ~ 2^20, B ~ 2^-20) give the same TF32 accuracy: a kernel that converted
    them to f16 would overflow (inf / NaN) or lose B to subnormals."""
    _, config, dtype, flags, shapes = next(g for g in GRID if g[0] == "e1-f32")
    inst, lib = libs[("grid", dtype, tuple(config.items()), tuple(flags.items()))]
    prob = problem(dtype, shapes[0], flags)
    inputs = wide_range_inputs(prob, 23)
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    got = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"])["y"].astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_error(got, FAMILY.reference(prob, inputs)["y"]) < RAW_TOL["f32"]
    assert rel_error(got, exact_f32_reference(prob, inputs)) < TF32_TOL
    with np.errstate(over="ignore"):
        assert not np.isfinite(inputs["a"].astype(np.float16)).all()  # the f16 path really could not hold A


def test_missing_tf32_rounding_is_caught(libs):
    """GTCO_GEMM_TEST_FAULT=3 feeds the raw fp32 bits to the mma, which reads them truncated: ~7e-4 from the TF32
    reference, so the f32 tolerance catches it."""
    inst, lib = libs[("fault", "no_tf32_rounding")]
    prob = problem("f32", (1, 40, 24, 48, False), FULL)
    got, inputs = run(inst, lib, prob, seed=24)
    assert rel_error(got, FAMILY.reference(prob, inputs)["y"]) > 1e-4
    with pytest.raises(AssertionError, match="rel err"):
        assert_close(got, prob, inputs)


def test_tf32_reference_rounds_ties_away():
    x = np.float32([1 + 2.0**-11, -(1 + 2.0**-11), 1 + 3 * 2.0**-11, 1 + 2.0**-12, np.inf, -np.inf])
    want = np.float32([1 + 2.0**-10, -(1 + 2.0**-10), 1 + 2 * 2.0**-10, 1.0, np.inf, -np.inf])
    np.testing.assert_array_equal(tf32_round(x), want)
    assert np.isnan(tf32_round(np.float32([np.nan]))).all()


@pytest.mark.parametrize(("config", "shape"), [({**E1, "STAGES": 3}, (2, 70, 40, 56, True)),
                                               ({**E1, "VEC": 0}, (1, 45, 37, 29, False))], ids=["vec", "scalar"])
def test_output_cast_to_f32(tmp_path, config, shape):
    """out_dtype f32: the epilogue writes fp32 (and reads an fp32 residual), never rounding y to fp16."""
    flags = {**FULL, "out_dtype": "f32"}
    prob = problem("f16", shape, flags)
    inst = FAMILY.instantiate(prob, config, "sm_80")
    assert inst.name.endswith("_of32") and "/*TOut=*/float" in inst.source
    lib = build_emulated(inst, tmp_path, EMU_FLAGS)
    got, inputs = run(inst, lib, prob, seed=5)
    assert inputs["residual"].dtype == np.float32
    ref = FAMILY.reference(prob, inputs)["y"]
    err = rel_error(got, ref)
    assert not np.isnan(got).any() and err < RAW_TOL["f16"], err
    # fp32 output keeps what an fp16 y would round away
    rounded = from_storage(to_storage(ref, "f16"), "f16")
    assert rel_error(got, ref) < rel_error(rounded, ref)


def test_search_space_pins_vec_and_epi_where_k_or_n_is_ragged():
    """A trial never suggests 16-byte loads or the staged epilogue that check would refuse for every shape of the
    task (attention's QKᵀ with 197 tokens); elsewhere both ways are tuned, and every space value stays in the
    family's space."""
    from onnx_gtco.tune.search import search_space
    from onnx_gtco.tune.tasks import Task

    ragged = search_space(Task(gemm_problem("f16", 96, 197, 197, 64, b_batched=True, trans_b=True), "sm_80", "v"))
    assert ragged["VEC"] == [0] and ragged["EPI"] == [0] and ragged["SPLITK"] == list(FAMILY.space["SPLITK"])
    even = search_space(Task(VIT, "sm_80", "v"))
    assert sorted(even["VEC"]) == [0, 1] and sorted(even["EPI"]) == [0, 1]
    assert set(even) == set(FAMILY.space)
