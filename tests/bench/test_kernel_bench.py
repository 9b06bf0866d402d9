"""The kernel bench (onnx_gtco.bench.kernel_bench) without a GPU: its shape table and candidates (--list), its
Markdown, and --compile-only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onnx_gtco.bench.kernel_bench import __main__ as cli
from onnx_gtco.bench.kernel_bench.candidates import listing
from onnx_gtco.bench.kernel_bench.markdown import markdown
from onnx_gtco.bench.kernel_bench.measure import ratios
from onnx_gtco.bench.kernel_bench.shapes import CUTLASS_CONFIGS, SETS, cases
from onnx_gtco.families.gemm import cublaslt, cutlass


def _rows(arch: str) -> list[dict]:
    return listing(cases(), arch, None)


def test_list_holds_every_shape_set_of_the_issue(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--list"]) == 0
    printed = capsys.readouterr().out
    rows = _rows("sm_90")
    assert printed.count("\n[") == len(rows)
    labels = [w for r in rows for w in r["where"]]
    for b in (1, 8, 64):  # ViT-B/16 at batch 1, 8 and 64: 197 tokens
        for layer, shape in (("qkv", f"{197 * b}x2304x768"), ("fc1", f"{197 * b}x3072x768")):
            assert any(r["case"].startswith(f"vit-b16 b{b} {layer} {shape}") for r in rows), (b, layer)
        assert f"vit-b16 b{b} patch-embed" in labels
    for s in (128, 512):  # BERT-base at 128 and 512 tokens, batch 1 (the suite's)
        assert any(r["case"].startswith(f"bert-base b1 s{s} fc1 {s}x3072x768") for r in rows)
        assert any(r["case"].startswith(f"bert-base b1 s{s} attention B1 H12 S{s} D64 +mask") for r in rows)
    assert any(r["case"].startswith("setr b1 fc1 577x3072x768") for r in rows)  # the suite's SETR: ViT-B, 577
    assert {"setr patch-embed", "setr head 1x1"} <= set(labels)
    detr = [r for r in rows if r["set"] == "detr"]
    assert {"detr enc fc1", "detr dec fc1", "detr dec cross k/v", "detr class head", "detr@800 enc fc1"} <= {
        w for r in detr for w in r["where"]}
    convs = [r for r in detr if r["kind"] == "conv"]
    assert sum(r["count"] for r in convs) == 53 + 1  # ResNet-50's 53 convs (4 downsamples) + the input projection
    assert any("stem 7x7" in r["case"] for r in convs) and any("+bias+res+relu" in r["case"] for r in convs)
    assert {r["set"] for r in rows} == set(SETS)


def test_list_offers_each_implementation_where_it_applies() -> None:
    """cutlass only for the sm_90 target (sm_90a instances) and where its mapping expresses the group; cublaslt
    exactly where cublaslt.unsupported(problem) is None; mma everywhere; conv: our conv family's instances (the
    implicit GEMM, or the direct kernel of a grouped conv) beside cuDNN through torch and ORT."""
    for arch in ("sm_90", "sm_80"):
        for case, row in zip(cases(), _rows(arch), strict=True):
            c = row["candidates"]
            if row["kind"] == "conv":
                assert set(c) == {"ours"} and c["ours"] and all(n.startswith("conv_") for n in c["ours"]), row
                assert any("ORT" in b for b in row["baselines"]) and any("cuDNN" in b for b in row["baselines"])
                continue
            assert isinstance(c["mma"], list) and c["mma"], row
            if row["kind"] != "gemm":
                assert set(c) == {"mma"}
                continue
            p = case.problem
            assert isinstance(c[cublaslt.IMPL], list) == (cublaslt.unsupported(p) is None), row
            if isinstance(c[cublaslt.IMPL], list):
                assert len(c[cublaslt.IMPL]) == len(cublaslt.RANKS)
            cut = c[cutlass.IMPL]
            if arch != cutlass.TARGET:
                assert isinstance(cut, str) and cutlass.ARCH in cut
            elif isinstance(cutlass.include_dirs(), tuple) and cutlass.unsupported(p) is None:
                assert isinstance(cut, list) and 1 <= len(cut) <= CUTLASS_CONFIGS
                assert all(name.startswith("gemm_sm90a_cutlass_") for name in cut)
            else:
                assert isinstance(cut, str)
            assert any(b.startswith("cublaslt fused") for b in row["baselines"])
            ln = " + layer_norm" if p.flag("layernorm") else ""  # the GEMM + LayerNorm rows: the pair in torch
            assert "torch.compile max-autotune" + ln in row["baselines"]
    # the GEMM + LayerNorm rows: mma only, against the GEMM and torch's layer_norm after it
    ln_rows = [r for r in _rows("sm_90") if r["kind"] == "gemm" and "+layernorm " in r["case"]]
    assert ln_rows and all(isinstance(r["candidates"]["cublaslt"], str) for r in ln_rows)
    assert all("torch addmm + epilogue + layer_norm" in r["baselines"] for r in ln_rows)
    # the GELU(erf) projections have no cuBLASLt candidate but a tanh-GELU proxy for the fused baseline
    fc1 = next(r for r in _rows("sm_90") if " fc1 " in r["case"] and "gelu_erf" in r["case"])
    assert isinstance(fc1["candidates"][cublaslt.IMPL], str)
    assert "cublaslt fused (tanh proxy)" in fc1["baselines"]


def test_max_configs_and_impls_cap_the_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    rows = listing(cases(["vit-b16"], quick=True), "sm_90", 1, ("mma",))
    assert len(rows) == 3 and all(r["kind"] == "gemm" for r in rows)
    for r in rows:
        assert len(r["candidates"]["mma"]) == 1
        assert r["candidates"][cutlass.IMPL] == r["candidates"][cublaslt.IMPL] == "not selected (--impls)"
    with pytest.raises(SystemExit):
        cli.main(["--list", "--set", "vit-b16,resnet"])
    with pytest.raises(SystemExit):
        cli.main(["--list", "--impls", "mma,triton"])
    assert "choose from" in capsys.readouterr().err


def test_markdown_marks_wrong_answers_and_gives_the_ratios() -> None:
    """The table from results as a GPU run writes them: ratio = baseline / ours, wrong candidates listed and not
    best, skipped implementations and rows with their reasons."""
    gemm = {"set": "vit-b16", "case": "vit-b16 b64 fc1 12608x3072x768 +bias+gelu_erf", "kind": "gemm", "count": 12,
            "rows": [{"instance": "gemm_a", "impl": "mma", "ok": True, "us": 200.0, "rel_err": 2e-4},
                     {"instance": "gemm_b", "impl": "mma", "ok": False, "us": None, "rel_err": 0.5,
                      "error": "wrong answer: ‖err‖/‖ref‖ 0.5"},
                     {"instance": "cut_a", "impl": "cutlass", "ok": True, "us": 100.0, "rel_err": 3e-4}],
            "skipped": {"cublaslt": "activation 'gelu_erf' has no cuBLASLt epilogue"},
            "best": {"mma": ("gemm_a", 200.0), "cutlass": ("cut_a", 100.0), "cublaslt": None},
            "tuned": {"instance": "cut_a", "impl": "cutlass", "us": 100.0},
            "analytical_pick": {"instance": "gemm_a", "impl": "mma", "us": 200.0, "ok": True},
            "baselines": {}, "separate": {"name": "torch addmm + epilogue", "us": 150.0},
            "cublaslt_fused": {"ok": True, "us": 90.0, "note": "tanh proxy"},
            "compile": {"name": "torch.compile max-autotune", "ok": True, "us": 120.0}, "all_ok": False}
    gemm["ratios"] = ratios(gemm)
    assert gemm["ratios"] == pytest.approx({"tuned_vs_separate": 1.5, "cutlass_vs_cublaslt_fused": 0.9,
                                            "tuned_vs_compile": 1.2})
    conv = {"set": "detr", "case": "detr backbone stem 7x7", "kind": "conv", "count": 1, "rows": [],
            "ours": {"skipped": "no conv family"}, "all_ok": True,
            "baselines": {"torch cuDNN": {"ok": True, "us": 30.0, "rel_err": 1e-4},
                          "ORT cuDNN": {"ok": False, "us": None, "skipped": "no CUDAExecutionProvider"}},
            "ratios": {"ours_vs_cudnn_ort": None, "ours_vs_cudnn_torch": None}}
    skipped = {"set": "detr", "case": "detr dec fc1", "kind": "gemm", "count": 6, "rows": [], "all_ok": True,
               "skipped_reason": "--time-budget-s spent"}
    attn = {"set": "vit-b16", "case": "vit-b16 b1 attention", "kind": "attention", "count": 12,
            "rows": [{"instance": "attention_a", "ok": True, "us": 10.0}], "best": {"mma": ("attention_a", 10.0)},
            "baselines": {"torch SDPA": {"us": 12.0, "ok": True}}, "all_ok": True}
    conv_ok = dict(conv, case="detr backbone 3x3", ours={"instance": "conv_a", "us": 20.0},
                   rows=[{"instance": "conv_a", "ok": True, "us": 20.0},
                         {"instance": "conv_b", "ok": False, "us": None, "error": "wrong answer"}],
                   ratios={"ours_vs_cudnn_ort": None, "ours_vs_cudnn_torch": 1.5})
    md = markdown([gemm, skipped, conv, conv_ok, attn], "NVIDIA H100", ["torch 2.x"])
    row = next(ln for ln in md.splitlines() if ln.startswith("| vit-b16 | vit-b16 b64 fc1"))
    assert "| 200.0 | 100.0 | skip | 100.0 (cutlass) | 200.0 (mma) | 90.0 (tanh proxy) | 150.0 | 120.0 | 1.50x | " \
           "0.90x | 1.20x | 5.0e-01 | 2/3 |" in row
    assert "- vit-b16 b64 fc1 12608x3072x768 +bias+gelu_erf: `gemm_b`: wrong answer" in md
    assert "- cublaslt: activation 'gelu_erf' has no cuBLASLt epilogue" in md
    assert "| detr | detr dec fc1 | 6 | skipped: --time-budget-s spent |" in md
    assert "| detr | detr backbone stem 7x7 | 1 | 30.0 | skip | skip | - | - | 1.0e-04 |" in md
    assert "- ours skipped: no conv family" in md and "- ORT skipped: no CUDAExecutionProvider" in md
    assert "| detr | detr backbone 3x3 | 1 | 30.0 | skip | 20.0 | 1.50x | - | 1.0e-04 |" in md
    assert "- detr backbone 3x3: `conv_b` failed (excluded from ours): wrong answer" in md
    assert "`attention_a` | 10.0 / 10.0 | torch SDPA 12.0 | torch SDPA 1.20x | 1/1 |" in md


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("NVCC") or "nvcc") is None, reason="nvcc not found on PATH")
def test_compile_only_builds_without_torch_or_a_gpu(tmp_path: Path) -> None:
    """What tools/gpu_suite --dry-run runs: three instances built, none launched, in a process where torch cannot
    be imported."""
    out = tmp_path / "kb"
    argv = ["--compile-only", "--quick", "--max-configs", "1", "--impls", "mma", "--out", str(out)]
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'kernel_bench'; "
            "runpy.run_module('onnx_gtco.bench.kernel_bench', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=False,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["compile_only"] and res["results"] == [] and len(res["built"]) == 3 and not res["build_failed"]
    assert "none launched (--compile-only)" in (out / "results.md").read_text()
