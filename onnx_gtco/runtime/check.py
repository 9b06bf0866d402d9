"""Run the original and the rewritten model in ORT on the same seeded inputs and compare every output."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from onnx_gtco.errors import CheckError, GtcoError, first_line
from onnx_gtco.ir.load import read_model
from onnx_gtco.runtime.cuda_ep import load_cuda_libraries, require_cuda_ep

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


@dataclass(frozen=True)
class OutputDiff:
    """How far one output of the rewritten model is from the original's."""

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    ok: bool


def _session(model: onnx.ModelProto | str | os.PathLike[str], provider: str, library: bool = False):
    import onnxruntime as ort

    name = PROVIDERS.get(provider)
    if name is None:
        raise CheckError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    if name not in ort.get_available_providers():
        raise CheckError(f"{name} is not available in this onnxruntime ({ort.__version__}); "
                         "install onnxruntime-gpu for --provider cuda")
    if provider == "cuda":
        load_cuda_libraries()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if library:
        from onnx_gtco.plugin.session import LibraryError, make_session

        if isinstance(model, onnx.ModelProto):
            raise CheckError("checking with the library needs the rewritten model as a file (the library is "
                             "found beside it)")
        try:
            session = make_session(model, [name], library=True, sess_options=so)
        except LibraryError as e:
            raise CheckError(str(e)) from None
        except Exception as e:  # ORT raises its own exception types per failure
            raise CheckError(f"onnxruntime cannot load the model with its library: {first_line(e)}"
                             ) from None
    else:
        src = str(model) if not isinstance(model, onnx.ModelProto) else model.SerializeToString()
        try:
            session = ort.InferenceSession(src, so, providers=[name])
        except Exception as e:  # ORT raises its own exception types per failure
            raise CheckError(f"onnxruntime cannot load the model: {first_line(e)}") from None
    return require_cuda_ep(session, "check --provider cuda") if provider == "cuda" else session


def _index_bound(model: onnx.ModelProto, name: str) -> int | None:
    """Rows of the table an integer input indexes through a Gather, so ids stay in range."""
    inits = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == name and n.input[0] in inits:
            return int(inits[n.input[0]].dims[0])
    return None


def make_inputs(model: onnx.ModelProto, seed: int = 0, dims: dict[str, int] | None = None
                ) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input that is not an initializer.

    Floats are standard normal; integer inputs that index a Gather table are uniform ids; inputs named like a mask
    are 0/1 with a padded tail; other integers are 0/1. Symbolic dims take `dims[name]`, default 1.
    """
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    dims = dims or {}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 1) for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.random(shape) < 0.5
        elif "mask" in vi.name.lower():
            m = np.ones(shape, dtype=dtype)
            if m.ndim >= 1 and m.shape[-1] > 1:
                m[..., m.shape[-1] - max(1, m.shape[-1] // 4):] = 0
            feeds[vi.name] = m
        else:
            hi = _index_bound(model, vi.name) or 2
            feeds[vi.name] = rng.integers(0, hi, size=shape).astype(dtype)
    return feeds


@dataclass(frozen=True)
class Deviation:
    """How far one output is from its reference: max |got - ref|, max |got - ref| / max(|ref|, atol), the cosine
    similarity, whether `got` has a NaN where the reference has none (NaN positions shared by both count as 0), and
    whether every element is within |got - ref| <= atol + rtol * |ref| with no such NaN."""

    max_abs: float
    max_rel: float
    cosine: float
    nan_bad: bool
    within: bool


def output_error(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float = 0.0) -> Deviation:
    """The deviation of `got` from `ref` (same shape), computed in float64; relative errors divide by
    max(|ref|, atol) (atol 0: by |ref|, zeros counting as 1e-30)."""
    r64, g64 = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    nan_bad = bool(np.any(np.isnan(g64) & ~np.isnan(r64)))
    diff = np.nan_to_num(np.abs(g64 - r64), nan=0.0)
    rel = diff / np.maximum(np.abs(r64), atol if atol > 0 else 1e-30)
    denom = float(np.linalg.norm(r64) * np.linalg.norm(g64))
    cos = float(np.vdot(r64.ravel(), g64.ravel()) / denom) if denom > 0 else float(np.array_equal(r64, g64))
    within = not nan_bad and bool(np.all(diff <= atol + rtol * np.abs(r64)))
    return Deviation(float(diff.max(initial=0.0)), float(rel.max(initial=0.0)), cos, nan_bad, within)


def compare(original: onnx.ModelProto | str | os.PathLike[str], rewritten: onnx.ModelProto | str | os.PathLike[str],
            provider: str = "cpu", rtol: float = 1e-4, atol: float = 1e-5, samples: int = 1, seed: int = 0,
            dims: dict[str, int] | None = None, library: bool = False) -> list[OutputDiff]:
    """Per-output worst difference over `samples` seeded input sets. An output is ok when every element obeys
    |new - ref| <= atol + rtol * |ref| (numpy.allclose) and no NaN appears where the original has none.

    library=True runs the rewritten model (a file) with its custom-op library registered (plugin.session), so the
    plugin's kernels are what is compared; the default runs its model-local functions.

    Raises:
        CheckError: a model cannot be read or run, or the two models' outputs differ in names.
    """
    try:
        orig_model = read_model(original)
        new_model = read_model(rewritten)
    except GtcoError as e:
        raise CheckError(str(e)) from None
    if [o.name for o in orig_model.graph.output] != [o.name for o in new_model.graph.output]:
        raise CheckError("the two models have different outputs: "
                         f"{[o.name for o in orig_model.graph.output]} vs {[o.name for o in new_model.graph.output]}")
    s_orig = _session(original if not isinstance(original, onnx.ModelProto) else orig_model, provider)
    s_new = _session(rewritten if not isinstance(rewritten, onnx.ModelProto) else new_model, provider, library)
    names = [o.name for o in orig_model.graph.output]
    worst = {n: [0.0, 0.0, 1.0, True] for n in names}
    for k in range(samples):
        feeds = make_inputs(orig_model, seed + k, dims)
        try:
            ref = s_orig.run(None, feeds)
            got = s_new.run(None, feeds)
        except Exception as e:  # ORT runtime failures
            raise CheckError(f"onnxruntime failed while running: {first_line(e)}") from None
        for name, r, g in zip(names, ref, got, strict=True):
            w = worst[name]
            r64, g64 = np.asarray(r, dtype=np.float64), np.asarray(g, dtype=np.float64)
            if r64.shape != g64.shape:
                raise CheckError(f"output {name}: shape {g64.shape} != original {r64.shape}")
            e = output_error(r64, g64, atol, rtol)
            w[0] = max(w[0], e.max_abs)
            w[1] = max(w[1], e.max_rel)
            w[2] = min(w[2], e.cosine)
            w[3] = bool(w[3]) and e.within
    return [OutputDiff(n, w[0], w[1], w[2], bool(w[3])) for n, w in worst.items()]


def format_diffs(diffs: list[OutputDiff]) -> str:
    rows = [f"{'output':<32} {'max_abs':>11} {'max_rel':>11} {'cosine':>10}  result"]
    for d in diffs:
        rows.append(f"{d.name[:32]:<32} {d.max_abs:11.3e} {d.max_rel:11.3e} {d.cosine:10.7f}  "
                    f"{'ok' if d.ok else 'FAIL'}")
    return "\n".join(rows)



