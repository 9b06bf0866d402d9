"""The report for people: Markdown and PNG rendered from a real optimize report (ViT-tiny, one block), the
optimize --report-md option, and bad input as one line and exit 2."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from onnx_gtco import models, report_md
from onnx_gtco.cli import EXIT_ERROR, EXIT_OK, main
from onnx_gtco.ir.export import save_atomic
from onnx_gtco.pipeline import optimize_file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """ViT-tiny with one block, optimized with the library's CPU kernels; its JSON report's path and content."""
    d = tmp_path_factory.mktemp("vit")
    src = d / "vit.onnx"
    save_atomic(models.build("vit-tiny", depth=1), src)
    _, _, rep = optimize_file(src, build="cpu")
    return rep, json.loads(rep.read_text())


def _row(md: str, first: str) -> list[str]:
    """The cells of the Markdown table row whose first cell is `first`."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no table row {first!r} in:\n{md}")


def _section(md: str, title: str) -> str:
    """The text of the `## title` section, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", md, re.S | re.M)
    assert m, f"no section {title!r}"
    return m.group(1)


def test_header_and_families_match_the_json(vit: tuple[Path, dict[str, Any]]) -> None:
    _, rep = vit
    md = report_md.render(rep)
    assert md.startswith(f"# onnx-gtco report: {rep['model']}\n")
    assert f"**{rep['target']}**" in md and f"**{rep['precision']}**" in md
    nodes = _row(md, "nodes")
    assert nodes[1:3] == [str(rep["nodes_before"]), str(rep["nodes_after"])]
    pred = _row(md, "predicted time, µs (estimate)")
    assert pred[1:3] == [report_md._us(rep["predicted_us_before"]), report_md._us(rep["predicted_us_after"])]
    assert "measured time" not in md  # nothing was measured: no measured row, no per-group comparison
    assert "Predicted vs measured" not in md
    assert f"{100 * rep['fused_flop_share']:.1f}%" in md
    fams = _section(md, "Fused groups by family")
    assert rep["families"]  # the ViT block has gemm, attention, layernorm and conv groups
    for fam, count in rep["families"].items():
        groups = [g for g in rep["groups"] if g["family"] == fam]
        cells = _row(fams, fam)
        assert cells[1:3] == [str(count), str(sum(len(g["nodes"]) for g in groups))]
        assert cells[3] == report_md._us(sum(g["predicted_unfused_us"] for g in groups))
        assert cells[4] == report_md._us(sum(g["predicted_us"] for g in groups))
    total = _row(fams, "**total**")
    # the rows are the planned graph's (the patch embedding rewritten as a patchify copy and a GEMM)
    assert total[1:3] == [str(rep["groups_fused"]), str(rep.get("nodes_planned", rep["nodes_before"]))]
    assert total[3] == report_md._us(rep.get("predicted_us_before_planned", rep["predicted_us_before"]))


def test_unfused_section_has_reasons_and_op_types(vit: tuple[Path, dict[str, Any]]) -> None:
    _, rep = vit
    text = _section(report_md.render(rep), "What stays unfused")
    assert rep["rejected"], "the ViT block's elementwise split is rejected by a rule check"
    for r in rep["rejected"]:
        assert r["reason"] in text
    for op, n in rep["unfused_ops"].items():
        assert _row(text, op)[1] == str(n)
    assert f"{len(rep['not_chosen'])} candidates lost to a cheaper cover" in text


def test_coverage_matches_the_library_section(vit: tuple[Path, dict[str, Any]]) -> None:
    _, rep = vit
    lib = rep["library"]
    text = _section(report_md.render(rep), "Custom-op library and device kernels")
    assert lib["file"] in text and "CPU kernels only" in text
    assert not lib["skipped"], "every group of the ViT, its patch-embedding conv included, has a CPU kernel"
    assert _row(text, "fused nodes, all")[1] == str(len(rep["groups"]))
    assert _row(text, "keep their model-local functions (no kernel in the library)")[1] == str(len(lib["skipped"]))
    assert _row(text, "run the library's CPU kernels")[1] == str(len(rep["groups"]) - len(lib["skipped"]))
    for why in lib["skipped"].values():
        assert why in text
    assert "device kernels on" not in text  # a CPU-only build claims no device coverage


def test_device_coverage_per_arch_and_kernel_resources(vit: tuple[Path, dict[str, Any]]) -> None:
    """A CUDA build's section (the ViT report's groups, with kernel entries shaped as library.to_json writes them):
    per arch, the bound nodes less those with a kernel skip; every instance's ptxas resources."""
    _, rep = vit
    rep = copy.deepcopy(rep)
    bound = [g["name"] for g in rep["groups"] if g["name"] not in rep["library"]["skipped"]]
    gemms = [n for n in bound if "/gemm/" in n]
    rep["library"].update(cuda=True, kernel_skips={n: "gemm runs on Tensor Cores in fp16 or bf16" for n in gemms},
                          kernels=[{"instance": f"layernorm_{a.replace('_', '')}_x", "arch": a,
                                    "config": {"THREADS": 32}, "dynamic_smem_bytes": 32, "compile_s": 1.0,
                                    "cached": True,
                                    "kernels": [{"registers": 30 + i, "static_smem_bytes": 0, "stack_frame_bytes": 0,
                                                 "spill_store_bytes": 0, "spill_load_bytes": 0}]}
                                   for i, a in enumerate(("sm_80", "sm_90"))])
    text = _section(report_md.render(rep), "Custom-op library and device kernels")
    for arch in ("sm_80", "sm_90"):
        assert _row(text, f"with device kernels on {arch}")[1] == str(len(bound) - len(gemms))
    assert _row(text, "bound, but without a device kernel")[1] == str(len(gemms))
    assert _row(text, "gemm runs on Tensor Cores in fp16 or bf16")[1] == str(len(gemms))
    assert _row(text, "`layernorm_sm90_x`")[1:4] == ["sm_90", "THREADS=32", "31"]


