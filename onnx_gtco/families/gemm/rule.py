"""GEMM with its epilogue: MatMul or Gemm, + bias, + activation, * LayerScale, + residual; every prefix is a
candidate."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from onnx_gtco.families.gemm.gated import gated_tail
from onnx_gtco.families.gemm.qkv_rule import QkvPattern
from onnx_gtco.families.layernorm.rule import LayerNormPattern
from onnx_gtco.ir.view import GraphView, Node
from onnx_gtco.patterns.base import Match, Reject, is_op, other_input
from onnx_gtco.patterns.epilogue import const_add, layer_scale, residual_add
from onnx_gtco.patterns.find_activation import find_activation
from onnx_gtco.patterns.util import dims, prod


class GemmPattern:
    """A matrix product and the elementwise epilogue a GEMM kernel applies before storing.

    Formula: ``y = act(A @ B + bias) * gamma + residual`` (bias, act, gamma and residual optional), where
    ``A @ B`` is a MatMul (2-D weight, or batched with any B, including attention's QKᵀ and PV) or a Gemm, and
    gamma is LayerScale (DINOv2, CaiT, DeiT-III): a Mul by a constant of one value per output column.

        A    B
         \\  /
        MatMul/Gemm -> [Add bias] -> [act: Relu | GELU (erf, tanh) | SiLU | ...] -> [Mul gamma] -> [Add residual] -> y

    Each prefix (matmul alone, +bias, +act, +gamma, +residual) is proposed; the planner keeps the cheapest cover.
    A weight MatMul whose columns a gated MLP's packing interleaved (families/gemm/gated.py: two step-2 Slices, an
    activation of the gate and its product with the up half) is proposed with that whole tail instead, gated.
    attrs: m, n, k, batch (batch dims of a batched GEMM, () for a weight GEMM), trans_b, bias, activation,
    layer_scale (only when true), residual, gated (only when true: N counts the gate's and the up columns).
    """

    name = "gemm"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        for node in view.nodes:
            if is_op(node, "MatMul", "Gemm"):
                yield from self._site(view, node)

    def _site(self, view: GraphView, mm: Node) -> Iterator[Match | Reject]:
        attrs = self._shape_attrs(view, mm)
        if isinstance(attrs, str):
            yield Reject(self.name, mm.name, attrs)
            return
        group = {mm.id}
        out = mm.outputs[0]
        roles = {"a": mm.inputs[0], "b": mm.inputs[1]}
        if len(mm.inputs) > 2 and mm.inputs[2]:
            roles["bias"] = mm.inputs[2]
        attrs |= {"bias": "bias" in roles, "activation": "none", "residual": False}

        def match() -> Match:
            return Match(frozenset(group), "gemm", dict(attrs), dict(roles), {"y": out})

        yield match()
        weight = attrs["batch"] == ()  # near misses of a batched GEMM (QKᵀ + mask) are not worth a report
        gated = gated_tail(view, out) if weight and "bias" not in roles else None
        if gated is not None:  # a gated MLP packed by families/gemm/gated.py: act(gate) * up of column pairs
            yield Match(frozenset(group | gated[1]), "gemm", {**attrs, "activation": gated[0], "gated": True},
                        dict(roles), {"y": gated[2]})
            return
        add, why = const_add(view, out, -1)
        if why and weight:
            yield Reject(self.name, mm.name, why)
        if add is not None:
            group.add(add.id)
            # one bias role: a Gemm's C and a bias Add are two biases, and a Gemm's beta would scale the Add's
            # (the kernel takes neither: the node has no bias input then and runs its function)
            if "bias" in roles or attrs.get("beta", 1.0) != 1.0:
                roles.pop("bias", None)
            else:
                roles["bias"] = other_input(add, out) or ""
            out = add.outputs[0]
            attrs["bias"] = True
            yield match()
        act = find_activation(view, out)
        if act is not None:
            group |= act[1]
            out = act[2]
            attrs["activation"] = act[0]
            yield match()
        gamma = layer_scale(view, out, attrs["n"])
        if gamma is not None:
            group.add(gamma.id)
            roles["layer_scale"] = other_input(gamma, out) or ""
            out = gamma.outputs[0]
            attrs["layer_scale"] = True
            yield match()
        res, why = residual_add(view, out, group)
        if why and weight:
            yield Reject(self.name, mm.name, why)
        if res is not None:
            group.add(res.id)
            roles["residual"] = other_input(res, out) or ""
            out = res.outputs[0]
            attrs["residual"] = True
            yield match()

    @staticmethod
    def _shape_attrs(view: GraphView, mm: Node) -> dict[str, Any] | str:
        a, b = dims(view, mm.inputs[0]), dims(view, mm.inputs[1])
        if a is None or b is None:
            return f"{mm.op_type} {mm.name!r}: operand rank unknown"
        if len(a) < 2 or len(b) < 2:
            return f"{mm.op_type} {mm.name!r} has a 1-D operand (a GEMV, not a GEMM)"
        if mm.op_type == "Gemm":
            ta, tb = bool(mm.attrs.get("transA", 0)), bool(mm.attrs.get("transB", 0))
            m, k = (a[1], a[0]) if ta else (a[0], a[1])
            attrs: dict[str, Any] = {"m": m, "k": k, "n": b[0] if tb else b[1], "trans_b": tb, "batch": ()}
            if ta:
                attrs["trans_a"] = True
            for key in ("alpha", "beta"):
                if float(mm.attrs.get(key, 1.0)) != 1.0:
                    attrs[key] = float(mm.attrs[key])
            return attrs
        if len(b) == 2:  # weight GEMM: every leading dim of A is a row
            return {"m": prod(a[:-1]), "k": a[-1], "n": b[-1], "trans_b": False, "batch": ()}
        out = dims(view, mm.outputs[0]) or ()
        return {"m": a[-2], "k": a[-1], "n": b[-1], "trans_b": False, "batch": tuple(out[:-2])}


MAX_LN_N = 1024
"""The widest row the GEMM + LayerNorm kernel normalizes (gemm.cuh kMaxLnN: one warp holds a row, at most 32
floats per lane); families.gemm.kernel checks problems against this same bound."""


class GemmLayerNormPattern:
    """A weight GEMM and the LayerNorm over its rows as one group: ``sum = GEMM epilogue (+ residual)``,
    ``norm = LayerNorm(sum) * gamma + beta``. The GEMM kernel then normalizes the rows it wrote (a block or the last
    block of each row panel), so the pair is one launch and the sum is not read back by a second kernel.

        pre-LN (ViT):   MatMul -> [+bias] -> [act] -> [*gamma] -> Add residual -> sum --> LayerNorm -> norm
        post-LN (BERT): MatMul -> +bias -> Add residual -> LayerNorm -> norm   (the LayerNorm match holds the Add)

    Proposed beside the GEMM and LayerNorm candidates (never instead of them): the planner takes it only where the
    cost model says one kernel beats the pair. Only where the normalized width is the GEMM's N, N <= MAX_LN_N, the
    LayerNorm has gamma and beta and normalizes the last axis alone, its output is no graph output, and, post-LN,
    the GEMM's own result is read by the LayerNorm's Add alone. attrs: the GEMM's, with layernorm and epsilon;
    roles gamma, beta; outputs y (the sum, when read outside) and norm.
    """

    name = "gemm_layernorm"

    def match(self, view: GraphView) -> Iterator[Match | Reject]:
        by_input: dict[str, list[Match]] = {}
        for ln in LayerNormPattern().match(view):
            if isinstance(ln, Match) and ln.attrs.get("affine") and {"gamma", "beta"} <= set(ln.roles) \
                    and ln.attrs.get("axis") == -1:
                for role in ("a", "b"):
                    if role in ln.roles:
                        by_input.setdefault(ln.roles[role], []).append(ln)
        for g in GemmPattern().match(view):
            if not isinstance(g, Match) or g.attrs.get("batch") != () or g.attrs.get("trans_a"):
                continue
            n = g.attrs.get("n")
            if not isinstance(n, int) or n > MAX_LN_N:
                continue
            y = g.outputs["y"]
            for ln in by_input.get(y, ()):
                merged = self._merge(view, g, ln, y, n)
                if merged is not None:
                    yield merged

    @staticmethod
    def _merge(view: GraphView, g: Match, ln: Match, y: str, n: int) -> Match | None:
        if ln.attrs.get("hidden") != n or ln.outputs["y"] in view.graph_outputs:
            return None  # a graph output may be written in another dtype (the precision conversion's fp32 outputs)
        attrs = dict(g.attrs) | {"layernorm": True, "epsilon": float(ln.attrs.get("epsilon", 1e-5))}
        roles = dict(g.roles) | {"gamma": ln.roles["gamma"], "beta": ln.roles["beta"]}
        outs = {"y": y, "norm": ln.outputs["y"]}
        if ln.attrs.get("residual"):  # post-LN: the LayerNorm's Add is the GEMM's residual
            if g.attrs.get("residual"):
                return None
            other = ln.roles["b"] if ln.roles["a"] == y else ln.roles["a"]
            if other == y or view.shape(other) != view.shape(y):
                return None
            if any(c.id not in ln.nodes for c in view.consumers_of(y)) or y in view.graph_outputs:
                return None  # the GEMM's own result is read elsewhere: the kernel does not write it
            roles["residual"] = other
            attrs["residual"] = True
            outs["y"] = ln.outputs.get("sum", "")
            if not outs["y"]:
                del outs["y"]
        return Match(g.nodes | ln.nodes, "gemm", attrs, roles, outs)


RULES = (QkvPattern(), GemmPattern(), GemmLayerNormPattern())
"""The QKV rule first: three projections of one input are one qkv node before they are three gemm nodes."""
