// LayerNorm family: y = (x - mean) / sqrt(var + eps) * gamma + beta over rows of HIDDEN elements, x = a + b when
// RES (the residual Add fused in; with RES_OUT the sum is written too, rounded to T). Without CENTER the same kernel
// is RMSNorm's (the rmsnorm family): no mean, y = x / sqrt(mean(x^2) + eps) * gamma.
//
// THREADS threads (one warp, or up to 8 warps) own one row; a block holds ROWS rows (blockDim = (THREADS, ROWS)).
// One pass over global memory: each thread loads its ITEMS vectors of VEC elements (16 bytes at most) into
// registers, the row's mean is reduced first and then the centered sum of squares from the same registers (no
// E[x^2] - mean^2 cancellation), all in fp32. Reductions: warp shuffles, then shared memory across the row's warps.
// HIDDEN % VEC == 0 is required (the Python side falls back to a narrower VEC, down to scalar).
//
// GTCO_TEST_LN_UNCENTERED (tests only): var = E[x^2] - mean^2 in one pass, which cancels badly for rows with a
// large mean; the tests use it to prove they can fail.
#pragma once

#include "layernorm/layernorm_args.h"
#include "elementwise/elementwise.cuh"
#include "gtco/launch.cuh"
#include "gtco/primitives.cuh"

namespace gtco {

// Sum over the THREADS threads of a row: a warp shuffle tree, then (THREADS > 32) through red[WARPS] in shared
// memory. Every thread of the block must call it (it may __syncthreads).
template <int THREADS>
GTCO_DEVICE float row_reduce_sum(float s, float* red) {
    s = warp_sum(s);
    if constexpr (THREADS > 32) {
        constexpr int WARPS = THREADS / 32;
        if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
        __syncthreads();
        s = 0.0f;
        GTCO_UNROLL
        for (int w = 0; w < WARPS; ++w) s += red[w];
    }
    return s;
}

template <int THREADS>
GTCO_DEVICE float row_reduce_max(float s, float* red) {
    s = warp_max(s);
    if constexpr (THREADS > 32) {
        constexpr int WARPS = THREADS / 32;
        if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
        __syncthreads();
        s = red[0];
        GTCO_UNROLL
        for (int w = 1; w < WARPS; ++w) s = fmaxf(s, red[w]);
    }
    return s;
}

template <typename T, int HIDDEN, int THREADS, int VEC, int ROWS, bool RES, bool RES_OUT, bool GAMMA, bool BETA,
          bool CENTER>
__global__ void __launch_bounds__(THREADS* ROWS)
    layernorm_kernel(const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ gamma,
                     const T* __restrict__ beta, T* __restrict__ y, T* __restrict__ sum_out, int64_t rows,
                     float eps) {
#if !defined(GTCO_TEST_PDL_LATE_WAIT)
    grid_dep_wait();  // PDL: the grid ahead of this one has finished writing what this one reads (primitives.cuh)
#endif
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS: whole warps");
    static_assert(HIDDEN % VEC == 0, "HIDDEN % VEC");
    constexpr int NV = HIDDEN / VEC;                       // vectors per row
    constexpr int ITEMS = (NV + THREADS - 1) / THREADS;   // vectors per thread (the last may be out of the row)
    constexpr int WARPS = THREADS / 32;
    GTCO_SHARED(float, red, 2 * ROWS * WARPS);

    const int t = threadIdx.x;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * ROWS + threadIdx.y;
    const bool valid = row < rows;  // threads of a missing row still take part in the barriers
    const int64_t off = valid ? row * HIDDEN : 0;

    float v[ITEMS * VEC];
    float s = 0.0f;
    GTCO_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
        const int c = (i * THREADS + t) * VEC;
        float* vi = v + i * VEC;
        if (valid && (NV % THREADS == 0 || c < HIDDEN)) {
            load_vec_at<T, VEC>(vi, x + off + c);
#if defined(GTCO_TEST_PDL_LATE_WAIT)  // a planted fault: the first load comes before the wait (test_pdl.py)
            grid_dep_wait();
#endif
            if constexpr (RES) {
                float b[VEC];
                load_vec_at<T, VEC>(b, res + off + c);
                GTCO_UNROLL
                for (int k = 0; k < VEC; ++k) vi[k] += b[k];
                if constexpr (RES_OUT) store_vec_at<T, VEC>(sum_out + off + c, vi);
            }
        } else {
            GTCO_UNROLL
            for (int k = 0; k < VEC; ++k) vi[k] = 0.0f;
        }
        GTCO_UNROLL
        for (int k = 0; k < VEC; ++k) s += vi[k];
    }
    float* red_row = red + threadIdx.y * WARPS;
    float mean = 0.0f;
    if constexpr (CENTER) mean = row_reduce_sum<THREADS>(s, red_row) * (1.0f / HIDDEN);

#if defined(GTCO_TEST_LN_UNCENTERED)
    float q = 0.0f;
    GTCO_UNROLL
    for (int i = 0; i < ITEMS * VEC; ++i) q += v[i] * v[i];
    const float var = fmaxf(row_reduce_sum<THREADS>(q, red_row + ROWS * WARPS) * (1.0f / HIDDEN) - mean * mean, 0.f);
#else
    float q = 0.0f;
    GTCO_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
        const int c = (i * THREADS + t) * VEC;
        if (NV % THREADS == 0 || c < HIDDEN) {
            GTCO_UNROLL
            for (int k = 0; k < VEC; ++k) {
                const float d = v[i * VEC + k] - mean;
                q += d * d;
            }
        }
    }
    const float var = row_reduce_sum<THREADS>(q, red_row + ROWS * WARPS) * (1.0f / HIDDEN);
