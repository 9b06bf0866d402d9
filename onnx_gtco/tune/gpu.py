"""The GPU measurer: compile a configuration, run it on the GPU, check its answer, time it.

One trial is a build (in the tuning process, in parallel with the other builds in flight: tune.builder) and a run (in
a child process, one at a time: tune.runner):
1. build: the instance is built by kernels.compile (nvcc -Xptxas -v, cached by content) for the arch its
   configuration runs on (search.config_arch: the task's, or sm_90a for a CUTLASS one, which only a 9.0 GPU runs:
   on another the trial fails with "runtime" unbuilt); a compiler error is error kind "compile", a spill or stack
   frame in the ptxas report is "resource"; the object is linked into a shared library (nvcc -shared, the CUDA
   runtime of the machine). This step needs nvcc only (`build_candidate`).
2. run: in the runner's child, the instance's C entry point (family.c_args / entry_point) on `rotate` sets of
   seeded inputs in device memory (CuPy), on a CuPy stream; a non-zero return code or a CUDA error is "runtime",
   the child dying is "crash", no answer within the runner's timeout is "timeout".
3. check: the first run's outputs against the family's fp64 reference; a relative error over the family's
   tolerance or any NaN is "wrong_answer" (a wrong answer is a failed trial, never a fast one).
4. time: CUDA events around each launch, rotating the input sets so that no run finds the previous one's data in
   L2, `warmup` launches first; the median of `reps` (>= 20) runs, and the p90 - p10 spread. With `queued` each
   timed launch waits in the stream behind a short spin kernel, so that the events time the kernel as a profiler
   would and not the host's launch latency too (a few microseconds that dwarf a small kernel): what a calibration
   compares with profiled kernel times (the GPU suite's calibration row).

Every family of kernels.select.FAMILIES is measured, and the elementwise programs (their Problem carries the
program: the patchify copy, a transpose).

The device name (GPU model and compute capability) names the studies: times from one GPU never mix with another's.
"""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from onnx_gtco.errors import BuildError, KernelResourceError
from onnx_gtco.kernels.compile import compile_instance
from onnx_gtco.kernels.family import (
    Instance,
    KernelFamily,
    Problem,
    c_args,
    entry_point,
    from_storage,
    np_dtype,
    rel_error,
)
from onnx_gtco.kernels.select import ALL_FAMILIES, implementation
from onnx_gtco.kernels.toolchain import cache_root, find_nvcc
from onnx_gtco.tune.builder import Artifact, BuildResult, build_and_run
from onnx_gtco.tune.runner import RUN_TIMEOUT_S, LocalRunner
from onnx_gtco.tune.search import Measurement, config_arch
from onnx_gtco.tune.tasks import Task

TOLERANCE = {"f16": 2e-3, "bf16": 8e-3, "f32": 1e-5}
QUEUE_CYCLES = 100_000
"""SM clock cycles a queued measurement's spin kernel runs ahead of each timed launch (50 us at 2 GHz): longer than
the host takes to record the start event and launch the instance, so the GPU reaches both back to back."""
_SPIN = r"""
extern "C" __global__ void gtco_queue_spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
"""


def family_of(problem: Problem) -> KernelFamily:
    """The kernel family that builds and checks `problem` (kernels.select.ALL_FAMILIES: the per-group elementwise
    family too, which its binder selects)."""
    return ALL_FAMILIES[problem.family]


def shared_library(instance: Instance) -> Path | Measurement:
    """The instance as a shared library to call, or the failed Measurement (compile / resource). Safe to call from
    several threads at once, for the same instance too (each links under a name of its own, then renames)."""
    try:
        compiled = compile_instance(instance)
    except BuildError as e:
        kind = "resource" if isinstance(e, KernelResourceError) else "compile"
        return Measurement(None, error_kind=kind, detail=str(e)[-2000:])
    lib = cache_root() / "measure" / (compiled.object_path.stem + ".so")
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".so.tmp", dir=lib.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            proc = subprocess.run([find_nvcc(), "-shared", "-o", str(tmp), str(compiled.object_path)],
                                  capture_output=True, text=True, check=False, timeout=300)
            if proc.returncode != 0:
                return Measurement(None, error_kind="compile", detail=proc.stderr[-2000:])
            tmp.replace(lib)
        finally:
            tmp.unlink(missing_ok=True)
    return lib


def build_candidate(task: Task, config: Mapping[str, Any]) -> BuildResult:
    """A configuration of `task` built for the arch it runs on (search.config_arch) as a shared library, or the
    failed build (compile / resource). nvcc only: no GPU is needed."""
    inst = family_of(task.problem).instantiate(task.problem, dict(config), config_arch(task, config))
    lib = shared_library(inst)
    if isinstance(lib, Measurement):
        return BuildResult(None, lib.error_kind, lib.detail)
    return BuildResult(Artifact(str(lib), inst.symbol))


