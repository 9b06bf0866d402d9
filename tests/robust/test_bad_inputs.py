"""Bad and unusual input through `onnx-gtco optimize`, as a user meets it.

Errors end with one line `onnx-gtco: error: ...`, exit 2, and the output directory exactly as it was (no model, no
report, no temp file). The unusual-but-valid inputs succeed with the right outcome. The loader-level cases are in
tests/ir/test_load.py; the missing and the empty input file at the CLI in tests/test_cli.py. The module prints how
every case it tried ended.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_gtco.cli import main

Mlp = Callable[..., onnx.ModelProto]
"""tests/conftest.py's mlp builder (x -> MatMul+Add -> Relu -> MatMul+Add -> y), the make_mlp fixture."""

OUTCOMES: dict[str, str] = {}
"""case id -> how it ended, printed when the module finishes."""


@pytest.fixture(scope="module", autouse=True)
def _print_outcomes(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    errors = sum(v.startswith("exit 2") for v in OUTCOMES.values())
    lines = [f"bad inputs tried: {len(OUTCOMES)} ({errors} refused with exit 2, {len(OUTCOMES) - errors} succeeded)"]
    lines += [f"  {k:<28} {v}" for k, v in sorted(OUTCOMES.items())]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # straight to the run's log, under pytest-xdist workers too
        sys.stderr.write("\n" + "\n".join(lines) + "\n")


# --- models --------------------------------------------------------------------------------------------------------

def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The mlp's output in float64 numpy (the higher-precision reference)."""
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    h = np.maximum(x.astype(np.float64) @ w["w0"] + w["b0"], 0.0)
    return h @ w["w1"] + w["b1"]


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _old_opset(mlp_model: Mlp, opset: int) -> onnx.ModelProto:
    """The mlp as an exporter of that opset wrote it: IR version of its time, initializers also graph inputs."""
    m = mlp_model()
    m.opset_import[0].version = opset
    m.ir_version = {7: 3, 8: 3, 9: 4, 10: 5, 11: 6, 12: 7}[opset]
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in m.graph.initializer)
    return m


def _retyped(mlp_model: Mlp, dtype: int) -> onnx.ModelProto:
    m = mlp_model()
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    for t in m.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np_dtype), t.name))
    for v in (*m.graph.input, *m.graph.output):
        v.type.tensor_type.elem_type = dtype
    return m


