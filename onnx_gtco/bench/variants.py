"""The benchmarked variants of one model at one batch size: the baselines and ours ("gtco").

Each variant is prepared and timed by `run_variant`, which never raises: a variant that is not installed is
"skipped" and one that cannot be built or run is "failed", each with a one-line reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnx_gtco.bench.stats import Accuracy, accuracy
from onnx_gtco.bench.timing import CPU_EP, CUDA_EP, Timed, ep_list, session_options, time_callable, time_ort
from onnx_gtco.errors import VariantSkipped, first_line, install_hint

OURS = "gtco"
BASELINES = ("ort-fp32", "ort-fp16", "ort-transformers-fp16", "torch-compile", "tensorrt")
"""Every baseline `--baselines` can select, in the order they are run and reported."""
TRT_EP = "TensorrtExecutionProvider"


@dataclass
class Context:
    """Everything the variants of one batch share.

    Attributes:
        model: the fp32 original with every dim bound (the accuracy reference).
        path: that model as a file in `workdir`.
        workdir: a scratch folder for converted and rewritten models, removed after the run.
        provider: "cuda" or "cpu".
        precision: what ours is optimized with (fp32, fp16 or bf16).
        target: the GPU target ours is planned for.
        model_type: the ORT transformer optimizer's model type ("vit", "bert", ...).
        feeds: the seeded inputs (onnx_gtco.runtime.check.make_inputs), in the graph inputs' order.
        reference: the fp32 original's outputs on those inputs (reference_outputs: on the CPU EP).
        runs, warmup: timed and untimed runs per variant.
        rewritten: an already optimized model to time as ours (its library beside it), else None.
        torch_program: the model's torch.export program file for torch-compile, else None (onnx2torch).
        ort_model: the file ORT's transformer optimizer gets for ort-transformers-fp16 (the same model in the graph
            form its fusions match, its inputs and outputs the original's), else None (`path`).
        num_heads, hidden_size: that optimizer's num_heads / hidden_size (0: it reads them from the graph).
    """

    model: onnx.ModelProto
    path: Path
    workdir: Path
    provider: str
    precision: str
    target: str
    model_type: str
    feeds: dict[str, np.ndarray]
    reference: list[np.ndarray]
    runs: int
    warmup: int
    rewritten: Path | None = None
    torch_program: Path | None = None
    ort_model: Path | None = None
    num_heads: int = 0
    hidden_size: int = 0
    _fp16: onnx.ModelProto | None = field(default=None, repr=False)

    @property
    def outputs(self) -> dict[str, tuple[int, ...]]:
        """The original's output names -> shapes, in its order (the reference's)."""
        return {o.name: tuple(r.shape) for o, r in zip(self.model.graph.output, self.reference, strict=True)}

    def fp16_model(self) -> onnx.ModelProto:
        """The original converted to fp16 with fp32 inputs and outputs (ORT's float16 converter), made once."""
        if self._fp16 is None:
            from onnxruntime.transformers.float16 import convert_float_to_float16

            self._fp16 = convert_float_to_float16(self.model, keep_io_types=True)
        return self._fp16

    def time(self, make: Callable[[bool], Any]) -> Timed:
        """time_ort over this context's inputs and counts."""
        return time_ort(make, self.feeds, self.provider, self.outputs, self.runs, self.warmup)


@dataclass
class Result:
    """One variant's outcome: status "ok" with its timing and accuracy, else "skipped" or "failed" with a reason."""

    name: str
    status: str
    reason: str = ""
    timed: Timed | None = None
    accuracy: Accuracy | None = None
    note: str = ""


def reference_outputs(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The fp32 original's outputs on `feeds`, on the CPU EP whatever the benchmark's provider (plain fp32 there;
    the CUDA EP may run fp32 MatMuls in TF32), with plain session.run."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), session_options(), providers=[CPU_EP])
    return [np.asarray(o) for o in session.run(None, feeds)]


def _ort_session(src: str | bytes, ctx: Context) -> Callable[[bool], Any]:
    import onnxruntime as ort

    return lambda cuda_graph: ort.InferenceSession(src, session_options(), providers=ep_list(ctx.provider, cuda_graph))


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence a library's Python loggers below ERROR for the duration (ORT's transformer optimizer warns a lot)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


CONTRIB_DOMAINS = ("com.microsoft", "com.microsoft.nchwc")


def session_fusions(model: onnx.ModelProto, provider: str, workdir: Path) -> dict[str, int]:
    """What ORT's own graph optimizations (ORT_ENABLE_ALL, on `provider`) fused in a session of `model`: the
    contrib ops (Attention, SkipLayerNormalization, FusedMatMul, BiasGelu, ...) of the session's optimized graph,
    less those the model had already, by op type.

    Raises:
        onnxruntime's errors when no session can be made.
    """
    import onnxruntime as ort

    def contrib(m: onnx.ModelProto) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in m.graph.node:
            if n.domain in CONTRIB_DOMAINS:
                counts[n.op_type] = counts.get(n.op_type, 0) + 1
        return counts

    so = session_options()
    saved = workdir / "ort-session-optimized.onnx"
    so.optimized_model_filepath = str(saved)
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=ep_list(provider, False))
        after = contrib(onnx.load(str(saved), load_external_data=False))
    finally:
        saved.unlink(missing_ok=True)
        for extra in workdir.glob(f"{saved.name}.*"):
            extra.unlink()
    before = contrib(model)
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v > before.get(k, 0)}


