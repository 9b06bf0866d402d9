"""Latency statistics and the accuracy of one variant's outputs against the fp32 original's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnx_gtco.runtime.check import output_error

ATOL_FLOOR = 1e-5
"""Relative errors divide by max(|reference|, ATOL_FLOOR), as `onnx-gtco check` does with its default atol."""


@dataclass(frozen=True)
class Latency:
    """Summary of the per-run wall times of one variant, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int


def summarize(times_ms: Sequence[float]) -> Latency:
    """Median, 10th and 90th percentile (numpy's linear interpolation) of per-run times in milliseconds.

    Raises:
        ValueError: no times, or a time that is negative or not finite.
    """
    t = np.asarray(times_ms, dtype=np.float64)
    if t.size == 0:
        raise ValueError("no timed runs to summarize")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError("run times must be finite and >= 0")
    p10, med, p90 = np.percentile(t, [10, 50, 90])
    return Latency(float(med), float(p10), float(p90), int(t.size))


@dataclass(frozen=True)
class Accuracy:
    """Worst difference over all outputs of a variant against the reference outputs."""

    max_abs_err: float
    max_rel_err: float
    cosine: float


def accuracy(reference: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> Accuracy:
    """Max absolute error, max relative error (|got - ref| / max(|ref|, ATOL_FLOOR)) and the smallest cosine
    similarity over every output, computed in float64. A NaN where the reference has none makes every error
    infinite and the cosine NaN.

    Raises:
        ValueError: the output counts or shapes differ.
    """
    if len(reference) != len(got):
        raise ValueError(f"{len(got)} outputs, the reference has {len(reference)}")
    max_abs = max_rel = 0.0
    cos_min = 1.0
    for r, g in zip(reference, got, strict=True):
        if np.shape(r) != np.shape(g):
            raise ValueError(f"output shape {np.shape(g)} != reference {np.shape(r)}")
        e = output_error(r, g, ATOL_FLOOR)
        if e.nan_bad:
            return Accuracy(float("inf"), float("inf"), float("nan"))
        max_abs, max_rel, cos_min = max(max_abs, e.max_abs), max(max_rel, e.max_rel), min(cos_min, e.cosine)
    return Accuracy(max_abs, max_rel, cos_min)
