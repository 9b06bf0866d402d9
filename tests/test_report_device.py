"""The report says which fused nodes have device kernels: per group, per arch slot in the JSON, one line per arch
and the families without (with their reason) on the terminal, a section in the Markdown. The counts are those the
library builder's binders and device selection give the rewritten model, nothing compiled (--no-build)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from onnx_gtco import models, report, report_md
from onnx_gtco.cli import main
from onnx_gtco.ir.export import save_atomic
from onnx_gtco.plugin.device import ARCH_SLOTS
from onnx_gtco.plugin.library import bind_nodes, select_device
from onnx_gtco.plugin.nodes import fused_nodes


def _independent(model) -> tuple[dict[str, int], dict[str, str]]:
    """Per arch slot, the fused nodes a CUDA build gives device kernels; node name -> why the others have none."""
    nodes = fused_nodes(model)
    results, _ = bind_nodes(nodes)
    found, why = select_device(nodes, results, ARCH_SLOTS)
    return ({a: len(found) for a in ARCH_SLOTS},
            {r.node: r.reason or why[r.node] for r in results if r.node not in found})


def _optimize(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[Path, dict, str]:
    out = tmp_path / "vit-tiny.gtco.onnx"
    assert main(["optimize", "vit-tiny", "--no-build", "--target", "sm_90", "-o", str(out), *extra]) == 0
    return out, json.loads(out.with_name(out.name + ".report.json").read_text()), capsys.readouterr().out


def test_fp32_vit_reports_the_device_kernels_it_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, rep, text = _optimize(tmp_path, capsys)
    counts, why = _independent(onnx.load(str(out)))
    dev = rep["device"]
    fused = len(rep["groups"])
    assert dev["arch_slots"] == list(ARCH_SLOTS) and dev["fused_nodes"] == fused
    assert dev["with_kernels"] == counts
    assert 0 < counts["sm_90"] < fused  # today: LayerNorm only; fp32 GEMM and attention have no kernel yet
    for g in rep["groups"]:
        if g["name"] in why:
            assert (g["device_kernels"], g["device_reason"]) == ([], why[g["name"]])
        else:
            assert (g["device_kernels"], g["device_reason"]) == (list(ARCH_SLOTS), None)
    assert sum(w["nodes"] for w in dev["without"]) == len(why)
    for arch in ARCH_SLOTS:
        assert f"{arch}: {counts[arch]} of {fused} fused nodes have device kernels" in text
    # conv has no plugin kernel at all: named with its reason, on the terminal and in the JSON
    assert {"family": "conv", "reason": "no plugin kernel for family 'conv' yet", "nodes": 1} in dev["without"]
    assert "conv x1 keep their functions: no plugin kernel for family 'conv' yet" in text
    for w in dev["without"]:
        assert f"{w['family']} x{w['nodes']} keep their functions: {w['reason']}" in text
    # concise: one line per arch, one per (family, reason), not one per node
    device_block = text[text.index("device "):text.index("wrote ")].splitlines()
    assert len(device_block) == len(ARCH_SLOTS) + len(dev["without"]) <= 8


def test_fp16_on_fp32_tensors_has_no_device_kernel_and_says_why(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _, rep, text = _optimize(tmp_path, capsys, "--precision", "fp16")
    fused = len(rep["groups"])
    assert rep["device"]["with_kernels"] == {a: 0 for a in ARCH_SLOTS}
    assert f"sm_90: 0 of {fused} fused nodes have device kernels" in text
    assert "give the model f16 tensors" in text


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
