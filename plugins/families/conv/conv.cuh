// 2-D convolution (a 1-D one runs as in_h = kh = oh = 1) as an implicit GEMM on Tensor Cores, with the conv
// group's epilogue fused:
//
//     y = post_act(act((conv(x, w) + bias) * a + b) + residual)                  (every step optional)
//
// a and b are folded per output channel in the epilogue from the node's constants: a = scale, b = shift (either
// alone), or with BN (an inference BatchNormalization) a = scale / sqrt(var + epsilon), b = shift - mean * a, as
// plugins/families/conv/conv_ref.h's fold_affine does. The implicit GEMM runs groups == 1; grouped and depthwise convs run
// conv_direct_kernel (at the end of this file).
//
// The GEMM (gemm.cuh's tile machinery: GemmTile, gemm_detail::mma_ktile, the same STAGES ring of shared stages):
//   M = n * oh * ow output pixels (row m = (image, oy, ox)), N = oc output channels, K = c * kh * kw in w's order
//   (k = (ci * kh + ky) * kw + kx), so B = w viewed as [oc, K] row-major: gemm.cuh's TRANS_B layout.
//   A[m][k] = x[image][ci][oy * stride_h - pad_t + ky * dil_h][ox * stride_w - pad_l + kx * dil_w], 0 outside x.
//
// Loads:
//   - A is gathered (im2col addressing in the loader): NCHW puts neither k nor m contiguous in general (a window
//     row is contiguous only with dil_w == 1, consecutive pixels only with stride_w == 1 and inside one row), so
//     A is read element by element with plain predicated loads, out-of-range taps (padding, the ragged M and K
//     edges) as zero. Each thread owns one A row (output pixel) of the tile and kThreads / BM... of its BK
//     columns; the pixel's (image, iy0, ix0) is decoded once per kernel. The next k-tile's elements are loaded
//     into registers before this k-tile's mma and stored to their ring slot after it, so the global latency
//     overlaps the Tensor Core work.
//   - B (the weights) as gemm.cuh loads a TRANS_B B: 16-byte cp.async chunks with zero-fill at the edges (VEC,
//     needs K % chunk == 0 and a 16-byte aligned w) or element-wise predicated loads (VEC = false: a 7x7 stem on 3
//     channels has K = 147).
// Epilogue straight from the accumulator fragments; y and residual are NCHW, so a lane's two adjacent columns are
// two channel planes apart and every element is stored on its own (the 8 rows g of a fragment are 8 consecutive
// pixels of one plane).
//
// Test hook: GTCO_CONV_TEST_FAULT=1 adds the padding instead of subtracting it (a wrong window origin), =2 drops
// the dilation of the kernel rows. They exist only so that tests can show they catch such bugs.
#pragma once

#include "conv/conv_args.h"
#include "gemm/gemm.cuh"

#ifndef GTCO_CONV_TEST_FAULT
#define GTCO_CONV_TEST_FAULT 0
#endif

