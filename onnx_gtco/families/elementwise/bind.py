"""Binder of the Elementwise family (op types Elementwise_*) for plugins/families/elementwise/elementwise_op.h.

The node's function is a chain or tree of elementwise ops (onnx_gtco/families/elementwise/rule.py); its program
(families.elementwise.kernel.program_from_onnx) is built per node from the function body and the static shapes of the
node's inputs, or where they name symbolic dims its RuntimeProgram (runtime_program_from_onnx: one instance for every
size they take, each call's dims and strides from the tensors' shapes), so the kernel roles are the program's
operands: input role i -> the node input its i-th kernel input reads (a tensor a view op reshapes inside the group
is read twice, under two shapes), output role j -> node output j. Scalar constant inputs (initializers and Constant
outputs of one element) are folded into the program; larger constants are ordinary operands.

Unlike the other families the program is not a fixed kernel with attributes, so the glue carries per node what
`glue` writes from plugins/families/elementwise/elementwise.cu.j2: the program's host function (the CPU-EP kernel,
shared by the nodes of one program) and the node's `gtco::ElementwiseNode` (NodeSpec::node_data: the shapes and dtypes
of every node input and output as built, the element count, the host function; over symbolic dims their names, the
iteration dims, the collapsed runs and each kernel input's shape, from which the glue computes a call's dims and
strides).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from onnx_gtco.families.elementwise.kernel import (
    FAMILY,
    KINDS,
    MAX_IN,
    MAX_OUT,
    TEMPLATE,
    Program,
    RuntimeProgram,
    program_from_onnx,
    runtime_program_from_onnx,
)
from onnx_gtco.kernels.family import Problem
from onnx_gtco.kernels.render import macro
from onnx_gtco.kernels.select import kernel_dtype
from onnx_gtco.plugin.binding import Binding, FusedNode, Operand
from onnx_gtco.plugin.nodes import DTYPE_NAMES

DTYPES = ("f32", "f16", "bf16")
_ONNX_TYPES = {name: TensorProto.DataType.Name(t) for t, name in DTYPE_NAMES.items()}  # "f16" -> "FLOAT16"


def _static(info: Operand) -> tuple[int, ...] | None:
    if info.shape is None or not all(isinstance(d, int) for d in info.shape):
        return None
    return tuple(int(d) for d in info.shape)


def _known(info: Operand) -> tuple[int | str, ...] | None:
    """Its shape where every dim is a size or a named symbol ("?", an unnamed unknown dim, names none)."""
    if info.shape is None or any(d == "?" or not isinstance(d, int | str) for d in info.shape):
        return None
    return tuple(info.shape)


def node_program(node: FusedNode) -> Program | RuntimeProgram | str:
    """The program of an Elementwise node's function over its inputs' shapes, or why there is none: a Program for
    static shapes, a RuntimeProgram (one instance for every size) where they name symbolic dims."""
    if node.dtype not in DTYPES:
        return f"dtype {node.dtype}: the kernel takes {', '.join(DTYPES)}"
    fn = node.function
    if len(fn.input) != len(node.inputs) or len(fn.output) != len(node.outputs):
        return (f"the node has {len(node.inputs)} inputs and {len(node.outputs)} outputs, its function "
                f"{len(fn.input)} and {len(fn.output)}")
    inputs, constants = [], {}
    for formal, info in zip(fn.input, node.inputs, strict=True):
        if not info.name:
            return f"function input {formal!r} is not given (an absent optional input)"
        shape = _known(info)
        if shape is None:
            return (f"input {info.name!r} has shape {info.shape}: the elementwise kernel needs each dim static or "
                    "a named symbol (unknown rank or unnamed dims)")
        if not info.dtype:
            return f"input {info.name!r} has an unknown element type"
        if info.value is not None:
            constants[formal] = np.asarray(info.value)
            if constants[formal].size == 1:
                continue  # a scalar constant: program_from_onnx inlines its value, so no kernel operand reads it
        if info.dtype in DTYPES:
            if info.dtype != node.dtype:
                return (f"input {info.name!r} is {info.dtype}; the {node.node.op_type} kernel reads float inputs as "
                        f"{node.dtype}")
            kind = "float"
        elif info.dtype in KINDS:  # bool, i32, i64: read as such
            kind = info.dtype
        else:
            kind = ""  # read only by a view op as its shape / axes (a constant), or refused below when computed on
        inputs.append((formal, shape, kind))
    for info in node.outputs:
        if info.dtype != node.dtype:
            return f"output {info.name!r} is {info.dtype or 'of unknown type'}; the kernel writes {node.dtype}"
        if _known(info) is None:
            return (f"output {info.name!r} has shape {info.shape}: the elementwise kernel needs each dim static or "
                    "a named symbol")
    runtime = any(isinstance(d, str) for _, s, _ in inputs for d in s)
    try:
        program = (runtime_program_from_onnx(list(fn.node), inputs, list(fn.output), constants) if runtime
                   else program_from_onnx(list(fn.node), inputs, list(fn.output), constants))
    except ValueError as e:
        return str(e)
    except (IndexError, KeyError, TypeError) as e:  # a malformed body (an op without its operands, ...): a reason too
        return f"elementwise: the function body cannot be read as a program ({type(e).__name__}: {e})"
    for name, _, kind in program.inputs:
        if not kind:
            info = node.inputs[list(fn.input).index(name)]
            return f"input {info.name!r} is {info.dtype}: the kernel reads float, bool, int32 and int64 operands"
    if isinstance(program, RuntimeProgram):
        for info in node.outputs:
            shape = _known(info)
            assert shape is not None
            built = tuple(d if d >= 0 else program.symbols[-1 - d] for d in program.iteration)
            if _strip_ones(shape) != _strip_ones(built):
                return f"output {info.name!r} has shape {list(shape)}, not the iteration shape {list(built)}"
            if any(isinstance(d, str) and d not in program.symbols for d in shape):
                return f"output {info.name!r} has shape {list(shape)}: a symbol no input gives"
        return program
    n = math.prod(program.shape)
    for info in node.outputs:
        shape = _static(info)
        if shape is None:
            return f"output {info.name!r} has shape {info.shape}: symbolic where every input's shape is static"
        if math.prod(shape) != n:
            return f"output {info.name!r} has shape {list(shape)}, not the iteration shape {list(program.shape)}"
    return program


def _strip_ones(shape: tuple[int | str, ...]) -> tuple[int | str, ...]:
    return tuple(d for d in shape if d != 1)


def node_problem(node: FusedNode, program: Program | RuntimeProgram | None = None) -> Problem | str:
    """The kernel Problem of an Elementwise node: its program in the node's kernel dtype (its compute precision
    when that is fp16 / bf16, else its tensors' dtype: kernels.select.kernel_dtype), validated."""
    got = node_program(node) if program is None else program
    if isinstance(got, str):
        return got
    precision = node.attrs.get("precision", "fp32")
    precision = precision.decode() if isinstance(precision, bytes) else str(precision)
    dtype = kernel_dtype("elementwise", node.dtype, precision)
    problem = got.problem(dtype)
    # the smallest config: the program's own checks (rank, sizes, operands), not a launch shape
    why = FAMILY.check(problem, {"THREADS": 256, "VEC": 1}, "sm_80")
    return f"the elementwise kernel does not take this program: {why}" if why else problem


