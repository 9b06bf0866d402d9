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


OTHER_EXCEPTIONS: set[tuple[str, str]] = set()  # exception classes allowed outside errors.py: none


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, ast.Name | ast.Attribute)]


def _exception_classes(modules: list[tuple[str, ast.Module]]) -> list[tuple[str, str, int]]:
    """(path, class name, line) of every class that derives from an exception: a builtin one, one of the package's
    own (followed through any depth), or a library's whose name says so (...Error, ...Exception, ...Warning)."""
    import builtins

    known = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    classes = [(path, node) for path, tree in modules for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    found: dict[tuple[str, str], int] = {}
    while True:
        more = {(path, c.name): c.lineno for path, c in classes if (path, c.name) not in found
                and any(b in known or b.endswith(("Error", "Exception", "Warning")) for b in _base_names(c))}
        if not more:
            return sorted((path, name, line) for (path, name), line in found.items())
        found.update(more)
        known |= {name for _, name in more}


def test_every_exception_class_lives_in_errors_py() -> None:
    modules = _modules()
    found = _exception_classes(modules)
    assert {name for path, name, _ in found if path == "onnx_gtco/errors.py"} >= {"GtcoError", "BuildError"}
    elsewhere = [f"{path}:{line} {name}" for path, name, line in found
                 if path != "onnx_gtco/errors.py" and (path, name) not in OTHER_EXCEPTIONS]
    assert elsewhere == [], "define exception classes in onnx_gtco/errors.py:\n" + "\n".join(elsewhere)


def test_the_exception_check_follows_bases() -> None:
    tree = ast.parse("class A(ValueError): pass\nclass B(A): pass\nclass C(x.FooError): pass\nclass D: pass\n")
    assert [name for _, name, _ in _exception_classes([("m.py", tree)])] == ["A", "B", "C"]


OTHER_PRIVATE_IMPORTS: set[tuple[str, str]] = set()  # private names allowed across modules: none


def _module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _private_imports(modules: list[tuple[str, ast.Module]]) -> list[tuple[str, int, str, str]]:
    """(path, line, imported name, the private name in it) of every `from X import _y`, and every import of a private
    module `_m`, made outside the package or module the private name belongs to."""
    found = []
    for path, tree in modules:
        me = _module_name(path)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("onnx_gtco")):
                continue
            for name in (f"{node.module}.{a.name}" for a in node.names):
                parts = name.split(".")
                private = next((i for i, part in enumerate(parts) if part.startswith("_") and not
                                part.startswith("__")), None)
                if private is not None and not me.startswith(".".join(parts[:private]) + "."):
                    found.append((path, node.lineno, name, ".".join(parts[:private + 1])))
    return found


def test_modules_import_only_public_names_of_other_modules() -> None:
    found = [f"{path}:{line} {name}" for path, line, name, private in _private_imports(_modules())
             if (path, private) not in OTHER_PRIVATE_IMPORTS]
    assert found == [], "import public names (give the shared ones a public name):\n" + "\n".join(found)


def test_the_private_import_check_knows_whose_name_it_is() -> None:
    own = ast.parse("from onnx_gtco.patterns._util import dims\nfrom onnx_gtco.patterns import _heads\n")
    other = ast.parse("from onnx_gtco.tune.search import _space, storage_url\nfrom onnx_gtco.patterns._act import R\n")
    found = _private_imports([("onnx_gtco/patterns/gemm.py", own), ("onnx_gtco/tune/shape_generic.py", other)])
    assert [(name, private) for _, _, name, private in found] == [
        ("onnx_gtco.tune.search._space", "onnx_gtco.tune.search._space"),
        ("onnx_gtco.patterns._act.R", "onnx_gtco.patterns._act")]


MAX_FUNCTION_LINES = 100


def _long_functions(tree: ast.Module, path: str) -> list[str]:
    return [f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n.end_lineno or n.lineno) - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_over_a_hundred_lines() -> None:
    root = PACKAGE.parent
    tools = [p for p in (root / "tools").rglob("*") if p.is_file() and (p.suffix == ".py" or p.name == "gpu_suite")]
    found = [*(f for path, tree in _modules() for f in _long_functions(tree, path)),
             *(f for p in sorted(tools)
               for f in _long_functions(ast.parse(p.read_text(encoding="utf-8")), p.relative_to(root).as_posix()))]
    assert found == [], "split these along the steps they take:\n" + "\n".join(found)


def test_the_length_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(ast.parse(f"def f():\n{body}\n"), "m.py") == ["m.py:1 f (101 lines)"]
