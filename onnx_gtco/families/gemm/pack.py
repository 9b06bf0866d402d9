"""Q, K and V projections packed into one GEMM before planning, so that the QKV projection is one launch.

A block's Q, K and V projections read the same input (`QkvPattern`): three MatMuls (each with its bias Add) whose
results an attention core reads, head-split, as q, k and v. Their weights concatenated in q, k, v order make one
MatMul of N = 3·hidden, and its result is the packed [.., S, 3·H·D] tensor that the attention kernel reads in its
"qkv_packed" layout (q at offset 0, k at H·D, v at 2·H·D): the form a timm ViT exports with its single qkv Linear.

    A --MatMul Wq--Add bq--> q           A --MatMul [Wq|Wk|Wv]--Add [bq|bk|bv]--Split--> q
      --MatMul Wk--Add bk--> k     =>                                              \\--> k
      --MatMul Wv--Add bv--> v                                                     \\--> v

The Split keeps the three tensors' names, so every reader is unchanged; the rules then see a GEMM (one task for
every GEMM implementation: mma, CUTLASS, cuBLASLt) and an attention whose head split starts at the Split. Only
groups whose three outputs an attention match reads as q, k and v in the "bshd_merged" layout ([B, S, H·D]) with
equal widths H·D are packed: a projection group that feeds anything else (a gated MLP's gate and up, the K and V of
cross-attention) keeps its Qkv node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_gtco.families.attention.rule import AttentionPattern
from onnx_gtco.families.gemm.qkv_rule import QkvPattern
from onnx_gtco.ir.view import GraphView
from onnx_gtco.patterns.base import Match
from onnx_gtco.patterns.util import spliced

ROLES = ("q", "k", "v")


@dataclass(frozen=True)
class Packing:
    """One packed projection group: its MatMuls' first node name, the outputs in q, k, v order, the width of each,
    and whether the projections had their bias Adds."""

    first: str
    outputs: tuple[str, str, str]
    width: int
    bias: bool


def _widest(matches: list[Match]) -> list[Match]:
    """Per projection group (its MatMuls), the match with the bias Adds when there is one."""
    best: dict[frozenset[str], Match] = {}
    for m in matches:
        key = frozenset(v for r, v in m.roles.items() if r.startswith("w"))
        if key not in best or len(m.nodes) > len(best[key].nodes):
            best[key] = m
    return list(best.values())


def _plans(view: GraphView) -> list[tuple[Match, tuple[int, int, int]]]:
    """Projection groups to pack, each with the projection index that plays q, k and v."""
    qkvs = _widest([m for m in QkvPattern().match(view) if isinstance(m, Match) and m.roles])
    readers: dict[frozenset[str], Match] = {}
    for m in AttentionPattern().match(view):
        if not isinstance(m, Match) or m.family != "attention":
            continue
        if any(m.attrs.get(f"{r}_layout") != "bshd_merged" for r in ROLES):
            continue
        readers.setdefault(frozenset(m.roles.get(r, "") for r in ROLES), m)
    out = []
    for qkv in qkvs:
        ns = qkv.attrs.get("ns") or ()
        if len(ns) != 3 or not all(isinstance(n, int) for n in ns) or len(set(ns)) != 1:
            continue
        outs = [qkv.outputs[f"y{p}"] for p in range(3)]
        att = readers.get(frozenset(outs))
        if att is None:
            continue
        heads, head_dim = att.attrs.get("heads"), att.attrs.get("head_dim")
        if not (isinstance(heads, int) and isinstance(head_dim, int) and heads * head_dim == ns[0]):
            continue
        order = tuple(outs.index(att.roles[r]) for r in ROLES)
        if sorted(order) == [0, 1, 2]:
            out.append((qkv, order))  # type: ignore[arg-type]
    return out


def pack_qkv(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[Packing]]:
    """`model` with every packable Q/K/V projection group made one MatMul (+ Add) and a Split (a copy; the model
    passed in is unchanged), and what was packed. A model with nothing to pack is returned as it is."""
    view = GraphView(model)
    plans = _plans(view)
    if not plans:
        return model, []
    removed: set[int] = set()
    inserts: dict[int, list[onnx.NodeProto]] = {}
    new_inits: list[onnx.TensorProto] = []
    new_infos: list[onnx.ValueInfoProto] = []
    packings = []
    for qkv, order in plans:
        ids = sorted(qkv.nodes)
        first = view.nodes[ids[0]].name
        a = qkv.roles["a"]
        ws = [view.const_value(qkv.roles[f"w{p}"]) for p in order]
        bias = bool(qkv.attrs.get("bias"))
        bs = [view.const_value(qkv.roles[f"bias{p}"]) for p in order] if bias else []
        if any(w is None or w.ndim != 2 for w in ws):
            continue
        width = int(ws[0].shape[1])  # type: ignore[union-attr]
        # a bias of one value per column ([N] or [1, .., 1, N]); a broadcast scalar or a row bias stays unpacked
        if any(b is None or b.size != width or b.shape[-1] != width for b in bs):  # type: ignore[union-attr]
            continue
        outs = tuple(qkv.outputs[f"y{p}"] for p in order)
        info = view.info(outs[0])
        if info is None or info.shape is None:
            continue
        base = f"{first}.qkv_packed"
        w_cat = numpy_helper.from_array(np.concatenate(ws, axis=1), f"{base}.weight")  # type: ignore[arg-type]
        split = numpy_helper.from_array(np.array([width] * 3, dtype=np.int64), f"{base}.split")
        new_inits += [w_cat, split]
        nodes = [helper.make_node("MatMul", [a, w_cat.name], [f"{base}.matmul"], name=f"{base}.matmul")]
        packed = f"{base}.matmul"
        if bias:
            b_cat = numpy_helper.from_array(
                np.concatenate([np.asarray(b).reshape(-1) for b in bs]), f"{base}.bias")
            new_inits.append(b_cat)
            nodes.append(helper.make_node("Add", [packed, b_cat.name], [f"{base}.add"], name=f"{base}.add"))
            packed = f"{base}.add"
        nodes.append(helper.make_node("Split", [packed, split.name], list(outs), name=f"{base}.split", axis=-1))
        shape = [*info.shape[:-1], 3 * width]
        new_infos += [helper.make_tensor_value_info(n.output[0], info.dtype, shape) for n in nodes[:-1]]
        removed.update(ids)
        inserts[ids[0]] = nodes
        packings.append(Packing(first, outs, width, bias))  # type: ignore[arg-type]
    if not packings:
        return model, []
    return spliced(model, inserts, removed, new_inits, new_infos), packings
