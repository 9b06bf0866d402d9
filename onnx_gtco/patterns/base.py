"""What a fusion rule is: it proposes node groups (Match) or explains why not (Reject)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from onnx_gtco.ir.view import GraphView, Node


@dataclass(frozen=True)
class Reject:
    """A match that a rule or the legality checks turned down, and why."""

    pattern: str
    anchor: str
    reason: str


@dataclass(frozen=True)
class Match:
    """A group a rule proposes: its nodes, the kernel family, what the kernel needs to know (attrs, checked
    against the family's opspec.OpSpec when the group is rewritten) and which tensor plays which of its roles
    (roles: input role -> tensor, outputs: output role -> tensor; a role left out is absent)."""

    nodes: frozenset[int]
    family: str
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    roles: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    outputs: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


class Pattern(Protocol):
    """A fusion rule. `match` yields a Match per proposed group and a Reject per near miss, never mutates."""

    name: str

    def match(self, view: GraphView) -> Iterator[Match | Reject]: ...


# --- small helpers shared by the rules -----------------------------------------------------------------


def only_consumer(view: GraphView, node: Node) -> Node | None:
    """The single node reading `node`'s single output, if there is exactly one and it is not a graph output."""
    if len(node.outputs) != 1 or node.outputs[0] in view.graph_outputs:
        return None
    users = view.consumers_of(node.outputs[0])
    return users[0] if len(users) == 1 else None


def other_input(node: Node, tensor: str) -> str | None:
    """For a binary node reading `tensor`, the name of its other input."""
    if len(node.inputs) != 2 or tensor not in node.inputs:
        return None
    a, b = node.inputs
    return b if a == tensor else a


def is_op(node: Node | None, *op_types: str) -> bool:
    return node is not None and node.domain == "" and node.op_type in op_types
