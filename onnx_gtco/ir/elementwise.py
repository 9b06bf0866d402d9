"""An elementwise group of ONNX nodes as a program: what onnx_gtco.families.elementwise.kernel generates a kernel for,
and what the elementwise pattern asks of a group before it proposes it (whether its layout ops fold into loads and
stores). The encoding of a program is described in onnx_gtco/families/elementwise/kernel.py."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# op -> number of operands (None: two or more)
ARITY = {"Add": 2, "Sub": 2, "Mul": 2, "Div": 2, "Pow": 2, "Sqrt": 1, "Reciprocal": 1, "Neg": 1, "Abs": 1,
         "Exp": 1, "Log": 1, "Tanh": 1, "Erf": 1, "Sigmoid": 1, "Relu": 1, "LeakyRelu": 1, "Gelu": 1, "Max": 2,
         "Min": 2, "Where": 3, "Cast": 1, "Identity": 1, "PRelu": 2, "Elu": 1, "Softplus": 1, "Softsign": 1,
         "HardSigmoid": 1, "HardSwish": 1, "Floor": 1, "Ceil": 1, "Round": 1, "Sign": 1, "Sin": 1, "Cos": 1,
         "Equal": 2, "Less": 2, "LessOrEqual": 2, "Greater": 2, "GreaterOrEqual": 2, "Not": 1, "And": 2, "Or": 2,
         "Xor": 2, "IsNaN": 1}
# boolean values (comparisons, Not/And/Or/Xor, Cast to bool, bool inputs) are 1.0f / 0.0f in the fp32 program
CAST_TARGETS = ("f16", "bf16", "f32", "f64", "bool")
Ref = tuple[str, Any]
Instr = tuple[str, tuple[Ref, ...], Any]
# (source shape, element strides over the view, base[, terms]); a term (n, r, q, m, stride, weights over the view dims)
# adds ((sum_d i_d * weights_d + r) % n // q % m) * stride to the offset (onnx_gtco/families/elementwise/kernel.py)
Layout = tuple[Any, ...]
Term = tuple[int, int, int, int, int, tuple[int, ...]]


@dataclass(frozen=True)
class ProgramSpec:
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[tuple[str, Ref], ...]
    layouts: tuple[Layout | None, ...] = ()
    out_strides: tuple[tuple[int, ...] | None, ...] = ()  # per output: store strides over the iteration shape

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.broadcast_shapes(*(s for _, s, _ in self.inputs))) if self.inputs else ()


def canonical_layout(lay: Sequence[Any]) -> Layout:
    head = (tuple(int(d) for d in lay[0]), tuple(int(d) for d in lay[1]), int(lay[2]))
    terms = tuple((*(int(v) for v in t[:5]), tuple(int(w) for w in t[5])) for t in (lay[3] if len(lay) > 3 else ()))
    return (*head, terms) if terms else head


def layout_rolls(lay: Layout | None) -> tuple[Term, ...]:
    """The terms of a layout (none for None or a plain strided view)."""
    return tuple(lay[3]) if lay is not None and len(lay) > 3 else ()


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major tensor of `shape`."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return tuple(out[::-1])


# ---------------------------------------------------------------------------------------------------------------
# ONNX -> Program
# ---------------------------------------------------------------------------------------------------------------

_VIEW_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten")
LAYOUT_OPS = ("Transpose", "Slice", "Pad", "Concat")  # index maps of a group input, folded into its load (Layout)


def _onnx_cast_target(to: int) -> str:
    from onnx import TensorProto

    names = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16",
             TensorProto.DOUBLE: "f64", TensorProto.BOOL: "bool"}
    if to not in names:
        raise ValueError(f"elementwise: Cast to {TensorProto.DataType.Name(to)} is not supported (float and bool "
                         "targets only)")
    return names[to]


def _widens_input(node: Any, attr: Callable[..., Any], env: Mapping[str, tuple[Ref, tuple[int, ...]]],
                  flat: Mapping[str, tuple[int, ...]], prog_inputs: Sequence[tuple[str, tuple[int, ...], str]]) -> bool:
    """Whether a Cast converts a float group input (or a view of one) to f32."""
    src = node.input[0] if node.input else ""
    if _onnx_cast_target(int(attr(node, "to"))) != "f32" or src not in env or src in flat:
        return False
    ref = env[src][0]
    return ref[0] == "x" and prog_inputs[ref[1]][2] == "float"


def _moved_to_output(node: Any, attr: Callable[..., Any], env: Mapping[str, tuple[Ref, tuple[int, ...]]],
                     transposed: Mapping[str, Any], flat: Mapping[str, Any], outputs: Sequence[str],
                     nodes: Sequence[Any],
                     prog_inputs: Sequence[tuple[str, tuple[int, ...], str]]) -> bool:
    """Whether a Cast to a float type only writes a group output that is a float input's view, a Transpose of one or
    a free reshape of a computed value (no node of the group reads it, so only the store sees its rounding)."""
    src, dst = (node.input[0] if node.input else ""), node.output[0]
    if _onnx_cast_target(int(attr(node, "to"))) not in ("f32", "f16", "bf16") or dst not in outputs:
        return False
    if any(dst in n.input for n in nodes) or src not in env:
        return False
    ref = env[src][0]
    return src in transposed or src in flat or (ref[0] == "x" and prog_inputs[ref[1]][2] == "float")


def _kind_of_elem_type(t: int) -> str:
    from onnx import TensorProto

    if t == TensorProto.BOOL:
        return "bool"
    if t == TensorProto.INT32:
        return "i32"
    if t == TensorProto.INT64:
        return "i64"
    if t in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE, 0):
        return "float"
    raise ValueError(f"elementwise: input element type {TensorProto.DataType.Name(t)} is not supported")


def _as_input(item: Any) -> tuple[str, tuple[int, ...], str]:
    from onnx import ValueInfoProto

    if isinstance(item, ValueInfoProto):
        tt = item.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if any(d is None for d in dims):
            raise ValueError(f"elementwise: input {item.name!r} has a symbolic shape {dims}: static shapes only")
        return item.name, tuple(int(d) for d in dims), _kind_of_elem_type(tt.elem_type)
    if isinstance(item, str):
        raise ValueError(f"elementwise: input {item!r} needs a shape: pass (name, shape) or a ValueInfoProto")
    name, shape, *kind = item
    return str(name), tuple(int(d) for d in shape), (kind[0] if kind else "float")


def _const_array(value: Any) -> np.ndarray:
    from onnx import TensorProto, numpy_helper

    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def program_from_onnx(nodes: Sequence[Any], inputs: Sequence[Any] | Mapping[str, Sequence[int]],
                      outputs: Sequence[str], constants: Mapping[str, Any] | None = None) -> ProgramSpec:
    """The Program of an elementwise group.

    Args:
        nodes: the group's onnx NodeProto, in any order. Constant nodes among them give scalar constants.
        inputs: the group's tensor inputs: ValueInfoProto, (name, shape) or (name, shape, kind) with kind
            "float" / "bool" / "i32" / "i64", or a mapping name -> shape (float inputs).
        outputs: names of the tensors the kernel writes (each of the group's iteration shape).
        constants: initializers the group reads, name -> array or TensorProto; scalars (one element) are folded
            into the program; larger constants must be passed as inputs instead.

    Raises:
        ValueError: an op that is not supported (named), a non-scalar constant, a value of unknown shape, a view
            op on a computed value, or an output that does not have the iteration shape.
    """
    if isinstance(inputs, Mapping):
        items = [(k, tuple(v), "float") for k, v in inputs.items()]
    else:
        items = [_as_input(i) for i in inputs]
    builder = _ProgramBuilder(items, constants or {}, nodes, outputs)
    for node in _topological(nodes):
        builder.add(node)
    return builder.finish()


def _attr(node: Any, key: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == key:
            return helper.get_attribute_value(a)
    return default


def _topological(nodes: Sequence[Any]) -> list[Any]:
    """The nodes in a topological order over the group's own edges."""
    pending = list(nodes)
    produced = {o for n in pending for o in n.output}
    ordered: list[Any] = []
    while pending:
        ready = [n for n in pending if all(i not in produced or any(i in m.output for m in ordered)
                                           for i in n.input if i)]
        if not ready:
            raise ValueError("elementwise: the nodes form a cycle")
        ordered += ready
        pending = [n for n in pending if n not in ready]
    return ordered


class _ProgramBuilder:
    """The state of program_from_onnx while it reads a group's nodes in order: the program's inputs (a group input
    read through a view is one more program input with its layout), each tensor's value, and the instructions."""

    def __init__(self, items: Sequence[tuple[str, tuple[int, ...], str]], constants: Mapping[str, Any],
                 nodes: Sequence[Any], outputs: Sequence[str]) -> None:
        self.nodes, self.outputs = nodes, outputs
        self.consts: dict[str, float] = {}
        for k, v in constants.items():
            arr = _const_array(v)
            if arr.size == 1:
                self.consts[k] = float(arr.reshape(()))
        self.prog_inputs: list[tuple[str, tuple[int, ...], str]] = []
        self.layouts: list[Layout | None] = []
        self.env: dict[str, tuple[Ref, tuple[int, ...]]] = {}  # tensor -> (ref, shape)
        # a computed value reshaped freely -> its shape before: an output only
        self.flat: dict[str, tuple[int, ...]] = {}
        self.transposed: dict[str, tuple[str, list[int]]] = {}  # a Transpose of an input's view -> (that view, perm)
        for name, shape, kind in items:
            self.env[name] = (("x", len(self.prog_inputs)), shape)
            self.prog_inputs.append((name, shape, kind))
            self.layouts.append(None)
        # every constant array by name (initializers and the group's Constant nodes): view ops read their shape or
        # axes from here; a non-scalar one read by a computing op must be passed as an input instead
        self.arrays = {k: _const_array(v) for k, v in constants.items()}
        self.big_consts = {k for k, v in self.arrays.items() if v.size != 1}
        self.instrs: list[Instr] = []

    def get(self, tensor: str, node: Any) -> tuple[Ref, tuple[int, ...]]:
        if tensor in self.flat and node.op_type not in _VIEW_OPS:
            raise ValueError(f"elementwise: {node.op_type} {node.name!r} reads {tensor!r}, a computed value reshaped "
                             f"{self.flat[tensor]} -> {self.env[tensor][1]}, which moves its broadcast axes: a "
                             "computed value may only gain or lose leading 1s before another op reads it (reshape "
                             "the group's inputs instead)")
        if tensor in self.env:
            return self.env[tensor]
        if tensor in self.consts:
            return ("c", self.consts[tensor]), ()
        if tensor in self.big_consts:
            raise ValueError(f"elementwise: constant {tensor!r} read by {node.op_type} {node.name!r} is not a "
                             "scalar: pass it as an input")
        raise ValueError(f"elementwise: {node.op_type} {node.name!r} reads {tensor!r}, which is neither an input, "
                         "a constant nor computed in the group")

    def operands(self, node: Any) -> tuple[list[tuple[Ref, tuple[int, ...]]], tuple[int, ...] | None]:
        """The operands of a computing node, and the shape before the reshape where it reads freely reshaped values
        (all from one shape, at the node's full shape): then the iteration runs in that shape, and the node's other
        operands, group inputs or scalars, are read through the same reshape as views (None: no such operand)."""
        env, flat = self.env, self.flat
        names = [t for t in node.input if t]
        before = {flat[t] for t in names if t in flat}
        if not before:
            return [self.get(t, node) for t in names], None
        full = _broadcast([env[t][1] if t in env else () for t in names], node)
        if len(before) > 1 or any(env[t][1] != full for t in names if t in flat):
            raise ValueError(f"elementwise: {node.op_type} {node.name!r} reads values reshaped from different shapes "
                             f"{sorted(before)} or broadcast after the reshape")
        pre = before.pop()
        args = []
        for t in names:
            if t in flat:
                args.append((env[t][0], pre))
                continue
            ref, shape = self.get(t, node)
            if ref[0] == "c" or all(d == 1 for d in shape):
                args.append((ref, ()))
                continue
            if ref[0] != "x":
                raise ValueError(f"elementwise: {node.op_type} {node.name!r} reads the computed value {t!r} {shape} "
                                 f"with values reshaped {pre} -> {full}: only group inputs are read through the "
                                 "reshape")
            name, _, kind = self.prog_inputs[ref[1]]
            src, strides, base, rolls = self.view_of_input(ref[1], shape)
            moved = _reshape_view(full, _widen(shape, full, strides),
                                  [(*t[:5], _widen(shape, full, t[5])) for t in rolls], pre)
            if moved is None:
                raise ValueError(f"elementwise: {node.op_type} {node.name!r}: {t!r} {shape} cannot be read through "
                                 f"the reshape {full} -> {pre} as a view")
            args.append((("x", len(self.prog_inputs)), pre))
            self.prog_inputs.append((name, pre, kind))
            self.layouts.append(canonical_layout((src, moved[0], base, moved[1])))
        return args, pre

    def view_of_input(self, i: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], list[int], int, list[Any]]:
        """(source shape, strides, base, rolls) of program input i of `shape`."""
        lay = self.layouts[i]
        if lay is None:
            return shape, list(contiguous_strides(shape)), 0, []
        return tuple(lay[0]), list(lay[1]), int(lay[2]), list(layout_rolls(lay))

    def add_view(self, node: Any, i: int, shape: tuple[int, ...], strides: Sequence[int], base: int,
                 rolls: Sequence[Any]) -> None:
        name, _, kind = self.prog_inputs[i]
        self.env[node.output[0]] = (("x", len(self.prog_inputs)), shape)
        self.prog_inputs.append((name, shape, kind))
        self.layouts.append(_layout_or_none(self.view_of_input(i, self.prog_inputs[i][1])[0], shape, strides, base,
                                            rolls))

    def emit(self, op: str, refs: list[Ref], a: Any = None) -> Ref:
        self.instrs.append((op, tuple(refs), a))
        return ("t", len(self.instrs) - 1)

    def add(self, node: Any) -> None:
        """Read one node (its inputs already read)."""
        op = node.op_type
        if node.domain not in ("", "ai.onnx") and not (node.domain == "com.microsoft" and op == "Gelu"):
            raise ValueError(f"elementwise: unsupported op {node.domain}.{op} (node {node.name!r})")
        if op == "Constant":
            self.add_constant(node)
        elif op == "Cast" and _widens_input(node, _attr, self.env, self.flat, self.prog_inputs):
            # a float input widened to f32 (a half group's boundary Cast): the program computes in f32, so this is
            # what loading the input does already; the Cast's readers read the input, and layout ops after it fold
            # into that input's load like any other
            self.env[node.output[0]] = self.env[node.input[0]]
        elif op == "Cast" and _moved_to_output(node, _attr, self.env, self.transposed, self.flat, self.outputs,
                                               self.nodes, self.prog_inputs):
            # a moved float input narrowed where the group writes it (a half group's boundary Cast): the store
            # rounds to the output's type as the Cast does, and a transposed store stays one
            self.env[node.output[0]] = self.env[node.input[0]]
            if node.input[0] in self.transposed:
                self.transposed[node.output[0]] = self.transposed[node.input[0]]
            if node.input[0] in self.flat:
                self.flat[node.output[0]] = self.flat[node.input[0]]
        elif op in LAYOUT_OPS:
            self.add_layout(node)
        elif op in _VIEW_OPS:
            self.add_reshape(node)
        else:
            self.add_compute(node)

    def add_constant(self, node: Any) -> None:
        values = [_attr(node, k) for k in ("value", "value_float", "value_floats", "value_int", "value_ints")]
        if all(v is None for v in values):
            raise ValueError(f"elementwise: Constant {node.name!r} has no numeric value attribute")
        arr = _const_array(next(v for v in values if v is not None))
        self.arrays[node.output[0]] = arr
        if arr.size != 1:
            self.big_consts.add(node.output[0])  # a shape or axes operand, unless a computing op reads it
        else:
            self.consts[node.output[0]] = float(arr.reshape(()))

    def add_layout(self, node: Any) -> None:
        """A layout op (Transpose, Slice, Pad, a torch.roll's Concat): folded into the load of a group input."""
        op, where = node.op_type, f"{node.op_type} {node.name!r}"
        ins = [self.get(t, node) for t in (node.input if op == "Concat" else node.input[:1])]
        if any(ref[0] != "x" for ref, _ in ins):
            raise ValueError(f"elementwise: {where} moves the elements of a computed value or a constant: a "
                             "layout op is folded only into the load of a group input")
        if op == "Concat":
            views = [(shape, *self.view_of_input(ref[1], shape)[1:]) for ref, shape in ins]
            names = {self.prog_inputs[ref[1]][0] for ref, _ in ins}
            rolled = _concat_roll(node, views, int(_attr(node, "axis", 0))) if len(names) == 1 else None
            if rolled is None:
                raise ValueError(f"elementwise: {where}: only the Concat of a torch.roll (the two slices of one "
                                 "tensor, swapped) is folded")
            self.add_view(node, ins[0][0][1], *rolled)
            return
        (ref, shape), = ins
        _, strides, base, rolls = self.view_of_input(ref[1], shape)
        self.add_view(node, ref[1], *_layout_view(node, shape, strides, base, rolls, self.consts, _attr,
                                                  self.arrays))
        if op == "Transpose":
            self.transposed[node.output[0]] = (node.input[0], [int(p) % len(shape) for p in (
                _attr(node, "perm") or list(range(len(shape)))[::-1])])

    def add_reshape(self, node: Any) -> None:
        """A view op (Reshape, Unsqueeze, Squeeze, Flatten)."""
        tensor = node.input[0]
        ref, shape = self.get(tensor, node)
        new = _view_shape(node, shape, self.consts, _attr, self.arrays)
        moved = None
        if ref[0] == "x" and tensor not in self.flat:
            _, strides, base, rolls = self.view_of_input(ref[1], shape)
            moved = _reshape_view(shape, strides, rolls, new)
        if ref[0] == "c":
            self.env[node.output[0]] = (ref, ())
        elif moved is not None:
            self.add_view(node, ref[1], new, moved[0], base, moved[1])
        elif ref[0] == "t" and _strip_leading_ones(new) == _strip_leading_ones(shape) and tensor not in self.flat:
            self.env[node.output[0]] = (ref, new)  # only adds or drops leading 1s: the broadcast is unchanged
        else:
            # a reshape that is no view (of a computed value, or merging dims a view walks apart): the kernel
            # writes the value densely in its own shape's order, which is this reshape's as well, so it is free
            # as long as only outputs read it
            self.env[node.output[0]] = (ref, new)
            self.flat[node.output[0]] = self.flat.get(tensor, shape)

    def add_compute(self, node: Any) -> None:
        """A computing op: its instructions."""
        op = node.op_type
        if op not in ARITY and op not in ("Sum", "Mean", "Clip"):
            raise ValueError(f"elementwise: unsupported op {op!r} (node {node.name!r}); supported: "
                             f"{', '.join(sorted([*ARITY, 'Sum', 'Mean', 'Clip', *_VIEW_OPS, *LAYOUT_OPS]))}")
        args, pre = self.operands(node)
        refs = [r for r, _ in args]
        shape = _broadcast([s for _, s in args], node)
        if not refs:
            raise ValueError(f"elementwise: {op} {node.name!r} has no operand")
        out = self.compute(node, refs)
        if pre is None:
            self.env[node.output[0]] = (out, shape)
        else:  # computed in the shape before the reshape: the node's own shape is a free reshape of it
            self.env[node.output[0]] = (out, _broadcast([self.env[t][1] if t in self.env else ()
                                                         for t in node.input if t], node))
            self.flat[node.output[0]] = shape

    def compute(self, node: Any, refs: list[Ref]) -> Ref:
        op, emit = node.op_type, self.emit
        if op in ("Max", "Min", "Sum", "Mean"):
            out = refs[0]
            for r in refs[1:]:
                out = emit(op if op in ("Max", "Min") else "Add", [out, r])
            if op == "Mean" and len(refs) > 1:
                out = emit("Div", [out, ("c", float(len(refs)))])
            elif len(refs) == 1:
                out = emit("Identity", [out])
            return out
        if op == "Clip":
            # opset 11+: optional min / max inputs (an empty name skips one); before: min / max attributes
            out = self.get(node.input[0], node)[0]
            bounds = []
            for pos, key, default in ((1, "min", None), (2, "max", None)):
                if len(node.input) > pos and node.input[pos]:
                    bounds.append((key, self.get(node.input[pos], node)[0]))
                elif _attr(node, key, default) is not None:
                    bounds.append((key, ("c", float(_attr(node, key)))))
            for key, r in bounds:
                out = emit("Max" if key == "min" else "Min", [out, r])
            return out if bounds else emit("Identity", [out])
        if op in ("Elu", "LeakyRelu"):
            return emit(op, refs, float(_attr(node, "alpha", 1.0 if op == "Elu" else 0.01)))
        if op == "HardSigmoid":
            return emit(op, refs, (float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))))
        if op == "Pow":
            return emit("Pow", refs)
        if op == "Gelu":
            approx = _attr(node, "approximate", b"none")
            return emit(op, refs, approx.decode() if isinstance(approx, bytes) else str(approx))
        if op == "Cast":
            return emit(op, refs, _onnx_cast_target(int(_attr(node, "to"))))
        if len(refs) != ARITY[op]:
            raise ValueError(f"elementwise: {op} {node.name!r} has {len(refs)} operands, {ARITY[op]} supported")
        return emit(op, refs)

    def finish(self) -> ProgramSpec:
        env, flat, prog_inputs, outputs = self.env, self.flat, self.prog_inputs, self.outputs
        for name in outputs:
            if name not in env:
                raise ValueError(f"elementwise: output {name!r} is not computed by the group")
        stores = _transposed_stores(outputs, env, flat, self.transposed)
        for name, (src, _) in stores.items():
            env[name] = env[src]  # stored transposed: the program computes the value before the Transpose
        # drop inputs only a view op read (their reshaped alias is what the program uses); the iteration shape is
        # the broadcast of the inputs the program reads
        used = {r[1] for _, refs, _ in self.instrs for r in refs if r[0] == "x"} | {
            env[name][0][1] for name in outputs if env[name][0][0] == "x"}
        keep = sorted(used)
        if not keep:
            raise ValueError("elementwise: the group reads no tensor input (only constants)")
        shape = tuple(np.broadcast_shapes(*(prog_inputs[i][1] for i in keep)))
        outs = []
        for name in outputs:
            ref, s = env[name]
            s = flat.get(name, s)
            if ref[0] == "c":
                raise ValueError(f"elementwise: output {name!r} is a constant")
            if tuple(np.broadcast_shapes(s, shape)) != shape or int(np.prod(s)) != int(np.prod(shape)):
                raise ValueError(f"elementwise: output {name!r} has shape {s}, not the iteration shape {shape}")
            if name in stores and tuple(s) != shape:
                raise ValueError(f"elementwise: output {name!r} is stored transposed from {s}, not the iteration "
                                 f"shape {shape}")
            outs.append((name, ref))
        out_strides = [None if name not in stores else _store_strides(shape, stores[name][1]) for name in outputs]
        remap = {old: new for new, old in enumerate(keep)}

        def fix(r: Ref) -> Ref:
            return ("x", remap[r[1]]) if r[0] == "x" else r

        kept_layouts = tuple(self.layouts[i] for i in keep)
        return ProgramSpec(tuple(prog_inputs[i] for i in keep),
                           tuple((op, tuple(fix(r) for r in refs), a) for op, refs, a in self.instrs),
                           tuple((n, fix(r)) for n, r in outs),
                           kept_layouts if any(lay is not None for lay in kept_layouts) else (),
                           tuple(out_strides) if any(st is not None for st in out_strides) else ())


