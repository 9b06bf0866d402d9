// GEMM / batched GEMM on Tensor Cores with a fused epilogue:
//
//     y[b] = act(alpha * A[b] @ B[b] + bias) * layer_scale + residual[b]  (bias, act, layer_scale and residual
//                                                                          optional; alpha at run time)
//
// A [batch, M, K] row-major; B [K, N] row-major (TRANS_B = false) or [N, K] (TRANS_B = true: ONNX Gemm transB,
// nn.Linear weights), per batch or shared by the whole batch (stride_b = 0, a weight GEMM); bias [N]; layer_scale
// [N] (HAS_SCALE: LayerScale, DINOv2's / CaiT's per-channel Mul between a block's projection and its residual Add,
// one factor per column after the activation); residual and
// y [batch, M, N] row-major. Inputs are T; products accumulate in fp32, the epilogue runs in fp32 and rounds once
// to TOut: T, or float (the output cast fused in: a group that ends in Cast to fp32). The residual has y's type.
//   T = __half / __nv_bfloat16: mma.m16n8k16 with f16 / bf16 operands.
//   T = float: TF32 (what cuBLAS and ORT's CUDA EP do for fp32 with TF32 allowed): mma.m16n8k8 .tf32, each
//   operand rounded from fp32 by cvt.rna.tf32.f32 (10 mantissa bits, nearest, ties away) after its shared load;
//   fp32 I/O, bias and residual, fp32 accumulation.
//
// Schedule (one block per BM x BN tile of one batch entry; WM x WN warps, each a (BM/WM) x (BN/WN) warp tile of
// m16n8k16 or m16n8k8 mma):
//   - global -> shared: cp.async.cg 16-byte chunks (8 halves or 4 floats) in a STAGES-deep ring (prologue of
//     STAGES-1 k-tiles, one new k-tile issued per iteration, ALCOP's multi-stage pipeline). Chunks outside M, N or
//     K are zero-filled (src-size 0), so ragged edges need no other masking in the main loop. This needs K and N
//     multiples of the chunk (a chunk never straddles an edge) and 16-byte aligned A and B.
//     VEC = false is the slower fallback for any K and N (attention's 197-long rows): each thread reads its
//     chunk element by element with plain predicated loads and stores it to the same ring slot; the ring,
//     barriers and fragments are unchanged, only the copy is synchronous (no overlap of load and mma).
//   - shared rows are padded (GemmTile::kAPad / kBPad): 16 bytes for 16-bit T, keeping rows 16-byte aligned for
//     ldmatrix/cp.async with the 8 row addresses of one ldmatrix matrix in distinct bank groups; for fp32, 4 or
//     8 floats so that the 32 words of a fragment load hit 32 distinct banks.
//   - shared -> registers: ldmatrix.x4 for A; ldmatrix.x4 (TRANS_B) or ldmatrix.x4.trans ([K, N] B) for two
//     n8 tiles of B at once (.x2 for an odd last one). fp32: ldmatrix (.b16 rows of 16 bytes = 4 floats, which is
//     the tf32 A layout) for A and TRANS_B B, plain 32-bit shared loads for [K, N] B.
//   - epilogue straight from the accumulator fragments: each lane owns pairs of adjacent columns, so bias,
//     residual and y move as 32-bit pairs, fp32 as 8-byte pairs (element by element with VEC = false).
//   - EPI_SMEM = true (VEC only): the epilogue staged through shared memory instead. The block's fp32 accumulators
//     go to a BM x (BN + 8) fp32 tile over the (then idle) ring, and each thread then takes whole 16-byte chunks of
//     y rows (8 halves or 4 floats): bias, activation, residual and the store move as 16-byte accesses, a warp's
//     stores cover whole 128-byte lines. The padding of 8 floats puts the 8-byte fragment stores of a half-warp
//     (4 rows x 4 column pairs) in 32 distinct banks. Same arithmetic, same rounding: bit-identical to the direct
//     epilogue.
//   - SPLITK > 1: split-K. Grid z is batch x SPLITK; split s of a tile runs k-tiles [s*kt/SPLITK, (s+1)*kt/SPLITK)
//     and stores its fp32 accumulators to the workspace (fragment order, coalesced, through L2), fences, and counts
//     itself in the tile's counter. The block that arrives last sums the SPLITK partial tiles in split order (its own
//     read back too) - the same sum whichever block is last, so results are deterministic - resets the counter to
//     zero for the next launch and runs the epilogue. The workspace (stream_scratch_zeroed: counters zero when made,
//     zero again after every launch) holds one counter and SPLITK partial tiles per output tile. For small M x N
//     with a long K (fc2 of a batch-1 ViT: 12 tiles of 96 k-tiles), where one block per tile leaves most SMs idle.
//   - LN = true: LayerNorm of y's rows fused (GEMM + bias + residual + LayerNorm, a transformer's post-LN block
//     or the next block's pre-LN): after the epilogue wrote the tile of y (T-rounded, the residual stream), the
//     block that completes a row panel (BM rows, all N columns) computes ln_y = (y - mean) / sqrt(var + eps) *
//     gamma + beta from y as stored, as an unfused GEMM then LayerNorm would: with BN >= N the block itself, else
//     the last of the panel's blocks to arrive at the panel's counter (the stream's zeroed workspace, like
//     split-K's; reset by that block), reading the other blocks' y through L2. fp32 statistics, the mean first,
//     then the centered sum of squares (layernorm/layernorm.cuh); one warp per row, the row in registers (N <= 1024),
//     read whole before ln_y is written, so ln_y may be y. VEC, SPLITK = 1 and TOut = T only.
//   - GATED = true: a gated MLP's two projections in one GEMM (SwiGLU, GeGLU: y = act(x @ Wg) * (x @ Wu)). B holds
//     the gate's and the up projection's columns interleaved ([K, 2N']: gate j at column 2j, up j at 2j + 1, the
//     weight packed so before planning, families/gemm/gated.py), so each lane's pair of adjacent columns is one
//     output's (gate, up): the direct epilogue writes y[row, col / 2] = act(gate + bias) * (up + bias), y [M, N / 2]
//     (stride_y counts its elements). Without a residual, LayerScale, LayerNorm or the staged epilogue.
//   - FP8 = true (T = __half, TRANS_B, VEC): an fp8 GEMM (onnx_gtco/fp8.py). B is E4M3 bytes [N, K], copied in
//     16-byte chunks (16 values) into rows of BK bytes + 16 of padding; each lane reads its B pairs (k 2*tig, +1 and
//     + 8) as 16-bit words and decodes them to halves (every E4M3 value is exact in fp16). A is fp16 as always; its
//     fragments are divided by p.a_scale and rounded to E4M3 (saturated at 448) after ldmatrix. The f16 mma then
//     multiplies the E4M3 values exactly with fp32 accumulation; alpha carries s_a * s_b. Plain arithmetic for the
//     conversions (the sm_89+ cvt instructions would be faster and are not used yet).
// Shared memory is static up to 48 KiB and dynamic (GTCO_DYNAMIC_SHARED + GTCO_LAUNCH_SMEM) above.
//
// Test hook: GTCO_GEMM_TEST_FAULT=1 adds the bias twice, =2 waits for one cp.async group too few (reads a stage
// before its copy landed), =3 skips the tf32 rounding of the fp32 operands, =4 leaves split-K's tile counters
// where the last launch left them, =5 divides the LayerNorm's row sum by N + 1 (a wrong mean), =6 leaves the
// residual out of the LayerNorm's input. They exist only so that tests can show they catch such bugs.
#pragma once

