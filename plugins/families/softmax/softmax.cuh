// Softmax family: y[r, :] = softmax(x[r, :] * scale + mask[m(r), :]) over rows of COLS elements, fp32 math with
// the row max subtracted before exp.
//
// THREADS threads own one row, a block holds ROWS rows (blockDim = (THREADS, ROWS)); each thread keeps its ITEMS
// vectors of VEC elements in registers: one read and one write of the row. COLS % VEC == 0 is required (rows of
// odd length, e.g. 49 or 197, use VEC = 1); the tail beyond COLS within a thread's last vector slot is masked
// with -inf. A row whose every entry is -inf gives zeros (not NaN).
//
// The optional additive mask (MASK) broadcasts over rows: mask row m(r) = (r / mask_div) * mask_mul + r % mask_mod,
// which covers [B,1,1,S] (div = H*S, mul = 1, mod = 1), [1,1,S,S] (div = rows, mod = S), [B,1,S,S] (div = H*S,
// mul = S, mod = S) and a full mask (div = 1, mul = 1, mod = 1) for scores [B,H,S,S].
//
// GTCO_TEST_SOFTMAX_NO_MAX (tests only): skip the max subtraction, so exp overflows to inf on large inputs.
#pragma once

#include "softmax/softmax_args.h"
#include "elementwise/elementwise.cuh"
#include "gtco/launch.cuh"
#include "layernorm/layernorm.cuh"  // row_reduce_sum / row_reduce_max
#include "gtco/primitives.cuh"

namespace gtco {

template <typename T, int COLS, int THREADS, int VEC, int ROWS, bool MASK>
__global__ void __launch_bounds__(THREADS* ROWS)
    softmax_kernel(const T* __restrict__ x, const T* __restrict__ mask, T* __restrict__ y, int64_t rows,
                   float scale, int64_t mask_div, int64_t mask_mul, int64_t mask_mod) {
    grid_dep_wait();  // PDL: the grid ahead of this one has finished writing what this one reads (primitives.cuh)
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS: whole warps");
    static_assert(COLS % VEC == 0, "COLS % VEC");
    constexpr int NV = COLS / VEC;
    constexpr int ITEMS = (NV + THREADS - 1) / THREADS;
    constexpr int WARPS = THREADS / 32;
    GTCO_SHARED(float, red, 2 * ROWS * WARPS);

    const int t = threadIdx.x;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * ROWS + threadIdx.y;
    const bool valid = row < rows;
    const int64_t off = valid ? row * COLS : 0;
    const int64_t moff = MASK && valid ? ((row / mask_div) * mask_mul + row % mask_mod) * COLS : 0;

    float v[ITEMS * VEC];
    float m = -INFINITY;
    GTCO_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
        const int c = (i * THREADS + t) * VEC;
        float* vi = v + i * VEC;
        if (valid && (NV % THREADS == 0 || c < COLS)) {
            load_vec_at<T, VEC>(vi, x + off + c);
            float mk[VEC];
            if constexpr (MASK) load_vec_at<T, VEC>(mk, mask + moff + c);
            GTCO_UNROLL
            for (int k = 0; k < VEC; ++k) {
                vi[k] *= scale;
                if constexpr (MASK) vi[k] += mk[k];
            }
        } else {
            GTCO_UNROLL
            for (int k = 0; k < VEC; ++k) vi[k] = -INFINITY;
        }
        GTCO_UNROLL
        for (int k = 0; k < VEC; ++k) m = fmaxf(m, vi[k]);
    }
    float* red_row = red + threadIdx.y * WARPS;
#if defined(GTCO_TEST_SOFTMAX_NO_MAX)
    m = 0.0f;
#else
    m = row_reduce_max<THREADS>(m, red_row);
    if (m == -INFINITY) m = 0.0f;  // a fully masked row: exp(-inf) = 0 everywhere, not exp(nan)
#endif
    float s = 0.0f;
    GTCO_UNROLL
    for (int i = 0; i < ITEMS * VEC; ++i) {
        v[i] = expf(v[i] - m);
        s += v[i];
    }
    s = row_reduce_sum<THREADS>(s, red_row + ROWS * WARPS);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    if (!valid) return;  // no barrier follows

    GTCO_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
        const int c = (i * THREADS + t) * VEC;
        if (NV % THREADS == 0 || c < COLS) {
            float o[VEC];
            GTCO_UNROLL
            for (int k = 0; k < VEC; ++k) o[k] = v[i * VEC + k] * inv;
            store_vec_at<T, VEC>(y + off + c, o);
        }
    }
}

template <typename T, int COLS, int THREADS, int VEC, int ROWS, bool MASK>
int softmax_launch(const GtcoSoftmaxArgs* a, void* stream) {
    if (a == nullptr || a->cols != COLS || a->rows < 0) return GTCO_EBADSHAPE;
    if (MASK && (a->mask_div <= 0 || a->mask_mul < 0 || a->mask_mod <= 0)) return GTCO_EBADSHAPE;
    const void* need[] = {a->x, a->y, MASK ? a->mask : a->x};
    for (const void* p : need)
        if (p == nullptr || !aligned_to(p, static_cast<int>(sizeof(T)) * VEC)) return GTCO_EBADSHAPE;
    if (a->rows == 0) return GTCO_OK;
    const int64_t blocks = (a->rows + ROWS - 1) / ROWS;
    if (blocks > 0x7fffffff) return GTCO_EBADSHAPE;
    auto kernel = &softmax_kernel<T, COLS, THREADS, VEC, ROWS, MASK>;
    return GTCO_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks)), dim3(THREADS, ROWS), stream,
                       static_cast<const T*>(a->x), static_cast<const T*>(a->mask), static_cast<T*>(a->y), a->rows,
                       a->scale, a->mask_div, a->mask_mul, a->mask_mod);
}

}  // namespace gtco
