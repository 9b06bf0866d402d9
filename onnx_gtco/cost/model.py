"""The planner's cost of a candidate group, and the estimate of what ONNX Runtime's own kernels take.

The DP (plan.dp) prices every candidate with `cost_fn`, in microseconds of a CUDA graph replay on the configured
target:

* a fused group with a device kernel: the estimate of the kernel the library would build for it (the caller's
  `kernel_us`: the same selection and the same family estimate the build and the tuner use, kernels'
  `estimate_us` through plugin.coverage), plus the graph gap of each of its launches (a QKV group: one per
  projection);
* a fused group without one: what its nodes cost unfused, as its model-local function runs them (less a tie-break);
* an unfused node: ONNX Runtime's kernel for it (`ort_us`): a MatMul, Gemm, matmul Einsum, Attention or Conv as the
  vendor GEMM (cuBLAS: `vendor_gemm_us`), anything else memory-bound, at the fitted bandwidth of ORT's elementwise
  kernels; plus its graph gap. View ops and host-side shape arithmetic cost nothing.

Every constant (the launch floor and graph gap, the vendor GEMM's and ORT's efficiencies) is fitted per GPU from
measured kernel times (onnx_gtco.calibration), or its default where the target has no calibration.

A fused group reads its external inputs and writes its external outputs once (not the constant shapes, axes, pads
or bounds of its view and layout ops: its kernel holds those in its code); an unfused node does the same on its own.
Nodes that only compute shapes (small integer tensors), and metadata-only ops (Reshape, Squeeze, ...), cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from onnx import TensorProto

from onnx_gtco.calibration import Constants, Hardware, LaunchConstants, hardware, param
from onnx_gtco.config import GtcoConfig
from onnx_gtco.ir.einsum import batched_matmul
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.opspec import SPECS
from onnx_gtco.plan.types import Candidate

# Ops that never launch a kernel in ORT (they alias or reinterpret their input).
ALIAS_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Constant", "Shape", "Size"})
# View and layout ops whose operands after the first (shape, axes, pads, bounds) are no data they read.
OPERAND_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Slice", "Pad"})
# FLOPs per output element of the cheaper-than-matmul ops; default 1.
_EW_FLOPS = {"Erf": 8, "Tanh": 6, "Exp": 4, "Sqrt": 4, "Pow": 4, "Div": 2, "Gelu": 12, "Sigmoid": 5, "Log": 4}
_NORM_FLOPS = {"Softmax": 5, "LayerNormalization": 8}
SMALL_INT = 64  # integer tensors up to this many elements are shape arithmetic, run on the host


@dataclass(frozen=True)
class VendorGemmConstants(Constants):
    """The vendor GEMM (cuBLAS / cuBLASLt: ONNX Runtime's MatMul and Gemm kernels, and our cuBLASLt instances),
    fitted to ORT's cuBLAS kernels in the measured profiles."""

    GROUP: ClassVar[str] = "vendor_gemm"
    extra_us: float = param(2.96, 0.0, 20.0, "us", "what a cuBLAS GEMM takes beyond the launch floor however small "
                            "it is (its kernel's setup and tail, a split-K reduction)")
    mma_frac: float = param(0.644, 0.05, 1.0, "of the Tensor Core peak", "the share of the peak it sustains on a "
                            "GEMM that fills the GPU")
    bw_frac: float = param(0.65, 0.05, 1.5, "of DRAM bandwidth", "the rate at which it moves A, B and y where those "
                           "bound it (few rows)")


@dataclass(frozen=True)
class OrtConstants(Constants):
    """ONNX Runtime's memory-bound kernels (elementwise ops, bias adds, casts, LayerNorm, Softmax), fitted to those
    kernels in the measured profiles."""

    GROUP: ClassVar[str] = "ort"
    extra_us: float = param(2.11, 0.0, 20.0, "us", "what one takes beyond the launch floor however small it is")
    bw_frac: float = param(0.39, 0.02, 1.5, "of DRAM bandwidth", "the rate at which it reads and writes its "
                           "tensors")


def vendor_gemm_us(flops: float, moved_bytes: float, tf32: bool, hw: Hardware) -> float:
    """A cuBLAS GEMM of `flops` moving `moved_bytes` on `hw`: the launch floor and its extra time, then the slower of
    its Tensor Core work and its traffic at their fitted shares (VendorGemmConstants)."""
    t, c = hw.target, hw.constants(VendorGemmConstants)
    peak = t.tf32_tflops if tf32 else t.tc_tflops
    busy = max(flops / (peak * 1e6 * c.mma_frac), moved_bytes / (t.dram_gbps * 1e3 * c.bw_frac))
    return hw.constants(LaunchConstants).floor_us + c.extra_us + busy


def memory_us(moved_bytes: float, other_flops: float, hw: Hardware) -> float:
    """An ONNX Runtime memory-bound kernel moving `moved_bytes` (its CUDA-core FLOPs at the peak, where they bound
    it instead): the launch floor, its extra time and the traffic at the fitted share (OrtConstants)."""
    t, c = hw.target, hw.constants(OrtConstants)
    busy = max(moved_bytes / (t.dram_gbps * 1e3 * c.bw_frac), other_flops / (t.cuda_tflops * 1e6))
    return hw.constants(LaunchConstants).floor_us + c.extra_us + busy


@dataclass(frozen=True)
class Estimate:
    """Work of one group. FLOPs split by unit; bytes of DRAM traffic; number of kernel launches."""

    mm_flops: float = 0.0
    other_flops: float = 0.0
    dram_bytes: float = 0.0
    launches: int = 0

    def ort_us(self, hw: Hardware, precision: str = "fp32") -> float:
        """What ONNX Runtime's kernels of this work take, without graph gaps: the vendor GEMM where it has
        matmul-class FLOPs (TF32 at fp32), else a memory-bound kernel; 0 for work that launches nothing."""
        if not self.launches:
            return 0.0
        if self.mm_flops:
            return self.launches * vendor_gemm_us(self.mm_flops / self.launches, self.dram_bytes / self.launches,
                                                  precision == "fp32", hw)
        return self.launches * memory_us(self.dram_bytes / self.launches, self.other_flops / self.launches, hw)


# A symbolic or unknown dim (a dynamic batch, say) counts as SYMBOLIC_DIM when costing: the plan is then the plan
# for the smallest instance, and FLOP shares stay meaningful instead of dropping to zero.
SYMBOLIC_DIM = 1


def _static(shape: tuple | None) -> tuple[int, ...] | None:
    """The shape with symbolic dims bound to SYMBOLIC_DIM; None when the rank is unknown."""
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else SYMBOLIC_DIM for d in shape)


