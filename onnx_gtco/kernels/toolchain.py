"""Find the compilers (nvcc for devices, g++ for the CPU emulation) and run one compile with a clear failure."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from onnx_gtco.config import SANITIZE_ENV, cache_base, compiler_environ, compiler_override, sanitizer_env
from onnx_gtco.errors import BuildError

DEFAULT_TIMEOUT_S = 120.0


def _plugins_dir() -> Path:
    """The C++/CUDA sources: `plugins/` of a source checkout, else the copy a wheel ships as onnx_gtco/_plugins."""
    package = Path(__file__).resolve().parents[1]
    for cand in (package.parent / "plugins", package / "_plugins"):
        if (cand / "include" / "gtco").is_dir():
            return cand
    return package.parent / "plugins"  # not found: paths under it name what is missing in the compile error


PLUGINS_DIR = _plugins_dir()
DEVICE_INCLUDE_DIRS = (PLUGINS_DIR / "include", PLUGINS_DIR / "families")
"""Where a kernel instance's includes are found: the shared device headers (`gtco/primitives.cuh`, ...) and the
families' folders (`<family>/<family>.cuh`)."""
GLUE_INCLUDE_DIRS = (PLUGINS_DIR / "ort", PLUGINS_DIR / "cpu", *DEVICE_INCLUDE_DIRS)
"""Where the ORT glue's includes are found: the shared glue (`gtco_ort.h`), the CPU kernels' shared helpers
(`parallel.h`) and the device include folders (a family's `<family>/<family>_op.h` and `_ref.h` beside its header)."""


@lru_cache(maxsize=1)
def headers_digest() -> str:
    """Hash of every file under plugins/include, plugins/families and plugins/emu (a header change rebuilds every
    kernel)."""
    h = hashlib.sha256()
    for root in (*DEVICE_INCLUDE_DIRS, PLUGINS_DIR / "emu"):
        for path in sorted(root.rglob("*")):
            if path.is_file():
                h.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_root() -> Path:
    """Where built kernels, libraries and the ORT headers are kept: `$GTCO_CACHE_DIR`, else
    `$XDG_CACHE_HOME/onnx-gtco`, else `~/.cache/onnx-gtco`; with $GTCO_SANITIZE set, its `sanitize-<name>`
    subfolder, so that sanitized builds and plain ones never share a cache entry (nor a library file name's hash
    in it)."""
    root = cache_base()
    name = sanitizer()
    return root / f"sanitize-{name}" if name else root


_SANITIZERS = {
    "address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-g"),
}


def sanitizer() -> str:
    """The sanitizer $GTCO_SANITIZE asks for ("address"), or "" when it is unset or empty.

    Raises:
        BuildError: any other value.
    """
    name = sanitizer_env()
    if name and name not in _SANITIZERS:
        raise BuildError(f"{SANITIZE_ENV}={name!r}: choose one of {', '.join(sorted(_SANITIZERS))} or leave it unset")
    return name


def sanitize_flags() -> tuple[str, ...]:
    """The host-compiler flags of $GTCO_SANITIZE (compile and link), added by run_compile to every g++ command.

    A sanitized library must be loaded into a process that has the sanitizer's runtime first, e.g.
    `LD_PRELOAD=$(g++ -print-file-name=libasan.so)` for "address". nvcc-compiled device objects are not instrumented.
    """
    name = sanitizer()
    return _SANITIZERS[name] if name else ()


def _is_host_compiler(tool: str) -> bool:
    name = Path(tool).name
    cxx = compiler_override("CXX")
    return name.endswith(("g++", "c++", "clang++")) or (bool(cxx) and name == Path(cxx).name)


_ERROR_LINES = 6


@dataclass(frozen=True)
class CompileResult:
    """A compile that succeeded: the command line, what it printed and how long it took."""

    command: tuple[str, ...]
    stdout: str
    stderr: str
    seconds: float


