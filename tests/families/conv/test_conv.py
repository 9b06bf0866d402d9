"""The conv family (plugins/families/conv/conv.cuh, onnx_gtco/families/conv/kernel.py): implicit-GEMM convolutions
through the CPU emulation against a float64 reference on ragged shapes (1x1, 3x3, 7x7, strides, asymmetric pads,
dilation 2, ViT's 16x16 / 16 patchify), every dtype and epilogue, deliberate faults that the comparison catches,
`check`'s reasons, the launcher's argument checks, and nvcc/ptxas resources for sm_80 and sm_90; the same for the direct
kernel of grouped and depthwise convs (depthwise 3x3 stride 1 and 2, groups 2 and 4 with several channels a group,
dilation 2, a channel multiplier, asymmetric pads)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from kernel_helpers import nvcc_missing, ptxas_of_cases

from onnx_gtco.errors import EmulationError
from onnx_gtco.families.conv.kernel import FAMILY, conv_problem, gemm_sizes
from onnx_gtco.kernels.emulate import build_emulated, run_emulated
from onnx_gtco.kernels.family import Field, Instance, Problem, from_storage, rel_error, to_storage

TOL = 2e-3                                           # against the fp64 reference rounded to the output dtype
RAW_TOL = {"f16": 2e-3, "bf16": 4e-3, "f32": 1e-5}  # against the unrounded one (f32: TF32-rounded operands)
JOBS = 2
EMU_FLAGS = ("-O1",)

# Emulated configurations: 128 threads gathering two A columns each (BM 64), one each (BM 128), 256 threads.
C1 = {"BM": 64, "BN": 32, "BK": 32, "WM": 2, "WN": 2, "STAGES": 2}   # warp tile 32x16
C2 = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}   # warp tile 32x32
C3 = {"BM": 128, "BN": 64, "BK": 32, "WM": 4, "WN": 1, "STAGES": 4}  # warp tile 32x64, 32 A elements a thread
C4 = {"BM": 128, "BN": 128, "BK": 32, "WM": 4, "WN": 2, "STAGES": 3}  # 8 warps, the default big tile

# (N, C, H, W, OC, KH, KW, stride, pads (t, l, b, r), dilation): ragged in every GEMM dim (M = N·OH·OW, OC, K)
SHAPES = {
    "1x1": (2, 40, 9, 11, 24, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1)),
    "1x1_s2": (2, 16, 13, 13, 36, 1, 1, (2, 2), (0, 0, 0, 0), (1, 1)),
    "3x3_p1": (2, 8, 12, 10, 20, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)),
    "3x3_s2": (2, 5, 15, 14, 12, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1)),
    "7x7_s2": (2, 3, 20, 18, 16, 7, 7, (2, 2), (3, 3, 3, 3), (1, 1)),
    "3x3_d2": (2, 6, 13, 12, 10, 3, 3, (1, 1), (2, 2, 2, 2), (2, 2)),
    "patch16": (2, 3, 32, 48, 24, 16, 16, (16, 16), (0, 0, 0, 0), (1, 1)),
    "asym": (1, 7, 9, 10, 9, 3, 2, (1, 2), (0, 1, 2, 0), (1, 1)),
}
BN_RELU = {"batchnorm": True, "activation": "relu"}
BLOCK_END = {"batchnorm": True, "activation": "none", "residual": True, "post_activation": "relu"}  # ResNet
FROZEN = {"scale": True, "shift": True, "activation": "relu"}  # DETR's FrozenBatchNorm Mul / Add
# (id, config, dtype, flags, shapes): each dtype meets the padded, strided, dilated and patchify shapes
GRID = [
    ("c1-f16-bias", C1, "f16", {"bias": True}, ["1x1", "3x3_s2", "patch16", "asym"]),
    ("c2-f16-block", C2, "f16", BLOCK_END, ["1x1_s2", "3x3_p1", "7x7_s2", "3x3_d2"]),
    ("c3-bf16-bnrelu", C3, "bf16", BN_RELU, ["1x1", "3x3_s2", "3x3_d2", "7x7_s2"]),
    ("c1-bf16-frozen", C1, "bf16", {**FROZEN, "residual": True}, ["3x3_p1", "patch16", "asym"]),
    ("c2-f32-bnrelu", C2, "f32", {**BN_RELU, "bias": True}, ["1x1", "3x3_p1", "7x7_s2", "3x3_d2"]),
    ("c4-f32-bias", C4, "f32", {"bias": True, "activation": "gelu_erf"}, ["1x1_s2", "3x3_s2", "patch16"]),
    ("c4-f16-block", C4, "f16", BLOCK_END, ["3x3_p1", "asym"]),
]
FAULTS = {"pad_added": "GTCO_CONV_TEST_FAULT=1", "no_row_dilation": "GTCO_CONV_TEST_FAULT=2"}

# Grouped and depthwise convs, the direct kernel: (N, C, H, W, OC, KH, KW, stride, pads, dilation, groups), ragged
# planes (no size a multiple of the block), C/groups and OC/groups above 1 where the groups are not depthwise.
DIRECT_SHAPES = {
    "dw3x3_p1": (2, 12, 11, 13, 12, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 12),   # SegFormer's Mix-FFN conv
    "dw3x3_s2": (2, 10, 15, 14, 10, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 10),
    "g2": (2, 8, 9, 11, 6, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 2),              # 4 in, 3 out channels a group
    "g4_d2": (1, 12, 13, 12, 8, 3, 3, (1, 1), (2, 2, 2, 2), (2, 2), 4),         # 3 in, 2 out, dilation 2
    "dw_x2_asym": (2, 6, 10, 9, 12, 3, 2, (1, 2), (0, 1, 2, 0), (1, 1), 6),     # channel multiplier 2
}
DW_GELU = {"bias": True, "activation": "gelu_erf"}                                  # SegFormer's dwconv + GELU
BN_RELU_RES = {"batchnorm": True, "activation": "relu", "residual": True}
# (id, THREADS, dtype, flags): every dtype with both epilogues, over every direct shape
DIRECT_GRID = [
    ("d256-f16-gelu", 256, "f16", DW_GELU),
    ("d128-f16-bnres", 128, "f16", BN_RELU_RES),
    ("d256-bf16-gelu", 256, "bf16", DW_GELU),
    ("d128-bf16-bnres", 128, "bf16", BN_RELU_RES),
    ("d128-f32-gelu", 128, "f32", DW_GELU),
    ("d256-f32-bnres", 256, "f32", {**BN_RELU_RES, "post_activation": "relu"}),
]
DIRECT_TOL = {"f16": 2e-3, "bf16": 4e-3, "f32": 1e-6}  # f32: plain fp32 products, no TF32
DIRECT_FAULTS = {"pad_added": "GTCO_CONV_TEST_FAULT=1", "no_group_offset": "GTCO_CONV_TEST_FAULT=3"}


def problem(dtype: str, shape: str, flags: dict) -> Problem:
    n, c, h, w, oc, kh, kw, stride, pads, dil = SHAPES[shape]
    return conv_problem(dtype, n, c, h, w, oc, kh, kw, stride=stride, pads=pads, dilation=dil, **flags)


def direct_problem(dtype: str, shape: str, flags: dict) -> Problem:
    n, c, h, w, oc, kh, kw, stride, pads, dil, groups = DIRECT_SHAPES[shape]
    return conv_problem(dtype, n, c, h, w, oc, kh, kw, stride=stride, pads=pads, dilation=dil, groups=groups,
                        **flags)


def vec(prob: Problem) -> int:
    """1 where the weights' rows take 16-byte chunks (K % 8 halves / 4 floats), as configs chooses."""
    return int(gemm_sizes(prob)[2] % (4 if prob.dtype == "f32" else 8) == 0)


