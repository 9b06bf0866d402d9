"""Calibrations a test pins: the shipped one of a target with some constants changed, so a plan does not turn on
the estimate's current values where the test is about something else (binding, the device path of a family), and a
test of a choice shows the choice follows the estimate."""

from __future__ import annotations

import contextlib
import json

import pytest


def write_calibration(folder, target: str, **groups: dict) -> None:
    """The target's shipped calibration (an empty one where none ships) with the given constants changed, written
    into `folder` as <target>.json."""
    from onnx_gtco.calibration import Calibration, load_calibration

    base = load_calibration(target) or Calibration(target, "test", "", {})
    data = base.to_json()
    for group, values in groups.items():
        data["constants"].setdefault(group, {}).update(values)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{target}.json").write_text(json.dumps(data))


FUSED_FORMS = {"vendor_gemm": {"extra_us": 100.0}, "elementwise": {"extra_us": 100.0}, "rowwise": {"pass_us": 100.0}}
"""Constants under which the estimate fuses every epilogue, LayerScale and LayerNorm into its GEMM (cuBLASLt and a
separate elementwise or LayerNorm kernel made dear): for tests of those fused forms' binding and glue, whose plans
must not turn on the estimate's current values."""


@contextlib.contextmanager
def pinned_calibration(folder, target: str, **groups: dict):
    """While it lasts, plans for `target` use its calibration with the given constants changed (write_calibration
    into `folder`, named by $GTCO_CALIBRATION_DIR)."""
    from onnx_gtco.calibration import hardware
    from onnx_gtco.config import CALIBRATION_DIR_ENV

    write_calibration(folder, target, **groups)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CALIBRATION_DIR_ENV, str(folder))
        mp.delenv("GTCO_TARGET", raising=False)
        hardware.cache_clear()
        try:
            yield
        finally:
            hardware.cache_clear()


CONV_KERNELS = {"conv": {"gather_ns": 1.0, "gather_gps": 1e4}, "vendor_gemm": {"extra_us": 100.0}}
"""Constants under which the estimate runs a conv on our implicit-GEMM kernel rather than ONNX Runtime's (its A
gather made cheap, the vendor kernels ORT would run dear): for tests of the conv family's binding and device
path."""
