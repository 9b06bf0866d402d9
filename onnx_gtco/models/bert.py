"""BERT encoders built as Hugging Face's BertModel exports through TorchScript."""

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

LN_EPS = 1e-12  # BertConfig.layer_norm_eps


def bert(*, batch: int | str = 1, seed: int = 0, vocab: int = 30522, seq: int | str = 128, dim: int = 768,
         depth: int = 12, heads: int = 12, mlp: int = 3072, max_positions: int = 512, type_vocab: int = 2,
         token_types: bool = False, pooler: bool = False, mask_value: float = -10000.0,
         ln: str = "decomposed", gelu: str = "erf", qkv: str = "split", opset: int = 17,
         name: str = "bert") -> onnx.ModelProto:
    """A post-norm BERT encoder: `input_ids`, `attention_mask` (int64 [batch, seq]) -> `last_hidden_state`.

    Embeddings: Gather(word, input_ids) + Gather(token_type, ids or constant zeros) + Gather(position,
    constant range) -> LayerNorm. With a symbolic `seq`, the position ids and the default token types are the
    first seq columns of [1, max_positions] buffers, Slice(buffer, 0, Shape(input_ids)[1]) as exporters write
    `position_ids[:, :seq_length]`, and the head Reshapes take -1 for the sequence. Extended mask:
    Unsqueeze(mask, [1, 2]) -> Cast float -> Sub(1, m) -> Mul(mask_value), added to the scores after the Div by
    sqrt(head_dim). Each layer: h = LN(x + dense(attention(x))), then LN(h + dense(gelu(dense(h)))).

    Args:
        batch: the batch size, or a dim name for a symbolic batch (Reshapes then copy it with 0).
        seed: seed of the numpy generator drawing every weight.
        vocab: rows of the word embedding table.
        seq: sequence length of the inputs, or a dim name (e.g. "seq") for a symbolic length.
        dim: hidden width.
        depth: number of encoder layers.
        heads: attention heads; `dim` must be a multiple of it.
        mlp: intermediate width.
        max_positions: rows of the position table (at least `seq` are used).
        type_vocab: rows of the token type table.
        token_types: add a `token_type_ids` int64 [batch, seq] input (else every token has type 0).
        pooler: add the `pooler_output` [batch, dim] output (Gather token 0 -> Gemm -> Tanh).
        mask_value: what a masked position adds to the scores (-10000, or the float32 minimum as newer
            transformers versions use).
        ln: "decomposed" (ReduceMean ... Sqrt, Div chain) or "op" (LayerNormalization, opset >= 17).
        gelu: "erf" (Div/Erf/Add/Mul/Mul), "tanh" (the tanh approximation with Pow) or "op" (Gelu,
            opset >= 20).
        qkv: "split" (query/key/value Linears, as BERT) or "fused" (one Linear, then a Reshape/Transpose/
            Gather unbind).
        opset: the default-domain opset, 13..21.
        name: the graph name.

    Returns:
        The model, with float32 weights drawn deterministically from `seed`.

    Raises:
        ValueError: a size is not positive or does not divide, or a form is unknown or needs a newer opset.
    """
    check_forms(opset, ln, gelu, qkv)
    symbolic = isinstance(seq, str)
    if symbolic and not seq:
        raise ValueError("seq must be a positive int or a dim name, not ''")
    check_dims(dim, heads, vocab=vocab, seq=1 if symbolic else seq, depth=depth, mlp=mlp, type_vocab=type_vocab,
               max_positions=max_positions)
    if not symbolic and seq > max_positions:
        raise ValueError(f"seq {seq} exceeds max_positions {max_positions}")
    b = Builder(name, seed=seed, opset=opset, batch=batch)
    ids = b.input("input_ids", TensorProto.INT64, [batch, seq])
    mask = b.input("attention_mask", TensorProto.INT64, [batch, seq])
    x = _embeddings(b, ids, batch, seq, token_types=token_types, vocab=vocab, dim=dim, type_vocab=type_vocab,
                    max_positions=max_positions, ln=ln)
    m = _extended_mask(b, mask, mask_value)

    for i in range(depth):
        p = f"encoder.layer.{i}"
        last = i == depth - 1
        h = attention_core(b, x, f"{p}.attention.self", seq=-1 if symbolic else seq, dim=dim, heads=heads, qkv=qkv,
                           scale_op="Div", mask=m, proj=("query", "key", "value"))
        h = linear(b, h, f"{p}.attention.output.dense", dim, dim)
        h = b.op("Add", [h, x], f"{p}.attention.output.residual")
        x = layer_norm(b, h, f"{p}.attention.output.LayerNorm", dim, ln, LN_EPS)
        h = gelu_act(b, linear(b, x, f"{p}.intermediate.dense", dim, mlp), f"{p}.intermediate.act", gelu)
        h = b.op("Add", [linear(b, h, f"{p}.output.dense", mlp, dim), x], f"{p}.output.residual")
        out = "last_hidden_state" if last else None
        x = layer_norm(b, h, f"{p}.output.LayerNorm", dim, ln, LN_EPS, out=out)
    b.output("last_hidden_state", TensorProto.FLOAT, [batch, seq, dim])

    if pooler:
        first = b.op("Gather", [x, b.const("pooler.token_index", 0, np.int64)], "pooler.first_token", axis=1)
        weight, bias = b.param("pooler.dense.weight", (dim, dim)), b.param("pooler.dense.bias", (dim,))
        pooled = b.op("Gemm", [first, weight, bias], "pooler.dense", alpha=1.0, beta=1.0, transB=1)
        b.op("Tanh", [pooled], "pooler.activation", out="pooler_output")
        b.output("pooler_output", TensorProto.FLOAT, [batch, dim])
    return b.model(f"{name}: BERT, vocab {vocab}, seq {seq}, dim {dim}, depth {depth}, heads {heads}, "
                   f"mlp {mlp}, ln={ln}, gelu={gelu}, qkv={qkv}, seed {seed}")


