"""optimize(): load -> label/match -> plan -> rewrite -> validate. The only module that knows the order.

A run loads its model once (load); with tuning that measures real kernels it plans the same loaded model again
with the measured times (replan), and tuning takes the fused nodes' shapes and the dynamic ranges from the plan."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from onnx_gtco import patterns as patterns_mod
from onnx_gtco import progress
from onnx_gtco import report as report_mod
from onnx_gtco.calibration import hardware
from onnx_gtco.config import DYNAMIC_METADATA_KEY, GtcoConfig, Ranges, resolve_ranges
from onnx_gtco.cost.model import cost_fn
from onnx_gtco.errors import OpsetNotConvertedError, OutputError
from onnx_gtco.fp8 import FP8_OPSET, quantize, read_calibration
from onnx_gtco.ir.export import remove_saved, save_atomic, validate, writable_parent, write_text_atomic
from onnx_gtco.ir.load import MIN_OPSET, load_model
from onnx_gtco.ir.view import GraphView
from onnx_gtco.plan import candidates as cands_mod
from onnx_gtco.plan.dp import plan as dp_plan
from onnx_gtco.plan.types import Candidate, Plan, Reject
from onnx_gtco.plugin.passes import graph_passes
from onnx_gtco.precision import HALF_TYPES, Conversion, convert
from onnx_gtco.rewrite import rewrite

__version__ = "0.1.0"


@dataclass(frozen=True)
class LoadedModel:
    """A model as a run loaded it, once (load_model: read, check, opset conversion, constant folding, shape
    inference), with what the run reads from it before planning. Every plan of the run starts from it.

    Attributes:
        model: load_model's model (never modified afterwards).
        source: the model's name in the report: the file's name, or the graph's of a ModelProto.
        ranges: the ranges of its symbolic dims that apply (config.resolve_ranges; empty for a static model).
        unfused: why no rule may run on it ("" when they may; see plan_model).
        seconds: how long loading took.
    """

    model: onnx.ModelProto = field(repr=False)
    source: str
    ranges: Ranges
    unfused: str = ""
    seconds: float = 0.0


@dataclass
class OptimizeResult:
    """What optimize() produced.

    Attributes:
        model: the rewritten model (fused nodes in domain ai.gtco, each with a model-local function).
        plan: the DP's plan over the loaded model's nodes.
        report: JSON-ready dict (see report.build_report); deterministic for the same input and config.
        timings: seconds per stage (kept out of the report so the report stays byte-identical).
    """

    model: onnx.ModelProto
    plan: Plan
    report: dict[str, Any]
    view: GraphView = field(repr=False)
    candidates: list[Candidate] = field(repr=False)
    rejects: list[Reject] = field(repr=False)
    timings: dict[str, float] = field(default_factory=dict)
    library: Any = None
    """The plugin.library.LibraryResult when optimize_file built the custom-op library, else None."""
    warnings: list[str] = field(default_factory=list)
    dynamic: Any = None
    """The tune.shape_generic.Ranges of the model's symbolic dims (declared or defaulted; empty for a static model)."""
    loaded: LoadedModel | None = field(default=None, repr=False)
    """The loaded model the plan was made for (replan plans it again)."""
    conversion: Conversion | None = field(default=None, repr=False)
    """How the rewritten model was converted to the half precision (None for fp32)."""
    fp8: Any = field(default=None, repr=False)
    """The fp8.Fp8Result of an fp8 run (its GEMMs' amax and errors, which replan reuses), else None."""

    def planned(self) -> Callable[[str], Any]:
        """Each tensor of the written model as the plan knows it (ir.view.TensorInfo, or None): the view's, in the
        dtypes and names of the precision conversion."""
        return planned_types(self.view, self.conversion)

    def shape_of(self) -> Callable[[str], tuple | None]:
        """The shapes of the written model's tensors from the plan (tune.tasks.view_shapes of the view)."""
        from onnx_gtco.tune.tasks import view_shapes

        shapes = view_shapes(self.view)
        return self.conversion.shape_of(shapes) if self.conversion is not None else shapes


