"""Acceptance on real exports: every zoo model, from both torch exporters, optimizes, fuses every attention block,
offers at least 90% of its FLOPs to fusion (the DP leaves to ONNX Runtime what the estimate predicts faster there:
DETR's ResNet convs), is predicted faster than the model as given, builds its custom-op library, and `onnx-gtco
check` passes at fp32 tolerances on the CPU EP both through the model-local functions and through the library's
kernels (conv groups included)."""

from __future__ import annotations

import json
import pathlib

import onnx
import pytest

from onnx_gtco.cli import main

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

MIN_FLOP_SHARE = 0.9
ATTENTION = ("attention", "bmm_softmax")


def test_optimize_and_check(zoo_case: tuple[str, str], zoo_onnx: pathlib.Path, tmp_path: pathlib.Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    name, exporter = zoo_case
    out = tmp_path / f"{name}.{exporter}.gtco.onnx"
    # --cpu: the library's CPU kernels are what `check --library` runs here; compiling every zoo model's TF32 device
    # instances would cost CI minutes that the kernel tests (tests/kernels, tests/plugin) already spend on them
    assert main(["optimize", str(zoo_onnx), "-o", str(out), "--cpu"]) == 0, capsys.readouterr().err
    report = json.loads(out.with_name(out.name + ".report.json").read_text())

    # every softmax that survives loading (dead branches are dropped) sits inside an attention group, or, where the
    # attention group would have no device kernel (fp32 attention has none yet) and so costs its nodes unfused, in
    # a group that has one
    in_attention = sum(g["ops"].count("Softmax") for g in report["groups"] if g["family"] in ATTENTION)
    elsewhere = [g["name"] for g in report["groups"] if g["family"] not in ATTENTION and "Softmax" in g["ops"]
                 and g["device_reason"] is not None]
    attention_candidates = in_attention + sum(x["family"] in ATTENTION for x in report["not_chosen"])
    assert attention_candidates > 0
    assert "Softmax" not in report["unfused_ops"], report["unfused_ops"]
    assert not elsewhere
    assert report["matched_flop_share"] >= MIN_FLOP_SHARE
    assert report["nodes_after"] < report["nodes_before"]
    assert report["predicted_us_after"] < report["predicted_us_before"]

    # TF32: every GEMM, QKV and attention node of an fp32 model has its device kernels (the loader folds the shape
    # arithmetic of TorchScript exports, so their extents are static too); sm_90a joins them where a node has its own
    no_kernel = [(g["name"], g["device_reason"]) for g in report["groups"]
                 if g["family"] in ("gemm", "qkv", *ATTENTION) and not {"sm_80", "sm_90"} <= set(g["device_kernels"])]
    assert not no_kernel, no_kernel

    rewritten = onnx.load(str(out))
    assert any(n.domain == "ai.gtco" for n in rewritten.graph.node)
    assert {f.name for f in rewritten.functions} >= {n.op_type for n in rewritten.graph.node if n.domain == "ai.gtco"}

    library = report["library"]
    assert (out.parent / library["file"]).is_file()
    assert {m.key: m.value for m in rewritten.metadata_props}["gtco.library"] == library["file"]
    assert {"Gemm_f32", "Layernorm_f32"} <= set(library["op_types"]), library
    if in_attention:  # Swin's shifted windows included
        assert "Attention_f32" in library["op_types"], library
    # conv groups (ViT's patch embedding, DETR's ResNet-50 with its FrozenBatchNorm epilogues) run the library's CPU
    # conv kernel: bound, none left to its function
    convs = {g["name"] for g in report["groups"] if g["family"] == "conv"}
    if convs:
        assert "Conv_f32" in library["op_types"], library
        assert not convs & set(library["skipped"]), {n: library["skipped"][n] for n in convs & set(library["skipped"])}
    for with_library in ([], ["--library"]):
        capsys.readouterr()
        code = main(["check", str(zoo_onnx), str(out), "--provider", "cpu", "--rtol", "1e-4", "--atol", "1e-5",
                     *with_library])
        printed = capsys.readouterr()
        assert code == 0, printed.out + printed.err
