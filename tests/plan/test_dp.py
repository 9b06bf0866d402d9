"""The DP against brute force on seeded random DAGs, and GTCO's MHA example."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from onnx_gtco.errors import PlanError
from onnx_gtco.plan.dp import plan
from onnx_gtco.plan.types import Candidate


@dataclass(frozen=True)
class Dag:
    succ_mask: tuple[int, ...]


def random_dag(rng: np.random.Generator, n: int, p: float) -> tuple[Dag, list[set[int]]]:
    succ: list[set[int]] = [set() for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if rng.random() < p:
                succ[i].add(j)
    return Dag(tuple(sum(1 << s for s in ss) for ss in succ)), succ


def reach(succ: list[set[int]]) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in succ]
    for i in range(len(succ) - 1, -1, -1):
        for s in succ[i]:
            out[i] |= {s} | out[s]
    return out


def random_candidates(rng: np.random.Generator, succ: list[set[int]], count: int) -> list[Candidate]:
    """Random connected groups of 2-4 nodes (convex or not: the DP must cope with both)."""
    n = len(succ)
    und = [set(succ[i]) | {j for j in range(n) if i in succ[j]} for i in range(n)]
    out = []
    for k in range(count):
        grp = {int(rng.integers(n))}
        for _ in range(int(rng.integers(1, 4))):
            frontier = sorted(set().union(*(und[v] for v in grp)) - grp)
            if not frontier:
                break
            grp.add(frontier[int(rng.integers(len(frontier)))])
        if len(grp) > 1:
            out.append(Candidate(frozenset(grp), "fam", f"c{k}"))
    return out


def brute_force(n: int, succ: list[set[int]], cands: list[Candidate], cost) -> float:
    """Every exact cover of the nodes by candidates and singletons whose quotient graph is acyclic."""
    groups = list({c.nodes: c for c in cands}.values())
    groups += [Candidate(frozenset([i]), "unfused", "single") for i in range(n)]
    by_min: dict[int, list[Candidate]] = {}
    for g in groups:
        by_min.setdefault(min(g.nodes), []).append(g)
    best = math.inf

    def acyclic(chosen: list[Candidate]) -> bool:
        owner = {v: k for k, g in enumerate(chosen) for v in g.nodes}
        edges = {(owner[u], owner[v]) for u in range(n) for v in succ[u] if owner[u] != owner[v]}
        indeg = {k: 0 for k in range(len(chosen))}
        for _, b in edges:
            indeg[b] += 1
        ready = [k for k, d in indeg.items() if d == 0]
        seen = 0
        while ready:
            k = ready.pop()
            seen += 1
            for a, b in edges:
                if a == k:
                    indeg[b] -= 1
                    if indeg[b] == 0:
                        ready.append(b)
        return seen == len(chosen)

    def rec(covered: frozenset[int], chosen: list[Candidate], total: float) -> None:
        nonlocal best
        if total >= best:
            return
        if len(covered) == n:
            if acyclic(chosen):
                best = total
            return
        first = min(set(range(n)) - covered)
        for g in by_min.get(first, []):
            if not g.nodes & covered:
                rec(covered | g.nodes, [*chosen, g], total + cost(g))

    # every group containing `first` must have it as its minimum, since smaller nodes are covered already
    rec(frozenset(), [], 0.0)
    return best


def check_valid(n: int, succ: list[set[int]], groups: tuple[Candidate, ...]) -> None:
    seen: set[int] = set()
    for g in groups:
        assert not g.nodes & seen, "a node is scheduled twice"
        for v in g.nodes:
            for u in range(n):
                if v in succ[u] and u not in g.nodes:
                    assert u in seen, f"node {v} runs before its producer {u}"
        seen |= g.nodes
    assert seen == set(range(n))


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 13))
    dag, succ = random_dag(rng, n, float(rng.uniform(0.15, 0.5)))
    cands = random_candidates(rng, succ, int(rng.integers(3, 14)))
    table = {c.nodes: float(rng.uniform(0.5, 2.0)) * len(c.nodes) for c in cands}
    single = {i: float(rng.uniform(0.6, 1.6)) for i in range(n)}

    def cost(c: Candidate) -> float:
        return single[next(iter(c.nodes))] if len(c.nodes) == 1 else table[c.nodes]

    result = plan(dag, cands, cost)
    check_valid(n, succ, result.groups)
    assert result.cost_us == pytest.approx(sum(cost(g) for g in result.groups))
    assert result.cost_us == pytest.approx(brute_force(n, succ, cands, cost))
    assert result.costs == tuple(cost(g) for g in result.groups)  # what the search charged each group
    forced = plan(dag, cands, cost, unforced_states=0)  # the search with forced moves only
    check_valid(n, succ, forced.groups)
    assert forced.cost_us == pytest.approx(result.cost_us) and forced.states <= result.states


def test_dp_never_uses_an_infinite_group() -> None:
    dag = Dag((0b10, 0b100, 0))
    cands = [Candidate(frozenset([0, 1, 2]), "fam", "all")]
    result = plan(dag, cands, lambda c: math.inf if len(c.nodes) == 3 else 1.0)
    assert all(len(g.nodes) == 1 for g in result.groups)
    assert result.cost_us == 3.0


def test_dp_rejects_a_cycle_through_the_quotient() -> None:
    # 0 -> 1 -> 2 and {0, 2} fused would need 1 both before and after the group.
    dag = Dag((0b10, 0b100, 0))
    cands = [Candidate(frozenset([0, 2]), "fam", "nonconvex")]
    result = plan(dag, cands, lambda c: 0.1 if len(c.nodes) == 2 else 1.0)
    assert result.cost_us == 3.0


def test_gtco_mha_core_split() -> None:
    """Thesis Fig. 3.5: on {QKᵀ, Softmax, PV} the optimum is {QKᵀ + Softmax} then {PV}.

    GTCO's costs: softmax is opaque, so any pair with it is +inf except inside the BMM+softmax sketch;
    a fused stage costs less than its parts (S never goes to DRAM).
    """
    dag = Dag((0b010, 0b100, 0))  # QK -> Softmax -> PV
    qk, soft, pv = (frozenset([i]) for i in range(3))
    table = {
        qk: 31.0, soft: 24.0, pv: 30.0,
        qk | soft: 36.0,  # GTCO's fused BMM+softmax sketch
        soft | pv: math.inf,  # softmax is opaque to the second BMM
        qk | soft | pv: math.inf,  # no cross-block rescaling in GTCO's sketch
    }
    cands = [Candidate(k, "fam", "mha") for k in table if len(k) > 1]
    cands += [Candidate(k, "unfused", "single") for k in table if len(k) == 1]
    result = plan(dag, cands, lambda c: table[c.nodes])
    assert [sorted(g.nodes) for g in result.groups] == [[0, 1], [2]]
    assert result.cost_us == 66.0
    assert result.states == 4  # the paper's four states: {M1,Soft,M2}, {M1,Soft}, {M1}, {}


def _pair_cost(c: Candidate) -> float:
    return 1.0 if len(c.nodes) == 1 else 1.5


def test_forced_moves_keep_the_optimum_past_the_state_budget() -> None:
    """16 independent nodes under one spanning candidate: 2^16 remaining-sets, but 14 nodes can only run alone."""
    n = 16
    dag = Dag(tuple(0 for _ in range(n)))
    cands = [Candidate(frozenset([0, n - 1]), "fam", "span")]
    full = plan(dag, cands, _pair_cost, unforced_states=10**6)  # every order searched
    assert full.states > 1000
    capped = plan(dag, cands, _pair_cost, max_states=100)
    assert capped.rejects == ()
    assert capped.cost_us == full.cost_us == 15.5
    assert capped.states <= 100
    assert frozenset([0, n - 1]) in {g.nodes for g in capped.groups}
    assert sorted(i for g in capped.groups for i in g.nodes) == list(range(n))
    default = plan(dag, cands, _pair_cost)  # past the first search's budget: forced moves, without searching 2^16
    assert default.groups == capped.groups and default.cost_us == full.cost_us and default.states <= 100


def _parallel_pairs() -> tuple[Dag, list[Candidate]]:
    """Nodes 0-15 independent, all in fusable pairs (nothing forced); then a chain 16 -> 17 that still fuses."""
    n = 18
    dag = Dag(tuple(1 << 17 if i == 16 else 0 for i in range(n)))
    cands = [Candidate(frozenset([i, i + 1]), "fam", "pair") for i in range(0, 16, 2)]
    cands += [Candidate(frozenset([0, 15]), "fam", "span"), Candidate(frozenset([16, 17]), "fam", "chain")]
    return dag, cands


def test_a_sink_whose_groups_all_end_the_state_is_the_only_one_tried() -> None:
    """Parallel fusable pairs: every order of them is 2^16 states; trying only the groups through one sink whose every
    group can run last finds the same optimum in a few dozen."""
    dag, cands = _parallel_pairs()
    full = plan(dag, cands, _pair_cost, unforced_states=10**6)  # every order searched
    assert full.states > 60_000
    forced = plan(dag, cands, _pair_cost, max_states=100)
    assert forced.rejects == () and forced.states <= 40
    assert forced.cost_us == full.cost_us == 13.5
    assert sorted(i for g in forced.groups for i in g.nodes) == list(range(18))


def test_segment_past_the_budget_is_covered_greedily_and_says_so() -> None:
    """Past the budget even with forced moves, the segment is no longer left unfused (17.5 here): its groups are
    chosen greedily, the largest saving first, which on these pairs is the optimum."""
    dag, cands = _parallel_pairs()
    result = plan(dag, cands, _pair_cost, max_states=20)
    assert [g.nodes for g in result.groups] == [frozenset([i, i + 1]) for i in range(0, 16, 2)] + [
        frozenset([16, 17])]
    assert result.cost_us == 13.5 == sum(result.costs)
    assert result.costs == tuple(_pair_cost(g) for g in result.groups)
    assert [(r.pattern, r.anchor) for r in result.rejects] == [("dp", "#0")]
    assert "passed 20 states on nodes 0..15" in result.rejects[0].reason
    assert "covered greedily (8 groups" in result.rejects[0].reason


def _valid_order(succ: list[set[int]], groups: list[frozenset[int]]) -> bool:
    """Every node once, and each group runs after every group that writes what it reads."""
    done: set[int] = set()
    for g in groups:
        if any(v in g for u in range(len(succ)) if u not in done | g for v in succ[u]):
            return False
        done |= g
    return sorted(done) == list(range(len(succ))) and sum(map(len, groups)) == len(succ)


def test_the_greedy_cover_keeps_a_group_only_where_the_groups_can_still_run_in_order() -> None:
    """0 -> 1 -> 2 with {0, 2} the largest saving: taken alone it needs 1 both before and after it, so the greedy
    cover passes it over for {0, 1} and {1, 2}'s best that fits."""
    succ = [{1}, {2}, set()]
    dag = Dag((0b010, 0b100, 0))
    cands = [Candidate(frozenset([0, 2]), "fam", "outer"), Candidate(frozenset([1, 2]), "fam", "tail")]
    cost = {frozenset([0, 2]): 0.5, frozenset([1, 2]): 1.5}
    result = plan(dag, cands, lambda c: cost.get(c.nodes, 1.0), max_states=1)
    assert [g.nodes for g in result.groups] == [frozenset([0]), frozenset([1, 2])]
    assert _valid_order(succ, [g.nodes for g in result.groups]) and result.rejects


