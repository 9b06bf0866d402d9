"""Dynamic shapes end to end: the built-in BERT encoder with symbolic batch and sequence, optimized once for a
declared range, runs every (batch, seq) inside it and refuses the shapes outside it.

One optimized model per precision, one library build of each kind: (a) the plugin's CPU path (host kernels) on
the fp32 rewrite, (b) the CPU emulation of the device kernels on the fp16 rewrite, which launches each dynamic
node's dispatch table entry for the call's run-time extent. Both are compared with the fp32 original on ORT at 30
seeded (batch, seq) pairs that include 1 and primes, and the launched dispatch entries are checked per pair
against the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from cpu_session import cpu_session

from onnx_gtco import optimize
from onnx_gtco.config import DYNAMIC_METADATA_KEY as DYNAMIC_KEY
from onnx_gtco.config import GtcoConfig, format_dynamic
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.models import build
from onnx_gtco.plugin.dispatch import bucket_of, launches
from onnx_gtco.plugin.library import LibraryResult, build_library

sys.path.insert(0, str(Path(__file__).parents[1] / "plugin"))
from test_device_path import fp16

RANGES = (("batch", 1, 3), ("seq", 1, 40))
SIZES = {"depth": 1, "dim": 64, "heads": 2, "mlp": 128}  # bert-tiny, narrower: the emulation runs every pair
PAIRS = 30
FORCED = [(1, 1), (3, 40), (1, 2), (3, 37), (2, 31), (3, 13), (1, 17), (2, 7)]  # 1, the tops, primes
PRIMES = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}
TOL_FP32 = 1e-4   # host kernels in fp32 vs the fp32 original (relative norm error)
TOL_FP16 = 5e-3   # device kernels in fp16 (emulated) vs the fp32 original, as tests/plugin/test_device_path.py


def pairs() -> list[tuple[int, int]]:
    """FORCED, then seeded random pairs from the declared ranges, 30 in all."""
    rng = np.random.default_rng(2026)
    (_, b_lo, b_hi), (_, s_lo, s_hi) = RANGES
    out = list(FORCED)
    while len(out) < PAIRS:
        p = (int(rng.integers(b_lo, b_hi + 1)), int(rng.integers(s_lo, s_hi + 1)))
        if p not in out:
            out.append(p)
    return out


def feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[0, (seq + 1) // 2:] = 0  # padding in the first sequence (none when seq is 1)
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    original = build("bert-tiny", batch="batch", seq="seq", seed=0, **SIZES)
    out: dict[str, object] = {"original": original, "ref": cpu_session(original, threads=2)}
    for kind, model in (("cpu", original), ("emu", fp16(original))):
        rewritten = optimize(model, GtcoConfig(dynamic=RANGES)).model  # writes the ranges into gtco.dynamic
        lib = build_library(rewritten, tmp_path_factory.mktemp(kind), cuda=False, emulated=kind == "emu")
        out[kind] = (rewritten, lib, cpu_session(rewritten, lib.path, threads=2))
    return out


def test_rewrite_keeps_the_symbolic_dims_and_the_ranges(built) -> None:
    original = built["original"]
    for kind in ("cpu", "emu"):
        rewritten, lib, _ = built[kind]
        for want, got in zip([*original.graph.input, *original.graph.output],
                             [*rewritten.graph.input, *rewritten.graph.output], strict=True):
            dims = [d.dim_param or d.dim_value for d in got.type.tensor_type.shape.dim]
            assert dims == [d.dim_param or d.dim_value for d in want.type.tensor_type.shape.dim], (kind, got.name)
        assert {p.key: p.value for p in rewritten.metadata_props}[DYNAMIC_KEY] == format_dynamic(RANGES)
        assert {"Attention_f16" if kind == "emu" else "Attention_f32", "Layernorm_f16" if kind == "emu"
                else "Layernorm_f32"} <= set(lib.op_types), lib.skipped()
    emu: LibraryResult = built["emu"][1]
    # Q, K and V: one Gemm (families/gemm/pack.py)
    assert {"Attention_f16", "Gemm_f16", "Layernorm_f16"} <= set(emu.cuda_op_types), emu.kernel_skips


def test_thirty_shapes_in_the_range_match_the_original(built) -> None:
    chosen = pairs()
    assert len(chosen) == PAIRS and (1, 1) in chosen
    assert len({s for _, s in chosen} & PRIMES) >= 5 and any(b in (2, 3) for b, _ in chosen)
    _, emu, emu_sess = built["emu"]
    tables = {n: t["sm_80"] for n, t in emu.dispatch.items()}
    multi = {n: t for n, t in tables.items() if len(t) > 1}
    assert multi, f"no dispatch table with more than one entry: {tables}"
    node, table = next((n, t) for n, t in multi.items() if n.startswith("gtco/attention/"))
    worst = {"cpu": 0.0, "emu": 0.0}
    entries = set()
    for i, (b, s) in enumerate(chosen):
        x = feeds(b, s, seed=i)
        want = built["ref"].run(None, x)[0]
        got_cpu = built["cpu"][2].run(None, x)[0]
        before = launches(emu.path)[node]
        got_emu = emu_sess.run(None, x)[0]
        after = launches(emu.path)[node]
        launched = [k for k, (a, c) in enumerate(zip(after, before, strict=True)) if a != c]
        assert launched == [bucket_of([(t, name) for t, name, _ in table], s)], (b, s, before, after, table)
        entries.update(launched)
        assert got_cpu.shape == got_emu.shape == want.shape == (b, s, SIZES["dim"])
        worst["cpu"] = max(worst["cpu"], rel_error(got_cpu, want))
        worst["emu"] = max(worst["emu"], rel_error(got_emu, want))
    assert worst["cpu"] < TOL_FP32 and worst["emu"] < TOL_FP16, worst
    assert len(entries) > 1, f"every pair launched the same entry of {node}'s table {table}"


@pytest.mark.parametrize(("b", "s", "dim"), [(1, 41, "seq"), (4, 8, "batch")])
@pytest.mark.parametrize("kind", ["cpu", "emu"])
def test_a_shape_outside_the_range_is_an_ort_error_naming_the_dim(built, kind: str, b: int, s: int,
                                                                  dim: str) -> None:
    with pytest.raises(Exception, match="outside the declared range") as err:
        built[kind][2].run(None, feeds(b, s, seed=0))
    bound = dict((n, f"{n}={lo}:{hi}") for n, lo, hi in RANGES)[dim]
    assert f"dim '{dim}' is {s if dim == 'seq' else b}" in str(err.value) and bound in str(err.value)
