"""Tuning records: a storage's GPU-measured trials merged into per-arch record files (the faster record per problem
kept, the analytical model's predictions never), optimize building a record's configuration for a problem it
covers (the report naming the source, the library building its instance), --no-shipped-records ignoring them, a
tuned trial of the user's own GPU coming first, and a record that no longer fits giving way to the default with
the reason. The shipped files are valid and empty: no GPU run has filled them yet."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from onnx_gtco import optimize
from onnx_gtco.cli import main
from onnx_gtco.config import GtcoConfig
from onnx_gtco.errors import GtcoError
from onnx_gtco.kernels.select import FAMILIES
from onnx_gtco.plugin.library import build_library, library_info
from onnx_gtco.report_md import _tuning
from onnx_gtco.tune import records
from onnx_gtco.tune.apply import shipped_model, tune_model
from onnx_gtco.tune.driver import tune
from onnx_gtco.tune.search import AnalyticalMeasurer, Measurement, predict_us
from onnx_gtco.tune.tasks import Task, model_tasks
from onnx_gtco.tune.trials import command_line


class FakeGpu:
    """A stand-in for the GPU measurer (not the analytical model): the analytical time times `factor`."""

    name = "fake-gpu"
    arch = "sm_80"

    def __init__(self, factor: float = 1.0, gpu: str = "FakeGPU A") -> None:
        self.factor, self.gpu = factor, gpu
        self.device = f"{gpu} sm_80"

    def measure(self, task: Task, config: Mapping[str, Any]) -> Measurement:
        return Measurement(predict_us(task, config) * self.factor, 0.01, runs=20)

    def environment(self) -> dict[str, str]:
        return {"measurer": self.name, "gpu": self.gpu, "driver": "13000", "toolchain": "nvcc 13.0"}


def softmax_model(rows: int = 4) -> onnx.ModelProto:
    """x [rows, 16] fp16 -> Softmax: one Softmax_f16 node of static shape."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [rows, 16]) for n in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)], "sm", io[:1], io[1:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def rewritten() -> onnx.ModelProto:
    return optimize(softmax_model(), GtcoConfig(target="sm_80")).model


def _task(model: onnx.ModelProto) -> Task:
    (task,) = model_tasks(model, "sm_80")[0]
    return task


def _record(task: Task, config: Mapping[str, Any], us: float = 3.0, date: str = "2026-11-28") -> records.Record:
    return records.Record(problem=task.problem_key, arch=task.arch, describe=task.describe(), config=dict(config),
                          median_us=us, gpu="NVIDIA H200", driver="13000", date=date, command="onnx-gtco optimize m")


def test_the_shipped_record_files_are_valid_and_empty() -> None:
    for arch in ("sm_80", "sm_90"):
        doc = json.loads(records.path_for(arch, records.SHIPPED_DIR).read_text())
        assert doc == {"format": records.FORMAT, "arch": arch, "records": []}
        assert records.load(arch, records.SHIPPED_DIR) == {}


def test_merge_keeps_the_faster_gpu_measurement_per_problem(tmp_path: Path, rewritten: onnx.ModelProto) -> None:
    tasks = model_tasks(optimize(build_two(), GtcoConfig(target="sm_80")).model, "sm_80")[0]
    assert len(tasks) == 2
    first = f"journal:{tmp_path / 'first.log'}"
    tune(tasks, trials=4, measurer=FakeGpu(1.0), storage=first)
    tune(tasks, trials=4, measurer=AnalyticalMeasurer(), storage=first)  # predictions: never records
    out = tmp_path / "records"
    out.mkdir()
    got = records.merge(first, out)
    assert len(got.added) == 2 and not got.replaced and not got.kept
    assert got.written == [out / "sm_80.json"]
    saved = records.load("sm_80", out)
    assert set(saved) == {t.problem_key for t in tasks}
    for t in tasks:
        r = saved[t.problem_key]
        assert r.gpu == "FakeGPU A" and r.driver == "13000" and r.toolchain == "nvcc 13.0" and r.date
        assert r.median_us == pytest.approx(predict_us(t, r.config))  # the GPU study's best, not the analytical
        assert r.template_version == t.version and r.command == command_line()  # the command that measured it
    assert all(line.startswith("added") for line in got.lines()[:2])
    again = records.merge(first, out)  # the same trials: nothing faster
    assert len(again.kept) == 2 and not again.added and not again.replaced and not again.written
    faster = f"journal:{tmp_path / 'faster.log'}"
    tune(tasks[:1], trials=4, measurer=FakeGpu(0.5, "FakeGPU B"), storage=faster)
    tune(tasks[1:], trials=4, measurer=FakeGpu(2.0, "FakeGPU B"), storage=faster)
    mixed = records.merge(faster, out)
    assert [n.problem for _, n in mixed.replaced] == [tasks[0].problem_key] and len(mixed.kept) == 1
    assert "replaced" in "\n".join(mixed.lines()) and "1 replaced, 1 kept" in mixed.lines()[-1]
    now = records.load("sm_80", out)
    assert now[tasks[0].problem_key].gpu == "FakeGPU B" and now[tasks[1].problem_key].gpu == "FakeGPU A"
    with pytest.raises(GtcoError, match="does not exist, so it has no trials to merge"):
        records.merge(f"journal:{tmp_path / 'typo.log'}", out)
    assert not (tmp_path / "typo.log").exists()