#include <climits>
#include <cstdint>

#include "gemm/gemm_args.h"
#include "gtco/launch.cuh"
#if !defined(GTCO_EMULATE)
#include "gtco/scratch.h"
#endif

#ifndef GTCO_GEMM_TEST_FAULT
#define GTCO_GEMM_TEST_FAULT 0
#endif

namespace gtco {

// Epilogue activations, named as in onnx_gtco/patterns/_act.py.
enum class Act : int { kNone = 0, kRelu, kGeluErf, kGeluTanh, kSilu, kQuickGelu, kSigmoid, kTanh, kRelu6 };

namespace gemm_detail {

// The two T of a 32-bit word (low half first) as floats.
template <class T>
GTCO_DEVICE void unpack_f32(uint32_t w, float& lo, float& hi) {
    const auto l = static_cast<unsigned short>(w & 0xffffu), h = static_cast<unsigned short>(w >> 16);
    if constexpr (std::is_same<T, __half>::value) {
        lo = __half2float(__ushort_as_half(l));
        hi = __half2float(__ushort_as_half(h));
    } else {
        lo = __bfloat162float(__ushort_as_bfloat16(l));
        hi = __bfloat162float(__ushort_as_bfloat16(h));
    }
}

// One 16-byte chunk of T (8 halves or 4 floats) to and from floats.
template <class T>
GTCO_DEVICE void unpack16(const uint4& w, float (&f)[16 / sizeof(T)]) {
    if constexpr (std::is_same<T, float>::value) {
        f[0] = __uint_as_float(w.x);
        f[1] = __uint_as_float(w.y);
        f[2] = __uint_as_float(w.z);
        f[3] = __uint_as_float(w.w);
    } else {
        unpack_f32<T>(w.x, f[0], f[1]);
        unpack_f32<T>(w.y, f[2], f[3]);
        unpack_f32<T>(w.z, f[4], f[5]);
        unpack_f32<T>(w.w, f[6], f[7]);
    }
}

template <class T>
GTCO_DEVICE uint4 pack16(const float (&f)[16 / sizeof(T)]) {
    uint4 w;
    if constexpr (std::is_same<T, float>::value) {
        w.x = __float_as_uint(f[0]);
        w.y = __float_as_uint(f[1]);
        w.z = __float_as_uint(f[2]);
        w.w = __float_as_uint(f[3]);
    } else {
        w.x = pack_b16(from_f32<T>(f[0]), from_f32<T>(f[1]));
        w.y = pack_b16(from_f32<T>(f[2]), from_f32<T>(f[3]));
        w.z = pack_b16(from_f32<T>(f[4]), from_f32<T>(f[5]));
        w.w = pack_b16(from_f32<T>(f[6]), from_f32<T>(f[7]));
    }
    return w;
}

GTCO_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <Act ACT>
GTCO_DEVICE float activate(float x) {
    if constexpr (ACT == Act::kNone) {
        return x;
    } else if constexpr (ACT == Act::kRelu) {
        return fmaxf(x, 0.0f);
    } else if constexpr (ACT == Act::kGeluErf) {
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    } else if constexpr (ACT == Act::kGeluTanh) {
        return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    } else if constexpr (ACT == Act::kSilu) {
        return x * sigmoid(x);
    } else if constexpr (ACT == Act::kQuickGelu) {
        return x * sigmoid(1.702f * x);
    } else if constexpr (ACT == Act::kSigmoid) {
        return sigmoid(x);
    } else if constexpr (ACT == Act::kTanh) {
        return tanhf(x);
    } else {
        static_assert(ACT == Act::kRelu6, "unknown activation");
        return fminf(fmaxf(x, 0.0f), 6.0f);
    }
}

}  // namespace gemm_detail

// Compile-time geometry of one tile configuration (shared by the kernel, the launcher and, as numbers, Python).
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, bool TRANS_B, bool FP8 = false>
struct GemmTile {
    static constexpr bool kTf32 = std::is_same<T, float>::value;  // fp32 I/O: m16n8k8 tf32 mma
    static constexpr int kThreads = WM * WN * 32;
    static constexpr int kChunk = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte cp.async chunk
    static constexpr int kMmaK = kTf32 ? 8 : 16;
    // Padding per shared row (elements): 16 bytes for 16-bit T. fp32: rows read along k (A, and B when TRANS_B)
    // are padded by 4 floats, so that the row stride is 4 words mod 32 banks (ldmatrix rows and the 8 rows x 4
    // columns of a fragment fall in distinct banks); [K, N] B rows, read as 4 k-rows x 8 n-columns of 32-bit
    // words, are padded by 8 floats (8 words mod 32).
    static constexpr int kAPad = kTf32 ? 4 : 8;
    static constexpr int kBPad = kTf32 && TRANS_B ? 4 : 8;
    static constexpr int kAStride = BK + kAPad;               // A stage: BM rows of BK
    static constexpr int kBRows = TRANS_B ? BN : BK;          // B stage: BN rows of BK, or BK rows of BN
    // FP8: B's rows are BK E4M3 bytes padded by 16 bytes, counted in T (halves)
    static constexpr int kBStride = FP8 ? (BK + 16) / 2 : (TRANS_B ? BK : BN) + kBPad;
    static constexpr int kBRowBytes = kBStride * static_cast<int>(sizeof(T));
    static constexpr int kBChunk = FP8 ? 16 : kChunk;         // B elements per 16-byte cp.async chunk
    static constexpr int kAStage = BM * kAStride, kBStage = kBRows * kBStride;
    static constexpr int kSmemElems = STAGES * (kAStage + kBStage);
    static constexpr int kSmemBytes = kSmemElems * static_cast<int>(sizeof(T));
    static constexpr bool kDynamic = kSmemBytes > 48 * 1024;
    static constexpr int TM = BM / WM, TN = BN / WN;          // warp tile
    static constexpr int MI = TM / 16, NI = TN / 8;           // mma tiles per warp tile

