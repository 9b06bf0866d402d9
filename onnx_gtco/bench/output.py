"""The benchmark's outputs: the printed table (also bench.md), bench.json and bench.png."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from onnx_gtco.errors import GtcoError
from onnx_gtco.ir.export import write_bytes_atomic, write_text_atomic

FILES = ("bench.json", "bench.md", "bench.png")


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(doc: dict[str, Any]) -> str:
    """A Markdown table per batch: each variant's latency, its ratio to ours and ours' speedup over it, its
    accuracy against the fp32 original and its multiple of the roofline floor; then the floor and every variant's
    reason or note."""
    dev = doc["device"]
    lines = [f"# onnx-gtco bench: {doc['model']} on {doc['provider']} ({dev['name']}), gtco precision "
             f"{doc['precision']}", ""]
    for b in doc["batches"]:
        roof = b["roofline"]
        floor = roof.get("floor_ms")
        lines += [f"## batch {b['batch']}", "",
                  "| variant | status | median ms | p10 ms | p90 ms | runs | CUDA graph | gtco ÷ it | speedup "
                  "(it ÷ gtco) | x floor | max abs err | max rel err | cosine |",
                  "|---|---|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
        ours = next((v for v in b["variants"] if v["name"] == "gtco" and v["status"] == "ok"), None)
        for v in b["variants"]:
            ok = v["status"] == "ok"
            ratio = b["ours_over"].get(v["name"]) if v["name"] != "gtco" else (1.0 if ok else None)
            speedup = (v["median_ms"] / ours["median_ms"]) if ok and ours else None
            over_floor = v["median_ms"] / floor if ok and floor else None
            graph = "-" if not ok else ("yes" if v["cuda_graph"] else "no")
            lines.append(
                f"| {v['name']} | {v['status']} | {_f(v['median_ms'], '.3f')} | {_f(v['p10_ms'], '.3f')} | "
                f"{_f(v['p90_ms'], '.3f')} | {v['runs'] or '-'} | {graph} | "
                f"{_f(ratio, '.3f')} | {_f(speedup, '.2f')}{'x' if speedup is not None else ''} | "
                f"{_f(over_floor, '.1f')} | {_f(v['max_abs_err'], '.2e')} | {_f(v['max_rel_err'], '.2e')} | "
                f"{_f(v['cosine'], '.6f')} |")
        lines.append("")
        if floor is not None:
            lines.append(f"roofline floor {floor:.4f} ms = max({roof['flops'] / 1e9:.3f} GFLOP at "
                         f"{roof['peak_tflops']:.2f} TFLOP/s, {roof['bytes'] / 1e6:.3f} MB at {roof['peak_gbps']:.1f} "
                         "GB/s)")
            below = [v["name"] for v in b["variants"] if v["status"] == "ok" and v["median_ms"] < floor]
            if below:  # a floor no run can beat: the peaks were measured low (on a busy machine)
                lines.append(f"warning: {', '.join(below)} ran below the roofline floor, so the peaks measured on "
                             f"{dev['name']} are too low (the machine was busy?); a run on an idle machine raises "
                             "them")
        else:
            lines.append(f"roofline floor not available: {roof.get('reason', 'no peaks')} "
                         f"({roof['flops'] / 1e9:.3f} GFLOP, {roof['bytes'] / 1e6:.3f} MB)")
        for v in b["variants"]:
            text = v["reason"] if v["status"] != "ok" else v.get("note", "")
            if text:
                lines.append(f"- {v['name']} ({v['status']}): {text}")
        lines.append("")
    return "\n".join(lines)


def write_png(doc: dict[str, Any], path: Path) -> None:
    """Bars of each ok variant's median with p10/p90 error bars, one panel per batch, the roofline floor as a
    dashed line; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = doc["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(max(6.0, 4.5 * len(batches)), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        ok = [v for v in b["variants"] if v["status"] == "ok"]
        names = [v["name"] for v in ok]
        med = [v["median_ms"] for v in ok]
        err = [[v["median_ms"] - v["p10_ms"] for v in ok], [v["p90_ms"] - v["median_ms"] for v in ok]]
        colors = ["tab:green" if n == "gtco" else "tab:blue" for n in names]
        ax.bar(range(len(ok)), med, yerr=err, capsize=4, color=colors)
        ax.set_xticks(range(len(ok)), names, rotation=30, ha="right")
        floor = b["roofline"].get("floor_ms")
        if floor:
            ax.axhline(floor, color="tab:red", linestyle="--", label=f"roofline floor {floor:.3g} ms")
            ax.legend(loc="best", fontsize=8)
        skipped = [v["name"] for v in b["variants"] if v["status"] != "ok"]
        ax.set_title(f"batch {b['batch']}" + (f"\nnot run: {', '.join(skipped)}" if skipped else ""), fontsize=9)
        ax.set_ylabel("median latency, ms (p10-p90)")
    fig.suptitle(f"{doc['model']} on {doc['provider']} ({doc['device']['name']})", fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=100)
    finally:
        plt.close(fig)
    write_bytes_atomic(png.getvalue(), path)


def check_out_dir(out_dir: Path) -> None:
    """Raise GtcoError unless `out_dir` is a writable folder or can be created as one (checked before measuring;
    the folder itself is made only when the results are written)."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise GtcoError(f"--out {out_dir}: not a directory")
        if not os.access(out_dir, os.W_OK):
            raise GtcoError(f"--out {out_dir}: directory is not writable")
        return
    parent = out_dir.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise GtcoError(f"--out {out_dir}: cannot create it in {parent}")


def write_outputs(doc: dict[str, Any], table: str, out_dir: Path) -> list[Path]:
    """bench.json, bench.md and bench.png in `out_dir` (created when missing), each written atomically. Returns
    their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f for f in FILES]
    write_text_atomic(json.dumps(doc, indent=2) + "\n", paths[0])
    write_text_atomic(table + "\n", paths[1])
    write_png(doc, paths[2])
    return paths
