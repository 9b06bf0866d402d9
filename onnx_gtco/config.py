"""One frozen configuration, built once at the edge (CLI or API caller), and the GPU targets we plan for."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from onnx_gtco.errors import GtcoError


@dataclass(frozen=True)
class Target:
    """Published peak numbers of one GPU, used by the analytical cost model.

    Attributes:
        name: short name, e.g. "sm_80".
        gpu: the GPU these peaks are for.
        tc_tflops: dense fp16/bf16 Tensor Core peak (fp32 accumulate), TFLOP/s.
        tf32_tflops: dense TF32 Tensor Core peak, TFLOP/s (fp32 GEMMs).
        cuda_tflops: fp32 CUDA-core (FMA) peak, TFLOP/s.
        dram_gbps: DRAM bandwidth, GB/s.
        launch_us: cost of one kernel launch and its tail, microseconds.
        smem_kib: shared memory a block may use, KiB.
    """

    name: str
    gpu: str
    tc_tflops: float
    tf32_tflops: float
    cuda_tflops: float
    dram_gbps: float
    launch_us: float
    smem_kib: int


# A100-SXM4-80GB and H100-SXM5 data-sheet numbers (dense, no sparsity).
TARGETS: dict[str, Target] = {
    "sm_80": Target("sm_80", "A100-SXM4-80GB", 312.0, 156.0, 19.5, 2039.0, 3.0, 163),
    "sm_90": Target("sm_90", "H100-SXM5-80GB", 989.4, 494.7, 66.9, 3350.0, 2.5, 227),
}

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class GtcoConfig:
    """Everything a run of the optimizer depends on.

    Attributes:
        target: GPU target name, a key of TARGETS.
        precision: compute precision of fused groups: fp32, fp16 or bf16 (fp32 accumulation always).
        max_group_size: largest number of ONNX nodes one fused group may hold (DP ending bound).
        max_states: the DP gives up with a PlanError past this many memoized states.
        seed: seed of every random choice (check inputs, tuning).
    """

    target: str = "sm_90"
    precision: str = "fp32"
    max_group_size: int = 48
    max_states: int = 2_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise GtcoError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if self.precision not in PRECISIONS:
            raise GtcoError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.max_group_size < 1:
            raise GtcoError(f"max_group_size must be >= 1, got {self.max_group_size}")

    @property
    def hw(self) -> Target:
        return TARGETS[self.target]

    def replace(self, **changes: object) -> GtcoConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, **overrides: object) -> GtcoConfig:
        """Defaults, then GTCO_TARGET / GTCO_PRECISION / GTCO_SEED from the environment, then overrides."""
        env: dict[str, object] = {}
        if "GTCO_TARGET" in os.environ:
            env["target"] = os.environ["GTCO_TARGET"]
        if "GTCO_PRECISION" in os.environ:
            env["precision"] = os.environ["GTCO_PRECISION"]
        if "GTCO_SEED" in os.environ:
            env["seed"] = int(os.environ["GTCO_SEED"])
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)  # type: ignore[arg-type]