def _find(env: str, default: str, hint: str) -> str:
    override = compiler_override(env)
    if override:
        found = shutil.which(override)
        if found is None:
            raise BuildError(f"{default} not found ({hint}): {env}={override!r} is not an executable")
        return found
    found = shutil.which(default)
    if found is None:
        raise BuildError(f"{default} not found ({hint})")
    return found


def find_nvcc() -> str:
    """Path of nvcc: $NVCC if set, else nvcc on PATH.

    Raises:
        BuildError: "nvcc not found (set NVCC or install the CUDA toolkit)".
    """
    return _find("NVCC", "nvcc", "set NVCC or install the CUDA toolkit")


def find_cxx() -> str:
    """Path of the host C++ compiler: $CXX if set, else g++ on PATH.

    Raises:
        BuildError: "g++ not found (set CXX or install g++)".
    """
    return _find("CXX", "g++", "set CXX or install g++")


def _first_errors(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return "\n".join((errors or lines[-_ERROR_LINES:])[:_ERROR_LINES])


def run_compile(command: Sequence[str], source: str | os.PathLike[str],
                timeout_s: float = DEFAULT_TIMEOUT_S) -> CompileResult:
    """Run one compiler command line (a host compiler's with the flags of $GTCO_SANITIZE, sanitize_flags()).

    Args:
        command: the full command, compiler first.
        source: the file being compiled, named in errors.
        timeout_s: wall-clock limit.

    Raises:
        BuildError: naming the source and the compiler's first error lines when it exits non-zero, or saying it
            timed out.
    """
    cmd = tuple(str(c) for c in command)
    tool = Path(cmd[0]).name
    extra = sanitize_flags() if _is_host_compiler(cmd[0]) else ()
    cmd = (cmd[0], *extra, *cmd[1:])
    start = time.monotonic()
    env = compiler_environ() if sanitizer() else None  # the tests' preloaded sanitizer runtime: not in compilers
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{tool} timed out after {timeout_s:g} s compiling {source}") from None
    except OSError as e:
        raise BuildError(f"{tool} could not run on {source}: {e.strerror or e}") from None
    if proc.returncode != 0:
        raise BuildError(f"{tool} failed on {source} (exit {proc.returncode}):\n"
                         f"{_first_errors(proc.stderr + proc.stdout)}")
    return CompileResult(cmd, proc.stdout, proc.stderr, time.monotonic() - start)


def _flags(include_dirs: Sequence[str | os.PathLike[str]], defines: Sequence[str]) -> list[str]:
    return [f"-I{d}" for d in include_dirs] + [f"-D{d}" for d in defines]


def nvcc_compile(source: str | os.PathLike[str], output: str | os.PathLike[str], arch: str = "sm_80", *,
                 include_dirs: Sequence[str | os.PathLike[str]] = (), defines: Sequence[str] = (),
                 extra: Sequence[str] = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> CompileResult:
    """Compile a .cu to an object file for one architecture with the ptxas report on (parse its stderr with
    onnx_gtco.kernels.ptxas.parse_ptxas)."""
    cmd = [find_nvcc(), f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", *_flags(include_dirs, defines), *extra,
           "-c", str(source), "-o", str(output)]
    return run_compile(cmd, source, timeout_s)


def cxx_build(source: str | os.PathLike[str], output: str | os.PathLike[str], *,
              include_dirs: Sequence[str | os.PathLike[str]] = (), defines: Sequence[str] = (),
              extra: Sequence[str] = ("-O1",), timeout_s: float = DEFAULT_TIMEOUT_S) -> CompileResult:
    """Build an executable from one C++ (or .cu written for the emulation) source with the host compiler."""
    cmd = [find_cxx(), "-std=c++17", "-pthread", *_flags(include_dirs, defines), *extra,
           "-x", "c++", str(source), "-o", str(output)]
    return run_compile(cmd, source, timeout_s)
