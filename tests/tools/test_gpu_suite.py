"""tools/gpu_suite and its parts (tools/suite): the plan and its stand-ins, the budget that starts no row it cannot
finish, resuming a run cut off at any point, the preflight on a machine shaped like the GPU one, the bundle's
environment, the commands each row runs, the install of carried wheels, and the rendered table."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from onnx_gtco.errors import GtcoError

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_suite"
sys.path.insert(0, str(ROOT / "tools"))

from suite import machine, plan, preflight, render, rows, runner  # noqa: E402
from suite.common import Step, run_command  # noqa: E402


def _tool() -> ModuleType:
    """Import tools/gpu_suite (a script without extension) as module gpu_suite."""
    if "gpu_suite" in sys.modules:
        return sys.modules["gpu_suite"]
    loader = importlib.machinery.SourceFileLoader("gpu_suite", str(TOOL))
    spec = importlib.util.spec_from_loader("gpu_suite", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module
    loader.exec_module(module)
    return module


suite = _tool()


def make_wheel(folder: Path, dist: str, module: str, top_level: bool = True, body: str = "VALUE = 7\n") -> Path:
    """A minimal pure-Python wheel installing package `module`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-0.1-py3-none-any.whl"
    info = f"{dist}-0.1.dist-info"
    files = {f"{module}/__init__.py": body,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if top_level:
        files[f"{info}/top_level.txt"] = module + "\n"
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", record)
    return path


def steps_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def ctx_for(tmp_path: Path, dry_run: bool = False, target: str | None = "sm_90") -> rows.Context:
    return rows.Context(tmp_path, steps_env(), dry_run, target, 4, 1, None, None, tmp_path / "zoo",
                        f"sqlite:///{tmp_path / 'tuning.db'}")


def row(row_id: str, dry_run: bool = False) -> plan.Row:
    got = [r for r in plan.build_plan(dry_run) if r.id == row_id]
    assert got, row_id
    return got[0]


def _zoo() -> ModuleType:
    import export_zoo

    return export_zoo


# ------------------------------------------------------------------------------------------------------ plan


def test_the_plan_runs_the_issues_rows_in_the_order_that_makes_a_short_window_count() -> None:
    rows_ = plan.build_plan(False)
    ids = [r.id for r in rows_]
    assert len(ids) == len(set(ids))
    assert ids[:5] == ["smoke/probe", "calibration/refit", "core/vit-b16.b1", "core/vit-b16.b64",
                       "core/bert-base.b1"]
    assert [plan.PHASES.index(r.phase) for r in rows_] == sorted(plan.PHASES.index(r.phase) for r in rows_)
    core = [r for r in rows_ if r.phase == "core"]
    assert all(r.baselines == ("ort-fp16", "ort-transformers-fp16") and not r.tune for r in core)
    assert {r.id for r in rows_ if r.tune} == {"tune/vit-b16.b1", "tune/vit-b16.b64", "tune/bert-base.b1"}
    assert {r.kernel_set for r in rows_ if r.kind == "kernels"} == {"vit-b16", "bert-base"}
    rest = {(r.model.name, r.batch, r.dims) for r in rows_ if r.phase == "rest"}
    assert {(m, b) for m, b, _ in rest} >= {("vit-b16", 8), ("deit-s", 1), ("swin-t", 1), ("setr", 1),
                                            ("detr-r50", 1), ("bert-base-dyn", 1)}
    assert {d for m, _, d in rest if m == "bert-base-dyn"} == {(("sequence", s),) for s in (32, 128, 512)}
    extra = {b for r in rows_ if r.phase == "extra" for b in r.baselines}
    assert extra == {"torch-compile", "tensorrt"}
    zoo = _zoo()
    for r in rows_:
        if r.model is not None:  # each a zoo export: torch.compile compiles the model's own module
            assert r.model.zoo in zoo.MODELS and r.model.builtin is None
            assert r.model.ort_form == zoo.ORT_OPTIMIZER_ARGS.get(r.model.zoo, {})
    # what a 9-minute first call starts: smoke, the calibration and ViT-B/16's two core rows; BERT's waits for --resume
    first = [r for r in rows_ if sum(x.estimate_s for x in rows_[:rows_.index(r) + 1]) <= 9 * 60 - 30]
    assert [r.id for r in first] == ids[:4]
    calib = rows_[1]
    assert calib.kind == "calibration" and calib.phase == "calibration" and calib.estimate_s <= 150
    assert plan.dry_row(calib).estimate_s <= 15  # the dry suite runs it: a few seconds beyond its compiles


def test_a_dry_run_stands_in_for_every_row_or_says_why_it_cannot() -> None:
    gpu, dry = plan.build_plan(False), plan.build_plan(True)
    assert [r.id for r in gpu] == [r.id for r in dry]
    for g, d in zip(gpu, dry, strict=True):
        if g.model is None:
            continue
        assert d.stands_in_for == g.model.name and d.model.builtin is not None
        if any(b in ("torch-compile", "tensorrt") for b in g.baselines):
            assert d.no_stand_in
        else:
            assert not d.no_stand_in and d.baselines == ("ort-fp32", "ort-fp16") and d.tune == g.tune
    assert sum(r.estimate_s for r in dry) < 9 * 60  # the whole dry plan fits its default budget
    probe = next(r for r in dry if r.kind == "probe")
    assert probe.id == "kernels/hopper-libraries" and "Hopper GPU" in probe.no_stand_in


def test_the_hopper_probe_times_and_tables_what_it_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/hopper_probe.py (GPU only): its timing takes the median of its groups after the warm-up, its table
    gives each case's times, ratios and the libraries' refusals; the suite's probe row runs it and renders that
    table, or says why it did not run."""
    import hopper_probe as hp

    calls: list[float] = []  # each call takes 3 us of the fake clock

    def clock() -> float:
        return len(calls) * 3e-6

    assert hp.time_us(lambda: calls.append(1), 4, lambda: None, clock) == pytest.approx(3.0)
    assert len(calls) == 10 + 5 * 4
    gemm = hp.Case("gemm", "vit-b16 b1 qkv", "M=197 K=768 N=2304", {"fp16": 20.0, "fp8": 12.0}, rel_error=0.031)
    att = hp.Case("attention", "bert-base b1", "B=1 H=12 S=128 D=64 mask",
                  {"cudnn": 9.0, "flash": None, "efficient": 12.0}, {"flash": "RuntimeError: no mask"})
    md = hp.markdown([gemm, att], "H200")
    assert "| vit-b16 b1 qkv | M=197 K=768 N=2304 | 20.0 | 12.0 | 0.60 | 0.031 |" in md
    assert "| bert-base b1 | B=1 H=12 S=128 D=64 mask | 9.0 | - | 12.0 | 0.75 |" in md
    assert "- bert-base b1 (attention) flash: RuntimeError: no mask" in md
    assert {g[0].split()[0] for g in hp.GEMMS} == {"vit-b16", "bert-base"} and len(hp.ATTENTIONS) == 3
    calls_made: list[list[str]] = []

    def fake_run(name, cmd, *, env, timeout_s, log, cwd=ROOT):
        calls_made.append(list(cmd))
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "results.md").write_text(md)
        return Step(name, "ok", "", 1.0, str(log))

    monkeypatch.setattr(rows, "run_command", fake_run)
    ctx = ctx_for(tmp_path)
    ctx.logs.mkdir(parents=True)
    rec = rows.run_row(ctx, row("kernels/hopper-libraries"), time.monotonic() + 100)
    assert rec["status"] == "ok" and calls_made[0][1].endswith("tools/hopper_probe.py")
    assert 0 < float(calls_made[0][calls_made[0].index("--budget-s") + 1]) < 100
    summary = {"suite": {"command": "c", "date": "2026-12-08 10:00 UTC", "dry_run": False, "budget_min": 9.0,
                         "elapsed_s": 1.0, "tune_trials": 8, "storage": "s"}, "env": {}, "steps": [], "rows": [rec]}
    text = render.render_markdown(summary)
    assert "### Hopper's library paths: FP8 GEMMs, cuDNN attention (kernels/hopper-libraries)" in text
    assert "| vit-b16 b1 qkv |" in text


def test_rows_and_skip_select_the_plan_and_reject_what_matches_nothing() -> None:
    picked = plan.build_plan(False, only=["core/bert-*", "tune/*"])
    assert [r.id for r in picked] == ["smoke/probe", "core/bert-base.b1", "tune/vit-b16.b1", "tune/vit-b16.b64",
                                      "tune/bert-base.b1"]
    assert next(r.id for r in plan.build_plan(False, skip=["smoke"], only=["core/*"])) == "core/vit-b16.b1"
    assert plan.build_plan(True, wheels=True)[0].kind == "install"
    with pytest.raises(GtcoError, match="matches no row"):
        plan.build_plan(False, only=["core/resnet*"])
    with pytest.raises(GtcoError, match="--skip everything"):
        plan.build_plan(False, skip=["everything"])


def test_bad_arguments_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(GtcoError, match="never replaces docs"):
        suite.parse_args(["--dry-run", "--write-docs"])
    assert suite.main(["--dry-run", "--budget-min", "-1"]) == 2
    assert suite.main(["--dry-run", "--tune-trials", "-1"]) == 2
    assert suite.main(["--dry-run", "--skip", "models", "--out", str(tmp_path / "out")]) == 2
    assert suite.main(["--dry-run", "--rows", "nothing/*", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    assert machine.target_for("sm_90") == "sm_90" and machine.target_for("sm_89") == "sm_80"
    assert machine.target_for("sm_100") == "sm_90" and machine.target_for("sm_75") is None


def test_the_target_is_the_gpus_own_name_where_onnx_gtco_knows_it_so_its_calibration_applies() -> None:
    assert machine.target_for("sm_90", "NVIDIA H200") == "h200"
    assert machine.target_for("sm_90", "NVIDIA H100 80GB HBM3") == "h100"
    assert machine.target_for("sm_80", "NVIDIA A100-SXM4-80GB") == "a100"
    assert machine.target_for("sm_90", "NVIDIA GH200 480GB") == "sm_90"  # an sm_90 GPU it does not know by name
    assert machine.target_for("sm_89", "NVIDIA L40S") == "sm_80"
    assert machine.target_for("sm_100", "NVIDIA B200") == "sm_90" and machine.target_for("sm_75", "Tesla T4") is None
    assert [machine.target_arch(t) for t in ("h200", "a100", "sm_90")] == ["sm_90", "sm_80", "sm_90"]
    assert preflight.needs_for(False, "h200", sql_storage=False).cutlass_headers


def test_list_prints_each_row_with_its_expected_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["smoke/probe", "75", "75"]
    assert out[2].split() == ["calibration/refit", "150", "225"]
    assert any(ln.startswith("core/vit-b16.b64") for ln in out)


# ------------------------------------------------------------------------------------------------------ budget


def test_budget_starts_no_row_it_cannot_finish_and_counts_from_since() -> None:
    now = [0.0]
    budget = runner.Budget(2.0, clock=lambda: now[0])  # 120 s
    assert budget.skip_reason(100.0) is None
    now[0] = 30.0
    reason = budget.skip_reason(100.0)
    assert reason is not None and reason.startswith("budget: 90 s of 2.0 min left") and "100 s" in reason
    now[0] = 500.0
    assert budget.left_s() == 0.0


def test_rows_past_the_budget_are_listed_skipped_with_the_reason(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = suite.main(["--dry-run", "--out", str(out), "--budget-min", "0.1", "--rows", "core/*"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["id"] for r in summary["rows"]] == ["smoke/probe", "core/vit-b16.b1", "core/vit-b16.b64",
                                                  "core/bert-base.b1"]
    for r in summary["rows"]:  # 6 s: not even the smoke row (20 s expected on the CPU) starts
        assert r["status"] == "skipped" and r["reason"].startswith("budget:"), r
    md = (out / "benchmarks.md").read_text()
    assert "- core/bert-base.b1: skipped: budget:" in md
    assert "core/bert-base.b1" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------ resume


def test_resume_needs_a_run_of_the_same_kind(tmp_path: Path) -> None:
    assert suite.main(["--dry-run", "--out", str(tmp_path / "none"), "--resume"]) == 2  # nothing to continue
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"suite": {"dry_run": False, "date": "d"}, "rows": []}))
    assert suite.main(["--dry-run", "--out", str(out), "--resume"]) == 2  # a GPU run's OUT, resumed dry
    (out / "summary.json").write_text("{")
    assert suite.main(["--dry-run", "--out", str(out), "--resume"]) == 2


def test_resume_keeps_each_finished_row_and_runs_only_the_rest(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    ran: list[str] = []

    def fake_row(ctx, r, deadline):
        ran.append(r.id)
        cut = r.id == "core/vit-b16.b64" and not (out / "cut").exists()
        if cut:
            (out / "cut").touch()
        return rows.record(r) | {"status": "failed" if cut else "ok", "reason": "timed out" if cut else ""}

    monkeypatch.setattr(runner, "run_row", fake_row)
    skip = ["--skip", "smoke", "--rows", "core/*"]
    assert suite.main(["--dry-run", "--out", str(out), *skip]) == 1
    assert ran == ["core/vit-b16.b1", "core/vit-b16.b64", "core/bert-base.b1"]
    ran.clear()
    assert suite.main(["--dry-run", "--out", str(out), "--resume", *skip]) == 0
    assert ran == ["core/vit-b16.b64"]
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["id"], r["status"], r.get("resumed", False)) for r in summary["rows"]] == [
        ("core/vit-b16.b1", "ok", True), ("core/vit-b16.b64", "ok", False), ("core/bert-base.b1", "ok", True)]
    assert summary["suite"]["resumed_from"] and "(kept)" in (out / "benchmarks.md").read_text()


@pytest.mark.slow
def test_the_whole_dry_plan_killed_at_a_random_point_finishes_with_resume_repeating_no_row(tmp_path: Path) -> None:
    """The acceptance run: `--dry-run --budget-min 9` over the whole plan, killed (SIGKILL to its process group)
    at a random point after its first row, then `--resume`: every row ends ok or skipped with its reason, inside
    the budget, and no row that had finished runs again (its log is not rewritten)."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(TOOL), "--dry-run", "--out", str(out), "--budget-min", "9"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=steps_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    rng = random.Random(os.getpid())
    wanted = rng.randint(1, 8)  # rows finished before the kill
    done: list[dict] = []
    while proc.poll() is None and len(done) < wanted and time.monotonic() - t0 < 400:
        time.sleep(0.2)
        try:
            done = json.loads((out / "summary.json").read_text())["rows"]
        except (OSError, ValueError, KeyError):
            pass
    time.sleep(rng.uniform(0.0, 2.0))  # somewhere inside the next row
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = json.loads((out / "summary.json").read_text())
    finished = {r["id"] for r in first["rows"] if r["status"] == "ok"}
    assert finished, "the run was killed before any row finished"
    logs = {p.name: p.stat().st_mtime_ns for p in (out / "logs").iterdir()}
    kept_logs = {n for n in logs if any(n.startswith(rid.replace("/", "-")) for rid in finished)}

    code = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=steps_env(), capture_output=True, text=True,
                          timeout=600).returncode
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, (out / "benchmarks.md").read_text()
    assert [r["id"] for r in summary["rows"]] == [r.id for r in plan.build_plan(True)]
    for r in summary["rows"]:
        assert r["status"] == "ok" or (r["status"] == "skipped" and r["reason"].startswith("no CPU stand-in")), r
        assert bool(r.get("resumed")) == (r["id"] in finished)
    for name in kept_logs:  # a finished row ran once
        assert (out / "logs" / name).stat().st_mtime_ns == logs[name], name
    assert summary["suite"]["elapsed_s"] < 9 * 60
    bench = [r for r in summary["rows"] if r["kind"] == "bench" and r["status"] == "ok"]
    for r in bench:
        variants = {v["name"]: v for v in r["variants"]}
        assert set(variants) == {"gtco", "ort-fp32", "ort-fp16"}
        assert all(v["status"] == "ok" and v["median_ms"] > 0 for v in variants.values()), variants
        assert r["ours_over"]["ort-fp32"] == pytest.approx(
            variants["gtco"]["median_ms"] / variants["ort-fp32"]["median_ms"])
    tuned = [r for r in bench if r["tuned"]]
    for r in tuned:  # tuned into the run's storage (a row cut off mid-tuning finds its trials there on resume)
        t = r["optimize"]["tuning"]
        assert t["trials_per_task"] == 2 and t["tasks_found"] > 0, r["optimize"]
    assert tuned and (out / "tuning.journal").stat().st_size > 0
    kernels = [r for r in summary["rows"] if r["kind"] == "kernels"]
    assert all(r["kernel_bench"]["compile_only"] for r in kernels if "kernel_bench" in r)
    tests = next(r for r in summary["rows"] if r["kind"] == "tests")
    assert tests["status"] == "ok" and tests["tests"]["tests"] >= 1 and tests["tests"]["skipped"] == \
        tests["tests"]["tests"]  # collected, and skipped without a GPU: a collection error anywhere fails it
    md = (out / "benchmarks.md").read_text()
    for line in ("- GPU: none (dry run), onnx-gtco target sm_90", "**Dry run**", "### Core rows",
                 "| vit-b16.b64 (vit-tiny b2) | ok", "### Calibration: the estimate refitted on this GPU",
                 "In force for the rest of the run: the refit `sm_90.json`", "| model | ln-chain64, PDL on"):
        assert line in md, line
    # the calibration row: stand-in records the fit reads, the refit in OUT/calibration, every later row on it
    from onnx_gtco.calibration import Hardware, LaunchConstants, load_calibration
    from onnx_gtco.config import TARGETS
    from onnx_gtco.tune import fit

    calib = next(r for r in summary["rows"] if r["kind"] == "calibration")
    refit_dir = out / "calibration"
    assert calib["sets_env"] == {"GTCO_CALIBRATION_DIR": str(refit_dir)} and calib["calibration"]["stand_in"]
    recs = fit.load_records([refit_dir / "records.json"])
    assert {(k.family, str(k.config.get("impl", "mma"))) for k in recs.kernels} >= {
        ("gemm", "mma"), ("gemm", "cublaslt"), ("layernorm", "mma"), ("conv", "mma"), ("elementwise", "mma")}
    assert any(k.problems[0][1].flag("layernorm") for k in recs.kernels)  # the fused GEMM + LayerNorm
    assert sorted(m.pdl_launches > 0 for m in recs.models) == [False, True]
    assert all(k.side == "gtco" and k.proxy is None and {"gpu", "driver", "commit", "date"} <= set(k.source)
               for k in recs.kernels)
    cal = load_calibration("sm_90", refit_dir)
    assert cal is not None and cal.gpu == recs.gpu and "launch.pdl_overlap_us" in cal.fitted["fitted"]
    assert Hardware(TARGETS["sm_90"], cal).constants(LaunchConstants).graph_gap_us > 0
    measure = json.loads((refit_dir / "measure.json").read_text())
    if shutil.which("nvcc"):  # compile-only where nvcc is, as the kernels rows
        assert measure["compiled"] and set(measure["compiled"].values()) == {"ok"}, measure["compiled"]
    after = [r for r in bench if summary["rows"].index(r) > summary["rows"].index(calib)]
    assert after
    for r in after:  # planned with the refit, in the first run and in the resumed one alike
        estimate = json.loads(Path(r["report"]).read_text())["estimate"]
        assert estimate["calibration"]["file"] == "sm_90.json" and estimate["calibration"]["gpu"] == recs.gpu, r["id"]


