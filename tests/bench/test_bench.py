"""onnx-gtco bench: the CLI end to end on the CPU EP, the statistics, the roofline arithmetic, argument errors."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_gtco import models
from onnx_gtco.bench import BASELINES, roofline, variants
from onnx_gtco.bench.output import format_table
from onnx_gtco.bench.run import BenchOptions, bind_dims, check_ort_model, infer_model_type, ours_over
from onnx_gtco.bench.stats import accuracy, summarize
from onnx_gtco.cli import main
from onnx_gtco.errors import GtcoError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def module_cache() -> Iterator[Path]:
    """Measured peaks go to a cache of this module's, never the user's."""
    with tempfile.TemporaryDirectory(prefix="gtco-bench-cache-") as d, pytest.MonkeyPatch.context() as mp:
        mp.setenv("GTCO_CACHE_DIR", d)
        yield Path(d)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of the test's own."""
    d = tmp_path / "cache"
    monkeypatch.setenv("GTCO_CACHE_DIR", str(d))
    return d


def test_cli_bench_vit_tiny_on_cpu_writes_table_json_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CI acceptance with the real defaults (100 timed runs, 10 warm-up, every baseline) on a one-layer ViT-tiny
    file, so it fits the test budget on a shared CPU; `onnx-gtco bench vit-tiny --provider cpu` runs the same
    path on the built-in twelve layers."""
    src = tmp_path / "vit-tiny.onnx"
    vit = models.build("vit-tiny", batch="N", depth=1)
    onnx.save(vit, str(src))
    out = tmp_path / "out"
    assert main(["bench", str(src), "--provider", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = (out / "bench.md").read_text()
    assert table.strip() in printed and "roofline floor" in table and "speedup" in table

    doc = json.loads((out / "bench.json").read_text())
    assert doc["model"] == str(src) and doc["provider"] == "cpu" and doc["precision"] == "fp32"
    assert doc["device"]["name"] and doc["device"]["onnxruntime"] == ort.__version__
    assert doc["device"]["peaks"]["method"].startswith("numpy fp32 matmul")
    assert doc["command"].startswith(f"onnx-gtco bench {src} --provider cpu --batch 1 --precision fp32")
    [b] = doc["batches"]
    assert b["batch"] == 1
    names = [v["name"] for v in b["variants"]]
    assert names == [*BASELINES, "gtco"]
    by = {v["name"]: v for v in b["variants"]}
    for v in b["variants"]:
        assert v["status"] in ("ok", "skipped", "failed")
        if v["status"] == "ok":
            assert v["runs"] >= 100 and v["runs"] == 100
            assert 0 < v["p10_ms"] <= v["median_ms"] <= v["p90_ms"]
            assert v["cosine"] > 0.999 and v["max_abs_err"] < 0.1, v  # fp16 variants included
        else:
            assert v["reason"] and v["median_ms"] is None, v
    assert by["tensorrt"]["status"] == "skipped" and "GPU" in by["tensorrt"]["reason"]
    for must_run in ("ort-fp32", "gtco"):
        assert by[must_run]["status"] == "ok", by[must_run]
    # the original through IO binding is the reference itself; ours at fp32 within check's default tolerance
    assert by["ort-fp32"]["max_abs_err"] == 0.0
    assert by["gtco"]["max_abs_err"] <= 1e-4 and by["gtco"]["cosine"] > 1 - 1e-6
    assert set(b["ours_over"]) == set(BASELINES)
    for name, ratio in b["ours_over"].items():
        if by[name]["status"] == "ok":
            assert ratio == pytest.approx(by["gtco"]["median_ms"] / by[name]["median_ms"], rel=1e-12)
        else:
            assert ratio is None
    roof = b["roofline"]
    weights = sum(int(np.prod(t.dims)) * 4 for t in vit.graph.initializer)
    assert roof["bytes"] >= weights + 3 * 224 * 224 * 4
    # patch embedding (196 x 768 x 192) + one layer's QKV/proj/MLP GEMMs on 197 tokens + attention, in FLOPs
    gemms = 2 * 196 * 768 * 192 + 2 * 197 * 192 * (3 * 192 + 192 + 2 * 768) + 2 * 2 * 197 * 197 * 192
    assert gemms <= roof["mm_flops"] <= 1.01 * gemms + 2 * 192 * 1000
    assert roof["floor_ms"] == pytest.approx(max(roof["flops"] / (roof["peak_tflops"] * 1e12),
                                                 roof["bytes"] / (roof["peak_gbps"] * 1e9)) * 1e3)
    png = (out / "bench.png").read_bytes()
    assert png.startswith(PNG_MAGIC)
    import matplotlib.image

    assert matplotlib.image.imread(str(out / "bench.png")).shape[:2] == (450, 600)


def test_symbolic_batch_file_binds_each_batch(tmp_path: Path) -> None:
    src = tmp_path / "bert.onnx"
    onnx.save(models.build("bert-tiny", batch="B", depth=1), str(src))
    out = tmp_path / "out"
    assert main(["bench", str(src), "--provider", "cpu", "--batch", "1", "3", "--baselines", "ort-fp32",
                 "--runs", "5", "--warmup", "1", "--quick", "--remeasure-peaks", "--out", str(out)]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["device"]["peaks"]["cached"] is False and doc["command"].endswith("--quick --remeasure-peaks")
    assert [b["batch"] for b in doc["batches"]] == [1, 3]
    assert [[v["name"] for v in b["variants"]] for b in doc["batches"]] == [["ort-fp32", "gtco"]] * 2
    b1, b3 = (b["roofline"] for b in doc["batches"])
    assert b3["flops"] == pytest.approx(3 * b1["flops"])  # every FLOP of an encoder scales with the batch
    assert all(v["status"] == "ok" and v["runs"] == 5 for b in doc["batches"] for v in b["variants"])
    # what ORT's own session optimizations fused is said beside its time (the model has none of these ops)
    for b in doc["batches"]:
        note = next(v["note"] for v in b["variants"] if v["name"] == "ort-fp32")
        assert "ORT session fusions: " in note and "SkipLayerNormalization" in note and "Gelu 1" in note


def test_rewritten_model_is_timed_as_ours_and_a_failing_baseline_is_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "bert.onnx"
    onnx.save(models.build("bert-tiny", batch="B", depth=1), str(src))
    rewritten = tmp_path / "bert.gtco.onnx"
    assert main(["optimize", str(src), "-o", str(rewritten), "--no-build"]) == 0

    def broken(ctx: object) -> None:
        raise RuntimeError("fp16 kernel missing\nsecond line of the trace")

    monkeypatch.setitem(variants._RUNNERS, "ort-fp16", broken)
    out = tmp_path / "out"
    assert main(["bench", str(src), "--rewritten", str(rewritten), "--provider", "cpu", "--batch", "2",
                 "--baselines", "ort-fp16", "ort-fp32", "--runs", "5", "--quick", "--out", str(out)]) == 0
    [b] = json.loads((out / "bench.json").read_text())["batches"]
    by = {v["name"]: v for v in b["variants"]}
    assert list(by) == ["ort-fp32", "ort-fp16", "gtco"]
    assert (by["ort-fp16"]["status"], by["ort-fp16"]["reason"]) == ("failed", "fp16 kernel missing")
    assert by["gtco"]["status"] == "ok" and by["gtco"]["note"] == f"the given rewritten model {rewritten.name}"
    assert by["gtco"]["max_abs_err"] < 1e-4 and by["gtco"]["cosine"] > 1 - 1e-6
    assert b["ours_over"]["ort-fp16"] is None and b["ours_over"]["ort-fp32"] > 0
    assert "- ort-fp16 (failed): fp16 kernel missing" in (out / "bench.md").read_text()


def test_torch_compile_compiles_the_models_torch_program(tmp_path: Path, make_mlp) -> None:
    """--torch-program: the torch-compile baseline compiles the model's own torch.export program (here the mlp's
    torch twin, same weights), and a file that is not a program fails that variant with the reason."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -r requirements-zoo.txt)")
    from onnx import numpy_helper

    model = make_mlp(rows=4)
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, w in weights.items():
                self.register_buffer(name, w)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.w0 + self.b0) @ self.w1 + self.b1

    src, program, bad = tmp_path / "mlp.onnx", tmp_path / "mlp.pt2", tmp_path / "bad.pt2"
    onnx.save(model, str(src))
    torch.export.save(torch.export.export(Mlp().eval(), (torch.zeros(4, 8),)), str(program))
    bad.write_bytes(b"not a torch.export program")
    common = ["bench", str(src), "--provider", "cpu", "--batch", "4", "--baselines", "torch-compile", "--runs", "5",
              "--warmup", "1", "--quick"]
    assert main([*common, "--torch-program", str(program), "--out", str(tmp_path / "ok")]) == 0
    doc = json.loads((tmp_path / "ok" / "bench.json").read_text())
    tc = doc["batches"][0]["variants"][0]
    assert (tc["name"], tc["status"]) == ("torch-compile", "ok"), tc
    assert tc["note"] == "torch.export program mlp.pt2, torch.compile(mode='max-autotune')"
    assert tc["max_abs_err"] < 1e-4 and tc["cosine"] > 1 - 1e-6 and tc["runs"] == 5
    assert doc["command"].endswith(f"--torch-program {program} --quick")
    assert main([*common, "--torch-program", str(bad), "--out", str(tmp_path / "bad")]) == 0
    tc = json.loads((tmp_path / "bad" / "bench.json").read_text())["batches"][0]["variants"][0]
    assert tc["status"] == "failed" and tc["reason"].startswith("torch.export.load(bad.pt2) failed"), tc


