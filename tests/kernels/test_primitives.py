"""plugins/include/gtco/primitives.cuh: numerics through the CPU emulation, resources through nvcc/ptxas."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import INCLUDES, KERNELS, nvcc_missing, run_exe

from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.toolchain import nvcc_compile

SOURCE = "mma_tile.cu"
NORM_TOL = 1e-3  # ||D - ref|| / ||ref||, ref in fp64 from the same 16-bit inputs
ELEM_TOL = 1e-5  # |D - ref| per element, relative to (|A| @ |B|): fp32 accumulation over K <= 64
DTYPES = ("f16", "bf16")


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding the nearest bfloat16 (ties to even), chosen by comparing both neighbours."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32) & np.uint32(0xFFFF0000)
    lo = bits.view(np.float32)  # truncated toward zero
    hi = (bits + np.uint32(0x10000)).view(np.float32)  # next bf16 away from zero
    d_lo = np.abs(x.astype(np.float64) - lo)
    d_hi = np.abs(hi.astype(np.float64) - x)
    odd = ((bits >> 16) & 1).astype(bool)
    return np.where((d_hi < d_lo) | ((d_hi == d_lo) & odd), hi, lo)


def quantize(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(16-bit patterns for the kernel, their values in fp64)."""
    if dtype == "f16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    b = to_bf16(x)
    return (b.view(np.uint32) >> 16).astype(np.uint16), b.astype(np.float64)


def run_gemm(exe, tmp_path, dtype: str, config: str, m: int, n: int, k: int, seed: int = 0):
    """Run the emulated gemm_tile on seeded normal inputs; returns (D, fp64 reference, |A| @ |B|)."""
    rng = np.random.default_rng(seed)
    a_bits, a = quantize(rng.standard_normal((m, k)).astype(np.float32), dtype)
    b_bits, b = quantize(rng.standard_normal((k, n)).astype(np.float32), dtype)
    (tmp_path / "a.bin").write_bytes(a_bits.tobytes())
    b_layout = b_bits.T if config.endswith("nk") else b_bits  # [N][K] or [K][N]
    (tmp_path / "b.bin").write_bytes(np.ascontiguousarray(b_layout).tobytes())
    run_exe(exe, "gemm", dtype, config, m, n, k, tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "d.bin")
    d = np.fromfile(tmp_path / "d.bin", np.float32).reshape(m, n).astype(np.float64)
    return d, a @ b, np.abs(a) @ np.abs(b)


