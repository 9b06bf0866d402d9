"""Which task gets the next trial: weight x expected gain (GTCO Eq. 3.2, Ansor's gradient rule).

A task's expected gain per trial is what its best time has been dropping by lately (the improvement over its last
`window` finished trials, per trial), with an optimistic floor of `beta * best / trials` so that a task whose curve
has gone flat still gets an occasional trial while its share is small. Its priority is weight x gain (the end-to-end
time it can still take off). Tasks without a finished trial come first, heaviest first; a task stops when it has
`limit` finished trials, when its best has not improved for `patience` trials (early stopping), or when it reached
its optional target time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Curve:
    """What the scheduler knows of one task: its weight and its finished trials' times (None: failed)."""

    weight: float
    times: list[float | None] = field(default_factory=list)
    target: float | None = None

    def best_after(self, n: int) -> float:
        vals = [t for t in self.times[:n] if t is not None]
        return min(vals) if vals else math.inf

    @property
    def best(self) -> float:
        return self.best_after(len(self.times))

    def since_improvement(self) -> int:
        """Finished trials since the best time last improved."""
        best, last = math.inf, 0
        for i, t in enumerate(self.times):
            if t is not None and t < best * (1 - 1e-9):
                best, last = t, i + 1
        return len(self.times) - last


@dataclass(frozen=True)
class Policy:
    limit: int                 # finished trials per task (the per-task total of --tune-trials)
    patience: int = 20         # early stop after this many trials without improvement
    window: int = 5            # trials over which the recent improvement is measured
    beta: float = 0.05         # optimistic floor of the expected gain, a share of the best time


def stopped(c: Curve, p: Policy) -> str | None:
    """Why the task takes no more trials, or None."""
    if len(c.times) >= p.limit:
        return "trial limit"
    if c.target is not None and c.best <= c.target:
        return "target reached"
    if len(c.times) >= p.patience and c.since_improvement() >= p.patience:
        return "early stop"
    return None


def priority(c: Curve, p: Policy) -> float:
    n = len(c.times)
    if n == 0 or math.isinf(c.best):
        return math.inf
    w = min(p.window, n)
    recent = (c.best_after(n - w) - c.best) / w if n - w > 0 and not math.isinf(c.best_after(n - w)) else 0.0
    return c.weight * max(recent, p.beta * c.best / n)


def next_task(curves: Sequence[Curve], p: Policy) -> int | None:
    """Index of the task to give the next trial, or None when every task has stopped."""
    open_ = [i for i, c in enumerate(curves) if stopped(c, p) is None]
    if not open_:
        return None
    return max(open_, key=lambda i: (priority(curves[i], p), curves[i].weight, -i))


def next_round(curves: Sequence[Curve], p: Policy, k: int, room: Sequence[int] | None = None,
               pending: Sequence[int] | None = None) -> list[int]:
    """Indices of the tasks to give the next `k` trials, which run as one round (a task may get several): picked
    one after another as next_task picks, each pick counting as a trial of its task that has not finished, so
    that it takes one of the task's `room` slots (default: up to the policy's limit) and lowers its priority as a
    trial without gain would. A task without a successful trial (infinite priority: none finished yet, or all
    failed) gets one trial of a round ahead of the others, heaviest first, and more only behind them: its gain is
    unknown until a trial of it succeeds. With k = 1 this is next_task. Fewer than `k` when the open tasks have no
    more room; empty when every task has stopped. `pending`: trials of each task already in flight (they count
    as picks made; `room` is what is left beside them)."""
    flying = [0] * len(curves) if pending is None else list(pending)
    room = [p.limit - len(c.times) - f for c, f in zip(curves, flying, strict=True)] if room is None else list(room)
    pending = list(flying)
    open_ = [i for i, c in enumerate(curves) if stopped(c, p) is None]
    picks: list[int] = []
    for _ in range(k):
        fits = [i for i in open_ if pending[i] - flying[i] < room[i]]
        if not fits:
            break

        def key(i: int) -> tuple[float, int, float, int]:
            c = curves[i]
            ahead = priority(Curve(c.weight, [*c.times, *([None] * pending[i])], c.target), p)
            if math.isinf(ahead) and pending[i]:
                ahead = 0.0
            return ahead, -pending[i], c.weight, -i

        i = max(fits, key=key)
        pending[i] += 1
        picks.append(i)
    return picks


__all__ = ["Curve", "Policy", "next_round", "next_task", "priority", "stopped"]
