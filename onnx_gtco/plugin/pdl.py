"""Which fused nodes launch with programmatic dependent launch (PDL), per arch slot: the NodeSpec::pdl column of
the generated glue (plugins/ort/gtco_ort.h).

A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel ahead of it in
the stream is still running; every gtco kernel waits for that grid (griddepcontrol.wait, gtco::grid_dep_wait) before
its first global access. A node of the library launches that way in an arch slot when all of these hold:

- the slot's arch is sm_90 or later (the glue also checks the device's compute capability at run time);
- every instance of the node in that slot (its instance and its dispatch entries) is a gtco kernel, not a CUTLASS
  or cuBLASLt one (those do not wait in griddepcontrol.wait);
- every input of the node that is not a constant (an initializer or a Constant node's output) is an output of
  another fused node that runs gtco kernels in that slot by the same rule (a bound node with device kernels). A
  graph input or a tensor written by any other node (an ORT kernel, a function-only fused node, a CUTLASS or
  cuBLASLt instance) keeps the node on a plain launch: gtco_ort.h (NodeRef::pdl) says why.

The session config entry gtco.pdl=0 turns it off at run time (plugins/ort/register.inc).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import onnx

from onnx_gtco.kernels.family import Instance
from onnx_gtco.kernels.select import IMPLEMENTATIONS

FOREIGN_IMPLS = tuple(IMPLEMENTATIONS)
"""Implementations whose kernels are not gtco's own (every family's library implementations: the GEMM's cuBLASLt
and CUTLASS): never launched with PDL, and no PDL launch after them."""
MIN_ARCH = 90


def own_kernel(inst: Instance) -> bool:
    """Whether `inst` runs a gtco kernel (one that waits in griddepcontrol.wait), not a CUTLASS or cuBLASLt one."""
    return str(inst.config.get("impl", "mma")) not in FOREIGN_IMPLS


def arch_number(arch: str) -> int:
    """sm_90a -> 90."""
    digits = "".join(c for c in arch.removeprefix("sm_") if c.isdigit())
    return int(digits) if digits else 0


def pdl_slots(model: onnx.ModelProto, archs: Sequence[str], instances: Mapping[str, Sequence[Sequence[Instance]]],
              ) -> dict[str, list[bool]]:
    """Node name -> whether it launches with PDL, per arch of `archs`, for every node of `instances`.

    `model` is the rewritten model as the library registers it (function-only nodes already moved); `instances`
    maps each node that runs device kernels (a bound node of an op type with device kernels) to its instances per
    arch of `archs`: its instance and every dispatch entry's."""
    constants: set[str] = {t.name for t in model.graph.initializer}
    constants.update(t.name for t in model.graph.sparse_initializer if t.values.name)
    producer: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            constants.update(o for o in n.output if o)
            continue
        for o in n.output:
            if o:
                producer[o] = n.name
    inputs = {n.name: [t for t in n.input if t] for n in model.graph.node if n.name in instances}

    def own_in(node: str, slot: int) -> bool:
        return node in instances and all(own_kernel(i) for i in instances[node][slot])

    out: dict[str, list[bool]] = {}
    for node in instances:
        row = []
        for slot, arch in enumerate(archs):
            row.append(arch_number(arch) >= MIN_ARCH and own_in(node, slot) and all(
                t in constants or (producer.get(t) not in (None, node) and own_in(producer[t], slot))
                for t in inputs.get(node, ())))
        out[node] = row
    return out


def pdl_archs(pdl: Mapping[str, Sequence[bool]], archs: Collection[str]) -> dict[str, list[str]]:
    """node -> the archs it launches with PDL on (nodes with none left out), for the build report."""
    order = list(archs)
    return {n: [a for a, on in zip(order, row, strict=False) if on] for n, row in pdl.items() if any(row)}


__all__ = ["FOREIGN_IMPLS", "arch_number", "own_kernel", "pdl_archs", "pdl_slots"]
