"""Run a generated instance on the CPU: build its source with g++ -DGTCO_EMULATE into a shared library and call its
C entry point in a child process (the emulation exits the process on a kernel fault, which must not take the
caller down with it)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from onnx_gtco.errors import EmulationError
from onnx_gtco.kernels.family import Field, Instance
from onnx_gtco.kernels.toolchain import DEVICE_INCLUDE_DIRS, find_cxx, headers_digest, run_compile

RUN_TIMEOUT_S = 300.0


def build_emulated(instance: Instance, out_dir: str | os.PathLike[str], extra: Sequence[str] = ("-O2",)) -> Path:
    """Compile `instance.source` for the emulation; cached in `out_dir` by a hash of the source, the flags and the
    headers it includes (plugins/include, plugins/families and plugins/emu: an emulation change rebuilds)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256("\0".join([instance.source, *extra, headers_digest()]).encode()).hexdigest()[:16]
    lib = out / f"{instance.name}.{key}.emu.so"
    if lib.exists():
        return lib
    src = out / f"{instance.name}.{key}.cu"
    src.write_text(instance.source)
    tmp = lib.with_name(lib.name + f".{os.getpid()}.tmp")
    cmd = [find_cxx(), "-std=c++17", "-pthread", "-shared", "-fPIC", "-DGTCO_EMULATE", *(f"-I{d}" for d in
    DEVICE_INCLUDE_DIRS), *extra,        "-x", "c++", str(src), "-o", str(tmp)]
    try:
        run_compile(cmd, src)
        tmp.replace(lib)
    finally:
        tmp.unlink(missing_ok=True)
    return lib


def run_emulated(lib: str | os.PathLike[str], symbol: str, fields: Sequence[Field],
                 arrays: Mapping[str, np.ndarray], outputs: Sequence[str],
                 timeout_s: float = RUN_TIMEOUT_S, calls: int = 1) -> dict[str, np.ndarray]:
    """Call `symbol(&args, nullptr)` of an emulated library on `arrays` and return the named output arrays.

    `arrays` holds inputs and preallocated outputs by name; "ptr" fields name them. With `calls` > 1 the entry
    point runs that many times in one process, the outputs refilled with their preallocated contents before each
    call, and the last call's outputs are returned: what one launch leaves behind for the next (a workspace)
    shows.

    Raises:
        EmulationError: the kernel faulted, returned non-zero, or ran past `timeout_s`.
    """
    with tempfile.TemporaryDirectory(prefix="gtco-emu-") as tmp:
        data = Path(tmp) / "arrays.npz"
        np.savez(data, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
        spec = Path(tmp) / "fields.txt"
        spec.write_text("\n".join(f"{f.name}\t{f.kind}\t{f.value}" for f in fields) + "\n")
        cmd = [sys.executable, "-m", "onnx_gtco.kernels._emu_runner", str(lib), symbol, str(spec), str(data),
               ",".join(outputs), str(calls)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise EmulationError(f"{symbol}: emulation ran past {timeout_s:g} s") from None
        if proc.returncode != 0:
            raise EmulationError(f"{symbol}: emulation failed (exit {proc.returncode}): "
                                 f"{(proc.stderr.strip() or proc.stdout.strip())[-2000:]}")
        with np.load(Path(tmp) / "out.npz") as out:
            return {k: out[k] for k in outputs}
