// Device scratch for kernels that need a workspace (CUTLASS's stream-K partials and tile flags, the split-K GEMMs'
// partial sums and tile counters of gemm/gemm.cuh): one buffer per device, stream and kind, made on an uncaptured
// call and kept. A call under CUDA graph capture (ORT's enable_cuda_graph) may use the buffer an earlier call
// made, but cannot make or grow one: cudaMalloc is not capturable, and a stream-ordered cudaMallocAsync inside the
// captured graph would be an allocation on every replay. ORT runs a model once before it captures, so a captured
// call finds its buffer.
//
// Keyed by stream as well as device: two streams never share a workspace that their kernels write. Buffers live as
// long as the process (the library is unloaded with it).
//
// Plain C++ over the CUDA runtime API, so it also builds with g++ against a stand-in cuda_runtime.h that records
// the calls (tests/plugin/test_graph_safe.py).
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include <cuda_runtime.h>

namespace gtco {

struct ScratchBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
};

namespace scratch_detail {

// The buffer of (device, stream, kind): kind 0 is stream_scratch's, 1 stream_scratch_zeroed's (zero-filled when
// made, so kept apart from buffers whose users leave anything behind).
inline void* get(void* stream, size_t bytes, const char*& why, int kind) {
    why = nullptr;
    if (bytes == 0) return nullptr;
    static std::mutex lock;
    static auto* buffers = new std::map<std::tuple<int, void*, int>, ScratchBuffer>();  // never destroyed: see above
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
        why = "cudaGetDevice failed";
        return nullptr;
    }
    std::lock_guard<std::mutex> g(lock);
    ScratchBuffer& buf = (*buffers)[{device, stream, kind}];
    if (buf.bytes >= bytes) return buf.ptr;
    const auto cuda_stream = static_cast<cudaStream_t>(stream);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(cuda_stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
        why = "the kernel's workspace is made on an uncaptured call and this is the first call of this size inside "
              "a CUDA graph capture; run the model once before capturing";
        return nullptr;
    }
    if (buf.ptr != nullptr) {  // growing: the smaller buffer may still be read by work queued on this stream
        if (cudaStreamSynchronize(cuda_stream) != cudaSuccess) {
            why = "cudaStreamSynchronize before growing the workspace failed";
            return nullptr;
        }
        cudaFree(buf.ptr);
        buf = ScratchBuffer{};
    }
    void* ptr = nullptr;
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
        cudaGetLastError();  // clear it, so that the caller's own launch check does not report it
        why = "cudaMalloc of the kernel's workspace failed";
        return nullptr;
    }
    if (kind == 1 && cudaMemsetAsync(ptr, 0, bytes, cuda_stream) != cudaSuccess) {
        cudaFree(ptr);
        cudaGetLastError();
        why = "cudaMemsetAsync zeroing the kernel's workspace failed";
        return nullptr;
    }
    buf = ScratchBuffer{ptr, bytes};
    return ptr;
}

}  // namespace scratch_detail

// A device buffer of at least `bytes` for `stream` on the current device, or null with `why` set.
inline void* stream_scratch(void* stream, size_t bytes, const char*& why) {
    return scratch_detail::get(stream, bytes, why, 0);
}

// The same, zero-filled when made or grown (in stream order, before any kernel that uses it), and a buffer of its
// own: for kernels that leave it zeroed again when they finish (split-K's per-tile arrival counters), so every
// launch finds zeros without a memset of its own.
inline void* stream_scratch_zeroed(void* stream, size_t bytes, const char*& why) {
    return scratch_detail::get(stream, bytes, why, 1);
}

}  // namespace gtco