def _builds() -> dict[tuple, tuple[Instance, tuple[str, ...]]]:
    builds: dict[tuple, tuple[Instance, tuple[str, ...]]] = {}
    for key, config, dtype, flags, shapes in GRID:
        for shape in shapes:
            prob = problem(dtype, shape, flags)
            v = vec(prob)
            builds.setdefault((key, v), (FAMILY.instantiate(prob, {**config, "VEC": v}, "sm_80"), ()))
    for fault, define in FAULTS.items():
        prob = problem("f16", "3x3_d2", BLOCK_END)
        builds[("fault", fault)] = (FAMILY.instantiate(prob, {**C2, "VEC": 0}, "sm_80"), (*EMU_FLAGS, f"-D{define}"))
    for key, threads, dtype, flags in DIRECT_GRID:
        prob = direct_problem(dtype, "g2", flags)  # the instance serves every grouped shape
        builds[(key,)] = (FAMILY.instantiate(prob, {"DIRECT": 1, "THREADS": threads}, "sm_80"), ())
    for fault, define in DIRECT_FAULTS.items():
        prob = direct_problem("f16", "g4_d2", DW_GELU)
        builds[("direct-fault", fault)] = (FAMILY.instantiate(prob, {"DIRECT": 1, "THREADS": 128}, "sm_80"),
                                           (*EMU_FLAGS, f"-D{define}"))
    return builds


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """Every emulated instance of this file, built once, two at a time: key -> (instance, library path)."""
    out = tmp_path_factory.mktemp("conv_emu")

    def build(item):
        key, (inst, extra) = item
        return key, inst, build_emulated(inst, out / "_".join(map(str, key)), extra or EMU_FLAGS)

    with ThreadPoolExecutor(JOBS) as pool:
        return {key: (inst, lib) for key, inst, lib in pool.map(build, _builds().items())}


