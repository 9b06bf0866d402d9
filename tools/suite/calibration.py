"""The calibration row's inputs and outputs, apart from running it (rows._calibration runs it): the provenance its
records carry, the records the refit fits, and the row's summary of what tools/calibrate.py measured and how the
shipped calibration and the refit price it (OUT/calibration/measure.json and compare.json). Plain JSON in and out:
the suite's process imports no onnx-gtco here (its dependencies may come with the install row)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from suite.common import ROOT

SHIPPED_RECORDS = ROOT / "onnx_gtco" / "calibration" / "records"
"""The shipped calibration records (onnx_gtco.calibration.RECORDS_DIR), which the refit fits beside the row's own."""
ENV = "GTCO_CALIBRATION_DIR"
"""The variable that makes every later command plan with the refit (onnx_gtco.config.calibration_dir_env)."""
KEY_CONSTANTS = ("launch.graph_gap_us", "launch.pdl_overlap_us", "launch.floor_us", "gemm.mma.ln_sm_gbps",
                 "gemm.cutlass.extra_us", "elementwise.extra_us", "vendor_gemm.extra_us")
"""Constants the row was made to measure: the Markdown lists them whether or not the refit moved them."""
MOVED = 0.02
"""A constant the refit moved by more than this share is listed too."""


def provenance(machine: Mapping[str, Any], dry_run: bool) -> dict[str, Any]:
    """What every record says of where it was measured, from the run's env step: the GPU as nvidia-smi names it, its
    driver, CUDA (nvcc), the checkout's commit, onnxruntime's version and today's date (UTC). A dry run names no
    GPU: tools/calibrate.py then names its stand-ins as such."""
    gpu = machine.get("gpu") or {}
    versions = machine.get("versions") or {}
    out = {"gpu": None if dry_run else gpu.get("name"), "driver": gpu.get("driver"), "cuda": machine.get("cuda"),
           "commit": machine.get("tree"), "onnxruntime": versions.get("onnxruntime"),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    return {k: v for k, v in out.items() if v}


def fit_inputs(records: Path, shipped: Path = SHIPPED_RECORDS) -> tuple[list[Path], str]:
    """The records the refit fits: the shipped files that measured the same GPU for the same target as `records`
    (a fit takes one GPU at a time), then `records`; and a sentence saying which.

    Raises:
        ValueError: `records` is not a records file.
    """
    try:
        doc = json.loads(records.read_text())
        gpu, target = str(doc["gpu"]), str(doc["target"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{records}: not a records file ({e})") from None
    same, other = [], []
    for f in sorted(shipped.glob("*.json")):
        try:
            head = json.loads(f.read_text())
            (same if (str(head.get("gpu")), str(head.get("target"))) == (gpu, target) else other).append(f)
        except (OSError, ValueError):
            other.append(f)
    if same:
        why = f"the shipped records of the {gpu} ({', '.join(f.name for f in same)}) and this run's"
    else:
        why = f"this run's records alone (no shipped record measured a {gpu} for {target})"
    return [*same, records], why


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's content, None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def summary(measure: Mapping[str, Any], compare: Mapping[str, Any] | None, refit: str | None,
            why_not: str = "") -> dict[str, Any]:
    """The row's record of the calibration (what render shows): what was measured (counts per kind, the model
    records), cut and failed; the chain's graph gap and PDL overlap; the clock observation; the comparisons (fused
    against split kernels); each record's measured time beside the shipped calibration's and the refit's; the error
    summaries and the constants the row was made to measure, with any other the refit moved. `refit` is the refit
    file in force, or None with `why_not` (the shipped calibration stays in force)."""
    chain = measure.get("chain") or {}
    runs = {side: {k: (chain.get(side) or {}).get(k) for k in ("measured_ms", "launches", "pdl_launches",
                                                                "unrecorded_kernel_us", "profiled_kernel_us",
                                                                "ort_fp16_ms", "skipped", "failed")
                   if (chain.get(side) or {}).get(k) is not None} for side in ("off", "on")}
    out: dict[str, Any] = {
        "target": measure.get("target"), "stand_in": bool(measure.get("stand_in")),
        "gpu": (measure.get("provenance") or {}).get("gpu"), "refit": refit,
        "in_force": "refit" if refit else f"shipped ({why_not})" if why_not else "shipped",
        "counts": dict(measure.get("counts") or {}), "kernel_records": measure.get("timed", 0),
        "model_records": measure.get("models", 0), "cases": measure.get("cases", 0),
        "cut": list(measure.get("cut") or ()), "failed": list(measure.get("failed") or ()),
        "compiled": dict(measure.get("compiled") or {}), "measure_s": measure.get("seconds"),
        "chain": {"layers": chain.get("layers"), "rows": chain.get("rows"), **(chain.get("summary") or {}),
                  "runs": runs},
        "clock": dict(measure.get("clock") or {}), "comparisons": list(measure.get("comparisons") or ()),
        "tells": list(measure.get("tells") or ())}
    if compare:
        out["error"] = dict(compare.get("error") or {})
        fitted = compare.get("refit_fit") or {}
        if fitted:
            out["refit_error_all"] = fitted.get("error")
            out["refit_records"] = fitted.get("records")
            out["at_bound"] = fitted.get("at_bound")
        out["constants"] = {name: c for name, c in (compare.get("constants") or {}).items()
                            if name in KEY_CONSTANTS or _moved(c)}
        out["records"] = [{k: r.get(k) for k in ("part", "kernel", "impl", "calls", "measured_us", "shipped_us",
                                                 "refit_us")} for r in compare.get("kernels") or ()]
        out["models"] = list(compare.get("models") or ())
    return out


def _moved(c: Mapping[str, Any]) -> bool:
    a, b = c.get("shipped"), c.get("refit")
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(b - a) > MOVED * max(abs(a), 1e-9)


def counts_line(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def _ratio(pred: Any, meas: Any) -> str:
    if not isinstance(pred, (int, float)) or not isinstance(meas, (int, float)) or meas <= 0:
        return _us(pred)
    return f"{pred:.1f} ({pred / meas:.2f})"


def _error(e: Mapping[str, Any] | None) -> str:
    if not e:
        return "-"
    return f"{e['rows']} rows, furthest {e['worst_ratio']:.3f}x, rms log {e['rms_log']:.3f}"


def render(rec: Mapping[str, Any]) -> list[str]:
    """The Markdown section of a calibration row (render.render_markdown puts it after the steps)."""
    head = ["", f"### Calibration: the estimate refitted on this GPU (`{rec['id']}`)", ""]
    c = rec.get("calibration")
    if not c:
        return [*head, f"Not run: {rec['status']}" + (f": {rec['reason']}" if rec.get("reason") else "."), ""]
    lines = [*head]
    if c.get("stand_in"):
        lines += ["**Stand-ins**: a dry run's records carry the estimate's own times (no GPU ran them); they prove "
                  "the row's path, not the GPU.", ""]
    force = (f"the refit `{Path(c['refit']).name}` (`{ENV}` for every later command)" if c.get("refit")
             else c.get("in_force", "shipped"))
    lines += [f"In force for the rest of the run: {force}. `tools/calibrate.py measure` ({_us(c.get('measure_s'))} s) "
              f"wrote {c.get('kernel_records', 0)} kernel records ({counts_line(c['counts'])}) and "
              f"{c.get('model_records', 0)} model records, from {c.get('cases', 0)} cases (one record per "
              "measurement: a case another part shares is recorded once)."]
    if c.get("tells"):
        lines.append(f"They tell constants no earlier record could: {', '.join(c['tells'])}.")
    if c.get("cut"):
        lines += ["", f"Cut ({len(c['cut'])}):"] + [f"- {x['case']}: {x['why']}" for x in c["cut"][:20]]
        if len(c["cut"]) > 20:
            lines.append(f"- ... and {len(c['cut']) - 20} more (summary.json)")
    if c.get("failed"):
        lines += ["", f"Failed ({len(c['failed'])}):"] + [f"- {x['case']}: {x['why']}" for x in c["failed"]]
    lines += ["", "#### Launches in a CUDA graph, with and without PDL", ""]
    ch = c.get("chain") or {}
    runs = ch.get("runs") or {}
    off, on = runs.get("off") or {}, runs.get("on") or {}
    if off.get("measured_ms") is not None:
        lines.append(f"{ch.get('layers')} LayerNorm kernels over [{ch.get('rows')}, 768] in one graph (`onnx-gtco "
                     f"bench`): {off['measured_ms'] * 1e3:.1f} µs per forward without PDL"
                     + (f", {on['measured_ms'] * 1e3:.1f} µs with it ({on.get('pdl_launches')} launches after one "
                        "of ours)" if on.get("measured_ms") is not None else
                        f"; with PDL: {on.get('skipped') or on.get('failed') or 'not run'}")
                     + f"; the kernels measured alone {_us(ch.get('kernel_us'))} µs, {off.get('launches')} launches. "
                     f"Gap per launch: {_us2(ch.get('gap_us_per_launch'))} µs; PDL hides "
                     f"{_us2(ch.get('pdl_hides_us'))} µs per dependent launch"
                     + (f". ORT fp16 on the same chain: {off['ort_fp16_ms'] * 1e3:.1f} µs." if off.get("ort_fp16_ms")
                        else "."))
    else:
        lines.append(f"Not measured: {off.get('skipped') or off.get('failed') or 'no run'}.")
    consts = c.get("constants") or {}
    if consts:
        lines += ["", "| constant | shipped | refit | fitted |", "|---|---|---|---|"]
        lines += [f"| {name} | {_g(v.get('shipped'))} | {_g(v.get('refit'))} | {'yes' if v.get('fitted') else 'no'} |"
                  for name, v in consts.items()]
    lines += ["", "#### SM clock under sustained batch-64 GEMMs", ""]
    clock = c.get("clock") or {}
    if "skipped" in clock:
        lines.append(f"Not observed: {clock['skipped']}.")
    else:
        phases = "; ".join(f"{p} {v['sm_mhz_median']:.0f} MHz (min {v['sm_mhz_min']:.0f}, max {v['sm_mhz_max']:.0f}, "
                           f"{v['power_w_median']:.0f} W" + (f", reasons {' '.join(v['clock_event_reasons'])}"
                                                             if v.get("clock_event_reasons") else "") + ")"
                           for p, v in ((p, clock.get(p)) for p in ("before", "load", "after")) if v)
        lines.append(f"{clock.get('gemm')}, {clock.get('launches')} launches back to back: median "
                     f"{_us(clock.get('cold_us'))} µs cold, {_us(clock.get('sustained_us'))} µs sustained "
                     f"({clock.get('sustained_over_cold')}x). SM clock ({clock.get('source')}): {phases}.")
    if c.get("comparisons"):
        lines += ["", "#### One kernel against the kernels it replaces (measured)", "",
                  "| comparison | one kernel µs | split µs (fastest) | ratio |", "|---|---|---|---|"]
        lines += [f"| {x['what']} | {_us(x.get('fused_us'))} | {_us(x.get('split_us'))} | "
                  f"{_us2(x.get('ratio'))} |" for x in c["comparisons"]]
    if c.get("error"):
        lines += ["", "#### The estimate against these records", "",
                  "| records | shipped calibration | refit |", "|---|---|---|"]
        err = c["error"]
        for kind in sorted({k for side in err.values() for k in side}):
            lines.append(f"| {kind} | {_error(err.get('shipped', {}).get(kind))} | "
                         f"{_error(err.get('refit', {}).get(kind))} |")
        if c.get("refit_error_all"):
            lines += ["", f"The refit over every record it fitted ({', '.join(c.get('refit_records') or ())}): "
                      + "; ".join(f"{k} {_error(v)}" for k, v in c["refit_error_all"].items())
                      + (f"; at a bound: {', '.join(c['at_bound'])}" if c.get("at_bound") else "") + "."]
    if c.get("records"):
        lines += ["", "#### Each record: measured µs per forward, then each calibration's prediction (its ratio)", "",
                  "| part | kernel | calls | measured | shipped | refit |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['part']} | {r['kernel']} | {r['calls']} | {_us(r['measured_us'])} | "
                  f"{_ratio(r.get('shipped_us'), r['measured_us'])} | {_ratio(r.get('refit_us'), r['measured_us'])} |"
                  for r in c["records"]]
        lines += [f"| model | {m['model']}, PDL {'on' if m['pdl'] else 'off'} ({m['launches']} launches, "
                  f"{m['pdl_launches']} with PDL) | 1 | {_us(m['measured_us'])} | "
                  f"{_ratio(m.get('shipped_us'), m['measured_us'])} | {_ratio(m.get('refit_us'), m['measured_us'])} |"
                  for m in c.get("models") or ()]
    return [*lines, ""]


def _us2(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


def _g(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else "-"


__all__ = ["ENV", "SHIPPED_RECORDS", "fit_inputs", "provenance", "read_json", "render", "summary"]
