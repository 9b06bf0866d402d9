"""Run the original and the rewritten model in ORT on the same seeded inputs and compare every output."""

from __future__ import annotations

import functools
import io
import math
import os
import re
import shlex
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnx_gtco.errors import CheckError, GtcoError, LibraryError, OutputError, first_line
from onnx_gtco.ir.export import writable_parent, write_bytes_atomic
from onnx_gtco.ir.load import read_model
from onnx_gtco.runtime.cuda_ep import (
    load_cuda_libraries,
    profile_events,
    profiled_options,
    require_cuda_ep,
    require_fused_on_cuda,
)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
INTEGER_TYPES = frozenset({onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32,
                           onnx.TensorProto.INT64, onnx.TensorProto.UINT8, onnx.TensorProto.UINT16,
                           onnx.TensorProto.UINT32, onnx.TensorProto.UINT64, onnx.TensorProto.BOOL})
"""Output types check judges by agreement (ids, masks) rather than by tolerances."""


@dataclass(frozen=True)
class OutputDiff:
    """How far one output of the rewritten model is from the original's, over every sample: the max, mean and
    median of the absolute error |new - ref| and of the relative error |new - ref| / max(|ref|, atol), the worst
    cosine similarity, the tolerances it was judged by, and the smallest tolerances that would pass it.

    need_atol is the smallest atol with which every element passes at the given rtol; need_rtol the smallest rtol
    at the given atol (inf: none does, the reference is 0 where the error exceeds atol). Both are inf when the
    rewritten model has a NaN where the original has none (nan_bad).

    An integer (or bool) output (class ids, token ids, masks) is judged by agreement instead: `exact` is set, and
    it is ok when the share of its elements equal to the original's (`agreement`, `equal` of `elements`) is at
    least `min_agreement`; the error statistics are still given, but a size of error means nothing for ids."""

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    ok: bool
    mean_abs: float = float("nan")
    median_abs: float = float("nan")
    mean_rel: float = float("nan")
    median_rel: float = float("nan")
    atol: float = 1e-5
    rtol: float = 1e-4
    need_atol: float = 0.0
    need_rtol: float = 0.0
    nan_bad: bool = False
    exact: bool = False
    agreement: float = 1.0
    min_agreement: float = 1.0
    equal: int = 0
    elements: int = 0
    min_cosine: float | None = None


@dataclass(frozen=True)
class Tolerance:
    """A tolerance with a default and per-output values (Polygraphy's `--atol 1e-5 logits:1e-2`)."""

    default: float
    per_output: Mapping[str, float] = field(default_factory=dict)

    def of(self, name: str) -> float:
        return self.per_output.get(name, self.default)

    def describe(self, flag: str) -> str:
        """e.g. `atol=1e-05 (logits:0.01)`."""
        extra = " ".join(f"{n}:{v:g}" for n, v in self.per_output.items())
        return f"{flag}={self.default:g}" + (f" ({extra})" if extra else "")


PRECISION_KEY = "gtco.precision"
"""Metadata key of the precision optimize computed the fused nodes in (pipeline writes it)."""

DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    # (rtol, atol) of check when --rtol / --atol are not given, by the rewritten model's precision; the reference is
    # the original (fp32) model run on the same inputs.
    # fp32: the fused kernels only reorder fp32 sums.
    "fp32": (1e-4, 1e-5),
    # fp16 rounds every stored weight and activation to 4.9e-4 relative, and a transformer adds those errors up over
    # its layers. BERT-base (the zoo's torchscript export) optimized with --precision fp16 differs from its fp32
    # original by up to 1.03e-2 in last_hidden_state (|ref| up to 4.3; ORT's own float16 converter: 1.05e-2), at a
    # norm-relative error of 1.7e-3; the built-in ViT-tiny, DeiT-S and BERT-tiny need at most 1.4e-3 beyond rtol
    # 1e-2. atol 2e-2 leaves BERT-base a margin of 2. A GELU whose sqrt(2) is 10% off fails ViT-tiny
    # (tests/test_check_precision.py); errors of a few percent in one constant hide below fp16's own.
    "fp16": (1e-2, 2e-2),
    # bf16 keeps 8 significant bits to fp16's 11: 8 times fp16's rounding error, so 8 times fp16's tolerances
    # (BERT-base with --precision bf16: up to 8.6e-2 at a norm-relative error of 1.35e-2).
    "bf16": (8e-2, 1.6e-1),
    # fp8 is judged by cosine (DEFAULT_MIN_COSINE); these are the tolerances its table's need_* columns are read at.
    "fp8": (1e-1, 2.0),
}

