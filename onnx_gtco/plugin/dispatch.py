"""Dynamic shapes in the library: the declared ranges a node checks at run time, and the dispatch table its device
kernel launches from.

A rewritten model with symbolic dims carries the declared ranges in its metadata, `gtco.dynamic` =
``"batch=1:64,seq=1:512"``. For each bound node:

- ranges: every (input, axis) whose dim is a declared name, with its [lo, hi]. The glue checks them on every call,
  on the CPU path and the device path alike: a size outside its range is an ORT error naming the op, the node, the
  dim and the range.
- extent: the (input, axis) dims whose product is the node's run-time extent (`onnx_gtco.kernels.dynamic`): a GEMM's
  M (A's leading dims, or A's row dim of a batched GEMM), attention's query length (the seq axis of q's layout),
  LayerNorm's and Softmax's rows (every dim of x but the last).
- table: per arch, (max_extent, Instance) entries in ascending max_extent; a call launches the first entry whose
  max_extent is at least its extent, the last one covering everything above. A node whose extent has a symbolic dim
  gets one: the caller's (`build_library(dispatch=...)`, the tuner's), or by default the family's analytical choice
  (`select_instance` on `with_extent(problem, top)`) for the bucket tops of `BUCKETS` under the extent's top, with
  neighbouring buckets of the same instance merged. Static nodes keep their one instance.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from onnx_gtco.calibration import Hardware
from onnx_gtco.errors import GtcoError
from onnx_gtco.kernels.dynamic import extent_name, with_extent
from onnx_gtco.kernels.family import Config, Instance, Problem
from onnx_gtco.kernels.select import IMPLEMENTATIONS, candidates, fastest
from onnx_gtco.plugin.binders import binder_for
from onnx_gtco.plugin.binding import Binding, FusedNode

BUCKETS = (16, 64, 256, 1024, 4096, 16384)
"""Default dispatch bucket tops (below the extent's top, which closes the table)."""
TABLE_IMPLS = frozenset({"mma", *(name for name, i in IMPLEMENTATIONS.items() if not i.fallible)})
"""The implementations a default dispatch entry may be: a dispatch entry keeps no mma fallback for an instance that
can fail (plugin.library.node_fallbacks), so none is of a fallible implementation (cuBLASLt) unless the tuner names
it."""

Entry = tuple[int | None, Instance]
"""One dispatch entry: (max_extent, instance); None as max_extent: no upper bound (the extent's top is unknown)."""


@dataclass(frozen=True)
class NodeDynamic:
    """What the glue of one bound node checks and dispatches on.

    Attributes:
        ranges: (input index, axis, lo, hi, dim name) per input dim that is a declared name.
        extent: (input index, axis) of the dims whose product is the run-time extent; () when the node does not
            dispatch on size.
        tables: per arch (the order of the archs built), the dispatch entries; () for a node with one instance.
    """

    ranges: tuple[tuple[int, int, int, int, str], ...] = ()
    extent: tuple[tuple[int, int], ...] = ()
    tables: tuple[tuple[Entry, ...], ...] = ()


def node_ranges(node: FusedNode, ranges: Mapping[str, tuple[int, int]]) -> tuple[tuple[int, int, int, int, str], ...]:
    """(input index, axis, lo, hi, dim) for every input dim of `node` that is a declared name."""
    out = []
    for i, t in enumerate(node.inputs):
        for axis, d in enumerate(t.shape or ()):
            if isinstance(d, str) and d in ranges:
                out.append((i, axis, *ranges[d], d))
    return tuple(out)


def extent_dims(node: FusedNode, binding: Binding) -> tuple[tuple[int, int], ...]:
    """(input index, axis) of the dims whose product is the node's run-time extent (its binder's `extent_dims`, by
    default the leading dims of its first operand: A of a GEMM, x of a row-wise kernel); () when it has none or the
    operand's rank is unknown."""
    if extent_name(node.family) is None or not binding.inputs or binding.inputs[0] < 0:
        return ()
    first = binding.inputs[0]
    shape = node.inputs[first].shape
    if not shape:
        return ()
    own = getattr(binder_for(node.family), "extent_dims", None)
    if own is not None:
        return tuple(own(node, binding))
    return tuple((first, a) for a in range(len(shape) - 1))


def extent_top(node: FusedNode, dims: Sequence[tuple[int, int]], ranges: Mapping[str, tuple[int, int]]
               ) -> tuple[bool, int | None]:
    """(whether the extent has a symbolic dim, its largest value under `ranges`, or None when unbounded)."""
    symbolic, top = False, 1
    for i, axis in dims:
        d = (node.inputs[i].shape or ())[axis]
        if isinstance(d, int) and d > 0:
            top *= d
            continue
        symbolic = True
        if not (isinstance(d, str) and d in ranges):
            return True, None
        top *= ranges[d][1]
    return symbolic, top


def default_table(problem: Problem, arch: str, top: int | None, hw: Hardware | None = None,
                  impls: Container[str] = TABLE_IMPLS) -> tuple[tuple[int | None, Config], ...] | str:
    """The default dispatch table of a dynamic node: (bucket top, the configuration the estimate predicts fastest
    for the problem at that extent on `hw`, of the implementations in `impls`) for each of `BUCKETS` under `top`,
    then `top` itself (None: unbounded, sized as the last bucket), neighbouring buckets with the same config merged;
    or why a bucket has no config."""
    tops: list[int | None] = [b for b in BUCKETS if top is None or b < top]
    tops.append(top)
    out: list[tuple[int | None, Config]] = []
    for t in tops:
        at = with_extent(problem, t if t is not None else BUCKETS[-1])
        pick = fastest(at, arch, candidates(at, arch, impls=impls), hw)
        if pick is None:
            return f"no valid {problem.family} configuration for {arch} at {extent_name(problem.family)}={t}"
        if out and dict(out[-1][1]) == dict(pick[0]):
            out[-1] = (t, out[-1][1])
        else:
            out.append((t, pick[0]))
    return tuple(out)


def check_table(table: Sequence[tuple[int | None, Config]], node: str, arch: str) -> None:
    """Raise GtcoError unless `table` is non-empty with strictly ascending max_extents (None only last)."""
    tops = [t for t, _ in table]
    bounded = tops[:-1] if tops and tops[-1] is None else tops
    if not tops or None in bounded or any(a >= b for a, b in itertools.pairwise(bounded)):  # type: ignore[operator]
        raise GtcoError(f"dispatch table of node {node!r} for {arch}: max_extents {tops} are not ascending "
                         "(or the table is empty)")


def launches(path: str) -> dict[str, list[int]]:
    """Launches per dispatch entry of each dynamic node since the library was loaded into this process (read with
    ctypes from the same file ONNX Runtime loaded: its exported gtco_dispatch_launches). The entries are the glue's:
    with one arch (an emulated build) those of `LibraryResult.dispatch`, with several the union of their
    max_extents."""
    import ctypes
    import json

    f = ctypes.CDLL(str(path)).gtco_dispatch_launches
    f.restype = ctypes.c_char_p
    return {k: [int(x) for x in v] for k, v in json.loads(f().decode()).items()}


def bucket_of(table: Sequence[tuple[int | None, object]], extent: float) -> int:
    """Index of the entry a call with `extent` launches (the first whose max_extent is at least it; None as
    max_extent covers everything, and an extent above every entry takes the last), as the glue looks it up."""
    for k, (top, _) in enumerate(table):
        if top is None or extent <= top:
            return k
    return len(table) - 1
