"""The node table's programmatic-dependent-launch column (NodeSpec::pdl, onnx_gtco.plugin.pdl): on in the sm_90
slots of a fused node fed by another fused node running a gtco kernel; off after a graph input or a non-gtco node,
in the sm_80 slot, for a CUTLASS / cuBLASLt instance and after one; and the glue that carries it compiles."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from plugin_helpers import ln_softmax_model

from onnx_gtco import optimize
from onnx_gtco.families.gemm.cublaslt import IMPL as CUBLASLT
from onnx_gtco.families.gemm.cutlass import IMPL as CUTLASS
from onnx_gtco.kernels.toolchain import GLUE_INCLUDE_DIRS, find_cxx
from onnx_gtco.plugin.headers import ort_include_dir
from onnx_gtco.plugin.library import CUDA_ARCHS, CXX_FLAGS, bind_nodes, device_nodes, generate_glue, select_device
from onnx_gtco.plugin.nodes import fused_nodes
from onnx_gtco.plugin.pdl import pdl_archs, pdl_slots

LN, SM = "gtco/layernorm/res", "gtco/softmax/sm"


@pytest.fixture(scope="module")
def rewritten() -> onnx.ModelProto:
    """Layernorm_f16 (fed by the graph inputs) -> Softmax_f16 (fed by the LayerNorm)."""
    model = optimize(ln_softmax_model(16, TensorProto.FLOAT16)).model
    assert [n.name for n in model.graph.node] == [LN, SM]
    return model


def table(model: onnx.ModelProto, archs=CUDA_ARCHS, impl: dict[str, str] | None = None):
    """(pdl per node and arch slot, the glue source); `impl` gives a node's sm_90 / sm_90a instances another impl."""
    nodes = fused_nodes(model)
    results, binders = bind_nodes(nodes)
    device, why = select_device(nodes, results, archs)
    assert not why
    for node, name in (impl or {}).items():
        device[node] = tuple(dataclasses.replace(i, config={**i.config, "impl": name}) if i.arch != "sm_80" else i
                             for i in device[node])
    pdl = pdl_slots(model, archs, device_nodes(results, binders, device, {}, len(archs)))
    source, _, _ = generate_glue(nodes, results, binders, device, pdl=pdl)
    return pdl, source


def test_on_after_a_fused_node_off_after_graph_inputs_and_on_sm80(rewritten) -> None:
    pdl, source = table(rewritten)
    assert pdl == {LN: [False, False, False], SM: [False, True, True]}
    assert source.count(".pdl = {false, true, true}") == 1  # the Softmax row; the LayerNorm row leaves it out
    assert pdl_archs(pdl, CUDA_ARCHS) == {SM: ["sm_90", "sm_90a"]}


def test_off_after_a_node_that_is_not_fused(rewritten) -> None:
    model = onnx.ModelProto()
    model.CopyFrom(rewritten)
    sm = model.graph.node[1]
    sm.input[0] = "y_relu"
    model.graph.node.insert(1, helper.make_node("Relu", ["y"], ["y_relu"], name="relu"))
    pdl, source = table(model)
    assert pdl[SM] == [False, False, False] and ".pdl = " not in source


def test_an_emulated_build_never_uses_pdl(rewritten) -> None:
    pdl, _ = table(rewritten, archs=("sm_80",))
    assert pdl == {LN: [False], SM: [False]}


@pytest.mark.parametrize("impl", [CUTLASS, CUBLASLT])
def test_off_for_foreign_instances_and_after_them(rewritten, impl: str) -> None:
    """A node whose sm_90 instance is CUTLASS / cuBLASLt never waits in griddepcontrol.wait: no PDL for it, and
    none for a node it feeds."""
    pdl, _ = table(rewritten, impl={SM: impl})
    assert pdl[SM] == [False, False, False]
    pdl, _ = table(rewritten, impl={LN: impl})
    assert pdl[SM] == [False, False, False]


def test_the_glue_with_pdl_compiles(rewritten, tmp_path: Path) -> None:
    _, source = table(rewritten)
    glue = tmp_path / "glue.cc"
    glue.write_text(source)
    inc = [*(f"-I{d}" for d in GLUE_INCLUDE_DIRS),
           f"-I{ort_include_dir()}"]
    proc = subprocess.run([find_cxx(), *CXX_FLAGS, "-O0", *inc, "-c", str(glue), "-o", str(tmp_path / "glue.o")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
