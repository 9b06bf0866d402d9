"""Time one ONNX Runtime session: IO binding with device-resident inputs and pre-allocated outputs, warm-up, CUDA
graph replay where the CUDA EP can capture the model, per-run wall times."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_gtco.bench.stats import Latency, summarize
from onnx_gtco.errors import first_line
from onnx_gtco.runtime.cuda_ep import CUDA_EP, load_cuda_libraries, require_cuda_ep

CPU_EP = "CPUExecutionProvider"
CAPTURE_WARMUP = 3
"""Untimed runs at least, with CUDA graphs on: ORT captures the graph after a first regular run or two."""
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


@dataclass
class Timed:
    """One variant's measurement: latency summary, the outputs of its last run (host copies), whether the runs
    replayed a CUDA graph, and a note (e.g. why CUDA graph replay was not used)."""

    latency: Latency
    outputs: list[np.ndarray]
    cuda_graph: bool
    note: str = ""
    plain: Latency | None = None
    """The same session's latency without CUDA graph replay, when `latency` replayed one (so a ratio against a
    variant that could not capture compares like with like)."""
    make: Callable[[bool], Any] | None = None
    """What made the timed session (`make(cuda_graph)`), for a profiled run after the timing; None outside ORT."""


def session_options() -> Any:
    """Quiet ORT session options with every graph optimization on."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return so


def ep_list(provider: str, cuda_graph: bool) -> list[Any]:
    """ORT providers for `provider` ("cuda" or "cpu"); the CUDA EP with CUDA graph capture on or off."""
    if provider == "cuda":
        return [(CUDA_EP, {"enable_cuda_graph": "1" if cuda_graph else "0"}), CPU_EP]
    return [CPU_EP]


def _time_bound(session: Any, feeds: Mapping[str, np.ndarray], provider: str, outputs: Mapping[str, tuple[int, ...]],
                runs: int, warmup: int) -> tuple[Latency, list[np.ndarray]]:
    if provider == "cuda":
        require_cuda_ep(session, "the timed session")
    metas = {m.name: m for m in session.get_outputs()}
    missing = [n for n in outputs if n not in metas]
    if missing:
        raise ValueError(f"the model has no output {missing[0]!r} (it has {', '.join(metas)})")
    binding, _keep = bind_io(session, feeds, provider, outputs, metas)  # _keep: alive until the copies are made
    latency, _ = time_callable(lambda: session.run_with_iobinding(binding), binding.synchronize_outputs, runs, warmup)
    return latency, [np.asarray(o) for o in binding.copy_outputs_to_cpu()]


def bind_io(session: Any, feeds: Mapping[str, np.ndarray], provider: str, outputs: Mapping[str, tuple[int, ...]],
            metas: Mapping[str, Any] | None = None) -> tuple[Any, list[Any]]:
    """An IO binding of `session` with `feeds` on the device ("cuda") and `outputs` pre-allocated there, and what
    must outlive its runs."""
    import onnxruntime as ort

    metas = metas if metas is not None else {m.name: m for m in session.get_outputs()}
    binding = session.io_binding()
    keep: list[Any] = []  # what is bound must outlive the runs
    for name, arr in feeds.items():
        host = np.ascontiguousarray(arr)
        keep.append(host)
        if provider == "cuda":
            value = ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0)
            keep.append(value)
            binding.bind_ortvalue_input(name, value)
        else:
            binding.bind_cpu_input(name, host)
    for name, shape in outputs.items():  # bound in the reference's order, so the copies come back in it
        dtype = _ORT_TYPES.get(metas[name].type)
        if provider != "cuda":
            binding.bind_output(name)
        elif dtype is None:
            binding.bind_output(name, "cuda", 0)
        else:  # pre-allocated at a fixed address, as CUDA graph replay needs
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, "cuda", 0)
            keep.append(value)
            binding.bind_ortvalue_output(name, value)
    return binding, keep


def time_ort(make: Callable[[bool], Any], feeds: Mapping[str, np.ndarray], provider: str,
             outputs: Mapping[str, tuple[int, ...]], runs: int, warmup: int) -> Timed:
    """Time the session `make(cuda_graph)` creates: `warmup` untimed runs, then `runs` timed ones.

    On "cuda" the CUDA EP first tries CUDA graph capture (a warm-up run captures, at least CAPTURE_WARMUP of them
    run, later runs replay); when creating or running that session fails (a node outside the CUDA EP, a dynamic
    shape), the session is made again without it and the note says why. When the capture works, a session without
    it is timed too (`Timed.plain`): CUDA graphs on both sides of a ratio or on neither. `outputs` (name -> shape,
    from the reference run) are the outputs compared, returned in that order; on "cuda" they are pre-allocated on
    the device at fixed addresses as graph replay needs.

    Raises:
        whatever ORT raises when the session without CUDA graphs cannot be created or run.
    """
    note = ""
    if provider == "cuda":
        load_cuda_libraries()
        try:
            # ORT runs a model normally a couple of times before it captures the graph: keep that out of the timing
            latency, outs = _time_bound(make(True), feeds, provider, outputs, runs, max(CAPTURE_WARMUP, warmup))
        except Exception as e:  # ORT raises its own exception types per failure
            note = f"CUDA graph replay not used: {first_line(e)}"
        else:
            plain, _ = _time_bound(make(False), feeds, provider, outputs, runs, warmup)
            return Timed(latency, outs, True, plain=plain, make=make)
    latency, outs = _time_bound(make(False), feeds, provider, outputs, runs, warmup)
    return Timed(latency, outs, False, note, make=make)


def time_callable(fn: Callable[[], Any], sync: Callable[[], None], runs: int, warmup: int) -> tuple[Latency, Any]:
    """Time a runner: `warmup` untimed calls, then `fn()` and `sync()` per timed run (e.g. torch.cuda.synchronize,
    or an IO binding's synchronize_outputs). Returns the latency and the last run's result."""
    result = None
    for _ in range(warmup):
        result = fn()
    sync()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times), result
