"""tools/gpu_suite: its dry run writes every file with every model and step accounted for, the budget is split and
enforced, and the install step installs only what is not importable yet."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from onnx_gtco.errors import GtcoError

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_suite"


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


# ------------------------------------------------------------------------------------------------------ budget


def test_budget_shares_follow_the_weights_and_never_go_negative() -> None:
    assert suite.budget_shares(100.0, [3.0, 1.0, 1.0]) == pytest.approx([60.0, 20.0, 20.0])
    assert sum(suite.budget_shares(7.5, [1.5, 2.0, 1.0, 1.0])) == pytest.approx(7.5)
    assert suite.budget_shares(-5.0, [1.0, 2.0]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        suite.budget_shares(10.0, [1.0, 0.0])
    with pytest.raises(ValueError):
        suite.budget_shares(10.0, [])


def test_budget_gives_unused_time_to_the_later_models_and_names_the_spent_budget() -> None:
    now = [0.0]
    budget = suite.Budget(2.0, clock=lambda: now[0])  # 120 s
    weights = [2.0, 1.0, 1.0]
    assert budget.model_share_s(weights) == pytest.approx(60.0)
    now[0] = 20.0  # the first model used 20 of its 60 s: the other two share the 100 s left
    assert budget.model_share_s(weights[1:]) == pytest.approx(50.0)
    assert budget.skip_reason(15.0) is None
    now[0] = 110.0
    reason = budget.skip_reason(15.0)
    assert reason is not None and reason.startswith("budget:") and "1.8 of 2.0 min" in reason
    now[0] = 500.0
    assert budget.left_s() == 0.0 and budget.model_share_s([1.0]) == 0.0


def test_models_after_the_budget_are_listed_skipped_with_the_reason(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = suite.main(["--dry-run", "--out", str(out), "--budget-min", "0.001",
                       "--skip", "plugin,gpu-tests,kernel-bench"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [m["name"] for m in summary["models"]] == [m.name for m in suite.DRY_RUN_MODELS]
    for m in summary["models"]:
        assert m["status"] == "skipped" and m["reason"].startswith("budget:")
        assert [r["batch"] for r in m["results"]] == m["batches"]
        assert all(r["status"] == "skipped" and r["reason"].startswith("budget:") for r in m["results"])
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["install"]["status"] == "skipped" and steps["install"]["reason"].startswith("budget:")
    assert steps["plugin"]["reason"] == "--skip"
    md = (out / "benchmarks.md").read_text()
    assert "| vit-tiny (for vit-b16) | 2 | skipped: budget:" in md
    assert "- bert-tiny: skipped: budget:" in md
    assert "bert-tiny" in capsys.readouterr().out.splitlines()[-3]


def test_resume_keeps_what_finished_and_runs_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A run cut off after its first model: --resume keeps its ok steps and model (not run again) and runs the rest,
    and OUT/summary.json and OUT/benchmarks.md hold both."""
    out = tmp_path / "out"
    first, second = (m.name for m in suite.DRY_RUN_MODELS)
    ran: list[str] = []

    def fake_model(ctx, spec, share_s, kept=None):
        ran.append(spec.name)
        assert share_s > 0
        return {"name": spec.name, "label": spec.label, "stands_in_for": spec.stands_in_for,
                "batches": list(spec.batches), "share_s": share_s, "status": "ok" if spec.name == first else "failed",
                "reason": "" if spec.name == first else "cut off", "steps": [],
                "results": [{"batch": b, "status": "ok" if spec.name == first else "failed"} for b in spec.batches]}

    monkeypatch.setattr(suite, "run_model", fake_model)
    monkeypatch.setattr(suite, "run_kernel_bench", lambda ctx, t, reps: suite.Step("kernel-bench", "ok", "", 1.0))
    skip = ["--skip", "install,plugin,gpu-tests"]
    assert suite.main(["--dry-run", "--out", str(out), *skip]) == 1  # the second model failed
    assert ran == [first, second]

    ran.clear()
    monkeypatch.setattr(suite, "run_kernel_bench", lambda *a: pytest.fail("kept step run again"))
    assert suite.main(["--dry-run", "--out", str(out), "--resume", *skip]) == 1
    assert ran == [second]  # the ok model is kept, the failed one runs again
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"]["resumed_from"]
    assert [(m["name"], m["status"], m.get("resumed", False)) for m in summary["models"]] == [
        (first, "ok", True), (second, "failed", False)]
    steps = {st["name"]: st for st in summary["steps"]}
    assert steps["kernel-bench"]["status"] == "ok" and steps["kernel-bench"]["resumed"]
    assert not steps["env"].get("resumed")  # the machine is read again
    md = (out / "benchmarks.md").read_text()
    assert first in md and second in md
    assert "kept from the run of" in capsys.readouterr().out


