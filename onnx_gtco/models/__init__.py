"""Deterministic built-in transformers (ViT, DeiT, BERT) shaped like PyTorch exports, for demos and tests."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import onnx

from onnx_gtco.errors import GtcoError
from onnx_gtco.models.bert import bert
from onnx_gtco.models.vit import vit

BUILTIN: dict[str, Callable[..., onnx.ModelProto]] = {
    "vit-tiny": partial(vit, name="vit-tiny", dim=192, depth=12, heads=3, mlp=768),
    "vit-b16": partial(vit, name="vit-b16", dim=768, depth=12, heads=12, mlp=3072),
    "deit-s": partial(vit, name="deit-s", dim=384, depth=12, heads=6, mlp=1536),
    "deit-b": partial(vit, name="deit-b", dim=768, depth=12, heads=12, mlp=3072, distilled=True),
    "bert-tiny": partial(bert, name="bert-tiny", vocab=1000, seq=128, dim=128, depth=2, heads=2, mlp=512),
    "bert-base": partial(bert, name="bert-base", vocab=30522, seq=128, dim=768, depth=12, heads=12, mlp=3072),
}
"""Built-in model names -> builders with that model's configuration as defaults (all overridable)."""


def build(name: str, *, batch: int | str = 1, seed: int = 0, **overrides: object) -> onnx.ModelProto:
    """Build a built-in model with seeded weights; the same arguments give byte-identical models.

    Args:
        name: one of `BUILTIN` ("vit-tiny", "vit-b16", "deit-s", "deit-b", "bert-tiny", "bert-base").
        batch: the batch size, or a dim name (e.g. "N") for a symbolic batch.
        seed: seed of the weights.
        **overrides: builder arguments replacing the model's defaults: depth, dim, heads, mlp, image/patch
            (ViT) or seq/vocab (BERT), forms ln/gelu/qkv, opset, ... (see `vit.vit` and `bert.bert`).

    Returns:
        The ONNX model.

    Raises:
        ValueError: an unknown name, or overrides the builder rejects.
        TypeError: an override the builder does not take.
    """
    try:
        builder = BUILTIN[name]
    except KeyError:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN)}") from None
    return builder(batch=batch, seed=seed, **overrides)


def resolve(spec: str) -> Path | str:
    """What a model argument names: an existing path (a file wins over a built-in model of the same name), else a
    built-in model's name.

    Raises:
        GtcoError: neither.
    """
    if Path(spec).exists():
        return Path(spec)
    if spec in BUILTIN:
        return spec
    raise GtcoError(f"{spec}: neither a file nor a built-in model (no such file; built-in: {', '.join(BUILTIN)})")


__all__ = ["BUILTIN", "bert", "build", "resolve", "vit"]
