"""LayerNorm family (onnx_gtco/families/layernorm/kernel.py, plugins/families/layernorm/layernorm.cuh): emulated
numerics against the fp64 reference, a deliberately broken variance that the test catches, check() reasons, ptxas
resources."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import INCLUDES, nvcc_missing

from onnx_gtco.families.layernorm.kernel import FAMILY
from onnx_gtco.kernels.emulate import EmulationError, build_emulated, run_emulated
from onnx_gtco.kernels.family import Problem, from_storage, np_dtype, rel_error, to_storage
from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.toolchain import nvcc_compile

TOL = {"f16": 2e-3, "bf16": 2e-3, "f32": 1e-5}
# bf16 outputs: rounding the exact result to bf16 alone costs up to 2^-8 (~1.5e-3..2.5e-3 in norm), so for bf16
# the 2e-3 bound is on the error beyond that rounding (against the reference rounded to bf16) and the raw bound
# is the unit roundoff
RAW_TOL = {"f16": 2e-3, "bf16": 2**-8, "f32": 1e-5}
# the kernel's own error: against the reference rounded to the output dtype, only rare 1-ulp differences remain
ROUNDED_TOL = {"f16": 5e-4, "bf16": 2e-3, "f32": 1e-5}


def problem(dtype: str, hidden: int, rows: int, **flags) -> Problem:
    return Problem.make("layernorm", dtype, {"hidden": hidden, "rows": rows}, flags)


def run(tmp, prob: Problem, cfg: dict, seed: int = 0, defines: tuple[str, ...] = (), inputs=None, fields=None):
    inst = FAMILY.instantiate(prob, cfg, "sm_80")
    lib = build_emulated(inst, tmp, ("-O1", *(f"-D{d}" for d in defines)))
    ins = inputs if inputs is not None else FAMILY.random_inputs(prob, seed)
    arrays = dict(ins)
    outs = FAMILY.outputs(prob)
    for k, (shape, dt) in outs.items():
        arrays[k] = np.zeros(shape, np_dtype(dt))
    got = run_emulated(lib, inst.symbol, fields or FAMILY.args_fields(prob, arrays), arrays, list(outs))
    ref = FAMILY.reference(prob, ins)
    return {k: from_storage(v, prob.dtype).reshape(ref[k].shape) for k, v in got.items()}, ref


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ln_emu")


GRID = [  # dtype, hidden, rows, config, flags
    ("f16", 768, 5, {"THREADS": 64, "VEC": 8, "ROWS": 2}, {"residual": True}),              # BERT, res + sum
    ("bf16", 200, 7, {"THREADS": 32, "VEC": 8, "ROWS": 4}, {"residual": True}),             # ragged, warp/row
    ("f32", 384, 3, {"THREADS": 64, "VEC": 2, "ROWS": 2}, {}),                              # f32, 2 warps/row
    ("bf16", 1024, 2, {"THREADS": 256, "VEC": 4, "ROWS": 1}, {"beta": False}),              # 8 warps, no beta
    ("f32", 192, 9, {"THREADS": 32, "VEC": 2, "ROWS": 8}, {"affine": False, "residual": True,
                                                           "residual_out": False}),      # no gamma/beta/sum
    ("f16", 200, 3, {"THREADS": 128, "VEC": 1, "ROWS": 1}, {"epsilon": 1e-12}),              # scalar, ragged
]


@pytest.mark.parametrize(("dtype", "hidden", "rows", "cfg", "flags"), GRID,
                         ids=[f"{g[0]}-h{g[1]}-t{g[3]['THREADS']}v{g[3]['VEC']}r{g[3]['ROWS']}" for g in GRID])
def test_matches_fp64_reference(emu_dir, dtype, hidden, rows, cfg, flags):
    prob = problem(dtype, hidden, rows, **flags)
    assert FAMILY.check(prob, cfg, "sm_80") is None
    got, ref = run(emu_dir, prob, cfg, seed=hidden + rows)
    assert set(got) == ({"y", "sum"} if flags.get("residual") and flags.get("residual_out", True) else {"y"})
    for k in got:
        assert np.isfinite(got[k]).all()
        err = rel_error(got[k], ref[k])
        assert err < RAW_TOL[dtype], f"{k}: {err:.3g}"
        rounded = from_storage(to_storage(ref[k], dtype), dtype)
        assert rel_error(got[k], rounded) < ROUNDED_TOL[dtype], k


def test_uncentered_variance_is_caught(emu_dir):
    """E[x^2] - mean^2 cancels on rows with a large mean: the test sees it; the centered kernel passes."""
    prob = problem("f16", 768, 4, residual=True, test_offset=2000.0)
    cfg = {"THREADS": 64, "VEC": 8, "ROWS": 2}
    good, ref = run(emu_dir, prob, cfg, seed=3)
    assert rel_error(good["y"], ref["y"]) < TOL["f16"]
    bad, _ = run(emu_dir, prob, cfg, seed=3, defines=("GTCO_TEST_LN_UNCENTERED",))
    assert rel_error(bad["y"], ref["y"]) > 10 * TOL["f16"]


def test_wrong_hidden_is_refused(emu_dir):
    prob = problem("f16", 256, 2)
    cfg = {"THREADS": 32, "VEC": 8, "ROWS": 1}
    ins = FAMILY.random_inputs(prob, 0)
    fields = [f if f.name != "hidden" else type(f)("hidden", "i32", 128) for f in FAMILY.args_fields(
        prob, {**ins, "y": np.zeros((2, 256), np.float16)})]
    with pytest.raises(EmulationError, match="error code 1"):
        run(emu_dir, prob, cfg, inputs=ins, fields=fields)


@pytest.mark.parametrize(("dtype", "hidden", "cfg", "reason"), [
    ("f16", 200, {"THREADS": 32, "VEC": 16, "ROWS": 1}, "VEC=16"),
    ("f32", 768, {"THREADS": 64, "VEC": 8, "ROWS": 1}, "over one 16-byte access"),
    ("f16", 198, {"THREADS": 32, "VEC": 4, "ROWS": 1}, "not a multiple of VEC=4"),
    ("f16", 1024, {"THREADS": 256, "VEC": 8, "ROWS": 8}, "2048 threads per block"),
    ("f32", 4096, {"THREADS": 32, "VEC": 4, "ROWS": 1}, "128 elements per thread"),
    ("f16", 192, {"THREADS": 256, "VEC": 8, "ROWS": 1}, "would idle"),
    ("f16", 0, {"THREADS": 32, "VEC": 1, "ROWS": 1}, "must be positive"),
    ("f16", 768, {"THREADS": 32, "VEC": 8}, "lacks ROWS"),
])
def test_check_rejects_with_reason(dtype, hidden, cfg, reason):
    prob = problem(dtype, hidden, 4)
    why = FAMILY.check(prob, cfg, "sm_80")
    assert why is not None and reason in why, why
    with pytest.raises(ValueError, match="layernorm: "):
        FAMILY.instantiate(prob, cfg, "sm_80")
    assert FAMILY.check(prob, {"THREADS": 32, "VEC": 1, "ROWS": 1}, "sm_70") is not None


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("hidden", [192, 256, 384, 768, 1024, 200, 198, 49])
def test_configs_are_valid_and_fall_back_to_narrower_vectors(dtype, hidden):
    cfgs = FAMILY.configs(problem(dtype, hidden, 8), "sm_90")
    assert cfgs and all(FAMILY.check(problem(dtype, hidden, 8), c, "sm_90") is None for c in cfgs)
    widest = max(v for v in (8, 4, 2, 1) if hidden % v == 0 and v * (4 if dtype == "f32" else 2) <= 16)
    assert cfgs[0]["VEC"] == widest


def test_instance_name_and_fields():
    prob = problem("f16", 768, 4, residual=True)
    inst = FAMILY.instantiate(prob, {"THREADS": 128, "VEC": 4, "ROWS": 1}, "sm_80")
    assert inst.name == "layernorm_sm80_f16_h768_t128_v4_r1_res_sum" and inst.symbol == "gtco_" + inst.name
    assert [f.name for f in FAMILY.args_fields(prob, {"x": np.zeros((4, 768))})] == [
        "x", "residual", "gamma", "beta", "y", "sum", "rows", "hidden", "eps"]
    ins = FAMILY.random_inputs(prob, 1)
    assert all((from_storage(v, "f16") != 0).all() for v in ins.values())


PTXAS_CASES = [
    ("f16", 768, {"THREADS": 64, "VEC": 8, "ROWS": 2}, {"residual": True}),
    ("bf16", 1024, {"THREADS": 32, "VEC": 8, "ROWS": 4}, {"residual": True}),
    ("f16", 200, {"THREADS": 32, "VEC": 8, "ROWS": 4}, {}),
    ("bf16", 384, {"THREADS": 128, "VEC": 2, "ROWS": 1}, {"beta": False}),
    ("f32", 1024, {"THREADS": 128, "VEC": 4, "ROWS": 1}, {"residual": True}),
]


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ptxas_no_spills(tmp_path, arch):
    """All the instances in one translation unit (each exports its own symbol), one nvcc run per arch."""
    insts = [FAMILY.instantiate(problem(dt, h, 4, **fl), cfg, arch) for dt, h, cfg, fl in PTXAS_CASES]
    src = tmp_path / f"layernorm_{arch}.cu"
    src.write_text("\n".join(i.source for i in insts))
    result = nvcc_compile(src, tmp_path / "ln.o", arch, include_dirs=INCLUDES, timeout_s=120)
    kernels = [k for k in parse_ptxas(result.stderr) if "layernorm_kernel" in k.name]
    assert len(kernels) == len(PTXAS_CASES)
    for k in kernels:
        assert k.arch == arch and k.registers > 0, k
        assert not k.spills and k.stack_frame_bytes == 0, k
