"""The optimize report for people: Markdown (`onnx-gtco report`, `optimize --report-md`) and a PNG of where the time
goes per family. Reads only what report.build_report, pipeline.optimize(_file) and the library / tuning entries
write; a section the report lacks is left out or says "none"."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from onnx_gtco.errors import ReportError
from onnx_gtco.ir.export import write_bytes_atomic, write_text_atomic
from onnx_gtco.kernels.family import KernelFamily
from onnx_gtco.kernels.select import ALL_FAMILIES
from onnx_gtco.plan.types import GraphPass
from onnx_gtco.plugin.passes import graph_passes
from onnx_gtco.report import estimate_words, per_layer, speedup

REQUIRED_KEYS = ("model", "target", "precision", "nodes_before", "nodes_after", "groups", "rejected", "not_chosen",
                 "unfused_ops", "fused_flop_share", "predicted_us_before", "predicted_us_after")
"""Top-level keys every report of onnx-gtco optimize has (report.build_report)."""
GROUP_KEYS = ("name", "family", "nodes", "predicted_us", "predicted_unfused_us")
UNFUSED_ROW = "(unfused nodes)"


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The report at `path`, checked to be one onnx-gtco optimize wrote.

    Raises:
        ReportError: one line naming the file and the problem (the missing key, where one is missing).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ReportError(f"{p}: is a directory, not a report file") from None
    except UnicodeDecodeError:
        raise ReportError(f"{p}: not JSON (not UTF-8 text)") from None
    except OSError as e:
        raise ReportError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{p}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    check_report(doc, str(p))
    return doc


def check_report(doc: Any, where: str = "report") -> None:
    """Raise ReportError unless `doc` has the keys the renderer reads (naming the first one missing)."""
    if not isinstance(doc, dict):
        raise ReportError(f"{where}: not an onnx-gtco report (a JSON {type(doc).__name__}, not an object)")
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise ReportError(f"{where}: not an onnx-gtco report (no key {missing[0]!r})")
    for key in ("groups", "rejected", "not_chosen"):
        if not isinstance(doc[key], list):
            raise ReportError(f"{where}: not an onnx-gtco report ({key!r} is not a list)")
    if not isinstance(doc["unfused_ops"], dict):
        raise ReportError(f"{where}: not an onnx-gtco report ('unfused_ops' is not an object)")
    for i, g in enumerate(doc["groups"]):
        if not isinstance(g, dict):
            raise ReportError(f"{where}: not an onnx-gtco report (groups[{i}] is not an object)")
        lacking = next((k for k in GROUP_KEYS if k not in g), None)
        if lacking is not None:
            raise ReportError(f"{where}: not an onnx-gtco report (groups[{i}] has no key {lacking!r})")


# ---------------------------------------------------------------------------------------------------------- helpers


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}" if abs(x) >= 100 else f"{x:.2f}"


def _cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """A GitHub Markdown table; `align` is one letter per column, l or r (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    out = ["| " + " | ".join(_cell(h) for h in header) + " |",
           "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _ranked(counts: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def _examples(names: Sequence[str], k: int = 3) -> str:
    more = f", ... ({len(names) - k} more)" if len(names) > k else ""
    return ", ".join(f"`{n}`" for n in names[:k]) + more


def has_measured(report: dict[str, Any]) -> bool:
    return any(g.get("measured_us") is not None for g in report["groups"])


# ------------------------------------------------------------------------------------------------------- per family


def family_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per family, heaviest first: groups, nodes, predicted time unfused (before) and fused (after), and the measured
    time of the groups that have one. A last row holds the nodes no group fused (their estimated time, the
    report's `unfused_nodes_us`; in reports without it, the predicted time before less the groups' unfused times),
    the same before and after."""
    fams: dict[str, dict[str, Any]] = {}
    for g in report["groups"]:
        f = fams.setdefault(g["family"], {"family": g["family"], "groups": 0, "nodes": 0, "before_us": 0.0,
                                          "after_us": 0.0, "measured_us": 0.0, "measured_groups": 0})
        f["groups"] += 1
        f["nodes"] += len(g["nodes"])
        f["before_us"] += g["predicted_unfused_us"]
        f["after_us"] += g["predicted_us"]
        if g.get("measured_us") is not None:
            f["measured_us"] += g["measured_us"]
            f["measured_groups"] += 1
    rows = sorted(fams.values(), key=lambda f: (-f["before_us"], f["family"]))
    rest = report.get("unfused_nodes_us", report["predicted_us_before"] - sum(f["before_us"] for f in rows))
    unfused_nodes = sum(report["unfused_ops"].values())
    if unfused_nodes or rest > 0.005:
        rows.append({"family": UNFUSED_ROW, "groups": 0, "nodes": unfused_nodes, "before_us": max(rest, 0.0),
                     "after_us": max(rest, 0.0), "measured_us": 0.0, "measured_groups": 0})
    return rows


# --------------------------------------------------------------------------------------------------------- sections


def _header(r: dict[str, Any]) -> list[str]:
    gpu = f" ({r['gpu']})" if r.get("gpu") else ""
    lines = [f"# onnx-gtco report: {r['model']}", "",
             f"Target **{r['target']}**{gpu}, precision **{r['precision']}**. "
             f"{len(r['groups'])} fused groups; {100 * r['fused_flop_share']:.1f}% of the model's "
             + (f"{r['flops_total'] / 1e9:.3f} GFLOP " if r.get("flops_total") is not None else "FLOPs ")
             + "run inside fused groups.", ""]
    rows: list[list[Any]] = [["nodes", r["nodes_before"], r["nodes_after"], "-"]]
    speed = r.get("predicted_speedup")
    rows.append(["predicted time, µs (estimate)", _us(r["predicted_us_before"]), _us(r["predicted_us_after"]),
                 speedup(speed) if speed else "-"])
    la = r.get("launches")
    if la:
        rows.append(["kernel launches per forward", f"{la['original_launching_nodes']} (nodes that launch)",
                     la["ours"], "-"])
        blk = la.get("per_block")
        if blk and "original_launching_nodes" in blk:
            what = "layer" if per_layer(blk["anchor"]) else f"repeated block ({blk['anchor']})"
            rows.append([f"kernel launches per {what}", f"{blk['original_launching_nodes']:g}", f"{blk['ours']:g}",
                         "-"])
    if r.get("predicted_us_after_pdl") is not None:
        rows.append(["predicted time with PDL, µs (assumed overlap)", "-", _us(r["predicted_us_after_pdl"]), "-"])
    mb, ma = r.get("measured_us_before"), r.get("measured_us_after")
    if mb is not None or ma is not None:
        rows.append(["measured time, µs", _us(mb), _us(ma), speedup(mb / ma) if mb and ma else "-"])
    lines += _table(["", "before", "after", "speedup"], rows)
    if r.get("plan_costs"):
        lines += ["", f"The plan used {r['plan_costs']}"
                  + (f"; its cost is {_us(r['planned_us_after'])} µs." if r.get("planned_us_after") is not None
                     else ".")]
    if r.get("assumptions"):
        lines += ["", "Assumed, not measured: " + r["assumptions"]["note"] + "."]
    lines += ["", f"Times are predicted by {estimate_words(r)}" + (
        ", with measured kernel times where tuning measured them." if has_measured(r) else
        "; nothing in this report was measured.")]
    est = r.get("estimate") or {}
    if est.get("calibration"):
        cal = est["calibration"]
        lines += ["", f"Calibration: `{cal['file']}`, fitted {cal.get('date', '?')} to {cal.get('kernel_rows', '?')} "
                  f"kernel and {cal.get('model_rows', '?')} model records of {cal['gpu']}"
                  + (" (proxies: " + "; ".join(est["proxies"]) + ")" if est.get("proxies") else "") + "."]
    elif est:
        lines += ["", est["note"] + "."]
    for graph_pass in graph_passes():  # each planner pass's decisions (the patch embeddings, priced both ways)
        lines += _pass_table(graph_pass, r.get(graph_pass.name) or [])
    return lines


def _families(r: dict[str, Any]) -> list[str]:
    lines = ["", "## Fused groups by family", ""]
    if not r["groups"]:
        return [*lines, "none: no group was fused."]
    rows = family_rows(r)
    measured = has_measured(r)
    header = ["family", "groups", "nodes", "predicted µs before (unfused)", "predicted µs after (fused)"]
    if measured:
        header.append("measured µs (groups measured)")
    body = []
    for f in rows:
        row = [f["family"], f["groups"] or "-", f["nodes"], _us(f["before_us"]), _us(f["after_us"])]
        if measured:
            row.append(f"{_us(f['measured_us'])} ({f['measured_groups']} of {f['groups']})"
                       if f["measured_groups"] else "-")
        body.append(row)
    tot = ["**total**", len(r["groups"]), sum(f["nodes"] for f in rows), _us(sum(f["before_us"] for f in rows)),
           _us(sum(f["after_us"] for f in rows))]
    if measured:
        tot.append(_us(sum(f["measured_us"] for f in rows)))
    lines += _table(header, [*body, tot])
    lines += ["", f"{UNFUSED_ROW}: nodes outside every fused group, costed alone (the same before and after)."
              if rows[-1]["family"] == UNFUSED_ROW else ""]
    if r.get("predicted_us_before_planned") is not None:
        lines += ["", f"The planner rewrote the graph first ({'; '.join(p.describe for p in graph_passes())}): the "
                  f"rows cost the {r.get('nodes_planned', r['nodes_before'])} nodes of that graph, "
                  f"{_us(r['predicted_us_before_planned'])} µs unfused, against {_us(r['predicted_us_before'])} µs "
                  f"for the model as given ({r['nodes_before']} nodes)."]
    top = sorted(r["groups"], key=lambda g: -g["predicted_us"])[:5]
    lines += ["", f"The {len(top)} groups with the most predicted time:", ""]
    lines += _table(["group", "pattern", "ops", "predicted µs", "unfused µs"],
                    [[f"`{g['name']}`", g.get("pattern", g["family"]), len(g["nodes"]), _us(g["predicted_us"]),
                      _us(g["predicted_unfused_us"])] for g in top], "llrrr")
    return lines


def _unfused(r: dict[str, Any]) -> list[str]:
    lines = ["", "## What stays unfused", "", "### Op types outside every group", ""]
    ops = _ranked(r["unfused_ops"])
    lines += _table(["op type", "nodes"], ops) if ops else ["none: every node is in a fused group."]
    lines += ["", "### Matches rejected by rule checks", ""]
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for x in r["rejected"]:
        by_reason.setdefault(x["reason"], []).append(x)
    if by_reason:
        lines += _table(["reason", "pattern", "matches", "at"],
                        [[reason, ", ".join(sorted({x["pattern"] for x in xs})), len(xs),
                          _examples([x["anchor"] for x in xs])]
                         for reason, xs in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0]))], "llrl")
    else:
        lines.append("none")
    lines += ["", "### Legal candidates the plan did not choose", ""]
    nc = r["not_chosen"]
    if not nc:
        return [*lines, "none"]
    by_kind: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for x in nc:
        by_kind.setdefault((x["pattern"], x["family"]), []).append(x)
    lines += [f"{len(nc)} candidates lost to a cheaper cover of their nodes (the DP's choice; each one's winner is "
              "in the JSON's `not_chosen`).", ""]
    lines += _table(["pattern", "family", "candidates", "at"],
                    [[p, f, len(xs), _examples(sorted({x["anchor"] for x in xs}))]
                     for (p, f), xs in sorted(by_kind.items(), key=lambda kv: (-len(kv[1]), kv[0]))], "llrl")
    return lines


def device_archs(lib: dict[str, Any]) -> list[str]:
    """The archs the library has device kernels for: those of its compiled instances; an emulated build's
    instances run on the CPU as the sm_80 ones."""
    archs = sorted({k["arch"] for k in lib.get("kernels") or []})
    if lib.get("emulated") and not archs:
        archs = ["sm_80"]
    return archs


def coverage(report: dict[str, Any]) -> dict[str, Any]:
    """Fused nodes by where they run, from the report's groups and library entry: `fused`, `functions` (keep their
    model-local functions: library.skipped), `cpu` (CPU kernels), `device` (with device kernels, on each of
    `archs`), `no_device` (bound but without a device kernel: library.kernel_skips)."""
    lib = report["library"]
    names = [g["name"] for g in report["groups"]]
    skipped = lib.get("skipped") or {}
    kskips = lib.get("kernel_skips") or {}
    bound = [n for n in names if n not in skipped]
    has_device = bool(lib.get("cuda") or lib.get("emulated"))
    device = [n for n in bound if n not in kskips] if has_device else []
    return {"fused": len(names), "functions": len(names) - len(bound), "cpu": len(bound), "device": len(device),
            "no_device": len(bound) - len(device), "archs": device_archs(lib) if device else []}


def _reasons(reasons: dict[str, str]) -> list[str]:
    by: dict[str, list[str]] = {}
    for node, why in reasons.items():
        by.setdefault(why, []).append(node)
    return _table(["reason", "nodes", "e.g."], [[why, len(ns), _examples(ns, 2)] for why, ns in
                                                sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0]))], "lrl")


def _fp8(r: dict[str, Any]) -> list[str]:
    """fp8's GEMMs (onnx_gtco.fp8): each with its error on E4M3 operands over the calibration samples and whether
    it computes on them, or why not."""
    f = r.get("fp8")
    if not f:
        return []
    rows = [[g["node"], _cell(g.get("error", "-")), "E4M3" if g["fp8"] else "fp16", g.get("why", "")]
            for g in f["gemms"]]
    return ["", "## FP8 GEMMs", "", f"{f['gemms_fp8']} of {len(f['gemms'])} GEMMs on E4M3 operands, error budget "
            f"{f['budget']:g} (‖Q(a) Q(b) − a b‖ / ‖a b‖ over {f['samples']} calibration samples; "
            f"{f['calibration']}).", "", *_table(["node", "error", "operands", "kept fp16 because"], rows, "lrll")]


def _device(r: dict[str, Any]) -> list[str]:
    d = r.get("device")
    if not d:
        return []
    lines = ["", "## Device kernels", "",
             f"Which fused nodes have device kernels is decided by {d.get('decided_by', 'the plugin')}.", ""]
    if d.get("error"):
        return [*lines, f"Unknown for this model: {d['error']}"]
    lines += _table(["arch", "fused nodes with device kernels", "fused nodes"],
                    [[a, n, d["fused_nodes"]] for a, n in d["with_kernels"].items()], "lrr")
    if d.get("without"):
        lines += ["", "Fused nodes without a device kernel run their model-local functions:", ""]
        lines += _table(["family", "reason", "nodes"], [[w["family"], w["reason"], w["nodes"]] for w in d["without"]],
                        "llr")
    return lines


def _library(r: dict[str, Any]) -> list[str]:
    lines = ["", "## Custom-op library and device kernels", ""]
    lib = r.get("library")
    if not lib:
        return [*lines, "none: the model was written without its custom-op library (optimize --no-build); every "
                "fused node runs its model-local function."]
    kind = ("CPU kernels + CUDA device kernels" if lib.get("cuda") else
            "CPU kernels + device kernels emulated on the CPU" if lib.get("emulated") else "CPU kernels only")
    lines += [f"`{lib['file']}` ({kind}). Registers {', '.join(f'`{t}`' for t in lib['op_types']) or 'no op type'}"
              + (f"; with device kernels: {', '.join(f'`{t}`' for t in lib.get('cuda_op_types') or [])}."
                 if lib.get("cuda_op_types") else "; none with device kernels."), ""]
    c = coverage(r)
    rows: list[list[Any]] = [["fused nodes, all", c["fused"]],
                             ["keep their model-local functions (no kernel in the library)", c["functions"]],
                             ["run the library's CPU kernels", c["cpu"]]]
    if lib.get("cuda") or lib.get("emulated"):
        emu = " (emulated on the CPU)" if lib.get("emulated") else ""
        rows += [[f"with device kernels on {a}{emu}", c["device"]] for a in c["archs"]] or [
            ["with device kernels", 0]]
        rows.append(["bound, but without a device kernel", c["no_device"]])
    lines += _table(["where the fused nodes run", "nodes"], rows)
    if lib.get("skipped"):
        lines += ["", "Why nodes keep their functions:", "", *_reasons(lib["skipped"])]
    if lib.get("kernel_skips"):
        lines += ["", "Why bound nodes have no device kernel:", "", *_reasons(lib["kernel_skips"])]
    kernels = lib.get("kernels") or []
    if kernels:
        lines += ["", "### Kernels (ptxas resources)", ""]
        rows = []
        for k in kernels:
            ks = k.get("kernels") or []
            cfg = ", ".join(f"{a}={b}" for a, b in (k.get("config") or {}).items())
            rows.append([f"`{k['instance']}`", k["arch"], cfg,
                         max((x["registers"] for x in ks), default="-"),
                         max((x["static_smem_bytes"] for x in ks), default="-"), k.get("dynamic_smem_bytes", "-"),
                         sum(x["spill_store_bytes"] + x["spill_load_bytes"] for x in ks),
                         max((x["stack_frame_bytes"] for x in ks), default="-")])
        lines += _table(["instance", "arch", "config", "registers", "static smem B", "dynamic smem B",
                         "spill B (store + load)", "stack frame B"], rows, "lllrrrrr")
    if lib.get("dispatch"):
        sizes = {n: sum(len(rows) for rows in per.values()) for n, per in lib["dispatch"].items()}
        lines += ["", f"{len(sizes)} dynamic nodes dispatch over tables of {min(sizes.values())}-"
                  f"{max(sizes.values())} entries (all archs)."]
    return lines


def _tuning(r: dict[str, Any]) -> list[str]:
    t = r.get("tuning")
    if not t:
        return []
    if t.get("measurer") is None:  # no storage: the shipped records alone
        lines = ["", "## Tuning", "",
                 f"No tuning storage: the kernels for {t.get('arch')} take the shipped tuning records' configurations "
                 f"where a record covers their task ({t.get('records')})."]
    else:
        lines = ["", "## Tuning", "",
                 f"Measurer **{t.get('measurer')}** on {t.get('device')} for {t.get('arch')}: up to "
                 f"{t.get('trials_per_task')} trials per task, {t.get('measured', 0)} measured in this run, "
                 f"{t.get('tasks_found', 0)} of {len(t.get('tasks') or [])} tasks with a best configuration"
                 + (f"; their kernels take {_us(t['kernel_time_us'])} µs (weighted)." if t.get("kernel_time_us")
                    is not None else ".")]
    if t.get("replanned"):
        lines.append("The model was planned again with the measured kernel times.")
    tasks = t.get("tasks") or []
    if tasks:
        rows = [[x.get("describe", x.get("task")), x.get("weight", "-"), x.get("trials", "-"), _us(x.get("first_us")),
                 _us(x.get("best_us")), speedup(x["speedup_over_first"]) if x.get("speedup_over_first") else "-",
                 x.get("source", "-")] for x in tasks]
        lines += ["", *_table(["task", "weight", "trials", "first µs", "best µs", "gain", "configuration from"], rows,
                              "lrrrrrl")]
    unused = [[x.get("describe", x.get("task")), x["record_unused"]] for x in tasks if x.get("record_unused")]
    if unused:
        lines += ["", "Shipped tuning records not used:", "", *_table(["task", "why"], unused, "ll")]
    for family in ALL_FAMILIES.values():
        lines += _implementations_table(family, tasks) + _summary_table(family, tasks)
    if t.get("untuned"):
        lines += ["", "Fused nodes without a tuning task:", "", *_reasons(t["untuned"])]
    return lines


def _pass_table(graph_pass: GraphPass, decisions: list[dict[str, Any]]) -> list[str]:
    """A planner pass's decisions as its table (GraphPass.title, columns; a key ending in "_us" is a time)."""
    if not decisions or not graph_pass.columns:
        return []
    keys = [k for _, k in graph_pass.columns]
    rows = [[_us(d.get(k)) if k.endswith("_us") else d.get(k, "-") for k in keys] for d in decisions]
    return ["", f"{graph_pass.title}:", "",
            *_table([h for h, _ in graph_pass.columns], rows, "".join("r" if k.endswith("_us") else "l" for k in keys))]


def _times_kind(entries: list[dict[str, Any]], proxies: str = "") -> str:
    if entries[0].get("timing") == "analytical":
        return f"predicted by the estimate (no GPU measured them here{proxies})"
    return "measured on the GPU"


def _implementations_table(family: KernelFamily, tasks: list[dict[str, Any]]) -> list[str]:
    """The tasks of a family with library implementations (KernelFamily.implementations: the GEMM's, whose every
    entry says whether each was offered): the winner, its configuration and time, each library's best time."""
    impls = family.implementations
    entries = [x for x in tasks if impls and all(i.name in x for i in impls)]
    if not entries:
        return []
    proxies = "".join(f"; its {i.label or i.name} prices rest on {i.proxy} as a proxy until a record measures ours"
                      for i in impls if i.proxy)
    rows = [[", ".join(x.get("nodes") or []) or x.get("task"), x.get("impl") or "-", _config(x.get("best_config")),
             _us(x.get("best_us")), *(_candidate(x, i.name) for i in impls)] for x in entries]
    return ["", f"{family.title or family.name} implementations, times {_times_kind(entries, proxies)}:", "",
            *_table(["nodes", "implementation", "configuration", "best µs",
                     *(f"{i.label or i.name} µs" for i in impls)], rows)]


def _summary_table(family: KernelFamily, tasks: list[dict[str, Any]]) -> list[str]:
    """The tasks of a family that says more of them (KernelFamily.task_summary, task_columns: the conv's shape and
    winning kernel), with their configuration and time."""
    cols = family.task_columns
    entries = [x for x in tasks if cols and all(key in x for _, key, _ in cols) and not family.implementations]
    if not entries:
        return []
    rows = [[", ".join(x.get("nodes") or []) or x.get("task"),
             *(names.get(x[key], "-") if names else x[key] for _, key, names in cols),
             _config(x.get("best_config")), _us(x.get("best_us"))] for x in entries]
    return ["", f"{family.title or family.name} kernels, times {_times_kind(entries)}:", "",
            *_table(["nodes", *(h for h, _, _ in cols), "configuration", "best µs"], rows, "l" * (len(cols) + 2) + "r")]


def _config(config: dict[str, Any] | None) -> str:
    """A configuration as `KEY=value` pairs, less its "impl" (its own column)."""
    return " ".join(f"{k}={v}" for k, v in (config or {}).items() if k != "impl") or "-"


def _candidate(entry: dict[str, Any], impl: str) -> str:
    """A library implementation's best time in a GEMM task's entry, "-" where offered but no trial succeeded, or
    why it was not offered."""
    if entry.get(f"{impl}_us") is not None:
        return _us(entry[f"{impl}_us"])
    why = entry.get(impl)
    return "-" if why in (None, "offered") else f"not offered: {why}"


def _dynamic(r: dict[str, Any]) -> list[str]:
    d = r.get("dynamic")
    if not d:
        return []
    lines = ["", "## Dynamic shapes", ""]
    lines += _table(["dim", "lo", "hi", "from"], [[x["dim"], x["lo"], x["hi"], x["source"]] for x in d["dims"]],
                    "lrrl")
    t = d.get("tuning")
    if t:
        sizes = t.get("table_sizes") or []
        err = t.get("max_prediction_error")
        lines += ["", f"Shape-generic tuning: measurer **{t.get('measurer')}** on {t.get('device')} for "
                  f"{t.get('arch')}, {t.get('trials', 0)} micro-kernel trials, {len(sizes)} dispatch tables"
                  + (f" of {min(sizes)}-{max(sizes)} entries" if sizes else "")
                  + (f"; predictions within {100 * err:.1f}% of the measurements." if err is not None else ".")]
        tasks = t.get("tasks") or []
        if tasks:
            rows = [[x.get("describe", x.get("task")), "{}-{}".format(*x["range"]) if x.get("range") else "-",
                     x.get("trials", "-"), sum(len(v) for v in (x.get("tables") or {}).values()),
                     f"{100 * x['max_error']:.1f}%" if x.get("max_error") is not None else "-"] for x in tasks]
            lines += ["", *_table(["task", "extent range", "trials", "table entries", "max error"], rows)]
    else:
        lines += ["", "Dispatch tables: the library's defaults (not tuned)."]
    return lines


def _measured(r: dict[str, Any]) -> list[str]:
    gs = [g for g in r["groups"] if g.get("measured_us") is not None]
    if not gs:
        return []
    lines = ["", "## Predicted vs measured, per group", ""]
    lines += _table(["group", "family", "predicted µs", "measured µs", "measured / predicted"],
                    [[f"`{g['name']}`", g["family"], _us(g["predicted_us"]), _us(g["measured_us"]),
                      f"{g['measured_us'] / g['predicted_us']:.2f}" if g["predicted_us"] else "-"] for g in gs])
    return lines


def render(report: dict[str, Any]) -> str:
    """The report as GitHub Markdown."""
    check_report(report)
    lines = [*_header(report), *_families(report), *_unfused(report), *_fp8(report), *_device(report),
             *_library(report), *_tuning(report), *_dynamic(report), *_measured(report)]
    out: list[str] = []
    for line in lines:  # no runs of blank lines
        if line == "" and out and out[-1] == "":
            continue
        out.append(line)
    return "\n".join(out).strip() + "\n"


def write_markdown(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    return write_text_atomic(render(report), path)


# -------------------------------------------------------------------------------------------------------------- PNG


def png_bytes(report: dict[str, Any]) -> bytes:
    """A horizontal bar chart of the time per family, before (unfused) and after (fused): predicted, or measured
    for the families whose groups all have measured times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_report(report)
    rows = family_rows(report)[::-1]  # heaviest at the top
    after = [f["measured_us"] if f["groups"] and f["measured_groups"] == f["groups"] else f["after_us"] for f in rows]
    names = [f["family"] + (" (measured)" if f["groups"] and f["measured_groups"] == f["groups"] else "")
             for f in rows]
    fig, ax = plt.subplots(figsize=(8.0, 1.6 + 0.45 * max(len(rows), 1)))
    try:
        y = list(range(len(rows)))
        h = 0.4
        ax.barh([i + h / 2 for i in y], [f["before_us"] for f in rows], height=h, color="tab:gray",
                label=f"before, unfused: {report['predicted_us_before']:.1f} µs predicted")
        ax.barh([i - h / 2 for i in y], after, height=h, color="tab:green",
                label=f"after, fused: {sum(after):.1f} µs" + (" (measured where present)" if has_measured(report)
                                                             else " predicted"))
        ax.set_yticks(y, names)
        ax.set_xlabel("time per inference, µs" + (" (predicted; measured where marked)" if has_measured(report)
                                                  else " (estimate, predicted)"))
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"{report['model']}: time per family on {report['target']}, {report['precision']}", fontsize=10)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
    finally:
        plt.close(fig)
    return buf.getvalue()


def write_png(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """The chart, rendered in memory first and then written atomically (nothing is left on an error)."""
    return write_bytes_atomic(png_bytes(report), path)
