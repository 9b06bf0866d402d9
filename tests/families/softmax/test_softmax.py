"""Softmax family (onnx_gtco/families/softmax/kernel.py, plugins/families/softmax/softmax.cuh): emulated numerics
against the fp64 reference, overflow without the max subtraction, fully masked rows, check() reasons, ptxas
resources."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import INCLUDES, nvcc_missing

from onnx_gtco.families.softmax.kernel import FAMILY, mask_rows
from onnx_gtco.kernels.emulate import build_emulated, run_emulated
from onnx_gtco.kernels.family import Problem, from_storage, np_dtype, rel_error, to_storage
from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.toolchain import nvcc_compile

TOL = {"f16": 2e-3, "bf16": 2e-3, "f32": 1e-5}
# bf16 outputs: rounding the exact result to bf16 alone costs up to 2^-8 (~1.5e-3..2.5e-3 in norm), so for bf16
# the 2e-3 bound is on the error beyond that rounding (against the reference rounded to bf16) and the raw bound
# is the unit roundoff
RAW_TOL = {"f16": 2e-3, "bf16": 2**-8, "f32": 1e-5}
ROUNDED_TOL = {"f16": 5e-4, "bf16": 2e-3, "f32": 1e-5}


def problem(dtype: str, cols: int, rows: int, **flags) -> Problem:
    return Problem.make("softmax", dtype, {"cols": cols, "rows": rows}, flags)


def run(tmp, prob: Problem, cfg: dict, seed: int = 0, defines: tuple[str, ...] = (), inputs=None):
    inst = FAMILY.instantiate(prob, cfg, "sm_80")
    lib = build_emulated(inst, tmp, ("-O1", *(f"-D{d}" for d in defines)))
    ins = inputs if inputs is not None else FAMILY.random_inputs(prob, seed)
    arrays = dict(ins)
    (shape, dt), = FAMILY.outputs(prob).values()
    arrays["y"] = np.zeros(shape, np_dtype(dt))
    got = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"])
    ref = FAMILY.reference(prob, ins)["y"]
    return from_storage(got["y"], prob.dtype).reshape(ref.shape), ref


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("softmax_emu")


# scores [B, H, S, S] flattened to rows = B*H*S; mask_map picks the mask row of each score row
GRID = [  # dtype, cols, rows, config, flags
    ("f16", 49, 12, {"THREADS": 32, "VEC": 1, "ROWS": 4},            # Swin window, mask [B,1,S,S]: B=2 H=2 S=3
     {"scale": 0.125, "mask": True, "mask_map": (6, 3, 3)}),
    ("bf16", 4096, 2, {"THREADS": 256, "VEC": 8, "ROWS": 1}, {}),      # long row, 8 warps
    ("bf16", 128, 8, {"THREADS": 32, "VEC": 4, "ROWS": 4},             # BERT mask [B,1,1,S]: B=2, H*S=4
     {"mask": True, "mask_map": (4, 1, 1)}),
    ("f32", 197, 3, {"THREADS": 64, "VEC": 1, "ROWS": 2}, {"mask": True, "scale": 0.125}),  # ViT length
]


@pytest.mark.parametrize(("dtype", "cols", "rows", "cfg", "flags"), GRID,
                         ids=[f"{g[0]}-c{g[1]}-t{g[3]['THREADS']}v{g[3]['VEC']}r{g[3]['ROWS']}" for g in GRID])
def test_matches_fp64_reference(emu_dir, dtype, cols, rows, cfg, flags):
    prob = problem(dtype, cols, rows, **flags)
    assert FAMILY.check(prob, cfg, "sm_80") is None
    got, ref = run(emu_dir, prob, cfg, seed=cols + rows)
    assert np.isfinite(got).all()
    assert rel_error(got, ref) < RAW_TOL[dtype]
    assert rel_error(got, from_storage(to_storage(ref, dtype), dtype)) < ROUNDED_TOL[dtype]
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=cols * {"f16": 1e-3, "bf16": 4e-3, "f32": 1e-6}[dtype])


def test_no_max_subtraction_overflows(emu_dir):
    """Logits near 100 overflow exp in fp32 unless the row max is subtracted; the test sees the broken variant."""
    prob = problem("f16", 256, 4, test_amplitude=40.0)
    cfg = {"THREADS": 32, "VEC": 8, "ROWS": 2}
    ins = FAMILY.random_inputs(prob, 5)
    assert from_storage(ins["x"], "f16").max() > 89  # exp(89) > FLT_MAX
    good, ref = run(emu_dir, prob, cfg, inputs=ins)
    assert np.isfinite(good).all() and rel_error(good, ref) < TOL["f16"]
    bad, _ = run(emu_dir, prob, cfg, inputs=ins, defines=("GTCO_TEST_SOFTMAX_NO_MAX",))
    assert not (rel_error(bad, ref) < TOL["f16"])  # NaN (inf / inf) or far off


def test_fully_masked_row_gives_zeros(emu_dir):
    prob = problem("f16", 128, 8, mask=True, mask_map=(4, 1, 1))
    cfg = {"THREADS": 32, "VEC": 8, "ROWS": 4}
    ins = FAMILY.random_inputs(prob, 7)
    mask = from_storage(ins["mask"], "f16")
    mask[1, :] = -np.inf  # every score row of batch 1
    ins["mask"] = to_storage(mask, "f16")
    got, ref = run(emu_dir, prob, cfg, inputs=ins)
    assert (got[4:] == 0).all() and (ref[4:] == 0).all()
    assert rel_error(got, ref) < TOL["f16"]


@pytest.mark.parametrize(("cols", "cfg", "flags", "reason"), [
    (49, {"THREADS": 32, "VEC": 2, "ROWS": 1}, {}, "not a multiple of VEC=2"),
    (4096, {"THREADS": 32, "VEC": 8, "ROWS": 1}, {}, "128 elements per thread"),
    (64, {"THREADS": 128, "VEC": 1, "ROWS": 1}, {}, "would idle"),
    (1024, {"THREADS": 1024, "VEC": 1, "ROWS": 2}, {}, "2048 threads per block"),
    (128, {"THREADS": 48, "VEC": 1, "ROWS": 1}, {}, "whole warps"),
    (128, {"THREADS": 32, "VEC": 4, "ROWS": 1}, {"mask": True, "mask_map": (0, 1, 1)}, "div and mod must be"),
])
def test_check_rejects_with_reason(cols, cfg, flags, reason):
    prob = problem("f16", cols, 4, **flags)
    why = FAMILY.check(prob, cfg, "sm_80")
    assert why is not None and reason in why, why
    with pytest.raises(ValueError, match="softmax: "):
        FAMILY.instantiate(prob, cfg, "sm_80")


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cols", [49, 50, 64, 197, 577, 1000, 2048, 4096])
def test_configs_are_valid(dtype, cols):
    prob = problem(dtype, cols, 16)
    cfgs = FAMILY.configs(prob, "sm_80")
    assert cfgs and all(FAMILY.check(prob, c, "sm_80") is None for c in cfgs)


def test_mask_rows_and_names():
    assert mask_rows(problem("f16", 8, 2 * 12 * 8, mask=True, mask_map=(96, 1, 1))) == 2  # [2,1,1,8]
    assert mask_rows(problem("f16", 8, 2 * 12 * 8, mask=True, mask_map=(96, 8, 8))) == 16  # [2,1,8,8]
    assert mask_rows(problem("f16", 8, 2 * 12 * 8, mask=True, mask_map=(96 * 2, 0, 8))) == 8  # [1,1,8,8]
    inst = FAMILY.instantiate(problem("bf16", 197, 4, scale=0.125), {"THREADS": 64, "VEC": 1, "ROWS": 2}, "sm_90")
    assert inst.name == "softmax_sm90_bf16_c197_t64_v1_r2_scale" and inst.symbol == "gtco_" + inst.name


PTXAS_CASES = [
    ("f16", 4096, {"THREADS": 128, "VEC": 8, "ROWS": 1}, {"mask": True, "scale": 0.125}),
    ("bf16", 197, {"THREADS": 64, "VEC": 1, "ROWS": 2}, {"scale": 0.125}),
    ("f16", 128, {"THREADS": 32, "VEC": 4, "ROWS": 4}, {"mask": True}),
    ("f32", 1024, {"THREADS": 256, "VEC": 4, "ROWS": 1}, {}),
]


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ptxas_no_spills(tmp_path, arch):
    insts = [FAMILY.instantiate(problem(dt, c, 4, **fl), cfg, arch) for dt, c, cfg, fl in PTXAS_CASES]
    src = tmp_path / f"softmax_{arch}.cu"
    src.write_text("\n".join(i.source for i in insts))
    result = nvcc_compile(src, tmp_path / "softmax.o", arch, include_dirs=INCLUDES, timeout_s=120)
    kernels = [k for k in parse_ptxas(result.stderr) if "softmax_kernel" in k.name]
    assert len(kernels) == len(PTXAS_CASES)
    for k in kernels:
        assert k.arch == arch and k.registers > 0, k
        assert not k.spills and k.stack_frame_bytes == 0, k
