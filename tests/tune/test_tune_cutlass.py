"""CUTLASS as an implementation of GEMM tasks: offered on tasks for sm_90 (built for their sm_90a slot) where the
mapping expresses the group and the headers are installed, its tunables as the study's parameters, priced by the
estimate from its fitted constants (families.gemm.cutlass.CutlassConstants), built and timed by the GPU measurer like
the others, and reported per GEMM node beside the cuBLASLt candidate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest

from onnx_gtco.calibration import hardware
from onnx_gtco.families.gemm import cutlass
from onnx_gtco.families.gemm.kernel import FAMILY, gemm_problem
from onnx_gtco.kernels.family import Instance, to_storage
from onnx_gtco.report_md import _tuning
from onnx_gtco.tune import gpu
from onnx_gtco.tune.analytical import estimate_us
from onnx_gtco.tune.apply import implementations, slots
from onnx_gtco.tune.builder import Artifact
from onnx_gtco.tune.driver import impl_bests, tune
from onnx_gtco.tune.search import (
    IMPL_SPACES,
    AnalyticalMeasurer,
    Measurement,
    analytical_guesses,
    check,
    config_arch,
    impls,
    offered,
    open_storage,
    param_names,
    predict_us,
    study_for,
    study_name,
    to_config,
    to_params,
)
from onnx_gtco.tune.tasks import Task
from onnx_gtco.tune.trials import run_trial

COOP = {"impl": "cutlass", "TILE_M": 128, "TILE_N": 256, "TILE_K": 64, "CLUSTER_M": 2, "CLUSTER_N": 1,
        "SCHEDULE": "cooperative", "STAGES": 0, "RASTER": "heuristic", "TILE_SCHEDULER": "streamk"}
PINGPONG = {**COOP, "TILE_M": 64, "TILE_N": 128, "CLUSTER_M": 1, "SCHEDULE": "pingpong", "STAGES": 4,
            "TILE_SCHEDULER": "persistent"}
MMA = {"impl": "mma", "BM": 128, "BN": 128, "BK": 32, "WM": 2, "WN": 4, "STAGES": 3, "VEC": 1}


@pytest.fixture(autouse=True)
def headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvidia-cutlass headers as found, whether or not the package is installed: nothing here compiles."""
    monkeypatch.setattr(cutlass, "include_dirs", lambda: (Path("/cutlass/include"), Path("/cutlass/util")))


def _task(arch: str = "sm_90", dtype: str = "f16", batch: int = 1, m: int = 12608, n: int = 3072, k: int = 768,
          **flags: Any) -> Task:
    """ViT-B/16's MLP up-projection at batch 64 by default (its batch folds into M), erf GELU: cuBLASLt has no
    epilogue for it."""
    flags = {"bias": True, "activation": "gelu_erf"} | flags
    return Task(gemm_problem(dtype, batch, m, n, k, **flags), arch, "v", 12, ("fc1_0", "fc1_1"))


# ------------------------------------------------------------------------------------------------------------------
# The search space


def test_cutlass_is_offered_on_sm90_tasks_for_their_sm90a_slot_and_not_on_sm80() -> None:
    hopper, ampere = _task(), _task("sm_80")
    assert impls(hopper) == ["mma", "cutlass"] and offered(hopper)["cutlass"] == "offered"
    assert impls(_task(activation="gelu_tanh")) == ["mma", "cublaslt", "cutlass"]
    assert impls(ampere) == ["mma"]
    assert "sm_90a code, run on 9.0 GPUs only" in offered(ampere)["cutlass"]
    # a CUTLASS configuration of an sm_90 task is checked and built for sm_90a; the others for the task's arch
    assert config_arch(hopper, COOP) == "sm_90a" and config_arch(hopper, MMA) == "sm_90"
    assert config_arch(hopper, {"impl": "cublaslt", "RANK": 0}) == "sm_90"
    assert check(hopper, COOP) is None and check(hopper, MMA) is None
    assert "built for sm_90a only" in (check(ampere, COOP) or "")


def test_without_the_headers_cutlass_is_not_offered_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    why = "nvidia-cutlass is not installed (pip install 'onnx-gtco[cutlass]'): it carries the CUTLASS headers"
    monkeypatch.setattr(cutlass, "include_dirs", lambda: why)
    task = _task()
    assert impls(task) == ["mma"] and offered(task)["cutlass"] == why
    assert "+cutlass" not in study_name(task, "analytical")
    entry = implementations(task, (MMA, 100.0), {"mma": 100.0}, "analytical")
    assert entry["impl"] == "mma" and entry["cutlass_us"] is None and entry["cutlass"] == why