def test_measured_times_are_shown_beside_the_predictions(vit: tuple[Path, dict[str, Any]]) -> None:
    _, rep = vit
    rep = copy.deepcopy(rep)
    g = rep["groups"][0]
    g["measured_us"] = 1.25
    md = report_md.render(rep)
    assert "## Predicted vs measured, per group" in md
    row = _row(_section(md, "Predicted vs measured, per group"), f"`{g['name']}`")
    assert row[2:4] == [report_md._us(g["predicted_us"]), "1.25"]
    n = rep["families"][g["family"]]
    assert _row(_section(md, "Fused groups by family"), g["family"])[5] == f"1.25 (1 of {n})"


def test_optional_sections_absent_or_none(vit: tuple[Path, dict[str, Any]]) -> None:
    _, rep = vit
    rep = {k: v for k, v in rep.items() if k != "library"}
    md = report_md.render(rep)
    assert "none: the model was written without its custom-op library" in md
    assert "## Tuning" not in md and "## Dynamic shapes" not in md
    rep["dynamic"] = {"ranges": "batch=1:8", "dims": [{"dim": "batch", "lo": 1, "hi": 8, "source": "--dynamic"}]}
    assert _row(_section(report_md.render(rep), "Dynamic shapes"), "batch")[1:] == ["1", "8", "--dynamic"]


def test_cli_report_writes_markdown_and_png(vit: tuple[Path, dict[str, Any]], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path, rep = vit
    assert main(["report", str(path)]) == EXIT_OK
    assert capsys.readouterr().out == report_md.render(rep)
    md, png = tmp_path / "r.md", tmp_path / "r.png"
    assert main(["report", str(path), "-o", str(md), "--png", str(png)]) == EXIT_OK
    assert md.read_text() == report_md.render(rep)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.md", "r.png"]  # no temporary files left


def test_optimize_report_md(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.onnx"
    save_atomic(models.build("vit-tiny", depth=1), src)
    assert main(["optimize", str(src), "--no-build", "--report-md"]) == EXIT_OK
    md = tmp_path / "m.gtco.onnx.report.md"
    assert f"markdown   {md}" in capsys.readouterr().out
    rep = json.loads((tmp_path / "m.gtco.onnx.report.json").read_text())
    assert md.read_text() == report_md.render(rep)
    other = tmp_path / "x.md"
    assert main(["optimize", str(src), "--no-build", "--report-md", str(other)]) == EXIT_OK
    assert other.read_text() == md.read_text()


def test_optimize_report_md_in_a_missing_folder_writes_nothing(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.onnx"
    save_atomic(models.build("vit-tiny", depth=1), src)
    code = main(["optimize", str(src), "--no-build", "--report-md", str(tmp_path / "nope" / "m.md")])
    assert code == EXIT_ERROR and capsys.readouterr().err.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "missing.json", "no such file"),
    (lambda d: _write(d / "bad.json", "{not json"), "not JSON"),
    (lambda d: _write(d / "list.json", "[1, 2]"), "not an onnx-gtco report"),
    (lambda d: _write(d / "bench.json", json.dumps({"model": "m", "target": "sm_90", "precision": "fp32"})),
     "no key 'nodes_before'"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], make,
                                                          message: str) -> None:
    src = make(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    code = main(["report", str(src), "-o", str(out / "r.md"), "--png", str(out / "r.png")])
    err = capsys.readouterr()
    assert code == EXIT_ERROR
    assert err.out == ""
    assert err.err.count("\n") == 1 and err.err.startswith("onnx-gtco: error: ") and message in err.err
    assert list(out.iterdir()) == []


def test_group_without_a_key_is_named(vit: tuple[Path, dict[str, Any]], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, rep = vit
    rep = copy.deepcopy(rep)
    del rep["groups"][1]["family"]
    bad = _write(tmp_path / "r.json", json.dumps(rep))
    assert main(["report", str(bad)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.strip() == f"onnx-gtco: error: {bad}: not an onnx-gtco report (groups[1] has no key 'family')"


def test_png_failure_leaves_no_markdown(vit: tuple[Path, dict[str, Any]], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = vit
    md = tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(md), "--png", str(tmp_path / "no-such-dir" / "r.png")]) == EXIT_ERROR
    assert "no-such-dir" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
