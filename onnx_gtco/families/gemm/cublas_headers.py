"""The cuBLASLt header the cuBLASLt GEMM instances compile against (never committed to the repo; nothing links
against libcublasLt: plugins/families/gemm/cublaslt.h resolves its functions at run time).

`cublaslt_include_dir()` returns a directory holding `cublasLt.h` (and the `cublas_api.h` it includes):

1. `$GTCO_CUBLASLT_INCLUDE` when set (validated: an error when the header is not there);
2. else the installed `nvidia-cublas` wheel's `nvidia/cu13/include` (the `cublaslt` extra; torch's CUDA 13 builds
   install it too);
3. else a per-user cache, `cache_root()/cublas-headers/<version>/`, filled once by
   `python -m pip download --no-deps nvidia-cublas==<version>` (the wheel is large; only its headers are kept).
   The headers are unpacked into a temporary directory that is renamed into place, so the cache is either complete
   or absent.

cublasLt.h includes CUDA's runtime headers (driver_types.h and the crt/ it includes, cuda_fp16.h, library_types.h).
nvcc brings its own; a g++ build of a cuBLASLt instance, the emulation's (onnx_gtco.plugin.library), takes them from
`cuda_runtime_include_dir()`.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from onnx_gtco.config import CUBLASLT_INCLUDE_ENV, cublaslt_include_override
from onnx_gtco.errors import BuildError, HeaderError
from onnx_gtco.kernels.toolchain import cache_root, find_nvcc

ENV = CUBLASLT_INCLUDE_ENV
HEADER = "cublasLt.h"
PACKAGE = "nvidia-cublas"
VERSION = "13.1.1.3"
_INNER = "nvidia/cu13/include/"
_TIMEOUT_S = 900.0


def cublaslt_include_dir(download: bool = True) -> Path:
    """A directory with cublasLt.h (see the module docstring); with download=False only what is here already.

    Raises:
        HeaderError: $GTCO_CUBLASLT_INCLUDE lacks the header, the download / unpacking failed (the message
            names the step and how to work around it), or, with download=False, none is here.
    """
    override = cublaslt_include_override()
    if override:
        d = Path(override)
        if not (d / HEADER).is_file():
            raise HeaderError(f"{ENV}={override!r} has no {HEADER} (point it at the folder holding cublasLt.h, "
                              f"e.g. a CUDA toolkit's include/, or unset it to use the {PACKAGE} package)")
        return d
    installed = installed_include_dir()
    if installed is not None:
        return installed
    target = cache_root() / "cublas-headers" / VERSION
    if (target / HEADER).is_file():
        return target
    if not download:
        raise HeaderError(f"{HEADER} is not here ({ENV} is unset, {PACKAGE} is not installed, {target} is empty) "
                          f"and would be downloaded: set {ENV} to a folder with {HEADER}")
    return _fill(target)


RUNTIME_HEADERS = ("driver_types.h", "crt/host_defines.h", "cuda_fp16.h", "library_types.h")
"""What cublasLt.h needs of CUDA's own headers, beside it or in a folder of cuda_runtime_include_dir's."""
CUDA_INCLUDE = Path("/usr/local/cuda/include")
"""The CUDA toolkit's default install: the last folder cuda_runtime_include_dir tries."""


def cuda_runtime_include_dir(lt_include: Path) -> Path:
    """A folder with CUDA's runtime headers that cublasLt.h (in `lt_include`) includes, for a g++ build of a cuBLASLt
    instance (the emulation; nvcc brings its own): `lt_include` itself where it has them (a CUDA toolkit's include/,
    or the nvidia wheels' shared folder where they carry crt/), else the toolkit of nvcc (its bin/'s ../include,
    symbolic links followed), else /usr/local/cuda/include.

    Raises:
        HeaderError: none of them has every one of RUNTIME_HEADERS (the message names the folders tried).
    """
    tried = [lt_include]
    try:
        tried.append(Path(find_nvcc()).resolve().parent.parent / "include")
    except BuildError:
        pass  # no nvcc: the default install may still be there
    tried.append(CUDA_INCLUDE)
    for d in tried:
        if all((d / h).is_file() for h in RUNTIME_HEADERS):
            return d
    raise HeaderError(f"CUDA's runtime headers that {HEADER} includes ({', '.join(RUNTIME_HEADERS)}) are in none of "
                      f"{', '.join(map(str, dict.fromkeys(tried)))}: install the CUDA toolkit (nvcc on PATH, or "
                      f"{CUDA_INCLUDE})")


def installed_include_dir() -> Path | None:
    """The installed nvidia-cublas wheel's include folder, or None when it is not installed (or has no header)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    header = Path(str(dist.locate_file(_INNER + HEADER)))
    return header.parent if header.is_file() else None


def installed_library() -> Path | None:
    """The installed nvidia-cublas wheel's libcublasLt.so.<major>, or None (a process without ONNX Runtime's CUDA EP,
    such as the GPU measurer's, loads it from there before calling a cuBLASLt instance)."""
    include = installed_include_dir()
    if include is None:
        return None
    found = sorted((include.parent / "lib").glob("libcublasLt.so.*"))
    return found[0] if found else None


def unpack_headers(wheel: Path, target: Path) -> Path:
    """The wheel's `nvidia/cu13/include/*.h` into `target` (created through a temporary sibling, so it is complete
    or absent); returns target.

    Raises:
        HeaderError: the wheel is unreadable or has no cublasLt.h.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith(_INNER) and n.endswith(".h") and "/" not in
                     n[len(_INNER):]]
            if _INNER + HEADER not in names:
                raise HeaderError(f"{wheel.name} has no {_INNER}{HEADER}")
            for n in names:
                (tmp / n[len(_INNER):]).write_bytes(z.read(n))
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / HEADER).is_file():  # another process filled it first: fine
                raise
        return target
    except zipfile.BadZipFile as e:
        raise HeaderError(f"{wheel.name} is not a readable wheel: {e}") from None
    except OSError as e:
        raise HeaderError(f"cannot write the cuBLASLt header cache {target}: {e} (set {ENV} to a folder with "
                          f"{HEADER})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fill(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".dl.", dir=target.parent) as dl:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", dl, f"{PACKAGE}=={VERSION}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise HeaderError(f"pip download {PACKAGE}=={VERSION} failed: {e} (install {PACKAGE}, or set {ENV} to a "
                              f"folder with {HEADER})") from None
        wheels = sorted(Path(dl).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise HeaderError(f"pip download {PACKAGE}=={VERSION} failed (exit {proc.returncode}): {tail} (needs "
                              f"access to PyPI; or install {PACKAGE}, or set {ENV} to a folder with {HEADER})")
        return unpack_headers(wheels[0], target)


__all__ = ["CUDA_INCLUDE", "ENV", "HEADER", "PACKAGE", "RUNTIME_HEADERS", "VERSION", "cublaslt_include_dir",
           "cuda_runtime_include_dir", "installed_include_dir", "installed_library", "unpack_headers"]
