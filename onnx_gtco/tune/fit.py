"""Fit the kernel-time estimate's constants to measured kernel times: `onnx-gtco calibration fit` and `backtest`.

The records (onnx_gtco/calibration/records/*.json, or files a GPU run wrote) are measured kernels with their GPU,
driver, commit and date:

* a kernel record: one kernel (or one instance serving several shapes) of one profile: its family, its
  configuration, its problems with their call counts, the measured microseconds per forward over all of them, and
  which side ran it ("gtco": our kernel; "gtco-ort": an ONNX Runtime kernel inside our model; "ort-fp16": a kernel
  of the ORT baseline); `proxy`, where another implementation's kernel stands in for one of ours that no record
  measured (ORT's cuBLAS GEMMs for our cuBLASLt instances);
* a model record: one whole model's median time in a CUDA graph replay, with its profiled kernel time and launches
  (`pdl_launches` of them with programmatic dependent launch) and the microseconds of the kernels no kernel record
  describes.

A records file may name, under "tells", constants whose `param` says fit=False (no record of the shipped kind tells
them apart) that its records were made to tell: the GPU suite's calibration row times CUTLASS at a few tiles and a
short elementwise copy for that. The fit then fits them too, whenever that file is among its records.

`predict_kernel` prices a kernel record with the same estimate the planner and the build use (its family's
estimate_us, or cost.model's for ORT's kernels); `predict_model` adds a model's kernel records, the unrecorded
kernels and a graph gap per launch. `fit` searches the constants (every `param` of the estimate's Constants
groups that some record's prediction depends on, within its bounds) with scipy's least squares on the logarithm of
predicted over measured time, each record one residual; `backtest` lists the ratios.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_gtco import families
from onnx_gtco.calibration import (
    FORMAT,
    RECORDS_DIR,
    Calibration,
    Constants,
    Hardware,
    LaunchConstants,
    fields_of,
    hardware,
)
from onnx_gtco.cost.model import OrtConstants, VendorGemmConstants, memory_us
from onnx_gtco.errors import GtcoError, missing_package
from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.select import implementation
from onnx_gtco.tune.analytical import estimate_us

GROUPS: tuple[type[Constants], ...] = tuple(dict.fromkeys((
    LaunchConstants, VendorGemmConstants, OrtConstants,
    *(g for part in families.parts("kernel") for g in getattr(part, "CONSTANTS", ())))))
"""Every group of constants of the estimate, in the order the fit and the files list them: the launch, ONNX
Runtime's and the vendor GEMM's, then each family's (its kernel module's CONSTANTS) in the registry's order."""
OUR_SIDES = ("gtco", "gtco-ort")
"""The sides of a kernel record that ran inside our rewritten model (its model record adds them)."""


def _frozen(x: Any) -> Any:
    """JSON lists as the tuples a Problem's flags hold."""
    return tuple(_frozen(v) for v in x) if isinstance(x, list) else x


@dataclass(frozen=True)
class KernelRecord:
    """One measured kernel row (see the module docstring)."""

    id: str
    family: str
    config: Mapping[str, Any]
    problems: tuple[tuple[int, Problem], ...]
    calls: int
    us_per_forward: float
    side: str
    run: str
    model: str
    batch: int
    kernel: str = ""
    proxy: str | None = None
    source: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ModelRecord:
    """One measured whole model (see the module docstring)."""

    id: str
    run: str
    model: str
    batch: int
    measured_us: float
    launches: int
    unrecorded_kernel_us: float
    source: Mapping[str, Any] = field(default_factory=dict, compare=False)
    pdl_launches: int = 0


@dataclass(frozen=True)
class Records:
    """The records of one or more files, all of one GPU."""

    gpu: str
    target: str
    files: tuple[str, ...]
    kernels: tuple[KernelRecord, ...]
    models: tuple[ModelRecord, ...]
    tells: tuple[str, ...] = ()
    """Constants ("group.name") with fit=False that some file's records were made to tell (fitted all the same)."""

    def only(self, runs: Sequence[str]) -> Records:
        """The records of the named runs."""
        return Records(self.gpu, self.target, self.files, tuple(k for k in self.kernels if k.run in runs),
                       tuple(m for m in self.models if m.run in runs), self.tells)


