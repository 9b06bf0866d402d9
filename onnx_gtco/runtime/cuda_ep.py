"""onnxruntime-gpu's CUDA execution provider: its CUDA libraries found, and proof that a session really got it.

ORT falls back to the CPU with one log line when the CUDA EP's libraries (cuBLAS, cuDNN, cudart) cannot be loaded,
and the session then runs on the CPU under a "cuda" label. `onnxruntime.preload_dlls()` loads them from the nvidia-*
wheels, but only from the site folder onnxruntime itself is installed in; `load_cuda_libraries` asks it for every
site folder that holds them (a venv's, torch's), and `require_cuda_ep` turns a silent fallback into an error.

A session can have the CUDA EP and still run a fused node on the CPU (a CPU kernel of the library, or ORT placing
the ops of a node's function there): `require_fused_on_cuda` reads ORT's profile of a run (every kernel run's
"provider") and names each ai.gtco node that did not run on the CUDA EP.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

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


# --- where each fused node ran: ORT's profile -------------------------------------------------------------------

_INT_TYPES = {"int64", "int32"}
INLINED_PREFIX = "_inlfunc_"
"""How ORT names the nodes of an inlined model-local function: `_inlfunc_<op type>[_<n>]_<inner node>`."""


@dataclass(frozen=True)
class NodeRun:
    """One kernel run of an ORT profile (SessionOptions.enable_profiling): the node's name as ORT knows it, its op
    type, the execution provider it ran on, and whether it only computes shapes (every output an integer tensor:
    what ORT keeps on the CPU next to the CUDA EP on purpose)."""

    node: str
    op_type: str
    provider: str
    shape_only: bool


def node_runs(events: Iterable[Mapping[str, Any]]) -> list[NodeRun]:
    """The kernel runs of an ORT profile's events (the JSON list `session.end_profiling()` writes): its Node
    events named `<node>_kernel_time`."""
    runs = []
    for e in events:
        args = e.get("args") or {}
        name = str(e.get("name", ""))
        if e.get("cat") != "Node" or not name.endswith("_kernel_time") or "provider" not in args:
            continue
        outs = [t for shape in args.get("output_type_shape") or () for t in shape]
        runs.append(NodeRun(name[:-len("_kernel_time")], str(args.get("op_name", "?")), str(args["provider"]),
                            bool(outs) and all(t in _INT_TYPES for t in outs)))
    return runs


def fused_nodes_of(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(name, op type) of the model's ai.gtco nodes."""
    from onnx_gtco.opspec import DOMAIN

    return [(n.name, n.op_type) for n in model.graph.node if n.domain == DOMAIN]


def _function_of(run: NodeRun, op_types: Iterable[str]) -> str | None:
    """The fused op type whose inlined function `run` is a node of (the longest that prefixes its name)."""
    if not run.node.startswith(INLINED_PREFIX):
        return None
    rest = run.node[len(INLINED_PREFIX):]
    return max((t for t in op_types if rest.startswith(t + "_")), key=len, default=None)


def off_cuda(fused: Sequence[tuple[str, str]], runs: Sequence[NodeRun]) -> list[str]:
    """Why some fused nodes did not run on the CUDA EP, one line per node (empty: all did).

    A node registered by the library ran as its kernel (a run named after the node): that kernel must be the CUDA
    EP's. A node whose op type is not registered ran as its model-local function, inlined by ORT: every node of it
    that does more than shape arithmetic must be on the CUDA EP. When ORT's own fusions renamed all of a function's
    nodes, the profile cannot name them: the node passes only when nothing but shape arithmetic ran off the CUDA EP.
    """
    op_types = {op for _, op in fused}
    per_function: dict[str, list[NodeRun]] = {}
    for r in runs:
        op = _function_of(r, op_types)
        if op is not None:
            per_function.setdefault(op, []).append(r)
    stray = [r for r in runs if r.provider != CUDA_EP and not r.shape_only]
    problems = []
    for name, op in fused:
        own = sorted({r.provider for r in runs if r.node == name and r.op_type == op} - {CUDA_EP})
        inlined = per_function.get(op, [])
        bad = [r for r in inlined if r.provider != CUDA_EP and not r.shape_only]
        if own:
            problems.append(f"ai.gtco node {name!r} ({op}) ran its kernel on {', '.join(own)}")
        elif any(r.node == name for r in runs):
            continue
        elif bad:
            problems.append(f"ai.gtco node {name!r} ({op}) ran as its function, whose node {bad[0].node!r} "
                            f"({bad[0].op_type}) ran on {bad[0].provider}")
        elif not inlined and stray:
            problems.append(f"ai.gtco node {name!r} ({op}) has no run in the profile (ORT fused its function's "
                            f"nodes) while {stray[0].node!r} ({stray[0].op_type}) ran on {stray[0].provider}: "
                            "nothing shows it ran on the CUDA EP")
    return problems


def require_fused_on_cuda(model: onnx.ModelProto, events: Iterable[Mapping[str, Any]], what: str) -> None:
    """Check an ORT profile of `model` (its events): every ai.gtco node ran on the CUDA EP.

    Raises:
        CudaProviderError: naming each node that did not (its kernel or its function's nodes on another EP).
    """
    problems = off_cuda(fused_nodes_of(model), node_runs(events))
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CudaProviderError(f"{what}: not every fused node ran on the {CUDA_EP}: " + "; ".join(problems[:3]) +
                                more + " (a CPU kernel registered with gtco.register=all, or ORT placed the "
                                "function's ops on the CPU)")


def profiled_options(sess_options: Any, folder: str | os.PathLike[str]) -> Any:
    """`sess_options` with ORT's profiler on, writing into `folder`."""
    sess_options.enable_profiling = True
    sess_options.profile_file_prefix = str(Path(folder) / "gtco-placement")
    return sess_options


def profile_events(session: Any) -> list[dict[str, Any]]:
    """End a profiled session's profiling and return its events (the profile file is removed)."""
    path = Path(session.end_profiling())
    try:
        return json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
