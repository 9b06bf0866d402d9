"""The constants of the kernel-time estimate, per GPU: fitted to measured kernel times, shipped as package data.

Every choice the optimizer makes (the DP's groups, each group's implementation and configuration, the tuner's first
guesses, the report's predicted times) reads one estimate of a kernel's time: its family's `estimate_us(problem,
config, hw)` (onnx_gtco.kernels) for our kernels and the library implementations (CUTLASS, cuBLASLt), and
onnx_gtco.cost.model for the nodes ONNX Runtime runs itself. Each is a formula over the problem, the
configuration and the GPU's data sheet (config.Target) with named constants: a launch floor, a warp's mma rate, an
effective bandwidth, a split-K cost, ... Those constants are declared where their formula lives, as a frozen
dataclass per group (a `Constants` subclass with a GROUP name; each field's `param` gives its default, bounds,
unit and meaning), and read through a `Hardware`: the target and its calibration.

A calibration is a file `<target>.json` beside this module (or in the folder $GTCO_CALIBRATION_DIR names, which
comes first: a GPU run's refit):

    {"format": 1, "target": "h200", "gpu": "NVIDIA H200", "constants": {GROUP: {NAME: VALUE, ...}, ...},
     "fitted": {"date", "command", "records": [files], "kernel_rows", "model_rows", "error": {...}},
     "proxies": [what stands in for an implementation no record of ours measured]}

written by `onnx-gtco calibration fit` (onnx_gtco.tune.fit: scipy's least squares over the records in
`records/`, measured kernel times with their GPU, driver, commit and date). A target without a calibration gets
every constant's default, which is the value fitted on the first calibrated GPU (an H200) for the dimensionless
ones (efficiencies, exponents) and a data-sheet-relative one for the rest: transferred, not measured, and the
report says so (`Hardware.describe`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from onnx_gtco.config import TARGETS, Target, calibration_dir_env
from onnx_gtco.errors import GtcoError

FORMAT = 1
SHIPPED_DIR = Path(__file__).resolve().parent
RECORDS_DIR = SHIPPED_DIR / "records"


def param(default: float, lo: float, hi: float, unit: str, doc: str, fit: bool = True) -> Any:
    """A constant of an estimate: its default, the bounds a fit keeps it in, its unit and what it means; `fit` False
    for one that no record of the kind the fit reads can tell apart from the others (it keeps its default)."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "unit": unit, "doc": doc, "fit": fit})


@dataclass(frozen=True)
class Constants:
    """A group of an estimate's constants (subclass it as a frozen dataclass with a GROUP name and `param`
    fields)."""

    GROUP: ClassVar[str] = ""


C = TypeVar("C", bound=Constants)


def fields_of(cls: type[Constants]) -> list[dataclasses.Field]:
    """The constants of a group, in declaration order."""
    return list(dataclasses.fields(cls))


@dataclass(frozen=True)
class LaunchConstants(Constants):
    """What every kernel costs beyond its work, and what a launch costs in a CUDA graph replay."""

    GROUP: ClassVar[str] = "launch"
    floor_us: float = param(0.5, 0.5, 4.0, "us", "a kernel's time with no work: the launch's ramp-up of its first "
                            "blocks and the tail of its last ones, as a profiler times it")
    graph_gap_us: float = param(1.14, 0.0, 10.0, "us", "the gap between one kernel's end and the next one's start in a "
                                "CUDA graph replay (a whole model's time less its kernels', per launch)")
    pdl_overlap_us: float = param(0.5, 0.0, 5.0, "us", "what programmatic dependent launch hides of a graph gap when a "
                                  "kernel follows one of ours (an assumption until a GPU measures it)")


@dataclass(frozen=True)
class Calibration:
    """A GPU's fitted constants (see the module docstring).

    Attributes:
        target: the config.TARGETS name it calibrates.
        gpu: the GPU the records measured, as nvidia-smi names it.
        path: the file it was read from.
        constants: group -> constant -> fitted value.
        fitted: how it was made: date, command, the record files, the rows and the fit's error.
        proxies: what stands in for an implementation none of our records measured (e.g. ORT's cuBLAS kernels for
            our cuBLASLt GEMMs).
    """

    target: str
    gpu: str
    path: str
    constants: Mapping[str, Mapping[str, float]]
    fitted: Mapping[str, Any] = field(default_factory=dict)
    proxies: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "target": self.target, "gpu": self.gpu,
                "constants": {g: dict(v) for g, v in self.constants.items()}, "fitted": dict(self.fitted),
                "proxies": list(self.proxies)}

    @classmethod
    def from_json(cls, data: Any, path: str) -> Calibration:
        """A calibration as a file holds it; GtcoError naming `path` when it is not one."""
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, not {FORMAT}")
            constants = {str(g): {str(k): float(v) for k, v in vals.items()}
                         for g, vals in data["constants"].items()}
            return cls(str(data["target"]), str(data.get("gpu", "")), path, constants, dict(data.get("fitted", {})),
                       tuple(str(p) for p in data.get("proxies", ())))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise GtcoError(f"calibration {path}: not a calibration file ({e})") from None