def _store_strides(shape: Sequence[int], perm: Sequence[int]) -> tuple[int, ...]:
    """Store strides over the iteration shape of an output stored transposed: output index j_k = iteration index
    i_perm[k]."""
    dense = contiguous_strides([shape[p] for p in perm])
    st = [0] * len(shape)
    for k, p in enumerate(perm):
        st[p] = dense[k]
    return tuple(st)


def _transposed_stores(outputs: Sequence[str], env: Mapping[str, Any], flat: Mapping[str, Any],
                       transposed: Mapping[str, tuple[str, list[int]]]) -> dict[str, tuple[str, list[int]]]:
    """Outputs a Transpose of a group input's view makes of another shape than the group's other outputs: stored
    transposed from the view before it (Swin's k^T beside q and v), name -> (that view, perm)."""
    def shape_of(name: str) -> tuple[int, ...]:
        return tuple(flat.get(name, env[name][1]))

    stores = {}
    for name in outputs:
        others = {shape_of(o) for o in outputs if o != name}
        if name in transposed and shape_of(name) not in others:
            src, perm = transposed[name]
            if src in env and env[src][0][0] == "x" and shape_of(src) in others:
                stores[name] = (src, perm)
    return stores


def _broadcast(shapes: Sequence[Sequence[int]], node: Any) -> tuple[int, ...]:
    """The numpy broadcast of the operand shapes of `node`, or a ValueError naming the node."""
    try:
        return tuple(np.broadcast_shapes(*(tuple(s) for s in shapes)))
    except ValueError:
        raise ValueError(f"elementwise: {node.op_type} {node.name!r}: operand shapes {[tuple(s) for s in shapes]} "
                         "do not broadcast") from None


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a view of `shape` with element `strides` is the dense row-major layout (dims of 1 take any stride)."""
    return all(st == want for d, st, want in zip(shape, strides, contiguous_strides(shape), strict=True) if d != 1)


def _layout_or_none(src: tuple[int, ...], shape: tuple[int, ...], strides: Sequence[int], base: int,
                    rolls: Sequence[Any] = ()) -> Layout | None:
    """The Layout of a view, or None where it is its whole source read densely (a plain reshape of it)."""
    if not rolls and base == 0 and math.prod(shape) == math.prod(src) and _dense(shape, strides):
        return None
    return canonical_layout((src, strides, base, rolls))


def _reshape_view(old: Sequence[int], strides: Sequence[int], rolls: Sequence[Any], new: Sequence[int]
                  ) -> tuple[list[int], list[Any]] | None:
    """(strides, rolls) of `new` over a view of `old`, or None when the reshape is no view: the strides and every
    roll's weights must each stay a view (reshape_strides)."""
    moved = reshape_strides(old, strides, new)
    out = []
    for t in rolls:
        w = reshape_strides(old, t[5], new)
        if w is None:
            return None
        out.append((*t[:5], tuple(w)))
    if moved is None:  # dims merged whose strides do not merge: each becomes a term of the merged dim
        merged = _merge_terms(old, strides, new)
        if merged is None:
            return None
        moved, extra = merged
        out += extra
    return moved, out


