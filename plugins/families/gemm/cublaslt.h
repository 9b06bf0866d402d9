// The cuBLASLt implementation of the GEMM family: y = act(alpha * A @ B + bias) (+ residual through C, beta = 1)
// as one cublasLtMatmul with its fused epilogue. onnx_gtco/families/gemm/cublaslt.py generates one entry point per
// (dtypes, epilogue, transposed B, residual, heuristic rank) with the GEMM instance ABI (gemm/gemm_args.h GemmArgs), so
// the node table, the dispatch and the tuner call it as any GEMM instance.
//
// libcublasLt is not linked: its functions are resolved with dlsym into `Api` on first use, from the copy ONNX
// Runtime's CUDA EP already loaded (dlopen RTLD_NOLOAD), else from the library path. Without it the library still
// loads and a call returns GTCO_ELIBRARY with last_error() saying why; so do a heuristic without an algorithm of the
// chosen rank and a plan that cannot be made. The glue then launches the node's generated mma fallback instead, where
// the build gave it one (plugins/families/gemm/gemm_op.h run_gemm), so a vendor failure does not fail the session. Only the
// header comes from the nvidia-cublas package at build time (onnx_gtco/families/gemm/cublas_headers.py).
//
// An emulated build (g++ -DGTCO_EMULATE, plugins/emu/gtco_emu_runtime.h for the few CUDA runtime calls) runs this
// path on the CPU up to the plan, with a libcublasLt already loaded into the process only (never one from the library
// path: a GPU's cuBLASLt does not start up inside a CPU test unasked), and stops before cublasLtMatmul with
// GTCO_ELIBRARY: cuBLASLt's kernels cannot read the emulation's host memory. So there a cuBLASLt node always runs its
// fallback, which is how CI tests the fallback path.
//
// A `Plan` (handle, matmul descriptor, layouts, preference, the heuristic's algorithm of the chosen rank, workspace)
// is made once per (device, stream, instance, shape, operand alignment), on the first call, which must not be
// inside a CUDA graph capture (cudaMalloc of the workspace and the heuristic query are not capturable): a first
// call under capture fails with that reason. Keying by stream means two streams never share a workspace. Plans
// live until the process exits (like the custom ops, which ORT may use until then).
#pragma once

#include <cublasLt.h>
#include <dlfcn.h>
#if defined(GTCO_EMULATE)
#include "../../emu/gtco_emu_runtime.h"
#else
#include <cuda_runtime.h>
#endif

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "gtco/args.h"
#include "gemm/gemm_args.h"
#include "gemm/cublaslt_shape.h"

#ifndef GTCO_EXPORT
#define GTCO_EXPORT extern "C" __attribute__((visibility("default")))
#endif

