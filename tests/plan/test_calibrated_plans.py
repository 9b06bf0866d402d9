"""The plans the H200 calibration makes of ViT-B/16 and BERT-base at fp16, and that each choice the measurements
changed follows the estimate rather than a rule: the GEMM + LayerNorm fusion, cuBLASLt and CUTLASS as defaults, the
patch embedding as a patchify copy and a GEMM; and the launches per layer the report counts from those plans."""

from __future__ import annotations

from typing import Any

import pytest

from onnx_gtco import GtcoConfig, models, optimize
from onnx_gtco.report import summary
from onnx_gtco.report_md import family_rows, render


def _impl(group: dict[str, Any]) -> str:
    name = (group.get("kernel") or {}).get("instance", "")
    return "cutlass" if "_cutlass_" in name else "cublaslt" if name.startswith("cublaslt") else name.split("_")[0]


@pytest.fixture(scope="module")
def plans() -> dict[str, dict[str, Any]]:
    config = GtcoConfig(target="h200", precision="fp16")
    return {f"{name}.b{batch}": optimize(models.build(name, batch=batch, seed=0), config).report
            for name, batch in (("vit-b16", 64), ("vit-b16", 1), ("bert-base", 1))}


def test_every_plan_is_priced_with_the_h200_calibration(plans: dict[str, dict[str, Any]]) -> None:
    for report in plans.values():
        assert report["estimate"]["calibration"]["gpu"] == "NVIDIA H200"
        kernels = [g for g in report["groups"] if g.get("kernel")]
        assert kernels and all(g["predicted_us"] >= g["kernel"]["estimate_us"] for g in kernels)


def test_vit_b64_runs_every_gemm_on_a_hopper_library_kernel_and_no_gemm_layernorm(
        plans: dict[str, dict[str, Any]]) -> None:
    """At batch 64 the measured CUTLASS kernels ran ViT-B/16's GEMMs in 73-153 us where the mma kernels took 165-254,
    and ORT's cuBLAS kernels (cuBLASLt's proxy) faster still: no GEMM may stay on (or be pulled onto, by a fused
    LayerNorm) the mma kernel."""
    report = plans["vit-b16.b64"]
    gemms = [g for g in report["groups"] if g["family"] == "gemm"]
    assert len(gemms) == 50  # 48 block GEMMs, the patch embedding's, the head
    assert not [g["name"] for g in gemms if g["attrs"].get("layernorm")]
    assert {_impl(g) for g in gemms} <= {"cutlass", "cublaslt"}, {g["name"]: _impl(g) for g in gemms}
    assert report["patchify"] == [{**report["patchify"][0], "chosen": "patchify + GEMM"}]
    assert not [g for g in report["groups"] if g["family"] == "conv"]


@pytest.mark.parametrize("model", ["vit-b16.b1", "bert-base.b1"])
def test_batch_1_keeps_gemm_and_layernorm_apart_where_the_pair_is_predicted_faster(
        plans: dict[str, dict[str, Any]], model: str) -> None:
    report = plans[model]
    assert not [g for g in report["groups"] if g["family"] == "gemm" and g["attrs"].get("layernorm")]
    # offered, priced and passed: every block's pair but the last, whose LayerNorm output is the graph's
    assert len([n for n in report["not_chosen"] if n["pattern"] == "gemm_layernorm"]) >= 23
    assert {_impl(g) for g in report["groups"] if g["family"] == "gemm"} <= {"cublaslt", "cutlass", "gemm"}


def test_the_choices_follow_the_estimate_not_a_rule(calibrated) -> None:
    """The same model planned against two calibrations: one where the LayerNorm kernel and the library GEMMs are
    cheap, one where they are dear. The GEMM + LayerNorm fusion and the mma kernels come and go with the estimate."""
    model = models.build("bert-tiny", seed=0)
    config = GtcoConfig(target="h200", precision="fp16")
    calibrated("h200", rowwise={"pass_us": 0.0, "stream_us": 0.0}, vendor_gemm={"extra_us": 0.0})
    before = optimize(model, config).report
    assert not [g for g in before["groups"] if g["attrs"].get("layernorm")]
    assert "cublaslt" in {_impl(g) for g in before["groups"] if g["family"] == "gemm"}
    calibrated("h200", rowwise={"pass_us": 40.0}, vendor_gemm={"extra_us": 40.0})
    after = optimize(model, config).report
    assert after["estimate"]["calibration"]["file"] == "h200.json"
    assert [g for g in after["groups"] if g["family"] == "gemm" and g["attrs"].get("layernorm")]
    assert "cublaslt" not in {_impl(g) for g in after["groups"] if g["family"] == "gemm"}


def test_a_patch_embedding_stays_a_conv_where_the_conv_is_predicted_faster(calibrated) -> None:
    model = models.build("vit-tiny", seed=0)
    config = GtcoConfig(target="h200", precision="fp16")
    report = optimize(model, config).report
    assert report["patchify"][0]["chosen"] == "patchify + GEMM"
    assert not [g for g in report["groups"] if g["family"] == "conv"]
    # the conv's gather cheap and a streaming copy slow: patchify copies the whole image, the conv only its
    # output's tokens (a gathered read, which bw_frac does not price)
    calibrated("h200", conv={"gather_ns": 5.0, "gather_gps": 5000.0}, elementwise={"bw_frac": 0.05})
    report = optimize(model, config).report
    assert report["patchify"][0]["chosen"] == "conv"
    assert [g for g in report["groups"] if g["family"] == "conv"]
    assert not [g for g in optimize(model, config.replace(patchify=False)).report["groups"]
                if "patchify" in g["name"]]


@pytest.mark.parametrize("key", ["vit-b16.b1", "bert-base.b1"])
def test_the_report_counts_the_plans_launches_per_layer(plans: dict[str, dict[str, Any]], key: str) -> None:
    rep = plans[key]
    la = rep["launches"]
    blk = la["per_block"]
    assert blk["anchor"] == "attention" and blk["blocks"] == 11
    assert blk["ours"] < blk["original_launching_nodes"] and la["ours"] < la["original_launching_nodes"]
    assert la["original_nodes"] == rep["nodes_before"]
    assert "qkv" not in rep["families"]  # BERT's three projections packed into one GEMM before matching
    for g in rep["groups"]:  # where a GEMM + LayerNorm was chosen, the report names what it replaced and why
        if g["attrs"].get("layernorm"):
            assert g["instead_of"]["groups"] == ["gemm", "layernorm"]
            assert g["predicted_us"] < g["instead_of"]["predicted_us"]
    assert 0 < la["after_ours"] <= la["ours"]
    assert rep["predicted_us_after_pdl"] < rep["predicted_us_after"]
    text = summary(rep)
    assert f"launches   {la['ours']} per forward" in text and f"per layer {blk['ours']:g}" in text
    assert "with PDL" in text
    md = render(rep)
    assert f"| kernel launches per layer | {blk['original_launching_nodes']:g} | {blk['ours']:g} | - |" in md
    assert "Assumed, not measured" in md
    # the family table adds up to the predicted time after, also where Q, K and V were packed first (BERT)
    assert sum(f["after_us"] for f in family_rows(rep)) == pytest.approx(rep["predicted_us_after"], abs=0.01)
    # both were rewritten before planning (ViT's patch embedding as patchify + GEMM, BERT's Q, K and V packed):
    # the report prices the model as given and as planned
    assert rep["predicted_us_before_planned"] != rep["predicted_us_before"]
    assert "The planner rewrote the graph first" in md
