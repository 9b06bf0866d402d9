"""Shape-generic tuning (onnx_gtco.tune.shape_generic) on the CPU with the analytical measurer: BERT with symbolic batch
and sequence is tuned once over a range, in far fewer trials than per-shape tuning of 8 sampled shapes; its dispatch
tables cover the range and its micro-kernel cost model predicts the measurer's time at sampled shapes. Also the
`--dynamic` option: parsing, validation, the ranges the rewritten model carries."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_gtco import models
from onnx_gtco.cli import main
from onnx_gtco.config import GtcoConfig, format_dynamic, parse_dynamic, resolve_ranges
from onnx_gtco.errors import GtcoError
from onnx_gtco.pipeline import optimize
from onnx_gtco.tune.driver import tune
from onnx_gtco.tune.search import AnalyticalMeasurer
from onnx_gtco.tune.shape_generic import DynamicTask, dynamic_tasks, table_config, tune_dynamic
from onnx_gtco.tune.tasks import Task, merge

RANGES = (("batch", 1, 16), ("seq", 1, 128))
TRIALS, PATIENCE = 12, 6      # per task, in both modes
# the cost model's largest relative error against the analytical measurer: linear in waves and occupancy, it
# cannot follow the estimate's SM crowding and L2 sharing within a wave (tune.shape_generic)
MAX_ERROR = 0.25


@pytest.fixture(scope="module")
def bert() -> onnx.ModelProto:
    m = models.build("bert-tiny", batch="batch", seq="seq", depth=1)
    return optimize(m, GtcoConfig(precision="fp16", dynamic=RANGES)).model


def _shape_tasks(tasks: list[DynamicTask], batch: int, seq: int) -> list[Task]:
    values = {"batch": batch, "seq": seq}
    out = []
    for dt in tasks:
        n = math.prod(int(f) if f.isdigit() else values[f] for f in dt.expr.split("*"))
        out.append(Task(dt.problem_at(n), dt.task.arch, dt.task.version, dt.task.weight, dt.task.nodes))
    return out


def test_shape_generic_tuning_beats_per_shape_tuning(bert: onnx.ModelProto, tmp_path: Path) -> None:
    ranges = resolve_ranges(bert, ())
    assert ranges.ranges == RANGES and set(ranges.sources.values()) == {"model"}
    tasks, _ = dynamic_tasks(bert, "sm_90", ranges)
    assert {dt.extent for dt in tasks} == {"M", "seq_q", "rows"}
    meas = AnalyticalMeasurer()
    results = tune_dynamic(tasks, trials=TRIALS, measurer=meas, storage=f"memory:{tmp_path}/dyn")
    generic = sum(r.measured for r in results)

    rng = np.random.default_rng(0)
    shapes = [(1, 1), (16, 128), (1, 127), *zip(rng.integers(1, 17, 5).tolist(), rng.integers(1, 129, 5).tolist(),
                                                  strict=True)]
    per_shape_tasks = merge(t for b, s in shapes for t in _shape_tasks(tasks, b, s))
    per_shape = tune(per_shape_tasks, trials=TRIALS, patience=PATIENCE, measurer=AnalyticalMeasurer(),
                     storage=f"memory:{tmp_path}/shape")
    per_shape_trials = sum(r.measured for r in per_shape)
    print(f"\nshape-generic: {generic} micro-kernel trials for {len(tasks)} tasks over {RANGES}; per-shape tuning of "
          f"{len(shapes)} shapes: {per_shape_trials} trials ({len(per_shape_tasks)} tasks); ratio "
          f"{per_shape_trials / generic:.1f}x")
    assert 0 < generic <= per_shape_trials / 4
    assert all(r.trials <= TRIALS for r in results)

    changed = 0
    for r in results:
        assert r.table is not None, r.task.describe()
        tops = [top for top, _ in r.table]
        assert tops == sorted(tops) and tops[-1] == r.task.hi  # ascending, closed at the top: no gap, no overlap
        assert all(table_config(r.table, n) for n in (r.task.lo, (r.task.lo + r.task.hi) // 2, r.task.hi))
        assert len(r.samples) >= 5 and {r.task.lo, r.task.hi} <= {n for n, *_ in r.samples}
        assert r.max_error is not None and r.max_error <= MAX_ERROR, (r.task.describe(), r.samples)
        for n, config, predicted, measured in r.samples:  # the sample ran the table's choice at its extent
            assert config == table_config(r.table, n) and measured is not None and predicted > 0
        changed += len({tuple(sorted(c.items())) for _, c in r.table}) > 1
    assert changed >= 1, [r.table for r in results]

    for budget in (TRIALS, 0):  # a second run, or a look-up, reuses every recorded micro-kernel
        again = tune_dynamic(tasks, trials=budget, measurer=meas, storage=f"memory:{tmp_path}/dyn", samples=0)
        assert sum(r.measured for r in again) == 0 and [r.table for r in again] == [r.table for r in results]
    fresh = tune_dynamic(tasks, trials=0, measurer=meas, storage=f"memory:{tmp_path}/fresh")
    assert all(r.table is None and r.measured == 0 for r in fresh)
    small = tune_dynamic(tasks[:1], trials=1, measurer=meas, storage=f"memory:{tmp_path}/small", samples=0)
    assert len(small[0].kernels) == 1 and small[0].table is not None  # at least one micro-kernel, measured in full


class _Noisy(AnalyticalMeasurer):
    """The analytical model with a seeded +-3% noise, so the fit has something to smooth."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(1)

    def measure(self, task, config):  # type: ignore[no-untyped-def]
        m = super().measure(task, config)
        return type(m)(m.median_us * (1 + self.rng.uniform(-0.03, 0.03)), 0.0, runs=1)


