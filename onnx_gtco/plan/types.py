"""Frozen records that planning produces: candidate groups, rejections and the plan."""

from __future__ import annotations

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
        rejects: segments the search left unfused because they passed the state budget, and why.
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


__all__ = ["Candidate", "Plan", "Reject", "freeze_attrs"]
