"""Open an optimized model in ONNX Runtime, with or without its custom-op library.

The rewritten model names its library in the metadata entry `gtco.library` (a file name, resolved beside the
model). Registering it hides the model-local functions of the op types it registers (facts §4/5); what it registers
is the session config entry gtco.register (plugins/ort/register.inc): "cuda", the library's default, only the op
types with a CUDA kernel (the others keep running their functions, on the GPU rather than a CPU kernel), "all"
every op type (CPU sessions only: on a CUDA session it pins the CPU-only op types to the CPU EP), "none" nothing.
By default ("auto") the library is registered only for sessions that can use its CUDA kernels (CUDAExecutionProvider
requested and available, facts §5 option 4), in mode "cuda"; every other session runs the functions.
library=True registers it for any providers: in mode "all" on a session without the CUDA EP (the CPU kernels then
run: that is how `onnx-gtco check --library` tests them), in mode "cuda" on one with it; False never registers it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import onnx

from onnx_gtco.config import pdl_env
from onnx_gtco.errors import CudaProviderError, LibraryError, first_line
from onnx_gtco.runtime.cuda_ep import CUDA_EP, load_cuda_libraries, require_cuda_ep

METADATA_KEY = "gtco.library"
REGISTER_KEY = "gtco.register"
"""The session config entry the library reads when it is registered: one of REGISTER_MODES."""
REGISTER_MODES = ("cuda", "all", "none")
PDL_KEY = "gtco.pdl"
"""Session config entry: "0" launches no kernel with programmatic dependent launch (plugins/ort/register.inc);
$GTCO_PDL sets it in the sessions make_session creates, unless the caller's options set it."""


def library_path(path: str | os.PathLike[str]) -> Path | None:
    """The library the model at `path` names in its metadata (resolved beside it), or None when it names none."""
    model = onnx.load_model(str(path), load_external_data=False)
    name = next((m.value for m in model.metadata_props if m.key == METADATA_KEY), None)
    if not name:
        return None
    return Path(path).resolve().parent / name


def _provider_names(providers: Sequence[Any]) -> list[str]:
    return [p[0] if isinstance(p, (tuple, list)) else p for p in providers]


def _wants_library(library: bool | str, providers: Sequence[Any], available: Sequence[str]) -> bool:
    if library is True or library is False:
        return library
    if library != "auto":
        raise ValueError(f"library={library!r}: choose True, False or 'auto'")
    return CUDA_EP in _provider_names(providers) and CUDA_EP in available


def register_mode(library: bool | str, providers: Sequence[Any]) -> str:
    """The gtco.register mode for a session that registers the library: "all" (every CPU kernel) only when the
    caller asked for the library (True) on a session without the CUDA EP, else "cuda", so a CUDA session never
    has a fused node pinned to a CPU kernel."""
    return "all" if library is True and CUDA_EP not in _provider_names(providers) else "cuda"


def _has_entry(so: Any, key: str) -> bool:
    """Whether the session options set config entry `key` (ORT raises for an entry never set)."""
    try:
        return bool(so.get_session_config_entry(key))
    except Exception:  # ORT raises its own types
        return False


def make_session(path: str | os.PathLike[str], providers: Sequence[Any] | None = None, *,
                 library: bool | Literal["auto"] = "auto", sess_options: Any = None) -> Any:
    """An onnxruntime.InferenceSession of the optimized model at `path`.

    Args:
        path: the .onnx file.
        providers: ORT providers; default: the available ones among CUDA and CPU, CUDA first.
        library: True: register the model's library (every op type on a CPU session); False: never; "auto": only
            for a CUDA EP session.
        sess_options: an onnxruntime.SessionOptions to extend (default a new one).

    Raises:
        LibraryError: the library is wanted but the metadata names none, or the file is missing or fails to load.
        CudaProviderError: `providers` asks for the CUDA EP and this onnxruntime has none, or ORT could not create
            it for the session (never a silent CPU session).
    """
    import onnxruntime as ort

    available = ort.get_available_providers()
    if providers is None:
        providers = [p for p in (CUDA_EP, "CPUExecutionProvider") if p in available]
    cuda = CUDA_EP in _provider_names(providers)
    if cuda and CUDA_EP not in available:
        raise CudaProviderError(f"{path}: {CUDA_EP} was asked for, but this onnxruntime ({ort.__version__}) has "
                                f"none (it has {', '.join(available)}): install onnxruntime-gpu, or ask for "
                                "CPUExecutionProvider")
    if cuda:
        load_cuda_libraries()
    so = sess_options if sess_options is not None else ort.SessionOptions()
    if _wants_library(library, providers, available):
        so.add_session_config_entry(REGISTER_KEY, register_mode(library, providers))
        try:
            pdl = pdl_env()
        except ValueError as e:
            raise LibraryError(str(e)) from None
        if pdl is not None and not _has_entry(so, PDL_KEY):
            so.add_session_config_entry(PDL_KEY, pdl)
        lib = library_path(path)
        if lib is None:
            if library is True:
                raise LibraryError(f"{path}: the model names no custom-op library (metadata {METADATA_KEY!r}); "
                                   "optimize it without --no-build")
        elif not lib.is_file():
            raise LibraryError(f"{path}: its custom-op library {lib} (metadata {METADATA_KEY!r}) does not exist; "
                               "keep the library beside the model, rebuild it with onnx-gtco optimize, or pass "
                               "library=False to run the model-local functions")
        else:
            try:
                so.register_custom_ops_library(str(lib))
            except Exception as e:  # ORT raises its own types
                raise LibraryError(f"{lib}: onnxruntime cannot load the library: {first_line(e)}") from None
    session = ort.InferenceSession(str(path), so, providers=list(providers))
    return require_cuda_ep(session, str(path)) if cuda else session