class GpuMeasurer:
    """Times configurations on the current CUDA device through CuPy (see the module docstring).

    `isolate` (the default): runs happen in a child process (runner.LocalRunner, started on the first run and
    again after a failed one), which makes its own GpuMeasurer with isolate=False, the one that launches;
    `timeout_s` bounds one run there. `queued`: each timed launch waits behind a spin kernel (the module
    docstring's step 4). `close()` stops the child."""

    name = "gpu"

    def __init__(self, reps: int = 20, warmup: int = 5, rotate: int = 4, seed: int = 0, isolate: bool = True,
                 timeout_s: float = RUN_TIMEOUT_S, queued: bool = False) -> None:
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
        self.isolate, self.queued = isolate, queued
        child = functools.partial(GpuMeasurer, reps=reps, warmup=warmup, rotate=rotate, seed=seed, isolate=False,
                                  queued=queued)
        self._runner = LocalRunner(child, timeout_s=timeout_s) if isolate else None
        self._env = {"measurer": self.name, "gpu": self.device,
                     "driver": str(cupy.cuda.runtime.driverGetVersion()),
                     "toolchain": f"cuda runtime {cupy.cuda.runtime.runtimeGetVersion()}, {_nvcc_version()}"}

    def environment(self) -> dict[str, str]:
        return dict(self._env)

    def measure(self, task: Task, config: Mapping[str, Any]) -> Measurement:
        """build, then run: one trial's measurement."""
        return build_and_run(self, task, config)

    def build(self, task: Task, config: Mapping[str, Any]) -> BuildResult:
        """The trial's shared library (build_candidate), or why it is not built: a compile or resource error, or
        this GPU cannot run its code (error kind "runtime": a task for another arch, a configuration built for an
        arch-specific target, a CUTLASS one's sm_90a, on a GPU other than that one)."""
        if task.arch != self.arch:
            return BuildResult(None, "runtime", f"the task is built for {task.arch}; this GPU runs {self.arch} code")
        arch = config_arch(task, config)
        if arch.endswith("a") and self.cc != int(arch[3:-1]):
            cc = int(arch[3:-1])
            return BuildResult(None, "runtime", f"{self.device}: {arch} code (the {config.get('impl')} "
                               f"configurations) runs on {cc // 10}.{cc % 10} GPUs only")
        return build_candidate(task, config)

    def run(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        """Measure a built candidate: in the child process when isolated, else here (launch())."""
        if self._runner is not None:
            return self._runner.run(task, config, artifact)
        return self.launch(task, config, artifact)

    def close(self) -> None:
        """Stop the measuring child process, if one runs."""
        if getattr(self, "_runner", None) is not None:
            self._runner.close()

    def launch(self, task: Task, config: Mapping[str, Any], artifact: Artifact) -> Measurement:
        """Launch the built candidate in this process on seeded inputs, check its first answer against the fp64
        reference (a wrong one fails the trial), then time it."""
        impl = implementation(config)
        if impl is not None and impl.prepare is not None:
            impl.prepare()  # cuBLASLt: its library loaded as ONNX Runtime's CUDA EP loads it
        cp = self.cp
        family = family_of(task.problem)
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
        fn = entry_point(artifact.library, artifact.symbol, sets[0][2])
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            code = fn(ctypes.byref(sets[0][2]), stream.ptr)
            stream.synchronize()
            if code != 0:
                why = impl.last_error(artifact.library) if impl is not None and impl.last_error else ""
                return Measurement(None, error_kind="runtime", detail=f"{artifact.symbol} returned {code}{why}")
            wrong = wrong_answer(task, sets[0][0], {k: cp.asnumpy(v) for k, v in sets[0][1].items()})
            if wrong is not None:
                return wrong
            for i in range(self.warmup):
                fn(ctypes.byref(sets[i % self.rotate][2]), stream.ptr)
            spin = cp.RawKernel(_SPIN, "gtco_queue_spin") if self.queued else None
            times = []
            for i in range(self.reps):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                if spin is not None:  # the GPU spins while the host records the start event and launches
                    spin((1,), (1,), (np.int64(QUEUE_CYCLES),))
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
    family = family_of(task.problem)
    p = task.problem
    want = family.reference(p, dict(inputs))
    for name, out in outputs.items():
        got = from_storage(np.asarray(out), family.outputs(p)[name][1])
        err = rel_error(got, want[name])
        if not np.isfinite(err) or err > TOLERANCE[p.dtype]:
            return Measurement(None, error_kind="wrong_answer",
                               detail=f"{name}: relative error {err:.3g} against the fp64 reference")
    return None


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


__all__ = ["QUEUE_CYCLES", "GpuMeasurer", "build_candidate", "family_of", "gpu_available", "shared_library",
           "wrong_answer"]
