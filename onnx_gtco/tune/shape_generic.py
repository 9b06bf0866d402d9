"""Shape-generic tuning (DietCode): tune a few micro-kernels once for a whole range of shapes, predict any shape in
the range from them, and give each dynamic node a dispatch table.

A model with symbolic dims (`batch`, `seq`) has declared ranges (`GtcoConfig.dynamic`, the model's `gtco.dynamic`
metadata, else DEFAULT_DYNAMIC_RANGE: `resolve_ranges`). A fused node's kernel runs its tiles over one run-time
extent (`kernels.dynamic.extent_name`: GEMM rows M, attention seq_q, row-wise rows) whose range follows from the
dims' ranges: M = batch*seq spans lo_batch*lo_seq .. hi_batch*hi_seq. Identical nodes over the same range are one
DynamicTask.

Per task:
1. micro-kernels: the family's candidate configurations, ranked by the analytical model at a few extents spread
   over the range (the union of each extent's best), at most `max_configs` of them;
2. each is measured (the Measurer protocol: the analytical model in CI, the GPU measurer on a GPU) at a few
   micro-kernel extents: one tile, one full wave and two full waves of its blocks (analytical.Tiling). Every
   measurement is an Optuna trial of the task's own study `<task key>@<device>#microkernels` (never mixed with
   the per-shape studies `<task key>@<device>`), so a later run measures only what is missing;
3. the micro-kernel cost model, fitted per configuration by least squares on its measurements:

       predicted(n) = L + f_microkernel * W(n) * u(n) * f_penalty(o(n)),   f_penalty(o) = beta + (1 - beta) * o

   with W the waves of blocks (ceil of blocks over the resident slots), u the work of one block relative to a full
   tile (1 for a GEMM tile, whose padded edge computes in full; the padded key length for attention) and o the
   core occupancy of a wave (busy blocks over the blocks that saturate it, at least one block per SM for the
   Tensor Core families): linear in occupancy, as DietCode has it. L is the launch overhead. Two departures
   follow the fitted estimates (onnx_gtco.calibration): a GEMM adds C * W * o * r, r the share of valid rows in
   its tiles (its blocks load A's valid rows and write only those: families.gemm.kernel.mma_estimate_us), and is
   measured at one row as well; the memory-bound row-wise kernels (LayerNorm, Softmax) take the rows' traffic,
   n over the rows of a full wave, instead of W * u (their estimate is bytes over bandwidth). The estimate's SM
   crowding and L2 sharing within a wave are not linear in o: against it the model errs by up to ~20%;
4. the dispatch table: the predicted-fastest configuration at every extent of the range, adjacent equal intervals
   merged: `((max_extent, config), ...)` ascending, the last entry at the range's top (the contract of
   `plugin.library.build_library(dispatch=...)`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import optuna
from onnx import helper

from onnx_gtco.config import Ranges
from onnx_gtco.kernels.dynamic import extent_name, with_extent
from onnx_gtco.kernels.select import ALL_FAMILIES, FAMILIES, extent_attr
from onnx_gtco.opspec import split_op_type
from onnx_gtco.plugin.dispatch import bucket_of
from onnx_gtco.progress import stage
from onnx_gtco.tune.analytical import Tiling, estimate_us, tiling
from onnx_gtco.tune.search import (
    Measurer,
    measure_into,
    open_storage,
    optimize_once,
    search_space,
    storage_url,
    with_defaults,
)
from onnx_gtco.tune.tasks import ShapeOf, Task, fused_node_tasks, model_shapes

MAX_CONFIGS = 6         # micro-kernel configurations per task
RANK_POINTS = 5         # extents of the range at which the analytical model ranks the candidates
RANK_TOP = 2            # best candidates taken at each of them
TABLE_SLACK = 0.02      # predicted slowdown a dispatch table accepts for fewer entries
SAMPLES = 8             # extents of the range the report compares predicted and measured time at


# ---------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class DynamicTask:
    """Fused nodes of one kernel problem whose run-time extent spans the same range.

    Attributes:
        task: the per-shape Task (its problem at the extent the symbolic dims count as 1).
        extent: the Problem size the nodes dispatch on (kernels.dynamic.extent_name).
        lo, hi: the extent's range.
        expr: the extent as the nodes compute it, e.g. "batch*seq".
    """

    task: Task
    extent: str
    lo: int
    hi: int
    expr: str

    @property
    def key(self) -> str:
        return f"{self.task.key}[{self.lo}:{self.hi}]"

    def problem_at(self, n: int) -> Any:
        return with_extent(self.task.problem, n)

    def describe(self) -> str:
        p = self.task.problem
        fixed = ",".join(f"{k}={v}" for k, v in p.sizes if k != self.extent and not (
            self.extent == "seq_q" and k == "seq_k" and self.follows))
        return (f"{p.family} {p.dtype} {fixed} {self.extent}={self.expr} in {self.lo}..{self.hi} on "
                f"{self.task.arch} (x{self.task.weight})")

    @property
    def follows(self) -> bool:
        """Whether attention's key length follows the query length (self-attention)."""
        return self.extent == "seq_q" and self.problem_at(2).size("seq_k") == 2


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _extent_factors(node: onnx.NodeProto, family: str, shape_of: ShapeOf) -> list[Any] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    key = extent_attr(family)
    if key is not None and key in attrs:
        v = attrs[key]
        return [v] if isinstance(v, int) else _text(v).split("*")
    shape = shape_of(node.input[0]) if node.input else None
    return list(shape[:-1]) if shape else None