DEFAULT_MIN_COSINE: dict[str, float] = {
    # The worst cosine similarity to the original's a float output must keep when neither --rtol nor --atol is
    # given, by precision (where one is listed; elsewhere the tolerances judge). fp8 (E4M3 GEMM operands: 3
    # mantissa bits) moves every element by a share of its row's magnitude, so no elementwise tolerance both passes
    # it and fails a wrong kernel: MiniLM's last_hidden_state (real weights, 8 sentences) needs atol 1.97 at rtol
    # 0.1 at a cosine of 0.9951, ViT-B/16's logits (random weights) keep 0.9907; GEMMs with their activations'
    # negative values clipped to 0 (an onnxruntime optimizer fault fp8.py works around) gave 0.39-0.42.
    "fp8": 0.98,
}


DEFAULT_AGREEMENT: dict[str, float] = {
    # The share of an integer output's elements (ArgMax class ids, token ids, masks) that must equal the original's
    # when --agreement is not given, by the rewritten model's precision.
    # fp32: the fused kernels only reorder fp32 sums, so a changed id is a fault until shown otherwise (logits tied
    # to their last bit can swap; --agreement passes such a model): every id must match.
    "fp32": 1.0,
    # fp16 and bf16 round the logits an ArgMax compares, so classes whose logits are closer than that rounding can
    # swap (ArgMax class ids over 512 rows after an fp16 conversion: one flipped, 0.2%). 99% passes a few such
    # ties and still fails a kernel that computes the wrong thing, which flips far more ids.
    "fp16": 0.99,
    "bf16": 0.99,
    # fp8 rounds the logits' inputs to 3 mantissa bits: a guess, not measured on a model with integer outputs.
    "fp8": 0.95,
}


def defaults_text(what: str) -> str:
    """check's defaults of "rtol", "atol" or "agreement" by precision, as --help states them: e.g. "fp32 1e-4,
    fp16 1e-2, bf16 8e-2; fp8 by cosine (--min-cosine)", "fp32 1, fp16 0.99, bf16 0.99, fp8 0.95" (from
    DEFAULT_TOLERANCES, DEFAULT_MIN_COSINE and DEFAULT_AGREEMENT, which check applies)."""
    if what == "agreement":
        return ", ".join(f"{p} {v:g}" for p, v in DEFAULT_AGREEMENT.items())
    index = ("rtol", "atol").index(what)
    by_cosine = [p for p in DEFAULT_TOLERANCES if p in DEFAULT_MIN_COSINE]
    return ", ".join(f"{p} {_short(tols[index])}" for p, tols in DEFAULT_TOLERANCES.items() if p not in by_cosine) + (
        f"; {', '.join(by_cosine)} by cosine (--min-cosine)" if by_cosine else "")


def _short(v: float) -> str:
    """The shortest scientific notation that reads back as `v`: 1e-4, 2e-2, 1.6e-1."""
    text = next(t for t in (f"{v:.{d}e}" for d in range(17)) if float(t) == v)
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def model_precision(model: onnx.ModelProto) -> str | None:
    """The `gtco.precision` metadata of a model optimize wrote, or None."""
    return next((p.value for p in model.metadata_props if p.key == PRECISION_KEY), None)


def default_tolerances(model: onnx.ModelProto | str | os.PathLike[str]) -> tuple[float, float, str]:
    """check's default (rtol, atol) for a rewritten model, and why: "defaults for precision fp16" from its
    gtco.precision metadata; fp32's when it has none or one check does not know (the reason says so).

    Raises:
        CheckError: the model cannot be read.
    """
    precision, why = _defaults_precision(model)
    return (*DEFAULT_TOLERANCES[precision], why)