    static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value || kTf32,
                  "T: __half, __nv_bfloat16 or float (tf32 mma)");
    static_assert(STAGES >= 2 && STAGES <= 4, "STAGES: 2..4");
    static_assert(BK % 16 == 0, "BK: a multiple of 16 (the f16 mma k; two tf32 k-steps)");
    static_assert(BM % (16 * WM) == 0 && BN % (8 * WN) == 0, "warp tile: a multiple of 16 x 8");
    static_assert(!kTf32 || TRANS_B || BN % 32 == 0, "fp32 [K, N] B: BN a multiple of 32 (bank-conflict-free rows)");
    static_assert(kThreads <= 1024, "at most 1024 threads per block");
    static_assert(!FP8 || (TRANS_B && std::is_same<T, __half>::value), "FP8: a K-major E4M3 B and fp16 A");
};

// Shared memory of one gemm_kernel instance: the ring, or with EPI_SMEM the larger of the ring and the staged fp32
// epilogue tile (BM rows of BN + 8 floats) that reuses it.
template <class Tile, int BM, int BN, bool EPI_SMEM>
struct GemmSmem {
    static constexpr int kEpiStride = BN + 8;
    static constexpr int kEpiBytes = EPI_SMEM ? BM * kEpiStride * 4 : 0;
    static constexpr int kBytes = Tile::kSmemBytes > kEpiBytes ? Tile::kSmemBytes : kEpiBytes;
    static constexpr bool kDynamic = kBytes > 48 * 1024;
};

// Split-K workspace of one launch (null without split-K): one arrival counter per output tile (zero between
// launches), then SPLITK fp32 partial tiles per output tile in fragment order.
struct GemmSplit {
    unsigned* counters;
    float* parts;
};

// The largest N of an LN instance: a row lives in one warp's registers, at most 32 floats per lane.
constexpr int kMaxLnN = 1024;