def run(inst: Instance, lib: Path, prob: Problem, seed: int = 0, inputs: dict | None = None
        ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    inputs = inputs if inputs is not None else FAMILY.random_inputs(prob, seed)
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    out = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, ["y"])
    return from_storage(out["y"], prob.dtype), inputs


def errors(got: np.ndarray, prob: Problem, inputs: dict[str, np.ndarray]) -> tuple[float, float]:
    ref = FAMILY.reference(prob, inputs)["y"]
    assert got.shape == ref.shape
    assert not np.isnan(got).any(), f"{np.count_nonzero(np.isnan(got))} NaN outputs (unwritten or poison read)"
    return rel_error(got, from_storage(to_storage(ref, prob.dtype), prob.dtype)), rel_error(got, ref)


# ---------------------------------------------------------------------------------------------------------------
# Numerics in the emulation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "config", "dtype", "flags", "shapes"), GRID, ids=[g[0] for g in GRID])
def test_grid_matches_fp64_reference(libs, key, config, dtype, flags, shapes):
    for shape in shapes:
        prob = problem(dtype, shape, flags)
        inst, lib = libs[(key, vec(prob))]
        got, inputs = run(inst, lib, prob)
        err, raw = errors(got, prob, inputs)
        assert err < TOL and raw < RAW_TOL[dtype], f"{key} {shape}: rel err {err:.3g} (rounded), {raw:.3g} (fp64)"


@pytest.mark.parametrize(("key", "threads", "dtype", "flags"), DIRECT_GRID, ids=[g[0] for g in DIRECT_GRID])
def test_direct_grid_matches_fp64_reference(libs, key, threads, dtype, flags):
    for shape in DIRECT_SHAPES:
        prob = direct_problem(dtype, shape, flags)
        inst, lib = libs[(key,)]
        assert inst.config == {"DIRECT": 1, "THREADS": threads}
        got, inputs = run(inst, lib, prob, seed=3)
        err, raw = errors(got, prob, inputs)
        assert err < TOL and raw < DIRECT_TOL[dtype], f"{key} {shape}: rel err {err:.3g} (rounded), {raw:.3g} (fp64)"


@pytest.mark.parametrize("fault", list(DIRECT_FAULTS))
def test_direct_deliberate_faults_are_caught(libs, fault):
    """A window origin that adds the padding, or every group reading the first group's input channels, fail."""
    prob = direct_problem("f16", "g4_d2", DW_GELU)
    inst, lib = libs[("direct-fault", fault)]
    got, inputs = run(inst, lib, prob)
    err, _ = errors(got, prob, inputs)
    assert err > 0.05, f"{fault}: rel err {err:.3g} went unnoticed"


def test_direct_launcher_rejects_groups_that_do_not_divide(libs):
    prob = direct_problem("f16", "g2", DW_GELU)
    inst, lib = libs[("d256-f16-gelu",)]
    inputs = FAMILY.random_inputs(prob, 0)
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    fields = [Field(f.name, f.kind, 4 if f.name == "groups" else f.value)  # 4 divides C = 8, not OC = 6
              for f in FAMILY.args_fields(prob, arrays)]
    with pytest.raises(EmulationError, match="returned error code 1"):
        run_emulated(lib, inst.symbol, fields, arrays, ["y"])


