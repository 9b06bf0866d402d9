"""RMSNorm family (onnx_gtco/families/rmsnorm/kernel.py: LayerNorm's kernel without the mean): emulated numerics
against an fp64 RMSNorm written out here, at fp16, bf16 and fp32 on ragged shapes; no beta ever; ptxas resources."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kernel_helpers import nvcc_missing, ptxas_of_cases

from onnx_gtco.families.rmsnorm.kernel import FAMILY
from onnx_gtco.kernels.emulate import build_emulated, run_emulated
from onnx_gtco.kernels.family import Problem, from_storage, np_dtype, rel_error, to_storage

# bf16: rounding the exact result to bf16 alone costs up to 2^-8, so the raw bound is the unit roundoff and the
# kernel's own error is measured against the reference rounded to the output dtype
RAW_TOL = {"f16": 2e-3, "bf16": 2**-8, "f32": 1e-5}
ROUNDED_TOL = {"f16": 5e-4, "bf16": 2e-3, "f32": 1e-5}


def problem(dtype: str, hidden: int, rows: int, **flags) -> Problem:
    return Problem.make("rmsnorm", dtype, {"hidden": hidden, "rows": rows}, flags)


def rmsnorm64(ins: dict[str, np.ndarray], prob: Problem) -> dict[str, np.ndarray]:
    """RMSNorm in fp64, written out (not the family's reference, which the test checks too)."""
    hidden, dt = prob.size("hidden"), prob.dtype
    x = from_storage(ins["x"], dt).reshape(-1, hidden)
    if "residual" in ins:
        x = x + from_storage(ins["residual"], dt).reshape(-1, hidden)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + float(np.float32(prob.flag("epsilon", 1e-5))))
    if "gamma" in ins:
        y = y * from_storage(ins["gamma"], dt)
    return {"y": y, "sum": x}


GRID = [  # dtype, hidden, rows, config, flags
    ("f16", 512, 5, {"THREADS": 64, "VEC": 8, "ROWS": 2}, {"residual": True}),              # LLaMA-style, res + sum
    ("bf16", 200, 7, {"THREADS": 32, "VEC": 8, "ROWS": 4}, {"residual": True}),             # ragged, warp/row
    ("f32", 384, 3, {"THREADS": 64, "VEC": 2, "ROWS": 2}, {"epsilon": 1e-6}),               # f32, 2 warps/row
    ("bf16", 1024, 2, {"THREADS": 256, "VEC": 4, "ROWS": 1}, {}),                           # 8 warps
    ("f32", 128, 9, {"THREADS": 32, "VEC": 2, "ROWS": 8}, {"gamma": False, "residual": True,
                                                           "residual_out": False}),      # a q/k head's norm
    ("f16", 100, 3, {"THREADS": 128, "VEC": 1, "ROWS": 1}, {"test_offset": 30.0}),          # scalar, large rows
]


@pytest.mark.parametrize(("dtype", "hidden", "rows", "cfg", "flags"), GRID,
                         ids=[f"{g[0]}-h{g[1]}-t{g[3]['THREADS']}v{g[3]['VEC']}r{g[3]['ROWS']}" for g in GRID])
def test_matches_fp64_rmsnorm(tmp_path: Path, dtype: str, hidden: int, rows: int, cfg: dict, flags: dict) -> None:
    prob = problem(dtype, hidden, rows, **flags)
    inst = FAMILY.instantiate(prob, cfg, "sm_80")
    assert "false>(args" in inst.source and inst.name.startswith("rmsnorm_")  # LayerNorm's launch, CENTER false
    ins = FAMILY.random_inputs(prob, hidden + rows)
    assert "beta" not in ins and ("gamma" in ins) == flags.get("gamma", True)
    arrays = {**ins, **{k: np.zeros(s, np_dtype(d)) for k, (s, d) in FAMILY.outputs(prob).items()}}
    got = run_emulated(build_emulated(inst, tmp_path, ("-O1",)), inst.symbol, FAMILY.args_fields(prob, arrays),
                       arrays, list(FAMILY.outputs(prob)))
    want, ref = rmsnorm64(ins, prob), FAMILY.reference(prob, ins)
    assert set(got) == set(ref) == ({"y", "sum"} if flags.get("residual") and flags.get("residual_out", True)
                                    else {"y"})
    for k, v in got.items():
        y = from_storage(v, dtype).reshape(want[k].shape)
        np.testing.assert_allclose(ref[k], want[k], rtol=1e-12)
        assert rel_error(y, want[k]) < RAW_TOL[dtype], k
        assert rel_error(y, from_storage(to_storage(want[k], dtype), dtype)) < ROUNDED_TOL[dtype], k


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("hidden", [64, 128, 200, 896, 2048, 49])
def test_configs_are_valid_and_never_take_beta(dtype: str, hidden: int) -> None:
    prob = problem(dtype, hidden, 8, beta=True)
    cfgs = FAMILY.configs(prob, "sm_90")
    assert cfgs and all(FAMILY.check(prob, c, "sm_90") is None for c in cfgs)
    assert "_nobeta" in FAMILY.instantiate(prob, cfgs[0], "sm_90").name


PTXAS_PROBLEMS = {"f16-4096-res": problem("f16", 4096, 4, residual=True), "bf16-896": problem("bf16", 896, 4),
                  "f32-2048-res": problem("f32", 2048, 4, residual=True), "f16-128": problem("f16", 128, 4)}
PTXAS_CASES = [(k, arch, c) for k, c in (("f16-4096-res", {"THREADS": 128, "VEC": 8, "ROWS": 1}),
                                        ("bf16-896", {"THREADS": 32, "VEC": 8, "ROWS": 4}),
                                        ("f32-2048-res", {"THREADS": 128, "VEC": 4, "ROWS": 1}),
                                        ("f16-128", {"THREADS": 32, "VEC": 4, "ROWS": 8}))
               for arch in ("sm_80", "sm_90")]


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
def test_ptxas_no_spills(tmp_path: Path) -> None:
    for inst, kernels in ptxas_of_cases(FAMILY, PTXAS_PROBLEMS, PTXAS_CASES, tmp_path).values():
        assert len(kernels) == 1 and kernels[0].registers > 0, inst.name
        assert not kernels[0].spills and kernels[0].stack_frame_bytes == 0, (inst.name, kernels[0])
