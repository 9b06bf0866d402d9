#!/usr/bin/env python3
"""The GPU suite's calibration row: time, on this GPU and with our own instances, what the kernel-time estimate's
constants were never fitted to, and write it as calibration records (onnx_gtco.tune.fit's format), so that a refit
plans the rest of the run.

    python tools/calibrate.py measure --target h200 --out DIR [--stand-in] [--time-budget-s S] [--jobs N]
                                      [--max-cutlass N] [--provenance JSON]
    python tools/calibrate.py compare --target h200 --records DIR/records.json --refit DIR -o DIR/compare.json
    python tools/calibrate.py list [--target h200] [--max-cutlass N]

What `measure` times (fp16, every case one record; `list` prints them without a GPU or nvcc):

a. the small-M GEMM curve: M 128 and 197, (N, K) (768, 768), (2304, 768), (3072, 768), (768, 3072), with a bias
   (and bias + residual for N = 768): mma tiles 64x64x32 and 128x64x32 (2x2 warps, 4 stages) at split-K 1, 2, 4, 8
   where the family's check passes, our cuBLASLt instance at rank 0 (until now ORT's cuBLAS stood in for it), and
   at M = 197 CUTLASS's 128x128x64 cooperative persistent and 64x128 ping-pong tiles where the nvidia-cutlass
   headers are (bias only: at most --max-cutlass instances, 30-60 s of nvcc each; what is left out is listed as
   cut);
b. GEMM + LayerNorm fused against the pair, M 197 and 12608, N 768, K 768 and 3072, bias + residual: the fused mma
   instance beside the GEMM (its candidate the estimate predicts fastest) and the LayerNorm kernel;
c. a CUDA-graph chain of 64 LayerNorm nodes over [197, 768], optimized by onnx-gtco (--cuda) and timed with
   `onnx-gtco bench` (CUDA graphs, --profile) with programmatic dependent launch off (GTCO_PDL=0) and on: two model
   records (launches, pdl_launches) beside the kernel record of the same LayerNorm measured standalone, from which
   the fit gets launch.graph_gap_us and launch.pdl_overlap_us;
d. ViT-B/16's patch embedding (16x16 stride 16, 3 -> 768 channels, 224 px) at batch 1 and 64: our conv instance
   (the one the build selects) against families.conv.patchify's copy (the elementwise program of its rewrite) and the
   GEMM [N*196, 768] x [768, 768] with its bias (our cuBLASLt instance and the mma instance the estimate prefers);
e. not a record: the SM clock (pynvml, else nvidia-smi) before, during and after about 2 s of back-to-back batch-64
   GEMMs (cuBLAS through CuPy, ViT-B/16's fc1 at batch 64), and that GEMM's median time cold against sustained, to
   confirm or rule out a power / clock effect behind the 4-5 us per launch outside kernels ours showed at batch 64.

How: every instance is built on this machine with nvcc, --jobs at a time, the CUTLASS ones first (they take
longest); the cases are timed in the order that matters most first (our cuBLASLt instances, the fused pair, the
patch embedding, the chain and its benches, CUTLASS, the mma curve), each as soon as its build is done (a case whose
build is still running lets the next one go first), each by the GPU measurer
(tune.gpu.GpuMeasurer: in a child process, the first answer checked against the fp64 reference, CUDA events around
each launch queued behind a spin kernel, the median of its runs). A case that fails (its build, its answer, its
launch) is recorded with the reason and the rest go on; none starts after --time-budget-s (they are listed as cut).

--stand-in (the suite's dry run, no GPU): the same cases, a few of their instances compiled where nvcc is, and the
estimate's times (tune.analytical.estimate_us with the target's shipped calibration) as the records' times, each
record marked "stand_in"; the chain is planned (onnx-gtco inspect) and not run.

`compare` prices every record of a records file with the shipped calibration and with the refit (`onnx-gtco
calibration fit`'s output in --refit): what the suite's Markdown shows beside each measurement.

Writes DIR/records.json and DIR/measure.json (the cases, what was cut or failed, the chain, the clock), each
replaced atomically after every phase. Exit status: 0 records written, 1 none could be, 2 a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from onnx_gtco.calibration import SHIPPED_DIR, Hardware, hardware, load_calibration  # noqa: E402
from onnx_gtco.config import TARGETS  # noqa: E402
from onnx_gtco.errors import GtcoError  # noqa: E402
from onnx_gtco.families.conv.kernel import conv_problem  # noqa: E402
from onnx_gtco.families.conv.patchify import patchify_convs  # noqa: E402
from onnx_gtco.families.elementwise.kernel import FAMILY as ELEMENTWISE  # noqa: E402
from onnx_gtco.families.elementwise.kernel import program_from_onnx  # noqa: E402
from onnx_gtco.families.gemm import cublaslt, cutlass  # noqa: E402
from onnx_gtco.families.gemm.kernel import FAMILY as GEMM  # noqa: E402
from onnx_gtco.families.gemm.kernel import gemm_problem  # noqa: E402
from onnx_gtco.kernels.family import Instance, Problem  # noqa: E402
from onnx_gtco.kernels.select import candidates, fastest  # noqa: E402
from onnx_gtco.tune import fit  # noqa: E402
from onnx_gtco.tune.analytical import estimate_us  # noqa: E402
from onnx_gtco.tune.gpu import family_of  # noqa: E402

PARTS = ("gemm-curve", "gemm-layernorm", "patch-embed", "ln-chain")
"""The parts of the row (a case's `part`)."""
CURVE_M = (197, 128)
CURVE_NK = ((768, 768), (2304, 768), (3072, 768), (768, 3072))
CURVE_TILES = ({"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4},
               {"BM": 128, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 4})
CURVE_SPLITS = (1, 2, 4, 8)
CUTLASS_TILES = ((128, 128, "cooperative", "persistent"), (64, 128, "pingpong", "persistent"))
"""(TILE_M, TILE_N, SCHEDULE, TILE_SCHEDULER) of the CUTLASS configurations timed at a few tiles."""
MAX_CUTLASS = 2
"""CUTLASS instances built by default: each takes 30-60 s of nvcc, in parallel with everything else."""
LN_M = (197, 12608)
LN_K = (768, 3072)
HIDDEN = 768
EPSILON = 1e-6
PATCH_BATCHES = (1, 64)
CHAIN_LAYERS = 64
CHAIN_ROWS = 197
CHAIN_MODEL = f"ln-chain{CHAIN_LAYERS}"
REPS, WARMUP, ROTATE = 30, 5, 2
"""The measurer's timed runs, warm-up launches and input sets per case (two sets: a 197-row GEMM's operands stay
in L2 either way, and the host's inputs of the 12608-row ones take a second a set)."""
DRY_COMPILE = ("gemm-curve", "gemm-layernorm", "patch-embed")
"""A stand-in run compiles the first instance of each of these parts (mma, the fused GEMM + LayerNorm, the patchify
copy): the families the row adds to the dry run's other compiles."""
BENCH_RUNS = 200
CLOCK_GEMM = (12608, 3072, 768)
"""M, N, K of the clock probe's GEMM: ViT-B/16's fc1 at batch 64."""
CLOCK_LOAD_S = 2.0
CLOCK_IDLE_S = 1.0
"""The clock probe's idle second before the load (its cold launches come after it) and after it."""
TELLS = ("gemm.cutlass.extra_us", "elementwise.extra_us")
"""Constants with fit=False that these records tell (CUTLASS at a few tiles; the short patchify copy at batch 1)."""


# ------------------------------------------------------------------------------------------------------ cases


def _key(problem: Problem, instance: Instance) -> str:
    return f"{instance.name} @ " + " ".join(f"{k}={v}" for k, v in problem.sizes)


@dataclass(frozen=True)
class Case:
    """One kernel to time and the record it makes.

    Attributes:
        part: one of PARTS.
        model: the record's model name (a model record adds the kernel records of its model).
        batch: the record's batch.
        problem: the kernel Problem (fp16).
        config: the configuration (an mma tile, {"impl": "cublaslt", "RANK": 0}, a CUTLASS one, ...).
        arch: the arch the instance is built for (sm_90a for CUTLASS).
        label: what the record's "kernel" says.
        count: calls per forward the record counts (the chain: one per LayerNorm node).
        role: its place in a comparison ("fused", "gemm", "layernorm", "conv", "copy"), else "".
    """

    part: str
    model: str
    batch: int
    problem: Problem
    config: Mapping[str, Any] = field(compare=False)
    arch: str
    label: str
    count: int = 1
    role: str = ""

    @functools.cached_property
    def instance(self) -> Instance:
        return family_of(self.problem).instantiate(self.problem, dict(self.config), self.arch)

    @functools.cached_property
    def key(self) -> str:
        """What identifies the measurement: the instance on the problem's sizes (one instance serves several)."""
        return _key(self.problem, self.instance)

    @property
    def impl(self) -> str:
        return str(self.config.get("impl", "mma")) if self.problem.family == "gemm" else self.problem.family


@dataclass(frozen=True)
class Comparison:
    """One kernel against the kernels it replaces: the sum of `fused`'s times against the fastest sum of `split`'s
    alternatives (each a list of case keys)."""

    what: str
    fused: tuple[str, ...]
    split: tuple[tuple[str, ...], ...]

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "fused": list(self.fused), "split": [list(s) for s in self.split]}


@dataclass
class Plan:
    """The row's cases in timing order, its comparisons, and what was cut (with why)."""

    cases: list[Case] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    cut: list[dict[str, str]] = field(default_factory=list)

    def add(self, case: Case) -> Case:
        self.cases.append(case)
        return case


def _fastest(problem: Problem, arch: str, configs: Iterable[Mapping[str, Any]], hw: Hardware) -> dict[str, Any]:
    """The configuration the estimate predicts fastest on `hw` (kernels.select.fastest, the build's rule)."""
    pick = fastest(problem, arch, list(configs), hw)
    if pick is None:
        raise GtcoError(f"{problem.family} {dict(problem.sizes)}: no configuration passes the family's check on {arch}")
    return pick[0]


def _tile_label(config: Mapping[str, Any]) -> str:
    if config.get("impl") == cublaslt.IMPL:
        return f"cuBLASLt rank {config['RANK']}"
    if config.get("impl") == cutlass.IMPL:
        return (f"CUTLASS {config['TILE_M']}x{config['TILE_N']}x{config['TILE_K']} {config['SCHEDULE']} "
                f"{config['TILE_SCHEDULER']}")
    if "BM" in config:
        split = int(config.get("SPLITK", 1))
        return (f"mma {config['BM']}x{config['BN']}x{config['BK']} w{config['WM']}x{config['WN']} "
                f"s{config['STAGES']}" + (f" sk{split}" if split > 1 else "") + (" es" if config.get("EPI") else "")
                + ("" if config.get("VEC", 1) else " sc"))
    return " ".join(f"{k}={v}" for k, v in config.items())


def _gemm_label(p: Problem) -> str:
    epi = "+".join(x for x in ("bias" if p.flag("bias") else "", "res" if p.flag("residual") else "",
                               "ln" if p.flag("layernorm") else "") if x)
    return f"gemm {p.size('M')}x{p.size('N')}x{p.size('K')} {epi}"


def cutlass_configs(problem: Problem) -> list[dict[str, Any]]:
    """The CUTLASS configurations of CUTLASS_TILES that pass their check for `problem` (none without the headers)."""
    offered = [{"impl": cutlass.IMPL, **c} for c in cutlass.configs(problem, cutlass.ARCH)]
    out = []
    for tm, tn, schedule, scheduler in CUTLASS_TILES:
        out += [c for c in offered if (c["TILE_M"], c["TILE_N"], c["SCHEDULE"], c["TILE_SCHEDULER"], c["CLUSTER_M"],
                                       c["CLUSTER_N"]) == (tm, tn, schedule, scheduler, 1, 1)][:1]
    return out


def build_plan(target: str, max_cutlass: int = MAX_CUTLASS) -> Plan:
    """Every kernel case of parts a, b and d (the chain's come from its plan: chain_cases), in timing order, with
    the comparisons and what was cut. Pure: no GPU, no nvcc.

    Raises:
        GtcoError: an unknown target.
    """
    if target not in TARGETS:
        raise GtcoError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    arch = TARGETS[target].arch
    hw = hardware(target)
    plan = Plan()
    curve: list[tuple[Problem, int]] = []
    for m in CURVE_M:
        for n, k in CURVE_NK:
            curve.append((gemm_problem("f16", 1, m, n, k, bias=True), m))
            if n == HIDDEN:
                curve.append((gemm_problem("f16", 1, m, n, k, bias=True, residual=True), m))
    lt = [Case("gemm-curve", "gemm-small-m", 1, p, {"impl": cublaslt.IMPL, "RANK": 0}, arch,
               _label(p, {"impl": cublaslt.IMPL, "RANK": 0})) for p, _ in curve]
    mma = []
    for p, _ in curve:
        for tile in CURVE_TILES:
            for split in CURVE_SPLITS:
                config = {**tile, "VEC": 1, "SPLITK": split}
                why = GEMM.check(p, config, arch)
                if why is None:
                    mma.append(Case("gemm-curve", "gemm-small-m", 1, p, config, arch, _label(p, config)))
                else:
                    plan.cut.append({"case": _label(p, config), "why": why})
    cutlass_all: list[Case] = []
    if arch == cutlass.TARGET and not isinstance(cutlass.include_dirs(), str):
        for p, m in curve:
            for config in cutlass_configs(p) if m == 197 else ():
                cutlass_all.append(Case("gemm-curve", "gemm-small-m", 1, p, config, cutlass.ARCH, _label(p, config)))
    elif arch == cutlass.TARGET:
        plan.cut.append({"case": "CUTLASS at a few tiles", "why": str(cutlass.include_dirs())})
    built: list[str] = []
    cutlass_cases = []
    for c in cutlass_all:  # at most max_cutlass instances: the first flags' (bias), each configuration once
        name = c.instance.name
        if name in built or len(built) < max_cutlass:
            built += [name] if name not in built else []
            cutlass_cases.append(c)
        else:
            plan.cut.append({"case": c.label, "why": f"at most {max_cutlass} CUTLASS instances (30-60 s of nvcc "
                                                     "each) fit the row"})
    for c in lt:
        plan.add(c)
    for m in LN_M:
        for k in LN_K:
            fused = gemm_problem("f16", 1, m, HIDDEN, k, bias=True, residual=True, layernorm=True, epsilon=EPSILON)
            pair = gemm_problem("f16", 1, m, HIDDEN, k, bias=True, residual=True)
            ln = Problem.make("layernorm", "f16", {"hidden": HIDDEN, "rows": m},
                              {"residual": False, "residual_out": False, "gamma": True, "beta": True,
                               "epsilon": EPSILON})
            keys = []
            for role, p in (("fused", fused), ("gemm", pair), ("layernorm", ln)):
                config = _fastest(p, arch, candidates(p, arch), hw)
                keys.append(plan.add(Case("gemm-layernorm", "gemm-layernorm", 1, p, config, arch,
                                          f"M{m} K{k} {role}: {_label(p, config)}", role=role)).key)
            plan.comparisons.append(Comparison(f"GEMM + LayerNorm M{m} K{k}: fused / pair", (keys[0],),
                                               ((keys[1], keys[2]),)))
    for n in PATCH_BATCHES:
        conv = conv_problem("f16", n, 3, 224, 224, HIDDEN, 16, 16, stride=(16, 16), bias=True)
        copy = patchify_copy(n)
        gemm = gemm_problem("f16", 1, n * 196, HIDDEN, HIDDEN, bias=True)
        copy_config = _fastest_elementwise(copy, arch, hw)
        model = "vit-b16-patch-embed"
        conv_config = _fastest(conv, arch, candidates(conv, arch), hw)
        mma_config = _fastest(gemm, arch, candidates(gemm, arch, impls={"mma"}), hw)
        conv_key = plan.add(Case("patch-embed", model, n, conv, conv_config, arch,
                                 f"b{n} conv 16x16/16: {_tile_label(conv_config)}", role="conv")).key
        copy_key = plan.add(Case("patch-embed", model, n, copy, copy_config, arch,
                                 f"b{n} patchify copy [{n}, 196, 768]: {_tile_label(copy_config)}", role="copy")).key
        gemm_keys = [plan.add(Case("patch-embed", model, n, gemm, config, arch,
                                   f"b{n} {_label(gemm, config)}", role="gemm")).key
                     for config in ({"impl": cublaslt.IMPL, "RANK": 0}, mma_config)]
        plan.comparisons.append(Comparison(f"patch embedding b{n}: conv / patchify copy + GEMM", (conv_key,),
                                           tuple((copy_key, g) for g in gemm_keys)))
    plan.cases += cutlass_cases + mma  # CUTLASS ahead of the curve: timed as soon as its long builds are done
    return plan


def _label(p: Problem, config: Mapping[str, Any]) -> str:
    if p.family == "gemm":
        return f"{_gemm_label(p)}: {_tile_label(config)}" + (" (ours)" if config.get("impl") == cublaslt.IMPL else "")
    if p.family == "layernorm":
        return f"layernorm {p.size('rows')}x{p.size('hidden')}: {_tile_label(config)}"
    return f"{p.family}: {_tile_label(config)}"


def _fastest_elementwise(problem: Problem, arch: str, hw: Hardware) -> dict[str, Any]:
    configs = ELEMENTWISE.configs(problem, arch)
    return dict(min(configs, key=lambda c: ELEMENTWISE.estimate_us(problem, c, hw)))


def patchify_copy(batch: int) -> Problem:
    """The elementwise Problem of ViT-B/16's patch embedding at `batch` as patchify_convs rewrites it: a one-conv
    model (16x16 stride 16, 3 -> 768 channels, 224 px) through the rewrite, and the program (the elementwise
    binder's program_from_onnx) of the layout ops the rewrite puts before the GEMM, x -> patches [N, 196, 768]."""
    n = batch
    w = numpy_helper.from_array(np.zeros((HIDDEN, 3, 16, 16), np.float32), "w")
    b = numpy_helper.from_array(np.zeros((HIDDEN,), np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[16, 16], strides=[16, 16], name="embed")],
        "patch-embed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 3, 224, 224])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, HIDDEN, 14, 14])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rewritten, convs = patchify_convs(model)
    if len(convs) != 1:
        raise GtcoError("families.conv.patchify did not rewrite the 16x16 stride-16 conv")
    layout_ops = []
    for node in rewritten.graph.node:
        if node.op_type == "MatMul":
            break
        layout_ops.append(node)
    consts = {t.name: numpy_helper.to_array(t) for t in rewritten.graph.initializer}
    used = {i for node in layout_ops for i in node.input}
    program = program_from_onnx(layout_ops, {"x": [n, 3, 224, 224]}, [layout_ops[-1].output[0]],
                                {k: v for k, v in consts.items() if k in used})
    return program.problem("f16")


def chain_model(layers: int = CHAIN_LAYERS, rows: int = CHAIN_ROWS, hidden: int = HIDDEN) -> onnx.ModelProto:
    """`layers` LayerNormalization nodes in a chain over [1, rows, hidden], fp32 as users export (optimize
    --precision fp16 converts it): one fused node, one kernel each, every one after the first reading ours."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    prev = "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), f"g{i}"),
                  numpy_helper.from_array((0.1 * rng.standard_normal(hidden)).astype(np.float32), f"b{i}")]
        out = "y" if i == layers - 1 else f"t{i}"
        nodes.append(helper.make_node("LayerNormalization", [prev, f"g{i}", f"b{i}"], [out], name=f"ln{i}", axis=-1,
                                      epsilon=EPSILON))
        prev = out
    graph = helper.make_graph(nodes, CHAIN_MODEL,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, rows, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def chain_cases(report: Mapping[str, Any], target: str) -> list[Case]:
    """The kernel cases of the chain's plan (an optimize or inspect report of chain_model): one per distinct
    LayerNorm instance its groups run, counted once per group, at CHAIN_ROWS rows.

    Raises:
        GtcoError: a group without a device kernel, or of another family (the chain did not plan as expected).
    """
    arch = TARGETS[target].arch
    dtype = {"fp16": "f16", "bf16": "bf16"}.get(str(report.get("precision")), "f32")
    seen: dict[tuple[Problem, tuple[tuple[str, Any], ...]], int] = {}
    for g in report.get("groups") or ():
        kernel = g.get("kernel")
        if g.get("family") != "layernorm" or not kernel:
            what = f"is a {g.get('family')} group" if g.get("family") != "layernorm" else "has no device kernel"
            raise GtcoError(f"the chain's group {g.get('name')} {what}: expected one LayerNorm kernel per node")
        attrs = g.get("attrs") or {}
        res, affine = bool(attrs.get("residual")), bool(attrs.get("affine", True))
        problem = Problem.make("layernorm", dtype, {"hidden": int(attrs["hidden"]), "rows": CHAIN_ROWS},
                               {"residual": res, "residual_out": res, "gamma": affine, "beta": affine,
                                "epsilon": attrs.get("epsilon", EPSILON)})
        key = (problem, tuple(sorted(kernel["config"].items())))
        seen[key] = seen.get(key, 0) + 1
    if not seen:
        raise GtcoError("the chain's plan has no group: expected one LayerNorm kernel per node")
    return [Case("ln-chain", CHAIN_MODEL, 1, p, dict(cfg), arch,
                 f"layernorm {CHAIN_ROWS}x{p.size('hidden')}: {_tile_label(dict(cfg))} (x{n} in the chain)", n)
            for (p, cfg), n in seen.items()]


def chain_launches(report: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The chain's launches as its plan counts them (report "launches": ours, those after one of ours) and, where
    the report has the built library, the nodes that launch with PDL on `arch` (plugin.pdl)."""
    launches = report.get("launches") or {}
    lib = report.get("library") or {}
    pdl = lib.get("pdl")
    return {"launches": int(launches.get("ours", 0)), "after_ours": int(launches.get("after_ours", 0)),
            "pdl_nodes": None if pdl is None else sum(arch in archs for archs in pdl.values())}


# ------------------------------------------------------------------------------------------------------ records


def problem_json(p: Problem) -> dict[str, Any]:
    """A Problem as the records hold it (fit.load_records reads it back)."""
    return {"family": p.family, "dtype": p.dtype, "sizes": dict(p.sizes), "flags": dict(p.flags)}


def kernel_record(case: Case, result: Mapping[str, Any], prov: Mapping[str, Any]) -> dict[str, Any]:
    """The record of a timed case: our kernel ("gtco" side, a cuBLASLt instance included: no proxy), its problem
    counted `case.count` times per forward, with the provenance of every record."""
    rec = {**_source(prov), "model": case.model, "batch": case.batch, "side": "gtco", "family": case.problem.family,
           "config": dict(case.config), "problems": [{"count": case.count, "problem": problem_json(case.problem)}],
           "calls": case.count, "us_per_forward": round(case.count * float(result["us"]), 4), "kernel": case.label,
           "proxy": None, "case": case.key, "part": case.part}
    if result.get("spread_us") is not None:
        rec["spread_us"] = round(float(result["spread_us"]), 4)
    if result.get("stand_in"):
        rec["stand_in"] = True
    return rec


def model_record(chain: Mapping[str, Any], pdl: bool, prov: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chain's model record with programmatic dependent launch on or off, or None where that run has no time in
    a CUDA graph replay. `chain[pdl and "on" or "off"]` holds the run: measured_ms, launches, pdl_launches,
    unrecorded_kernel_us (and the profile's kernel time where there was one)."""
    run = chain.get("on" if pdl else "off") or {}
    if run.get("measured_ms") is None:
        return None
    rec = {**_source(prov), "model": CHAIN_MODEL, "batch": 1, "precision": "fp16", "cuda_graph": True,
           "measured_ms": round(float(run["measured_ms"]), 6), "launches": int(run["launches"]),
           "pdl_launches": int(run["pdl_launches"]) if pdl else 0,
           "unrecorded_kernel_us": round(float(run.get("unrecorded_kernel_us", 0.0)), 3), "pdl": pdl}
    for key in ("profiled_kernel_us", "ort_fp16_ms", "command"):
        if run.get(key) is not None:
            rec[key] = run[key]
    if run.get("stand_in"):
        rec["stand_in"] = True
    return rec


def _source(prov: Mapping[str, Any]) -> dict[str, Any]:
    return {"run": prov["run"], "commit": prov["commit"], "gpu": prov["gpu"], "driver": prov["driver"],
            "cuda": prov["cuda"], "date": prov["date"], **({"onnxruntime": prov["onnxruntime"]}
                                                           if prov.get("onnxruntime") else {})}


def records_doc(target: str, prov: Mapping[str, Any], cases: Sequence[Case], results: Mapping[str, Any],
                chain: Mapping[str, Any], stand_in: bool) -> dict[str, Any]:
    """The records file: a kernel record per timed case (once per measurement, but for counted ones: the chain's
    kernels), the chain's model records, and the constants with fit=False the records tell (TELLS, where a record
    of their kind is there)."""
    kernels, seen = [], set()
    for case in cases:
        res = results.get(case.key) or {}
        if res.get("us") is None or (case.count == 1 and case.key in seen):
            continue
        seen.add(case.key)
        kernels.append(kernel_record(case, res, prov))
    chain_timed = bool(chain.get("kernels")) and not chain.get("mismatch") and all(
        (results.get(k["key"]) or {}).get("us") is not None for k in chain["kernels"])
    models = [m for m in (model_record(chain, False, prov), model_record(chain, True, prov))
              if m is not None and chain_timed]  # a model record adds its kernels' records: they must be there
    told = {"gemm.cutlass.extra_us": any(k["config"].get("impl") == cutlass.IMPL for k in kernels),
            "elementwise.extra_us": any(k["family"] == "elementwise" for k in kernels)}
    return {"format": fit.FORMAT, "gpu": prov["gpu"], "target": target, "stand_in": stand_in,
            "source": ("tools/gpu_suite's calibration row (tools/calibrate.py measure): our own instances, built "
                       "here and timed by the GPU measurer (CUDA events, queued), and a chain of 64 LayerNorm kernels "
                       "in a CUDA graph with and without PDL (onnx-gtco bench)" if not stand_in else
                       "a dry run's stand-ins: the cases of tools/calibrate.py with the estimate's times (no GPU)"),
            "tells": [t for t in TELLS if told[t]], "kernels": kernels, "models": models}


def provenance(raw: Mapping[str, Any], stand_in: bool, target: str) -> dict[str, Any]:
    """Every record's provenance: GPU, driver, CUDA, the checkout's commit, the date, and the run's id; what the
    suite passes, the rest filled in (a stand-in run names its GPU so that no record passes for a measurement)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    raw = dict(raw)
    if not stand_in and not raw.get("gpu"):  # run on its own: nvidia-smi names the GPU and its driver
        smi = shutil.which("nvidia-smi")
        out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=False).stdout if smi else ""
        fields = [f.strip() for f in (out.strip().splitlines() or [""])[0].split(",")]
        if len(fields) == 2 and fields[0]:
            raw.setdefault("driver", fields[1])
            raw["gpu"] = fields[0]
    gpu = raw.get("gpu") or (f"stand-in for {target} (dry run, no GPU)" if stand_in else None)
    if gpu is None:
        raise GtcoError("no GPU to name in the records: --provenance gives none and nvidia-smi finds none")
    return {"gpu": str(gpu), "driver": str(raw.get("driver") or "-"), "cuda": str(raw.get("cuda") or "-"),
            "commit": str(raw.get("commit") or "-"), "date": str(raw.get("date") or now.strftime("%Y-%m-%d")),
            "run": str(raw.get("run") or ("dry-" if stand_in else "calib-") + now.strftime("%Y%m%d-%H%M")),
            **({"onnxruntime": str(raw["onnxruntime"])} if raw.get("onnxruntime") else {})}


def chain_summary(chain: Mapping[str, Any], kernel_us: float) -> dict[str, Any]:
    """What the chain says without a fit: the gap per launch outside the kernels with PDL off ((graph time - the
    standalone kernels - the unrecorded ones) / launches) and what PDL hides per dependent launch ((off - on) /
    pdl_launches), in microseconds; None where a run is missing."""
    off, on = chain.get("off") or {}, chain.get("on") or {}
    out: dict[str, Any] = {"kernel_us": round(kernel_us, 3), "gap_us_per_launch": None, "pdl_hides_us": None}
    if off.get("measured_ms") is not None and off.get("launches"):
        out["gap_us_per_launch"] = round((off["measured_ms"] * 1e3 - kernel_us - off.get("unrecorded_kernel_us", 0.0))
                                         / off["launches"], 3)
    if off.get("measured_ms") is not None and on.get("measured_ms") is not None and on.get("pdl_launches"):
        out["pdl_hides_us"] = round((off["measured_ms"] - on["measured_ms"]) * 1e3 / on["pdl_launches"], 3)
    return out


def write_json(path: Path, doc: Any) -> None:
    """Write JSON so that a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------------------------ measure


class Run:
    """One `measure`: the plan, what each case measured or why not, the chain and the clock; saved after every phase
    (records.json and measure.json) so that a run cut off keeps what it measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.time_budget_s
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.target, self.stand_in, self.jobs = args.target, args.stand_in, args.jobs
        self.arch = TARGETS[self.target].arch
        self.prov = provenance(json.loads(args.provenance or "{}"), self.stand_in, self.target)
        self.plan = build_plan(self.target, args.max_cutlass)
        self.results: dict[str, dict[str, Any]] = {}
        self.chain: dict[str, Any] = {}
        self.clock: dict[str, Any] = {}
        self.notes: list[str] = []
        self.compiled: dict[str, str] = {}
        self.chain_path = self.out / "chain" / f"{CHAIN_MODEL}.onnx"
        self.lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    def save(self) -> int:
        """records.json and measure.json as they stand; the number of kernel records."""
        with self.lock:
            doc = records_doc(self.target, self.prov, self.plan.cases, self.results, self.chain, self.stand_in)
            write_json(self.out / "records.json", doc)
            failed = [{"case": c.label, "key": c.key, "why": self.results[c.key]["error"]}
                      for c in self.plan.cases if (self.results.get(c.key) or {}).get("error")]
            counts: dict[str, int] = {}
            for k in doc["kernels"]:
                kind = f"{k['family']} {k['config'].get('impl', 'mma')}" if k["family"] == "gemm" else k["family"]
                if k["family"] == "gemm" and k["problems"][0]["problem"]["flags"].get("layernorm"):
                    kind = "gemm+layernorm mma"
                counts[kind] = counts.get(kind, 0) + 1
            measure = {"target": self.target, "arch": self.arch, "stand_in": self.stand_in, "provenance": self.prov,
                       "seconds": round(time.monotonic() - self.t0, 1), "cases": len(self.plan.cases),
                       "timed": len(doc["kernels"]), "models": len(doc["models"]), "counts": counts,
                       "cut": self.plan.cut, "failed": failed, "compiled": self.compiled,
                       "comparisons": self._comparisons(), "chain": self.chain, "clock": self.clock,
                       "notes": self.notes, "tells": doc["tells"],
                       "results": {c.key: {"part": c.part, "label": c.label, **self.results.get(c.key, {})}
                                   for c in self.plan.cases}}
            write_json(self.out / "measure.json", measure)
            return len(doc["kernels"])

    def _comparisons(self) -> list[dict[str, Any]]:
        def total(keys: Sequence[str]) -> float | None:
            got = [(self.results.get(k) or {}).get("us") for k in keys]
            return None if any(v is None for v in got) else float(sum(got))  # type: ignore[arg-type]

        out = []
        for c in self.plan.comparisons:
            fused = total(c.fused)
            splits = [s for s in (total(keys) for keys in c.split) if s is not None]
            split = min(splits) if splits else None
            out.append({**c.to_json(), "fused_us": fused, "split_us": split,
                        "ratio": None if fused is None or not split else round(fused / split, 4)})
        return out

    # ---------------------------------------------------------------------------------------------- the chain

    def plan_chain(self) -> None:
        """Write the chain model and plan it (onnx-gtco inspect, seconds): its kernel cases join the plan after the
        patch embedding's, its launches are the plan's. A chain that cannot be planned is said in measure.json and
        costs the run its model records only."""
        path = self.chain_path
        path.parent.mkdir(exist_ok=True)
        onnx.save(chain_model(), str(path.with_suffix(".tmp")))
        os.replace(path.with_suffix(".tmp"), path)
        try:
            proc = subprocess.run([sys.executable, "-m", "onnx_gtco", "inspect", str(path), "--target", self.target,
                                   "--precision", "fp16", "--json"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=max(10.0, min(120.0, self.left())), check=False)
            if proc.returncode != 0:
                raise GtcoError(f"onnx-gtco inspect: exit {proc.returncode}: {_last_line(proc.stderr)}")
            self.add_chain(json.loads(proc.stdout))
        except (GtcoError, ValueError, subprocess.TimeoutExpired) as e:
            self.chain["failed"] = f"planning the chain: {_last_line(str(e))}"
            self.notes.append(self.chain["failed"])

    def add_chain(self, report: Mapping[str, Any]) -> None:
        """The chain's kernel cases (chain_cases of its plan) into the plan, after the patch embedding's; its launches
        as planned."""
        cases = chain_cases(report, self.target)
        at = max((i for i, c in enumerate(self.plan.cases) if c.part in ("patch-embed", "gemm-layernorm")),
                 default=-1) + 1
        self.plan.cases[at:at] = cases
        self.chain.update({"model": str(self.chain_path), "layers": CHAIN_LAYERS,
                           "rows": CHAIN_ROWS, "kernels": [{"key": c.key, "count": c.count} for c in cases],
                           "plan": chain_launches(report, self.arch)})

    def chain_kernel_us(self) -> float | None:
        """The chain's kernels per forward as measured standalone (None where one is missing)."""
        got = [((self.results.get(k["key"]) or {}).get("us"), k["count"]) for k in self.chain.get("kernels", ())]
        if not got or any(us is None for us, _ in got):
            return None
        return float(sum(us * n for us, n in got))

    def stand_in_chain(self, hw: Hardware) -> None:
        """The chain's model records with the estimate's times: its kernels, a graph gap per launch, less what PDL
        hides of it after one of ours (what fit.predict_model computes)."""
        from onnx_gtco.calibration import LaunchConstants

        launch = hw.constants(LaunchConstants)
        kernel_us = self.chain_kernel_us()
        if kernel_us is None:
            return
        plan = self.chain["plan"]
        for pdl in (False, True):
            dependent = plan["after_ours"] if pdl else 0
            us = kernel_us + plan["launches"] * launch.graph_gap_us - dependent * min(launch.pdl_overlap_us,
                                                                                      launch.graph_gap_us)
            self.chain["on" if pdl else "off"] = {"measured_ms": us / 1e3, "launches": plan["launches"],
                                                  "pdl_launches": dependent, "unrecorded_kernel_us": 0.0,
                                                  "stand_in": True}
        self.chain["summary"] = chain_summary(self.chain, kernel_us)

    def optimize_chain(self) -> subprocess.CompletedProcess[str] | str:
        """The chain optimized for the GPU (--cuda): the library the bench runs (called in a thread, beside the
        kernel builds); the finished process, or why it did not run."""
        rewritten = self.chain_path.with_name(f"{CHAIN_MODEL}.gtco.onnx")
        try:
            return subprocess.run([sys.executable, "-m", "onnx_gtco", "optimize", str(self.chain_path), "-o",
                                   str(rewritten), "--target", self.target, "--precision", "fp16", "--cuda", "-q"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=max(10.0, self.left()), check=False)
        except subprocess.TimeoutExpired:
            return "timed out"

    def bench_chain(self, pdl: bool, optimized: Future[Any]) -> None:
        """`onnx-gtco bench` of the optimized chain with CUDA graphs and --profile, GTCO_PDL=1 or 0: its median in a
        graph replay, the profiled launches, the kernels no record describes, and the PDL launches (the library's
        nodes that launch with PDL on this arch, else the plan's count)."""
        side = "on" if pdl else "off"
        if "plan" not in self.chain:
            self.chain[side] = {"skipped": self.chain.get("failed", "the chain was not planned")}
            return
        if pdl and os.environ.get("GTCO_PDL") == "0":
            self.chain[side] = {"skipped": "PDL is off for this run (GTCO_PDL=0: the smoke row found the device "
                                           "kernels wrong with it, or --no-pdl)"}
            return
        try:
            proc = optimized.result(timeout=max(1.0, self.left()))
        except FutureTimeout:
            self.chain[side] = {"skipped": "the chain's optimize did not finish within the time budget"}
            return
        if isinstance(proc, str) or proc.returncode != 0:
            why = proc if isinstance(proc, str) else f"exit {proc.returncode}: {_last_line(proc.stderr)}"
            self.chain[side] = {"failed": f"optimize: {why}"}
            return
        rewritten = self.chain_path.with_name(f"{CHAIN_MODEL}.gtco.onnx")
        try:
            report = json.loads(rewritten.with_name(rewritten.name + ".report.json").read_text())
        except (OSError, ValueError) as e:
            self.chain[side] = {"failed": f"optimize wrote no readable report ({e})"}
            return
        launches = chain_launches(report, self.arch)
        self.chain["built"] = launches
        built = {str(k.get("instance")) for k in (report.get("library") or {}).get("kernels") or ()
                 if k.get("arch") == self.arch}
        timed = {k["key"].split(" @ ")[0] for k in self.chain.get("kernels", ())}
        if built and not timed <= built:  # the library runs other kernels than those timed alone: no model record
            self.chain["mismatch"] = (f"the library built {', '.join(sorted(built))} for {self.arch}; the chain's "
                                      f"plan timed {', '.join(sorted(timed))}")
            self.notes.append(self.chain["mismatch"])
        out = self.out / "chain" / f"bench-pdl-{side}"
        cmd = [sys.executable, "-m", "onnx_gtco", "bench", str(self.chain_path), "--rewritten", str(rewritten),
               "--provider", "cuda", "--batch", "1", "--precision", "fp16", "--target", self.target, "--baselines",
               "ort-fp16" if not pdl else ",", "--runs", str(BENCH_RUNS), "--warmup", "20", "--profile", "--out",
               str(out), "-q"]
        env = {**os.environ, "GTCO_PDL": "1" if pdl else "0"}
        self.log(f"bench of the chain, PDL {side}")
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(10.0, self.left()), check=False)
        except subprocess.TimeoutExpired:
            self.chain[side] = {"failed": "bench: timed out"}
            return
        if proc.returncode != 0:
            self.chain[side] = {"failed": f"bench: exit {proc.returncode}: {_last_line(proc.stderr)}"}
            return
        self.chain[side] = bench_run(json.loads((out / "bench.json").read_text()), pdl, launches)
        self.chain[side]["command"] = " ".join(cmd[1:])

    # ---------------------------------------------------------------------------------------------- kernels

    def compile_some(self) -> None:
        """A stand-in run: build the first instance of each part of DRY_COMPILE (compile-only, as the kernels rows'
        dry run), where nvcc is."""
        if shutil.which(os.environ.get("NVCC", "nvcc")) is None:
            self.compiled["skipped"] = "nvcc not found"
            return
        picks = [next(c for c in self.plan.cases if c.part == part and c.impl in ("mma", "elementwise"))
                 for part in DRY_COMPILE]
        with ThreadPoolExecutor(max_workers=max(1, min(self.jobs, len(picks)))) as pool:
            built = list(pool.map(lambda c: _build(c.instance), picks))
        for case, lib in zip(picks, built, strict=True):
            self.compiled[case.instance.name] = "ok" if isinstance(lib, Path) else lib

    def stand_in_times(self, hw: Hardware) -> None:
        for case in self.plan.cases:
            self.results[case.key] = {"us": estimate_us(case.problem, case.config, case.arch, hw), "stand_in": True}

    def measure_all(self) -> None:
        """Build every instance (CUTLASS first, --jobs at a time) and time the cases in plan order, each as soon as
        its build is done: the first pending case whose build has finished goes next, so a slow build (CUTLASS)
        holds up nothing behind it; with none finished, the first pending one is waited for. The chain's two benches
        run once its kernels are timed and its optimize has finished (else after the last case), then the clock
        probe. What the time budget leaves out is cut."""
        from onnx_gtco.tune.builder import Artifact
        from onnx_gtco.tune.gpu import GpuMeasurer
        from onnx_gtco.tune.tasks import Task, template_version

        version = template_version()
        order = sorted({c.instance.name: c.instance for c in self.plan.cases}.values(),
                       key=lambda i: i.config.get("impl") != cutlass.IMPL)  # stable: CUTLASS first, then plan order
        futures = in_background([(_build, (i,)) for i in order], self.jobs)
        builds = {i.name: f for i, f in zip(order, futures, strict=True)}
        optimized = in_background([(self.optimize_chain, ())], 1)[0]
        chain_keys = {c.key for c in self.plan.cases if c.part == "ln-chain"}
        benched = False
        try:
            measurer = GpuMeasurer(reps=REPS, warmup=WARMUP, rotate=ROTATE, isolate=True, queued=True)
        except RuntimeError as e:  # no CuPy, no CUDA device, an unsupported GPU: no case can be timed
            measurer, broken = None, f"the GPU measurer cannot run here: {e}"
        else:
            broken = ""
            self.prov["gpu_measured"] = measurer.device
        pending = list(self.plan.cases)
        try:
            while pending:
                if not benched and optimized.done() and chain_keys <= set(self.results):
                    benched = self.bench_both(optimized)
                if broken or self.left() <= 0:
                    why = broken or "the time budget was spent (--time-budget-s)"
                    self.plan.cut += [{"case": c.label, "why": why} for c in pending if c.key not in self.results]
                    break
                case = next((c for c in pending if builds[c.instance.name].done()), pending[0])
                pending.remove(case)
                if case.key in self.results:
                    continue
                try:
                    lib = builds[case.instance.name].result(timeout=max(0.1, self.left()))
                except FutureTimeout:
                    self.plan.cut.append({"case": case.label, "why": "its build did not finish within the time budget"})
                    continue
                if isinstance(lib, str):
                    self.results[case.key] = {"us": None, "error": f"build: {lib}"}
                    continue
                assert measurer is not None
                task = Task(case.problem, self.arch, version)
                try:
                    got = measurer.run(task, dict(case.config), Artifact(str(lib), case.instance.symbol))
                except GtcoError as e:  # the measuring process cannot start: nothing after this case can be timed
                    broken = f"the measuring process does not start: {e}"
                    self.results[case.key] = {"us": None, "error": broken}
                    continue
                self.results[case.key] = ({"us": got.median_us, "spread_us": got.spread_us, "runs": got.runs}
                                          if got.error_kind is None else
                                          {"us": None, "error": f"{got.error_kind}: {_last_line(got.detail)}"})
                self.log(f"{case.label}: " + (f"{got.median_us:.2f} us" if got.error_kind is None
                                              else self.results[case.key]["error"]))
            if not benched:
                self.bench_both(optimized)
            self.save()
            try:
                self.clock = clock_probe(self.left()) if not broken else {"skipped": broken}
            except Exception as e:  # a diagnostic: its failure is said, the records stand
                self.clock = {"failed": f"{type(e).__name__}: {_last_line(str(e))}"}
        finally:
            if measurer is not None:
                measurer.close()

    def bench_both(self, optimized: Future[Any]) -> bool:
        """The chain's benches, PDL off then on, and its summary (records saved first and after); True."""
        self.save()
        for pdl in (False, True):
            self.bench_chain(pdl, optimized)
        self.summarize_chain()
        self.save()
        return True

    def summarize_chain(self) -> None:
        kernel_us = self.chain_kernel_us()
        if kernel_us is not None:
            self.chain["summary"] = chain_summary(self.chain, kernel_us)


def in_background(calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]], jobs: int) -> list[Future[Any]]:
    """Run the calls on `jobs` daemon threads, in order, each one's result (or exception) in its Future. Daemon
    threads: a build still running when the run is done (a CUTLASS instance the time budget cut) does not hold the
    process's exit, as a ThreadPoolExecutor's workers would; its nvcc finishes on its own, into the kernel cache."""
    todo: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
    futures: list[Future[Any]] = []
    for fn, args in calls:
        futures.append(Future())
        todo.put((futures[-1], fn, args))

    def work() -> None:
        while True:
            try:
                fut, fn, args = todo.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the caller reads it from the Future
                fut.set_exception(e)

    for k in range(max(1, min(jobs, len(futures)))):
        threading.Thread(target=work, name=f"calib-{k}", daemon=True).start()
    return futures


def _build(instance: Instance) -> Path | str:
    """An instance as a shared library (tune.gpu.shared_library: the cached, spill-checked nvcc build, linked), or
    why it did not build."""
    from onnx_gtco.tune.gpu import shared_library

    try:
        lib = shared_library(instance)
    except Exception as e:  # a header that cannot be found, nvcc missing: this instance's failure, not the run's
        return f"{type(e).__name__}: {_last_line(str(e))}"
    return lib if isinstance(lib, Path) else f"{lib.error_kind}: {_last_line(lib.detail)}"


def bench_run(bench: Mapping[str, Any], pdl: bool, launches: Mapping[str, Any]) -> dict[str, Any]:
    """A chain run from its bench.json: gtco's median in a CUDA graph replay (None without one), the launches its
    profile counted (else the plan's), the PDL launches (the library's PDL nodes, else the plan's launches after
    ours), and the profiled kernel time no LayerNorm kernel of ours accounts for."""
    entry = (bench.get("batches") or [{}])[0]
    variants = {v.get("name"): v for v in entry.get("variants") or ()}
    ours = variants.get("gtco") or {}
    run: dict[str, Any] = {"measured_ms": None, "launches": launches["launches"],
                           "pdl_launches": launches["pdl_nodes"] if launches.get("pdl_nodes") is not None
                           else launches["after_ours"], "unrecorded_kernel_us": 0.0}
    if ours.get("status") != "ok":
        run["failed"] = f"gtco {ours.get('status')}: {ours.get('reason')}"
        return run
    if not ours.get("cuda_graph"):
        run["failed"] = f"no CUDA graph replay: {ours.get('note') or 'no reason given'}"
        run["median_ms_no_graph"] = ours.get("median_ms")
        return run
    run["measured_ms"] = float(ours["median_ms"])
    prof = ours.get("profile") or {}
    if "calls_per_run" in prof:
        run["launches"] = round(float(prof["calls_per_run"]))
        run["profiled_kernel_us"] = round(float(prof["kernel_us_per_run"]), 3)
        ln = sum(float(k["us_per_run"]) for k in prof.get("top") or () if "layernorm" in str(k["kernel"]).lower())
        run["unrecorded_kernel_us"] = round(max(0.0, float(prof["kernel_us_per_run"]) - ln), 3)
    base = variants.get("ort-fp16") or {}
    if base.get("status") == "ok":
        run["ort_fp16_ms"] = base.get("median_ms")
    if not pdl:
        run["pdl_launches"] = 0
    return run


def clock_probe(left_s: float) -> dict[str, Any]:
    """The SM clock (pynvml, else nvidia-smi) sampled before, during and after CLOCK_LOAD_S of back-to-back fp16
    GEMMs of CLOCK_GEMM (cuBLAS through CuPy), and the GEMM's median time cold (the first launches after a second
    idle) against sustained (the last ones)."""
    need = CLOCK_LOAD_S + 2 * CLOCK_IDLE_S + 1.0
    if left_s < need:
        return {"skipped": f"{left_s:.0f} s of the time budget left, the probe takes about {need:.0f} s"}
    try:
        import cupy as cp
    except ImportError as e:
        return {"skipped": f"CuPy does not import ({e})"}
    read = _clock_reader()
    if isinstance(read, str):
        return {"skipped": read}
    sampler = _Sampler(read)
    m, n, k = CLOCK_GEMM
    a = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((k, n), dtype=cp.float32).astype(cp.float16)
    cp.matmul(a, b)  # cuBLAS's handle and heuristics, before the idle second
    cp.cuda.Device().synchronize()
    sampler.start()
    try:
        time.sleep(CLOCK_IDLE_S)
        sampler.mark("load")
        times: list[float] = []
        t_end = time.monotonic() + CLOCK_LOAD_S
        while time.monotonic() < t_end:
            pairs = []
            for _ in range(50):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                cp.matmul(a, b)
                end.record()
                pairs.append((start, end))
            pairs[-1][1].synchronize()
            times += [cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in pairs]
        sampler.mark("after")
        time.sleep(CLOCK_IDLE_S)
    finally:
        sampler.stop()
    phases = sampler.phases()
    cold, sustained = statistics.median(times[:10]), statistics.median(times[-500:])
    return {"gemm": f"cuBLAS (CuPy) fp16 {m}x{n}x{k}", "launches": len(times), "first_us": round(times[0], 2),
            "cold_us": round(cold, 2),
            "sustained_us": round(sustained, 2), "sustained_over_cold": round(sustained / cold, 4),
            "source": sampler.source, **phases}


def _clock_reader() -> Callable[[], dict[str, float]] | str:
    """A function reading the SM clock (MHz), its maximum and the power (W) of GPU 0, or why there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)

        def nvml() -> dict[str, float]:
            reasons = 0
            with contextlib.suppress(Exception):
                reasons = int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))
            return {"sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                    "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3, "reasons": float(reasons)}
        nvml()
        nvml.source = "pynvml"  # type: ignore[attr-defined]
        return nvml
    except Exception:  # no pynvml, no NVML: the command-line tool reads the same counters
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "neither pynvml nor nvidia-smi reads the clocks here"

    def query() -> dict[str, float]:
        out = subprocess.run([smi, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=False).stdout.split(",")
        return {"sm_mhz": float(out[0]), "power_w": float(out[1])}
    try:
        query()
    except (ValueError, IndexError, OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi does not read the clocks ({e})"
    query.source = "nvidia-smi"  # type: ignore[attr-defined]
    return query


class _Sampler:
    """Samples a clock reader every 20 ms in a thread, labelling each sample with the phase it falls in."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read, self.source = read, str(getattr(read, "source", "?"))
        self.phase = "before"
        self.samples: list[tuple[str, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.samples.append((self.phase, self.read()))
            self._stop.wait(0.02)

    def start(self) -> None:
        self._thread.start()

    def mark(self, phase: str) -> None:
        self.phase = phase

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def phases(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for phase in ("before", "load", "after"):
            got = [s for p, s in self.samples if p == phase]
            if not got:
                continue
            mhz = [s["sm_mhz"] for s in got]
            out[phase] = {"samples": len(got), "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
                          "sm_mhz_max": max(mhz), "power_w_median": round(statistics.median(s["power_w"]
                                                                                            for s in got), 1)}
            reasons = {int(s.get("reasons", 0)) for s in got} - {0}
            if reasons:
                out[phase]["clock_event_reasons"] = sorted(f"0x{r:x}" for r in reasons)
        return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# ------------------------------------------------------------------------------------------------------ compare


def compare(records_path: Path, target: str, refit_dir: Path | None) -> dict[str, Any]:
    """Every record of `records_path` priced with the shipped calibration of `target` and with the refit in
    `refit_dir` (None, or no file there: the shipped one alone), the error summary of each over these records, and
    the constants of both.

    Raises:
        GtcoError: the records or a calibration file cannot be read.
    """
    doc = json.loads(records_path.read_text())
    recs = fit.load_records([records_path])
    data_sheet = hardware(target).target
    shipped_cal = load_calibration(target, SHIPPED_DIR)
    refit_cal = load_calibration(target, refit_dir) if refit_dir is not None else None
    sides = {"shipped": Hardware(data_sheet, shipped_cal)}
    if refit_cal is not None:
        sides["refit"] = Hardware(data_sheet, refit_cal)
    tests = {name: fit.backtest(recs, hw) for name, hw in sides.items()}
    kernels = []
    for i, (raw, rec) in enumerate(zip(doc["kernels"], recs.kernels, strict=True)):
        kernels.append({"case": raw.get("case", rec.id), "part": raw.get("part", ""), "kernel": rec.kernel,
                        "family": rec.family, "impl": str(rec.config.get("impl", "mma")), "calls": rec.calls,
                        "measured_us": rec.us_per_forward,
                        **{f"{name}_us": round(t[0][i].predicted_us, 3) for name, t in tests.items()}})
    models = []
    for i, (raw, rec) in enumerate(zip(doc["models"], recs.models, strict=True)):
        models.append({"model": rec.model, "pdl": bool(raw.get("pdl")), "launches": rec.launches,
                       "pdl_launches": rec.pdl_launches, "measured_us": round(rec.measured_us, 3),
                       **{f"{name}_us": round(t[1][i].predicted_us, 3) for name, t in tests.items()}})
    constants: dict[str, dict[str, Any]] = {}
    for group in fit.GROUPS:
        for f in fit.fields_of(group):
            name = f"{group.GROUP}.{f.name}"
            constants[name] = {side: getattr(hw.constants(group), f.name) for side, hw in sides.items()}
            constants[name]["fitted"] = bool(refit_cal and name in refit_cal.fitted.get("fitted", ()))
    return {"target": target, "records": str(records_path), "stand_in": bool(doc.get("stand_in")),
            "shipped": shipped_cal.path if shipped_cal else None, "refit": refit_cal.path if refit_cal else None,
            "kernels": kernels, "models": models,
            "error": {name: fit.errors(recs, *t) for name, t in tests.items()},
            "refit_fit": dict(refit_cal.fitted) if refit_cal else None, "constants": constants}


# ------------------------------------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time the cases (or, --stand-in, price them) and write the records")
    m.add_argument("--target", required=True, choices=sorted(TARGETS), help="the onnx-gtco target of this GPU")
    m.add_argument("--out", required=True, type=Path, help="folder for records.json, measure.json and the chain")
    m.add_argument("--stand-in", action="store_true", help="no GPU: the estimate's times, a few instances compiled")
    m.add_argument("--time-budget-s", type=float, default=120.0, help="start no case after this (default 120)")
    m.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="nvcc builds at a time (default: cores)")
    m.add_argument("--max-cutlass", type=int, default=MAX_CUTLASS,
                   help=f"CUTLASS instances to build, 30-60 s of nvcc each (default {MAX_CUTLASS})")
    m.add_argument("--provenance", default=None, metavar="JSON",
                   help='{"gpu", "driver", "cuda", "commit", "date", "onnxruntime"} written on every record')
    c = sub.add_parser("compare", help="price a records file with the shipped calibration and the refit")
    c.add_argument("--target", required=True, choices=sorted(TARGETS))
    c.add_argument("--records", required=True, type=Path)
    c.add_argument("--refit", type=Path, default=None, metavar="DIR", help="the folder of the refit <target>.json")
    c.add_argument("-o", "--output", required=True, type=Path)
    ls = sub.add_parser("list", help="print the cases, the comparisons and what is cut (no GPU, no nvcc)")
    ls.add_argument("--target", default="h200", choices=sorted(TARGETS))
    ls.add_argument("--max-cutlass", type=int, default=MAX_CUTLASS)
    args = ap.parse_args(argv)
    if getattr(args, "jobs", 1) < 1 or getattr(args, "max_cutlass", 0) < 0 or getattr(args, "time_budget_s", 1) <= 0:
        ap.error("--jobs must be >= 1, --max-cutlass >= 0 and --time-budget-s > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.command == "list":
            plan = build_plan(args.target, args.max_cutlass)
            for case in plan.cases:
                print(f"{case.part:<15} {case.model:<20} b{case.batch:<3} {case.label}")
            print(f"{len(plan.cases)} cases, {len({c.instance.name for c in plan.cases})} instances "
                  f"({sum(c.impl == cutlass.IMPL for c in {c.instance.name: c for c in plan.cases}.values())} "
                  f"CUTLASS); the chain's LayerNorm cases come from its plan")
            for cut in plan.cut:
                print(f"cut: {cut['case']}: {cut['why']}")
            return 0
        if args.command == "compare":
            write_json(args.output, compare(args.records, args.target, args.refit))
            return 0
        run = Run(args)
        run.plan_chain()
        hw = hardware(args.target)
        if args.stand_in:
            run.compile_some()
            run.stand_in_times(hw)
            run.stand_in_chain(hw)
            run.clock = {"skipped": "stand-in run: no GPU"}
        else:
            run.measure_all()
        written = run.save()
        models = sum(bool((run.chain.get(side) or {}).get("measured_ms")) for side in ("off", "on"))
        run.log(f"{run.out / 'records.json'}: {written} kernel and {models} model records")
        return 0 if written else 1
    except GtcoError as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