@dataclass(frozen=True)
class ElementwiseBinder:
    """Roles of an Elementwise_* node from its program; the per-node glue (descriptor and host function)."""

    family: str = "elementwise"
    header: str = "elementwise/elementwise_op.h"
    cpp_struct: str = "gtco::Elementwise"

    def bind(self, node: FusedNode) -> Binding | str:
        program = node_program(node)
        if isinstance(program, str):
            return program
        if len(program.inputs) > MAX_IN or len(program.outputs) > MAX_OUT:
            return (f"the program reads {len(program.inputs)} operands and writes {len(program.outputs)}; the kernel "
                    f"takes at most {MAX_IN} and {MAX_OUT}")
        problem = node_problem(node, program)
        if isinstance(problem, str):
            return problem
        formal = list(node.function.input)
        outs = list(node.function.output)
        return Binding(inputs=tuple(formal.index(name) for name, _, _ in program.inputs),
                       outputs=tuple(outs.index(name) for name, _ in program.outputs))

    def problem(self, node: FusedNode) -> Problem | str:
        """The device Problem of a bound node (plugin.device uses it in place of kernels.select.node_problem)."""
        return node_problem(node)

    def glue(self, node: FusedNode, binding: Binding) -> tuple[tuple[str, ...], str]:
        """C++ blocks for the generated glue (deduplicated by text: nodes of one program share its host function)
        and the NodeSpec::node_data initializer: the node's `gtco::ElementwiseNode`."""
        program = node_program(node)
        assert not isinstance(program, str), program
        # the host function computes in fp32 on the node's own storage type, whatever its precision attribute
        symbol, source = FAMILY.host_function(program.problem(node.dtype))
        shapes = [_known(i) for i in (*node.inputs, *node.outputs)]
        assert all(s is not None for s in shapes)  # bind refuses nodes with an unknown shape
        name = f"gtco_elementwise_node_{hashlib.sha1(node.node.name.encode()).hexdigest()[:12]}"
        runtime = program if isinstance(program, RuntimeProgram) else None
        code = {sym: -1 - k for k, sym in enumerate(runtime.symbols)} if runtime else {}  # as in program.iteration
        descriptor = macro(TEMPLATE, "node", name=name, node=node.node.name, run=symbol,
                           n=0 if runtime else math.prod(program.shape),
                           types=[_ONNX_TYPES.get(i.dtype, "UNDEFINED") for i in node.inputs],
                           ranks=[len(s) for s in shapes if s is not None],
                           dims=[code.get(d, d) for s in shapes if s is not None for d in s] or [0], runtime=runtime)
        return (source, descriptor), f"&{name}"


__all__ = ["ElementwiseBinder", "node_problem", "node_program"]


BINDERS = (ElementwiseBinder(),)