namespace gtco {

// Epilogue operands an instance is built with (the EPI bit set).
enum ConvEpi : int { kConvBias = 1, kConvScale = 2, kConvShift = 4, kConvBn = 8, kConvRes = 16 };

// The epilogue both conv kernels share (the implicit GEMM's fragments and the direct kernel's single sums).
namespace conv_detail {

// Output channel c's fold of the per-channel operands: v = (acc + add) * mul + post.
template <class T, int EPI>
GTCO_DEVICE void channel_affine(const ConvArgs& p, int c, float& add, float& mul, float& post) {
    add = 0.0f;
    if constexpr ((EPI & kConvBias) != 0) add = to_f32(static_cast<const T*>(p.bias)[c * p.bias_step]);
    const float s = (EPI & kConvScale) != 0 ? to_f32(static_cast<const T*>(p.scale)[c * p.scale_step]) : 1.0f;
    const float t = (EPI & kConvShift) != 0 ? to_f32(static_cast<const T*>(p.shift)[c * p.shift_step]) : 0.0f;
    if constexpr ((EPI & kConvBn) != 0) {
        const float mean = to_f32(static_cast<const T*>(p.mean)[c * p.mean_step]);
        const float var = to_f32(static_cast<const T*>(p.var)[c * p.var_step]);
        mul = s / sqrtf(var + p.epsilon);
        post = t - mean * mul;
    } else {
        mul = s, post = t;
    }
}

// y[off] = post_act(act((acc + add) * mul + post) + residual[off]).
template <class T, int EPI, Act ACT, Act POST>
GTCO_DEVICE void store_out(float acc, float add, float mul, float post, const T* R, T* Y, int64_t off) {
    float v = gemm_detail::activate<ACT>((acc + add) * mul + post);
    if constexpr ((EPI & kConvRes) != 0) v += to_f32(R[off]);
    Y[off] = from_f32<T>(gemm_detail::activate<POST>(v));
}

// The argument checks both launchers share: sizes, pads, the window origin's int math, operand pointers present
// or absent against the instance (EPI), steps of 0 or 1, element alignment. groups is checked by each launcher.
template <class T, int EPI>
bool args_ok(const ConvArgs& p) {
    const int64_t sizes[] = {p.n, p.c, p.in_h, p.in_w, p.oc, p.kh, p.kw, p.oh, p.ow,
                             p.stride_h, p.stride_w, p.dil_h, p.dil_w, p.groups};
    for (int64_t s : sizes)
        if (s < 1 || s > INT_MAX) return false;
    if (p.pad_t < 0 || p.pad_l < 0 || p.pad_t > INT_MAX / 2 || p.pad_l > INT_MAX / 2) return false;
    if (p.in_h * p.in_w > INT_MAX || p.kh * p.kw > INT_MAX / p.c) return false;
    if (p.oh * p.stride_h + p.kh * p.dil_h > INT_MAX / 2 || p.ow * p.stride_w + p.kw * p.dil_w > INT_MAX / 2)
        return false;
    if (p.x == nullptr || p.w == nullptr || p.y == nullptr) return false;
    const void* ops[] = {p.bias, p.scale, p.shift, p.mean, p.var, p.residual};
    const bool want[] = {(EPI & kConvBias) != 0, (EPI & kConvScale) != 0, (EPI & kConvShift) != 0,
                         (EPI & kConvBn) != 0,   (EPI & kConvBn) != 0,    (EPI & kConvRes) != 0};
    for (int i = 0; i < 6; ++i) {
        if ((ops[i] != nullptr) != want[i]) return false;
        if (!gemm_detail::aligned(ops[i], sizeof(T))) return false;
    }
    const int64_t steps[] = {p.bias_step, p.scale_step, p.shift_step, p.mean_step, p.var_step};
    for (int64_t s : steps)
        if (s != 0 && s != 1) return false;
    return gemm_detail::aligned(p.x, sizeof(T)) && gemm_detail::aligned(p.w, sizeof(T)) &&
           gemm_detail::aligned(p.y, sizeof(T));
}

}  // namespace conv_detail

template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int EPI, Act ACT, Act POST, bool VEC>
__global__ void __launch_bounds__(WM * WN * 32) conv_kernel(const ConvArgs p) {
    grid_dep_wait();  // PDL: the grid ahead of this one has finished writing what this one reads (primitives.cuh)
    using Tile = GemmTile<T, BM, BN, BK, WM, WN, STAGES, /*TRANS_B=*/true>;
    constexpr int kThreads = Tile::kThreads, TM = Tile::TM, TN = Tile::TN, MI = Tile::MI, NI = Tile::NI;
    constexpr int kAStride = Tile::kAStride, kBStride = Tile::kBStride, CH = Tile::kChunk;
    static_assert(kThreads % BM == 0, "the A gather gives each thread one row: threads a multiple of BM");
    constexpr int kAStep = kThreads / BM;  // columns between a thread's A elements
    static_assert(BK % kAStep == 0, "BK a multiple of threads / BM");
    constexpr int kAPer = BK / kAStep;     // A elements per thread per k-tile

    T* smem;
    if constexpr (Tile::kDynamic) {
        GTCO_DYNAMIC_SHARED(T, dyn, Tile::kSmemElems);
        smem = dyn;
    } else {
        GTCO_SHARED(T, stat, Tile::kSmemElems);
        smem = stat;
    }
    T* const a_smem = smem;
    T* const b_smem = smem + STAGES * Tile::kAStage;

    const int H = static_cast<int>(p.in_h), W = static_cast<int>(p.in_w), KW = static_cast<int>(p.kw);
    const int KHW = static_cast<int>(p.kh) * KW, P = static_cast<int>(p.oh * p.ow), OW = static_cast<int>(p.ow);
    const int M = static_cast<int>(p.n) * P, N = static_cast<int>(p.oc), K = static_cast<int>(p.c) * KHW;
    const int dh = static_cast<int>(p.dil_h), dw = static_cast<int>(p.dil_w);
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = static_cast<int>(lane_id());
    const int wm = warp % WM, wn = warp / WM;
    const int m0 = static_cast<int>(blockIdx.x) * BM, n0 = static_cast<int>(blockIdx.y) * BN;
    const T* const B = static_cast<const T*>(p.w);
    const int ktiles = (K + BK - 1) / BK;

    // This thread's A row: output pixel m0 + ar, columns ak0, ak0 + kAStep, ... of each k-tile.
    const int ar = tid % BM, ak0 = tid / BM;
    const bool m_ok = m0 + ar < M;
    int iy0 = 0, ix0 = 0;
    const T* xb = static_cast<const T*>(p.x);
    if (m_ok) {
        const int img = (m0 + ar) / P, pix = (m0 + ar) - img * P, oy = pix / OW, ox = pix - oy * OW;
#if GTCO_CONV_TEST_FAULT == 1
        iy0 = oy * static_cast<int>(p.stride_h) + static_cast<int>(p.pad_t);
        ix0 = ox * static_cast<int>(p.stride_w) + static_cast<int>(p.pad_l);
#else
        iy0 = oy * static_cast<int>(p.stride_h) - static_cast<int>(p.pad_t);
        ix0 = ox * static_cast<int>(p.stride_w) - static_cast<int>(p.pad_l);
#endif
        xb += static_cast<int64_t>(img) * p.c * H * W;
    }

    // The A elements of k-tile kt for this thread (zero outside x and past M / K).
    auto fetch_a = [&](int kt, T (&v)[kAPer]) {
        GTCO_UNROLL
        for (int i = 0; i < kAPer; ++i) {
            const int k = kt * BK + ak0 + i * kAStep;
            v[i] = T(0.0f);
            if (m_ok && k < K) {
                const int ci = k / KHW, r = k - ci * KHW, ky = r / KW, kx = r - ky * KW;
#if GTCO_CONV_TEST_FAULT == 2
                const int iy = iy0 + ky, ix = ix0 + kx * dw;
#else
                const int iy = iy0 + ky * dh, ix = ix0 + kx * dw;
#endif
                if (static_cast<unsigned>(iy) < static_cast<unsigned>(H) &&
                    static_cast<unsigned>(ix) < static_cast<unsigned>(W))
                    v[i] = xb[(static_cast<int64_t>(ci) * H + iy) * W + ix];
            }
        }
    };
    auto store_a = [&](int stage, const T (&v)[kAPer]) {
        T* const as = a_smem + stage * Tile::kAStage + ar * kAStride + ak0;
        GTCO_UNROLL
        for (int i = 0; i < kAPer; ++i) as[i * kAStep] = v[i];
    };
    // Issue the copies of B's k-tile kt into ring slot `stage` (cp.async with VEC: no commit here).
    auto load_b = [&](int stage, int kt) {
        const int k0 = kt * BK;
        T* const bs = b_smem + stage * Tile::kBStage;
        constexpr int kBChunks = BN * BK / CH, kBCols = BK / CH;
        GTCO_UNROLL
        for (int i = 0; i < (kBChunks + kThreads - 1) / kThreads; ++i) {
            const int c = tid + i * kThreads;
            if (kBChunks % kThreads == 0 || c < kBChunks) {
                const int r = c / kBCols, cc = (c % kBCols) * CH;  // row n0 + r, column k0 + cc
                const int cols_left = K - k0 - cc;
                const T* src = B + static_cast<int64_t>(n0 + r) * K + (k0 + cc);
                if constexpr (VEC) {
                    const bool ok = n0 + r < N && cols_left > 0;
                    cp_async_16(bs + r * kBStride + cc, ok ? src : B, ok);
                } else {
                    GTCO_UNROLL
                    for (int e = 0; e < CH; ++e)
                        bs[r * kBStride + cc + e] = n0 + r < N && e < cols_left ? src[e] : T(0.0f);
                }
            }
        }
    };

    float acc[MI][NI][4];
    gemm_detail::zero_acc(acc);

    // Prologue: k-tiles 0 .. STAGES-2 in their slots (B's copies one commit group each, empty past the end, so
    // that cp_async_wait<STAGES-2> always means "B's k-tile kt has landed"; A's stores are plain).
    T av[kAPer];
    GTCO_UNROLL
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) {
            fetch_a(s, av);
            store_a(s, av);
            load_b(s, s);
        }
        cp_async_commit();
    }

    const int a_row = wm * TM + (lane % 16);
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        // k-tile kt is visible to the whole block, and every warp is done with the slot of k-tile kt-1, which
        // this iteration refills.
        __syncthreads();
        const int next = kt + STAGES - 1;
        const bool more = next < ktiles;
        if (more) {
            fetch_a(next, av);  // global loads in flight during the mma below
            load_b(next % STAGES, next);
        }
        cp_async_commit();
        const int stage = kt % STAGES;
        gemm_detail::mma_ktile<Tile, T, true, BK>(acc, a_smem + stage * Tile::kAStage,
                                                  b_smem + stage * Tile::kBStage, a_row, wn, lane);
        if (more) store_a(next % STAGES, av);  // read after the next __syncthreads, STAGES-1 iterations on
    }
    cp_async_wait<0>();  // only empty groups remain; leaves no copy outstanding at exit

    // Epilogue: lane (g, tig) of mma tile (mi, ni) holds rows g and g+8, columns 2*tig and 2*tig+1.
    T* const Y = static_cast<T*>(p.y);
    const T* const R = static_cast<const T*>(p.residual);
    const int g = lane / 4, tig = lane % 4;
    const int64_t plane = P, image = static_cast<int64_t>(N) * P;
    GTCO_UNROLL
    for (int ni = 0; ni < NI; ++ni) {
        const int col0 = n0 + wn * TN + ni * 8 + 2 * tig;
        float add[2], mul[2], post[2];  // v = (acc + add) * mul + post, per column
        GTCO_UNROLL
        for (int j = 0; j < 2; ++j) conv_detail::channel_affine<T, EPI>(p, col0 + j < N ? col0 + j : 0, add[j], mul[j], post[j]);
        GTCO_UNROLL
        for (int mi = 0; mi < MI; ++mi) {
            GTCO_UNROLL
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm * TM + mi * 16 + g + 8 * h;
                if (row >= M) continue;
                const int img = row / P;
                const int64_t base = img * image + (row - img * P);
                GTCO_UNROLL
                for (int j = 0; j < 2; ++j) {
                    if (col0 + j >= N) continue;
                    const int64_t off = base + (col0 + j) * plane;
                    conv_detail::store_out<T, EPI, ACT, POST>(acc[mi][ni][2 * h + j], add[j], mul[j], post[j], R, Y, off);
                }
            }
        }
    }
}

