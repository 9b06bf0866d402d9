"""A gated MLP's gate and up projections packed into one GEMM before planning (SwiGLU in LLaMA, Qwen, Mistral;
GeGLU in T5 v1.1 and Gemma), so that the MLP's first half is one launch.

The MLP computes ``act(x @ Wg) * (x @ Wu)``: two MatMuls of one input, an activation of the first (SiLU as
``g * Sigmoid(g)``, a GELU), and their product. Packed, the weights interleave their columns (gate j at column 2j, up
j at 2j + 1) into one [K, 2N] weight, and two Slices of step 2 on the last axis give the gate and the up halves back
under their old names, so the activation and the product read what they read before:

    x --MatMul Wg--> g --act--> a --Mul--> y
      --MatMul Wu--> u ------------^

    x --MatMul [Wg, Wu interleaved]--> h --Slice 0::2--> g --act--> a --Mul--> y
                                         --Slice 1::2--> u ------------^

The GEMM rule (families/gemm/rule.py) then sees one MatMul whose pairs of adjacent columns are (gate, up): the
kernel's epilogue computes act(gate) * up from the pair a lane holds (gemm.cuh GATED) and writes y [.., N]. Only
pairs whose weights are constant [K, N] matrices of one shape, whose results nothing else reads, and whose
activation the GEMM epilogue knows are packed; biases (rare in these models) keep the two GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import is_op, other_input
from onnx_gtco.patterns.find_activation import find_activation
from onnx_gtco.patterns.util import sole_reader, spliced

GATED_ACTIVATIONS = frozenset({"silu", "gelu_erf", "gelu_tanh", "quick_gelu", "relu", "sigmoid", "tanh"})
"""Activations of a gate the GEMM epilogue applies (the ones gemm.cuh's Act has, less none and relu6)."""
SLICE_STEP = 2


@dataclass(frozen=True)
class GatedPair:
    """One gated MLP: the gate's and the up projection's MatMuls, the activation's nodes and name, and the Mul."""

    gate: Node
    up: Node
    activation: str
    act_nodes: frozenset[int]
    mul: Node


def _weight(view: GraphView, mm: Node) -> np.ndarray | None:
    if not is_op(mm, "MatMul") or len(mm.inputs) != 2:
        return None
    w = view.const_value(mm.inputs[1])
    return w if w is not None and w.ndim == 2 else None


def _pair_at(view: GraphView, gate: Node) -> GatedPair | None:
    """The gated MLP whose gate projection is the MatMul `gate`, or None."""
    wg = _weight(view, gate)
    if wg is None:
        return None
    act = find_activation(view, gate.outputs[0])
    if act is None or act[0] not in GATED_ACTIVATIONS:
        return None
    mul = sole_reader(view, act[2])
    if not is_op(mul, "Mul") or len(mul.inputs) != 2:  # type: ignore[union-attr]
        return None
    assert mul is not None
    other = other_input(mul, act[2])
    up = view.producer_of(other) if other is not None else None
    wu = _weight(view, up) if up is not None else None
    if up is None or wu is None or up.inputs[0] != gate.inputs[0] or sole_reader(view, up.outputs[0]) is not mul:
        return None
    if wg.shape != wu.shape or wg.dtype != wu.dtype:
        return None
    return GatedPair(gate, up, act[0], act[1], mul)


def gated_pairs(view: GraphView) -> list[GatedPair]:
    """Every gated MLP of the graph that pack_gated packs, in node order of their gate projections."""
    return [p for node in view.nodes if (p := _pair_at(view, node)) is not None]


def pack_gated(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[GatedPair]]:
    """`model` with each gated MLP's gate and up MatMuls one MatMul over their interleaved weights and two step-2
    Slices that keep the gate's and the up projection's tensor names (a copy; the model passed in is unchanged), and
    what was packed. A model with nothing to pack is returned as it is."""
    view = GraphView(model)
    pairs = gated_pairs(view)
    if not pairs:
        return model, []
    graph = model.graph
    taken = {t for n in graph.node for t in (*n.input, *n.output)} | {t.name for t in graph.initializer}
    removed: set[int] = set()
    inserts: dict[int, list[onnx.NodeProto]] = {}
    new_inits: list[onnx.TensorProto] = []
    new_infos: list[onnx.ValueInfoProto] = []
    for pair in pairs:
        wg, wu = _weight(view, pair.gate), _weight(view, pair.up)
        assert wg is not None and wu is not None
        k, n = wg.shape
        base = _fresh(f"{pair.gate.name or pair.gate.outputs[0]}.gated", taken)
        packed = numpy_helper.from_array(np.stack([wg, wu], axis=-1).reshape(k, 2 * n), f"{base}.weight")
        starts = [numpy_helper.from_array(np.array([s], np.int64), f"{base}.start{s}") for s in (0, 1)]
        ends = numpy_helper.from_array(np.array([2 * n], np.int64), f"{base}.end")
        axes = numpy_helper.from_array(np.array([-1], np.int64), f"{base}.axes")
        steps = numpy_helper.from_array(np.array([SLICE_STEP], np.int64), f"{base}.steps")
        new_inits += [packed, *starts, ends, axes, steps]
        h = f"{base}.matmul"
        nodes = [helper.make_node("MatMul", [pair.gate.inputs[0], packed.name], [h], name=h)]
        for start, half, suffix in ((starts[0], pair.gate.outputs[0], "gate"), (starts[1], pair.up.outputs[0], "up")):
            nodes.append(helper.make_node("Slice", [h, start.name, ends.name, axes.name, steps.name], [half],
                                          name=f"{base}.{suffix}"))
        info = view.info(pair.gate.outputs[0])
        if info is not None and info.shape is not None:
            new_infos.append(helper.make_tensor_value_info(h, info.dtype, [*info.shape[:-1], 2 * n]))
        first = min(pair.gate.id, pair.up.id)
        removed.update((pair.gate.id, pair.up.id))
        inserts[first] = nodes
    return spliced(model, inserts, removed, new_inits, new_infos), pairs


def _fresh(name: str, taken: set[str]) -> str:
    out, i = name, 0
    while any(t == out or t.startswith(f"{out}.") for t in taken):
        i += 1
        out = f"{name}_{i}"
    taken.add(out)
    return out


def gated_tail(view: GraphView, tensor: str) -> tuple[str, frozenset[int], str] | None:
    """Where `tensor` (a GEMM's result of N columns) is read only by two Slices of step 2 on its last axis, starting
    at 0 and 1 (the gate's and the up projection's columns, as pack_gated writes them), the first through an
    activation the epilogue knows into a Mul with the second: (the activation, the nodes after the GEMM, the Mul's
    output). None otherwise."""
    readers = view.consumers_of(tensor)
    if tensor in view.graph_outputs or len(readers) != 2:
        return None
    halves: dict[int, Node] = {}
    for s in readers:
        start = _step_slice(view, s, tensor)
        if start is None:
            return None
        halves[start] = s
    if set(halves) != {0, 1}:
        return None
    gate, up = halves[0], halves[1]
    act = find_activation(view, gate.outputs[0])
    if act is None or act[0] not in GATED_ACTIVATIONS:
        return None
    mul = sole_reader(view, act[2])
    if not is_op(mul, "Mul") or other_input(mul, act[2]) != up.outputs[0]:
        return None
    if sole_reader(view, up.outputs[0]) is not mul:
        return None
    assert mul is not None
    return act[0], frozenset({gate.id, up.id, *act[1], mul.id}), mul.outputs[0]


def _step_slice(view: GraphView, node: Node, tensor: str) -> int | None:
    """The start of `node` if it is a Slice of `tensor` with step 2 on its last axis alone, to its end."""
    if not is_op(node, "Slice") or len(node.inputs) != 5 or node.inputs[0] != tensor:
        return None
    values = [view.const_value(t) for t in node.inputs[1:]]
    shape = view.shape(tensor)
    if any(v is None or v.size != 1 for v in values) or shape is None:
        return None
    start, end, axis, step = (int(np.asarray(v).reshape(-1)[0]) for v in values)  # type: ignore[union-attr]
    last = isinstance(shape[-1], int) and end >= shape[-1]
    if step != SLICE_STEP or axis not in (-1, len(shape) - 1) or not last or start not in (0, 1):
        return None
    return start


__all__ = ["GATED_ACTIVATIONS", "GatedPair", "gated_pairs", "gated_tail", "pack_gated"]
