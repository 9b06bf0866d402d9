"""The roofline floor of a model: its FLOPs at the device's matmul peak, or its minimum DRAM traffic at the
device's copy bandwidth, whichever takes longer.

    floor_ms = max(flops / peak_flops, bytes / bandwidth)

FLOPs are the cost model's (`onnx_gtco.cost.model.node_flops`, matmul-class and other FLOPs summed, symbolic dims
as 1: bind the batch first). The minimum bytes are every weight, graph input and graph output read or written once,
in the model's own dtypes (fp32 weights as 2 bytes when ours runs in fp16 or bf16). The peaks are measured and kept
as JSON in the user cache (`<cache root>/bench/peaks.json`, keyed by device name): on CUDA a large
CuPy fp16 matmul (the Tensor Core peak) and a large device-to-device copy; on the CPU a large numpy fp32 matmul and a
large memcpy. Each bench run measures them again and keeps, per device, the best seen so far (contention only
lowers a measured peak).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from onnx_gtco.cost.model import node_flops
from onnx_gtco.errors import GtcoError, missing_package
from onnx_gtco.ir.export import write_text_atomic
from onnx_gtco.ir.load import load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.kernels.toolchain import cache_root


@dataclass(frozen=True)
class Work:
    """What a model must at least do: FLOPs (all of them, matmul-class included) and DRAM bytes."""

    flops: float
    mm_flops: float
    bytes: float


@dataclass(frozen=True)
class Peaks:
    """Measured peaks of one device: matmul TFLOP/s and copy bandwidth GB/s, and how they were measured."""

    device: str
    peak_tflops: float
    peak_gbps: float
    method: str


def _tensor_bytes(t: onnx.TensorProto) -> int:
    itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return int(np.prod(t.dims, dtype=np.int64)) * itemsize


def model_work(model: onnx.ModelProto | str | os.PathLike[str], precision: str = "fp32",
               io: Sequence[np.ndarray] | None = None) -> Work:
    """FLOPs from the cost model over every node, and the weights + graph inputs + graph outputs in bytes.
    With precision fp16 or bf16 the fp32 weights count 2 bytes each (what a half-precision variant must read);
    graph inputs and outputs keep their dtypes. `io`: the actual input and output arrays of a run, counted instead
    of the graph's declared input and output shapes.

    Raises:
        GtcoError: the model cannot be loaded (load_model's errors); or a graph input or output has an unknown
            shape (bind symbolic dims first).
    """
    loaded = load_model(model)
    view = GraphView(loaded)
    mm = other = 0.0
    for n in view.nodes:
        a, b = node_flops(view, n)
        mm += a
        other += b
    inits = {t.name for t in loaded.graph.initializer}
    half = precision in ("fp16", "bf16")
    total = float(sum(_tensor_bytes(t) // (2 if half and t.data_type == onnx.TensorProto.FLOAT else 1)
                      for t in loaded.graph.initializer))
    if io is not None:
        return Work(mm + other, mm, total + float(sum(a.nbytes for a in io)))
    for vi in [*loaded.graph.input, *loaded.graph.output]:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if any(d is None for d in dims):
            raise GtcoError(f"graph {'input' if vi in loaded.graph.input else 'output'} {vi.name!r} has a "
                            "symbolic or unknown shape; bind its dims before computing the roofline")
        total += float(np.prod(dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
    return Work(mm + other, mm, total)


def floor_ms(work: Work, peaks: Peaks) -> float:
    """max(flops / peak, bytes / bandwidth) in milliseconds."""
    compute = work.flops / (peaks.peak_tflops * 1e12)
    memory = work.bytes / (peaks.peak_gbps * 1e9)
    return max(compute, memory) * 1e3


def roofline_json(work: Work, peaks: Peaks) -> dict[str, float]:
    """The JSON entry of one batch: flops, bytes, the peaks and the floor."""
    return {"flops": work.flops, "bytes": work.bytes, "peak_tflops": peaks.peak_tflops,
            "peak_gbps": peaks.peak_gbps, "floor_ms": floor_ms(work, peaks)}


def cpu_name() -> str:
    """The CPU's model name and logical core count (its numpy matmul peak depends on both)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()} x{os.cpu_count()}"


def _best_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu_peaks(n: int = 1024, copy_mib: int = 256, repeats: int = 5) -> Peaks:
    """numpy fp32 matmul of two n x n matrices (2 n^3 FLOPs) and a copy of copy_mib MiB (read + write); the best of
    `repeats` runs each."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    mm_s = _best_seconds(lambda: np.matmul(a, b, out=c), repeats)
    src = np.ones(copy_mib * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    cp_s = _best_seconds(lambda: np.copyto(dst, src), repeats)
    return Peaks(cpu_name(), 2.0 * n**3 / mm_s / 1e12, 2.0 * src.nbytes / cp_s / 1e9,
                 f"numpy fp32 matmul {n}x{n}x{n}, memcpy {copy_mib} MiB (read + write), best of {repeats}")


def measure_cuda_peaks(n: int = 8192, copy_mib: int = 1024, repeats: int = 10) -> Peaks:
    """CuPy fp16 matmul of two n x n matrices (cuBLAS, Tensor Cores) and a device-to-device copy of copy_mib MiB
    (read + write), timed with CUDA events; the best of `repeats` runs each.

    Raises:
        GtcoError: CuPy is not installed or sees no CUDA device.
    """
    try:
        import cupy as cp
    except ImportError:
        raise missing_package("cupy", "measuring the GPU's peaks") from None
    try:
        name = _cuda_name(cp)
    except Exception as e:  # CuPy raises CUDARuntimeError without a driver or device
        raise GtcoError(f"CuPy sees no CUDA device: {e}") from None

    def best_ms(fn: Callable[[], object]) -> float:
        fn()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        best = float("inf")
        for _ in range(repeats):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop))
        return best

    a = cp.random.default_rng(0).standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = a.T.copy()
    c = cp.empty((n, n), dtype=cp.float16)
    mm_ms = best_ms(lambda: cp.matmul(a, b, out=c))
    src = cp.ones(copy_mib * 2**20, dtype=cp.uint8)
    dst = cp.empty_like(src)
    cp_ms = best_ms(lambda: cp.copyto(dst, src))
    return Peaks(name, 2.0 * n**3 / (mm_ms * 1e-3) / 1e12, 2.0 * src.nbytes / (cp_ms * 1e-3) / 1e9,
                 f"CuPy fp16 matmul {n}x{n}x{n}, device copy {copy_mib} MiB (read + write), best of {repeats}")


def peaks_cache() -> Path:
    """The JSON file of measured peaks, keyed by device name."""
    return cache_root() / "bench" / "peaks.json"


def device_peaks(provider: str, remeasure: bool = False) -> tuple[Peaks, bool]:
    """The device's peaks: measured on every call (a second or less) and raised, field by field, to the best the
    cache holds for the device, and stored back. A busy machine only measures a peak low, so the best ever measured
    is the closest to the device's own; one measurement on a loaded machine cannot pin a floor above real runs.
    `remeasure` forgets the cached best and keeps this measurement alone.
    Returns (peaks, whether a cached value was higher than this measurement)."""
    path = peaks_cache()
    try:
        cached = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        cached = {}  # a corrupt cache is overwritten
    if not isinstance(cached, dict):
        cached = {}
    peaks = measure_cuda_peaks() if provider == "cuda" else measure_cpu_peaks()
    old = cached.get(peaks.device)
    from_cache = False
    if not remeasure and isinstance(old, dict):
        try:
            best = Peaks(**old)
        except TypeError:
            best = None  # an entry of another layout is replaced
        if best is not None:
            from_cache = best.peak_tflops > peaks.peak_tflops or best.peak_gbps > peaks.peak_gbps
            peaks = Peaks(peaks.device, max(best.peak_tflops, peaks.peak_tflops),
                          max(best.peak_gbps, peaks.peak_gbps), peaks.method)
    cached[peaks.device] = asdict(peaks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json.dumps(cached, indent=2, sort_keys=True) + "\n", path)
    except (OSError, GtcoError):
        pass  # an unwritable cache only loses the best of earlier runs
    return peaks, from_cache


def _cuda_name(cp: object) -> str:
    """`cuda: <device name>` of CuPy's current device."""
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)  # type: ignore[attr-defined]
    name = props["name"]
    return f"cuda: {name.decode() if isinstance(name, bytes) else name}"
