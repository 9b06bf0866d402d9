"""The fitted estimate against what the GPU measured: the shipped H200 calibration reproduces every measured kernel
and whole-model record, is the fit of the shipped records, and the fit itself recovers known constants."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from onnx_gtco.calibration import Hardware, LaunchConstants, hardware, load_calibration
from onnx_gtco.cli import main
from onnx_gtco.errors import GtcoError
from onnx_gtco.families.gemm.kernel import MmaConstants
from onnx_gtco.tune import fit

KERNEL_BOUND = 1.25  # every measured kernel row of ours within 25%, either way
MODEL_BOUND = 1.20  # every measured whole model within 20%


def _worst(rows: list[fit.Row]) -> float:
    return max(max(r.ratio, 1 / r.ratio) for r in rows)


@pytest.fixture(scope="module")
def records() -> fit.Records:
    return fit.load_records()


def test_the_shipped_records_carry_their_provenance(records: fit.Records) -> None:
    assert records.gpu == "NVIDIA H200" and records.target == "h200"
    ours = [k for k in records.kernels if k.side == "gtco"]
    assert len(ours) == 44  # every onnx-gtco kernel of the two runs' profiles
    for k in records.kernels:
        assert {"gpu", "driver", "commit", "date"} <= set(k.source), k.id
    proxies = [k for k in records.kernels if k.proxy]
    assert proxies and all(k.config.get("impl") == "cublaslt" and k.side == "ort-fp16" for k in proxies)
    assert len(records.models) == 5


def test_the_h200_calibration_reproduces_every_measured_kernel_and_model(records: fit.Records) -> None:
    hw = hardware("h200")
    assert hw.calibration is not None and hw.calibration.gpu == "NVIDIA H200"
    kernels, models = fit.backtest(records, hw)
    ours = {k.id for k in records.kernels if k.side == "gtco" or k.proxy}
    assert _worst([r for r in kernels if r.id in ours]) < KERNEL_BOUND, [
        (round(r.ratio, 3), r.what) for r in kernels if r.id in ours and max(r.ratio, 1 / r.ratio) >= KERNEL_BOUND]
    assert _worst(models) < MODEL_BOUND, [(round(r.ratio, 3), r.what) for r in models]


def test_the_data_sheet_alone_would_miss_them(records: fit.Records) -> None:
    """The bound above is the fit's doing: with every constant at a value 2x off (the planner's old roofline was
    2.5-4.6x optimistic on these GEMMs) the kernels leave it."""
    hw = hardware("h200")
    wrong = hw.with_overrides({"gemm.mma": {"warp_peak_frac": 2 * hw.constants(MmaConstants).warp_peak_frac}})
    kernels, _ = fit.backtest(records, wrong)
    mma = {k.id for k in records.kernels if k.family == "gemm" and k.side == "gtco" and "impl" not in k.config}
    assert _worst([r for r in kernels if r.id in mma]) > KERNEL_BOUND


def test_the_shipped_calibration_is_the_fit_of_the_shipped_records(records: fit.Records) -> None:
    shipped = load_calibration("h200")
    assert shipped is not None
    got = fit.fit(records).calibration
    assert set(got.constants) == set(shipped.constants)
    for group, values in got.constants.items():
        for name, value in values.items():
            assert value == pytest.approx(shipped.constants[group][name], rel=0.02, abs=1e-3), f"{group}.{name}"
    assert shipped.fitted["records"] == [Path(f).name for f in records.files]


def test_fit_recovers_the_constants_that_made_its_records(records: fit.Records, tmp_path: Path) -> None:
    """Stand-in records: the shipped records' shapes and configurations with times the estimate gives at known
    constants; the fit from the defaults reproduces those times."""
    target = Hardware(hardware("h200").target)
    truth = {"launch": {"graph_gap_us": 2.0}, "gemm.mma": {"warp_peak_frac": 0.05, "epilogue_ns": 30.0},
             "rowwise": {"bw_frac": 0.6}}
    hw = target.with_overrides(truth)
    doc = json.loads(next(iter(sorted((Path(fit.RECORDS_DIR)).glob("*.json")))).read_text())
    by_id = {k.id.split("#")[1]: k for k in records.kernels}
    for i, k in enumerate(doc["kernels"]):
        k["us_per_forward"] = fit.predict_kernel(by_id[str(i)], hw)
    for m, rec in zip(doc["models"], records.models, strict=True):
        m["measured_ms"] = fit.predict_model(rec, records.kernels, hw) / 1e3
    path = tmp_path / "stand-in.json"
    path.write_text(json.dumps(doc))
    result = fit.fit(fit.load_records([path]))
    assert _worst([*result.kernels, *result.models]) < 1.01
    got = result.calibration.constants
    assert got["launch"]["graph_gap_us"] == pytest.approx(2.0, rel=0.05)
    assert got["rowwise"]["bw_frac"] == pytest.approx(0.6, rel=0.05)


def test_a_records_file_that_tells_an_unfitted_constant_gets_it_fitted_and_ends_the_proxy(
        records: fit.Records, tmp_path: Path) -> None:
    """cutlass.extra_us has fit=False: the shipped records (5 to 18 waves) cannot tell it. A file of CUTLASS GEMMs at a
    few tiles that says it tells it (what the GPU suite's calibration row writes) gets it fitted, and its own
    cuBLASLt record ends the ORT cuBLAS proxy note; without "tells" the constant keeps its default."""
    from onnx_gtco.families.gemm.kernel import gemm_problem

    truth = Hardware(hardware("h200").target).with_overrides({"gemm.cutlass": {"extra_us": 6.0}})
    doc = json.loads(next(iter(sorted(Path(fit.RECORDS_DIR).glob("*.json")))).read_text())
    by_id = {k.id.split("#")[1]: k for k in records.kernels}
    for i, k in enumerate(doc["kernels"]):
        k["us_per_forward"] = fit.predict_kernel(by_id[str(i)], truth)
    doc["models"] = []
    few = {"impl": "cutlass", "TILE_M": 128, "TILE_N": 128, "TILE_K": 64, "CLUSTER_M": 1, "CLUSTER_N": 1,
           "SCHEDULE": "cooperative", "STAGES": 0, "RASTER": "heuristic", "TILE_SCHEDULER": "persistent"}
    extra = []
    for n, k, cfg in ((768, 768, few), (2304, 768, few), (3072, 768, few), (768, 3072, few),
                      (768, 768, {"impl": "cublaslt", "RANK": 0})):
        p = gemm_problem("f16", 1, 197, n, k, bias=True)
        rec = fit.KernelRecord("x", "gemm", cfg, ((1, p),), 1, 0.0, "gtco", "calib", "gemm-small-m", 1)
        extra.append({"run": "calib", "model": "gemm-small-m", "batch": 1, "side": "gtco", "family": "gemm",
                      "config": cfg, "calls": 1, "us_per_forward": fit.predict_kernel(rec, truth), "proxy": None,
                      "problems": [{"count": 1, "problem": {"family": "gemm", "dtype": "f16", "sizes": dict(p.sizes),
                                                            "flags": dict(p.flags)}}]})
    (tmp_path / "shipped.json").write_text(json.dumps(doc))
    (tmp_path / "calib.json").write_text(json.dumps({**doc, "kernels": extra, "tells": ["gemm.cutlass.extra_us"]}))
    both = fit.load_records([tmp_path])
    assert both.tells == ("gemm.cutlass.extra_us",)
    told = fit.fit(both)
    assert told.calibration.constants["gemm.cutlass"]["extra_us"] == pytest.approx(6.0, rel=0.05)
    assert not told.calibration.proxies and told.calibration.fitted["tells"] == ["gemm.cutlass.extra_us"]
    (tmp_path / "calib.json").write_text(json.dumps({**doc, "kernels": extra}))
    untold = fit.fit(fit.load_records([tmp_path])).calibration
    assert "extra_us" not in untold.constants.get("gemm.cutlass", {})  # keeps its default
    (tmp_path / "calib.json").write_text(json.dumps({**doc, "kernels": extra, "tells": ["gemm.cutlass.nothing"]}))
    with pytest.raises(GtcoError, match="no constant of the estimate"):
        fit.load_records([tmp_path])


def test_records_of_two_gpus_are_refused(tmp_path: Path) -> None:
    doc = json.loads(next(iter(sorted(Path(fit.RECORDS_DIR).glob("*.json")))).read_text())
    (tmp_path / "a.json").write_text(json.dumps(doc))
    (tmp_path / "b.json").write_text(json.dumps({**doc, "gpu": "NVIDIA A100-SXM4-80GB", "target": "a100"}))
    with pytest.raises(GtcoError, match="several GPUs"):
        fit.load_records([tmp_path])
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(GtcoError, match="not a records file"):
        fit.load_records([tmp_path / "b.json"])


def test_calibration_cli_fits_backtests_and_shows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibration", "fit", "--runs", "run1", "-o", str(tmp_path / "h200.json")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'h200.json'}" in out and "gtco" in out
    cal = json.loads((tmp_path / "h200.json").read_text())
    assert cal["target"] == "h200" and cal["fitted"]["kernel_rows"] < len(fit.load_records().kernels)
    assert main(["calibration", "backtest", "--runs", "run2", "--calibration-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert str(tmp_path / "h200.json") in lines[0]
    ratios = [float(ln.split()[0]) for ln in lines[1:] if "run2 vit-b16 b1 gtco: gemm 64x64" in ln]
    assert len(ratios) == 4 and all(0.8 < r < 1.25 for r in ratios)  # out of sample: run 2's 64x64 tiles
    assert main(["calibration", "show", "--target", "sm_90"]) == 0
    shown = capsys.readouterr().out
    assert '"calibration": null' in shown and "warp_peak_frac" in shown and "default" in shown


def test_a_target_without_calibration_says_so() -> None:
    hw = hardware("a100")
    assert hw.calibration is None
    assert "no calibration of a100" in hw.describe()["note"]
    assert hw.constants(LaunchConstants) == LaunchConstants()
    assert math.isclose(hardware("h200").constants(LaunchConstants).graph_gap_us,
                        load_calibration("h200").constants["launch"]["graph_gap_us"])  # type: ignore[union-attr]
