// The C argument struct of the GEMM family (and the kernels built on its tiles): plain C types only, so that the
// g++-built ORT glue fills the same struct that the nvcc-built instances read; mirrored field for field by
// onnx_gtco/families/gemm/kernel.py args_fields. A layout change changes the library hash and every kernel's cache key
// (both cover this file).
#pragma once

#include "gtco/args.h"

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
    // fp8 instances (gemm.cuh FP8; onnx_gtco/fp8.py): B is E4M3 bytes, K-major; A (fp16) is divided by a_scale and
    // rounded to E4M3 as it is read; alpha carries both operands' scales. 0 otherwise.
    float a_scale;
};
