"""check: per-output tolerances, error statistics, the tolerance a failing output would pass with, and inputs saved
to and loaded from an .npz."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco.cli import main
from onnx_gtco.errors import CheckError
from onnx_gtco.runtime.check import (
    OutputDiff,
    Tolerance,
    compare,
    format_diffs,
    inputs_npz,
    load_inputs,
    make_inputs,
    parse_tolerance,
    round_up,
)

FP32_WHY = "for precision fp32: the rewritten model has no gtco.precision metadata"  # the test models have none


def two_outputs(w_noise: float = 0.0, c_noise: float = 0.0) -> onnx.ModelProto:
    """x [4, 8] -> MatMul(w) -> logits, x + c -> hidden; the noise perturbs w and c (seeded) for a 'rewritten'
    model whose two outputs are off by different amounts."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal(8).astype(np.float32)
    noise = np.random.default_rng(8)
    w = w + w_noise * noise.standard_normal(w.shape).astype(np.float32)
    c = c + c_noise * noise.standard_normal(c.shape).astype(np.float32)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"]), helper.make_node("Add", ["x", "c"], ["hidden"])], "two",
        [vi("x", TensorProto.FLOAT, [4, 8])],
        [vi("logits", TensorProto.FLOAT, [4, 8]), vi("hidden", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def unary(*ops: str, elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """x [4, 8] through a chain of unary ops to y."""
    names = ["x", *[f"t{i}" for i in range(len(ops) - 1)], "y"]
    nodes = [helper.make_node(op, [names[i]], [names[i + 1]]) for i, op in enumerate(ops)]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "unary", [vi("x", elem, [4, 8])], [vi("y", elem, [4, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """original and 'rewritten' two-output models: logits off by ~1e-2, hidden by ~1e-4."""
    a, b = tmp_path / "orig.onnx", tmp_path / "new.onnx"
    onnx.save(two_outputs(), str(a))
    onnx.save(two_outputs(w_noise=3e-3, c_noise=1e-4), str(b))
    return a, b


def _run(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)


def _rows(out: str) -> dict[str, str]:
    """Table rows by output name."""
    return {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in
            ("logits", "hidden", "y")}


# -- tolerances ---------------------------------------------------------------------------------------------------


def test_parse_tolerance_default_and_per_output() -> None:
    t = parse_tolerance(["1e-3", "logits:1e-2", "a:b:0.5", "logits:2e-2"], 1e-5, "atol")
    assert t.default == 1e-3 and dict(t.per_output) == {"logits": 2e-2, "a:b": 0.5}
    assert t.of("logits") == 2e-2 and t.of("other") == 1e-3
    assert parse_tolerance(None, 1e-4, "rtol") == Tolerance(1e-4)
    assert t.describe("atol") == "atol=0.001 (logits:0.02 a:b:0.5)"


@pytest.mark.parametrize("entry", ["abc", "-1", "y:", ":1e-3", "nan", "inf", "y:-2"])
def test_a_bad_tolerance_is_one_line_naming_it(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
                                               entry: str) -> None:
    assert main(["check", str(pair[0]), str(pair[1]), "--atol", entry]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("onnx-gtco: error: --atol ")
    assert repr(entry) in err


def test_an_unknown_output_in_a_tolerance_names_the_outputs(pair: tuple[Path, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(pair[0]), str(pair[1]), "--rtol", "1e-3", "logit:1e-2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("onnx-gtco: error: --rtol logit:0.01: the models have no output 'logit' (their outputs: logits, "
                   "hidden)")


def test_per_output_tolerances_apply_to_their_output_only(pair: tuple[Path, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    a, b = (str(p) for p in pair)
    assert main(["check", a, b, "--atol", "1e-3"]) == 1
    rows = _rows(capsys.readouterr().out)
    assert "FAIL" in rows["logits"] and rows["hidden"].endswith("ok")
    assert main(["check", a, b, "--atol", "logits:1e-1"]) == 1
    rows = _rows(capsys.readouterr().out)
    assert rows["logits"].endswith("ok") and "FAIL" in rows["hidden"]
    assert main(["check", a, b, "--atol", "1e-3", "logits:1e-1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("2 of 2 outputs within rtol=0.0001 atol=0.001 (logits:0.1) "
                                                        f"(atol given, rtol default {FP32_WHY})")
    assert main(["check", a, b, "--rtol", "logits:1", "--atol", "1e-3"]) == 0  # repeated flags accumulate too
    assert capsys.readouterr().out.splitlines()[-1] == ("2 of 2 outputs within rtol=0.0001 (logits:1) atol=0.001 "
                                                        f"(atol given, rtol default {FP32_WHY})")


def test_the_defaults_are_unchanged(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    diffs = compare(pair[0], pair[1])
    assert [(d.atol, d.rtol) for d in diffs] == [(1e-5, 1e-4)] * 2
    assert main(["check", str(pair[0]), str(pair[1])]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"0 of 2 outputs within rtol=0.0001 atol=1e-05 (defaults {FP32_WHY})"


def test_compare_takes_plain_floats_positionally(pair: tuple[Path, Path]) -> None:
    loose = compare(pair[0], pair[1], "cpu", 1e-4, 1.0, 1, 0)
    assert all(d.ok for d in loose)
    tight = compare(pair[0], pair[1], "cpu", 1e-4, Tolerance(1.0, {"hidden": 1e-6}), 1, 0)
    assert [d.ok for d in tight] == [True, False]


# -- statistics ---------------------------------------------------------------------------------------------------


def test_statistics_are_over_every_sample(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    atol, rtol = 1e-3, 1e-4
    diffs = {d.name: d for d in compare(pair[0], pair[1], rtol=rtol, atol=atol, samples=3, seed=5)}
    model = onnx.load(str(pair[0]))
    refs = [_run(pair[0], make_inputs(model, 5 + k)) for k in range(3)]
    gots = [_run(pair[1], make_inputs(model, 5 + k)) for k in range(3)]
    for i, name in enumerate(("logits", "hidden")):
        r = np.concatenate([x[i].ravel() for x in refs]).astype(np.float64)
        g = np.concatenate([x[i].ravel() for x in gots]).astype(np.float64)
        err = np.abs(g - r)
        rel = err / np.maximum(np.abs(r), atol)
        d = diffs[name]
        assert err.min() > 0  # the inputs are not zeros: every element differs a little
        np.testing.assert_allclose([d.max_abs, d.mean_abs, d.median_abs], [err.max(), err.mean(), np.median(err)],
                                   rtol=1e-12)
        np.testing.assert_allclose([d.max_rel, d.mean_rel, d.median_rel], [rel.max(), rel.mean(), np.median(rel)],
                                   rtol=1e-12)
        cos = min(float(np.dot(x[i].ravel().astype(np.float64), y[i].ravel().astype(np.float64))
                        / np.linalg.norm(x[i].astype(np.float64)) / np.linalg.norm(y[i].astype(np.float64)))
                  for x, y in zip(refs, gots, strict=True))
        assert d.cosine == pytest.approx(cos, abs=1e-12) and d.cosine < 1.0
        assert d.need_atol == pytest.approx(max(0.0, float((err - rtol * np.abs(r)).max())), rel=1e-12)
    assert main(["check", str(pair[0]), str(pair[1]), "--samples", "3", "--seed", "5", "--atol", "1e-3"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["output", "max_abs", "mean_abs", "med_abs", "max_rel", "mean_rel",
                                           "med_rel", "cosine", "result"]
    cells = _rows(out)["logits"].split()
    d = diffs["logits"]
    assert [float(c) for c in cells[1:8]] == pytest.approx(
        [d.max_abs, d.mean_abs, d.median_abs, d.max_rel, d.mean_rel, d.median_rel, d.cosine], rel=1e-3)


# -- what a failing output would pass with -------------------------------------------------------------------------


@pytest.mark.parametrize(("x", "text"), [(3.04e-3, "3.1e-3"), (0.0, "0"), (123.4, "1.3e2"), (9.96, "1.0e1"),
                                         (1.0, "1.1e0"), (2.5e-12, "2.6e-12")])
def test_round_up_never_rounds_down(x: float, text: str) -> None:
    assert round_up(x) == text
    assert float(round_up(x)) >= x


def test_the_suggested_tolerances_pass_and_are_tight(pair: tuple[Path, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a, b = (str(p) for p in pair)
    base = ["check", a, b, "--samples", "2", "--atol", "hidden:1e-2"]
    assert main(base) == 1
    verdict = _rows(capsys.readouterr().out)["logits"]
    m = re.search(r"FAIL \(would pass with --atol logits:(\S+) or --rtol logits:(\S+)\)$", verdict)
    assert m, verdict
    need_atol, need_rtol = float(m.group(1)), float(m.group(2))
    assert main([*base, "logits:" + m.group(1)]) == 0
    assert main(["check", a, b, "--samples", "2", "--atol", "hidden:1e-2", "--rtol", "logits:" + m.group(2)]) == 0
    # the suggestions are the smallest at two significant digits: 10 % less fails
    assert main([*base, f"logits:{need_atol * 0.9:g}"]) == 1
    assert main(["check", a, b, "--samples", "2", "--atol", "hidden:1e-2", "--rtol", f"logits:{need_rtol * 0.9:g}"]
                ) == 1


def test_no_rtol_passes_where_the_reference_is_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Relu's zeros against the identity: the error there is |x| whatever rtol, so only an atol can pass."""
    onnx.save(unary("Relu"), str(tmp_path / "a.onnx"))
    onnx.save(unary("Identity"), str(tmp_path / "b.onnx"))
    (d,) = compare(tmp_path / "a.onnx", tmp_path / "b.onnx")
    assert not d.ok and d.need_rtol == float("inf") and 0 < d.need_atol < np.inf
    assert main(["check", str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx")]) == 1
    verdict = _rows(capsys.readouterr().out)["y"]
    assert verdict.endswith(f"FAIL (would pass with --atol y:{round_up(d.need_atol)})")


def test_a_new_nan_fails_whatever_the_tolerance(tmp_path: Path) -> None:
    onnx.save(unary("Abs", "Sqrt"), str(tmp_path / "a.onnx"))
    onnx.save(unary("Sqrt"), str(tmp_path / "b.onnx"))  # NaN at the negative inputs
    (d,) = compare(tmp_path / "a.onnx", tmp_path / "b.onnx", atol=1e3, rtol=1e3)
    assert not d.ok and d.nan_bad and d.need_atol == d.need_rtol == float("inf")
    assert format_diffs([d]).endswith("FAIL (NaN where the original has none: no tolerance passes)")


def test_format_diffs_quotes_a_name_the_shell_would_split() -> None:
    d = OutputDiff("out put", 0.5, 0.25, 0.9, False, need_atol=0.5, need_rtol=0.25)
    assert format_diffs([d]).endswith("FAIL (would pass with --atol 'out put:5.1e-1' or --rtol 'out put:2.6e-1')")


# -- samples and seed ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"samples": 0}, {"samples": -2}, {"seed": -1}])
def test_compare_refuses_no_samples_and_negative_seeds(pair: tuple[Path, Path], kwargs: dict[str, int]) -> None:
    with pytest.raises(CheckError, match="must be"):
        compare(pair[0], pair[1], **kwargs)


def test_more_samples_see_more(pair: tuple[Path, Path]) -> None:
    one = {d.name: d for d in compare(pair[0], pair[1], samples=1, seed=0)}
    four = {d.name: d for d in compare(pair[0], pair[1], samples=4, seed=0)}
    assert four["logits"].max_abs >= one["logits"].max_abs
    assert four["logits"].mean_abs != one["logits"].mean_abs


# -- saved and loaded inputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("samples", [1, 3])
def test_saved_inputs_are_the_seeded_ones_and_load_back(pair: tuple[Path, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], samples: int) -> None:
    a, b = (str(p) for p in pair)
    npz = tmp_path / "inputs.npz"
    assert main(["check", a, b, "--samples", str(samples), "--seed", "4", "--save-inputs", str(npz)]) == 1
    seeded_out = capsys.readouterr().out
    model = onnx.load(a)
    with np.load(npz) as z:
        saved = {k: z[k] for k in z.files}
    if samples == 1:
        assert list(saved) == ["x"]
        np.testing.assert_array_equal(saved["x"], make_inputs(model, 4)["x"])
    else:
        assert sorted(saved) == ["sample0/x", "sample1/x", "sample2/x"]
        for k in range(samples):
            np.testing.assert_array_equal(saved[f"sample{k}/x"], make_inputs(model, 4 + k)["x"])
    assert [f["x"].tolist() for f in load_inputs(npz, model)] == [make_inputs(model, 4 + k)["x"].tolist()
                                                                   for k in range(samples)]
    assert main(["check", a, b, "--load-inputs", str(npz)]) == 1
    assert _rows(capsys.readouterr().out) == _rows(seeded_out)


def test_loaded_inputs_are_the_ones_compared(pair: tuple[Path, Path], tmp_path: Path) -> None:
    x = (100 * np.random.default_rng(11).standard_normal((4, 8))).astype(np.float32)
    npz = tmp_path / "mine.npz"
    np.savez(npz, x=x)
    ref, got = _run(pair[0], {"x": x}), _run(pair[1], {"x": x})
    diffs = compare(pair[0], pair[1], inputs=npz)
    assert [d.max_abs for d in diffs] == pytest.approx(
        [float(np.abs(g.astype(np.float64) - r).max()) for r, g in zip(ref, got, strict=True)], rel=1e-12)
    assert diffs[0].max_abs > 10 * compare(pair[0], pair[1])[0].max_abs  # not the seeded N(0, 1) inputs
    assert [d.max_abs for d in compare(pair[0], pair[1], inputs=[{"x": x}])] == [d.max_abs for d in diffs]


def test_an_input_named_like_a_sample_key_round_trips(tmp_path: Path) -> None:
    """One sample keys by the input's name even when that name looks like sample<K>/<name>."""
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Relu", ["sample0/x"], ["y"])], "g",
                              [vi("sample0/x", TensorProto.FLOAT, [2, 3])], [vi("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = make_inputs(model, 3)
    npz = tmp_path / "in.npz"
    npz.write_bytes(inputs_npz([feeds]))
    (back,) = load_inputs(npz, model)
    assert list(back) == ["sample0/x"]
    np.testing.assert_array_equal(back["sample0/x"], feeds["sample0/x"])


def _x(shape=(4, 8), dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(2).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({}, "holds no arrays"),
        ({"z": _x()}, r"'z' is not an input of the model \(its inputs: x\)"),
        ({"x": _x(), "z": _x()}, r"'z' is not an input of the model \(its inputs: x\)"),
        ({"sample0/x": _x(), "sample1/z": _x()}, r"input 'sample1/z' is not an input of the model"),
        ({"sample0/x": _x(), "sample2/x": _x()}, r"samples 0, 2 given, sample1 is missing"),
        ({"sample0/x": _x(), "sample1/y": _x(), "sample1/x": _x()}, r"'sample1/y' is not an input"),
        ({"x": _x(), "sample1/x": _x()}, r"'x' is keyed by the input's name, the other arrays by sample<K>/<input>"),
        ({"x": _x(dtype=np.float64)}, r"input 'x' is float64, the model takes float32"),
        ({"sample0/x": _x(), "sample1/x": _x(dtype=np.int64)}, r"input 'sample1/x' is int64, the model takes float32"),
        ({"x": _x((32,))}, r"input 'x' has rank 1 \(shape \[32\]\), the model takes rank 2 \[4, 8\]"),
        ({"x": _x((4, 7))}, r"input 'x' has shape \[4, 7\], the model takes \[4, 8\]"),
    ],
    ids=["empty", "extra-only", "extra", "extra-in-sample", "sample-gap", "missing-in-sample", "mixed-keys", "dtype",
         "dtype-in-sample", "rank", "fixed-dim"],
)
def test_bad_loaded_inputs_are_one_line_naming_the_input(pair: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         arrays: dict[str, np.ndarray], message: str) -> None:
    npz = tmp_path / "bad.npz"
    npz.write_bytes(inputs_npz([arrays]) if arrays else _empty_npz())
    before = sorted(os.listdir(tmp_path))
    assert main(["check", str(pair[0]), str(pair[1]), "--load-inputs", str(npz),
                 "--save-inputs", str(tmp_path / "out.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"onnx-gtco: error: --load-inputs {npz}: ")
    assert re.search(message, err), err
    assert sorted(os.listdir(tmp_path)) == before


def _empty_npz() -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf)
    return buf.getvalue()


def test_a_missing_sample_input_is_named(pair: tuple[Path, Path], tmp_path: Path) -> None:
    model = onnx.load(str(pair[0]))
    vi = helper.make_tensor_value_info
    model.graph.input.append(vi("mask", TensorProto.INT64, [4, 8]))
    npz = tmp_path / "in.npz"
    npz.write_bytes(inputs_npz([{"x": _x()}]))
    with pytest.raises(CheckError, match=r"input 'mask' is missing \(the model's inputs: x, mask\)$"):
        load_inputs(npz, model)


@pytest.mark.parametrize(("content", "message"), [(None, "no such file"), (b"not a zip", "not an .npz"),
                                                  ("npy", "a single .npy array")])
def test_an_unreadable_inputs_file_is_one_line(pair: tuple[Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str], content, message: str) -> None:
    path = tmp_path / "in.npz"
    if content == "npy":
        np.save(path.with_suffix(".npy"), _x())
        path = path.with_suffix(".npy")
    elif content is not None:
        path.write_bytes(content)
    assert main(["check", str(pair[0]), str(pair[1]), "--load-inputs", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and str(path) in err


def test_load_inputs_excludes_the_seeded_options(pair: tuple[Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    npz = tmp_path / "in.npz"
    npz.write_bytes(inputs_npz([{"x": _x()}]))
    assert main(["check", str(pair[0]), str(pair[1]), "--load-inputs", str(npz), "--samples", "2", "--seed", "0"]
                ) == 2
    assert capsys.readouterr().err.strip() == ("onnx-gtco: error: --load-inputs gives the inputs, so --samples and "
                                               "--seed would be unused; drop them")


def test_save_inputs_writes_nothing_when_the_check_cannot_run(pair: tuple[Path, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "saved.npz"
    broken = tmp_path / "broken.onnx"
    model = two_outputs()
    model.graph.node[0].op_type = "NoSuchOp"
    onnx.save(model, str(broken))
    before = sorted(os.listdir(tmp_path))
    assert main(["check", str(pair[0]), str(broken), "--save-inputs", str(out)]) == 2
    assert sorted(os.listdir(tmp_path)) == before
    assert main(["check", str(pair[0]), str(pair[1]), "--save-inputs", str(tmp_path / "no" / "x.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    out.write_bytes(b"old")
    assert main(["check", str(pair[0]), str(broken), "--save-inputs", str(out)]) == 2
    assert out.read_bytes() == b"old"
    assert main(["check", str(pair[0]), str(pair[0]), "--save-inputs", str(out)]) == 0
    assert sorted(os.listdir(tmp_path)) == [*before, "saved.npz"] and np.load(out)["x"].shape == (4, 8)
