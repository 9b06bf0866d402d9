"""Compile generated instances with nvcc for their architecture, read ptxas's resource report, and cache the objects.

Every instance is compiled with `-Xptxas -v`; a kernel that spills registers or needs a stack frame is a
BuildError naming the instance and its configuration (a spill costs more than any tile choice gains). Objects are
cached by a hash of the instance source, the architecture, the nvcc flags and every header under plugins/include,
so the same kernel is compiled once per machine whatever model asks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from onnx_gtco import progress
from onnx_gtco.errors import BuildError, HeaderError, KernelResourceError
from onnx_gtco.kernels.family import Instance
from onnx_gtco.kernels.ptxas import KernelResources, parse_ptxas
from onnx_gtco.kernels.select import impl_include_dirs, implementation
from onnx_gtco.kernels.toolchain import DEVICE_INCLUDE_DIRS, cache_root, headers_digest, nvcc_compile

NVCC_FLAGS: tuple[str, ...] = ("-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden")
TIMEOUT_S = 1200.0  # a CUTLASS instance takes about 60 s of one core, several times that on a busy machine


@dataclass(frozen=True)
class CompiledInstance:
    """An instance's device object and what ptxas said about each of its kernels."""

    instance: Instance
    object_path: Path
    kernels: tuple[KernelResources, ...]
    seconds: float
    cached: bool

    def summary(self) -> dict[str, object]:
        """Registers, shared memory and spills per kernel, for the optimize report."""
        return {
            "instance": self.instance.name, "arch": self.instance.arch, "config": dict(self.instance.config),
            "dynamic_smem_bytes": self.instance.smem_bytes, "compile_s": round(self.seconds, 2),
            "cached": self.cached,
            "kernels": [{"registers": k.registers, "static_smem_bytes": k.smem_bytes,
                         "stack_frame_bytes": k.stack_frame_bytes, "spill_store_bytes": k.spill_store_bytes,
                         "spill_load_bytes": k.spill_load_bytes} for k in self.kernels],
        }


def describe(instance: Instance) -> str:
    """`gemm_sm80_f16_... (BM=128, BN=64, ...)`: the instance and its parameters, for error messages."""
    params = ", ".join(f"{k}={v}" for k, v in instance.config.items())
    return f"{instance.name} ({params})"


def check_resources(instance: Instance, kernels: Sequence[KernelResources]) -> None:
    """Raise BuildError when ptxas reported no kernel, a spill or a stack frame for `instance` (an instance of an
    implementation without kernels of its own, Implementation.own_kernels: host code calling cuBLASLt, has none)."""
    impl = implementation(instance.config)
    if not kernels and (impl is None or impl.own_kernels):
        raise KernelResourceError(f"{describe(instance)} for {instance.arch}: ptxas reported no kernel",
                                  instance.name, instance.arch)
    for k in kernels:
        if k.spills or k.stack_frame_bytes:
            raise KernelResourceError(
                f"{describe(instance)} for {instance.arch}: ptxas reports {k.registers} registers, "
                f"{k.stack_frame_bytes} B stack frame, {k.spill_store_bytes} B spill stores, "
                f"{k.spill_load_bytes} B spill loads; this configuration must not be used",
                instance.name, instance.arch)


def include_dirs(instance: Instance) -> list[Path]:
    """The device include folders (plugins/include, plugins/families), the instance's own include folders (a library's
    headers, e.g. CUTLASS's), and its implementation's (select.impl_include_dirs: cuBLASLt's header, fetched on first
    use)."""
    return [*DEVICE_INCLUDE_DIRS, *map(Path, instance.include_dirs), *impl_include_dirs(instance, False)]


def compile_instance(instance: Instance, cache_dir: str | os.PathLike[str] | None = None,
                     flags: Sequence[str] = NVCC_FLAGS) -> CompiledInstance:
    """nvcc -Xptxas -v one instance into a cached object; BuildError on a compile error, spill or stack frame."""
    flags = (*flags, *instance.nvcc_flags)
    key = hashlib.sha256("\0".join([instance.source, instance.arch, *flags, *instance.include_dirs,
                                    headers_digest()]).encode())
    out = Path(cache_dir) if cache_dir is not None else cache_root() / "kernels"
    entry = out / f"{instance.name}.{key.hexdigest()[:16]}"
    obj, report = entry.with_suffix(".o"), entry.with_suffix(".ptxas.json")
    if obj.exists() and report.exists():
        data = json.loads(report.read_text())
        kernels = tuple(KernelResources(**k) for k in data["kernels"])
        check_resources(instance, kernels)
        return CompiledInstance(instance, obj, kernels, float(data["seconds"]), cached=True)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gtco-nvcc-", dir=out) as tmp:
        src = Path(tmp) / f"{instance.name}.cu"
        src.write_text(instance.source)
        tmp_obj = Path(tmp) / "kernel.o"
        try:
            result = nvcc_compile(src, tmp_obj, instance.arch, include_dirs=include_dirs(instance), extra=flags,
                                  timeout_s=TIMEOUT_S)
        except (BuildError, HeaderError) as e:  # a header the instance needs (cuBLASLt's) is a build failure too
            raise BuildError(f"{describe(instance)} for {instance.arch}: {e}") from None
        kernels = tuple(parse_ptxas(result.stderr))
        check_resources(instance, kernels)
        tmp_report = Path(tmp) / "ptxas.json"
        tmp_report.write_text(json.dumps({"seconds": result.seconds,
                                          "kernels": [asdict(k) for k in kernels]}))
        tmp_obj.replace(obj)
        tmp_report.replace(report)
    return CompiledInstance(instance, obj, kernels, result.seconds, cached=False)


def compile_instances(instances: Iterable[Instance], cache_dir: str | os.PathLike[str] | None = None,
                      jobs: int | None = None, rejected: dict[tuple[str, str], str] | None = None
                      ) -> list[CompiledInstance]:
    """compile_instance over distinct instances (by name and arch), `jobs` nvcc processes at a time.

    With `rejected` given, an instance ptxas rejects (KernelResourceError: a spill, a stack frame) is left out of
    the result and recorded there ((name, arch) -> the reason) instead of raising; every other failure raises.
    """
    unique: dict[tuple[str, str], Instance] = {}
    for inst in instances:
        prev = unique.setdefault((inst.name, inst.arch), inst)
        if prev.source != inst.source:
            raise BuildError(f"two different sources are named {inst.name} for {inst.arch}")
    workers = jobs or max(1, min(len(unique), os.cpu_count() or 1))
    done: dict[tuple[str, str], CompiledInstance] = {}
    with progress.stage("kernels", total=len(unique), unit="kernel") as st, \
            ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(compile_instance, inst, cache_dir): key for key, inst in unique.items()}
        hits = 0
        for f in as_completed(futures):
            try:
                c = done[futures[f]] = f.result()
            except KernelResourceError as e:
                if rejected is None:
                    raise
                rejected[futures[f]] = str(e)
                st.step(f"{hits} from the cache")
                continue
            hits += c.cached
            st.step(f"{hits} from the cache")
        st.note = f"compiled {len(done) - hits} of {len(done)} kernels, {hits} from the cache"
    return [done[k] for k in unique if k in done]