def planned_types(view: GraphView, conversion: Conversion | None) -> Callable[[str], Any]:
    """Each tensor of a written model as the plan knows it: `view.info`, in the dtypes and names of `conversion`."""
    return conversion.info(view.info) if conversion is not None else view.info


def measured_time(view: GraphView, config: GtcoConfig, measured_us: Mapping[str, float]
                  ) -> Callable[[Candidate], float | None]:
    """A fused candidate's measured kernel time where its tuning task has one (onnx_gtco.tune task key ->
    microseconds on the target GPU), else None."""
    from onnx_gtco.kernels.select import shaped
    from onnx_gtco.rewrite import fused_node
    from onnx_gtco.tune.tasks import node_task, template_version, view_shapes

    version = template_version()
    shape_of = view_shapes(view)

    def measured(cand: Candidate) -> float | None:
        if not cand.fused:
            return None
        # a conv's binder checks its group's Conv (auto_pad), which the rewrite puts in the node's function
        body = onnx.FunctionProto(node=[view.model.graph.node[i] for i in sorted(cand.nodes)]
                                  ) if shaped(cand.family) else None
        task = node_task(fused_node(view, cand, config.plan_precision), shape_of, config.arch, version, function=body)
        if isinstance(task, str) or task.key not in measured_us:
            return None
        return float(measured_us[task.key])

    return measured


@dataclass
class Planned:
    """What plan_model found.

    Attributes:
        view: the view the plan is over (after the planner's own rewrites: patchify, QKV packing).
        candidates, rejects: the rules' candidates, and what they and the DP refused.
        plan: the DP's plan.
        cost: the DP's cost callable (cost.model.cost_fn over the kernels' estimates): the report's "predicted".
        measured: the measured-time lookup of tuned groups (None without measurements).
        coverage: candidate -> its device kernel on the target, as the build selects it, with its estimate.
        passes: each planner pass's decisions by its name, where it made any (GraphPass: the conv family's
            patchify pass prices each stride = kernel conv's two forms, families.conv.passes.PatchifyChoice).
    """

    view: GraphView
    candidates: list[Candidate]
    rejects: list[Reject]
    plan: Plan
    cost: Callable[[Candidate], float]
    measured: Callable[[Candidate], float | None] | None
    coverage: Any
    passes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def plan_model(
    model: onnx.ModelProto | GraphView, config: GtcoConfig, measured_us: Mapping[str, float] | None = None,
    unfused: str = "", matched: tuple[list[Candidate], list[Reject]] | None = None,
) -> Planned:
    """Rewrite what the planner rewrites first, match the rules, cost the candidates and run the DP on a loaded model
    (or the view of one, which is planned as it is). The planner's rewrites are the families' passes (graph_passes:
    a stride = kernel conv becomes a patchify copy and a GEMM where the estimate predicts that faster,
    GtcoConfig.patchify; then a block's Q, K and V projections one GEMM, GtcoConfig.pack_qkv). With `measured_us`
    (tuning task key -> measured kernel time), the DP costs those groups by their measurements. `unfused`: why no
    rule may run on the model (it is planned node by node, and the reason is its one reject). `matched`: the
    candidates and rejects an earlier plan of the same view found (the rules are not matched again)."""
    from onnx_gtco.plugin.coverage import candidate_coverage

    hw = hardware(config.target)
    passes: dict[str, list[dict[str, Any]]] = {}
    with progress.stage("plan", total=3) as st:
        if not isinstance(model, GraphView) and not unfused and matched is None:
            for graph_pass in graph_passes():  # the patch embedding as a copy and a GEMM where it pays, then
                if graph_pass.enabled(config):  # one GEMM for a block's Q, K and V
                    model, decisions = graph_pass.run(model, config, hw)
                    if decisions:
                        passes[graph_pass.name] = decisions
        view = model if isinstance(model, GraphView) else GraphView(model)
        if matched is not None:
            candidates, rejects = matched
        elif unfused:
            candidates, rejects = [], [Reject("model", view.model.graph.name or "graph", unfused)]
        else:
            candidates, rejects = cands_mod.collect(view, patterns_mod.rules(), config.max_group_size)
        st.step(f"{len(candidates)} candidates")

        # the kernel the build would select for each group, and its estimate on the target: the DP's price
        coverage = candidate_coverage(view, config.plan_precision, hw=hw)

        def has_kernel(cand: Candidate) -> bool:
            return coverage(cand).on(config.arch)

        def kernel_us(cand: Candidate) -> float | None:
            return coverage(cand).us if has_kernel(cand) else None

        cost = cost_fn(view, config, kernel_us)  # a group without a device kernel costs its nodes unfused
        measured = measured_time(view, config, measured_us) if measured_us else None
        st.step("costs")

        def dp_cost(cand: Candidate) -> float:
            m = measured(cand) if measured is not None and has_kernel(cand) else None
            return m if m is not None else float(cost(cand))

        plan = dp_plan(view, candidates, dp_cost if measured is not None else cost, config.max_states)
        rejects = [*rejects, *plan.rejects]  # segments the DP covered greedily past its state budget
        st.step("DP")
        st.note = (f"{len(view)} nodes, {len(candidates)} candidates, {len(plan.fused_groups)} fused groups, "
                   f"{plan.states} DP states")
    return Planned(view, candidates, rejects, plan, cost, measured, coverage, passes)


