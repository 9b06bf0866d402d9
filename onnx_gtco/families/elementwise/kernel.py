"""Elementwise kernel family (plugins/families/elementwise/elementwise.cuh): a chain or tree of elementwise ONNX ops,
computed as one fp32 expression per element, with numpy broadcasting of the inputs over a flattened index.

Only the program is generated (plugins/families/elementwise/elementwise.cu.j2): its storage type, its iteration shape
collapsed (`collapse`) and each operand's strides over it, and its body, one C expression per instruction. The loop,
the broadcast indexing, the vector and scalar paths and the launch are the header's (gtco::ew::Elementwise, and
gtco::ref::ew::run for the host function of the ORT glue).

A program (`Program`, hashable) is what the group computes:

* inputs: (tensor name, shape, kind) per kernel input; kind "float" (the kernel dtype), "bool" (uint8), "i32" or
  "i64". Shapes broadcast numpy-style to the iteration shape (rank <= 6). A tensor may appear twice under two
  shapes when a view op (Unsqueeze, Reshape, ...) reinterprets it inside the group.
* instrs: (op, refs, attr) in topological order. A ref is ("x", i) (input i), ("c", value) (a scalar constant)
  or ("t", j) (the result of instruction j). attr: LeakyRelu / Elu alpha, HardSigmoid (alpha, beta), Gelu
  "none" / "tanh", Cast target "f16" / "bf16" / "f32" / "f64" / "bool", else None. The ops are ARITY's keys;
  program_from_onnx also lowers Sum, Mean, Max, Min of any arity and Clip to them. Every value is fp32 in the
  kernel; booleans (bool inputs, comparisons, Not / And / Or / Xor, Cast to bool) are 1.0 / 0.0, and Where takes
  any nonzero condition as true.
* outputs: (tensor name, ref); every output has the iteration shape and the kernel dtype.
* layouts: one per input (or none at all): None for a tensor read as it is (broadcast by its shape), else
  (source shape, element strides, base[, terms]): the input is a view of a tensor of the source shape, element
  (i0, i1, ...) of the view at source element base + sum(i_k * strides_k) + the terms, each term
  (n, r, q, m, stride, weights) adding ((sum(i_k * weights_k) + r) % n // q % m) * stride: a torch.roll of a dim
  (q = 1, m = n), or one of the dims a reshape merged where their strides do not merge (Swin's window reverse).
  Layout ops on a group input (Transpose, Slice with positive steps, Reshape, all-zero Pad, and the Slice + Slice +
  Concat of a torch.roll) are folded into its load this way: the index map of the chain, computed per element.

Problem (`Program.problem(dtype)`): sizes d0..d{r-1} (the iteration shape), flags program (instrs), inputs
((shape, kind) per input), outputs (refs). Arrays are named x0, x1, ... and y0, y1, ...

`program_from_onnx(nodes, inputs, outputs)` builds the Program of an elementwise group of onnx NodeProto.

Programs over symbolic dims (`RuntimeProgram`, `runtime_program_from_onnx`; DietCode's shape-generic kernel for this
family): one instance (gtco::ew::Dynamic) for every size the dims take. Its Problem (`runtime_problem`) is over the
iteration shape collapsed at build time (`RuntimeSpec.groups`), with the flags `runtime` (the collapsed dims sized per
call; the Problem's sizes for them are one call's, which estimates and tests use and the instance ignores), `walks`
(per input, the bits of the collapsed dims it walks), `rolls` (per input, None or (collapsed dim, shift): a roll
along a static dim) and `gathers` (per input, read across its innermost dim: a Transpose); the call's dims and each
input's strides (a transposed input's permuted) come in GtcoElementwiseArgs `dims` / `strides`.

Config: THREADS per block (64..512), VEC consecutive elements per thread (one load / store of at most 16 bytes of
the outputs, of the inputs that have the full shape and of inputs contiguous along an innermost dim that is a
multiple of VEC (a bias [N]); one load per VEC elements of inputs broadcast along that dim (a per-row scale, a
scalar); other broadcast inputs are gathered per element; a ragged tail runs scalar: gtco::ew::access).
Vector-loaded inputs and the outputs must be aligned to VEC elements for the vector path; when one is not, the
entry point launches the kernel with every element on the scalar path (correct, slower).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from onnx_gtco.calibration import Constants, Hardware, LaunchConstants, param
from onnx_gtco.families.layernorm.kernel import C_TYPES, ITEM_BYTES, arch_tag
from onnx_gtco.ir.elementwise import (
    ARITY,
    CAST_TARGETS,
    Instr,
    Layout,
    ProgramSpec,
    Ref,
    RuntimeSpec,
    canonical_layout,
    contiguous_strides,
    layout_rolls,
    runtime_spec_from_onnx,
)
from onnx_gtco.ir.elementwise import program_from_onnx as spec_from_onnx
from onnx_gtco.kernels.family import (
    ARCHS,
    DTYPES,
    Config,
    Field,
    Instance,
    KernelFamily,
    Problem,
    from_storage,
    to_storage,
)
from onnx_gtco.kernels.render import macro

MAX_IN, MAX_OUT, MAX_RANK = 8, 4, 6  # elementwise_args.h
MAX_SYMBOLS = 16  # gtco::Elementwise::kMaxSymbols (elementwise_op.h)
KINDS = {"float": None, "bool": "uint8_t", "i32": "int32_t", "i64": "int64_t"}
KIND_NP = {"bool": np.bool_, "i32": np.int32, "i64": np.int64}
TEMPLATE = "families/elementwise/elementwise.cu.j2"  # under plugins/
_COMPARE = {"Equal": "==", "Less": "<", "LessOrEqual": "<=", "Greater": ">", "GreaterOrEqual": ">="}

class Program(ProgramSpec):
    """A ProgramSpec (onnx_gtco.ir.elementwise) with its kernel Problem."""

    def problem(self, dtype: str) -> Problem:
        return elementwise_problem(dtype, self.shape, self.instrs, tuple(
            (s, k) for _, s, k in self.inputs), tuple(r for _, r in self.outputs), self.layouts, self.out_strides)


def program_from_onnx(nodes: Sequence[Any], inputs: Sequence[Any] | Mapping[str, Sequence[int]],
                      outputs: Sequence[str], constants: Mapping[str, Any] | None = None) -> Program:
    """onnx_gtco.ir.elementwise.program_from_onnx, as a Program (see there for the arguments and errors)."""
    spec = spec_from_onnx(nodes, inputs, outputs, constants)
    return Program(spec.inputs, spec.instrs, spec.outputs, spec.layouts, spec.out_strides)


class RuntimeProgram(RuntimeSpec):
    """A RuntimeSpec (onnx_gtco.ir.elementwise: a program over symbolic dims) with its kernel Problem: one instance
    for every size the symbols take (gtco::ew::Dynamic), DietCode's shape-generic kernel for this family."""

    def problem(self, dtype: str, values: Mapping[str, int] | None = None) -> Problem:
        """Its Problem, for a call where each symbol has its value in `values` (default 1: the size the tuner's
        tasks and the estimates count a symbolic dim as)."""
        starts = (0, *self.groups[:-1])
        runtime = tuple(j for j, (a, b) in enumerate(zip(starts, self.groups, strict=True))
                        if any(d < 0 for d in self.iteration[a:b]))
        return runtime_problem(dtype, self.dims(values), runtime, self.program.instrs,
                               tuple(zip(self.walks, (k for _, _, k in self.program.inputs), strict=True)),
                               tuple(r for _, r in self.program.outputs), self.rolls, self.gathers)


