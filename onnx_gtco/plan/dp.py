"""GTCO's dynamic-programming operator fusion (thesis Alg. 1, Eq. 3.1).

    dp[∅] = 0
    dp[V] = min over endings V' of V:  dp[V − V'] + cost(V')

V is the set of nodes still to schedule (a bitmask over topological ids); an ending V' is a candidate group inside V
with no edge from V' to V − V', so it can run last. The chosen endings, read back from V = all nodes, are the stages.
Every ending holds at least one sink of V, so only candidates through a sink are tried, and the graph is first cut
where no candidate spans the topological order (see `segments`).

Each segment has its own state budget. A segment that passes it is solved again with forced moves: a sink whose only
candidates are single nodes is always removed first (running it last is legal and changes no cost, so the optimum is
the same), which collapses the many orderings of parallel unfusable nodes (shape arithmetic in expanded functions)
into one. A segment that passes the budget even so is left unfused, and the plan says so in `Plan.rejects`; the
rest of the graph is planned as usual. Pure: no graph mutation, no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from onnx_gtco.errors import PlanError, SearchBudgetError
from onnx_gtco.plan.types import Candidate, Plan, Reject


class Dag(Protocol):
    """What the DP needs of a graph: successor bitmasks of nodes in topological order."""

    @property
    def succ_mask(self) -> Sequence[int]: ...


def _order(c: Candidate) -> tuple[object, ...]:
    return (min(c.nodes), -len(c.nodes), tuple(sorted(c.nodes)), c.family, c.pattern)


def plan(
    dag: Dag,
    candidates: Sequence[Candidate],
    cost: Callable[[Candidate], float],
    max_states: int = 2_000_000,
) -> Plan:
    """Least-cost cover of all nodes by candidate groups that can run in some order.

    Args:
        dag: the graph (GraphView or any object with `succ_mask`).
        candidates: groups that may fuse; every node also gets an "unfused" single candidate (ONNX Runtime runs it),
            so a group the cost predicts slower than its nodes left to ONNX Runtime is never chosen, one node or many.
        cost: predicted time of one group, microseconds; math.inf forbids it.
        max_states: state budget of one segment's search; a segment past it even with forced moves (module
            docstring) runs unfused, with a Reject naming it in `Plan.rejects`.

    Returns:
        The Plan: groups in execution order, total predicted cost, number of states explored, segments left unfused,
        the cost of each group.

    Raises:
        PlanError: no finite-cost cover exists, or a candidate names a node outside the graph.
    """
    succ = list(dag.succ_mask)
    n = len(succ)
    cands = sorted(set(candidates), key=_order)
    unfused = {next(iter(c.nodes)) for c in cands if len(c.nodes) == 1 and not c.fused}
    cands += [Candidate(frozenset([i]), "unfused", "single") for i in range(n) if i not in unfused]
    masks: list[int] = []
    outs: list[int] = []
    costs: list[float] = []
    by_node: list[list[int]] = [[] for _ in range(n)]
    for k, c in enumerate(cands):
        m = 0
        for i in c.nodes:
            if not 0 <= i < n:
                raise PlanError(f"candidate {c.family}/{c.pattern} names node {i}, graph has {n}")
            m |= 1 << i
        o = 0
        for i in c.nodes:
            o |= succ[i]
        masks.append(m)
        outs.append(o & ~m)
        costs.append(float(cost(c)))
        for i in c.nodes:
            by_node[i].append(k)

    # forced[v]: the cheapest single-node candidate of v when every candidate through v is a single node, else -1
    forced = [min(ks, key=lambda k: (costs[k], k)) if all(masks[k] == 1 << v for k in ks) else -1
              for v, ks in enumerate(by_node)]

    def endings(state: int, force: bool) -> list[int]:
        found: dict[int, None] = {}
        rest = state
        while rest:
            low = rest & -rest
            v = low.bit_length() - 1
            rest ^= low
            if succ[v] & state:
                continue  # not a sink of state
            if force and forced[v] >= 0:
                return [forced[v]]
            for k in by_node[v]:
                if masks[k] & ~state == 0 and outs[k] & state == 0 and costs[k] < math.inf:
                    found.setdefault(k, None)
        return sorted(found)

    def solve(full: int, force: bool) -> dict[int, tuple[float, int]]:
        """best[state] = (least cost, chosen ending) for `full` and every state it reaches; SearchBudgetError past
        max_states."""
        best: dict[int, tuple[float, int]] = {0: (0.0, -1)}
        pending: dict[int, list[int]] = {}
        stack = [full]
        while stack:
            state = stack[-1]
            if state in best:
                stack.pop()
                continue
            trans = pending.get(state)
            if trans is None:
                trans = pending[state] = endings(state, force)
                todo = [state & ~masks[k] for k in trans if (state & ~masks[k]) not in best]
                if todo:
                    stack.extend(todo)
                    if len(best) + len(pending) > max_states:
                        raise SearchBudgetError
                    continue
            value, choice = math.inf, -1
            for k in trans:
                v = best[state & ~masks[k]][0] + costs[k]
                if v < value:
                    value, choice = v, k
            best[state] = (value, choice)
            del pending[state]
            stack.pop()
        return best

    names = [getattr(node, "name", "") or f"#{i}" for i, node in enumerate(getattr(dag, "nodes", range(n)))]
    groups: list[Candidate] = []
    charged: list[float] = []
    rejects: list[Reject] = []
    total = 0.0
    states = 0
    for lo, hi in segments(n, cands):
        full = ((1 << hi) - 1) & ~((1 << lo) - 1)
        seg: list[Candidate] = []
        seg_costs: list[float] = []
        try:
            try:
                best = solve(full, force=False)
            except SearchBudgetError:
                best = solve(full, force=True)
        except SearchBudgetError:
            # Past the budget even with forced moves: every node of the segment runs alone, in topological order.
            rejects.append(Reject("dp", names[lo], f"fusion search passed {max_states} states on nodes {lo}..{hi - 1} "
                                                   f"({names[lo]} .. {names[hi - 1]}); that segment is left unfused"))
            alone = [min((k for k in by_node[i] if masks[k] == 1 << i), key=lambda k: (costs[k], k))
                     for i in range(lo, hi)]
            seg = [cands[k] for k in alone]
            seg_costs = [costs[k] for k in alone]
            seg_total = sum(costs[k] for k in alone)
            states += max_states
        else:
            seg_total = best[full][0]
            state = full if seg_total < math.inf else 0
            while state:
                _, k = best[state]
                seg.append(cands[k])
                seg_costs.append(costs[k])
                state &= ~masks[k]
            seg.reverse()
            seg_costs.reverse()
            states += len(best) - (1 if lo else 0)  # the empty state is shared by every segment
        if seg_total == math.inf:
            raise PlanError("no finite-cost way to schedule the graph (every cover uses a forbidden group)")
        total += seg_total
        groups.extend(seg)
        charged.extend(seg_costs)
    return Plan(tuple(groups), total, states=states, rejects=tuple(rejects), costs=tuple(charged))


def segments(n: int, candidates: Sequence[Candidate]) -> list[tuple[int, int]]:
    """Split topological positions [0, n) where no candidate spans the cut.

    Edges only go forward in topological order, so the prefix can run before the suffix; with no group across the
    cut, the best plan is the best plan of each side, one after the other. This keeps the DP's states linear in depth.
    """
    reach = list(range(n))  # reach[i]: furthest node a candidate starting at or before i extends to
    for c in candidates:
        lo, hi = min(c.nodes), max(c.nodes)
        reach[lo] = max(reach[lo], hi)
    out: list[tuple[int, int]] = []
    start, far = 0, -1
    for i in range(n):
        far = max(far, reach[i])
        if far == i:
            out.append((start, i + 1))
            start = i + 1
    return out
