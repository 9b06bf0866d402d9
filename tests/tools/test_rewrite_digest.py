"""tools/rewrite_digest.py: digests of what `optimize` writes, the same on a second run, and a planted difference
named with the file it is in."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from tool_module import load_tool

from onnx_gtco.models import build


def test_digests_repeat_and_a_difference_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=1, seed=0), str(model))
    tool = load_tool("rewrite_digest")
    before = tmp_path / "before.json"
    assert tool.main(["--builtin", "bert-tiny", str(model), "-o", str(before), "-j", "1"]) == 0
    digests = json.loads(before.read_text())
    assert sorted(digests) == sorted(f"{m} {p}" for m in ("bert-tiny", "vit.onnx") for p in ("fp32", "fp16", "bf16"))
    assert all(set(d) == {"model", "report"} for d in digests.values()), digests
    assert len({d["model"] for d in digests.values()}) == 6  # each precision writes its own model
    capsys.readouterr()
    assert tool.main(["--builtin", "bert-tiny", str(model), "--against", str(before), "-j", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "6 same, 0 differ"
    digests["vit.onnx fp16"]["report"] = "0" * 64
    before.write_text(json.dumps(digests))
    assert tool.main(["--builtin", "bert-tiny", str(model), "--against", str(before), "-j", "1"]) == 1
    out = capsys.readouterr().out
    assert "vit.onnx fp16: DIFFERS in report" in out and out.splitlines()[-1] == "5 same, 1 differ"
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path / "missing.onnx"), "-o", str(before)])