@pytest.mark.parametrize("flags, reason", [
    ({"activation": "quick_gelu"}, "activation 'quick_gelu' has no CUTLASS epilogue functor"),
    ({"n": 197}, "N=197: TMA needs rows of 16-byte multiples"),
    ({"dtype": "f32", "activation": "none"}, "TF32 with a [K, N] B"),
])
def test_problems_the_mapping_cannot_express_are_refused_with_the_reason(flags: dict, reason: str) -> None:
    task = _task(**flags)
    assert "cutlass" not in impls(task)
    assert reason in offered(task)["cutlass"]
    entry = implementations(task, (MMA, 100.0), {"mma": 100.0}, "analytical")
    assert reason in entry["cutlass"] and entry["cutlass_us"] is None
    assert all(g.get("impl", "mma") != "cutlass" for g in analytical_guesses(task))


def test_cutlass_tunables_are_study_parameters_apart_from_the_mma_ones() -> None:
    task = _task()
    assert IMPL_SPACES["cutlass"] == {k: list(v) for k, v in cutlass.SPACE.items()}
    names = param_names(task, "cutlass")
    assert names["STAGES"] == "cutlass_STAGES"  # the mma kernels' STAGES has another value space
    assert all(names[k] == k for k in cutlass.SPACE if k != "STAGES")
    assert to_params(task, COOP)["cutlass_STAGES"] == 0 and to_config(to_params(task, COOP)) == COOP
    assert to_params(task, MMA) == MMA and to_config(MMA) == MMA
    url = "memory:cutlass-space"
    tune([task], trials=40, measurer=AnalyticalMeasurer(), storage=url, patience=100)
    study = optuna.load_study(study_name=study_name(task, "analytical"), storage=open_storage(url))
    assert study.study_name.endswith(f"+cutlass-{cutlass.version()}@analytical")
    trials = study.get_trials(deepcopy=False)
    by_impl = {impl: [t for t in trials if t.params.get("impl") == impl] for impl in ("mma", "cutlass")}
    assert by_impl["mma"] and by_impl["cutlass"]  # both sampled, one study, no clash of value spaces
    for t in by_impl["cutlass"]:
        assert set(t.params) == {"impl", *names.values()}
        config = to_config(t.params)
        why = FAMILY.check(task.problem, config, "sm_90a")
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert why is None and t.value == pytest.approx(estimate_us(task.problem, config, "sm_90a"))
        else:  # rejected unmeasured, with the family's reason
            assert t.user_attrs["error_kind"] == "invalid" and t.user_attrs["error"] == why


def test_an_invalid_cutlass_combination_is_a_failed_trial_with_its_reason() -> None:
    task = _task(m=4096)
    study = study_for(task, open_storage("memory:cutlass-invalid"), "analytical")
    bad = {"stream-K needs the cooperative schedule": PINGPONG | {"TILE_SCHEDULER": "streamk"},
           "cooperative schedule splits the tile's M": COOP | {"TILE_M": 64},
           "at most 2 CTAs": COOP | {"CLUSTER_N": 2}}
    for config in bad.values():
        study.enqueue_trial(to_params(task, config))
    for _ in range(len(analytical_guesses(task))):  # the study's own guesses first
        run_trial(study, task, AnalyticalMeasurer())
    errors = [run_trial(study, task, AnalyticalMeasurer()) for _ in range(3)]
    assert [t.state for t in errors] == [optuna.trial.TrialState.FAIL] * 3
    assert all(t.user_attrs["error_kind"] == "invalid" for t in errors)
    assert all(r in t.user_attrs["error"] for t, r in zip(errors, bad, strict=True))


# ------------------------------------------------------------------------------------------------------------------
# The analytical model


def _best(task: Task, impl: str) -> tuple[float, dict[str, Any]]:
    """The analytical model's best configuration of one implementation among the study's guesses."""
    return min(((predict_us(task, c), c) for c in analytical_guesses(task, n=12) if c.get("impl", "mma") == impl),
               key=lambda x: x[0])


def test_the_model_ranks_a_large_projection_gemms_cutlass_above_mma_for_its_fitted_efficiency() -> None:
    task = _task()
    guesses = analytical_guesses(task)
    assert guesses[0]["impl"] == "cutlass" and {g.get("impl") for g in guesses} == {"mma", "cutlass"}
    cut, config = _best(task, "cutlass")
    mma, _ = _best(task, "mma")
    assert cut < mma
    # the ranking rests on the constants, all in CutlassConstants: a mainloop at a fifth of the fitted efficiency
    # turns it over
    hw = hardware("sm_90")
    slow = hw.with_overrides({"gemm.cutlass": {"mainloop_frac": hw.constants(cutlass.CutlassConstants).mainloop_frac
                                               / 5}})
    assert estimate_us(task.problem, config, "sm_90a", slow) > mma


