"""The command line as a user meets it: outputs, exit codes, one-line errors, nothing half-written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_gtco.cli import main
from onnx_gtco.runtime.check import defaults_text


@pytest.fixture
def model_path(tmp_path: Path, mlp: onnx.ModelProto) -> Path:
    p = tmp_path / "mlp.onnx"
    onnx.save(mlp, str(p))
    return p


def test_optimize_writes_model_and_report(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["optimize", str(model_path)]) == 0
    out = model_path.with_name("mlp.gtco.onnx")
    rep = model_path.with_name("mlp.gtco.onnx.report.json")
    assert out.exists() and rep.exists()
    report = json.loads(rep.read_text())
    assert report["nodes_before"] == 5 and report["nodes_after"] < 5
    assert {"groups", "rejected", "fused_flop_share", "predicted_us_before", "predicted_us_after"} <= set(report)
    assert "wrote" in capsys.readouterr().out
    assert main(["check", str(model_path), str(out)]) == 0


def test_optimize_is_byte_deterministic(model_path: Path, tmp_path: Path) -> None:
    for k in (1, 2):
        assert main(["optimize", str(model_path), "-o", str(tmp_path / f"o{k}.onnx")]) == 0
    assert (tmp_path / "o1.onnx").read_bytes() == (tmp_path / "o2.onnx").read_bytes()
    r1 = (tmp_path / "o1.onnx.report.json").read_text()
    assert r1 == (tmp_path / "o2.onnx.report.json").read_text()


def test_inspect_writes_nothing(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(os.listdir(model_path.parent))
    assert main(["inspect", str(model_path)]) == 0
    assert sorted(os.listdir(model_path.parent)) == before
    assert "nodes" in capsys.readouterr().out
    assert main(["inspect", "--json", str(model_path)]) == 0
    assert json.loads(capsys.readouterr().out)["nodes_before"] == 5


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d / "absent.onnx", "no such file"),
        (lambda d: _write(d / "empty.onnx", b""), "empty"),
        (lambda d: _write(d / "junk.onnx", b"\xff\x01not onnx at all" * 10), "not a valid ONNX|no ONNX graph"),
    ],
    ids=["missing", "empty", "junk"],
)
def test_bad_input_exit_2_one_line_no_output(tmp_path: Path, capsys: pytest.CaptureFixture[str], setup, message: str
                                             ) -> None:
    path = setup(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main(["optimize", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("onnx-gtco: error:")
    assert __import__("re").search(message, err)
    assert sorted(os.listdir(tmp_path)) == before


def test_unwritable_output_dir(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["optimize", str(model_path), "-o", str(tmp_path / "nope" / "x.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that can write to a read-only directory (root)")
        assert main(["optimize", str(model_path), "-o", str(ro / "x.onnx")]) == 2
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_check_detects_a_wrong_model(model_path: Path, tmp_path: Path, mlp: onnx.ModelProto,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = onnx.ModelProto()
    bad.CopyFrom(mlp)
    w = onnx.numpy_helper.to_array(bad.graph.initializer[0]).copy()
    w[0, 0] += 0.5
    bad.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w, bad.graph.initializer[0].name))
    onnx.save(bad, str(tmp_path / "bad.onnx"))
    assert main(["check", str(model_path), str(tmp_path / "bad.onnx")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL \(would pass with --atol y:\S+ or --rtol y:\S+\)", out)
    assert out.splitlines()[-1] == ("0 of 1 outputs within rtol=0.0001 atol=1e-05 (defaults for precision fp32: the "
                                    "rewritten model has no gtco.precision metadata)")
    assert main(["check", str(model_path), str(tmp_path / "missing.onnx")]) == 2


@pytest.mark.parametrize(("flags", "message"), [(["--samples", "0"], "--samples must be at least 1, got 0"),
                                               (["--samples", "-3"], "--samples must be at least 1, got -3"),
                                               (["--seed", "-1"], "--seed must be >= 0, got -1")])
def test_check_refuses_no_samples_and_negative_seeds(model_path: Path, capsys: pytest.CaptureFixture[str],
                                                     flags: list[str], message: str) -> None:
    """--samples 0 used to compare nothing and pass; a negative seed was numpy's traceback."""
    assert main(["check", str(model_path), str(model_path), *flags]) == 2
    out = capsys.readouterr()
    assert out.err == f"onnx-gtco: error: {message}\n" and out.out == ""


def test_check_help_shows_each_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    by_precision = "by the rewritten model's gtco.precision: "  # the numbers: test_check_precision.py
    for flag, default in (("--rtol", by_precision + defaults_text("rtol")),
                          ("--atol", by_precision + defaults_text("atol")),
                          ("--agreement", by_precision + defaults_text("agreement")), ("--samples", "1"),
                          ("--seed", "0"), ("--save-inputs", "not written"), ("--load-inputs", "seeded inputs")):
        assert re.search(re.escape(flag) + r" .*?\(default:? " + re.escape(default) + r"\)", text), flag


def test_check_unknown_provider_is_clear(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP")
    assert main(["check", str(model_path), str(model_path), "--provider", "cuda"]) == 2
    assert "CUDAExecutionProvider is not available" in capsys.readouterr().err


def test_console_script_runs(model_path: Path) -> None:
    exe = Path(sys.executable).with_name("onnx-gtco")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "onnx_gtco"]
    res = subprocess.run([*cmd, "inspect", str(model_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    res = subprocess.run([*cmd, "optimize", str(model_path.with_name("none.onnx"))], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1


def test_check_masks_and_ids_are_in_range() -> None:
    from onnx_gtco.runtime.check import make_inputs

    onnx_helper = onnx.helper
    table = onnx.numpy_helper.from_array(np.ones((7, 4), np.float32), "emb")
    g = onnx_helper.make_graph(
        [onnx_helper.make_node("Gather", ["emb", "ids"], ["e"])], "g",
        [onnx_helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 16]),
         onnx_helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, [2, 16])],
        [onnx_helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2, 16, 4])], [table])
    feeds = make_inputs(onnx_helper.make_model(g), seed=3)
    assert feeds["ids"].min() >= 0 and feeds["ids"].max() < 7 and len(np.unique(feeds["ids"])) > 1
    assert set(np.unique(feeds["attention_mask"])) == {0, 1}


def test_a_missing_optional_package_is_one_line_naming_its_extra(model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A feature importing a package that is not installed: exit 2, one line naming the package and the extra."""
    import onnx_gtco.cli as cli

    def needs_cupy(args: object) -> int:
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(cli, "cmd_inspect", needs_cupy)
    assert main(["inspect", str(model_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("onnx-gtco: error: onnx-gtco inspect needs the Python package cupy, which is not "
                           "installed: pip install 'onnx-gtco[gpu]'")


def test_a_storage_without_its_database_driver_names_it() -> None:
    from onnx_gtco.errors import MissingPackageError
    from onnx_gtco.tune.search import open_storage

    with pytest.raises(MissingPackageError, match=r"^the tuning storage mysql\+pymysql:// needs the Python "
                                                  r"package pymysql, which is not installed: pip install pymysql$"):
        open_storage("mysql+pymysql://u@127.0.0.1/db")
