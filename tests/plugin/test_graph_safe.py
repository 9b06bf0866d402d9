"""The device path can be captured in a CUDA graph (ORT's enable_cuda_graph): a call allocates nothing, syncs
nothing, sets no function attribute after the first launch and builds no string unless it fails.

Without a GPU this is shown on the host code itself: the dynamic shared memory opt-in (gtco/smem_opt_in.h) built
with g++ against a stand-in cuda_runtime.h that counts the CUDA calls, run_instance refusing an eagerly built
description at compile time, and a scan of the launch path's sources for CUDA calls a captured run must not make.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from onnx_gtco.kernels.toolchain import GLUE_INCLUDE_DIRS, find_cxx
from onnx_gtco.plugin.headers import ort_include_dir

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"

FAKE_CUDA = textwrap.dedent("""
    // stand-in for the CUDA runtime: counts what the opt-in calls
    #pragma once
    typedef int cudaError_t;
    enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
    enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
    extern int g_device, g_set, g_fail;
    inline cudaError_t cudaGetDevice(int* d) { *d = g_device; return cudaSuccess; }
    template <class T>
    cudaError_t cudaFuncSetAttribute(T, cudaFuncAttribute, int) { ++g_set; return g_fail ? cudaErrorInvalidValue : 0; }
""")

DRIVER = textwrap.dedent("""
    #include <cstdio>
    #include "gtco/smem_opt_in.h"
    int g_device = 0, g_set = 0, g_fail = 0;
    static void k1(int) {}
    static void k2(int) {}
    static gtco::SmemOptIn a, b, c;
    static void report(const char* what, bool ok) { std::printf("%s %d %d\\n", what, g_set, ok ? 1 : 0); }
    int main() {
        bool ok = true;
        for (int i = 0; i < 100; ++i) ok = gtco::smem_opt_in(a, &k1, 64 * 1024) && ok;
        report("repeat", ok);                                  // 100 launches: one attribute call
        ok = gtco::smem_opt_in(a, &k1, 96 * 1024);
        report("larger", ok);                                  // a larger size: one more
        ok = gtco::smem_opt_in(a, &k1, 64 * 1024);
        report("smaller", ok);                                 // covered by the larger one: none
        g_device = 1;
        for (int i = 0; i < 5; ++i) ok = gtco::smem_opt_in(a, &k1, 64 * 1024) && ok;
        report("device1", ok);                                 // another device: once more
        g_device = 0;
        ok = gtco::smem_opt_in(a, &k1, 48 * 1024);
        report("default", ok);                                 // within 48 KiB: never
        for (int i = 0; i < 3; ++i) ok = gtco::smem_opt_in(b, i % 2 ? &k2 : &k1, 64 * 1024) && ok;
        report("two_kernels", ok);                             // k1 once, k2 on each of its launches
        g_fail = 1;
        ok = gtco::smem_opt_in(c, &k1, 64 * 1024);
        report("refused", ok);                                 // CUDA refuses: false, not remembered
        g_fail = 0;
        ok = gtco::smem_opt_in(c, &k1, 64 * 1024) && gtco::smem_opt_in(c, &k1, 64 * 1024);
        report("retried", ok);
        return 0;
    }
