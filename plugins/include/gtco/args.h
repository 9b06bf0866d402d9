// The C argument struct of every kernel family: plain C types only, so that the g++-built ORT glue
// (plugins/ort/*_op.h) fills the same structs that the nvcc-built instances read. Each is mirrored field for field
// by its family's Python side (onnx_gtco/kernels/<family>.py args_fields), which fills it for the emulation and
// GPU runs. A layout change here changes the library hash and every kernel's cache key (both cover this file).
#pragma once

#include <stdint.h>

// What an instance's entry point returns (gtco/launch.cuh).
#define GTCO_OK 0
#define GTCO_EBADSHAPE 1    // a size differs from the one the instance was built for, or breaks its divisibility
#define GTCO_ELAUNCH 2      // the launch itself failed (cudaGetLastError after the launch)

// GEMM (gemm/gemm.cuh), y = act(alpha * A @ B + bias) * layer_scale + residual; mirrored by GemmFamily.args_fields.
// With a fused LayerNorm (gemm.cuh's LN instances) also ln_y = LayerNorm(y) over each row of N, from y as stored.
// Sizes and strides count elements. Batch strides: A[b] = a + b * stride_a, B[b] = b + b * stride_b (0: one B
// shared by the batch), y[b] and residual[b] = ... + b * stride_y. Leading dimensions are dense: K for A, N (or K
// when transposed) for B, N for y and residual.
struct GemmArgs {
    const void* a;
    const void* b;
    const void* bias;      // [N], null when the instance has no bias
    const void* residual;  // like y, null when the instance has no residual
    void* y;
    int64_t batch, m, n, k;
    int64_t stride_a, stride_b, stride_y;
    float alpha;           // scales A @ B before the bias (ONNX Gemm's alpha; 1 for a MatMul)
    const void* layer_scale;  // [N]: multiplies column n after the activation (LayerScale); null when none
    // LayerNorm of y's rows (LN instances only; null / 0 otherwise): ln_y = (y - mean) / sqrt(var + ln_eps) *
    // ln_gamma + ln_beta. ln_y is like y and may be y itself (in place, when the pre-LN sum is not needed).
    const void* ln_gamma;  // [N]
    const void* ln_beta;   // [N]
    void* ln_y;
    float ln_eps;
};

// Convolution (conv/conv.cuh: implicit GEMM or direct), y = post_act(act((conv(x, w) + bias) * a + b) + residual), a
// and b folded per output channel from scale / shift (or BatchNormalization's scale, shift, mean, var and epsilon);
// mirrored by ConvFamily.args_fields. x [n, c, in_h, in_w] and y, residual [n, oc, oh, ow] NCHW, dense; w [oc,
// c / groups, kh, kw] (groups == 1: the implicit GEMM; otherwise the direct kernel). Per-channel operands hold one
// value (step 0) or one per output channel (step 1); null when the instance has none.
struct ConvArgs {
    const void* x;
    const void* w;
    const void* bias;
    const void* scale;
    const void* shift;
    const void* mean;
    const void* var;
    const void* residual;
    void* y;
    int64_t n, c, in_h, in_w, oc, kh, kw, oh, ow;
    int64_t stride_h, stride_w, pad_t, pad_l, dil_h, dil_w;
    int64_t groups;        // 1 for the implicit GEMM; divides c and oc
    int64_t bias_step, scale_step, shift_step, mean_step, var_step;
    float epsilon;
};

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
};

// LayerNorm (layernorm/layernorm.cuh).
struct GtcoLayerNormArgs {
    const void* x;         // a: [rows][hidden]
    const void* residual;  // b: [rows][hidden] when RES, else null
    const void* gamma;     // [hidden] when GAMMA, else null
    const void* beta;      // [hidden] when BETA, else null
    void* y;               // [rows][hidden]
    void* sum;             // a + b: [rows][hidden] when RES_OUT, else null
    int64_t rows;
    int32_t hidden;        // must equal the instance's HIDDEN
    float eps;
};

// Softmax (softmax/softmax.cuh).
struct GtcoSoftmaxArgs {
    const void* x;     // [rows][cols]
    const void* mask;  // [mask_rows][cols] (T) when MASK, else null
    void* y;           // [rows][cols]
    int64_t rows;
    int32_t cols;      // must equal the instance's COLS
    float scale;       // multiplies x before the mask is added (1 when the group has none)
    int64_t mask_div;
    int64_t mask_mul;
    int64_t mask_mod;
};

#define GTCO_EW_MAX_IN 8
#define GTCO_EW_MAX_OUT 4

// The argument struct of every elementwise instance. in[i] is the i-th kernel input (T, or uint8 for bool, or
// int32/int64 for integer inputs, as the instance was built), out[j] the j-th output (T); unused slots are null.
// n: elements of the iteration (output) shape, checked against the instance's.
struct GtcoElementwiseArgs {
    const void* in[GTCO_EW_MAX_IN];
    void* out[GTCO_EW_MAX_OUT];
    int64_t n;
};
