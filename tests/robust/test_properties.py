"""Property: optimize (default config, no tuning) never changes what a model computes.

Random models from graphs.py (motifs the fusion rules look for, connected at random, intermediates taken as graph
outputs) are optimized and run in onnxruntime's CPU EP beside the original on the same seeded inputs:

- through the model-local functions (what any runtime without the library runs): rtol 1e-4, atol 1e-5, the
  `onnx-gtco check` defaults; onnxruntime's own fusions may differ on the two graphs, so not bit-exact;
- through the custom-op library's CPU kernels (`build_library(cuda=False)`, every op type registered): rtol 1e-3,
  atol 1e-4, for the kernels' other summation order in fp32 GEMM, softmax and LayerNorm reductions.

atol is relative to the output's RMS where that exceeds 1. One library is a g++ build, so the plugin test puts
several random graphs side by side in one model per example. Counts (graphs tried, fused groups, families hit,
nodes on the library's kernels) are printed at the end of the run (conftest.py).
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.opspec import DOMAIN
from onnx_gtco.plugin.library import build_library
from onnx_gtco.runtime.session import METADATA_KEY, make_session

FUNCTION_TOL = (1e-4, 1e-5)
KERNEL_TOL = (1e-3, 1e-4)
PLUGIN_EXAMPLES = max(2, settings.get_profile("gtco-ci").max_examples // 50)  # of conftest.py's profile
# every family the motifs are built to reach (bmm_softmax is rare: only where P has another reader than PV)
FAMILIES = {"gemm", "qkv", "attention", "layernorm", "softmax", "elementwise"}


def _options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return so


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs on the CPU EP (its model-local functions inlined)."""
    sess = ort.InferenceSession(model.SerializeToString(), _options(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close(names: list[str], ref: list[np.ndarray], got: list[np.ndarray], tol: tuple[float, float],
                 what: str) -> None:
    """Every output within |got - ref| <= atol * max(1, rms(ref)) + rtol * |ref|; NaN / inf only where ref has
    them."""
    rtol, atol = tol
    for name, r, g in zip(names, ref, got, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, f"{what}: output {name} is {g.dtype}{g.shape}, " \
                                                          f"the original {r.dtype}{r.shape}"
        finite = r[np.isfinite(r)].astype(np.float64)
        scale = max(1.0, float(np.sqrt(np.mean(finite**2)))) if finite.size else 1.0
        ok = np.isclose(g, r, rtol=rtol, atol=atol * scale, equal_nan=True)
        if not ok.all():
            bad = np.argwhere(~ok)[0]
            diff = np.abs(g.astype(np.float64) - r)
            raise AssertionError(f"{what}: output {name} differs at {ok.size - int(ok.sum())} of {ok.size} "
                                 f"elements, e.g. {tuple(bad)}: {g[tuple(bad)]} vs {r[tuple(bad)]} (max |diff| "
                                 f"{np.nanmax(diff):.3g}, rtol {rtol}, atol {atol * scale:.3g})")


def check_functions(case: graphs.Case, stats: Counter) -> onnx.ModelProto:
    """Optimize the case, run original and rewritten (functions), compare; count what was fused."""
    onnx.checker.check_model(case.model, full_check=True)
    ref = run(case.model, case.feeds)
    result = optimize(case.model, GtcoConfig())
    new = result.model
    names = [o.name for o in case.model.graph.output]
    assert [o.name for o in new.graph.output] == names
    assert [i.name for i in new.graph.input] == [i.name for i in case.model.graph.input]
    fused = result.plan.fused_groups
    stats["graphs tried"] += 1
    stats["graphs rewritten"] += bool(fused)
    stats["fused groups"] += len(fused)
    for g in fused:
        stats[f"family {g.family}"] += 1
    assert sum(n.domain == DOMAIN for n in new.graph.node) == len(fused)
    assert_close(names, ref, run(new, case.feeds), FUNCTION_TOL, "functions")
    return new


def test_optimize_keeps_outputs_through_functions(record_property: Callable[[str, object], None]) -> None:
    stats: Counter = Counter()

    @settings(settings.get_profile("gtco-ci"))
    @given(graphs.cases())
    def prop(case: graphs.Case) -> None:
        check_functions(case, stats)

    prop()
    record_property("gtco_counts", {"property/functions": dict(stats)})
    families = {k.removeprefix("family ") for k in stats if k.startswith("family ")}
    assert FAMILIES <= families, f"the random graphs never formed {sorted(FAMILIES - families)} groups"
    assert stats["graphs rewritten"] >= stats["graphs tried"] // 2, f"too few graphs rewritten: {dict(stats)}"


@pytest.mark.slow
def test_optimize_keeps_outputs_through_cpu_kernels(tmp_path: Path,
                                                    record_property: Callable[[str, object], None]) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the custom-op library")
    stats: Counter = Counter()
    registered: set[str] = set()

    @settings(settings.get_profile("gtco-ci"), max_examples=PLUGIN_EXAMPLES)
    @given(graphs.merged(min_graphs=4, max_graphs=7, symbolic=False, max_leaks=0))
    def prop(case: graphs.Case) -> None:
        new = check_functions(case, stats)
        out = tmp_path / f"example{stats['graphs tried']}"
        out.mkdir()
        lib = build_library(new, out, cuda=False)
        new.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
        onnx.save(new, str(out / "model.gtco.onnx"))
        sess = make_session(out / "model.gtco.onnx", ["CPUExecutionProvider"], library=True,
                            sess_options=_options())
        names = [o.name for o in case.model.graph.output]
        assert_close(names, run(case.model, case.feeds), sess.run(None, case.feeds), KERNEL_TOL, "CPU kernels")
        registered.update(lib.op_types)
        stats["random graphs merged"] += len({m.split(":")[0] for m in case.motifs})
        stats["libraries built"] += 1
        stats["nodes on kernels"] += sum(r.op_type in lib.op_types for r in lib.nodes)
        stats["nodes on functions"] += sum(r.op_type not in lib.op_types for r in lib.nodes)

    prop()
    stats["op types registered"] = len(registered)
    record_property("gtco_counts", {"property/cpu-kernels": dict(stats)})
    assert len(registered) >= 3, f"the library registered only {sorted(registered)} over the examples"