def _merge_terms(old: Sequence[int], strides: Sequence[int], new: Sequence[int]
                 ) -> tuple[list[int], list[Term]] | None:
    """(strides, terms) of `new` over a view of `old` where the reshape merges dims whose strides do not merge: such
    a merged dim has stride 0 and one term per old dim, (index // q % m) * stride (index: along the merged dim, q: the
    extent of the old dims after it in the merge, m: its own). None where a reshape splits and merges at once."""
    od = [int(d) for d in old]
    nd = [int(d) for d in new]
    ns, terms = [0] * len(nd), []
    oi = ni = 0
    while ni < len(nd) or oi < len(od):
        if ni < len(nd) and nd[ni] == 1:
            ni += 1
            continue
        if oi < len(od) and od[oi] == 1:
            oi += 1
            continue
        if ni >= len(nd) or oi >= len(od):
            return None
        oj, size = oi + 1, od[oi]
        while size < nd[ni] and oj < len(od):
            size *= od[oj]
            oj += 1
        if size != nd[ni]:
            return None  # a split: the stride path handles those, a mix of both is no view
        group = [k for k in range(oi, oj) if od[k] != 1]
        if len(group) == 1 or all(strides[a] == od[b] * strides[b] for a, b in itertools.pairwise(group)):
            ns[ni] = int(strides[group[-1]])
        else:
            weights = tuple(1 if j == ni else 0 for j in range(len(nd)))
            after = 1
            for k in reversed(group):
                terms.append((nd[ni], 0, after, od[k], int(strides[k]), weights))
                after *= od[k]
        oi, ni = oj, ni + 1
    return ns, terms