def _problem(data: Mapping[str, Any]) -> Problem:
    return Problem.make(data["family"], data["dtype"], data["sizes"],
                        {k: _frozen(v) for k, v in data.get("flags", {}).items()})


def load_records(paths: Iterable[str | Path] | None = None) -> Records:
    """The records of `paths` (files, or folders of *.json records), by default every shipped file.

    Raises:
        GtcoError: a file that is not a records file, or files of different GPUs.
    """
    files: list[Path] = []
    for p in [Path(x) for x in paths] if paths is not None else [RECORDS_DIR]:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise GtcoError(f"no calibration records in {', '.join(map(str, paths or [RECORDS_DIR]))}")
    kernels: list[KernelRecord] = []
    models: list[ModelRecord] = []
    gpus: set[tuple[str, str]] = set()
    tells: list[str] = []
    known = {f"{p.group.GROUP}.{p.name}" for p in _params(all_constants=True)}
    for f in files:
        try:
            doc = json.loads(f.read_text())
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, not {FORMAT}")
            gpus.add((str(doc["gpu"]), str(doc["target"])))
            for name in doc.get("tells", ()):
                if name not in known:
                    raise ValueError(f"tells {name!r}, which is no constant of the estimate")
                tells += [name] if name not in tells else []
            for i, k in enumerate(doc["kernels"]):
                problems = tuple((int(p["count"]), _problem(p["problem"])) for p in k["problems"])
                source = {key: k[key] for key in ("gpu", "driver", "cuda", "onnxruntime", "commit", "date")
                          if key in k}
                kernels.append(KernelRecord(f"{f.stem}#{i}", str(k["family"]), dict(k["config"]), problems,
                                            int(k["calls"]), float(k["us_per_forward"]), str(k["side"]),
                                            str(k["run"]), str(k["model"]), int(k["batch"]), str(k.get("kernel", "")),
                                            k.get("proxy"), {**source, "file": f.name}))
            for i, m in enumerate(doc.get("models", ())):
                source = {key: m[key] for key in ("gpu", "driver", "commit", "date", "command", "ort_fp16_ms",
                                                  "ort_transformers_fp16_ms") if key in m}
                models.append(ModelRecord(f"{f.stem}@{i}", str(m["run"]), str(m["model"]), int(m["batch"]),
                                          float(m["measured_ms"]) * 1e3, int(m["launches"]),
                                          float(m["unrecorded_kernel_us"]), {**source, "file": f.name},
                                          int(m.get("pdl_launches", 0))))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise GtcoError(f"calibration records {f}: not a records file ({e})") from None
    if len(gpus) != 1:
        raise GtcoError(f"calibration records of several GPUs ({', '.join(sorted(g for g, _ in gpus))}): fit one "
                        "GPU at a time")
    (gpu, target), = gpus
    return Records(gpu, target, tuple(str(f) for f in files), tuple(kernels), tuple(models), tuple(tells))


def predict_kernel(record: KernelRecord, hw: Hardware) -> float:
    """The estimate of a kernel record on `hw`: microseconds per forward over all its calls."""
    total = 0.0
    for count, problem in record.problems:
        if record.family == "ort":
            us = memory_us(float(problem.size("bytes")), 0.0, hw)
        else:
            impl = implementation(record.config)  # a CUTLASS record: its sm_90a code on an sm_90 GPU
            arch = hw.arch if impl is None else impl.arch_for.get(hw.arch, hw.arch)
            us = estimate_us(problem, record.config, arch, hw)
        total += count * us
    return total


