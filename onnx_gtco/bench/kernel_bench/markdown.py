"""The kernel bench's results as Markdown."""

from __future__ import annotations

from typing import Any

from onnx_gtco.bench.kernel_bench.shapes import IMPLS


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _base_cell(b: dict | None) -> str:
    if not b:
        return "-"
    if b.get("us") is not None and b.get("ok"):
        return _us(b["us"])
    return "wrong" if b.get("us") is not None or str(b.get("error", "")).startswith("wrong") else "-"


def markdown(results: list[dict], device: str, notes: list[str] | None = None) -> str:
    lines = [f"Device: {device}. Median µs of CUDA-event timings (ORT: wall-clock per run); ratio = baseline / ours "
             "(> 1: ours faster). tuned = the fastest correct candidate of all implementations (what a GPU tuning "
             "study picks among them); separate = the faster of torch matmul or addmm + the epilogue as separate "
             "ops; err = the largest ‖err‖/‖ref‖ against fp64 of our candidates (a wrong one is excluded from best).",
             ""]
    gemm = [r for r in results if r.get("kind") == "gemm"]
    if gemm:
        lines += ["| set | GEMM (M x N x K, epilogue) | x | mma best | cutlass best | cublaslt best | tuned (impl) | "
                  "analytical pick | cuBLASLt fused | separate | max-autotune | tuned / separate | "
                  "cutlass / cuBLASLt fused | tuned / max-autotune | err | ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in gemm:
            if r.get("error") or r.get("skipped_reason"):
                lines.append(_unmeasured_row(r, 12))
                continue
            best = r["best"]
            cells = []
            for impl in IMPLS:
                cells.append(_us(best[impl][1]) if best.get(impl) else
                             ("skip" if impl in r["skipped"] else "-"))
            t = r["tuned"]
            pick = r["analytical_pick"]
            fused = r["cublaslt_fused"]
            fused_cell = (_us(fused["us"]) + (f" ({fused['note']})" if fused.get("note") else "")
                          if fused.get("ok") else "-")
            comp = r.get("compile") or {}
            comp_cell = _us(comp["us"]) if comp.get("ok") else ("wrong" if comp.get("us") else
                                                                 comp.get("skipped", "-")[:24] if comp else "-")
            errs = [x["rel_err"] for x in r["rows"] if isinstance(x.get("rel_err"), float)]
            n_ok = sum(x["ok"] for x in r["rows"])
            ra = r["ratios"]
            lines.append(
                f"| {r['set']} | {r['case']} | {r['count']} | {' | '.join(cells)} | "
                f"{_us(t['us']) + ' (' + t['impl'] + ')' if t else '-'} | "
                f"{(_us(pick['us']) if pick['ok'] else 'failed') + ' (' + pick['impl'] + ')' if pick else '-'} | "
                f"{fused_cell} | {_us((r['separate'] or {}).get('us'))} | {comp_cell} | "
                f"{_x(ra['tuned_vs_separate'])} | {_x(ra['cutlass_vs_cublaslt_fused'])} | "
                f"{_x(ra['tuned_vs_compile'])} | {max(errs):.1e} | {n_ok}/{len(r['rows'])} |"
                if errs else
                f"| {r['set']} | {r['case']} | {r['count']} | {' | '.join(cells)} | - | - | {fused_cell} | "
                f"{_us((r['separate'] or {}).get('us'))} | {comp_cell} | - | - | - | - | 0/{len(r['rows'])} |")
        skipped = {(impl, why) for r in gemm for impl, why in (r.get("skipped") or {}).items()}
        if skipped:
            lines += ["", "Implementations not timed on some rows:"]
            lines += [f"- {impl}: {why}" for impl, why in sorted(skipped)]
        wrong = [(r["case"], x["instance"], x.get("error")) for r in gemm for x in r["rows"] if not x["ok"]]
        if wrong:
            lines += ["", "Candidates that failed (excluded from best):"]
            lines += [f"- {case}: `{inst}`: {err}" for case, inst, err in wrong]
    conv = [r for r in results if r.get("kind") == "conv"]
    if conv:
        lines += ["", "| set | conv (N x C x H x W -> K x OH x OW) | x | torch cuDNN | ORT cuDNN | ours | "
                  "cuDNN (torch) / ours | cuDNN (ORT) / ours | torch err |", "|---|---|---|---|---|---|---|---|---|"]
        for r in conv:
            if r.get("error") or r.get("skipped_reason"):
                lines.append(_unmeasured_row(r, 5))
                continue
            b = r["baselines"]
            ort_b = b.get("ORT cuDNN") or {}
            tb = b.get("torch cuDNN") or {}
            ours = r.get("ours") or {}
            err = f"{tb['rel_err']:.1e}" if isinstance(tb.get("rel_err"), float) else "-"
            lines.append(f"| {r['set']} | {r['case']} | {r['count']} | {_base_cell(tb)} | "
                         f"{'skip' if ort_b.get('skipped') else _base_cell(ort_b)} | "
                         f"{'skip' if ours.get('skipped') else _us(ours.get('us'))} | "
                         f"{_x(r['ratios'].get('ours_vs_cudnn_torch'))} | {_x(r['ratios']['ours_vs_cudnn_ort'])} | "
                         f"{err} |")
        why = {(r.get("ours") or {}).get("skipped") for r in conv} - {None}
        why_ort = {((r.get("baselines") or {}).get("ORT cuDNN") or {}).get("skipped") for r in conv} - {None}
        lines += [""] + [f"- ours skipped: {w}" for w in sorted(why)] + [f"- ORT skipped: {w}" for w in sorted(why_ort)]
        wrong = [(r["case"], x["instance"], x.get("error")) for r in conv for x in r.get("rows", []) if not x["ok"]]
        lines += [f"- {case}: `{inst}` failed (excluded from ours): {err}" for case, inst, err in wrong]
    other = [r for r in results if r.get("kind") not in ("gemm", "conv")]
    if other:
        lines += ["", "| set | case | x | ours: best config | ours µs (default / best) | baseline µs | ratio vs each | "
                  "configs ok |", "|---|---|---|---|---|---|---|---|"]
        for r in other:
            if r.get("error") or r.get("skipped_reason"):
                lines.append(_unmeasured_row(r, 5))
                continue
            best = (r.get("best") or {}).get("mma")
            default = r["rows"][0]["us"] if r["rows"] else None
            base = ", ".join(f"{k} {_us(v['us'])}" for k, v in r["baselines"].items())
            ratio = ", ".join(f"{k} {v['us'] / best[1]:.2f}x" for k, v in r["baselines"].items()) if best else "-"
            n_ok = sum(x["ok"] for x in r["rows"])
            lines.append(f"| {r['set']} | {r['case']} | {r['count']} | `{best[0] if best else '-'}` | "
                         f"{_us(default)} / {_us(best[1] if best else None)} | {base} | {ratio} | "
                         f"{n_ok}/{len(r['rows'])} |")
    lines += [""] + [f"- {n}" for n in notes or ()]
    return "\n".join(lines).rstrip() + "\n"


def _unmeasured_row(r: dict, empty: int) -> str:
    """A case's table row when it failed or was skipped: the reason, then `empty` empty cells."""
    why = r.get("error") or "skipped: " + r["skipped_reason"]
    return f"| {r['set']} | {r['case']} | {r.get('count', 1)} | {why} |" + " |" * empty
