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

from onnx_gtco.kernels.toolchain import find_cxx
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
    """The ORT glue (plugins/ort), the launch macros and the families' host launchers call no allocator, no
    synchronizing copy or wait and no cudaFuncSetAttribute; the opt-in header alone sets the attribute, and the
    launch macro goes through it."""
    macro = _launch_macro((PLUGINS / "include" / "gtco" / "launch.cuh").read_text())
    assert "smem_opt_in(" in macro and "cudaFuncSetAttribute" not in macro, macro
    sources = [*sorted((PLUGINS / "ort").glob("*.h")), PLUGINS / "ort" / "register.inc",
               *sorted((PLUGINS / "include" / "gtco").glob("*.cuh"))]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sources
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if FORBIDDEN.search(line.split("//")[0])]
    assert not hits, hits
    opt_in = (PLUGINS / "include" / "gtco" / "smem_opt_in.h").read_text()
    assert len(re.findall(r"\bcudaFuncSetAttribute\(", opt_in)) == 1


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
    proc = subprocess.run([find_cxx(), "-std=c++17", "-fsyntax-only", f"-I{PLUGINS / 'ort'}",
                           f"-I{PLUGINS / 'include'}", f"-I{ort_include_dir()}", str(tu)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode == 0) == compiles, proc.stderr[-2000:]
    if not compiles:
        assert "describe the operands with a callable" in proc.stderr
