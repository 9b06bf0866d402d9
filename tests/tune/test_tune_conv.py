"""Conv nodes as tuning tasks: their Problem is the one the library builds (the conv binder's, from x's and w's
shapes), identical convs merge, the analytical model prices the implicit GEMM and the direct kernel, the search
suggests only configurations the family checks, and the tuned configuration reaches the built instance and the
report."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from pins import CONV_KERNELS, pinned_calibration

from onnx_gtco import optimize
from onnx_gtco.calibration import LaunchConstants, hardware
from onnx_gtco.cli import main
from onnx_gtco.config import GtcoConfig, Ranges
from onnx_gtco.families.conv.bind import CONV
from onnx_gtco.families.conv.kernel import FAMILY, conv_problem
from onnx_gtco.families.gemm.kernel import gemm_problem
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.kernels.select import candidates, fastest
from onnx_gtco.plugin.device import device_problem
from onnx_gtco.plugin.library import CUDA_ARCHS, bind_nodes, build_library, library_info, select_device
from onnx_gtco.plugin.nodes import fused_nodes
from onnx_gtco.report_md import _tuning
from onnx_gtco.runtime.session import METADATA_KEY, make_session
from onnx_gtco.tune.analytical import estimate_us, tiling
from onnx_gtco.tune.apply import tune_model
from onnx_gtco.tune.search import AnalyticalMeasurer, analytical_guesses, check, predict_us, search_space
from onnx_gtco.tune.shape_generic import dynamic_tasks
from onnx_gtco.tune.tasks import Task, model_tasks

FP16 = GtcoConfig(precision="fp16", target="sm_90")
CPU = ["CPUExecutionProvider"]


def convnet(batch: int | str = 2, refused: bool = True) -> onnx.ModelProto:
    """Three identical 3x3 conv + BatchNormalization + ReLU blocks (ResNet's repeats), a depthwise 3x3, a strided
    1x1 with bias and, with `refused`, a strided 3x3 padded by auto_pad SAME_UPPER (a task: its pads come from x's
    shape) and, on a second input, a 3-D conv (no conv kernel takes it; the library then runs no node of its op type
    on its kernel)."""
    rng = np.random.default_rng(0)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name: str, *shape: int, positive: bool = False) -> str:
        v = rng.uniform(0.5, 1.5, shape) if positive else rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        inits.append(numpy_helper.from_array(v.astype(np.float32), name))
        return name

    def node(op: str, inputs: list[str], name: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    t = "x"
    for i in range(3):
        c = node("Conv", [t, const(f"b{i}_w", 16, 16, 3, 3)], f"b{i}", pads=[1, 1, 1, 1])
        bn = node("BatchNormalization", [c, const(f"b{i}_g", 16, positive=True), const(f"b{i}_b", 16),
                                         const(f"b{i}_m", 16), const(f"b{i}_v", 16, positive=True)], f"b{i}_bn")
        t = node("Relu", [bn], f"b{i}_relu")
    dw = node("Conv", [t, const("dw_w", 16, 1, 3, 3)], "dw", pads=[1, 1, 1, 1], group=16)
    pw = node("Conv", [dw, const("pw_w", 32, 16, 1, 1), const("pw_b", 32)], "pw", strides=[2, 2])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16, 16, 16])]
    outputs = [helper.make_tensor_value_info(pw, TensorProto.FLOAT, [batch, 32, 8, 8])]
    if refused:
        same = node("Conv", [pw, const("same_w", 32, 32, 3, 3)], "same", auto_pad="SAME_UPPER", strides=[2, 2])
        c3 = node("Conv", ["v", const("c3_w", 4, 2, 3, 3, 3)], "c3")
        inputs.append(helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 2, 6, 6, 6]))
        outputs = [helper.make_tensor_value_info(same, TensorProto.FLOAT, [batch, 32, 4, 4]),
                   helper.make_tensor_value_info(c3, TensorProto.FLOAT, [1, 4, 4, 4, 4])]
    graph = helper.make_graph(nodes, "convnet", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    with pinned_calibration(tmp_path_factory.mktemp("calibration"), "sm_90", **CONV_KERNELS):
        return optimize(convnet(), FP16).model  # the convs planned on our conv kernel


def test_conv_nodes_are_tasks_and_identical_ones_merge(rewritten: onnx.ModelProto) -> None:
    tasks, skipped = model_tasks(rewritten, "sm_90")
    assert all(t.problem.family == "conv" for t in tasks)
    by_nodes = {t.nodes: t for t in tasks}
    assert set(by_nodes) == {("gtco/conv/b0", "gtco/conv/b1", "gtco/conv/b2"), ("gtco/conv/dw",), ("gtco/conv/pw",),
                             ("gtco/conv/same",)}
    blocks = by_nodes[("gtco/conv/b0", "gtco/conv/b1", "gtco/conv/b2")]
    assert blocks.weight == 3 and blocks.problem.flag("batchnorm") and blocks.problem.flag("activation") == "relu"
    assert by_nodes[("gtco/conv/dw",)].problem.flag("groups") == 16
    pw = by_nodes[("gtco/conv/pw",)].problem
    assert (pw.size("C"), pw.size("H"), pw.size("OC"), pw.size("SH"), pw.flag("bias")) == (16, 16, 32, 2, True)
    # SAME_UPPER 3x3 / 2 on 8x8: a total pad of 1 per axis, at the end
    same = by_nodes[("gtco/conv/same",)].problem
    assert tuple(same.size(k) for k in ("H", "SH", "PT", "PL", "PB", "PR")) == (8, 2, 0, 0, 1, 1)
    # the binder's refusal is the reason, as the library gives it
    assert skipped == {
        "gtco/conv/c3": "Conv_f16 node 'gtco/conv/c3': a 3-D convolution; the kernel takes 1-D and 2-D ones"}


def test_a_conv_task_tunes_the_problem_the_library_builds(rewritten: onnx.ModelProto) -> None:
    tasks, _ = model_tasks(rewritten, "sm_90")
    task_of = {n: t for t in tasks for n in t.nodes}
    checked = 0
    for node in fused_nodes(rewritten):
        binding = CONV.bind(node)
        if node.node.name in task_of:
            assert not isinstance(binding, str), binding
            assert device_problem(node, binding) == task_of[node.node.name].problem, node.node.name
            checked += 1
    assert checked == 6


@pytest.mark.usefixtures("conv_kernels")
def test_the_plan_and_the_rewritten_model_give_the_same_conv_tasks() -> None:
    """The plan's shapes (what optimize tunes with) and the rewritten model's value_info agree, and the planner's
    lookup of measured times (pipeline.measured_time, on the candidates before the rewrite) finds the conv tasks
    by the same keys, and not the 3-D conv, whose binder refuses it there too."""
    result = optimize(convnet(), FP16)
    a, why_a = model_tasks(result.model, "sm_90")
    b, why_b = model_tasks(result.model, "sm_90", result.shape_of())
    assert [(t.key, t.weight, t.nodes) for t in a] == [(t.key, t.weight, t.nodes) for t in b] and why_a == why_b
    measured = optimize(convnet(), FP16, measured_us={t.key: 0.25 for t in a}).report
    timed = {g["name"] for g in measured["groups"] if g.get("measured_us") == 0.25}
    assert timed == {n for t in a for n in t.nodes}


@pytest.mark.usefixtures("conv_kernels")  # the convs planned on our conv kernel
def test_conv_has_no_run_time_extent_for_the_shape_generic_tuner() -> None:
    result = optimize(convnet(batch="batch"), GtcoConfig(precision="fp16", dynamic=(("batch", 1, 8),)))
    tasks, skipped = dynamic_tasks(result.model, "sm_90", result.dynamic or Ranges())
    assert not tasks and skipped["gtco/conv/b0"] == "conv kernels do not dispatch on a run-time size"
    problem = model_tasks(result.model, "sm_90")[0][0].problem  # its symbolic batch stands as 1 for the tile
    assert problem.size("N") == 1
    with pytest.raises(ValueError, match="conv kernels have no tiling"):
        tiling(problem, FAMILY.configs(problem, "sm_90")[0], "sm_90")


BIG = conv_problem("f16", 32, 256, 14, 14, 1024, 1, 1, batchnorm=True)      # a ResNet-50 stage-3 1x1, batch 32
STEM = conv_problem("f16", 8, 3, 224, 224, 64, 7, 7, stride=(2, 2), pads=(3, 3, 3, 3), batchnorm=True,
                    activation="relu")                                        # K = 147: element-wise weights
DEPTHWISE = conv_problem("f16", 1, 96, 112, 112, 96, 3, 3, pads=(1, 1, 1, 1), groups=96)


@pytest.mark.parametrize("problem", [BIG, STEM, DEPTHWISE], ids=["big", "stem", "depthwise"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_suggestion_is_checked_and_each_kernel_keeps_its_own_keys(problem, arch: str) -> None:
    """A trial suggests the direct kernel's keys (DIRECT fixed at 1) for a grouped conv and the implicit GEMM's for
    the others; every combination either builds an instance of that kernel or fails the family's check with a
    reason, and the study's first guesses are valid ones."""
    task = Task(problem, arch, "v")
    space = search_space(task)
    grouped = problem.flag("groups", 1) != 1
    assert set(space) == ({"DIRECT", "THREADS"} if grouped else {"BM", "BN", "BK", "WM", "WN", "STAGES", "VEC"})
    assert not grouped or space["DIRECT"] == [1]
    valid = 0
    for values in itertools.product(*space.values()):
        config = dict(zip(space, values, strict=True))
        why = check(task, config)
        if why is None:
            valid += 1
            name = FAMILY.instantiate(problem, config, arch).name
            assert ("_direct_" in name) == grouped, name
        else:
            assert isinstance(why, str) and why
    assert valid
    assert all(check(task, c) is None for c in analytical_guesses(task))


def test_the_analytical_model_ranks_conv_configurations() -> None:
    big = Task(BIG, "sm_90", "v")
    ranked = sorted((c for c in (dict(zip(search_space(big), v, strict=True))
                                 for v in itertools.product(*search_space(big).values())) if check(big, c) is None),
                    key=lambda c: predict_us(big, c))
    best = ranked[0]
    assert best["BM"] * best["BN"] >= 128 * 64 and best["VEC"] == 1, best  # a real tile, 16-byte weight loads
    assert predict_us(big, best) < predict_us(big, ranked[-1]) / 3
    # the A gather bounds it: element-wise weight loads (VEC = 0) cost no less, here no more
    assert predict_us(big, best) <= predict_us(big, {**best, "VEC": 0})
    # the im2col gather reads A element by element: dearer than the same GEMM's cp.async A tile
    m, n, k = 32 * 14 * 14, 1024, 256
    gemm = gemm_problem("f16", 1, m, n, k, b_batched=False, trans_b=True, bias=False, activation="none",
                        residual=False, alpha=1.0)
    assert estimate_us(BIG, best, "sm_90") > estimate_us(gemm, best, "sm_90")
    # the stem's K = 147 takes element-wise weight loads only
    stem = Task(STEM, "sm_90", "v")
    assert all(g["VEC"] == 0 for g in analytical_guesses(stem))
    # the depthwise conv: the direct kernel, priced near its bytes at the bandwidth (9 FMAs an output)
    dw = Task(DEPTHWISE, "sm_90", "v")
    guess = analytical_guesses(dw)[0]
    assert guess["DIRECT"] == 1
    floor = hardware("sm_90").constants(LaunchConstants).floor_us
    assert 2 * 96 * 112 * 112 * 2 / 3350e3 < predict_us(dw, guess) - floor < 2 * (3 * 96 * 112 * 112 * 2 / 3350e3)


@pytest.mark.usefixtures("conv_kernels")  # the convs planned on our conv kernel
def test_tuning_end_to_end_puts_the_conv_winner_in_the_report_and_the_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """optimize --tune-trials with the analytical measurer: the report lists each conv task with its kernel,
    configuration and time per node, and the library's instance for a conv node is built from that
    configuration, not the family's default (which the model ranks below it here)."""
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "convnet.onnx"
    onnx.save(convnet(refused=False), str(src))  # a refused node of the op type would leave every conv unbound
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    assert main(["optimize", str(src), "--no-build", "--precision", "fp16", "--target", "sm_90", "--tune-trials",
                 "6", "--storage", url, "--report-md"]) == 0
    out = tmp_path / "convnet.gtco.onnx"
    tuning = json.loads(out.with_name(out.name + ".report.json").read_text())["tuning"]
    entries = {tuple(e["nodes"]): e for e in tuning["tasks"]}
    blocks = entries[("gtco/conv/b0", "gtco/conv/b1", "gtco/conv/b2")]
    assert blocks["impl"] == "implicit_gemm" and blocks["weight"] == 3 and blocks["best_us"] > 0
    assert blocks["conv"] == "x 2x16x16x16, w 16x16x3x3, pads 1,1,1,1"
    assert entries[("gtco/conv/dw",)]["impl"] == "direct" and entries[("gtco/conv/dw",)]["best_config"]["DIRECT"] == 1
    assert not tuning["untuned"]
    markdown = out.with_name(out.name + ".report.md").read_text()
    assert "Conv kernels, times predicted by the estimate" in markdown
    config = " ".join(f"{k}={v}" for k, v in blocks["best_config"].items())
    assert (f"| gtco/conv/b0, gtco/conv/b1, gtco/conv/b2 | x 2x16x16x16, w 16x16x3x3, pads 1,1,1,1 | implicit GEMM "
            f"(Tensor Cores) | {config} |") in markdown

    # the build: the tuned configurations the storage holds for each node become its sm_90 instance
    model = onnx.load(str(out))
    _, tuned = tune_model(model, "sm_90", 0, url, measurer=AnalyticalMeasurer())
    nodes = fused_nodes(model)
    results, _ = bind_nodes(nodes)
    instances, _ = select_device(nodes, results, CUDA_ARCHS, tuned)
    plain, _ = select_device(nodes, results, CUDA_ARCHS)
    b0 = next(n for n in nodes if n.node.name == "gtco/conv/b0")
    problem = device_problem(b0, next(r.binding for r in results if r.node == "gtco/conv/b0"))
    sm90 = CUDA_ARCHS.index("sm_90")
    want = FAMILY.instance_name(problem, blocks["best_config"], "sm_90")
    # the tuned configuration (found in the family's whole space) reaches the library; the untuned build takes the
    # offered configuration the same estimate predicts fastest
    assert instances["gtco/conv/b0"][sm90].name == want
    pick = fastest(problem, "sm_90", candidates(problem, "sm_90"))
    assert pick is not None and plain["gtco/conv/b0"][sm90].name == FAMILY.instance_name(problem, pick[0], "sm_90")
    assert instances["gtco/conv/dw"][sm90].config == {"DIRECT": 1, "THREADS": entries[("gtco/conv/dw",)][
        "best_config"]["THREADS"]}


@pytest.mark.usefixtures("conv_kernels")  # the convs planned on our conv kernel
def test_an_emulated_build_runs_the_tuned_conv_instances(tmp_path: Path) -> None:
    """The library built with the tuner's sm_80 configurations (the emulated device's arch) names them as the conv
    nodes' instances and computes the model with them, on the CPU through the emulation, as the original does."""
    original = convnet(refused=False)
    model = optimize(original, GtcoConfig(precision="fp16", target="sm_80")).model
    report, tuned = tune_model(model, "sm_80", 6, "memory:conv-emulated", measurer=AnalyticalMeasurer())
    best = {n: e["best_config"] for e in report["tasks"] for n in e["nodes"]}
    lib = build_library(model, tmp_path, cuda=False, emulated=True, tuned=tuned)
    assert lib.cuda_op_types == ["Conv_f16"] and not lib.kernel_skips, lib.kernel_skips
    nodes = {n.node.name: n for n in fused_nodes(model)}
    instances = library_info(lib.path)["instances"]
    defaults = 0
    for name, node in nodes.items():
        problem = device_problem(node, CONV.bind(node))
        assert instances[name] == [FAMILY.instance_name(problem, best[name], "sm_80")], name
        defaults += best[name] == {k: v for k, v in FAMILY.configs(problem, "sm_80")[0].items() if k in best[name]}
    assert defaults < len(nodes)  # the tuner chose otherwise than the family's default somewhere
    model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
    onnx.save(model, str(tmp_path / "model.gtco.onnx"))
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 16, 16, 16)).astype(np.float32)}
    (want,) = ort.InferenceSession(original.SerializeToString(), providers=CPU).run(None, feeds)
    (got,) = make_session(tmp_path / "model.gtco.onnx", CPU, library=True).run(None, feeds)
    assert rel_error(got, want) < 1e-2


def test_the_report_has_a_conv_table_beside_the_gemm_one() -> None:
    entry = {"task": "conv-sm_90-0", "describe": "conv f16 ...", "weight": 2, "best_us": 5.5,
             "best_config": {"DIRECT": 1, "THREADS": 256}, "impl": "direct",
             "conv": "x 1x16x8x8, w 16x1x3x3, groups 16", "timing": "measured", "nodes": ["dw1", "dw2"]}
    text = "\n".join(_tuning({"tuning": {"measurer": "gpu", "device": "H100", "arch": "sm_90", "tasks": [entry]}}))
    assert "Conv kernels, times measured on the GPU" in text and "GEMM implementations" not in text
    row = "| dw1, dw2 | x 1x16x8x8, w 16x1x3x3, groups 16 | direct (CUDA cores) | DIRECT=1 THREADS=256 | 5.50 |"
    assert row in text
