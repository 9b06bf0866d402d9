// The cuBLASLt GEMM path's pure parts, with no CUDA or cuBLAS dependency (the g++-built ORT glue includes this;
// a CPU test checks lt_shape against onnx_gtco/families/gemm/cublaslt.py's describe, which it mirrors):
//   * lt_shape: a GemmArgs problem (row-major, dense leading dimensions, gemm/gemm_args.h) as cuBLASLt's column-major
//     matmul Yᵀ = Bᵀ Aᵀ: cuBLASLt's A is our B buffer, its B our A buffer, D our y;
//   * the status an instance returns when the cuBLASLt path cannot run, and the reason, per thread.
#pragma once

#include <stdint.h>

#include <string>

#include "gemm/gemm_args.h"
#include "gtco/args.h"

// An instance's return code (beside GTCO_OK / GTCO_EBADSHAPE / GTCO_ELAUNCH of gtco/args.h): the library it calls
// is absent or refused the problem; gtco::lt::last_error() says why.
#define GTCO_ELIBRARY 3

namespace gtco {
namespace lt {

// cuBLASLt's sizes, leading dimensions and batch strides (elements) of one matmul (column-major terms).
struct Shape {
    int64_t m, n, k;        // D is m x n: our N x M (M counting the batch when it folds into the rows)
    bool trans_a;           // cuBLASLt's op on A (our B): T when B is stored [N, K]
    int64_t lda, ldb, ldc;  // stored A (m x k, or k x m with trans_a), B (k x n), C = D (m x n)
    int64_t batch;
    int64_t stride_a, stride_b, stride_c;  // 0 when batch == 1
};

// `a` as one cuBLASLt matmul. One B for the batch (stride_b 0) with A and y dense across it: the batch folds into
// the rows, one matmul of M * batch rows.
inline Shape lt_shape(const GemmArgs& a, bool trans_b) {
    Shape s{};
    const bool fold = a.batch == 1 || (a.stride_b == 0 && a.stride_a == a.m * a.k && a.stride_y == a.m * a.n);
    const int64_t rows = fold ? a.m * a.batch : a.m;
    s.m = a.n, s.n = rows, s.k = a.k;
    s.trans_a = trans_b;
    s.lda = trans_b ? a.k : a.n, s.ldb = a.k, s.ldc = a.n;
    s.batch = fold ? 1 : a.batch;
    s.stride_a = fold ? 0 : a.stride_b;
    s.stride_b = fold ? 0 : a.stride_a;
    s.stride_c = fold ? 0 : a.stride_y;
    return s;
}

// The reason the last cuBLASLt call of this thread failed ("" after a success).
inline std::string& last_error() {
    thread_local std::string why;
    return why;
}

// An instance name the cuBLASLt generator made (onnx_gtco/families/gemm/cublaslt.py: "cublaslt_<arch>_...").
inline bool is_instance(const std::string& name) { return name.rfind("cublaslt_", 0) == 0; }

}  // namespace lt
}  // namespace gtco
