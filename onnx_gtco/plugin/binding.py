"""How a fused `ai.gtco` node meets its kernel: the roles of its inputs and outputs.

A family's glue in C++ (plugins/families/<family>/<family>_op.h) reads its inputs by *role* (x, residual, gamma,
...). Which node input plays which role the rule decided and the rewrite wrote down (onnx_gtco.opspec: role i is node
input i); a binder reads it back through the spec, checks what only it knows (the dtypes, layouts and variants its C++
kernel takes), and maps the roles onto the C++ role enums for the generated node table (gtco::NodeSpec). A binder that
cannot bind a node says why (a string); the node then keeps running its function, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnx

from onnx_gtco.opspec import FusedOp, decode, split_op_type

MAX_ROLES = 8  # gtco::kMaxRoles in plugins/ort/gtco_ort.h


@dataclass(frozen=True)
class Operand:
    """One input or output of a fused node as the optimizer knows it after shape inference."""

    name: str
    dtype: str                            # "f32", "f16", "bf16", "i64", ... ("" when unknown)
    shape: tuple[int | str, ...] | None   # ints, symbols (str) for dynamic dims; None when unknown
    value: np.ndarray | None = None       # the initializer's value, when the input is a constant


@dataclass(frozen=True)
class FusedNode:
    """A fused node of the rewritten model, with its function body and what shape inference said."""

    node: onnx.NodeProto
    function: onnx.FunctionProto
    attrs: dict[str, Any]                 # onnx.helper.get_attribute_value of each attribute
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]

    @property
    def family(self) -> str:
        """`Layernorm_f32` -> `layernorm`, `BmmSoftmax_f16` -> `bmm_softmax` (inverse of opspec.op_type)."""
        return split_op_type(self.node.op_type)[0]

    @property
    def dtype(self) -> str:
        return split_op_type(self.node.op_type)[1]

    @property
    def op(self) -> FusedOp | str:
        """The node read through its family's spec (opspec.decode), or why it has none."""
        return decode(self.node.op_type, self.attrs, list(self.node.input), list(self.node.output))


