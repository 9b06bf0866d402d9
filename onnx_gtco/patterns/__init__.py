"""Fusion rules: each family's, in the order the planner runs them (for identical node sets the first rule wins).

Families a rule proposes, and the attrs each candidate carries (ints where static, else the dim's name); each
family's roles, attribute kinds and defaults are its onnx_gtco.opspec.OpSpec, and a Match also says which tensor
plays which role:

    attention    heads, head_dim, seq_q, seq_k, scale, mask, bias, nan_guard, batch_dims,
                 q_layout, k_layout, v_layout, out_layout (ONNX Attention op: also causal; scores_path when
                 more than a scale, a mask and a bias lie between QKᵀ and the Softmax; mask_period nW for
                 Swin's shifted-window mask, read at batch row b % nW; mask_scale / bias_scale for a scale
                 applied after the mask's / bias's Add)
    bmm_softmax  as attention, without v_layout / out_layout
    qkv          m, k, ns, n_out, bias
    gemm         m, n, k, batch, trans_b, bias, activation, residual (Gemm: trans_a, alpha, beta if set;
                 layer_scale when a per-column Mul follows the activation; layernorm, epsilon when the
                 LayerNorm over the GEMM's rows is in the group: GemmLayerNormPattern)
    conv         kernel, stride, pads, dilations, auto_pad, groups, bias, scale, shift, batchnorm, epsilon,
                 affine, activation, residual, post_activation
    layernorm    epsilon, axis, hidden, residual, decomposed, affine
    softmax      axis, rows, cols
    elementwise  ops
"""

from __future__ import annotations

from onnx_gtco import families
from onnx_gtco.patterns.base import Match, Pattern


def rules() -> tuple[Pattern, ...]:
    """Every family's rules (its rule module's RULES), in the families' order (onnx_gtco.families.ORDER)."""
    return tuple(rule for part in families.parts("rule") for rule in part.RULES)


__all__ = ["Match", "Pattern", "rules"]