def test_one_value_per_channel_operands(libs):
    """Per-channel operands of one value (a scalar bias, BatchNormalization constants broadcast): step 0."""
    prob = problem("f16", "3x3_p1", BLOCK_END)
    inst, lib = libs[("c2-f16-block", vec(prob))]
    inputs = FAMILY.random_inputs(prob, 5)
    for key in ("scale", "mean"):
        inputs[key] = inputs[key][:1].copy()
    fields = FAMILY.args_fields(prob, inputs)
    assert {f.name: f.value for f in fields}["scale_step"] == 0
    got, _ = run(inst, lib, prob, inputs=inputs)
    err, _ = errors(got, prob, inputs)
    assert err < TOL


def test_tf32_is_not_exact_fp32(libs):
    """The f32 instance multiplies TF32 operands: it matches the TF32-rounded reference far better than the
    product of the unrounded fp32 operands (which it still meets to TF32 accuracy)."""
    prob = problem("f32", "3x3_p1", {**BN_RELU, "bias": True})
    inst, lib = libs[("c2-f32-bnrelu", 1)]
    got, inputs = run(inst, lib, prob, seed=2)
    err, _ = errors(got, prob, inputs)
    # the same sizes and epilogue through the 16-bit path's reference: it reads the fp32 arrays unrounded
    plain = FAMILY.reference(Problem.make("conv", "f16", dict(prob.sizes), dict(prob.flags)), inputs)["y"]
    assert err < 1e-5 < rel_error(got, plain) < 2e-3


@pytest.mark.parametrize("fault", list(FAULTS))
def test_deliberate_faults_are_caught(libs, fault):
    """A window origin that adds the padding, or kernel rows without their dilation, fail the comparison."""
    prob = problem("f16", "3x3_d2", BLOCK_END)
    inst, lib = libs[("fault", fault)]
    got, inputs = run(inst, lib, prob)
    err, _ = errors(got, prob, inputs)
    assert err > 0.05, f"{fault}: rel err {err:.3g} went unnoticed"


def test_wrong_padding_in_the_reference_is_caught(libs):
    """The comparison is sharp: the right kernel against a reference with its pads shifted by one fails."""
    prob = problem("f16", "3x3_p1", BLOCK_END)
    inst, lib = libs[("c2-f16-block", vec(prob))]
    got, inputs = run(inst, lib, prob)
    shifted = Problem.make("conv", "f16", {**dict(prob.sizes), "PT": 0, "PB": 2}, dict(prob.flags))
    assert rel_error(got, FAMILY.reference(shifted, inputs)["y"]) > 0.05


@pytest.mark.parametrize(("what", "change"), [
    ("no bias pointer", {"bias": ""}),
    ("a residual the instance lacks", None),
    ("step 2", {"scale_step": 2}),
    ("zero channels", {"c": 0}),
    ("K not a chunk multiple for VEC", {"c": 3}),
    ("groups 2 to the implicit GEMM", {"groups": 2}),
])
def test_launcher_rejects_bad_arguments(libs, what, change):
    prob = problem("f16", "1x1", {"bias": True})
    inst, lib = libs[("c1-f16-bias", 1)]
    inputs = FAMILY.random_inputs(prob, 0)
    arrays = {**inputs, **FAMILY.allocate_outputs(prob)}
    fields = FAMILY.args_fields(prob, arrays)
    if change is None:
        arrays["residual"] = np.zeros_like(arrays["y"])
        fields = [Field(f.name, f.kind, "residual") if f.name == "residual" else f for f in fields]
    else:
        fields = [Field(f.name, f.kind, change.get(f.name, f.value)) for f in fields]
    with pytest.raises(EmulationError, match="returned error code 1"):
        run_emulated(lib, inst.symbol, fields, arrays, ["y"])