def test_cost_model_fits_noisy_measurements(bert: onnx.ModelProto) -> None:
    tasks, _ = dynamic_tasks(bert, "sm_80", resolve_ranges(bert, ()))
    results = tune_dynamic(tasks, trials=TRIALS, measurer=_Noisy(), storage="memory:noisy")
    errors = [r.max_error for r in results]
    print("\nlargest prediction error per task with 3% measurement noise:", [round(e or 0, 3) for e in errors])
    assert all(e is not None and e <= MAX_ERROR + 0.06 for e in errors)


def test_dynamic_ranges_parse_validate_and_format() -> None:
    assert parse_dynamic("seq=1:512, batch=1:64") == (("batch", 1, 64), ("seq", 1, 512))
    assert format_dynamic(parse_dynamic("seq=1:512,batch=1:64")) == "batch=1:64,seq=1:512"
    assert GtcoConfig(dynamic=(("seq", 1, 8), ("batch", 2, 4))).dynamic == (("batch", 2, 4), ("seq", 1, 8))
    for bad, why in (("seq=0:8", ">= 1"), ("seq=9:8", "exceeds"), ("seq", "NAME=LO:HI"), ("seq=a:b", "NAME=LO:HI"),
                     ("seq=1:2,seq=1:3", "more than once")):
        with pytest.raises(GtcoError, match=why):
            parse_dynamic(bad)
    with pytest.raises(GtcoError, match="lower bound"):
        GtcoConfig(dynamic=(("seq", 4, 2),))


def test_dynamic_option_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))  # no tuning storage: nothing to look up
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "b.onnx"
    onnx.save(models.build("bert-tiny", batch="batch", seq="seq", depth=1), src)
    assert main(["inspect", str(src), "--dynamic", "seq=1:x"]) == 2
    assert "--dynamic 'seq=1:x'" in capsys.readouterr().err
    assert main(["inspect", str(src), "--dynamic", "seq=1:64,heads=1:2"]) == 2
    assert "heads" in capsys.readouterr().err
    out = tmp_path / "b.gtco.onnx"
    assert main(["optimize", str(src), "-o", str(out), "--no-build", "--dynamic", "seq=1:64"]) == 0
    assert "batch=1:512 (default), seq=1:64 (declared); dispatch tables: the library's defaults" in \
        capsys.readouterr().out
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["gtco.dynamic"] == "batch=1:512,seq=1:64"
    dims = {d.dim_param for vi in onnx.load(str(out)).graph.input for d in vi.type.tensor_type.shape.dim}
    assert {"batch", "seq"} <= dims
    again = resolve_ranges(onnx.load(str(out)), ())  # the rewritten model's ranges come back as the model's own
    assert again.ranges == (("batch", 1, 512), ("seq", 1, 64)) and set(again.sources.values()) == {"model"}


def test_optimize_tunes_dynamic_models_shape_generically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "b.onnx"
    onnx.save(models.build("bert-tiny", batch="batch", seq="seq", depth=1), src)
    out = tmp_path / "b.gtco.onnx"
    args = ["optimize", str(src), "-o", str(out), "--no-build", "--precision", "fp16", "--dynamic",
            "seq=1:128,batch=1:16", "--tune-trials", "6", "--storage", f"memory:{tmp_path}"]
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dynamic"))
    # 6 tasks: Q, K and V packed into one GEMM of N = 384 (families/gemm/pack.py), attention, the output projection,
    # fc1 and fc2, and the two LayerNorms as one task (the estimate keeps them apart from their GEMMs)
    assert "batch=1:16 (declared), seq=1:128 (declared); 6 tuned dispatch tables" in line
    rep = json.loads((tmp_path / "b.gtco.onnx.report.json").read_text())
    tuning = rep["dynamic"]["tuning"]
    assert tuning["mode"] == "shape-generic" and tuning["measured"] == tuning["trials"] > 0
    assert "tuning" not in rep  # no per-shape tuning of a dynamic model
    for task in tuning["tasks"]:
        (rows,) = task["tables"].values()  # the tuning arch's table: intervals that tile the range
        assert task["trials"] <= 6 and rows[0]["extents"][0] == task["range"][0]
        assert rows[-1]["extents"][1] == task["range"][1]
        assert all(r["extents"][0] <= r["extents"][1] for r in rows)
        assert len(task["samples"]) >= 5 and task["max_error"] is not None
