"""The cuBLASLt GEMM glue on a machine without a GPU: its instances compile for sm_80 and sm_90 against the header
of the nvidia-cublas package and link into a shared library with no link-time dependency on libcublasLt; that
library loads without libcublasLt and a call says clearly that it is absent; with the package's libcublasLt loaded
first (as ONNX Runtime's CUDA EP loads it) the dlsym table resolves every entry. The C++ mirror of the layout
mapping (gemm/cublaslt_shape.h lt_shape) agrees with onnx_gtco.families.gemm.cublaslt.describe."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kernel_helpers import INCLUDES, nvcc_missing

from onnx_gtco.errors import HeaderError
from onnx_gtco.families.gemm import cublaslt
from onnx_gtco.families.gemm.cublas_headers import cublaslt_include_dir, installed_include_dir
from onnx_gtco.families.gemm.kernel import FAMILY, gemm_problem
from onnx_gtco.kernels.compile import compile_instance
from onnx_gtco.kernels.toolchain import cxx_build, find_nvcc, nvcc_compile

NEEDS_NVCC = pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")

PROBLEMS = [
    gemm_problem("f16", 1, 64, 128, 32, bias=True, activation="relu"),
    gemm_problem("bf16", 4, 16, 64, 32, b_batched=True, trans_b=True, residual=True, out_dtype="f32"),
    gemm_problem("f32", 2, 8, 24, 16, bias=True, activation="gelu_tanh"),
]

# what the test library exports beside the instances (and their gtco_cublaslt_error): the dlsym table's error
_PROBE = """
#include "gemm/cublaslt.h"
GTCO_EXPORT const char* gtco_test_api_error() { return gtco::lt::api().error.c_str(); }
"""

_CALL = """
import ctypes, json, sys
lib_path, symbol, preload = sys.argv[1], sys.argv[2], sys.argv[3]
if preload:
    ctypes.CDLL(preload, mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(lib_path)
class GemmArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("a", "b", "bias", "residual", "y")] + [
        (n, ctypes.c_int64) for n in ("batch", "m", "n", "k", "stride_a", "stride_b", "stride_y")] + [
        ("alpha", ctypes.c_float), ("layer_scale", ctypes.c_void_p)]
for f in ("gtco_test_api_error", "gtco_cublaslt_error"):
    getattr(lib, f).restype = ctypes.c_char_p
api_error = lib.gtco_test_api_error().decode()
rc = None
if not preload:  # without the library nothing touches the device: the call fails before
    buf = ctypes.create_string_buffer(4096)
    p = ctypes.cast(buf, ctypes.c_void_p)
    args = GemmArgs(p, p, p, None, p, 1, 64, 128, 32, 64 * 32, 0, 64 * 128, 1.0, None)
    rc = getattr(lib, symbol)(ctypes.byref(args), None)
