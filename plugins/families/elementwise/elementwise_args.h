// The C argument struct of the elementwise family: plain C types only, so that the g++-built ORT glue fills the same
// struct that the nvcc-built instances read; mirrored field for field by onnx_gtco/families/elementwise/kernel.py
// args_fields. A layout change changes the library hash and every kernel's cache key (both cover this file).
#pragma once

#include "gtco/args.h"

#define GTCO_EW_MAX_IN 8
#define GTCO_EW_MAX_OUT 4
#define GTCO_EW_MAX_RANK 6

// The argument struct of every elementwise instance. in[i] is the i-th kernel input (T, or uint8 for bool, or
// int32/int64 for integer inputs, as the instance was built), out[j] the j-th output (T); unused slots are null.
// n: elements of the iteration (output) shape, checked against the instance's.
// dims, strides: read only by an instance built for run-time shapes (a program over symbolic dims): the collapsed
// iteration dims of this call, outermost first, and each input's element strides over them (0: broadcast along
// that dim); the outputs are dense. An instance built for one static shape ignores them (zeros).
struct GtcoElementwiseArgs {
    const void* in[GTCO_EW_MAX_IN];
    void* out[GTCO_EW_MAX_OUT];
    int64_t n;
    int64_t dims[GTCO_EW_MAX_RANK];
    int64_t strides[GTCO_EW_MAX_IN][GTCO_EW_MAX_RANK];
};