def predict_model(model: ModelRecord, kernels: Sequence[KernelRecord], hw: Hardware) -> float:
    """The estimate of a model record: its kernel records inside our model (OUR_SIDES), the kernels no record
    describes as measured, and a graph gap per launch, less what programmatic dependent launch hides of it for the
    record's `pdl_launches`."""
    ours = [k for k in kernels if k.run == model.run and k.model == model.model and k.batch == model.batch
            and k.side in OUR_SIDES]
    if not ours:
        raise GtcoError(f"model record {model.id}: no kernel record of {model.model} at batch {model.batch} in "
                        f"{model.run}")
    launch = hw.constants(LaunchConstants)
    hidden = model.pdl_launches * min(launch.pdl_overlap_us, launch.graph_gap_us)
    return (sum(predict_kernel(k, hw) for k in ours) + model.unrecorded_kernel_us
            + model.launches * launch.graph_gap_us - hidden)


@dataclass(frozen=True)
class Row:
    """One record's prediction against its measurement."""

    id: str
    what: str
    measured_us: float
    predicted_us: float
    proxy: bool = False

    @property
    def ratio(self) -> float:
        return self.predicted_us / self.measured_us


def backtest(records: Records, hw: Hardware) -> tuple[list[Row], list[Row]]:
    """Every kernel record's and model record's prediction on `hw` against its measurement."""
    kernels = [Row(k.id, f"{k.run} {k.model} b{k.batch} {k.side}: {k.kernel}", k.us_per_forward,
                   predict_kernel(k, hw), k.proxy is not None) for k in records.kernels]
    models = [Row(m.id, f"{m.run} {m.model} b{m.batch}", m.measured_us,
                  predict_model(m, records.kernels, hw)) for m in records.models]
    return kernels, models


@dataclass(frozen=True)
class Param:
    group: type[Constants]
    name: str
    default: float
    lo: float
    hi: float


def _params(tells: Sequence[str] = (), all_constants: bool = False) -> list[Param]:
    """The constants a fit searches: those whose param has fit=True, those named in `tells` ("group.name"), or with
    `all_constants` every one."""
    return [Param(g, f.name, float(f.default), float(f.metadata["lo"]), float(f.metadata["hi"]))
            for g in GROUPS for f in fields_of(g)
            if all_constants or f.metadata.get("fit", True) or f"{g.GROUP}.{f.name}" in tells]


