"""The hypothesis profile of the robustness tests, and the counts they report at the end of the run.

Tests report counts with `record_property("gtco_counts", {"section": {"name": n, ...}})`; the properties travel
with the test reports, so the counts add up over pytest-xdist workers and are printed in the terminal summary.
When the controller process never loaded this file (`pytest tests -n 2` collects only in the workers), each
worker writes its own totals to stderr as its session ends instead.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

# Examples per property test in CI, sized to the time budget; GTCO_HYPOTHESIS_EXAMPLES=N scales them to N for a
# longer local run (the plugin test, which compiles one library per example, gets N // 50 of them, at least 2).
EXAMPLES = int(os.environ.get("GTCO_HYPOTHESIS_EXAMPLES") or 150)

settings.register_profile(
    "gtco-ci", derandomize=True, deadline=None, print_blob=True, max_examples=EXAMPLES, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_KEY = "gtco_counts"
_COUNTS: dict[str, Counter] = {}
_SUMMARY_FLAG = "gtco_counts_in_summary"


def _add(props: list[tuple[str, object]]) -> None:
    for key, value in props:
        if key == _KEY and isinstance(value, dict):
            for section, counts in value.items():
                _COUNTS.setdefault(section, Counter()).update(counts)


def _lines() -> list[str]:
    return [f"{section}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            for section, counts in sorted(_COUNTS.items())]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up the counts of every finished test (in the controller: those of all workers)."""
    if report.when == "call":
        _add(report.user_properties)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # pytest-xdist, controller side: tell workers the summary prints
    node.workerinput[_SUMMARY_FLAG] = True


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _COUNTS:
        terminalreporter.section("onnx-gtco robustness counts")
        for line in _lines():
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In an xdist worker whose controller has no summary hook, write the worker's counts to stderr."""
    worker = getattr(session.config, "workerinput", None)
    if worker is None or worker.get(_SUMMARY_FLAG) or not _COUNTS:
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        for line in _lines():
            sys.stderr.write(f"\nonnx-gtco robustness counts ({worker.get('workerid', 'worker')}) {line}\n")
        sys.stderr.flush()
