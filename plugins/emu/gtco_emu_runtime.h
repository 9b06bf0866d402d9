// The CUDA runtime calls of the cuBLASLt GEMM path's host code (gemm/cublaslt.h), for an emulated build
// (g++ -DGTCO_EMULATE): no cudart is linked there, the emulated device is the host and its memory is host memory.
//
// Declared over CUDA's own types (driver_types.h, which cublasLt.h includes anyway), so cublaslt.h compiles
// unchanged with or without them. Kept apart from gtco_emu.h: its __half / __nv_bfloat16 stand-ins cannot share a
// translation unit with cuda_fp16.h, which cublasLt.h includes, and the cuBLASLt path runs no kernel of its own.
//
// The emulated build never runs cuBLASLt's kernels (they cannot read host memory): gemm/cublaslt.h stops before
// cublasLtMatmul with GTCO_ELIBRARY, so the node takes its mma fallback (plugins/families/gemm/gemm_op.h run_gemm). What these
// calls give is what lets it get that far on the CPU: one device (0), never a capture, host memory for a workspace.
#pragma once

#if !defined(GTCO_EMULATE)
#error "gtco_emu_runtime.h is for emulated builds (g++ -DGTCO_EMULATE) only"
#endif

#include <driver_types.h>

#include <cstddef>
#include <cstdlib>

inline cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}

inline cudaError_t cudaStreamIsCapturing(cudaStream_t /*stream*/, cudaStreamCaptureStatus* status) {
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
}

inline cudaError_t cudaMalloc(void** ptr, size_t bytes) {
    *ptr = std::malloc(bytes);
    return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

inline const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "no error";
        case cudaErrorMemoryAllocation: return "out of memory (emulated runtime: host malloc)";
        default: return "CUDA error (emulated runtime)";
    }
}