# ---------------------------------------------------------------------------------------------------------------
# check / configs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("prob_kw", "config", "words"), [
    ({"groups": 4}, C2, "use the direct kernel"),
    ({}, {"DIRECT": 1, "THREADS": 256}, "DIRECT=1 with groups == 1"),
    ({"groups": 4}, {"DIRECT": 1, "THREADS": 64}, "THREADS=64"),
    ({"groups": 3}, {"DIRECT": 1, "THREADS": 128}, "does not divide"),
    ({}, {**C2, "VEC": 1, "kw": 3}, None),
    ({"activation": "hardswish"}, C2, "not fused"),
    ({}, {**C3, "WM": 2, "WN": 1}, "multiple of BM"),
    ({}, {**C3, "BK": 64}, "staged in registers"),
])
def test_check_reasons(prob_kw, config, words):
    config = dict(config)
    if config.pop("kw", None):  # K = 5·3·3 = 45 with VEC=1
        prob = conv_problem("f16", 1, 5, 8, 8, 16, 3, 3)
        assert "VEC=0" in FAMILY.check(prob, config, "sm_80")
        assert FAMILY.check(prob, {**config, "VEC": 0}, "sm_80") is None
        return
    prob = conv_problem("f16", 1, 16, 8, 8, 16, 3, 3, **prob_kw)
    why = FAMILY.check(prob, config, "sm_80")
    assert why is not None and words in why, why


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_configs_are_valid_for_the_target_shapes(arch):
    for prob in NVCC_PROBLEMS.values():
        configs = FAMILY.configs(prob, arch)
        assert configs and all(FAMILY.check(prob, c, arch) is None for c in configs), prob
        if prob.flag("groups", 1) == 1:
            assert configs[0]["VEC"] == vec(prob) and not any(c.get("DIRECT") for c in configs)
        else:
            assert all(c["DIRECT"] == 1 for c in configs)
            assert all(FAMILY.check(prob, {**c, "VEC": 1}, arch) is not None for c in FAMILY.configs(
                NVCC_PROBLEMS["r50_3x3"], arch))  # no GEMM config passes a grouped problem


def test_instance_name_and_source():
    inst = FAMILY.instantiate(problem("bf16", "3x3_p1", BLOCK_END), {**C2, "VEC": 1}, "sm_90")
    assert inst.name == "conv_sm90_bf16_64x64x32_w2x2_s3_bn_res_post_relu"
    assert inst.symbol == "gtco_" + inst.name and '#include "conv/conv.cuh"' in inst.source
    assert "gtco::launch_conv<__nv_bfloat16, 64, 64, 32, 2, 2, 3, /*EPI=*/30" in inst.source
    dw = FAMILY.instantiate(direct_problem("f16", "dw3x3_p1", DW_GELU), {"DIRECT": 1, "THREADS": 256}, "sm_80")
    assert dw.name == "conv_sm80_f16_direct_t256_bias_gelu_erf" and dw.smem_bytes == 0
    assert "gtco::launch_conv_direct<__half, 256, /*EPI=*/1, gtco::Act::kGeluErf, gtco::Act::kNone>" in dw.source


# ---------------------------------------------------------------------------------------------------------------
# nvcc / ptxas: no spills, no stack, on the target shapes
# ---------------------------------------------------------------------------------------------------------------
NVCC_PROBLEMS = {
    # ViT-B/16 patch embedding at batch 8: 16x16 / 16 on 224x224, bias
    "vit_patch": conv_problem("f16", 8, 3, 224, 224, 768, 16, 16, stride=(16, 16), bias=True),
    # ResNet-50 stem (DETR's backbone at 800x1066), 7x7 / 2, FrozenBatchNorm, ReLU; K = 147: VEC=0
    "r50_stem": conv_problem("bf16", 1, 3, 800, 1066, 64, 7, 7, stride=(2, 2), pads=(3, 3, 3, 3), scale=True,
                             shift=True, activation="relu"),
    # a bottleneck's 3x3 with BN + ReLU and its last 1x1 with the residual and the ReLU after it
    "r50_3x3": conv_problem("f16", 1, 128, 100, 134, 128, 3, 3, pads=(1, 1, 1, 1), batchnorm=True,
                            activation="relu"),
    "r50_1x1_res": conv_problem("f16", 1, 128, 100, 134, 512, 1, 1, batchnorm=True, residual=True,
                                post_activation="relu"),
    # SegFormer's overlapping patch embedding (7x7 / 4, pad 3) and its 1x1 fuse conv, TF32
    "segformer_embed": conv_problem("f32", 1, 3, 512, 512, 64, 7, 7, stride=(4, 4), pads=(3, 3, 3, 3), bias=True),
    "segformer_fuse": conv_problem("f32", 1, 1024, 128, 128, 256, 1, 1, batchnorm=True, activation="relu"),
    # grouped: SegFormer-B0's Mix-FFN depthwise 3x3 (stage 1, 128 channels at 128x128) + GELU in fp16 and TF32's
    # fp32, a ResNeXt 3x3 (32 groups of 4) with BN + ReLU + residual in bf16
    "segformer_dw": conv_problem("f16", 1, 128, 128, 128, 128, 3, 3, pads=(1, 1, 1, 1), groups=128, bias=True,
                                 activation="gelu_erf"),
    "segformer_dw_f32": conv_problem("f32", 1, 256, 64, 64, 256, 3, 3, pads=(1, 1, 1, 1), groups=256, bias=True,
                                     activation="gelu_erf"),
    "resnext_g32": conv_problem("bf16", 1, 128, 56, 56, 128, 3, 3, stride=(2, 2), pads=(1, 1, 1, 1), groups=32,
                                batchnorm=True, activation="relu", residual=True),
}