def test_resume_needs_a_run_of_the_same_kind(tmp_path: Path) -> None:
    assert suite.main(["--dry-run", "--out", str(tmp_path / "none"), "--resume"]) == 2  # nothing to continue
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"suite": {"dry_run": False, "date": "d"}, "steps": [],
                                                  "models": []}))
    assert suite.main(["--dry-run", "--out", str(out), "--resume"]) == 2  # a GPU run's OUT, resumed dry
    (out / "summary.json").write_text("{")
    assert suite.main(["--dry-run", "--out", str(out), "--resume"]) == 2


def test_model_selection_and_bad_arguments(tmp_path: Path) -> None:
    assert [m.name for m in suite.select_models(["bert-base", "vit-b16"], dry_run=False)] == ["bert-base", "vit-b16"]
    assert [m.name for m in suite.select_models(None, dry_run=False)] == [m.name for m in suite.GPU_MODELS]
    with pytest.raises(GtcoError, match="unknown model swin-x"):
        suite.select_models(["swin-x"], dry_run=False)
    with pytest.raises(GtcoError, match="never replaces docs"):
        suite.parse_args(["--dry-run", "--write-docs"])
    with pytest.raises(GtcoError, match="--skip"):
        suite.parse_args(["--skip", "everything"])
    assert suite.main(["--dry-run", "--budget-min", "-1"]) == 2
    assert suite.main(["--dry-run", "--models", "vit-b16", "--out", str(tmp_path / "out")]) == 2  # not a dry-run model
    assert not (tmp_path / "out").exists()
    assert suite.target_for("sm_90") == "sm_90" and suite.target_for("sm_89") == "sm_80"
    assert suite.target_for("sm_100") == "sm_90" and suite.target_for("sm_75") is None


def test_the_gpu_list_holds_the_issues_models_at_their_batches() -> None:
    got = {m.name: m.batches for m in suite.GPU_MODELS}
    assert got == {"vit-b16": (1, 8, 64), "deit-s": (1,), "swin-t": (1,), "setr": (1,), "detr-r50": (1,),
                   "bert-base": (1,)}
    zoo = _zoo()
    for m in suite.GPU_MODELS:  # each has its own torch module: the torch-compile baseline runs on every row
        assert m.zoo in zoo.MODELS and m.builtin is None
    assert zoo.SETR_IMAGE_SIZE == 384


def _zoo() -> ModuleType:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import export_zoo
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return export_zoo


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    step = suite.run_command("slow", cmd, env=dict(os.environ), timeout_s=1.0, log=tmp_path / "slow.log")
    assert step.status == "failed" and step.reason == "timed out after 1 s" and step.seconds < 30
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(50):  # killed: gone, or a zombie until its new parent reaps it
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the step's child process outlived the timeout")
    ok = suite.run_command("fine", ["sh", "-c", "echo one; echo two >&2; exit 3"], env=dict(os.environ),
                           timeout_s=30.0, log=tmp_path / "fine.log")
    assert ok.status == "failed" and ok.reason == "exit 3: two"


def test_a_zoo_model_without_its_dependencies_is_skipped_with_the_reason(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite, "_probe", lambda code, args, env, timeout_s=120.0: ["timm", "onnxscript"])
    ctx = suite.Context(tmp_path, dict(os.environ), suite.Budget(1.0), False, "sm_90", 1, 1, None, tmp_path / "zoo")
    swin = next(m for m in suite.GPU_MODELS if m.name == "swin-t")
    rec = suite.run_model(ctx, swin, 60.0)
    assert rec["status"] == "skipped" and rec["reason"].startswith("swin-t: export: needs timm, onnxscript")
    assert rec["results"] == [{"batch": 1, "status": "skipped", "reason": rec["reason"]}]
    assert not (tmp_path / "zoo").exists()


