"""Zoo fixtures: export real architectures once per session and parametrize tests over (model, exporter)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
from tool_module import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCH_REASON = "zoo tests need torch, timm, transformers and onnxscript: pip install -r requirements-zoo.txt"

_ERRORS = pytest.StashKey[dict[tuple[str, str], str]]()


zoo = load_tool("export_zoo")  # it needs no torch to import; test modules then `import export_zoo`


def _selected(env: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return allowed
    chosen = tuple(v.strip() for v in raw.split(",") if v.strip())
    unknown = [v for v in chosen if v not in allowed]
    if unknown:
        raise pytest.UsageError(f"{env}: unknown {unknown}; choose from {','.join(allowed)}")
    return chosen


def zoo_cases() -> list[Any]:
    """Returns one ``pytest.param((model, exporter), id="model-exporter")`` per zoo export.

    ``GTCO_ZOO_MODELS`` and ``GTCO_ZOO_EXPORTERS`` (comma-separated) narrow the set.
    """
    models = _selected("GTCO_ZOO_MODELS", zoo.MODELS)
    exporters = _selected("GTCO_ZOO_EXPORTERS", zoo.EXPORTERS)
    return [pytest.param((m, e), id=f"{m}-{e}") for m in models for e in exporters]


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers this marker itself; registering it here keeps --strict-markers happy without it.
    config.addinivalue_line("markers", "xdist_group(name): run these tests in one pytest-xdist worker")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrizes every test that takes ``zoo_case`` over ``zoo_cases()``."""
    if "zoo_case" in metafunc.fixturenames:
        metafunc.parametrize("zoo_case", zoo_cases())


def _requested(session: pytest.Session) -> list[tuple[str, str]]:
    cases = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "zoo_case" in callspec.params:
            cases.add(tuple(callspec.params["zoo_case"]))
    order = {(m, e): i for i, (m, e) in enumerate((m, e) for m in zoo.MODELS for e in zoo.EXPORTERS)}
    return sorted(cases, key=order.__getitem__)


@pytest.fixture(scope="session")
def zoo_dir(request: pytest.FixtureRequest) -> pathlib.Path:
    """Exports every (model, exporter) the session's tests ask for, once, into the zoo cache directory.

    The directory is ``$GTCO_ZOO_DIR`` or ``~/.cache/onnx-gtco/zoo``; valid earlier exports are reused.
    A failed export is remembered and fails only the tests of that case (see ``zoo_onnx``).
    """
    for module in zoo.ZOO_DEPS:
        pytest.importorskip(module, reason=TORCH_REASON)
    out = zoo.default_out_dir()
    errors: dict[tuple[str, str], str] = {}
    for name, exporter in _requested(request.session):
        try:
            zoo.export(name, exporter, out)
        except Exception as exc:  # reported per test
            errors[(name, exporter)] = f"{type(exc).__name__}: {exc}"
    request.config.stash[_ERRORS] = errors
    return out


@pytest.fixture
def zoo_onnx(
    zoo_dir: pathlib.Path, zoo_case: tuple[str, str], request: pytest.FixtureRequest
) -> pathlib.Path:
    """Path of the exported ONNX file of ``zoo_case``; fails the test if that export failed."""
    error = request.config.stash[_ERRORS].get(tuple(zoo_case))
    if error is not None:
        pytest.fail(f"export of {zoo_case[0]} with {zoo_case[1]} failed: {error}", pytrace=False)
    return zoo.onnx_path(zoo_dir, *zoo_case)


@pytest.fixture(scope="session")
def torch_outputs() -> Callable[[str, int], dict[str, Any]]:
    """Returns ``get(name, seed)``: the torch outputs on ``make_inputs(name, seed)``, computed once each."""
    for module in zoo.ZOO_DEPS:
        pytest.importorskip(module, reason=TORCH_REASON)
    cache: dict[tuple[str, int], dict[str, Any]] = {}

    def get(name: str, seed: int) -> dict[str, Any]:
        if (name, seed) not in cache:
            cache[(name, seed)] = zoo.run_torch(name, seed=seed)
        return cache[(name, seed)]

    return get
