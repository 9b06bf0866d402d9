"""The generated glue as a template fills it (plugins/ort/glue.cc.j2, kernels.render): strict about what it is given,
and NodeSpec rows that name their fields, so that a field moved in gtco_ort.h cannot shift the values after it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
from plugin_helpers import ln_softmax_model

from onnx_gtco import optimize
from onnx_gtco.kernels.render import macro, render
from onnx_gtco.kernels.toolchain import GLUE_INCLUDE_DIRS, PLUGINS_DIR, find_cxx
from onnx_gtco.plugin.headers import ort_include_dir
from onnx_gtco.plugin.library import CXX_FLAGS, bind_nodes, generate_glue
from onnx_gtco.plugin.nodes import fused_nodes


def test_a_missing_variable_is_an_error() -> None:
    with pytest.raises(jinja2.UndefinedError, match="'headers' is undefined"):
        render("ort/glue.cc.j2", emulated=False)
    with pytest.raises(jinja2.UndefinedError, match="'outputs' was not provided"):
        macro("families/elementwise/elementwise.cu.j2", "program", storage="float", qualifier="", dims=[4],
              inputs=[{"type": "T", "strides": [1], "base": 0, "rolls": []}], body=["x[0]"])


def _compile(source: Path, ort_dir: Path) -> subprocess.CompletedProcess[str]:
    inc = [f"-I{ort_dir}", *(f"-I{d}" for d in GLUE_INCLUDE_DIRS), f"-I{ort_include_dir()}"]
    return subprocess.run([find_cxx(), *CXX_FLAGS, "-O0", *inc, "-c", str(source), "-o", str(source.with_suffix(".o"))],
                          capture_output=True, text=True, timeout=300, check=False)


def test_nodespec_rows_name_their_fields(tmp_path: Path) -> None:
    nodes = fused_nodes(optimize(ln_softmax_model()).model)
    results, binders = bind_nodes(nodes)
    source, op_types, _ = generate_glue(nodes, results, binders, {})
    assert op_types and source.count("{.op_type = ") == sum(r.binding is not None for r in results)
    glue = tmp_path / "glue.cc"
    glue.write_text(source)
    proc = _compile(glue, PLUGINS_DIR / "ort")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same glue against a NodeSpec whose n_inputs and n_outputs trade places: a compile error, not a library
    # that reads every node's input count as its output count
    moved = tmp_path / "ort"
    shutil.copytree(PLUGINS_DIR / "ort", moved)
    header = (moved / "gtco_ort.h").read_text()
    fields = "    int n_inputs;\n    int n_outputs;\n"
    assert fields in header
    (moved / "gtco_ort.h").write_text(header.replace(fields, "    int n_outputs;\n    int n_inputs;\n"))
    proc = _compile(glue, moved)
    assert proc.returncode != 0 and "designator order" in proc.stderr, proc.stderr[-3000:]