# ------------------------------------------------------------------------------------------------------ install


def test_already_importable_checks_modules_and_the_cuda_provider_for_onnxruntime_gpu(tmp_path: Path) -> None:
    stdlib = make_wheel(tmp_path, "jsonlike", "json")
    absent = make_wheel(tmp_path, "gtco_absent_pkg", "gtco_absent_pkg", top_level=False)
    ort_gpu = tmp_path / "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    shutil.copy(make_wheel(tmp_path / "o", "onnxruntime_gpu", "onnxruntime"), ort_gpu)
    assert suite.wheel_modules(absent) == ["gtco_absent_pkg"]  # from the archive's layout without top_level.txt
    got = suite.already_importable([stdlib, absent, ort_gpu], steps_env())
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
    joined = suite.collect_wheels([parts], tmp_path / "joined")
    assert [w.name for w in joined] == [name] and joined[0].read_bytes() == data
    assert suite.wheel_dist(joined[0]) == "onnxruntime_gpu"
    (parts / "ort-part2").write_bytes(data[third:2 * third - 1] + b"\x00")
    with pytest.raises(GtcoError, match="sha256"):
        suite.reassemble_ort_parts(parts, tmp_path / "bad")
    assert not list((tmp_path / "bad").iterdir())  # nothing half-written
    (parts / "ort-part3").unlink()
    with pytest.raises(GtcoError, match="missing ort-part3 of 3 parts"):
        suite.reassemble_ort_parts(parts, tmp_path / "bad")


def test_two_versions_of_one_wheel_are_refused(tmp_path: Path) -> None:
    make_wheel(tmp_path, "gtco_twice", "gtco_twice")
    shutil.copy(tmp_path / "gtco_twice-0.1-py3-none-any.whl", tmp_path / "gtco_twice-0.2-py3-none-any.whl")
    with pytest.raises(GtcoError, match="two wheels of gtco_twice"):
        suite.collect_wheels([tmp_path], tmp_path / "joined")


# ------------------------------------------------------------------------------------------------------ report


def test_markdown_lists_variants_that_did_not_run_with_their_reasons(tmp_path: Path) -> None:
    summary = {
        "suite": {"command": "tools/gpu_suite --models vit-b16", "date": "2026-11-23 16:00 UTC", "dry_run": False,
                  "budget_min": 9.0, "elapsed_s": 300.0, "tune_trials": 16, "storage": "sqlite:///x/tuning.db"},
        "out": str(tmp_path),
        "env": {"gpu": {"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "compute_cap": "9.0",
                        "arch": "sm_90"}, "target": "sm_90", "cuda": "13.0", "tree": "abc",
                "versions": {"onnx_gtco": "0.1.0", "onnxruntime": "1.31.1", "torch": "2.11.0"}},
        "steps": [{"name": "env", "status": "ok", "reason": "", "seconds": 1.0, "detail": {"target": "sm_90"}}],
        "models": [{"name": "vit-b16", "stands_in_for": None, "status": "ok", "reason": "", "results": [
            {"batch": 8, "status": "ok", "reason": "", "ours_over": {"ort-fp16": 0.8, "tensorrt": None},
             "roofline": {"floor_ms": 0.5},
             "variants": [{"name": "gtco", "status": "ok", "median_ms": 2.0},
                          {"name": "ort-fp16", "status": "ok", "median_ms": 2.5},
                          {"name": "tensorrt", "status": "skipped", "reason": "tensorrt is not importable"}]}]}],
    }
    md = suite.render_markdown(summary)
    assert "- GPU: NVIDIA H100 80GB HBM3 (sm_90, onnx-gtco target sm_90), driver 580.159.04" in md
    assert "- Command: `tools/gpu_suite --models vit-b16`" in md and "Dry run" not in md
    assert "| vit-b16 | 8 | ok | 2.000 | 2.500 (0.80×) | skipped | 0.500 |" in md
    assert "- tensorrt skipped (vit-b16 b8): tensorrt is not importable" in md
    assert "Not run (see the steps)." in md