def _numel(view: GraphView, t: str) -> int:
    ti = view.info(t)
    shape = _static(ti.shape) if ti is not None else None
    return 0 if shape is None else int(np.prod(shape, dtype=np.int64))


def node_flops(view: GraphView, n: Node) -> tuple[float, float]:
    """(matmul-class FLOPs, other FLOPs) of one node; 0 where the rank is unknown (symbolic dims count as 1)."""
    if n.domain != "":
        return 0.0, 0.0
    out = _numel(view, n.outputs[0]) if n.outputs else 0
    if n.op_type in ("MatMul", "Gemm"):
        a = _static(view.shape(n.inputs[0]))
        if a is None or not a:
            return 0.0, 0.0
        k = a[0] if (n.op_type == "Gemm" and n.attrs.get("transA", 0)) else a[-1]
        return 2.0 * out * k, float(out if n.op_type == "Gemm" and len(n.inputs) > 2 else 0)
    if n.op_type == "Einsum" and (form := batched_matmul(n.attrs.get("equation"))) is not None:
        a = _static(view.shape(n.inputs[0]))
        if a is None or len(a) < 2:
            return 0.0, 0.0
        return 2.0 * out * (a[-2] if form.trans_a else a[-1]), 0.0
    if n.op_type in ("Conv", "ConvTranspose"):
        w = _static(view.shape(n.inputs[1]))
        if w is None:
            return 0.0, 0.0
        per_out = float(np.prod(w[1:])) if n.op_type == "Conv" else float(w[0] * np.prod(w[2:]))
        return 2.0 * out * per_out, 0.0
    if n.op_type == "Attention":
        q, k = _static(view.shape(n.inputs[0])), _static(view.shape(n.inputs[1]))
        if q is None or k is None:
            return 0.0, 0.0
        return 4.0 * float(np.prod(q)) * k[-2], 5.0 * float(np.prod(q[:-1])) * k[-2]
    if n.op_type in ALIAS_OPS:
        return 0.0, 0.0
    if n.op_type in _NORM_FLOPS:
        return 0.0, float(_NORM_FLOPS[n.op_type] * out)
    if n.op_type.startswith("Reduce"):
        return 0.0, float(_numel(view, n.inputs[0]))
    return 0.0, float(_EW_FLOPS.get(n.op_type, 1) * out)