def default_min_cosine(model: onnx.ModelProto | str | os.PathLike[str]) -> tuple[float | None, str]:
    """check's default worst cosine of float outputs for a rewritten model (None: the tolerances judge), and why
    (as default_tolerances).

    Raises:
        CheckError: the model cannot be read.
    """
    precision, why = _defaults_precision(model)
    return DEFAULT_MIN_COSINE.get(precision), why


def default_agreement(model: onnx.ModelProto | str | os.PathLike[str]) -> tuple[float, str]:
    """check's default agreement of integer outputs for a rewritten model, and why (as default_tolerances).

    Raises:
        CheckError: the model cannot be read.
    """
    precision, why = _defaults_precision(model)
    return DEFAULT_AGREEMENT[precision], why


def _defaults_precision(model: onnx.ModelProto | str | os.PathLike[str]) -> tuple[str, str]:
    """The precision whose defaults apply to a rewritten model, and why (see default_tolerances).

    Raises:
        CheckError: the model cannot be read.
    """
    if isinstance(model, onnx.ModelProto):
        precision = model_precision(model)
    else:
        path = os.path.abspath(model)
        try:
            st = os.stat(path)
            key: tuple = (path, st.st_mtime_ns, st.st_size)
        except OSError:
            key = (path,)  # read_model names what is wrong with it
        precision = _file_precision(*key)
    if precision in DEFAULT_TOLERANCES:
        return precision, f"defaults for precision {precision}"
    why = "no gtco.precision metadata" if precision is None else f"unknown gtco.precision {precision!r}"
    return "fp32", f"defaults for precision fp32: the rewritten model has {why}"


@functools.lru_cache(maxsize=4)
def _file_precision(path: str, *version: int) -> str | None:
    """The gtco.precision of the model file at `path`, read once per version of the file (its mtime and size in
    `version`): check's tolerances and agreement both ask.

    Raises:
        CheckError: the model cannot be read.
    """
    try:
        return model_precision(read_model(path))
    except GtcoError as e:
        raise CheckError(str(e)) from None


