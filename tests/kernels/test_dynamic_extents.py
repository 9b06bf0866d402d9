"""Shape-generic kernels: one built instance of each family serves every run-time extent (onnx_gtco.kernels.dynamic),
1, primes and sizes that are no multiple of any tile included, and matches the fp64 reference at each (CPU
emulation). The elementwise family is built per static shape and is not dispatched on size."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_gtco.families.attention.kernel import make_problem
from onnx_gtco.families.gemm.kernel import gemm_problem
from onnx_gtco.kernels.dynamic import extent_name, with_extent
from onnx_gtco.kernels.emulate import build_emulated, run_emulated
from onnx_gtco.kernels.family import Problem, from_storage, rel_error, to_storage
from onnx_gtco.kernels.select import FAMILIES

EXTENTS = (1, 7, 61, 131)  # 1, primes, 131 = three past a 128 tile
TOL = 5e-3  # fp16 I/O, fp32 accumulation (the families' own tests use 2e-3..5e-3)

PROBLEMS: dict[str, Problem] = {  # each at extent 1; the built instance is chosen for it
    "gemm": gemm_problem("f16", 1, 1, 72, 40, bias=True, activation="gelu_erf", residual=True),
    "attention": make_problem("attention", "f16", batch=2, heads=2, seq_q=1, head_dim=32, mask=True,
                              q_layout="bshd_merged", k_layout="bshd_merged", v_layout="bshd_merged",
                              out_layout="bshd_merged"),
    "bmm_softmax": make_problem("bmm_softmax", "f16", batch=1, heads=2, seq_q=1, head_dim=64, mask=True,
                                k_layout="bhds"),
    "layernorm": Problem.make("layernorm", "f16", {"hidden": 72, "rows": 1},
                              {"residual": True, "residual_out": True, "epsilon": 1e-12}),
    "softmax": Problem.make("softmax", "f16", {"rows": 1, "cols": 37}, {"scale": None, "mask": False}),
}


def test_with_extent_sets_the_families_run_time_size() -> None:
    assert [extent_name(f) for f in ("gemm", "qkv", "attention", "bmm_softmax", "layernorm", "softmax",
                                     "elementwise")] == ["M", "M", "seq_q", "seq_q", "rows", "rows", None]
    attn = PROBLEMS["attention"]
    assert with_extent(attn, 13).size("seq_q") == with_extent(attn, 13).size("seq_k") == 13  # self-attention
    cross = make_problem("attention", "f16", batch=1, heads=1, seq_q=4, seq_k=50, head_dim=32, mask=True,
                         mask_shape=(1, 1, 4, 50))
    moved = with_extent(cross, 9)
    assert (moved.size("seq_q"), moved.size("seq_k"), moved.flag("mask_shape")) == (9, 50, (1, 1, 9, 50))
    assert with_extent(PROBLEMS["gemm"], 300).size("M") == 300
    with pytest.raises(ValueError, match="no run-time extent"):
        with_extent(Problem.make("elementwise", "f16", {"n": 4}), 3)


@pytest.mark.parametrize("family", list(PROBLEMS))
def test_one_instance_serves_every_extent(tmp_path_factory, family: str) -> None:
    fam = FAMILIES[family]
    base = PROBLEMS[family]
    config = fam.configs(base, "sm_80")[0]
    inst = fam.instantiate(base, config, "sm_80")
    lib = build_emulated(inst, tmp_path_factory.mktemp(f"dyn_{family}"), ("-O1",))
    for n in EXTENTS:
        problem = with_extent(base, n)
        assert fam.instantiate(problem, config, "sm_80").source == inst.source  # nothing depends on the extent
        inputs = fam.random_inputs(problem, seed=n)
        outputs = {k: to_storage(np.full(shape, np.nan), dt)  # NaN: an element the kernel never writes shows
                   for k, (shape, dt) in fam.outputs(problem).items()}
        arrays = {**inputs, **outputs}
        got = run_emulated(lib, inst.symbol, fam.args_fields(problem, arrays), arrays, list(outputs))
        for name, want in fam.reference(problem, inputs).items():
            out = from_storage(got[name], fam.outputs(problem)[name][1]).reshape(want.shape)
            assert not np.isnan(out).any(), f"{family} at {n}: unwritten or NaN outputs"
            assert rel_error(out, want) < TOL, (family, n, rel_error(out, want))