def runtime_program_from_onnx(nodes: Sequence[Any], inputs: Sequence[tuple[str, Sequence[int | str], str]],
                              outputs: Sequence[str], constants: Mapping[str, Any] | None = None
                              ) -> RuntimeProgram:
    """onnx_gtco.ir.elementwise.runtime_spec_from_onnx, as a RuntimeProgram (see there for the arguments and errors)."""
    spec = runtime_spec_from_onnx(nodes, inputs, outputs, constants, max_rank=MAX_RANK, max_symbols=MAX_SYMBOLS)
    return RuntimeProgram(**{f.name: getattr(spec, f.name) for f in fields(spec)})


def elementwise_problem(dtype: str, shape: Sequence[int], instrs: Sequence[Instr],
                        inputs: Sequence[tuple[Sequence[int], str]], outputs: Sequence[Ref],
                        layouts: Sequence[Layout | None] = (),
                        out_strides: Sequence[Sequence[int] | None] = ()) -> Problem:
    """The Problem of a program over the iteration `shape` (see the module doc for the encoding). The flag `layouts`
    is there only when some input is a view, so programs without one keep their problem (and instance names)."""
    flags = {"program": tuple((op, tuple(tuple(r) for r in refs), attr) for op, refs, attr in instrs),
             "inputs": tuple((tuple(int(d) for d in s), k) for s, k in inputs),
             "outputs": tuple(tuple(r) for r in outputs)}
    if any(lay is not None for lay in layouts):
        flags["layouts"] = tuple(None if lay is None else canonical_layout(lay) for lay in layouts)
    if any(st is not None for st in out_strides):
        flags["out_strides"] = tuple(None if st is None else tuple(int(v) for v in st) for st in out_strides)
    return Problem.make("elementwise", dtype, {f"d{i}": int(d) for i, d in enumerate(shape)}, flags)


def runtime_dims(problem: Problem) -> tuple[int, ...]:
    """The collapsed iteration dims of a program built for run-time shapes whose size each call gives (none: a
    program built for its static shape)."""
    return tuple(problem.flag("runtime") or ())


def input_walks(problem: Problem) -> tuple[int, ...]:
    """Per input of a program built for run-time shapes, the bits of the collapsed dims it walks (else broadcasts
    along)."""
    return tuple(problem.flag("walks") or ())


def runtime_problem(dtype: str, dims: Sequence[int], runtime: Sequence[int], instrs: Sequence[Instr],
                    inputs: Sequence[tuple[int, str]], outputs: Sequence[Ref],
                    rolls: Sequence[tuple[int, int] | None] = (), gathers: Sequence[bool] = ()) -> Problem:
    """The Problem of a program built for run-time shapes: `dims`, the collapsed iteration dims of one call (the
    ones in `runtime` vary per call; their values here are what estimates and tests use, not what the instance is
    built for), `inputs` (bits of the collapsed dims each walks, kind), dense outputs; `rolls`: per input None or
    (collapsed dim, shift), a torch.roll along that static dim; `gathers`: per input, whether its innermost dim is read
    across its tensor (a Transpose), one element at a time (each flag only where some input has one)."""
    rank = len(dims)
    flags = {"program": tuple((op, tuple(tuple(r) for r in refs), attr) for op, refs, attr in instrs),
             "inputs": tuple((tuple(int(dims[j]) if w >> j & 1 else 1 for j in range(rank)), k) for w, k in inputs),
             "outputs": tuple(tuple(r) for r in outputs),
             "runtime": tuple(int(j) for j in runtime), "walks": tuple(int(w) for w, _ in inputs)}
    if any(r is not None for r in rolls):
        flags["rolls"] = tuple(None if r is None else (int(r[0]), int(r[1])) for r in rolls)
    if any(gathers):
        flags["gathers"] = tuple(bool(g) for g in gathers)
    return Problem.make("elementwise", dtype, {f"d{i}": int(d) for i, d in enumerate(dims)}, flags)


def input_gathers(problem: Problem) -> tuple[bool, ...]:
    """Per input of a program built for run-time shapes, whether it is read across its tensor's innermost dim."""
    return problem.flag("gathers") or (False,) * len(problem.flag("inputs"))


