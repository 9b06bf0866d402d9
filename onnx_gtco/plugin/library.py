"""Build the custom-op library of a rewritten model: bind its fused nodes, generate the glue, compile, cache.

`build_library(model, out_dir, cuda=...)`:

1. `fused_nodes(model)`; each node's family binder (binders.py) maps its operands onto the C++ roles or says why it
   cannot. Registration is per op type (a registered op type hides the model-local function of *every* node of
   that name, facts §4/5): an op type is registered only when every one of its nodes binds; otherwise all its
   nodes keep their functions and the report says why.
2. One generated glue `.cc`: includes plugins/ort/gtco_ort.h and the used families' headers, the NodeSpec table
   `kNodes`, `add_ops()` registering one CPU-EP op per bound op type (and a CUDA-EP op only when every node of the
   op type has CUDA instances: today never), `kLibraryInfo` (JSON), then register.inc.
3. g++ -std=c++17 -O2 -fPIC -fvisibility=hidden against `ort_include_dir()`. With cuda=True, nvcc also builds
   plugins/cuda/probe.cu and the kernel instance every fused node selects (kernels.select) for sm_80 and sm_90,
   through kernels.compile (cached objects, the ptxas report checked: a spill or a stack frame is a BuildError
   naming the kernel and its parameters; registers / shared memory / spills go into the report), and the library
   links them with the CUDA runtime statically. The C++ CUDA branch of the op structs does not call them yet, so
   no op type is registered for the CUDA EP (the hook is `Binding.instances`).
4. The file is `libgtco-<hash12>.so`, the hash covering the generated source, every file under plugins/, the
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from onnx_gtco.kernels.compile import CompiledInstance, compile_instances
from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.select import model_instances
from onnx_gtco.kernels.toolchain import PLUGINS_DIR, BuildError, cache_root, find_cxx, find_nvcc, run_compile
from onnx_gtco.plugin.binders import binder_for
from onnx_gtco.plugin.binding import MAX_ROLES, Binder, Binding, FusedNode
from onnx_gtco.plugin.headers import HeaderError, ort_include_dir
from onnx_gtco.plugin.nodes import fused_nodes

PLUGINS = PLUGINS_DIR
CUDA_ARCHS = ("sm_80", "sm_90")
CXX_FLAGS = ("-std=c++17", "-O3", "-pthread", "-fPIC", "-fvisibility=hidden", "-Wall")
_DTYPES = {"f32": "gtco::DType::f32", "f16": "gtco::DType::f16", "bf16": "gtco::DType::bf16"}


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
        cuda_op_types: op types it also registers for the CUDA EP.
        nodes: every fused node with its binding or the reason it keeps its function.
        cuda: whether nvcc objects (probe + instances) are linked in.
        cached: the library came from the cache (no compiler ran).
        created: the file was written into out_dir by this call (it was not there already).
        seconds: wall time of build_library.
        log: compiler command lines and their output.
        kernels: the compiled kernel instances (cuda builds): name, arch, config, ptxas registers / smem / spills.
        kernel_skips: fused node -> why it selects no kernel instance (cuda builds).
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

    @property
    def name(self) -> str:
        return self.path.name

    def skipped(self) -> dict[str, str]:
        """Node name -> why it keeps running its function."""
        return {n.node: n.reason for n in self.nodes if n.reason is not None}

    def to_json(self) -> dict[str, object]:
        return {"file": self.name, "cuda": self.cuda, "op_types": self.op_types,
                "cuda_op_types": self.cuda_op_types, "skipped": self.skipped(), "kernels": self.kernels,
                "kernel_skips": self.kernel_skips}


def lib_cache_dir() -> Path:
    return cache_root() / "libs"


def bind_nodes(nodes: Sequence[FusedNode]) -> tuple[list[NodeResult], dict[str, Binder]]:
    """Bind every node; an op type is kept only when all its nodes bind (else every node of it gets a reason)."""
    results: list[NodeResult] = []
    binders: dict[str, Binder] = {}
    seen: dict[str, int] = {}
    for n in nodes:
        seen[n.node.name] = seen.get(n.node.name, 0) + 1
    for n in nodes:
        binder = binder_for(n.family)
        res: Binding | str
        if binder is None:
            res = f"no plugin kernel for family {n.family!r} yet"
        elif n.dtype not in _DTYPES:
            res = f"dtype {n.dtype!r} has no kernel"
        elif not n.node.name or seen[n.node.name] > 1:
            res = f"node name {n.node.name!r} is empty or not unique (the kernel finds its node by name)"
        else:
            res = binder.bind(n)
            binders[n.node.op_type] = binder
        if isinstance(res, str):
            results.append(NodeResult(n.node.name, n.node.op_type, None, res))
        else:
            results.append(NodeResult(n.node.name, n.node.op_type, res, None))
    failed = {r.op_type: r for r in results if r.reason is not None}
    out = []
    for r in results:
        bad = failed.get(r.op_type)
        if r.reason is None and bad is not None:
            r = NodeResult(r.node, r.op_type, None, f"op type {r.op_type} not registered: node {bad.node!r} "
                           f"cannot be bound ({bad.reason})")
        out.append(r)
    return out, {k: v for k, v in binders.items() if k not in failed}


def _c(s: str) -> str:
    return json.dumps(s, ensure_ascii=True)


def _roles(idx: tuple[int, ...]) -> str:
    return "{" + ", ".join(str(i) for i in (*idx, *([-1] * (MAX_ROLES - len(idx))))) + "}"


def generate_glue(nodes: Sequence[FusedNode], results: Sequence[NodeResult], binders: dict[str, Binder],
                  cuda: bool) -> tuple[str, list[str], list[str], dict[str, str]]:
    """The glue source, the op types registered for the CPU EP and for the CUDA EP, and symbol -> instance name
    of the CUDA instances it references."""
    by_name = {n.node.name: n for n in nodes}
    bound = [r for r in results if r.binding is not None]
    op_types = sorted(binders)
    instances: dict[str, str] = {}
    cuda_types = []
    for t in op_types:
        rs = [r for r in bound if r.op_type == t]
        if cuda and rs and all(r.binding is not None and r.binding.instances for r in rs):
            cuda_types.append(t)
    lines = ["// Generated by onnx_gtco.plugin.library: do not edit.", '#include "gtco_ort.h"']
    lines += [f'#include "{h}"' for h in sorted({b.header for b in binders.values()})]
    decls, rows = [], []
    for r in bound:
        assert r.binding is not None
        n = by_name[r.node]
        fn = "nullptr"
        if r.op_type in cuda_types:
            inst = r.binding.instances[0]
            instances[inst.symbol] = inst.name
            decls.append(f'extern "C" int {inst.symbol}(const void* args, void* stream);')
            fn = f"reinterpret_cast<const void*>(&{inst.symbol})"
        rows.append(f"    {{{_c(r.op_type)}, {_c(r.node)}, {len(n.node.input)}, {len(n.node.output)}, "
                    f"{_roles(r.binding.inputs)}, {_roles(r.binding.outputs)}, {fn}}},")
    lines += decls
    lines += ["", "namespace gtco {", "", "const NodeSpec kNodes[] = {"]
    lines += rows or ['    {"", "", 0, 0, {-1}, {-1}, nullptr},  // placeholder: no node is bound']
    lines += ["};", f"const size_t kNodeCount = {len(rows)};", ""]
    info = {"op_types": op_types, "cuda_op_types": cuda_types,
            "nodes": {r.node: r.op_type for r in bound}, "cuda": cuda}
    text = json.dumps(info, sort_keys=True)
    if ")gtco\"" in text:
        raise BuildError("a node name contains the sequence )gtco\" that the generated glue cannot quote")
    lines += [f'const char* const kLibraryInfo = R"gtco({text})gtco";', "",
              "// The op objects, created on first use and never freed (they must outlive every session).",
              "struct GeneratedOps {"]
    cpu_ops, cuda_ops = [], []
    for k, t in enumerate(op_types):
        b = binders[t]
        dt = _DTYPES[t.rsplit("_", 1)[1]]
        lines.append(f"    FusedOp<{b.cpp_struct}, {dt}, false> cpu{k}{{{_c(t)}}};")
        cpu_ops.append(f"    domain.Add(&o.cpu{k});")
        if t in cuda_types:
            lines.append(f"    FusedOp<{b.cpp_struct}, {dt}, true> cuda{k}{{{_c(t)}}};")
            cpu_ops.append(f"    domain.Add(&o.cuda{k});")
            cuda_ops += [f"    domain.Add(&o.cpu{k});", f"    domain.Add(&o.cuda{k});"]
    lines += ["};", "static GeneratedOps& generated_ops() {", "    static GeneratedOps* o = new GeneratedOps();",
              "    return *o;", "}", ""]
    for fn, adds, doc in (("add_ops", cpu_ops, "every op type"),
                          ("add_cuda_ops", cuda_ops, "gtco.register=cuda: only the op types with CUDA kernels")):
        lines += [f"// {doc} (register.inc)", f"void {fn}(Ort::CustomOpDomain& domain) {{",
                  "    GeneratedOps& o = generated_ops();", *adds, "    (void)o;", "    (void)domain;", "}", ""]
    lines += ["}  // namespace gtco", "", '#include "register.inc"', ""]
    return "\n".join(lines), op_types, cuda_types, instances


def _tree_digest(h: hashlib._Hash, root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".h", ".cuh", ".inc", ".cu", ".cc"):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")


def _cuda_objects(tmp: Path, instances: Sequence[tuple[str, str, tuple[str, ...]]], log: list[str]) -> list[Path]:
    """nvcc the probe (for every arch of CUDA_ARCHS) and each instance (name, source, its archs); checks the ptxas
    report of every kernel."""
    nvcc = find_nvcc()
    objs = []
    sources = [("probe", (PLUGINS / "cuda" / "probe.cu").read_text(), CUDA_ARCHS), *instances]
    for name, text, archs in sources:
        gencode = [f for a in archs for f in ("-gencode", f"arch=compute_{a[3:]},code={a}")]
        src = tmp / f"{name}.cu"
        src.write_text(text)
        obj = tmp / f"{name}.o"
        cmd = [nvcc, *gencode, "-std=c++17", "-O3", "-Xptxas", "-v", "-Xcompiler", "-fPIC,-fvisibility=hidden",
               f"-I{PLUGINS / 'include'}", "-c", str(src), "-o", str(obj)]
        try:
            res = run_compile(cmd, src, timeout_s=600)
        except BuildError as e:
            raise BuildError(f"CUDA kernel {name}: {e}") from None
        log.append(" ".join(cmd) + "\n" + res.stderr)
        for k in parse_ptxas(res.stderr):
            if k.spills or k.stack_frame_bytes > 0:
                raise BuildError(f"CUDA kernel {name} ({k.name}, {k.arch}): {k.stack_frame_bytes} bytes stack frame, "
                                 f"{k.spill_store_bytes} bytes spill stores: choose another config")
        objs.append(obj)
    return objs


def build_library(model: onnx.ModelProto, out_dir: str | os.PathLike[str], *, cuda: bool) -> LibraryResult:
    """Build (or take from the cache) the model's custom-op library into out_dir (see the module docstring).

    Raises:
        BuildError: g++ or nvcc missing or failing (naming the op types / kernel), the ORT headers unavailable.
    """
    start = time.monotonic()
    out = Path(out_dir)
    if not out.is_dir():
        raise BuildError(f"library output directory {out} does not exist")
    nodes = fused_nodes(model)
    results, binders = bind_nodes(nodes)
    source, op_types, cuda_types, _ = generate_glue(nodes, results, binders, cuda)
    unique = {i.symbol: (i.name, i.source, (i.arch,)) for r in results
              if r.binding is not None and r.op_type in cuda_types
              for i in r.binding.instances}  # nodes of the same shape share an instance
    instances = [unique[k] for k in sorted(unique)]
    compiled: list[CompiledInstance] = []
    kernel_skips: dict[str, str] = {}
    if cuda:
        selected, kernel_skips = model_instances(model, CUDA_ARCHS)
        compiled = compile_instances(selected)  # cached per instance; BuildError names a failing or spilling one
    try:
        inc = ort_include_dir()
    except HeaderError as e:
        raise BuildError(str(e)) from None
    cxx = find_cxx()
    nvcc = find_nvcc() if cuda else ""  # an explicit CUDA build needs nvcc even when the cache has the library
    h = hashlib.sha256()
    for part in (source, *CXX_FLAGS, cxx, nvcc, *CUDA_ARCHS, *(t for _, t, _ in instances),
                 *(f"{c.instance.arch}:{c.instance.source}" for c in compiled)):
        h.update(part.encode() + b"\0")
    _tree_digest(h, PLUGINS)
    _tree_digest(h, inc)
    name = f"libgtco-{h.hexdigest()[:12]}.so"
    dest = out / name

    def result(cached: bool, created: bool, log: str) -> LibraryResult:
        return LibraryResult(dest, op_types, cuda_types, results, cuda, cached, created, time.monotonic() - start,
                             log, [c.summary() for c in compiled], kernel_skips)

    if dest.is_file():
        return result(True, False, "")
    cache = lib_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise PermissionError(f"{cache} is not writable")
    except OSError:
        cache = out  # no per-user cache: build in out_dir (the temp dir and the rename stay atomic)
    cached = cache / name
    log_text = ""
    if not cached.is_file():
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
        except OSError as e:
            raise BuildError(f"cannot build in {cache}: {e.strerror or e}") from None
        log: list[str] = []
        try:
            glue = tmp / "glue.cc"
            glue.write_text(source)
            obj = tmp / "glue.o"
            inc_flags = [f"-I{PLUGINS / 'ort'}", f"-I{PLUGINS / 'cpu'}", f"-I{inc}"]
            cmd = [cxx, *CXX_FLAGS, *inc_flags, "-c", str(glue), "-o", str(obj)]
            try:
                res = run_compile(cmd, glue, timeout_s=600)
            except BuildError as e:
                raise BuildError(f"glue of op types {', '.join(op_types) or '(none)'}: {e}") from None
            log.append(" ".join(cmd) + "\n" + res.stderr)
            objs = [obj]
            if cuda:
                objs += _cuda_objects(tmp, instances, log) + [c.object_path for c in compiled]
                link = [find_nvcc(), "-shared", "-cudart", "static", "-o", str(tmp / name), *map(str, objs)]
            else:
                link = [cxx, "-shared", "-pthread", "-o", str(tmp / name), *map(str, objs)]
            res = run_compile(link, tmp / name, timeout_s=600)
            log.append(" ".join(link) + "\n" + res.stderr)
            log_text = "\n".join(log)
            os.replace(tmp / name, cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fresh = True
    else:
        fresh = False
    if cached == dest:
        return result(False, True, log_text)
    fd, part = tempfile.mkstemp(prefix=f".{name}.", dir=out)
    os.close(fd)
    try:
        shutil.copyfile(cached, part)
        os.chmod(part, 0o755)
        os.replace(part, dest)
    except OSError as e:
        Path(part).unlink(missing_ok=True)
        raise BuildError(f"cannot write {dest}: {e.strerror or e}") from None
    return result(not fresh, True, log_text)


def library_info(path: str | os.PathLike[str]) -> dict[str, object]:
    """The JSON a built library reports about itself (its exported gtco_library_info), read with ctypes."""
    import ctypes

    lib = ctypes.CDLL(str(path))
    f = lib.gtco_library_info
    f.restype = ctypes.c_char_p
    return dict(json.loads(f().decode()))


__all__ = ["BuildError", "LibraryResult", "NodeResult", "bind_nodes", "build_library", "generate_glue",
           "library_info"]