namespace gemm_detail {

// The LayerNorm step of an LN instance, after the block's epilogue wrote its tile of y (T-rounded). The block that
// completes a row panel (rows m0 .. m0+BM-1 of batch entry bz, all N columns) normalizes it: with one block per row
// (gridDim.x == 1) that block, otherwise the last of the panel's gridDim.x blocks to arrive at the panel's counter
// in `counters` (zero between launches; the last block resets it), which reads the others' y through L2.
// One warp per row: each lane holds the row's 16-byte chunks lane, lane + 32, ... in registers (at most 32 floats),
// the mean first, then the centered sum of squares, fp32 - the whole row is read before any of it is written, so
// ln_y may be y. `flag` is a word of shared memory that no thread reads or writes any more.
template <class T, int BM, int kThreads, bool HAS_RES>
GTCO_DEVICE void ln_panel(const GemmArgs& p, unsigned* counters, int64_t bz, int m0, int* flag) {
    constexpr int E = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
    constexpr int kIters = kMaxLnN / (32 * E);
    constexpr int kWarps = kThreads / 32;
    const int M = static_cast<int>(p.m), N = static_cast<int>(p.n);
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
    const bool shared_rows = gridDim.x > 1;
    if (shared_rows) {
        fence_gpu();      // this thread's y is visible device-wide before the block is counted
        __syncthreads();  // every thread's is
        volatile int* const last = flag;
        if (tid == 0) {
            unsigned* const counter = counters + bz * static_cast<int64_t>(gridDim.y) + blockIdx.y;
            const unsigned arrived = atomic_add_u32(counter, 1u);
            *last = arrived == gridDim.x - 1;
            if (arrived == gridDim.x - 1) *counter = 0u;  // zero for the next launch on this stream
        }
        __syncthreads();
        if (*last == 0) return;  // the whole block: another block of the panel normalizes it
        fence_gpu();
    } else {
        __syncthreads();  // the block's own y tile is whole (and visible to all its threads)
    }
    const T* const Y = static_cast<const T*>(p.y) + bz * p.stride_y;
    T* const LY = static_cast<T*>(p.ln_y) + bz * p.stride_y;
    const T* const gamma = static_cast<const T*>(p.ln_gamma);
    const T* const beta = static_cast<const T*>(p.ln_beta);
#if GTCO_GEMM_TEST_FAULT == 6
    const T* const R = HAS_RES ? static_cast<const T*>(p.residual) + bz * p.stride_y : nullptr;
#endif
    const float inv_n = 1.0f / static_cast<float>(N);
    for (int r = warp; r < BM; r += kWarps) {
        const int row = m0 + r;
        if (row >= M) break;  // warp-uniform; later rows of the panel are past M too
        const int64_t off = static_cast<int64_t>(row) * N;
        float v[kIters][E];
        float s = 0.0f;
        GTCO_UNROLL
        for (int i = 0; i < kIters; ++i) {
            const int col = (i * 32 + lane) * E;
            if (col < N) {  // N is a multiple of E: a chunk is wholly in or out
                uint4 w;
                if (shared_rows) {
                    w = ld_cg_16(Y + off + col);
                } else {
                    w = *reinterpret_cast<const uint4*>(Y + off + col);
                }
                unpack16<T>(w, v[i]);
#if GTCO_GEMM_TEST_FAULT == 6
                if constexpr (HAS_RES) {
                    float rr[E];
                    unpack16<T>(*reinterpret_cast<const uint4*>(R + off + col), rr);
                    GTCO_UNROLL
                    for (int e = 0; e < E; ++e) v[i][e] -= rr[e];
                }
#endif
                GTCO_UNROLL
                for (int e = 0; e < E; ++e) s += v[i][e];
            }
        }
#if GTCO_GEMM_TEST_FAULT == 5
        const float mean = warp_sum(s) / static_cast<float>(N + 1);
#else
        const float mean = warp_sum(s) * inv_n;
#endif
        float q = 0.0f;
        GTCO_UNROLL
        for (int i = 0; i < kIters; ++i) {
            if ((i * 32 + lane) * E < N) {
                GTCO_UNROLL
                for (int e = 0; e < E; ++e) {
                    const float d = v[i][e] - mean;
                    q += d * d;
                }
            }
        }
        const float rstd = fast_rsqrt(warp_sum(q) * inv_n + p.ln_eps);
        GTCO_UNROLL
        for (int i = 0; i < kIters; ++i) {
            const int col = (i * 32 + lane) * E;
            if (col < N) {
                float g[E], b[E], o[E];
                unpack16<T>(*reinterpret_cast<const uint4*>(gamma + col), g);
                unpack16<T>(*reinterpret_cast<const uint4*>(beta + col), b);
                GTCO_UNROLL
                for (int e = 0; e < E; ++e) o[e] = (v[i][e] - mean) * rstd * g[e] + b[e];
                *reinterpret_cast<uint4*>(LY + off + col) = pack16<T>(o);
            }
        }
    }
}

// Zero a warp tile's accumulators.
template <int MI, int NI>
GTCO_DEVICE void zero_acc(float (&acc)[MI][NI][4]) {
    GTCO_UNROLL
    for (int mi = 0; mi < MI; ++mi)
        GTCO_UNROLL
        for (int ni = 0; ni < NI; ++ni)
            GTCO_UNROLL
            for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.0f;
}

// One BK-wide k-tile of this warp's mma tiles from shared memory (as, bs: the stage; a_row: this lane's ldmatrix
// row of A). 16-bit T: m16n8k16 on ldmatrix fragments. fp32 T: m16n8k8 tf32 on fragments rounded by cvt.rna:
// A (and B when TRANS_B) through ldmatrix, whose .b16 rows of 16 bytes are 4 floats each; [K, N] B with plain
// 32-bit shared loads (ldmatrix.trans would split the words).
// The four registers of an x4 ldmatrix of B as the fragments of n-tiles ni and ni + 1 (b0 b1 of each).
template <int NI>
GTCO_DEVICE void take_b_pair(uint32_t (&bf)[NI][2], int ni, const uint32_t (&r)[4]) {
    bf[ni][0] = r[0];
    bf[ni][1] = r[1];
    bf[ni + 1][0] = r[2];
    bf[ni + 1][1] = r[3];
}

template <class Tile, class T, bool TRANS_B, int BK, bool FP8 = false>
GTCO_DEVICE void mma_ktile(float (&acc)[Tile::MI][Tile::NI][4], const T* as, const T* bs, int a_row, int wn,
                           int lane, float a_scale = 1.0f) {
    constexpr int MI = Tile::MI, NI = Tile::NI, TN = Tile::TN, kAStride = Tile::kAStride,
                  kBStride = Tile::kBStride;
    constexpr int E = 8 / (Tile::kTf32 ? 2 : 1);  // elements per 16-byte ldmatrix row: 8 halves or 4 floats
    const int a_col = (lane / 16) * E;
    GTCO_UNROLL
    for (int kk = 0; kk < BK / Tile::kMmaK; ++kk) {
        const int k0 = kk * Tile::kMmaK;
        uint32_t af[MI][4], bf[NI][2];
        // A matrices: (rows 0-7, k 0..E-1), (rows 8-15, k 0..E-1), (rows 0-7, k E..2E-1), (rows 8-15, k E..2E-1)
        GTCO_UNROLL
        for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(af[mi], as + (a_row + mi * 16) * kAStride + k0 + a_col);
        if constexpr (FP8) {  // A rounded to E4M3 at its scale; B's E4M3 pairs (k 2*tig, +1; and + 8) as halves
            GTCO_UNROLL
            for (int mi = 0; mi < MI; ++mi)
                GTCO_UNROLL
                for (int i = 0; i < 4; ++i) af[mi][i] = quantize_e4m3x2(af[mi][i], a_scale);
            const unsigned char* const b8 = reinterpret_cast<const unsigned char*>(bs);
            GTCO_UNROLL
            for (int ni = 0; ni < NI; ++ni) {
                const unsigned char* const row = b8 + (wn * TN + ni * 8 + lane / 4) * Tile::kBRowBytes + k0 +
                                                 (lane % 4) * 2;
                bf[ni][0] = e4m3x2_to_half2(*reinterpret_cast<const unsigned short*>(row));
                bf[ni][1] = e4m3x2_to_half2(*reinterpret_cast<const unsigned short*>(row + 8));
            }
        } else if constexpr (TRANS_B) {  // matrices: (n 0-7, k 0..E-1), (n 0-7, k E..), (n 8-15, k 0..E-1), (n 8-15, k E..)
            GTCO_UNROLL
            for (int ni = 0; ni + 1 < NI; ni += 2) {
                uint32_t r[4];
                ldmatrix_x4(r, bs + (wn * TN + ni * 8 + (lane / 16) * 8 + lane % 8) * kBStride + k0 +
                                   ((lane / 8) % 2) * E);
                take_b_pair(bf, ni, r);
            }
            if constexpr (NI % 2 == 1) {
                constexpr int ni = NI - 1;
                ldmatrix_x2(bf[ni], bs + (wn * TN + ni * 8 + lane % 8) * kBStride + k0 + ((lane / 8) % 2) * E);
            }
        } else if constexpr (Tile::kTf32) {  // b0 = B[k0 + tig][n g], b1 = B[k0 + tig + 4][n g]
            const T* const col = bs + (k0 + lane % 4) * kBStride + wn * TN + lane / 4;
            GTCO_UNROLL
            for (int ni = 0; ni < NI; ++ni) {
                bf[ni][0] = __float_as_uint(col[ni * 8]);
                bf[ni][1] = __float_as_uint(col[4 * kBStride + ni * 8]);
            }
        } else {  // rows are k: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
            GTCO_UNROLL
            for (int ni = 0; ni + 1 < NI; ni += 2) {
                uint32_t r[4];
                ldmatrix_x4_trans(r, bs + (k0 + lane % 16) * kBStride + wn * TN + ni * 8 + (lane / 16) * 8);
                take_b_pair(bf, ni, r);
            }
            if constexpr (NI % 2 == 1) {
                constexpr int ni = NI - 1;
                ldmatrix_x2_trans(bf[ni], bs + (k0 + lane % 16) * kBStride + wn * TN + ni * 8);
            }
        }
        if constexpr (Tile::kTf32) {
#if GTCO_GEMM_TEST_FAULT != 3
            GTCO_UNROLL
            for (int mi = 0; mi < MI; ++mi)
                GTCO_UNROLL
                for (int i = 0; i < 4; ++i) af[mi][i] = round_tf32(af[mi][i]);
            GTCO_UNROLL
            for (int ni = 0; ni < NI; ++ni) {
                bf[ni][0] = round_tf32(bf[ni][0]);
                bf[ni][1] = round_tf32(bf[ni][1]);
            }
#endif
            GTCO_UNROLL
            for (int mi = 0; mi < MI; ++mi)
                GTCO_UNROLL
                for (int ni = 0; ni < NI; ++ni) mma_m16n8k8_tf32(acc[mi][ni], af[mi], bf[ni]);
        } else {
            GTCO_UNROLL
            for (int mi = 0; mi < MI; ++mi)
                GTCO_UNROLL
                for (int ni = 0; ni < NI; ++ni) mma_m16n8k16<T>(acc[mi][ni], af[mi], bf[ni]);
        }
    }
}

}  // namespace gemm_detail