def load(model_or_path: str | os.PathLike[str] | onnx.ModelProto, config: GtcoConfig) -> LoadedModel:
    """Load a model for a run (the "load" stage): load_model, and the ranges of its symbolic dims for `config`.
    A valid model in an opset the rules cannot read is passed through (LoadedModel.unfused says why).

    Raises:
        GtcoError: load_model's errors; a declared dynamic dim the model lacks, or malformed `gtco.dynamic`
            metadata (resolve_ranges).
    """
    t0 = time.perf_counter()
    unfused = ""
    with progress.stage("load", total=4) as st:  # load_model steps it: read, check, opset, fold + shapes
        try:
            model = load_model(model_or_path, min_opset=FP8_OPSET if config.precision == "fp8" else MIN_OPSET)
        except OpsetNotConvertedError as e:  # a valid model the rules cannot read: passed through, saying why
            model, unfused = e.model, f"not optimized: {e}"
        ranges = resolve_ranges(model, config.dynamic)  # a declared dim the model lacks is an error before planning
        st.note = f"{len(model.graph.node)} nodes" + (" (not optimized)" if unfused else "")
    source = Path(model_or_path).name if not isinstance(model_or_path, onnx.ModelProto) else (
        model_or_path.graph.name or "model")
    return LoadedModel(model, source, ranges, unfused, time.perf_counter() - t0)


def optimize(model_or_path: str | os.PathLike[str] | onnx.ModelProto | LoadedModel,
             config: GtcoConfig | None = None, measured_us: Mapping[str, float] | None = None) -> OptimizeResult:
    """Plan and rewrite a model in memory.

    Args:
        model_or_path: a ModelProto or a path to an .onnx file (external data resolved beside it), or a model
            load() loaded already with this config.
        config: the run's configuration; defaults to GtcoConfig.from_env().
        measured_us: tuning task key -> measured kernel time (us) on the target GPU: the DP plans those groups
            with their measurements (plan_model).

    Returns:
        OptimizeResult with the rewritten model and its report.

    Raises:
        GtcoError: ModelError / UnsupportedError for bad input, PlanError, RewriteError.
    """
    config = config or GtcoConfig.from_env()
    loaded = model_or_path if isinstance(model_or_path, LoadedModel) else load(model_or_path, config)
    return _plan_and_rewrite(loaded, config, measured_us)


def replan(result: OptimizeResult, config: GtcoConfig, measured_us: Mapping[str, float]) -> OptimizeResult:
    """`result`'s model planned again with measured kernel times (tuning task key -> us; see plan_model), from the
    same loaded model, view and matched candidates: nothing is loaded or matched again."""
    if result.loaded is None:
        raise ValueError("replan needs an OptimizeResult of optimize()")
    return _plan_and_rewrite(result.loaded, config, measured_us, earlier=result)


