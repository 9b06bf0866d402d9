"""Everything a run needs, resolved before the first compile: the Python packages (in the steps' environment), the
headers (found here, never downloaded: a GPU machine has no network) and the tools. A missing required piece is one
line naming it, and the run stops before anything else; an optional one is noted.

The check runs in a subprocess of the steps' Python with the steps' environment (the bundle's PYTHONPATH,
ORT_INCLUDE_DIR, GTCO_CUBLASLT_INCLUDE), so it sees what the rows will see.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from suite.common import Step, probe
from suite.machine import target_arch


@dataclass(frozen=True)
class Needs:
    """What a run needs.

    Attributes:
        modules: importable module names the run cannot do without.
        optional_modules: modules whose absence only skips some rows (named in the result).
        cuda_ep: onnxruntime must list the CUDAExecutionProvider.
        ort_headers: the ONNX Runtime C/C++ headers (every library build).
        cublaslt_header: cublasLt.h (the tuner offers cuBLASLt instances on a GPU).
        cutlass_headers: CUTLASS's headers (the sm_90a GEMMs of an sm_90 target).
        tools: executables on PATH the run cannot do without.
        optional_tools: executables whose absence only skips a check (compute-sanitizer).
        why: module -> what it is for (a missing module's line says it).
    """

    modules: tuple[str, ...]
    optional_modules: tuple[str, ...] = ()
    cuda_ep: bool = False
    ort_headers: bool = True
    cublaslt_header: bool = False
    cutlass_headers: bool = False
    tools: tuple[str, ...] = ()
    optional_tools: tuple[str, ...] = ()
    why: Mapping[str, str] = field(default_factory=dict)
    """What a module is for, said beside it when it is missing."""


BASE_MODULES = ("numpy", "onnx", "onnxruntime", "onnx_graphsurgeon", "onnxscript", "onnx_ir", "optuna", "jinja2",
                "ml_dtypes", "sympy", "google.protobuf", "tqdm", "matplotlib", "onnx_gtco")
ZOO_MODULES = ("torch", "timm", "transformers")


CALIBRATION_WHY = {"scipy": "the calibration row's fit: onnx-gtco calibration fit",
                   "pynvml": "the calibration row's SM clock readings; without it nvidia-smi reads them"}


def needs_for(dry_run: bool, target: str | None, sql_storage: bool, calibration: bool = False) -> Needs:
    """A GPU run needs the CUDA EP, nvcc, g++, nvidia-smi, the zoo's exporters, CuPy (the tuner's measurer and the
    bench's peaks) and every header offline; a dry run the packages, g++ and the ORT headers (nvcc only for the
    kernels rows' compile, which it skips without). A plan with the calibration row needs scipy for its fit (and on a
    GPU reads the clocks through pynvml where it is, else nvidia-smi)."""
    modules = BASE_MODULES + (("sqlalchemy",) if sql_storage else ()) + (("scipy",) if calibration else ())
    why = {k: v for k, v in CALIBRATION_WHY.items() if calibration}
    if dry_run:
        return Needs(modules, optional_modules=ZOO_MODULES, tools=("g++",), optional_tools=("nvcc",), why=why)
    return Needs(modules + ZOO_MODULES + ("cupy",), optional_modules=("pynvml",) if calibration else (),
                 cuda_ep=True, cublaslt_header=True,
                 cutlass_headers=target is not None and target_arch(target) == "sm_90",
                 tools=("nvcc", "g++", "nvidia-smi"), optional_tools=("compute-sanitizer",), why=why)


_PROBE = r"""
import importlib, importlib.util, json, sys
n = json.loads(sys.argv[1])
missing, optional, found = [], [], {}
def importable(m):
    try:
        return importlib.util.find_spec(m) is not None
    except (ImportError, ValueError):
        return False
def line(m):
    return f"Python package {m} is not importable" + (f" ({n['why'][m]})" if m in n["why"] else "")
for m in n["modules"]:
    if not importable(m):
        missing.append(line(m))
for m in n["optional_modules"]:
    if not importable(m):
        optional.append(line(m))
if n["cuda_ep"] and importable("onnxruntime"):
    try:
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            missing.append(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)")
    except Exception as e:
        missing.append(f"onnxruntime does not import: {e}")
if n["ort_headers"]:
    try:
        from onnx_gtco.plugin.headers import ort_include_dir
        found["ort_headers"] = str(ort_include_dir(download=False))
    except Exception as e:
        missing.append(f"ONNX Runtime headers: {e}")
if n["cublaslt_header"]:
    try:
        from onnx_gtco.families.gemm.cublas_headers import cublaslt_include_dir
        found["cublaslt_header"] = str(cublaslt_include_dir(download=False))
    except Exception as e:
        missing.append(f"cuBLASLt header: {e}")
if n["cutlass_headers"]:
    try:
        from onnx_gtco.families.gemm.cutlass import include_dirs
        dirs = include_dirs()
        if isinstance(dirs, str):
            missing.append(f"CUTLASS headers: {dirs}")
        else:
            found["cutlass_headers"] = str(dirs[0])
    except Exception as e:
        missing.append(f"CUTLASS headers: {e}")
print(json.dumps({"missing": missing, "optional": optional, "found": found}))
"""


def preflight(needs: Needs, env: dict[str, str], timeout_s: float = 120.0) -> Step:
    """Check `needs` in the steps' environment (its PATH for the tools): Step ok (detail: where each header was
    found, what optional piece is missing), or failed with the missing pieces (the first as the reason)."""
    t0 = time.monotonic()
    path = env.get("PATH")
    missing = [f"tool {t} is not on PATH" for t in needs.tools if shutil.which(t, path=path) is None]
    optional = [f"tool {t} is not on PATH" for t in needs.optional_tools if shutil.which(t, path=path) is None]
    query = {"modules": list(needs.modules), "optional_modules": list(needs.optional_modules),
             "cuda_ep": needs.cuda_ep, "ort_headers": needs.ort_headers, "cublaslt_header": needs.cublaslt_header,
             "cutlass_headers": needs.cutlass_headers, "why": dict(needs.why)}
    try:
        got = probe(_PROBE, query, env, timeout_s)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return Step("preflight", "failed", f"the check itself failed: {e}", round(time.monotonic() - t0, 2))
    missing += got["missing"]
    optional += got["optional"]
    detail = {"found": got["found"], "optional_missing": optional, "missing": missing}
    seconds = round(time.monotonic() - t0, 2)
    if missing:
        return Step("preflight", "failed", missing[0] + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                                          else ""), seconds, None, detail)
    return Step("preflight", "ok", "", seconds, None, detail)


def lines(step: Step) -> Sequence[str]:
    """One line per missing piece of a preflight step (what the run prints)."""
    return [f"preflight: missing: {m}" for m in step.detail.get("missing", ())] + \
        [f"preflight: optional, missing: {m}" for m in step.detail.get("optional_missing", ())]


__all__ = ["Needs", "lines", "needs_for", "preflight"]
