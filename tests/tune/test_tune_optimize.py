"""Tuning as part of optimize: `--tune-trials` / `--storage` on the CLI, the report's tuning entry, a warm storage
that measures nothing, and the build launching the tuned configuration."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from onnx_gtco import optimize
from onnx_gtco.cli import main
from onnx_gtco.config import GtcoConfig
from onnx_gtco.models import build
from onnx_gtco.plugin.library import build_library, library_info
from onnx_gtco.plugin.nodes import fused_nodes


def softmax_f16() -> onnx.ModelProto:
    """x [N, 16] fp16 -> Softmax: one Softmax_f16 node."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["N", 16]) for n in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)], "sm", io[:1], io[1:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_cli_tunes_and_a_second_run_measures_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=2), str(src))
    url = f"sqlite:///{tmp_path / 'team.db'}"
    argv = ["optimize", str(src), "--no-build", "--precision", "fp16", "--tune-trials", "4", "--storage", url]
    assert main(["-v", *argv]) == 0
    err = capsys.readouterr().err  # -v: a line per task with its trials and best time, and the stage's line
    assert re.search(r"^onnx-gtco: tune +.*: [1-4] trials, best \d+\.\d\d us predicted", err, re.M)
    assert re.search(r"^onnx-gtco: tune +\d+\.\d\d s  \d+ tasks", err, re.M)
    report = json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())["tuning"]
    assert report["measurer"] == "analytical" and report["arch"] == "sm_90" and report["measured"] > 0
    assert report["tasks_found"] == len(report["tasks"]) > 0
    assert all(t["best_config"] and t["trials"] <= 4 for t in report["tasks"])
    assert not (tmp_path / "cache" / "tuning.db").exists()  # the named storage, not the default
    assert main(argv) == 0
    again = json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())["tuning"]
    assert again["measured"] == 0 and [t["best_config"] for t in again["tasks"]] == [
        t["best_config"] for t in report["tasks"]]
    # without --tune-trials the named storage is still read: the build would use its records
    assert main(["optimize", str(src), "--no-build", "--precision", "fp16", "--storage", url]) == 0
    looked_up = json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())["tuning"]
    assert looked_up["measured"] == 0 and looked_up["tasks_found"] == report["tasks_found"]


def test_plain_optimize_opens_no_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=1), str(src))
    assert main(["optimize", str(src), "--no-build"]) == 0
    assert "tuning" not in json.loads((tmp_path / "vit.gtco.onnx.report.json").read_text())
    assert not (tmp_path / "cache" / "tuning.db").exists()


def test_negative_trials_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=1), str(src))
    assert main(["optimize", str(src), "--no-build", "--tune-trials", "-1"]) == 2
    assert "tune_trials=-1" in capsys.readouterr().err
    assert not (tmp_path / "vit.gtco.onnx").exists()


def test_build_launches_the_tuned_configuration(tmp_path: Path) -> None:
    """A tuned configuration for a node's arch replaces the family's default instance in the library."""
    from onnx_gtco.kernels.select import FAMILIES, node_problem

    rewritten = optimize(softmax_f16(), GtcoConfig()).model
    node = next(n for n in fused_nodes(rewritten) if n.family == "softmax")
    problem = node_problem(node.node)
    assert not isinstance(problem, str)
    configs = FAMILIES["softmax"].configs(problem, "sm_80")
    default, other = configs[0], configs[-1]
    assert default != other
    plain = library_info(build_library(rewritten, tmp_path, cuda=False, emulated=True).path)
    out = tmp_path / "tuned"
    out.mkdir()
    tuned = library_info(build_library(rewritten, out, cuda=False, emulated=True,
                                       tuned={node.node.name: {"sm_80": other}}).path)
    want = FAMILIES["softmax"].instantiate(problem, other, "sm_80").name
    assert tuned["instances"][node.node.name] == [want] != plain["instances"][node.node.name]


class SlowGemmGpu:
    """A stand-in for a real measurer (not the analytical model): GEMM kernels measure very slow, the rest fast."""

    name = "synthetic-gpu"
    device = "synthetic GPU"

    def measure(self, task, config):
        from onnx_gtco.tune.search import Measurement

        return Measurement(1e6 if task.problem.family == "gemm" else 0.5, runs=20)

    def environment(self) -> dict[str, str]:
        return {"measurer": self.name, "gpu": self.device}


