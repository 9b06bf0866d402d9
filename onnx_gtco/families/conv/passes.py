"""The conv family's pass: a patch embedding (a conv whose stride is its kernel) rewritten as a patchify copy and a
GEMM where the estimate predicts that faster (families/conv/patchify.py does the rewrite; GtcoConfig.patchify)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx

from onnx_gtco.calibration import Hardware, LaunchConstants
from onnx_gtco.config import GtcoConfig
from onnx_gtco.families.conv.kernel import conv_problem
from onnx_gtco.families.conv.patchify import PatchConv, patchify_convs
from onnx_gtco.families.elementwise.kernel import FAMILY as ELEMENTWISE
from onnx_gtco.families.elementwise.kernel import elementwise_problem
from onnx_gtco.families.gemm.kernel import gemm_problem
from onnx_gtco.plan.types import GraphPass
from onnx_gtco.plugin.device import slot_estimate
from onnx_gtco.plugin.nodes import DTYPE_NAMES


@dataclass(frozen=True)
class PatchifyChoice:
    """Whether a stride = kernel conv runs as its conv kernel or as a patchify copy and a GEMM (families.conv.patchify),
    with both estimates on the planning target: the conv (and the token transpose its readers add) against the copy,
    the GEMM (its fastest implementation) and the NCHW restore where a reader keeps it, each with its graph gap."""

    conv: str
    conv_us: float | None
    patchify_us: float | None
    why: str = ""

    @property
    def patchify(self) -> bool:
        return self.patchify_us is not None and (self.conv_us is None or self.patchify_us < self.conv_us)

    def to_json(self) -> dict[str, object]:
        return {"conv": self.conv, "conv_us": None if self.conv_us is None else round(self.conv_us, 3),
                "patchify_us": None if self.patchify_us is None else round(self.patchify_us, 3),
                "chosen": "patchify + GEMM" if self.patchify else "conv", **({"why": self.why} if self.why else {})}


ONE_BY_ONE = ("a 1x1 conv reads each pixel's channels as one GEMM row already: the rewrite would add a copy on each "
              "side and take the conv's fused epilogue (BatchNorm, activation, residual) apart")


def patchify_choice(pc: PatchConv, precision: str, hw: Hardware) -> PatchifyChoice:
    """The estimates of one conv's two forms (PatchifyChoice) in the kernel dtype `precision` gives (the tensors'
    own for fp32); a 1x1 conv is not a patch embedding and stays a conv (ONE_BY_ONE). The conv's form is our conv
    kernel: ONNX Runtime's conv of a patch embedding measured 82.8 us at batch 1 and 472.6 at batch 64 on the H200
    (docs/benchmarks.md), which the vendor GEMM estimate of an unfused conv does not describe."""
    if pc.kh * pc.kw == 1:
        return PatchifyChoice(pc.name, None, None, ONE_BY_ONE)
    dtype = {"fp16": "f16", "bf16": "bf16"}.get(precision, DTYPE_NAMES.get(pc.dtype, "f32"))
    gap = hw.constants(LaunchConstants).graph_gap_us

    def copy_us(elems: int, gathered: bool) -> float:
        if not elems:
            return 0.0
        inp = (((elems,), "float"),)
        layout = ((((elems,), (2,), 0),) if gathered else (None,))  # innermost stride != 1: read one per access
        problem = elementwise_problem(dtype, (elems,), (), inp, (("x", 0),), layout)
        return ELEMENTWISE.estimate_us(problem, {"THREADS": 256, "VEC": 8}, hw) + gap

    conv = conv_problem(dtype, pc.batch, pc.c, pc.h, pc.w, pc.oc, pc.kh, pc.kw, stride=(pc.kh, pc.kw), bias=pc.bias)
    conv_pick = slot_estimate(conv, hw)
    gemm = gemm_problem(dtype, 1, pc.gemm_m, pc.gemm_n, pc.gemm_k, bias=pc.bias)
    gemm_pick = slot_estimate(gemm, hw)
    tokens = pc.gemm_m * pc.oc
    conv_us = None if conv_pick is None else conv_pick[1] + gap + (0.0 if pc.nchw_copy else copy_us(tokens, True))
    patch_us = None if gemm_pick is None else (copy_us(pc.patchify_elems, False) + gemm_pick[1] + gap
                                               + copy_us(pc.nchw_elems, True))
    return PatchifyChoice(pc.name, conv_us, patch_us)


def patchify(model: onnx.ModelProto, config: GtcoConfig, hw: Hardware) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """`model` with each patch embedding that the estimate prices faster as a copy and a GEMM rewritten so, and the
    decision of each (PatchifyChoice.to_json, one per conv: the last pass's where the rewrite asks again)."""
    choices: list[PatchifyChoice] = []

    def pays(pc: PatchConv) -> bool:
        choice = patchify_choice(pc, config.plan_precision, hw)
        choices.append(choice)
        return choice.patchify

    model, _ = patchify_convs(model, pays)
    by_conv = {c.conv: c for c in choices}  # the decisions of the last pass, one per conv
    return model, [c.to_json() for c in by_conv.values()]


PASSES = (GraphPass("patchify", 0, lambda config: bool(config.patchify), patchify,
                    "a patch embedding as a patchify copy and a GEMM, families/conv/patchify.py",
                    "Convs whose stride is their kernel (patch embeddings), priced both ways",
                    (("conv", "conv"), ("conv µs", "conv_us"), ("patchify + GEMM µs", "patchify_us"),
                     ("runs as", "chosen"))),)
"""The conv family's passes (GraphPass): the patch embedding's patchify rewrite, before the QKV packing."""


__all__ = ["ONE_BY_ONE", "PASSES", "PatchifyChoice", "patchify", "patchify_choice"]