def build_two() -> onnx.ModelProto:
    """Two softmax nodes of different shapes: two tasks."""
    f16 = TensorProto.FLOAT16
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="a", axis=-1),
                               helper.make_node("Softmax", ["u"], ["v"], name="b", axis=-1)], "two",
                              [vi("x", f16, [4, 16]), vi("u", f16, [8, 64])], [vi("y", f16, [4, 16]),
                                                                               vi("v", f16, [8, 64])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_cli_merges_and_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  rewritten: onnx.ModelProto) -> None:
    url = f"journal:{tmp_path / 't.log'}"
    tune([_task(rewritten)], trials=3, measurer=FakeGpu(), storage=url)
    assert main(["tune-records", "merge", "--storage", url, "--records-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("added     sm_80 softmax f16") and "1 added, 0 replaced, 0 kept" in out
    assert main(["tune-records", "list", "--records-dir", str(tmp_path)]) == 0
    assert "sm_80.json: 1 records" in capsys.readouterr().out
    assert main(["tune-records", "merge", "--records-dir", str(tmp_path)]) == 2
    assert "give the storage to merge from" in capsys.readouterr().err
    assert main(["tune-records", "merge", "--storage", url, "--records-dir", str(tmp_path / "no")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_optimize_builds_a_records_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 rewritten: onnx.ModelProto) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))  # no default storage
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    task = _task(rewritten)
    configs = FAMILIES["softmax"].configs(task.problem, "sm_80")
    default, other = configs[0], configs[-1]
    assert default != other
    recs = tmp_path / "records"
    recs.mkdir()
    records.save("sm_80", [_record(task, other)], recs)
    monkeypatch.setenv(records.TUNE_RECORDS_ENV, str(recs))
    src = tmp_path / "sm.onnx"
    onnx.save(softmax_model(), str(src))
    argv = ["optimize", str(src), "--no-build", "--target", "sm_80", "--report-md"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "sm.gtco.onnx.report.json").read_text())["tuning"]
    (entry,) = report["tasks"]
    assert report["storage"] is None and entry["source"] == "shipped record (NVIDIA H200, 2026-11-28)"
    assert entry["config"] == other and entry["record"]["median_us"] == 3.0 and "record_unused" not in entry
    md = (tmp_path / "sm.gtco.onnx.report.md").read_text()
    assert "| configuration from |" in md and "shipped record (NVIDIA H200, 2026-11-28)" in md
    # the library builds the record's instance (the configuration optimize hands the build)
    _, tuned = shipped_model(rewritten, "sm_80")
    lib = tmp_path / "lib"
    lib.mkdir()
    info = library_info(build_library(rewritten, lib, cuda=False, emulated=True, tuned=tuned).path)
    want = FAMILIES["softmax"].instantiate(task.problem, other, "sm_80").name
    assert info["instances"]["gtco/softmax/sm"] == [want]
    assert want != FAMILIES["softmax"].instantiate(task.problem, default, "sm_80").name
    # --no-shipped-records: no record, no tuning entry, the default
    assert main([*argv, "--no-shipped-records"]) == 0
    assert "tuning" not in json.loads((tmp_path / "sm.gtco.onnx.report.json").read_text())


