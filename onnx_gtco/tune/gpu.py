"""The GPU measurer: compile a configuration, run it on the GPU, check its answer, time it.

One trial:
1. compile: the instance is built by kernels.compile (nvcc -Xptxas -v, cached by content) for the arch its
   configuration runs on (search.config_arch: the task's, or sm_90a for a CUTLASS one, which only a 9.0 GPU runs:
   on another the trial fails with "runtime" unbuilt); a compiler error is error kind "compile", a spill or stack
   frame in the ptxas report is "resource"; the object is linked into a shared library (nvcc -shared, the CUDA
   runtime of the machine). This step needs nvcc only.
2. run: the instance's C entry point (family.c_args / entry_point) on `rotate` sets of seeded inputs in device
   memory (CuPy), on a CuPy stream; a non-zero return code is "runtime".
3. check: the first run's outputs against the family's fp64 reference; a relative error over the family's
   tolerance or any NaN is "wrong_answer" (a wrong answer is a failed trial, never a fast one).
4. time: CUDA events around each launch, rotating the input sets so that no run finds the previous one's data in
   L2, `warmup` launches first; the median of `reps` (>= 20) runs, and the p90 - p10 spread.

The device name (GPU model and compute capability) names the studies: times from one GPU never mix with another's.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from onnx_gtco.errors import BuildError
from onnx_gtco.kernels import cublaslt, cutlass
from onnx_gtco.kernels.compile import compile_instance
from onnx_gtco.kernels.cublas_headers import installed_library
from onnx_gtco.kernels.family import Instance, c_args, entry_point, from_storage, np_dtype, rel_error
from onnx_gtco.kernels.select import FAMILIES
from onnx_gtco.kernels.toolchain import cache_root, find_nvcc
from onnx_gtco.tune.search import Measurement, config_arch
from onnx_gtco.tune.tasks import Task

TOLERANCE = {"f16": 2e-3, "bf16": 8e-3, "f32": 1e-5}


def shared_library(instance: Instance) -> Path | Measurement:
    """The instance as a shared library to call, or the failed Measurement (compile / resource)."""
    try:
        compiled = compile_instance(instance)
    except BuildError as e:
        kind = "resource" if "ptxas reports" in str(e) or "ptxas reported no kernel" in str(e) else "compile"
        return Measurement(None, error_kind=kind, detail=str(e)[-2000:])
    lib = cache_root() / "measure" / (compiled.object_path.stem + ".so")
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(".so.tmp")
        proc = subprocess.run([find_nvcc(), "-shared", "-o", str(tmp), str(compiled.object_path)],
                              capture_output=True, text=True, check=False, timeout=300)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            return Measurement(None, error_kind="compile", detail=proc.stderr[-2000:])
        tmp.replace(lib)
    return lib


class GpuMeasurer:
    """Times configurations on the current CUDA device through CuPy (see the module docstring)."""

    name = "gpu"

    def __init__(self, reps: int = 20, warmup: int = 5, rotate: int = 4, seed: int = 0) -> None:
        try:
            import cupy
        except ImportError as e:
            raise RuntimeError(f"the GPU measurer needs CuPy with a CUDA device ({e})") from None
        if reps < 20:
            raise ValueError(f"reps={reps}: the median needs at least 20 runs")
        self.cp = cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.cc = int(props["major"]) * 10 + int(props["minor"])
        self.device = f"{name} sm_{self.cc}"
        if not 80 <= self.cc < 100:
            raise RuntimeError(f"{self.device}: the kernels are built for sm_80 (8.x) and sm_90 (9.x) GPUs")
        self.arch = "sm_80" if self.cc < 90 else "sm_90"
        self.reps, self.warmup, self.rotate, self.seed = reps, warmup, rotate, seed
        self._env = {"measurer": self.name, "gpu": self.device,
                     "driver": str(cupy.cuda.runtime.driverGetVersion()),
                     "toolchain": f"cuda runtime {cupy.cuda.runtime.runtimeGetVersion()}, {_nvcc_version()}"}

    def environment(self) -> dict[str, str]:
        return dict(self._env)

    def measure(self, task: Task, config: Mapping[str, Any]) -> Measurement:
        inst = self.instance(task, config)
        if isinstance(inst, Measurement):
            return inst
        lib = shared_library(inst)
        if isinstance(lib, Measurement):
            return lib
        if config.get("impl") == cublaslt.IMPL:
            load_cublaslt()
        return self.run(task, config, inst, lib)

    def instance(self, task: Task, config: Mapping[str, Any]) -> Instance | Measurement:
        """The trial's instance, built for the arch the configuration runs on (search.config_arch: a CUTLASS one
        for sm_90a), or why this GPU cannot run it (error kind "runtime")."""
        if task.arch != self.arch:
            return Measurement(None, error_kind="runtime",
                               detail=f"the task is built for {task.arch}; this GPU runs {self.arch} code")
        arch = config_arch(task, config)
        if arch == cutlass.ARCH and self.cc != 90:
            return Measurement(None, error_kind="runtime",
                               detail=f"{self.device}: {cutlass.ARCH} code (the CUTLASS GEMMs) runs on 9.0 GPUs only")
        return FAMILIES[task.problem.family].instantiate(task.problem, dict(config), arch)

    def run(self, task: Task, config: Mapping[str, Any], inst: Instance, lib: Path) -> Measurement:
        """Launch the built instance on seeded inputs, check its first answer against the fp64 reference (a wrong
        one fails the trial), then time it."""
        cp = self.cp
        family = FAMILIES[task.problem.family]
        p = task.problem
        sets = []
        for r in range(self.rotate):
            host = family.random_inputs(p, self.seed + r)
            dev = {k: cp.asarray(v) for k, v in host.items()}
            outs = {k: cp.full(shape, np.nan, dtype=np_dtype(dt)) if dt == "f32" else
                    cp.full(shape, 0xFFFF, dtype=np.uint16).view(np_dtype(dt))
                    for k, (shape, dt) in family.outputs(p).items()}
            arrays = {**dev, **outs}
            fields = family.args_fields(p, {k: np.empty(v.shape, v.dtype) for k, v in arrays.items()})
            args = c_args(fields, lambda name, arrays=arrays: int(arrays[name].data.ptr) if name in arrays else None)
            sets.append((host, outs, args))
        fn = entry_point(str(lib), inst.symbol, sets[0][2])
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            code = fn(ctypes.byref(sets[0][2]), stream.ptr)
            stream.synchronize()
            if code != 0:
                why = _cublaslt_error(str(lib)) if config.get("impl") == cublaslt.IMPL else ""
                return Measurement(None, error_kind="runtime", detail=f"{inst.symbol} returned {code}{why}")
            wrong = wrong_answer(task, sets[0][0], {k: cp.asnumpy(v) for k, v in sets[0][1].items()})
            if wrong is not None:
                return wrong
            for i in range(self.warmup):
                fn(ctypes.byref(sets[i % self.rotate][2]), stream.ptr)
            times = []
            for i in range(self.reps):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                fn(ctypes.byref(sets[i % self.rotate][2]), stream.ptr)
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
        q = statistics.quantiles(times, n=10)
        return Measurement(statistics.median(times), q[-1] - q[0], runs=self.reps)


def wrong_answer(task: Task, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
                 ) -> Measurement | None:
    """The failed Measurement (error kind "wrong_answer") when an output of a run on `inputs` (as stored: 16-bit
    outputs as their bits) is off the family's fp64 reference by more than TOLERANCE or not finite, else None."""
    family = FAMILIES[task.problem.family]
    p = task.problem
    want = family.reference(p, dict(inputs))
    for name, out in outputs.items():
        got = from_storage(np.asarray(out), family.outputs(p)[name][1])
        err = rel_error(got, want[name])
        if not np.isfinite(err) or err > TOLERANCE[p.dtype]:
            return Measurement(None, error_kind="wrong_answer",
                               detail=f"{name}: relative error {err:.3g} against the fp64 reference")
    return None


def load_cublaslt() -> None:
    """Load libcublasLt globally, as ONNX Runtime's CUDA EP does, from the nvidia-cublas package where installed (a
    cuBLASLt instance finds it loaded; without it the instance reports that it is absent)."""
    lib = installed_library()
    if lib is not None:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def _cublaslt_error(lib: str) -> str:
    fn = ctypes.CDLL(lib).gtco_cublaslt_error
    fn.restype = ctypes.c_char_p
    why = fn().decode()
    return f": {why}" if why else ""


def _nvcc_version() -> str:
    try:
        out = subprocess.run([find_nvcc(), "--version"], capture_output=True, text=True, check=False).stdout
    except (BuildError, OSError):
        return "nvcc unknown"
    return out.strip().splitlines()[-1] if out.strip() else "nvcc unknown"


def gpu_available() -> bool:
    """Whether CuPy sees a CUDA device (the GPU measurer can run)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no CuPy, no driver, no device: all mean no GPU measurer
        return False


__all__ = ["GpuMeasurer", "gpu_available", "shared_library", "wrong_answer"]
