"""GTCO's dynamic-programming operator fusion (thesis Alg. 1, Eq. 3.1).

    dp[∅] = 0
    dp[V] = min over endings V' of V:  dp[V − V'] + cost(V')

V is the set of nodes still to schedule (a bitmask over topological ids); an ending V' is a candidate group inside V
with no edge from V' to V − V', so it can run last. The chosen endings, read back from V = all nodes, are the stages.
Every ending holds at least one sink of V, so only candidates through a sink are tried, and the graph is first cut
where no candidate spans the topological order (see `segments`).

Each segment is first searched over every order of its endings, within a small budget (UNFORCED_STATES). A segment
that passes it is solved again with forced moves, within the segment budget: a sink whose only candidates are single
nodes is always removed first (running it last is legal and changes no cost, so the optimum is the same), which
collapses the many orderings of parallel unfusable nodes (shape arithmetic in expanded functions, the Shape / Gather /
Concat chains of symbolic dims) into one; and a sink every fitting group through which is an ending of the state is
the only sink whose groups are tried (the group a cover takes through it has no successor left, so it can run last at
the same cost: the orders of parallel fusable chains, a rotary table beside a layer's GEMMs, collapse too). Both
searches find the least cost; they may break a tie between covers of equal cost differently, which is why the first
is kept where it is cheap. A segment that passes the budget even with forced moves is covered greedily instead (the
groups that save the most first, each kept where the groups chosen so far can still run in some order: no longer the
least cost, but no longer every node alone either), and the plan says so in `Plan.rejects`; the rest of the graph is
planned as usual.
Pure: no graph mutation, no I/O, no clock, no randomness.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Protocol

from onnx_gtco.errors import PlanError, SearchBudgetError
from onnx_gtco.plan.types import Candidate, Plan, Reject

UNFORCED_STATES = 5_000
"""Budget of a segment's search over every order before forced moves. Every segment of the built-in and zoo models
that this search finishes takes at most 2,627 states (BERT-base with symbolic batch and tokens); a segment of parallel
shape arithmetic (a LLaMA-style block exported with symbolic dims) takes millions, at about 30 us a state here, where
the forced search takes thousands."""


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
    unforced_states: int = UNFORCED_STATES,
) -> Plan:
    """Least-cost cover of all nodes by candidate groups that can run in some order.

    Args:
        dag: the graph (GraphView or any object with `succ_mask`).
        candidates: groups that may fuse; every node also gets an "unfused" single candidate (ONNX Runtime runs it),
            so a group the cost predicts slower than its nodes left to ONNX Runtime is never chosen, one node or many.
        cost: predicted time of one group, microseconds; math.inf forbids it.
        max_states: state budget of one segment's search; a segment past it even with forced moves (module
            docstring) is covered greedily (_Search.greedy), with a Reject naming it in `Plan.rejects`.
        unforced_states: state budget of a segment's first search, over every order of its endings, before the
            search with forced moves (at most max_states).

    Returns:
        The Plan: groups in execution order, total predicted cost, number of states explored, segments covered greedily,
        the cost of each group.

    Raises:
        PlanError: no finite-cost cover exists, or a candidate names a node outside the graph.
    """
    search = _Search(list(dag.succ_mask), candidates, cost, max_states, min(unforced_states, max_states))
    n = len(search.succ)
    names = [getattr(node, "name", "") or f"#{i}" for i, node in enumerate(getattr(dag, "nodes", range(n)))]
    groups: list[Candidate] = []
    charged: list[float] = []
    rejects: list[Reject] = []
    total = 0.0
    states = 0
    for lo, hi in segments(n, search.cands):
        try:
            chosen, seg_total, seg_states = search.segment(lo, hi)
        except SearchBudgetError:
            # Past the budget even with forced moves: the segment's groups chosen greedily, largest saving first.
            chosen = search.greedy(lo, hi)
            seg_total, seg_states = sum(search.costs[k] for k in chosen), max_states
            fused = sum(len(search.cands[k].nodes) > 1 for k in chosen)
            rejects.append(Reject("dp", names[lo], f"fusion search passed {max_states} states on nodes {lo}..{hi - 1} "
                                                   f"({names[lo]} .. {names[hi - 1]}); that segment is covered "
                                                   f"greedily ({fused} groups, the largest predicted savings first), "
                                                   "not searched for the least cost"))
        if seg_total == math.inf:
            raise PlanError("no finite-cost way to schedule the graph (every cover uses a forbidden group)")
        total += seg_total
        groups.extend(search.cands[k] for k in chosen)
        charged.extend(search.costs[k] for k in chosen)
        states += seg_states
    return Plan(tuple(groups), total, states=states, rejects=tuple(rejects), costs=tuple(charged))


class _Search:
    """The DP over one graph's candidates: each candidate's node mask, the successors outside it and its cost, the
    candidates through each node."""

    def __init__(self, succ: list[int], candidates: Sequence[Candidate], cost: Callable[[Candidate], float],
                 max_states: int, unforced_states: int) -> None:
        self.succ, self.max_states, self.unforced_states = succ, max_states, unforced_states
        n = len(succ)
        cands = sorted(set(candidates), key=_order)
        unfused = {next(iter(c.nodes)) for c in cands if len(c.nodes) == 1 and not c.fused}
        cands += [Candidate(frozenset([i]), "unfused", "single") for i in range(n) if i not in unfused]
        self.cands = cands
        self.masks: list[int] = []
        self.outs: list[int] = []
        self.costs: list[float] = []
        self.by_node: list[list[int]] = [[] for _ in range(n)]
        for k, c in enumerate(cands):
            m = 0
            for i in c.nodes:
                if not 0 <= i < n:
                    raise PlanError(f"candidate {c.family}/{c.pattern} names node {i}, graph has {n}")
                m |= 1 << i
            o = 0
            for i in c.nodes:
                o |= succ[i]
            self.masks.append(m)
            self.outs.append(o & ~m)
            self.costs.append(float(cost(c)))
            for i in c.nodes:
                self.by_node[i].append(k)
        # forced[v]: the cheapest single-node candidate of v when every candidate through v is a single node, else -1
        self.forced = [min(ks, key=lambda k: (self.costs[k], k)) if all(self.masks[k] == 1 << v for k in ks) else -1
                       for v, ks in enumerate(self.by_node)]

    def endings(self, state: int, force: bool) -> list[int]:
        succ, masks, outs, costs = self.succ, self.masks, self.outs, self.costs
        found: dict[int, None] = {}
        rest = state
        while rest:
            low = rest & -rest
            v = low.bit_length() - 1
            rest ^= low
            if succ[v] & state:
                continue  # not a sink of state
            if force and self.forced[v] >= 0:
                return [self.forced[v]]
            mine, closed = [], True
            for k in self.by_node[v]:
                if masks[k] & ~state or costs[k] == math.inf:
                    continue  # not inside the state, or never chosen
                if outs[k] & state == 0:
                    mine.append(k)
                else:
                    closed = False
            if force and closed and mine:
                # every group through the sink v that fits is an ending: whichever a cover takes can run last
                return mine
            found.update(dict.fromkeys(mine))
        return sorted(found)

    def solve(self, full: int, force: bool, budget: int) -> dict[int, tuple[float, int]]:
        """best[state] = (least cost, chosen ending) for `full` and every state it reaches; SearchBudgetError past
        `budget` states."""
        masks, costs = self.masks, self.costs
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
                trans = pending[state] = self.endings(state, force)
                todo = [state & ~masks[k] for k in trans if (state & ~masks[k]) not in best]
                if todo:
                    stack.extend(todo)
                    if len(best) + len(pending) > budget:
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

    def segment(self, lo: int, hi: int) -> tuple[list[int], float, int]:
        """The candidates covering nodes lo..hi-1 at least cost, in execution order, that cost (inf: no finite
        cover), and the states explored; SearchBudgetError past the budget even with forced moves."""
        full = ((1 << hi) - 1) & ~((1 << lo) - 1)
        try:
            best = self.solve(full, force=False, budget=self.unforced_states)
        except SearchBudgetError:
            best = self.solve(full, force=True, budget=self.max_states)
        chosen = []
        state = full if best[full][0] < math.inf else 0
        while state:
            _, k = best[state]
            chosen.append(k)
            state &= ~self.masks[k]
        # the empty state is shared by every segment
        return chosen[::-1], best[full][0], len(best) - (1 if lo else 0)

    def alone(self, i: int) -> int:
        """Node i's cheapest single-node candidate."""
        return min((k for k in self.by_node[i] if self.masks[k] == 1 << i), key=lambda k: (self.costs[k], k))

    def greedy(self, lo: int, hi: int) -> list[int]:
        """A cover of nodes lo..hi-1, in execution order: the groups inside it that save the most against their nodes
        alone first (ties in candidate order), each kept where none of its nodes is taken yet and the groups so far
        can still run in some order (no cycle between them); every other node alone."""
        inside = ((1 << hi) - 1) & ~((1 << lo) - 1)
        chosen = {i: self.alone(i) for i in range(lo, hi)}  # group key (its least node) -> candidate
        owner = {i: i for i in range(lo, hi)}  # node -> its group's key
        taken: set[int] = set()  # the nodes of the groups kept so far
        savings = [(sum(self.costs[chosen[i]] for i in c.nodes) - self.costs[k], k) for k, c in enumerate(self.cands)
                   if len(c.nodes) > 1 and not self.masks[k] & ~inside and self.costs[k] < math.inf]
        for _, k in sorted((-x, k) for x, k in savings if x > 0):
            nodes = sorted(self.cands[k].nodes)
            if taken.intersection(nodes):
                continue
            trial = {**owner, **dict.fromkeys(nodes, nodes[0])}
            if self._order_of(trial, lo, inside) is None:
                continue
            owner = trial
            taken.update(nodes)
            for i in nodes:
                del chosen[i]
            chosen[nodes[0]] = k
        order = self._order_of(owner, lo, inside)
        assert order is not None
        return [chosen[g] for g in order]

    def _order_of(self, owner: dict[int, int], lo: int, inside: int) -> list[int] | None:
        """The groups of `owner` (node -> group key, nodes lo.. of the mask `inside`) in an order they can run in
        (least key first among the ready), or None where two of them need each other."""
        edges: dict[int, set[int]] = {g: set() for g in set(owner.values())}
        indeg = dict.fromkeys(edges, 0)
        for u in range(lo, lo + len(owner)):
            rest = self.succ[u] & inside
            while rest:
                low = rest & -rest
                v = low.bit_length() - 1
                rest ^= low
                a, b = owner[u], owner[v]
                if a != b and b not in edges[a]:
                    edges[a].add(b)
                    indeg[b] += 1
        ready = [g for g, d in indeg.items() if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            g = heapq.heappop(ready)
            order.append(g)
            for h in edges[g]:
                indeg[h] -= 1
                if indeg[h] == 0:
                    heapq.heappush(ready, h)
        return order if len(order) == len(edges) else None


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
