"""check's default tolerances follow the rewritten model's precision (its gtco.precision metadata) and are printed;
given flags win; and the fp16 defaults pass a correct fp16 model and fail a wrong one against the fp32 original."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco import GtcoConfig, models, optimize
from onnx_gtco.cli import main, parser
from onnx_gtco.runtime.check import (
    DEFAULT_AGREEMENT,
    DEFAULT_MIN_COSINE,
    DEFAULT_TOLERANCES,
    compare,
    default_tolerances,
    resolve_tolerances,
)


def pair_model(noise: float) -> onnx.ModelProto:
    """x [4, 8] @ w -> logits, x + c -> hidden; `noise` perturbs w (seeded)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 8)).astype(np.float32) * 0.1
    w = w + noise * np.random.default_rng(8).standard_normal(w.shape).astype(np.float32)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"]), helper.make_node("Add", ["x", "c"], ["hidden"])], "two",
        [vi("x", TensorProto.FLOAT, [4, 8])],
        [vi("logits", TensorProto.FLOAT, [4, 8]), vi("hidden", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(8, np.float32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def tagged(model: onnx.ModelProto, precision: str | None) -> onnx.ModelProto:
    if precision is not None:
        model.metadata_props.append(onnx.StringStringEntryProto(key="gtco.precision", value=precision))
    return model


@pytest.fixture
def files(tmp_path: Path):
    """The original, and 'rewritten' copies whose logits are off by ~3e-4 (an fp16-sized error: outside fp32's
    defaults, inside fp16's), tagged fp32, fp16, bf16, or not at all."""
    orig = tmp_path / "orig.onnx"
    onnx.save(pair_model(0.0), str(orig))
    out = {}
    for precision in ("fp32", "fp16", "bf16", None):
        path = tmp_path / f"new.{precision}.onnx"
        onnx.save(tagged(pair_model(1e-4), precision), str(path))
        out[precision] = path
    return orig, out


def last_line(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_defaults_follow_the_precision_metadata(files, precision: str) -> None:
    rtol, atol, why = default_tolerances(files[1][precision])
    assert (rtol, atol) == DEFAULT_TOLERANCES[precision]
    assert why == f"defaults for precision {precision}"
    assert DEFAULT_TOLERANCES["fp32"] == (1e-4, 1e-5)  # what check used for every model before


def test_a_model_without_the_metadata_gets_fp32_defaults_and_says_why(files, tmp_path: Path) -> None:
    assert default_tolerances(files[1][None]) == (
        1e-4, 1e-5, "defaults for precision fp32: the rewritten model has no gtco.precision metadata")
    odd = tmp_path / "odd.onnx"
    onnx.save(tagged(pair_model(0.0), "int4"), str(odd))
    assert default_tolerances(odd)[2] == ("defaults for precision fp32: the rewritten model has unknown "
                                          "gtco.precision 'int4'")


def test_check_prints_the_tolerances_and_why(files, capsys: pytest.CaptureFixture[str]) -> None:
    orig, new = files
    assert main(["check", str(orig), str(new["fp32"])]) == 1  # the ~3e-4 error fails fp32's defaults
    assert last_line(capsys) == "1 of 2 outputs within rtol=0.0001 atol=1e-05 (defaults for precision fp32)"
    assert main(["check", str(orig), str(new["fp16"])]) == 0  # the same model tagged fp16 passes fp16's
    assert last_line(capsys) == "2 of 2 outputs within rtol=0.01 atol=0.02 (defaults for precision fp16)"
    assert main(["check", str(orig), str(new["bf16"])]) == 0
    assert last_line(capsys) == "2 of 2 outputs within rtol=0.08 atol=0.16 (defaults for precision bf16)"
    assert main(["check", str(orig), str(new[None])]) == 1
    assert last_line(capsys).endswith("(defaults for precision fp32: the rewritten model has no gtco.precision "
                                      "metadata)")


def test_given_flags_win(files, capsys: pytest.CaptureFixture[str]) -> None:
    orig, new = files
    fp16 = str(new["fp16"])
    assert main(["check", str(orig), fp16, "--rtol", "1e-4", "--atol", "1e-5"]) == 1  # both given: fp32's values
    assert last_line(capsys) == "1 of 2 outputs within rtol=0.0001 atol=1e-05 (given)"
    assert main(["check", str(orig), fp16, "--atol", "1e-6"]) == 1  # one given: the other from the precision
    assert last_line(capsys) == ("1 of 2 outputs within rtol=0.01 atol=1e-06 "
                                 "(atol given, rtol default for precision fp16)")
    # NAME:TOL alone sets that output and keeps the precision's default for the rest
    assert main(["check", str(orig), fp16, "--atol", "logits:1e-6", "--rtol", "logits:0"]) == 1
    assert last_line(capsys) == ("1 of 2 outputs within rtol=0.01 (logits:0) atol=0.02 (logits:1e-06) "
                                 "(defaults for precision fp16)")


def test_a_malformed_flag_is_reported_before_the_model_is_read(tmp_path: Path) -> None:
    from onnx_gtco.errors import CheckError

    with pytest.raises(CheckError, match="--atol 'x'"):
        resolve_tolerances(None, ["x"], tmp_path / "missing.onnx")


# --- the fp16 defaults on a real fp16 model ------------------------------------------------------------------

def _fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_float_to_float16(model, keep_io_types=True)


def _help_of(flag: str) -> str:
    """check --help's text of one option (from its line to the next option's), its lines joined."""
    sub = next(a for a in parser()._actions if a.dest == "cmd").choices["check"]
    m = re.search(rf"^  {flag} (.*?)(?=^  -)", sub.format_help(), re.M | re.S)
    assert m, f"check --help has no {flag}"
    return " ".join(m.group(1).split())


@pytest.mark.parametrize(("flag", "defaults"), [
    ("--rtol", {p: t[0] for p, t in DEFAULT_TOLERANCES.items() if p not in DEFAULT_MIN_COSINE}),
    ("--atol", {p: t[1] for p, t in DEFAULT_TOLERANCES.items() if p not in DEFAULT_MIN_COSINE}),
    ("--agreement", DEFAULT_AGREEMENT),
])
def test_help_states_the_defaults_check_applies(flag: str, defaults: dict[str, float]) -> None:
    """Read back from check --help: each precision's number there is the one check uses (the help stated fp16 and
    bf16 atols of 3e-3 and 2.4e-2 long after check had moved to 2e-2 and 1.6e-1)."""
    text = _help_of(flag)
    stated = {p: float(v) for p, v in re.findall(r"\b(fp32|fp16|bf16|fp8) (\d[\d.e+-]*)", text)}
    assert stated == defaults, text
    if flag != "--agreement":  # fp8 is judged by cosine, and the help says so
        assert all(f"{p} by cosine" in text for p in DEFAULT_MIN_COSINE), text


def _scaled(model: onnx.ModelProto, name_part: str, factor: float) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if name_part in t.name:
            a = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array((a.astype(np.float32) * factor).astype(a.dtype), t.name))
    return out


@pytest.mark.slow
def test_fp16_defaults_pass_a_correct_fp16_vit_and_fail_a_wrong_one(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """ViT-tiny in fp16, optimized for fp16, against its fp32 original: within fp16's defaults (and not fp32's); with
    every GELU's sqrt(2) 10% off, outside them."""
    original = models.build("vit-tiny")
    orig = tmp_path / "vit.onnx"
    onnx.save(original, str(orig))
    for label, model in (("ok", _fp16(original)), ("wrong", _scaled(_fp16(original), "sqrt2", 1.10))):
        path = tmp_path / f"vit.{label}.gtco.onnx"
        onnx.save(optimize(model, GtcoConfig(precision="fp16")).model, str(path))
        code = main(["check", str(orig), str(path), "--samples", "4"])
        line = last_line(capsys)
        assert line.endswith("(defaults for precision fp16)")
        assert code == (0 if label == "ok" else 1), line
        if label == "ok":
            fp32 = compare(orig, path, "cpu", *DEFAULT_TOLERANCES["fp32"], samples=4)
            assert not fp32[0].ok  # what fp32's defaults would have said of a correct fp16 model
