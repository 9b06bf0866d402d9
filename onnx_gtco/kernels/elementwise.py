"""Elementwise kernel family (plugins/include/gtco/elementwise.cuh): a chain or tree of elementwise ONNX ops,
computed as one fp32 expression per element, with numpy broadcasting of the inputs over a flattened index.

Only the program is generated (plugins/include/gtco/elementwise.cu.j2): its storage type, its iteration shape
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
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

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
from onnx_gtco.kernels.layernorm import C_TYPES, ITEM_BYTES, arch_tag
from onnx_gtco.kernels.render import macro

MAX_IN, MAX_OUT, MAX_RANK = 8, 4, 6
KINDS = {"float": None, "bool": "uint8_t", "i32": "int32_t", "i64": "int64_t"}
KIND_NP = {"bool": np.bool_, "i32": np.int32, "i64": np.int64}
TEMPLATE = "include/gtco/elementwise.cu.j2"  # under plugins/
# op -> number of operands (None: two or more)
ARITY = {"Add": 2, "Sub": 2, "Mul": 2, "Div": 2, "Pow": 2, "Sqrt": 1, "Reciprocal": 1, "Neg": 1, "Abs": 1,
         "Exp": 1, "Log": 1, "Tanh": 1, "Erf": 1, "Sigmoid": 1, "Relu": 1, "LeakyRelu": 1, "Gelu": 1, "Max": 2,
         "Min": 2, "Where": 3, "Cast": 1, "Identity": 1, "PRelu": 2, "Elu": 1, "Softplus": 1, "Softsign": 1,
         "HardSigmoid": 1, "HardSwish": 1, "Floor": 1, "Ceil": 1, "Round": 1, "Sign": 1, "Sin": 1, "Cos": 1,
         "Equal": 2, "Less": 2, "LessOrEqual": 2, "Greater": 2, "GreaterOrEqual": 2, "Not": 1, "And": 2, "Or": 2,
         "Xor": 2}
# boolean values (comparisons, Not/And/Or/Xor, Cast to bool, bool inputs) are 1.0f / 0.0f in the fp32 program
CAST_TARGETS = ("f16", "bf16", "f32", "f64", "bool")
_COMPARE = {"Equal": "==", "Less": "<", "LessOrEqual": "<=", "Greater": ">", "GreaterOrEqual": ">="}

Ref = tuple[str, Any]
Instr = tuple[str, tuple[Ref, ...], Any]
# (source shape, element strides over the view, base[, terms]); a term (n, r, q, m, stride, weights over the view dims)
# adds ((sum_d i_d * weights_d + r) % n // q % m) * stride to the offset (see the module doc)
Layout = tuple[Any, ...]
Term = tuple[int, int, int, int, int, tuple[int, ...]]


@dataclass(frozen=True)
class Program:
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[tuple[str, Ref], ...]
    layouts: tuple[Layout | None, ...] = ()
    out_strides: tuple[tuple[int, ...] | None, ...] = ()  # per output: store strides over the iteration shape

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.broadcast_shapes(*(s for _, s, _ in self.inputs))) if self.inputs else ()

    def problem(self, dtype: str) -> Problem:
        return elementwise_problem(dtype, self.shape, self.instrs, tuple(
            (s, k) for _, s, k in self.inputs), tuple(r for _, r in self.outputs), self.layouts, self.out_strides)


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
        flags["layouts"] = tuple(None if lay is None else _canonical_layout(lay) for lay in layouts)
    if any(st is not None for st in out_strides):
        flags["out_strides"] = tuple(None if st is None else tuple(int(v) for v in st) for st in out_strides)
    return Problem.make("elementwise", dtype, {f"d{i}": int(d) for i, d in enumerate(shape)}, flags)


def _canonical_layout(lay: Sequence[Any]) -> Layout:
    head = (tuple(int(d) for d in lay[0]), tuple(int(d) for d in lay[1]), int(lay[2]))
    terms = tuple((*(int(v) for v in t[:5]), tuple(int(w) for w in t[5])) for t in (lay[3] if len(lay) > 3 else ()))
    return (*head, terms) if terms else head


def layout_rolls(lay: Layout | None) -> tuple[Term, ...]:
    """The terms of a layout (none for None or a plain strided view)."""
    return tuple(lay[3]) if lay is not None and len(lay) > 3 else ()


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


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major tensor of `shape`."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return tuple(out[::-1])


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
            "Not": "{ns}::lnot({})"}
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


def _program(problem: Problem, storage: str, ns: str) -> dict[str, Any]:
    """What elementwise.cu.j2 writes of a program: its storage type, iteration shape and collapsed dims, operands
    (element type, strides over those dims), one fp32 expression per instruction (op math in namespace `ns`), the
    outputs, and the instructions listed for a comment."""
    instrs, inputs, outputs = problem.flag("program"), problem.flag("inputs"), problem.flag("outputs")
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

    def value(r: Ref) -> str:
        return f"x[{r[1]}]" if r[0] == "x" else f"t{r[1]}" if r[0] == "t" else _lit(r[1])

    return {"storage": storage, "shape": shape, "dims": dims,
            "inputs": [{"type": KINDS[k] or "T", "strides": st, "base": 0 if lay is None else lay[2], "rolls": ro}
                       for (_, k), st, lay, ro in zip(inputs, strides[:len(inputs)], layouts, rolls, strict=True)],
            "body": [_expr(op, [value(r) for r in refs], refs, attr, ns) for op, refs, attr in instrs],
            "outputs": [value(r) for r in outputs], "out_strides": out_strides,
            "listing": "; ".join(f"t{j} = {op}({', '.join(map(str, refs))}){'' if a is None else f' [{a}]'}"
                                 for j, (op, refs, a) in enumerate(instrs))}


# ---------------------------------------------------------------------------------------------------------------
# the family
# ---------------------------------------------------------------------------------------------------------------

class ElementwiseFamily(KernelFamily):
    name = "elementwise"
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

    def instantiate(self, problem: Problem, config: Config, arch: str) -> Instance:
        why = self.check(problem, config, arch)
        if why is not None:
            raise ValueError(f"elementwise: {why}")
        threads, vec = int(config["THREADS"]), int(config["VEC"])
        instrs, inputs, outputs = problem.flag("program"), problem.flag("inputs"), problem.flag("outputs")
        n = int(np.prod(iteration_shape(problem), dtype=np.int64))
        views = () if problem.flag("layouts") is None else (problem.flag("layouts"),)
        digest = hashlib.sha1(repr((problem.sizes, instrs, inputs, outputs, *views)).encode()).hexdigest()[:8]
        ops = [op.lower() for op, _, _ in instrs if op != "Identity"]
        tag = "_".join(ops[:6]) + (f"_{len(ops) - 6}more" if len(ops) > 6 else "") or "copy"
        name = f"elementwise_{arch_tag(arch)}_{problem.dtype}_{tag}_n{n}_t{threads}_v{vec}_{digest}"
        source = macro(TEMPLATE, "instance", name=name, symbol=f"gtco_{name}", threads=threads, vec=vec,
                       **_program(problem, C_TYPES[problem.dtype], "gtco::ew"))
        return Instance(name, f"gtco_{name}", source, problem, dict(config), arch, 0)

    def host_function(self, problem: Problem) -> tuple[str, str]:
        """The symbol and C++ source of `problem` as a plain host function (plugins/cpu/elementwise_ref.h).

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
        instrs, inputs, outputs = problem.flag("program"), problem.flag("inputs"), problem.flag("outputs")
        views = () if problem.flag("layouts") is None else (problem.flag("layouts"),)
        key = (problem.dtype, problem.sizes, instrs, inputs, outputs, *views)
        digest = hashlib.sha1(repr(key).encode()).hexdigest()
        symbol = f"gtco_elementwise_host_{problem.dtype}_{digest[:12]}"
        storage = {"f32": "float", "f16": "gtco::ref::ew::f16", "bf16": "gtco::ref::ew::bf16"}[problem.dtype]
        return symbol, macro(TEMPLATE, "host_function", symbol=symbol, **_program(problem, storage, "gtco::ref::ew"))

    def args_fields(self, problem: Problem, arrays: Mapping[str, np.ndarray]) -> list[Field]:
        nin, nout = len(problem.flag("inputs")), len(problem.flag("outputs"))
        n = int(np.prod(iteration_shape(problem), dtype=np.int64))
        return ([Field(f"in{i}", "ptr", f"x{i}" if i < nin else "") for i in range(MAX_IN)]
                + [Field(f"out{k}", "ptr", f"y{k}" if k < nout else "") for k in range(MAX_OUT)]
                + [Field("n", "i64", n)])

    def outputs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        shape = iteration_shape(problem)
        return {f"y{k}": (shape, problem.dtype) for k in range(len(problem.flag("outputs")))}

    def reference(self, problem: Problem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        shape = iteration_shape(problem)
        xs = []
        for i, ((s, kind), lay) in enumerate(zip(problem.flag("inputs"), input_layouts(problem), strict=True)):
            a = inputs[f"x{i}"]
            a = from_storage(a, problem.dtype) if kind == "float" else np.asarray(a).astype(np.float64)
            xs.append(a.reshape(s) if lay is None else view_of(a, s, lay))
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
        "Sin": lambda: np.sin(x), "Cos": lambda: np.cos(x),
        "Equal": lambda: a[0] == a[1], "Less": lambda: a[0] < a[1], "LessOrEqual": lambda: a[0] <= a[1],
        "Greater": lambda: a[0] > a[1], "GreaterOrEqual": lambda: a[0] >= a[1],
        "Not": lambda: np.asarray(x) == 0, "And": lambda: (np.asarray(a[0]) != 0) & (np.asarray(a[1]) != 0),
        "Or": lambda: (np.asarray(a[0]) != 0) | (np.asarray(a[1]) != 0),
        "Xor": lambda: (np.asarray(a[0]) != 0) ^ (np.asarray(a[1]) != 0),
    }
    return table[op]()


