"""`onnx-gtco bench`: one process, one run, the same seeded inputs for every variant of a model at each batch size.

Per batch: the fp32 original is run once on the CPU EP for the reference outputs, then every selected baseline and
ours ("gtco") is prepared and timed (onnx_gtco.bench.variants), its accuracy taken against the reference, and the
roofline floor computed (onnx_gtco.bench.roofline). The result is one JSON document (schema in `run_bench`),
printed as a table.
"""

from __future__ import annotations

import dataclasses
import platform
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnx_gtco.bench import roofline
from onnx_gtco.bench.output import check_out_dir
from onnx_gtco.bench.variants import BASELINES, OURS, Context, Result, reference_outputs, run_variant
from onnx_gtco.errors import GtcoError, first_line

MIN_RUNS = 100
PROVIDERS = ("cuda", "cpu")


@dataclass(frozen=True)
class BenchOptions:
    """What one `onnx-gtco bench` run measures (the CLI's arguments).

    Attributes:
        model: an .onnx path or a built-in model name (onnx_gtco.models.BUILTIN, built at each batch size).
        rewritten: an already optimized model to time as ours; None optimizes `model` per batch size.
        torch_program: a torch.export program file of the model (torch.export.save) for the torch-compile
            baseline, taking the ONNX model's graph inputs in order; None converts the ONNX model with onnx2torch.
        provider: "cuda" or "cpu".
        batches: batch sizes; a file model's symbolic batch dim is bound to each, a fixed one must equal it. None:
            the model's own batch (its fixed batch dim; 1 when the dim is symbolic, and for built-in models).
        precision: what ours is optimized with; None: fp16 on cuda, fp32 on cpu.
        target: the GPU target ours is planned for (GtcoConfig's default when None).
        baselines: a subset of variants.BASELINES, run in that order.
        runs, warmup: timed and untimed runs per variant; runs >= MIN_RUNS unless quick.
        quick: allow fewer runs (smoke tests; the numbers are not for reporting).
        model_type: the ORT transformer optimizer's model type; None infers vit or bert from the inputs.
        ort_model: the .onnx file ORT's transformer optimizer gets for ort-transformers-fp16 instead of `model`:
            the same model in the graph form its fusions match (tools/export_zoo.py's ORT form), taking `model`'s
            inputs and giving its outputs by name, each input dim symbolic or the size `model`'s has. None: `model`.
        num_heads, hidden_size: the optimizer's `num_heads` / `hidden_size` (0, 0: it reads them from the graph,
            which fails where the graph reshapes to (..., -1, head_size), as transformers 5 does).
        dims: sizes of other symbolic input dims (e.g. a sequence length).
        seed: seed of the inputs.
        remeasure_peaks: keep only this run's measured peaks, forgetting the best of earlier runs on the device.
        profile: on "cuda", after each ORT variant's timing, profile a few runs of it (bench.profile: its top
            kernels by GPU time) into the variant's "profile".
        out: folder for bench.json, bench.md and bench.png.
        command: the command line, recorded in the JSON.
    """

    model: str
    rewritten: str | None = None
    torch_program: str | None = None
    provider: str = "cuda"
    batches: tuple[int, ...] | None = None
    precision: str | None = None
    target: str | None = None
    baselines: tuple[str, ...] = BASELINES
    runs: int = MIN_RUNS
    warmup: int = 10
    quick: bool = False
    model_type: str | None = None
    ort_model: str | None = None
    num_heads: int = 0
    hidden_size: int = 0
    dims: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    remeasure_peaks: bool = False
    profile: bool = False
    out: str = "."
    command: str = ""

    def validate(self) -> None:
        """Raise GtcoError for any argument that cannot be benchmarked, before anything runs."""
        from onnx_gtco.config import PRECISIONS

        if self.provider not in PROVIDERS:
            raise GtcoError(f"unknown provider {self.provider!r}; choose one of {', '.join(PROVIDERS)}")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise GtcoError(f"unknown baseline {unknown[0]!r}; choose among {', '.join(BASELINES)}")
        if self.batches is not None and (not self.batches or any(b < 1 for b in self.batches)):
            raise GtcoError(f"--batch takes sizes >= 1, got {' '.join(map(str, self.batches)) or 'none'}")
        if self.batches is not None and len(set(self.batches)) != len(self.batches):
            raise GtcoError(f"--batch lists a size twice: {' '.join(map(str, self.batches))}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise GtcoError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.runs < 1 or (self.runs < MIN_RUNS and not self.quick):
            raise GtcoError(f"--runs {self.runs}: at least {MIN_RUNS} timed runs (pass --quick for a smoke test "
                            "with fewer)")
        if self.warmup < 0:
            raise GtcoError(f"--warmup {self.warmup}: give a count >= 0")
        check_out_dir(Path(self.out))
        if self.torch_program is not None and not Path(self.torch_program).is_file():
            raise GtcoError(f"--torch-program {self.torch_program}: no such file")
        if self.model_type is not None:
            from onnxruntime.transformers.optimizer import MODEL_TYPES

            if self.model_type not in MODEL_TYPES:
                raise GtcoError(f"unknown --model-type {self.model_type!r}; ORT's transformer optimizer knows "
                                f"{', '.join(MODEL_TYPES)}")
        if self.ort_model is not None and not Path(self.ort_model).is_file():
            raise GtcoError(f"--ort-model {self.ort_model}: no such file")
        if not ((self.num_heads == 0 and self.hidden_size == 0)
                or (self.num_heads > 0 and self.hidden_size > 0 and self.hidden_size % self.num_heads == 0)):
            raise GtcoError(f"--num-heads {self.num_heads} --hidden-size {self.hidden_size}: give both, the hidden "
                            "size a multiple of the head count (or neither: ORT reads them from the graph)")

    def as_command(self) -> str:
        """The equivalent `onnx-gtco bench` command line, every option spelled out (recorded in the JSON)."""
        argv = ["onnx-gtco", "bench", self.model, "--provider", self.provider,
                *(["--batch", *map(str, self.batches)] if self.batches is not None else []),
                "--precision", self.gtco_precision, "--baselines", *self.baselines, "--runs", str(self.runs),
                "--warmup", str(self.warmup), "--seed", str(self.seed), "--out", self.out]
        argv += ["--rewritten", self.rewritten] if self.rewritten else []
        argv += ["--torch-program", self.torch_program] if self.torch_program else []
        argv += ["--target", self.target] if self.target else []
        argv += ["--model-type", self.model_type] if self.model_type else []
        argv += ["--ort-model", self.ort_model] if self.ort_model else []
        argv += ["--num-heads", str(self.num_heads), "--hidden-size", str(self.hidden_size)] if self.num_heads else []
        argv += [a for k, v in self.dims.items() for a in ("--dim", f"{k}={v}")]
        argv += ["--quick"] if self.quick else []
        argv += ["--remeasure-peaks"] if self.remeasure_peaks else []
        argv += ["--profile"] if self.profile else []
        return shlex.join(argv)

    @property
    def gtco_precision(self) -> str:
        return self.precision or ("fp16" if self.provider == "cuda" else "fp32")


def bind_dims(model: onnx.ModelProto, batch: int, dims: dict[str, int], name: str) -> onnx.ModelProto:
    """A copy of `model` whose graph inputs' first dim is `batch` and whose symbolic dims named in `dims` take
    those sizes (in inputs, outputs and value_info alike).

    Raises:
        GtcoError: an input's batch is fixed to another size, or an input keeps a symbolic dim not in `dims`.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name for t in out.graph.initializer}
    inputs = [vi for vi in out.graph.input if vi.name not in inits]
    values = dict(dims)
    for vi in inputs:
        shape = vi.type.tensor_type.shape.dim
        if not shape:
            continue
        d0 = shape[0]
        if d0.HasField("dim_value"):
            if d0.dim_value != batch:
                raise GtcoError(f"{name}: input {vi.name!r} has a fixed batch of {d0.dim_value}; --batch {batch} "
                                "needs a model with a symbolic batch dim")
        elif d0.dim_param:
            values[d0.dim_param] = batch
        else:
            d0.dim_value = batch
    for vi in [*inputs, *out.graph.output, *out.graph.value_info]:
        for d in vi.type.tensor_type.shape.dim:
            if not d.HasField("dim_value") and d.dim_param in values:
                d.dim_value = values[d.dim_param]
    for vi in inputs:
        for d in vi.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                raise GtcoError(f"{name}: input {vi.name!r} has the symbolic dim {d.dim_param or '?'!r}; give its "
                                f"size with --dim {d.dim_param or 'NAME'}=INT")
    return out


def check_ort_model(ort_model: onnx.ModelProto, model: onnx.ModelProto, name: str) -> None:
    """Raise GtcoError unless `ort_model` takes `model`'s (bound) inputs and gives its outputs: the same names in
    the same order, every input dim symbolic or the size `model`'s has."""
    def inputs(m: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
        inits = {t.name for t in m.graph.initializer}
        return [vi for vi in m.graph.input if vi.name not in inits]

    want, got = inputs(model), inputs(ort_model)
    if [vi.name for vi in got] != [vi.name for vi in want]:
        raise GtcoError(f"{name}: its inputs {[vi.name for vi in got]} are not the model's {[vi.name for vi in want]}")
    if [o.name for o in ort_model.graph.output] != [o.name for o in model.graph.output]:
        raise GtcoError(f"{name}: its outputs {[o.name for o in ort_model.graph.output]} are not the model's "
                        f"{[o.name for o in model.graph.output]}")
    for a, b in zip(got, want, strict=True):
        dims_a, dims_b = a.type.tensor_type.shape.dim, b.type.tensor_type.shape.dim
        sizes = [d.dim_value if d.HasField("dim_value") else None for d in dims_a]
        if len(dims_a) != len(dims_b) or any(s is not None and s != d.dim_value for s, d in zip(sizes, dims_b,
                                                                                                 strict=True)):
            shape = [s if s is not None else "?" for s in sizes]
            raise GtcoError(f"{name}: input {a.name!r} of shape {shape} cannot take the model's "
                            f"{[d.dim_value for d in dims_b]}")


def infer_model_type(model: onnx.ModelProto) -> str:
    """"bert" when a graph input is an integer tensor (token ids), "vit" when one is a 4-D float image, else
    "bert" (ORT's transformer optimizer's generic encoder fusions)."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if np.issubdtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type), np.integer):
            return "bert"
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        if vi.name not in inits and len(tt.shape.dim) == 4 and tt.elem_type in (onnx.TensorProto.FLOAT,
                                                                               onnx.TensorProto.FLOAT16):
            return "vit"
    return "bert"


def own_batch(model: onnx.ModelProto) -> int:
    """The batch a model is exported for: the fixed first dim of its first non-initializer input with one, else 1
    (a symbolic batch)."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name not in inits and dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    return 1


def _model_source(spec: str) -> Callable[[int], onnx.ModelProto]:
    """batch -> the fp32 model at that batch (not yet bound, for a file)."""
    from onnx_gtco import models
    from onnx_gtco.ir.load import read_model

    source = models.resolve(spec)
    if isinstance(source, str):
        return lambda batch: models.build(source, batch=batch, seed=0)
    model = read_model(source)
    return lambda batch: model


def device_info(provider: str, peaks: roofline.Peaks | None) -> dict[str, Any]:
    """The device's name (the peaks' key) and the versions of everything measured."""
    import onnxruntime

    from onnx_gtco.pipeline import __version__

    versions: dict[str, Any] = {"onnx_gtco": __version__, "onnxruntime": onnxruntime.__version__,
                                "onnx": onnx.__version__, "numpy": np.__version__,
                                "python": platform.python_version()}
    for key, dists in (("torch", ("torch",)), ("tensorrt", ("tensorrt",)), ("onnx2torch", ("onnx2torch",)),
                       ("cupy", ("cupy", "cupy-cuda12x", "cupy-cuda11x", "cupy-cuda13x"))):
        versions[key] = None  # not installed
        for dist in dists:
            try:
                versions[key] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    name = peaks.device if peaks is not None else (roofline.cpu_name() if provider == "cpu" else "cuda: unknown")
    return {"name": name, "providers": onnxruntime.get_available_providers(), **versions}


def _variant_json(r: Result) -> dict[str, Any]:
    lat = r.timed.latency if r.timed is not None and r.status == "ok" else None
    acc = r.accuracy
    return {"name": r.name, "status": r.status, "reason": r.reason,
            "median_ms": lat.median_ms if lat else None, "p10_ms": lat.p10_ms if lat else None,
            "p90_ms": lat.p90_ms if lat else None, "runs": lat.runs if lat else 0,
            "cuda_graph": bool(lat is not None and r.timed is not None and r.timed.cuda_graph),
            "median_ms_no_graph": (r.timed.plain.median_ms if lat is not None and r.timed is not None
                                   and r.timed.plain is not None else None),
            "max_abs_err": acc.max_abs_err if acc else None, "max_rel_err": acc.max_rel_err if acc else None,
            "cosine": acc.cosine if acc else None, "note": r.note}


def _profile(r: Result, ctx: Context) -> dict[str, Any]:
    """The profile of an ok variant's session made as it was timed, without CUDA graphs (a replay hides its
    kernels from nothing, but ORT captures only after warm-up runs): {"reason"} when it has no ORT session."""
    from onnx_gtco.bench.profile import profile_session

    if r.timed is None or r.timed.make is None:
        return {"reason": "not an ORT session"}
    try:
        session = r.timed.make(False)
    except Exception as e:  # ORT's own exception types
        return {"reason": f"making the session failed: {first_line(e)}"}
    return profile_session(session, ctx.feeds, ctx.outputs)


def _median(v: dict[str, Any], graph: bool) -> float | None:
    """A variant's median with CUDA graph replay (`graph`) or without it, None when it was not measured so."""
    if v.get("status") != "ok":
        return None
    if graph:
        return v["median_ms"] if v.get("cuda_graph") else None
    return v.get("median_ms_no_graph") if v.get("cuda_graph") else v["median_ms"]


def ratio_mode(ours: dict[str, Any], base: dict[str, Any]) -> bool | None:
    """Whether ours and `base` are compared with CUDA graph replay (True), without (False), or not at all (None):
    with graphs when both replayed one, else without on both sides (a variant that replayed one was timed without
    too: `median_ms_no_graph`). A variant with no graph-free time (torch.compile's cudagraph trees) is compared
    with graphs only."""
    if _median(ours, True) is not None and _median(base, True) is not None:
        return True
    if _median(ours, False) is not None and _median(base, False) is not None:
        return False
    return None


def ours_over(variants: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """baseline -> ours' median / that baseline's median, CUDA graphs on both sides or neither (`ratio_mode`);
    None where either did not run or no like-for-like pair of times exists."""
    ours = next((v for v in variants if v["name"] == OURS), None)
    out: dict[str, float | None] = {}
    for v in variants:
        if v["name"] == OURS:
            continue
        mode = ratio_mode(ours, v) if ours is not None else None
        if mode is None:
            out[v["name"]] = None
            continue
        a, b = _median(ours, mode), _median(v, mode)  # type: ignore[arg-type]
        out[v["name"]] = a / b if a is not None and b else None
    return out


def graph_modes(variants: Sequence[dict[str, Any]]) -> dict[str, bool | None]:
    """baseline -> whether its ratio in ours_over compared CUDA graph replays (True), plain runs (False) or
    nothing (None)."""
    ours = next((v for v in variants if v["name"] == OURS), None)
    return {v["name"]: (ratio_mode(ours, v) if ours is not None else None) for v in variants if v["name"] != OURS}


def _log(msg: str) -> None:
    print(f"bench  {msg}", file=sys.stderr, flush=True)


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Measure every variant at every batch size and return the JSON document:

    {"model", "provider", "device": {"name", "providers", versions...}, "precision", "runs", "warmup", "quick",
     "batches": [{"batch", "variants": [{"name", "status": "ok"|"skipped"|"failed", "reason", "median_ms",
     "p10_ms", "p90_ms", "runs", "cuda_graph", "max_abs_err", "max_rel_err", "cosine", "note"}],
     "ours_over": {baseline: ours_median / baseline_median or None}, "roofline": {"flops", "bytes",
     "peak_tflops", "peak_gbps", "floor_ms"}}], "command"}

    Raises:
        GtcoError: invalid options, a model that cannot be read or bound to a batch size, or the CUDA EP missing
            for provider "cuda". A variant's own failure is recorded in the document instead.
    """
    import onnxruntime as ort

    from onnx_gtco.config import GtcoConfig
    from onnx_gtco.ir.export import save_atomic
    from onnx_gtco.runtime.check import make_inputs

    opts.validate()
    if opts.provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise GtcoError(f"--provider cuda: CUDAExecutionProvider is not available in this onnxruntime "
                        f"({ort.__version__}); install onnxruntime-gpu, or pass --provider cpu")
    rewritten = Path(opts.rewritten) if opts.rewritten else None
    if rewritten is not None and not rewritten.is_file():
        raise GtcoError(f"--rewritten {rewritten}: no such file")
    source = _model_source(opts.model)
    if opts.batches is None:  # the recorded command spells the resolved batch out, as every other option
        resolved = dataclasses.replace(opts, batches=(own_batch(source(1)),))
        opts = dataclasses.replace(resolved, command=resolved.as_command() if opts.command else "")
        _log(f"batch {opts.batches[0]}: the model's own (pass --batch to time other sizes)")
    assert opts.batches is not None
    for batch in opts.batches:  # a batch the model cannot take is an error before anything is measured
        bind_dims(source(batch), batch, opts.dims, opts.model)
        if rewritten is not None:  # its inputs must take the same feeds; a fixed batch must match
            bind_dims(onnx.load(str(rewritten), load_external_data=False), batch, opts.dims, str(rewritten))
        if opts.ort_model is not None:
            check_ort_model(onnx.load(opts.ort_model, load_external_data=False),
                            bind_dims(source(batch), batch, opts.dims, opts.model), opts.ort_model)
    target = GtcoConfig.from_env(target=opts.target).target
    try:
        peaks, cached = roofline.device_peaks(opts.provider, remeasure=opts.remeasure_peaks)
        _log(f"peaks of {peaks.device}: {peaks.peak_tflops:.2f} TFLOP/s, {peaks.peak_gbps:.1f} GB/s "
             f"({'best of this run and earlier ones' if cached else 'measured now'})")
        peak_reason = ""
    except GtcoError as e:
        peaks, cached, peak_reason = None, False, str(e)
    names = [*[b for b in BASELINES if b in opts.baselines], OURS]
    batches = []
    for batch in opts.batches:
        model = bind_dims(source(batch), batch, opts.dims, opts.model)
        with tempfile.TemporaryDirectory(prefix="gtco-bench-") as tmp:
            work_dir = Path(tmp)
            path = save_atomic(model, work_dir / "model.onnx")
            feeds = make_inputs(model, opts.seed)
            try:
                reference = reference_outputs(path, feeds)
            except Exception as e:  # ORT's own exception types
                raise GtcoError(f"{opts.model}: onnxruntime cannot run the fp32 original: {first_line(e)}") from None
            ctx = Context(model, path, work_dir, opts.provider, opts.gtco_precision, target,
                          opts.model_type or infer_model_type(model), feeds, reference, opts.runs, opts.warmup,
                          rewritten=rewritten,
                          torch_program=Path(opts.torch_program) if opts.torch_program else None,
                          ort_model=Path(opts.ort_model) if opts.ort_model else None, num_heads=opts.num_heads,
                          hidden_size=opts.hidden_size)
            variants = []
            for name in names:
                r = run_variant(name, ctx)
                lat = r.timed.latency if r.timed is not None and r.status == "ok" else None
                _log(f"batch {batch:<4} {name:<22} {r.status:<8} "
                     + (f"{lat.median_ms:.3f} ms" if lat else r.reason))
                entry = _variant_json(r)
                if opts.profile and opts.provider == "cuda" and r.status == "ok":
                    entry["profile"] = _profile(r, ctx)
                    top = entry["profile"].get("top") or [{}]
                    _log(f"batch {batch:<4} {name:<22} profile: " + (
                        f"{entry['profile']['kernel_us_per_run']:.1f} us of kernels per run, top "
                        f"{top[0].get('kernel', '')[:60]} {top[0].get('share', 0):.0%}" if "top" in entry["profile"]
                        else entry["profile"]["reason"]))
                variants.append(entry)
        work = roofline.model_work(model, opts.gtco_precision, io=[*feeds.values(), *reference])
        roof: dict[str, Any] = (roofline.roofline_json(work, peaks) if peaks is not None else
                                {"flops": work.flops, "bytes": work.bytes, "peak_tflops": None, "peak_gbps": None,
                                 "floor_ms": None, "reason": peak_reason})
        roof["mm_flops"] = work.mm_flops
        batches.append({"batch": batch, "variants": variants, "ours_over": ours_over(variants),
                        "ours_over_cuda_graph": graph_modes(variants), "roofline": roof})
    device = device_info(opts.provider, peaks)
    if peaks is not None:
        device["peaks"] = {"method": peaks.method, "cached": cached}
    return {"model": opts.model, "provider": opts.provider, "device": device,
            "precision": opts.gtco_precision, "runs": opts.runs, "warmup": opts.warmup, "quick": opts.quick,
            "batches": batches, "command": opts.command}
