"""OUT/benchmarks.md (what docs/benchmarks.md is a copy of) and the short table printed last, from the summary."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from suite import calibration
from suite.common import PROG
from suite.plan import BASELINES, PHASES

OURS = "gtco"
PATH_KEYS = ("junit", "results", "site", "library", "md")
"""Details that are paths: in summary.json, not in the tables."""
PHASE_TITLES = {
    "core": "Core rows: the fp32 exports optimized to fp16, default configurations",
    "tune": "Tuned rows: the same models after tuning their kernel tasks",
    "rest": "The other models",
    "extra": "torch.compile and TensorRT beside ours",
}


def _ms(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def _variants(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v.get("name"): v for v in row.get("variants") or ()}


def _floor(row: dict[str, Any]) -> Any:
    return (row.get("roofline") or {}).get("floor_ms")


def baseline_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The baselines any row reported, known ones in BASELINES order, then the others by name."""
    seen = {n for r in rows for n in _variants(r) if n != OURS}
    return [b for b in BASELINES if b in seen] + sorted(seen - set(BASELINES))


def _row_name(r: dict[str, Any]) -> str:
    what = r["id"].split("/", 1)[-1]
    return what + (f" ({r['model']} b{r['batch']})" if r.get("stands_in_for") else "")


def _bench_table(rows: Sequence[dict[str, Any]], notes: dict[tuple[str, str, str], list[str]]) -> list[str]:
    cols = baseline_columns(rows)
    head = ["row", "status", "gtco ms", *(f"{c} ms" for c in cols), "floor ms"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        var = _variants(r)
        cells = []
        for name in (OURS, *cols):
            x = var.get(name)
            if x is None:
                cells.append("-")
                continue
            if x.get("status") != "ok":
                cells.append(x.get("status") or "?")
                notes.setdefault((name, x.get("status") or "?", x.get("reason") or ""), []).append(r["id"])
                continue
            ratio = (r.get("ours_over") or {}).get(name)
            mode = {True: " g", False: " n"}.get((r.get("ours_over_cuda_graph") or {}).get(name), "")
            cells.append(_ms(x.get("median_ms")) + (" g" if x.get("cuda_graph") else "")
                         + (f" ({ratio:.2f}×{mode})" if isinstance(ratio, (int, float)) else ""))
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "") + (
            " (kept)" if r.get("resumed") else "")
        out.append(f"| {_row_name(r)} | {status} | " + " | ".join(cells) + f" | {_ms(_floor(r))} |")
    return out