def test_a_gpu_tuned_trial_comes_before_a_record_and_a_record_before_the_analytical_pick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rewritten: onnx.ModelProto) -> None:
    task = _task(rewritten)
    configs = FAMILIES["softmax"].configs(task.problem, "sm_80")
    recs = tmp_path / "records"
    recs.mkdir()
    records.save("sm_80", [_record(task, configs[-1])], recs)
    analytical = f"journal:{tmp_path / 'a.log'}"
    report, tuned = tune_model(rewritten, "sm_80", 3, analytical, measurer=AnalyticalMeasurer(), records_dir=recs)
    (entry,) = report["tasks"]
    assert entry["source"].startswith("shipped record") and tuned["gtco/softmax/sm"] == {"sm_80": configs[-1]}
    assert entry["best_config"] is not None  # the storage's pick is still reported, but the record is built
    report, tuned = tune_model(rewritten, "sm_80", 3, analytical, measurer=AnalyticalMeasurer(), records_dir=recs,
                               shipped=False)
    assert report["tasks"][0]["source"] == "tuned (analytical model)"
    assert report["records"] == "not used (--no-shipped-records)"
    gpu = f"journal:{tmp_path / 'g.log'}"
    report, tuned = tune_model(rewritten, "sm_80", 3, gpu, measurer=FakeGpu(), records_dir=recs)
    (entry,) = report["tasks"]
    assert entry["source"] == "tuned" and tuned["gtco/softmax/sm"] == {"sm_80": entry["best_config"]}
    assert "a configuration tuned on this machine's GPU comes first" in entry["record_unused"]


@pytest.mark.parametrize(("change", "why"), [
    ({"XYZ": 1}, "its parameters do not match the kernel's: it has unknown XYZ"),
    ({"THREADS": 1024, "ROWS": 8}, "the family's check rejects it: THREADS*ROWS = 8192 threads per block"),
    ({"impl": "cutlass"}, "its implementation 'cutlass' is not offered here"),
    ({"impl": "mma"}, "it names an implementation ('mma'), which this family's configurations do not have"),
], ids=["renamed_parameter", "check_fails", "foreign_impl", "impl_on_a_family_without"])
def test_a_record_that_no_longer_fits_gives_way_to_the_default_with_the_reason(
        change: dict[str, Any], why: str, tmp_path: Path, rewritten: onnx.ModelProto) -> None:
    task = _task(rewritten)
    config = {**FAMILIES["softmax"].configs(task.problem, "sm_80")[-1], **change}
    records.save("sm_80", [_record(task, config)], tmp_path)
    report, tuned = shipped_model(rewritten, "sm_80", records_dir=tmp_path)
    assert report is not None and tuned == {}
    (entry,) = report["tasks"]
    assert entry["source"] == "default" and entry["config"] is None
    assert why in entry["record_unused"] and entry["record_unused"].startswith("shipped record (NVIDIA H200")
    assert "the default configuration instead" in entry["record_unused"]
    text = "\n".join(_tuning({"tuning": report}))
    assert "Shipped tuning records not used:" in text and why in text and "No tuning storage" in text


def test_malformed_record_files_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sm_80.json"
    for text, why in (("{", "not readable JSON"), ('{"format": 1, "arch": "sm_90", "records": []}', "not 'sm_80'"),
                      ('{"format": 1, "arch": "sm_80", "records": [{"problem": "p"}]}', "record 0: a record needs"),
                      ('{"format": 1, "arch": "sm_80", "records": [{"problem": "p", "arch": "sm_80", "config": {}, '
                       '"median_us": -1}]}', "is not a positive time")):
        path.write_text(text)
        with pytest.raises(GtcoError, match=why):
            records.load("sm_80", tmp_path)
    monkeypatch.setenv(records.TUNE_RECORDS_ENV, str(tmp_path))
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "sm.onnx"
    onnx.save(softmax_model(), str(src))
    assert main(["optimize", str(src), "--no-build", "--target", "sm_80"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"tuning records {path}" in err[0]
    assert not (tmp_path / "sm.gtco.onnx").exists()
