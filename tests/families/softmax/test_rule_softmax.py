"""A standalone Softmax over the last axis."""

from __future__ import annotations

from onnx_gtco.families.softmax.rule import SoftmaxPattern

RULE = SoftmaxPattern()


def test_last_axis_only(kit) -> None:
    g = kit.graph()
    g.input("x", [2, 3, 10])
    g.op("Softmax", ["x"], "last", axis=-1)
    g.op("Softmax", ["x"], "last_positive", axis=2)
    g.op("Softmax", ["x"], "middle", axis=1)
    g.output("last", "last_positive", "middle")
    view = g.view()
    matches, rejects = kit.run(RULE, view)
    assert kit.groups(view, matches) == [{"last"}, {"last_positive"}]
    assert matches[0].attrs == {"axis": -1, "rows": 6, "cols": 10}
    assert [(r.anchor, r.reason) for r in rejects] == [("middle", "Softmax axis 1 is not the last axis")]
    cands, _ = kit.collect(view)
    assert sorted(len(c.nodes) for c in cands if c.family == "softmax") == [1, 1]


def test_symbolic_rows(kit) -> None:
    g = kit.graph()
    g.input("x", ["batch", 4, 10])
    g.op("Softmax", ["x"], "sm", axis=-1)
    g.output("sm")
    matches, _ = kit.run(RULE, g.view())
    assert matches[0].attrs == {"axis": -1, "rows": "batch*4", "cols": 10}