@pytest.mark.parametrize("seed", range(20))
def test_the_greedy_cover_is_valid_and_no_dearer_than_every_node_alone(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 12
    dag, succ = random_dag(rng, n, 0.25)
    cands = random_candidates(rng, succ, 20)
    cost = lambda c: 1.0 if len(c.nodes) == 1 else 0.6 * len(c.nodes) + 0.1 * (min(c.nodes) % 3)  # noqa: E731
    greedy = plan(dag, cands, cost, max_states=1)
    optimum = plan(dag, cands, cost)
    assert _valid_order(succ, [g.nodes for g in greedy.groups])
    assert optimum.cost_us <= greedy.cost_us + 1e-9 and greedy.cost_us <= n
    assert greedy.rejects and not optimum.rejects


def test_infeasible_cover_is_still_an_error() -> None:
    dag = Dag((0b10, 0))
    with pytest.raises(PlanError, match="no finite-cost"):
        plan(dag, [], lambda c: math.inf)


def test_segments_cut_where_no_candidate_spans() -> None:
    from onnx_gtco.plan.dp import segments

    cands = [Candidate(frozenset([1, 3]), "f", "a"), Candidate(frozenset([2, 4]), "f", "b"),
             Candidate(frozenset([6, 7]), "f", "c")]
    assert segments(9, cands) == [(0, 1), (1, 5), (5, 6), (6, 8), (8, 9)]


def test_dp_is_deterministic_under_candidate_order() -> None:
    rng = np.random.default_rng(7)
    dag, succ = random_dag(rng, 10, 0.3)
    cands = random_candidates(rng, succ, 12)
    cost = lambda c: 1.0 if len(c.nodes) == 1 else 0.9 * len(c.nodes)  # noqa: E731 - many ties on purpose
    first = plan(dag, cands, cost)
    for perm in itertools.islice(itertools.permutations(range(len(cands))), 5):
        assert plan(dag, [cands[i] for i in perm], cost).groups == first.groups