def assert_matches(d: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> None:
    assert np.isfinite(d).all(), f"{np.count_nonzero(~np.isfinite(d))} non-finite outputs"
    rel = np.linalg.norm(d - ref) / np.linalg.norm(ref)
    worst = np.max(np.abs(d - ref) / scale)
    assert rel < NORM_TOL and worst < ELEM_TOL, f"norm ratio {rel:.3g}, worst element {worst:.3g} of |A||B|"


@pytest.fixture(scope="module")
def exe(emu_build):
    return emu_build(SOURCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("config", "m", "n", "k"), [
    ("w1", 16, 8, 16),     # one warp, one 16x8x16 mma; B [K][N] through ldmatrix.x2.trans
    ("w1nk", 16, 8, 16),   # one warp; B [N][K] through ldmatrix.x2
    ("w4", 32, 16, 16),    # 2x2 warps, one block
    ("w4nk", 32, 16, 64),  # 2x2 warps, four k-steps through the 2-stage cp.async pipeline
])
def test_tile_matches_fp64_reference(exe, tmp_path, dtype, config, m, n, k):
    assert_matches(*run_gemm(exe, tmp_path, dtype, config, m, n, k, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("config", "m", "n", "k"), [
    ("w1", 40, 24, 48),    # 3x3 blocks, rows 40..47 zero-filled
    ("w4", 40, 24, 48),    # 2x2 blocks, rows 40..63 and cols 24..31 zero-filled
    ("w4nk", 40, 24, 48),
    ("w4", 40, 24, 40),    # K % 16 != 0: the last k-step's upper half is zero-filled in A and B
    ("w1nk", 40, 24, 40),
])
def test_ragged_grid_is_masked(exe, tmp_path, dtype, config, m, n, k):
    """Edge tiles rely on cp.async zero-fill: a missing predicate would read poison (NaN) from shared memory."""
    assert_matches(*run_gemm(exe, tmp_path, dtype, config, m, n, k, seed=2))


@pytest.mark.parametrize(("permute", "config"), [(1, "w4"), (2, "w4"), (2, "w4nk"), (3, "w4nk")])
def test_wrong_fragment_mapping_is_caught(emu_build, tmp_path, permute, config):
    """Swapping two A registers, two B registers, or the row/column roles of C makes the result wrong."""
    exe = emu_build(SOURCE, f"GTCO_TEST_PERMUTE={permute}")
    d, ref, _ = run_gemm(exe, tmp_path, "f16", config, 40, 24, 48, seed=3)
    assert np.linalg.norm(d - ref) / np.linalg.norm(ref) > 0.1


def test_missing_cp_async_wait_is_caught(emu_build, tmp_path):
    """cp.async completes only at the wait that covers it, so reading the tile before waiting reads the poison."""
    exe = emu_build(SOURCE, "GTCO_TEST_NO_WAIT")
    d, _, _ = run_gemm(exe, tmp_path, "f16", "w4", 40, 24, 48, seed=4)
    assert np.isnan(d).any()


def tf32_rna(x: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest tf32 (10 mantissa bits), ties away from zero, chosen by comparing both neighbours
    (independent of the bit trick in onnx_gtco.families.gemm.kernel.tf32_round)."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    lo = (bits & np.uint32(0xFFFFE000)).view(np.float32)  # truncated toward zero
    hi = ((bits & np.uint32(0xFFFFE000)) + np.uint32(0x2000)).view(np.float32)  # next tf32 away from zero
    with np.errstate(invalid="ignore"):  # infinities and NaN: hi is NaN, lo is kept
        hi_val = np.where(np.isinf(hi), np.copysign(2.0**128, x.astype(np.float64)), hi.astype(np.float64))
        d_lo = np.abs(x.astype(np.float64) - lo)
        d_hi = np.abs(hi_val - x)
    return np.where(d_hi <= d_lo, hi, lo)


def run_tf32(exe, tmp_path, mode: str, m: int, n: int, k: int, seed: int, spread: int = 0
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the emulated tf32_tile ("round": cvt.rna operands, "raw": the fp32 bits) on standard normal A and B whose
    rows of A and columns of B are scaled by powers of two up to 2^±spread; returns (D in fp64, A, B in fp32)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)) * np.exp2(rng.integers(-spread, spread + 1, (m, 1)))
    b = rng.standard_normal((k, n)) * np.exp2(rng.integers(-spread, spread + 1, (1, n)))
    a, b = a.astype(np.float32), b.astype(np.float32)
    (tmp_path / "a.bin").write_bytes(a.tobytes())
    (tmp_path / "b.bin").write_bytes(b.tobytes())
    run_exe(exe, "tf32", mode, m, n, k, tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "d.bin")
    return np.fromfile(tmp_path / "d.bin", np.float32).reshape(m, n).astype(np.float64), a, b


def test_tf32_tile_matches_fp64_reference_of_rounded_operands(exe, tmp_path):
    """mma.m16n8k8 .tf32 on cvt.rna operands: the fp64 product of the tf32-rounded inputs up to fp32 summation; the
    rounding is visible against the unrounded product (a kernel computing in fp32 would fail that side), and the
    operands span 2^±24, far outside fp16's range (a kernel computing in f16 would overflow or flush them)."""
    d, a, b = run_tf32(exe, tmp_path, "round", 48, 24, 40, seed=7, spread=24)
    ref = tf32_rna(a).astype(np.float64) @ tf32_rna(b).astype(np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert np.max(np.abs(d - ref) / scale) < 1e-6
    rel_exact = np.linalg.norm(d - exact) / np.linalg.norm(exact)
    assert 5e-5 < rel_exact < 2e-3, rel_exact  # tf32 has 2^-11 relative rounding, fp32 2^-24, f16's error ~ tf32's
    # the same product in f16 (what a kernel silently computing in half precision gives) misses the tf32 reference
    with np.errstate(over="ignore", invalid="ignore"):
        f16 = a.astype(np.float16).astype(np.float64) @ b.astype(np.float16).astype(np.float64)
    assert not np.isfinite(f16).all() or np.max(np.abs(f16 - ref) / scale) > 1e-3


def test_tf32_mma_ignores_the_low_operand_bits(exe, tmp_path):
    """Raw fp32 bits into the tf32 mma: the emulation, like the hardware, reads 19 bits (truncation), so a kernel that
    forgets cvt.rna computes a measurably different result."""
    d, a, b = run_tf32(exe, tmp_path, "raw", 32, 16, 64, seed=8)
    trunc = [(x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64) for x in (a, b)]
    rounded = tf32_rna(a).astype(np.float64) @ tf32_rna(b).astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert np.max(np.abs(d - trunc[0] @ trunc[1]) / scale) < 1e-6
    assert np.linalg.norm(d - rounded) / np.linalg.norm(rounded) > 1e-4


@pytest.mark.parametrize("permute", [1, 2])
def test_wrong_tf32_fragment_mapping_is_caught(emu_build, tmp_path, permute):
    """Swapping a1 / a2 (rows g+8 and cols tig+4 of A) or b0 / b1 (k rows tig and tig+4) makes the result wrong."""
    exe = emu_build(SOURCE, f"GTCO_TEST_PERMUTE={permute}")
    d, a, b = run_tf32(exe, tmp_path, "round", 32, 16, 16, seed=9)
    ref = tf32_rna(a).astype(np.float64) @ tf32_rna(b).astype(np.float64)
    assert np.linalg.norm(d - ref) / np.linalg.norm(ref) > 0.1


def test_tf32_rounding_is_nearest_ties_away(exe, tmp_path):
    """round_tf32 (the emulated cvt.rna.tf32.f32) bit for bit against tf32_rna: normal and subnormal values, exact
    halfway cases of both signs, a carry into the exponent, overflow to infinity, infinities and NaN."""
    rng = np.random.default_rng(10)
    x = np.concatenate([rng.standard_normal(4000) * np.exp2(rng.integers(-140, 120, 4000)),
                        np.float32([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-45, 2.0**-130])]).astype(np.float32)
    bits = x.view(np.uint32)
    ties = ((bits & np.uint32(0xFFFFE000)) | np.uint32(0x1000)).view(np.float32)[:1000]  # exactly halfway
    carry = np.float32([1.9999999, -1.9999999, 3.4028235e38])  # all-ones mantissa: rounds up a binade (or to inf)
    x = np.concatenate([x, ties, carry, np.float32([np.inf, -np.inf, np.nan])])
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    run_exe(exe, "round_tf32", tmp_path / "x.bin", tmp_path / "out.bin")
    out = np.fromfile(tmp_path / "out.bin", np.uint32)
    nan = np.isnan(x)
    assert np.isnan(out[nan].view(np.float32)).all()
    np.testing.assert_array_equal(out[~nan], tf32_rna(x[~nan]).view(np.uint32))
    assert (out[~nan] & np.uint32(0x1FFF) == 0).all()
    assert np.isinf(out[-4:-3].view(np.float32)).all()  # 3.4028235e38 rounds to infinity
    tie_out = out[len(x) - 1006:len(x) - 6].view(np.float32)
    assert (np.abs(tie_out) > np.abs(ties)).all()  # ties away from zero


def test_warp_and_quad_reductions(exe, tmp_path):
    x = np.random.default_rng(5).standard_normal(64).astype(np.float32)
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    run_exe(exe, "reduce", tmp_path / "x.bin", tmp_path / "out.bin")
    out = np.fromfile(tmp_path / "out.bin", np.float32).reshape(64, 4)
    warps, quads = x.reshape(2, 32).astype(np.float64), x.reshape(16, 4).astype(np.float64)
    np.testing.assert_array_equal(out[:, 0], np.repeat(warps.max(1), 32))
    np.testing.assert_allclose(out[:, 1], np.repeat(warps.sum(1), 32), rtol=0, atol=1e-5 * np.abs(x).sum())
    np.testing.assert_array_equal(out[:, 2], np.repeat(quads.max(1), 4))
    np.testing.assert_allclose(out[:, 3], np.repeat(quads.sum(1), 4), rtol=0, atol=1e-6 * np.abs(x).sum())


def test_conversions_round_to_nearest_even(exe, tmp_path):
    rng = np.random.default_rng(6)
    values = [rng.standard_normal(4000) * np.exp2(rng.integers(-30, 17, 4000)),  # fp16 normal and subnormal range
              rng.standard_normal(1000) * np.exp2(rng.integers(-140, 120, 1000)),  # all of bf16's range
              np.float32([0.0, -0.0, 65504, 65519.996, 65520, 1e6, -1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26])]
    x = np.concatenate(values).astype(np.float32)
    bits = x.view(np.uint32)
    ties = ((bits & ~np.uint32(0x1FFF)) | np.uint32(0x1000)).view(np.float32)  # fp16 halfway cases
    bf_ties = ((bits & ~np.uint32(0xFFFF)) | np.uint32(0x8000)).view(np.float32)  # bf16 halfway cases
    x = np.concatenate([x, ties[:500], bf_ties[4000:4500], np.float32([np.inf, -np.inf, np.nan])])
    x = x[np.isfinite(x) | ~np.isfinite(x)]
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    run_exe(exe, "convert", tmp_path / "x.bin", tmp_path / "out.bin")
    out = np.fromfile(tmp_path / "out.bin", np.uint16).reshape(2, -1)
    with np.errstate(over="ignore"):
        f16 = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[0][~nan], f16.view(np.uint16)[~nan])
    assert np.isnan(out[0][nan].view(np.float16)).all()
    in_range = ~nan & (np.abs(x) < 3.3e38)
    expect_bf16 = (to_bf16(x[in_range]).view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(out[1][in_range], expect_bf16)
    assert np.isnan((out[1][nan].astype(np.uint32) << 16).view(np.float32)).all()


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ptxas_reports_no_spills(tmp_path, arch):
    result = nvcc_compile(KERNELS / SOURCE, tmp_path / f"mma_tile_{arch}.o", arch, include_dirs=INCLUDES,
                          timeout_s=60)
    kernels = parse_ptxas(result.stderr)
    gemms = [k for k in kernels if "gemm_tile" in k.name]
    assert len(gemms) == 8 and sum("reduce_test" in k.name for k in kernels) == 1
    assert sum("tf32_tile" in k.name for k in kernels) == 2
    for k in kernels:
        assert k.arch == arch
        assert k.registers > 0, k
        assert not k.spills and k.stack_frame_bytes == 0, k
    assert all(k.smem_bytes > 0 for k in gemms)