# ------------------------------------------------------------------------------------------------------ dry run


@pytest.mark.slow
def test_dry_run_writes_every_file_with_every_model_and_step(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "gtco_suite_probe", "gtco_suite_probe")
    make_wheel(wheels, "jsonlike", "json")
    out = tmp_path / "out"
    argv = ["--dry-run", "--out", str(out), "--wheels", str(wheels), "--budget-min", "15"]
    code = suite.main(argv)
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"]["command"] == "tools/gpu_suite " + " ".join(argv)

    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == list(suite.STEPS)
    assert steps["env"]["status"] == "ok" and summary["env"]["target"] == "sm_90" and summary["env"]["gpu"] is None
    assert summary["env"]["versions"]["onnx_gtco"] and summary["env"]["versions"]["onnxruntime"]
    install = steps["install"]
    assert install["status"] == "ok" and install["detail"]["already_importable"] == ["jsonlike"]
    assert install["detail"]["installed"] == ["gtco_suite_probe-0.1-py3-none-any.whl"]
    assert (out / "site" / "gtco_suite_probe" / "__init__.py").read_text() == "VALUE = 7\n"
    assert steps["plugin"]["status"] == "ok" and Path(steps["plugin"]["detail"]["library"]).is_file()
    tests = steps["gpu-tests"]
    assert tests["status"] == "ok", tests["reason"]  # a collection error anywhere in tests/ fails it
    assert tests["detail"]["tests"] >= 1
    assert tests["detail"]["skipped"] == tests["detail"]["tests"] and (out / "pytest-gpu.xml").is_file()
    kb = steps["kernel-bench"]
    if shutil.which(os.environ.get("NVCC", "nvcc")):
        assert kb["status"] == "ok" and kb["detail"]["compile_only"] and kb["detail"]["built"] == 3
        assert json.loads((out / "kernel-bench" / "results.json").read_text())["results"] == []
    else:
        assert kb["status"] == "skipped" and kb["reason"] == "nvcc not found"

    assert [m["name"] for m in summary["models"]] == ["vit-tiny", "bert-tiny"]
    for m in summary["models"]:
        assert m["status"] == "ok", m
        assert [r["batch"] for r in m["results"]] == m["batches"]
        for r in m["results"]:
            variants = {v["name"]: v for v in r["variants"]}
            assert set(variants) == {"gtco", "ort-fp32", "ort-fp16"}
            assert all(v["status"] == "ok" and v["median_ms"] > 0 for v in variants.values()), variants
            assert r["ours_over"]["ort-fp32"] == pytest.approx(
                variants["gtco"]["median_ms"] / variants["ort-fp32"]["median_ms"])
            assert r["roofline"]["floor_ms"] > 0
            report = json.loads((out / "models" / f"{m['name']}.b{r['batch']}.gtco.onnx.report.json").read_text())
            assert report["tuning"]["trials_per_task"] == 2 and report["tuning"]["measured"] > 0
    assert (out / "tuning.db").stat().st_size > 0

    md = (out / "benchmarks.md").read_text()
    for line in ("- Date: ", "- GPU: none (dry run), onnx-gtco target sm_90", "- CUDA: ", "- Versions: onnx-gtco ",
                 f"- Command: `{summary['suite']['command']}`", "**Dry run**"):
        assert line in md, line
    assert "| model | batch | status | gtco ms | ort-fp32 ms | ort-fp16 ms | floor ms |" in md
    for name, batch in (("vit-tiny (for vit-b16)", 1), ("vit-tiny (for vit-b16)", 2), ("bert-tiny (for bert-base)", 1)):
        assert f"| {name} | {batch} | ok | " in md
    assert code == 0 and summary["suite"]["exit"] == 0
    last = printed.strip().splitlines()
    assert last[-1].startswith("files: ") and last[-2].startswith("steps: env ok | install ok | plugin ok")
    assert [ln.split()[:3] for ln in last[-5:-2]] == [["vit-tiny", "1", "ok"], ["vit-tiny", "2", "ok"],
                                                      ["bert-tiny", "1", "ok"]]