def _plan_and_rewrite(loaded: LoadedModel, config: GtcoConfig, measured_us: Mapping[str, float] | None = None,
                      earlier: OptimizeResult | None = None) -> OptimizeResult:
    """optimize() after loading: plan (plan_model; on the view and candidates of the `earlier` plan of the same
    loaded model when given), rewrite, validate and report."""
    model, ranges, unfused = loaded.model, loaded.ranges, loaded.unfused
    t1 = time.perf_counter()
    if earlier is None:
        planned = plan_model(model, config, measured_us, unfused)
    else:  # plan_model put the DP's rejects after the rules' ones
        matched = earlier.rejects[:len(earlier.rejects) - len(earlier.plan.rejects)]
        planned = plan_model(earlier.view, config, measured_us, matched=(earlier.candidates, matched))
        planned.passes = {p.name: list(earlier.report[p.name]) for p in graph_passes() if earlier.report.get(p.name)}
    view, candidates, rejects, plan = planned.view, planned.candidates, planned.rejects, planned.plan
    cost, measured, coverage = planned.cost, planned.measured, planned.coverage
    t2 = time.perf_counter()
    with progress.stage("rewrite", total=4 if config.precision == "fp8" else 3) as st:
        new_model, names = rewrite(view, plan, config.plan_precision)
        st.step("precision")
        conversion, fp8_result = None, None
        if config.plan_precision in HALF_TYPES:  # planned on fp32; the fused nodes now compute on half tensors

            def dtype_of(t: str) -> int | None:
                info = view.info(t)
                return info.dtype if info is not None else None

            conversion = convert(new_model, config.plan_precision, dtype_of)
            fp32_model, new_model = new_model, conversion.model
            if config.precision == "fp8":  # the weight GEMMs on E4M3 operands where calibration says they may
                st.step("fp8")
                feeds = read_calibration(config.calibration_data, model)
                new_model, fp8_result = quantize(new_model, fp32_model, feeds, config.fp8_budget,
                                                 earlier.fp8 if earlier is not None else None)
        st.step("validate")
        if ranges:  # the ranges that apply replace any the input model carried
            kept = [p for p in new_model.metadata_props if p.key != DYNAMIC_METADATA_KEY]
            del new_model.metadata_props[:]
            new_model.metadata_props.extend(kept)
        dynamic = [onnx.StringStringEntryProto(key=DYNAMIC_METADATA_KEY, value=ranges.to_json()["ranges"])
                   ] if ranges else []
        new_model.metadata_props.extend([
            onnx.StringStringEntryProto(key="gtco.version", value=__version__),
            onnx.StringStringEntryProto(key="gtco.target", value=config.target),
            onnx.StringStringEntryProto(key="gtco.precision", value=config.precision),
            *dynamic,
        ])
        validate(new_model, model)
        st.step()
        st.note = f"{len(view)} -> {len(new_model.graph.node)} nodes"
    from onnx_gtco.plugin.coverage import model_coverage

    # which fused nodes get device kernels: the binders' answer, nothing compiled
    device = model_coverage(new_model, planned=planned_types(view, conversion), hw=hardware(config.target))
    t3 = time.perf_counter()
    original = view if view.model is model else GraphView(model)  # before the patchify and QKV packing, if any
    rep = report_mod.build_report(view, plan, names, candidates, rejects, cost, config, len(new_model.graph.node),
                                  loaded.source, device, original, coverage)
    if measured is not None:
        measured_groups = 0
        for g, cand in zip(rep["groups"], plan.fused_groups, strict=True):
            m = measured(cand)
            if m is not None:
                g["measured_us"] = round(m, 4)
                measured_groups += 1
        rep["plan_costs"] = f"measured kernel times for {measured_groups} groups, the analytical model elsewhere"
        rep["planned_us_after"] = round(plan.cost_us, 3)
    rep.update(planned.passes)  # each planner pass's decisions (the patch embeddings' prices), under its name
    if conversion is not None:
        rep["conversion"] = conversion.to_json()
    if fp8_result is not None:
        rep["fp8"] = fp8_result.to_json()
    if ranges:
        rep["dynamic"] = ranges.to_json()
    timings = {"load_s": loaded.seconds, "plan_s": t2 - t1, "rewrite_s": t3 - t2}
    return OptimizeResult(new_model, plan, rep, view, candidates, rejects, timings, dynamic=ranges,
                          warnings=[unfused] if unfused else [], loaded=loaded, conversion=conversion,
                          fp8=fp8_result)