// Check *args against what the instance was built for, then launch on `stream`. Returns GTCO_OK, GTCO_EBADSHAPE
// (a size out of range or past the kernel's 32-bit index math, groups != 1, an operand pointer present or absent against the
// instance, a step other than 0 or 1, misaligned pointers, K not a multiple of a 16-byte chunk or w not 16-byte
// aligned for a VEC instance) or GTCO_ELAUNCH.
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int EPI, Act ACT, Act POST, bool VEC>
int launch_conv(const ConvArgs* args, void* stream) {
    using Tile = GemmTile<T, BM, BN, BK, WM, WN, STAGES, true>;
    if (args == nullptr) return GTCO_EBADSHAPE;
    const ConvArgs& p = *args;
    if (!conv_detail::args_ok<T, EPI>(p) || p.groups != 1) return GTCO_EBADSHAPE;  // groups: conv_direct_kernel
    // the kernel's int math: pixels (M), K and the column tiles stay below INT_MAX
    if (p.oh * p.ow > INT_MAX / p.n || p.n * p.oh * p.ow > INT_MAX - BM || p.c * p.kh * p.kw > INT_MAX - BK ||
        p.oc > INT_MAX - BN)
        return GTCO_EBADSHAPE;
    if ((p.oc + BN - 1) / BN > 65535) return GTCO_EBADSHAPE;  // grid y limit
    if (VEC && ((p.c * p.kh * p.kw) % Tile::kChunk != 0 || !gemm_detail::aligned(p.w, 16))) return GTCO_EBADSHAPE;
    const dim3 grid(static_cast<unsigned>((p.n * p.oh * p.ow + BM - 1) / BM), static_cast<unsigned>((p.oc + BN - 1) / BN));
    const dim3 block(Tile::kThreads);
    auto* kernel = &conv_kernel<T, BM, BN, BK, WM, WN, STAGES, EPI, ACT, POST, VEC>;
    (void)stream;
    if constexpr (Tile::kDynamic) {
        return GTCO_LAUNCH_SMEM(kernel, grid, block, Tile::kSmemBytes, stream, p);
    } else {
        return GTCO_LAUNCH(kernel, grid, block, stream, p);
    }
}

