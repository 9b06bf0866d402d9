"""Conv with bias, FrozenBatchNorm (Mul/Add per channel), activation and residual epilogues."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_gtco.families.conv.rule import ConvPattern

RULE = ConvPattern()


def block(kit, *, bad_scale: bool = False):
    """DETR's ResNet: Conv -> Mul(scale) -> Add(shift) -> Relu, then Conv(bias) -> + identity -> Relu."""
    g = kit.graph()
    g.input("x", [1, 4, 8, 8])
    g.op("Conv", ["x", g.weight("w1", 4, 4, 3, 3)], "conv1", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.op("Mul", ["conv1", g.weight("s1", 1, 1, 1, 8) if bad_scale else g.weight("s1", 1, 4, 1, 1)], "bn1_mul")
    g.op("Add", ["bn1_mul", g.weight("t1", 1, 4, 1, 1)], "bn1_add")
    g.op("Relu", ["bn1_add"], "relu1")
    g.op("Conv", ["relu1", g.weight("w2", 4, 2, 3, 3), g.weight("b2", 4)], "conv2", kernel_shape=[3, 3],
         pads=[1, 1, 1, 1], strides=[1, 1], group=2)
    g.op("Add", ["conv2", "x"], "residual")
    g.op("Relu", ["residual"], "relu2")
    g.output("relu2")
    return g.view()


def test_prefix_variants(kit) -> None:
    view = block(kit)
    matches, rejects = kit.run(RULE, view)
    assert rejects == []
    assert kit.groups(view, matches) == [
        {"conv1"}, {"conv1", "bn1_mul"}, {"conv1", "bn1_mul", "bn1_add"},
        {"conv1", "bn1_mul", "bn1_add", "relu1"},
        {"conv2"}, {"conv2", "residual"}, {"conv2", "residual", "relu2"},
    ]
    first, last = matches[3].attrs, matches[-1].attrs
    assert first == {"kernel": (3, 3), "stride": (1, 1), "pads": (1, 1, 1, 1), "dilations": (1, 1),
                     "auto_pad": "NOTSET", "groups": 1, "bias": False, "scale": True, "shift": True,
                     "batchnorm": False, "epsilon": None, "affine": True, "activation": "relu", "residual": False,
                     "post_activation": "none"}
    assert matches[3].roles == {"x": "x", "w": "w1", "scale": "s1", "shift": "t1"}
    assert matches[3].outputs == {"y": "relu1"}
    assert (last["groups"], last["bias"], last["residual"]) == (2, True, True)
    assert last["post_activation"] == "relu"
    assert last.get("scale") is False and matches[-1].outputs == {"y": "relu2"}
    assert matches[-1].roles == {"x": "relu1", "w": "w2", "bias": "b2", "residual": "x"}


def affine_chain(kit, steps: list[str]):
    """Conv without bias followed by the given per-channel steps ("Add", "Mul", "BatchNormalization")."""
    g = kit.graph()
    g.input("x", [1, 4, 6, 6])
    out = g.op("Conv", ["x", g.weight("w", 4, 4, 1, 1)], "conv")
    for i, op in enumerate(steps):
        if op == "BatchNormalization":
            bn = [g.weight(f"bn{i}_{k}", 4) for k in ("g", "b", "m")] + [g.const(f"bn{i}_v", np.full(4, 0.5))]
            out = g.op(op, [out, *bn], f"s{i}", epsilon=1e-3)
        else:
            out = g.op(op, [out, g.weight(f"c{i}", 4, 1, 1)], f"s{i}")
    g.output(out)
    return g.view()


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_auto_pad_is_carried_into_the_candidate(kit, auto_pad: str) -> None:
    """SAME_* pads depend on x's size, which the kernels read at run time: the rule carries the Conv's auto_pad (its
    pads stay zero), else the fused node would pad as NOTSET does."""
    g = kit.graph()
    g.input("x", [1, 4, 8, 8])
    g.op("Conv", ["x", g.weight("w", 4, 4, 3, 3)], "conv", strides=[2, 2], auto_pad=auto_pad)
    g.op("Relu", ["conv"], "relu")
    g.output("relu")
    matches, _ = kit.run(RULE, g.view())
    assert [(m.attrs["auto_pad"], m.attrs["pads"]) for m in matches] == [(auto_pad, (0, 0, 0, 0))] * 2


def test_affine_steps_take_bias_scale_shift_or_batchnorm_in_order(kit) -> None:
    view = affine_chain(kit, ["Add", "Mul", "Add"])
    matches, _ = kit.run(RULE, view)
    full = matches[-1]
    assert kit.groups(view, [full]) == [{"conv", "s0", "s1", "s2"}]
    assert full.roles == {"x": "x", "w": "w", "bias": "c0", "scale": "c1", "shift": "c2"}
    assert (full.attrs["bias"], full.attrs["scale"], full.attrs["shift"], full.attrs["affine"]) == (True,) * 4

    view = affine_chain(kit, ["BatchNormalization"])
    full = kit.run(RULE, view)[0][-1]
    assert full.roles == {"x": "x", "w": "w", "scale": "bn0_g", "shift": "bn0_b", "mean": "bn0_m", "var": "bn0_v"}
    assert full.attrs["batchnorm"] is True and full.attrs["epsilon"] == pytest.approx(1e-3)


def test_affine_steps_stop_where_the_order_breaks(kit) -> None:
    view = affine_chain(kit, ["Mul", "Mul"])           # a second scale: the group ends after the first
    assert kit.groups(view, kit.run(RULE, view)[0]) == [{"conv"}, {"conv", "s0"}]
    view = affine_chain(kit, ["Mul", "BatchNormalization"])
    assert kit.groups(view, kit.run(RULE, view)[0]) == [{"conv"}, {"conv", "s0"}]


def test_scale_that_is_not_per_channel_is_a_near_miss(kit) -> None:
    view = block(kit, bad_scale=True)
    matches, rejects = kit.run(RULE, view)
    assert kit.groups(view, matches)[0] == {"conv1"} and kit.groups(view, matches)[1] == {"conv2"}
    assert rejects[0].reason == "Mul 'bn1_mul' of constant shape (1, 1, 1, 8) does not broadcast along axis 1"
