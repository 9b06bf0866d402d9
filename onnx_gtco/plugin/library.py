"""Build the custom-op library of a rewritten model: bind its fused nodes, generate the glue, compile, cache.

`build_library(model, out_dir, cuda=..., emulated=...)`:

1. `fused_nodes(model)` (with the plan's types when the caller has them: optimize_file); each node's family binder
   (binders.py) maps its operands onto the C++ roles or says why it cannot.
2. For a device build, each bound node's kernel instance per arch (plugin.device: sm_80, sm_90 and sm_90a for CUDA,
   the sm_80 one for the emulation), or why it has none (its own reason: the arch and the family's check).
   Support is decided per node. Registration is per op type (a registered op type hides the model-local function of
   *every* node of that name, facts §4/5), so a node without a kernel where siblings of its op type have theirs (it
   cannot be bound, or has no device instance) moves to an op type of its own that the library does not register
   (function_only_op_type: `Attention_f16` -> `AttentionFn_f16`, its function copied under that name; `model` is
   changed in place) and runs its function, while the siblings keep their kernels; the report lists it with the
   reason (`function_only`, `skipped`).
   Dynamic shapes (plugin.dispatch): every bound node checks the declared ranges (the plan's, else the `gtco.dynamic`
   metadata) of its symbolic input dims on each call, and a node whose run-time extent is symbolic gets a dispatch
   table per arch (the caller's `dispatch`, else the analytical default), every distinct instance of which is built.
   A node whose instance in some arch slot is a cuBLASLt one (a tuned {"impl": "cublaslt"} configuration) gets an
   mma fallback instance for that slot (plugin.device.mma_fallbacks), built with the others, which the glue launches
   when cuBLASLt cannot run (plugins/families/gemm/gemm_op.h run_gemm); nodes with a dispatch table get none.
3. One glue `.cc`, plugins/ort/glue.cc.j2 filled with plain data (generate_glue): includes plugins/ort/gtco_ort.h
   and the used families' headers, the per-node code or data of binders with a `glue` hook (the Elementwise
   family's host functions and node descriptors), the NodeSpec table `kNodes` (roles, the instances' entry points
   per arch slot, the hook's `node_data`, the ranges, extent factors and dispatch table of a dynamic node, and per
   arch slot whether it launches with programmatic dependent launch (plugin.pdl: sm_90 and later, gtco kernels
   fed by gtco kernels only), the mma fallback per arch slot of a cuBLASLt node; each row names its fields),
   `add_ops()` registering one CPU-EP op per bound op type
   and a CUDA-EP op per op type with device kernels (every node of it has them, after step 2), `kLibraryInfo`
   (JSON), then register.inc.
4. g++ -std=c++20 -O3 -fPIC -fvisibility=hidden against `ort_include_dir()` (found, with cuBLASLt's header where
   an instance needs it, before anything compiles). With cuda=True the instances are compiled by kernels.compile
   (nvcc, cached objects, the ptxas report checked; registers / shared memory / spills go into the report): an
   instance that spills or needs a stack frame is never built into the library, its nodes select again without it
   (the family's next configuration; a node with none left runs its function) and the report's `rejected` names it;
   any other compiler failure is a BuildError naming the kernel and its parameters. The instances are
   linked with plugins/cuda/probe.cu and the CUDA runtime statically. With emulated=True they are compiled with
   g++ -DGTCO_EMULATE and their ops registered for the CPU EP instead of the reference ones, so a CPU session runs
   the whole device path (argument structs, strides, arch dispatch, the instances' checks) on the emulation. A
   cuBLASLt instance builds there too (against cublasLt.h and CUDA's runtime headers: cublas_headers); it goes as
   far as cuBLASLt's plan and never runs its kernels (gemm/cublaslt.h), so its node runs its mma fallback.
5. The file is `libgtco-<hash12>.so`, the hash covering the generated source, every file under plugins/, the
   flags and the compilers; it is built once into a per-user cache ($XDG_CACHE_HOME/onnx-gtco/libs) and copied
   atomically into out_dir. Nothing is left behind when a build fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Container, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from onnx_gtco import progress
from onnx_gtco.calibration import Hardware, hardware
from onnx_gtco.config import model_ranges
from onnx_gtco.errors import GtcoError
from onnx_gtco.ir.view import TensorInfo as PlanTensor
from onnx_gtco.kernels.compile import CompiledInstance, compile_instances
from onnx_gtco.kernels.dynamic import with_extent
from onnx_gtco.kernels.family import Instance, Problem
from onnx_gtco.kernels.render import render
from onnx_gtco.kernels.select import MMA_ONLY, Avoid, fallible, implementation
from onnx_gtco.kernels.toolchain import (
    DEVICE_INCLUDE_DIRS,
    GLUE_INCLUDE_DIRS,
    PLUGINS_DIR,
    BuildError,
    cache_root,
    find_cxx,
    find_nvcc,
    headers_digest,
    run_compile,
    sanitize_flags,
)
from onnx_gtco.opspec import FP8_DTYPE
from onnx_gtco.plugin.binders import binder_for
from onnx_gtco.plugin.binding import MAX_ROLES, Binder, Binding, FusedNode
from onnx_gtco.plugin.device import (
    ARCH_SLOTS,
    EMULATED_ARCH,
    FALLBACK_SLOTS,
    device_instances,
    device_problem,
    mma_fallbacks,
    select_config,
)
from onnx_gtco.plugin.dispatch import (
    BUCKETS,
    TABLE_IMPLS,
    NodeDynamic,
    bucket_of,
    check_table,
    default_table,
    extent_dims,
    extent_top,
    node_ranges,
)
from onnx_gtco.plugin.headers import HeaderError, ort_include_dir
from onnx_gtco.plugin.nodes import fused_nodes
from onnx_gtco.plugin.pdl import pdl_archs, pdl_slots

PLUGINS = PLUGINS_DIR
CUDA_ARCHS = ARCH_SLOTS
CXX_FLAGS = ("-std=c++20", "-O3", "-pthread", "-fPIC", "-fvisibility=hidden", "-Wall")
_DTYPES = {"f32": "gtco::DType::f32", "f16": "gtco::DType::f16", "bf16": "gtco::DType::bf16",
           FP8_DTYPE: "gtco::DType::f8"}


@dataclass(frozen=True)
class NodeResult:
    """One fused node: bound (binding set, reason None) or kept on its function (reason says why)."""

    node: str
    op_type: str
    binding: Binding | None
    reason: str | None


@dataclass
class LibraryResult:
    """What build_library produced.

    Attributes:
        path: the library in out_dir.
        op_types: op types the library registers for the CPU EP (sorted).
        cuda_op_types: op types with device kernels (registered for the CUDA EP, or for the CPU EP in an
            emulated build).
        nodes: every fused node with its binding or the reason it keeps its function.
        cuda: whether nvcc objects (probe + instances) are linked in.
        emulated: whether the instances are linked in built for the CPU emulation instead.
        cached: nothing was compiled: the library (or the same file already in out_dir) and every kernel object
            came from the caches.
        built: this call compiled the glue and linked the library (it was in neither out_dir nor the cache).
        created: the file was written into out_dir by this call (it was not there already).
        seconds: wall time of build_library.
        log: compiler command lines and their output.
        kernels: the compiled kernel instances (cuda builds): name, arch, config, ptxas registers / smem / spills.
        kernel_skips: bound fused node -> why it has no device kernel (cuda and emulated builds).
        dispatch: dynamic node -> arch -> its dispatch table [(max_extent, instance name, config)] in ascending
            max_extent (the last entry's max_extent is the extent's top under the declared ranges, None when
            unbounded); nodes with one instance are absent.
        rejected: "instance (arch)" -> ptxas's reason, for each instance the build compiled and did not use (a
            spill, a stack frame): its nodes took the family's next configuration.
        function_only: node -> the op type it was moved to (function_only_op_type): it has no kernel of its own
            where siblings of its op type have theirs, and runs its model-local function.
        pdl: node -> the archs on which it launches with programmatic dependent launch (plugin.pdl; nodes with
            none left out).
        fallbacks: node -> arch -> the mma instance its cuBLASLt instance on that arch falls back to when cuBLASLt
            cannot run (plugin.device.mma_fallbacks); nodes without a cuBLASLt instance left out.
        fallback_skips: node -> arch -> why its cuBLASLt instance there has no fallback (a failure of cuBLASLt is
            then the node's error): no mma configuration left, or the node has a dispatch table.
    """

    path: Path
    op_types: list[str]
    cuda_op_types: list[str]
    nodes: list[NodeResult]
    cuda: bool
    cached: bool
    created: bool
    seconds: float
    log: str = field(default="", repr=False)
    kernels: list[dict[str, object]] = field(default_factory=list)
    kernel_skips: dict[str, str] = field(default_factory=dict)
    emulated: bool = False
    dispatch: dict[str, dict[str, list[tuple[int | None, str, dict[str, int]]]]] = field(default_factory=dict)
    built: bool = False
    rejected: dict[str, str] = field(default_factory=dict)
    function_only: dict[str, str] = field(default_factory=dict)
    pdl: dict[str, list[str]] = field(default_factory=dict)
    fallbacks: dict[str, dict[str, str]] = field(default_factory=dict)
    fallback_skips: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    def what(self) -> str:
        """What this build did: "from the cache" only when nothing was compiled, else e.g. "compiled 18 of 24
        kernels, 6 from the cache"."""
        if self.cached:
            return "from the cache"
        if not self.kernels:
            return "compiled"
        hits = sum(bool(k["cached"]) for k in self.kernels)
        kernels = f"compiled {len(self.kernels) - hits} of {len(self.kernels)} kernels, {hits} from the cache"
        return kernels if self.built else f"{kernels}, the library from the cache"

    def how(self) -> str:
        """what() and the seconds, for the command line: `from the cache in 0.1 s`, `compiled 18 of 24 kernels, 6
        from the cache, in 41.2 s`."""
        return f"{self.what()}{',' if self.kernels and not self.cached else ''} in {self.seconds:.1f} s"

    def skipped(self) -> dict[str, str]:
        """Node name -> why it keeps running its function."""
        return {n.node: n.reason for n in self.nodes if n.reason is not None}

    def to_json(self) -> dict[str, object]:
        return {"file": self.name, "cuda": self.cuda, "emulated": self.emulated, "op_types": self.op_types,
                "cuda_op_types": self.cuda_op_types, "skipped": self.skipped(), "kernels": self.kernels,
                "kernel_skips": self.kernel_skips, "rejected": self.rejected, "function_only": self.function_only,
                "pdl": self.pdl, "fallbacks": self.fallbacks, "fallback_skips": self.fallback_skips,
                "dispatch": {n: {a: [[t, name, dict(c)] for t, name, c in rows] for a, rows in per.items()}
                             for n, per in self.dispatch.items()}}


def lib_cache_dir() -> Path:
    return cache_root() / "libs"


def bind_node(n: FusedNode, unique: bool = True) -> Binding | str:
    """One node's Binding by its family's binder, or why it has none. `unique`: whether its name is non-empty and
    unique in its model (bind_nodes checks that across the nodes; the kernel finds its node by name)."""
    binder = binder_for(n.family)
    if binder is None:
        return f"no plugin kernel for family {n.family!r} yet"
    if n.dtype not in _DTYPES:
        return f"dtype {n.dtype!r} has no kernel"
    if not unique:
        return f"node name {n.node.name!r} is empty or not unique (the kernel finds its node by name)"
    return binder.bind(n)


def bind_nodes(nodes: Sequence[FusedNode]) -> tuple[list[NodeResult], dict[str, Binder]]:
    """Bind every node (a node that cannot be bound gets its reason; its siblings of the same op type keep their
    bindings: build_library moves such a node to an op type of its own that the library does not register), and
    the binder of each op type with a bound node."""
    results: list[NodeResult] = []
    binders: dict[str, Binder] = {}
    seen: dict[str, int] = {}
    for n in nodes:
        seen[n.node.name] = seen.get(n.node.name, 0) + 1
    for n in nodes:
        res = bind_node(n, unique=bool(n.node.name) and seen[n.node.name] == 1)
        binder = binder_for(n.family)
        if isinstance(res, str) or binder is None:
            results.append(NodeResult(n.node.name, n.node.op_type, None, str(res)))
        else:
            binders[n.node.op_type] = binder
            results.append(NodeResult(n.node.name, n.node.op_type, res, None))
    return results, binders


def generate_glue(nodes: Sequence[FusedNode], results: Sequence[NodeResult], binders: dict[str, Binder],
                  device: Mapping[str, tuple[Instance, ...]], emulated: bool = False,
                  dynamic: Mapping[str, NodeDynamic] | None = None, pdl: Mapping[str, Sequence[bool]] | None = None,
                  fallbacks: Mapping[str, Sequence[Instance | str | None]] | None = None
                  ) -> tuple[str, list[str], list[str]]:
    """The glue source (plugins/ort/glue.cc.j2), the op types it registers, and those among them with device kernels.

    `device` maps a bound node's name to its instance per arch slot (device.ARCH_SLOTS; one, the sm_80 one, in
    an emulated build). An op type gets a device kernel when every one of its bound nodes has instances (build_library
    has moved the others to function-only op types where some had them). In an emulated
    build (`emulated`) the device kernels are registered for the CPU EP in place of the reference ones.
    `dynamic` maps a bound node to the ranges it checks and, with device kernels, its dispatch table (one table
    per arch slot of `device`). `pdl` maps a node with device kernels to whether it launches with programmatic
    dependent launch, per arch slot of `device` (plugin.pdl.pdl_slots; absent: never). `fallbacks` maps a node
    with device kernels to the mma instance per arch slot that its cuBLASLt instance falls back to
    (plugin.device.mma_fallbacks; a reason or None: none), written into NodeSpec::fallback_fn and the library
    info's "fallback"."""
    by_name = {n.node.name: n for n in nodes}
    bound = [r for r in results if r.binding is not None]
    op_types = sorted(binders)
    device_types = _device_types(results, binders, device)
    dynamic = dynamic or {}
    tables = {r.node: dynamic[r.node].tables for r in bound
              if r.op_type in device_types and r.node in dynamic and dynamic[r.node].tables}

    def slots(insts: Sequence[Instance | None]) -> list[Instance | None]:
        return [*insts, *([None] * (len(ARCH_SLOTS) - len(insts)))]

    def fallback(node: str) -> list[Instance | None]:  # a node's fallback per slot of `device`, None: none
        return [f if isinstance(f, Instance) else None for f in (fallbacks or {}).get(node, ())]

    launches_fallback = {r.node: fallback(r.node) for r in bound if r.op_type in device_types and any(fallback(r.node))}

    blocks: dict[str, None] = {}  # per-node glue of the binders that have a `glue` hook, deduplicated by text
    rows = []
    for r in bound:
        assert r.binding is not None
        n = by_name[r.node]
        hook = getattr(binders[r.op_type], "glue", None)
        texts, node_data = hook(n, r.binding) if hook is not None else ((), "nullptr")
        blocks.update(dict.fromkeys(texts))
        dyn = dynamic.get(r.node, NodeDynamic())
        entries = _rows(tables[r.node]) if r.node in tables else []
        rows.append({"op_type": r.op_type, "node": r.node, "n_inputs": len(n.node.input),
                     "n_outputs": len(n.node.output), "in": _roles(r.binding.inputs), "out": _roles(r.binding.outputs),
                     "insts": slots(device[r.node] if r.op_type in device_types else ()), "node_data": node_data,
                     "pdl": _pdl_row((pdl or {}).get(r.node) if r.op_type in device_types else None),
                     "fallbacks": slots(launches_fallback.get(r.node, [])),
                     "ranges": dyn.ranges, "extent": dyn.extent,
                     # the last entry takes every extent above
                     "entries": [("INT64_MAX" if e == len(entries) - 1 or top is None else top, slots(insts))
                                 for e, (top, insts) in enumerate(entries)]})
    info = {"op_types": op_types, "cuda_op_types": device_types,
            "nodes": {r.node: r.op_type for r in bound}, "cuda": bool(device_types) and not emulated,
            "emulated": emulated,
            "instances": {r.node: [i.name for i in device[r.node]] for r in bound if r.op_type in device_types},
            "ranges": {r.node: [list(x) for x in dynamic[r.node].ranges] for r in bound
                       if r.node in dynamic and dynamic[r.node].ranges},
            "dispatch": {node: [[top, [i.name for i in per_arch]] for top, per_arch in _rows(t)]
                         for node, t in tables.items()},
            "pdl": {r.node: _pdl_row(pdl[r.node]) for r in bound
                    if r.op_type in device_types and pdl and any(pdl.get(r.node, ()))},
            "fallback": {node: [i.name if i is not None else None for i in per_slot]
                         for node, per_slot in launches_fallback.items()}}
    # op types with a node whose output is of another dtype than the op's (a half GEMM writing an fp32 graph output)
    # declare their outputs of any type: ORT then takes each node's output type from the model
    mixed_out = {r.op_type for r in bound
                 if any(t.dtype and t.dtype != by_name[r.node].dtype for t in by_name[r.node].outputs)}
    text = json.dumps(info, sort_keys=True)
    if ")gtco\"" in text:
        raise BuildError("a node name contains the sequence )gtco\" that the generated glue cannot quote")
    source = render(
        "ort/glue.cc.j2", emulated=emulated, headers=sorted({b.header for b in binders.values()}), blocks=list(blocks),
        symbols=sorted({i.symbol for r in bound if r.op_type in device_types for i in device[r.node]} |
                       {i.symbol for t in tables.values() for table in t for _, i in table} |
                       {i.symbol for per_slot in launches_fallback.values() for i in per_slot if i is not None}),
        nodes=rows, info=text,
        ops=[{"op_type": t, "family": binders[t].cpp_struct, "dtype": _DTYPES[t.rsplit("_", 1)[1]],
              "cpu": not (emulated and t in device_types), "device": t in device_types,
              "any_output_type": t in mixed_out}
             for t in op_types])
    return source, op_types, device_types


def _device_types(results: Sequence[NodeResult], binders: Mapping[str, Binder],
                  device: Mapping[str, tuple[Instance, ...]]) -> list[str]:
    """The op types registered with device kernels: those every bound node of which has instances."""
    bound = [r for r in results if r.binding is not None]
    return [t for t in sorted(binders) if all(r.node in device for r in bound if r.op_type == t)]


def _pdl_row(row: Sequence[bool] | None) -> list[bool]:
    """NodeSpec::pdl: one flag per arch slot (gtco::kArchSlots), False past the node's."""
    got = [bool(x) for x in (row or ())]
    return [*got, *([False] * (len(ARCH_SLOTS) - len(got)))]


def _roles(idx: tuple[int, ...]) -> list[int]:
    """Role -> node operand index, -1 for the roles past the binding's (gtco::kMaxRoles of them)."""
    return [*idx, *([-1] * (MAX_ROLES - len(idx)))]


def _rows(tables: Sequence[Sequence[tuple[int | None, Instance]]]) -> list[tuple[int | None, list[Instance]]]:
    """Per-arch tables -> rows of (max_extent, the instance per arch) over the union of their max_extents (None,
    unbounded, last), neighbouring rows with the same instances merged."""
    def key(t: int | None) -> float:
        return float("inf") if t is None else t

    tops = sorted({t for table in tables for t, _ in table}, key=key)
    rows: list[tuple[int | None, list[Instance]]] = []
    for top in tops:
        insts = [table[bucket_of(table, key(top))][1] for table in tables]
        if rows and [i.name for i in rows[-1][1]] == [i.name for i in insts]:
            rows[-1] = (top, insts)
        else:
            rows.append((top, insts))
    return rows


def device_nodes(results: Sequence[NodeResult], binders: Mapping[str, Binder],
                 device: Mapping[str, tuple[Instance, ...]], dynamic: Mapping[str, NodeDynamic],
                 n_archs: int, fallbacks: Mapping[str, Sequence[Instance | str | None]] | None = None
                 ) -> dict[str, list[list[Instance]]]:
    """Each node that runs device kernels (as generate_glue decides: bound, of an op type every bound node of which
    has instances) -> per arch slot, every instance it may launch: its own, its dispatch entries' and its mma
    fallback (`fallbacks`, node_fallbacks)."""
    types = set(_device_types(results, binders, device))
    out: dict[str, list[list[Instance]]] = {}
    for r in results:
        if r.binding is None or r.op_type not in types or r.node not in device:
            continue
        tables = dynamic.get(r.node, NodeDynamic()).tables
        fallback = (fallbacks or {}).get(r.node, ())
        out[r.node] = []
        for s in range(n_archs):
            slot = [device[r.node][s], *(i for _, i in (tables[s] if s < len(tables) else ()))]
            if s < len(fallback) and isinstance(fallback[s], Instance):
                slot.append(fallback[s])
            out[r.node].append(slot)
    return out


NO_DISPATCH_FALLBACK = ("the node has a dispatch table (dynamic shapes), whose entries keep no fallback: a failure of "
                        "its library instance is the node's error")
"""node_fallbacks' reason for a dynamic node's slot whose instance can fail (select.fallible: a cuBLASLt one)."""


def node_fallbacks(device: Mapping[str, tuple[Instance, ...]], dynamic: Mapping[str, NodeDynamic],
                   avoid: Avoid = (), hw: Hardware | None = None) -> dict[str, tuple[Instance | str | None, ...]]:
    """Each node with a cuBLASLt instance in some arch slot -> per slot its mma fallback, or why it has none
    (plugin.device.mma_fallbacks; None where the slot's instance is not cuBLASLt). A node with a dispatch table gets
    none: the glue launches its table's entries, never its own instance, and a DispatchEntry names one instance per
    slot, with no fallback (left for when the tuner gives dispatch entries cuBLASLt configurations)."""
    out: dict[str, tuple[Instance | str | None, ...]] = {}
    for node, insts in device.items():
        if not any(map(fallible, insts)):
            continue
        if dynamic.get(node, NodeDynamic()).tables:
            out[node] = tuple(NO_DISPATCH_FALLBACK if fallible(i) else None for i in insts)
        else:
            out[node] = mma_fallbacks(insts, avoid, hw)
    return out


def _tree_digest(h: hashlib._Hash, root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".h", ".cuh", ".inc", ".cu", ".cc"):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")


def _probe_object(tmp: Path, log: list[str]) -> Path:
    """nvcc plugins/cuda/probe.cu (what the glue asks of the CUDA runtime) for every arch of CUDA_ARCHS."""
    gencode = [f for a in CUDA_ARCHS for f in ("-gencode", f"arch=compute_{a[3:]},code={a}")]
    obj = tmp / "probe.o"
    src = PLUGINS / "cuda" / "probe.cu"
    cmd = [find_nvcc(), *gencode, "-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-c", str(src),
           "-o", str(obj)]
    try:
        res = run_compile(cmd, src, timeout_s=600)
    except BuildError as e:
        raise BuildError(f"CUDA probe: {e}") from None
    log.append(" ".join(cmd) + "\n" + res.stderr)
    return obj


def _emulated_objects(tmp: Path, instances: Sequence[Instance], log: list[str],
                      impl_include: Mapping[str, Sequence[Path]] | None = None) -> list[Path]:
    """g++ -DGTCO_EMULATE each instance into an object of the library (plugins/emu runs its grid on fibers), cached
    under cache_root()/emu by a hash of the source, the command and the headers, as nvcc's objects are: models
    share most instances, and a full-size model's emulated library is built once per precision and tested more.
    An instance of a library implementation also takes its folders in `impl_include` (impl name -> folders:
    _impl_includes)."""
    cxx = find_cxx()
    cache = cache_root() / "emu"

    def one(inst: Instance) -> Path:
        src = tmp / f"{inst.name}.emu.cc"
        impl = implementation(inst.config)
        lib = [f"-I{d}" for d in (impl_include or {}).get(impl.name, ())] if impl is not None else []
        flags = ["-std=c++17", "-O2", "-pthread", "-fPIC", "-fvisibility=hidden", "-DGTCO_EMULATE",
                 *(f"-I{d}" for d in DEVICE_INCLUDE_DIRS), *lib]
        key = hashlib.sha256("\0".join([inst.source, cxx, *flags, headers_digest()]).encode()).hexdigest()[:16]
        cached = cache / f"{inst.name}.{key}.o"
        if cached.exists():
            return cached
        cache.mkdir(parents=True, exist_ok=True)
        part = cached.with_name(f"{cached.name}.{os.getpid()}.{id(inst)}.tmp")
        src.write_text(inst.source)
        cmd = [cxx, *flags, "-c", str(src), "-o", str(part)]
        try:
            res = run_compile(cmd, src, timeout_s=600)
            part.replace(cached)
        except BuildError as e:
            raise BuildError(f"emulated kernel {inst.name}: {e}") from None
        finally:
            part.unlink(missing_ok=True)
        log.append(" ".join(cmd) + "\n" + res.stderr)
        return cached

    with ThreadPoolExecutor(max_workers=max(1, min(len(instances), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, instances))


def select_device(nodes: Sequence[FusedNode], results: Sequence[NodeResult], archs: Sequence[str],
                  tuned: Mapping[str, Mapping[str, Mapping[str, int]]] | None = None, avoid: Avoid = (),
                  hw: Hardware | None = None, impls: Container[str] | None = None
                  ) -> tuple[dict[str, tuple[Instance, ...]], dict[str, str]]:
    """Each bound node's instances for `archs` (from `tuned`: node -> arch -> configuration, where the tuner has
    one; else the candidate the estimate predicts fastest on `hw`, the planning target, for the slots it runs, of
    the implementations in `impls`; never an instance in `avoid`, which ptxas rejected), and why each other bound
    node has none: its own reason, naming the arch and the family's check. A node's siblings keep their instances
    (function_only_nodes says which nodes then run their functions)."""
    by_name = {n.node.name: n for n in nodes}
    found: dict[str, tuple[Instance, ...]] = {}
    why: dict[str, str] = {}
    for r in results:
        if r.binding is None:
            continue
        got = device_instances(by_name[r.node], r.binding, archs, (tuned or {}).get(r.node), avoid, hw, impls)
        if isinstance(got, str):
            why[r.node] = got
        else:
            found[r.node] = got
    return found, why


FUNCTION_ONLY_SUFFIX = "Fn"
"""What function_only_op_type adds to a fused op type's family part: `Attention_f16` -> `AttentionFn_f16`, a name
no binder has, so the library never registers it and ORT runs the node's model-local function."""


def function_only_op_type(op_type: str) -> str:
    """The op type a fused node without a kernel of its own moves to, its siblings keeping theirs."""
    head, _, dtype = op_type.rpartition("_")
    return f"{head}{FUNCTION_ONLY_SUFFIX}_{dtype}"


def function_only_nodes(results: Sequence[NodeResult], device: Mapping[str, tuple[Instance, ...]] | None,
                        why: Mapping[str, str] | None = None) -> dict[str, str]:
    """Node -> why it must run its function while siblings of its op type keep their kernels: a node that cannot
    be bound beside bound ones, and, in a device build (`device` given), a bound node without device instances
    beside ones that have them (`why`: select_device's reasons). An op type none of whose nodes has the kernel
    keeps them all (nothing of it is registered, so they run their functions as they are)."""
    out: dict[str, str] = {}
    by_type: dict[str, list[NodeResult]] = {}
    for r in results:
        by_type.setdefault(r.op_type, []).append(r)
    for group in by_type.values():
        bound = [r for r in group if r.binding is not None]
        if device is not None and any(r.node in device for r in bound):
            out.update({r.node: r.reason or (why or {}).get(r.node) or "no device kernel" for r in group
                        if r.binding is None or r.node not in device})
        elif bound:
            out.update({r.node: r.reason or "not bound" for r in group if r.binding is None})
    return out


def move_to_functions(model: onnx.ModelProto, nodes: Mapping[str, str]) -> dict[str, str]:
    """Give each named node of `model` (changed in place) its function-only op type (function_only_op_type) and
    the model a copy of its function under that name; returns node -> new op type."""
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    moved: dict[str, str] = {}
    for n in model.graph.node:
        if n.name not in nodes:
            continue
        new = function_only_op_type(n.op_type)
        key = (n.domain, n.op_type, n.overload)
        if (n.domain, new, n.overload) not in functions:
            if key not in functions:
                raise BuildError(f"fused node {n.name!r} ({n.op_type}) has no model-local function to run")
            fn = onnx.FunctionProto()
            fn.CopyFrom(functions[key])
            fn.name = new
            model.functions.append(fn)
            functions[(n.domain, new, n.overload)] = fn
        n.op_type = new
        moved[n.name] = new
    return moved


Dispatch = Mapping[str, Mapping[str, Sequence[tuple[int | None, Mapping[str, int]]]]]
"""node name -> arch -> (max_extent, config) entries in ascending max_extent, the last covering the range's top."""


def dynamic_nodes(nodes: Sequence[FusedNode], results: Sequence[NodeResult], archs: Sequence[str],
                  device: Mapping[str, tuple[Instance, ...]], ranges: Mapping[str, tuple[int, int]],
                  dispatch: Dispatch | None = None, avoid: Avoid = (), hw: Hardware | None = None,
                  impls: Container[str] | None = None) -> dict[str, NodeDynamic]:
    """What each bound node checks and dispatches on (plugin.dispatch): the declared ranges of its input dims, and
    for a node with device instances whose run-time extent has a symbolic dim, its table per arch of `archs`:
    `dispatch`'s entries for the node where given (an entry whose config does not fit takes the default config
    at its extent), else the analytical default (dispatch.default_table); where an extent of the table has no
    instance, the node's one instance (`device`) is the whole table."""
    by_name = {n.node.name: n for n in nodes}
    out: dict[str, NodeDynamic] = {}
    # a dispatch entry has no mma fallback (node_fallbacks): a default entry is never cuBLASLt
    table_impls = frozenset(i for i in TABLE_IMPLS if impls is None or i in impls)
    for r in results:
        if r.binding is None:
            continue
        node = by_name[r.node]
        checked = node_ranges(node, ranges)
        dims = extent_dims(node, r.binding) if r.node in device else ()
        symbolic, top = extent_top(node, dims, ranges) if dims else (False, None)
        problem = device_problem(node, r.binding) if symbolic else None
        if not isinstance(problem, Problem):
            if checked:
                out[r.node] = NodeDynamic(ranges=checked)
            continue
        tables: list[tuple[tuple[int | None, Instance], ...]] = []
        for slot, arch in enumerate(archs):
            given = (dispatch or {}).get(r.node, {}).get(arch)
            own = device[r.node][slot]
            if given is None and arch in FALLBACK_SLOTS:  # the fallback slot's table, or the one own instance
                fallback = FALLBACK_SLOTS[arch]
                tables.append(tables[archs.index(fallback)] if own.arch == fallback else ((top, own),))
                continue
            if given is not None:
                check_table(given, r.node, arch)
                rows: Sequence[tuple[int | None, Mapping[str, int] | None]] = given
            else:
                default = default_table(problem, arch, top, hw, table_impls)
                rows = default if not isinstance(default, str) else [(top, None)]
            table: list[tuple[int | None, Instance]] = []
            for t, config in rows:
                at = with_extent(problem, t if t is not None else BUCKETS[-1])
                inst = select_config(at, arch, config, avoid, hw, impls)
                if isinstance(inst, str) and config:
                    inst = select_config(at, arch, avoid=avoid, hw=hw, impls=table_impls)
                if isinstance(inst, str):  # no instance at this extent: the node's one instance serves them all
                    table = [(top, device[r.node][slot])]
                    break
                if table and table[-1][1].name == inst.name:  # neighbouring entries of one instance: one entry
                    table[-1] = (t, inst)
                else:
                    table.append((t, inst))
            tables.append(tuple(table))
        out[r.node] = NodeDynamic(ranges=checked, extent=dims, tables=tuple(tables))
    return out


def build_library(model: onnx.ModelProto, out_dir: str | os.PathLike[str], *, cuda: bool,
                  emulated: bool = False, tuned: Mapping[str, Mapping[str, Mapping[str, int]]] | None = None,
                  dispatch: Dispatch | None = None, ranges: Mapping[str, tuple[int, int]] | None = None,
                  planned: Callable[[str], PlanTensor | None] | None = None, target: str | None = None
                  ) -> LibraryResult:
    """Build (or take from the cache) the model's custom-op library into out_dir (see the module docstring).

    Args:
        cuda: link the device kernels built with nvcc for CUDA_ARCHS and register them for the CUDA EP.
        emulated: instead, link them built for the CPU emulation and register them for the CPU EP (tests of the
            device path without a GPU; slow, small shapes only). Exclusive with `cuda`. A tuned cuBLASLt
            configuration is kept: its instance builds for the emulation and always gives way to the node's mma
            fallback there (gemm/cublaslt.h), which is how the fallback is tested without a GPU.
        tuned: node name -> arch -> the tuner's best configuration (onnx_gtco.tune); other nodes and archs get
            the family's default. A tuned instance that spills is a BuildError like any other; a cuBLASLt one
            brings the node's mma fallback into the build (LibraryResult.fallbacks).
        dispatch: node name -> arch -> the dispatch table [(max_extent, config)] of a node whose run-time extent
            is symbolic (onnx_gtco.tune.shape_generic); such nodes missing from it get the analytical default table
            (plugin.dispatch), whatever `tuned` says for them. Every distinct instance of the tables is built.
        ranges: the ranges of the model's symbolic dims ({dim: (lo, hi)}) that each node checks at run time; by
            default read from the model's `gtco.dynamic` metadata. optimize_file passes the plan's.
        planned: each tensor's type as the plan knew it (plugin.nodes.fused_nodes); by default the fused nodes'
            types come from shape inference over `model`. optimize_file passes the plan's view.
        target: the config.TARGETS name the model was planned for: its hardware (and calibration) ranks the
            candidates of the slots it runs, so the build selects what the planner priced; None: each arch's
            data-sheet target.

    Raises:
        BuildError: g++ or nvcc missing or failing (naming the op types / kernel), the ORT headers unavailable (or,
            for a cuBLASLt instance, cublasLt.h; in an emulated build also CUDA's runtime headers it includes), a
            malformed `gtco.dynamic` metadata or dispatch table.
    """
    if cuda and emulated:
        raise ValueError("build_library: cuda and emulated exclude each other")
    start = time.monotonic()
    out = Path(out_dir)
    if not out.is_dir():
        raise BuildError(f"library output directory {out} does not exist")
    if ranges is None:
        try:
            ranges = model_ranges(model)
        except GtcoError as e:
            raise BuildError(str(e)) from None
    nodes = fused_nodes(model, planned)
    results, binders = bind_nodes(nodes)
    archs = CUDA_ARCHS if cuda else (EMULATED_ARCH,) if emulated else ()
    hw = hardware(target) if target is not None else None
    # every header the build needs is found before the first compile: a machine without network learns what is
    # missing in a second, not after minutes of nvcc
    try:
        inc = ort_include_dir()
    except HeaderError as e:
        raise BuildError(str(e)) from None
    sel = _select_and_compile(nodes, results, archs, cuda, emulated, tuned, dispatch, ranges, hw)
    device, dynamic = sel.device, sel.dynamic
    moved, results, binders, kernel_skips = _to_functions(model, results, binders, sel, bool(archs))
    # node -> the instances it may launch per arch slot (its own, its dispatch entries', its fallback)
    launched = device_nodes(results, binders, device, dynamic, len(archs), sel.fallbacks)
    fallbacks = {node: per_slot for node, per_slot in sel.fallbacks.items() if node in launched}
    pdl = pdl_slots(model, archs, launched)
    source, op_types, device_types = generate_glue(nodes, results, binders, device, emulated, dynamic, pdl,
                                                   fallbacks)
    tables = {node: {arch: [(t, i.name, dict(i.config)) for t, i in table]
                     for arch, table in zip(archs, dynamic[node].tables, strict=True)}
              for node in launched if node in dynamic and dynamic[node].tables}
    used = {(i.name, i.arch) for per_slot in launched.values() for insts in per_slot for i in insts}
    instances = [i for i in sel.instances if (i.name, i.arch) in used]
    compiled = [c for c in sel.compiled if (c.instance.name, c.instance.arch) in used]
    cxx = find_cxx()
    nvcc = find_nvcc() if cuda else ""  # an explicit CUDA build needs nvcc even when the cache has the library
    name = _library_name(source, cxx, nvcc, emulated, instances, inc)
    dest = out / name

    fallback_names, fallback_skips = _fallback_entries(fallbacks, archs)

    def result(built: bool, created: bool, log: str, fresh: bool) -> LibraryResult:
        lib = LibraryResult(dest, op_types, device_types, results, cuda, not built and not fresh, created,
                            time.monotonic() - start, log, [c.summary() for c in compiled], kernel_skips, emulated,
                            tables, built=built,
                            rejected={f"{n} ({a})": why for (n, a), why in sel.rejected.items()},
                            function_only=moved, pdl=pdl_archs(pdl, archs),
                            fallbacks={n: names for n, names in fallback_names.items() if names},
                            fallback_skips={n: why for n, why in fallback_skips.items() if why})
        st.note = lib.what()
        return lib

    with progress.stage("library", total=2, unit="step") as st:  # the glue, the link
        if dest.is_file():
            return result(False, False, "", sel.fresh)
        cached = _build_dir(out) / name
        log_text = ""
        fresh = not cached.is_file()
        if fresh:
            log_text = _link(cached, source, op_types, inc, cxx, cuda, emulated, instances, compiled,
                             sel.impl_include, st)
        if cached != dest:
            _install(cached, dest)
        return result(fresh, True, log_text, fresh)


def _to_functions(model: onnx.ModelProto, results: list[NodeResult], binders: dict[str, Binder], sel: _Selection,
                  device_build: bool) -> tuple[dict[str, str], list[NodeResult], dict[str, Binder], dict[str, str]]:
    """Turn the nodes left without a kernel into their functions' op types in `model`: the nodes moved, the
    results and binders that remain, and the other nodes' reasons for having no device kernel."""
    moved = move_to_functions(model, function_only_nodes(results, sel.device if device_build else None,
                                                         sel.kernel_skips))
    results = [NodeResult(r.node, function_only_op_type(r.op_type), None,
                          r.reason or sel.kernel_skips.get(r.node) or "no device kernel")
               if r.node in moved else r for r in results]
    binders = {t: b for t, b in binders.items() if any(r.op_type == t and r.binding is not None for r in results)}
    return moved, results, binders, {n: why for n, why in sel.kernel_skips.items() if n not in moved}


def _fallback_entries(fallbacks: Mapping[str, Any], archs: Sequence[str]
                      ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """Per node and arch, the fallback instance's name, and why a node has none."""
    per_arch = {n: dict(zip(archs, per, strict=True)) for n, per in fallbacks.items()}
    return ({n: {a: f.name for a, f in per.items() if isinstance(f, Instance)} for n, per in per_arch.items()},
            {n: {a: f for a, f in per.items() if isinstance(f, str)} for n, per in per_arch.items()})


def _library_name(source: str, cxx: str, nvcc: str, emulated: bool, instances: Sequence[Instance], inc: Path) -> str:
    """The library's file name: a hash of everything that goes into it (the glue, the flags and compilers, each
    instance's source, the plugin headers and ORT's)."""
    h = hashlib.sha256()
    for part in (source, *CXX_FLAGS, *sanitize_flags(), cxx, nvcc, *CUDA_ARCHS, "emulated" if emulated else "",
                 *(f"{i.arch}:{i.source}" for i in instances)):
        h.update(part.encode() + b"\0")
    _tree_digest(h, PLUGINS)
    _tree_digest(h, inc)
    return f"libgtco-{h.hexdigest()[:12]}.so"


def _build_dir(out: Path) -> Path:
    """The per-user library cache, or `out` where there is none (the temp dir and the rename stay atomic)."""
    cache = lib_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise PermissionError(f"{cache} is not writable")
    except OSError:
        return out
    return cache


@dataclass
class _Selection:
    """What build_library's select-and-compile rounds settled on."""

    device: dict[str, Any]
    kernel_skips: dict[str, str]
    dynamic: dict[str, NodeDynamic]
    fallbacks: dict[str, Any]
    instances: list[Instance]  # every distinct instance the nodes may launch
    compiled: list[CompiledInstance]  # their objects (a CUDA build)
    rejected: dict[tuple[str, str], str]  # (instance, arch) -> why it is avoided
    fresh: bool  # an instance was compiled, not taken from the cache, in some round
    impl_include: dict[str, list[Path]]  # a library implementation -> its folders (cuBLASLt: cublasLt.h's, and CUDA's
    #                                      runtime headers' for the emulation's g++)


def _impl_includes(instances: Sequence[Instance], known: Mapping[str, Sequence[Path]], emulated: bool,
                   asked: Container[str]) -> tuple[dict[str, list[Path]], dict[tuple[str, str], str]]:
    """The include folders of each library implementation of `instances` not in `known` (Implementation.
    include_dirs), and the instances to avoid because their implementation's headers are missing ((name, arch) ->
    why), where it was chosen by default; a BuildError where the caller (the tuner) named that implementation."""
    found: dict[str, list[Path]] = {}
    missing: dict[tuple[str, str], str] = {}
    for impl in {i.name: i for inst in instances if (i := implementation(inst.config)) is not None}.values():
        if impl.name in known or impl.include_dirs is None:
            continue
        try:
            found[impl.name] = list(impl.include_dirs(emulated))
        except BuildError as e:
            if impl.name in asked:  # a configuration the caller named: say what is missing
                raise
            missing.update({(i.name, i.arch): f"{i.name}: {e}" for i in instances if implementation(i.config) is impl})
    return found, missing


def _select_and_compile(nodes: Sequence[FusedNode], results: Sequence[NodeResult], archs: Sequence[str], cuda: bool,
                        emulated: bool, tuned: Mapping[str, Mapping[str, Mapping[str, int]]] | None,
                        dispatch: Dispatch | None, ranges: Mapping[str, tuple[int, int]],
                        hw: Hardware | None) -> _Selection:
    """Select, compile; an instance ptxas rejects (a spill, a stack frame) is avoided and its nodes select again,
    until every node has instances that compile clean or has none left (it then runs its function)."""
    # the emulation runs the generated kernels, and a tuned configuration of a library that builds there
    # (Implementation.emulated: cuBLASLt's plan, then its node's mma fallback, gemm/cublaslt.h): another library's
    # configuration (CUTLASS) gives way, and its default selections are among the generated kernels only
    impls = MMA_ONLY if emulated else None
    if emulated and tuned:
        tuned = {n: {a: c for a, c in per.items() if (i := implementation(c)) is None or i.emulated}
                 for n, per in tuned.items()}
    asked = {str(c.get("impl")) for per in (tuned or {}).values() for c in per.values()}
    rejected: dict[tuple[str, str], str] = {}
    compiled: list[CompiledInstance] = []
    fresh = False
    impl_include: dict[str, list[Path]] = {}
    while True:
        device, kernel_skips = select_device(nodes, results, archs, tuned, rejected, hw, impls) if archs else ({}, {})
        dynamic = dynamic_nodes(nodes, results, archs, device, ranges, dispatch, rejected, hw, impls)
        fallbacks = node_fallbacks(device, dynamic, rejected, hw)  # built, and ptxas-checked, with the others
        unique = {(i.name, i.arch): i for node in device
                  for i in (*device[node], *(i for t in dynamic.get(node, NodeDynamic()).tables for _, i in t),
                            *(f for f in fallbacks.get(node, ()) if isinstance(f, Instance)))}
        instances = [unique[k] for k in sorted(unique)]  # nodes of the same problem share an instance
        found, missing = _impl_includes(instances, impl_include, emulated, asked)
        impl_include.update(found)
        if missing:  # chosen by default: without its headers no such instance, and its nodes select again
            rejected.update(missing)
            continue
        if not cuda:
            break
        new: dict[tuple[str, str], str] = {}
        # nvcc per instance, cached across models; BuildError names a failing one
        compiled = compile_instances(instances, rejected=new)
        fresh = fresh or bool(new) or any(not c.cached for c in compiled)
        if not new:
            break
        again = [k for k in new if k in rejected]
        if again:  # a selection that returns what it was told to avoid would loop forever
            raise BuildError(f"{new[again[0]]} (selected again after ptxas rejected it)")
        rejected.update(new)
    return _Selection(device, kernel_skips, dynamic, fallbacks, instances, compiled, rejected, fresh, impl_include)


def _link(cached: Path, source: str, op_types: Sequence[str], inc: Path, cxx: str, cuda: bool, emulated: bool,
          instances: Sequence[Instance], compiled: Sequence[CompiledInstance],
          impl_include: Mapping[str, Sequence[Path]], st: Any) -> str:
    """Compile the glue and link the library as `cached` (renamed there whole, built in a temporary folder beside
    it); the build log."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cached.parent))
    except OSError as e:
        raise BuildError(f"cannot build in {cached.parent}: {e.strerror or e}") from None
    name = cached.name
    log: list[str] = []
    try:
        glue = tmp / "glue.cc"
        glue.write_text(source)
        obj = tmp / "glue.o"
        inc_flags = [*(f"-I{d}" for d in GLUE_INCLUDE_DIRS), f"-I{inc}"]
        cmd = [cxx, *CXX_FLAGS, *inc_flags, "-c", str(glue), "-o", str(obj)]
        try:
            res = run_compile(cmd, glue, timeout_s=600)
        except BuildError as e:
            raise BuildError(f"glue of op types {', '.join(op_types) or '(none)'}: {e}") from None
        log.append(" ".join(cmd) + "\n" + res.stderr)
        st.step("link")
        objs = [obj]
        if cuda:
            objs += [_probe_object(tmp, log), *(c.object_path for c in compiled)]
            link = [find_nvcc(), "-shared", "-cudart", "static", "-o", str(tmp / name), *map(str, objs)]
        else:
            objs += _emulated_objects(tmp, instances, log, impl_include) if emulated else []
            link = [cxx, "-shared", "-pthread", "-o", str(tmp / name), *map(str, objs)]
        res = run_compile(link, tmp / name, timeout_s=600)
        log.append(" ".join(link) + "\n" + res.stderr)
        st.step()
        os.replace(tmp / name, cached)
        return "\n".join(log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(cached: Path, dest: Path) -> None:
    """Copy the cached library to `dest` (whole or not at all)."""
    fd, part = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(cached, part)
        os.chmod(part, 0o755)
        os.replace(part, dest)
    except OSError as e:
        Path(part).unlink(missing_ok=True)
        raise BuildError(f"cannot write {dest}: {e.strerror or e}") from None


def library_info(path: str | os.PathLike[str]) -> dict[str, object]:
    """The JSON a built library reports about itself (its exported gtco_library_info), read with ctypes."""
    import ctypes

    lib = ctypes.CDLL(str(path))
    f = lib.gtco_library_info
    f.restype = ctypes.c_char_p
    return dict(json.loads(f().decode()))


__all__ = ["BuildError", "Dispatch", "LibraryResult", "NodeResult", "bind_node", "bind_nodes", "build_library",
           "dynamic_nodes", "generate_glue", "library_info", "select_device"]