// Grouped and depthwise convs (groups != 1): a direct convolution on CUDA cores, one thread per output element.
// Thread i of the grid computes y's NCHW element i, so consecutive threads take consecutive ox of one output plane
// (coalesced stores, and coalesced x loads along a row for stride 1). Output channel oc belongs to group
// g = oc / (OC / groups) and sums its group's C / groups input channels over the KH x KW taps (stride, pad,
// dilation; zero outside x), in fp32 (plain fp32 products for f32 I/O: no TF32 here), then the implicit GEMM's
// epilogue (conv_detail). w is [OC, C / groups, KH, KW]. A depthwise 3x3 has 9 multiply-adds an output: memory
// bound, where a Tensor Core tile would run at one column of its N. No shared memory and no reuse across ox (each
// thread reads its own window; neighbours' overlapping reads hit L1).
//
// Test hook: GTCO_CONV_TEST_FAULT=1 adds the padding (as above); =3 reads every group's input channels from
// channel 0 (a missing group offset).
template <class T, int THREADS, int EPI, Act ACT, Act POST>
__global__ void __launch_bounds__(THREADS) conv_direct_kernel(const ConvArgs p) {
    grid_dep_wait();  // PDL: the grid ahead of this one has finished writing what this one reads (primitives.cuh)
    const int H = static_cast<int>(p.in_h), W = static_cast<int>(p.in_w);
    const int KH = static_cast<int>(p.kh), KW = static_cast<int>(p.kw);
    const int OH = static_cast<int>(p.oh), OW = static_cast<int>(p.ow), OC = static_cast<int>(p.oc);
    const int G = static_cast<int>(p.groups), CG = static_cast<int>(p.c) / G, OCG = OC / G;
    const int dh = static_cast<int>(p.dil_h), dw = static_cast<int>(p.dil_w);
    const int total = static_cast<int>(p.n) * OC * OH * OW;  // launcher: below INT_MAX - THREADS
    const int idx = static_cast<int>(blockIdx.x) * THREADS + static_cast<int>(threadIdx.x);
    if (idx >= total) return;
    int t = idx / OW;
    const int ox = idx - t * OW;
    const int oy = t % OH;
    t /= OH;
    const int oc = t % OC, img = t / OC;
#if GTCO_CONV_TEST_FAULT == 1
    const int iy0 = oy * static_cast<int>(p.stride_h) + static_cast<int>(p.pad_t);
    const int ix0 = ox * static_cast<int>(p.stride_w) + static_cast<int>(p.pad_l);
#else
    const int iy0 = oy * static_cast<int>(p.stride_h) - static_cast<int>(p.pad_t);
    const int ix0 = ox * static_cast<int>(p.stride_w) - static_cast<int>(p.pad_l);
#endif
#if GTCO_CONV_TEST_FAULT == 3
    const int c0 = 0;
#else
    const int c0 = oc / OCG * CG;  // the group's first input channel
#endif
    const int64_t plane = static_cast<int64_t>(H) * W;
    const T* xc = static_cast<const T*>(p.x) + (static_cast<int64_t>(img) * p.c + c0) * plane;
    const T* wk = static_cast<const T*>(p.w) + static_cast<int64_t>(oc) * CG * KH * KW;
    float acc = 0.0f;
    for (int ci = 0; ci < CG; ++ci, xc += plane) {
        for (int ky = 0; ky < KH; ++ky, wk += KW) {
            const int iy = iy0 + ky * dh;
            if (static_cast<unsigned>(iy) >= static_cast<unsigned>(H)) continue;
            const T* row = xc + static_cast<int64_t>(iy) * W;
            for (int kx = 0; kx < KW; ++kx) {
                const int ix = ix0 + kx * dw;
                if (static_cast<unsigned>(ix) < static_cast<unsigned>(W))
                    acc += to_f32(row[ix]) * to_f32(wk[kx]);
            }
        }
    }
    float add, mul, post;
    conv_detail::channel_affine<T, EPI>(p, oc, add, mul, post);
    conv_detail::store_out<T, EPI, ACT, POST>(acc, add, mul, post, static_cast<const T*>(p.residual),
                                              static_cast<T*>(p.y), idx);
}