FAMILY = ElementwiseFamily()


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
                      outputs: Sequence[str], constants: Mapping[str, Any] | None = None) -> Program:
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
    consts: dict[str, float] = {}
    for k, v in (constants or {}).items():
        arr = _const_array(v)
        if arr.size == 1:
            consts[k] = float(arr.reshape(()))
    prog_inputs: list[tuple[str, tuple[int, ...], str]] = []
    layouts: list[Layout | None] = []
    env: dict[str, tuple[Ref, tuple[int, ...]]] = {}  # tensor -> (ref, shape)
    flat: dict[str, tuple[int, ...]] = {}  # a computed value reshaped freely -> its shape before: an output only
    transposed: dict[str, tuple[str, list[int]]] = {}  # a Transpose of an input's view -> (that view, perm)
    for name, shape, kind in items:
        env[name] = (("x", len(prog_inputs)), shape)
        prog_inputs.append((name, shape, kind))
        layouts.append(None)
    # every constant array by name (initializers and the group's Constant nodes): view ops read their shape or
    # axes from here; a non-scalar one read by a computing op must be passed as an input instead
    arrays = {k: _const_array(v) for k, v in (constants or {}).items()}
    big_consts = {k for k, v in arrays.items() if v.size != 1}

    # topological order over the group's own edges
    pending = list(nodes)
    produced = {o for n in pending for o in n.output}
    ordered = []
    while pending:
        ready = [n for n in pending if all(i not in produced or any(i in m.output for m in ordered)
                                           for i in n.input if i)]
        if not ready:
            raise ValueError("elementwise: the nodes form a cycle")
        ordered += ready
        pending = [n for n in pending if n not in ready]

    instrs: list[Instr] = []

    def get(tensor: str, node: Any) -> tuple[Ref, tuple[int, ...]]:
        if tensor in flat and node.op_type not in _VIEW_OPS:
            raise ValueError(f"elementwise: {node.op_type} {node.name!r} reads {tensor!r}, a computed value reshaped "
                             f"{flat[tensor]} -> {env[tensor][1]}, which moves its broadcast axes: a computed value "
                             "may only gain or lose leading 1s before another op reads it (reshape the group's "
                             "inputs instead)")
        if tensor in env:
            return env[tensor]
        if tensor in consts:
            return ("c", consts[tensor]), ()
        if tensor in big_consts:
            raise ValueError(f"elementwise: constant {tensor!r} read by {node.op_type} {node.name!r} is not a "
                             "scalar: pass it as an input")
        raise ValueError(f"elementwise: {node.op_type} {node.name!r} reads {tensor!r}, which is neither an input, "
                         "a constant nor computed in the group")

    def attr(node: Any, key: str, default: Any = None) -> Any:
        from onnx import helper

        for a in node.attribute:
            if a.name == key:
                return helper.get_attribute_value(a)
        return default

    def operands(node: Any) -> tuple[list[tuple[Ref, tuple[int, ...]]], tuple[int, ...] | None]:
        """The operands of a computing node, and the shape before the reshape where it reads freely reshaped values
        (all from one shape, at the node's full shape): then the iteration runs in that shape, and the node's other
        operands, group inputs or scalars, are read through the same reshape as views (None: no such operand)."""
        names = [t for t in node.input if t]
        before = {flat[t] for t in names if t in flat}
        if not before:
            return [get(t, node) for t in names], None
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
            ref, shape = get(t, node)
            if ref[0] == "c" or all(d == 1 for d in shape):
                args.append((ref, ()))
                continue
            if ref[0] != "x":
                raise ValueError(f"elementwise: {node.op_type} {node.name!r} reads the computed value {t!r} {shape} "
                                 f"with values reshaped {pre} -> {full}: only group inputs are read through the "
                                 "reshape")
            name, _, kind = prog_inputs[ref[1]]
            src, strides, base, rolls = view_of_input(ref[1], shape)
            moved = _reshape_view(full, _widen(shape, full, strides),
                                  [(*t[:5], _widen(shape, full, t[5])) for t in rolls], pre)
            if moved is None:
                raise ValueError(f"elementwise: {node.op_type} {node.name!r}: {t!r} {shape} cannot be read through "
                                 f"the reshape {full} -> {pre} as a view")
            args.append((("x", len(prog_inputs)), pre))
            prog_inputs.append((name, pre, kind))
            layouts.append(_canonical_layout((src, moved[0], base, moved[1])))
        return args, pre

    def view_of_input(i: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], list[int], int, list[Any]]:
        """(source shape, strides, base, rolls) of program input i of `shape`."""
        lay = layouts[i]
        if lay is None:
            return shape, list(contiguous_strides(shape)), 0, []
        return tuple(lay[0]), list(lay[1]), int(lay[2]), list(layout_rolls(lay))

    def add_view(node: Any, i: int, shape: tuple[int, ...], strides: Sequence[int], base: int,
                 rolls: Sequence[Any]) -> None:
        name, _, kind = prog_inputs[i]
        env[node.output[0]] = (("x", len(prog_inputs)), shape)
        prog_inputs.append((name, shape, kind))
        layouts.append(_layout_or_none(view_of_input(i, prog_inputs[i][1])[0], shape, strides, base, rolls))

    def emit(op: str, refs: list[Ref], a: Any = None) -> Ref:
        instrs.append((op, tuple(refs), a))
        return ("t", len(instrs) - 1)

    for node in ordered:
        op = node.op_type
        where = f"{op} {node.name!r}"
        if node.domain not in ("", "ai.onnx") and not (node.domain == "com.microsoft" and op == "Gelu"):
            raise ValueError(f"elementwise: unsupported op {node.domain}.{op} (node {node.name!r})")
        if op == "Constant":
            values = [attr(node, k) for k in ("value", "value_float", "value_floats", "value_int", "value_ints")]
            if all(v is None for v in values):
                raise ValueError(f"elementwise: Constant {node.name!r} has no numeric value attribute")
            arr = _const_array(next(v for v in values if v is not None))
            arrays[node.output[0]] = arr
            if arr.size != 1:
                big_consts.add(node.output[0])  # a shape or axes operand, unless a computing op reads it
            else:
                consts[node.output[0]] = float(arr.reshape(()))
            continue
        if op in LAYOUT_OPS:
            ins = [get(t, node) for t in (node.input if op == "Concat" else node.input[:1])]
            if any(ref[0] != "x" for ref, _ in ins):
                raise ValueError(f"elementwise: {where} moves the elements of a computed value or a constant: a "
                                 "layout op is folded only into the load of a group input")
            if op == "Concat":
                views = [(shape, *view_of_input(ref[1], shape)[1:]) for ref, shape in ins]
                names = {prog_inputs[ref[1]][0] for ref, _ in ins}
                rolled = _concat_roll(node, views, int(attr(node, "axis", 0))) if len(names) == 1 else None
                if rolled is None:
                    raise ValueError(f"elementwise: {where}: only the Concat of a torch.roll (the two slices of one "
                                     "tensor, swapped) is folded")
                add_view(node, ins[0][0][1], *rolled)
                continue
            (ref, shape), = ins
            _, strides, base, rolls = view_of_input(ref[1], shape)
            add_view(node, ref[1], *_layout_view(node, shape, strides, base, rolls, consts, attr, arrays))
            if op == "Transpose":
                transposed[node.output[0]] = (node.input[0], [int(p) % len(shape) for p in (
                    attr(node, "perm") or list(range(len(shape)))[::-1])])
            continue
        if op in _VIEW_OPS:
            tensor = node.input[0]
            ref, shape = get(tensor, node)
            new = _view_shape(node, shape, consts, attr, arrays)
            moved = None
            if ref[0] == "x" and tensor not in flat:
                _, strides, base, rolls = view_of_input(ref[1], shape)
                moved = _reshape_view(shape, strides, rolls, new)
            if ref[0] == "c":
                env[node.output[0]] = (ref, ())
            elif moved is not None:
                add_view(node, ref[1], new, moved[0], base, moved[1])
            elif ref[0] == "t" and _strip_leading_ones(new) == _strip_leading_ones(shape) and tensor not in flat:
                env[node.output[0]] = (ref, new)  # only adds or drops leading 1s: the broadcast is unchanged
            else:
                # a reshape that is no view (of a computed value, or merging dims a view walks apart): the kernel
                # writes the value densely in its own shape's order, which is this reshape's as well, so it is free
                # as long as only outputs read it
                env[node.output[0]] = (ref, new)
                flat[node.output[0]] = flat.get(tensor, shape)
            continue
        if op not in ARITY and op not in ("Sum", "Mean", "Clip"):
            raise ValueError(f"elementwise: unsupported op {op!r} (node {node.name!r}); supported: "
                             f"{', '.join(sorted([*ARITY, 'Sum', 'Mean', 'Clip', *_VIEW_OPS, *LAYOUT_OPS]))}")
        args, pre = operands(node)
        refs = [r for r, _ in args]
        shape = _broadcast([s for _, s in args], node)
        if not refs:
            raise ValueError(f"elementwise: {where} has no operand")
        if op in ("Max", "Min", "Sum", "Mean"):
            out = refs[0]
            for r in refs[1:]:
                out = emit(op if op in ("Max", "Min") else "Add", [out, r])
            if op == "Mean" and len(refs) > 1:
                out = emit("Div", [out, ("c", float(len(refs)))])
            elif len(refs) == 1:
                out = emit("Identity", [out])
        elif op == "Clip":
            # opset 11+: optional min / max inputs (an empty name skips one); before: min / max attributes
            out = get(node.input[0], node)[0]
            bounds = []
            for pos, key, default in ((1, "min", None), (2, "max", None)):
                if len(node.input) > pos and node.input[pos]:
                    bounds.append((key, get(node.input[pos], node)[0]))
                elif attr(node, key, default) is not None:
                    bounds.append((key, ("c", float(attr(node, key)))))
            for key, r in bounds:
                out = emit("Max" if key == "min" else "Min", [out, r])
            if not bounds:
                out = emit("Identity", [out])
        elif op == "Elu":
            out = emit(op, refs, float(attr(node, "alpha", 1.0)))
        elif op == "HardSigmoid":
            out = emit(op, refs, (float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5))))
        elif op == "Pow":
            out = emit("Pow", refs)
        elif op == "LeakyRelu":
            out = emit(op, refs, float(attr(node, "alpha", 0.01)))
        elif op == "Gelu":
            approx = attr(node, "approximate", b"none")
            approx = approx.decode() if isinstance(approx, bytes) else str(approx)
            out = emit(op, refs, approx)
        elif op == "Cast":
            out = emit(op, refs, _onnx_cast_target(int(attr(node, "to"))))
        else:
            if len(refs) != ARITY[op]:
                raise ValueError(f"elementwise: {where} has {len(refs)} operands, {ARITY[op]} supported")
            out = emit(op, refs)
        if pre is None:
            env[node.output[0]] = (out, shape)
        else:  # computed in the shape before the reshape: the node's own shape is a free reshape of it
            env[node.output[0]] = (out, _broadcast([env[t][1] if t in env else () for t in node.input if t], node))
            flat[node.output[0]] = shape

    for name in outputs:
        if name not in env:
            raise ValueError(f"elementwise: output {name!r} is not computed by the group")
    stores = _transposed_stores(outputs, env, flat, transposed)
    for name, (src, _) in stores.items():
        env[name] = env[src]  # stored transposed: the program computes the value before the Transpose
    # drop inputs only a view op read (their reshaped alias is what the program uses); the iteration shape is
    # the broadcast of the inputs the program reads
    used = {r[1] for _, refs, _ in instrs for r in refs if r[0] == "x"} | {
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
            raise ValueError(f"elementwise: output {name!r} is stored transposed from {s}, not the iteration shape "
                             f"{shape}")
        outs.append((name, ref))
    out_strides = []
    for name in outputs:
        if name not in stores:
            out_strides.append(None)
            continue
        perm = stores[name][1]  # output index j_k = iteration index i_perm[k]
        dense = contiguous_strides([shape[p] for p in perm])
        st = [0] * len(shape)
        for k, p in enumerate(perm):
            st[p] = dense[k]
        out_strides.append(tuple(st))
    remap = {old: new for new, old in enumerate(keep)}

    def fix(r: Ref) -> Ref:
        return ("x", remap[r[1]]) if r[0] == "x" else r

    kept_layouts = tuple(layouts[i] for i in keep)
    return Program(tuple(prog_inputs[i] for i in keep),
                   tuple((op, tuple(fix(r) for r in refs), a) for op, refs, a in instrs),
                   tuple((n, fix(r)) for n, r in outs),
                   kept_layouts if any(lay is not None for lay in kept_layouts) else (),
                   tuple(out_strides) if any(st is not None for st in out_strides) else ())


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
    return _canonical_layout((src, strides, base, rolls))


def _reshape_view(old: Sequence[int], strides: Sequence[int], rolls: Sequence[Any], new: Sequence[int]
                  ) -> tuple[list[int], list[Any]] | None:
    """(strides, rolls) of `new` over a view of `old`, or None when the reshape is no view: the strides and every
    roll's weights must each stay a view (_reshape_strides)."""
    moved = _reshape_strides(old, strides, new)
    out = []
    for t in rolls:
        w = _reshape_strides(old, t[5], new)
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


def _reshape_strides(old: Sequence[int], strides: Sequence[int], new: Sequence[int]) -> list[int] | None:
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