def test_the_model_prices_waves_clusters_and_the_epilogue_overlap() -> None:
    p = _task().problem
    hw = hardware("sm_90")
    price = lambda c: cutlass.estimate_us(p, c, hw)  # noqa: E731
    sms = cutlass.TARGETS[cutlass.TARGET].sms
    # wave quantization: one tile past a full wave costs a whole wave with the data-parallel scheduler; stream-K
    # splits that tail (CUTLASS's heuristic), and with no tail the two are the same kernel
    coop = COOP | {"TILE_N": 128, "CLUSTER_M": 1, "TILE_SCHEDULER": "persistent"}
    one_past = _task(m=128 * (sms + 1), n=128).problem
    exact = _task(m=128 * sms, n=128).problem
    dp, sk = (cutlass.estimate_us(one_past, coop | {"TILE_SCHEDULER": s}, hw) for s in ("persistent", "streamk"))
    assert sk < dp
    full = cutlass.estimate_us(exact, coop, hw)
    assert full == cutlass.estimate_us(exact, coop | {"TILE_SCHEDULER": "streamk"}, hw) < dp
    # a 2-CTA cluster multicasts the shared operand: less L2 traffic for an L2-bound tile
    assert price(coop | {"CLUSTER_M": 2}) < price(coop)
    # ping-pong hides one warp group's epilogue behind the other's mainloop; cooperative does not
    pp = coop | {"SCHEDULE": "pingpong"}
    assert price(pp) < price(coop)
    # the raster order is not modeled: it never ranks one configuration above another
    assert price(coop | {"RASTER": "m"}) == price(coop)


# ------------------------------------------------------------------------------------------------------------------
# The GPU measurer (its CPU side: the trial's instance, the answer check; the timing mocked)


def _measurer(cc: int = 90) -> gpu.GpuMeasurer:
    m = object.__new__(gpu.GpuMeasurer)
    m.cc, m.arch, m.device = cc, "sm_90", f"NVIDIA H100 80GB HBM3 sm_{cc}"
    m._env = {"measurer": "gpu", "gpu": m.device, "driver": "0", "toolchain": "mock"}
    return m


def test_gpu_measurer_builds_a_cutlass_trial_with_its_config_and_times_it(monkeypatch: pytest.MonkeyPatch) -> None:
    task = _task()
    built: list[Instance] = []

    def fake_library(inst: Instance) -> Path:
        built.append(inst)
        return Path(f"/fake/{inst.name}.so")

    ran: list[Artifact] = []

    def fake_run(self: gpu.GpuMeasurer, task: Task, config: dict, artifact: Artifact) -> Measurement:
        ran.append(artifact)
        return Measurement(42.5, 0.5, runs=20)

    monkeypatch.setattr(gpu, "shared_library", fake_library)
    monkeypatch.setattr(gpu.GpuMeasurer, "run", fake_run)
    m = _measurer()
    study = study_for(task, open_storage("memory:cutlass-gpu"), m.device)
    study.enqueue_trial(to_params(task, COOP), skip_if_exists=False)
    study.enqueue_trial(to_params(task, PINGPONG), skip_if_exists=False)
    for _ in range(len(analytical_guesses(task)) + 1):  # the study's guesses, then the cooperative stream-K one
        run_trial(study, task, m)
    record = run_trial(study, task, m)
    assert record.state == optuna.trial.TrialState.COMPLETE and record.value == 42.5
    assert record.user_attrs["median_us"] == 42.5 and record.user_attrs["gpu"] == m.device
    inst = built[-1]
    assert ran[-1] == Artifact(f"/fake/{inst.name}.so", inst.symbol)
    assert inst.arch == "sm_90a" and inst.config == PINGPONG
    assert inst.name.startswith("gemm_sm90a_cutlass_f16_64x128x64_c1x1_pp_s4_rh_dp")
    assert "cute::Shape<cute::_64, cute::_128, cute::_64>" in inst.source
    assert "cutlass::gemm::KernelTmaWarpSpecializedPingpong" in inst.source
    assert "cutlass::gemm::PersistentScheduler" in inst.source and "StageCount<4>" in inst.source
    assert "cutlass::epilogue::thread::GELU" in inst.source  # the task's erf GELU in the epilogue tree
    coop = next(i for i in built if i.config.get("SCHEDULE") == "cooperative")
    assert "KernelTmaWarpSpecializedCooperative" in coop.source and "StreamKScheduler" in coop.source
    mma = next(i for i in built if i.config.get("impl", "mma") == "mma")
    assert mma.arch == "sm_90" and mma.name.startswith("gemm_sm90_f16_")