def extent_range(node: onnx.NodeProto, shape_of: ShapeOf, bounds: Mapping[str, tuple[int, int]]
                 ) -> tuple[int, int, str] | str:
    """(lo, hi, expression) of a fused node's run-time extent over the dims' ranges, or why it has none.
    `shape_of` gives the shape of the node's inputs (tasks.ShapeOf)."""
    family, _ = split_op_type(node.op_type)
    if extent_name(family) is None:
        return f"{family} kernels do not dispatch on a run-time size"
    factors = _extent_factors(node, family, shape_of)
    if factors is None:
        return "the extent's shape is unknown"
    lo = hi = 1
    names = []
    for f in factors:
        f = _text(f).strip() if not isinstance(f, int) else f
        if isinstance(f, int) or f.isdigit():
            lo, hi = lo * int(f), hi * int(f)
            names.append(str(f))
        elif f in bounds:
            lo, hi = lo * bounds[f][0], hi * bounds[f][1]
            names.append(f)
        else:
            return f"the extent depends on {f!r}, which has no declared range"
    if all(n.isdigit() for n in names):
        return "a static run-time extent (no dispatch: the library's instance for it)"
    return lo, hi, "*".join(names)


def dynamic_tasks(model: onnx.ModelProto, arch: str, ranges: Ranges, shape_of: ShapeOf | None = None
                  ) -> tuple[list[DynamicTask], dict[str, str]]:
    """The DynamicTasks of a rewritten model's fused nodes for `arch` (heaviest first) and why the other fused
    nodes have none. `shape_of` gives the nodes' input shapes: the plan's (tasks.view_shapes) where the caller has
    it, else the model's value_info (tasks.model_shapes)."""
    shape_of = shape_of or model_shapes(model)
    bounds = ranges.bounds()
    found: dict[tuple[str, int, int], DynamicTask] = {}
    skipped: dict[str, str] = {}
    for node, task in fused_node_tasks(model, arch, shape_of):
        if isinstance(task, str):
            skipped[node.name] = task
            continue
        rng = extent_range(node, shape_of, bounds)
        if isinstance(rng, str):
            skipped[node.name] = rng
            continue
        lo, hi, expr = rng
        prev = found.get((task.key, lo, hi))
        if prev is not None:
            task = Task(task.problem, arch, task.version, prev.task.weight + 1, prev.task.nodes + task.nodes)
        found[(task.key, lo, hi)] = DynamicTask(task, extent_name(task.problem.family) or "", lo, hi, expr)
    return sorted(found.values(), key=lambda d: (-d.task.weight, d.key)), skipped


# ---------------------------------------------------------------------------------------------- micro-kernels


def _valid(dt: DynamicTask, config: Mapping[str, int]) -> bool:
    family = FAMILIES[dt.task.problem.family]
    return all(family.check(dt.problem_at(n), config, dt.task.arch) is None for n in {dt.lo, dt.hi})


def spread(lo: int, hi: int, count: int) -> list[int]:
    """`count` extents from lo to hi (both included), spaced geometrically, distinct."""
    if count <= 1 or lo == hi:
        return sorted({lo, hi})
    pts = {lo, hi}
    for i in range(1, count - 1):
        pts.add(round(lo * (hi / lo) ** (i / (count - 1))))
    return sorted(pts)


