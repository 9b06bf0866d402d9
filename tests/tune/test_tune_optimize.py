"""Tuning as part of optimize: `--tune-trials` / `--storage` on the CLI, the report's tuning entry, a warm storage
that measures nothing, and the build launching the tuned configuration."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from onnx_gtco import optimize
from onnx_gtco.cli import main
from onnx_gtco.config import GtcoConfig
from onnx_gtco.models import build
from onnx_gtco.plugin.library import build_library, library_info
from onnx_gtco.plugin.nodes import fused_nodes


def softmax_f16() -> onnx.ModelProto:
    """x [N, 16] fp16 -> Softmax: one Softmax_f16 node."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["N", 16]) for n in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)], "sm", io[:1], io[1:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_cli_tunes_and_a_second_run_measures_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=2), str(src))
    url = f"sqlite:///{tmp_path / 'team.db'}"
    argv = ["optimize", str(src), "--no-build", "--precision", "fp16", "--tune-trials", "4", "--storage", url]
    assert main(argv) == 0
    assert "tune  " in capsys.readouterr().err  # progress lines
    report = json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())["tuning"]
    assert report["measurer"] == "analytical" and report["arch"] == "sm_90" and report["measured"] > 0
    assert report["tasks_found"] == len(report["tasks"]) > 0
    assert all(t["best_config"] and t["trials"] <= 4 for t in report["tasks"])
    assert not (tmp_path / "cache" / "tuning.db").exists()  # the named storage, not the default
    assert main(argv) == 0
    again = json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())["tuning"]
    assert again["measured"] == 0 and [t["best_config"] for t in again["tasks"]] == [
        t["best_config"] for t in report["tasks"]]
    # without --tune-trials the named storage is still read: the build would use its records
    assert main(["optimize", str(src), "--no-build", "--precision", "fp16", "--storage", url]) == 0
    looked_up = json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())["tuning"]
    assert looked_up["measured"] == 0 and looked_up["tasks_found"] == report["tasks_found"]


def test_plain_optimize_opens_no_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=1), str(src))
    assert main(["optimize", str(src), "--no-build"]) == 0
    assert "tuning" not in json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())
    assert not (tmp_path / "cache" / "tuning.db").exists()


def test_negative_trials_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=1), str(src))
    assert main(["optimize", str(src), "--no-build", "--tune-trials", "-1"]) == 2
    assert "tune_trials=-1" in capsys.readouterr().err
    assert not (tmp_path / "vit.gtco.onnx").exists()


def test_build_launches_the_tuned_configuration(tmp_path: Path) -> None:
    """A tuned configuration for a node's arch replaces the family's default instance in the library."""
    from onnx_gtco.kernels.select import FAMILIES, node_problem

    rewritten = optimize(softmax_f16(), GtcoConfig()).model
    node = next(n for n in fused_nodes(rewritten) if n.family == "softmax")
    problem = node_problem(node.node)
    assert not isinstance(problem, str)
    configs = FAMILIES["softmax"].configs(problem, "sm_80")
    default, other = configs[0], configs[-1]
    assert default != other
    plain = library_info(build_library(rewritten, tmp_path, cuda=False, emulated=True).path)
    out = tmp_path / "tuned"
    out.mkdir()
    tuned = library_info(build_library(rewritten, out, cuda=False, emulated=True,
                                       tuned={node.node.name: {"sm_80": other}}).path)
    want = FAMILIES["softmax"].instantiate(problem, other, "sm_80").name
    assert tuned["instances"][node.node.name] == [want] != plain["instances"][node.node.name]
