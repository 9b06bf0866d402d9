"""plugins/families/attention/attention.cuh through onnx_gtco/families/attention/kernel.py: numerics in the CPU
emulation against the fp64 reference (key rows of 49 .. 1050, head dims 32 / 64 / 80 / 96 / 128 / 256 and padded ones
such as 26 and 40, with and without mask / bias), a deliberately broken online softmax that the comparison must catch
in both families, check()'s rejections, and ptxas resources (no spills, no stack): every config configs() proposes for
the zoo's attention shapes, and the configs check() accepts closest to its register budget."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
from kernel_helpers import INCLUDES, nvcc_missing

from onnx_gtco.families.attention.kernel import (
    ACC_REG_BUDGET,
    FAMILIES,
    AttentionFamily,
    BmmSoftmaxFamily,
    band,
    band_key_tiles,
    kernel_head_dim,
    make_problem,
    output_dtype_array,
)
from onnx_gtco.kernels.emulate import build_emulated, run_emulated
from onnx_gtco.kernels.family import Instance, Problem, from_storage, rel_error, to_storage
from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.toolchain import nvcc_compile

ATTN, BMM = AttentionFamily(), BmmSoftmaxFamily()
# ‖err‖/‖ref‖. fp16: P and O are rounded to 11-bit significands, ~3e-4 each. bf16 has an 8-bit significand: rounding
# the output alone gives ‖err‖/‖ref‖ ≈ 2^-8/√3 ≈ 2.3e-3 against an fp64 reference, with P's rounding about the same
# again, so 2e-3 is out of reach for any bf16 kernel; 8e-3 still fails a missing rescale or a swapped fragment.
TOL = {"f16": 2e-3, "bf16": 8e-3}
# f32 (TF32) against the reference of the TF32-rounded q, k, v: bmm_softmax differs by fp32 arithmetic only; attention
# also rounds P to TF32 before P V (~1.5e-4 measured), which the reference does not.
TOL_TF32 = {"attention": 4e-4, "bmm_softmax": 1e-5}
TOL_F32_EXACT = 2e-3  # f32 (TF32) against the fp64 reference of the unrounded fp32 inputs


def cfg(bq: int, bkv: int, warps: int, stages: int) -> dict[str, int]:
    return {"BQ": bq, "BKV": bkv, "WARPS": warps, "STAGES": stages}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """run(family, problem, config, inputs=None, prefix="") -> (outputs, reference, inputs) via the emulation."""
    out_dir = tmp_path_factory.mktemp("attn_emu")

    def run(family, problem: Problem, config, inputs=None, prefix: str = ""):
        inst = family.instantiate(problem, config, "sm_90")
        if prefix:
            inst = dataclasses.replace(inst, source=prefix + inst.source)
        lib = build_emulated(inst, out_dir, extra=("-O1",))
        inputs = family.random_inputs(problem, seed=7) if inputs is None else inputs
        arrays = dict(inputs)
        for name, (shape, dtype) in family.outputs(problem).items():
            arrays[name] = output_dtype_array(shape, dtype)  # NaN: an element the kernel never writes shows
        out = run_emulated(lib, inst.symbol, family.args_fields(problem, arrays), arrays, list(family.outputs(problem)))
        got = {k: from_storage(v, problem.dtype) for k, v in out.items()}
        return got, family.reference(problem, inputs), inputs

    run.out_dir = out_dir  # type: ignore[attr-defined]
    return run


def assert_close(got: dict, ref: dict, dtype: str) -> None:
    for name, want in ref.items():
        assert got[name].shape == want.shape
        assert not np.isnan(got[name]).any(), f"{name}: {np.count_nonzero(np.isnan(got[name]))} NaN outputs"
        err = rel_error(got[name], want)
        assert err < TOL[dtype], f"{name}: ‖err‖/‖ref‖ = {err:.3g} (tolerance {TOL[dtype]:g})"


SWIN = {"mask_shape": (2, 1, 49, 49)}  # [nW, 1, N, N] window mask over batch = B_ x nW
# Swin's shifted windows as the optimizer binds them: 2 images x 4 windows, rel-pos bias [1, H, N, N], the shift
# mask [nW, 1, N, N] read at batch row b % nW
SHIFTED = dict(batch=8, heads=2, seq_q=16, head_dim=32, mask=True, bias=True, mask_shape=(4, 1, 16, 16))
ATTENTION_CASES = [
    # dtype, config, problem
    ("f16", cfg(64, 32, 4, 2), dict(batch=1, heads=2, seq_q=77, head_dim=64, mask=True)),
    ("bf16", cfg(64, 64, 4, 3), dict(batch=1, heads=2, seq_q=197, head_dim=32, bias=True, q_layout="bshd_merged",
                                     k_layout="bshd_merged", v_layout="bshd_merged", out_layout="bshd_merged")),
    ("f16", cfg(128, 32, 8, 2), dict(batch=2, heads=1, seq_q=49, head_dim=80, mask=True, bias=True, **SWIN,
                                     q_layout="qkv_packed", k_layout="qkv_packed", v_layout="qkv_packed",
                                     out_layout="bshd_merged")),
    ("bf16", cfg(64, 32, 4, 3), dict(batch=1, heads=2, seq_q=77, head_dim=128, mask=True, k_layout="bhds")),
    ("f16", cfg(64, 32, 4, 2), SHIFTED),
    ("f16", cfg(128, 64, 4, 2), dict(batch=1, heads=3, seq_q=49, seq_k=197, head_dim=32, q_layout="bshd",
                                     k_layout="bshd", v_layout="bshd", out_layout="bshd")),
    ("bf16", cfg(64, 128, 4, 2), dict(batch=3, heads=1, seq_q=77, head_dim=64, mask=True, bias=True,
                                      k_layout="bhds", out_layout="bshd")),
    # long key rows, not multiples of the key tile (few queries keep the emulation quick)
    ("f16", cfg(64, 32, 4, 2), dict(batch=1, heads=1, seq_q=64, seq_k=197, head_dim=128)),
    ("f16", cfg(64, 64, 4, 2), dict(batch=1, heads=1, seq_q=40, seq_k=257, head_dim=80, mask=True)),
    ("f16", cfg(64, 128, 4, 3), dict(batch=1, heads=1, seq_q=33, seq_k=577, head_dim=64)),
    ("f16", cfg(128, 64, 8, 2), dict(batch=1, heads=1, seq_q=70, seq_k=1050, head_dim=32, mask=True)),
    ("bf16", cfg(64, 64, 4, 3), dict(batch=1, heads=1, seq_q=20, seq_k=1050, head_dim=128, mask=True, bias=True,
                                     k_layout="bhds")),
    # head dims 96 and 256 (256 on its one tile), and padded ones: 26 and 40 run as 32 and 64, their rows read and
    # written element by element (26 halves are no 16-byte multiple), dims past head_dim zero in shared memory
    ("f16", cfg(64, 64, 4, 2), dict(batch=1, heads=2, seq_q=40, seq_k=77, head_dim=96, mask=True, bias=True,
                                    k_layout="bhds")),
    ("bf16", cfg(128, 32, 8, 3), dict(batch=2, heads=1, seq_q=50, head_dim=96, q_layout="bshd_merged",
                                      k_layout="bshd_merged", v_layout="bshd_merged", out_layout="bshd_merged")),
    ("f16", cfg(64, 32, 4, 2), dict(batch=1, heads=1, seq_q=33, seq_k=70, head_dim=256, mask=True, q_layout="bshd",
                                    k_layout="bshd", v_layout="bshd", out_layout="bshd")),
    ("bf16", cfg(64, 32, 4, 3), dict(batch=1, heads=2, seq_q=20, seq_k=45, head_dim=256, bias=True, k_layout="bhds")),
    ("f16", cfg(64, 32, 4, 2), dict(batch=1, heads=3, seq_q=37, seq_k=45, head_dim=26, mask=True,
                                    q_layout="bshd_merged", k_layout="bshd_merged", v_layout="bshd_merged",
                                    out_layout="bshd_merged")),
    ("f16", cfg(64, 64, 4, 2), dict(batch=1, heads=2, seq_q=29, head_dim=26, q_layout="qkv_packed",
                                    k_layout="qkv_packed", v_layout="qkv_packed", out_layout="bshd")),
    ("bf16", cfg(64, 32, 4, 2), dict(batch=2, heads=3, seq_q=30, seq_k=41, head_dim=40, mask=True, bias=True,
                                     k_layout="bhds")),
]

BMM_CASES = [
    ("f16", cfg(64, 32, 4, 2), dict(batch=1, heads=2, seq_q=77, head_dim=64, mask=True, k_layout="bhds")),
    ("bf16", cfg(128, 64, 8, 3), dict(batch=1, heads=2, seq_q=197, head_dim=32, bias=True)),
    ("f16", cfg(64, 64, 4, 2), dict(batch=2, heads=1, seq_q=49, head_dim=80, mask=True, bias=True, **SWIN,
                                    q_layout="qkv_packed", k_layout="qkv_packed")),
    ("bf16", cfg(64, 32, 4, 3), dict(batch=1, heads=2, seq_q=128, head_dim=128, mask=True,
                                     q_layout="bshd_merged", k_layout="bshd_merged")),
    # long key rows (SETR 577, DETR 1050), not multiples of the key tile
    ("f16", cfg(64, 128, 4, 3), dict(batch=1, heads=1, seq_q=64, seq_k=197, head_dim=128, bias=True)),
    ("bf16", cfg(64, 32, 4, 3), dict(batch=1, heads=1, seq_q=20, seq_k=257, head_dim=80)),
    ("f16", cfg(64, 64, 4, 2), dict(batch=1, heads=1, seq_q=40, seq_k=577, head_dim=64, mask=True, k_layout="bhds")),
    ("f16", cfg(128, 128, 8, 2), dict(batch=1, heads=1, seq_q=30, seq_k=1050, head_dim=32, mask=True)),
    ("bf16", cfg(128, 32, 4, 3), dict(batch=1, heads=2, seq_q=40, seq_k=77, head_dim=96, mask=True)),
    ("f16", cfg(64, 64, 4, 2), dict(batch=1, heads=1, seq_q=33, seq_k=70, head_dim=256, bias=True, k_layout="bhds")),
    ("f16", cfg(64, 32, 4, 2), dict(batch=1, heads=3, seq_q=37, seq_k=45, head_dim=26, mask=True,
                                    q_layout="bshd_merged", k_layout="bshd_merged")),
    ("bf16", cfg(64, 32, 4, 3), dict(batch=1, heads=2, seq_q=21, seq_k=50, head_dim=26, k_layout="bhds")),
]


def _id(case) -> str:
    dtype, c, p = case
    lay = p.get("q_layout", "bhsd") + ("-kT" if p.get("k_layout") == "bhds" else "")
    extra = "".join(f"-{f}" for f in ("mask", "bias") if p.get(f))
    keys = f"x{p['seq_k']}" if "seq_k" in p else ""
    tile = f"q{c['BQ']}kv{c['BKV']}w{c['WARPS']}s{c['STAGES']}"
    return f"{dtype}-s{p['seq_q']}{keys}-d{p['head_dim']}-{tile}-{lay}{extra}"


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_id)
def test_attention_matches_fp64_reference(emu, case):
    dtype, config, kw = case
    problem = make_problem("attention", dtype, **kw)
    assert_close(*emu(ATTN, problem, config)[:2], dtype)


@pytest.mark.parametrize("case", BMM_CASES, ids=_id)
def test_bmm_softmax_matches_fp64_reference(emu, case):
    dtype, config, kw = case
    problem = make_problem("bmm_softmax", dtype, **kw)
    got, ref, _ = emu(BMM, problem, config)
    assert_close(got, ref, dtype)
    np.testing.assert_allclose(got["probs"].sum(-1), 1.0, atol=0.02)  # rows are distributions


def test_missing_rescale_is_caught(emu):
    """Without O, l *= exp(m_old - m_new) the later key tiles are weighted wrongly: 7 tiles of 32 keys of 197."""
    problem = make_problem("attention", "f16", batch=1, heads=1, seq_q=64, seq_k=197, head_dim=64)
    inputs = ATTN.random_inputs(problem, seed=3)
    got, ref, _ = emu(ATTN, problem, cfg(64, 32, 4, 2), inputs=inputs)
    assert rel_error(got["out"], ref["out"]) < TOL["f16"]
    bad, _, _ = emu(ATTN, problem, cfg(64, 32, 4, 2), inputs=inputs, prefix="#define GTCO_ATTN_TEST_NO_RESCALE 1\n")
    assert rel_error(bad["out"], ref["out"]) > 0.05


def test_bmm_softmax_missing_rescale_is_caught(emu):
    """Pass 1 of bmm_softmax sums the row online: without l *= exp(m_old - m_new) the row sums of 577 keys (19
    tiles of 32) are wrong and so is every P."""
    problem = make_problem("bmm_softmax", "f16", batch=1, heads=1, seq_q=32, seq_k=577, head_dim=64)
    inputs = BMM.random_inputs(problem, seed=5)
    got, ref, _ = emu(BMM, problem, cfg(64, 32, 4, 2), inputs=inputs)
    assert rel_error(got["probs"], ref["probs"]) < TOL["f16"]
    bad, _, _ = emu(BMM, problem, cfg(64, 32, 4, 2), inputs=inputs, prefix="#define GTCO_ATTN_TEST_NO_RESCALE 1\n")
    assert rel_error(bad["probs"], ref["probs"]) > 0.05


@pytest.mark.parametrize("family", [ATTN, BMM], ids=lambda f: f.name)
def test_fully_masked_rows_are_zero_not_nan(emu, family):
    """A -inf mask over every key of batch 0 gives l = 0: those rows are zeros (the exporters' IsNaN guard);
    batch 1, masked only on its tail, is unaffected. Finite -10000 masks are covered by the reference tests."""
    problem = make_problem(family.name, "f16", batch=2, heads=1, seq_q=40, seq_k=70, head_dim=32, mask=True)
    inputs = family.random_inputs(problem, seed=4)
    mask = np.zeros((2, 1, 1, 70))
    mask[0] = -np.inf
    mask[1, ..., 60:] = -np.inf
    inputs["mask"] = to_storage(mask, "f16")
    got, ref, _ = emu(family, problem, cfg(64, 32, 4, 2), inputs=inputs)
    (name, out), = got.items()
    assert not np.isnan(out).any()
    assert np.all(out[0] == 0.0)
    assert np.all(ref[name][0] == 0.0)
    assert rel_error(out[1], ref[name][1]) < TOL["f16"]


@pytest.mark.parametrize("family", [ATTN, BMM], ids=lambda f: f.name)
def test_mask_and_bias_scales_multiply_their_terms(emu, family):
    """softmax((Q Kᵀ + M + B) * s) as the graph writes it: the kernel scales M and B by their own factors (run-time
    arguments). With a mask of moderate values (where scaling it matters) it matches the reference, and the
    reference of the mask left unscaled is far from it."""
    kw = dict(batch=2, heads=2, seq_q=40, seq_k=50, head_dim=64, mask=True, bias=True, scale=0.125,
              mask_scale=0.125, bias_scale=0.5)
    problem = make_problem(family.name, "f16", **kw)
    inputs = family.random_inputs(problem, seed=21)
    rng = np.random.default_rng(21)
    inputs["mask"] = to_storage(4.0 * rng.standard_normal(inputs["mask"].shape), "f16")
    got, ref, _ = emu(family, problem, cfg(64, 32, 4, 2), inputs=inputs)
    assert_close(got, ref, "f16")
    unscaled = family.reference(make_problem(family.name, "f16", **{**kw, "mask_scale": 1.0}), inputs)
    (name, want), = ref.items()
    assert rel_error(unscaled[name], want) > 0.05


def test_padded_head_reads_and_writes_only_its_elements(emu):
    """head_dim 26 in bhsd: each operand is followed by NaNs and the output by a sentinel; a kernel reading past a
    row would mix the next row (or the NaNs) into the scores, one writing past it would touch the next row or the
    sentinel."""
    problem = make_problem("attention", "f16", batch=1, heads=2, seq_q=19, seq_k=35, head_dim=26)
    inputs = ATTN.random_inputs(problem, seed=13)
    tail = 64
    arrays = {k: np.concatenate([v.reshape(-1), np.full(tail, np.nan, v.dtype)]) for k, v in inputs.items()}
    (shape, dtype), = ATTN.outputs(problem).values()
    out = output_dtype_array(shape, dtype).reshape(-1)
    arrays["out"] = np.concatenate([out, to_storage(np.full(tail, 7.0), dtype).astype(out.dtype)])
    inst = ATTN.instantiate(problem, cfg(64, 32, 4, 2), "sm_90")
    lib = build_emulated(inst, emu.out_dir, extra=("-O1",))
    got = run_emulated(lib, inst.symbol, ATTN.args_fields(problem, arrays), arrays, ["out"])["out"]
    o = from_storage(got, "f16")
    assert np.all(o[out.size:] == 7.0)
    assert rel_error(o[:out.size].reshape(shape), ATTN.reference(problem, inputs)["out"]) < TOL["f16"]


BAND_CASES = [
    # family, dtype, config, problem: partial q and key tiles, a q tile whose keys end inside a key tile, a padding
    # mask beside the band, GQA; causal with seq_q > seq_k (the rows past seq_k see every key) and seq_q < seq_k;
    # sliding windows that skip key tiles on both sides of a q tile, symmetric (ModernBERT's) and not
    (ATTN, "f16", cfg(64, 32, 4, 2), dict(batch=2, heads=2, seq_q=150, head_dim=64, mask=True, causal=True)),
    (ATTN, "bf16", cfg(128, 64, 8, 3), dict(batch=1, heads=4, seq_q=77, head_dim=32, causal=True, kv_group=2,
                                           q_layout="bshd_merged", k_layout="bshd_merged", v_layout="bshd_merged",
                                           out_layout="bshd_merged")),
    (ATTN, "f16", cfg(64, 64, 4, 2), dict(batch=1, heads=1, seq_q=90, seq_k=45, head_dim=80, causal=True,
                                          k_layout="bhds")),
    (ATTN, "f32", cfg(64, 32, 4, 2), dict(batch=1, heads=2, seq_q=40, seq_k=97, head_dim=64, causal=True)),
    (ATTN, "f16", cfg(64, 32, 4, 2), dict(batch=1, heads=2, seq_q=230, head_dim=64, window=(32, 32), mask=True)),
    (ATTN, "bf16", cfg(64, 64, 4, 2), dict(batch=1, heads=2, seq_q=200, head_dim=32, window=(70, 5), kv_group=2)),
    (BMM, "f16", cfg(64, 32, 4, 2), dict(batch=1, heads=2, seq_q=100, head_dim=64, mask=True, causal=True)),
    (BMM, "bf16", cfg(64, 64, 4, 3), dict(batch=1, heads=1, seq_q=33, seq_k=70, head_dim=26, causal=True)),
    (BMM, "f16", cfg(64, 32, 4, 2), dict(batch=1, heads=1, seq_q=100, head_dim=32, window=(16, 16))),
]


@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: f"{c[0].name}-" + _id(c[1:]) + (
    f"-w{c[3]['window'][0]}_{c[3]['window'][1]}" if "window" in c[3] else "-causal"))
def test_band_masks_are_generated(emu, case):
    """The BAND instances keep key j of query i only where lo <= j - i <= hi (causal: upper-left aligned as ONNX
    Attention's is_causal; sliding windows) without reading a mask, the attention kernel walking only the key tiles
    the band reaches from each q tile: equal to the banded reference, and far from the same problem without the band
    (so it was applied)."""
    family, dtype, config, kw = case
    problem = make_problem(family.name, dtype, **kw)
    inst = family.instantiate(problem, config, "sm_90")
    assert inst.name.endswith("_band") and inst.source.count("true>") == 1
    got, ref, inputs = emu(family, problem, config)
    (name, out), = got.items()
    assert not np.isnan(out).any()
    tol = TOL_TF32[family.name] if dtype == "f32" else TOL[dtype]
    assert rel_error(out, ref[name]) < tol
    plain = family.reference(make_problem(family.name, dtype, **{**kw, "causal": False, "window": None}), inputs)
    assert rel_error(plain[name], ref[name]) > 0.1
    if family is BMM:  # P is exactly zero outside the band
        lo, hi = band(problem)
        sq, sk = out.shape[-2:]
        offset = np.arange(sk)[None, :] - np.arange(sq)[:, None]
        assert np.all(out[..., (offset < lo) | (offset > hi)] == 0.0)


def test_band_instance_refuses_a_node_that_is_not_banded():
    """gtco_attention_args.banded must match the instance: a banded instance given a plain node's arguments (or the
    other way round) returns GTCO_EBADSHAPE instead of running the wrong mask; a plain problem has no band tag."""
    kw = dict(batch=1, heads=1, seq_q=40, head_dim=32)
    plain = make_problem("attention", "f16", **kw)
    assert "_band" not in ATTN.instantiate(plain, cfg(64, 32, 4, 2), "sm_90").name
    causal = make_problem("attention", "f16", **kw, causal=True)
    window = make_problem("attention", "f16", **kw, window=(3, 1), causal=True)
    arrays = dict(ATTN.random_inputs(causal, seed=1), out=output_dtype_array(*ATTN.outputs(causal)["out"]))
    fields = [{f.name: f.value for f in ATTN.args_fields(p, arrays)} for p in (plain, causal, window)]
    assert [(f["banded"], f["band_lo"], f["band_hi"]) for f in fields] == [(0, 0, 0), (1, -(1 << 30), 0), (1, -3, 0)]
    src = Path(__file__).parents[3] / "plugins" / "families" / "attention" / "attention.cuh"
    assert "if ((a->banded != 0) != BAND) return false;" in src.read_text()
    assert "window (3, -1)" in ATTN.check(make_problem("attention", "f16", **kw, window=(3, -1)), cfg(64, 32, 4, 2),
                                          "sm_90")


def test_band_estimate_walks_only_the_band():
    """The estimate of a banded attention block walks the mean of its q tiles' key tiles: a causal one at 1024 tokens
    well under the full problem's time and above half of it (each q tile walks its diagonal tile whole), a window of
    128 keys far under it."""
    from onnx_gtco.calibration import hardware

    far = 1 << 30
    assert band_key_tiles(128, 128, 64, 64, -far, 0) == 1.5
    assert band_key_tiles(100, 45, 64, 32, -far, 0) == 2.0  # rows past seq_k see all of its 2 tiles
    assert band_key_tiles(256, 256, 64, 64, -64, 64) == 2.5  # tiles 0-1, 0-2, 1-3, 2-3
    hw = hardware("h200")
    kw = dict(batch=1, heads=16, seq_q=1024, head_dim=64)
    full = ATTN.estimate_us(make_problem("attention", "f16", **kw), cfg(128, 64, 8, 2), hw)
    half = ATTN.estimate_us(make_problem("attention", "f16", **kw, causal=True), cfg(128, 64, 8, 2), hw)
    local = ATTN.estimate_us(make_problem("attention", "f16", **kw, window=(64, 64)), cfg(128, 64, 8, 2), hw)
    assert 0.45 * full < half < 0.75 * full and local < 0.4 * full, (half, local, full)


def test_kernel_head_dims():
    """Supported head dims run as they are, smaller ones as the next supported one, 129..255 and > 256 not at all."""
    assert [kernel_head_dim(d) for d in (26, 32, 40, 80, 90, 96, 100, 128, 129, 200, 256, 257)] == [
        32, 32, 64, 80, 96, 96, 128, 128, None, None, 256, None]
    p26 = make_problem("attention", "f16", batch=1, heads=2, seq_q=77, head_dim=26, mask=True)
    inst = ATTN.instantiate(p26, cfg(64, 32, 4, 2), "sm_80")
    assert inst.name == "attention_sm80_f16_d26p32_q64_kv32_w4_s2_mask"
    assert "gtco::attention_launch<__half, 32, 64, 32, 4, 2, false, true, false, true>" in inst.source
    p32 = make_problem("attention", "f16", batch=1, heads=2, seq_q=77, head_dim=32, mask=True)
    assert inst.smem_bytes == ATTN.instantiate(p32, cfg(64, 32, 4, 2), "sm_80").smem_bytes
    wide = make_problem("attention", "f16", batch=1, heads=4, seq_q=197, head_dim=256)
    assert [{k: c[k] for k in ("BQ", "BKV", "WARPS")} for c in ATTN.configs(wide, "sm_90")] == [
        {"BQ": 64, "BKV": 32, "WARPS": 4}] * 2  # its one tile, with 2 and 3 stages
    assert BMM.configs(make_problem("bmm_softmax", "f16", batch=1, heads=4, seq_q=197, head_dim=256), "sm_80")


# ---- check() -------------------------------------------------------------------------------------------------------
VIT = dict(batch=1, heads=12, seq_q=197, head_dim=64, mask=False)


@pytest.mark.parametrize(("family", "dtype", "config", "kw", "arch", "reason"), [
    (BMM, "f32", cfg(128, 64, 4, 2), {**VIT, "head_dim": 128}, "sm_90", "224 fp32 accumulator registers"),
    (ATTN, "f16", cfg(64, 32, 4, 2), {**VIT, "head_dim": 200}, "sm_90", "head_dim 200 not supported"),
    (BMM, "f16", cfg(64, 32, 4, 2), {**VIT, "head_dim": 257}, "sm_90", "head_dim 257 not supported"),
    (ATTN, "f16", cfg(64, 64, 4, 2), {**VIT, "head_dim": 256}, "sm_90", "head_dim 256 takes only the tile"),
    (ATTN, "f16", cfg(128, 32, 8, 2), {**VIT, "head_dim": 256}, "sm_80", "head_dim 256 takes only the tile"),
    (ATTN, "f32", cfg(64, 32, 4, 2), {**VIT, "head_dim": 256}, "sm_80", "exceeds the sm_80 limit"),
    (BMM, "f16", cfg(64, 128, 4, 2), {**VIT, "head_dim": 256}, "sm_90", "128 fp32 accumulator registers"),
    (ATTN, "f16", cfg(128, 32, 4, 2), {**VIT, "head_dim": 90}, "sm_90", "128 fp32 accumulator registers"),
    (ATTN, "f16", cfg(64, 32, 8, 2), VIT, "sm_90", "whole 16-row m-tiles"),
    (ATTN, "f16", cfg(64, 48, 4, 2), VIT, "sm_90", "BKV=48 not in the space"),
    # 2 * (128 x 136 + 3 * 2 * 128 x 136) B is over sm_80's 166912 B too, but the register budget says so first:
    # every config under the budget fits shared memory on both archs
    (ATTN, "f16", cfg(128, 128, 8, 3), {**VIT, "head_dim": 128}, "sm_80", "128 fp32 accumulator registers"),
    (ATTN, "f16", cfg(128, 64, 4, 2), {**VIT, "head_dim": 128}, "sm_90", "accumulator registers"),
    (ATTN, "f16", cfg(64, 32, 4, 2), {**VIT, "out_layout": "bhds"}, "sm_90", "out_layout 'bhds' not supported"),
    (ATTN, "f16", cfg(64, 32, 4, 2), {**VIT, "q_layout": "qkv_packed"}, "sm_90", "qkv_packed must be used by all"),
    (ATTN, "f16", cfg(64, 32, 4, 2), {**VIT, "mask": True, "mask_shape": (1, 1, 5, 197)}, "sm_90",
     "mask dim 5 neither 1 nor seq_q 197"),
    (ATTN, "f16", cfg(64, 32, 4, 2), VIT, "sm_75", "arch 'sm_75'"),
    (ATTN, "f16", cfg(64, 128, 4, 2), {**VIT, "head_dim": 128}, "sm_80", "128 fp32 accumulator registers"),
    (BMM, "f16", cfg(128, 128, 4, 2), VIT, "sm_90", "accumulator registers"),
    (BMM, "f16", cfg(128, 64, 4, 2), {**VIT, "head_dim": 128}, "sm_90", "128 fp32 accumulator registers"),
])
def test_check_rejects_with_reason(family, dtype, config, kw, arch, reason):
    problem = make_problem(family.name, dtype, **kw)
    why = family.check(problem, config, arch)
    assert why is not None and reason in why, why
    with pytest.raises(ValueError, match="^" + family.name):
        family.instantiate(problem, config, arch)


def test_configs_are_valid_and_named():
    problem = make_problem("attention", "f16", **{**VIT, "mask": True})
    configs = ATTN.configs(problem, "sm_90")
    assert 3 <= len(configs) <= 6
    assert all(ATTN.check(problem, c, "sm_90") is None for c in configs)
    inst = ATTN.instantiate(problem, cfg(128, 64, 8, 2), "sm_90")
    assert inst.name == "attention_sm90_f16_d64_q128_kv64_w8_s2_mask"
    assert inst.symbol in inst.source and '#include "attention/attention.cuh"' in inst.source
    assert inst.smem_bytes == 2 * (128 * 72 + 2 * 2 * 64 * 72)
    bmm = make_problem("bmm_softmax", "bf16", **{**VIT, "k_layout": "bhds"})
    assert BMM.instantiate(bmm, cfg(64, 32, 4, 2), "sm_80").name == "bmm_softmax_sm80_bf16_d64_q64_kv32_w4_s2_kt"
    for shape in ZOO.values():  # the two-pass kernel takes any key length: no "seq_k too long" any more
        long = make_problem("bmm_softmax", "f16", **shape, mask=True)
        assert len(BMM.configs(long, "sm_80")) >= 3 and len(BMM.configs(long, "sm_90")) >= 3
    assert {f.name for f in FAMILIES} == {"attention", "bmm_softmax"}


# ---- nvcc / ptxas ----------------------------------------------------------------------------------------------------
ZOO = {  # the attention shapes of the zoo (GTCO's models)
    "vit_b": dict(batch=1, heads=12, seq_q=197, head_dim=64),  # ViT-B/16, 224 px
    "setr": dict(batch=1, heads=16, seq_q=577, head_dim=64),   # ViT-L/16 at 384 px (SETR's backbone)
    "detr": dict(batch=1, heads=8, seq_q=1050, head_dim=32),   # DETR-R50 encoder, d_model 256
}


def _compile_all(tmp_path, family, shape: str, arch: str, **flags):
    problem = make_problem(family.name, "f16", **ZOO[shape], **flags)
    configs = family.configs(problem, arch)
    insts: list[Instance] = [family.instantiate(problem, c, arch) for c in configs]
    if not insts:
        return problem, configs, []
    src = tmp_path / f"{family.name}_{shape}_{arch}.cu"
    src.write_text("\n".join(i.source for i in insts))
    result = nvcc_compile(src, src.with_suffix(".o"), arch, include_dirs=INCLUDES, timeout_s=600)
    return problem, configs, parse_ptxas(result.stderr)


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("shape", list(ZOO))
def test_attention_configs_do_not_spill(tmp_path, shape, arch):
    """With a mask and the causal one beside it (a superset of the plain and the masked kernels' work)."""
    _, configs, kernels = _compile_all(tmp_path, ATTN, shape, arch, mask=True, causal=True)
    assert len(configs) >= 3 and len(kernels) == len(configs)
    for k in kernels:
        assert k.arch == arch and "attention_kernel" in k.name
        assert not k.spills and k.stack_frame_bytes == 0, k


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("shape", list(ZOO))
def test_bmm_softmax_configs_do_not_spill(tmp_path, shape, arch):
    """The two-pass kernel keeps one S tile in registers whatever seq_k is: ViT-B's 197, SETR's 577 and DETR's 1050
    keys all get configs, and none spills (with a mask and the causal one beside it)."""
    _, configs, kernels = _compile_all(tmp_path, BMM, shape, arch, mask=True, causal=True, k_layout="bhds")
    assert len(configs) >= 3 and len(kernels) == len(configs)
    for k in kernels:
        assert k.arch == arch and "bmm_softmax_kernel" in k.name
        assert not k.spills and k.stack_frame_bytes == 0, k


def ptxas_clean(insts: list[Instance], src: Path, arch: str, timeout_s: float = 600) -> list:
    """Compile `insts` as one source `src` for `arch` and return ptxas's report of their kernels, one per instance,
    each asserted free of spills and of a stack frame."""
    src.write_text("\n".join(i.source for i in insts))
    kernels = parse_ptxas(nvcc_compile(src, src.with_suffix(".o"), arch, include_dirs=INCLUDES,
                                       timeout_s=timeout_s).stderr)
    assert len(kernels) == len(insts)
    for k in kernels:
        assert not k.spills and k.stack_frame_bytes == 0, k
    return kernels


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_swin_window_configs_do_not_spill(tmp_path, arch):
    """Swin-T's stage-1 window attention (64 windows x 3 heads x 49 tokens, head_dim 32) with the rel-pos bias and
    the shift mask, f16 and f32 (TF32): every proposed config compiles without spills or a stack frame."""
    insts: list[Instance] = []
    for dtype in ("f16", "f32"):
        problem = make_problem("attention", dtype, batch=64, heads=3, seq_q=49, head_dim=32, mask=True, bias=True,
                               mask_shape=(64, 1, 49, 49))
        configs = ATTN.configs(problem, arch)
        assert len(configs) >= 3
        insts += [ATTN.instantiate(problem, c, arch) for c in configs]
    for k in ptxas_clean(insts, tmp_path / f"swin_{arch}.cu", arch):
        assert k.arch == arch and "attention_kernel" in k.name


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family", [ATTN, BMM], ids=lambda f: f.name)
def test_check_budget_is_honest_at_its_edge(tmp_path, family, arch):
    """Every config check() accepts within 16 registers of ACC_REG_BUDGET, for every head dim, with the heaviest
    flags (mask + bias, gathered Kᵀ), compiles without spills or a stack frame: the budget is not optimistic."""
    keys = list(family.space)
    insts: list[Instance] = []
    for d in (32, 64, 80, 96, 128, 256):
        problem = make_problem(family.name, "f16", batch=1, heads=4, seq_q=197, head_dim=d, mask=True, bias=True,
                               k_layout="bhds")
        for vals in itertools.product(*family.space.values()):
            c = dict(zip(keys, vals, strict=True))
            if family.check(problem, c, arch) is None and family._acc_regs(problem, c) >= ACC_REG_BUDGET - 16:
                insts.append(family.instantiate(problem, c, arch))
    assert len(insts) >= 4
    ptxas_clean(insts, tmp_path / f"{family.name}_edge_{arch}.cu", arch)


# ---------------------------------------------------------------------------------------------------------------
# f32: TF32 Q Kᵀ and P V, fp32 softmax and I/O
# ---------------------------------------------------------------------------------------------------------------
F32_CASES = [
    (ATTN, cfg(64, 32, 4, 2), SHIFTED),
    (ATTN, cfg(64, 32, 4, 2), dict(batch=2, heads=2, seq_q=49, seq_k=70, head_dim=64, mask=True)),
    (ATTN, cfg(64, 64, 4, 3), dict(batch=1, heads=2, seq_q=37, head_dim=80, bias=True, k_layout="bhds",
                                   out_layout="bshd_merged")),
    (ATTN, cfg(64, 32, 4, 2), dict(batch=1, heads=2, seq_q=30, head_dim=32, q_layout="qkv_packed",
                                   k_layout="qkv_packed", v_layout="qkv_packed", out_layout="bshd_merged")),
    (BMM, cfg(64, 32, 4, 2), dict(batch=2, heads=2, seq_q=49, seq_k=70, head_dim=64, mask=True, k_layout="bhds")),
    (BMM, cfg(64, 64, 4, 3), dict(batch=1, heads=2, seq_q=40, head_dim=128, bias=True, q_layout="bshd_merged",
                                  k_layout="bshd_merged")),
    (ATTN, cfg(64, 32, 4, 2), dict(batch=1, heads=1, seq_q=20, seq_k=37, head_dim=256, mask=True)),
    (ATTN, cfg(64, 32, 4, 2), dict(batch=1, heads=2, seq_q=41, head_dim=26, q_layout="qkv_packed",
                                   k_layout="qkv_packed", v_layout="qkv_packed", out_layout="bshd_merged")),
    (BMM, cfg(128, 64, 8, 2), dict(batch=1, heads=2, seq_q=40, seq_k=45, head_dim=96, mask=True, k_layout="bhds")),
]
NO_TF32_ROUND = "#define GTCO_ATTN_TEST_NO_TF32_ROUND 1\n"


def exact_reference(family, problem: Problem, inputs: dict) -> dict:
    """The fp64 reference of the unrounded fp32 inputs (the f16 path of the reference does not round to TF32)."""
    return family.reference(dataclasses.replace(problem, dtype="f16"),
                            {k: np.asarray(v, np.float64) for k, v in inputs.items()})


def _f32_id(case) -> str:
    family, c, p = case
    return f"{family.name}-" + _id(("f32", c, p))


@pytest.mark.parametrize("case", F32_CASES, ids=_f32_id)
def test_f32_matches_reference_in_tf32(emu, case):
    """Within TOL_TF32 of the TF32-rounded reference and TOL_F32_EXACT of the unrounded one, and measurably off the
    unrounded one (a kernel multiplying in full fp32 would be ~1e-7 from it)."""
    family, config, kw = case
    problem = make_problem(family.name, "f32", **kw)
    got, ref, inputs = emu(family, problem, config)
    exact = exact_reference(family, problem, inputs)
    for name in ref:
        assert got[name].dtype == np.float64 and not np.isnan(got[name]).any()
        err, err_exact = rel_error(got[name], ref[name]), rel_error(got[name], exact[name])
        assert err < TOL_TF32[family.name] and 2e-5 < err_exact < TOL_F32_EXACT, (err, err_exact)


@pytest.mark.parametrize("family", [ATTN, BMM], ids=lambda f: f.name)
def test_f32_missing_tf32_rounding_is_caught(emu, family):
    """Raw fp32 operands (the mma reads them truncated to 19 bits) land well outside the TF32 tolerance."""
    _, config, kw = next(c for c in F32_CASES if c[0] is family)
    problem = make_problem(family.name, "f32", **kw)
    good, ref, _ = emu(family, problem, config)
    bad, _, _ = emu(family, problem, config, prefix=NO_TF32_ROUND)
    name = next(iter(ref))
    err, err_bad = rel_error(good[name], ref[name]), rel_error(bad[name], ref[name])
    assert err_bad > TOL_TF32[family.name] and err_bad > 3 * err, (err, err_bad)


@pytest.mark.parametrize("family", [ATTN, BMM], ids=lambda f: f.name)
def test_f32_is_not_computed_in_f16(emu, family):
    """q x 2^20, k x 2^-20 (the same scores) and v x 2^20: operands fp16 cannot hold (q and v overflow it, k falls
    into its subnormals) keep the TF32 accuracy."""
    _, config, kw = next(c for c in F32_CASES if c[0] is family)
    problem = make_problem(family.name, "f32", **kw)
    inputs = family.random_inputs(problem, seed=11)
    for name, scale in (("q", 2.0**20), ("k", 2.0**-20), ("v", 2.0**20)):
        if name in inputs:
            inputs[name] = (inputs[name] * np.float32(scale)).astype(np.float32)
    got, ref, _ = emu(family, problem, config, inputs=inputs)
    exact = exact_reference(family, problem, inputs)
    for name in ref:
        assert np.isfinite(got[name]).all()
        assert rel_error(got[name], ref[name]) < TOL_TF32[family.name]
        assert rel_error(got[name], exact[name]) < TOL_F32_EXACT
    with np.errstate(over="ignore"):
        assert not np.isfinite(inputs["q"].astype(np.float16)).all()


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family", [ATTN, BMM], ids=lambda f: f.name)
def test_f32_heaviest_configs_do_not_spill(tmp_path, family, arch):
    """For each head dim, the f32 config check() accepts with the most accumulator registers, with the heaviest
    flags (mask + bias, gathered Kᵀ), compiles without spills or a stack frame (one nvcc per family and arch)."""
    keys = list(family.space)
    insts: list[Instance] = []
    for d in (32, 64, 80, 96, 128, 256):
        problem = make_problem(family.name, "f32", batch=1, heads=4, seq_q=197, head_dim=d, mask=True, bias=True,
                               k_layout="bhds")
        valid = [c for c in (dict(zip(keys, v, strict=True)) for v in itertools.product(*family.space.values()))
                 if family.check(problem, c, arch) is None]
        if d == 256 and (family is BMM or arch == "sm_80"):  # over the budget, or sm_80's shared memory
            assert not valid
            continue
        insts.append(family.instantiate(problem, max(valid, key=lambda c: family._acc_regs(problem, c)), arch))
    for k in ptxas_clean(insts, tmp_path / f"{family.name}_f32_{arch}.cu", arch):
        assert 0 < k.registers <= 255, k


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_padded_and_wide_head_configs_do_not_spill(tmp_path, arch):
    """Every config configs() proposes for padded head dims (26 -> 32, 40 -> 64, 100 -> 128) and for 256, both
    families, f16 and f32, with the heaviest flags (mask + bias, gathered Kᵀ): no spills, no stack frame."""
    insts: list[Instance] = []
    for family, dtype, d in itertools.product((ATTN, BMM), ("f16", "f32"), (26, 40, 100, 256)):
        problem = make_problem(family.name, dtype, batch=1, heads=4, seq_q=197, head_dim=d, mask=True, bias=True,
                               k_layout="bhds")
        insts += [family.instantiate(problem, c, arch) for c in family.configs(problem, arch)]
    assert len(insts) >= 20
    assert any(i.name.startswith("attention_") and "_d256_" in i.name for i in insts)
    ptxas_clean(insts, tmp_path / f"padded_wide_{arch}.cu", arch, timeout_s=1200)
