"""The report says which fused nodes have device kernels: per group, per arch slot in the JSON, one line per arch
and the families without (with their reason) on the terminal, a section in the Markdown. The counts are those the
library builder's binders and device selection give the rewritten model, nothing compiled (--no-build)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pins import CONV_KERNELS, pinned_calibration

from onnx_gtco import GtcoConfig, models, optimize, report, report_md
from onnx_gtco.cli import main
from onnx_gtco.ir.export import save_atomic
from onnx_gtco.plugin.device import ARCH_SLOTS
from onnx_gtco.plugin.library import bind_nodes, select_device
from onnx_gtco.plugin.nodes import fused_nodes

CONV3D_REASON = "Conv_f32 node 'gtco/conv/conv': a 3-D convolution; the kernel takes 1-D and 2-D ones"
"""Why a 3-D conv has no kernel (families.conv.bind): a CUDA session keeps its function. Since grouped and depthwise
convs got their direct kernel and SAME-padded ones their run-time pads, a 3-D conv is the honest conv without one."""


def _independent(model) -> tuple[dict[str, int], dict[str, str]]:
    """Per arch slot, the fused nodes a CUDA build gives device kernels; node name -> why the others have none."""
    nodes = fused_nodes(model)
    results, _ = bind_nodes(nodes)
    found, why = select_device(nodes, results, ARCH_SLOTS)
    return ({a: len(found) for a in ARCH_SLOTS},
            {r.node: r.reason or why[r.node] for r in results if r.node not in found})


def _optimize(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[Path, dict, str]:
    out = tmp_path / "vit-tiny.gtco.onnx"
    # the patch embedding kept a conv (--no-patchify) on our conv kernel (CONV_KERNELS), so every family is there
    with pinned_calibration(tmp_path / "calibration", "sm_90", **CONV_KERNELS):
        assert main(["optimize", "vit-tiny", "--no-build", "--target", "sm_90", "--no-patchify", "-o", str(out),
                     *extra]) == 0
    return out, json.loads(out.with_name(out.name + ".report.json").read_text()), capsys.readouterr().out


def test_fp32_vit_reports_the_device_kernels_it_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, rep, text = _optimize(tmp_path, capsys)
    counts, why = _independent(onnx.load(str(out)))
    dev = rep["device"]
    fused = len(rep["groups"])
    assert dev["arch_slots"] == list(ARCH_SLOTS) and dev["fused_nodes"] == fused
    assert dev["with_kernels"] == counts
    assert 0 < counts["sm_90"] <= fused  # TF32 GEMM, attention and conv, fp32 LayerNorm, ...
    for g in rep["groups"]:
        if g["name"] in why:
            assert (g["device_kernels"], g["device_reason"]) == ([], why[g["name"]])
        else:
            assert (g["device_kernels"], g["device_reason"]) == (list(ARCH_SLOTS), None)
    assert sum(w["nodes"] for w in dev["without"]) == len(why)
    for arch in ARCH_SLOTS:
        assert f"{arch}: {counts[arch]} of {fused} fused nodes have device kernels" in text
    # the patch-embedding conv has its implicit-GEMM kernel (TF32)
    assert not [w for w in dev["without"] if w["family"] == "conv"]
    assert all(g["device_kernels"] == list(ARCH_SLOTS) for g in rep["groups"] if g["family"] == "conv")
    for w in dev["without"]:
        assert f"{w['family']} x{w['nodes']} keep their functions: {w['reason']}" in text
    # concise: one line per arch, one per (family, reason), not one per node
    device_block = text[text.index("device "):text.index("wrote ")].splitlines()
    assert len(device_block) == len(ARCH_SLOTS) + len(dev["without"]) <= 8


def test_fp16_conversion_gives_device_kernels_and_names_the_rest(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An fp32 export at --precision fp16 is converted: every fused node, the patch-embedding conv included, has
    device kernels, and the terminal says so."""
    _, rep, text = _optimize(tmp_path, capsys, "--precision", "fp16")
    fused = len(rep["groups"])
    assert any(g["family"] == "conv" for g in rep["groups"])
    assert rep["device"]["with_kernels"] == {a: fused for a in ARCH_SLOTS}
    assert f"sm_90: {fused} of {fused} fused nodes have device kernels" in text
    assert "keep their functions" not in text


def test_summary_keeps_to_a_few_lines_with_many_reasons() -> None:
    device = {"arch_slots": ["sm_80", "sm_90"], "fused_nodes": 9, "with_kernels": {"sm_80": 1, "sm_90": 1},
              "without": [{"family": "gemm", "reason": f"reason {i}", "nodes": 1} for i in range(8)]}
    lines = report.device_lines(device)
    assert lines[:2] == ["device     sm_80: 1 of 9 fused nodes have device kernels",
                         "           sm_90: 1 of 9 fused nodes have device kernels"]
    assert len(lines) == 2 + 4 + 1 and "4 more fused nodes keep their functions for 4 other reasons" in lines[-1]
    assert report.device_lines({**device, "error": "shape inference failed"}) == [
        "device     which fused nodes have device kernels is unknown: shape inference failed"]