@pytest.mark.parametrize(("argv", "message"), [
    (["--baselines", "ort-fp32", "onnxruntime-magic"], "unknown baseline 'onnxruntime-magic'"),
    (["--batch", "0"], "--batch takes sizes >= 1"),
    (["--batch", "2", "2"], "lists a size twice"),
    (["--runs", "10"], "at least 100 timed runs"),
    (["--model-type", "resnet"], "unknown --model-type 'resnet'"),
    (["--torch-program", "missing.pt2"], "--torch-program missing.pt2: no such file"),
    (["--ort-model", "missing.onnx"], "--ort-model missing.onnx: no such file"),
    (["--num-heads", "12"], "--num-heads 12 --hidden-size 0: give both"),
    (["--num-heads", "5", "--hidden-size", "768"], "the hidden size a multiple of the head count"),
])
def test_argument_errors_exit_2_with_one_line(argv: list[str], message: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vit-tiny", "--provider", "cpu", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_fixed_batch_that_differs_and_missing_model_are_errors(tmp_path: Path, make_mlp,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "mlp.onnx"
    onnx.save(make_mlp(rows=4), str(src))
    assert main(["bench", str(src), "--provider", "cpu", "--batch", "2", "--out", str(tmp_path / "o")]) == 2
    assert "fixed batch of 4; --batch 2 needs a model with a symbolic batch dim" in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "nope.onnx"), "--provider", "cpu", "--out", str(tmp_path / "o")]) == 2
    assert "neither a file nor a built-in model" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_ort_transformers_optimizes_the_given_ort_model_with_its_heads(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--ort-model / --num-heads / --hidden-size: ORT's transformer optimizer gets that file (the same model in the
    graph form its fusions match) with those arguments, its dynamic dims then take the feeds' sizes, the note says
    which file and what it fused, and the outputs are checked against the original's like every variant's."""
    from onnxruntime.transformers import optimizer

    src, ort_form = tmp_path / "bert.onnx", tmp_path / "bert.ort.onnx"
    onnx.save(models.build("bert-tiny", depth=1), str(src))
    onnx.save(models.build("bert-tiny", batch="B", depth=1), str(ort_form))  # same weights, a symbolic batch
    calls: list[tuple[str, dict[str, object]]] = []
    real = optimizer.optimize_model

    def recording(path, **kw):
        calls.append((Path(path).name, kw))
        return real(path, **kw)

    monkeypatch.setattr(optimizer, "optimize_model", recording)
    seen: list[list[list[int]]] = []
    time_ort = variants.time_ort

    def recording_time(make, *args, **kw):  # the static shapes of what the variant times
        sess = make(False)
        seen.append([list(i.shape) for i in sess.get_inputs()])
        return time_ort(make, *args, **kw)

    monkeypatch.setattr(variants, "time_ort", recording_time)
    out = tmp_path / "out"
    assert main(["bench", str(src), "--provider", "cpu", "--baselines", "ort-transformers-fp16", "--ort-model",
                 str(ort_form), "--num-heads", "2", "--hidden-size", "128", "--runs", "3", "--warmup", "1",
                 "--quick", "--out", str(out)]) == 0
    assert [(name, kw["num_heads"], kw["hidden_size"], kw["model_type"]) for name, kw in calls] == [
        ("bert.ort.onnx", 2, 128, "bert")]
    assert seen[0] == [[1, 128]] * len(seen[0])
    doc = json.loads((out / "bench.json").read_text())
    assert doc["command"].endswith(f"--ort-model {ort_form} --num-heads 2 --hidden-size 128 --quick")
    v = doc["batches"][0]["variants"][0]
    assert (v["name"], v["status"]) == ("ort-transformers-fp16", "ok"), v
    assert v["note"].startswith("optimize_model(model_type='bert', num_heads=2, hidden_size=128) of bert.ort.onnx "
                                "then fp16; fused ops: ")
    assert v["cosine"] > 0.999


def test_an_ort_model_must_take_the_models_inputs_and_give_its_outputs(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    bert = models.build("bert-tiny", batch=2, depth=1)
    check_ort_model(models.build("bert-tiny", batch="B", depth=1), bert, "ort.onnx")
    with pytest.raises(GtcoError, match=r"ort.onnx: its inputs \['pixel_values'\] are not the model's"):
        check_ort_model(models.build("vit-tiny", depth=1), bert, "ort.onnx")
    with pytest.raises(GtcoError, match=r"ort.onnx: input 'input_ids' of shape \[3, 128\] cannot take the model's "
                                        r"\[2, 128\]"):
        check_ort_model(models.build("bert-tiny", batch=3, depth=1), bert, "ort.onnx")
    renamed = models.build("bert-tiny", batch="B", depth=1)
    renamed.graph.output[0].name = "other"
    with pytest.raises(GtcoError, match="its outputs"):
        check_ort_model(renamed, bert, "ort.onnx")
    src, vit = tmp_path / "bert.onnx", tmp_path / "vit.onnx"
    onnx.save(models.build("bert-tiny", batch="B", depth=1), str(src))
    onnx.save(models.build("vit-tiny", depth=1), str(vit))
    assert main(["bench", str(src), "--provider", "cpu", "--ort-model", str(vit), "--out", str(tmp_path / "o")]) == 2
    assert "are not the model's" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bind_dims_binds_the_batch_and_asks_for_other_symbols() -> None:
    model = models.build("bert-tiny", batch="B", seq="S", depth=1)
    with pytest.raises(GtcoError, match=r"symbolic dim 'S'; give its size with --dim S=INT"):
        bind_dims(model, 2, {}, "bert")
    bound = bind_dims(model, 2, {"S": 16}, "bert")
    for vi in [*bound.graph.input, *bound.graph.output]:
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert dims[:2] == [2, 16], (vi.name, dims)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "B"  # the original is untouched
    assert infer_model_type(model) == "bert" and infer_model_type(models.build("vit-tiny", depth=1)) == "vit"


def test_summarize_percentiles_and_bad_input() -> None:
    lat = summarize(np.arange(1, 101, dtype=float)[::-1])  # order does not matter
    assert (lat.median_ms, lat.p10_ms, lat.p90_ms, lat.runs) == (50.5, pytest.approx(10.9), pytest.approx(90.1), 100)
    assert summarize([3.0]).median_ms == 3.0
    for bad in ([], [1.0, float("nan")], [1.0, -1.0]):
        with pytest.raises(ValueError):
            summarize(bad)


def test_accuracy_against_a_float64_reference() -> None:
    rng = np.random.default_rng(7)
    ref = rng.standard_normal((4, 33))
    got = ref.astype(np.float16).astype(np.float32)  # a real rounding error
    got[2, 5] = ref[2, 5] + 0.25  # and one known outlier
    acc = accuracy([ref, ref[:1]], [got, ref[:1].astype(np.float32)])
    assert acc.max_abs_err == pytest.approx(0.25, rel=1e-6)
    want_rel = np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-5))
    assert acc.max_rel_err == pytest.approx(want_rel, rel=1e-9)
    want_cos = float(np.dot(ref.ravel(), got.ravel().astype(np.float64))
                     / (np.linalg.norm(ref) * np.linalg.norm(got.astype(np.float64))))
    assert acc.cosine == pytest.approx(want_cos, rel=1e-12) and acc.cosine < 1.0
    nan = got.copy()
    nan[0, 0] = np.nan
    assert math.isinf(accuracy([ref], [nan]).max_abs_err)
    with pytest.raises(ValueError, match="shape"):
        accuracy([ref], [got[:2]])


def test_ours_over_is_ours_median_divided_by_each_baseline() -> None:
    v = [{"name": "ort-fp32", "status": "ok", "median_ms": 4.0}, {"name": "tensorrt", "status": "skipped",
         "median_ms": None}, {"name": "gtco", "status": "ok", "median_ms": 3.0}]
    assert ours_over(v) == {"ort-fp32": 0.75, "tensorrt": None}


def test_model_work_of_a_two_layer_mlp(make_mlp) -> None:
    work = roofline.model_work(make_mlp(rows=4, width=8))
    assert work.mm_flops == 2 * (2 * 4 * 8 * 8)
    assert work.flops == work.mm_flops + 3 * 4 * 8  # two bias Adds and a Relu, one FLOP per element
    assert work.bytes == 4 * (2 * 8 * 8 + 2 * 8 + 2 * 4 * 8)  # weights, biases, input and output once
    half = roofline.model_work(make_mlp(rows=4, width=8), "fp16")
    assert half.bytes == 2 * (2 * 8 * 8 + 2 * 8) + 4 * (2 * 4 * 8)  # fp16 weights, fp32 input and output
    assert half.flops == work.flops
    io = [np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float64)]  # actual arrays replace the declared shapes
    assert roofline.model_work(make_mlp(rows=4, width=8), io=io).bytes == 4 * (2 * 8 * 8 + 2 * 8) + 32 * 4 + 32 * 8


def test_floor_is_the_slower_of_compute_and_memory() -> None:
    peaks = roofline.Peaks("dev", peak_tflops=100.0, peak_gbps=1000.0, method="given")
    assert roofline.floor_ms(roofline.Work(2e12, 2e12, 1e9), peaks) == pytest.approx(20.0)  # compute: 2e12 / 1e14
    assert roofline.floor_ms(roofline.Work(1e9, 0.0, 5e10), peaks) == pytest.approx(50.0)  # memory: 5e10 / 1e12
    entry = roofline.roofline_json(roofline.Work(2e12, 2e12, 1e9), peaks)
    assert entry == {"flops": 2e12, "bytes": 1e9, "peak_tflops": 100.0, "peak_gbps": 1000.0,
                     "floor_ms": pytest.approx(20.0)}


def test_table_warns_when_a_variant_beats_the_floor() -> None:
    """Peaks measured on a busy machine put the floor above real runs: the table says so instead of printing a
    multiple of the floor below 1 without comment."""
    def variant(name: str, median: float) -> dict[str, object]:
        return {"name": name, "status": "ok", "reason": None, "median_ms": median, "p10_ms": median,
                "p90_ms": median, "runs": 100, "cuda_graph": False, "max_abs_err": 0.0, "max_rel_err": 0.0,
                "cosine": 1.0}

    def doc(floor: float) -> dict[str, object]:
        return {"model": "m", "provider": "cpu", "precision": "fp32", "device": {"name": "cpu-x"},
                "batches": [{"batch": 1, "variants": [variant("ort-fp32", 20.0), variant("gtco", 25.0)],
                             "ours_over": {"ort-fp32": 1.25},
                             "roofline": {"flops": 2.5e9, "bytes": 2.3e7, "peak_tflops": 0.05, "peak_gbps": 30.0,
                                          "floor_ms": floor}}]}

    warned = format_table(doc(22.0))
    assert "warning: ort-fp32 ran below the roofline floor" in warned and "gtco," not in warned
    assert "a run on an idle machine raises them" in warned
    assert "warning" not in format_table(doc(16.7))


def test_peaks_keep_the_best_measurement_per_device(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run measures; the cache keeps the best per field, so one run on a busy machine cannot lower the peaks
    (and so raise the floor above real runs); --remeasure-peaks keeps the new measurement alone."""
    measured = iter([(2.0, 50.0), (1.0, 80.0), (0.5, 10.0), (0.5, 10.0)])

    def fake(**_: object) -> roofline.Peaks:
        tflops, gbps = next(measured)
        return roofline.Peaks(roofline.cpu_name(), tflops, gbps, "fake")

    monkeypatch.setattr(roofline, "measure_cpu_peaks", fake)
    first, cached1 = roofline.device_peaks("cpu")
    second, cached2 = roofline.device_peaks("cpu")  # a slower matmul, a faster copy: each field keeps its best
    third, cached3 = roofline.device_peaks("cpu")
    assert (first.peak_tflops, first.peak_gbps, cached1) == (2.0, 50.0, False)
    assert (second.peak_tflops, second.peak_gbps, cached2) == (2.0, 80.0, True)
    assert (third.peak_tflops, third.peak_gbps, cached3) == (2.0, 80.0, True)
    stored = json.loads((cache_dir / "bench" / "peaks.json").read_text())[roofline.cpu_name()]
    assert (stored["peak_tflops"], stored["peak_gbps"]) == (2.0, 80.0)
    fourth, cached4 = roofline.device_peaks("cpu", remeasure=True)
    assert (fourth.peak_tflops, fourth.peak_gbps, cached4) == (0.5, 10.0, False)
    stored = json.loads((cache_dir / "bench" / "peaks.json").read_text())[roofline.cpu_name()]
    assert (stored["peak_tflops"], stored["peak_gbps"]) == (0.5, 10.0)