def test_a_gpu_run_optimizes_the_fp32_model_with_precision_fp16(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the suite hands optimize the fp32 model as users export it (the conversion to half is optimize's
    --precision fp16), never a model it converted to fp16 itself; the bench times that same original."""
    commands: dict[str, list[str]] = {}

    def fake_run(name, cmd, **kwargs):
        commands[name] = list(cmd)
        return suite.Step(name, "failed" if name.endswith("bench") else "ok", "stop here", 0.0)

    monkeypatch.setattr(suite, "run_command", fake_run)
    ctx = suite.Context(tmp_path, steps_env(), suite.Budget(10), False, "h100", 2, 1, None, tmp_path / "zoo")
    spec = suite.ModelSpec("vit-b16", "ViT-B/16", batches=(8,), builtin="vit-b16")
    rec = suite.run_model(ctx, spec, 60.0)
    prepare, optimize, bench = (commands[f"vit-b16.b8: {w}"] for w in ("prepare", "optimize", "bench"))
    written = json.loads(prepare[-1])["path"]
    assert optimize[3:5] == ["optimize", written] and bench[3:5] == ["bench", written]
    assert optimize[optimize.index("--precision") + 1] == "fp16" and "--cuda" in optimize
    assert not any("fp16.onnx" in part for cmd in commands.values() for part in cmd)
    assert rec["results"][0]["reason"] == "bench: stop here"


def test_a_zoo_row_exports_at_its_batch_and_benches_torch_compile_of_that_program(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ViT-B/16 at batch 8: the export step asks tools/export_zoo.py for batch 8 with its torch.export program,
    optimize and bench read that export, and the bench's torch-compile baseline gets that program."""
    commands: dict[str, list[str]] = {}

    def fake_run(name, cmd, **kwargs):
        commands[name] = list(cmd)
        return suite.Step(name, "failed" if name.endswith("bench") else "ok", "stop here", 0.0)

    monkeypatch.setattr(suite, "_probe", lambda code, args, env, timeout_s=120.0: [])
    monkeypatch.setattr(suite, "run_command", fake_run)
    ctx = suite.Context(tmp_path, steps_env(), suite.Budget(10), False, "h100", 2, 1, None, tmp_path / "zoo")
    vit = next(m for m in suite.GPU_MODELS if m.name == "vit-b16")
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "vit-b16.b8.pt2").write_bytes(b"program")  # what the export step writes
    suite.run_model(ctx, vit, 60.0)
    export = commands["vit-b16.b8: export"]
    assert export[export.index("--batch") + 1] == "8" and "--programs" in export
    onnx_file = str(tmp_path / "zoo" / "vit-b16.b8.torchscript.onnx")
    assert commands["vit-b16.b8: optimize"][4] == onnx_file == commands["vit-b16.b8: bench"][4]
    bench = commands["vit-b16.b8: bench"]
    assert bench[bench.index("--torch-program") + 1] == str(tmp_path / "zoo" / "vit-b16.b8.pt2")
    assert commands["vit-b16.b1: optimize"][4] == str(tmp_path / "zoo" / "vit-b16.torchscript.onnx")
    assert "--ort-model" not in bench and export[export.index("--exporters") + 1] == "torchscript"


def test_the_bert_row_gives_ort_transformers_the_zoo_ort_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """BERT-base: the export step also writes the zoo's ORT form (the graph ORT's transformer optimizer fuses
    Attention in), and the bench's ort-transformers-fp16 baseline optimizes it with the zoo's optimizer arguments;
    ours and every other baseline keep the zoo's own export. No other row has an ORT form (the zoo has none)."""
    commands: dict[str, list[str]] = {}

    def fake_run(name, cmd, **kwargs):
        commands[name] = list(cmd)
        return suite.Step(name, "failed" if name.endswith("bench") else "ok", "stop here", 0.0)

    monkeypatch.setattr(suite, "_probe", lambda code, args, env, timeout_s=120.0: [])
    monkeypatch.setattr(suite, "run_command", fake_run)
    ctx = suite.Context(tmp_path, steps_env(), suite.Budget(10), False, "h100", 2, 1, None, tmp_path / "zoo")
    bert = next(m for m in suite.GPU_MODELS if m.name == "bert-base")
    zoo = _zoo()
    assert bert.ort_form == zoo.ORT_OPTIMIZER_ARGS["bert-base"]
    assert [m.name for m in suite.GPU_MODELS if m.ort_form] == list(zoo.ORT_MODELS)
    suite.run_model(ctx, bert, 60.0)
    export, bench = commands["bert-base.b1: export"], commands["bert-base.b1: bench"]
    assert export[export.index("--exporters") + 1] == "torchscript,ort"
    assert commands["bert-base.b1: optimize"][4] == str(tmp_path / "zoo" / "bert-base.torchscript.onnx") == bench[4]
    i = bench.index("--ort-model")
    assert bench[i:i + 8] == ["--ort-model", str(tmp_path / "zoo" / "bert-base.ort.onnx"), "--model-type", "bert",
                              "--num-heads", "12", "--hidden-size", "768"]


