// The C argument struct of the attention family (attention and bmm_softmax): plain C types only, so that the g++-built
// ORT glue fills the same struct that the nvcc-built instances read; mirrored field for field by
// onnx_gtco/families/attention/kernel.py args_fields. A layout change changes the library hash and every kernel's cache
// key (both cover this file).
#pragma once

#include "gtco/args.h"

// The C argument struct of both families (mirrored by onnx_gtco/families/attention/kernel.py field for field). All
// strides and offsets are in elements. For bmm_softmax, v* are unused and out is P with (o_sb, o_sh, o_ss, o_sd)
// = strides of (batch, head, query, key); for attention o_sd must be 1.
struct gtco_attention_args {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const void* mask;  // null without a mask
    const void* bias;  // null without a bias
    int64_t q_off, k_off, v_off;
    int64_t q_sb, q_sh, q_ss;
    int64_t k_sb, k_sh, k_ss, k_sd;
    int64_t v_sb, v_sh, v_ss;
    int64_t o_sb, o_sh, o_ss, o_sd;
    int64_t m_sb, m_sh, m_sq, m_sk;
    int64_t bias_sb, bias_sh, bias_sq, bias_sk;
    int32_t batch, heads, seq_q, seq_k, head_dim;
    int32_t m_bmod, bias_bmod;  // batch index of mask / bias = b % bmod
    float scale;                // multiplies Q Kᵀ
    float mask_scale, bias_scale;  // multiply the mask and the bias (1, unless the graph scales after adding them)
    int32_t kv_group;  // query heads per key / value head: K and V have heads / kv_group heads (GQA, MQA); 1 without
    int32_t banded;    // 1: key j of query i is kept only where band_lo <= j - i <= band_hi (causal: band_hi = 0 and
                       // band_lo far below; sliding window: both finite); the instance must be a BAND one
    int32_t band_lo, band_hi;
};
