"""Which fused nodes get device kernels (plugin.coverage), decided without compiling: on a rewritten model it is what
the library builder's binders and device selection say, and a candidate group asked before the rewrite gets the
same answer as its node after it."""

from __future__ import annotations

import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pins import CONV_KERNELS, pinned_calibration

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.models import build
from onnx_gtco.plugin.coverage import Coverage, candidate_coverage, model_coverage
from onnx_gtco.plugin.device import ARCH_SLOTS, device_instances
from onnx_gtco.plugin.library import bind_nodes
from onnx_gtco.plugin.nodes import fused_nodes


def mlp(elem: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """x @ w + b -> Relu -> LayerNormalization: one GEMM group and one LayerNorm group."""
    dt = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 128)).astype(dt), "w"),
             numpy_helper.from_array(rng.standard_normal(128).astype(dt), "b"),
             numpy_helper.from_array(np.ones(128, dt), "g"), numpy_helper.from_array(np.zeros(128, dt), "be")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("LayerNormalization", ["r", "g", "be"], ["y"], name="ln", axis=-1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", elem, [16, 64])],
                              [helper.make_tensor_value_info("y", elem, [16, 128])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory):
    """The built-in ViT with its patch embedding kept a conv on our conv kernel, so every family has a node."""
    with pinned_calibration(tmp_path_factory.mktemp("cal"), "sm_90", **CONV_KERNELS):
        return optimize(build("vit-tiny", seed=0), GtcoConfig(target="sm_90", patchify=False))


def _where(c: Coverage) -> tuple[tuple[str, ...], str | None]:
    """Where a node runs: its arch slots, or why none (the planner's Coverage also holds the target slot's kernel
    and its estimate, which a rewritten model's coverage leaves out)."""
    return c.archs, c.reason


def _no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"coverage ran a process: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_model_coverage_is_what_binding_and_device_selection_say(vit, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_subprocess(monkeypatch)  # no compiler, no nvcc: a property of the nodes and the kernel families
    cov = model_coverage(vit.model)
    assert cov.archs == ARCH_SLOTS and cov.error is None
    got = cov.nodes
    nodes = fused_nodes(vit.model)
    results, _ = bind_nodes(nodes)
    assert set(got) == {r.node for r in results} == {g["name"] for g in vit.report["groups"]}
    by_name = {n.node.name: n for n in nodes}
    for r in results:
        own = r.reason or device_instances(by_name[r.node], r.binding, ARCH_SLOTS)
        if isinstance(own, str):
            assert got[r.node].archs == () and got[r.node].reason
        else:  # a node with instances of its own keeps them unless a sibling of its op type has none
            assert got[r.node].archs in ((), ARCH_SLOTS)
    families = {}
    for n in nodes:
        families.setdefault(n.family, set()).add(got[n.node.name])
    assert families["layernorm"] == {Coverage(ARCH_SLOTS)}
    assert families["conv"] == {Coverage(ARCH_SLOTS)}  # the patch embedding: the implicit-GEMM conv (TF32)
    for family in ("gemm", "attention"):  # TF32 kernels on fp32 tensors
        assert families[family] == {Coverage(ARCH_SLOTS)}, families[family]


@pytest.mark.parametrize(("elem", "precision", "families"), [
    (TensorProto.FLOAT16, "fp16", {"gemm": ARCH_SLOTS, "layernorm": ARCH_SLOTS}),
    (TensorProto.FLOAT, "fp32", {"gemm": ARCH_SLOTS, "layernorm": ARCH_SLOTS}),  # TF32
    # an fp32 model at fp16 is converted (onnx_gtco.precision): its fused nodes read f16 tensors, as kernels do
    (TensorProto.FLOAT, "fp16", {"gemm": ARCH_SLOTS, "layernorm": ARCH_SLOTS}),
    (TensorProto.FLOAT, "bf16", {"gemm": ARCH_SLOTS, "layernorm": ARCH_SLOTS}),
])
def test_candidate_coverage_agrees_with_the_rewritten_node(elem: int, precision: str, families: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    result = optimize(mlp(elem), GtcoConfig(precision=precision))
    _no_subprocess(monkeypatch)
    truth = model_coverage(result.model).nodes
    ask = candidate_coverage(result.view, precision)
    names = [g["name"] for g in result.report["groups"]]
    assert {n.split("/")[1]: truth[n].archs for n in names} == families
    for cand, name in zip(result.plan.fused_groups, names, strict=True):
        assert _where(ask(cand)) == _where(truth[name]), name
        assert ask(cand).kernel is not None and ask(cand).us is not None and ask(cand).us > 0
    if precision != "fp32" and elem == TensorProto.FLOAT:  # the rewritten model the truth comes from is converted
        assert all(n.op_type.endswith("_" + {"fp16": "f16", "bf16": "bf16"}[precision])
                   for n in result.model.graph.node if n.domain == "ai.gtco")


def test_candidate_coverage_of_every_vit_group_matches(vit) -> None:
    truth = model_coverage(vit.model).nodes
    ask = candidate_coverage(vit.view, "fp32")
    for cand, g in zip(vit.plan.fused_groups, vit.report["groups"], strict=True):
        assert _where(ask(cand)) == _where(truth[g["name"]]), g["name"]
    assert not ask(next(c for c in vit.plan.groups if not c.fused)).archs


def test_the_sm90a_slot_holds_an_instance_of_its_own_only_where_asked() -> None:
    """A 9.0 device runs the node's sm_90a instance (a CUTLASS GEMM) where a configuration for it is given and
    fits, else the node's sm_90 instance, which every build already compiles."""
    from onnx_gtco.families.gemm.cutlass import include_dirs
    from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
    from onnx_gtco.plugin.device import device_problem

    nodes = fused_nodes(optimize(mlp(), GtcoConfig(precision="fp16")).model)
    results, _ = bind_nodes(nodes)
    by_family = {n.family: (n, r.binding) for n, r in zip(nodes, results, strict=True)}
    assert ARCH_SLOTS[-1] == "sm_90a"
    for node, binding in by_family.values():
        plain = device_instances(node, binding, ARCH_SLOTS)
        assert not isinstance(plain, str) and [i.arch for i in plain] == ["sm_80", "sm_90", "sm_90"]
        assert plain[2] == plain[1]
    node, binding = by_family["gemm"]
    problem = device_problem(node, binding)
    assert not isinstance(problem, str)
    assert not isinstance(include_dirs(), str), include_dirs()  # the test extra installs nvidia-cutlass
    config = GEMM.configs(problem, "sm_90a")[0]
    asked = device_instances(node, binding, ARCH_SLOTS, {"sm_90a": config})
    plain = device_instances(node, binding, ARCH_SLOTS)
    assert not isinstance(asked, str) and not isinstance(plain, str)
    assert asked[:2] == plain[:2] and asked[2].arch == "sm_90a" and asked[2].config["impl"] == "cutlass"
    unfit = device_instances(node, binding, ARCH_SLOTS, {"sm_90a": {**config, "TILE_M": 64}})  # cooperative: 128
    assert unfit == plain
    ln_node, ln_binding = by_family["layernorm"]
    assert device_instances(ln_node, ln_binding, ARCH_SLOTS, {"sm_90a": config}) == \
        device_instances(ln_node, ln_binding, ARCH_SLOTS)


def test_an_untuned_gemm_gets_a_cutlass_instance_on_sm90a_where_it_is_predicted_faster() -> None:
    """ViT-B/16's erf-GELU fc1 at batch 64 (12608 rows; cuBLASLt has no erf GELU): the H200 measured CUTLASS at
    153 us against the mma kernel's 254, and the sm_90a slot builds a CUTLASS instance for it untuned; where the
    sm_90 slot's instance is predicted faster (cuBLASLt on a bias GEMM of 128 rows), the slot holds that one."""
    from onnx_gtco.calibration import hardware
    from onnx_gtco.families.gemm.kernel import gemm_problem
    from onnx_gtco.kernels.select import select_instance
    from onnx_gtco.plugin.device import estimate_instance, own_config

    hw = hardware("h200")
    big = gemm_problem("f16", 1, 197 * 64, 3072, 768, bias=True, activation="gelu_erf")
    mma = select_instance(big, "sm_90", hw=hw)
    assert not isinstance(mma, str) and "impl" not in mma.config
    config = own_config(big, "sm_90a", mma, hw=hw)
    assert config is not None and config["impl"] == "cutlass"
    cutlass = select_instance(big, "sm_90a", config)
    assert not isinstance(cutlass, str) and estimate_instance(cutlass, hw) < estimate_instance(mma, hw)
    assert own_config(big, "sm_90", mma, hw=hw) is None and own_config(big, "sm_80", mma, hw=hw) is None
    small = gemm_problem("f16", 1, 128, 768, 768, bias=True)
    lt = select_instance(small, "sm_90", hw=hw)
    assert not isinstance(lt, str) and lt.config.get("impl") == "cublaslt"
    assert own_config(small, "sm_90a", lt, hw=hw) is None
    odd = gemm_problem("f16", 1, 197 * 64, 3000 + 4, 768)  # N % 8 != 0: TMA cannot take its rows
    assert own_config(odd, "sm_90a", None, hw=hw) is None


def test_a_layer_scale_gemm_runs_the_mma_kernel_in_every_slot() -> None:
    """LayerScale (a per-column Mul before the residual) is in the mma kernels' epilogue only: a GEMM with it big
    enough for CUTLASS on sm_90a keeps the mma instance there (CUTLASS and cuBLASLt refuse the problem, saying why),
    and every slot's instance is built with the scale."""
    from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
    from onnx_gtco.families.gemm.kernel import gemm_problem
    from onnx_gtco.plugin.device import device_problem, own_config

    big = gemm_problem("f16", 1, 197 * 64, 768, 3072, bias=True, layer_scale=True, residual=True)
    assert own_config(big, "sm_90a", None) is None
    assert GEMM.check(big, {"impl": "cublaslt", "RANK": 0}, "sm_90") is not None
    rng = np.random.default_rng(1)
    d, rows = 64, 197 * 64
    inits = [numpy_helper.from_array(rng.standard_normal((4 * d, d)).astype(np.float16), "w"),
             numpy_helper.from_array(rng.standard_normal(d).astype(np.float16), "b"),
             numpy_helper.from_array(rng.standard_normal(d).astype(np.float16), "gamma")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc2"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Mul", ["hb", "gamma"], ["ls"], name="ls"),
             helper.make_node("Add", ["r", "ls"], ["y"], name="res")]
    f16 = TensorProto.FLOAT16
    graph = helper.make_graph(nodes, "ls", [helper.make_tensor_value_info("x", f16, [rows, 4 * d]),
                                            helper.make_tensor_value_info("r", f16, [rows, d])],
                              [helper.make_tensor_value_info("y", f16, [rows, d])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (node,) = fused_nodes(optimize(model, GtcoConfig(precision="fp16")).model)
    (result,), _ = bind_nodes([node])
    problem = device_problem(node, result.binding)
    assert not isinstance(problem, str) and problem.flag("layer_scale") is True
    insts = device_instances(node, result.binding, ARCH_SLOTS)
    assert not isinstance(insts, str) and [i.arch for i in insts] == ["sm_80", "sm_90", "sm_90"]
    assert all("_ls_res" in i.name and "HAS_SCALE=*/true" in i.source for i in insts)