namespace gtco {
namespace lt {

// What one generated entry point fixes (onnx_gtco/families/gemm/cublaslt.py instance()).
struct Spec {
    cudaDataType_t dtype;      // A and B
    cudaDataType_t out;        // C and D (y, residual)
    cudaDataType_t bias;       // the bias vector
    cublasComputeType_t compute;
    cublasLtEpilogue_t epilogue;
    bool trans_b;              // B stored [N, K]
    bool residual;             // C = residual, beta = 1
    int rank;                  // which of the heuristic's algorithms
};

// The cuBLASLt functions this path calls, resolved at run time.
struct Api {
    decltype(&cublasLtCreate) create = nullptr;
    decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
    decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
    decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
    decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
    decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
    decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
    decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
    decltype(&cublasLtMatmul) matmul = nullptr;
    std::string error;  // why the table is unusable; "" when every entry is set
};

inline std::string library_name() { return "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR); }

inline Api load_api() {
    Api api;
    const std::string name = library_name();
    void* lib = dlopen(name.c_str(), RTLD_NOLOAD | RTLD_NOW);  // the CUDA EP's copy
#if defined(GTCO_EMULATE)
    if (lib == nullptr) {  // the emulation takes a loaded copy only (see the top of this file)
        api.error = name + " is not loaded in this process (an emulated build takes only a copy already loaded, "
                    "never one from the library path)";
        return api;
    }
#else
    if (lib == nullptr) lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
#endif
    if (lib == nullptr) {
        const char* why = dlerror();
        api.error = name + " is neither loaded in this process nor found on the library path (" +
                    (why ? why : "?") + "); it comes with ONNX Runtime's CUDA EP dependencies (pip install "
                    "nvidia-cublas)";
        return api;
    }
    auto sym = [&](auto& fn, const char* s) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, s));
        if (fn == nullptr && api.error.empty()) api.error = name + " has no symbol " + s;
    };
    sym(api.create, "cublasLtCreate");
    sym(api.desc_create, "cublasLtMatmulDescCreate");
    sym(api.desc_set, "cublasLtMatmulDescSetAttribute");
    sym(api.layout_create, "cublasLtMatrixLayoutCreate");
    sym(api.layout_set, "cublasLtMatrixLayoutSetAttribute");
    sym(api.pref_create, "cublasLtMatmulPreferenceCreate");
    sym(api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    sym(api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    sym(api.matmul, "cublasLtMatmul");
    return api;
}

inline const Api& api() {
    static const Api a = load_api();
    return a;
}

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // the most a plan's algorithm may ask for

struct Plan {
    cublasLtHandle_t handle = nullptr;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // D has C's layout
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulAlgo_t algo{};
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
    std::mutex use;  // the descriptor's bias pointer is set per call
};

inline size_t elem_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

// The largest power of two up to 256 dividing every address and batch step (bytes) of the operands: the alignment
// the heuristic may assume.
inline uint32_t alignment(const GemmArgs& a, const Spec& s) {
    uint64_t bits = 256;
    auto add = [&](const void* p, int64_t stride, size_t elem) {
        if (p != nullptr) bits |= reinterpret_cast<uint64_t>(p) | static_cast<uint64_t>(stride) * elem;
    };
    add(a.a, a.stride_a, elem_bytes(s.dtype));
    add(a.b, a.stride_b, elem_bytes(s.dtype));
    add(a.y, a.stride_y, elem_bytes(s.out));
    add(a.residual, a.stride_y, elem_bytes(s.out));
    add(a.bias, 0, elem_bytes(s.bias));
    return static_cast<uint32_t>(bits & (~bits + 1));
}

inline bool ok(cublasStatus_t st, const char* what, std::string& why) {
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    why = std::string(what) + " failed (cublasStatus_t " + std::to_string(static_cast<int>(st)) + ")";
    return false;
}

inline bool make_layout(const Api& api, cublasLtMatrixLayout_t& l, cudaDataType_t t, int64_t rows, int64_t cols,
                        int64_t ld, int64_t batch, int64_t stride, std::string& why) {
    if (!ok(api.layout_create(&l, t, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
            "cublasLtMatrixLayoutCreate", why)) {
        return false;
    }
    if (batch == 1) return true;
    const int32_t count = static_cast<int32_t>(batch);
    return ok(api.layout_set(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)), "batch count", why) &&
           ok(api.layout_set(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
              "batch stride", why);
}

// A new plan, or null with `why` set.
inline std::unique_ptr<Plan> make_plan(const Api& api, const Spec& s, const Shape& sh, uint32_t align,
                                       std::string& why) {
    auto p = std::make_unique<Plan>();
    const cublasOperation_t ta = sh.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    const bool has_bias = s.epilogue == CUBLASLT_EPILOGUE_BIAS || s.epilogue == CUBLASLT_EPILOGUE_RELU_BIAS ||
                          s.epilogue == CUBLASLT_EPILOGUE_GELU_BIAS;
    const int32_t bias_type = s.bias;
    if (!ok(api.create(&p->handle), "cublasLtCreate", why) ||
        !ok(api.desc_create(&p->desc, s.compute, CUDA_R_32F), "cublasLtMatmulDescCreate", why) ||
        !ok(api.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA", why) ||
        !ok(api.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB", why) ||
        !ok(api.desc_set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &s.epilogue, sizeof(s.epilogue)), "EPILOGUE", why) ||
        (has_bias && !ok(api.desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)),
                         "BIAS_DATA_TYPE", why)) ||
        !make_layout(api, p->a, s.dtype, sh.trans_a ? sh.k : sh.m, sh.trans_a ? sh.m : sh.k, sh.lda, sh.batch,
                     sh.stride_a, why) ||
        !make_layout(api, p->b, s.dtype, sh.k, sh.n, sh.ldb, sh.batch, sh.stride_b, why) ||
        !make_layout(api, p->c, s.out, sh.m, sh.n, sh.ldc, sh.batch, sh.stride_c, why) ||
        !ok(api.pref_create(&p->pref), "cublasLtMatmulPreferenceCreate", why) ||
        !ok(api.pref_set(p->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes,
                         sizeof(kWorkspaceBytes)), "MAX_WORKSPACE_BYTES", why)) {
        return nullptr;
    }
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
        if (!ok(api.pref_set(p->pref, attr, &align, sizeof(align)), "MIN_ALIGNMENT", why)) return nullptr;
    }
    constexpr int kMaxRank = 8;
    cublasLtMatmulHeuristicResult_t found[kMaxRank] = {};
    int returned = 0;
    if (s.rank < 0 || s.rank >= kMaxRank) {
        why = "algorithm rank " + std::to_string(s.rank) + " is outside [0, " + std::to_string(kMaxRank) + ")";
        return nullptr;
    }
    if (!ok(api.heuristic(p->handle, p->desc, p->a, p->b, p->c, p->c, p->pref, s.rank + 1, found, &returned),
            "cublasLtMatmulAlgoGetHeuristic", why)) {
        return nullptr;
    }
    if (returned <= s.rank) {
        why = "the heuristic offers " + std::to_string(returned) + " algorithm(s) for this problem; rank " +
              std::to_string(s.rank) + " was chosen";
        return nullptr;
    }
    p->algo = found[s.rank].algo;
    p->workspace_bytes = found[s.rank].workspaceSize;
    if (p->workspace_bytes > 0) {
        const cudaError_t e = cudaMalloc(&p->workspace, p->workspace_bytes);
        if (e != cudaSuccess) {
            why = "cudaMalloc of the " + std::to_string(p->workspace_bytes) + "-byte workspace failed: " +
                  cudaGetErrorString(e);
            return nullptr;
        }
    }
    return p;
}

// The plan of this call (made on first use), or null with `why` set.
inline Plan* plan_for(const Api& api, const Spec& s, const GemmArgs& a, const Shape& sh, void* stream,
                      std::string& why) {
    using Key = std::tuple<int, void*, const Spec*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           uint32_t>;
    static std::mutex lock;
    static std::map<Key, std::unique_ptr<Plan>>* plans = new std::map<Key, std::unique_ptr<Plan>>();
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
        why = "cudaGetDevice failed";
        return nullptr;
    }
    const uint32_t align = alignment(a, s);
    const Key key{device, stream, &s, sh.m, sh.n, sh.k, sh.batch, sh.stride_a, sh.stride_b, sh.stride_c, align};
    std::lock_guard<std::mutex> g(lock);
    auto it = plans->find(key);
    if (it != plans->end()) return it->second.get();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
        why = "first call of this shape inside a CUDA graph capture: the cuBLASLt plan (handle, workspace, "
              "algorithm) is made on an uncaptured call; run the model once before capturing";
        return nullptr;
    }
    std::unique_ptr<Plan> p = make_plan(api, s, sh, align, why);
    if (p == nullptr) return nullptr;
    return plans->emplace(key, std::move(p)).first->second.get();
}

