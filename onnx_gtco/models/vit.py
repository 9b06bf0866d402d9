"""Vision transformers (ViT, DeiT, distilled DeiT) built as timm models export through TorchScript."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from onnx_gtco.models._build import (
    Builder,
    attention_core,
    check_dims,
    check_forms,
    gelu_act,
    layer_norm,
    linear,
)

LN_EPS = 1e-6  # timm's ViT LayerNorm


def vit(*, batch: int | str = 1, seed: int = 0, image: int = 224, patch: int = 16, channels: int = 3,
        dim: int = 192, depth: int = 12, heads: int = 3, mlp: int = 768, classes: int = 1000,
        distilled: bool = False, ln: str = "op", gelu: str = "erf", qkv: str = "fused", opset: int = 17,
        name: str = "vit") -> onnx.ModelProto:
    """A pre-norm ViT classifier: `pixel_values` [batch, channels, image, image] -> `logits` [batch, classes].

    Conv patch embedding (kernel = stride = patch) -> Reshape -> Transpose -> Concat(Expand(cls_token),
    patches) -> Add pos_embed -> `depth` blocks -> LayerNorm -> Gather token 0 -> Gemm head. Each block:
    x + proj(attention(norm1(x))), then x + fc2(gelu(fc1(norm2(x)))). With `distilled`, a distillation token
    follows the cls token and the logits are the mean of the cls head and the distillation head (DeiT).

    Args:
        batch: the batch size, or a dim name for a symbolic batch (Reshapes then copy it with 0).
        seed: seed of the numpy generator drawing every weight.
        image: image height and width in pixels.
        patch: patch size; `image` must be a multiple of it.
        channels: input channels.
        dim: embedding width.
        depth: number of blocks.
        heads: attention heads; `dim` must be a multiple of it.
        mlp: hidden width of the MLP.
        classes: output classes.
        distilled: add DeiT's distillation token and head.
        ln: "op" (LayerNormalization, opset >= 17) or "decomposed" (ReduceMean ... Sqrt, Div chain).
        gelu: "erf" (Div/Erf/Add/Mul/Mul), "tanh" (the tanh approximation with Pow) or "op" (Gelu,
            opset >= 20).
        qkv: "fused" (one qkv Linear, Reshape/Transpose/Gather unbind, as timm) or "split" (three Linears).
        opset: the default-domain opset, 13..21.
        name: the graph name.

    Returns:
        The model, with float32 weights drawn deterministically from `seed`.

    Raises:
        ValueError: a size is not positive or does not divide, or a form is unknown or needs a newer opset.
    """
    check_forms(opset, ln, gelu, qkv)
    check_dims(dim, heads, image=image, patch=patch, channels=channels, depth=depth, mlp=mlp, classes=classes)
    if image % patch:
        raise ValueError(f"image {image} is not a multiple of patch {patch}")
    b = Builder(name, seed=seed, opset=opset, batch=batch)
    pixels = b.input("pixel_values", TensorProto.FLOAT, [batch, channels, image, image])
    patches = (image // patch) ** 2
    prefix = 2 if distilled else 1
    seq = patches + prefix

    w = b.param("patch_embed.proj.weight", (dim, channels, patch, patch))
    x = b.op("Conv", [pixels, w, b.param("patch_embed.proj.bias", (dim,))], "patch_embed.proj",
             dilations=[1, 1], group=1, kernel_shape=[patch, patch], pads=[0, 0, 0, 0],
             strides=[patch, patch])
    x = b.reshape(x, "patch_embed.flatten", [dim, patches])
    x = b.op("Transpose", [x], "patch_embed.transpose", perm=[0, 2, 1])
    shape = _expand_shape(b, pixels, dim)
    tokens = [b.op("Expand", [b.param(t, (1, 1, dim)), shape], f"{t}.expand")
              for t in ("cls_token", "dist_token")[:prefix]]
    x = b.op("Concat", [*tokens, x], "tokens.concat", axis=1)
    x = b.op("Add", [x, b.param("pos_embed", (1, seq, dim))], "pos_embed.add")

    for i in range(depth):
        p = f"blocks.{i}"
        h = layer_norm(b, x, f"{p}.norm1", dim, ln, LN_EPS)
        h = attention_core(b, h, f"{p}.attn", seq=seq, dim=dim, heads=heads, qkv=qkv, scale_op="Mul")
        x = b.op("Add", [x, linear(b, h, f"{p}.attn.proj", dim, dim)], f"{p}.residual1")
        h = layer_norm(b, x, f"{p}.norm2", dim, ln, LN_EPS)
        h = gelu_act(b, linear(b, h, f"{p}.mlp.fc1", dim, mlp), f"{p}.mlp.act", gelu)
        x = b.op("Add", [x, linear(b, h, f"{p}.mlp.fc2", mlp, dim)], f"{p}.residual2")

    x = layer_norm(b, x, "norm", dim, ln, LN_EPS)
    heads_out = []
    for idx, head in enumerate(("head", "head_dist")[:prefix]):
        token = b.op("Gather", [x, b.const(f"{head}.token_index", idx, np.int64)], f"{head}.token", axis=1)
        weight, bias = b.param(f"{head}.weight", (classes, dim)), b.param(f"{head}.bias", (classes,))
        heads_out.append(b.op("Gemm", [token, weight, bias], head, out=None if distilled else "logits",
                              alpha=1.0, beta=1.0, transB=1))
    if distilled:
        both = b.op("Add", heads_out, "head.sum")
        b.op("Div", [both, b.const("head.average.divisor", 2.0)], "head.average", out="logits")
    b.output("logits", TensorProto.FLOAT, [batch, classes])
    kind = "distilled DeiT" if distilled else "ViT"
    return b.model(f"{name}: {kind}, image {image}, patch {patch}, dim {dim}, depth {depth}, heads {heads}, "
                   f"mlp {mlp}, classes {classes}, ln={ln}, gelu={gelu}, qkv={qkv}, seed {seed}")


def _expand_shape(b: Builder, pixels: str, dim: int) -> str:
    """The target shape [batch, 1, dim] of the token Expand: a constant, or built from the input's batch."""
    if isinstance(b.batch, int):
        return b.const("tokens.expand_shape", [b.batch, 1, dim], np.int64)
    shape = b.op("Shape", [pixels], "tokens.input_shape")
    n = b.op("Gather", [shape, b.const("tokens.batch_index", 0, np.int64)], "tokens.batch", axis=0)
    n = b.op("Unsqueeze", [n, b.const("tokens.batch_axes", [0], np.int64)], "tokens.batch_1d")
    tail = b.const("tokens.shape_tail", [1, dim], np.int64)
    return b.op("Concat", [n, tail], "tokens.expand_shape", axis=0)
