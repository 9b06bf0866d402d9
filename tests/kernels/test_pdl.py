"""Programmatic dependent launch (PDL): every gtco kernel waits for the grid ahead of it (gtco::grid_dep_wait,
griddepcontrol.wait) before it touches global memory.

Three checks: the sources (the wait is the first statement of every `__global__` body, which also covers plain
pointer dereferences the emulation cannot see), the emulation's PDL check (GTCO_EMU_PDL_CHECK=1: a global access
through an emulated primitive before the wait fails) on GEMM, split-K GEMM, LayerNorm and attention instances with
a planted late wait that it catches, and nvcc (the sm_90 PTX has griddepcontrol.wait, the sm_80 build has none)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from kernel_helpers import INCLUDES, nvcc_missing

from onnx_gtco.families.attention.kernel import AttentionFamily, make_problem, output_dtype_array
from onnx_gtco.families.gemm.kernel import FAMILY as GEMM
from onnx_gtco.families.gemm.kernel import gemm_problem
from onnx_gtco.families.layernorm.kernel import FAMILY as LN
from onnx_gtco.kernels.emulate import EmulationError, build_emulated, run_emulated
from onnx_gtco.kernels.family import Instance, Problem, np_dtype
from onnx_gtco.kernels.toolchain import find_nvcc, run_compile

KERNEL_SOURCES = sorted(path for d in INCLUDES for pattern in ("*/*.cuh", "*/*.cu.j2") for path in d.glob(pattern))
WAIT = re.compile(r"(gtco::)?grid_dep_wait\(\)")


def _strip(text: str) -> str:
    """The C++ of a header or template without comments, preprocessor lines (both sides of an #if are kept) and
    Jinja markup (a `{{ name }}` becomes an identifier, so its braces are not taken for a body)."""
    text = re.sub(r"\{#.*?#\}", " ", text, flags=re.S)
    text = re.sub(r"\{%.*?%\}", " ", text, flags=re.S)
    text = re.sub(r"\{\{.*?\}\}", "X", text, flags=re.S)
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def global_kernels(path: Path) -> list[tuple[str, str]]:
    """(kernel name, its body's first statement) of every __global__ function in `path`."""
    text = _strip(path.read_text())
    out = []
    for m in re.finditer(r"\b__global__\b", text):
        depth, i = 0, m.end()
        while not (text[i] == "{" and depth == 0):  # the body opens at the first brace outside parentheses
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        head = text[m.end():i]
        name = re.findall(r"(\w+)\s*\(", re.sub(r"__launch_bounds__\s*\([^)]*\)", "", head))[0]
        first = text[i + 1:text.index(";", i)].strip()
        out.append((name, first))
    return out


def test_every_kernel_waits_first() -> None:
    found = {(p.name, name): first for p in KERNEL_SOURCES for name, first in global_kernels(p)}
    names = {name for _, name in found}
    # the kernels of every family: a parser that finds none would pass vacuously
    assert {"gemm_kernel", "attention_kernel", "bmm_softmax_kernel", "conv_kernel", "conv_direct_kernel",
            "layernorm_kernel", "softmax_kernel", "X_kernel"} <= names, names
    late = {k: first for k, first in found.items() if not WAIT.fullmatch(first)}
    assert not late, f"kernels whose first statement is not grid_dep_wait(): {late}"


def test_the_source_check_sees_a_late_wait(tmp_path: Path) -> None:
    bad = tmp_path / "late.cuh"
    bad.write_text("// __global__ in a comment\n__global__ void __launch_bounds__(128) k(const float* p, float* y) {\n"
                   "    y[0] = p[0];\n    gtco::grid_dep_wait();\n}\n")
    assert global_kernels(bad) == [("k", "y[0] = p[0]")]


# ---------------------------------------------------------------------------------------------------------------
# The emulation's PDL check
# ---------------------------------------------------------------------------------------------------------------
E1 = {"BM": 64, "BN": 64, "BK": 32, "WM": 2, "WN": 2, "STAGES": 2}
FULL = {"trans_b": False, "bias": True, "activation": "gelu_erf", "residual": True}


@pytest.fixture
def pdl_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every emulated launch of the test is checked as a PDL launch (run_emulated's process inherits it)."""
    monkeypatch.setenv("GTCO_EMU_PDL_CHECK", "1")


def _run(family, inst: Instance, prob: Problem, arrays: dict[str, np.ndarray], lib: Path) -> dict[str, np.ndarray]:
    return run_emulated(lib, inst.symbol, family.args_fields(prob, arrays), arrays, list(family.outputs(prob)))


def _gemm(tmp: Path, config: dict, shape: tuple[int, int, int]) -> None:
    inst = GEMM.instantiate(gemm_problem("f16", 1, 64, 64, 512, **FULL), config, "sm_80")
    prob = gemm_problem("f16", 1, *shape, **FULL)
    arrays = {**GEMM.random_inputs(prob, 1), **GEMM.allocate_outputs(prob)}
    out = _run(GEMM, inst, prob, arrays, build_emulated(inst, tmp, ("-O1",)))
    assert np.isfinite(out["y"].astype(np.float32)).all()


def _layernorm(tmp: Path, defines: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    prob = Problem.make("layernorm", "f16", {"hidden": 256, "rows": 3}, {"residual": True})
    inst = LN.instantiate(prob, {"THREADS": 32, "VEC": 8, "ROWS": 2}, "sm_80")
    arrays = dict(LN.random_inputs(prob, 0))
    for k, (shape, dt) in LN.outputs(prob).items():
        arrays[k] = np.zeros(shape, np_dtype(dt))
    return _run(LN, inst, prob, arrays, build_emulated(inst, tmp, ("-O1", *(f"-D{d}" for d in defines))))


def test_gemm_waits_before_cp_async(tmp_path: Path, pdl_check: None) -> None:
    _gemm(tmp_path, E1, (40, 24, 48))


def test_split_k_gemm_waits_before_its_workspace(tmp_path: Path, pdl_check: None) -> None:
    """ld_cg / st_cg / atomic_add_u32 on the split-K workspace come after the wait too."""
    _gemm(tmp_path, {**E1, "SPLITK": 4}, (40, 24, 512))


def test_layernorm_waits_before_its_loads(tmp_path: Path, pdl_check: None) -> None:
    assert np.isfinite(_layernorm(tmp_path)["y"].astype(np.float32)).all()


def test_attention_waits_before_cp_async(tmp_path: Path, pdl_check: None) -> None:
    attn = AttentionFamily()
    prob = make_problem("attention", "f16", batch=1, heads=2, seq_q=20, seq_k=33, head_dim=32, mask=True)
    inst = attn.instantiate(prob, {"BQ": 64, "BKV": 32, "WARPS": 4, "STAGES": 2}, "sm_90")
    arrays = dict(attn.random_inputs(prob, seed=7))
    for name, (shape, dtype) in attn.outputs(prob).items():
        arrays[name] = output_dtype_array(shape, dtype)
    out = _run(attn, inst, prob, arrays, build_emulated(inst, tmp_path, ("-O1",)))
    assert np.isfinite(out["out"].astype(np.float32)).all()


def test_a_late_wait_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GTCO_TEST_PDL_LATE_WAIT moves LayerNorm's wait after its first load: unchecked it computes the same, checked
    it fails naming the access."""
    monkeypatch.delenv("GTCO_EMU_PDL_CHECK", raising=False)
    assert np.isfinite(_layernorm(tmp_path, ("GTCO_TEST_PDL_LATE_WAIT",))["y"].astype(np.float32)).all()
    monkeypatch.setenv("GTCO_EMU_PDL_CHECK", "1")
    with pytest.raises(EmulationError, match=r"gtco-emu: error: PDL: load_vec_at from global memory before "
                                             r"grid_dep_wait\(\)"):
        _layernorm(tmp_path, ("GTCO_TEST_PDL_LATE_WAIT",))


# ---------------------------------------------------------------------------------------------------------------
# nvcc: the wait is in the sm_90 code and compiles away for sm_80
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ptx_has_griddepcontrol_wait_on_sm90_only(tmp_path: Path, arch: str) -> None:
    prob = Problem.make("layernorm", "f16", {"hidden": 256, "rows": 3}, {"residual": True})
    inst = LN.instantiate(prob, {"THREADS": 32, "VEC": 8, "ROWS": 2}, arch)
    src = tmp_path / "ln.cu"
    src.write_text(inst.source)
    ptx = tmp_path / "ln.ptx"
    run_compile([find_nvcc(), f"-arch={arch}", "-std=c++17", *(f"-I{d}" for d in INCLUDES), "-ptx", str(src), "-o",
                 str(ptx)], src, 120)
    text = ptx.read_text()
    assert ("griddepcontrol.wait" in text) == (arch == "sm_90")
    assert "griddepcontrol.launch_dependents" not in text  # no kernel triggers early (primitives.cuh says why)