def render_markdown(summary: dict[str, Any]) -> str:
    """OUT/benchmarks.md: date, GPU, driver, versions, the exact command, the steps, the calibration row's refit,
    each phase's rows with their latencies and ratios, where the time goes, the kernel bench, and every row not run
    with its reason."""
    s, env = summary["suite"], summary["env"]
    v = env.get("versions") or {}
    gpu = env.get("gpu")
    title = (f"{gpu['name']}, {s['date'][:10]}" if gpu and not s["dry_run"]
             else f"dry run on the CPU, {s['date'][:10]}")
    lines = ["# Benchmarks", "",
             f"Written by `{PROG}` (its `OUT/benchmarks.md`; `--write-docs` copies it to `docs/benchmarks.md`). "
             "Every number below comes from that run's files; none is edited by hand.", "",
             "To make such a run on a machine with an NVIDIA GPU (sm_80 or newer), nvcc and network: "
             "`pip install '.[gpu,cutlass]' onnxruntime-gpu -r requirements-zoo.txt` (onnxruntime-gpu in place of "
             "onnxruntime), then `tools/gpu_suite --out gpu-suite --budget-min 25`. `--list` prints the plan's rows "
             "with their expected times, `--rows 'core/*'` runs some of them, `--resume` continues a run that was cut "
             "off, and a machine without network needs every package and header carried to it (the run checks that "
             "first and names what is missing).", "",
             f"## End to end and kernels ({title})", ""]
    if summary.get("stop"):
        lines += [f"**Stopped**: {summary['stop']}", ""]
    if s["dry_run"]:
        lines += ["**Dry run**: CPU stand-ins (small models, `--provider cpu`, kernels compiled but not launched). "
                  "It proves the suite's plumbing; its times say nothing about a GPU.", ""]
    clocks = f", SM clock {gpu.get('sm_clock')} of {gpu.get('sm_clock_max')}" if gpu and gpu.get("sm_clock") else ""
    gpu_line = (f"{gpu['name']} ({gpu['arch']}, onnx-gtco target {env.get('target')}), driver {gpu['driver']}{clocks}"
                if gpu else f"none{' (dry run)' if s['dry_run'] else ''}, onnx-gtco target {env.get('target')}")
    providers = ", ".join(v.get("onnxruntime_providers") or ())
    versions = [f"onnx-gtco {v.get('onnx_gtco') or '?'}" + (f" (tree {env['tree']})" if env.get("tree") else ""),
                f"onnxruntime {v.get('onnxruntime') or '-'} ({providers or 'no providers'})",
                f"torch {v.get('torch') or '-'}" + (f" (CUDA {v['torch_cuda']})" if v.get("torch_cuda") else ""),
                f"cupy {v.get('cupy') or '-'}", f"onnx {v.get('onnx') or '-'}", f"optuna {v.get('optuna') or '-'}"]
    lines += [f"- Date: {s['date']}", f"- GPU: {gpu_line}", f"- CUDA: {env.get('cuda') or '-'} (nvcc)",
              f"- Versions: {', '.join(versions)}", f"- Command: `{s['command']}`",
              f"- Budget: {s['budget_min']:g} min, {s['elapsed_s'] / 60:.1f} min used; tuning: {s['tune_trials']} "
              f"trials per kernel task in the tune rows (`{s['storage']}`)"]
    if s.get("resumed_from"):
        lines.append(f"- Resumed: rows marked (kept) come from the run of {s['resumed_from']} in the same folder")
    lines += ["", "### Steps", "", "| step | status | seconds | note |", "|---|---|---|---|"]
    for st in summary["steps"]:
        note = st["reason"] or ", ".join(f"{k} {val}" for k, val in st["detail"].items()
                                         if isinstance(val, (int, float, str)) and k not in PATH_KEYS)
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.1f} | {note} |")
    rows = summary["rows"]
    for r in (r for r in rows if r["kind"] in ("smoke", "install", "calibration")):
        lines.append(f"| {r['id']} | {r['status']} | {r['seconds']:.1f} | {r['reason'] or _steps_note(r)} |")
    for r in (r for r in rows if r["kind"] == "calibration"):
        lines += calibration.render(r)
    provider = "cpu" if s["dry_run"] else "cuda"
    notes: dict[tuple[str, str, str], list[str]] = {}
    for phase in PHASES:
        bench = [r for r in rows if r["phase"] == phase and r["kind"] == "bench"]
        if not bench:
            continue
        lines += ["", f"### {PHASE_TITLES.get(phase, phase)} (`onnx-gtco bench --provider {provider} --precision "
                      "fp16`)", ""]
        if phase == "core":
            lines += ["Median latency in ms per run of the whole model (p10–p90 in the bench's files); in each "
                      "baseline column the baseline's median and, in brackets, the bench's `ours_over`: gtco's "
                      "median over the baseline's (< 1: gtco faster), compared with CUDA graph replay on both sides "
                      "(`g`) or on neither (`n`: then each side's time without graphs, the bench's "
                      "`median_ms_no_graph` where a side replayed one). A median marked `g` replayed a CUDA graph. "
                      "`floor` is the roofline floor: the model's FLOPs at the measured matmul peak or its minimum "
                      "DRAM bytes at the measured copy bandwidth, whichever is longer.", ""]
        lines += _bench_table(bench, notes)
    if notes:
        lines += ["", "Variants that did not run:"]
        lines += [f"- {name} {status} ({', '.join(where)}): {reason or 'no reason given'}"
                  for (name, status, reason), where in notes.items()]
    not_run = [r for r in rows if r["status"] != "ok"]
    if not_run:
        lines += ["", "### Rows not run or failed", ""]
        lines += [f"- {r['id']}: {r['status']}: {r['reason']}" for r in not_run]
    lines += render_profiles(rows)
    lines += ["", "### Kernels vs cuBLASLt, torch and ONNX Runtime (`python -m onnx_gtco.bench.kernel_bench`)", ""]
    kernel_rows = [r for r in rows if r["kind"] == "kernels"]
    for r in kernel_rows:
        md = Path((r.get("kernel_bench") or {}).get("md") or "/nonexistent")
        lines += [f"#### {r['id']}", "", md.read_text().strip() if md.is_file() else f"Not run: {r['status']}"
                  + (f": {r['reason']}" if r.get("reason") else "."), ""]
    if not kernel_rows:
        lines.append("Not in this run's plan.")
    for r in (r for r in rows if r["kind"] == "probe"):
        md = Path((r.get("probe") or {}).get("md") or "/nonexistent")
        lines += ["", f"### Hopper's library paths: FP8 GEMMs, cuDNN attention ({r['id']})", "",
                  md.read_text().strip() if md.is_file() else f"Not run: {r['status']}"
                  + (f": {r['reason']}" if r.get("reason") else ".")]
    return "\n".join(lines).rstrip() + "\n"