def _nvcc_cases() -> list[tuple[str, str, dict]]:
    cases = [(key, arch, FAMILY.configs(prob, arch)[0]) for key, prob in NVCC_PROBLEMS.items()
             for arch in ("sm_80", "sm_90")]
    cases += [("r50_3x3", "sm_80", c) for c in FAMILY.configs(NVCC_PROBLEMS["r50_3x3"], "sm_80")[1:]]
    cases += [("segformer_dw", "sm_80", c) for c in FAMILY.configs(NVCC_PROBLEMS["segformer_dw"], "sm_80")[1:]]
    return cases


NVCC_CASES = _nvcc_cases()


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv_nvcc")

    return ptxas_of_cases(FAMILY, NVCC_PROBLEMS, NVCC_CASES, out, JOBS)


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("case", range(len(NVCC_CASES)),
                         ids=[f"{k}-{a}-t{c['THREADS']}" if c.get("DIRECT") else
                              f"{k}-{a}-{c['BM']}x{c['BN']}x{c['BK']}w{c['WM']}x{c['WN']}s{c['STAGES']}v{c['VEC']}"
                              for k, a, c in NVCC_CASES])
def test_ptxas_no_spills(ptxas_reports, case):
    inst, kernels = ptxas_reports[case]
    convs = [k for k in kernels if "conv_kernel" in k.name or "conv_direct_kernel" in k.name]
    assert len(convs) == 1, kernels
    k = convs[0]
    print(f"{inst.name}: {k.registers} registers, spills {k.spills}, stack {k.stack_frame_bytes} B")
    assert k.arch == inst.arch
    assert 0 < k.registers <= 255, k
    assert not k.spills and k.stack_frame_bytes == 0, k
    if inst.smem_bytes <= 48 * 1024:
        assert k.smem_bytes == inst.smem_bytes, (k, inst.smem_bytes)
    else:
        assert k.smem_bytes == 0, k


def test_search_space_pins_vec_where_k_is_ragged():
    """The 7x7 stem on 3 channels (K = 147) never suggests 16-byte weight loads, which check refuses for it; a
    3x3 conv on 64 channels (K = 576) tunes both."""
    from onnx_gtco.tune.search import search_space
    from onnx_gtco.tune.tasks import Task

    stem = conv_problem("f16", 1, 3, 224, 224, 64, 7, 7, stride=(2, 2), pads=(3, 3, 3, 3))
    assert gemm_sizes(stem)[2] == 147 and search_space(Task(stem, "sm_80", "v"))["VEC"] == [0]
    body = conv_problem("f16", 1, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1))
    assert sorted(search_space(Task(body, "sm_80", "v"))["VEC"]) == [0, 1]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_conv_that_128x128_tiles_leave_idle_gets_the_tile_that_fills_the_gpu(arch):
    """ViT-B/16's patch embedding (196 x 768 output rows x channels per image): at batch 1 no small tile fills the
    GPU, so the one with the most blocks comes first; at batch 8 the biggest small tile that fills it."""
    from onnx_gtco.config import TARGETS

    sms = TARGETS[arch].sms

    def blocks(prob, c):
        m, n, _ = gemm_sizes(prob)
        return -(-m // c["BM"]) * -(-n // c["BN"])

    one = conv_problem("f16", 1, 3, 224, 224, 768, 16, 16, stride=(16, 16), bias=True)
    configs = FAMILY.configs(one, arch)
    assert all(blocks(one, configs[0]) >= blocks(one, c) for c in configs)
    eight = conv_problem("f16", 8, 3, 224, 224, 768, 16, 16, stride=(16, 16), bias=True)
    first = FAMILY.configs(eight, arch)[0]
    assert blocks(eight, first) >= sms and (first["BM"], first["BN"]) == (128, 64)