""")


def test_smem_opt_in_sets_the_attribute_once_per_kernel_and_device(tmp_path: Path) -> None:
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "cuda_runtime.h").write_text(FAKE_CUDA)
    (tmp_path / "driver.cc").write_text(DRIVER)
    exe = tmp_path / "driver"
    subprocess.run([find_cxx(), "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{tmp_path / 'fake'}",
                    f"-I{PLUGINS / 'include'}", str(tmp_path / "driver.cc"), "-o", str(exe)], check=True,
                   capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout.split("\n")
    got = {w: (int(n), ok == "1") for w, n, ok in (line.split() for line in out if line)}
    assert got == {"repeat": (1, True), "larger": (2, True), "smaller": (2, True), "device1": (3, True),
                   "default": (3, True), "two_kernels": (5, True), "refused": (6, False), "retried": (7, True)}


def _launch_macro(text: str) -> str:
    """The CUDA (not emulated) definition of GTCO_LAUNCH_SMEM in launch.cuh."""
    cuda = text.split("#else", 1)[1]
    m = re.search(r"#define GTCO_LAUNCH_SMEM\(.*?\n((?:.*\\\n)*.*\n)", cuda)
    assert m, "launch.cuh has no CUDA GTCO_LAUNCH_SMEM"
    return m.group(1)


FORBIDDEN = re.compile(r"\b(cudaMalloc\w*|cudaFree\w*|cudaMemcpy|cudaMemset|cuda\w*Synchronize|cudaDeviceSetLimit|"
                       r"cudaStreamCreate\w*|cudaEventCreate\w*|GetAllocator|cudaFuncSetAttribute)\b\s*\(")


def test_the_launch_path_makes_no_call_a_captured_run_must_not_make() -> None:
    """The ORT glue (plugins/ort, each family's op struct), the launch macros and the families' host launchers call no
    allocator, no synchronizing copy or wait and no cudaFuncSetAttribute; the opt-in header alone sets the attribute,
    and the launch macro goes through it."""
    macro = _launch_macro((PLUGINS / "include" / "gtco" / "launch.cuh").read_text())
    assert "smem_opt_in(" in macro and "cudaFuncSetAttribute" not in macro, macro
    sources = [*sorted((PLUGINS / "ort").glob("*.h")), PLUGINS / "ort" / "register.inc",
               *sorted((PLUGINS / "families").glob("*/*_op.h")), *sorted((PLUGINS / "include" / "gtco").glob("*.cuh")),
               *sorted((PLUGINS / "families").glob("*/*.cuh"))]
    assert len(sources) >= 16, sources  # the shared glue and headers, and each family's op struct and header
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sources
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if FORBIDDEN.search(line.split("//")[0])]
    assert not hits, hits
    opt_in = (PLUGINS / "include" / "gtco" / "smem_opt_in.h").read_text()
    assert len(re.findall(r"\bcudaFuncSetAttribute\(", opt_in)) == 1


def test_the_cutlass_instance_path_leaves_allocation_and_attributes_to_the_graph_safe_helpers() -> None:
    """A CUTLASS instance's entry point (plugins/families/gemm/cutlass_gemm.cu.j2) neither allocates its workspace per
    call nor lets GemmUniversalAdapter::initialize set the shared memory attribute per call: it takes the workspace from
    gtco/scratch.h and the opt-in from gtco/smem_opt_in.h."""
    text = (PLUGINS / "families" / "gemm" / "cutlass_gemm.cu.j2").read_text()
    code = "\n".join(line.split("//")[0] for line in text.splitlines())
    assert not FORBIDDEN.search(code), FORBIDDEN.search(code)
    assert not re.search(r"\.(initialize|run)\(", code), "the adapter object's initialize/run set attributes per call"
    assert "gtco::stream_scratch(" in code and "gtco::smem_opt_in(" in code


SCRATCH_CUDA = textwrap.dedent("""
    // stand-in for the CUDA runtime: counts what the scratch helper calls
    #pragma once
    #include <cstddef>
    #include <cstdlib>
    typedef int cudaError_t;
    typedef void* cudaStream_t;
    enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
    enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
    extern int g_device, g_malloc, g_free, g_sync, g_capturing, g_oom, g_memset;
    inline cudaError_t cudaGetDevice(int* d) { *d = g_device; return cudaSuccess; }
    inline cudaError_t cudaGetLastError() { return cudaSuccess; }
    inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* s) {
        *s = g_capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
        return cudaSuccess;
    }
    inline cudaError_t cudaStreamSynchronize(cudaStream_t) { ++g_sync; return cudaSuccess; }
    inline cudaError_t cudaMalloc(void** p, size_t n) {
        if (g_oom) return cudaErrorMemoryAllocation;
        ++g_malloc; *p = std::malloc(n); return cudaSuccess;
    }
    inline cudaError_t cudaFree(void* p) { ++g_free; std::free(p); return cudaSuccess; }
    inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
        ++g_memset; unsigned char* b = static_cast<unsigned char*>(p);
        for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(v);
        return cudaSuccess;
    }