def candidates(dt: DynamicTask, limit: int = MAX_CONFIGS) -> list[dict[str, int]]:
    """The task's micro-kernel configurations: the analytical model's best few at extents spread over the range
    (largest first), valid over the whole range, at most `limit`."""
    family = FAMILIES[dt.task.problem.family]
    out: list[dict[str, int]] = []
    for n in reversed(spread(dt.lo, dt.hi, RANK_POINTS)):
        p = dt.problem_at(n)
        ranked = sorted((with_defaults(dt.task, c) for c in family.configs(p, dt.task.arch)),
                        key=lambda c: estimate_us(p, c, dt.task.arch))
        for c in ranked[:RANK_TOP]:
            if c not in out and _valid(dt, c):
                out.append(c)
    return out[:max(1, limit)]


def micro_extents(dt: DynamicTask, config: Mapping[str, int]) -> list[int]:
    """The extents a micro-kernel is measured at: one tile, one full wave and two full waves of its blocks (three
    distinct extents; attention's are capped near the range's top, as its blocks' work grows with the extent)."""
    t = tiling(dt.problem_at(dt.hi), config, dt.task.arch)
    per_wave = max(1, t.slots // max(t.across, 1))
    pts = [t.tile, per_wave * t.tile, 2 * per_wave * t.tile]
    wanted = 3
    family = ALL_FAMILIES[dt.task.problem.family]
    if family.row_term and dt.lo < t.tile:  # one row: the share of a tile's rows (KernelFamily.row_term)
        pts, wanted = [dt.lo, *pts], 4
    if family.grows_with_extent:
        cap = math.ceil(max(dt.hi, 2 * t.tile) / t.tile) * t.tile
        pts = [min(p, cap) for p in pts] + [2 * t.tile, cap]
    else:
        pts += [4 * per_wave * t.tile]
    out: list[int] = []
    for p in pts:
        if p not in out and len(out) < wanted:
            out.append(p)
    return sorted(out)


def _features(dt: DynamicTask, t: Tiling, config: Mapping[str, int], n: np.ndarray) -> tuple[np.ndarray, ...]:
    """W * u, W * u * o and, for a family with a row term (KernelFamily.row_term), W * r at extents `n` (see the
    module docstring)."""
    tiles = np.ceil(n / t.tile)
    blocks = t.across * tiles
    waves = np.ceil(blocks / t.slots)
    occ = np.maximum(np.minimum(blocks, t.saturation), t.min_busy) / t.saturation
    occ = np.minimum(occ, 1.0)
    family = ALL_FAMILIES[dt.task.problem.family]
    if family.rowwise:
        # memory-bound: the time follows the rows' traffic, not the waves (the fitted row-wise estimate,
        # families.layernorm.kernel.rowwise_estimate_us, is a fixed cost plus bytes over bandwidth)
        fill = n / (t.slots * t.tile)
        return fill, fill * occ
    work = family.block_work(dt.task.problem, config, n, dt.follows)
    if family.row_term:
        return waves * work, waves * work * occ, waves * occ * n / (tiles * t.tile)
    return waves * work, waves * work * occ


@dataclass(frozen=True)
class MicroKernel:
    """One configuration's measurements and its fitted cost model (see the module docstring).

    Attributes:
        config: the configuration.
        points: (extent, measured us) it was measured at; a failed measurement is absent.
        launch_us, wave_us, beta: L, f_microkernel and f_penalty's floor, fitted.
        failed: why a measurement failed, when one did (the configuration is then not dispatched to).
        row_us: the time per wave of a tile's valid rows (KernelFamily.row_term; 0 for the others), fitted.
    """

    config: dict[str, int]
    points: tuple[tuple[int, float], ...]
    launch_us: float
    wave_us: float
    beta: float
    failed: str = ""
    row_us: float = 0.0

    def predict(self, dt: DynamicTask, n: np.ndarray | int) -> np.ndarray:
        """Predicted time in us at extent(s) `n`."""
        arr = np.atleast_1d(np.asarray(n, dtype=np.float64))
        wu, wuo, *wr = _features(dt, tiling(dt.problem_at(dt.hi), self.config, dt.task.arch), self.config, arr)
        rows = self.row_us * wr[0] if wr else 0.0
        return self.launch_us + self.wave_us * (self.beta * wu + (1.0 - self.beta) * wuo) + rows

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "measured": [[n, round(us, 4)] for n, us in self.points],
                "launch_us": round(self.launch_us, 4), "f_microkernel_us": round(self.wave_us, 4),
                "penalty_floor": round(self.beta, 4), **({"row_us": round(self.row_us, 4)} if self.row_us else {}),
                **({"failed": self.failed} if self.failed else {})}