def test_the_kernel_bench_runs_one_call_per_shape_set_and_merges_them(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the kernel bench is a call of tools/kernel_bench.py per shape set, each under the 10-minute command
    limit with a --time-budget-s inside it; their files are merged into OUT/kernel-bench, and a failed set fails the
    step with its reason while the others' numbers stay."""
    calls: list[tuple[list[str], float]] = []

    def fake_run(name, cmd, *, env, timeout_s, log, cwd=suite.ROOT):
        calls.append((list(cmd), timeout_s))
        kset, out = cmd[cmd.index("--set") + 1], Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        ok = kset != "setr"
        (out / "results.json").write_text(json.dumps({"device": "H100", "built": [f"{kset}_inst"], "results": [
            {"case": f"{kset} row", "all_ok": ok}]}))
        (out / "results.md").write_text(f"| {kset} table |\n")
        return suite.Step(name, "ok" if ok else "failed", "" if ok else "exit 1: wrong", 1.0, str(log))

    monkeypatch.setattr(suite, "run_command", fake_run)
    monkeypatch.setattr(suite.shutil, "which", lambda *a: "/usr/bin/nvcc")
    ctx = suite.Context(tmp_path, {}, suite.Budget(120), False, "sm_90", 2, 1, None, tmp_path / "zoo")
    step = suite.run_kernel_bench(ctx, suite.STEP_TIMEOUT_S["kernel-bench"], 20)
    assert [c[c.index("--set") + 1] for c, _ in calls] == [n for n, _ in suite.KERNEL_BENCH_SETS]
    for cmd, timeout_s in calls:
        assert timeout_s <= suite.KERNEL_BENCH_CALL_S < 600
        assert float(cmd[cmd.index("--time-budget-s") + 1]) < timeout_s
        assert cmd[cmd.index("--arch") + 1] == "sm_90" and cmd[cmd.index("--reps") + 1] == "20"
        assert "--compile-only" not in cmd
    assert step.status == "failed" and step.reason.startswith("1 of 4 cases") and "setr: exit 1: wrong" in step.reason
    assert step.detail["sets"] == {"vit-b16": "ok", "bert-base": "ok", "setr": "failed", "detr": "ok"}
    merged = json.loads((tmp_path / "kernel-bench" / "results.json").read_text())
    assert [r["case"] for r in merged["results"]] == [f"{n} row" for n, _ in suite.KERNEL_BENCH_SETS]
    md = (tmp_path / "kernel-bench" / "results.md").read_text()
    assert "#### vit-b16" in md and "| detr table |" in md and "This call failed: exit 1: wrong." in md

    calls.clear()  # little budget left: one call's time at most, split by weight; a set past it is skipped
    ctx.budget = suite.Budget(1)
    step = suite.run_kernel_bench(ctx, 60.0, None)
    assert sum(t for _, t in calls) <= 60.0 and step.detail["sets"]["detr"] == "skipped"


def test_resume_keeps_each_finished_row_and_runs_only_the_rest(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose first batch finished and whose second was cut off: --resume keeps the finished row as it is
    and runs the model's other batch alone."""
    out = tmp_path / "out"
    calls: list[tuple[str, int, str]] = []

    def fake_command(name, cmd, *, env, timeout_s, log, cwd=suite.ROOT):
        stem, what = name.split(": ")
        model, batch = stem.rsplit(".b", 1)
        calls.append((model, int(batch), what))
        if what == "bench" and model == "vit-tiny" and batch == "2" and not (out / "cut").exists():
            (out / "cut").touch()
            return suite.Step(name, "failed", "timed out after 30 s", 30.0)
        if what == "bench":
            bench = Path(cmd[cmd.index("--out") + 1])
            bench.mkdir(parents=True, exist_ok=True)
            (bench / "bench.json").write_text(json.dumps({"batches": [{"batch": int(batch), "variants": [],
                                                                       "ours_over": {}, "roofline": {}}]}))
        return suite.Step(name, "ok", "", 1.0)

    monkeypatch.setattr(suite, "run_command", fake_command)
    skip = ["--skip", "install,plugin,smoke,gpu-tests,kernel-bench"]
    assert suite.main(["--dry-run", "--out", str(out), *skip]) == 1
    first = [c for c in calls if c[2] == "bench"]
    assert first == [("vit-tiny", 1, "bench"), ("vit-tiny", 2, "bench"), ("bert-tiny", 1, "bench")]
    calls.clear()
    assert suite.main(["--dry-run", "--out", str(out), "--resume", *skip]) == 0
    assert {(m, b) for m, b, _ in calls} == {("vit-tiny", 2)}  # the finished rows are not run again
    summary = json.loads((out / "summary.json").read_text())
    rows = {(m["name"], r["batch"]): r for m in summary["models"] for r in m["results"]}
    assert rows[("vit-tiny", 1)].get("resumed") and rows[("bert-tiny", 1)].get("resumed")
    assert rows[("vit-tiny", 2)]["status"] == "ok" and not rows[("vit-tiny", 2)].get("resumed")
    assert all(m["status"] == "ok" for m in summary["models"])


def test_batches_and_baselines_narrow_the_plan(tmp_path: Path) -> None:
    models = suite.select_models(["vit-b16", "bert-base"], False, suite.parse_batches(["vit-b16=1,64"]))
    assert [(m.name, m.batches) for m in models] == [("vit-b16", (1, 64)), ("bert-base", (1,))]
    for bad in ("vit-b16", "vit-b16=", "vit-b16=0", "vit-b16=1,1", "=1", "vit-b16=x"):
        with pytest.raises(GtcoError, match="--batches"):
            suite.parse_batches([bad])
    with pytest.raises(GtcoError, match="given twice"):
        suite.parse_batches(["vit-b16=1", "vit-b16=8"])
    with pytest.raises(GtcoError, match="unknown model"):
        suite.select_models(None, False, {"resnet": (1,)})
    with pytest.raises(GtcoError, match="not in this run"):
        suite.select_models(["bert-base"], False, {"vit-b16": (1,)})
    assert suite.main(["--out", str(tmp_path / "o"), "--baselines", "ort-fp16,onnx"]) == 2
    assert suite.main(["--out", str(tmp_path / "o"), "--tune-trials", "-1"]) == 2


def test_a_failed_smoke_check_stops_a_gpu_run_with_the_reason_first(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(suite, "gpu_info", lambda: {"name": "NVIDIA H200", "arch": "sm_90", "driver": "580"})
    monkeypatch.setattr(suite, "run_plugin", lambda ctx, t: suite.Step("plugin", "ok", "", 1.0))
    monkeypatch.setattr(suite, "run_smoke", lambda ctx, t: suite.Step(
        "smoke", "failed", "exit 1: logits: max |new - ref| 3.1 > atol", 2.0))
    monkeypatch.setattr(suite, "run_model", lambda *a: pytest.fail("a model ran after a failed smoke check"))
    assert suite.main(["--out", str(out), "--skip", "install", "--models", "bert-base"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop"].startswith("smoke failed") and "max |new - ref|" in summary["stop"]
    assert {st["name"]: st["status"] for st in summary["steps"]}["kernel-bench"] == "skipped"
    assert summary["models"][0]["status"] == "skipped" and "smoke failed" in summary["models"][0]["reason"]
    assert "**Stopped**: smoke failed" in (out / "benchmarks.md").read_text()