def default_output(model_path: str | os.PathLike[str]) -> Path:
    """`model.onnx` -> `model.gtco.onnx` beside it."""
    p = Path(model_path)
    stem = p.name[:-5] if p.name.endswith(".onnx") else p.name
    return p.with_name(stem + ".gtco.onnx")


BUILD_MODES = ("auto", "cpu", "cuda")


def optimize_file(
    model_path: str | os.PathLike[str] | onnx.ModelProto,
    output: str | os.PathLike[str] | None = None,
    report_path: str | os.PathLike[str] | None = None,
    config: GtcoConfig | None = None,
    build: str | None = None,
    tune_trials: int = 0,
    storage: str | None = None,
    workers: int = 1,
    progress: Any = None,
    measurer: Any = None,
    markdown: str | os.PathLike[str] | bool = False,
    shipped_records: bool = True,
) -> tuple[OptimizeResult, Path, Path]:
    """optimize() a file (or a ModelProto, given `output`) and write the model and its report atomically; nothing is
    written on error.

    `build` also builds the custom-op library beside the output (onnx_gtco.plugin.library, cached by content hash)
    and records its file name in the model's `gtco.library` metadata and the report's "library" entry:

    - None (the Python default): no library;
    - "cpu": the CPU kernels only (needs g++ and the ORT headers);
    - "cuda": also the nvcc device objects; a missing nvcc is an error;
    - "auto" (the CLI default): "cuda" when nvcc is found, else "cpu" with a warning in result.warnings.

    A missing g++, the ORT headers not obtainable or a compiler error is a BuildError in every mode (the CLI says
    to pass --no-build); a library this call created is removed again when writing the model fails.

    `tune_trials` > 0 tunes the fused nodes' kernels for the config's target first (onnx_gtco.tune, up to that many
    finished trials per task in the tuning storage: `storage`, $GTCO_TUNE_STORAGE or SQLite in the user cache);
    whenever the storage is there, the build uses its best configurations and the report gets a "tuning" entry.
    `workers` > 1 runs that many tuning processes on the storage. `progress` is called with each
    tune.driver.TaskResult as trials finish. `measurer` overrides tune.apply.pick_measurer(). When the measurer
    measures real kernels (not the analytical model), the model is planned again with the measured times of its
    tuned groups and the build uses the new plan (replan: the model is loaded once either way). Tuning takes the
    fused nodes' shapes and the dynamic ranges from the plan, and so does the build. `config` defaults to
    GtcoConfig.from_env(), for planning and tuning alike.

    `markdown` also writes the report as Markdown (report_md.render): True beside the model as OUTPUT.report.md,
    or at the path given; written with the model and JSON report, all or nothing.

    `shipped_records` (default True): a task without a configuration a GPU measured in the storage gets its
    shipped tuning record's (tune.records; $GTCO_TUNE_RECORDS_DIR names another folder), also without a storage,
    before the analytical model's and the default; the report's tuning entry says each task's source. Models
    with dynamic ranges are tuned shape-generically and take no records.
    """
    if output is None and isinstance(model_path, onnx.ModelProto):
        raise OutputError("optimize_file of a ModelProto needs an output path")
    out = Path(output) if output else default_output(model_path)  # type: ignore[arg-type]
    rep_path = Path(report_path) if report_path else out.with_name(out.name + ".report.json")
    md_path = (out.with_name(out.name + ".report.md") if markdown is True else Path(markdown)) if markdown else None
    if build is not None and build not in BUILD_MODES:
        raise OutputError(f"build={build!r}: choose one of {', '.join(BUILD_MODES)} or None")
    for p in (out, rep_path, *([md_path] if md_path else [])):
        writable_parent(p)
    if tune_trials < 0:
        raise OutputError(f"tune_trials={tune_trials}: give a number of trials >= 0")
    if workers < 1:
        raise OutputError(f"workers={workers}: give at least 1")
    config = config or GtcoConfig.from_env()  # the one config of the run: planning, tuning and the build
    result = optimize(model_path, config)
    result, tuned, dispatch = _tune(result, config, tune_trials, storage, workers, progress, measurer,
                                    shipped_records)
    created = _build(result, out, build, tuned, dispatch, config) if build is not None else None
    _write_all(result, out, rep_path, md_path, created)
    return result, out, rep_path


