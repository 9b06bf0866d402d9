"""Conv with bias, FrozenBatchNorm (Mul/Add per channel), activation and residual epilogues."""

from __future__ import annotations

from onnx_gtco.patterns.conv import ConvPattern

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
                     "groups": 1, "bias": False, "affine": True, "activation": "relu", "residual": False,
                     "post_activation": "none"}
    assert (last["groups"], last["bias"], last["residual"]) == (2, True, True)
    assert last["post_activation"] == "relu"


def test_scale_that_is_not_per_channel_is_a_near_miss(kit) -> None:
    view = block(kit, bad_scale=True)
    matches, rejects = kit.run(RULE, view)
    assert kit.groups(view, matches)[0] == {"conv1"} and kit.groups(view, matches)[1] == {"conv2"}
    assert rejects[0].reason == "Mul 'bn1_mul' of constant shape (1, 1, 1, 8) does not broadcast along axis 1"