def _steps_note(r: dict[str, Any]) -> str:
    return "; ".join(f"{st['name'].split(': ')[-1]} {st['status']}" + (f" ({st['reason']})" if st["reason"] else "")
                     for st in r.get("steps") or ())


def render_profiles(rows: Sequence[dict[str, Any]]) -> list[str]:
    """"Where the time goes": per row and variant the top kernels of its profiled runs (bench --profile), or why
    it has none; nothing when no row was profiled."""
    out: list[str] = []
    for r in rows:
        for name, x in _variants(r).items():
            prof = x.get("profile")
            if not prof:
                continue
            out += ["", f"#### {r['id']}, {name}", ""]
            if "top" not in prof:
                out.append(f"No profile: {prof.get('reason') or 'no reason given'}.")
                continue
            out += [f"{prof['kernel_us_per_run']:.1f} µs of GPU kernels per run ({prof['calls_per_run']:.0f} "
                    f"launches of {prof['kernels_total']} distinct kernels; median run "
                    f"{_ms(x.get('median_ms_no_graph') or x.get('median_ms'))} ms without graphs).", "",
                    "| kernel | calls/run | µs/run | share |", "|---|---|---|---|"]
            out += [f"| `{k['kernel']}` | {k['calls_per_run']:g} | {k['us_per_run']:.1f} | {k['share']:.1%} |"
                    for k in prof["top"]]
    return ["", "### Where the time goes (top kernels by GPU time, `bench --profile`)", *out] if out else []


def short_table(summary: dict[str, Any]) -> str:
    """The few lines printed last: per bench row its status, our time, the fastest baseline with gtco's time over
    it, the roofline floor and, when not ok, the reason; then the other rows and steps."""
    lines = [f"{'row':<30} {'status':<8} {'gtco ms':>9}  {'fastest baseline (gtco/it)':<36} {'floor ms':>9}"]
    for r in summary["rows"]:
        if r["kind"] != "bench":
            lines.append(f"{r['id']:<30} {r['status']:<8}" + (f"  {r['reason']}" if r.get("reason") else ""))
            continue
        var = _variants(r)
        ours = var.get(OURS) or {}
        base = [(x["median_ms"], n) for n, x in var.items()
                if n != OURS and x.get("status") == "ok" and isinstance(x.get("median_ms"), (int, float))]
        fast = ""
        if base:
            ms, n = min(base)
            ratio = (r.get("ours_over") or {}).get(n)
            fast = f"{n} {ms:.3f}" + (f" ({ratio:.2f})" if isinstance(ratio, (int, float)) else "")
        line = (f"{r['id']:<30} {r['status']:<8} "
                f"{_ms(ours.get('median_ms') if ours.get('status') == 'ok' else None):>9}  {fast:<36} "
                f"{_ms(_floor(r)):>9}")
        lines.append(line + (f"  {r['reason']}" if r.get("reason") else ""))
    lines.append("steps: " + " | ".join(f"{s['name']} {s['status']}" for s in summary["steps"]))
    return "\n".join(([f"STOPPED: {summary['stop']}"] if summary.get("stop") else []) + lines)


__all__ = ["baseline_columns", "render_markdown", "render_profiles", "short_table"]
