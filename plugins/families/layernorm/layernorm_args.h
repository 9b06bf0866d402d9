// The C argument struct of the LayerNorm family (and RMSNorm, built on it): plain C types only, so that the g++-built
// ORT glue fills the same struct that the nvcc-built instances read; mirrored field for field by
// onnx_gtco/families/layernorm/kernel.py args_fields. A layout change changes the library hash and every kernel's cache
// key (both cover this file).
#pragma once

#include "gtco/args.h"

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
