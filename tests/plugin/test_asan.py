"""The plugin tests once more under AddressSanitizer: every g++ command built with GTCO_SANITIZE=address
(kernels.toolchain.sanitize_flags; its own cache folder), run in a pytest subprocess with ASan's runtime preloaded.

A representative subset, about two minutes under ASan from a cold cache (the whole of tests/plugin takes far
longer): the library end to end on the CPU EP with small models (test_plugin_library.py: LayerNorm + Softmax,
fp16, decomposed LayerNorm, BERT-tiny, wrong shapes, register modes), the GEMM/QKV reference kernels and their ORT
glue through the harness (test_gemm_glue.py), and the attention reference kernels (test_attention_glue.py
reference tests: layouts, masks, broadcasts, fully masked rows, causal, bf16), and the conv kernel on every conv
form against its float64 reference, fp32 and fp16, and its operand checks (test_conv_glue.py). Left out: what
needs nvcc or a GPU, the ViT-224 library tests, the elementwise libraries (70 s of compiling under ASan), the
emulated device path (minutes), header syntax checks (no code runs) and the load test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onnx_gtco.kernels.toolchain import SANITIZE_ENV, BuildError, cache_root, find_cxx, run_compile, sanitizer
from onnx_gtco.plugin.headers import ort_include_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ["tests/plugin/test_plugin_library.py", "tests/families/gemm/test_gemm_glue.py",
          "tests/families/attention/test_attention_glue.py", "tests/families/conv/test_conv_glue.py"]
SELECT = ("(test_plugin_library and (small_model or float16 or decomposed or wrong_shape or register_modes))"
          " or (test_gemm_glue and not header_compiles) or (test_attention_glue and reference)"
          " or (test_conv_glue and (float64_reference or bad_operands))")

# A shared library with a heap read one past the end, built by run_compile like the plugin's glue, loaded with
# ctypes like ORT loads the plugin: ASan must stop the process at it.
_OOB = textwrap.dedent("""
    import ctypes, sys
    from pathlib import Path
    from onnx_gtco.kernels.toolchain import find_cxx, run_compile, sanitize_flags
    out = Path(sys.argv[1])
    src = out / "oob.cc"
    src.write_text('#include <cstdlib>\\nextern "C" int gtco_oob(int n) {'
                   ' int* p = (int*)std::malloc(n * sizeof(int)); for (int i = 0; i < n; ++i) p[i] = i;'
                   ' int v = p[n]; std::free(p); return v; }\\n')
    run_compile([find_cxx(), "-shared", "-fPIC", "-O1", str(src), "-o", str(out / "liboob.so")], src)
    print("flags", " ".join(sanitize_flags()), flush=True)
    print("result", ctypes.CDLL(str(out / "liboob.so")).gtco_oob(8), flush=True)
""")


def _runtime(name: str) -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or "g++"
    path = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.fail(f"{cxx} has no {name}: install the compiler's AddressSanitizer runtime (libasan)")
    return path


@pytest.fixture(scope="module")
def asan_env() -> dict[str, str]:
    """The environment of a sanitized run: ASan preloaded (with libstdc++, so its __cxa_throw interceptor finds
    the real one in a python that does not link libstdc++ itself), leaks off (CPython keeps its heap by design),
    any error aborts; the ORT headers of this cache so the sanitized cache folder downloads nothing."""
    env = {**os.environ, SANITIZE_ENV: "address", "ORT_INCLUDE_DIR": str(ort_include_dir()),
           "LD_PRELOAD": f"{_runtime('libasan.so')} {_runtime('libstdc++.so')}",
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _sanitized_cache(env: dict[str, str]) -> Path:
    """cache_root() as the sanitized run sees it."""
    code = "from onnx_gtco.kernels.toolchain import cache_root; print(cache_root())"
    clean = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}
    return Path(subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True,
                               check=True).stdout.strip())


def test_sanitize_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GTCO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(SANITIZE_ENV, raising=False)
    plain = run_compile([find_cxx(), "--version"], "version")
    assert cache_root() == tmp_path and not any("sanitize" in c for c in plain.command)
    monkeypatch.setenv(SANITIZE_ENV, "address")
    assert cache_root() == tmp_path / "sanitize-address"  # its own cache: never a plain library's entry
    assert "-fsanitize=address" in run_compile([find_cxx(), "--version"], "version").command
    monkeypatch.setenv(SANITIZE_ENV, "adress")
    with pytest.raises(BuildError, match=r"GTCO_SANITIZE='adress': choose one of address"):
        sanitizer()


def test_asan_catches_an_out_of_bounds_read(asan_env: dict[str, str], tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", _OOB, str(tmp_path)], env=asan_env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "flags -fsanitize=address" in res.stdout, res.stdout + res.stderr
    assert res.returncode != 0 and "result" not in res.stdout, res.stdout
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in res.stderr and "gtco_oob" in res.stderr, res.stderr


def test_plugin_tests_pass_under_asan(asan_env: dict[str, str], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    cmd = [sys.executable, "-m", "pytest", *SUBSET, "-m", "not nvcc and not gpu", "-k", SELECT, "-q", "-n0",
           "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'run'}"]
    res = subprocess.run(cmd, env=asan_env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    tail = (res.stdout + res.stderr)[-4000:]
    assert "AddressSanitizer" not in res.stdout + res.stderr, tail
    assert res.returncode == 0, tail
    summary = res.stdout.strip().splitlines()[-1]
    libs = sorted((_sanitized_cache(asan_env) / "libs").glob("libgtco-*.so"))
    assert libs and all(b"__asan_init" in p.read_bytes() for p in libs), libs  # the run's libraries: instrumented
    with capsys.disabled():
        print(f"\nunder AddressSanitizer: {summary}")
    assert " passed" in summary and "failed" not in summary
