"""Kernel support is decided per node: a fused node the kernels cannot serve runs its model-local function while the
nodes of its op type that they can serve keep their kernels; and no configuration ptxas rejects (a spill, a stack
frame) is ever built: the build moves on to the family's next one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from cpu_session import run
from onnx import TensorProto

from onnx_gtco import optimize, pipeline
from onnx_gtco.cli import main
from onnx_gtco.config import GtcoConfig
from onnx_gtco.cost.model import cost_fn
from onnx_gtco.models._build import Builder, attention_core
from onnx_gtco.models.bert import bert
from onnx_gtco.plugin.library import (
    CUDA_ARCHS,
    bind_nodes,
    build_library,
    function_only_nodes,
    function_only_op_type,
    select_device,
)
from onnx_gtco.plugin.nodes import fused_nodes

SEQ, DIM = 16, 512


def two_attentions() -> onnx.ModelProto:
    """Two self-attentions in a row on [1, 16, 512]: 8 heads of 64 (the kernels' head dims), then 1 head of 512
    (none of the attention family's), each as a MatMul / scale / Softmax / MatMul chain of one op type."""
    b = Builder("two_attentions", seed=0, opset=17, batch=1)
    x = b.input("x", TensorProto.FLOAT, [1, SEQ, DIM])
    y = attention_core(b, x, "small", seq=SEQ, dim=DIM, heads=8, qkv="split", scale_op="Mul")
    z = attention_core(b, y, "wide", seq=SEQ, dim=DIM, heads=1, qkv="split", scale_op="Mul")
    b.output(z, TensorProto.FLOAT, [1, SEQ, DIM])
    return b.model("two attentions of different head dims")


def test_a_node_without_a_kernel_runs_its_function_and_its_siblings_keep_theirs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = two_attentions()
    # planned at ONNX Runtime's rates (cost_fn without the kernels' estimates), where both attentions fuse: the
    # kernel-aware planner would cover the wide one with the kernels of its pieces instead, and this test is about
    # what the build does with a fused node no kernel serves (a model optimized for another version, say)
    monkeypatch.setattr(pipeline, "cost_fn", lambda view, config, kernel_us=None: cost_fn(view, config))
    rewritten = optimize(original, GtcoConfig(precision="fp32", target="sm_90")).model
    attn = [n for n in rewritten.graph.node if n.op_type == "Attention_f32"]
    assert len(attn) == 2
    wide = next(n.name for n in attn if "wide" in n.name)

    # a CUDA build's choice, without compiling: the reason is the node's own, naming the arch and the head dim
    nodes = fused_nodes(rewritten)
    results, _ = bind_nodes(nodes)
    device, why = select_device(nodes, results, CUDA_ARCHS)
    assert set(why) == {wide} and "sm_80" in why[wide] and "head_dim 512" in why[wide]
    assert [n for n in device if n.startswith("gtco/attention/")] == [a.name for a in attn if a.name != wide]
    assert function_only_nodes(results, device, why) == {wide: why[wide]}

    # the emulated build runs what a CUDA build would: the 64-wide node on its kernel, the 512-wide on its function
    lib = build_library(rewritten, tmp_path, cuda=False, emulated=True)
    assert lib.function_only == {wide: function_only_op_type("Attention_f32")} == {wide: "AttentionFn_f32"}
    assert "Attention_f32" in lib.cuda_op_types and "AttentionFn_f32" not in lib.op_types
    assert "head_dim 512" in lib.skipped()[wide]
    moved = next(n for n in rewritten.graph.node if n.name == wide)
    assert moved.op_type == "AttentionFn_f32"
    assert any(f.name == "AttentionFn_f32" and f.overload == moved.overload for f in rewritten.functions)
    path = tmp_path / "m.gtco.onnx"
    onnx.save(rewritten, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    x = {"x": np.random.default_rng(0).standard_normal((1, SEQ, DIM)).astype(np.float32)}
    want = run(original, x)[0]
    for lib_path in (None, lib.path):  # the functions alone, and the library's kernels with the function between
        got = run(path, x, lib_path)[0]
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), lib_path


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="nvcc not found on PATH")
def test_a_fp32_bert_whose_default_attention_spills_builds_with_the_next_configuration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A symbolic-shape, masked, fp32 encoder: the attention family's first configurations spill on sm_80 and sm_90
    (255 registers and a stack frame); the build rejects them, takes the next ones, and the model checks."""
    src = tmp_path / "b.onnx"
    onnx.save(bert(batch="batch", seq="seq", depth=1, dim=256, heads=4, mlp=1024, vocab=1000), str(src))
    assert main(["optimize", str(src), "--target", "sm_90", "--cuda"]) == 0
    report = json.loads((tmp_path / "b.gtco.onnx.report.json").read_text())
    lib = report["library"]
    assert lib["rejected"] and all("spill" in why or "stack" in why for why in lib["rejected"].values())
    assert "Attention_f32" in lib["cuda_op_types"] and not lib["function_only"]
    used = {k["instance"] for k in lib["kernels"]}
    assert not used & {k.split(" (")[0] for k in lib["rejected"]}
    assert all(k["kernels"][0]["spill_store_bytes"] == 0 and k["kernels"][0]["stack_frame_bytes"] == 0
               for k in lib["kernels"] if k["kernels"])
    capsys.readouterr()
    assert main(["check", str(src), str(tmp_path / "b.gtco.onnx"), "--library", "--dim", "batch=2",
                 "--dim", "seq=24"]) == 0
