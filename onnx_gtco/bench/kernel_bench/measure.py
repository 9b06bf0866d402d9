"""The kernel bench on a GPU: each GEMM, attention and LayerNorm case's candidates and baselines, checked and timed."""

from __future__ import annotations

import ctypes
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from onnx_gtco.bench.kernel_bench.candidates import case_instances, fused_cublaslt, gemm_candidates, task_of
from onnx_gtco.bench.kernel_bench.shapes import ATTN, IMPLS, TOL, Case
from onnx_gtco.families.gemm import cublaslt, cutlass
from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
from onnx_gtco.kernels.family import (
    Instance,
    KernelFamily,
    Problem,
    c_args,
    entry_point,
    from_storage,
    rel_error,
)
from onnx_gtco.kernels.select import implementation
from onnx_gtco.tune.search import config_arch, predict_us


def median_us(fn: Callable[[], object], reps: int, torch) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def to_torch(x: np.ndarray, dtype: str, torch):
    """Storage array (float16, float32, or uint16 for bf16) -> CUDA tensor of the kernel dtype."""
    if dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def to_numpy(t, dtype: str, torch) -> np.ndarray:
    """CUDA tensor -> storage array (float16, float32, or uint16 for bf16)."""
    if dtype == "bf16":
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    return t.detach().cpu().numpy()


def _torch_dtype(dt: str, torch):
    return {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dt]


def _err(t, want: np.ndarray, dtype: str, torch) -> float:
    return rel_error(from_storage(to_numpy(t, dtype, torch), dtype), want)


class Runner:
    """Launches built instances of one problem on one set of device inputs and checks and times them."""

    def __init__(self, fam: KernelFamily, p: Problem, reps: int, torch, seed: int = 5) -> None:
        self.fam, self.p, self.reps, self.torch = fam, p, reps, torch
        self.inputs = fam.random_inputs(p, seed=seed)
        out_dt = {k: dt for k, (_, dt) in fam.outputs(p).items()}
        res_dt = out_dt.get("y", p.dtype)
        self.dev = {k: to_torch(v, res_dt if k == "residual" else p.dtype, torch) for k, v in self.inputs.items()}
        self.outs = {k: torch.full(shape, float("nan"), dtype=_torch_dtype(dt, torch), device="cuda")
                     for k, (shape, dt) in fam.outputs(p).items()}
        self.out_dt = out_dt
        self.ref = fam.reference(p, self.inputs)
        self.stream = torch.cuda.current_stream().cuda_stream

    def time(self, inst: Instance, lib: Path | str) -> dict:
        """One candidate's row: built, launched, checked against the fp64 reference, and timed when correct."""
        row: dict[str, Any] = {"instance": inst.name, "impl": str(inst.config.get("impl", "mma")),
                               "config": dict(inst.config), "ok": False, "us": None, "rel_err": None}
        if isinstance(lib, str):
            row["error"] = f"build: {lib}"
            return row
        impl = implementation(inst.config)
        if impl is not None and impl.prepare is not None:
            impl.prepare()
        arrays = dict(self.inputs) | {k: np.empty(tuple(v.shape), np.float16) for k, v in self.outs.items()}
        def address(name: str) -> int | None:
            t = self.outs.get(name, self.dev.get(name))
            return None if t is None else int(t.data_ptr())

        args = c_args(self.fam.args_fields(self.p, arrays), address)
        fn = entry_point(str(lib), inst.symbol, args)
        for t in self.outs.values():
            t.fill_(float("nan"))
        code = fn(ctypes.byref(args), self.stream)
        self.torch.cuda.synchronize()
        row["code"] = code
        errs = {k: _err(t, self.ref[k], self.out_dt[k], self.torch) for k, t in self.outs.items()}
        row["rel_err"] = max(errs.values()) if errs else None
        row["ok"] = code == 0 and all(math.isfinite(e) and e < TOL[self.p.dtype] for e in errs.values())
        if code != 0:
            row["error"] = f"returned {code}"
        elif not row["ok"]:
            row["error"] = f"wrong answer: ‖err‖/‖ref‖ {row['rel_err']:.3g} (tolerance {TOL[self.p.dtype]:g})"
        else:
            row["us"] = median_us(lambda: fn(ctypes.byref(args), self.stream), self.reps, self.torch)
        return row

    def baseline(self, name: str, fn: Callable[[], Any], want: np.ndarray | None = None) -> dict:
        """A torch baseline's row: its answer checked (against `want`, default the problem's reference), timed."""
        y = fn()
        self.torch.cuda.synchronize()
        err = _err(y, self.ref["y"] if want is None else want, self.out_dt.get("y", self.p.dtype), self.torch) \
            if "y" in self.ref or want is not None else None
        ok = err is None or (math.isfinite(err) and err < TOL[self.p.dtype])
        return {"name": name, "rel_err": err, "ok": ok, "us": median_us(fn, self.reps, self.torch),
                **({} if ok else {"error": f"wrong answer: ‖err‖/‖ref‖ {err:.3g}"})}


