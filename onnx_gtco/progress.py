"""Progress of the long stages on stderr: a tqdm bar per stage, one line per stage with its seconds at -v.

The level is set once by the command line (`verbosity`); library use stays silent (QUIET is the default):

- QUIET: nothing;
- NORMAL: a tqdm bar per stage while it runs, only when stderr is a terminal (tqdm's `disable=None`), cleared when
  the stage ends;
- VERBOSE: the bars as in NORMAL, and after each stage one line `onnx-gtco: <stage>  <seconds> s  <note>` whether
  or not stderr is a terminal.

Code that does a long stage wraps it in `with stage("load", total=4) as st:` and calls `st.step("what")` (or the
module's `step("what")`, which advances the innermost open stage, for code that is not handed the stage).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

QUIET, NORMAL, VERBOSE = 0, 1, 2

_level = QUIET
_open: list[Stage] = []


def level() -> int:
    """The current level (QUIET, NORMAL or VERBOSE)."""
    return _level


@contextmanager
def verbosity(new: int) -> Iterator[None]:
    """Set the level for the duration of the block (the CLI wraps a command in it), then restore the previous one."""
    global _level
    if new not in (QUIET, NORMAL, VERBOSE):
        raise ValueError(f"verbosity {new!r}: choose QUIET, NORMAL or VERBOSE")
    before, _level = _level, new
    try:
        yield
    finally:
        _level = before


def detail(text: str) -> None:
    """One line on stderr at VERBOSE (written above any open bar); nothing otherwise."""
    if _level >= VERBOSE:
        tqdm.write(f"onnx-gtco: {text}", file=sys.stderr)


class Stage:
    """An open stage: its bar (disabled unless NORMAL or VERBOSE and stderr is a terminal) and its note."""

    def __init__(self, name: str, total: int | None, unit: str) -> None:
        self.name = name
        self.note = ""
        self.start = time.perf_counter()
        self.bar: Any = tqdm(total=total, desc=name, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                             disable=True if _level < NORMAL else None)

    def step(self, what: str | None = None, n: int = 1) -> None:
        """Advance the bar by n, showing `what` beside it."""
        if what is not None:
            self.bar.set_postfix_str(what, refresh=False)
        self.bar.update(n)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


@contextmanager
def stage(name: str, total: int | None = None, unit: str = "step") -> Iterator[Stage]:
    """A stage of `total` steps (None: unknown). At VERBOSE, its line is printed when it ends without an error;
    set `st.note` to say what it did (e.g. "6 of 24 kernels from the cache")."""
    st = Stage(name, total, unit)
    _open.append(st)
    ok = False
    try:
        yield st
        ok = True
    finally:
        _open.remove(st)
        st.bar.close()
        if ok and _level >= VERBOSE:
            note = f"  {st.note}" if st.note else ""
            print(f"onnx-gtco: {name:<8} {st.seconds:7.2f} s{note}", file=sys.stderr, flush=True)


def step(what: str | None = None, n: int = 1) -> None:
    """Advance the innermost open stage (nothing when none is open, e.g. a function called on its own)."""
    if _open:
        _open[-1].step(what, n)


__all__ = ["NORMAL", "QUIET", "VERBOSE", "Stage", "detail", "level", "stage", "step", "verbosity"]