def test_measured_kernel_times_replan_the_model(tmp_path: Path) -> None:
    """With real measurements the DP plans again: GEMM groups measured far slower than their unfused nodes are
    dropped, and the report shows the measured next to the predicted time."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from onnx_gtco.pipeline import optimize_file

    src = tmp_path / "vit.onnx"
    # f16 tensors, so the fused nodes have device kernels and their measured times count (a node that keeps its
    # function costs its nodes unfused, whatever a kernel it would not run measured)
    onnx.save(convert_float_to_float16(build("vit-tiny", depth=1), keep_io_types=True), str(src))
    config = GtcoConfig(precision="fp16")
    plain = optimize(str(src), config)
    result, _, _ = optimize_file(src, tmp_path / "out.onnx", None, config, build=None, tune_trials=2,
                                 storage=f"sqlite:///{tmp_path / 's.db'}", measurer=SlowGemmGpu())
    rep = result.report
    assert rep["tuning"]["replanned"] is True and rep["tuning"]["measured"] > 0
    assert rep["plan_costs"].startswith("measured kernel times for ")

    # no multi-node GEMM group measured slow survives: the DP covers those nodes another way (unfused, or groups
    # of other shapes that were not measured). A single-node group is the DP's only choice for its node (it has no
    # unfused alternative), so it stays whatever it measured; the fast measured groups stay, with both times.
    slow = {e["task"] for e in rep["tuning"]["tasks_tuned_first_plan"] if e["best_us"] == 1e6}
    survivors = [g for g in rep["groups"] if g.get("measured_us") == 1e6]
    assert slow and len(survivors) < len(slow)
    assert all(len(g["nodes"]) == 1 for g in survivors), survivors
    assert [n.op_type for n in result.model.graph.node] != [n.op_type for n in plain.model.graph.node]
    measured = [g for g in rep["groups"] if "measured_us" in g]
    assert measured and all(g["measured_us"] in (0.5, 1e6) and g["predicted_us"] != g["measured_us"]
                            for g in measured)


def optimize_file_(src: Path, out: Path, config: GtcoConfig | None, **kw):
    from onnx_gtco.pipeline import optimize_file

    return optimize_file(src, out, None, config, build=None, **kw)


def test_a_replan_loads_and_matches_the_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real measurements plan the model again, from the model and candidates the run loaded and matched already:
    one load, one reading of the dynamic ranges, one match of the rules; the result is what planning a freshly
    loaded model with the same measurements gives."""
    from onnx_gtco import pipeline
    from onnx_gtco.tune.apply import measured_costs

    calls = {"load_model": 0, "resolve_ranges": 0, "collect": 0}

    def counting(module: object, name: str) -> None:
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    src = tmp_path / "vit.onnx"
    onnx.save(build("vit-tiny", depth=1), str(src))
    config = GtcoConfig(precision="fp16")
    counting(pipeline, "load_model")
    counting(pipeline, "resolve_ranges")
    counting(pipeline.cands_mod, "collect")
    result, _, _ = optimize_file_(src, tmp_path / "out.onnx", config, tune_trials=2,
                                  storage=f"sqlite:///{tmp_path / 's.db'}", measurer=SlowGemmGpu())
    assert result.report["tuning"]["replanned"] is True
    assert calls == {"load_model": 1, "resolve_ranges": 1, "collect": 1}

    first = result.report["tuning"]["tasks_tuned_first_plan"]
    measured = measured_costs({"measurer": SlowGemmGpu.name, "tasks": first})
    assert measured
    fresh = optimize(str(src), config, measured_us=measured)
    assert fresh.model.SerializeToString() == result.model.SerializeToString()
    assert fresh.report == {k: v for k, v in result.report.items() if k != "tuning"}


@pytest.mark.parametrize("name", ["vit-tiny", "bert-tiny-dynamic"])
def test_tuning_without_a_config_tunes_for_gtco_target(name: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With no config, planning and tuning (per shape or shape-generic) both take the target from GTCO_TARGET."""
    from onnx_gtco.tune.search import AnalyticalMeasurer

    monkeypatch.setenv("GTCO_TARGET", "sm_80")
    monkeypatch.setenv("GTCO_PRECISION", "fp16")
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GTCO_TUNE_STORAGE", raising=False)
    src = tmp_path / "m.onnx"
    model = build("vit-tiny", depth=1) if name == "vit-tiny" else build("bert-tiny", batch="batch", seq="seq",
                                                                           depth=1)
    onnx.save(model, str(src))
    result, _, _ = optimize_file_(src, tmp_path / "out.onnx", None, tune_trials=2,
                                  storage=f"sqlite:///{tmp_path / 's.db'}", measurer=AnalyticalMeasurer())
    assert {p.key: p.value for p in result.model.metadata_props}["gtco.target"] == "sm_80"
    tuning = result.report["dynamic"]["tuning"] if result.dynamic else result.report["tuning"]
    assert (name == "bert-tiny-dynamic") == bool(result.dynamic)
    assert tuning["arch"] == "sm_80" and tuning["tasks"]
    assert all("-sm_80-" in t["task"] for t in tuning["tasks"])


def test_tuning_takes_the_shapes_the_plan_has() -> None:
    """The plan's view gives the fused nodes the shapes the rewritten model's value_info records: the same tasks
    and skip reasons, per shape and shape-generic. The lookup is the one optimize_file tunes with
    (OptimizeResult.shape_of: the view's shapes under the names the precision conversion gave, such as the fp16
    Cast of ViT's image that its patch-embedding conv task reads x's shape from)."""
    from onnx_gtco.config import Ranges
    from onnx_gtco.tune.shape_generic import dynamic_tasks
    from onnx_gtco.tune.tasks import model_tasks

    def keyed(tasks):
        return [(t.key, getattr(t, "task", t).weight, getattr(t, "task", t).nodes) for t in tasks]

    config = GtcoConfig(precision="fp16", target="sm_80")
    for model in (build("vit-tiny", depth=1), build("bert-tiny", batch="batch", seq="seq", depth=1)):
        result = optimize(model, config)
        shapes = result.shape_of()
        for arch in ("sm_80", "sm_90"):
            (a, why_a), (b, why_b) = model_tasks(result.model, arch), model_tasks(result.model, arch, shapes)
            assert keyed(a) == keyed(b) and a and why_a == why_b
            ranges = result.dynamic or Ranges()
            (a, why_a), (b, why_b) = (dynamic_tasks(result.model, arch, ranges),
                                      dynamic_tasks(result.model, arch, ranges, shapes))
            assert keyed(a) == keyed(b) and why_a == why_b and bool(a) == bool(result.dynamic)