def _torch_epilogue(p: Problem, torch) -> Callable:
    """`act(y + bias) + residual` as separate torch ops (ACTIVATIONS of the GEMM family that torch names)."""
    F = torch.nn.functional
    act = str(p.flag("activation", "none"))
    acts = {"none": lambda y: y, "relu": F.relu, "gelu_erf": F.gelu,
            "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
            "silu": F.silu}
    return acts[act]


def gemm_baselines(p: Problem, r: Runner, torch) -> dict[str, Callable[[], Any]]:
    """The unfused torch forms of a GEMM row, on the Runner's inputs."""
    a, b = r.dev["a"].reshape(-1, r.dev["a"].shape[-1]), r.dev["b"]
    if p.flag("trans_b"):
        b = b.t()
    bias, res = r.dev.get("bias"), r.dev.get("residual")
    act = _torch_epilogue(p, torch)
    shape = r.outs["y"].shape
    if p.flag("layernorm"):  # then torch's layer_norm: the unfused pair (checked against y, which it returns)
        gamma, beta, eps = r.dev["gamma"], r.dev["beta"], float(p.flag("epsilon", 1e-5))
        ln = torch.nn.functional.layer_norm
        plain = gemm_baselines(Problem.make(p.family, p.dtype, dict(p.sizes),
                                            {k: v for k, v in p.flags if k not in ("layernorm", "epsilon")}), r, torch)

        def then_ln(f: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                y = f()
                ln(y, (y.shape[-1],), gamma, beta, eps)
                return y
            return run
        return {f"{name} + layer_norm": then_ln(f) for name, f in plain.items()}

    def matmul():
        y = a @ b
        if bias is not None:
            y = y + bias
        y = act(y)
        return (y + res.reshape(y.shape) if res is not None else y).reshape(shape)

    def addmm():
        y = act(torch.addmm(bias, a, b) if bias is not None else a @ b)
        return (y + res.reshape(y.shape) if res is not None else y).reshape(shape)
    return {"torch matmul + epilogue": matmul, "torch addmm + epilogue": addmm}


def run_gemm_case(case: Case, arch: str, libs: Mapping[str, Path | str], reps: int, torch, max_configs: int | None,
                  impls: Iterable[str], cc: int) -> dict:
    p = case.problem
    assert p is not None
    r = Runner(GEMM, p, reps, torch)
    task = task_of(p, arch)
    rows, skipped = [], {}
    for impl, cfgs in gemm_candidates(p, arch, max_configs, impls).items():
        if isinstance(cfgs, str):
            skipped[impl] = cfgs
            continue
        if impl == cutlass.IMPL and cc != 90:
            skipped[impl] = f"{cutlass.ARCH} code runs on 9.0 GPUs only (this one is {cc // 10}.{cc % 10})"
            continue
        for c in cfgs:
            inst = GEMM.instantiate(p, c, config_arch(task, c))
            row = r.time(inst, libs[inst.name])
            row["predicted_us"] = predict_us(task, c)
            rows.append(row)
    good = [x for x in rows if x["ok"]]
    best = {impl: min((x for x in good if x["impl"] == impl), key=lambda x: x["us"], default=None)
            for impl in IMPLS}
    tuned = min(good, key=lambda x: x["us"], default=None)
    pick = min(rows, key=lambda x: x["predicted_us"], default=None)
    base = {name: r.baseline(name, fn) for name, fn in gemm_baselines(p, r, torch).items()}
    sep = [x for x in base.values() if x["ok"]]
    separate = min(sep, key=lambda x: x["us"]) if sep else None
    fused = fused_cublaslt(p)
    fused_row: dict[str, Any] | None
    if isinstance(fused, str):
        fused_row = {"ok": False, "us": None, "error": fused}
    elif cublaslt.IMPL not in impls:
        fused_row = {"ok": False, "us": None, "error": "not selected (--impls)"}
    elif not fused[1]:
        fused_row = next((x for x in rows if x["impl"] == cublaslt.IMPL and x["config"].get("RANK") == 0),
                         {"ok": False, "us": None, "error": "rank 0 not timed"})
        fused_row = dict(fused_row, note="")
    else:
        inst = cublaslt.instance(fused[0], 0, arch)
        fused_row = Runner(GEMM, fused[0], reps, torch).time(inst, libs[inst.name]) | {"note": fused[1]}
    out = {"set": case.set, "case": case.label, "kind": "gemm", "count": case.count, "where": case.where,
           "rows": rows, "skipped": skipped,
           "best": {k: (v["instance"], v["us"]) if v else None for k, v in best.items()},
           "tuned": {"instance": tuned["instance"], "impl": tuned["impl"], "us": tuned["us"]} if tuned else None,
           "analytical_pick": ({"instance": pick["instance"], "impl": pick["impl"], "us": pick["us"],
                                "ok": pick["ok"]} if pick else None),
           "baselines": base, "separate": ({"name": separate["name"], "us": separate["us"]} if separate else None),
           "cublaslt_fused": fused_row, "compile": None,
           "all_ok": all(x["ok"] for x in rows) and all(x["ok"] for x in base.values())}
    out["ratios"] = ratios(out)
    return out


def ratios(res: dict) -> dict[str, float | None]:
    """baseline / ours (> 1: ours faster): tuned vs the separate epilogue, CUTLASS vs cuBLASLt fused, tuned vs
    torch.compile."""
    def div(a: Any, b: Any) -> float | None:
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None
    tuned = (res.get("tuned") or {}).get("us")
    cut = (res.get("best") or {}).get(cutlass.IMPL)
    fused = res.get("cublaslt_fused") or {}
    comp = res.get("compile") or {}
    return {"tuned_vs_separate": div((res.get("separate") or {}).get("us"), tuned),
            "cutlass_vs_cublaslt_fused": div(fused.get("us") if fused.get("ok") else None, cut[1] if cut else None),
            "tuned_vs_compile": div(comp.get("us") if comp.get("ok") else None, tuned)}


def run_family_case(case: Case, arch: str, libs: Mapping[str, Path | str], reps: int, torch,
                    max_configs: int | None) -> dict:
    """An attention / BMM+softmax / LayerNorm row: the family's configurations beside torch."""
    fam, p = case.family, case.problem
    assert fam is not None and p is not None
    r = Runner(fam, p, reps, torch)
    rows = [r.time(inst, libs[inst.name]) for inst in case_instances(case, arch, max_configs, ("mma",))]
    base = {name: {"name": name, "us": median_us(fn, reps, torch), "ok": True}
            for name, fn in family_baselines(fam, p, r.dev, torch).items()}
    good = [x for x in rows if x["ok"]]
    best = min(good, key=lambda x: x["us"], default=None)
    return {"set": case.set, "case": case.label, "kind": case.kind, "count": case.count, "where": case.where,
            "rows": rows, "best": {"mma": (best["instance"], best["us"]) if best else None},
            "tuned": {"instance": best["instance"], "impl": "mma", "us": best["us"]} if best else None,
            "baselines": base, "all_ok": all(x["ok"] for x in rows)}


def family_baselines(fam: KernelFamily, p: Problem, dev: dict, torch) -> dict[str, Callable[[], object]]:
    F = torch.nn.functional
    if fam.name in ATTN:
        q, k, v = dev["q"], dev["k"], dev.get("v")
        scale = float(p.flag("scale"))
        mask = dev.get("mask")
        m4 = None if mask is None else mask.reshape(mask.shape[0], 1, 1, -1) if mask.dim() != 4 else mask

        def unfused():
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            if m4 is not None:
                s = s + m4
            pr = torch.softmax(s.float(), -1).to(q.dtype)
            return pr if v is None else torch.matmul(pr, v)
        out = {"torch unfused": unfused}
        if fam.name == "attention":
            out["torch SDPA"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m4, scale=scale)
        return out
    x, res = dev["x"], dev["residual"]
    g, bt = dev["gamma"], dev["beta"]
    return {"torch add+layer_norm": lambda: F.layer_norm(x + res, (x.shape[-1],), g, bt, 1e-6)}


# ------------------------------------------------------------------------------------------------------ conv


# ------------------------------------------------------------------------------------------------------ torch.compile


def compile_gemm(case: Case, reps: int, torch) -> dict:
    """torch.compile(mode="max-autotune") of the row's unfused torch function, its answer checked, timed."""
    import torch._dynamo

    p = case.problem
    assert p is not None
    torch._dynamo.reset()
    r = Runner(GEMM, p, reps, torch)
    bias, res_t = r.dev.get("bias"), r.dev.get("residual")
    act = _torch_epilogue(p, torch)
    a, b = r.dev["a"].reshape(-1, r.dev["a"].shape[-1]), r.dev["b"]
    if p.flag("trans_b"):
        b = b.t()

    ln = (r.dev["gamma"], r.dev["beta"], float(p.flag("epsilon", 1e-5))) if p.flag("layernorm") else None

    def fn(a, b, bias, res):
        y = a @ b
        if bias is not None:
            y = y + bias
        y = act(y)
        y = y + res if res is not None else y
        if ln is None:
            return y, y
        return y, torch.nn.functional.layer_norm(y, (y.shape[-1],), ln[0], ln[1], ln[2])  # the pair, compiled
    compiled = torch.compile(fn, mode="max-autotune", dynamic=False, fullgraph=True)
    res2 = None if res_t is None else res_t.reshape(a.shape[0], -1)
    t0 = time.monotonic()
    y = compiled(a, b, bias, res2)[0]
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    err = _err(y.reshape(r.outs["y"].shape), r.ref["y"], "f16", torch)
    ok = math.isfinite(err) and err < TOL["f16"]
    us = median_us(lambda: compiled(a, b, bias, res2), reps, torch)
    name = "torch.compile max-autotune" + (" + layer_norm" if ln is not None else "")
    return {"name": name, "us": us, "rel_err": err, "ok": ok,
            "compile_s": round(seconds, 1), **({} if ok else {"error": f"wrong answer: ‖err‖/‖ref‖ {err:.3g}"})}