# ------------------------------------------------------------------------------------------------------ smoke


def test_a_failed_smoke_row_stops_a_gpu_run_with_the_reason_first(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(machine, "gpu_info", lambda: {"name": "NVIDIA H200", "arch": "sm_90", "driver": "580"})
    monkeypatch.setattr(runner, "gpu_info", machine.gpu_info)
    monkeypatch.setattr(runner, "preflight", lambda needs, env: Step("preflight", "ok"))
    monkeypatch.setattr(runner, "BUNDLE_SETUP", tmp_path / "no-setup")  # a bundle carried beside this checkout
    monkeypatch.setattr(runner, "BUNDLE_ENV", tmp_path / "no-env.sh")

    def smoke(ctx, r, deadline, rec):
        rec["status"], rec["reason"] = "failed", "check: exit 1: logits: max |new - ref| 3.1 > atol"

    monkeypatch.setattr(rows, "_smoke", smoke)
    monkeypatch.setattr(rows, "_bench", lambda *a: pytest.fail("a row ran after a failed smoke row"))
    assert suite.main(["--out", str(out), "--rows", "core/*"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env"]["target"] == "h200"  # the H200's own target: every command plans with its calibration
    assert summary["stop"].startswith("smoke/probe failed") and "max |new - ref|" in summary["stop"]
    assert all(r["status"] == "skipped" and "smoke/probe failed" in r["reason"] for r in summary["rows"][1:])
    md = (out / "benchmarks.md").read_text().splitlines()
    stopped = next(i for i, ln in enumerate(md) if ln.startswith("**Stopped**: smoke/probe failed"))
    assert stopped < next(i for i, ln in enumerate(md) if ln.startswith("- Date:"))  # the first thing said


def test_a_smoke_check_that_fails_only_with_pdl_turns_pdl_off_for_the_rest(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ctx_for(tmp_path)
    ctx.logs.mkdir(parents=True)
    seen = []

    def fake_run(name, cmd, *, env, timeout_s, log, cwd=ROOT):
        seen.append((name, env.get("GTCO_PDL")))
        ok = env.get("GTCO_PDL") == "0" or not pdl_broken
        return Step(name, "ok" if ok else "failed", "" if ok else "exit 1: logits off", 1.0, str(log))

    monkeypatch.setattr(rows, "run_command", fake_run)
    pdl_broken = True
    rec: dict = {"steps": []}
    step = rows._check_pdl_or_not(ctx, ["check"], time.monotonic() + 100, rec)
    assert step.status == "ok" and "without it, it passes" in step.reason and rec["pdl"] == "off"
    assert seen == [("smoke: check", None), ("smoke: check without PDL", "0")] and ctx.env["GTCO_PDL"] == "0"
    assert rec["steps"][0]["status"] == "failed"  # the failure with PDL stays on record
    # a library wrong either way fails; a dry run never retries
    ctx2, seen[:] = ctx_for(tmp_path / "b"), []
    ctx2.logs.mkdir(parents=True)
    monkeypatch.setattr(rows, "run_command", lambda name, cmd, *, env, timeout_s, log, cwd=ROOT: Step(
        name, "failed", "exit 1", 1.0, str(log)))
    rec = {"steps": []}
    assert rows._check_pdl_or_not(ctx2, ["check"], time.monotonic() + 100, rec).status == "failed"
    assert "pdl" not in rec and "GTCO_PDL" not in ctx2.env
    dry = ctx_for(tmp_path / "c", dry_run=True)
    dry.logs.mkdir(parents=True)
    rec = {"steps": []}
    assert rows._check_pdl_or_not(dry, ["check"], time.monotonic() + 100, rec).status == "failed"
    assert rec["steps"] == []


def test_memcheck_is_skipped_where_the_tool_cannot_work_and_fails_on_an_error(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ctx_for(tmp_path)
    ctx.logs.mkdir(parents=True)
    monkeypatch.setattr(rows.shutil, "which", lambda name, *a, **k: "/usr/bin/compute-sanitizer")
    answers = {"unsupported": ("exit 255: Device not supported", "========= Error: Device not supported\n"),
               "error": ("exit 99: 1 errors", "========= Invalid __global__ write of size 2 bytes\n"),
               "ok": ("", "")}

    def fake_run(name, cmd, *, env, timeout_s, log, cwd=ROOT):
        reason, text = answers[mode]
        log.write_text(text)
        assert cmd[:3] == ["/usr/bin/compute-sanitizer", "--tool", "memcheck"] and timeout_s <= rows.MEMCHECK_S
        return Step(name, "failed" if reason else "ok", reason, 1.0, str(log))

    monkeypatch.setattr(rows, "run_command", fake_run)
    for mode, want in (("unsupported", "skipped"), ("error", "failed"), ("ok", "ok")):
        step = rows._memcheck(ctx, ["python", "-m", "onnx_gtco", "check"], time.monotonic() + 100)
        assert step.status == want, (mode, step)
    mode = "error"
    assert "Invalid __global__ write" in rows._memcheck(ctx, ["x"], time.monotonic() + 100).reason
    assert rows._memcheck(ctx_for(tmp_path, dry_run=True), ["x"], time.monotonic() + 100).status == "skipped"


# ------------------------------------------------------------------------------------------------------ preflight


def _bundle_like(tmp_path: Path) -> Path:
    """A folder laid out as the GPU bundle's headers: ort/ with the ONNX Runtime headers, cublas/ with cublasLt.h."""
    from onnx_gtco.plugin.headers import ort_include_dir

    d = tmp_path / "gpu-headers"
    shutil.copytree(ort_include_dir(), d / "ort")
    (d / "cublas").mkdir()
    (d / "cublas" / "cublasLt.h").write_text("/* cuBLASLt */\n")
    return d


def test_preflight_passes_offline_on_a_machine_shaped_like_the_gpu_one_and_names_what_is_missing(
        tmp_path: Path) -> None:
    """No network (nothing is downloaded: an empty header cache stays empty), the headers from a bundle-like
    folder; removing the ORT headers gives one line naming them, and so does a package the machine lacks."""
    headers = _bundle_like(tmp_path)
    cache = tmp_path / "cache"
    env = dict(steps_env(), ORT_INCLUDE_DIR=str(headers / "ort"), GTCO_CUBLASLT_INCLUDE=str(headers / "cublas"),
               XDG_CACHE_HOME=str(cache), GTCO_CACHE_DIR=str(cache))
    needs = preflight.Needs(preflight.BASE_MODULES, cublaslt_header=True, tools=("g++",))
    step = preflight.preflight(needs, env)
    assert step.status == "ok", step.reason
    assert step.detail["found"] == {"ort_headers": str(headers / "ort"), "cublaslt_header": str(headers / "cublas")}

    shutil.rmtree(headers / "ort")
    del env["ORT_INCLUDE_DIR"]
    step = preflight.preflight(needs, env)
    assert step.status == "failed" and step.detail["missing"] == [step.reason]
    assert step.reason.startswith("ONNX Runtime headers: ") and "ORT_INCLUDE_DIR" in step.reason
    assert preflight.lines(step) == [f"preflight: missing: {step.reason}"]
    assert not cache.exists() or not any(cache.rglob("*.h"))  # nothing was downloaded

    env["ORT_INCLUDE_DIR"] = str(tmp_path)  # set, but without the header
    step = preflight.preflight(preflight.Needs(("numpy", "gtco_not_a_package"), tools=("gtco-no-such-tool",)), env)
    assert step.status == "failed" and len(step.detail["missing"]) == 3
    assert step.detail["missing"][:2] == ["tool gtco-no-such-tool is not on PATH",
                                          "Python package gtco_not_a_package is not importable"]


def test_a_gpu_run_needs_the_cuda_ep_the_headers_and_the_tools() -> None:
    gpu = preflight.needs_for(False, "sm_90", sql_storage=True)
    assert gpu.cuda_ep and gpu.cublaslt_header and gpu.cutlass_headers and "sqlalchemy" in gpu.modules
    assert {"nvcc", "g++", "nvidia-smi"} <= set(gpu.tools) and "compute-sanitizer" in gpu.optional_tools
    assert {"torch", "timm", "transformers", "cupy"} <= set(gpu.modules)
    dry = preflight.needs_for(True, "sm_90", sql_storage=False)
    assert not dry.cuda_ep and not dry.cublaslt_header and "sqlalchemy" not in dry.modules
    assert not preflight.needs_for(False, "sm_80", sql_storage=False).cutlass_headers


def test_a_failed_preflight_stops_the_run_before_any_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(tmp_path))  # no headers there
    monkeypatch.setattr(rows, "_smoke", lambda *a: pytest.fail("a row ran after a failed preflight"))
    out = tmp_path / "out"
    assert suite.main(["--dry-run", "--out", str(out), "--rows", "core/*"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop"].startswith("preflight failed") and "ORT_INCLUDE_DIR" in summary["stop"]
    printed = capsys.readouterr().out
    assert "preflight: missing: ONNX Runtime headers: ORT_INCLUDE_DIR=" in printed


# ------------------------------------------------------------------------------------------------------ bundle


def test_the_bundles_environment_is_read_and_its_setup_run_once(tmp_path: Path) -> None:
    env_file = tmp_path / "gpu-env.sh"
    setup = tmp_path / "setup"
    setup.write_text(f"""#!/usr/bin/env bash
echo ran >> {tmp_path}/ran
cat > {env_file} <<'X'
export PYTHONPATH=/tmp/gpu-site:/w${{PYTHONPATH:+:$PYTHONPATH}}
export ORT_INCLUDE_DIR=/tmp/gpu-headers/ort
export PATH=/tmp/gpu-bin:$PATH
X
""")
    env = {"PATH": "/usr/bin", "PYTHONPATH": "/a"}
    step = machine.bundle_env(env, False, setup, env_file)
    assert step.status == "ok" and step.detail["variables"] == ["ORT_INCLUDE_DIR", "PATH", "PYTHONPATH"]
    assert env == {"PATH": "/tmp/gpu-bin:/usr/bin", "PYTHONPATH": "/tmp/gpu-site:/w:/a",
                   "ORT_INCLUDE_DIR": "/tmp/gpu-headers/ort"}
    assert machine.bundle_env({"PATH": "/bin"}, False, setup, env_file).status == "ok"
    assert (tmp_path / "ran").read_text() == "ran\n"  # set up once: the second call read the file it wrote
    assert machine.bundle_env({}, True, tmp_path / "none", tmp_path / "none.sh").status == "skipped"
    setup.write_text("echo broken >&2; exit 3\n")
    failed = machine.bundle_env({}, False, setup, tmp_path / "other.sh")
    assert failed.status == "failed" and "exit 3: broken" in failed.reason


# ------------------------------------------------------------------------------------------------------ rows


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    step = run_command("slow", cmd, env=dict(os.environ), timeout_s=1.0, log=tmp_path / "slow.log")
    assert step.status == "failed" and step.reason == "timed out after 1 s" and step.seconds < 30
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(50):  # killed: gone, or a zombie until its new parent reaps it
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the step's child process outlived the timeout")
    ok = run_command("fine", ["sh", "-c", "echo one; echo two >&2; exit 3"], env=dict(os.environ),
                     timeout_s=30.0, log=tmp_path / "fine.log")
    assert ok.status == "failed" and ok.reason == "exit 3: two"


def _capture(monkeypatch: pytest.MonkeyPatch, stop_at: str = "bench") -> dict[str, list[str]]:
    commands: dict[str, list[str]] = {}

    def fake_run(name, cmd, **kwargs):
        commands[name.split(": ")[-1]] = list(cmd)
        return Step(name, "failed" if name.endswith(stop_at) else "ok", "stop here", 0.0)

    monkeypatch.setattr(rows, "run_command", fake_run)
    monkeypatch.setattr(rows, "probe", lambda code, args, env, timeout_s=120.0: [])
    return commands


def test_a_zoo_model_without_its_dependencies_is_skipped_with_the_reason(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "probe", lambda code, args, env, timeout_s=120.0: ["timm", "onnxscript"])
    rec = rows.run_row(ctx_for(tmp_path), row("rest/swin-t.b1"), time.monotonic() + 60)
    assert rec["status"] == "skipped" and rec["reason"].startswith("export: needs timm, onnxscript")
    assert not (tmp_path / "zoo").exists()


def test_a_core_row_optimizes_the_fp32_export_at_its_batch_with_precision_fp16(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ViT-B/16 at batch 64: export_zoo.py exports that batch (no torch.export program: no torch.compile in the
    row), optimize gets the fp32 export as users make it (the conversion to half is optimize's own), untuned, and
    the bench times that same export against the core baselines with the profiles."""
    commands = _capture(monkeypatch)
    ctx = ctx_for(tmp_path)
    ctx.profile = True
    rec = rows.run_row(ctx, row("core/vit-b16.b64"), time.monotonic() + 60)
    export, optimize, bench = commands["export"], commands["optimize"], commands["bench"]
    assert export[export.index("--batch") + 1] == "64" and "--programs" not in export
    assert export[export.index("--exporters") + 1] == "torchscript"
    onnx_file = str(tmp_path / "zoo" / "vit-b16.b64.torchscript.onnx")
    assert optimize[3:5] == ["optimize", onnx_file] and bench[3:5] == ["bench", onnx_file]
    assert optimize[optimize.index("--precision") + 1] == "fp16" and "--cuda" in optimize
    assert optimize[optimize.index("--tune-trials") + 1] == "0"
    i = bench.index("--baselines")
    assert bench[i + 1:i + 3] == ["ort-fp16", "ort-transformers-fp16"] and "--profile" in bench
    assert bench[bench.index("--batch") + 1] == "64" and "--ort-model" not in bench and "--quick" not in bench
    assert rec["status"] == "failed" and rec["reason"] == "bench: stop here"


def test_the_bert_rows_give_ort_transformers_the_form_it_fuses(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _capture(monkeypatch)
    rows.run_row(ctx_for(tmp_path), row("tune/bert-base.b1"), time.monotonic() + 60)
    export, optimize, bench = commands["export"], commands["optimize"], commands["bench"]
    assert export[export.index("--exporters") + 1] == "torchscript,ort"
    assert optimize[optimize.index("--tune-trials") + 1] == "4"
    assert optimize[4] == str(tmp_path / "zoo" / "bert-base.torchscript.onnx") == bench[4]
    i = bench.index("--ort-model")
    assert bench[i:i + 8] == ["--ort-model", str(tmp_path / "zoo" / "bert-base.ort.onnx"), "--model-type", "bert",
                              "--num-heads", "12", "--hidden-size", "768"]
    commands.clear()
    rows.run_row(ctx_for(tmp_path), row("rest/bert-base-dyn.s512"), time.monotonic() + 60)
    export, optimize, bench = commands["export"], commands["optimize"], commands["bench"]
    dyn = str(tmp_path / "zoo" / "bert-base.ort.onnx")  # the dynamic ORT form is the model itself
    assert export[export.index("--exporters") + 1] == "ort" and optimize[4] == dyn == bench[4]
    assert optimize[optimize.index("--dynamic") + 1] == "batch=1:1,sequence=1:512"
    assert bench[bench.index("--dim") + 1] == "sequence=512" and "--ort-model" not in bench
    assert bench[bench.index("--model-type") + 1] == "bert"


def test_an_extra_row_benches_torch_compile_of_the_models_own_program(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _capture(monkeypatch)
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "vit-b16.b64.pt2").write_bytes(b"program")  # what the export step writes
    rows.run_row(ctx_for(tmp_path), row("extra/vit-b16.b64.torch-compile"), time.monotonic() + 60)
    export, bench = commands["export"], commands["bench"]
    assert "--programs" in export
    assert bench[bench.index("--torch-program") + 1] == str(tmp_path / "zoo" / "vit-b16.b64.pt2")
    assert bench[bench.index("--baselines") + 1:bench.index("--baselines") + 2] == ["torch-compile"]


def test_a_kernels_row_times_its_shape_set_within_the_row_and_reads_its_results(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    calls: list[tuple[list[str], float]] = []

    def fake_run(name, cmd, *, env, timeout_s, log, cwd=ROOT):
        calls.append((list(cmd), timeout_s))
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps({"built": ["a", "b"], "results": [
            {"case": "qkv", "all_ok": True}, {"case": "fc1", "all_ok": False}]}))
        (out / "results.md").write_text("| kernel table |\n")
        return Step(name, "failed", "exit 1: wrong", 1.0, str(log))

    monkeypatch.setattr(rows, "run_command", fake_run)
    monkeypatch.setattr(rows.shutil, "which", lambda *a: "/usr/bin/nvcc")
    ctx = ctx_for(tmp_path)
    ctx.logs.mkdir(parents=True)
    ctx.target = "h200"  # the GPU's own target: kernel_bench takes its arch
    rec = rows.run_row(ctx, row("kernels/vit-b16"), time.monotonic() + 200)
    cmd, timeout_s = calls[0]
    assert cmd[cmd.index("--set") + 1] == "vit-b16" and cmd[cmd.index("--arch") + 1] == "sm_90"
    assert float(cmd[cmd.index("--time-budget-s") + 1]) < timeout_s <= 200 and "--no-compile" in cmd
    assert rec["status"] == "failed" and rec["reason"].startswith("kernel bench: 1 of 2 cases had a candidate fail")
    assert rec["kernel_bench"]["cases_all_ok"] == 1
    summary = {"suite": {"command": "c", "date": "2026-11-28 10:00 UTC", "dry_run": False, "budget_min": 9.0,
                         "elapsed_s": 1.0, "tune_trials": 8, "storage": "s"}, "env": {}, "steps": [], "rows": [rec]}
    assert "#### kernels/vit-b16\n\n| kernel table |" in render.render_markdown(summary)


# ------------------------------------------------------------------------------------------------------ install


def test_already_importable_checks_modules_and_the_cuda_provider_for_onnxruntime_gpu(tmp_path: Path) -> None:
    stdlib = make_wheel(tmp_path, "jsonlike", "json")
    absent = make_wheel(tmp_path, "gtco_absent_pkg", "gtco_absent_pkg", top_level=False)
    ort_gpu = tmp_path / "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    shutil.copy(make_wheel(tmp_path / "o", "onnxruntime_gpu", "onnxruntime"), ort_gpu)
    assert machine.wheel_modules(absent) == ["gtco_absent_pkg"]  # from the archive's layout without top_level.txt
    got = machine.already_importable([stdlib, absent, ort_gpu], steps_env())
    import onnxruntime  # importable here, so only the provider check keeps the GPU wheel in

    cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert got == {"jsonlike": True, "gtco_absent_pkg": False, "onnxruntime_gpu": cuda}


def test_ort_parts_are_joined_and_checked_against_the_install_script(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "w", "onnxruntime_gpu", "onnxruntime", body="X = 1\n" * 4000)
    data = wheel.read_bytes()
    name = "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    parts = tmp_path / "ort-parts"
    parts.mkdir()
    third = len(data) // 3 + 1
    for i in range(3):
        (parts / f"ort-part{i + 1}").write_bytes(data[i * third:(i + 1) * third])
    # the lines of the script ../shared/device/prepare-ort-gpu writes, for 3 parts
    (parts / "install-ort-gpu").write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\ncd /tmp/ort-parts\n"
        "for i in $(seq 1 3); do [ -f ort-part$i ] || { echo \"missing ort-part$i\" >&2; exit 1; }; done\n"
        f"cat $(for i in $(seq 1 3); do echo ort-part$i; done) > {name}\n"
        f"echo \"{hashlib.sha256(data).hexdigest()}  {name}\" | sha256sum -c - >/dev/null\n")
    joined = machine.collect_wheels([parts], tmp_path / "joined")
    assert [w.name for w in joined] == [name] and joined[0].read_bytes() == data
    assert machine.wheel_dist(joined[0]) == "onnxruntime_gpu"
    (parts / "ort-part2").write_bytes(data[third:2 * third - 1] + b"\x00")
    with pytest.raises(GtcoError, match="sha256"):
        machine.reassemble_ort_parts(parts, tmp_path / "bad")
    assert not list((tmp_path / "bad").iterdir())  # nothing half-written
    (parts / "ort-part3").unlink()
    with pytest.raises(GtcoError, match="missing ort-part3 of 3 parts"):
        machine.reassemble_ort_parts(parts, tmp_path / "bad")


def test_two_versions_of_one_wheel_are_refused(tmp_path: Path) -> None:
    make_wheel(tmp_path, "gtco_twice", "gtco_twice")
    shutil.copy(tmp_path / "gtco_twice-0.1-py3-none-any.whl", tmp_path / "gtco_twice-0.2-py3-none-any.whl")
    with pytest.raises(GtcoError, match="two wheels of gtco_twice"):
        machine.collect_wheels([tmp_path], tmp_path / "joined")


def test_the_install_row_installs_what_is_not_importable_then_the_preflight_runs(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "gtco_suite_probe", "gtco_suite_probe")
    make_wheel(wheels, "jsonlike", "json")
    out = tmp_path / "out"
    assert suite.main(["--dry-run", "--out", str(out), "--wheels", str(wheels), "--skip", "smoke", "--rows",
                       "core/bert-*"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    install = summary["rows"][0]
    assert install["id"] == "install/wheels" and install["status"] == "ok"
    assert install["detail"]["already_importable"] == ["jsonlike"]
    assert install["detail"]["installed"] == ["gtco_suite_probe-0.1-py3-none-any.whl"]
    assert (out / "site" / "gtco_suite_probe" / "__init__.py").read_text() == "VALUE = 7\n"
    assert [s["name"] for s in summary["steps"]] == ["bundle", "env", "preflight"]
    assert summary["rows"][1]["status"] == "ok"


# ------------------------------------------------------------------------------------------------------ report


def test_markdown_lists_variants_that_did_not_run_with_their_reasons(tmp_path: Path) -> None:
    rec = rows.record(row("core/vit-b16.b1")) | {
        "ours_over": {"ort-fp16": 0.8, "ort-transformers-fp16": None},
        "ours_over_cuda_graph": {"ort-fp16": True, "ort-transformers-fp16": None}, "roofline": {"floor_ms": 0.5},
        "variants": [{"name": "gtco", "status": "ok", "median_ms": 2.0, "cuda_graph": True},
                     {"name": "ort-fp16", "status": "ok", "median_ms": 2.5, "cuda_graph": True},
                     {"name": "ort-transformers-fp16", "status": "failed", "reason": "no fusion matched"}]}
    summary = {
        "suite": {"command": "tools/gpu_suite --rows core/*", "date": "2026-11-28 16:00 UTC", "dry_run": False,
                  "budget_min": 9.0, "elapsed_s": 300.0, "tune_trials": 8, "storage": "sqlite:///x/tuning.db"},
        "out": str(tmp_path), "stop": None,
        "env": {"gpu": {"name": "NVIDIA H200", "driver": "580.159.04", "compute_cap": "9.0", "arch": "sm_90",
                        "sm_clock": "1980 MHz", "sm_clock_max": "1980 MHz"}, "target": "sm_90", "cuda": "13.0",
                "tree": "abc", "versions": {"onnx_gtco": "0.1.0", "onnxruntime": "1.31.1", "torch": "2.11.0"}},
        "steps": [{"name": "env", "status": "ok", "reason": "", "seconds": 1.0, "detail": {"target": "sm_90"}}],
        "rows": [rec, rows.record(row("core/bert-base.b1")) | {"status": "skipped", "reason": "budget: 10 s"}]}
    md = render.render_markdown(summary)
    assert ("- GPU: NVIDIA H200 (sm_90, onnx-gtco target sm_90), driver 580.159.04, SM clock 1980 MHz of 1980 MHz"
            in md)
    assert "- Command: `tools/gpu_suite --rows core/*`" in md and "Dry run" not in md
    assert "| vit-b16.b1 | ok | 2.000 g | 2.500 g (0.80× g) | failed | 0.500 |" in md
    assert "- ort-transformers-fp16 failed (core/vit-b16.b1): no fusion matched" in md
    assert "- core/bert-base.b1: skipped: budget: 10 s" in md
    assert "Not in this run's plan." in md
    table = render.short_table(summary).splitlines()
    assert table[1].split()[:4] == ["core/vit-b16.b1", "ok", "2.000", "ort-fp16"]


def test_export_leaves_the_summary_and_an_archive_of_every_log_after_each_row(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import tarfile

    out, export = tmp_path / "out", tmp_path / "export"
    seen: list[set[str]] = []

    def fake_row(ctx, r, deadline):
        if export.exists():  # what a call killed now would bring back
            with tarfile.open(export / runner.EXPORT_ARCHIVE) as tar:
                seen.append(set(tar.getnames()))
        (ctx.out / "logs" / f"{r.stem}.log").write_text("ran\n")
        (ctx.out / "models").mkdir(exist_ok=True)
        (ctx.out / "models" / f"{r.stem}.gtco.onnx").write_bytes(b"model")  # never exported
        return rows.record(r)

    monkeypatch.setattr(runner, "run_row", fake_row)
    assert suite.main(["--dry-run", "--out", str(out), "--skip", "smoke", "--rows", "core/*", "--export",
                       str(export)]) == 0
    assert sorted(p.name for p in export.iterdir()) == ["benchmarks.md", runner.EXPORT_ARCHIVE, "summary.json"]
    assert json.loads((export / "summary.json").read_text())["rows"][-1]["id"] == "core/bert-base.b1"
    with tarfile.open(export / runner.EXPORT_ARCHIVE) as tar:
        names = set(tar.getnames())
    assert {"logs/core-vit-b16.b1.log", "logs/core-bert-base.b1.log", "summary.json"} <= names
    assert not any(n.endswith(".onnx") for n in names)
    assert "logs/core-vit-b16.b1.log" in seen[1] and "logs/core-vit-b16.b64.log" not in seen[1]


# ------------------------------------------------------------------------------------------------------ calibration


def _calibrate() -> ModuleType:
    import calibrate

    return calibrate


H200_PROV = {"gpu": "NVIDIA H200", "driver": "580.159.04", "cuda": "13.0", "commit": "abc1234", "date": "2026-12-08",
             "run": "calib-test"}


def _chain_report(layers: int = 64, pdl_nodes: int | None = None) -> dict:
    """What `onnx-gtco inspect --json` (and optimize, with its library) reports of tools/calibrate.py's chain."""
    group = {"family": "layernorm", "attrs": {"hidden": 768, "residual": False, "affine": True, "epsilon": 1e-6},
             "kernel": {"instance": "layernorm_sm90_f16_h768_t64_v8_r2",
                        "config": {"THREADS": 64, "VEC": 8, "ROWS": 2}}}
    report = {"precision": "fp16", "groups": [{**group, "name": f"gtco/layernorm/ln{i}"} for i in range(layers)],
              "launches": {"ours": layers, "after_ours": layers - 1}}
    if pdl_nodes is not None:
        report["library"] = {"pdl": {f"ln{i}": ["sm_90"] for i in range(pdl_nodes)},
                             "kernels": [{"instance": "layernorm_sm90_f16_h768_t64_v8_r2", "arch": "sm_90"}]}
    return report


def test_the_calibration_cases_measure_what_the_estimate_was_never_fitted_to() -> None:
    """The row's case list, without a GPU or nvcc: the small-M curve (mma 64x64 and 128x64 at split-K 1-8 where
    the family's check passes, our cuBLASLt instance, CUTLASS at M 197 capped at two instances, the rest listed as
    cut), GEMM + LayerNorm fused against the pair the build would pick, the patch embedding as conv and as patchify,
    the most-wanted cases first."""
    from onnx_gtco.calibration import hardware
    from onnx_gtco.families.gemm import cutlass
    from onnx_gtco.kernels.select import select_instance

    cal = _calibrate()
    plan_ = cal.build_plan("h200")
    cases = plan_.cases
    curve = [c for c in cases if c.part == "gemm-curve"]
    problems = {(c.problem.size("M"), c.problem.size("N"), c.problem.size("K"), bool(c.problem.flag("residual")))
                for c in curve}
    assert problems == {(m, n, k, res) for m in (128, 197) for n, k in ((768, 768), (2304, 768), (3072, 768),
                                                                       (768, 3072)) for res in (False, n == 768)}
    assert all(c.problem.dtype == "f16" and c.problem.flag("bias") for c in curve)
    mma = [c for c in curve if c.impl == "mma"]
    assert len(mma) == len(problems) * 8 and {c.config["SPLITK"] for c in mma} == {1, 2, 4, 8}
    assert {(c.config["BM"], c.config["BN"], c.config["STAGES"]) for c in mma} == {(64, 64, 4), (128, 64, 4)}
    lt = [c for c in curve if c.impl == "cublaslt"]
    assert len(lt) == len(problems) and all(c.config == {"impl": "cublaslt", "RANK": 0} for c in lt)
    cut = [c for c in curve if c.impl == "cutlass"]
    if isinstance(cutlass.include_dirs(), str):
        assert not cut and any("CUTLASS" in x["case"] for x in plan_.cut)
    else:
        assert len({c.instance.name for c in cut}) == 2 and all(c.arch == "sm_90a" for c in cut)
        assert {c.problem.size("M") for c in cut} == {197} and not any(c.problem.flag("residual") for c in cut)
        assert {(c.config["TILE_M"], c.config["SCHEDULE"]) for c in cut} == {(128, "cooperative"), (64, "pingpong")}
        assert sum("at most 2 CUTLASS instances" in x["why"] for x in plan_.cut) == 4  # bias + residual, cut
        assert not any(c.impl == "cutlass" for c in cal.build_plan("h200", max_cutlass=0).cases)
    # the most wanted first: our cuBLASLt instances, the fused pair, the patch embedding; CUTLASS, then the curve
    parts = [(c.part, c.impl) for c in cases]
    assert parts[0] == ("gemm-curve", "cublaslt") and parts.index(("gemm-curve", "mma")) > max(
        i for i, (p, _) in enumerate(parts) if p in ("gemm-layernorm", "patch-embed"))
    assert all(parts.index(("gemm-curve", "mma")) > i for i, (_, impl) in enumerate(parts) if impl == "cutlass")
    assert [c.problem.size("M") for c in mma] == sorted((c.problem.size("M") for c in mma), reverse=True)
    hw = hardware("h200")
    ln = [c for c in cases if c.part == "gemm-layernorm"]
    assert {(c.problem.size("M") if c.problem.family == "gemm" else c.problem.size("rows")) for c in ln} == {197, 12608}
    for fused in (c for c in ln if c.role == "fused"):
        assert fused.problem.flag("layernorm") and fused.problem.flag("residual") and fused.config.get("SPLITK", 1) == 1
        assert select_instance(fused.problem, "sm_90", hw=hw).name == fused.instance.name  # the build's pick
    assert len(plan_.comparisons) == 6 and all(len(x.fused) == 1 for x in plan_.comparisons)
    patch = [c for c in cases if c.part == "patch-embed"]
    assert {(c.batch, c.role) for c in patch} == {(b, r) for b in (1, 64) for r in ("conv", "copy", "gemm")}
    for conv in (c for c in patch if c.role == "conv"):
        assert conv.instance.name == select_instance(conv.problem, "sm_90", hw=hw).name
    for copy in (c for c in patch if c.role == "copy"):  # families.conv.patchify's copy: x [N, 3, 224, 224] as patches
        layout = copy.problem.flag("layouts")[0]
        assert copy.problem.flag("inputs")[0][0] == (copy.batch, 196, 768) and not copy.problem.flag("program")
        assert math.prod(layout[0]) == copy.batch * 3 * 224 * 224
    assert {c.config.get("impl", "mma") for c in patch if c.role == "gemm"} == {"mma", "cublaslt"}
    assert len({c.key for c in cases}) < len(cases)  # the pair's GEMM at M 197 is the curve's: timed once
    with pytest.raises(GtcoError, match="unknown target"):
        cal.build_plan("h300")


def test_the_records_writer_writes_what_the_fit_reads_and_predicts(tmp_path: Path) -> None:
    """records_doc over a few timed cases, a failed one and the chain: every record ours (side gtco, cuBLASLt
    included, no proxy) with its GPU, driver, CUDA, commit and date; a measurement shared by two parts recorded
    once; the chain's kernel counted per node and its two model records, which fit.predict_model can price."""
    from onnx_gtco.calibration import hardware
    from onnx_gtco.tune import fit

    cal = _calibrate()
    plan_ = cal.build_plan("h200", max_cutlass=0)
    chain = cal.chain_cases(_chain_report(), "h200")
    assert len(chain) == 1 and chain[0].count == 64 and chain[0].problem.size("rows") == 197
    unfused = _chain_report(2)
    del unfused["groups"][1]["kernel"]
    with pytest.raises(GtcoError, match="ln1 has no device kernel"):
        cal.chain_cases(unfused, "h200")
    wanted = [next(c for c in plan_.cases if c.part == p and c.impl == impl) for p, impl in
              (("gemm-curve", "cublaslt"), ("gemm-curve", "mma"), ("gemm-layernorm", "mma"),
               ("gemm-layernorm", "layernorm"), ("patch-embed", "conv"), ("patch-embed", "elementwise"))]
    shared = next(c for c in plan_.cases if c.part == "gemm-layernorm" and c.role == "gemm"
                  and c.problem.size("M") == 197)
    twin = next(c for c in plan_.cases if c.part == "gemm-curve" and c.key == shared.key)  # the curve's own case
    failed = next(c for c in plan_.cases if c.part == "gemm-curve" and c.impl == "mma" and c not in wanted)
    cases = [*wanted, twin, shared, failed, *chain]
    results = {c.key: {"us": 10.0 + i, "spread_us": 0.2} for i, c in enumerate(cases)}
    results[failed.key] = {"us": None, "error": "wrong_answer: y: relative error 0.5"}
    runs = {"kernels": [{"key": chain[0].key, "count": 64}],
            "off": {"measured_ms": 0.9, "launches": 66, "pdl_launches": 0, "unrecorded_kernel_us": 3.0},
            "on": {"measured_ms": 0.8, "launches": 66, "pdl_launches": 63, "unrecorded_kernel_us": 3.0}}
    prov = cal.provenance(H200_PROV, False, "h200")
    doc = cal.records_doc("h200", prov, cases, results, runs, stand_in=False)
    path = tmp_path / "records.json"
    cal.write_json(path, doc)
    recs = fit.load_records([path])
    assert recs.gpu == "NVIDIA H200" and recs.target == "h200"
    singles = [k for k in doc["kernels"] if k["calls"] == 1]
    assert len(singles) == len(set(results)) - 1  # one per measurement, none for the failed case
    assert [k["part"] for k in singles if k["case"] == shared.key] == ["gemm-curve"]  # shared: recorded once
    assert {(k.family, str(k.config.get("impl", "mma"))) for k in recs.kernels} >= {
        ("gemm", "mma"), ("gemm", "cublaslt"), ("layernorm", "mma"), ("conv", "mma"), ("elementwise", "mma")}
    assert all(k.side == "gtco" and k.proxy is None and k.run == "calib-test" for k in recs.kernels)
    for k in doc["kernels"]:
        assert {"gpu", "driver", "cuda", "commit", "date"} <= set(k) and k["date"] == "2026-12-08"
    counted = next(k for k in recs.kernels if k.model == cal.CHAIN_MODEL)
    assert counted.calls == 64 and counted.us_per_forward == pytest.approx(64 * results[chain[0].key]["us"])
    assert sorted((m.pdl_launches, m.launches) for m in recs.models) == [(0, 66), (63, 66)]
    hw = hardware("h200")
    for m in recs.models:  # its kernels' records (same run, model and batch) and a gap per launch
        assert fit.predict_model(m, recs.kernels, hw) > fit.predict_kernel(counted, hw)
    assert doc["tells"] == ["elementwise.extra_us"] and recs.tells == ("elementwise.extra_us",)
    # without the chain's kernel timed, no model record (the fit could not price it)
    results.pop(chain[0].key)
    assert not cal.records_doc("h200", prov, cases, results, runs, stand_in=False)["models"]
    stand_in = cal.records_doc("sm_90", cal.provenance({}, True, "sm_90"), cases[:1], results, {}, stand_in=True)
    assert stand_in["stand_in"] and stand_in["gpu"].startswith("stand-in for sm_90")


def test_a_chain_bench_is_a_model_run_and_says_the_gap_and_what_pdl_hides() -> None:
    cal = _calibrate()
    launches = cal.chain_launches(_chain_report(pdl_nodes=63), "sm_90")
    assert launches == {"launches": 64, "after_ours": 63, "pdl_nodes": 63}
    profile = {"calls_per_run": 66.0, "kernel_us_per_run": 150.0,
               "top": [{"kernel": "void gtco::layernorm_kernel<__half, 768>(...)", "us_per_run": 146.0},
                       {"kernel": "void onnxruntime::cuda::_UnaryElementWise<...Cast...>", "us_per_run": 4.0}]}
    bench = {"batches": [{"batch": 1, "variants": [
        {"name": "ort-fp16", "status": "ok", "median_ms": 0.41, "cuda_graph": True},
        {"name": "gtco", "status": "ok", "median_ms": 0.25, "cuda_graph": True, "profile": profile}]}]}
    on = cal.bench_run(bench, True, launches)
    assert on == {"measured_ms": 0.25, "launches": 66, "pdl_launches": 63, "unrecorded_kernel_us": 4.0,
                  "profiled_kernel_us": 150.0, "ort_fp16_ms": 0.41}
    off = cal.bench_run(bench, False, launches)
    assert off["pdl_launches"] == 0 and off["launches"] == 66
    no_graph = json.loads(json.dumps(bench))
    no_graph["batches"][0]["variants"][1]["cuda_graph"] = False
    assert cal.bench_run(no_graph, True, launches)["measured_ms"] is None
    chain = {"off": {**off, "measured_ms": 0.30}, "on": on}
    got = cal.chain_summary(chain, kernel_us=140.0)
    assert got["gap_us_per_launch"] == pytest.approx((300.0 - 140.0 - 4.0) / 66, abs=1e-3)
    assert got["pdl_hides_us"] == pytest.approx(50.0 / 63, abs=1e-3)
    assert cal.chain_summary({"off": {}}, 140.0)["gap_us_per_launch"] is None


def test_measuring_goes_past_a_failed_case_benches_the_chain_before_the_mma_curve_and_cuts_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path of `calibrate.py measure` with the GPU faked: every instance built (CUTLASS first), each case
    timed in plan order; a build that fails and a wrong answer are recorded and the rest go on; the chain's benches
    run once its kernel is timed and its optimize is done, before the mma curve; when the time budget is spent the
    remaining cases are cut with that reason; the records written load."""
    from onnx_gtco.tune import fit
    from onnx_gtco.tune import gpu as gpu_mod
    from onnx_gtco.tune.search import Measurement

    cal = _calibrate()
    built: list[str] = []
    events: list[str] = []

    def fake_build(instance):
        built.append(instance.name)
        if instance.name == "cublaslt_sm90_f16_r0_bias":  # a slow build: the cases behind it do not wait for it
            time.sleep(0.5)
        return "compile: nvcc said no" if "128x64x32" in instance.name and "sk8" in instance.name else tmp_path

    class FakeMeasurer:
        device = "NVIDIA H200 sm_90"

        def __init__(self, **kw):
            assert kw["queued"] and kw["isolate"]

        def run(self, task, config, artifact):
            p = task.problem
            curve = p.family == "gemm" and p.size("M") in (128, 197) and not p.flag("layernorm")
            events.append(f"case {p.family} {config.get('impl', 'mma')}" + (" curve" if curve else "")
                          + (" res" if p.flag("residual") else ""))
            n = len(events)
            if n == 3:
                return Measurement(None, error_kind="wrong_answer", detail="y: relative error 0.5")
            if n >= 60 and "case gemm cublaslt curve" in events:  # the time budget runs out here
                run.deadline = time.monotonic() - 1.0
            return Measurement(5.0 + n / 10, 0.1, runs=30)

        def close(self):
            events.append("closed")

    def fake_bench(self, pdl, optimized):
        events.append(f"bench pdl {'on' if pdl else 'off'}")
        assert optimized.result().returncode == 0
        self.chain["on" if pdl else "off"] = cal.bench_run(
            {"batches": [{"variants": [{"name": "gtco", "status": "ok", "median_ms": 0.3 - 0.05 * pdl,
                                        "cuda_graph": True}]}]}, pdl, self.chain["plan"])

    monkeypatch.setattr(cal, "_build", fake_build)
    monkeypatch.setattr(gpu_mod, "GpuMeasurer", FakeMeasurer)
    monkeypatch.setattr(cal.Run, "optimize_chain", lambda self: subprocess.CompletedProcess([], 0, "", ""))
    monkeypatch.setattr(cal.Run, "bench_chain", fake_bench)
    monkeypatch.setattr(cal, "clock_probe", lambda left: {"skipped": "faked"})
    args = cal.parse_args(["measure", "--target", "h200", "--out", str(tmp_path / "calib"), "--time-budget-s", "300",
                           "--provenance", json.dumps(H200_PROV), "--jobs", "2"])
    run = cal.Run(args)
    run.add_chain(_chain_report())
    run.measure_all()
    run.save()
    kinds = [c.impl for c in run.plan.cases]
    if "cutlass" in kinds:  # built first: they take longest
        assert all("cutlass" in b for b in built[:2])
    assert events[0] == "case gemm cublaslt curve res"  # the first case's build was slow: the next went first
    first_mma = next(i for i, e in enumerate(events) if e.startswith("case gemm mma curve"))
    bench = events.index("bench pdl off")
    assert events[bench + 1] == "bench pdl on" and bench < first_mma
    assert events.index("case layernorm mma") < bench and events[-1] == "closed"
    assert "case gemm cublaslt curve" in events  # the slow build's cases, timed once it was done
    measure = json.loads((tmp_path / "calib" / "measure.json").read_text())
    why = {f["why"].split(":")[0] for f in measure["failed"]}
    assert why == {"wrong_answer", "build"}, measure["failed"]
    spent = [x for x in measure["cut"] if "time budget" in x["why"]]
    assert spent and len(events) < len(run.plan.cases) + 3
    assert measure["chain"]["summary"]["pdl_hides_us"] == pytest.approx(50.0 / 63, abs=1e-3)
    recs = fit.load_records([tmp_path / "calib" / "records.json"])
    assert len(recs.kernels) == measure["timed"] and len(recs.models) == 2
    assert measure["provenance"]["gpu_measured"] == "NVIDIA H200 sm_90"


def test_the_clock_probe_samples_before_during_and_after_the_load_and_times_cold_against_sustained(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy and the clock faked: the GEMMs run back to back for CLOCK_LOAD_S between two idle spells, the clock
    is read in each phase, and the GEMM's first launches (cold) are set against its last (sustained)."""
    from types import SimpleNamespace

    cal = _calibrate()
    launches = [0]

    class Event:
        def record(self):
            self.n = launches[0]

        def synchronize(self):
            pass

    def matmul(a, b):
        launches[0] += 1

    def elapsed(s, e):
        return 0.100 if e.n <= 10 else 0.110  # ms: the first ten launches cold, then 10% slower

    array = SimpleNamespace(astype=lambda dtype: "array")
    fake = SimpleNamespace(float16="f16", float32="f32", matmul=matmul,
                           random=SimpleNamespace(standard_normal=lambda shape, dtype: array),
                           cuda=SimpleNamespace(Event=Event, Device=lambda: SimpleNamespace(synchronize=lambda: None),
                                                get_elapsed_time=elapsed))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    start = time.monotonic()

    def read():
        load = launches[0] > 1 and time.monotonic() - start < 0.4
        return {"sm_mhz": 1755.0 if load else 345.0, "power_w": 690.0 if load else 90.0, "reasons": 4.0 * load}

    read.source = "fake"
    monkeypatch.setattr(cal, "_clock_reader", lambda: read)
    monkeypatch.setattr(cal, "CLOCK_LOAD_S", 0.2)
    monkeypatch.setattr(cal, "CLOCK_IDLE_S", 0.1)
    got = cal.clock_probe(60.0)
    assert got["source"] == "fake" and got["launches"] % 50 == 0 and got["launches"] >= 50
    assert got["cold_us"] == pytest.approx(100.0) and got["sustained_us"] == pytest.approx(110.0)
    assert got["sustained_over_cold"] == pytest.approx(1.1)
    assert got["before"]["sm_mhz_median"] == 345.0 and got["load"]["sm_mhz_max"] == 1755.0
    assert got["load"]["clock_event_reasons"] == ["0x4"] and got["after"]["samples"] >= 1
    assert "skipped" in cal.clock_probe(1.0)  # no time left for it


def test_the_calibration_row_refits_into_out_and_a_failed_fit_keeps_the_shipped_calibration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row's commands: the measurement with the machine's provenance and a share of the row's time, the fit of
    the shipped H200 records beside the new ones (an H200's), its backtest, the comparison; the refit's folder goes
    into every later command's environment and the row's sets_env. A fit that fails fails the row, says that the
    shipped calibration stays in force, and sets nothing."""
    from suite import calibration as calib_mod

    ctx = ctx_for(tmp_path, target="h200")
    ctx.logs.mkdir(parents=True)
    ctx.machine = {"gpu": {"name": "NVIDIA H200", "driver": "580.159.04"}, "cuda": "13.0", "tree": "abc1234",
                   "versions": {"onnxruntime": "1.31.1"}}
    seen: dict[str, list[str]] = {}
    fit_ok = [True]

    def fake_run(name, cmd, *, env, timeout_s, log, cwd=ROOT):
        what = name.split(": ")[-1]
        seen[what] = list(cmd)
        assert calib_mod.ENV not in env  # measured and fitted against the shipped calibration
        d = tmp_path / "calibration"
        if what == "measure":
            assert timeout_s <= 150 and float(cmd[cmd.index("--time-budget-s") + 1]) < timeout_s
            (d / "records.json").write_text(json.dumps({"format": 1, "gpu": "NVIDIA H200", "target": "h200",
                                                        "kernels": [], "models": []}))
            (d / "measure.json").write_text(json.dumps({"target": "h200", "timed": 3, "models": 2, "counts": {},
                                                        "cut": [], "failed": []}))
        if what == "fit" and fit_ok[0]:
            (d / "h200.json").write_text("{}")
        if what == "compare":
            (d / "compare.json").write_text(json.dumps({"error": {}, "kernels": [], "models": []}))
        if what == "backtest":
            return Step(name, "failed", "exit 1: the backtest broke", 1.0)
        ok = what != "fit" or fit_ok[0]
        return Step(name, "ok" if ok else "failed", "" if ok else "exit 1: scipy.optimize did not converge", 1.0)

    monkeypatch.setattr(rows, "run_command", fake_run)
    rec = rows.run_row(ctx, row("calibration/refit"), time.monotonic() + 1000)
    assert rec["status"] == "ok", rec  # a broken backtest is said, the refit stands
    assert rec["reason"] == "backtest: exit 1: the backtest broke (the refit is in force all the same)"
    measure, fit_cmd = seen["measure"], seen["fit"]
    prov = json.loads(measure[measure.index("--provenance") + 1])
    assert prov["gpu"] == "NVIDIA H200" and prov["commit"] == "abc1234" and prov["cuda"] == "13.0"
    assert measure[measure.index("--target") + 1] == "h200" and "--stand-in" not in measure
    shipped = sorted(str(p) for p in calib_mod.SHIPPED_RECORDS.glob("*.json"))
    assert fit_cmd[3:5] == ["calibration", "fit"] and fit_cmd[5:-3] == shipped
    assert fit_cmd[-3:] == [str(tmp_path / "calibration" / "records.json"), "-o",
                            str(tmp_path / "calibration" / "h200.json")]
    assert "--refit" in seen["compare"] and "backtest" in seen["backtest"]
    assert rec["sets_env"] == {calib_mod.ENV: str(tmp_path / "calibration")} == {
        calib_mod.ENV: ctx.env[calib_mod.ENV]}
    assert rec["calibration"]["in_force"] == "refit"
    # a fit that fails: the shipped calibration stays, the row says so
    fit_ok[0] = False
    ctx2 = ctx_for(tmp_path, target="h200")
    ctx2.machine = ctx.machine
    seen.clear()
    rec = rows.run_row(ctx2, row("calibration/refit"), time.monotonic() + 1000)
    assert rec["status"] == "failed" and "shipped calibration stays in force" in rec["reason"]
    assert "scipy.optimize" in rec["reason"] and "sets_env" not in rec and calib_mod.ENV not in ctx2.env
    assert "backtest" not in seen and "--refit" not in seen["compare"]
    assert rec["calibration"]["in_force"].startswith("shipped (the fit failed")
    # records of another GPU are fitted alone (a fit takes one GPU)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "target": "h100"}))
    assert calib_mod.fit_inputs(other) == ([other], "this run's records alone (no shipped record measured a NVIDIA "
                                                    "H100 80GB HBM3 for h100)")


def test_a_resumed_run_plans_with_the_refit_its_calibration_row_made(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    seen: list[tuple[str, str | None]] = []

    def fake_row(ctx, r, deadline):
        seen.append((r.id, ctx.env.get("GTCO_CALIBRATION_DIR")))
        if r.kind == "calibration":
            rec = rows.record(r) | {"sets_env": {"GTCO_CALIBRATION_DIR": str(out / "calibration")}}
            ctx.env.update(rec["sets_env"])
            return rec
        cut = r.id == "core/vit-b16.b64" and not (out / "cut").exists()
        if cut:
            (out / "cut").touch()
        return rows.record(r) | {"status": "failed" if cut else "ok", "reason": "timed out" if cut else ""}

    monkeypatch.setattr(runner, "run_row", fake_row)
    monkeypatch.delenv("GTCO_CALIBRATION_DIR", raising=False)
    skip = ["--skip", "smoke", "--rows", "calibration/*,core/vit-b16*"]
    assert suite.main(["--dry-run", "--out", str(out), *skip]) == 1
    refit = str(out / "calibration")
    assert seen == [("calibration/refit", None), ("core/vit-b16.b1", refit), ("core/vit-b16.b64", refit)]
    seen.clear()
    assert suite.main(["--dry-run", "--out", str(out), "--resume", *skip]) == 0
    assert seen == [("core/vit-b16.b64", refit)]  # the kept row's refit, restored


def test_the_preflight_names_scipy_for_the_calibration_rows_fit() -> None:
    gpu = preflight.needs_for(False, "h200", sql_storage=False, calibration=True)
    assert "scipy" in gpu.modules and "pynvml" in gpu.optional_modules
    assert "scipy" not in preflight.needs_for(True, "sm_90", sql_storage=False).modules
    step = preflight.preflight(preflight.Needs(("gtco_not_scipy",), why={"gtco_not_scipy": "the row's fit"}),
                               steps_env())
    assert step.status == "failed"
    assert step.reason == "Python package gtco_not_scipy is not importable (the row's fit)"


def test_the_calibration_section_shows_each_measurement_beside_both_calibrations_the_gap_and_the_clock() -> None:
    from suite import calibration as calib_mod

    measure = {"target": "h200", "timed": 2, "models": 2, "cases": 3, "seconds": 97.0,
               "counts": {"gemm cublaslt": 1, "layernorm": 1}, "tells": ["gemm.cutlass.extra_us"],
               "cut": [{"case": "gemm 197x768x768 bias+res: CUTLASS", "why": "at most 2 CUTLASS instances"}],
               "failed": [{"case": "gemm 128x768x768 bias: mma", "why": "wrong_answer: y off"}],
               "provenance": {"gpu": "NVIDIA H200"},
               "chain": {"layers": 64, "rows": 197, "summary": {"kernel_us": 140.0, "gap_us_per_launch": 2.36,
                                                                "pdl_hides_us": 0.79},
                         "off": {"measured_ms": 0.3, "launches": 66, "ort_fp16_ms": 0.41},
                         "on": {"measured_ms": 0.25, "launches": 66, "pdl_launches": 63}},
               "clock": {"gemm": "cuBLAS (CuPy) fp16 12608x3072x768", "launches": 18000, "cold_us": 101.0,
                         "sustained_us": 108.0, "sustained_over_cold": 1.069, "source": "pynvml",
                         "before": {"sm_mhz_median": 345.0, "sm_mhz_min": 345.0, "sm_mhz_max": 1980.0,
                                    "power_w_median": 90.0},
                         "load": {"sm_mhz_median": 1755.0, "sm_mhz_min": 1650.0, "sm_mhz_max": 1980.0,
                                  "power_w_median": 690.0, "clock_event_reasons": ["0x4"]}},
               "comparisons": [{"what": "GEMM + LayerNorm M197 K768: fused / pair", "fused_us": 9.0, "split_us": 7.5,
                                "ratio": 1.2}]}
    compare = {"error": {"shipped": {"gtco": {"rows": 2, "worst_ratio": 1.6, "rms_log": 0.4}},
                         "refit": {"gtco": {"rows": 2, "worst_ratio": 1.05, "rms_log": 0.03}}},
               "refit_fit": {"records": ["h200-2026-11-28.json", "records.json"], "at_bound": [],
                             "error": {"gtco": {"rows": 46, "worst_ratio": 0.9, "rms_log": 0.05}}},
               "constants": {"launch.graph_gap_us": {"shipped": 1.14, "refit": 2.3, "fitted": True},
                             "rowwise.pass_us": {"shipped": 1.0, "refit": 1.005, "fitted": True}},
               "kernels": [{"part": "gemm-curve", "kernel": "gemm 197x768x768 bias: cuBLASLt rank 0 (ours)",
                            "impl": "cublaslt", "calls": 1, "measured_us": 5.0, "shipped_us": 8.0, "refit_us": 5.1}],
               "models": [{"model": "ln-chain64", "pdl": True, "launches": 66, "pdl_launches": 63,
                           "measured_us": 250.0, "shipped_us": 230.0, "refit_us": 249.0}]}
    rec = rows.record(row("calibration/refit")) | {
        "calibration": calib_mod.summary(measure, compare, "/out/calibration/h200.json")}
    assert set(rec["calibration"]["constants"]) == {"launch.graph_gap_us"}  # rowwise.pass_us barely moved
    md = "\n".join(calib_mod.render(rec))
    for want in ("In force for the rest of the run: the refit `h200.json`", "1 gemm cublaslt, 1 layernorm",
                 "- gemm 197x768x768 bias+res: CUTLASS: at most 2 CUTLASS instances", "wrong_answer: y off",
                 "300.0 µs per forward without PDL, 250.0 µs with it (63 launches after one of ours)",
                 "Gap per launch: 2.36 µs; PDL hides 0.79 µs", "| launch.graph_gap_us | 1.14 | 2.3 | yes |",
                 "median 101.0 µs cold, 108.0 µs sustained", "load 1755 MHz (min 1650, max 1980, 690 W, reasons 0x4)",
                 "| GEMM + LayerNorm M197 K768: fused / pair | 9.0 | 7.5 | 1.20 |",
                 "| gtco | 2 rows, furthest 1.600x, rms log 0.400 | 2 rows, furthest 1.050x, rms log 0.030 |",
                 "| gemm-curve | gemm 197x768x768 bias: cuBLASLt rank 0 (ours) | 1 | 5.0 | 8.0 (1.60) | 5.1 (1.02) |",
                 "| model | ln-chain64, PDL on (66 launches, 63 with PDL) | 1 | 250.0 | 230.0 (0.92) | 249.0 (1.00) |"):
        assert want in md, want
    summary = {"suite": {"command": "c", "date": "2026-12-08 10:00 UTC", "dry_run": False, "budget_min": 9.0,
                         "elapsed_s": 1.0, "tune_trials": 8, "storage": "s"}, "env": {}, "steps": [], "rows": [rec]}
    full = render.render_markdown(summary)
    assert full.index("### Calibration") < full.index("### Kernels vs cuBLASLt")
    failed = rows.record(row("calibration/refit")) | {"status": "failed", "reason": "measure: exit 1"}
    assert "Not run: failed: measure: exit 1" in "\n".join(calib_mod.render(failed))
