"""tools/zoo_summary.py prints one honest line per model and fails on a bad one."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from tool_module import load_tool

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.models import build


def test_summary_line_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=3, seed=0), str(good))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not a model")
    tool = load_tool("zoo_summary")
    assert tool.main([str(good)]) == 0
    line = capsys.readouterr().out
    rep = optimize(onnx.load(str(good)), GtcoConfig(target="sm_90")).report  # the line is the report's
    assert "softmax in attention 3/3" in line and f"95 -> {rep['nodes_after']:5d}" in line
    assert rep["nodes_after"] < 95 / 2
    assert tool.main([str(good), str(bad)]) == 1
    assert "bad.onnx" in capsys.readouterr().out