def fit(dt: DynamicTask, config: Mapping[str, int], points: Sequence[tuple[int, float]], failed: str = ""
        ) -> MicroKernel:
    """The micro-kernel cost model of `config` from its measurements: non-negative least squares of
    t = L + A * W*u + B * W*u*o (+ C * W*r where KernelFamily.row_term) over its points (f_microkernel = A + B,
    beta = A / (A + B), row_us = C). With so few variables the exact NNLS is the best of the least-squares fits on
    each subset of the terms whose coefficients are all non-negative; among those that use a wave term, the one
    with the least residual wins."""
    if not points:
        return MicroKernel(dict(config), (), math.inf, math.inf, 1.0, failed or "no measurement")
    n = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    features = _features(dt, tiling(dt.problem_at(dt.hi), config, dt.task.arch), config, n)
    wu = features[0]
    columns = np.stack([np.ones_like(n), *features], axis=1)
    width = columns.shape[1]
    best: tuple[float, np.ndarray] | None = None
    subsets = [s for size in range(width, 0, -1) for s in itertools.combinations(range(width), size)]
    for subset in subsets:
        coef = np.zeros(width)
        sol, *_ = np.linalg.lstsq(columns[:, subset], y, rcond=None)
        coef[list(subset)] = sol
        if np.any(coef < -1e-12) or coef[1] + coef[2] <= 0:
            continue
        residual = float(np.sum((columns @ coef - y) ** 2))
        if best is None or residual < best[0] * (1 - 1e-9):
            best = (residual, np.maximum(coef, 0.0))
    if best is None:  # times that fall with the extent: no model; charge the slowest point per wave
        return MicroKernel(dict(config), tuple(points), 0.0, float(np.max(y / wu)), 1.0, failed)
    launch, a, b, *c = best[1]
    return MicroKernel(dict(config), tuple(points), float(launch), float(a + b), float(a / (a + b)), failed,
                       float(c[0]) if c else 0.0)


def dispatch_table(dt: DynamicTask, kernels: Sequence[MicroKernel]) -> tuple[tuple[int, dict[str, int]], ...]:
    """The fastest predicted configuration per extent over [lo, hi], adjacent equal intervals merged:
    ((max_extent, config), ...) ascending, the last at hi. Among the configurations within TABLE_SLACK of the
    fastest at an extent, the one with the least predicted time over the whole range wins (it keeps the table
    short where the predictions ripple with the tile edges). Raises ValueError when no kernel has a finite
    prediction."""
    usable = [k for k in kernels if math.isfinite(k.wave_us) and not k.failed]
    if not usable:
        raise ValueError(f"{dt.describe()}: no micro-kernel was measured successfully")
    n = np.arange(dt.lo, dt.hi + 1, dtype=np.float64)
    pred = np.stack([k.predict(dt, n) for k in usable])
    # within TABLE_SLACK of the fastest, prefer the configuration fastest over the whole range: fewer entries
    near = pred <= pred.min(axis=0) * (1.0 + TABLE_SLACK)
    rank = np.argsort(np.argsort(pred.sum(axis=1), kind="stable"), kind="stable")
    best = np.argmin(np.where(near, rank[:, None], len(usable)), axis=0)
    ends = [*np.flatnonzero(np.diff(best)).tolist(), len(n) - 1]
    return tuple((int(n[e]), dict(usable[int(best[e])].config)) for e in ends)


def table_config(table: Sequence[tuple[int, Mapping[str, int]]], n: int) -> dict[str, int]:
    """The configuration a table dispatches extent `n` to (the first entry whose max_extent >= n, as the glue
    looks it up: plugin.dispatch.bucket_of)."""
    if n > table[-1][0]:
        raise ValueError(f"extent {n} is above the table's top {table[-1][0]}")
    return dict(table[bucket_of(table, n)][1])


# ---------------------------------------------------------------------------------------------- tuning