def calibration_path(target: str, directory: str | Path | None = None) -> Path:
    """Where the calibration of `target` is looked for: `directory`, else $GTCO_CALIBRATION_DIR when that folder
    has one, else the shipped folder."""
    if directory is not None:
        return Path(directory) / f"{target}.json"
    env = calibration_dir_env()
    if env and (Path(env) / f"{target}.json").is_file():
        return Path(env) / f"{target}.json"
    return SHIPPED_DIR / f"{target}.json"


def load_calibration(target: str, directory: str | Path | None = None) -> Calibration | None:
    """The calibration of `target` (calibration_path), or None where there is none.

    Raises:
        GtcoError: the file is there but is not a calibration of that target.
    """
    path = calibration_path(target, directory)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GtcoError(f"calibration {path}: {e}") from None
    cal = Calibration.from_json(data, str(path))
    if cal.target != target:
        raise GtcoError(f"calibration {path} is for target {cal.target!r}, not {target!r}")
    return cal


@dataclass(frozen=True, eq=False)
class Hardware:
    """A target as the estimate sees it: its data sheet and the constants that apply (its calibration's, the
    defaults where it has none or a group is missing; `overrides` replace both, as a fit does while it searches).

    Attributes:
        target: the GPU's data sheet (config.TARGETS).
        calibration: its fitted constants, or None.
        overrides: group -> constant -> value taking precedence (the fitter's trial values).
    """

    target: Target
    calibration: Calibration | None = None
    overrides: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    _cache: dict[type, Constants] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def arch(self) -> str:
        return self.target.arch

    def constants(self, cls: type[C]) -> C:
        """The group `cls` with its fitted values (or overrides), the defaults for the rest."""
        got = self._cache.get(cls)
        if got is None:
            values: dict[str, float] = {}
            if self.calibration is not None:
                values.update(self.calibration.constants.get(cls.GROUP, {}))
            values.update(self.overrides.get(cls.GROUP, {}))
            names = {f.name for f in fields_of(cls)}
            got = cls(**{k: v for k, v in values.items() if k in names})
            self._cache[cls] = got
        return got  # type: ignore[return-value]

    def with_overrides(self, overrides: Mapping[str, Mapping[str, float]]) -> Hardware:
        return Hardware(self.target, self.calibration, overrides)

    def describe(self) -> dict[str, Any]:
        """What the report says of the estimate's constants: which calibration applies, or that none does."""
        t = self.target
        out: dict[str, Any] = {"target": t.name, "gpu": t.gpu, "arch": t.arch}
        if self.calibration is None:
            out["calibration"] = None
            out["note"] = (f"no calibration of {t.name}: its data sheet ({t.dram_gbps:g} GB/s, {t.tc_tflops:g} "
                           "TFLOP/s fp16) with every constant of the estimate at its default (the efficiencies "
                           "fitted on another GPU, transferred; not measured on this one)")
            return out
        cal = self.calibration
        out["calibration"] = {"file": Path(cal.path).name, "gpu": cal.gpu,
                              **{k: cal.fitted[k] for k in ("date", "kernel_rows", "model_rows", "error")
                                 if k in cal.fitted}}
        if cal.proxies:
            out["proxies"] = list(cal.proxies)
        return out


@functools.cache
def hardware(target: str) -> Hardware:
    """The Hardware of a config.TARGETS name, with its calibration where one ships (load_calibration)."""
    if target not in TARGETS:
        raise GtcoError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return Hardware(TARGETS[target], load_calibration(target))


def hardware_for_arch(arch: str, planning: Hardware | None = None) -> Hardware:
    """The Hardware that prices a kernel built for `arch` (an arch slot: "sm_80", "sm_90", "sm_90a"): the planning
    target where it runs that arch's kernels, else the arch's data-sheet target."""
    base = arch.removesuffix("a")
    if planning is not None and planning.arch == base:
        return planning
    if base not in TARGETS:
        raise GtcoError(f"no target runs {arch} kernels; known archs: sm_80, sm_90")
    return hardware(base)


__all__ = ["FORMAT", "RECORDS_DIR", "SHIPPED_DIR", "Calibration", "Constants", "Hardware", "LaunchConstants",
           "calibration_path", "fields_of", "hardware", "hardware_for_arch", "load_calibration", "param"]