def _widen(shape: Sequence[int], full: Sequence[int], vec: Sequence[int]) -> list[int]:
    """Per-dim values (strides, roll weights) of a view of `shape` broadcast to `full`: 0 where it broadcasts."""
    pad = len(full) - len(shape)
    return [0] * pad + [v if d == big else 0 for d, big, v in zip(shape, full[pad:], vec, strict=True)]


def _concat_roll(node: Any, views: Sequence[Any], axis: int
                 ) -> tuple[tuple[int, ...], list[int], int, list[Any]] | None:
    """(shape, strides, base, rolls) of Concat([v[k:n], v[0:k]]) along `axis` for two views of one tensor that are
    that: torch.roll of v by n - k, i.e. element i of the result is v[(i + k) % n]. None for any other Concat."""
    if len(views) != 2:
        return None
    (sa, ta, ba, ra), (sb, tb, bb, rb) = views
    r = len(sa)
    axis %= max(r, 1)
    if len(sb) != r or any(sa[d] != sb[d] for d in range(r) if d != axis) or list(ta) != list(tb):
        return None
    # B = V[0:k] and A = V[k:n] for the view V that is B grown to n along the axis
    k, n = sb[axis], sa[axis] + sb[axis]
    shifted = [(*t[:1], (t[1] + k * t[5][axis]) % t[0], *t[2:]) for t in rb]
    if ba != bb + k * ta[axis] or [tuple(t) for t in shifted] != [tuple(t) for t in ra]:
        return None
    terms = []
    for t, moved in zip(rb, shifted, strict=True):  # a term of the axis alone, whose period is the axis, rolls
        if t[5][axis] == 0:
            terms.append(tuple(t))
        elif any(w for d, w in enumerate(t[5]) if d != axis) or t[0] != n * t[5][axis]:
            return None
        else:
            terms.append(tuple(moved))
    weights = tuple(1 if d == axis else 0 for d in range(r))
    if ta[axis]:
        terms.append((n, k, 1, n, int(ta[axis]), weights))
    shape = tuple(n if d == axis else sa[d] for d in range(r))
    return shape, [0 if d == axis else int(ta[d]) for d in range(r)], int(bb), terms