def _tolerance_value(text: str, entry: str, flag: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if flag == "agreement" and not 0 <= v <= 1:  # NaN fails both tests
        raise CheckError(f"--agreement {entry!r}: expected the share of equal elements, a number from 0 to 1 (0.99: "
                         "99%), or NAME:SHARE for one output")
    if not math.isfinite(v) or v < 0:
        raise CheckError(f"--{flag} {entry!r}: expected a number >= 0, or NAME:NUMBER for one output")
    return v


def parse_tolerance(items: Sequence[str] | None, default: float, flag: str) -> Tolerance:
    """`--atol`/`--rtol`/`--agreement` entries as a Tolerance: a bare number sets the default, `NAME:NUMBER` one
    output's value (split at the last colon, so output names may hold colons); a later entry overrides an earlier
    one.

    Raises:
        CheckError: an entry is not a number >= 0 (for agreement: from 0 to 1), or NAME:number, naming the entry.
    """
    per: dict[str, float] = {}
    for it in items or ():
        name, colon, val = it.rpartition(":")
        if not colon:
            default = _tolerance_value(it, it, flag)
        elif not name:
            raise CheckError(f"--{flag} {it!r}: the output name before ':' is empty")
        else:
            per[name] = _tolerance_value(val, it, flag)
    return Tolerance(default, per)


def resolve_tolerances(rtol: Sequence[str] | None, atol: Sequence[str] | None,
                       rewritten: onnx.ModelProto | str | os.PathLike[str]) -> tuple[Tolerance, Tolerance, str]:
    """check's tolerances from its --rtol / --atol entries (parse_tolerance), and where they come from: a flag
    without a bare number takes its default from the rewritten model's precision (default_tolerances), keeping
    any NAME:TOL it has. The text says which: "given", "defaults for precision fp16", or "rtol given, atol default
    for precision fp16".

    Raises:
        CheckError: a malformed entry (before the model is read), or the model cannot be read.
    """
    given = {flag: any(":" not in it for it in items or ()) for flag, items in (("rtol", rtol), ("atol", atol))}
    parsed = {flag: parse_tolerance(items, 0.0, flag) for flag, items in (("rtol", rtol), ("atol", atol))}
    if all(given.values()):
        return parsed["rtol"], parsed["atol"], "given"
    d_rtol, d_atol, why = default_tolerances(rewritten)
    defaults = {"rtol": d_rtol, "atol": d_atol}
    out = {flag: tol if given[flag] else Tolerance(defaults[flag], tol.per_output) for flag, tol in parsed.items()}
    if any(given.values()):
        mine = next(flag for flag, g in given.items() if g)
        other = next(flag for flag, g in given.items() if not g)
        why = f"{mine} given, {other} {why.replace('defaults', 'default', 1)}"
    return out["rtol"], out["atol"], why


def resolve_agreement(items: Sequence[str] | None, rewritten: onnx.ModelProto | str | os.PathLike[str]
                      ) -> tuple[Tolerance, str]:
    """check's agreement of integer outputs from its --agreement entries, and where it comes from: "given", or, for
    want of a bare number, the default for the rewritten model's precision (default_agreement), keeping any
    NAME:SHARE.

    Raises:
        CheckError: a malformed entry (before the model is read), or the model cannot be read.
    """
    parsed = parse_tolerance(items, 1.0, "agreement")
    if any(":" not in it for it in items or ()):
        return parsed, "given"
    default, why = default_agreement(rewritten)
    return Tolerance(default, parsed.per_output), why.replace("defaults", "default", 1)


def _as_tolerance(t: float | Tolerance, flag: str) -> Tolerance:
    tol = t if isinstance(t, Tolerance) else Tolerance(float(t))
    for name, v in (("", tol.default), *tol.per_output.items()):
        if not math.isfinite(v) or v < 0 or (flag == "agreement" and v > 1):
            bound = "from 0 to 1" if flag == "agreement" else ">= 0"
            raise CheckError(f"{flag} {f'{name}:' if name else ''}{v!r} is not a number {bound}")
    return tol


def _session(model: onnx.ModelProto | str | os.PathLike[str], provider: str, library: bool = False,
             profile_dir: str | None = None):
    """A session of `model` on `provider` (its CUDA EP proven on "cuda"), profiled into `profile_dir` if given."""
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
    if profile_dir is not None:
        profiled_options(so, profile_dir)
    if library:
        from onnx_gtco.runtime.session import make_session

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


def _errors(r64: np.ndarray, g64: np.ndarray, atol: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """|got - ref| (0 where either is NaN), that over max(|ref|, atol), and whether `got` has a NaN the reference
    has not."""
    nan_bad = bool(np.any(np.isnan(g64) & ~np.isnan(r64)))
    diff = np.nan_to_num(np.abs(g64 - r64), nan=0.0, posinf=np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = diff / np.fmax(np.abs(r64), atol if atol > 0 else 1e-30)
    return diff, np.nan_to_num(rel, nan=np.inf, posinf=np.inf), nan_bad


def _within(diff: np.ndarray, r64: np.ndarray, atol: float, rtol: float) -> bool:
    return bool(np.all(diff <= atol + rtol * np.abs(r64)))


def _cosine(r64: np.ndarray, g64: np.ndarray) -> float:
    denom = float(np.linalg.norm(r64) * np.linalg.norm(g64))
    return float(np.vdot(r64.ravel(), g64.ravel()) / denom) if denom > 0 else float(np.array_equal(r64, g64))


def _needed(diff: np.ndarray, r64: np.ndarray, atol: float, rtol: float) -> tuple[float, float]:
    """The smallest atol that passes every element at `rtol`, and the smallest rtol at `atol` (inf: none does,
    the reference is 0 or NaN where the error exceeds atol)."""
    ref = np.abs(r64)
    with np.errstate(invalid="ignore"):
        need_atol = float(np.fmax.reduce((diff - rtol * ref).ravel(), initial=0.0))
    excess = diff - atol
    over = excess > 0
    if not over.any():
        return need_atol, 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = excess[over] / ref[over]
    return need_atol, float(np.nan_to_num(ratio, nan=np.inf, posinf=np.inf).max())


def output_error(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float = 0.0) -> Deviation:
    """The deviation of `got` from `ref` (same shape), computed in float64; relative errors divide by
    max(|ref|, atol) (atol 0: by |ref|, zeros counting as 1e-30)."""
    r64, g64 = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    diff, rel, nan_bad = _errors(r64, g64, atol)
    within = not nan_bad and _within(diff, r64, atol, rtol)
    return Deviation(float(diff.max(initial=0.0)), float(rel.max(initial=0.0)), _cosine(r64, g64), nan_bad, within)


SAMPLE_KEY = re.compile(r"sample(\d+)/(.+)", re.S)
"""Key of an input in a --save-inputs file of several samples: `sample<K>/<input name>`, K from 0. A file of one
sample keys each array by the input's name alone."""


def _model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def inputs_npz(samples: Sequence[Mapping[str, np.ndarray]]) -> bytes:
    """The bytes of an .npz holding `samples` (one: keys are the input names; more: `sample<K>/<name>`)."""
    if len(samples) == 1:
        arrays = dict(samples[0])
    else:
        arrays = {f"sample{k}/{n}": a for k, feeds in enumerate(samples) for n, a in feeds.items()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:  # np.savez(**arrays) would clash
        for key, a in arrays.items():                                          # on an input named "file"
            with zf.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(a), allow_pickle=False)
    return buf.getvalue()


def _read_npz(path: str | os.PathLike[str], flag: str = "--load-inputs") -> dict[str, np.ndarray]:
    where = f"{flag} {os.fspath(path)}"
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise CheckError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise CheckError(f"{where}: is a directory") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckError(f"{where}: not an .npz of arrays: {first_line(e)}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise CheckError(f"{where}: a single .npy array, not an .npz of named inputs")
    try:
        with z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckError(f"{where}: cannot read its arrays: {first_line(e)}") from None
    if not arrays:
        raise CheckError(f"{where}: holds no arrays")
    return arrays


def _shape_text(vi: onnx.ValueInfoProto) -> str:
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in vi.type.tensor_type.shape.dim]
    return "[" + ", ".join(dims) + "]"


def load_inputs(path: str | os.PathLike[str], model: onnx.ModelProto, flag: str = "--load-inputs"
                ) -> list[dict[str, np.ndarray]]:
    """The input samples of an .npz (as --save-inputs writes it, or keyed by input name for one sample), checked
    against the model's inputs. `flag` names the option that gave the file in the errors.

    Raises:
        CheckError: the file cannot be read, or a sample lacks an input, has one the model does not take, or one
            of another dtype, rank or fixed dim than the model's (one line naming the input).
    """
    where = f"{flag} {os.fspath(path)}"
    arrays = _read_npz(path, flag)
    vis = _model_inputs(model)
    names = [vi.name for vi in vis]
    listed = ", ".join(names) or "none"
    keyed_by_sample = any(k not in names and SAMPLE_KEY.fullmatch(k) for k in arrays)
    if not keyed_by_sample:
        samples: dict[int, dict[str, np.ndarray]] = {0: arrays}
    else:
        samples = {}
        for key, a in arrays.items():
            m = SAMPLE_KEY.fullmatch(key)
            if m is None and key in names:
                raise CheckError(f"{where}: {key!r} is keyed by the input's name, the other arrays by "
                                 "sample<K>/<input>; use one form")
            if m is None:
                raise CheckError(f"{where}: {key!r} is not an input of the model (its inputs: {listed}), nor "
                                 "sample<K>/<input>")
            samples.setdefault(int(m.group(1)), {})[m.group(2)] = a
        gap = next((k for k in range(len(samples)) if k not in samples), None)
        if gap is not None:
            raise CheckError(f"{where}: samples {', '.join(map(str, sorted(samples)))} given, sample{gap} is missing")
    return [checked_sample(samples[k], model, where, f"sample{k}/" if keyed_by_sample else "") for k in sorted(samples)]


def checked_sample(feeds: Mapping[str, np.ndarray], model: onnx.ModelProto, where: str, tag: str = ""
                   ) -> dict[str, np.ndarray]:
    """One sample's feeds, in the order of `model`'s inputs, checked against them.

    Raises:
        CheckError: `where` and one line naming the input (`tag` + its name): one the model does not take, one
            missing, or one of another dtype, rank or fixed dim than the model's.
    """
    vis = _model_inputs(model)
    names = [vi.name for vi in vis]
    listed = ", ".join(names) or "none"
    for name in feeds:
        if name not in names:
            raise CheckError(f"{where}: input {tag + name!r} is not an input of the model (its inputs: {listed})")
    for vi in vis:
        if vi.name not in feeds:
            raise CheckError(f"{where}: input {tag + vi.name!r} is missing (the model's inputs: {listed})")
        a = feeds[vi.name]
        tt = vi.type.tensor_type
        want = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if a.dtype != want:
            raise CheckError(f"{where}: input {tag + vi.name!r} is {a.dtype}, the model takes {want}")
        if tt.HasField("shape"):
            dims = list(tt.shape.dim)
            if a.ndim != len(dims):
                raise CheckError(f"{where}: input {tag + vi.name!r} has rank {a.ndim} (shape {list(a.shape)}), "
                                 f"the model takes rank {len(dims)} {_shape_text(vi)}")
            for axis, d in enumerate(dims):
                if d.HasField("dim_value") and a.shape[axis] != d.dim_value:
                    raise CheckError(f"{where}: input {tag + vi.name!r} has shape {list(a.shape)}, the model "
                                     f"takes {_shape_text(vi)}")
    return {vi.name: feeds[vi.name] for vi in vis}


def compare(original: onnx.ModelProto | str | os.PathLike[str], rewritten: onnx.ModelProto | str | os.PathLike[str],
            provider: str = "cpu", rtol: float | Tolerance = 1e-4, atol: float | Tolerance = 1e-5, samples: int = 1,
            seed: int = 0, dims: dict[str, int] | None = None, library: bool = False, *,
            inputs: Sequence[Mapping[str, np.ndarray]] | str | os.PathLike[str] | None = None,
            save_inputs: str | os.PathLike[str] | None = None, agreement: float | Tolerance = 1.0,
            min_cosine: float | None = None) -> list[OutputDiff]:
    """Per-output errors over `samples` seeded input sets. A float output is ok when every element obeys
    |new - ref| <= atol + rtol * |ref| (numpy.allclose), or with `min_cosine` when its worst cosine similarity to
    the original's is at least that, and no NaN appears where the original has none; an integer or bool output
    (ids, masks) when at least the share `agreement` of its elements equal the original's.

    rtol, atol and agreement are one value for every output or a Tolerance with per-output values
    (parse_tolerance).
    `inputs` replaces the seeded inputs (then samples, seed and dims are unused): a list of feeds, or the path of
    an .npz (load_inputs). `save_inputs` writes the inputs used to that .npz (inputs_npz's keys), atomically and
    only once both models ran on them.

    library=True runs the rewritten model (a file) with its custom-op library registered (runtime.session), so the
    plugin's kernels are what is compared; the default runs its model-local functions.

    Raises:
        CheckError: a model or the inputs cannot be read or run, the two models' outputs differ in names, a
            tolerance names an output the models do not have (an agreement, one that is not an integer output), or
            samples < 1 or seed < 0.
        CudaProviderError: on "cuda", ORT gave a session no CUDA EP, or a fused node of the rewritten model did
            not run on it (its profile, runtime.cuda_ep.require_fused_on_cuda).
        OutputError: save_inputs cannot be written.
    """
    rt, at, ag = _as_tolerance(rtol, "rtol"), _as_tolerance(atol, "atol"), _as_tolerance(agreement, "agreement")
    if inputs is None and samples < 1:
        raise CheckError(f"samples must be at least 1, got {samples}")
    if inputs is None and seed < 0:
        raise CheckError(f"seed must be >= 0, got {seed}")
    if save_inputs is not None:
        try:
            writable_parent(save_inputs)
        except OutputError as e:
            raise OutputError(f"--save-inputs {e}") from None
    try:
        orig_model = read_model(original)
        new_model = read_model(rewritten)
    except GtcoError as e:
        raise CheckError(str(e)) from None
    names = [o.name for o in orig_model.graph.output]
    if names != [o.name for o in new_model.graph.output]:
        raise CheckError(f"the two models have different outputs: {names} vs "
                         f"{[o.name for o in new_model.graph.output]}")
    _check_tolerances(orig_model, names, rt, at, ag)
    if inputs is None:
        feeds_list = [make_inputs(orig_model, seed + k, dims) for k in range(samples)]
    elif isinstance(inputs, (str, os.PathLike)):
        feeds_list = load_inputs(inputs, orig_model)
    else:
        feeds_list = [dict(f) for f in inputs]
    s_orig = _session(original if not isinstance(original, onnx.ModelProto) else orig_model, provider)
    # on the CUDA EP, ORT's profile of the rewritten model's runs shows where each fused node ran
    placement = tempfile.TemporaryDirectory(prefix="gtco-check-") if provider == "cuda" else None
    s_new = _session(rewritten if not isinstance(rewritten, onnx.ModelProto) else new_model, provider, library,
                     placement.name if placement is not None else None)
    acc: dict[str, dict] = {n: {"abs": [], "rel": [], "cos": 1.0, "nan": False, "ok": True, "need_atol": 0.0,
                                "need_rtol": 0.0, "exact": False, "equal": 0, "elements": 0} for n in names}
    for feeds in feeds_list:
        try:
            ref = s_orig.run(None, feeds)
            got = s_new.run(None, feeds)
        except Exception as e:  # ORT runtime failures
            raise CheckError(f"onnxruntime failed while running: {first_line(e)}") from None
        for name, r, g in zip(names, ref, got, strict=True):
            _accumulate(acc[name], name, r, g, at.of(name), rt.of(name))
    if placement is not None:
        with placement:
            require_fused_on_cuda(new_model, profile_events(s_new), "check --provider cuda")
    if save_inputs is not None:
        write_bytes_atomic(inputs_npz(feeds_list), save_inputs)
    return [_output_diff(n, acc[n], rt, at, ag, min_cosine) for n in names]

def _check_tolerances(orig_model: onnx.ModelProto, names: Sequence[str], rt: Tolerance, at: Tolerance,
                      ag: Tolerance) -> None:
    """CheckError where a tolerance names an output the models do not have, or an agreement a float output."""
    for flag, tol in (("rtol", rt), ("atol", at), ("agreement", ag)):
        unknown = [n for n in tol.per_output if n not in names]
        if unknown:
            raise CheckError(f"--{flag} {unknown[0]}:{tol.per_output[unknown[0]]:g}: the models have no output "
                             f"{unknown[0]!r} (their outputs: {', '.join(names)})")
    declared = {o.name: o.type.tensor_type.elem_type for o in orig_model.graph.output}
    floats = [n for n in ag.per_output if declared[n] and declared[n] not in INTEGER_TYPES]
    if floats:
        raise CheckError(f"--agreement {floats[0]}:{ag.per_output[floats[0]]:g}: output {floats[0]!r} is "
                         f"{helper.tensor_dtype_to_np_dtype(declared[floats[0]])}, and agreement judges integer "
                         "outputs only; give a float output --atol / --rtol")


def _accumulate(a: dict[str, Any], name: str, r: Any, g: Any, o_atol: float, o_rtol: float) -> None:
    """Add one sample of output `name` (original `r`, rewritten `g`) to its errors so far `a`."""
    r64, g64 = np.asarray(r, dtype=np.float64), np.asarray(g, dtype=np.float64)
    if r64.shape != g64.shape:
        raise CheckError(f"output {name}: shape {g64.shape} != original {r64.shape}")
    diff, rel, nan_bad = _errors(r64, g64, o_atol)
    a["abs"].append(diff.ravel())
    a["rel"].append(rel.ravel())
    a["cos"] = min(a["cos"], _cosine(r64, g64))
    if np.issubdtype(np.asarray(r).dtype, np.integer) or np.asarray(r).dtype == np.bool_:
        a["exact"] = True
        a["equal"] += int(np.count_nonzero(np.asarray(r) == np.asarray(g)))
        a["elements"] += int(r64.size)
        return
    need_atol, need_rtol = _needed(diff, r64, o_atol, o_rtol)
    a["nan"] = a["nan"] or nan_bad
    a["ok"] = a["ok"] and not nan_bad and _within(diff, r64, o_atol, o_rtol)
    a["need_atol"] = max(a["need_atol"], need_atol)
    a["need_rtol"] = max(a["need_rtol"], need_rtol)


def _output_diff(n: str, a: dict[str, Any], rt: Tolerance, at: Tolerance, ag: Tolerance,
                 min_cosine: float | None = None) -> OutputDiff:
    """The verdict on output `n` from its errors over every sample."""
    d, r = np.concatenate(a["abs"]), np.concatenate(a["rel"])
    stats = [float(f(x)) if x.size else 0.0 for x in (d, r) for f in (np.max, np.mean, np.median)]
    inf = float("inf")
    share = a["equal"] / a["elements"] if a["elements"] else 1.0
    if a["exact"]:
        ok = share >= ag.of(n)
    elif min_cosine is not None:
        ok = not a["nan"] and a["cos"] >= min_cosine
    else:
        ok = a["ok"]
    return OutputDiff(n, stats[0], stats[3], a["cos"], ok, stats[1], stats[2], stats[4], stats[5],
                      at.of(n), rt.of(n), inf if a["nan"] else a["need_atol"],
                      inf if a["nan"] else a["need_rtol"], a["nan"], a["exact"], share, ag.of(n), a["equal"],
                      a["elements"], None if a["exact"] else min_cosine)

def round_up(x: float) -> str:
    """`x` rounded up to two significant digits, e.g. 3.04e-3 -> '3.1e-3', so that a tolerance of that text passes
    what one of `x` passes."""
    if x <= 0:
        return "0"
    x *= 1 + 1e-9  # margin for the rounding of atol + rtol * |ref|
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    m = math.ceil(x / step)
    while True:
        text = re.sub(r"e\+?(-?)0*(\d)", r"e\1\2", f"{m * step:.1e}")
        if float(text) >= x:
            return text
        m += 1


def round_down(share: float) -> str:
    """A share rounded down to four decimals, e.g. 511/512 -> '0.998', so that an agreement of that text passes
    what one of `share` passes."""
    k = math.floor(share * 10**4)
    while k > 0 and k / 10**4 > share:  # share * 10**4 rounded up
        k -= 1
    return f"{k / 10**4:.4f}".rstrip("0").rstrip(".")


def _verdict(d: OutputDiff) -> str:
    if d.ok:
        return "ok"
    if d.exact:
        return f"FAIL (would pass with --agreement {shlex.quote(f'{d.name}:{round_down(d.agreement)}')})"
    if d.nan_bad:
        return "FAIL (NaN where the original has none: no tolerance passes)"
    if d.min_cosine is not None:
        return f"FAIL (cosine {d.cosine:.4f} below {d.min_cosine:g})"
    fixes = [f"--{flag} {shlex.quote(f'{d.name}:{round_up(v)}')}"
             for flag, v in (("atol", d.need_atol), ("rtol", d.need_rtol)) if math.isfinite(v)]
    if not fixes:
        return "FAIL (no atol or rtol passes it)"
    return "FAIL (would pass with " + " or ".join(fixes) + ")"


def format_diffs(diffs: list[OutputDiff]) -> str:
    """A table of each output's absolute and relative error (max, mean, median over all samples), worst cosine
    and verdict, or for an integer output its equal elements and the agreement it needs; a failing output's verdict
    names the --atol, --rtol or --agreement that would pass it."""
    cols = ("max_abs", "mean_abs", "med_abs", "max_rel", "mean_rel", "med_rel")
    rows = [f"{'output':<32} " + " ".join(f"{c:>10}" for c in cols) + f" {'cosine':>10}  result"]
    width = 11 * (len(cols) + 1) - 1
    for d in diffs:
        if d.exact:  # ids: how many are equal, not how far apart they are
            what = f"{d.equal} of {d.elements} elements equal ({d.agreement:.3%}), needs {d.min_agreement:.3%}"
            rows.append(f"{d.name[:32]:<32} {what:>{width}}  {_verdict(d)}")
            continue
        vals = (d.max_abs, d.mean_abs, d.median_abs, d.max_rel, d.mean_rel, d.median_rel)
        rows.append(f"{d.name[:32]:<32} " + " ".join(f"{v:10.3e}" for v in vals) + f" {d.cosine:10.7f}  "
                    f"{_verdict(d)}")
    return "\n".join(rows)
