"""The README's quick-start commands exist as written and the demo they run works."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onnx_gtco.cli import main

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", text, re.S)
    assert block, "README has no quick-start bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_is_install_demo_test_in_order() -> None:
    assert quickstart() == ["make install", "make demo", "make test"]


def _recipe(mk: str, target: str) -> str:
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)*)", mk, re.M)
    assert m, f"no rule for {target}"
    return m.group(1)


def test_makefile_targets_set_up_their_own_venv() -> None:
    mk = (ROOT / "Makefile").read_text()
    for target in ("install", "test"):
        assert re.search(rf"^{target}: \$\(STAMP\)", mk, re.M), f"make {target} does not depend on the venv"
    assert re.search(r"^demo: \$\(BASE\)", mk, re.M), "make demo does not depend on the venv"
    assert "-m venv" in _recipe(mk, "$(BASE)") and "$(BASE)" in mk.split("$(STAMP):")[1].splitlines()[0]


def test_demo_needs_no_torch() -> None:
    """make demo installs onnx-gtco alone: torch and the zoo are for the tests."""
    mk = (ROOT / "Makefile").read_text()
    base = _recipe(mk, "$(BASE)")
    assert "pip install --quiet -e ." in base and "zoo" not in base and "[test]" not in base


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make install" in ci and re.search(r"^make test$", ci, re.M)


def test_demo_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "demo passed" in out
    assert out.count("rtol=0.0001 atol=1e-05 (defaults for precision fp32)") == 2  # check's defaults, said
    assert (tmp_path / "vit-tiny.gtco.onnx").exists()
    assert (tmp_path / "vit-tiny.gtco.onnx.report.json").exists()


def test_readme_commands_exist_and_parse() -> None:
    """Every `onnx-gtco ...` line of the README's code blocks and command table names a real command, and each full
    command line in a bash block parses with the options it shows."""
    from onnx_gtco.cli import parser

    text = (ROOT / "README.md").read_text()
    ap = parser()
    (subs,) = [a for a in ap._actions if a.dest == "cmd"]
    named = set(re.findall(r"`onnx-gtco ([a-z-]+)", text)) | set(re.findall(r"^onnx-gtco ([a-z-]+)", text, re.M))
    assert named and named <= set(subs.choices), named - set(subs.choices)
    lines = [ln.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for ln in block.splitlines() if ln.startswith("onnx-gtco ")]
    assert lines
    for line in lines:
        ap.parse_args(line.split()[1:])  # SystemExit (exit 2) on an option the command does not take
