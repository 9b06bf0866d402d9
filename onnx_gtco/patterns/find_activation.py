"""Recognise an activation epilogue by what it computes, whatever order the exporter wrote its operands in.

From a tensor x, the elementwise nodes that read only x, each other and scalar constants form a small
subgraph; each of its prefixes ending in one node is evaluated on sample points and compared with the
reference functions below (GELU erf/tanh forms, ReLU, SiLU, QuickGELU, ...). So `x*0.5*(1+erf(x/1.4142))`,
`0.5*x*(1+erf(x*0.7071))` and the `Gelu` op are all "gelu_erf", and `x*x*x` or `Pow(x, 3)` in the tanh form
are both "gelu_tanh".

The comparison allows for the type the subgraph computes in (patterns.util.tolerance): in fp16 or bf16 its
constants are rounded (sqrt(2) is 1.4140625), so it is compared with the type's rounding error, and where that
admits two references (GELU's erf and tanh forms differ by 5e-4) the nearer one names it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np

from onnx_gtco.ir.labels import Label, label
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.util import coarsest, read_only_by, tensor_dtype, tolerance

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sig(a: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-a))


def _gelu_tanh(a: np.ndarray) -> np.ndarray:
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))


REFERENCE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda a: np.maximum(a, 0.0),
    "gelu_erf": lambda a: 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0))),
    "gelu_tanh": _gelu_tanh,
    "silu": lambda a: a * _sig(a),
    "quick_gelu": lambda a: a * _sig(1.702 * a),
    "sigmoid": _sig,
    "tanh": np.tanh,
    "relu6": lambda a: np.clip(a, 0.0, 6.0),
}
_FLOAT_TYPES = (1, 10, 11, 16)  # float, float16, double, bfloat16
_SAMPLES = np.linspace(-12.0, 12.0, 97)  # past 6, so Clip(0, 6) is not taken for Relu
MAX_NODES = 10

_OPS: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
    "Max": np.maximum, "Min": np.minimum, "Erf": _erf, "Tanh": np.tanh, "Sigmoid": _sig, "Exp": np.exp,
    "Sqrt": np.sqrt, "Neg": np.negative, "Abs": np.abs, "Reciprocal": lambda a: 1.0 / a,
    "Relu": lambda a: np.maximum(a, 0.0), "Identity": lambda a: a, "Cast": lambda a: a,
}


def _eval(node: Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    if node.op_type == "Gelu":
        tanh = node.attrs.get("approximate", b"none") in (b"tanh", "tanh")
        return (_gelu_tanh if tanh else REFERENCE["gelu_erf"])(args[0])
    if node.op_type == "Clip":
        lo = args[1] if len(args) > 1 and args[1] is not None else -np.inf
        hi = args[2] if len(args) > 2 and args[2] is not None else np.inf
        return np.clip(args[0], lo, hi)
    if node.op_type == "Cast" and node.attrs.get("to") not in _FLOAT_TYPES:
        return None
    fn = _OPS.get(node.op_type)
    if fn is None or any(a is None for a in args):
        return None
    return fn(*args)


def _closed_subgraph(view: GraphView, x: str) -> list[Node]:
    """Elementwise nodes reachable from x whose inputs are x, each other or one-element constants."""
    inside: set[str] = {x}
    out: list[Node] = []
    heap = [c.id for c in view.consumers_of(x)]
    heapq.heapify(heap)
    seen: set[int] = set()
    while heap and len(out) < MAX_NODES:
        i = heapq.heappop(heap)
        if i in seen:
            continue
        seen.add(i)
        n = view.nodes[i]
        if label(n.op_type, n.domain) != Label.ELEMENTWISE or len(n.outputs) != 1:
            continue
        if not all(t in inside or (t and view.is_constant(t) and view.const_value(t).size == 1)  # type: ignore[union-attr]
                   for t in n.inputs if t):
            continue
        out.append(n)
        inside.add(n.outputs[0])
        for c in view.consumers_of(n.outputs[0]):
            heapq.heappush(heap, c.id)
    return out


def find_activation(view: GraphView, x: str) -> tuple[str, frozenset[int], str] | None:
    """The largest activation applied to x alone: (name, node ids, output tensor), or None.

    x must be read only by the activation's nodes, and only its last node's output may leave it.
    """
    sub = _closed_subgraph(view, x)
    best: tuple[str, frozenset[int], str] | None = None
    for k, sink in enumerate(sub):
        ids = _ancestors_within(sub[: k + 1], sink)
        if any(c.id not in ids for c in view.consumers_of(x)):
            continue
        if any(not read_only_by(view, view.nodes[i], ids) for i in ids if i != sink.id):
            continue
        name = _identify(view, x, [n for n in sub if n.id in ids])
        if name is not None and (best is None or len(ids) > len(best[1])):
            best = (name, ids, sink.outputs[0])
    return best


def _ancestors_within(prefix: list[Node], sink: Node) -> frozenset[int]:
    made = {n.outputs[0]: n for n in prefix}
    keep = {sink.id}
    stack = [sink]
    while stack:
        n = stack.pop()
        for t in n.inputs:
            p = made.get(t)
            if p is not None and p.id not in keep:
                keep.add(p.id)
                stack.append(p)
    return frozenset(keep)


def _identify(view: GraphView, x: str, nodes: list[Node]) -> str | None:
    env: dict[str, np.ndarray] = {x: _SAMPLES}
    with np.errstate(all="ignore"):
        for n in nodes:
            args = [env.get(t) if t in env else _const(view, t) for t in n.inputs]
            val = _eval(n, args)
            if val is None:
                return None
            env[n.outputs[0]] = np.broadcast_to(np.asarray(val, dtype=np.float64), _SAMPLES.shape)
        y = env[nodes[-1].outputs[0]]
        tol = tolerance(compute_dtype(view, x, nodes))
        best: tuple[float, str] | None = None
        for name, ref in REFERENCE.items():
            r = ref(_SAMPLES)
            if not np.allclose(y, r, rtol=tol, atol=tol):
                continue
            err = float(np.max(np.abs(y - r) / (tol + tol * np.abs(r))))
            if best is None or err < best[0]:
                best = (err, name)
    return None if best is None else best[1]


def compute_dtype(view: GraphView, x: str, nodes: list[Node]) -> int:
    """The least precise float type among x, the tensors the nodes read and write: a constant rounded to fp16 or
    an fp16 intermediate limits the whole activation to fp16's precision."""
    tensors = {x} | {t for n in nodes for t in (*n.inputs, *n.outputs) if t}
    return coarsest(tensor_dtype(view, t) for t in tensors)


def _const(view: GraphView, t: str) -> np.ndarray | None:
    if not t:
        return None
    val = view.const_value(t)
    return None if val is None else np.asarray(val, dtype=np.float64).reshape(())