def _tune(result: OptimizeResult, config: GtcoConfig, tune_trials: int, storage: str | None, workers: int,
          progress: Any, measurer: Any, shipped_records: bool) -> tuple[OptimizeResult, Any, Any]:
    """optimize_file's tuning (see there): the result (planned again where real kernels were measured), the tuned
    configurations and the dispatch tables of a model with symbolic dims."""
    from onnx_gtco.tune import apply as tuning

    tuned = dispatch = None

    if result.dynamic and tuning.wanted(tune_trials, storage):  # symbolic dims: shape-generic tuning instead
        from onnx_gtco.tune import shape_generic

        result.report["dynamic"]["tuning"], dispatch = shape_generic.tune_model(
            result.model, config.arch, result.dynamic, tune_trials, storage, measurer=measurer,
            shape_of=result.shape_of())
    elif tuning.wanted(tune_trials, storage):
        report_t, tuned = tuning.tune_model(result.model, config.arch, tune_trials, storage, measurer=measurer,
                                            workers=workers, progress=progress, shape_of=result.shape_of(),
                                            shipped=shipped_records, hw=hardware(config.target))
        measured = tuning.measured_costs(report_t)
        if measured:  # real kernel times: plan again with them, then look the new plan's tasks up (no measuring)
            result = replan(result, config, measured)
            report_t2, tuned = tuning.tune_model(result.model, config.arch, 0, storage, measurer=measurer,
                                                 shape_of=result.shape_of(), shipped=shipped_records,
                                                 hw=hardware(config.target))
            report_t = {**report_t2, "tasks_tuned_first_plan": report_t["tasks"], "measured": report_t["measured"],
                        "replanned": True}
        result.report["tuning"] = report_t
    elif shipped_records and not result.dynamic:  # no storage: the shipped records alone, where they cover a task
        report_s, tuned = tuning.shipped_model(result.model, config.arch, shape_of=result.shape_of())
        if report_s is not None:
            result.report["tuning"] = report_s
    return result, tuned, dispatch


def _build(result: OptimizeResult, out: Path, build: str, tuned: Any, dispatch: Any, config: GtcoConfig
           ) -> Path | None:
    """optimize_file's library build (see there) beside `out`: the library file this call created, if any."""
    from onnx_gtco.kernels.toolchain import BuildError, find_nvcc
    from onnx_gtco.plugin.library import build_library
    from onnx_gtco.runtime.session import METADATA_KEY

    cuda = build == "cuda"
    if build == "auto":
        try:
            find_nvcc()
            cuda = True
        except BuildError as e:
            result.warnings.append(f"{e}: the library has the CPU kernels only")
    out_dir = out.parent if str(out.parent) else Path(".")
    lib = build_library(result.model, out_dir, cuda=cuda, tuned=tuned, dispatch=dispatch,
                        ranges=result.dynamic.bounds() if result.dynamic else {}, planned=result.planned(),
                        target=config.target)
    result.library = lib
    result.timings["build_s"] = lib.seconds
    result.report["library"] = lib.to_json()
    result.model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
    return lib.path if lib.created else None


def _write_all(result: OptimizeResult, out: Path, rep_path: Path, md_path: Path | None, created: Path | None) -> None:
    """Write the model, its report and its Markdown, all or nothing (a library this call created goes too)."""
    saved = reported = False
    try:
        save_atomic(result.model, out)
        saved = True
        write_text_atomic(report_mod.to_json(result.report), rep_path)
        reported = True
        if md_path is not None:
            from onnx_gtco import report_md

            report_md.write_markdown(result.report, md_path)
    except BaseException:
        if reported:  # the Markdown failed: the JSON report it was to render goes too
            rep_path.unlink(missing_ok=True)
        if saved:  # the report failed: no model without its report
            remove_saved(out)
        if created is not None:
            created.unlink(missing_ok=True)
        raise