// One GEMM through cuBLASLt: the body of every generated cuBLASLt entry point.
inline int run(const Spec& s, const GemmArgs& a, void* stream) {
    std::string& why = last_error();
    why.clear();
    const bool has_bias = s.epilogue == CUBLASLT_EPILOGUE_BIAS || s.epilogue == CUBLASLT_EPILOGUE_RELU_BIAS ||
                          s.epilogue == CUBLASLT_EPILOGUE_GELU_BIAS;
    if (a.batch < 1 || a.m < 1 || a.n < 1 || a.k < 1 || a.a == nullptr || a.b == nullptr || a.y == nullptr ||
        (a.bias != nullptr) != has_bias || (a.residual != nullptr) != s.residual ||
        a.stride_a < 0 || a.stride_b < 0 || a.stride_y < 0) {
        why = "the arguments do not match the instance (sizes, operands present, strides)";
        return GTCO_EBADSHAPE;
    }
    const Api& api = lt::api();
    if (!api.error.empty()) {
        why = api.error;
        return GTCO_ELIBRARY;
    }
    const Shape sh = lt_shape(a, s.trans_b);
    Plan* p = plan_for(api, s, a, sh, stream, why);
    if (p == nullptr) return GTCO_ELIBRARY;
#if defined(GTCO_EMULATE)
    why = "an emulated build stops before cublasLtMatmul: cuBLASLt's kernels cannot read the emulation's operands "
          "(host memory)";
    return GTCO_ELIBRARY;
#endif
    const float alpha = a.alpha, beta = s.residual ? 1.0f : 0.0f;
    std::lock_guard<std::mutex> g(p->use);
    if (has_bias && !ok(api.desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &a.bias, sizeof(a.bias)),
                        "BIAS_POINTER", why)) {
        return GTCO_ELIBRARY;
    }
    const void* c = s.residual ? a.residual : a.y;
    if (!ok(api.matmul(p->handle, p->desc, &alpha, a.b, p->a, a.a, p->b, &beta, c, p->c, a.y, p->c, &p->algo,
                       p->workspace, p->workspace_bytes, static_cast<cudaStream_t>(stream)),
            "cublasLtMatmul", why)) {
        return GTCO_ELAUNCH;
    }
    return GTCO_OK;
}

}  // namespace lt
}  // namespace gtco

// The reason this thread's last cuBLASLt instance call failed ("" after a success), for callers that see the
// instances only through their C entry points (the GPU measurer). Weak: every instance's object defines it (an
// inline one would be emitted by none, being unused there) and the link keeps one.
extern "C" __attribute__((weak, visibility("default"))) const char* gtco_cublaslt_error() {
    return gtco::lt::last_error().c_str();
}
