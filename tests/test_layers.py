"""Rules of the package's layout that import-linter cannot state: which module reads the environment, where error
classes live, and that modules import only each other's public names. (The stage order itself is the `layers`
contract in pyproject.toml, which `make lint` checks.)"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "onnx_gtco"
ENV_ACCESS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _modules() -> list[tuple[str, ast.Module]]:
    """(path relative to the repository root, parsed module) of every Python file of the package."""
    root = PACKAGE.parent
    return [(p.relative_to(root).as_posix(), ast.parse(p.read_text(encoding="utf-8"), filename=str(p)))
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_the_package_is_found() -> None:
    names = {path for path, _ in _modules()}
    assert {"onnx_gtco/config.py", "onnx_gtco/errors.py", "onnx_gtco/kernels/toolchain.py"} <= names


def test_only_config_reads_the_environment() -> None:
    readers = []
    for path, tree in _modules():
        if path == "onnx_gtco/config.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ENV_ACCESS:
                readers.append(f"{path}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                readers += [f"{path}:{node.lineno} from os import {a.name}" for a in node.names if a.name in ENV_ACCESS]
    assert readers == [], "read the environment through a function of onnx_gtco/config.py:\n" + "\n".join(readers)


def test_the_environment_check_sees_a_read() -> None:
    tree = ast.parse("import os\nx = os.environ.get('A')\ny = os.getenv('B')\n")
    found = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ENV_ACCESS]
    assert sorted(found) == ["environ", "getenv"]
