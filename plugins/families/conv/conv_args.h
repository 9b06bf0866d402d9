// The C argument struct of the conv family: plain C types only, so that the g++-built ORT glue fills the same struct
// that the nvcc-built instances read; mirrored field for field by onnx_gtco/families/conv/kernel.py args_fields. A
// layout change changes the library hash and every kernel's cache key (both cover this file).
#pragma once

#include "gtco/args.h"

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
