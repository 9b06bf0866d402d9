"""cuBLASLt as an implementation of GEMM tasks: offered where the mapping expresses the group, its heuristic rank
as the parameter, ranked by the estimate without a GPU, and the report names the winner per GEMM node with
the cuBLASLt candidate's time beside it."""

from __future__ import annotations

import pytest

from onnx_gtco.calibration import hardware_for_arch
from onnx_gtco.families.gemm import cublaslt
from onnx_gtco.families.gemm.kernel import FAMILY, gemm_problem
from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.select import select_instance
from onnx_gtco.report_md import _tuning
from onnx_gtco.tune.analytical import estimate_us
from onnx_gtco.tune.apply import implementations
from onnx_gtco.tune.driver import impl_times, tune
from onnx_gtco.tune.search import AnalyticalMeasurer, analytical_guesses, impls
from onnx_gtco.tune.tasks import Task


def _task(arch: str = "sm_90", **kw: object) -> Task:
    args = {"dtype": "f16", "batch": 1, "m": 197, "n": 3072, "k": 768, "bias": True, "activation": "gelu_tanh"} | kw
    return Task(gemm_problem(**args), arch, "v", 12, ("fc1_0", "fc1_1"))  # type: ignore[arg-type]


def test_cublaslt_is_offered_only_where_the_mapping_expresses_the_group() -> None:
    assert impls(_task("sm_80")) == ["mma", "cublaslt"]
    assert impls(_task("sm_80", activation="gelu_erf")) == ["mma"]
    assert impls(_task("sm_80", activation="relu", residual=True)) == ["mma"]
    assert "cublaslt" not in impls(_task(activation="gelu_erf"))  # whatever else an sm_90 task offers


def test_gemm_family_routes_a_cublaslt_configuration() -> None:
    p = _task().problem
    assert FAMILY.check(p, {"impl": "cublaslt", "RANK": 1}, "sm_80") is None
    assert "RANK=7" in (FAMILY.check(p, {"impl": "cublaslt", "RANK": 7}, "sm_80") or "")
    assert "takes impl and RANK only" in (FAMILY.check(p, {"impl": "cublaslt", "RANK": 0, "BM": 64}, "sm_80") or "")
    assert "impl 'tensorrt'" in (FAMILY.check(p, {"impl": "tensorrt"}, "sm_80") or "")
    mma = {"impl": "mma", "BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 4, "STAGES": 3}
    assert FAMILY.check(p, mma, "sm_80") is None
    inst = select_instance(p, "sm_90", {"impl": "cublaslt", "RANK": 1})
    assert not isinstance(inst, str)
    assert inst.name == "cublaslt_sm90_f16_r1_bias_gelu_tanh" and "gtco::lt::run" in inst.source
    erf = _task(activation="gelu_erf").problem
    why = select_instance(erf, "sm_90", {"impl": "cublaslt", "RANK": 0})
    assert isinstance(why, str) and "tanh form" in why


def test_analytical_guesses_hold_every_implementation_ranked_by_the_model() -> None:
    task = _task("sm_80")
    guesses = analytical_guesses(task)
    assert {g["impl"] for g in guesses} == {"mma", "cublaslt"}
    times = [estimate_us(task.problem, g, task.arch) for g in guesses]
    assert times == sorted(times)
    lt = next(g for g in guesses if g["impl"] == "cublaslt")
    assert estimate_us(task.problem, lt, task.arch) == cublaslt.estimate_us(task.problem, hardware_for_arch(task.arch))
    only_mma = analytical_guesses(_task("sm_80", activation="gelu_erf"))
    assert only_mma and all("impl" not in g for g in only_mma)


@pytest.mark.parametrize("m", [8, 4096])
def test_tuning_without_a_gpu_ranks_the_implementations_analytically(m: int) -> None:
    task = _task("sm_80", m=m)
    url = f"memory:impl-{m}"
    (result,) = tune([task], trials=12, measurer=AnalyticalMeasurer(), storage=url, patience=50)
    by_impl = impl_times([task], "analytical", url)[task.key]
    assert set(by_impl) == {"mma", "cublaslt"}  # both measured (by the model)
    assert by_impl["cublaslt"] == pytest.approx(cublaslt.estimate_us(task.problem, hardware_for_arch(task.arch)))
    assert result.best_config is not None and result.best_us == pytest.approx(min(by_impl.values()))
    want = min(by_impl, key=by_impl.__getitem__)
    entry = implementations(task, (result.best_config, result.best_us), by_impl, "analytical")
    assert entry.pop("cutlass").startswith("the CUTLASS GEMMs are sm_90a code")
    assert entry == {"impl": want, "cublaslt_us": by_impl["cublaslt"], "cublaslt": "offered", "cutlass_us": None,
                     "timing": "analytical", "nodes": ["fc1_0", "fc1_1"]}


def test_report_names_the_winner_and_the_cublaslt_time_per_gemm_node() -> None:
    offered = implementations(_task(), ({"impl": "cublaslt", "RANK": 0}, 41.5), {"mma": 50.0, "cublaslt": 41.5},
                              "measured")
    refused = implementations(_task(activation="gelu_erf"), ({"BM": 128}, 60.0), {"mma": 60.0}, "measured")
    assert refused["impl"] == "mma" and refused["cublaslt_us"] is None and "tanh form" in refused["cublaslt"]
    report = {"tuning": {"measurer": "gpu", "device": "H100", "arch": "sm_90", "tasks": [
        {"task": "t1", "describe": "gemm a", "best_us": 41.5} | offered,
        {"task": "t2", "describe": "gemm b", "best_us": 60.0} | refused]}}
    text = "\n".join(_tuning(report))
    assert "GEMM implementations, times measured on the GPU" in text
    row = next(line for line in text.splitlines() if line.startswith("| fc1_0, fc1_1 | cublaslt"))
    assert "41.5" in row
    assert "not offered: activation 'gelu_erf'" in text
    layernorm = Problem.make("layernorm", "f16", {"hidden": 768, "rows": 197}, {"residual": False})
    assert implementations(Task(layernorm, "sm_90", "v"), None, {}, "analytical") == {}
