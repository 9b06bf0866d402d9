"""Progress on stderr: bars only on a terminal, nothing with -q or from library use, one line per stage with -v; the
build message and the summary say what was compiled, and which times are predicted."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from onnx_gtco import progress
from onnx_gtco.cli import main
from onnx_gtco.plugin.library import LibraryResult
from onnx_gtco.report import speedup

ROOT = Path(__file__).resolve().parents[1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def model_path(tmp_path: Path, mlp: onnx.ModelProto) -> Path:
    p = tmp_path / "mlp.onnx"
    onnx.save(mlp, str(p))
    return p


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty per-user cache for libraries and kernels (the ORT headers still come from the real one)."""
    from onnx_gtco.plugin.headers import ort_include_dir

    monkeypatch.setenv("ORT_INCLUDE_DIR", str(ort_include_dir()))
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _stage_lines(err: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"^onnx-gtco: (\w+) +\d+\.\d\d s.*$", err, re.M)}


def test_stage_bar_on_a_terminal_only_and_never_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress.stage("load", total=2) as st:  # library use: QUIET
        st.step("check")
        st.step()
    assert tty.getvalue() == ""
    with progress.verbosity(progress.NORMAL), progress.stage("load", total=2) as st:
        st.step("check")
        st.step()
    assert "load" in tty.getvalue() and "\r" in tty.getvalue()
    assert progress.level() == progress.QUIET  # restored
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with progress.verbosity(progress.NORMAL), progress.stage("load", total=2) as st:
        st.step("check")
    assert pipe.getvalue() == ""  # not a terminal: no bar


def test_verbose_line_per_stage_even_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.verbosity(progress.VERBOSE), progress.stage("plan", total=1) as st:
        st.step()
        st.note = "3 fused groups"
    err = capsys.readouterr().err
    assert re.fullmatch(r"onnx-gtco: plan +\d+\.\d\d s  3 fused groups\n", err)
    with pytest.raises(ValueError), progress.verbosity(progress.VERBOSE), progress.stage("plan"):
        raise ValueError
    assert capsys.readouterr().err == ""  # a failed stage has no line


def test_optimize_verbose_names_every_stage(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-v", "optimize", "--cpu", str(model_path)]) == 0
    lines = _stage_lines(capsys.readouterr().err)
    assert list(lines) == ["load", "plan", "rewrite", "library"]
    assert "5 nodes" in lines["load"] and "fused groups" in lines["plan"]
    assert main(["optimize", "-v", "--no-build", str(model_path)]) == 0  # also after the command
    assert list(_stage_lines(capsys.readouterr().err)) == ["load", "plan", "rewrite"]


def test_optimize_quiet_prints_nothing_on_stderr(model_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)  # even on a terminal
    assert main(["-q", "optimize", "--cpu", str(model_path)]) == 0
    assert tty.getvalue() == ""
    assert "wrote" in capsys.readouterr().out
    assert progress.level() == progress.QUIET


def test_library_use_is_silent_on_a_terminal(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx_gtco.pipeline import optimize_file

    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    optimize_file(model_path, build="cpu")
    assert tty.getvalue() == ""


def test_default_run_without_a_terminal_has_no_bars(model_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "onnx_gtco", "optimize", "--cpu", str(model_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    # only the one line saying which target was chosen (the user named none): no bars, no stage lines
    assert "\r" not in res.stderr
    assert [ln for ln in res.stderr.splitlines() if not ln.startswith("onnx-gtco: note: ")] == []
    assert len(res.stderr.splitlines()) == 1
    res = subprocess.run([sys.executable, "-m", "onnx_gtco", "-q", "optimize", "--cpu", str(model_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stderr == ""
    res = subprocess.run([sys.executable, "-m", "onnx_gtco", "-v", "optimize", "--cpu", str(model_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "\r" not in res.stderr
    assert list(_stage_lines(res.stderr)) == ["load", "plan", "rewrite", "library"]


def test_from_the_cache_only_when_nothing_was_compiled(model_path: Path, fresh_cache: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    outs = [tmp_path / "a", tmp_path / "b"]
    for d in outs:
        d.mkdir()
    assert main(["optimize", "--cpu", str(model_path), "-o", str(outs[0] / "m.onnx")]) == 0
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("built")]
    assert len(first) == 1 and "from the cache" not in first[0] and re.search(r"\(compiled in \d+\.\d s\)", first[0])
    assert main(["optimize", "--cpu", str(model_path), "-o", str(outs[1] / "m.onnx")]) == 0
    second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("built")]
    assert len(second) == 1 and re.search(r"\(from the cache in \d+\.\d s\)", second[0])
    assert any(fresh_cache.rglob("libgtco-*.so"))


def test_build_message_counts_compiled_and_cached_kernels() -> None:
    def lib(hits: int, misses: int, built: bool) -> LibraryResult:
        kernels: list[dict[str, object]] = [{"cached": True}] * hits + [{"cached": False}] * misses
        return LibraryResult(Path("libgtco-x.so"), [], [], [], True, cached=not built and not misses, created=True,
                             seconds=41.23, kernels=kernels, built=built)

    assert lib(6, 18, True).how() == "compiled 18 of 24 kernels, 6 from the cache, in 41.2 s"
    assert lib(24, 0, True).how() == "compiled 0 of 24 kernels, 24 from the cache, in 41.2 s"
    assert "from the cache" not in lib(24, 0, True).how().split(",")[0]
    assert lib(24, 0, False).how() == "from the cache in 41.2 s"
    assert lib(20, 4, False).how() == "compiled 4 of 24 kernels, 20 from the cache, the library from the cache, in " \
        "41.2 s"


def test_speedups_have_sensible_digits() -> None:
    assert [speedup(x) for x in (3.71428, 1.0412, 15.349, None)] == ["3.7x", "1.04x", "15.3x", "n/a"]


def test_summary_labels_predictions(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["optimize", "--no-build", str(model_path)]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "us ->" in s)
    assert line.startswith("predicted") and "predicted by the estimate" in line and "not measured" in line
    assert re.search(r"\(\d+\.\d{1,2}x predicted", line) and "measured " not in line.replace("not measured", "")
    assert main(["inspect", str(model_path)]) == 0
    assert "predicted us" in capsys.readouterr().out


def test_tune_verbose_says_analytical_times_are_predicted(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from onnx_gtco import models

    vit = tmp_path / "vit.onnx"
    onnx.save(models.build("vit-tiny", depth=1), str(vit))  # its LayerNorms are tuning tasks in fp32
    assert main(["-v", "optimize", "--no-build", "--tune-trials", "2", "--storage",
                 f"sqlite:///{tmp_path / 'tune.db'}", str(vit)]) == 0
    err = capsys.readouterr().err
    assert "tune" in _stage_lines(err)
    tasks = [line for line in err.splitlines() if line.startswith("onnx-gtco: tune ") and "trials," in line]
    assert tasks and all("us predicted" in t and "measured" not in t for t in tasks)
