"""Dispatch tables and declared ranges of dynamic nodes (onnx_gtco.plugin.dispatch), without compiling: which dims a
node checks, what its extent is, the default tables, the checks on a given table, and the glue they generate. The
compiled path (range errors, launched entries) is tests/dynamic/test_dynamic_bert.py."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

from onnx_gtco import optimize
from onnx_gtco.config import DYNAMIC_METADATA_KEY as DYNAMIC_KEY
from onnx_gtco.config import model_ranges
from onnx_gtco.errors import GtcoError
from onnx_gtco.families.attention.kernel import make_problem
from onnx_gtco.models import build
from onnx_gtco.plugin.device import device_instances
from onnx_gtco.plugin.dispatch import bucket_of, check_table, default_table
from onnx_gtco.plugin.library import BuildError, bind_nodes, build_library, dynamic_nodes, generate_glue, select_device
from onnx_gtco.plugin.nodes import fused_nodes

sys.path.insert(0, str(Path(__file__).parent))
from test_device_path import fp16

RANGES = {"batch": (1, 8), "seq": (1, 200)}


@pytest.fixture(scope="module")
def bert16() -> onnx.ModelProto:
    model = optimize(fp16(build("bert-tiny", batch="batch", seq="seq", depth=1, dim=64, heads=2, mlp=128))).model
    onnx.helper.set_model_props(model, {DYNAMIC_KEY: "batch=1:8,seq=1:200"})
    return model


def test_model_ranges_and_malformed_metadata(bert16, tmp_path: Path) -> None:
    assert model_ranges(bert16) == RANGES
    bad = onnx.ModelProto()
    bad.CopyFrom(bert16)
    onnx.helper.set_model_props(bad, {DYNAMIC_KEY: "seq=0:12"})
    with pytest.raises(GtcoError, match=r"gtco\.dynamic.*lower bound"):
        model_ranges(bad)
    with pytest.raises(BuildError, match=r"gtco\.dynamic"):
        build_library(bad, tmp_path, cuda=False)


def test_nodes_check_their_named_dims_and_dispatch_on_their_extent(bert16) -> None:
    nodes = fused_nodes(bert16)
    results, _ = bind_nodes(nodes)
    device, _ = select_device(nodes, results, ("sm_80", "sm_90"))
    dyn = dynamic_nodes(nodes, results, ("sm_80", "sm_90"), device, RANGES)
    by_family = {n.node.name.split("/")[1]: n.node.name for n in nodes}
    gemm, attn = dyn[by_family["gemm"]], dyn[by_family["attention"]]
    assert (0, 0, 1, 8, "batch") in gemm.ranges and (0, 1, 1, 200, "seq") in gemm.ranges
    assert gemm.extent == ((0, 0), (0, 1))          # M = batch * seq of A [batch, seq, K]
    assert attn.extent == ((0, 1),)                 # the query length of q [batch, seq, H*D]
    for tables in (gemm.tables, attn.tables):
        assert len(tables) == 2                     # one per arch
        for table in tables:
            tops = [t for t, _ in table]
            assert tops == sorted(tops) and tops[-1] == (1600 if tables is gemm.tables else 200)
    assert any(len(t) > 1 for t in attn.tables), attn.tables
    # the glue carries them: ranges, extent factors and one entry per table row, the last unbounded
    source, _, device_types = generate_glue(nodes, results, bind_nodes(nodes)[1], device, False, dyn)
    assert "Attention_f16" in device_types
    assert '{0, 1, 1, 200, "seq"}' in source and "INT64_MAX" in source and "kDispatch" in source


def test_default_table_and_given_tables() -> None:
    problem = make_problem("attention", "f16", batch=1, heads=2, seq_q=1, head_dim=64, mask=True)
    table = default_table(problem, "sm_80", 512)
    assert not isinstance(table, str) and table[-1][0] == 512 and len(table) > 1
    assert [t for t, _ in table] == sorted(t for t, _ in table)
    unbounded = default_table(problem, "sm_80", None)
    assert not isinstance(unbounded, str) and unbounded[-1][0] is None
    assert bucket_of([(16, "a"), (64, "b"), (None, "c")], 1) == 0
    assert bucket_of([(16, "a"), (64, "b"), (None, "c")], 17) == 1
    assert bucket_of([(16, "a"), (64, "b"), (None, "c")], 10**6) == 2
    check_table([(16, {}), (None, {})], "n", "sm_80")
    for bad in ([], [(64, {}), (16, {})], [(None, {}), (16, {})], [(16, {}), (16, {})]):
        with pytest.raises(GtcoError, match="not ascending"):
            check_table(bad, "n", "sm_80")


def test_a_given_dispatch_table_is_used(bert16) -> None:
    nodes = fused_nodes(bert16)
    results, _ = bind_nodes(nodes)
    attn = next(n for n in nodes if n.family == "attention")
    binding = next(r.binding for r in results if r.node == attn.node.name)
    device = {attn.node.name: device_instances(attn, binding, ("sm_80",))}
    small, large = {"BQ": 64, "BKV": 32, "WARPS": 4, "STAGES": 2}, {"BQ": 128, "BKV": 64, "WARPS": 8, "STAGES": 2}
    given = {attn.node.name: {"sm_80": [(32, small), (200, large)]}}
    dyn = dynamic_nodes(nodes, [r for r in results if r.node == attn.node.name], ("sm_80",), device, RANGES, given)
    (table,) = dyn[attn.node.name].tables
    assert [(t, dict(i.config)) for t, i in table] == [(32, small), (200, large)]
    with pytest.raises(GtcoError, match="not ascending"):
        dynamic_nodes(nodes, results, ("sm_80",), device, RANGES, {attn.node.name: {"sm_80": [(200, small),
                                                                                                (32, large)]}})


def test_the_sm90a_slot_takes_the_sm90_table_or_its_one_cutlass_instance(bert16) -> None:
    from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
    from onnx_gtco.plugin.device import ARCH_SLOTS, device_problem

    nodes = fused_nodes(bert16)
    results, _ = bind_nodes(nodes)
    by_family = {n.node.name.split("/")[1]: (n, r) for n, r in zip(nodes, results, strict=True)
                 if not n.attrs.get("layernorm")}  # a LayerNorm GEMM has no CUTLASS mapping
    gemm_node, gemm_result = by_family["gemm"]
    problem = device_problem(gemm_node, gemm_result.binding)
    assert not isinstance(problem, str)
    config = GEMM.configs(problem, "sm_90a")[0]
    tuned = {gemm_node.node.name: {"sm_90a": config}}
    device, _ = select_device(nodes, results, ARCH_SLOTS, tuned)
    dyn = dynamic_nodes(nodes, results, ARCH_SLOTS, device, RANGES)
    attn = dyn[by_family["attention"][0].node.name]
    assert attn.tables[2] == attn.tables[1] and len(attn.tables[1]) > 1  # no sm_90a instance: the sm_90 table
    own = device[gemm_node.node.name][2]
    assert own.arch == "sm_90a" and own.config["impl"] == "cutlass"
    assert dyn[gemm_node.node.name].tables[2] == ((1600, own),)  # one CUTLASS instance takes every extent
    source, _, _ = generate_glue(nodes, results, bind_nodes(nodes)[1], device, False, dyn)
    assert own.symbol in source