def microkernel_study_name(dt: DynamicTask, device: str) -> str:
    """The task's micro-kernel study on `device`: apart from its per-shape study (`search.study_name`)."""
    return f"{dt.task.key}@{device}#microkernels"


def _record(study: optuna.Study, dt: DynamicTask, config: dict[str, int], n: int, measurer: Measurer) -> None:
    study.enqueue_trial(config, user_attrs={"extent": int(n)})
    space = search_space(dt.task)

    def objective(trial: optuna.Trial) -> float:
        cfg = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
        return measure_into(trial, measurer, Task(dt.problem_at(n), dt.task.arch, dt.task.version), cfg)

    optimize_once(study, objective)


def _config_key(config: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """A configuration as a hashable key (its items in name order)."""
    return tuple(sorted(config.items()))


def _measured(study: optuna.Study) -> dict[tuple[tuple[tuple[str, int], ...], int], optuna.trial.FrozenTrial]:
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    out = {}
    for t in study.get_trials(deepcopy=False, states=states):
        if "extent" in t.user_attrs:
            out[(_config_key(t.params), int(t.user_attrs["extent"]))] = t
    return out


@dataclass
class DynamicResult:
    """One DynamicTask after shape-generic tuning.

    Attributes:
        task: the task.
        kernels: its micro-kernels with their fitted models ({} configs with no measurement yet are absent).
        trials: micro-kernel trials of its study in the storage; measured: those this call ran.
        table: the dispatch table (None: no usable micro-kernel, e.g. a look-up of a task never tuned).
        samples: (extent, configuration, predicted us, measured us) at extents spread over the range.
    """

    task: DynamicTask
    kernels: list[MicroKernel]
    trials: int
    measured: int
    table: tuple[tuple[int, dict[str, int]], ...] | None
    samples: list[tuple[int, dict[str, int], float, float | None]] = field(default_factory=list)

    @property
    def max_error(self) -> float | None:
        """Largest relative error |predicted - measured| / measured over the samples."""
        errs = [abs(p - m) / m for _, _, p, m in self.samples if m]
        return max(errs) if errs else None

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task.key, "describe": self.task.describe(), "nodes": list(self.task.task.nodes),
                "extent": self.task.extent, "expr": self.task.expr, "range": [self.task.lo, self.task.hi],
                "trials": self.trials, "measured": self.measured,
                "microkernels": [k.to_json() for k in self.kernels],
                "tables": {} if self.table is None else {self.task.task.arch: [
                    {"extents": [start, top], "config": cfg}
                    for start, (top, cfg) in zip([self.task.lo] + [t + 1 for t, _ in self.table], self.table,
                                                 strict=False)]},
                "samples": [{"extent": n, "config": c, "predicted_us": round(p, 4),
                             "measured_us": None if m is None else round(m, 4),
                             "error": None if not m else round(abs(p - m) / m, 4)} for n, c, p, m in self.samples],
                "max_error": None if self.max_error is None else round(self.max_error, 4)}