def _embeddings(b: Builder, ids: str, batch: int | str, seq: int | str, *, token_types: bool, vocab: int, dim: int,
                type_vocab: int, max_positions: int, ln: str) -> str:
    """Gather(word, input_ids) + Gather(token_type, ids or constant zeros) + Gather(position, constant range)
    -> LayerNorm (see bert)."""
    symbolic = isinstance(seq, str)
    seq_len = _seq_length(b, ids) if symbolic else None
    if token_types:
        types = b.input("token_type_ids", TensorProto.INT64, [batch, seq])
    elif seq_len is not None:
        types = _first_columns(b, "embeddings.token_type_ids", np.zeros((1, max_positions)), seq_len)
    else:
        types = b.const("embeddings.token_type_ids", np.zeros((1, seq)), np.int64)

    e = "embeddings"
    x = b.op("Gather", [b.param(f"{e}.word_embeddings.weight", (vocab, dim)), ids], f"{e}.word_embeddings")
    t = b.op("Gather", [b.param(f"{e}.token_type_embeddings.weight", (type_vocab, dim)), types],
             f"{e}.token_type_embeddings")
    x = b.op("Add", [x, t], f"{e}.add_token_types")
    if seq_len is not None:
        positions = _first_columns(b, f"{e}.position_ids", np.arange(max_positions)[None, :], seq_len)
    else:
        positions = b.const(f"{e}.position_ids", np.arange(seq)[None, :], np.int64)
    pos = b.op("Gather", [b.param(f"{e}.position_embeddings.weight", (max_positions, dim)), positions],
               f"{e}.position_embeddings")
    x = b.op("Add", [x, pos], f"{e}.add_positions")
    x = layer_norm(b, x, f"{e}.LayerNorm", dim, ln, LN_EPS)
    return x


def _extended_mask(b: Builder, mask: str, mask_value: float) -> str:
    """Unsqueeze(mask, [1, 2]) -> Cast float -> Sub(1, m) -> Mul(mask_value)."""
    m = b.op("Unsqueeze", [mask, b.const("extended_mask.axes", [1, 2], np.int64)], "extended_mask.unsqueeze")
    m = b.op("Cast", [m], "extended_mask.cast", to=TensorProto.FLOAT)
    m = b.op("Sub", [b.const("extended_mask.one", 1.0), m], "extended_mask.invert")
    m = b.op("Mul", [m, b.const("extended_mask.fill_value", mask_value)], "extended_mask.fill")
    return m


def _seq_length(b: Builder, ids: str) -> str:
    """The run-time sequence length as a 1-element int64 tensor: Shape(ids) -> Gather(1) -> Unsqueeze(0)."""
    shape = b.op("Shape", [ids], "embeddings.input_shape")
    length = b.op("Gather", [shape, b.const("embeddings.seq_axis", 1, np.int64)], "embeddings.seq_length", axis=0)
    return b.op("Unsqueeze", [length, b.const("embeddings.seq_length.axes", [0], np.int64)],
                "embeddings.seq_length.unsqueeze")


def _first_columns(b: Builder, name: str, buffer: np.ndarray, length: str) -> str:
    """buffer[:, :length] of an int64 [1, max_positions] buffer, as Slice(buffer, [0], length, [1])."""
    table = b.const(name, buffer, np.int64)
    starts = b.const(f"{name}.starts", [0], np.int64)
    axes = b.const(f"{name}.axes", [1], np.int64)
    return b.op("Slice", [table, starts, length, axes], f"{name}.slice")
