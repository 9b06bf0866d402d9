"""Determinism: optimizing the same model in two fresh processes with different hash seeds gives byte-identical
rewritten models, identical generated library sources (the glue .cc and the device kernels' .cu, which the
library's content hash covers) and identical reports once timing fields are dropped."""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

from onnx_gtco import models

# ViT (attention, LayerNorm, GEMM epilogues, GELU chains) and BERT (embeddings, masks): every kernel family.
MODELS = {"vit": ("vit-tiny", {"depth": 1}), "bert": ("bert-tiny", {})}

_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path

    import onnx

    from onnx_gtco.cli import main
    from onnx_gtco.plugin.library import CUDA_ARCHS, bind_nodes, generate_glue, select_device
    from onnx_gtco.plugin.nodes import fused_nodes

    out = Path(sys.argv[1])
    for src in map(Path, sys.argv[2:]):
        d = out / src.stem
        d.mkdir()
        code = main(["optimize", "--no-build", str(src), "-o", str(d / "model.gtco.onnx")])
        if code:
            sys.exit(code)
        model = onnx.load(str(d / "model.gtco.onnx"))
        nodes = fused_nodes(model)
        results, binders = bind_nodes(nodes)
        device, _ = select_device(nodes, results, CUDA_ARCHS)
        (d / "glue.cc").write_text(generate_glue(nodes, results, binders, device, False)[0])
        for insts in device.values():
            for inst in insts:
                (d / f"{inst.name}.{inst.arch}.cu").write_text(inst.source)
""")

_TIMING = re.compile(r"(^|_)(seconds|secs?|time|timings?|elapsed|wall)(_|$)|_s$|_ms$")


def _without_timings(value: object) -> object:
    """The report with every key that holds a timing removed, at any depth."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not _TIMING.search(k)}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _first_difference(a: str, b: str, what: str) -> str:
    for line in difflib.unified_diff(a.splitlines(), b.splitlines(), "run 1", "run 2", lineterm="", n=0):
        if line.startswith(("-", "+")) and not line.startswith(("---", "+++")):
            return f"{what} differs between the runs; first differing line: {line[:300]}"
    return f"{what} differs between the runs (same lines, different bytes)"


def _run(out: Path, sources: list[Path], hash_seed: str) -> None:
    out.mkdir()
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    res = subprocess.run([sys.executable, "-c", _CHILD, str(out), *map(str, sources)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
def test_two_runs_are_byte_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sources = []
    for key, (name, overrides) in MODELS.items():
        sources.append(tmp_path / f"{key}.onnx")
        onnx.save(models.build(name, seed=0, **overrides), str(sources[-1]))
    runs = [tmp_path / "run1", tmp_path / "run2"]
    for out, seed in zip(runs, ("1", "2"), strict=True):
        _run(out, sources, seed)
    counts = {"models": 0, "sources": 0, "reports": 0}
    for src in sources:
        a, b = runs[0] / src.stem, runs[1] / src.stem
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir()), f"{src.stem}: the runs wrote different files"
        assert "glue.cc" in names and any(n.endswith(".cu") for n in names), names
        model = (a / "model.gtco.onnx").read_bytes()
        assert model == (b / "model.gtco.onnx").read_bytes(), _first_difference(
            str(onnx.load_from_string(model)), str(onnx.load(str(b / "model.gtco.onnx"))), f"{src.stem} model")
        counts["models"] += 1
        for name in names:
            if name.endswith((".cc", ".cu")):
                ta, tb = (a / name).read_text(), (b / name).read_text()
                assert ta == tb, _first_difference(ta, tb, f"{src.stem}/{name}")
                counts["sources"] += 1
        ra, rb = (json.dumps(_without_timings(json.loads((d / "model.gtco.onnx.report.json").read_text())),
                             indent=1, sort_keys=True) for d in (a, b))
        assert ra == rb, _first_difference(ra, rb, f"{src.stem} report")
        assert json.loads(ra)["groups"], "a report without fused groups proves little"
        counts["reports"] += 1
    with capsys.disabled():
        print(f"\ndeterminism: {counts['models']} models, {counts['sources']} generated sources, {counts['reports']} "
              "reports identical over two processes (PYTHONHASHSEED 1 and 2)")