def test_markdown_has_the_device_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "vit.onnx"
    save_atomic(models.build("vit-tiny", depth=1), src)
    assert main(["optimize", str(src), "--no-build", "--target", "sm_80"]) == 0
    capsys.readouterr()
    rep = json.loads(src.with_name("vit.gtco.onnx.report.json").read_text())
    md = report_md.render(rep)
    section = md[md.index("## Device kernels"):md.index("## Custom-op library")]
    for arch, n in rep["device"]["with_kernels"].items():
        assert f"| {arch} | {n} | {len(rep['groups'])} |" in section
    for w in rep["device"]["without"]:
        assert f"| {w['family']} | {w['reason']} | {w['nodes']} |" in section


def _conv3d_block() -> onnx.ModelProto:
    """A 3x3x3 conv (no device kernel) + ReLU, its depth folded into channels, then a 1x1 conv + bias + ReLU (its
    implicit GEMM)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("c3_w", (8, 8, 3, 3, 3)), ("pw_w", (16, 32, 1, 1)), ("pw_b", (16,)))]
    inits.append(numpy_helper.from_array(np.array([1, 32, 16, 16], np.int64), "fold"))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "c3_w"], ["d"], name="c3", pads=[1] * 6),
         helper.make_node("Relu", ["d"], ["dr"], name="c3_relu"),
         helper.make_node("Reshape", ["dr", "fold"], ["df"], name="fold_depth"),
         helper.make_node("Conv", ["df", "pw_w", "pw_b"], ["p"], name="pw"),
         helper.make_node("Relu", ["p"], ["y"], name="pw_relu")], "dwblock",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _optimize_conv3d(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict, str]:
    src = tmp_path / "c3.onnx"
    save_atomic(_conv3d_block(), src)
    out = tmp_path / "c3.gtco.onnx"
    assert main(["optimize", str(src), "--no-build", "--target", "sm_90", "-o", str(out)]) == 0
    return out, json.loads(out.with_name(out.name + ".report.json").read_text()), capsys.readouterr().out


def test_nodes_without_device_kernels_count_unfused_in_the_prediction(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, rep, text = _optimize_conv3d(tmp_path, capsys)
    kernelless = [g for g in rep["groups"] if g["device_reason"] is not None]
    assert kernelless  # the 3-D conv
    for g in kernelless:  # no fictional kernel: a group that keeps its function costs what its nodes cost
        assert g["predicted_us"] == g["predicted_unfused_us"], g["name"]
    for g in rep["groups"]:
        if g["device_reason"] is None:
            assert g["predicted_us"] <= g["predicted_unfused_us"], g["name"]
    # after fusion: the groups' predicted times plus the nodes left unfused (their share of the time before)
    outside = rep["predicted_us_before"] - sum(g["predicted_unfused_us"] for g in rep["groups"])
    assert rep["predicted_us_after"] == pytest.approx(sum(g["predicted_us"] for g in rep["groups"]) + outside,
                                                      abs=0.01)
    fused = len(rep["groups"])
    n = rep["device"]["with_kernels"]["sm_90"]
    assert (f"sm_90: {n} of {fused} fused nodes have device kernels (the target: the other {fused - n} count at "
            "their unfused cost in the predicted time)") in text


def test_no_device_kernel_predicts_no_speedup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every fused group without a device kernel (a 3-D conv) is predicted at its unfused cost (it was 3.7x
    on the fp32 ViT when such groups were costed as kernels that do not exist)."""
    _, rep, _ = _optimize_conv3d(tmp_path, capsys)
    without = [g for g in rep["groups"] if g["device_kernels"] == []]
    assert without
    for g in without:
        assert g["predicted_us"] == g["predicted_unfused_us"], g["name"]


def test_conv_without_a_kernel_is_no_faster_fused(tmp_path: Path) -> None:
    """A model whose only fusable group is a 3-D conv (the conv kernel takes 1-D and 2-D ones): fused, named with
    its reason, and predicted no faster than unfused."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1] * 6)], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 4, 16, 16])], [w, b])
    result = optimize(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), GtcoConfig())
    rep = result.report
    assert [g["family"] for g in rep["groups"]] == ["conv"]
    assert rep["device"]["without"] == [{"family": "conv", "reason": CONV3D_REASON, "nodes": 1}]
    assert rep["predicted_us_after"] >= rep["predicted_us_before"] - 0.001
    assert f"conv x1 keep their functions: {CONV3D_REASON}" in report.summary(rep)
