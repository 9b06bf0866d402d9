"""The tuner's view of the one kernel-time estimate: a configuration's predicted time (the CPU measurer's answer
and the first guesses of every study) and its tiling over a run-time extent (the shape-generic tuner's
micro-kernels).

The estimate itself is each family's `estimate_us(problem, config, hw)` in its own module (families.gemm.kernel with
families.gemm.cutlass and families.gemm.cublaslt, families.attention.kernel, families.layernorm.kernel,
families.softmax.kernel, families.conv.kernel, families.elementwise.kernel), with the constants fitted per GPU
(onnx_gtco.calibration): the same estimate the planner's DP prices groups with and the build's default selection ranks
configurations by, so the tuner never ranks by another model. A task names its arch only; its hardware is the planning
target's where that runs the arch (`hw`), else the arch's data-sheet target.

Times are microseconds and deterministic: what the tuner measures in CI (no GPU) and what seeds a GPU study, never a
reported kernel time.
"""

from __future__ import annotations

from collections.abc import Mapping

from onnx_gtco.calibration import Hardware, hardware_for_arch
from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.select import ALL_FAMILIES
from onnx_gtco.kernels.timing import FILL_FLOOR, Tiling


def estimate_us(problem: Problem, config: Mapping[str, object], arch: str, hw: Hardware | None = None) -> float:
    """The estimated time of `config` on `problem` for `arch` (its family's estimate_us on `hw`, by default the
    arch's hardware: hardware_for_arch), in microseconds.

    Raises:
        ValueError: no family of that name.
    """
    family = ALL_FAMILIES.get(problem.family)
    if family is None:
        raise ValueError(f"no estimate for family {problem.family!r}")
    return float(family.estimate_us(problem, config, hw or hardware_for_arch(arch)))  # type: ignore[attr-defined]


def tiling(problem: Problem, config: Mapping[str, int], arch: str) -> Tiling:
    """The Tiling of `config` on `problem` for `arch` (its kernel family's `tiling`, by the resource rules the
    estimates use: kernels.timing.resident).

    Raises:
        ValueError: the family has no run-time extent (elementwise; conv, whose tile would run over N·OH·OW and
            which the dynamic tuner leaves out: kernels.dynamic.extent_name).
    """
    return ALL_FAMILIES[problem.family].tiling(problem, config, hardware_for_arch(arch).target)


__all__ = ["FILL_FLOOR", "Tiling", "estimate_us", "tiling"]