def test_gpu_measurer_fails_a_cutlass_trial_on_a_gpu_that_cannot_run_sm90a(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "shared_library", lambda inst: pytest.fail("nothing is built"))
    got = _measurer(cc=91).measure(_task(), COOP)
    assert got.error_kind == "runtime" and "runs on 9.0 GPUs only" in got.detail
    other = _measurer().measure(_task("sm_80"), COOP)
    assert other.error_kind == "runtime" and "built for sm_80" in other.detail


def test_a_wrong_answer_fails_the_trial() -> None:
    task = _task(m=64, n=128, k=64)
    p = task.problem
    inputs = FAMILY.random_inputs(p, 0)
    want = FAMILY.reference(p, inputs)
    right = {k: to_storage(v.astype(np.float32), FAMILY.outputs(p)[k][1]) for k, v in want.items()}
    assert gpu.wrong_answer(task, inputs, right) is None
    twice = {k: to_storage((2 * v).astype(np.float32), FAMILY.outputs(p)[k][1]) for k, v in want.items()}
    bad = gpu.wrong_answer(task, inputs, twice)
    assert bad is not None and bad.error_kind == "wrong_answer" and "against the fp64 reference" in bad.detail
    nan = {k: to_storage(np.full(v.shape, np.nan, np.float32), FAMILY.outputs(p)[k][1]) for k, v in want.items()}
    assert gpu.wrong_answer(task, inputs, nan) is not None


# ------------------------------------------------------------------------------------------------------------------
# The report and the library's arch slots


def test_report_names_winner_config_and_both_library_candidates_per_gemm_node() -> None:
    task = _task(activation="gelu_tanh")
    url = "memory:cutlass-report"
    (result,) = tune([task], trials=12, measurer=AnalyticalMeasurer(), storage=url, patience=50)
    bests = impl_bests([task], "analytical", url)[task.key]
    assert set(bests) == {"mma", "cublaslt", "cutlass"}  # each implementation's best guess was measured (predicted)
    times = {impl: us for impl, (_, us) in bests.items()}
    assert result.best_config is not None and result.best_us == min(times.values())
    entry = implementations(task, (result.best_config, result.best_us), times, "analytical")
    winner = result.best_config["impl"]
    assert entry["impl"] == winner == min(times, key=times.__getitem__)
    assert entry["cutlass_us"] == times["cutlass"] and entry["cublaslt_us"] == times["cublaslt"]
    assert entry["cutlass"] == entry["cublaslt"] == "offered" and entry["timing"] == "analytical"
    report = {"tuning": {"measurer": "analytical", "device": "analytical", "arch": "sm_90", "tasks": [
        {"task": task.key, "describe": task.describe(), "best_config": result.best_config,
         "best_us": result.best_us} | entry,
        {"task": "t2", "describe": "gemm b", "best_config": MMA, "best_us": 60.0}
        | implementations(_task(activation="quick_gelu"), (MMA, 60.0), {"mma": 60.0}, "analytical")]}}
    text = "\n".join(_tuning(report))
    assert "GEMM implementations, times predicted by the estimate" in text and "proxy" in text
    assert "| configuration |" in text and "| CUTLASS µs |" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| fc1_0, fc1_1 | {winner}"))
    assert all(f"{k}={v}" in row for k, v in result.best_config.items() if k != "impl")
    assert f"{times['cublaslt']:,.1f}" in row and f"{times['cutlass']:,.1f}" in row
    assert "not offered: activation 'quick_gelu' has no CUTLASS epilogue functor" in text


def test_a_cutlass_winner_takes_the_sm90a_slot_and_the_best_other_the_sm90_one() -> None:
    task = _task()
    bests = {"cutlass": (COOP, 50.0), "mma": (MMA, 80.0), "cublaslt": ({"impl": "cublaslt", "RANK": 0}, 70.0)}
    assert slots(task, COOP, bests) == {"sm_90a": COOP, "sm_90": {"impl": "cublaslt", "RANK": 0}}
    assert slots(task, COOP, {"cutlass": (COOP, 50.0)}) == {"sm_90a": COOP}  # sm_90 keeps its default
    assert slots(task, MMA, bests) == {"sm_90": MMA}
    assert slots(_task("sm_80"), MMA, {"mma": (MMA, 1.0)}) == {"sm_80": MMA}
