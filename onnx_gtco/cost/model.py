"""Analytical cost of one group on a Target: FLOPs at peak, DRAM bytes at bandwidth, plus launch overhead.

    time_us = max(mm_flops / mm_peak + other_flops / cuda_peak,  dram_bytes / bandwidth) + launches * launch_us
              + panel_elems * itemsize / sm_l2_bandwidth

mm_flops run on Tensor Cores (fp16/bf16, or TF32 for fp32 compute); everything else on CUDA cores. A QKV group
launches once per projection (gtco::Qkv runs its GEMM per projection); every other fused group once. The panel term is
work that does not overlap the rest: a GEMM + LayerNorm group's normalize step, which the last block of each row
panel runs alone over the panel it reads back (LN_PANEL_ROWS rows, read and written at one SM's share of L2
bandwidth, Target.sm_l2_gbps: an assumption until measured).

A fused group reads its external inputs and writes its external outputs once (not the constant shapes, axes, pads
or bounds of its view and layout ops: its kernel holds those in its code); an unfused node does the same on its own.
Nodes that only compute shapes (small integer tensors), and metadata-only ops (Reshape, Squeeze, ...), cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from onnx_gtco.config import GtcoConfig, Target
from onnx_gtco.ir.einsum import batched_matmul
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.plan.types import Candidate

# Ops that never launch a kernel in ORT (they alias or reinterpret their input).
ALIAS_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Constant", "Shape", "Size"})
# View and layout ops whose operands after the first (shape, axes, pads, bounds) are no data they read.
OPERAND_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Slice", "Pad"})
# FLOPs per output element of the cheaper-than-matmul ops; default 1.
_EW_FLOPS = {"Erf": 8, "Tanh": 6, "Exp": 4, "Sqrt": 4, "Pow": 4, "Div": 2, "Gelu": 12, "Sigmoid": 5, "Log": 4}
_NORM_FLOPS = {"Softmax": 5, "LayerNormalization": 8}
SMALL_INT = 64  # integer tensors up to this many elements are shape arithmetic, run on the host
LN_PANEL_ROWS = 64  # rows of the panel a GEMM + LayerNorm kernel's last block normalizes (a typical BM)


@dataclass(frozen=True)
class Estimate:
    """Work of one group. FLOPs split by unit; bytes of DRAM traffic; number of kernel launches."""

    mm_flops: float = 0.0
    other_flops: float = 0.0
    dram_bytes: float = 0.0
    launches: int = 0
    panel_elems: float = 0.0  # read back and written by one block after the rest (GEMM + LayerNorm)

    def time_us(self, hw: Target, precision: str) -> float:
        mm_peak = hw.tf32_tflops if precision == "fp32" else hw.tc_tflops
        compute = self.mm_flops / (mm_peak * 1e6) + self.other_flops / (hw.cuda_tflops * 1e6)
        memory = self.dram_bytes / (hw.dram_gbps * 1e3)
        panel = self.panel_elems * (4 if precision == "fp32" else 2) / (hw.sm_l2_gbps * 1e3)  # the kernel's dtype
        return max(compute, memory) + self.launches * hw.launch_us + panel


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
    return Estimate(mm, other, dram, launches(cand), _panel_elems(cand))


def launches(cand: Candidate) -> int:
    """Kernel launches of a fused group (a QKV group: one per projection) or of an unfused node that runs."""
    if cand.family == "qkv":
        return max(1, len(cand.attr("ns") or ()))
    return 1


def _panel_elems(cand: Candidate) -> float:
    """What the normalize step of a GEMM + LayerNorm group reads back and writes: LN_PANEL_ROWS rows of N, twice."""
    if cand.family != "gemm" or not cand.attr("layernorm"):
        return 0.0
    n, m = cand.attr("n"), cand.attr("m")
    if not isinstance(n, int):
        return 0.0
    rows = min(m, LN_PANEL_ROWS) if isinstance(m, int) else LN_PANEL_ROWS
    return 2.0 * rows * n


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


def cost_fn(view: GraphView, config: GtcoConfig, has_kernel: Callable[[Candidate], bool] | None = None
            ) -> Callable[[Candidate], float]:
    """The DP's cost callable: predicted microseconds of a candidate on the configured target.

    `has_kernel`: whether a fused candidate gets a device kernel on the target (the caller asks the kernel families;
    None: every one does). One that gets none runs its model-local function, the nodes it holds, so it costs what
    they cost unfused (unfused_cost), less FUNCTION_TIE of that per node it holds: of covers the model predicts
    equal, the DP keeps the one with the fewest, largest fused nodes, which record the groups as a kernel would run
    them (the report says why they have none and counts them unfused)."""
    hw, precision = config.hw, config.precision

    def cost(cand: Candidate) -> float:
        if cand.fused and len(cand.nodes) > config.max_group_size:
            return math.inf
        if cand.fused and has_kernel is not None and not has_kernel(cand):
            return unfused_cost(cost, cand) * (1.0 - FUNCTION_TIE * len(cand.nodes))
        # unfused nodes keep the model's own precision
        return estimate(view, cand).time_us(hw, precision if cand.fused else "fp32")

    return cost