@dataclass(frozen=True)
class Binding:
    """Role -> node input/output index (-1: the node has no such operand)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.inputs) > MAX_ROLES or len(self.outputs) > MAX_ROLES:
            raise ValueError(f"at most {MAX_ROLES} roles per side, got {len(self.inputs)} / {len(self.outputs)}")


def read(node: FusedNode, family: str) -> FusedOp | str:
    """The node through its spec (FusedNode.op) when it is of `family` and of one of the spec's dtypes, else why
    not."""
    op = node.op
    if isinstance(op, str):
        return op
    if op.family != family:
        return f"node {node.node.name!r} is of family {op.family!r}, not {family!r}"
    dtypes = op.spec.dtypes
    return op if op.dtype in dtypes else f"dtype {op.dtype!r}: the {family} kernel takes {', '.join(dtypes)}"


def bind_roles(node: FusedNode, op: FusedOp, need: dict[str, bool], cpp_in: tuple[str, ...],
               cpp_out: tuple[str, ...], outputs: int = 1, out_dtypes: tuple[str, ...] = (),
               io_dtype: str = "", role_dtypes: dict[str, str] | None = None) -> Binding | str:
    """The Binding of a node whose kernel reads the roles `cpp_in` / `cpp_out` (the C++ enums' order).

    `need`: role -> whether the node's attributes say it is there; a role they require that the node lacks (the
    group computes that operand itself) or one they rule out is an Unbound, as is an input of another dtype than
    the node's, an output of another dtype than the node's, or more than `outputs` node outputs (an intermediate of
    the group is read outside it). `out_dtypes`: output dtypes the kernel writes beside the node's own. `io_dtype`:
    the dtype of its inputs and outputs where it is not the node's (an fp8 GEMM's fp16), `role_dtypes` the roles
    of yet another dtype (its E4M3 B, its fp32 scales)."""
    io = io_dtype or node.dtype
    role_dtypes = role_dtypes or {}
    for role, wanted in need.items():
        if wanted != (role in op.inputs):
            return (f"{role} is {'not a node input' if wanted else 'a node input its attributes rule out'} "
                    "(the group computes it, or the kernel does not take this form)")
    if len(node.node.output) > outputs:
        return (f"the node has {len(node.node.output)} outputs (an intermediate of the group is read outside it); "
                f"the kernel writes {outputs}")
    for role, i in op.inputs.items():
        got, want = node.inputs[i].dtype, role_dtypes.get(role, io)
        if got and got != want:
            return (f"input {role} ({node.node.input[i]!r}) is {got}; the {node.node.op_type} kernel takes "
                    f"{want} only")
    for role, i in op.outputs.items():
        got = node.outputs[i].dtype if i < len(node.outputs) else ""
        if got and got != io and got not in out_dtypes:
            return (f"output {role} ({node.node.output[i]!r}) is {got}; the {node.node.op_type} kernel writes "
                    f"{io} only")
    return Binding(tuple(op.inputs.get(r, -1) for r in cpp_in), tuple(op.outputs.get(r, -1) for r in cpp_out))


def present(binding: Binding, operands: tuple[tuple[str, str, int], ...]) -> dict[str, bool]:
    """Flag -> whether the binding has the operand it names: (flag, "in" or "out", role index)."""
    flags = {}
    for flag, side, role in operands:
        roles = binding.inputs if side == "in" else binding.outputs
        flags[flag] = role < len(roles) and roles[role] >= 0
    return flags


def one_row(node: FusedNode, binding: Binding, role: str, index: int, n: int | None) -> str | None:
    """None when the input of role `role` (index `index` of the binding) is one row (of `n` values where given) or
    of unknown shape, else why the device kernel cannot take it (an operand of one value per column)."""
    operand = node.inputs[binding.inputs[index]]
    if operand.shape is None or not all(isinstance(d, int) for d in operand.shape):
        return None
    dims = [int(d) for d in operand.shape]
    if len(dims) == 0 or int(np.prod(dims[:-1], dtype=np.int64)) != 1 or (n is not None and dims[-1] != n):
        return f"{role} of shape {dims}: the device kernel {'adds' if role == 'bias' else 'takes'} one row of N"
    return None


class Binder(Protocol):
    """A family's build-time half: which C++ op struct serves it, and how a node's operands map onto roles.

    Two optional methods, for families whose kernel is generated per node rather than chosen by attributes
    (the elementwise family, bind_elementwise.py):

    * `glue(node, binding) -> (blocks, node_data)`: C++ text blocks for the generated glue (namespace scope,
      deduplicated by text across nodes) and the initializer of the node's `NodeSpec::node_data` (e.g.
      `&descriptor`); without it node_data is nullptr.
    * `problem(node) -> Problem | str`: the node's kernel Problem for its device instance (plugin.device), in place
      of kernels.select.node_problem, which reads the node's attributes only.

    And two for every family that needs them:

    * `operand_flags(node, binding, problem) -> dict | str`: the Problem flags the node's operands fix (a LayerNorm
      whose residual sum is read outside writes it, a GEMM with a bias input adds it, an attention node with a mask
      input reads it), so the instance's own argument checks and the node agree; or why the device kernel cannot
      take those operands. Without it the Problem keeps its flags.
    * `extent_dims(node, binding) -> ((input index, axis), ...)`: the dims whose product is the node's run-time
      extent (plugin.dispatch); without it, the leading dims of its first operand.
    """

    family: str         # the pattern family, e.g. "layernorm"
    header: str         # its glue header under plugins/families/, e.g. "layernorm/layernorm_op.h"
    cpp_struct: str     # the family struct in that header, e.g. "gtco::LayerNorm"

    def bind(self, node: FusedNode) -> Binding | str: ...