def _overrides(params: Sequence[Param], values: Sequence[float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for p, v in zip(params, values, strict=True):
        out.setdefault(p.group.GROUP, {})[p.name] = float(v)
    return out


def _residuals(records: Records, hw: Hardware) -> list[float]:
    kernels, models = backtest(records, hw)
    return [math.log(r.ratio) for r in (*kernels, *models)]


@dataclass(frozen=True)
class Fit:
    """What `fit` found: the calibration, the constants it fitted (the others kept their defaults: no record's
    prediction depends on them), those that ended at a bound, and the backtest of the fitted constants."""

    calibration: Calibration
    fitted: tuple[str, ...]
    at_bound: tuple[str, ...]
    kernels: tuple[Row, ...]
    models: tuple[Row, ...]


def error_summary(rows: Sequence[Row]) -> dict[str, float]:
    """The rows' fit: how many, the ratio furthest from 1 (predicted / measured), as `worst` the larger of it and
    its inverse (1.25: within 25% either way), and the root mean square of log(ratio)."""
    if not rows:
        return {}
    far = max(rows, key=lambda r: abs(math.log(r.ratio)))
    return {"rows": len(rows), "worst_ratio": round(far.ratio, 4), "worst": round(max(far.ratio, 1 / far.ratio), 4),
            "rms_log": round(math.sqrt(sum(math.log(r.ratio) ** 2 for r in rows) / len(rows)), 4)}


def errors(records: Records, kernels: Sequence[Row], models: Sequence[Row]) -> dict[str, dict[str, float]]:
    """error_summary by kind of record: our kernels ("gtco"), the proxies, ONNX Runtime's own kernels ("ort"), the
    whole models."""
    side = {k.id: ("proxy" if k.proxy else "gtco" if k.side == "gtco" else "ort") for k in records.kernels}
    out = {kind: error_summary([r for r in kernels if side[r.id] == kind]) for kind in ("gtco", "proxy", "ort")}
    out["models"] = error_summary(models)
    return {k: v for k, v in out.items() if v}


def fit(records: Records, target: str | None = None, command: str = "") -> Fit:
    """The constants that best reproduce `records` on their target (or `target`): scipy.optimize.least_squares
    (trust-region reflective, within each constant's bounds) on log(predicted / measured), one residual per kernel
    and model record, from the defaults. Constants no record's prediction depends on keep their defaults.

    Raises:
        GtcoError: scipy is not installed; no record to fit.
    """
    try:
        from scipy.optimize import least_squares
    except ImportError:
        raise missing_package("scipy", "fitting a calibration") from None
    target = target or records.target
    base = Hardware(hardware(target).target)  # the data sheet and the defaults, whatever ships
    if not records.kernels:
        raise GtcoError("no kernel record to fit")
    params = _params(records.tells)
    x0 = [p.default for p in params]
    r0 = _residuals(records, base.with_overrides(_overrides(params, x0)))
    used = []
    for i, p in enumerate(params):  # a constant moved by 5% that moves no residual is none of the records' business
        x = list(x0)
        x[i] = p.default * 1.05 if p.default else p.default + 0.05 * (p.hi - p.lo)
        r1 = _residuals(records, base.with_overrides(_overrides(params, x)))
        if any(abs(a - b) > 1e-12 for a, b in zip(r0, r1, strict=True)):
            used.append(i)
    free = [params[i] for i in used]

    def resid(values: Sequence[float]) -> list[float]:
        x = list(x0)
        for i, v in zip(used, values, strict=True):
            x[i] = v
        return _residuals(records, base.with_overrides(_overrides(params, x)))

    if free:
        res = least_squares(resid, [p.default for p in free], bounds=([p.lo for p in free], [p.hi for p in free]),
                            x_scale="jac", method="trf")
        values = [float(v) for v in res.x]
    else:
        values = []
    constants = _overrides(free, values)
    hw = base.with_overrides(constants)
    kernels, models = backtest(records, hw)
    at_bound = tuple(f"{p.group.GROUP}.{p.name}" for p, v in zip(free, values, strict=True)
                     if math.isclose(v, p.lo, rel_tol=1e-6) or math.isclose(v, p.hi, rel_tol=1e-6))
    fitted = {"date": datetime.date.today().isoformat(), "command": command,
              "records": [Path(f).name for f in records.files], "kernel_rows": len(kernels),
              "model_rows": len(models),
              "error": errors(records, kernels, models),
              "fitted": [f"{p.group.GROUP}.{p.name}" for p in free], "at_bound": list(at_bound),
              **({"tells": list(records.tells)} if records.tells else {})}
    ours = {str(k.config.get("impl", "mma")) for k in records.kernels if k.side == "gtco"}
    proxies = sorted({k.proxy for k in records.kernels  # a proxy stands in only where no record of ours measured
                      if k.proxy and str(k.config.get("impl", "mma")) not in ours})
    cal = Calibration(target, records.gpu, "", {g: {k: round(v, 6) for k, v in vals.items()}
                                               for g, vals in constants.items()}, fitted, tuple(proxies))
    return Fit(cal, tuple(fitted["fitted"]), at_bound, tuple(kernels), tuple(models))


def write_calibration(cal: Calibration, path: str | Path) -> None:
    """Write `cal` as a calibration file (atomically)."""
    from onnx_gtco.ir.export import write_text_atomic

    write_text_atomic(json.dumps(cal.to_json(), indent=1, sort_keys=False) + "\n", Path(path))


__all__ = [
    "GROUPS",
    "Fit",
    "KernelRecord",
    "ModelRecord",
    "Records",
    "Row",
    "backtest",
    "error_summary",
    "errors",
    "fit",
    "load_records",
    "predict_kernel",
    "predict_model",
    "write_calibration",
]