def reshape_strides(old: Sequence[int], strides: Sequence[int], new: Sequence[int]) -> list[int] | None:
    """Element strides of `new` over a view of `old` with `strides`, or None when the reshape is no view (it merges
    dims that are not contiguous): numpy's no-copy reshape rule, dims of 1 dropped first."""
    kept = [(int(d), int(st)) for d, st in zip(old, strides, strict=True) if d != 1]
    od, os_ = [d for d, _ in kept], [st for _, st in kept]
    nd, ns = [int(d) for d in new], [0] * len(new)
    oi = ni = 0
    while ni < len(nd) and oi < len(od):
        np_, op_, nj, oj = nd[ni], od[oi], ni + 1, oi + 1
        while np_ != op_:
            if np_ < op_:
                np_ *= nd[nj]
                nj += 1
            else:
                op_ *= od[oj]
                oj += 1
        if any(os_[k] != od[k + 1] * os_[k + 1] for k in range(oi, oj - 1)):
            return None
        ns[nj - 1] = os_[oj - 1]
        for k in range(nj - 1, ni, -1):
            ns[k - 1] = ns[k] * nd[k]
        ni, oi = nj, oj
    return ns


def _layout_view(node: Any, shape: tuple[int, ...], strides: Sequence[int], base: int, rolls: Sequence[Any],
                 consts: Mapping[str, float], attr: Any, arrays: Mapping[str, Any]
                 ) -> tuple[tuple[int, ...], list[int], int, list[Any]]:
    """(shape, strides, base, rolls) of a Transpose / Slice / Pad of a view of (`shape`, `strides`, `base`,
    `rolls`)."""
    where = f"{node.op_type} {node.name!r}"
    r = len(shape)
    if node.op_type == "Transpose":
        perm = attr(node, "perm") or list(range(r))[::-1]
        if sorted(int(p) % max(r, 1) for p in perm) != list(range(r)):
            raise ValueError(f"elementwise: {where}: perm {list(perm)} is no permutation of {r} dims")
        perm = [int(p) % r for p in perm]
        return (tuple(shape[p] for p in perm), [int(strides[p]) for p in perm], base,
                [(*t[:5], tuple(t[5][p] for p in perm)) for t in rolls])
    if node.op_type == "Pad":
        mode = attr(node, "mode", b"constant")
        pads = attr(node, "pads") or _const_ints(node, 1, consts, arrays) or []
        if (mode.decode() if isinstance(mode, bytes) else str(mode)) != "constant" or any(int(p) for p in pads):
            raise ValueError(f"elementwise: {where} pads {list(pads)}: only a Pad of zeros (a copy) is folded")
        return shape, list(strides), base, list(rolls)
    # Slice: starts, ends[, axes[, steps]] as inputs (opset 10+) or attributes (opset 1-9)
    starts = attr(node, "starts") or _const_ints(node, 1, consts, arrays)
    ends = attr(node, "ends") or _const_ints(node, 2, consts, arrays)
    axes = attr(node, "axes") or _const_ints(node, 3, consts, arrays) or list(range(len(starts or ())))
    steps = _const_ints(node, 4, consts, arrays) or [1] * len(axes)
    if starts is None or ends is None or not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(f"elementwise: {where}: starts, ends, axes and steps are not constants of one length")
    out, st = list(shape), [int(s) for s in strides]
    rolled = [[*t[:5], list(t[5])] for t in rolls]
    for a, b, e, step in zip(axes, starts, ends, steps, strict=True):
        a = int(a) % r
        if step <= 0:
            raise ValueError(f"elementwise: {where}: step {step} on axis {a}: only positive steps are folded")
        lo, hi, step = slice(int(b), int(e), int(step)).indices(shape[a])
        out[a] = len(range(lo, hi, step))
        if out[a] == 0:
            raise ValueError(f"elementwise: {where} selects nothing on axis {a}")
        base += lo * st[a]
        st[a] *= step
        for term in rolled:  # the term's index gains lo steps of this dim; a step of the slice is `step` of them
            term[1] = (term[1] + lo * term[5][a]) % term[0]
            term[5][a] *= step
    return tuple(out), st, base, [(*t[:5], tuple(t[5])) for t in rolled]