#endif
    const float rstd = fast_rsqrt(var + eps);
    if (!valid) return;  // no barrier follows

    GTCO_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
        const int c = (i * THREADS + t) * VEC;
        if (NV % THREADS == 0 || c < HIDDEN) {
            float o[VEC], g[VEC], b[VEC];
            if constexpr (GAMMA) load_vec_at<T, VEC>(g, gamma + c);
            if constexpr (BETA) load_vec_at<T, VEC>(b, beta + c);
            GTCO_UNROLL
            for (int k = 0; k < VEC; ++k) {
                float n = (v[i * VEC + k] - mean) * rstd;
                if constexpr (GAMMA) n *= g[k];
                if constexpr (BETA) n += b[k];
                o[k] = n;
            }
            store_vec_at<T, VEC>(y + off + c, o);
        }
    }
}

// The host side of one instance: checks the arguments against what it was built for and launches.
template <typename T, int HIDDEN, int THREADS, int VEC, int ROWS, bool RES, bool RES_OUT, bool GAMMA, bool BETA,
          bool CENTER = true>
int layernorm_launch(const GtcoLayerNormArgs* a, void* stream) {
    if (a == nullptr || a->hidden != HIDDEN || a->rows < 0) return GTCO_EBADSHAPE;
    const void* need[] = {a->x, a->y, RES ? a->residual : a->x, RES_OUT ? a->sum : a->x, GAMMA ? a->gamma : a->x,
                          BETA ? a->beta : a->x};
    for (const void* p : need)
        if (p == nullptr || !aligned_to(p, static_cast<int>(sizeof(T)) * VEC)) return GTCO_EBADSHAPE;
    if (a->rows == 0) return GTCO_OK;
    const int64_t blocks = (a->rows + ROWS - 1) / ROWS;
    if (blocks > 0x7fffffff) return GTCO_EBADSHAPE;
    auto kernel = &layernorm_kernel<T, HIDDEN, THREADS, VEC, ROWS, RES, RES_OUT, GAMMA, BETA, CENTER>;
    return GTCO_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks)), dim3(THREADS, ROWS), stream,
                       static_cast<const T*>(a->x), static_cast<const T*>(a->residual),
                       static_cast<const T*>(a->gamma), static_cast<const T*>(a->beta), static_cast<T*>(a->y),
                       static_cast<T*>(a->sum), a->rows, a->eps);
}

}  // namespace gtco