def _dequantize_chain() -> onnx.ModelProto:
    """int8 input -> Cast -> Mul scale -> Add bias -> Relu: an elementwise chain reading an int8 tensor."""
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
             numpy_helper.from_array(np.linspace(-1, 1, 16).astype(np.float32), "bias")]
    nodes = [helper.make_node("Cast", ["q"], ["f"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "scale"], ["p"], name="scale_mul"),
             helper.make_node("Add", ["p", "bias"], ["s"], name="bias_add"),
             helper.make_node("Relu", ["s"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "int8", [helper.make_tensor_value_info("q", TensorProto.INT8, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _with_unknown_op(mlp_model: Mlp) -> onnx.ModelProto:
    """The mlp with a custom-domain op between the activation and the second GEMM."""
    m = mlp_model()
    frob = helper.make_node("Frobnicate", ["r0"], ["f0"], name="frob", domain="com.example", gain=2.5,
                            mode="wide")
    m.graph.node.insert(3, frob)
    m.graph.node[4].input[0] = "f0"
    m.opset_import.append(helper.make_opsetid("com.example", 3))
    return m


def _external(mlp_model: Mlp, path: Path, data_name: str) -> onnx.ModelProto:
    """Save the mlp with every initializer in the file `data_name` beside `path`; returns the mlp as it was."""
    onnx.save(mlp_model(), str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name,
              size_threshold=0)
    return mlp_model()


# --- error cases ---------------------------------------------------------------------------------------------------

def _save(model: onnx.ModelProto, d: Path, name: str = "m.onnx") -> Path:
    onnx.save(model, str(d / name))
    return d / name


def _truncated(d: Path, mlp_model: Mlp) -> list[str]:
    data = mlp_model().SerializeToString()
    (d / "cut.onnx").write_bytes(data[: len(data) * 2 // 3])
    return [str(d / "cut.onnx")]


def _random_bytes(d: Path, mlp_model: Mlp) -> list[str]:
    (d / "noise.onnx").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return [str(d / "noise.onnx")]


def _not_a_model(d: Path, mlp_model: Mlp) -> list[str]:
    """A valid protobuf of another message (an ONNX tensor)."""
    t = numpy_helper.from_array(np.arange(64, dtype=np.float32), "t")
    (d / "tensor.onnx").write_bytes(t.SerializeToString())
    return [str(d / "tensor.onnx")]


def _cycle(d: Path, mlp_model: Mlp) -> list[str]:
    m = mlp_model()
    m.graph.node[0].input[0] = "y"  # fc0 reads the last node's output
    m.graph.input[0].name = "unused"
    return [str(_save(m, d))]


def _dangling(d: Path, mlp_model: Mlp) -> list[str]:
    m = mlp_model()
    m.graph.node[2].input[0] = "nowhere"
    return [str(_save(m, d))]


def _missing_external(d: Path, mlp_model: Mlp) -> list[str]:
    _external(mlp_model, d / "m.onnx", "weights.bin")
    (d / "weights.bin").unlink()
    return [str(d / "m.onnx")]


def _short_external(d: Path, mlp_model: Mlp) -> list[str]:
    _external(mlp_model, d / "m.onnx", "weights.bin")
    with open(d / "weights.bin", "r+b") as f:
        f.truncate(100)
    return [str(d / "m.onnx")]


def _unconvertible_opset(d: Path, mlp_model: Mlp) -> list[str]:
    """Opset 7 with ImageScaler, an experimental op that left ONNX: no conversion exists."""
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 4, 4]) for n in ("x", "y")]
    node = helper.make_node("ImageScaler", ["x"], ["y"], scale=2.0, bias=[0.0, 0.0, 0.0])
    m = helper.make_model(helper.make_graph([node], "old", vi[:1], vi[1:]),
                          opset_imports=[helper.make_opsetid("", 7)], ir_version=3)
    return [str(_save(m, d))]


def _missing_out_dir(d: Path, mlp_model: Mlp) -> list[str]:
    return [str(_save(mlp_model(), d)), "-o", str(d / "absent" / "m.gtco.onnx")]


def _report_unwritable(d: Path, mlp_model: Mlp) -> list[str]:
    """The report path is a directory: the model, written first, must go again."""
    (d / "taken").mkdir()
    return [str(_save(mlp_model(), d)), "-o", str(d / "m.gtco.onnx"), "--report", str(d / "taken")]


ERRORS: dict[str, tuple[Callable[[Path, Mlp], list[str]], str]] = {
    "truncated-protobuf": (_truncated, r"not a valid ONNX protobuf|holds no ONNX graph"),
    "random-bytes": (_random_bytes, r"not a valid ONNX protobuf|holds no ONNX graph"),
    "non-model-protobuf": (_not_a_model, r"holds no ONNX graph|not a valid ONNX protobuf"),
    "graph-cycle": (_cycle, r"invalid ONNX model"),
    "dangling-input": (_dangling, r"invalid ONNX model: input 'nowhere' of node 'act' \(Relu\) is no graph input"),
    "external-data-missing": (_missing_external, r"external data of tensor '\w+' is missing: .*weights\.bin"),
    "external-data-truncated": (_short_external, r"external data of tensor '\w+' is truncated"),
    "opset7-unconvertible": (_unconvertible_opset, r"ImageScaler has no ONNX definition at opset 7"),
    "output-dir-missing": (_missing_out_dir, r"directory .*absent does not exist"),
    "report-unwritable": (_report_unwritable, r"taken: write failed"),
}


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_error_is_one_line_exit_2_and_leaves_nothing(case: str, tmp_path: Path, make_mlp: Mlp,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    setup, message = ERRORS[case]
    args = setup(tmp_path, make_mlp)
    before = _listing(tmp_path)
    capsys.readouterr()
    code = main(["optimize", "--no-build", *args])
    captured = capsys.readouterr()
    err = captured.err.strip()
    OUTCOMES[case] = f"exit {code}: {err.replace(str(tmp_path) + os.sep, '')[:100]}"
    assert code == 2, captured
    assert len(err.splitlines()) == 1 and err.startswith("onnx-gtco: error: "), err
    assert captured.out == "", captured.out
    assert re.search(message, err), err
    assert _listing(tmp_path) == before


def test_read_only_output_dir(tmp_path: Path, mlp: onnx.ModelProto) -> None:
    """A directory the user may not write: chmod where that binds (not root), else (root ignores modes) a
    read-only tmpfs mounted in a private mount namespace around the command."""
    model = _save(mlp, tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):
            cmd = [sys.executable, "-m", "onnx_gtco", "optimize", "--no-build", str(model), "-o", str(ro / "x.onnx")]
        elif shutil.which("unshare") and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0:
            inner = (f"mount -t tmpfs -o ro,size=64k tmpfs {ro} && exec {sys.executable} -m onnx_gtco optimize "
                     f"--no-build {model} -o {ro / 'x.onnx'}")
            cmd = ["unshare", "-m", "sh", "-c", inner]
        else:
            pytest.skip("running as root without mount namespaces: no directory here is read-only to this user")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        ro.chmod(0o700)
    err = res.stderr.strip()
    OUTCOMES["output-dir-read-only"] = f"exit {res.returncode}: {err.replace(str(tmp_path) + os.sep, '')[:100]}"
    assert res.returncode == 2, res
    assert len(err.splitlines()) == 1 and re.match(r"onnx-gtco: error: .*is not writable", err), err
    assert list(ro.iterdir()) == []
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "ro"]


# --- inputs that are not errors ------------------------------------------------------------------------------------

def _optimize_ok(case: str, model: Path, *extra: str) -> tuple[onnx.ModelProto, dict, Path]:
    """optimize --no-build, exit 0; exactly the model and its report added to the directory."""
    d = model.parent
    before = set(_listing(d))
    code = main(["optimize", "--no-build", str(model), *extra])
    out = d / (model.name[:-5] + ".gtco.onnx")
    report = json.loads((d / (out.name + ".report.json")).read_text()) if code == 0 else {}
    OUTCOMES[case] = (f"exit {code}: {report.get('nodes_before')} -> {report.get('nodes_after')} nodes, "
                      f"{len(report.get('groups', []))} groups, {len(report.get('rejected', []))} rejected")
    assert code == 0
    added = set(_listing(d)) - before
    assert added == {out.name, out.name + ".report.json", *(p for p in added if p == out.name + ".data")}
    return onnx.load(str(out), load_external_data=False), report, out


@pytest.mark.parametrize("opset", range(7, 13))
def test_old_opsets_are_converted(opset: int, tmp_path: Path, make_mlp: Mlp) -> None:
    src = _old_opset(make_mlp, opset)
    model, report, out = _optimize_ok(f"opset{opset}-converted", _save(src, tmp_path))
    assert {(o.domain, o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")} == {("", 17)}
    assert report["nodes_after"] < report["nodes_before"] == 5
    x = np.random.default_rng(opset).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _reference(src, x), rtol=1e-5, atol=1e-5)


def test_old_opset_the_converter_cannot_keep_is_passed_through(tmp_path: Path, scan8: onnx.ModelProto,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Converting would make another model, and the rules read opset >= 13: the model is written unfused at its own
    opset, with one warning line and the reason in the report."""
    src = scan8
    capsys.readouterr()
    model, report, out = _optimize_ok("opset8-scan-passed-through", _save(src, tmp_path))
    # one warning; beside it only the note naming the target chosen for the user (who named none)
    err = "\n".join(ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("onnx-gtco: note: "))
    assert len(err.splitlines()) == 1 and re.match(r"onnx-gtco: warning: not optimized: .*opset 8 < 13 and onnx's "
                                                   r"version converter changed the graph's inputs or outputs", err), err
    assert [r["pattern"] for r in report["rejected"]] == ["model"] and report["groups"] == []
    assert [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in src.graph.node]
    assert ("", 8) in {(o.domain, o.version) for o in model.opset_import}
    rng = np.random.default_rng(8)
    init, xs = rng.standard_normal((1, 2)).astype(np.float32), rng.standard_normal((1, 3, 2)).astype(np.float32)
    final, ys = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"init": init, "xs": xs})
    expected = init.astype(np.float64)[:, None, :] + np.cumsum(xs.astype(np.float64), axis=1)
    np.testing.assert_allclose(ys, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(final, expected[:, -1], rtol=1e-6, atol=1e-6)


def test_unknown_domain_op_is_kept_untouched(tmp_path: Path, make_mlp: Mlp) -> None:
    src = _with_unknown_op(make_mlp)
    model, report, _ = _optimize_ok("unknown-domain-op-kept", _save(src, tmp_path))
    kept = [n for n in model.graph.node if n.domain == "com.example"]
    assert len(kept) == 1 and kept[0].SerializeToString(deterministic=True) == \
        src.graph.node[3].SerializeToString(deterministic=True)
    assert ("com.example", 3) in {(o.domain, o.version) for o in model.opset_import}
    assert report["groups"] and all("frob" not in g["nodes"] for g in report["groups"])


def test_external_data_in_a_sibling_file(tmp_path: Path, make_mlp: Mlp) -> None:
    src = _external(make_mlp, tmp_path / "m.onnx", "m.weights")
    _, report, out = _optimize_ok("external-data-sibling", tmp_path / "m.onnx")
    assert report["groups"]
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _reference(src, x), rtol=1e-5, atol=1e-5)


def test_symbolic_and_zero_sized_dims(tmp_path: Path, make_mlp: Mlp) -> None:
    sym = make_mlp(rows="batch")
    model, report, out = _optimize_ok("symbolic-dims", _save(sym, tmp_path, "sym.onnx"))
    assert [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == ["batch", 8]
    assert report["groups"]
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _reference(sym, x), rtol=1e-5, atol=1e-5)

    zero = make_mlp(rows=0)
    model, report, out = _optimize_ok("zero-sized-dims", _save(zero, tmp_path, "zero.onnx"))
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [0, 8]
    assert _run(out, np.zeros((0, 8), np.float32)).shape == (0, 8)


def test_float64_and_int8_groups_stay_unfused_with_the_reason(tmp_path: Path, make_mlp: Mlp) -> None:
    f64 = _save(_retyped(make_mlp, TensorProto.DOUBLE), tmp_path, "f64.onnx")
    model, report, _ = _optimize_ok("float64-left-unfused", f64)
    assert report["groups"] == [] and report["nodes_after"] == report["nodes_before"] == 5
    reasons = {r["reason"] for r in report["rejected"]}
    assert reasons and all(re.search(r"is double: no fused kernel", r) for r in reasons), reasons

    model, report, _ = _optimize_ok("int8-left-unfused", _save(_dequantize_chain(), tmp_path, "i8.onnx"))
    assert any(re.search(r"tensor 'q' of node 'cast' is int8: no fused kernel", r["reason"])
               for r in report["rejected"]), report["rejected"]
    assert all("cast" not in g["nodes"] for g in report["groups"])
    assert [n.name for n in model.graph.node if n.op_type == "Cast"] == ["cast"]


# --- a model over 2 GB ---------------------------------------------------------------------------------------------

_BIG_ROWS, _WIDTH = 2**26 + 64, 8  # an embedding table of 2 GiB + 2 KiB of float32

_BIG_CHILD = textwrap.dedent("""
    import sys
    from onnx_gtco.cli import main
    code = main(["optimize", "--no-build", sys.argv[1]])
    # VmHWM is this process image's own peak; ru_maxrss would also count the forking parent's (a big pytest worker)
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) // 1024)
    sys.exit(code)
""")


def _big_model(d: Path, mlp_model: Mlp) -> tuple[Path, np.ndarray]:
    """ids -> Gather(table) -> mlp, the table's 2 GiB in big.onnx.data written sparsely: real rows at its start, a
    hole for the rest (nothing of that size is ever in memory)."""
    rng = np.random.default_rng(11)
    head = rng.standard_normal((16, _WIDTH)).astype(np.float32)
    nbytes = _BIG_ROWS * _WIDTH * 4
    with open(d / "big.onnx.data", "wb") as f:
        f.write(head.tobytes())
        f.truncate(nbytes)
    table = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[_BIG_ROWS, _WIDTH],
                        data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "big.onnx.data"), ("offset", "0"), ("length", str(nbytes))):
        table.external_data.add(key=k, value=v)
    mlp = mlp_model()
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"], name="embed"), *mlp.graph.node]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
                              list(mlp.graph.output), [table, *mlp.graph.initializer])
    (d / "big.onnx").write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                   ir_version=8).SerializeToString())
    return d / "big.onnx", head


def _vm_kb(field: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(field + ":")).split()[1])


def test_model_over_2gb_keeps_its_weights_on_disk(tmp_path: Path, make_mlp: Mlp) -> None:
    # this process's peak from here on: a pytest worker's lifetime peak (ru_maxrss) counts the tests it ran before
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident size
    start_kb = _vm_kb("VmHWM")
    src, head = _big_model(tmp_path, make_mlp)
    res = subprocess.run([sys.executable, "-c", _BIG_CHILD, str(src)], capture_output=True, text=True, timeout=300)
    OUTCOMES["over-2gb-external"] = f"exit {res.returncode}: peak RSS {res.stdout.strip().splitlines()[-1]} MB"
    assert res.returncode == 0, res.stderr
    peak_mb = int(res.stdout.strip().splitlines()[-1])
    assert peak_mb < 1024, f"optimizing a 2 GiB model peaked at {peak_mb} MB: the weights were read in"
    out, data = tmp_path / "big.gtco.onnx", tmp_path / "big.gtco.onnx.data"
    assert sorted(os.listdir(tmp_path)) == ["big.gtco.onnx", "big.gtco.onnx.data", "big.gtco.onnx.report.json",
                                            "big.onnx", "big.onnx.data"]
    onnx.checker.check_model(str(out))  # the path form follows the external data
    model = onnx.load(str(out), load_external_data=False)
    table = next(t for t in model.graph.initializer if t.name == "table")
    info = {e.key: e.value for e in table.external_data}
    assert info["location"] == data.name and int(info["length"]) == _BIG_ROWS * _WIDTH * 4
    assert data.stat().st_size >= int(info["offset"]) + int(info["length"])
    with open(data, "rb") as f:
        f.seek(int(info["offset"]))
        assert np.array_equal(np.frombuffer(f.read(head.nbytes), np.float32).reshape(head.shape), head)
    assert data.stat().st_blocks * 512 < 64 << 20, "the copy filled the source's hole"
    assert json.loads((tmp_path / "big.gtco.onnx.report.json").read_text())["groups"]
    assert _vm_kb("VmHWM") - start_kb < 1 << 20  # this process never held the table (2 GiB) either
