"""The honest record of a run: what was fused, what was rejected and why, predicted cost before and after."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from onnx_gtco.calibration import Hardware, LaunchConstants, hardware
from onnx_gtco.config import GtcoConfig
from onnx_gtco.cost.model import cost_fn, estimate, launches, node_flops, unfused_cost
from onnx_gtco.ir.labels import Label, label
from onnx_gtco.ir.view import GraphView
from onnx_gtco.opspec import SPECS
from onnx_gtco.plan.types import Candidate, Plan, Reject

if TYPE_CHECKING:
    from onnx_gtco.plugin.coverage import Coverage, ModelCoverage

_RANK = [Label.OPAQUE, Label.ELEMENTWISE, Label.INJECTIVE, Label.REDUCTION, Label.COMPLEX]


def group_label(view: GraphView, cand: Candidate) -> str:
    """The label of a group: its strongest member (complex-out-fusable > reduction > ... ; opaque if alone)."""
    labels = {label(view.nodes[i].op_type, view.nodes[i].domain) for i in cand.nodes}
    for lab in reversed(_RANK):
        if lab in labels and lab is not Label.OPAQUE:
            return lab.value
    return Label.OPAQUE.value


def _flops(view: GraphView, ids: frozenset[int]) -> float:
    return sum(sum(node_flops(view, view.nodes[i])) for i in ids)


def build_report(
    view: GraphView,
    plan: Plan,
    node_names: list[str],
    candidates: list[Candidate],
    rejects: list[Reject],
    cost: Any,
    config: GtcoConfig,
    nodes_after: int,
    source: str,
    device: ModelCoverage | None = None,
    original: GraphView | None = None,
    coverage: Callable[[Candidate], Coverage] | None = None,
) -> dict[str, Any]:
    """Report as a JSON-ready dict. Deterministic: no timestamps or timings (the caller adds those apart).

    `device`: which fused nodes have device kernels (plugin.coverage.model_coverage of the rewritten model): each
    group gets `device_kernels` (the arch slots it has one for) and `device_reason` (why it has none), and the
    report a `device` entry (device_summary). A group without a device kernel on the config's target runs its
    function: its predicted time, and its share of the predicted time after fusion, are its nodes' unfused cost.
    `original`: the model before any rewrite of the planner's own (the QKV packing, families/gemm/pack.py), whose node
    count `launches` gives beside ours; default `view`. `coverage`: the planner's answer per candidate (the
    instance the target's slot would run, plugin.coverage.candidate_coverage): each group with a kernel gets
    `kernel`, its instance, configuration and estimated time per launch.

    Every predicted time is the one estimate the DP planned with (cost.model.cost_fn over the kernels' estimates),
    with the target's calibration (`estimate`: which GPU's fitted constants, or that none applies)."""
    groups, kernelless = _group_entries(view, plan, node_names, candidates, cost, config, device, coverage)
    not_chosen = _not_chosen(view, plan, node_names, candidates)
    fused_ids = set().union(*(g.nodes for g in plan.fused_groups)) if plan.fused_groups else set()
    unfused_ops = _count(n.op_type for n in view.nodes if n.id not in fused_ids)
    total_flops = _flops(view, frozenset(range(len(view))))
    fused_flops = sum(g["flops"] for g in groups)
    matched = frozenset().union(*(c.nodes for c in candidates)) if candidates else frozenset()
    node_us = [cost(Candidate(frozenset([i]), "unfused", "single")) for i in range(len(view))]
    planned_before = before = sum(node_us)
    if original is not None and original is not view:  # the model as given, before the planner's QKV packing
        cost_orig = cost_fn(original, config)
        before = sum(cost_orig(Candidate(frozenset([i]), "unfused", "single")) for i in range(len(original)))
    unfused_nodes_us = sum(us for i, us in enumerate(node_us) if i not in fused_ids)
    after = plan.cost_us
    if device is not None and len(plan.costs) == len(plan.groups):
        # what the DP charged each group, except a fused one without a device kernel on the target: its nodes, unfused
        after = sum(kernelless.get(g, c) for g, c in zip(plan.groups, plan.costs, strict=True))
    hw = hardware(config.target)
    out = {
        "model": source,
        "target": config.target,
        "gpu": config.hw.gpu,
        "estimate": hw.describe(),
        "precision": config.precision,
        "nodes_before": len(original or view),
        "nodes_after": nodes_after,
        "groups_fused": len(groups),
        "flops_total": total_flops,
        "flops_fused": fused_flops,
        "fused_flop_share": round(fused_flops / total_flops, 6) if total_flops else 0.0,
        # the FLOPs some rule offered to fuse (the DP leaves a group to ONNX Runtime where that is predicted faster)
        "matched_flop_share": round(_flops(view, matched) / total_flops, 6) if total_flops else 0.0,
        "predicted_us_before": round(before, 3),
        "predicted_us_after": round(after, 3),
        "predicted_speedup": round(before / after, 4) if after else None,
        "unfused_nodes_us": round(unfused_nodes_us, 3),
        **({"predicted_us_before_planned": round(planned_before, 3)} if abs(planned_before - before) > 1e-6
           else {}),
        **({"nodes_planned": len(view)} if original is not None and len(original) != len(view) else {}),
        "measured_us_before": None,
        "measured_us_after": None,
        "dp_states": plan.states,
        "candidates": len(candidates),
        "families": _count(g["family"] for g in groups),
        "unfused_ops": unfused_ops,
        "groups": groups,
        "rejected": [{"pattern": r.pattern, "anchor": r.anchor, "reason": r.reason} for r in rejects],
        "not_chosen": not_chosen,
        **({"device": device_summary(groups, device)} if device is not None else {}),
        "launches": launch_counts(view, plan, kernelless, original or view),
    }
    out.update(_pdl_entries(out["launches"]["after_ours"], after, config, hw))
    return out


def _group_entries(view: GraphView, plan: Plan, node_names: list[str], candidates: list[Candidate], cost: Any,
                   config: GtcoConfig, device: ModelCoverage | None,
                   coverage: Callable[[Candidate], Coverage] | None) -> tuple[list[dict[str, Any]],
                                                                              dict[Candidate, float]]:
    """The report's entry of each fused group, and the fused groups with no device kernel on the target (their
    unfused cost)."""
    groups = []
    kernelless: dict[Candidate, float] = {}  # fused groups with no device kernel on the target: their unfused cost
    for cand, name in zip(plan.fused_groups, node_names, strict=True):
        unfused = unfused_cost(cost, cand)
        est = estimate(view, cand)
        kernels = device.nodes.get(name) if device is not None and device.error is None else None
        if kernels is not None and not kernels.on(config.arch):
            kernelless[cand] = unfused
        chosen = coverage(cand) if coverage is not None and cand not in kernelless else None
        groups.append({
            "name": name,
            "family": cand.family,
            "pattern": cand.pattern,
            "label": group_label(view, cand),
            "nodes": [view.nodes[i].name for i in sorted(cand.nodes)],
            "ops": [view.nodes[i].op_type for i in sorted(cand.nodes)],
            "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in cand.attrs},
            "flops": _flops(view, cand.nodes),
            "dram_bytes": est.dram_bytes,
            "predicted_us": round(kernelless.get(cand, cost(cand)), 4),
            "predicted_unfused_us": round(unfused, 4),
            **_pair(cand, candidates, cost),
            **({"device_kernels": list(kernels.archs), "device_reason": kernels.reason} if kernels is not None
               else {}),
            **({"kernel": {"instance": chosen.kernel[0], "config": chosen.kernel[1],
                           "estimate_us": round(chosen.us, 4)}}
               if chosen is not None and chosen.kernel is not None and chosen.us is not None else {}),
        })
    return groups, kernelless


def _not_chosen(view: GraphView, plan: Plan, node_names: list[str], candidates: list[Candidate]
                ) -> list[dict[str, Any]]:
    """Each candidate the DP did not choose, and the groups that cover its nodes instead."""
    chosen = {g.nodes for g in plan.fused_groups}
    owner = {i: name for g, name in zip(plan.fused_groups, node_names, strict=True) for i in g.nodes}
    not_chosen = []
    for c in candidates:
        if c.nodes in chosen:
            continue
        by = sorted({owner.get(i, "unfused") for i in c.nodes})
        not_chosen.append({
            "pattern": c.pattern, "family": c.family, "anchor": view.nodes[min(c.nodes)].name,
            "nodes": len(c.nodes),
            "reason": "the DP found a cheaper cover: " + ", ".join(by),
        })
    return not_chosen


def _pdl_entries(dependent: int, after: float, config: GtcoConfig, hw: Hardware) -> dict[str, Any]:
    """On sm_90 and later, the predicted time with programmatic dependent launch, and what it assumes."""
    out: dict[str, Any] = {}
    launch = hw.constants(LaunchConstants)
    if int(config.arch[3:]) >= 90 and launch.pdl_overlap_us > 0 and dependent:
        fitted = set(hw.calibration.fitted.get("fitted", ()) if hw.calibration is not None else ())
        out["predicted_us_after_pdl"] = round(after - dependent * min(launch.pdl_overlap_us, launch.graph_gap_us), 3)
        out["assumptions"] = {
            "graph_gap_us": launch.graph_gap_us, "pdl_overlap_us": launch.pdl_overlap_us,
            "measured": sorted(k for k in ("launch.graph_gap_us", "launch.pdl_overlap_us") if k in fitted),
            "note": ("graph_gap_us is a launch's gap inside a CUDA graph (fitted to whole-model times where the "
                     "target has a calibration); pdl_overlap_us, what a programmatic dependent launch hides of it, "
                     "is an assumption until a GPU run measures it (the GPU suite's calibration row)")}
    return out


def _parts(cand: Candidate) -> tuple[str, ...] | None:
    spec = SPECS.get(cand.family)
    return None if spec is None or spec.parts is None else spec.parts(dict(cand.attrs))


def _pair(cand: Candidate, candidates: list[Candidate], cost: Any) -> dict[str, Any]:
    """For a composite group (OpSpec.parts: a GEMM with the LayerNorm over its rows), what the DP chose it over: its
    two parts as two kernels, and their cost (`instead_of`); {} for other groups."""
    parts = _parts(cand) if cand.fused else None
    if not parts or len(parts) != 2:
        return {}
    first, second = parts
    heads = [c for c in candidates if c.family == first and not _parts(c) and c.nodes < cand.nodes]
    tails = {c.nodes: c for c in candidates if c.family == second and c.nodes < cand.nodes}
    pairs = [(g, tails[cand.nodes - g.nodes]) for g in heads if cand.nodes - g.nodes in tails]
    if not pairs:
        return {}
    best = min(pairs, key=lambda p: cost(p[0]) + cost(p[1]))
    return {"instead_of": {"groups": list(parts), "predicted_us": round(cost(best[0]) + cost(best[1]), 4)}}


def per_layer(family: str) -> bool:
    """Whether a transformer layer holds one node of `family` (OpSpec.per_layer: attention)."""
    spec = SPECS.get(family)
    return spec is not None and spec.per_layer


def _runs(view: GraphView, cand: Candidate) -> bool:
    """Whether an unfused node launches a kernel (not a view op or host-side shape arithmetic)."""
    return estimate(view, cand).launches > 0


def launch_counts(view: GraphView, plan: Plan, kernelless: Collection[Candidate], original: GraphView
                  ) -> dict[str, Any]:
    """Kernel launches of one forward: ours (a fused node with a device kernel: its launches; one without: its
    nodes', as its function runs them; an unfused node that runs: one) beside the original's node count and its
    nodes that launch; and per repeated block (the span between two occurrences of the attention group, one per
    transformer layer, or else of the most repeated fused group), the same counts divided by the blocks it spans."""

    def ours(g: Candidate) -> int:
        if not g.fused:
            return 1 if _runs(view, g) else 0
        if g in kernelless:
            return sum(_runs(view, Candidate(frozenset([i]), "unfused", "single")) for i in g.nodes)
        return launches(g)

    per_group = [ours(g) for g in plan.groups]

    # launches of ours whose every input computed at run time comes from a kernel of ours (programmatic
    # dependent launch applies to them: plugin's node table `pdl`)
    producer = {t: k for k, g in enumerate(plan.groups) for i in g.nodes for t in view.nodes[i].outputs}
    after_ours = 0
    for k, g in enumerate(plan.groups):
        if not g.fused or g in kernelless or not per_group[k]:
            continue
        srcs = [producer.get(t) for t in view.external_inputs(g.nodes) if not view.is_constant(t)]
        if srcs and all(j is not None and plan.groups[j].fused and plan.groups[j] not in kernelless for j in srcs):
            after_ours += per_group[k]

    def runs_orig(i: int) -> bool:
        return _runs(original, Candidate(frozenset([i]), "unfused", "single"))

    out: dict[str, Any] = {"ours": sum(per_group), "after_ours": after_ours, "original_nodes": len(original),
                           "original_launching_nodes": sum(runs_orig(i) for i in range(len(original)))}
    keys = [(g.family, g.attrs) if g.fused else None for g in plan.groups]
    counts: dict[Any, int] = {}
    for k in keys:
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    repeated = [k for k in dict.fromkeys(keys) if k is not None and counts[k] >= 2]
    if not repeated:
        return out
    key = max(repeated, key=lambda k: (per_layer(k[0]), counts[k]))  # one attention per transformer layer
    at = [i for i, k in enumerate(keys) if k == key]
    blocks = len(at) - 1
    # the original's span: from the last node of the first occurrence to that of the last, by name
    index = {n.name: n.id for n in original.nodes}
    ends = [index.get(view.nodes[max(plan.groups[i].nodes)].name) for i in (at[0], at[-1])]
    block: dict[str, Any] = {"anchor": key[0], "blocks": blocks,
                             "ours": round(sum(per_group[at[0]:at[-1]]) / blocks, 2)}
    if ends[0] is not None and ends[1] is not None:
        span = range(ends[0], ends[1])
        block["original_nodes"] = round(len(span) / blocks, 2)
        block["original_launching_nodes"] = round(sum(runs_orig(i) for i in span) / blocks, 2)
    out["per_block"] = block
    return out


def device_summary(groups: list[dict[str, Any]], device: ModelCoverage) -> dict[str, Any]:
    """The report's `device` entry: per arch slot, how many fused nodes have device kernels, and the nodes without
    one grouped by family and reason (most nodes first); `error` instead when the nodes could not be read."""
    out: dict[str, Any] = {
        "decided_by": "the plugin's binders and kernel selection, without compiling: what a CUDA build registers",
        "arch_slots": list(device.archs),
        "fused_nodes": len(groups),
    }
    if device.error is not None:
        return {**out, "error": device.error}
    without: dict[tuple[str, str], int] = {}
    for g in groups:
        if g.get("device_reason") is not None:
            key = (g["family"], g["device_reason"])
            without[key] = without.get(key, 0) + 1
    return {**out, "with_kernels": {a: sum(a in g.get("device_kernels", ()) for g in groups) for a in device.archs},
            "without": [{"family": f, "reason": why, "nodes": n}
                        for (f, why), n in sorted(without.items(), key=lambda kv: (-kv[1], kv[0]))]}


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1, sort_keys=False) + "\n"


def _top(counts: dict[str, int], k: int = 6) -> str:
    """`Reshape x40, Transpose x12, ...` of the k most frequent op types; "nothing" when empty."""
    if not counts:
        return "nothing"
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    more = f", {len(ranked) - k} more op types" if len(ranked) > k else ""
    return f"{sum(counts.values())} nodes: " + ", ".join(f"{op} x{n}" for op, n in ranked[:k]) + more


def speedup(x: float | None) -> str:
    """`3.7x`, `1.04x`, `15.3x`: a ratio with the digits that mean something; "n/a" without one."""
    if x is None:
        return "n/a"
    return f"{x:.1f}x" if x >= 2 else f"{x:.2f}x"


def _time_line(report: dict[str, Any]) -> str:
    """The summary's time line, saying which times are the cost model's predictions and which are measured: a plan
    costed with measured kernel times (report["plan_costs"]) mixes both after fusion."""
    before, after = report["predicted_us_before"], report["predicted_us_after"]
    measured = [g for g in report["groups"] if g.get("measured_us") is not None]
    if report.get("measured_us_before") is not None and report.get("measured_us_after") is not None:
        mb, ma = report["measured_us_before"], report["measured_us_after"]
        return f"measured   {mb:.1f} us -> {ma:.1f} us ({speedup(mb / ma if ma else None)} measured)"
    if "plan_costs" in report and measured:
        ratio = before / after if after else None
        return (f"planned    {before:.1f} us predicted -> {after:.1f} us with the measured kernel times of "
                f"{len(measured)} of {len(report['groups'])} groups, the rest predicted ({speedup(ratio)}, "
                "partly measured)")
    return (f"predicted  {before:.1f} us -> {after:.1f} us ({speedup(report['predicted_speedup'])} predicted by "
            f"{estimate_words(report)}, not measured)")


def estimate_words(report: dict[str, Any]) -> str:
    """What the report's predicted times come from: "the estimate fitted to NVIDIA H200 kernels" or "the estimate's
    defaults (no calibration of sm_90)"."""
    est = report.get("estimate") or {}
    cal = est.get("calibration")
    if cal:
        return f"the estimate fitted to {cal['gpu']}'s measured kernels"
    return f"the estimate's defaults (no calibration of {est.get('target', report.get('target'))})"


def estimate_line(report: dict[str, Any]) -> str | None:
    """The summary's line on the estimate's constants: the calibration that applies (its file, date, rows, the
    proxies it holds) or that none does."""
    est = report.get("estimate")
    if not est:
        return None
    cal = est.get("calibration")
    if not cal:
        return f"estimate   {est['note']}"
    err = (cal.get("error") or {}).get("gtco", {})
    fit = f", our kernels within {100 * (err['worst'] - 1):.0f}%" if err.get("worst") else ""
    proxy = "; proxies: " + "; ".join(est["proxies"]) if est.get("proxies") else ""
    return (f"estimate   fitted to {cal['gpu']} ({cal['file']}, {cal.get('date', 'undated')}: "
            f"{cal.get('kernel_rows', '?')} kernel and {cal.get('model_rows', '?')} model records{fit}){proxy}")


def launch_lines(report: dict[str, Any]) -> list[str]:
    """`launches  64 per forward (the original: 616 nodes, 567 of them launch); per layer 5.0 (the original: 50
    nodes)` and, where the target has programmatic dependent launch, the predicted time with it."""
    la = report.get("launches")
    if not la:
        return []
    line = (f"launches   {la['ours']} per forward (the original: {la['original_nodes']} nodes, "
            f"{la['original_launching_nodes']} of them launch)")
    blk = la.get("per_block")
    if blk:
        what = "layer" if per_layer(blk["anchor"]) else f"repeated block ({blk['anchor']})"
        line += f"; per {what} {blk['ours']:g}"
        if "original_nodes" in blk:
            line += f" (the original: {blk['original_nodes']:g} nodes)"
    out = [line]
    if report.get("predicted_us_after_pdl") is not None:
        a = report["assumptions"]
        out.append(f"with PDL   {report['predicted_us_after_pdl']:.1f} us predicted: {la['after_ours']} launches "
                   f"follow one of ours, each assumed to hide {a['pdl_overlap_us']:g} us of its "
                   f"{a['graph_gap_us']:.2f} us graph gap")
    return out


def summary(report: dict[str, Any]) -> str:
    """A short human-readable summary (the CLI prints this)."""
    fam = ", ".join(f"{k} x{v}" for k, v in report["families"].items()) or "none"
    lines = [
        f"model      {report['model']}",
        f"target     {report['target']} ({report['gpu']}), precision {report['precision']}",
        *([line] if (line := estimate_line(report)) else []),
        f"nodes      {report['nodes_before']} -> {report['nodes_after']}  "
        f"({report['groups_fused']} fused groups: {fam})",
        f"FLOPs      {report['flops_total'] / 1e9:.3f} G total, "
        f"{100 * report['fused_flop_share']:.1f}% inside fused groups",
        _time_line(report),
        *launch_lines(report),
        f"unfused    {_top(report['unfused_ops'])}",
        f"rejected   {len(report['rejected'])} matches by rule checks, {len(report['not_chosen'])} legal candidates "
        "not chosen by the DP",
    ]
    conv = report.get("conversion")
    if conv:
        lines.append(conversion_line(conv))
    if report.get("fp8"):
        lines.append(fp8_line(report["fp8"]))
    if report.get("device"):
        lines += device_lines(report["device"], (report.get("estimate") or {}).get("arch", report["target"]))
    dyn = report.get("dynamic")
    if dyn:
        lines.append("dynamic    " + dynamic_line(dyn, report.get("library")))
    lib = report.get("library")
    if lib:
        kinds = "CPU + CUDA objects" if lib["cuda"] else "CPU kernels only"
        lines.append(f"library    {lib['file']} ({kinds}): registers {', '.join(lib['op_types']) or 'no op type'}; "
                     f"{len(lib['skipped'])} fused nodes keep their functions (reasons in the report)")
        if lib.get("kernels"):
            regs = max(k["registers"] for c in lib["kernels"] for k in c["kernels"])
            archs = ", ".join(sorted({c["arch"] for c in lib["kernels"]}))
            rejected = lib.get("rejected") or {}
            lines.append(f"kernels    {len(lib['kernels'])} instances for {archs}, 0 spills, at most {regs} registers "
                         "(ptxas report: library.kernels)"
                         + (f"; {len(rejected)} configurations that spill or need a stack frame passed over for the "
                            "family's next (library.rejected)" if rejected else ""))
        moved = lib.get("function_only") or {}
        if moved:
            types = sorted(set(moved.values()))
            lines.append(f"functions  {len(moved)} fused nodes without a kernel of their own run their functions as "
                         f"{', '.join(types)}, their siblings keep their kernels (library.function_only)")
    return "\n".join(lines)


def conversion_line(conv: dict[str, Any]) -> str:
    """The summary's line on the half-precision conversion (onnx_gtco.precision): what reads and writes half
    tensors now, the casts added, the graph outputs fused nodes write in fp32 themselves, and the op types kept in
    fp32."""
    kept = ", ".join(f"{k['op_type']} x{k['count']}" for k in conv["kept_fp32"])
    folded = conv.get("outputs_folded", 0)
    return (f"converted  {conv['precision']}: {conv['fused_nodes']} fused and {conv['converted_nodes']} other nodes on "
            f"half tensors, {conv['casts_added']} casts added"
            + (f", {folded} graph output(s) written in fp32 by their fused node" if folded else "")
            + (f"; fp32 kept: {kept} (reasons in the report)" if kept else ""))


def fp8_line(fp8: dict[str, Any], most: int = 3) -> str:
    """The summary's line on fp8 (onnx_gtco.fp8): the GEMMs on E4M3 operands, their errors, and those kept fp16
    with why (the first `most`; all in the report)."""
    errors = [g["error"] for g in fp8["gemms"] if g["fp8"]]
    spread = f" (relative error {min(errors):.2g}-{max(errors):.2g})" if errors else ""
    kept = [g for g in fp8["gemms"] if not g["fp8"]]
    why = "; ".join(f"{g['node']}: {g.get('why', '')}" for g in kept[:most]) + ("; ..." if len(kept) > most else "")
    return (f"fp8        {fp8['gemms_fp8']} of {len(fp8['gemms'])} GEMMs on E4M3 operands{spread}, budget "
            f"{fp8['budget']:g}, {fp8['samples']} calibration samples"
            + (f"; {len(kept)} kept fp16: {why}" if kept else ""))


def device_lines(device: dict[str, Any], target: str = "", most: int = 4) -> list[str]:
    """The summary's lines on device kernels: one per arch slot ("sm_90: 25 of 87 fused nodes have device
    kernels", the `target`'s saying that the others count unfused in the predicted time), then the families whose
    nodes keep their functions with the reason, at most `most` lines."""
    if device.get("error"):
        return [f"device     which fused nodes have device kernels is unknown: {device['error']}"]
    fused = device["fused_nodes"]
    lines = []
    for i, (arch, n) in enumerate(device["with_kernels"].items()):
        note = (f" (the target: the other {fused - n} count at their unfused cost in the predicted time)"
                if arch == target and n < fused else "")
        lines.append(f"{'device' if i == 0 else '':<10} {arch}: {n} of {fused} fused nodes have device kernels{note}")
    without = device.get("without") or []
    for i, w in enumerate(without[:most]):
        lines.append(f"{'functions' if i == 0 else '':<10} {w['family']} x{w['nodes']} keep their functions: "
                     f"{w['reason']}")
    if len(without) > most:
        rest = sum(w["nodes"] for w in without[most:])
        lines.append(f"{'':<10} {rest} more fused nodes keep their functions for {len(without) - most} other "
                     "reasons (the report's device.without)")
    return lines


def dynamic_line(dyn: dict[str, Any], library: dict[str, Any] | None = None) -> str:
    """The summary's line on dynamic shapes: the ranges and where they came from, and the dispatch tables' sizes
    (the shape-generic tuner's, else the library's defaults) with the largest prediction error measured."""
    ranges = ", ".join(f"{d['dim']}={d['lo']}:{d['hi']} ({d['source']})" for d in dyn["dims"])
    tuning = dyn.get("tuning")
    sizes = tuning["table_sizes"] if tuning else []
    if sizes:
        tables = (f"{len(sizes)} tuned dispatch tables of {min(sizes)}-{max(sizes)} entries from {tuning['trials']} "
                  "micro-kernel trials")
        if tuning.get("max_prediction_error") is not None:
            tables += (f", predictions within {100 * tuning['max_prediction_error']:.1f}% of the "
                       f"{tuning['measurer']} measurer")
    elif library and library.get("dispatch"):
        sizes = [len(rows) for per in library["dispatch"].values() for rows in per.values()]
        tables = f"{len(library['dispatch'])} nodes with default dispatch tables of {min(sizes)}-{max(sizes)} entries"
    else:
        tables = "dispatch tables: the library's defaults (untuned)"
    return f"{ranges}; {tables}"
