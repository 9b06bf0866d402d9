"""The models and the ordered plan of a GPU run: a list of rows, each a resumable unit with its expected time.

Phases, in order (a GPU window of 15 minutes is spent on what matters most first):

1. install: the carried wheels (`--wheels`), only where some are given;
2. smoke: the plugin of a one-block model built, loaded in onnxruntime-gpu, every fused node on the CUDA EP, its
   outputs checked with and without CUDA graphs, compute-sanitizer memcheck over it; a failure stops the run;
3. calibration: what the kernel-time estimate was never fitted to, timed with our own instances
   (tools/calibrate.py: the small-M GEMM curve, cuBLASLt and CUTLASS at a few tiles, GEMM + LayerNorm fused against
   the pair, a CUDA-graph chain with and without PDL, the patch embedding as conv and as patchify, the SM clock),
   then refitted (`onnx-gtco calibration fit`): every later row plans with the refit ($GTCO_CALIBRATION_DIR);
4. core: ViT-B/16 at batch 1 and 64 and BERT-base at 128 tokens, the fp32 exports optimized to fp16 without
   tuning, against ORT fp16 and ORT fp16 with its transformer optimizer, each side's top kernels profiled;
5. kernels: the kernel bench's GEMM and attention rows of those models (onnx_gtco.bench.kernel_bench), and
   Hopper's library paths at their shapes (tools/hopper_probe.py: FP8 GEMMs and cuDNN's attention beside fp16);
6. tune: those models' kernel tasks tuned (optimize --tune-trials), then the same rows benched with the tuned
   library;
7. rest: ViT-B/16 at batch 8, DeiT-S, Swin-T, SETR, DETR, BERT-base with dynamic tokens (1..512) at 32, 128 and 512;
8. extra: torch.compile max-autotune and TensorRT beside ours on the core rows;
9. tests: `pytest -m gpu`, the tests that need a GPU (the measurer, the device path, the library on the CUDA EP).

Each row's `estimate_s` is what it took (or is expected to take) on the H200 machine this plan was made for: one
H200, 16 cores, the bundle set up (measured: export 24-30 s, optimize 27-36 s, 88 s with the three CUTLASS
instances of ViT-B/16 at batch 64, bench 40-61 s with two ORT baselines and the profiles). The runner starts no row
whose estimate exceeds the budget left. A dry run plans the same rows over small built-in stand-ins on the CPU.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from suite.common import GtcoError

PHASES = ("install", "smoke", "calibration", "core", "kernels", "tune", "rest", "extra", "tests")
CORE_BASELINES = ("ort-fp16", "ort-transformers-fp16")
"""What ours is measured against in every row but the extra ones: ORT fp16, and ORT fp16 after its transformer
optimizer (on the form of the model it fuses, for BERT)."""
BASELINES = ("ort-fp32", "ort-fp16", "ort-transformers-fp16", "torch-compile", "tensorrt")
"""The bench's baseline variants, in the order of the table's columns."""


@dataclass(frozen=True)
class ModelSpec:
    """One model of the suite.

    Attributes:
        name: the name used in row ids, file names and tables.
        label: what it is, for the table.
        builtin: an `onnx_gtco.models.build` name (with `overrides`), or None for a zoo export.
        overrides: builder arguments replacing the built-in's defaults.
        zoo: a `tools/export_zoo.py` model name (exported at the row's batch), or None.
        ort_form: the `optimize_model` arguments (model_type, num_heads, hidden_size) of the zoo model's ORT form
            (tools/export_zoo.py's ORT_OPTIMIZER_ARGS), exported beside it: the ort-transformers-fp16 baseline
            optimizes that form instead of the model; empty: the model itself.
        ort_form_is_model: the ORT form (dynamic batch and sequence dims) is the model every variant runs.
    """

    name: str
    label: str
    builtin: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    zoo: str | None = None
    ort_form: dict[str, Any] = field(default_factory=dict)
    ort_form_is_model: bool = False


BERT_ORT = {"model_type": "bert", "num_heads": 12, "hidden_size": 768}
MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("vit-b16", "ViT-B/16, 224 px (timm export)", zoo="vit-b16"),
    ModelSpec("deit-s", "DeiT-S/16, 224 px (timm export)", zoo="deit-s"),
    ModelSpec("swin-t", "Swin-T, 224 px (timm export)", zoo="swin-t"),
    ModelSpec("setr", "SETR-Naive, ViT-B/16 encoder, 384 px, 577 tokens (timm export + head)", zoo="setr"),
    ModelSpec("detr-r50", "DETR-R50, 320 px (transformers export)", zoo="detr-r50"),
    ModelSpec("bert-base", "BERT-base, 128 tokens (transformers export)", zoo="bert-base", ort_form=BERT_ORT),
    ModelSpec("bert-base-dyn", "BERT-base, dynamic batch and tokens (its ORT-form export)", zoo="bert-base",
              ort_form=BERT_ORT, ort_form_is_model=True),
)}
"""The GPU run's models: every one a zoo export, so torch.compile compiles the model's own module."""
STAND_INS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("vit-tiny", "ViT-tiny, 1 block", builtin="vit-tiny", overrides={"depth": 1}),
    ModelSpec("vit-tiny-2", "ViT-tiny, 2 blocks", builtin="vit-tiny", overrides={"depth": 2}),
    ModelSpec("bert-tiny", "BERT-tiny, 1 layer", builtin="bert-tiny", overrides={"depth": 1}),
)}
"""The CPU stand-ins of a dry run."""
STAND_IN_FOR = {"vit-b16": "vit-tiny", "deit-s": "vit-tiny-2", "swin-t": "vit-tiny-2", "setr": "vit-tiny-2",
                "detr-r50": "vit-tiny-2", "bert-base": "bert-tiny", "bert-base-dyn": "bert-tiny"}
DRY_BATCH = {1: 1, 8: 2, 64: 2}
"""A GPU row's batch -> its stand-in's batch."""


@dataclass(frozen=True)
class Row:
    """One unit of the plan: run, saved and resumed as a whole.

    Attributes:
        id: "phase/what", e.g. "core/vit-b16.b64": the same in a dry run, whose row stands in for it.
        phase: one of PHASES.
        kind: "install", "smoke", "calibration" (tools/calibrate.py, then the refit), "bench" (prepare, optimize,
            bench), "kernels" (onnx_gtco.bench.kernel_bench), "probe" (tools/hopper_probe.py) or "tests" (pytest
            -m gpu).
        model: the model a bench row runs (a stand-in in a dry run), else None.
        batch: the batch size it runs at.
        tune: whether optimize tunes (the run's --tune-trials) before building.
        baselines: the bench's baselines beside ours.
        dims: sizes of other symbolic input dims the bench binds (a dynamic model's sequence length).
        dynamic: optimize's --dynamic ranges (a dynamic model), else None.
        kernel_set: the kernel bench's shape set of a kernels row.
        estimate_s: its expected seconds on the machine of the run's kind.
        stands_in_for: in a dry run, the GPU model the stand-in replaces.
        no_stand_in: in a dry run, why the row has no CPU stand-in (it is then listed as skipped), else "".
    """

    id: str
    phase: str
    kind: str
    model: ModelSpec | None = None
    batch: int = 1
    tune: bool = False
    baselines: tuple[str, ...] = CORE_BASELINES
    dims: tuple[tuple[str, int], ...] = ()
    dynamic: str | None = None
    kernel_set: str | None = None
    estimate_s: float = 60.0
    stands_in_for: str | None = None
    no_stand_in: str = ""

    @property
    def stem(self) -> str:
        """The row's id as a file name."""
        return self.id.replace("/", "-")


def _bench(phase: str, model: str, batch: int, estimate_s: float, **kw: Any) -> Row:
    suffix = kw.pop("suffix", f"b{batch}")
    return Row(f"{phase}/{model}.{suffix}", phase, "bench", MODELS[model], batch, estimate_s=estimate_s, **kw)


CALIBRATION_S = 150.0
"""The calibration row on the H200, expected: about 10 s to start and plan the chain, builds from the start (two
CUTLASS instances, 30-60 s of nvcc each, beside ~27 mma / cuBLASLt / LayerNorm / conv / elementwise ones, seconds
each, 16 at a time), ~45 s timing 136 kernel cases as their builds finish (a 197-row case takes ~0.1 s, each of the
nine 12608-row ones ~2.5 s of host inputs and fp64 reference), ~25 s for the chain's two benches, 5 s of clock
probe, ~10 s for the fit, the backtest and the comparison; tools/calibrate.py starts no case past the row's share of
it (rows.CALIBRATION_RESERVE_S is kept for the fit)."""

GPU_PLAN: tuple[Row, ...] = (
    Row("smoke/probe", "smoke", "smoke", estimate_s=75.0),
    Row("calibration/refit", "calibration", "calibration", estimate_s=CALIBRATION_S),
    _bench("core", "vit-b16", 1, 100.0),
    _bench("core", "vit-b16", 64, 165.0),
    _bench("core", "bert-base", 1, 125.0),
    Row("kernels/vit-b16", "kernels", "kernels", kernel_set="vit-b16", estimate_s=150.0),
    Row("kernels/bert-base", "kernels", "kernels", kernel_set="bert-base", estimate_s=120.0),
    Row("kernels/hopper-libraries", "kernels", "probe", estimate_s=60.0),
    _bench("tune", "vit-b16", 1, 200.0, tune=True),
    _bench("tune", "vit-b16", 64, 240.0, tune=True),
    _bench("tune", "bert-base", 1, 200.0, tune=True),
    _bench("rest", "vit-b16", 8, 110.0),
    _bench("rest", "deit-s", 1, 80.0),
    _bench("rest", "swin-t", 1, 130.0),
    _bench("rest", "setr", 1, 150.0),
    _bench("rest", "detr-r50", 1, 150.0),
    *(_bench("rest", "bert-base-dyn", 1, 110.0, suffix=f"s{s}", dims=(("sequence", s),),
             dynamic="batch=1:1,sequence=1:512") for s in (32, 128, 512)),
    *(_bench("extra", m, b, 330.0, suffix=f"b{b}.torch-compile", baselines=("torch-compile",))
      for m, b in (("vit-b16", 1), ("vit-b16", 64), ("bert-base", 1))),
    *(_bench("extra", m, b, 240.0, suffix=f"b{b}.tensorrt", baselines=("tensorrt",))
      for m, b in (("vit-b16", 1), ("vit-b16", 64), ("bert-base", 1))),
    Row("tests/pytest-gpu", "tests", "tests", estimate_s=300.0),
)
"""Every row of a GPU run, in order."""

DRY_ESTIMATE_S = {"smoke": 20.0, "calibration": 15.0, "bench": 15.0, "kernels": 40.0, "install": 30.0,
                  "tests": 90.0}
"""A dry row's expected seconds on a 2-core CPU machine, by kind (a tuned bench row takes the bench's)."""
NO_CPU_STAND_IN = {"torch-compile": "torch.compile max-autotune runs on the GPU (minutes of autotuning per model)",
                   "tensorrt": "TensorRT runs on the GPU only",
                   "probe": "FP8 GEMMs (torch._scaled_mm) and cuDNN's attention run on a Hopper GPU only"}


def dry_row(row: Row) -> Row:
    """The CPU stand-in of a GPU row: its model a small built-in one at a small batch, its baselines ORT fp32 and
    fp16 on the CPU EP, its time a CPU one; a row no CPU can stand in for says why."""
    est = DRY_ESTIMATE_S.get(row.kind, 15.0)
    if row.model is None:
        return replace(row, estimate_s=est, no_stand_in=NO_CPU_STAND_IN.get(row.kind, ""))
    why = next((NO_CPU_STAND_IN[b] for b in row.baselines if b in NO_CPU_STAND_IN), "")
    return replace(row, model=STAND_INS[STAND_IN_FOR[row.model.name]], batch=DRY_BATCH.get(row.batch, 1),
                   baselines=("ort-fp32", "ort-fp16"), dims=(), dynamic=None, estimate_s=est,
                   stands_in_for=row.model.name, no_stand_in=why)


def install_row(dry_run: bool) -> Row:
    return Row("install/wheels", "install", "install", estimate_s=DRY_ESTIMATE_S["install"] if dry_run else 120.0)


def build_plan(dry_run: bool, *, wheels: bool = False, skip: Sequence[str] = (),
               only: Sequence[str] = ()) -> tuple[Row, ...]:
    """The run's rows in order: the install row where wheels are given, then GPU_PLAN (or its stand-ins), less the
    phases in `skip`, and, when `only` is given, the rows whose id matches one of its glob patterns (the smoke row
    is kept unless skipped: nothing runs on a machine it has not checked).

    Raises:
        GtcoError: an unknown phase, or `only` matching no row.
    """
    bad = [p for p in skip if p not in PHASES]
    if bad:
        raise GtcoError(f"--skip {','.join(bad)}: choose phases from {','.join(PHASES)}")
    rows = [install_row(dry_run)] if wheels else []
    rows += [dry_row(r) if dry_run else r for r in GPU_PLAN]
    rows = [r for r in rows if r.phase not in skip]
    if only:
        picked = [r for r in rows if r.phase in ("install", "smoke") or any(fnmatch.fnmatch(r.id, p) for p in only)]
        if not any(r.phase not in ("install", "smoke") for r in picked):
            raise GtcoError(f"--rows {','.join(only)} matches no row; rows are e.g. "
                            f"{', '.join(r.id for r in GPU_PLAN[:4])}")
        rows = picked
    return tuple(rows)


__all__ = ["BASELINES", "CALIBRATION_S", "CORE_BASELINES", "GPU_PLAN", "MODELS", "PHASES", "STAND_INS", "ModelSpec",
           "Row", "build_plan", "dry_row"]
