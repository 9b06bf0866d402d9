"""Where a variant's GPU time goes: its top kernels over a few runs, read with torch's profiler.

ORT's own profile times a CUDA node by its launch on the host (the kernels run later, asynchronously), so its
durations say little about the GPU. torch's profiler reads CUPTI's activity records, which hold every kernel the
process runs on the device, whoever launched it: ORT's CUDA EP, cuBLAS, cuDNN and the custom-op library alike.
The kernels are grouped by name; each row gives its calls and GPU microseconds per run and its share of the
variant's kernel time. torch is optional: without it (or without a GPU it sees) the profile says why instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from onnx_gtco.errors import first_line

RUNS = 10
TOP = 10
NAME_CHARS = 160
"""Kernel names are cut to this many characters (templated CUTLASS and cuBLAS names run to thousands)."""


def summarize_kernels(durations: Mapping[str, list[float]], runs: int, top: int = TOP) -> dict[str, Any]:
    """The profile of `runs` runs from kernel name -> its durations in µs: the `top` kernels by GPU time, each with
    calls and µs per run and share of the total, and the total per run.

    Raises:
        ValueError: `runs` below 1.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    total = sum(sum(d) for d in durations.values())
    rows = sorted(((name, sum(d), len(d)) for name, d in durations.items()), key=lambda r: -r[1])
    kernels = [{"kernel": name[:NAME_CHARS], "calls_per_run": calls / runs, "us_per_run": us / runs,
                "share": us / total if total > 0 else 0.0} for name, us, calls in rows[:top]]
    return {"runs": runs, "kernel_us_per_run": total / runs, "kernels_total": len(rows),
            "calls_per_run": sum(len(d) for d in durations.values()) / runs, "top": kernels}


def profile_kernels(run: Callable[[], Any], sync: Callable[[], None], runs: int = RUNS,
                    top: int = TOP) -> dict[str, Any]:
    """Profile `runs` calls of `run` (each followed by `sync`) and summarize their kernels (`summarize_kernels`).
    Never raises: a profile that cannot be taken is {"reason": why}."""
    if importlib.util.find_spec("torch") is None:
        return {"reason": "torch is not installed (its profiler reads the kernels' GPU times)"}
    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if not torch.cuda.is_available():
            return {"reason": "torch sees no CUDA device"}
        torch.cuda.init()
        run()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                run()
                sync()
        durations: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:  # copies and memsets by kind ("Memcpy HtoD (...)" -> "Memcpy")
                name = e.name.split(" ")[0] if e.name.startswith(("Memcpy", "Memset")) else e.name
                durations.setdefault(name, []).append(float(e.time_range.elapsed_us()))
    except Exception as e:  # CUPTI or the profiler itself
        return {"reason": f"torch's profiler failed: {first_line(e)}"}
    if not durations:
        return {"reason": "the profiler recorded no kernel (CUPTI saw none of this process's launches)"}
    return summarize_kernels(durations, runs, top)


def profile_session(session: Any, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, tuple[int, ...]],
                    runs: int = RUNS, top: int = TOP) -> dict[str, Any]:
    """profile_kernels of an ORT CUDA session run through an IO binding as it is timed (inputs on the device,
    outputs pre-allocated there). Never raises."""
    from onnx_gtco.bench.timing import bind_io

    try:
        binding, _keep = bind_io(session, feeds, "cuda", outputs)
    except Exception as e:  # ORT's own exception types
        return {"reason": f"binding the session's inputs failed: {first_line(e)}"}
    return profile_kernels(lambda: session.run_with_iobinding(binding), binding.synchronize_outputs, runs, top)