// Check *args as launch_conv does (groups may be any divisor of c and oc, the output's elements below INT_MAX),
// then launch conv_direct_kernel on `stream`. Returns GTCO_OK, GTCO_EBADSHAPE or GTCO_ELAUNCH.
template <class T, int THREADS, int EPI, Act ACT, Act POST>
int launch_conv_direct(const ConvArgs* args, void* stream) {
    if (args == nullptr) return GTCO_EBADSHAPE;
    const ConvArgs& p = *args;
    if (!conv_detail::args_ok<T, EPI>(p)) return GTCO_EBADSHAPE;
    if (p.c % p.groups != 0 || p.oc % p.groups != 0) return GTCO_EBADSHAPE;
    if (p.oh * p.ow > INT_MAX / p.oc || p.oc * p.oh * p.ow > (INT_MAX - THREADS) / p.n) return GTCO_EBADSHAPE;
    const int64_t total = p.n * p.oc * p.oh * p.ow;
    const dim3 grid(static_cast<unsigned>((total + THREADS - 1) / THREADS));
    const dim3 block(THREADS);
    auto* kernel = &conv_direct_kernel<T, THREADS, EPI, ACT, POST>;
    (void)stream;
    return GTCO_LAUNCH(kernel, grid, block, stream, p);
}

}  // namespace gtco