def tune_dynamic(tasks: Sequence[DynamicTask], *, trials: int, measurer: Measurer, storage: str | None = None,
                 samples: int = SAMPLES, progress: Callable[[DynamicResult], None] | None = None
                 ) -> list[DynamicResult]:
    """Measure each task's micro-kernels (the candidates, in the analytical model's order, that `trials`
    measurements per task cover in full, at least one; those the storage has already are not measured again;
    0 measures nothing and uses the candidates measured already), fit their cost models and build the dispatch
    tables (None for a task with no usable micro-kernel). With trials > 0, each table is checked at `samples`
    extents spread over the range: predicted vs the measurer's time of the full shape (these checks are not
    trials)."""
    if trials < 0:
        raise ValueError(f"trials must be >= 0, got {trials}")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    store = open_storage(storage_url(storage))
    existing = {s.study_name for s in optuna.get_all_study_summaries(store, include_best_trial=False)}
    out = []
    for dt in tasks:
        name = microkernel_study_name(dt, measurer.device)
        if trials == 0 and name not in existing:  # a look-up creates nothing
            out.append(DynamicResult(dt, [], 0, 0, None))
            continue
        study = optuna.create_study(study_name=name, storage=store, direction="minimize", load_if_exists=True)
        if "task" not in study.user_attrs:
            study.set_user_attr("task", dt.describe())
        done = _measured(study)
        plan: list[tuple[dict[str, int], list[int]]] = []
        for c in candidates(dt):  # as many micro-kernels as the budget measures in full; 0: those measured already
            pts = micro_extents(dt, c)
            known = all((_config_key(c), n) in done for n in pts)
            over = bool(plan) and sum(len(q) for _, q in plan) + len(pts) > trials
            if (trials == 0 and not known) or (trials > 0 and over):
                break
            plan.append((c, pts))
        ran = 0
        for c, pts in plan:
            for n in pts:
                if (_config_key(c), n) not in done:
                    _record(study, dt, c, n, measurer)
                    ran += 1
        done = _measured(study)
        kernels = []
        for c, pts in plan:
            got = [done[(_config_key(c), n)] for n in pts]
            ok = [(n, float(t.value)) for n, t in zip(pts, got, strict=True)
                  if t.state == optuna.trial.TrialState.COMPLETE]
            bad = [t.user_attrs.get("error_kind", "runtime") for t in got
                   if t.state != optuna.trial.TrialState.COMPLETE]
            kernels.append(fit(dt, c, ok, f"{bad[0]} at a micro-kernel extent" if bad else ""))
        table = dispatch_table(dt, kernels) if any(not k.failed for k in kernels) else None
        result = DynamicResult(dt, kernels, len(done), ran, table)
        if table is not None and trials > 0:
            by_config = {_config_key(k.config): k for k in kernels}
            for n in spread(dt.lo, dt.hi, samples):
                c = table_config(table, n)
                pred = float(by_config[_config_key(c)].predict(dt, n)[0])
                m = measurer.measure(Task(dt.problem_at(n), dt.task.arch, dt.task.version), c)
                result.samples.append((n, c, pred, m.median_us))
        out.append(result)
        if progress is not None:
            progress(result)
    return out


Dispatch = dict[str, dict[str, tuple[tuple[int, dict[str, int]], ...]]]
"""node name -> arch -> ((max_extent, config), ...): build_library's `dispatch`."""


def tune_model(model: onnx.ModelProto, arch: str, ranges: Ranges, trials: int, storage: str | None = None,
               measurer: Measurer | None = None, progress: Callable[[DynamicResult], None] | None = None,
               shape_of: ShapeOf | None = None) -> tuple[dict[str, Any], Dispatch]:
    """Shape-generic tuning of a rewritten model's dynamic nodes for `arch` (a GPU measurer tunes for its own
    GPU's arch) over `ranges` (the plan's: OptimizeResult.dynamic): the report's dynamic tuning entry and the
    dispatch tables per node. `shape_of` as for dynamic_tasks."""
    from onnx_gtco.tune.apply import pick_measurer, redact

    measurer = measurer or pick_measurer()
    arch = getattr(measurer, "arch", arch)
    url = storage_url(storage)
    tasks, skipped = dynamic_tasks(model, arch, ranges, shape_of)
    with stage("tune", total=len(tasks), unit="task") as st:
        def each(r: DynamicResult) -> None:
            st.step(r.task.task.describe()[:48])
            if progress is not None:
                progress(r)

        results = tune_dynamic(tasks, trials=trials, measurer=measurer, storage=url, progress=each)
        st.note = (f"{len(tasks)} shape-generic tasks, {sum(r.measured for r in results)} micro-kernel trials run "
                   f"({measurer.name} measurer)")
    dispatch: Dispatch = {}
    for r in results:
        if r.table is not None:
            for node in r.task.task.nodes:
                dispatch[node] = {arch: r.table}
    errors = [r.max_error for r in results if r.max_error is not None]
    report = {"mode": "shape-generic", "storage": redact(url), "measurer": measurer.name, "device": measurer.device,
              "arch": arch, "trials_per_task": trials, "measured": sum(r.measured for r in results),
              "trials": sum(r.trials for r in results), "tasks": [r.to_json() for r in results],
              "table_sizes": [len(r.table) for r in results if r.table is not None],
              "max_prediction_error": round(max(errors), 4) if errors else None, "not_dynamic": skipped}
    return report, dispatch


__all__ = ["Dispatch", "DynamicResult", "DynamicTask", "MicroKernel", "candidates", "dispatch_table", "dynamic_tasks",
           "extent_range", "fit", "micro_extents", "microkernel_study_name", "spread", "table_config", "tune_dynamic",
           "tune_model"]
