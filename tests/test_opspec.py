"""The fused-op contract (onnx_gtco.opspec): one spec per family, which the C++ role enums and the rewrite follow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onnx_gtco.errors import RewriteError
from onnx_gtco.families.attention.bind import CPP_IN
from onnx_gtco.families.gemm.spec import QKV_PROJECTIONS
from onnx_gtco.opspec import SPECS, decode

FAMILIES = Path(__file__).resolve().parents[1] / "plugins" / "families"


def _enum(header: str, struct: str, enum: str) -> list[str]:
    """The enumerators of `enum` inside `struct` of plugins/families/<header>, lower-cased without IN_ / OUT_."""
    text = (FAMILIES / header).read_text()
    body = text[text.index(f"struct {struct}"):]
    if (base := re.match(rf"struct {struct} : (\w+)<", body)) is not None:  # the enums are its base template's
        body = text[text.index(f"struct {base.group(1)} {{"):]
    found = re.search(rf"enum {enum} \{{([^}}]*)\}}", body)
    assert found is not None, f"{header}: no enum {enum} in {struct}"
    names = [e.split("=")[0].strip() for e in found.group(1).split(",") if e.strip()]
    return [re.sub(r"^(IN|OUT)_", "", n).lower() for n in names]


@pytest.mark.parametrize(("family", "header", "struct"), [
    ("gemm", "gemm/gemm_op.h", "Gemm"), ("qkv", "gemm/gemm_op.h", "Qkv"), ("layernorm", "layernorm/layernorm_op.h",
    "LayerNorm"), ("softmax", "softmax/softmax_op.h", "Softmax"), ("conv", "conv/conv_op.h", "Conv"),
])
def test_cpp_role_enums_follow_the_spec(family: str, header: str, struct: str) -> None:
    spec = SPECS[family]
    assert tuple(_enum(header, struct, "InRole")) == spec.roles
    assert tuple(_enum(header, struct, "OutRole")) == spec.outputs


def test_qkv_projection_count_is_the_kernels() -> None:
    found = re.search(r"static constexpr int kMaxProj = (\d+);", (FAMILIES / "gemm/gemm_op.h").read_text())
    assert found is not None and int(found.group(1)) == QKV_PROJECTIONS


def test_attention_enum_covers_both_families() -> None:
    assert tuple(_enum("attention/attention_op.h", "AttentionGlue", "InRole")) == CPP_IN
    assert set(SPECS["attention"].roles) == set(CPP_IN) and set(SPECS["bmm_softmax"].roles) < set(CPP_IN)


def test_roles_lead_in_spec_order_and_read_back() -> None:
    spec = SPECS["attention"]
    external = ["shape", "qkv", "mask"]
    inputs, names = spec.order({"q": "qkv", "k": "qkv", "v": "qkv", "mask": "mask", "bias": "inside"}, external)
    assert inputs == ["qkv", "mask", "shape"] and names == ["q+k+v", "mask"]  # bias: computed inside, absent
    attrs = spec.encode({"heads": 2, "mask": True}, "fp16", names, ["out"])
    raw = {a.name: (a.ints or a.strings or a.s or a.i) for a in attrs}
    op = decode("Attention_f16", raw, inputs, ["y"])
    assert not isinstance(op, str)
    assert op.inputs == {"q": 0, "k": 0, "v": 0, "mask": 1} and op.outputs == {"out": 0}
    assert op["mask"] is True and op["k_layout"] == "bhds" and op["precision"] == "fp16"


def test_unknown_roles_and_families_are_refused() -> None:
    with pytest.raises(RewriteError, match="unknown input roles"):
        SPECS["gemm"].order({"c": "x"}, ["x"])
    assert "no fused-op spec" in str(decode("Pool_f32", {}))
