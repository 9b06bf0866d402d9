"""onnxruntime-gpu's CUDA execution provider: its CUDA libraries found, and proof that a session really got it.

ORT falls back to the CPU with one log line when the CUDA EP's libraries (cuBLAS, cuDNN, cudart) cannot be loaded,
and the session then runs on the CPU under a "cuda" label. `onnxruntime.preload_dlls()` loads them from the nvidia-*
wheels, but only from the site folder onnxruntime itself is installed in; `load_cuda_libraries` asks it for every
site folder that holds them (a venv's, torch's), and `require_cuda_ep` turns a silent fallback into an error.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
from pathlib import Path
from typing import Any

from onnx_gtco.errors import CudaProviderError

CUDA_EP = "CUDAExecutionProvider"


def nvidia_lib_dirs() -> list[Path]:
    """The `lib` folders of the installed nvidia-* wheels (`nvidia/cu13/lib`, `nvidia/cudnn/lib`, ...), across every
    site folder on the path that holds part of the `nvidia` namespace package."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    return [lib for root in roots for lib in sorted(Path(root).glob("*/lib")) if lib.is_dir()]


@functools.cache
def load_cuda_libraries() -> tuple[str, ...]:
    """Preload the CUDA and cuDNN libraries of the nvidia-* wheels with onnxruntime's own `preload_dlls`, one call per
    wheel folder, so the CUDA EP finds them by soname. A no-op without onnxruntime-gpu (or an ORT older than 1.21).
    Returns the folders it loaded from. What is still missing shows as a session without the CUDA EP, which
    `require_cuda_ep` reports."""
    import onnxruntime as ort

    if CUDA_EP not in ort.get_available_providers() or not hasattr(ort, "preload_dlls"):
        return ()
    used = []
    for lib in nvidia_lib_dirs():
        cuda = any(lib.glob("libcublasLt.so.*")) or any(lib.glob("libcudart.so.*"))
        cudnn = any(lib.glob("libcudnn.so.*"))
        if not (cuda or cudnn):
            continue
        # preload_dlls prints a line per library a folder lacks: the others are in their own folders
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(OSError, RuntimeError):
            ort.preload_dlls(cuda=cuda, cudnn=cudnn, msvc=False, directory=str(lib))
            used.append(str(lib))
    return tuple(used)


def require_cuda_ep(session: Any, what: str) -> Any:
    """`session` when ORT created the CUDA EP for it.

    Raises:
        CudaProviderError: the session runs on other providers only (ORT could not load the EP's libraries).
    """
    got = session.get_providers()
    if CUDA_EP not in got:
        raise CudaProviderError(
            f"{what}: onnxruntime created no {CUDA_EP} for the session (it runs on {', '.join(got)}): the CUDA "
            "EP's libraries (cuBLAS, cuDNN, cudart) were not found; install onnxruntime-gpu's CUDA dependencies "
            "(e.g. pip install 'onnxruntime-gpu[cuda,cudnn]') or put them on LD_LIBRARY_PATH")
    return session