def _is_host(view: GraphView, n: Node) -> bool:
    """Shape arithmetic: every output is a small integer tensor (ORT runs these on the CPU)."""
    if n.op_type in ALIAS_OPS and n.op_type not in ("Shape", "Size"):
        return False
    for o in n.outputs:
        ti = view.info(o)
        if ti is None or ti.dtype not in (TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL):
            return False
        if ti.numel is None or ti.numel > SMALL_INT:
            return False
    return True


def _bytes(view: GraphView, tensors: tuple[str, ...]) -> float:
    total = 0.0
    for t in tensors:
        ti = view.info(t)
        if ti is not None:
            total += _numel(view, t) * ti.itemsize
    return total


def estimate(view: GraphView, cand: Candidate) -> Estimate:
    """Work of a candidate group (or one unfused node) on any GPU."""
    nodes = [view.nodes[i] for i in sorted(cand.nodes)]
    mm = other = 0.0
    for n in nodes:
        a, b = node_flops(view, n)
        mm += a
        other += b
    if not cand.fused and (nodes[0].op_type in ALIAS_OPS or _is_host(view, nodes[0])):
        return Estimate(0.0, 0.0, 0.0, 0)
    reads = view.external_inputs(cand.nodes)
    if cand.fused:  # a shape, axes or pads operand is compiled into the kernel, not read
        reads = tuple(t for t in reads if not _compiled_in(view, t, nodes))
    dram = _bytes(view, reads) + _bytes(view, view.external_outputs(cand.nodes))
    return Estimate(mm, other, dram, launches(cand))


def launches(cand: Candidate) -> int:
    """Kernel launches of a fused group (its op's OpSpec.launches: a QKV group one per projection) or of an unfused
    node that runs."""
    spec = SPECS.get(cand.family)
    return spec.launches(dict(cand.attrs)) if spec is not None and spec.launches is not None else 1


def _compiled_in(view: GraphView, t: str, nodes: list[Node]) -> bool:
    """A constant that the group's nodes read only as the shape, axes, pads or bounds of a view or layout op, which a
    fused kernel holds in its code."""
    return view.is_constant(t) and all(n.op_type in OPERAND_OPS and n.domain == "" and t not in n.inputs[:1]
                                       for n in nodes if t in n.inputs)


FUNCTION_TIE = 1e-9
"""The share of its unfused cost, per node, that a fused group without a device kernel is cheaper in the DP (cost_fn):
a tie-break far below the model's precision."""


def unfused_cost(cost: Callable[[Candidate], float], cand: Candidate) -> float:
    """What the nodes of `cand` cost unfused, each alone (`cost` of a single-node unfused candidate), summed."""
    return sum(cost(Candidate(frozenset([i]), "unfused", "single")) for i in sorted(cand.nodes))


KernelUs = Callable[[Candidate], float | None]
"""A fused candidate -> the estimated time of one launch of the kernel the library would build for it (kernels'
estimate_us of its selected implementation and configuration), or None when it gets no device kernel (it runs its
model-local function)."""


def cost_fn(view: GraphView, config: GtcoConfig, kernel_us: KernelUs | None = None) -> Callable[[Candidate], float]:
    """The DP's cost callable: predicted microseconds of a candidate in a CUDA graph replay on the configured target
    (see the module docstring).

    `kernel_us`: the estimate of a fused candidate's kernel, None where it has none (the caller asks the kernel
    families: plugin.coverage); a group without one costs its nodes unfused, less FUNCTION_TIE of that per node it
    holds: of covers the model predicts equal, the DP keeps the one with the fewest, largest fused nodes, which
    record the groups as a kernel would run them (the report says why they have none and counts them unfused).
    Without `kernel_us` (a caller with no kernel families: the model as given, tests) a fused group costs its work
    at ORT's rates, as one launch per kernel."""
    hw = hardware(config.target)
    gap = hw.constants(LaunchConstants).graph_gap_us

    def cost(cand: Candidate) -> float:
        if cand.fused and len(cand.nodes) > config.max_group_size:
            return math.inf
        est = estimate(view, cand)
        if cand.fused and kernel_us is not None:
            us = kernel_us(cand)
            if us is None:
                return unfused_cost(cost, cand) * (1.0 - FUNCTION_TIE * len(cand.nodes))
            return est.launches * (us + gap)
        # unfused nodes keep the model's own precision
        return est.ort_us(hw, config.plan_precision if cand.fused else "fp32") + est.launches * gap

    return cost
