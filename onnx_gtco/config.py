"""One frozen configuration, built once at the edge (CLI or API caller), the GPU targets we plan for, the ranges
of a model's symbolic dims (`--dynamic`, the `gtco.dynamic` metadata), and every read of the environment: no other
module reads os.environ (tests/test_layers.py checks it)."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_gtco.errors import GtcoError

if TYPE_CHECKING:
    import onnx


@dataclass(frozen=True)
class Target:
    """One GPU the planner plans for: its published peaks and resources (the data sheet), and the arch of the
    kernels it runs. The estimate of a kernel on it (kernels' `estimate_us`, onnx_gtco.calibration) combines these
    with the constants fitted to the GPU's measured kernel times, where a calibration of it ships, or with the
    estimate's defaults (their values fitted on another GPU, transferred) where none does.

    Attributes:
        name: the target's name, e.g. "h200"; an arch name ("sm_80", "sm_90") names that arch's data-sheet GPU.
        gpu: the GPU these numbers are for.
        arch: the compute capability of the kernels it runs, "sm_80" or "sm_90".
        tc_tflops: dense fp16/bf16 Tensor Core peak (fp32 accumulate), TFLOP/s.
        tf32_tflops: dense TF32 Tensor Core peak, TFLOP/s (fp32 GEMMs).
        cuda_tflops: fp32 CUDA-core (FMA) peak, TFLOP/s.
        dram_gbps: DRAM bandwidth, GB/s.
        smem_kib: shared memory a block may use, KiB.
        sms: streaming multiprocessors.
        max_threads_per_sm: threads resident on one SM at once.
        l2_mib: L2 cache, MiB.
    """

    name: str
    gpu: str
    arch: str
    tc_tflops: float
    tf32_tflops: float
    cuda_tflops: float
    dram_gbps: float
    smem_kib: int
    sms: int
    max_threads_per_sm: int
    l2_mib: float


# Data-sheet numbers, dense (no sparsity): A100-SXM4-80GB, H100-SXM5-80GB and H200-SXM-141GB (the same GH100 die
# and clocks as the H100, with 4.8 TB/s of HBM3e; both SXM parts enable 50 MB of the die's 60 MB of L2).
GPUS: dict[str, Target] = {
    "a100": Target("a100", "A100-SXM4-80GB", "sm_80", 312.0, 156.0, 19.5, 2039.0, 163, 108, 2048, 40.0),
    "h100": Target("h100", "H100-SXM5-80GB", "sm_90", 989.4, 494.7, 66.9, 3350.0, 227, 132, 2048, 50.0),
    "h200": Target("h200", "H200-SXM-141GB", "sm_90", 989.4, 494.7, 66.9, 4800.0, 227, 132, 2048, 50.0),
}
"""The GPUs the planner knows by name."""

ARCH_GPUS: dict[str, str] = {"sm_80": "a100", "sm_90": "h100"}
"""An arch as a target: the GPU whose data sheet stands for it."""

TARGETS: dict[str, Target] = {**GPUS, **{arch: dataclasses.replace(GPUS[g], name=arch)
                                          for arch, g in ARCH_GPUS.items()}}
"""Every target name --target takes: the GPUs, and the archs (each its data-sheet GPU's numbers, under the arch's
name). Kernel code keyed by arch (shared memory limits, SM counts) reads TARGETS[arch]."""

GPU_NAMES: tuple[tuple[str, str], ...] = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))
"""A word of the name nvidia-smi reports -> the target of that GPU."""

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
FP8_ARCHS = frozenset({"sm_90"})
"""The target archs with FP8 (E4M3) Tensor Cores among those we build for: Hopper. Ampere (sm_80) has none."""
DEFAULT_FP8_BUDGET = 0.1
"""--fp8-budget's default: the largest relative error ||Q(a) Q(b) - a b|| / ||a b|| of a GEMM's product over the
calibration samples for which it computes on E4M3 operands (onnx_gtco.fp8)."""

DEFAULT_TARGET = "sm_90"


@functools.cache
def local_gpu() -> tuple[str, str] | None:
    """The name and compute capability ("sm_XY") of the first GPU nvidia-smi lists; None without nvidia-smi,
    without a GPU, or with CUDA_VISIBLE_DEVICES hiding every device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
    m = re.fullmatch(r"(?:(.*),\s*)?(\d+)\.(\d+)", lines[0].strip()) if lines else None
    return ((m[1] or "").strip(), f"sm_{m[2]}{m[3]}") if m else None


def local_gpu_arch() -> str | None:
    """The compute capability of the first GPU nvidia-smi lists, as "sm_XY" (local_gpu), or None."""
    gpu = local_gpu()
    return gpu[1] if gpu else None


def target_for_arch(arch: str) -> str | None:
    """The target whose kernels run best on a GPU of compute capability `arch` ("sm_86" -> "sm_80": Ampere and Ada
    get the sm_80 instances, Hopper 9.x the sm_90 ones); None for an arch we have no kernels for."""
    m = re.fullmatch(r"sm_(\d+?)(\d)a?", arch)
    major = int(m[1]) if m else 0
    return {8: "sm_80", 9: "sm_90"}.get(major)


def target_for_gpu(name: str, arch: str) -> str | None:
    """The target of a GPU as nvidia-smi names it: the GPU itself where the planner knows it by name ("NVIDIA
    H200" -> "h200"), else its arch's data-sheet target (target_for_arch); None for an arch without kernels."""
    arch_target = target_for_arch(arch)
    for word, target in GPU_NAMES:
        if re.search(rf"\b{word}\b", name.upper()) and arch_target == GPUS[target].arch:
            return target
    return arch_target


def default_target() -> tuple[str, str]:
    """The target to plan for when none is given (--target, GTCO_TARGET), and a sentence saying why."""
    gpu = local_gpu()
    if gpu is None:
        return DEFAULT_TARGET, f"no GPU visible: planning for {DEFAULT_TARGET} (pass --target to choose)"
    name, arch = gpu
    target = target_for_gpu(name, arch)
    what = f"{name} ({arch})" if name else arch
    if target is None:
        return DEFAULT_TARGET, (f"the local GPU is {what}, which has no kernels of its own: planning for "
                                f"{DEFAULT_TARGET} (pass --target to choose)")
    return target, f"the local GPU is {what}: planning for {target}"


def target_note(explicit: str | None) -> str | None:
    """Where the target came from when the user did not name one (None when --target or GTCO_TARGET did)."""
    if explicit is not None or "GTCO_TARGET" in os.environ:
        return None
    return default_target()[1]

# --- the environment: the variables other modules act on, each read by one function here ---------------------------

CACHE_DIR_ENV = "GTCO_CACHE_DIR"
SANITIZE_ENV = "GTCO_SANITIZE"
TUNE_STORAGE_ENV = "GTCO_TUNE_STORAGE"
TUNE_DELAY_ENV = "GTCO_TUNE_TEST_DELAY_S"  # seconds each analytical measurement sleeps (tests of workers only)
TUNE_RECORDS_ENV = "GTCO_TUNE_RECORDS_DIR"  # a folder of tuning records in place of the shipped ones
ORT_INCLUDE_ENV = "ORT_INCLUDE_DIR"
CUBLASLT_INCLUDE_ENV = "GTCO_CUBLASLT_INCLUDE"
CALIBRATION_DIR_ENV = "GTCO_CALIBRATION_DIR"  # a folder of calibration files read before the shipped ones


def cache_base() -> Path:
    """The user cache folder: `$GTCO_CACHE_DIR`, else `$XDG_CACHE_HOME/onnx-gtco`, else `~/.cache/onnx-gtco`
    (kernels.toolchain.cache_root adds the sanitizer's subfolder)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "onnx-gtco"


def sanitizer_env() -> str:
    """$GTCO_SANITIZE, stripped; "" when unset (kernels.toolchain.sanitizer checks the name)."""
    return os.environ.get(SANITIZE_ENV, "").strip()


def compiler_override(env: str) -> str | None:
    """The compiler the variable `env` ("NVCC", "CXX") names in place of the one on PATH; None when unset or empty."""
    return os.environ.get(env) or None


def compiler_environ() -> dict[str, str] | None:
    """The environment for a compiler run under a sanitizer: this process's without LD_PRELOAD (the sanitizer's
    runtime, preloaded for the tests, crashes nvcc); None (inherit it unchanged) when LD_PRELOAD is unset or empty."""
    if not os.environ.get("LD_PRELOAD"):
        return None
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


PDL_ENV = "GTCO_PDL"


def pdl_env() -> str | None:
    """$GTCO_PDL: "0" turns programmatic dependent launch off in the sessions onnx-gtco makes (the library's
    session config entry gtco.pdl), "1" leaves it on; None when unset or empty (the library's default: on).

    Raises:
        ValueError: another value.
    """
    v = os.environ.get(PDL_ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"${PDL_ENV}={v!r}: use 0 (off) or 1 (on)")
    return v or None


def calibration_dir_env() -> str | None:
    """$GTCO_CALIBRATION_DIR, a folder of calibration files (onnx_gtco.calibration) read before the shipped ones; None
    when unset or empty."""
    return os.environ.get(CALIBRATION_DIR_ENV) or None


def tune_storage_env() -> str | None:
    """$GTCO_TUNE_STORAGE, the tuning storage's URL when no --storage is given; None when unset or empty."""
    return os.environ.get(TUNE_STORAGE_ENV) or None


def tune_records_env() -> str | None:
    """$GTCO_TUNE_RECORDS_DIR, the folder of tuning records (tune.records) in place of the shipped ones; None when
    unset or empty."""
    return os.environ.get(TUNE_RECORDS_ENV) or None


def tune_test_delay_s() -> float:
    """$GTCO_TUNE_TEST_DELAY_S: seconds each analytical measurement sleeps (a test hook), 0 when unset or empty.

    Raises:
        ValueError: the value is not a number.
    """
    return float(os.environ.get(TUNE_DELAY_ENV, "0") or 0)


def ort_include_override() -> str | None:
    """$ORT_INCLUDE_DIR, a folder with the ONNX Runtime C/C++ API headers in place of the downloaded ones; None when
    unset or empty."""
    return os.environ.get(ORT_INCLUDE_ENV) or None


def cublaslt_include_override() -> str | None:
    """$GTCO_CUBLASLT_INCLUDE, a folder with cublasLt.h in place of the nvidia-cublas package's or the fetched one;
    None when unset or empty."""
    return os.environ.get(CUBLASLT_INCLUDE_ENV) or None


DynamicRanges = tuple[tuple[str, int, int], ...]
"""Declared ranges of symbolic dims: (dim name, lo, hi) per dim, sorted by name."""

DEFAULT_DYNAMIC_RANGE = (1, 512)
"""The range of a symbolic dim that neither `--dynamic` nor the model's `gtco.dynamic` metadata declares."""


def parse_dynamic(text: str) -> DynamicRanges:
    """`"seq=1:512,batch=1:64"` -> (("batch", 1, 64), ("seq", 1, 512)): the `--dynamic` option and the
    `gtco.dynamic` metadata value. An empty string is no range.

    Raises:
        GtcoError: an entry is not NAME=LO:HI with integers 1 <= LO <= HI, or a name repeats.
    """
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, eq, bounds = item.partition("=")
        lo, colon, hi = bounds.partition(":")
        name = name.strip()
        if not (eq and colon and name and lo.strip().isdigit() and hi.strip().isdigit()):
            raise GtcoError(f"dynamic range {item!r}: expected NAME=LO:HI with integers, e.g. seq=1:512")
        out.append((name, int(lo), int(hi)))
    return check_dynamic(out)


def check_dynamic(ranges: object) -> DynamicRanges:
    """Validated ranges, sorted by name (see GtcoConfig.dynamic).

    Raises:
        GtcoError: not (name, lo, hi) triples, lo < 1, lo > hi, or a name given twice.
    """
    out: list[tuple[str, int, int]] = []
    for r in ranges or ():  # type: ignore[attr-defined]
        if not (isinstance(r, tuple | list) and len(r) == 3 and isinstance(r[0], str) and r[0]
                and all(isinstance(v, int) and not isinstance(v, bool) for v in r[1:])):
            raise GtcoError(f"dynamic range {r!r}: expected (dim name, lo, hi) with integer bounds")
        name, lo, hi = r
        if lo < 1:
            raise GtcoError(f"dynamic range {name}={lo}:{hi}: the lower bound must be >= 1")
        if lo > hi:
            raise GtcoError(f"dynamic range {name}={lo}:{hi}: the lower bound exceeds the upper bound")
        out.append((name, lo, hi))
    names = [r[0] for r in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise GtcoError(f"dynamic range for {', '.join(twice)} given more than once")
    return tuple(sorted(out))


def format_dynamic(ranges: DynamicRanges) -> str:
    """(("batch", 1, 64), ("seq", 1, 512)) -> "batch=1:64,seq=1:512" (names sorted): parse_dynamic's inverse."""
    return ",".join(f"{n}={lo}:{hi}" for n, lo, hi in sorted(ranges))


DYNAMIC_METADATA_KEY = "gtco.dynamic"
"""The metadata key of a model's ranges (format_dynamic's text): the rewritten model carries the ranges that apply."""


@dataclass(frozen=True)
class Ranges:
    """The ranges of a model's symbolic dims and where each came from.

    Attributes:
        ranges: (dim name, lo, hi) sorted by name, one per symbolic dim of the model's inputs.
        sources: dim name -> "declared" (GtcoConfig.dynamic / --dynamic), "model" (the input model's
            `gtco.dynamic` metadata) or "default" (DEFAULT_DYNAMIC_RANGE).
    """

    ranges: DynamicRanges = ()
    sources: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def bounds(self) -> dict[str, tuple[int, int]]:
        return {n: (lo, hi) for n, lo, hi in self.ranges}

    def to_json(self) -> dict[str, Any]:
        return {"ranges": format_dynamic(self.ranges),
                "dims": [{"dim": n, "lo": lo, "hi": hi, "source": self.sources[n]} for n, lo, hi in self.ranges]}


def symbolic_dims(model: onnx.ModelProto) -> list[str]:
    """Names of the symbolic dims of the model's inputs, in order of first use."""
    init = {i.name for i in model.graph.initializer}
    out: list[str] = []
    for vi in model.graph.input:
        if vi.name in init or not vi.type.tensor_type.HasField("shape"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param and d.dim_param not in out:
                out.append(d.dim_param)
    return out


def model_ranges(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """The ranges a model declares in its `gtco.dynamic` metadata, {dim: (lo, hi)} ({} without).

    Raises:
        GtcoError: the metadata is malformed (parse_dynamic says how).
    """
    for prop in model.metadata_props:
        if prop.key == DYNAMIC_METADATA_KEY:
            try:
                return {name: (lo, hi) for name, lo, hi in parse_dynamic(prop.value)}
            except GtcoError as e:
                raise GtcoError(f"the model's {DYNAMIC_METADATA_KEY} metadata: {e}") from None
    return {}


def resolve_ranges(model: onnx.ModelProto, declared: DynamicRanges) -> Ranges:
    """The ranges that apply to `model`: the declared ones, then the model's `gtco.dynamic` metadata, then the
    default, for each symbolic dim of its inputs.

    Raises:
        GtcoError: a declared dim that no input of the model has, or malformed `gtco.dynamic` metadata.
    """
    dims = symbolic_dims(model)
    missing = [n for n, _, _ in declared if n not in dims]
    if missing:
        have = ", ".join(dims) if dims else "none"
        raise GtcoError(f"dynamic range for {', '.join(missing)}: no model input has that dim (symbolic dims: "
                        f"{have})")
    from_model = model_ranges(model)
    given = {n: (lo, hi) for n, lo, hi in declared}
    ranges, sources = [], {}
    for n in dims:
        if n in given:
            (lo, hi), sources[n] = given[n], "declared"
        elif n in from_model:
            (lo, hi), sources[n] = from_model[n], "model"
        else:
            (lo, hi), sources[n] = DEFAULT_DYNAMIC_RANGE, "default"
        ranges.append((n, lo, hi))
    return Ranges(tuple(sorted(ranges)), sources)


@dataclass(frozen=True)
class GtcoConfig:
    """Everything a run of the optimizer depends on.

    Attributes:
        target: GPU target name, a key of TARGETS: a GPU ("h200") or an arch ("sm_90", its data-sheet GPU).
        precision: compute precision of fused groups: fp32, fp16 or bf16 (fp32 accumulation always).
        max_group_size: largest number of ONNX nodes one fused group may hold (DP ending bound).
        max_states: the DP's state budget per segment; a segment past it (even with forced moves) is covered
            greedily, and the report's rejects say which (plan/dp.py).
        seed: seed of every random choice (check inputs, tuning).
        dynamic: declared ranges of the model's symbolic dims, (dim name, lo, hi) sorted by name; the model is
            optimized for every shape inside them (see parse_dynamic for the `--dynamic` text form).
        pack_qkv: pack a block's Q, K and V projections into one GEMM that the attention reads packed
            (families/gemm/pack.py); False keeps them three GEMMs of one QKV node.
        patchify: run a conv whose stride equals its kernel (a ViT's patch embedding) as a patchify copy and a GEMM
            where the estimate predicts that faster (families/conv/patchify.py); False keeps every conv a conv.
        pack_gated: pack a gated MLP's gate and up projections into one GEMM whose epilogue multiplies the
            activated gate by the up half (families/gemm/gated.py); False keeps them two GEMMs.
        calibration_data: fp8's calibration samples: a folder of .npz files or one .npz (as check --save-inputs
            writes them), "MODULE:NAME" or "FILE.py:NAME" naming a data reader (an onnxruntime
            CalibrationDataReader, an iterable of feed dicts, or a function returning one), or the feed dicts
            themselves (onnx_gtco.fp8.read_calibration).
        fp8_budget: the relative error of a GEMM's product on E4M3 operands, over the calibration samples, past
            which the GEMM stays fp16 (onnx_gtco.fp8).
    """

    target: str = DEFAULT_TARGET
    precision: str = "fp32"
    max_group_size: int = 48
    max_states: int = 2_000_000
    seed: int = 0
    dynamic: DynamicRanges = ()
    pack_qkv: bool = True
    patchify: bool = True
    pack_gated: bool = True
    calibration_data: Any = None
    fp8_budget: float = DEFAULT_FP8_BUDGET

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise GtcoError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if self.precision not in PRECISIONS:
            raise GtcoError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.precision == "fp8" and TARGETS[self.target].arch not in FP8_ARCHS:
            raise GtcoError(f"precision fp8 needs FP8 Tensor Cores (sm_90); target {self.target} is "
                            f"{TARGETS[self.target].arch}: use --precision fp16 or bf16 there")
        if self.precision == "fp8" and self.calibration_data is None:
            raise GtcoError("precision fp8 needs calibration data for its activation scales: give --calibration-data "
                            "(a folder of .npz samples, as check --save-inputs writes them, or MODULE:READER)")
        if not 0 < self.fp8_budget:
            raise GtcoError(f"fp8_budget must be > 0, got {self.fp8_budget}")
        if self.max_group_size < 1:
            raise GtcoError(f"max_group_size must be >= 1, got {self.max_group_size}")
        object.__setattr__(self, "dynamic", check_dynamic(self.dynamic))

    @property
    def hw(self) -> Target:
        return TARGETS[self.target]

    @property
    def plan_precision(self) -> str:
        """The precision the plan, the rewrite and the half conversion use: `precision`, but fp16 for fp8, whose
        E4M3 GEMM operands come after them (onnx_gtco.fp8)."""
        return "fp16" if self.precision == "fp8" else self.precision

    @property
    def arch(self) -> str:
        """The arch of the kernels the target runs ("sm_80", "sm_90"): the library's slots, the tuning tasks."""
        return TARGETS[self.target].arch

    def replace(self, **changes: object) -> GtcoConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, **overrides: object) -> GtcoConfig:
        """Defaults (the target of the local GPU, see `default_target`), then GTCO_TARGET / GTCO_PRECISION /
        GTCO_SEED from the environment, then overrides."""
        env: dict[str, object] = {}
        if "GTCO_TARGET" in os.environ:
            env["target"] = os.environ["GTCO_TARGET"]
        elif overrides.get("target") is None:
            env["target"] = default_target()[0]
        if "GTCO_PRECISION" in os.environ:
            env["precision"] = os.environ["GTCO_PRECISION"]
        if "GTCO_SEED" in os.environ:
            env["seed"] = int(os.environ["GTCO_SEED"])
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)  # type: ignore[arg-type]