def input_rolls(problem: Problem) -> tuple[tuple[int, int] | None, ...]:
    """Per input of a program built for run-time shapes, None or the (collapsed dim, shift) of its roll."""
    return problem.flag("rolls") or (None,) * len(problem.flag("inputs"))


def _identity(problem: Problem) -> tuple[Any, ...]:
    """What an instance is built for: the problem less the sizes of its run-time dims."""
    runtime = set(runtime_dims(problem))
    if not runtime:
        views = () if problem.flag("layouts") is None else (problem.flag("layouts"),)
        return (problem.sizes, problem.flag("program"), problem.flag("inputs"), problem.flag("outputs"), *views)
    sizes = tuple((k, 0 if k[1:].isdigit() and int(k[1:]) in runtime else v) for k, v in problem.sizes)
    return (sizes, problem.flag("program"), tuple(k for _, k in problem.flag("inputs")), problem.flag("outputs"),
            ("walks", input_walks(problem)), ("runtime", tuple(sorted(runtime))),
            *((("rolls", input_rolls(problem)),) if problem.flag("rolls") else ()),
            *((("gathers", input_gathers(problem)),) if problem.flag("gathers") else ()))


def input_layouts(problem: Problem) -> tuple[Layout | None, ...]:
    """The layout of every input of `problem` (None: read as it is)."""
    return problem.flag("layouts") or (None,) * len(problem.flag("inputs"))