def test_cpu_peaks_are_plausible() -> None:
    peaks = roofline.measure_cpu_peaks(n=256, copy_mib=8, repeats=2)
    assert peaks.device == roofline.cpu_name()
    assert 0 < peaks.peak_tflops < 1e3 and 0 < peaks.peak_gbps < 1e5


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu with the CUDA EP and an NVIDIA GPU")
def test_cuda_bench_times_every_installed_baseline(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["bench", "bert-tiny", "--provider", "cuda", "--out", str(out)]) == 0
    doc = json.loads((out / "bench.json").read_text())
    by = {v["name"]: v for v in doc["batches"][0]["variants"]}
    assert doc["precision"] == "fp16" and doc["device"]["name"].startswith("cuda: ")
    for name in ("ort-fp32", "ort-fp16", "ort-transformers-fp16", "gtco"):
        assert by[name]["status"] == "ok", by[name]
        assert by[name]["cosine"] > 0.999 and by[name]["runs"] >= 100
    assert doc["batches"][0]["roofline"]["floor_ms"] > 0
    assert BenchOptions(model="bert-tiny").gtco_precision == "fp16"


def test_ours_is_timed_on_exactly_the_file_optimize_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "gtco" variant times the model file optimize_file wrote, optimized with the bench's precision, and no
    other: the fp32 original goes to optimize, which converts it to fp16 itself (no conversion of ours in bench)."""
    import onnx_gtco.pipeline
    import onnx_gtco.runtime.session

    seen: dict[str, object] = {}
    optimize_file, make_session = onnx_gtco.pipeline.optimize_file, onnx_gtco.runtime.session.make_session

    def recording_optimize(src, out, report, config, **kw):
        result = optimize_file(src, out, report, config, **kw)
        seen.update(src=Path(src), written=Path(result[1]), precision=config.precision,
                    src_dtypes={t.data_type for t in onnx.load(str(src)).graph.initializer})
        return result

    def recording_session(path, *args, **kw):
        seen.setdefault("timed", Path(path))
        return make_session(path, *args, **kw)

    monkeypatch.setattr(onnx_gtco.pipeline, "optimize_file", recording_optimize)
    monkeypatch.setattr(onnx_gtco.runtime.session, "make_session", recording_session)
    src = tmp_path / "bert.onnx"
    onnx.save(models.build("bert-tiny", depth=1), str(src))
    out = tmp_path / "out"
    assert main(["bench", str(src), "--provider", "cpu", "--precision", "fp16", "--baselines", "ort-fp32",
                 "--runs", "5", "--warmup", "1", "--quick", "--out", str(out)]) == 0
    assert seen["timed"] == seen["written"]  # the file optimize wrote, not a copy or a conversion of it
    assert seen["precision"] == "fp16"
    # the fp32 original: optimize converts it, bench does not
    assert onnx.TensorProto.FLOAT in seen["src_dtypes"] and onnx.TensorProto.FLOAT16 not in seen["src_dtypes"]
    gtco = json.loads((out / "bench.json").read_text())["batches"][0]["variants"][-1]
    assert gtco["name"] == "gtco" and gtco["status"] == "ok", gtco
    assert gtco["note"].startswith(f"fp16 from {seen['src'].name}")


def test_session_fusions_count_the_contrib_ops_ort_adds(tmp_path: Path) -> None:
    """The count is of what the session added: a model that carries a contrib op already is not credited with it,
    and the optimized copy ORT writes for the count is removed."""
    model = models.build("bert-tiny", depth=2)
    fused = variants.session_fusions(model, "cpu", tmp_path)
    assert fused["Gelu"] == 2 and fused["SkipLayerNormalization"] >= 2
    from onnxruntime.transformers.fusion_gelu import FusionGelu
    from onnxruntime.transformers.onnx_model import OnnxModel

    # the same model with its GELUs as contrib ops already: the session is not credited with them
    pre = OnnxModel(onnx.load_from_string(model.SerializeToString()))
    FusionGelu(pre).apply()
    pre.prune_graph()
    assert sum(n.op_type == "Gelu" for n in pre.model.graph.node) == 2
    assert "Gelu" not in variants.session_fusions(pre.model, "cpu", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_ratios_compare_cuda_graphs_on_both_sides_or_on_neither() -> None:
    from onnx_gtco.bench.run import graph_modes

    ours = {"name": "gtco", "status": "ok", "median_ms": 1.0, "cuda_graph": True, "median_ms_no_graph": 1.5}
    graphed = {"name": "ort-fp16", "status": "ok", "median_ms": 2.0, "cuda_graph": True, "median_ms_no_graph": 6.0}
    plain = {"name": "ort-fp32", "status": "ok", "median_ms": 3.0, "cuda_graph": False, "median_ms_no_graph": None}
    compiled = {"name": "torch-compile", "status": "ok", "median_ms": 0.5, "cuda_graph": True,
                "median_ms_no_graph": None}  # cudagraph trees: no graph-free time
    v = [graphed, plain, compiled, ours]
    assert ours_over(v) == {"ort-fp16": 0.5, "ort-fp32": 0.5, "torch-compile": 2.0}  # 1/2, 1.5/3, 1/0.5
    assert graph_modes(v) == {"ort-fp16": True, "ort-fp32": False, "torch-compile": True}
    ours_plain = {**ours, "cuda_graph": False, "median_ms": 1.5, "median_ms_no_graph": None}
    assert ours_over([graphed, compiled, ours_plain]) == {"ort-fp16": 0.25, "torch-compile": None}


def test_kernel_profile_summary_ranks_kernels_by_gpu_time() -> None:
    from onnx_gtco.bench.profile import NAME_CHARS, summarize_kernels

    durations = {"gemm": [30.0, 30.0, 40.0, 40.0], "ln": [5.0, 5.0], "x" * 400: [10.0, 10.0, 10.0, 20.0]}
    prof = summarize_kernels(durations, runs=2, top=2)
    assert prof["kernel_us_per_run"] == pytest.approx(100.0) and prof["calls_per_run"] == 5
    assert prof["kernels_total"] == 3 and [k["kernel"] for k in prof["top"]] == ["gemm", "x" * NAME_CHARS]
    assert prof["top"][0]["us_per_run"] == pytest.approx(70.0) and prof["top"][0]["share"] == pytest.approx(0.7)
    assert prof["top"][0]["calls_per_run"] == 2
    with pytest.raises(ValueError, match="runs"):
        summarize_kernels(durations, runs=0)
