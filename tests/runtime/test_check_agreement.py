"""check judges integer outputs (class ids after an ArgMax, token ids, masks) by agreement: the share of elements
equal to the original's, 100% by default at fp32 and 99% after a half-precision conversion, --agreement to set it
(tests/test_check_precision.py reads the defaults back from check --help)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco.cli import main
from onnx_gtco.runtime.check import DEFAULT_AGREEMENT, DEFAULT_TOLERANCES, compare, make_inputs

ROWS, CLASSES = 512, 8


def classifier(flip_rows: int = 0) -> onnx.ModelProto:
    """x [512, 8] -> scores = ReduceMax(x) (float), classes = ArgMax(x + bias) (int64). The bias is 0 in the
    original; for a 'rewritten' model it lifts another class above the winner in the first `flip_rows` rows of
    check's seeded input (seed 0), so exactly that many class ids differ."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, CLASSES])
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [ROWS]),
               helper.make_tensor_value_info("classes", TensorProto.INT64, [ROWS])]
    nodes = [helper.make_node("ReduceMax", ["x"], ["scores"], axes=[1], keepdims=0),
             helper.make_node("Add", ["x", "bias"], ["biased"]),
             helper.make_node("ArgMax", ["biased"], ["classes"], axis=1, keepdims=0)]
    bias = np.zeros((ROWS, CLASSES), np.float32)
    graph = helper.make_graph(nodes, "classifier", [x], outputs, [numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = make_inputs(model, seed=0)["x"]
    for row in range(flip_rows):
        winner = int(np.argmax(feeds[row]))
        bias[row, (winner + 1) % CLASSES] = 100.0
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(bias, "bias"))
    return model


@pytest.fixture
def files(tmp_path: Path) -> dict[str | None, Path]:
    """The original (key "original") and 'rewritten' copies with one class id in 512 flipped, tagged fp32, fp16,
    bf16, or not at all (None)."""
    out: dict[str | None, Path] = {"original": tmp_path / "orig.onnx"}
    onnx.save(classifier(), str(out["original"]))
    for precision in ("fp32", "fp16", "bf16", None):
        model = classifier(flip_rows=1)
        if precision is not None:
            model.metadata_props.append(onnx.StringStringEntryProto(key="gtco.precision", value=precision))
        out[precision] = tmp_path / f"new.{precision}.onnx"
        onnx.save(model, str(out[precision]))
    return out


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, str], str]:
    """Exit code, table rows by output name, last line of `onnx-gtco check ARGS`."""
    capsys.readouterr()
    code = main(["check", *args])
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out if line.split() and line.split()[0] in ("scores", "classes")}
    return code, rows, out[-1] if out else ""


def test_compare_counts_equal_ids() -> None:
    orig, new = classifier(), classifier(flip_rows=1)
    classes = {d.name: d for d in compare(orig, new, agreement=0.99)}["classes"]
    assert classes.exact and (classes.equal, classes.elements) == (ROWS - 1, ROWS) and classes.ok
    assert classes.max_abs >= 1  # what the tolerances judged: one id off by at least one class
    assert not {d.name: d for d in compare(orig, new)}["classes"].ok  # agreement 1 by default: every id


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_one_flipped_id_in_512_passes_after_a_half_precision_conversion(files, precision: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, rows, last = _check(capsys, str(files["original"]), str(files[precision]))
    assert code == 0, rows
    assert re.search(rf"\b{ROWS - 1} of {ROWS} elements equal \(99\.805%\), needs 99\.000% +ok$", rows["classes"])
    assert rows["scores"].endswith("ok")
    rtol, atol = DEFAULT_TOLERANCES[precision]
    assert last == (f"2 of 2 outputs within rtol={rtol:g} atol={atol:g} agreement={DEFAULT_AGREEMENT[precision]:g} "
                    f"(defaults for precision {precision})")


@pytest.mark.parametrize("precision", ["fp32", None])
def test_one_flipped_id_in_512_fails_at_fp32_naming_the_agreement_that_passes(
        files, precision: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    code, rows, last = _check(capsys, str(files["original"]), str(files[precision]))
    assert code == 1
    assert rows["classes"].endswith("needs 100.000%  FAIL (would pass with --agreement classes:0.998)")
    assert rows["scores"].endswith("ok")
    assert re.fullmatch(r"1 of 2 outputs within rtol=0.0001 atol=1e-05 agreement=1 \(defaults for precision fp32.*\)",
                        last), last
    code, rows, _ = _check(capsys, str(files["original"]), str(files[precision]), "--agreement", "classes:0.998")
    assert code == 0 and rows["classes"].endswith("ok")


def test_agreement_option_overrides_the_default(files, capsys: pytest.CaptureFixture[str]) -> None:
    orig, fp16 = str(files["original"]), str(files["fp16"])
    code, rows, last = _check(capsys, orig, fp16, "--agreement", "1")
    assert code == 1 and "FAIL" in rows["classes"]
    assert last == ("1 of 2 outputs within rtol=0.01 atol=0.02 (defaults for precision fp16), agreement=1 for "
                    "integer outputs (given)")
    assert _check(capsys, orig, fp16, "--agreement", "0.999")[0] == 1
    assert _check(capsys, orig, fp16, "--agreement", "0.998")[0] == 0
    code, _, last = _check(capsys, orig, fp16, "--agreement", "1", "classes:0.998")
    assert code == 0 and last.endswith(", agreement=1 (classes:0.998) for integer outputs (given)")
    code, _, last = _check(capsys, orig, str(files["fp32"]), "--agreement", "classes:0.99")  # default kept for others
    assert code == 0 and last == "2 of 2 outputs within rtol=0.0001 atol=1e-05 agreement=1 (classes:0.99) " \
        "(defaults for precision fp32)"


@pytest.mark.parametrize(("entry", "message"), [
    ("1.5", r"--agreement '1.5': expected the share of equal elements, a number from 0 to 1 \(0.99: 99%\), or "
            r"NAME:SHARE for one output"),
    ("-0.1", r"--agreement '-0.1': expected the share of equal elements, a number from 0 to 1 \(0.99: 99%\), or "
             r"NAME:SHARE for one output"),
    ("classes:most", r"--agreement 'classes:most': expected the share of equal elements, a number from 0 to 1 "
                     r"\(0.99: 99%\), or NAME:SHARE for one output"),
    ("scores:0.9", r"--agreement scores:0.9: output 'scores' is float32, and agreement judges integer outputs only; "
                   r"give a float output --atol / --rtol"),
    ("label:0.9", r"--agreement label:0.9: the models have no output 'label' \(their outputs: scores, classes\)"),
])
def test_a_bad_agreement_is_one_line_naming_it(files, entry: str, message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["check", str(files["original"]), str(files["fp16"]), "--agreement", entry]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.fullmatch(f"onnx-gtco: error: {message}", err), err
