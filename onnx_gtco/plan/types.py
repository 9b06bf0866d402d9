"""Frozen records that planning produces: candidate groups, rejections and the plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from onnx_gtco.patterns.base import Reject


def freeze_attrs(attrs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Attributes as a sorted tuple of pairs, so records stay hashable; lists become tuples."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))


@dataclass(frozen=True)
class Candidate:
    """A set of nodes that may run as one kernel.

    Attributes:
        nodes: node ids (GraphView order) in the group.
        family: kernel family that would run it, e.g. "attention", "bmm_softmax", "gemm", "layernorm",
            "elementwise"; "unfused" for a single node left as it is.
        pattern: name of the rule that proposed it.
        attrs: what the kernel needs to know (heads, scale, activation, ...), as sorted pairs.
        roles: input role -> tensor, as sorted pairs (patterns.base.Match.roles).
        outputs: output role -> tensor, as sorted pairs.
    """

    nodes: frozenset[int]
    family: str
    pattern: str
    attrs: tuple[tuple[str, Any], ...] = ()
    roles: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    outputs: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def fused(self) -> bool:
        return self.family != "unfused"

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)


@dataclass(frozen=True)
class Plan:
    """The DP's answer: groups in execution order (they cover every node exactly once) and predicted cost (us).

    Attributes:
        states: memoized states the search explored.
        rejects: segments the search covered greedily because they passed the state budget, and why.
        costs: the cost the search charged each group (same order as `groups`; empty when not recorded).
    """

    groups: tuple[Candidate, ...]
    cost_us: float
    states: int = field(default=0, compare=False)
    rejects: tuple[Reject, ...] = field(default=(), compare=False)
    costs: tuple[float, ...] = field(default=(), compare=False)

    @property
    def fused_groups(self) -> tuple[Candidate, ...]:
        return tuple(g for g in self.groups if g.fused)




@dataclass(frozen=True)
class GraphPass:
    """A rewrite of the planner's own, run on the loaded model before the rules match (a family's `passes.py`
    PASSES: the patch embedding as a copy and a GEMM, a block's Q, K and V projections as one GEMM).

    Attributes:
        name: its name, and the report's key for its decisions where it has any.
        order: passes run in ascending order (ties in the registry's order).
        enabled: (the run's GtcoConfig) -> whether it runs.
        run: (model, config, hardware) -> the model it leaves (the one passed in where it rewrote nothing; never
            changed in place) and its decisions, one JSON-able dict each, for the report.
        describe: what it rewrites, for the report ("a patch embedding as a patchify copy and a GEMM").
        title: the report's heading for its decisions' table.
        columns: the table's (header, key) pairs; a key ending in "_us" is a time.
    """

    name: str
    order: int
    enabled: Callable[[Any], bool]
    run: Callable[[Any, Any, Any], tuple[Any, list[dict[str, Any]]]]
    describe: str
    title: str = ""
    columns: tuple[tuple[str, str], ...] = ()


__all__ = ["Candidate", "GraphPass", "Plan", "Reject", "freeze_attrs"]
