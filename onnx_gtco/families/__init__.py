"""The kernel families, one folder each, and the one ordered list of them.

A family's folder holds everything that knows it, one module per stage it takes part in, each importing only the
stages at or below its own (the families contracts in pyproject.toml):

    spec.py     opspec     SPECS: the OpSpec of each fused op it writes (roles, typed attributes, dtypes)
    rule.py     patterns   RULES: its fusion rules, in the order they run
    kernel.py   kernels    KERNELS: its KernelFamily objects, each saying how a node becomes its Problem, the
                           size it dispatches on at run time, its tiling and its estimate
    bind.py     plugin     BINDERS: the Binder of each fused op, mapping its roles onto the C++ op struct
    passes.py   plugin     PASSES: its rewrites of the graph before the rules match (plan.types.GraphPass)

with the device code beside them in plugins/ (its header, its ORT op struct, its CPU kernel) and its tests in
tests/families/<family>/. The engines (planning, rewrite, kernel selection, tuning, the library, the report) read
the families through `parts` and name none of them. A new family is a folder and one line in ORDER
(docs/architecture.md, "Adding a kernel family").
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

ORDER = ("attention", "gemm", "conv", "layernorm", "rmsnorm", "softmax", "elementwise")
"""The families, in the order their rules run (for identical node sets the first rule wins)."""

STAGES = ("spec", "rule", "kernel", "bind", "passes")
"""The modules a family folder may have, lowest stage first."""


@functools.cache
def parts(stage: str) -> tuple[ModuleType, ...]:
    """Each family's `stage` module (one of STAGES), in ORDER; a family without one is left out. A stage's engine
    asks for its own stage's modules only, so importing them never reaches above it."""
    if stage not in STAGES:
        raise ValueError(f"{stage!r} is no family stage: choose one of {STAGES}")
    names = (f"{__name__}.{family}.{stage}" for family in ORDER)
    return tuple(importlib.import_module(n) for n in names if importlib.util.find_spec(n) is not None)


__all__ = ["ORDER", "STAGES", "parts"]