def _const_ints(node: Any, i: int, consts: Mapping[str, float], arrays: Mapping[str, Any]) -> list[int] | None:
    """Input i of `node` as a list of ints (None where the node has no such input), from the group's constants."""
    if len(node.input) <= i or not node.input[i]:
        return None
    t = node.input[i]
    if t in arrays:
        return [int(v) for v in _const_array(arrays[t]).reshape(-1)]
    if t in consts:
        return [int(consts[t])]
    raise ValueError(f"elementwise: {node.op_type} {node.name!r}: its input {i} ({t!r}) is not a constant")


def _strip_leading_ones(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _view_shape(node: Any, shape: tuple[int, ...], consts: Mapping[str, float], attr: Any,
                constants: Mapping[str, Any] | None) -> tuple[int, ...]:
    """Output shape of a Reshape / Unsqueeze / Squeeze / Flatten of a value of `shape`."""
    def const_ints(i: int) -> list[int] | None:
        return _const_ints(node, i, consts, constants or {})

    r = len(shape)
    if node.op_type == "Unsqueeze":
        axes = attr(node, "axes") or const_ints(1) or []
        out_r = r + len(axes)
        axes = sorted(a % out_r for a in axes)
        out, it = [], iter(shape)
        for d in range(out_r):
            out.append(1 if d in axes else next(it))
        return tuple(out)
    if node.op_type == "Squeeze":
        axes = attr(node, "axes") or const_ints(1)
        axes = {a % r for a in axes} if axes else {d for d in range(r) if shape[d] == 1}
        return tuple(d for i, d in enumerate(shape) if i not in axes)
    if node.op_type == "Flatten":
        ax = int(attr(node, "axis", 1)) % (r + 1) if r else 0
        return (int(np.prod(shape[:ax])), int(np.prod(shape[ax:])))
    target = const_ints(1) or []
    out = [shape[i] if d == 0 and not attr(node, "allowzero", 0) else d for i, d in enumerate(target)]
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1]))
        out[out.index(-1)] = int(np.prod(shape)) // max(known, 1)
    if int(np.prod(out)) != int(np.prod(shape)):
        raise ValueError(f"elementwise: Reshape {node.name!r} of {shape} to {target} changes the element count")
    return tuple(out)