template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, bool TRANS_B, bool HAS_BIAS, Act ACT,
          bool HAS_RES, bool VEC = true, class TOut = T, int SPLITK = 1, bool EPI_SMEM = false, bool HAS_SCALE = false,
          bool LN = false, bool GATED = false, bool FP8 = false>
__global__ void __launch_bounds__(WM * WN * 32) gemm_kernel(const GemmArgs p, const GemmSplit split_ws) {
    grid_dep_wait();  // PDL: the grid ahead of this one has finished writing what this one reads (primitives.cuh)
    static_assert(std::is_same<TOut, T>::value || std::is_same<TOut, float>::value, "TOut: T or float");
    static_assert(SPLITK >= 1 && SPLITK <= 16, "SPLITK: 1..16");
    static_assert(VEC || !EPI_SMEM, "the staged epilogue moves 16-byte chunks: VEC instances only");
    static_assert(!LN || (VEC && SPLITK == 1 && std::is_same<TOut, T>::value),
                  "LN: VEC instances without split-K whose y is T");
    static_assert(!GATED || (!EPI_SMEM && !LN && !HAS_RES && !HAS_SCALE),
                  "GATED: the direct epilogue, without a residual, LayerScale or LayerNorm");
    static_assert(!FP8 || VEC, "FP8: 16-byte chunks of E4M3 B (VEC instances)");
    using Tile = GemmTile<T, BM, BN, BK, WM, WN, STAGES, TRANS_B, FP8>;
    using Smem = GemmSmem<Tile, BM, BN, EPI_SMEM>;
    constexpr int kThreads = Tile::kThreads, TM = Tile::TM, TN = Tile::TN, MI = Tile::MI, NI = Tile::NI;
    constexpr int kAStride = Tile::kAStride, kBStride = Tile::kBStride, CH = Tile::kChunk;
    constexpr int kSmemElems = (Smem::kBytes + static_cast<int>(sizeof(T)) - 1) / static_cast<int>(sizeof(T));

    T* smem;
    if constexpr (Smem::kDynamic) {
        GTCO_DYNAMIC_SHARED(T, dyn, kSmemElems);
        smem = dyn;
    } else {
        GTCO_SHARED(T, stat, kSmemElems);
        smem = stat;
    }
    T* const a_smem = smem;
    T* const b_smem = smem + STAGES * Tile::kAStage;

    const int M = static_cast<int>(p.m), N = static_cast<int>(p.n), K = static_cast<int>(p.k);
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = static_cast<int>(lane_id());
    const int wm = warp % WM, wn = warp / WM;
    const int m0 = static_cast<int>(blockIdx.y) * BM, n0 = static_cast<int>(blockIdx.x) * BN;
    const int64_t bz = static_cast<int64_t>(blockIdx.z) / SPLITK;  // the batch entry
    const int split = static_cast<int>(blockIdx.z % SPLITK);
    const T* const A = static_cast<const T*>(p.a) + bz * p.stride_a;
    const T* const B = static_cast<const T*>(p.b) + bz * p.stride_b;  // FP8: read as bytes (B8)
    const unsigned char* const B8 = static_cast<const unsigned char*>(p.b) + bz * p.stride_b;
    const int ktiles_all = (K + BK - 1) / BK;
    // This split's k-tiles (all of them without split-K): balanced, none empty while ktiles_all >= SPLITK.
    const int kt_begin = static_cast<int>(static_cast<int64_t>(split) * ktiles_all / SPLITK);
    const int ktiles = static_cast<int>(static_cast<int64_t>(split + 1) * ktiles_all / SPLITK) - kt_begin;

    // Issue the cp.async copies of this split's k-tile kt into ring slot `stage` (no commit).
    auto load_tile = [&](int stage, int kt) {
        const int k0 = (kt_begin + kt) * BK;
        T* const as = a_smem + stage * Tile::kAStage;
        T* const bs = b_smem + stage * Tile::kBStage;
        constexpr int kAChunks = BM * BK / CH, kACols = BK / CH;
        GTCO_UNROLL
        for (int i = 0; i < (kAChunks + kThreads - 1) / kThreads; ++i) {
            const int c = tid + i * kThreads;
            if (kAChunks % kThreads == 0 || c < kAChunks) {
                const int r = c / kACols, kc = (c % kACols) * CH;
                const bool ok = m0 + r < M && k0 + kc < K;
                if constexpr (VEC) {
                    const T* src = ok ? A + static_cast<int64_t>(m0 + r) * K + (k0 + kc) : A;
                    cp_async_16(as + r * kAStride + kc, src, ok);
                } else {
                    const T* src = A + static_cast<int64_t>(m0 + r) * K + (k0 + kc);
                    GTCO_UNROLL
                    for (int e = 0; e < CH; ++e)
                        as[r * kAStride + kc + e] = m0 + r < M && k0 + kc + e < K ? src[e] : T(0.0f);
                }
            }
        }
        if constexpr (FP8) {  // BN rows of BK E4M3 bytes: n0 + r, k0 + cc
            constexpr int BC = Tile::kBChunk, kB8Chunks = BN * BK / BC, kB8Cols = BK / BC;
            unsigned char* const b8 = reinterpret_cast<unsigned char*>(bs);
            GTCO_UNROLL
            for (int i = 0; i < (kB8Chunks + kThreads - 1) / kThreads; ++i) {
                const int c = tid + i * kThreads;
                if (kB8Chunks % kThreads == 0 || c < kB8Chunks) {
                    const int r = c / kB8Cols, cc = (c % kB8Cols) * BC;
                    const bool ok = n0 + r < N && k0 + cc < K;
                    cp_async_16(b8 + r * Tile::kBRowBytes + cc,
                                ok ? B8 + static_cast<int64_t>(n0 + r) * K + (k0 + cc) : B8, ok);
                }
            }
            return;
        }
        constexpr int kBChunks = BN * BK / CH, kBCols = (TRANS_B ? BK : BN) / CH;
        GTCO_UNROLL
        for (int i = 0; i < (kBChunks + kThreads - 1) / kThreads; ++i) {
            const int c = tid + i * kThreads;
            if (kBChunks % kThreads == 0 || c < kBChunks) {
                const int r = c / kBCols, cc = (c % kBCols) * CH;
                // TRANS_B: row r is n0 + r, column cc is k0 + cc; else row r is k0 + r, column cc is n0 + cc.
                const int rows_left = TRANS_B ? N - n0 - r : K - k0 - r;
                const int cols_left = TRANS_B ? K - k0 - cc : N - n0 - cc;
                const T* src = TRANS_B ? B + static_cast<int64_t>(n0 + r) * K + (k0 + cc)
                                       : B + static_cast<int64_t>(k0 + r) * N + (n0 + cc);
                if constexpr (VEC) {
                    const bool ok = rows_left > 0 && cols_left > 0;
                    cp_async_16(bs + r * kBStride + cc, ok ? src : B, ok);
                } else {
                    GTCO_UNROLL
                    for (int e = 0; e < CH; ++e)
                        bs[r * kBStride + cc + e] = rows_left > 0 && e < cols_left ? src[e] : T(0.0f);
                }
            }
        }
    };

    float acc[MI][NI][4];
    gemm_detail::zero_acc(acc);

    // Prologue: k-tiles 0 .. STAGES-2 in flight, one commit group each (empty past the end, so that the group
    // count stays uniform and cp_async_wait<STAGES-2> always means "k-tile kt has landed").
    GTCO_UNROLL
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) load_tile(s, s);
        cp_async_commit();
    }

    const int a_row = wm * TM + (lane % 16);
    for (int kt = 0; kt < ktiles; ++kt) {
#if GTCO_GEMM_TEST_FAULT == 2
        cp_async_wait<STAGES - 1>();
#else
        cp_async_wait<STAGES - 2>();
#endif
        // k-tile kt is visible to the whole block, and every warp is done with the slot of k-tile kt-1, which
        // the next load overwrites.
        __syncthreads();
        {
            const int next = kt + STAGES - 1;
            if (next < ktiles) load_tile(next % STAGES, next);
            cp_async_commit();
        }
        const int stage = kt % STAGES;
        const T* const as = a_smem + stage * Tile::kAStage;
        const T* const bs = b_smem + stage * Tile::kBStage;
        gemm_detail::mma_ktile<Tile, T, TRANS_B, BK, FP8>(acc, as, bs, a_row, wn, lane, p.a_scale);
    }
    cp_async_wait<0>();  // only empty groups remain; leaves no copy outstanding at exit

    if constexpr (SPLITK > 1) {
        // Split-K: publish this split's partial tile; the last of the tile's SPLITK blocks sums them and goes on.
        constexpr int kFrag = MI * NI * 4;
        const int64_t tile =
            (bz * static_cast<int64_t>(gridDim.y) + blockIdx.y) * static_cast<int64_t>(gridDim.x) + blockIdx.x;
        float* const parts = split_ws.parts + tile * (static_cast<int64_t>(SPLITK) * kFrag * kThreads);
        float* const mine = parts + static_cast<int64_t>(split) * kFrag * kThreads;
        GTCO_UNROLL
        for (int mi = 0; mi < MI; ++mi)
            GTCO_UNROLL
            for (int ni = 0; ni < NI; ++ni)
                GTCO_UNROLL
                for (int i = 0; i < 4; ++i) st_cg(mine + ((mi * NI + ni) * 4 + i) * kThreads + tid, acc[mi][ni][i]);
        fence_gpu();      // this thread's partial sums are visible device-wide before the block is counted
        __syncthreads();  // every thread's are (and every warp is done with the ring: the flag lands in it)
        volatile int* const last = reinterpret_cast<volatile int*>(smem);
        if (tid == 0) {
            const unsigned arrived = atomic_add_u32(split_ws.counters + tile, 1u);
            *last = arrived == SPLITK - 1;
#if GTCO_GEMM_TEST_FAULT != 4
            if (arrived == SPLITK - 1) split_ws.counters[tile] = 0u;  // zero for the next launch on this stream
#endif
        }
        __syncthreads();
        if (*last == 0) return;  // the whole block: another split finishes this tile
        fence_gpu();
        // The sum in split order, this block's own partial read back like the others: the same sum whichever block
        // is last (deterministic), and no second array of accumulators in registers.
        gemm_detail::zero_acc(acc);
        for (int s = 0; s < SPLITK; ++s) {
            const float* const part = parts + static_cast<int64_t>(s) * kFrag * kThreads + tid;
            GTCO_UNROLL
            for (int mi = 0; mi < MI; ++mi)
                GTCO_UNROLL
                for (int ni = 0; ni < NI; ++ni)
                    GTCO_UNROLL
                    for (int i = 0; i < 4; ++i) acc[mi][ni][i] += ld_cg(part + ((mi * NI + ni) * 4 + i) * kThreads);
        }
    }

    // Epilogue: lane (g, tig) of mma tile (mi, ni) holds rows g and g+8, columns 2*tig and 2*tig+1.
    const T* const bias = static_cast<const T*>(p.bias);
    const T* const lscale = static_cast<const T*>(p.layer_scale);
    TOut* const Y = static_cast<TOut*>(p.y) + bz * p.stride_y;
    const TOut* const R = HAS_RES ? static_cast<const TOut*>(p.residual) + bz * p.stride_y : nullptr;
    const int g = lane / 4, tig = lane % 4;
    if constexpr (EPI_SMEM) {
        // Staged: fragments -> fp32 tile in shared memory -> 16-byte chunks of y rows.
        constexpr int S = Smem::kEpiStride;
        constexpr int OE = 16 / static_cast<int>(sizeof(TOut));  // y elements per 16-byte chunk
        constexpr int kRowChunks = BN / OE, kChunks = BM * kRowChunks;
        static_assert(BN % OE == 0 && kChunks % kThreads == 0, "whole chunks per thread");
        float* const stage = reinterpret_cast<float*>(smem);
        __syncthreads();  // every warp is done reading the ring (and the split-K flag) before it is overwritten
        GTCO_UNROLL
        for (int mi = 0; mi < MI; ++mi)
            GTCO_UNROLL
            for (int ni = 0; ni < NI; ++ni)
                GTCO_UNROLL
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<float2*>(stage + (wm * TM + mi * 16 + g + 8 * h) * S + wn * TN + ni * 8 +
                                               2 * tig) = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        __syncthreads();
        GTCO_UNROLL
        for (int i = 0; i < kChunks / kThreads; ++i) {
            const int c = tid + i * kThreads, r = c / kRowChunks, cc = (c % kRowChunks) * OE;
            const int row = m0 + r, col = n0 + cc;
            if (row >= M || col >= N) continue;  // VEC: N is a multiple of OE, so a chunk is wholly in or out
            float v[OE];
            GTCO_UNROLL
            for (int q = 0; q < OE / 4; ++q) {
                const float4 f = *reinterpret_cast<const float4*>(stage + r * S + cc + 4 * q);
                v[4 * q] = f.x;
                v[4 * q + 1] = f.y;
                v[4 * q + 2] = f.z;
                v[4 * q + 3] = f.w;
            }
            GTCO_UNROLL
            for (int e = 0; e < OE; ++e) {
                float b = 0.0f;
                if constexpr (HAS_BIAS) {
                    b = to_f32(bias[col + e]);
#if GTCO_GEMM_TEST_FAULT == 1
                    b *= 2.0f;
#endif
                }
                v[e] = gemm_detail::activate<ACT>(v[e] * p.alpha + b);
                if constexpr (HAS_SCALE) v[e] *= to_f32(lscale[col + e]);
            }
            const int64_t off = static_cast<int64_t>(row) * N + col;
            if constexpr (std::is_same<TOut, float>::value) {
                if constexpr (HAS_RES) {
                    const float4 r4 = *reinterpret_cast<const float4*>(R + off);
                    v[0] += r4.x;
                    v[1] += r4.y;
                    v[2] += r4.z;
                    v[3] += r4.w;
                }
                float4 o;
                o.x = v[0];
                o.y = v[1];
                o.z = v[2];
                o.w = v[3];
                *reinterpret_cast<float4*>(Y + off) = o;
            } else {
                uint32_t w[4];
                if constexpr (HAS_RES) {
                    const uint4 r4 = *reinterpret_cast<const uint4*>(R + off);
                    w[0] = r4.x;
                    w[1] = r4.y;
                    w[2] = r4.z;
                    w[3] = r4.w;
                    GTCO_UNROLL
                    for (int q = 0; q < 4; ++q) {
                        float r0, r1;
                        gemm_detail::unpack_f32<T>(w[q], r0, r1);
                        v[2 * q] += r0;
                        v[2 * q + 1] += r1;
                    }
                }
                GTCO_UNROLL
                for (int q = 0; q < 4; ++q)
                    w[q] = pack_b16(from_f32<T>(v[2 * q]), from_f32<T>(v[2 * q + 1]));
                uint4 o;
                o.x = w[0];
                o.y = w[1];
                o.z = w[2];
                o.w = w[3];
                *reinterpret_cast<uint4*>(Y + off) = o;
            }
        }
        if constexpr (LN) gemm_detail::ln_panel<T, BM, kThreads, HAS_RES>(p, split_ws.counters, bz, m0,
                                                                         reinterpret_cast<int*>(smem));
        return;
    }
    GTCO_UNROLL
    for (int ni = 0; ni < NI; ++ni) {
        const int col = n0 + wn * TN + ni * 8 + 2 * tig;
        if (col >= N) continue;  // VEC (N % 8 == 0, fp32: N % 4 == 0): col < N implies col + 1 < N
        const bool pair = VEC || col + 1 < N;
        float b0 = 0.0f, b1 = 0.0f, s0 = 1.0f, s1 = 1.0f;
        if constexpr (HAS_BIAS) {
            b0 = to_f32(bias[col]);
            b1 = pair ? to_f32(bias[col + 1]) : 0.0f;
#if GTCO_GEMM_TEST_FAULT == 1
            b0 *= 2.0f;
            b1 *= 2.0f;
#endif
        }
        if constexpr (HAS_SCALE) {
            s0 = to_f32(lscale[col]);
            s1 = pair ? to_f32(lscale[col + 1]) : 0.0f;
        }
        GTCO_UNROLL
        for (int mi = 0; mi < MI; ++mi) {
            GTCO_UNROLL
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm * TM + mi * 16 + g + 8 * h;
                if (row >= M) continue;
                if constexpr (GATED) {  // the lane's pair is (gate, up) of y's column col / 2
                    const float v = gemm_detail::activate<ACT>(acc[mi][ni][2 * h] * p.alpha + b0) *
                                    (acc[mi][ni][2 * h + 1] * p.alpha + b1);
                    Y[static_cast<int64_t>(row) * (N / 2) + col / 2] = from_f32<TOut>(v);
                    continue;
                }
                float v0 = gemm_detail::activate<ACT>(acc[mi][ni][2 * h] * p.alpha + b0);
                float v1 = gemm_detail::activate<ACT>(acc[mi][ni][2 * h + 1] * p.alpha + b1);
                if constexpr (HAS_SCALE) {
                    v0 *= s0;
                    v1 *= s1;
                }
                const int64_t off = static_cast<int64_t>(row) * N + col;
                if constexpr (VEC && std::is_same<TOut, float>::value) {  // fp32 output: 8-byte pairs
                    if constexpr (HAS_RES) {
                        const float2 r = *reinterpret_cast<const float2*>(R + off);
                        v0 += r.x;
                        v1 += r.y;
                    }
                    *reinterpret_cast<float2*>(Y + off) = make_float2(v0, v1);
                } else if constexpr (VEC) {
                    if constexpr (HAS_RES) {
                        float r0, r1;
                        gemm_detail::unpack_f32<T>(*reinterpret_cast<const uint32_t*>(R + off), r0, r1);
                        v0 += r0;
                        v1 += r1;
                    }
                    *reinterpret_cast<uint32_t*>(Y + off) =
                        pack_b16(from_f32<T>(v0), from_f32<T>(v1));
                } else {
                    if constexpr (HAS_RES) v0 += to_f32(R[off]);
                    Y[off] = from_f32<TOut>(v0);
                    if (pair) {
                        if constexpr (HAS_RES) v1 += to_f32(R[off + 1]);
                        Y[off + 1] = from_f32<TOut>(v1);
                    }
                }
            }
        }
    }
    if constexpr (LN) gemm_detail::ln_panel<T, BM, kThreads, HAS_RES>(p, split_ws.counters, bz, m0,
                                                                     reinterpret_cast<int*>(smem));
}

