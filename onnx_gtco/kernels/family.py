"""What every kernel family provides: its tunable space, a validity check with a reason, one instantiation's
source, and an fp64 numpy reference of what the instance computes.

A family's device code is a thick header, `plugins/families/<family>/<family>.cuh`, holding the kernel templates, the
C argument struct and a host launcher template. `instantiate` writes the thin part: one `.cu` text that includes
that header and exports one C entry point (`gtco/launch.cuh`):

    extern "C" int <symbol>(const <Args>* args, void* stream);

The same text builds with nvcc (sm_80 / sm_90) and with g++ -DGTCO_EMULATE for the CPU emulation
(`onnx_gtco.kernels.emulate`). `args_fields` mirrors the C struct field for field, so Python can fill it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from onnx_gtco.config import Target
    from onnx_gtco.kernels.timing import Tiling
    from onnx_gtco.opspec import FusedOp

DTYPES = ("f16", "bf16", "f32")
ARCHS = ("sm_80", "sm_90")


@dataclass(frozen=True)
class Problem:
    """One kernel to build: the family, the I/O dtype, static sizes and the fixed semantics of the fused group.

    Attributes:
        family: family name, e.g. "gemm".
        dtype: element type of the kernel's inputs and outputs: "f16", "bf16" or "f32".
        sizes: named static extents, e.g. (("M", 197), ("N", 768), ("K", 768)).
        flags: named fixed choices, e.g. (("activation", "gelu_erf"), ("bias", True)).
    """

    family: str
    dtype: str
    sizes: tuple[tuple[str, int], ...] = ()
    flags: tuple[tuple[str, Any], ...] = ()

    def size(self, key: str) -> int:
        for k, v in self.sizes:
            if k == key:
                return int(v)
        raise KeyError(f"{self.family} problem has no size {key!r}")

    def flag(self, key: str, default: Any = None) -> Any:
        for k, v in self.flags:
            if k == key:
                return v
        return default

    def with_sizes(self, new: Mapping[str, int]) -> Problem:
        """The same problem with the sizes in `new` replaced (sizes it does not have are left out)."""
        return dataclasses.replace(self, sizes=tuple((k, int(new.get(k, v))) for k, v in self.sizes))

    @classmethod
    def make(cls, family: str, dtype: str, sizes: Mapping[str, int], flags: Mapping[str, Any] | None = None
             ) -> Problem:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose one of {DTYPES}")
        return cls(family, dtype, tuple(sorted((k, int(v)) for k, v in sizes.items())),
                   tuple(sorted((flags or {}).items())))


@dataclass(frozen=True)
class OpKernel:
    """How the nodes of one fused op (an opspec family) reach their kernel family: a family's kernel module lists one
    per op it writes (OPS), and kernels.select reads a node's Problem through it.

    Attributes:
        op: the fused op's family name, e.g. "qkv".
        kernel: the kernel family its nodes run, e.g. "gemm".
        problem: (the node read through its spec, the kernel dtype) -> the Problem, or why no kernel serves the node
            (it then runs its function).
        extent_attr: the node attribute whose factors ("batch*seq") make its run-time extent, where it has one
            (tune.shape_generic; None: the leading dims of its first input).
        shaped: its Problem needs the node's tensor shapes, which only its binder reads (`problem` says so).
    """

    op: str
    kernel: str
    problem: Callable[[FusedOp, str], Problem | str]
    extent_attr: str | None = None
    shaped: bool = False


@dataclass(frozen=True)
class Implementation:
    """A way to compute a family's Problem other than its own generated kernels ("mma"): a library's kernels behind
    the same instance ABI (the GEMM family's cuBLASLt and CUTLASS). What the tuner asks of one: a family lists its
    own in `KernelFamily.implementations`.

    Attributes:
        name: the configurations' "impl".
        space: its tunable parameters and their values.
        offered: (problem, the task's arch) -> why a tuning trial may not pick it, or None where it may.
        ranked: (problem, the planning hardware or None) -> its valid configurations, best first by the estimate;
            None: every point of `space`, ranked by the tuner.
        arch_for: the task's arch -> the arch its instances are built for, where that differs (CUTLASS's sm_90
            tasks build sm_90a code).
        version: its library's version, which the name of a study that offers it carries (a new version's trials
            time other kernels); None: no version.
        label: its name in reports ("cuBLASLt"); "": `name`.
        proxy: what stands in for its instances in the estimate until a record measures them ("ONNX Runtime's
            cuBLAS kernels"), which a report of predicted times says; None: they are measured.
        fallible: its instance can fail at run time where a generated kernel cannot (its library absent from the
            machine, no algorithm for the run-time alignment), so the library build gives its node the mma
            instance the glue falls back to, and a dispatch table entry (which keeps no fallback) takes it only
            where the tuner named it (cuBLASLt).
        own_kernels: whether ptxas reports kernels of its instance's own (False: host code calling the library's
            kernels, which has none to check).
        emulated: whether its instance builds in the CPU emulation (cuBLASLt's goes as far as its plan there, and
            its node then runs its fallback; CUTLASS's wgmma code does not build there).
        include_dirs: (emulated) -> the folders its instances compile against beyond the instance's own (fetched on
            first use: cuBLASLt's header, and for the emulation's g++ CUDA's runtime headers); raises
            errors.BuildError naming what is missing. None: none.
        prepare: what a process does before it runs one of its instances (cuBLASLt: load libcublasLt globally, as
            ONNX Runtime's CUDA EP does). None: nothing.
        last_error: (the shared library holding the instance) -> what the library said of its last failure, "" if
            nothing. None: it says nothing.
    """

    name: str
    space: Mapping[str, tuple[Any, ...]]
    offered: Callable[[Problem, str], str | None]
    ranked: Callable[[Problem, Any], Sequence[Mapping[str, Any]]] | None = None
    arch_for: Mapping[str, str] = field(default_factory=dict)
    version: Callable[[], str] | None = None
    label: str = ""
    proxy: str | None = None
    fallible: bool = False
    own_kernels: bool = True
    emulated: bool = False
    include_dirs: Callable[[bool], Sequence[Path]] | None = None
    prepare: Callable[[], None] | None = None
    last_error: Callable[[str], str] | None = None


def static_product(dims: Sequence[Any]) -> int | None:
    """The product of `dims`; None when one is symbolic (not an int)."""
    if any(not isinstance(d, int) for d in dims):
        return None
    return math.prod(dims)


Config = Mapping[str, int]
"""One point of a family's tunable space, e.g. {"BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 2, "STAGES": 3}."""


@dataclass(frozen=True)
class Field:
    """One field of the C argument struct, in declaration order.

    kind: "ptr" (value names an array of `run`'s inputs/outputs), "i32", "i64" or "f32" (value is the number).
    """

    name: str
    kind: str
    value: Any


@dataclass(frozen=True)
class Instance:
    """One generated instantiation.

    Attributes:
        name: procedural and readable: family, arch, dtype, tile, stages, e.g.
            "gemm_sm80_f16_128x128x32_w2x2_s3_bias_gelu_erf".
        symbol: the exported C entry point (usually `gtco_` + name).
        source: the whole .cu text.
        problem, config, arch: what it was built for.
        smem_bytes: shared memory per block the config needs (static + dynamic).
        include_dirs: include folders the source needs beyond plugins/include (a library's headers).
        nvcc_flags: nvcc flags the source needs beyond kernels.compile's.
    """

    name: str
    symbol: str
    source: str
    problem: Problem
    config: Mapping[str, int] = field(default_factory=dict)
    arch: str = "sm_80"
    smem_bytes: int = 0
    include_dirs: tuple[str, ...] = ()
    nvcc_flags: tuple[str, ...] = ()


class KernelFamily(ABC):
    """A parameterised CUDA kernel template and what Python needs to know of it."""

    name: str
    space: Mapping[str, tuple[int, ...]]
    """Tunable parameter -> allowed values (the tuner's search space)."""
    extent: str | None = None
    """The Problem size its tiles run over that changes with the input shape, which a dynamic-shape node dispatches
    on at run time (kernels.dynamic); None: it does not dispatch on size."""
    rowwise: bool = False
    """Whether its instance takes its row count at run time (a Problem from a node's attributes has rows 1; the
    tuner's task and the estimate take the rows from the node's first input)."""
    row_term: bool = False
    """Whether its blocks' time also follows the valid rows of their tiles (A's rows loaded, outputs written: the
    mma GEMM): the shape-generic tuner's cost model gets a third term and measures it at one row as well."""
    grows_with_extent: bool = False
    """Whether a block's work grows with the run-time extent (attention's keys follow its queries): the
    shape-generic tuner caps its micro-kernel extents near the range's top."""
    implementations: tuple[Implementation, ...] = ()
    """The library implementations a tuning trial may pick beside its own kernels (Implementation), in order."""
    title: str = ""
    """Its name in reports ("GEMM"); "": `name`."""
    task_columns: tuple[tuple[str, str, Mapping[str, str]], ...] = ()
    """The report's columns for what `task_summary` says of a task: (header, the entry's key, its values as the
    report names them, where it renames them); empty where it says nothing."""
    arch_specific: bool = False
    """Whether it offers configurations of its own for an arch-specific slot (sm_90a: CUTLASS's wgmma GEMMs), which
    the library builds where the estimate predicts them faster than the slot's fallback (plugin.device.own_config)."""
    fp32_output: bool = False
    """Whether its half instances can write an fp32 output, cast in their epilogue (the Problem flag out_dtype="f32":
    a graph output the precision conversion folds into the node, onnx_gtco.precision)."""
    per_group: bool = False
    """Whether its kernel is generated per fused group (the elementwise programs): the group's binder builds the
    Problem and the first valid configuration runs, with no estimate to choose and nothing to tune
    (kernels.select.FAMILIES holds the others)."""

    @abstractmethod
    def check(self, problem: Problem, config: Config, arch: str) -> str | None:
        """None when the config can run the problem on `arch`, else the reason it cannot (shared memory over the
        arch's limit, a tile that does not divide, a warp layout that does not cover the tile, ...)."""

    @abstractmethod
    def configs(self, problem: Problem, arch: str) -> list[dict[str, int]]:
        """A few valid configs, best first by the family's own rule of thumb (the tuner starts from these)."""

    @abstractmethod
    def instantiate(self, problem: Problem, config: Config, arch: str) -> Instance:
        """The instance's source. Raises ValueError with check()'s reason for an invalid config."""

    def library_configs(self, problem: Problem, arch: str) -> list[dict[str, Any]]:
        """Configurations that run a vendor library instead of a generated kernel, which the selection weighs beside
        `configs` (kernels.select.candidates); none by default."""
        del problem, arch
        return []

    def task_summary(self, problem: Problem, best: Config | None) -> dict[str, Any]:
        """What a tuning report entry says of a task of this family beyond its implementations' times (tune.apply.
        implementations), given its best configuration (None: no trial succeeded): e.g. which of the conv's
        kernels won and the conv's shape. Empty by default."""
        del problem, best
        return {}

    def tiling(self, problem: Problem, config: Config, target: Target) -> Tiling:
        """How `config`'s blocks cover `problem` along its run-time extent on `target` (tune.shape_generic's
        micro-kernels).

        Raises:
            ValueError: the family has no tiling over a run-time extent.
        """
        del config, target
        raise ValueError(f"{problem.family} kernels have no tiling over a run-time extent")

    def block_work(self, problem: Problem, config: Config, n: np.ndarray, follows: bool) -> np.ndarray:
        """The work of one block at run-time extents `n`, relative (the shape-generic tuner's W); `follows`: the
        problem's other lengths follow the extent. One unit by default."""
        del problem, config, follows
        return np.ones_like(n)

    def at_extent(self, problem: Problem, n: int) -> Problem:
        """`problem` with its run-time extent (`extent`, at least 1) set to `n` (kernels.dynamic.with_extent)."""
        return problem.with_sizes({str(self.extent): n})

    def instance_name(self, problem: Problem, config: Config, arch: str) -> str:
        """The name instantiate gives the instance (a family overrides this where it can say it without generating
        the source)."""
        return self.instantiate(problem, config, arch).name

    @abstractmethod
    def args_fields(self, problem: Problem, arrays: Mapping[str, np.ndarray]) -> list[Field]:
        """The C argument struct's fields for a run on `arrays` (inputs and preallocated outputs by name)."""

    @abstractmethod
    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What the instance computes, in float64 numpy on the (already rounded) inputs."""

    @abstractmethod
    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        """Output array name -> (shape, dtype) to preallocate for a run."""

    def random_inputs(self, problem: Problem, seed: int) -> dict[str, np.ndarray]:
        """Seeded inputs for tests (never zeros). Families override where inputs have structure (masks)."""
        raise NotImplementedError


_C_TYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


def c_args(fields: Sequence[Field], address: Callable[[str], int | None]) -> ctypes.Structure:
    """The instance's C argument struct filled from `fields`; `address(name)` is the data address of the array a
    "ptr" field names (a field naming none is a null pointer)."""
    struct = type("Args", (ctypes.Structure,), {"_fields_": [(f.name, _C_TYPES[f.kind]) for f in fields]})
    args = struct()
    for f in fields:
        if f.kind == "ptr":
            setattr(args, f.name, address(f.value) if f.value else None)
        else:
            setattr(args, f.name, float(f.value) if f.kind == "f32" else int(f.value))
    return args


def entry_point(lib: str, symbol: str, args: ctypes.Structure) -> Any:
    """An instance's `int gtco_<name>(const Args*, void* stream)` from a shared library, typed for `args`."""
    fn = getattr(ctypes.CDLL(lib), symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(type(args)), ctypes.c_void_p]
    return fn


def np_dtype(dtype: str) -> Any:
    """numpy storage dtype of a kernel dtype (bf16 is stored as uint16 bits)."""
    return {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}[dtype]


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float array -> the kernel's storage (bf16 rounded to nearest even, kept as uint16 bits)."""
    if dtype == "f16":
        return np.ascontiguousarray(x, dtype=np.float16)
    if dtype == "f32":
        return np.ascontiguousarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    nan = np.isnan(x)
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    out[nan] = np.uint16(0x7FC0)
    return out


def tf32_round(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to TF32 as cvt.rna.tf32.f32 does: 10 mantissa bits, to nearest, ties away from zero
    (float32 result; infinities and NaN pass through)."""
    x = np.ascontiguousarray(x, np.float32)
    bits = x.view(np.uint32)
    out = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), out, x)


def from_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """The kernel's storage -> float64 values."""
    if dtype == "bf16":
        return (x.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """‖got − want‖ / ‖want‖ in float64 (inf when got has a NaN that want does not)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if np.isnan(got).any() and not np.isnan(want).any():
        return float("inf")
    denom = float(np.linalg.norm(want))
    return float(np.linalg.norm(got - want) / (denom if denom else 1.0))