PLACEHOLDER = 1_000_003
"""While the program of a group over symbolic dims is built, symbol k stands as the size PLACEHOLDER + 2k: larger than
any static dim it accepts, so each dim of the result reads back as one symbol or a static size."""


@dataclass(frozen=True)
class RuntimeSpec:
    """The program of a group whose shapes have symbolic dims (batch, sequence), for a kernel that takes their sizes
    at run time (onnx_gtco.families.elementwise.kernel RuntimeProgram). Its dims are encoded as a static size (>= 0) or
    -1 - k for symbol k.

    program: the ProgramSpec over placeholder sizes (PLACEHOLDER); symbols: the symbols' names; iteration: the iteration
    dims; groups: the end (exclusive) of each collapsed dim's run of iteration dims (neighbours every input walks
    alike merged: broadcast along both, or walking two neighbouring dims of its tensor in order; a static 1 joins the
    run before it; a rolled dim is a run of its own); sources: per kernel input, the shape of the tensor it reads;
    perms: per kernel input and iteration dim, the dim of that tensor it walks (-1: broadcast), a Transpose folded
    into the load where they are out of order; walks: per kernel input, the bits of the collapsed dims it walks;
    rolls: per kernel input, None or (collapsed dim, shift) where it is a torch.roll of its tensor along a static dim
    (rotary embeddings' rotate-half, families/elementwise/rotate.py): index i of that dim reads element
    (i + shift) % size; gathers: per kernel input, whether its innermost walked dim is not its tensor's innermost
    (a transposed read, one element at a time)."""

    program: ProgramSpec
    symbols: tuple[str, ...]
    iteration: tuple[int, ...]
    groups: tuple[int, ...]
    sources: tuple[tuple[int, ...], ...]
    perms: tuple[tuple[int, ...], ...]
    walks: tuple[int, ...]
    rolls: tuple[tuple[int, int] | None, ...] = ()
    gathers: tuple[bool, ...] = ()

    @property
    def inputs(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        return self.program.inputs

    @property
    def outputs(self) -> tuple[tuple[str, Ref], ...]:
        return self.program.outputs

    def dims(self, values: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """The collapsed iteration dims where each symbol has its value in `values` (default 1)."""
        values = values or {}
        sizes = [d if d >= 0 else int(values.get(self.symbols[-1 - d], 1)) for d in self.iteration]
        starts = (0, *self.groups[:-1])
        return tuple(math.prod(sizes[a:b]) for a, b in zip(starts, self.groups, strict=True))


def runtime_spec_from_onnx(nodes: Sequence[Any], inputs: Sequence[tuple[str, Sequence[int | str], str]],
                           outputs: Sequence[str], constants: Mapping[str, Any] | None = None, *,
                           max_rank: int = 6, max_symbols: int = 16) -> RuntimeSpec:
    """The RuntimeSpec of an elementwise group whose input shapes name symbolic dims (strings), or ValueError
    saying why none: a layout op over them other than a Transpose of a whole tensor or a roll along a static dim (a
    Slice, a Pad, a Concat of two tensors: the run-time kernel reads whole tensors), a Transpose into an output, a dim
    mixing symbols (a Flatten of two), a static dim of PLACEHOLDER or more."""
    symbols: list[str] = []
    for _, shape, _ in inputs:
        for d in shape:
            if isinstance(d, str) and d not in symbols:
                symbols.append(d)
            elif not isinstance(d, str) and int(d) >= PLACEHOLDER:
                raise ValueError(f"elementwise: a static dim of {d} is too large for a program over symbolic dims")
    if not symbols:
        raise ValueError("elementwise: no symbolic dim: the program is built for its static shape")
    if len(symbols) > max_symbols:
        raise ValueError(f"elementwise: {len(symbols)} symbolic dims: the kernel for run-time shapes takes at most "
                         f"{max_symbols}")
    size = {name: PLACEHOLDER + 2 * k for k, name in enumerate(symbols)}
    code = {v: -1 - k for k, v in enumerate(size.values())}
    program = program_from_onnx(nodes, [(n, tuple(size[d] if isinstance(d, str) else int(d) for d in s), k)
                                        for n, s, k in inputs], outputs, constants)
    if any(st is not None for st in program.out_strides):
        raise ValueError("elementwise: a Transpose into an output over symbolic dims: the kernel for run-time shapes "
                         "writes dense outputs")

    def encode(d: int) -> int:
        if d < PLACEHOLDER:
            return int(d)
        if d in code:
            return code[d]
        raise ValueError(f"elementwise: a dim of the program ({d}) is a product of symbolic dims (a reshape "
                         "merging them): the kernel for run-time shapes takes each dim as one symbol or static")

    iteration = tuple(encode(d) for d in program.shape)
    rank = len(iteration)
    if rank > max_rank:
        raise ValueError(f"elementwise: iteration rank {rank} is over {max_rank}")
    sources, perms, roll_at = [], [], []
    for lay, (_, shape, _) in itertools.zip_longest(program.layouts, program.inputs, fillvalue=None):
        mapped = _whole_view(lay, tuple(shape))
        if mapped is None:
            raise ValueError("elementwise: a layout op (Slice, Pad, Concat) or a view of a strided input over "
                             "symbolic dims: the kernel for run-time shapes reads whole tensors, transposed or "
                             "rolled along one static dim")
        src, perm, roll = mapped
        if len(src) > max_rank:
            raise ValueError(f"elementwise: an input of rank {len(src)} is over {max_rank}")
        lead = rank - len(shape)
        sources.append(tuple(encode(d) for d in src))
        perms.append((-1,) * lead + perm)
        roll_at.append(None if roll is None else (lead + roll[0], roll[1]))

    def after(src: tuple[int, ...], k: int) -> int:
        """The dim of `src` after dim k, its static 1s skipped."""
        return next((k2 for k2 in range(k + 1, len(src)) if src[k2] != 1), -2)

    groups: list[int] = []
    last = -1
    for j in range(rank):
        if iteration[j] == 1:
            continue
        joins = last >= 0 and all(
            (p[last] < 0 and p[j] < 0)
            or (p[last] >= 0 and p[j] == after(src, p[last]) and (r is None or r[0] not in (last, j)))
            for p, r, src in zip(perms, roll_at, sources, strict=True))
        if joins:
            groups[-1] = j + 1
        else:
            if groups:
                groups[-1] = j  # the static 1s before this dim stay in the run before
            groups.append(j + 1)
        last = j
    if not groups:
        groups = [rank]
    groups[-1] = rank
    starts = (0, *groups[:-1])
    walks = tuple(sum(1 << c for c, (a, b) in enumerate(zip(starts, groups, strict=True))
                      if any(p[j] >= 0 for j in range(a, b))) for p in perms)
    rolls = tuple(None if r is None else (next(c for c, b in enumerate(groups) if r[0] < b), r[1]) for r in roll_at)
    inner = max((j for j in range(rank) if iteration[j] != 1), default=rank - 1)
    gathers = tuple(p[inner] >= 0 and p[inner] != len(src) - 1 for p, src in zip(perms, sources, strict=True))
    return RuntimeSpec(program, tuple(symbols), iteration, tuple(groups), tuple(sources), tuple(perms), walks, rolls,
                       gathers)


def _whole_view(lay: Layout | None, shape: tuple[int, ...]
                ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None] | None:
    """(source shape, the source dim each dim of `shape` walks (-1: broadcast or of size 1), roll) of an input read
    as a whole tensor: as it is (no layout `lay`), transposed, and/or rolled along one static dim (roll: (dim of
    `shape`, shift), element i of that dim reading (i + shift) % size); None for any other view."""
    if lay is None:
        return shape, tuple(-1 if d == 1 else k for k, d in enumerate(shape)), None
    src, strides, base, terms = tuple(lay[0]), tuple(lay[1]), int(lay[2]), layout_rolls(lay)
    if base != 0 or len(terms) > 1:
        return None
    dense = contiguous_strides(src)

    def source_dim(d: int, stride: int) -> int | None:
        found = [k for k in range(len(src)) if src[k] == d and dense[k] == stride and src[k] != 1]
        return found[0] if len(found) == 1 else None

    perm = [-1] * len(shape)
    roll = None
    for n, r, q, m, stride, weights in terms:
        dims = [j for j, w in enumerate(weights) if w]
        if len(dims) != 1 or weights[dims[0]] != 1 or q != 1 or m != n or shape[dims[0]] != n or n >= PLACEHOLDER:
            return None
        j = dims[0]
        k = source_dim(n, stride)
        if k is None or strides[j] != 0:
            return None
        perm[j], roll = k, (j, int(r) % n)
    for j, (d, st) in enumerate(zip(shape, strides, strict=True)):
        if d == 1 or (roll is not None and roll[0] == j):
            continue
        k = source_dim(d, st)
        if k is None:
            return None
        perm[j] = k
    walked = [k for k in perm if k >= 0]
    if len(set(walked)) != len(walked) or sorted(walked) != [k for k in range(len(src)) if src[k] != 1]:
        return None  # a dim read twice, or part of the tensor (a Slice)
    return src, tuple(perm), roll