print(json.dumps({"api_error": api_error, "rc": rc, "last_error": lib.gtco_cublaslt_error().decode()}))
"""


@pytest.fixture(scope="module")
def lt_include() -> Path:
    try:
        return cublaslt_include_dir()
    except HeaderError as e:
        pytest.skip(f"the cuBLASLt header could not be obtained: {e}")


@pytest.fixture(scope="module")
def lt_library(tmp_path_factory: pytest.TempPathFactory, lt_include: Path) -> dict[str, Path]:
    """arch -> a shared library of the PROBLEMS' rank-0 instances and _PROBE, linked as the custom-op library is
    (nvcc -shared -cudart static), without libcublasLt."""
    out = tmp_path_factory.mktemp("cublaslt")
    libs = {}
    for arch in ("sm_80", "sm_90"):
        objs = [compile_instance(cublaslt.instance(p, 0, arch), cache_dir=out / "cache").object_path
                for p in PROBLEMS]
        probe = out / f"probe_{arch}.cu"
        probe.write_text(_PROBE)
        nvcc_compile(probe, out / f"probe_{arch}.o", arch, include_dirs=[*INCLUDES, lt_include],
                     extra=["-O2", "-Xcompiler", "-fPIC,-fvisibility=hidden"])
        lib = out / f"libgtco_lt_{arch}.so"
        subprocess.run([find_nvcc(), "-shared", "-cudart", "static", "-o", str(lib), str(out / f"probe_{arch}.o"),
                        *map(str, objs)], check=True, capture_output=True, text=True)
        libs[arch] = lib
    return libs


def _call(lib: Path, symbol: str, preload: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", _CALL, str(lib), symbol, preload], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"}, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@NEEDS_NVCC
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_glue_links_without_libcublaslt(lt_library: dict[str, Path], arch: str) -> None:
    lib = lt_library[arch]
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", "--dyn-syms", "-W", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    assert "libcublas" not in dynamic.lower()  # neither NEEDED nor an undefined cublasLt* symbol
    for p in PROBLEMS:
        assert f"gtco_{cublaslt.instance(p, 0, arch).name}" in dynamic


@NEEDS_NVCC
def test_absent_libcublaslt_is_a_clear_error(lt_library: dict[str, Path]) -> None:
    probe = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcublasLt.so.13')"],
                           capture_output=True, env={"PATH": "/usr/bin:/bin"}, check=False)
    if probe.returncode == 0:
        pytest.skip("libcublasLt.so.13 is on this machine's library path: its absence cannot be shown here")
    symbol = f"gtco_{cublaslt.instance(PROBLEMS[0], 0, 'sm_80').name}"
    got = _call(lt_library["sm_80"], symbol)
    assert got["rc"] == 3  # GTCO_ELIBRARY
    assert "libcublasLt.so.13 is neither loaded in this process nor found" in got["api_error"]
    assert got["last_error"] == got["api_error"]


@NEEDS_NVCC
def test_dlsym_table_resolves_from_the_loaded_library(lt_library: dict[str, Path]) -> None:
    include = installed_include_dir()
    lib = include.parent / "lib" / "libcublasLt.so.13" if include is not None else None
    if lib is None or not lib.is_file():
        pytest.skip("the nvidia-cublas package (with libcublasLt.so.13) is not installed")
    got = _call(lt_library["sm_90"], "", str(lib))
    assert got["api_error"] == ""


_SHAPE_MAIN = """
#include <cstdio>
#include "gemm/cublaslt_shape.h"
int main(int argc, char** argv) {
    GemmArgs a{};
    int tb = 0;
    long long v[7];
    while (std::scanf("%lld %lld %lld %lld %lld %lld %lld %d", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                      &tb) == 8) {
        a.batch = v[0], a.m = v[1], a.n = v[2], a.k = v[3], a.stride_a = v[4], a.stride_b = v[5], a.stride_y = v[6];
        const gtco::lt::Shape s = gtco::lt::lt_shape(a, tb != 0);
        std::printf("%lld %lld %lld %d %lld %lld %lld %lld %lld %lld %lld\\n", (long long)s.m, (long long)s.n,
                    (long long)s.k, s.trans_a ? 1 : 0, (long long)s.lda, (long long)s.ldb, (long long)s.ldc,
                    (long long)s.batch, (long long)s.stride_a, (long long)s.stride_b, (long long)s.stride_c);
    }
    return 0;
}
"""


def test_cpp_shape_mirrors_describe(tmp_path: Path) -> None:
    src = tmp_path / "shape.cc"
    src.write_text(_SHAPE_MAIN)
    exe = tmp_path / "shape"
    cxx_build(src, exe, include_dirs=INCLUDES)
    problems = [gemm_problem("f16", batch, 5, 12, 7, b_batched=bb, trans_b=tb)
                for batch, bb in ((1, False), (3, False), (3, True), (1, True)) for tb in (False, True)]
    lines = []
    for p in problems:
        fields = {f.name: f.value for f in FAMILY.args_fields(p, {})}
        lines.append(" ".join(str(fields[k]) for k in ("batch", "m", "n", "k", "stride_a", "stride_b", "stride_y"))
                     + f" {int(bool(p.flag('trans_b')))}")
    out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    for p, line in zip(problems, out.stdout.splitlines(), strict=True):
        d = cublaslt.describe(p)
        assert isinstance(d, cublaslt.LtMatmul)
        want = [d.m, d.n, d.k, int(d.trans_a), d.lda, d.ldb, d.ldc, d.batch, d.stride_a, d.stride_b, d.stride_c]
        assert [int(x) for x in line.split()] == want, textwrap.shorten(str(p), 200)