namespace gemm_detail {
inline bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }
}  // namespace gemm_detail

// Check *args against what the instance was built for, then launch on `stream`. Returns GTCO_OK, GTCO_EBADSHAPE
// (sizes out of range, K or N not a multiple of a 16-byte chunk (8 halves, 4 floats) for a VEC instance, a
// bias / residual / layer_scale pointer present or absent against the instance, for LN N > kMaxLnN or a LayerNorm
// pointer absent (or present for an instance without LN), misaligned pointers or strides, overlapping batch
// entries) or GTCO_ELAUNCH.
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, bool TRANS_B, bool HAS_BIAS, Act ACT,
          bool HAS_RES, bool VEC = true, class TOut = T, int SPLITK = 1, bool EPI_SMEM = false, bool HAS_SCALE = false,
          bool LN = false, bool GATED = false, bool FP8 = false>
int launch_gemm(const GemmArgs* args, void* stream) {
    using Tile = GemmTile<T, BM, BN, BK, WM, WN, STAGES, TRANS_B, FP8>;
    using Smem = GemmSmem<Tile, BM, BN, EPI_SMEM>;
    if (args == nullptr) return GTCO_EBADSHAPE;
    const GemmArgs& p = *args;
    if (p.batch < 1 || p.m < 1 || p.n < 1 || p.k < 1) return GTCO_EBADSHAPE;
    if (p.m > INT_MAX - BM || p.n > INT_MAX - BN || p.k > INT_MAX - BK) return GTCO_EBADSHAPE;
    if (p.batch * SPLITK > 65535 || (p.m + BM - 1) / BM > 65535) return GTCO_EBADSHAPE;  // grid z and y limits
    if (p.a == nullptr || p.b == nullptr || p.y == nullptr) return GTCO_EBADSHAPE;
    if ((p.bias != nullptr) != HAS_BIAS || (p.residual != nullptr) != HAS_RES) return GTCO_EBADSHAPE;
    if ((p.layer_scale != nullptr) != HAS_SCALE || !gemm_detail::aligned(p.layer_scale, sizeof(T)))
        return GTCO_EBADSHAPE;
    if (p.stride_a < 0 || p.stride_b < 0 || p.stride_y < 0) return GTCO_EBADSHAPE;
    if (!gemm_detail::aligned(p.a, 2) || !gemm_detail::aligned(p.b, 2) || !gemm_detail::aligned(p.y, 2) ||
        !gemm_detail::aligned(p.residual, 2) || !gemm_detail::aligned(p.bias, 2))
        return GTCO_EBADSHAPE;
    if (!gemm_detail::aligned(p.y, sizeof(TOut)) || !gemm_detail::aligned(p.residual, sizeof(TOut)))
        return GTCO_EBADSHAPE;
    constexpr int CH = Tile::kChunk;
    if (VEC) {  // 16-byte cp.async chunks from A and B, pairs of y and residual in one access
        if (p.k % CH != 0 || p.n % CH != 0) return GTCO_EBADSHAPE;
        if (!gemm_detail::aligned(p.a, 16) || !gemm_detail::aligned(p.b, 16) ||
            !gemm_detail::aligned(p.y, (GATED ? 1 : 2) * sizeof(TOut)) ||
            !gemm_detail::aligned(p.residual, 2 * sizeof(TOut)))
            return GTCO_EBADSHAPE;
        if (p.stride_a % CH != 0 || p.stride_b % CH != 0 || (!GATED && p.stride_y % 2 != 0)) return GTCO_EBADSHAPE;
    }
    if (GATED && p.n % 2 != 0) return GTCO_EBADSHAPE;  // (gate, up) column pairs
    if (EPI_SMEM) {  // 16-byte chunks of y and the residual
        constexpr int OE = 16 / static_cast<int>(sizeof(TOut));
        if (p.n % OE != 0 || p.stride_y % OE != 0 || !gemm_detail::aligned(p.y, 16) ||
            !gemm_detail::aligned(p.residual, 16))
            return GTCO_EBADSHAPE;
    }
    if (p.batch > 1 && (p.stride_a < p.m * p.k || p.stride_y < p.m * (GATED ? p.n / 2 : p.n) ||
                        (p.stride_b != 0 && p.stride_b < p.k * p.n)))
        return GTCO_EBADSHAPE;  // batch entries of A, y (and a per-batch B) must not overlap
    const dim3 grid(static_cast<unsigned>((p.n + BN - 1) / BN), static_cast<unsigned>((p.m + BM - 1) / BM),
                    static_cast<unsigned>(p.batch * SPLITK));
    const dim3 block(Tile::kThreads);
    GemmSplit split_ws{nullptr, nullptr};
    if constexpr (SPLITK > 1) {
        // One counter per output tile (rounded up to 256 bytes), then SPLITK partial tiles of BM x BN fp32 each.
        const size_t tiles = static_cast<size_t>(grid.x) * grid.y * static_cast<size_t>(p.batch);
        const size_t counter_bytes = (tiles * sizeof(unsigned) + 255) / 256 * 256;
        const size_t bytes = counter_bytes + tiles * SPLITK * static_cast<size_t>(BM) * BN * sizeof(float);
#if defined(GTCO_EMULATE)
        void* ws = scratch_zeroed(bytes);
#else
        const char* why = nullptr;
        void* ws = stream_scratch_zeroed(stream, bytes, why);
        if (ws == nullptr) return GTCO_ELAUNCH;
#endif
        split_ws.counters = static_cast<unsigned*>(ws);
        split_ws.parts = reinterpret_cast<float*>(static_cast<unsigned char*>(ws) + counter_bytes);
    }
    if constexpr (LN) {
        // One arrival counter per row panel (grid y x batch) where the panel spans several blocks.
        constexpr int OE = 16 / static_cast<int>(sizeof(T));
        if (p.n > kMaxLnN || p.n % OE != 0 || p.stride_y % OE != 0) return GTCO_EBADSHAPE;
        if (p.ln_gamma == nullptr || p.ln_beta == nullptr || p.ln_y == nullptr) return GTCO_EBADSHAPE;
        if (!gemm_detail::aligned(p.y, 16) || !gemm_detail::aligned(p.ln_y, 16) ||
            !gemm_detail::aligned(p.ln_gamma, 16) || !gemm_detail::aligned(p.ln_beta, 16))
            return GTCO_EBADSHAPE;
        if (grid.x > 1) {
            const size_t bytes = static_cast<size_t>(grid.y) * p.batch * sizeof(unsigned);
#if defined(GTCO_EMULATE)
            split_ws.counters = static_cast<unsigned*>(scratch_zeroed(bytes));
#else
            const char* why = nullptr;
            split_ws.counters = static_cast<unsigned*>(stream_scratch_zeroed(stream, bytes, why));
            if (split_ws.counters == nullptr) return GTCO_ELAUNCH;
#endif
        }
    } else if (p.ln_gamma != nullptr || p.ln_beta != nullptr || p.ln_y != nullptr) {
        return GTCO_EBADSHAPE;  // a LayerNorm asked of an instance without one
    }
    if (FP8 && (p.k % 16 != 0 || p.stride_b % 16 != 0 || !(p.a_scale > 0.0f))) {
        return GTCO_EBADSHAPE;  // 16-byte chunks of E4M3 rows of B; A's scale a positive number
    }
    auto* kernel = &gemm_kernel<T, BM, BN, BK, WM, WN, STAGES, TRANS_B, HAS_BIAS, ACT, HAS_RES, VEC, TOut, SPLITK,
                                EPI_SMEM, HAS_SCALE, LN, GATED, FP8>;
    (void)stream;
    if constexpr (Smem::kDynamic) {
        return GTCO_LAUNCH_SMEM(kernel, grid, block, Smem::kBytes, stream, p, split_ws);
    } else {
        return GTCO_LAUNCH(kernel, grid, block, stream, p, split_ws);
    }
}

}  // namespace gtco