def _fusions_note(model: onnx.ModelProto, ctx: Context) -> str:
    """"ORT session fusions: ..." for a variant's note (never raises: a failure is said in the note)."""
    try:
        fused = session_fusions(model, ctx.provider, ctx.workdir)
    except Exception as e:  # the timed session was made already; this one only reports
        return f"ORT session fusions: unknown ({first_line(e)})"
    return "ORT session fusions: " + (", ".join(f"{k} {v}" for k, v in fused.items()) or "none")


def _ort_fp32(ctx: Context) -> tuple[Timed, str]:
    timed = ctx.time(_ort_session(str(ctx.path), ctx))
    return timed, f"the original model; {_fusions_note(ctx.model, ctx)}"


def _ort_fp16(ctx: Context) -> tuple[Timed, str]:
    half = ctx.fp16_model()
    timed = ctx.time(_ort_session(half.SerializeToString(), ctx))
    return timed, ("onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True); "
                   f"{_fusions_note(half, ctx)}")


def bind_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`model` (changed in place) with every symbolic dim of its graph inputs set to the size its feed has: a
    model exported with dynamic dims then runs with static shapes, as every other variant does."""
    for vi in model.graph.input:
        if vi.name in feeds:
            for d, size in zip(vi.type.tensor_type.shape.dim, feeds[vi.name].shape, strict=False):
                if not d.HasField("dim_value"):
                    d.dim_value = int(size)
    return model


def _ort_transformers_fp16(ctx: Context) -> tuple[Timed, str]:
    from onnxruntime.transformers.optimizer import optimize_model

    src = ctx.ort_model or ctx.path
    with _quiet("onnxruntime.transformers"):
        opt = optimize_model(str(src), model_type=ctx.model_type, num_heads=ctx.num_heads,
                             hidden_size=ctx.hidden_size, use_gpu=ctx.provider == "cuda")
        fused = {k: v for k, v in (opt.get_fused_operator_statistics() or {}).items() if v}
        opt.convert_float_to_float16(keep_io_types=True)
    model = bind_inputs(opt.model, ctx.feeds)  # after the fusions: ORT's own first pass folds static shapes
    timed = ctx.time(_ort_session(model.SerializeToString(), ctx))
    ops = ", ".join(f"{k} {v}" for k, v in sorted(fused.items())) or "none"
    args = f"model_type={ctx.model_type!r}" + (f", num_heads={ctx.num_heads}, hidden_size={ctx.hidden_size}"
                                               if ctx.num_heads else "")
    what = f" of {ctx.ort_model.name}" if ctx.ort_model is not None else ""
    return timed, (f"optimize_model({args}){what} then fp16; fused ops: {ops}; {_fusions_note(model, ctx)}")


def require_placement(ctx: Context, path: Path) -> None:
    """On "cuda": one profiled run of the rewritten model at `path`, made as it is timed (library "auto", CUDA graphs
    off, since a replay has no per-node events), before anything is timed: every fused node ran on the CUDA EP.

    Raises:
        CudaProviderError: the session has no CUDA EP, or a fused node ran elsewhere (named).
    """
    from onnx_gtco.runtime.cuda_ep import profile_events, profiled_options, require_fused_on_cuda
    from onnx_gtco.runtime.session import make_session

    if ctx.provider != "cuda":
        return
    with tempfile.TemporaryDirectory(prefix="gtco-bench-") as tmp:
        session = make_session(path, ep_list(ctx.provider, False), library="auto",
                               sess_options=profiled_options(session_options(), tmp))
        session.run(None, ctx.feeds)
        model = onnx.load(str(path), load_external_data=False)
        require_fused_on_cuda(model, profile_events(session), f"{OURS} {path.name}")


def _gtco(ctx: Context) -> tuple[Timed, str]:
    from onnx_gtco.config import GtcoConfig
    from onnx_gtco.pipeline import optimize_file
    from onnx_gtco.runtime.session import make_session

    if ctx.rewritten is not None:
        require_placement(ctx, ctx.rewritten)
        timed = ctx.time(lambda cg: make_session(ctx.rewritten, ep_list(ctx.provider, cg), library="auto",
                                                 sess_options=session_options()))
        return timed, f"the given rewritten model {ctx.rewritten.name}"
    src = ctx.path  # optimize converts to the precision itself: bench times what a user's optimize writes
    config = GtcoConfig.from_env(target=ctx.target, precision=ctx.precision)
    result, out, _ = optimize_file(src, ctx.workdir / "model.gtco.onnx", ctx.workdir / "model.gtco.report.json",
                                   config, build="auto" if ctx.provider == "cuda" else None)
    require_placement(ctx, out)
    timed = ctx.time(lambda cg: make_session(out, ep_list(ctx.provider, cg), library="auto",
                                             sess_options=session_options()))
    rep = result.report
    lib = "custom-op library registered" if ctx.provider == "cuda" and result.library is not None else (
        "model-local functions (no library on the CPU EP)" if ctx.provider == "cpu" else "model-local functions")
    warn = f"; warnings: {'; '.join(result.warnings)}" if result.warnings else ""
    return timed, (f"{ctx.precision} from {src.name}, {rep['groups_fused']} fused groups, {rep['nodes_before']} -> "
                   f"{rep['nodes_after']} nodes; {lib}{warn}")


def _torch_module(ctx: Context, device: str) -> tuple[Any, str]:
    """(the module torch.compile gets, where it came from): the model's torch.export program when given, else the
    ONNX model converted by onnx2torch."""
    import torch

    if ctx.torch_program is not None:
        try:
            program = torch.export.load(str(ctx.torch_program))
        except Exception as e:  # torch raises its own types for a file that is not a saved program
            raise RuntimeError(f"torch.export.load({ctx.torch_program.name}) failed: {first_line(e)}") from None
        return program.module().to(device), f"torch.export program {ctx.torch_program.name}"
    from onnx2torch import convert

    try:
        return convert(ctx.model).eval().to(device), "onnx2torch module"
    except Exception as e:  # onnx2torch raises NotImplementedError and others per unsupported node
        raise RuntimeError(f"onnx2torch cannot convert the model: {first_line(e)}") from None


def _torch_compile(ctx: Context) -> tuple[Timed, str]:
    if importlib.util.find_spec("torch") is None:
        raise VariantSkipped(f"torch is not installed ({install_hint('torch')})")
    if ctx.torch_program is None and importlib.util.find_spec("onnx2torch") is None:  # before importing torch
        raise VariantSkipped("torch.compile needs the model's torch module: pass --torch-program (the model's "
                             "torch.export.save file), or install onnx2torch to convert the ONNX model "
                             f"({install_hint('onnx2torch')})")
    import torch

    device = "cuda" if ctx.provider == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise VariantSkipped("torch sees no CUDA device")
    module, source = _torch_module(ctx, device)
    compiled = torch.compile(module, mode="max-autotune")
    args = [torch.from_numpy(x).to(device) for x in ctx.feeds.values()]  # the graph inputs, in their order
    half = device == "cuda" and ctx.precision == "fp16"

    def run() -> Any:
        amp = torch.autocast("cuda", dtype=torch.float16) if half else contextlib.nullcontext()
        with torch.inference_mode(), amp:
            return compiled(*args)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        latency, out = time_callable(run, sync, ctx.runs, max(1, ctx.warmup))
    except Exception as e:  # dynamo/inductor errors, or a program exported for other input shapes
        raise RuntimeError(f"torch.compile(mode='max-autotune') of the {source} failed: {first_line(e)}") \
            from None
    outs = out if isinstance(out, (tuple, list)) else [out]
    arrays = [o.detach().float().cpu().numpy() for o in outs]
    graphs = device == "cuda"  # max-autotune replays CUDA graphs (cudagraph trees) on the GPU
    how = f"{source}, torch.compile(mode='max-autotune')" + (", fp16 autocast" if half else "")
    return Timed(latency, arrays, graphs), how


def _tensorrt(ctx: Context) -> tuple[Timed, str]:
    import onnxruntime as ort

    if ctx.provider != "cuda":
        raise VariantSkipped("TensorRT runs on NVIDIA GPUs only (--provider cuda)")
    half = ctx.precision in ("fp16", "bf16")
    if TRT_EP in ort.get_available_providers():
        cache = ctx.workdir / "trt-cache"
        cache.mkdir(exist_ok=True)

        def make(cuda_graph: bool) -> Any:
            opts = {"trt_fp16_enable": "1" if half else "0", "trt_engine_cache_enable": "1",
                    "trt_engine_cache_path": str(cache), "trt_cuda_graph_enable": "1" if cuda_graph else "0"}
            return ort.InferenceSession(str(ctx.path), session_options(), providers=[(TRT_EP, opts), CUDA_EP, CPU_EP])

        return ctx.time(make), f"ORT TensorRT EP{' fp16' if half else ''}"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise VariantSkipped("neither ORT's TensorRT EP (onnxruntime-gpu with TensorRT) nor the tensorrt package is "
                             f"installed ({install_hint('tensorrt')})") from None
    return _tensorrt_package(ctx, half)


def _tensorrt_package(ctx: Context, half: bool) -> tuple[Timed, str]:
    """Build an engine with the tensorrt package's ONNX parser and time execute_async_v3 (torch holds the device
    buffers)."""
    import tensorrt as trt

    try:
        import torch
    except ImportError:
        raise VariantSkipped("the tensorrt package is installed but its runner needs torch for the device "
                             "buffers") from None
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(ctx.model.SerializeToString()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected the model: {errors}")
    config = builder.create_builder_config()
    if half:
        config.set_flag(trt.BuilderFlag.FP16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT could not build an engine for the model")
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    context = engine.create_execution_context()
    buffers: dict[str, Any] = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            t = torch.from_numpy(np.ascontiguousarray(ctx.feeds[name].astype(dtype))).cuda()
        else:
            shape = tuple(context.get_tensor_shape(name))
            t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, device="cuda")
        context.set_tensor_address(name, t.data_ptr())
        buffers[name] = t
    stream = torch.cuda.Stream()
    latency, _ = time_callable(lambda: context.execute_async_v3(stream.cuda_stream), stream.synchronize, ctx.runs,
                               max(1, ctx.warmup))
    outs = [buffers[o.name].float().cpu().numpy() for o in ctx.model.graph.output]
    return Timed(latency, outs, False), f"tensorrt {trt.__version__} engine{' fp16' if half else ''}, no CUDA graph"


_RUNNERS: dict[str, Callable[[Context], tuple[Timed, str]]] = {
    "ort-fp32": _ort_fp32, "ort-fp16": _ort_fp16, "ort-transformers-fp16": _ort_transformers_fp16,
    "torch-compile": _torch_compile, "tensorrt": _tensorrt, OURS: _gtco,
}


def run_variant(name: str, ctx: Context) -> Result:
    """Prepare and time one variant, then compare its outputs with the reference. Never raises for the variant's
    own problems: they become a "skipped" or "failed" Result with the reason."""
    try:
        timed, note = _RUNNERS[name](ctx)
    except VariantSkipped as e:
        return Result(name, "skipped", str(e))
    except Exception as e:  # any library's failure to build or run this variant is reported, not raised
        return Result(name, "failed", first_line(e))
    try:
        acc = accuracy(ctx.reference, timed.outputs)
    except ValueError as e:
        return Result(name, "failed", f"outputs do not match the original's: {e}", timed)
    notes = "; ".join(n for n in (note, timed.note) if n)
    return Result(name, "ok", "", timed, acc, notes)
