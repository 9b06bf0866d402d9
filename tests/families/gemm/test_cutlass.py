"""The CUTLASS Hopper GEMMs (onnx_gtco/families/gemm/cutlass.py, plugins/families/gemm/cutlass_gemm.cu.j2): which GEMM
problems map onto which template parameters and the reasons for those that do not; nvcc builds of the instances the zoo
models produce with the ptxas report checked; on a 9.0 GPU, their numerics against the fp64 reference."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np
import pytest
from kernel_helpers import nvcc_missing

from onnx_gtco.families.gemm import cutlass
from onnx_gtco.families.gemm.kernel import FAMILY, gemm_problem
from onnx_gtco.kernels.compile import compile_instances
from onnx_gtco.kernels.family import Problem, c_args, entry_point, from_storage, np_dtype, rel_error

needs_cutlass = pytest.mark.skipif(isinstance(cutlass.include_dirs(), str), reason=str(cutlass.include_dirs()))

COOP = {"impl": "cutlass", "TILE_M": 128, "TILE_N": 128, "TILE_K": 64, "CLUSTER_M": 1, "CLUSTER_N": 1,
        "SCHEDULE": "cooperative", "STAGES": 0, "RASTER": "heuristic", "TILE_SCHEDULER": "persistent"}
STREAMK = {**COOP, "TILE_SCHEDULER": "streamk"}
PINGPONG = {**COOP, "TILE_M": 64, "SCHEDULE": "pingpong", "CLUSTER_M": 2, "STAGES": 4, "RASTER": "n"}

# The GEMMs of the built-in zoo at fp16 (vit-tiny, bert-tiny; counted with plugin.device.device_problem) collapse to
# four epilogues over one dtype: bias (QKV and attention projections: 13 + 4 nodes, 2 QKV nodes), bias + residual
# (MLP second layer, attention output: 23), bias + GELU erf (MLP first layer: 12 + 2), and the classifier head, a Gemm
# with transB writing the fp32 graph output (bias, out_dtype f32: 1). B is a MatMul's [K, N] weight but for the head.
# A tanh GELU (GPT-2-style MLPs) adds a fifth instantiation at one tile. CI compiles CI_SET, two instances that
# between them take both B layouts, both schedules, stream-K, the residual's C source and GELU (one stream-K
# instance with GELU and the residual, which no zoo GEMM has together, and the pingpong one), about 60-67 s of one
# core each (nvcc 13.0); the rest share their code paths.
ZOO = [
    ("fc1_gelu_streamk", STREAMK, {"bias": True, "activation": "gelu_erf"}),
    ("fc2_residual", COOP, {"bias": True, "residual": True}),
    ("gemm_tb_pingpong", PINGPONG, {"trans_b": True, "bias": True}),
    ("proj_bias", COOP, {"bias": True}),
    ("head_tb_f32", COOP, {"trans_b": True, "bias": True, "out_dtype": "f32"}),
    ("fc1_gelu_tanh", COOP, {"bias": True, "activation": "gelu_tanh"}),
]
CI_SET = [("fc1_gelu_residual_streamk", STREAMK, {"bias": True, "activation": "gelu_erf", "residual": True}),
          ZOO[2]]


def zoo_problem(flags: dict, dtype: str = "f16", batch: int = 1, m: int = 197, n: int = 768, k: int = 768,
                b_batched: bool = False) -> Problem:
    return gemm_problem(dtype, batch, m, n, k, b_batched=b_batched, **flags)


# ------------------------------------------------------------------------------------------------------------------
# The mapping (pure logic)


@pytest.mark.parametrize("name, config, flags", ZOO, ids=[z[0] for z in ZOO])
def test_zoo_gemms_map_onto_the_cutlass_template(name: str, config: dict, flags: dict) -> None:
    p = zoo_problem(flags)
    assert FAMILY.check(p, config, "sm_90a") is None
    params = cutlass.template_params(p, config)
    assert params["element"] == "cutlass::half_t"
    assert params["layout_b"] == ("cutlass::layout::ColumnMajor" if flags.get("trans_b") else
                                  "cutlass::layout::RowMajor")
    assert params["element_d"] == ("float" if flags.get("out_dtype") == "f32" else "cutlass::half_t")
    assert params["element_c"] == ("cutlass::half_t" if flags.get("residual") else "void")
    assert params["tile_scheduler_type"] == ("cutlass::gemm::StreamKScheduler"
                                             if config["TILE_SCHEDULER"] == "streamk" else
                                             "cutlass::gemm::PersistentScheduler")
    assert params["mainloop_schedule"].endswith("Pingpong" if config["SCHEDULE"] == "pingpong" else "Cooperative")


def _leaves(node: dict) -> list[str]:
    return [node["leaf"]] if "leaf" in node else [x for c in node["children"] for x in _leaves(c)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["none", "relu", "gelu_erf", "gelu_tanh", "silu", "sigmoid", "tanh"])
@pytest.mark.parametrize("residual", [False, True])
def test_epilogue_tree_orders_scale_bias_activation_residual(bias: bool, act: str, residual: bool) -> None:
    p = zoo_problem({"bias": bias, "activation": act, "residual": residual, "alpha": 0.5})
    tree = cutlass.epilogue_tree(p)
    assert tree["out"] == "cutlass::half_t"  # the root converts to y's dtype
    assert _leaves(tree) == ["alpha", "acc", *(["bias"] if bias else []), *(["src"] if residual else [])]
    chain = []
    node = tree
    while "op" in node:
        chain.append(node["op"])
        node = node["children"][0]
        if "op" in node:
            assert node["out"] == "float"  # inner nodes stay in fp32
    want = (["cutlass::plus"] if residual else []) + ([cutlass.ACTIVATIONS[act]] if act != "none" else [])
    want.append("cutlass::homogeneous_multiply_add" if bias else "cutlass::multiplies")
    assert chain == want


@pytest.mark.parametrize("problem, config, arch, reason", [
    (zoo_problem({"activation": "quick_gelu"}), COOP, "sm_90a", "activation 'quick_gelu' has no CUTLASS"),
    (zoo_problem({"activation": "relu6"}), COOP, "sm_90a", "activation 'relu6' has no CUTLASS"),
    (zoo_problem({}, dtype="f32"), {**COOP, "TILE_K": 32}, "sm_90a", "TF32 with a [K, N] B"),
    (zoo_problem({}, n=197), COOP, "sm_90a", "N=197: TMA needs rows of 16-byte multiples"),
    (zoo_problem({}, k=36), COOP, "sm_90a", "K=36: TMA"),
    (Problem.make("gemm", "f16", {"batch": 1, "M": 8, "N": 64, "K": 64}, {"layout": "head_split"}), COOP, "sm_90a",
     "flag(s) layout are not expressed"),
    (zoo_problem({"layer_scale": True}), COOP, "sm_90a", "layer_scale: the epilogue tree here has no per-column"),
    (zoo_problem({}), COOP, "sm_90", "built for sm_90a only"),
    (zoo_problem({}), {**COOP, "TILE_K": 32}, "sm_90a", "TILE_K=32: 64 B rows"),
    (zoo_problem({}), {**COOP, "TILE_M": 64}, "sm_90a", "cooperative schedule splits"),
    (zoo_problem({}), {**PINGPONG, "TILE_M": 256}, "sm_90a", "ping-pong warp group owns a whole tile"),
    (zoo_problem({}), {**COOP, "TILE_M": 256, "TILE_N": 256}, "sm_90a", "256 fp32 accumulators"),
    (zoo_problem({}), {**COOP, "CLUSTER_M": 2, "CLUSTER_N": 2}, "sm_90a", "at most 2 CTAs"),
    (zoo_problem({}), {**PINGPONG, "TILE_SCHEDULER": "streamk"}, "sm_90a", "stream-K needs the cooperative"),
    (zoo_problem({}), {**COOP, "TILE_N": 256, "STAGES": 7}, "sm_90a", "7 stages"),
    (zoo_problem({}), {**COOP, "RASTER": "diagonal"}, "sm_90a", "RASTER='diagonal' is outside"),
    (zoo_problem({}), {"impl": "cutlass", "TILE_M": 128}, "sm_90a", "config lacks TILE_N"),
    (zoo_problem({}), {**COOP, "impl": "cudnn"}, "sm_90a", "impl 'cudnn': choose one of mma"),
])
def test_what_the_mapping_cannot_express_is_a_reason(problem: Problem, config: dict, arch: str, reason: str) -> None:
    why = FAMILY.check(problem, config, arch)
    assert why is not None and reason in why, why
    with pytest.raises(ValueError) as raised:
        FAMILY.instantiate(problem, config, arch)
    assert str(raised.value) == why


@needs_cutlass
def test_sm90a_offers_cutlass_configs_and_the_other_archs_keep_theirs() -> None:
    p = zoo_problem({"bias": True, "activation": "gelu_erf"}, m=197 * 8, n=3072)
    offered = FAMILY.configs(p, "sm_90a")
    assert offered and all(c["impl"] == "cutlass" and FAMILY.check(p, c, "sm_90a") is None for c in offered)
    assert len({FAMILY.instance_name(p, c, "sm_90a") for c in offered}) == len(offered)
    for arch in ("sm_80", "sm_90"):
        assert FAMILY.configs(p, arch) and all("impl" not in c for c in FAMILY.configs(p, arch))
    # 13 x 24 = 312 tiles are 2 waves of 132 SMs and a third of 48: stream-K first; 264 tiles fill 2 waves exactly
    assert offered[0]["TILE_SCHEDULER"] == "streamk"
    even = FAMILY.configs(zoo_problem({"bias": True}, m=128 * 11, n=128 * 24), "sm_90a")
    assert even[0]["TILE_SCHEDULER"] == "persistent"
    assert FAMILY.configs(zoo_problem({"activation": "relu6"}), "sm_90a") == []


def test_without_the_package_nothing_is_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cutlass, "include_dirs", lambda: "nvidia-cutlass is not installed")
    p = zoo_problem({"bias": True})
    assert FAMILY.configs(p, "sm_90a") == []
    with pytest.raises(ValueError, match="nvidia-cutlass is not installed"):
        FAMILY.instantiate(p, COOP, "sm_90a")


@needs_cutlass
def test_instances_have_procedural_names_and_render_their_parameters() -> None:
    p = zoo_problem({"trans_b": True, "bias": True, "activation": "gelu_erf", "residual": True})
    inst = FAMILY.instantiate(p, PINGPONG, "sm_90a")
    assert inst.name == "gemm_sm90a_cutlass_f16_64x128x64_c2x1_pp_s4_rn_dp_tb_bias_gelu_erf_res"
    assert inst.symbol == f"gtco_{inst.name}" and inst.arch == "sm_90a" and inst.config["impl"] == "cutlass"
    src = inst.source
    for text in ("cute::Shape<cute::_64, cute::_128, cute::_64>", "cute::Shape<cute::_2, cute::_1, cute::_1>",
                 "KernelTmaWarpSpecializedPingpong", "StageCount<4>", "Raster::AlongN", "PersistentScheduler",
                 "cutlass::layout::ColumnMajor", "epilogue::thread::GELU,", f"int {inst.symbol}(const GemmArgs*",
                 f"CUTLASS {cutlass.version()}"):
        assert text in src, text
    assert [Path(d).is_dir() for d in inst.include_dirs] == [True, True]
    assert "--expt-relaxed-constexpr" in inst.nvcc_flags


# ------------------------------------------------------------------------------------------------------------------
# nvcc: the CI set compiles for sm_90a with no spill and no local memory (kernels.compile checks the ptxas report)


@pytest.mark.nvcc
@pytest.mark.slow
@needs_cutlass
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found")
def test_ci_set_compiles_without_spills(record_property: pytest.RecordProperty) -> None:
    instances = [FAMILY.instantiate(zoo_problem(flags), config, "sm_90a") for _, config, flags in CI_SET]
    start = time.monotonic()
    built = compile_instances(instances, jobs=2)  # the content-hash cache: a second run compiles nothing
    wall = time.monotonic() - start
    for b in built:
        assert b.kernels and all(not k.spills and k.stack_frame_bytes == 0 for k in b.kernels), b.summary()
        assert all(k.arch == "sm_90a" for k in b.kernels)
        assert b.object_path.is_file() and b.object_path.stat().st_size > 0
        record_property(f"nvcc_s[{b.instance.name}]", round(b.seconds, 1))
    print("nvcc seconds per instance:", {b.instance.name: round(b.seconds, 1) for b in built}, f"wall {wall:.0f} s")


# ------------------------------------------------------------------------------------------------------------------
# GPU: numerics against the fp64 reference (the GEMM family's), on a 9.0 device


def _hopper() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0 and cupy.cuda.Device().compute_capability == "90"
    except Exception:  # no CuPy, no driver, no device
        return False


TOLERANCE = {"f16": 2e-3, "bf16": 8e-3, "f32": 2e-3}  # f32: TF32 operands against the unrounded fp64 reference

GPU_CASES = [
    # (config, dtype, batch, M, N, K, b_batched, flags): tails in M and N, a shared B folded into M, batched B
    (STREAMK, "f16", 1, 197, 3072, 768, False, {"bias": True, "activation": "gelu_erf"}),
    (COOP, "f16", 2, 197, 768, 3072, False, {"bias": True, "residual": True, "alpha": 0.5}),
    (PINGPONG, "bf16", 3, 100, 136, 64, True, {"trans_b": True, "activation": "gelu_tanh"}),
    (COOP, "f16", 1, 130, 264, 512, False, {"bias": True, "activation": "relu", "out_dtype": "f32"}),
    ({**COOP, "TILE_K": 32}, "f32", 1, 130, 264, 256, False, {"trans_b": True, "bias": True, "residual": True}),
]


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.slow
@needs_cutlass
@pytest.mark.skipif(not _hopper(), reason="needs CuPy and a compute capability 9.0 GPU (sm_90a code)")
@pytest.mark.parametrize("config, dtype, batch, m, n, k, b_batched, flags", GPU_CASES)
def test_cutlass_instance_matches_fp64_reference(config: dict, dtype: str, batch: int, m: int, n: int, k: int,
                                                 b_batched: bool, flags: dict) -> None:
    import cupy as cp

    from onnx_gtco.tune.gpu import shared_library

    p = gemm_problem(dtype, batch, m, n, k, b_batched=b_batched, **flags)
    inst = FAMILY.instantiate(p, config, "sm_90a")
    lib = shared_library(inst)
    assert not hasattr(lib, "error_kind"), lib
    host = FAMILY.random_inputs(p, seed=7)
    dev = {key: cp.asarray(v) for key, v in host.items()}
    outs = {key: cp.full(shape, np.nan, np_dtype(dt)) if dt == "f32" else
            cp.full(shape, 0xFFFF, np.uint16).view(np_dtype(dt)) for key, (shape, dt) in FAMILY.outputs(p).items()}
    arrays = {**dev, **outs}
    fields = FAMILY.args_fields(p, {key: np.empty(v.shape, v.dtype) for key, v in arrays.items()})
    args = c_args(fields, lambda name: int(arrays[name].data.ptr) if name in arrays else None)
    fn = entry_point(str(lib), inst.symbol, args)
    stream = cp.cuda.Stream(non_blocking=True)
    assert fn(ctypes.byref(args), stream.ptr) == 0
    stream.synchronize()
    want = FAMILY.reference(p, host)["y"]
    got = from_storage(cp.asnumpy(outs["y"]), FAMILY.outputs(p)["y"][1])
    err = rel_error(got, want)
    assert err < TOLERANCE[dtype], f"{inst.name}: relative error {err:.3g} against the fp64 reference"
    # a wrong size is refused with GTCO_EBADSHAPE, not run
    bad = c_args([f if f.name != "k" else type(f)("k", "i64", k + 1) for f in fields],
                 lambda name: int(arrays[name].data.ptr) if name in arrays else None)
    assert fn(ctypes.byref(bad), stream.ptr) == 1