""")

SCRATCH_DRIVER = textwrap.dedent("""
    #include <cstdio>
    #include "gtco/scratch.h"
    int g_device = 0, g_malloc = 0, g_free = 0, g_sync = 0, g_capturing = 0, g_oom = 0, g_memset = 0;
    static int s1, s2;
    static void report(const char* what, const void* p, const char* why) {
        std::printf("%s %d %d %d %d %d\\n", what, g_malloc, g_free, g_sync, p ? 1 : 0, why ? 1 : 0);
    }
    int main() {
        const char* why = nullptr;
        void* first = gtco::stream_scratch(&s1, 1000, why);
        void* p = first;
        for (int i = 0; i < 100; ++i) p = gtco::stream_scratch(&s1, 1000 - i, why);
        report("repeat", p == first ? p : nullptr, why);        // 101 calls: one allocation, one buffer
        p = gtco::stream_scratch(&s2, 1000, why);
        report("stream2", p != first ? p : nullptr, why);       // another stream: its own buffer
        g_device = 1;
        p = gtco::stream_scratch(&s1, 10, why);
        report("device1", p != first ? p : nullptr, why);       // another device: its own buffer
        g_device = 0;
        g_capturing = 1;
        p = gtco::stream_scratch(&s1, 1000, why);
        report("captured_fits", p == first ? p : nullptr, why); // under capture, the buffer made earlier
        p = gtco::stream_scratch(&s1, 4000, why);
        report("captured_grow", p, why);                        // under capture, no allocation: a reason
        g_capturing = 0;
        p = gtco::stream_scratch(&s1, 4000, why);
        report("grow", p, why);                                 // uncaptured: sync the stream, free, allocate
        g_oom = 1;
        p = gtco::stream_scratch(&s2, 8000, why);
        report("oom", p, why);
        p = gtco::stream_scratch(&s1, 0, why);
        report("empty", p, why);                                // no workspace asked: none made
        g_oom = 0;
        const int memsets = g_memset;
        unsigned* z = static_cast<unsigned*>(gtco::stream_scratch_zeroed(&s1, 64, why));
        bool zero = z != nullptr && z[0] == 0 && z[15] == 0;
        unsigned* again = static_cast<unsigned*>(gtco::stream_scratch_zeroed(&s1, 32, why));
        std::printf("zeroed %d %d %d %d\\n", zero ? 1 : 0, g_memset - memsets, again == z ? 1 : 0,
                    z != gtco::stream_scratch(&s1, 64, why) ? 1 : 0);  // zeroed once, kept, its own buffer
        return 0;
    }
""")


def test_scratch_is_made_once_per_device_and_stream_and_never_under_capture(tmp_path: Path) -> None:
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "cuda_runtime.h").write_text(SCRATCH_CUDA)
    (tmp_path / "driver.cc").write_text(SCRATCH_DRIVER)
    exe = tmp_path / "driver"
    subprocess.run([find_cxx(), "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{tmp_path / 'fake'}",
                    f"-I{PLUGINS / 'include'}", str(tmp_path / "driver.cc"), "-o", str(exe)], check=True,
                   capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout.split("\n")
    got = {w: tuple(int(v) for v in rest) for w, *rest in (line.split() for line in out if line)}
    # (allocations, frees, stream syncs, got a buffer, has a reason)
    assert got == {"repeat": (1, 0, 0, 1, 0), "stream2": (2, 0, 0, 1, 0), "device1": (3, 0, 0, 1, 0),
                   "captured_fits": (3, 0, 0, 1, 0), "captured_grow": (3, 0, 0, 0, 1), "grow": (4, 1, 1, 1, 0),
                   "oom": (4, 2, 2, 0, 1), "empty": (4, 2, 2, 0, 0),
                   # stream_scratch_zeroed: zero when made, one memset, the same buffer after (no memset per call:
                   # its users leave it zeroed), apart from stream_scratch's buffer
                   "zeroed": (1, 1, 1, 1)}


RUN_INSTANCE_TU = textwrap.dedent("""
    #include <string>
    #include "gtco_ort.h"
    extern "C" int gtco_device_cc() { return 80; }
    OrtStatus* call(Ort::KernelContext& ctx, const gtco::NodeRef& ref) {
        int args = 0;
        return gtco::run_instance(ctx, ref, args, %s);
    }
""")


@pytest.mark.parametrize(("describe", "compiles"), [("[&] { return std::string(\"x\"); }", True),
                                                     ("std::string(\"x [2,3]\")", False)])
def test_run_instance_takes_a_description_built_on_failure_only(tmp_path: Path, describe: str,
                                                                compiles: bool) -> None:
    tu = tmp_path / "tu.cc"
    tu.write_text(RUN_INSTANCE_TU % describe)
    proc = subprocess.run([find_cxx(), "-std=c++17", "-fsyntax-only", *(f"-I{d}" for d in GLUE_INCLUDE_DIRS),
    f"-I{ort_include_dir()}", str(tu)],                       capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode == 0) == compiles, proc.stderr[-2000:]
    if not compiles:
        assert "describe the operands with a callable" in proc.stderr
