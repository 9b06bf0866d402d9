"""The kernel bench's candidates per case: every implementation's configurations, their instances and builds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from onnx_gtco.bench.kernel_bench.shapes import CUTLASS_CONFIGS, IMPLS, Case
from onnx_gtco.errors import GtcoError
from onnx_gtco.families.gemm import cublaslt, cutlass
from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
from onnx_gtco.kernels.family import (
    Instance,
    Problem,
)
from onnx_gtco.tune.gpu import shared_library
from onnx_gtco.tune.search import OFFERED, Measurement, config_arch, offered
from onnx_gtco.tune.tasks import Task, template_version

# ------------------------------------------------------------------------------------------------------ candidates


def task_of(p: Problem, arch: str) -> Task:
    return Task(p, arch, template_version())


def gemm_candidates(p: Problem, arch: str, max_configs: int | None, impls: Iterable[str] = IMPLS
                    ) -> dict[str, list[dict[str, Any]] | str]:
    """Each GEMM implementation -> the configurations the bench times on `p` for target `arch`, or why none
    (tune.search.offered's reason, the tuner's own): mma the family's offered configs, cutlass the first
    CUTLASS_CONFIGS of families.gemm.cutlass.configs (sm_90 only), cublaslt the heuristic's ranks; each capped by
    `max_configs`."""
    cap = max_configs
    why = offered(task_of(p, arch))
    out: dict[str, list[dict[str, Any]] | str] = {}
    for impl in IMPLS:
        if impl not in impls:
            out[impl] = "not selected (--impls)"
        elif impl == "mma":
            out[impl] = [c for c in GEMM.configs(p, arch) if c.get("impl", "mma") == "mma"][:cap] or \
                "no generated configuration passes its check"
        elif why.get(impl) != OFFERED:
            out[impl] = why.get(impl) or f"{impl} is not offered"
        elif impl == cutlass.IMPL:
            out[impl] = [{"impl": impl, **c} for c in cutlass.configs(p, cutlass.ARCH)][:min(cap or CUTLASS_CONFIGS,
                                                                                            CUTLASS_CONFIGS)]
        else:
            out[impl] = [{"impl": impl, "RANK": r} for r in cublaslt.RANKS][:cap]
    return out


def fused_cublaslt(p: Problem) -> tuple[Problem, str] | str:
    """The problem the "cuBLASLt fused" baseline runs for `p`: `p` itself, or for a GELU(erf) group the same group
    with the tanh GELU (cuBLASLt's GELU epilogue; the same cost) with the note "tanh proxy"; or why there is none."""
    if cublaslt.unsupported(p) is None:
        return p, ""
    if p.flag("activation") == "gelu_erf":
        proxy = Problem.make(p.family, p.dtype, dict(p.sizes), dict(p.flags) | {"activation": "gelu_tanh"})
        if cublaslt.unsupported(proxy) is None:
            return proxy, "tanh proxy"
    return str(cublaslt.unsupported(p))


def case_instances(case: Case, arch: str, max_configs: int | None, impls: Iterable[str]) -> list[Instance]:
    """The instances a row times (each built for the arch its configuration runs on)."""
    fam = case.family
    if fam is None or case.problem is None:
        return []
    p = case.problem
    if case.kind != "gemm":
        return [fam.instantiate(p, c, arch) for c in fam.configs(p, arch)[:max_configs]]
    task = task_of(p, arch)
    out = [GEMM.instantiate(p, c, config_arch(task, c))
           for cfgs in gemm_candidates(p, arch, max_configs, impls).values() if isinstance(cfgs, list) for c in cfgs]
    fused = fused_cublaslt(p)
    if cublaslt.IMPL in impls and not isinstance(fused, str) and fused[1]:
        out.append(cublaslt.instance(fused[0], 0, arch))
    return out


def listing(todo: list[Case], arch: str, max_configs: int | None, impls: Iterable[str] = IMPLS) -> list[dict]:
    """Per row: its set, label, kind, count, what it stands for and its candidates (implementation -> instance
    names, or why none), the baselines it is timed against. No GPU, no nvcc."""
    impls = tuple(impls)
    rows = []
    for case in todo:
        cands: dict[str, list[str] | str] = {}
        base: list[str] = []
        if case.kind == "gemm":
            p = case.problem
            assert p is not None
            task = task_of(p, arch)
            for impl, cfgs in gemm_candidates(p, arch, max_configs, impls).items():
                cands[impl] = cfgs if isinstance(cfgs, str) else [
                    GEMM.instance_name(p, c, config_arch(task, c)) for c in cfgs]
            fused = fused_cublaslt(p)
            base = [f"cublaslt fused{' (tanh proxy)' if not isinstance(fused, str) and fused[1] else ''}"
                    if not isinstance(fused, str) else f"cublaslt fused: none ({fused})",
                    "torch matmul + epilogue", "torch addmm + epilogue", "torch.compile max-autotune"]
            if p.flag("layernorm"):
                base = [*base[:1], *(f"{b} + layer_norm" for b in base[1:])]
        elif case.kind == "conv":
            cands["ours"] = [i.name for i in case_instances(case, arch, max_configs, ("mma",))]
            base = ["torch conv2d (cuDNN) + epilogue", "ORT CUDA EP Conv (when onnxruntime-gpu is importable)"]
        else:
            fam, p = case.family, case.problem
            assert fam is not None and p is not None
            cands["mma"] = [fam.instantiate(p, c, arch).name for c in fam.configs(p, arch)[:max_configs]]
            base = list(_baseline_names(case))
        rows.append({"set": case.set, "case": case.label, "kind": case.kind, "count": case.count,
                     "where": case.where, "candidates": cands, "baselines": base})
    return rows


def _baseline_names(case: Case) -> tuple[str, ...]:
    if case.kind == "attention":
        return ("torch unfused", "torch SDPA")
    if case.kind == "bmm_softmax":
        return ("torch unfused",)
    return ("torch add+layer_norm",)


def print_listing(rows: list[dict], arch: str) -> None:
    print(f"Kernel bench shapes for {arch}: {len(rows)} rows")
    for r in rows:
        print(f"[{r['set']}] {r['case']} (x{r['count']}, {r['kind']})")
        for impl, c in r["candidates"].items():
            print(f"    {impl:<9} " + (f"skipped: {c}" if isinstance(c, str) else f"{len(c)}: " + ", ".join(c)))
        print(f"    baselines: {'; '.join(r['baselines'])}")


# ------------------------------------------------------------------------------------------------------ build


def build_all(insts: Mapping[str, Instance], jobs: int) -> dict[str, Path | str]:
    """Each instance as a shared library (tune.gpu.shared_library: kernels.compile's cached, spill-checked nvcc
    build, linked), or why it did not build."""
    def one(inst: Instance) -> Path | str:
        try:
            lib = shared_library(inst)
        except GtcoError as e:  # a header that could not be fetched, a missing nvcc
            return f"{type(e).__name__}: {e}"
        return f"{lib.error_kind}: {lib.detail[-600:]}" if isinstance(lib, Measurement) else lib
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return dict(zip(insts, pool.map(one, insts.values()), strict=True))
