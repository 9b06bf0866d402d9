// The C argument struct of the softmax family: plain C types only, so that the g++-built ORT glue fills the same struct
// that the nvcc-built instances read; mirrored field for field by onnx_gtco/families/softmax/kernel.py args_fields. A
// layout change changes the library hash and every kernel's cache key (both cover this file).
#pragma once

#include "gtco/args.h"

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
