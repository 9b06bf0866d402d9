"""The onnx package's backend node tests, optimized: each passes or is passed through untouched.

The cases are `onnx/backend/test/data/node/*` (model.onnx + test_data_set_*/input_*.pb, output_*.pb) where the
installed onnx ships them; wheels that do not are given the same cases by the generator that writes those
directories (onnx.backend.test.case.node.collect_testcases). Per case:

1. onnxruntime's CPU EP runs the original on the stored inputs; a model it cannot load or run is counted as
   "ORT cannot run" and left out. Where its outputs already differ from the stored ones ("ORT differs"), the
   optimized model is held to the original's outputs instead.
2. optimize (default config, no build). No fused node: "passed through" (the model still has to run and match).
   Otherwise the rewritten model runs through its functions and must match: "passed".
3. Anything else fails the test, except the tests listed in backend_known_failures.txt with the cause of each
   (a fix pending outside onnx-gtco); a listed test that passes fails the test too, so the list only shrinks.

Tolerance: the case's own (rtol 1e-3, atol 1e-7 for every node case), as onnx's backend runner compares. The cases
are split into chunks so `pytest -n 2` can spread them; counts are printed at the end of the run (conftest.py).
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_gtco import GtcoConfig, GtcoError, optimize
from onnx_gtco.opspec import DOMAIN

CHUNKS = 4
NODE_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
KNOWN_FAILURES_FILE = Path(__file__).with_name("backend_known_failures.txt")


def known_failures() -> dict[str, str]:
    """Backend tests optimize still breaks (backend_known_failures.txt): name -> why."""
    out = {}
    for line in KNOWN_FAILURES_FILE.read_text().splitlines():
        name, _, why = line.partition("#")
        if name.strip():
            out[name.strip()] = why.strip()
    return out


@dataclass
class NodeCase:
    """One backend node test: its model and (inputs, expected outputs) data sets."""

    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float = 1e-3
    atol: float = 1e-7


def _value(proto_bytes: bytes, type_proto: onnx.TypeProto) -> Any:
    """A stored input or output as onnxruntime takes and gives it (tensor, sequence or optional)."""
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        seq = onnx.SequenceProto()
        seq.ParseFromString(proto_bytes)
        return numpy_helper.to_list(seq)
    if kind == "optional_type":
        opt = onnx.OptionalProto()
        opt.ParseFromString(proto_bytes)
        return numpy_helper.to_optional(opt)
    tensor = onnx.TensorProto()
    tensor.ParseFromString(proto_bytes)
    return numpy_helper.to_array(tensor)


def _from_dir(case_dir: Path) -> NodeCase:
    model = onnx.load(str(case_dir / "model.onnx"))
    sets = []
    for ds in sorted(case_dir.glob("test_data_set_*")):
        ins = [_value((ds / f"input_{i}.pb").read_bytes(), vi.type) for i, vi in enumerate(model.graph.input)
               if (ds / f"input_{i}.pb").exists()]
        outs = [_value((ds / f"output_{i}.pb").read_bytes(), vi.type) for i, vi in enumerate(model.graph.output)]
        sets.append((ins, outs))
    return NodeCase(case_dir.name, model, sets)


def _plain(v: Any) -> Any:
    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v


@functools.cache
def node_cases() -> tuple[NodeCase, ...]:
    """Every backend node test, sorted by name (loaded once per process)."""
    if NODE_DIR.is_dir():
        return tuple(_from_dir(d) for d in sorted(NODE_DIR.iterdir()) if (d / "model.onnx").is_file())
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    return tuple(sorted((NodeCase(c.name, c.model, [([_plain(x) for x in i], [_plain(x) for x in o])
                                                     for i, o in c.data_sets], c.rtol, c.atol)
                         for c in cases if c.model is not None and c.data_sets), key=lambda c: c.name))


def _mismatch(ref: Any, got: Any, rtol: float, atol: float, where: str = "output") -> str | None:
    """Why `got` is not `ref` within tolerance (onnx's runner rules: floats close, the rest equal), or None."""
    if isinstance(ref, list) or isinstance(got, list):
        if not isinstance(ref, list) or not isinstance(got, list) or len(ref) != len(got):
            return f"{where}: sequence {type(got).__name__} of {len(got) if isinstance(got, list) else '-'} " \
                   f"items, expected {len(ref) if isinstance(ref, list) else '-'}"
        return next((m for k, (r, g) in enumerate(zip(ref, got, strict=True))
                     if (m := _mismatch(r, g, rtol, atol, f"{where}[{k}]"))), None)
    if ref is None or got is None:
        return None if ref is None and got is None else f"{where}: optional {got!r}, expected {ref!r}"
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape:
        return f"{where}: shape {got.shape}, expected {ref.shape}"
    if ref.dtype.kind in "OSU" or got.dtype.kind in "OSU":
        return None if np.array_equal(ref.astype(str), got.astype(str)) else f"{where}: strings differ"
    if ref.dtype.kind in "biu" and got.dtype.kind in "biu":
        return None if np.array_equal(ref, got) else f"{where}: integers differ"
    r, g = ref.astype(np.float64), got.astype(np.float64)
    ok = np.isclose(g, r, rtol=rtol, atol=atol, equal_nan=True)
    if ok.all():
        return None
    return f"{where}: {int((~ok).sum())} of {ok.size} elements differ (max |diff| " \
           f"{np.nanmax(np.abs(g - r)):.3g}, rtol {rtol}, atol {atol})"


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(sess: ort.InferenceSession, model: onnx.ModelProto, inputs: list[Any]) -> list[Any]:
    names = [vi.name for vi in model.graph.input][:len(inputs)]
    return sess.run(None, dict(zip(names, inputs, strict=True)))


def run_case(case: NodeCase) -> tuple[str, str | None]:
    """(outcome, why it failed or None): "ort-cannot-run", "passed", "passed-through", or "failed"."""
    try:
        original = _session(case.model)
        refs = [_run(original, case.model, ins) for ins, _ in case.data_sets]
    except Exception:  # onnxruntime raises its own types for what it does not implement
        return "ort-cannot-run", None
    ort_differs = any(_mismatch(e, r, case.rtol, case.atol) for (_, exp), ref in zip(case.data_sets, refs,
                                                                                    strict=True)
                      for e, r in zip(exp, ref, strict=True))
    expected = refs if ort_differs else [exp for _, exp in case.data_sets]
    try:
        result = optimize(case.model, GtcoConfig())
    except GtcoError as e:
        return "failed", f"optimize refused the model: {e}"
    except Exception as e:  # a crash, not an error a user could act on
        return "failed", f"optimize raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    fused = sum(n.domain == DOMAIN for n in result.model.graph.node)
    try:
        sess = _session(result.model)
        outs = [_run(sess, result.model, ins) for ins, _ in case.data_sets]
    except Exception as e:  # onnxruntime's own types
        return "failed", f"the optimized model does not run: {str(e).splitlines()[0][:200]}"
    for exp, got in zip(expected, outs, strict=True):
        names = [o.name for o in case.model.graph.output]
        for name, e, g in zip(names, exp, got, strict=True):
            why = _mismatch(e, g, case.rtol, case.atol, f"output {name}")
            if why:
                return "failed", why + (" (held to onnxruntime's original outputs)" if ort_differs else "")
    return ("passed" if fused else "passed-through"), ("ort-differs" if ort_differs else None)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_backend_node_cases(chunk: int, record_property: Callable[[str, object], None]) -> None:
    cases = node_cases()[chunk::CHUNKS]
    known = known_failures()
    counts: Counter = Counter(tried=len(cases))
    failures, fixed = [], []
    for case in cases:
        outcome, why = run_case(case)
        if outcome == "failed" and case.name in known:
            outcome = "failed (known, listed)"
        elif outcome == "failed":
            failures.append(f"{case.name}: {why}")
        elif case.name in known and outcome != "ort-cannot-run":
            fixed.append(case.name)
        counts[outcome] += 1
        counts["ort-differs-from-stored"] += why == "ort-differs"
    source = "data/node" if NODE_DIR.is_dir() else "generated node cases"
    record_property("gtco_counts", {f"onnx backend ({source})": dict(counts)})
    assert counts["tried"] > 0
    assert not failures, f"{len(failures)} backend node tests fail after optimize:\n" + "\n".join(failures)
    assert not fixed, f"{len(fixed)} tests of {KNOWN_FAILURES_FILE.name} pass now; remove them there: {fixed}"


def test_reads_the_node_data_layout(tmp_path: Path) -> None:
    """The data/node reader (used where the onnx wheel ships the directories) reads what the generator writes."""
    case = next(c for c in node_cases() if c.name == "test_add_bcast")
    d = tmp_path / case.name
    (d / "test_data_set_0").mkdir(parents=True)
    onnx.save(case.model, str(d / "model.onnx"))
    ins, outs = case.data_sets[0]
    for kind, values in (("input", ins), ("output", outs)):
        for i, v in enumerate(values):
            (d / "test_data_set_0" / f"{kind}_{i}.pb").write_bytes(numpy_helper.from_array(v).SerializeToString())
    back = _from_dir(d)
    assert back.name == case.name and len(back.data_sets) == 1
    for a, b in zip(back.data_sets[0][0] + back.data_sets[0][1], ins + outs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert run_case(back)[0] == run_case(case)[0] == "passed-through"