def output_strides(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """Where each output stores element (i0, i1, ...) of the iteration shape: sum(i_k * strides_k) (dense unless a
    Transpose folds into the store)."""
    dense = contiguous_strides(iteration_shape(problem))
    got = problem.flag("out_strides") or (None,) * len(problem.flag("outputs"))
    return tuple(dense if st is None else tuple(st) for st in got)


def source_shape(problem: Problem, i: int) -> tuple[int, ...]:
    """The shape of the tensor input i reads: its own shape, or the source shape of its view."""
    lay = input_layouts(problem)[i]
    return tuple(problem.flag("inputs")[i][0]) if lay is None else tuple(lay[0])


def iteration_shape(problem: Problem) -> tuple[int, ...]:
    dims = sorted((int(k[1:]), v) for k, v in problem.sizes if k.startswith("d") and k[1:].isdigit())
    return tuple(v for _, v in dims)


# ---------------------------------------------------------------------------------------------------------------
# validation and broadcasting
# ---------------------------------------------------------------------------------------------------------------

def _validate(problem: Problem) -> str | None:
    instrs = problem.flag("program")
    inputs = problem.flag("inputs")
    outputs = problem.flag("outputs")
    if instrs is None or inputs is None or outputs is None:
        return "problem flags need program, inputs and outputs"
    shape = iteration_shape(problem)
    if len(shape) > MAX_RANK:
        return f"iteration rank {len(shape)} is over {MAX_RANK}"
    if any(d <= 0 for d in shape):
        return f"iteration shape {shape} has an empty or negative dim"
    if not 1 <= len(inputs) <= MAX_IN:
        return f"{len(inputs)} inputs: 1 to {MAX_IN} supported"
    if not 1 <= len(outputs) <= MAX_OUT:
        return f"{len(outputs)} outputs: 1 to {MAX_OUT} supported"
    for i, (s, kind) in enumerate(inputs):
        if kind not in KINDS:
            return f"input {i} kind {kind!r} is not one of {tuple(KINDS)}"
        if len(s) > len(shape):
            return f"input {i} shape {s} has a higher rank than the iteration shape {shape}"
        if any(d not in (1, D) for d, D in zip(s[::-1], shape[::-1], strict=False)):
            return f"input {i} shape {s} does not broadcast to {shape}"
    if tuple(np.broadcast_shapes(*(s for s, _ in inputs))) != shape:
        return f"the inputs broadcast to {np.broadcast_shapes(*(s for s, _ in inputs))}, not {shape}"
    if why := _bad_runtime(problem, shape, inputs):
        return why
    if why := _bad_layouts(problem.flag("layouts"), inputs):
        return why
    stores = problem.flag("out_strides")
    if stores is not None and (len(stores) != len(outputs) or any(
            st is not None and not _permutes(shape, st) for st in stores)):
        return f"out_strides {stores} are not a dense permutation of the iteration shape {shape} per output"

    def bad_ref(r: Ref, j: int) -> str | None:
        if (r[0] == "x" and 0 <= r[1] < len(inputs)) or (r[0] == "t" and 0 <= r[1] < j) or r[0] == "c":
            return None
        return f"ref {r} of instruction {j} names no earlier value"

    for j, (op, refs, attr) in enumerate(instrs):
        if op not in ARITY:
            return f"op {op!r} is not supported (supported: {', '.join(ARITY)})"
        if len(refs) != ARITY[op]:
            return f"{op} takes {ARITY[op]} operands, instruction {j} has {len(refs)}"
        if op == "Cast" and attr not in CAST_TARGETS:
            return f"Cast to {attr!r}: only targets {CAST_TARGETS}"
        if op == "Gelu" and attr not in ("none", "tanh"):
            return f"Gelu approximate={attr!r}: 'none' or 'tanh'"
        if op == "HardSigmoid" and not (attr is None or (isinstance(attr, tuple) and len(attr) == 2)):
            return f"HardSigmoid attr {attr!r}: None or (alpha, beta)"
        for r in refs:
            if why := bad_ref(r, j):
                return why
    for r in outputs:
        if why := bad_ref(r, len(instrs)):
            return why
        if r[0] == "c":
            return "an output is a constant"
    return None


def _bad_runtime(problem: Problem, shape: Sequence[int], inputs: Sequence[tuple[Sequence[int], str]]) -> str | None:
    """Why the run-time flags (`runtime`, `walks`) do not describe a program over collapsed run-time dims, or None."""
    runtime, walks = problem.flag("runtime"), problem.flag("walks")
    if runtime is None and walks is None:
        return None
    rank = len(shape)
    if not runtime or any(not 0 <= j < rank for j in runtime):
        return f"runtime dims {runtime} are not dims of the collapsed iteration shape {tuple(shape)}"
    if walks is None or len(walks) != len(inputs):
        return f"walks {walks}: one bit set per input ({len(inputs)})"
    if problem.flag("layouts") is not None or problem.flag("out_strides") is not None:
        return "a program built for run-time shapes reads no views and writes dense outputs"
    for i, (w, (s, _)) in enumerate(zip(walks, inputs, strict=True)):
        if not 0 <= w < 1 << rank or tuple(s) != tuple(shape[j] if w >> j & 1 else 1 for j in range(rank)):
            return f"input {i}: shape {tuple(s)} is not the collapsed dims {tuple(shape)} it walks (bits {w})"
    rolls = problem.flag("rolls") or (None,) * len(inputs)
    if len(rolls) != len(inputs) or len(problem.flag("gathers") or inputs) != len(inputs):
        return f"rolls {rolls} and gathers {problem.flag('gathers')}: one per input ({len(inputs)})"
    for i, (r, w) in enumerate(zip(rolls, walks, strict=True)):
        if r is not None and not (0 <= r[0] < rank and r[0] not in runtime and w >> r[0] & 1
                                  and 0 <= r[1] < shape[r[0]]):
            return f"input {i}: roll {r} is not (a static dim it walks, a shift below its size)"
    return None


def _bad_layouts(layouts: Any, inputs: Sequence[tuple[Sequence[int], str]]) -> str | None:
    """Why the `layouts` flag does not describe views of the inputs, or None."""
    if layouts is None:
        return None
    if len(layouts) != len(inputs):
        return f"{len(layouts)} layouts for {len(inputs)} inputs"
    for i, (lay, (s, _)) in enumerate(zip(layouts, inputs, strict=True)):
        if lay is None:
            continue
        src, strides, base = lay[:3]
        rolls = layout_rolls(lay)
        if len(strides) != len(s) or any(st < 0 for st in strides) or base < 0:
            return f"input {i}: strides {strides} and base {base} are not non-negative strides of its shape {s}"
        if any(min(n, q, m) <= 0 or r < 0 or st < 0 or len(ws) != len(s) or min(ws, default=0) < 0
               for n, r, q, m, st, ws in rolls):
            return (f"input {i}: terms {rolls} are not (n, r, q, m, stride, one weight per dim), n, q, m positive, "
                    "the rest non-negative")
        last = base + sum((d - 1) * st for d, st in zip(s, strides, strict=True)) + sum(
            (min(m, -(-n // q)) - 1) * st for n, _, q, m, st, _ in rolls)
        if last >= math.prod(src):
            return f"input {i}: its view reads element {last} of a source {tuple(src)} of {math.prod(src)} elements"
    return None


def _permutes(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether `strides` store a tensor of `shape` densely in some order of its dims (a transposed output)."""
    if len(strides) != len(shape):
        return False
    order = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[d])
    return [strides[d] for d in order] == list(contiguous_strides([shape[d] for d in order]))


def collapse(shape: Sequence[int], in_shapes: Sequence[Sequence[int]],
             in_strides: Sequence[Sequence[int] | None] = ()) -> tuple[list[int], list[list[int]]]:
    """Collapsed iteration dims and each input's element strides over them (0 = broadcast), merging neighbours
    every input walks contiguously (or broadcasts over together) and dropping dims of 1. `in_strides`: an input's
    own element strides over its shape where it is a view (None or absent: dense)."""
    r = len(shape)
    strides = []
    for k, s in enumerate(in_shapes):
        own = in_strides[k] if k < len(in_strides) and in_strides[k] is not None else contiguous_strides(s)
        own = (0,) * (r - len(s)) + tuple(own)
        s = (1,) * (r - len(s)) + tuple(s)
        strides.append([own[d] if s[d] == shape[d] and shape[d] != 1 else 0 for d in range(r)])
    dims = [d for d in range(r) if shape[d] != 1]
    D = [int(shape[d]) for d in dims]
    S = [[st[d] for d in dims] for st in strides]
    j = 0
    while j + 1 < len(D):
        if all(st[j] == st[j + 1] * D[j + 1] for st in S):
            D[j:j + 2] = [D[j] * D[j + 1]]
            for st in S:
                st[j:j + 2] = [st[j + 1]]
        else:
            j += 1
    return D, S


def _lit(v: float) -> str:
    v = float(np.float32(v))
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    text = f"{abs(v)!r}f" if "e" in repr(v) or "." in repr(v) else f"{abs(v)!r}.0f"
    # parenthesised when negative, so that an operator before it never forms "--" or "- -"
    return f"(-{text})" if math.copysign(1.0, v) < 0 else text


def _expr(op: str, a: list[str], refs: tuple[Ref, ...], attr: Any, ns: str = "gtco::ew") -> str:
    """The C expression of one instruction; `ns` is the namespace of the op math (device or host, same names)."""
    if op in ("Add", "Sub", "Mul", "Div"):
        return f"{a[0]} {dict(Add='+', Sub='-', Mul='*', Div='/')[op]} {a[1]}"
    if op == "Pow":
        if refs[1][0] == "c":
            p = float(refs[1][1])
            special = {1.0: a[0], 2.0: f"{a[0]} * {a[0]}", 3.0: f"{a[0]} * {a[0]} * {a[0]}", 0.5: f"sqrtf({a[0]})",
                       -1.0: f"1.0f / {a[0]}", 0.0: "1.0f"}
            if p in special:
                return special[p]
        return f"powf({a[0]}, {a[1]})"
    unary = {"Sqrt": "sqrtf({})", "Reciprocal": "1.0f / {}", "Neg": "-{}", "Abs": "fabsf({})", "Exp": "expf({})",
             "Log": "logf({})", "Tanh": "tanhf({})", "Erf": "erff({})", "Sigmoid": "{ns}::sigmoid({})",
             "Relu": "{ns}::relu({})", "Identity": "{}"}
    if op in unary:
        return unary[op].format(a[0], ns=ns)
    if op == "LeakyRelu":
        return f"{ns}::leaky_relu({a[0]}, {_lit(0.01 if attr is None else attr)})"
    if op == "Gelu":
        return f"{ns}::gelu_{'tanh' if attr == 'tanh' else 'erf'}({a[0]})"
    if op in ("Max", "Min"):
        return f"{'fmaxf' if op == 'Max' else 'fminf'}({a[0]}, {a[1]})"
    if op == "Where":
        return f"{ns}::where({a[0]}, {a[1]}, {a[2]})"
    if op == "Cast":
        return {"f16": "{ns}::round_f16({})", "bf16": "{ns}::round_bf16({})",
                "bool": "{ns}::truth({})"}.get(attr, "{}").format(a[0], ns=ns)
    more = {"Softplus": "{ns}::softplus({})", "Softsign": "{ns}::softsign({})",
            "HardSwish": "{ns}::hard_swish({})", "Floor": "floorf({})", "Ceil": "ceilf({})",
            "Round": "rintf({})", "Sign": "{ns}::sign({})", "Sin": "{ns}::sin({})", "Cos": "{ns}::cos({})",
            "Not": "{ns}::lnot({})", "IsNaN": "{ns}::is_nan({})"}
    if op in more:
        return more[op].format(a[0], ns=ns)
    if op == "PRelu":
        return f"{ns}::leaky_relu({a[0]}, {a[1]})"
    if op == "Elu":
        return f"{ns}::elu({a[0]}, {_lit(1.0 if attr is None else attr)})"
    if op == "HardSigmoid":
        alpha, beta = (0.2, 0.5) if attr is None else attr
        return f"{ns}::hard_sigmoid({a[0]}, {_lit(alpha)}, {_lit(beta)})"
    if op in _COMPARE:
        return f"({a[0]} {_COMPARE[op]} {a[1]} ? 1.0f : 0.0f)"
    if op in ("And", "Or", "Xor"):
        return f"{ns}::l{op.lower()}({a[0]}, {a[1]})"
    raise ValueError(f"elementwise: unsupported op {op!r}")


def _body(problem: Problem, ns: str) -> dict[str, Any]:
    """What elementwise.cu.j2 writes of a program's computation, whatever its shapes: one fp32 expression per
    instruction (op math in namespace `ns`), the outputs, and the instructions listed for a comment."""
    instrs = problem.flag("program")

    def value(r: Ref) -> str:
        return f"x[{r[1]}]" if r[0] == "x" else f"t{r[1]}" if r[0] == "t" else _lit(r[1])

    return {"body": [_expr(op, [value(r) for r in refs], refs, attr, ns) for op, refs, attr in instrs],
            "outputs": [value(r) for r in problem.flag("outputs")],
            "listing": "; ".join(f"t{j} = {op}({', '.join(map(str, refs))}){'' if a is None else f' [{a}]'}"
                                 for j, (op, refs, a) in enumerate(instrs))}


def _runtime_program(problem: Problem, storage: str, ns: str) -> dict[str, Any]:
    """What elementwise.cu.j2's dynamic macros write of a program built for run-time shapes."""
    runtime, shape = set(runtime_dims(problem)), iteration_shape(problem)
    return {"storage": storage, "rank": len(shape), "shape": ["?" if j in runtime else d for j, d in enumerate(shape)],
            "inputs": [{"type": KINDS[k] or "T", "walks": w, "gather": g,
                        "roll": (-1, 0, 0) if r is None else (r[0], r[1], shape[r[0]])}
                       for (_, k), w, r, g in zip(problem.flag("inputs"), input_walks(problem), input_rolls(problem),
                                                  input_gathers(problem), strict=True)],
            **_body(problem, ns)}


def _program(problem: Problem, storage: str, ns: str) -> dict[str, Any]:
    """What elementwise.cu.j2 writes of a program: its storage type, iteration shape and collapsed dims, operands
    (element type, strides over those dims) and its computation (`_body`)."""
    inputs = problem.flag("inputs")
    shape = iteration_shape(problem)
    layouts = input_layouts(problem)
    # each roll's weights collapse like the strides of one more operand of its input's shape
    # and so do the outputs' store strides
    extra = [(s, t[5]) for (s, _), lay in zip(inputs, layouts, strict=True) for t in layout_rolls(lay)]
    stores = output_strides(problem)
    dims, strides = collapse(shape, [s for s, _ in inputs] + [s for s, _ in extra] + [shape] * len(stores),
                             [None if lay is None else lay[1] for lay in layouts] + [ws for _, ws in extra]
                             + list(stores))
    weights = iter(strides[len(inputs):])
    rolls = [[[*t[:5], *next(weights)] for t in layout_rolls(lay)] for lay in layouts]
    out_strides = list(weights)
    return {"storage": storage, "shape": shape, "dims": dims,
            "inputs": [{"type": KINDS[k] or "T", "strides": st, "base": 0 if lay is None else lay[2], "rolls": ro}
                       for (_, k), st, lay, ro in zip(inputs, strides[:len(inputs)], layouts, rolls, strict=True)],
            "out_strides": out_strides, **_body(problem, ns)}


# ---------------------------------------------------------------------------------------------------------------
# the family
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ElementwiseConstants(Constants):
    """The constants of the elementwise estimate (onnx_gtco.calibration: on the H200 fitted from one measured kernel,
    ViT-B/16's patch-embedding transpose at batch 64, a gathered read: the contiguous rate is not measured and
    keeps its default, LayerNorm's fitted rate)."""

    GROUP: ClassVar[str] = "elementwise"
    extra_us: float = param(1.0, 0.0, 20.0, "us", "a kernel's time beyond the launch floor however few elements it "
                            "has; not fitted (the one record is a long kernel): LayerNorm's fitted pass time stands in",
                            fit=False)
    bw_frac: float = param(0.893, 0.05, 1.5, "of DRAM bandwidth", "the rate of reads and writes along the "
                           "innermost dim (coalesced)", fit=False)
    gather_frac: float = param(0.104, 0.01, 1.5, "of DRAM bandwidth", "the rate of an input read across its "
                               "innermost dim (a transpose folded into the load: one element per access)")


_KIND_BYTES = {"bool": 1, "i32": 4, "i64": 8}


COALESCED_RUN = 8
"""Consecutive elements along the innermost dim that must be consecutive in memory for an access to count as
coalesced (16 bytes of a 16-bit type)."""


def _offset(layout: Sequence[Any], index: Sequence[int]) -> int:
    """The source element a layout (ir.elementwise: source shape, strides, base[, terms]) maps `index` to."""
    strides, base = layout[1], int(layout[2])
    off = base + sum(int(i) * int(st) for i, st in zip(index, strides, strict=False))
    for n, r, q, m, stride, weights in layout_rolls(tuple(layout)):
        off += ((sum(int(i) * int(w) for i, w in zip(index, weights, strict=False)) + r) % n // q % m) * stride
    return off


def _gathered(layout: Sequence[Any] | None, shape: Sequence[int]) -> bool:
    """Whether a view reads its innermost dim across memory (a transpose folded into the load): the first
    COALESCED_RUN elements along it are not consecutive in the source, so each is one access."""
    if layout is None or not shape or int(shape[-1]) < 2:
        return False
    run = min(COALESCED_RUN, int(shape[-1]))
    offsets = [_offset(layout, [0] * (len(shape) - 1) + [i]) for i in range(run)]
    return any(b - a != 1 for a, b in itertools.pairwise(offsets))


class ElementwiseFamily(KernelFamily):
    name = "elementwise"
    per_group = True
    space: ClassVar[Mapping[str, tuple[int, ...]]] = {"THREADS": (64, 128, 256, 512), "VEC": (1, 2, 4, 8)}

    def check(self, problem: Problem, config: Config, arch: str) -> str | None:
        if problem.family != self.name:
            return f"problem is for family {problem.family!r}, not {self.name!r}"
        if problem.dtype not in DTYPES:
            return f"dtype {problem.dtype!r} is not one of {DTYPES}"
        if arch not in ARCHS:
            return f"arch {arch!r} is not one of {ARCHS}"
        if why := _validate(problem):
            return why
        try:
            threads, vec = int(config["THREADS"]), int(config["VEC"])
        except KeyError as e:
            return f"config lacks {e.args[0]}"
        if threads not in self.space["THREADS"]:
            return f"THREADS={threads} is not one of {self.space['THREADS']}"
        if vec not in self.space["VEC"]:
            return f"VEC={vec} is not one of {self.space['VEC']}"
        if vec * ITEM_BYTES[problem.dtype] > 16:
            return f"VEC={vec} {problem.dtype} elements are {vec * ITEM_BYTES[problem.dtype]} bytes, over 16"
        n = int(np.prod(iteration_shape(problem), dtype=np.int64))
        if -(-n // (threads * vec)) > 2**31 - 1:
            return f"{n} elements need more than 2^31 - 1 blocks"
        return None

    def configs(self, problem: Problem, arch: str) -> list[dict[str, int]]:
        n = int(np.prod(iteration_shape(problem), dtype=np.int64))
        out = [{"THREADS": t, "VEC": v} for v in (8, 4, 2, 1) for t in (256, 128, 512, 64)
               if self.check(problem, {"THREADS": t, "VEC": v}, arch) is None]
        # widest vector first, then the block size that still gives a few waves of blocks
        return sorted(out, key=lambda c: (-c["VEC"], n < 64 * c["THREADS"] * c["VEC"] and c["THREADS"] > 128))

    def estimate_us(self, problem: Problem, config: Config, hw: Hardware) -> float:
        """The estimated time on `hw` (ElementwiseConstants): the launch floor and the extra time, then each input's
        and output's bytes, coalesced (at bw_frac of DRAM, less with accesses under 16 bytes) or gathered (a view read
        across its innermost dim, at gather_frac), or the instructions at the CUDA-core peak where they bound it."""
        t, c = hw.target, hw.constants(ElementwiseConstants)
        n = math.prod(iteration_shape(problem))
        elem = ITEM_BYTES[problem.dtype]
        layouts = input_layouts(problem)
        coalesced = gathered = 0.0
        it = iteration_shape(problem)
        for (shape, kind), lay in zip(problem.flag("inputs"), layouts, strict=True):
            size = math.prod(shape) * _KIND_BYTES.get(kind, elem)
            if _gathered(lay, it):
                gathered += size
            else:
                coalesced += size
        for i, _ in enumerate(problem.flag("outputs")):
            strides = (problem.flag("out_strides") or ())[i] if problem.flag("out_strides") else None
            out = None if strides is None else (tuple(it), tuple(strides), 0)
            gathered, coalesced = ((gathered + n * elem, coalesced) if _gathered(out, it)
                                   else (gathered, coalesced + n * elem))
        width = min(1.0, int(config["VEC"]) * elem / 16) ** 0.5
        memory = (coalesced / (t.dram_gbps * 1e3 * c.bw_frac * width)
                  + gathered / (t.dram_gbps * 1e3 * c.gather_frac))
        compute = n * max(1, len(problem.flag("program") or ())) * 4 / (t.cuda_tflops * 1e6)
        return hw.constants(LaunchConstants).floor_us + c.extra_us + max(memory, compute)

    def instantiate(self, problem: Problem, config: Config, arch: str) -> Instance:
        why = self.check(problem, config, arch)
        if why is not None:
            raise ValueError(f"elementwise: {why}")
        threads, vec = int(config["THREADS"]), int(config["VEC"])
        instrs = problem.flag("program")
        n = int(np.prod(iteration_shape(problem), dtype=np.int64))
        digest = hashlib.sha1(repr(_identity(problem)).encode()).hexdigest()[:8]
        ops = [op.lower() for op, _, _ in instrs if op != "Identity"]
        tag = "_".join(ops[:6]) + (f"_{len(ops) - 6}more" if len(ops) > 6 else "") or "copy"
        size = "dyn" if runtime_dims(problem) else f"n{n}"
        name = f"elementwise_{arch_tag(arch)}_{problem.dtype}_{tag}_{size}_t{threads}_v{vec}_{digest}"
        if runtime_dims(problem):
            source = macro(TEMPLATE, "dynamic_instance", name=name, symbol=f"gtco_{name}", threads=threads, vec=vec,
                           **_runtime_program(problem, C_TYPES[problem.dtype], "gtco::ew"))
        else:
            source = macro(TEMPLATE, "instance", name=name, symbol=f"gtco_{name}", threads=threads, vec=vec,
                           **_program(problem, C_TYPES[problem.dtype], "gtco::ew"))
        return Instance(name, f"gtco_{name}", source, problem, dict(config), arch, 0)

    def host_function(self, problem: Problem) -> tuple[str, str]:
        """The symbol and C++ source of `problem` as a plain host function
        (plugins/families/elementwise/elementwise_ref.h).

        The custom-op library's CPU-EP kernel of an Elementwise node: the program differs per node, so the glue
        carries one of these per distinct program. Same fp32 expression and numpy-broadcast index arithmetic
        (gtco/broadcast.h) as the device instance, one element at a time over [begin, end) (the caller splits the
        range over threads), no CUDA. Signature `gtco::ref::ew::HostFn`: `void f(const GtcoElementwiseArgs*,
        uint64_t begin, uint64_t end)`; `static`, so that glues of several models never share a symbol."""
        why = _validate(problem) if problem.family == self.name else f"problem is for family {problem.family!r}"
        if why is None and problem.dtype not in DTYPES:
            why = f"dtype {problem.dtype!r} is not one of {DTYPES}"
        if why is not None:
            raise ValueError(f"elementwise: {why}")
        digest = hashlib.sha1(repr((problem.dtype, *_identity(problem))).encode()).hexdigest()
        symbol = f"gtco_elementwise_host_{problem.dtype}_{digest[:12]}"
        storage = {"f32": "float", "f16": "gtco::ref::ew::f16", "bf16": "gtco::ref::ew::bf16"}[problem.dtype]
        if runtime_dims(problem):
            return symbol, macro(TEMPLATE, "dynamic_host_function", symbol=symbol,
                                 **_runtime_program(problem, storage, "gtco::ref::ew"))
        return symbol, macro(TEMPLATE, "host_function", symbol=symbol, **_program(problem, storage, "gtco::ref::ew"))

    def args_fields(self, problem: Problem, arrays: Mapping[str, np.ndarray]) -> list[Field]:
        nin, nout = len(problem.flag("inputs")), len(problem.flag("outputs"))
        n = int(np.prod(iteration_shape(problem), dtype=np.int64))
        dims, strides = [0] * MAX_RANK, [[0] * MAX_RANK for _ in range(MAX_IN)]
        if runtime_dims(problem):  # the collapsed dims of this call and each input's dense strides over them
            shape = iteration_shape(problem)
            dims[:len(shape)] = shape
            for i, (s, _) in enumerate(problem.flag("inputs")):
                own = contiguous_strides(s)
                strides[i][:len(s)] = [st if d != 1 else 0 for d, st in zip(s, own, strict=True)]
        return ([Field(f"in{i}", "ptr", f"x{i}" if i < nin else "") for i in range(MAX_IN)]
                + [Field(f"out{k}", "ptr", f"y{k}" if k < nout else "") for k in range(MAX_OUT)]
                + [Field("n", "i64", n)] + [Field(f"dims{j}", "i64", d) for j, d in enumerate(dims)]
                + [Field(f"strides{i}_{j}", "i64", st[j]) for i, st in enumerate(strides) for j in range(MAX_RANK)])

    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        shape = iteration_shape(problem)
        return {f"y{k}": (shape, problem.dtype) for k in range(len(problem.flag("outputs")))}

    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        shape = iteration_shape(problem)
        xs = []
        for i, ((s, kind), lay, roll) in enumerate(zip(problem.flag("inputs"), input_layouts(problem),
                                                        input_rolls(problem), strict=True)):
            a = inputs[f"x{i}"]
            a = from_storage(a, problem.dtype) if kind == "float" else np.asarray(a).astype(np.float64)
            a = a.reshape(s) if lay is None else view_of(a, s, lay)
            xs.append(a if roll is None else np.roll(a, -roll[1], axis=roll[0]))
        ts: list[np.ndarray] = []

        def val(r: Ref) -> Any:
            return xs[r[1]] if r[0] == "x" else ts[r[1]] if r[0] == "t" else float(np.float32(r[1]))

        with np.errstate(all="ignore"):
            for op, refs, attr in problem.flag("program"):
                ts.append(np.asarray(_np_op(op, [val(r) for r in refs], attr), np.float64))
        out = {}
        n = int(np.prod(shape, dtype=np.int64))
        for k, (r, st) in enumerate(zip(problem.flag("outputs"), output_strides(problem), strict=True)):
            y = np.broadcast_to(val(r), shape).astype(np.float64)
            if tuple(st) != contiguous_strides(shape):  # stored transposed: element i at sum(i_k * strides_k)
                flat = np.empty(n, np.float64)
                flat[view_of(np.arange(n), shape, (shape, st, 0)).reshape(-1)] = y.reshape(-1)
                y = flat.reshape(shape)
            out[f"y{k}"] = y
        return out

    def random_inputs(self, problem: Problem, seed: int) -> dict[str, np.ndarray]:
        """Normal values (|x| >= 0.05, never zero), positive in [0.5, 2) for inputs read by Sqrt, Log, Pow, or as a
        divisor / Reciprocal operand; bools alternate at random, integers in [0, 3)."""
        rng = np.random.default_rng(seed)
        positive = set()
        for op, refs, _ in problem.flag("program"):
            operands = refs[1:] if op == "Div" else refs[:1] if op == "Pow" else refs
            if op in ("Sqrt", "Log", "Pow", "Div", "Reciprocal"):
                positive |= {r[1] for r in operands if r[0] == "x"}
        out = {}
        for i, (_, kind) in enumerate(problem.flag("inputs")):
            s = source_shape(problem, i)
            if kind == "bool":
                out[f"x{i}"] = rng.random(s) < 0.5
            elif kind in ("i32", "i64"):
                out[f"x{i}"] = rng.integers(0, 3, s).astype(KIND_NP[kind])
            elif i in positive:
                out[f"x{i}"] = to_storage(rng.uniform(0.5, 2.0, s), problem.dtype)
            else:
                v = rng.standard_normal(s)
                v = np.where(np.abs(v) < 0.05, np.copysign(0.05, v), v)
                out[f"x{i}"] = to_storage(v, problem.dtype)
        return out


def view_of(source: np.ndarray, shape: Sequence[int], layout: Layout) -> np.ndarray:
    """The view `layout` describes of the array `source`, gathered: element (i0, i1, ...) of the result is element
    base + sum(i_k * strides_k) (+ the rolls' terms) of source, flattened."""
    flat = np.ascontiguousarray(source).reshape(-1)
    idx = np.indices(tuple(shape), dtype=np.int64)
    offset = np.full(tuple(shape), int(layout[2]), np.int64)
    for d, st in enumerate(layout[1]):
        offset += idx[d] * int(st)
    for n, r, q, m, st, ws in layout_rolls(layout):
        t = sum((idx[d] * int(w) for d, w in enumerate(ws)), np.zeros_like(offset)) + int(r)
        offset += t % int(n) // int(q) % int(m) * int(st)
    return flat[offset]


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _hs(attr: Any) -> tuple[float, float]:
    alpha, beta = (0.2, 0.5) if attr is None else attr
    return float(np.float32(alpha)), float(np.float32(beta))


def _round(x: Any, to: str) -> Any:
    if to == "bool":
        return (np.asarray(x) != 0).astype(np.float64)
    if to == "f16":
        return np.asarray(x, np.float16).astype(np.float64)
    if to == "bf16":
        return from_storage(to_storage(np.asarray(x, np.float64), "bf16"), "bf16")
    if to == "f32":
        return np.asarray(x, np.float32).astype(np.float64)
    return np.asarray(x, np.float64)


def _np_op(op: str, a: list[Any], attr: Any) -> Any:
    x = a[0]
    table = {
        "Add": lambda: a[0] + a[1], "Sub": lambda: a[0] - a[1], "Mul": lambda: a[0] * a[1],
        "Div": lambda: a[0] / a[1], "Pow": lambda: np.power(a[0], a[1]), "Sqrt": lambda: np.sqrt(x),
        "Reciprocal": lambda: 1.0 / np.asarray(x), "Neg": lambda: -np.asarray(x), "Abs": lambda: np.abs(x),
        "Exp": lambda: np.exp(x), "Log": lambda: np.log(x), "Tanh": lambda: np.tanh(x), "Erf": lambda: _erf(x),
        "Sigmoid": lambda: 1.0 / (1.0 + np.exp(-np.asarray(x))), "Relu": lambda: np.where(x > 0, x, 0.0),
        "LeakyRelu": lambda: np.where(x >= 0, x, (0.01 if attr is None else float(np.float32(attr))) * x),
        "Gelu": lambda: (0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))) if attr == "tanh"
        else 0.5 * x * (1 + _erf(x / np.sqrt(2.0))),
        "Max": lambda: np.maximum(a[0], a[1]), "Min": lambda: np.minimum(a[0], a[1]),
        "Where": lambda: np.where(np.asarray(a[0]) != 0, a[1], a[2]), "Cast": lambda: _round(x, attr),
        "Identity": lambda: x,
        "PRelu": lambda: np.where(a[0] >= 0, a[0], a[1] * a[0]),
        "Elu": lambda: np.where(x >= 0, x, float(np.float32(1.0 if attr is None else attr)) * np.expm1(x)),
        "Softplus": lambda: np.logaddexp(0.0, x), "Softsign": lambda: x / (1.0 + np.abs(x)),
        "HardSigmoid": lambda: np.clip(_hs(attr)[0] * x + _hs(attr)[1], 0.0, 1.0),
        "HardSwish": lambda: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0), "Floor": lambda: np.floor(x),
        "Ceil": lambda: np.ceil(x), "Round": lambda: np.round(x), "Sign": lambda: np.sign(x),
        "Sin": lambda: np.sin(x), "Cos": lambda: np.cos(x), "IsNaN": lambda: np.isnan(x),
        "Equal": lambda: a[0] == a[1], "Less": lambda: a[0] < a[1], "LessOrEqual": lambda: a[0] <= a[1],
        "Greater": lambda: a[0] > a[1], "GreaterOrEqual": lambda: a[0] >= a[1],
        "Not": lambda: np.asarray(x) == 0, "And": lambda: (np.asarray(a[0]) != 0) & (np.asarray(a[1]) != 0),
        "Or": lambda: (np.asarray(a[0]) != 0) | (np.asarray(a[1]) != 0),
        "Xor": lambda: (np.asarray(a[0]) != 0) ^ (np.asarray(a[1]) != 0),
    }
    return table[op]()


FAMILY = ElementwiseFamily()




KERNELS = (FAMILY,)
OPS = ()
"""None: an elementwise node's Problem is its program, which its binder reads (families.elementwise.bind)."""


CONSTANTS = (ElementwiseConstants,)
"""The groups of constants of this family's estimates, which `onnx-gtco calibration fit` fits per GPU (tune/fit.py)."""
