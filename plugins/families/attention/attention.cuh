// Attention kernel families on Tensor Cores (mma.m16n8k16 for f16 / bf16, m16n8k8 .tf32 for fp32; fp32
// accumulation), one header for two families:
//
//   attention:   O = softmax(scale * Q Kᵀ + mask + bias) V, FlashAttention-2 style (mask and bias times
//                mask_scale and bias_scale, 1 unless the graph scales the scores after adding them). One block per
//                (q tile of BQ rows, batch * head); each warp owns 16 * MT rows of the tile (MT = BQ / (16 * WARPS)
//                m-tiles).
//                K/V tiles of BKV keys stream through a STAGES-deep cp.async ring in shared memory. S = Q Kᵀ is
//                computed into accumulator registers, scaled and masked there, and the softmax runs online on the
//                registers: a running row max m and partial row sum l per thread (the four lanes of a quad hold
//                one row; quad_max combines the row max, quad_sum the sum at the end), O rescaled by
//                exp(m_old - m_new) per tile. P is rounded to T and re-packed from the S accumulators straight
//                into mma A fragments (the C layout of two 16x8 n-tiles is the A layout of one 16x16 k-step), so
//                P never touches shared memory. The result O / l is staged through shared memory and written
//                with 16-byte stores in the requested layout.
//   bmm_softmax: P = softmax(scale * Q Kᵀ + mask + bias) (GTCO's fused BMM + softmax). Same S pipeline, run
//                twice over the key tiles: pass 1 keeps the online row max and sum (no O), pass 2 recomputes
//                each S tile and writes P = exp(s - m) / l. One S tile per thread in registers, any seq_k.
//
// Layouts come as element strides: q, v and out as (batch, head, seq) with dim stride 1 (covers bhsd, bshd,
// bshd_merged and qkv_packed with an element offset); k as (batch, head, seq, dim). K with dim stride 1 goes
// through cp.async and ldmatrix; K given as Kᵀ (K_TRANS, e.g. bhds [B, H, D, S]) is gathered element by element
// (plain loads, any strides) into a [D][BKV] shared tile and read with ldmatrix.trans: slower, always correct.
// mask and bias are [B', H', Sq', Sk'] additive T tensors with element strides per dim (0 broadcasts); the batch
// index used for them is b % bmod (bmod = B for a per-batch mask, nW for Swin's [nW, 1, N, N] window mask).
//
// Head dims: D is a multiple of 16 up to 256 (32, 64, 80, 96, 128 and 256 are instantiated). PAD_D instances take any
// head_dim below D (a small odd one such as 26 runs as D = 32): Q, K and V rows are read element by element with
// plain loads (rows of head_dim elements need not be 16-byte aligned), dims head_dim .. D-1 are zero-filled in shared
// memory, so they add nothing to Q Kᵀ and give O zero columns there, which the epilogue does not store (it writes
// the head_dim columns element by element). No element past a row's head_dim is read or written.
//
// Banded (BAND): key j of query i is kept only where band_lo <= j - i <= band_hi, else -inf before the row max;
// nothing is read for it. Causal attention (upper-left aligned, as ONNX Attention's is_causal) is the band
// (-inf, 0], sliding-window (local) attention a finite one; the rule makes both from ONNX Attention's is_causal or a
// constant mask of that form. The attention kernel walks only the key tiles the band reaches from its q tile and
// runs its q tiles last to first (a causal band's longest first); bmm_softmax walks every tile and writes P's zeros
// outside the band.
//
// Edges: rows of Q and K/V beyond seq_q / seq_k are zero-filled in shared memory, key columns beyond seq_k get
// -inf before the row max. A row whose every score is -inf (a -inf mask over all keys) has l = 0: its output is
// zeros (not NaN), the `Where(IsNaN(P), 0, P)` guard exporters write. Finite masks (-10000 style) are ordinary
// values: a row masked everywhere by -10000 gives the uniform average, exactly as ONNX Softmax would.
//
// fp32 (T = float): TF32, as the GEMM family (gemm.cuh). Q Kᵀ and P V are mma.m16n8k8 .tf32 on operands rounded
// by cvt.rna.tf32.f32; the scores, the softmax statistics, O and the I/O stay fp32. Q, K (dim stride 1) and V tiles
// are fp32 rows padded by 4 floats; Q and K fragments come through ldmatrix (a .b16 row of 16 bytes is 4 floats,
// the tf32 A / B(n-major) layout), a Kᵀ tile and V through 32-bit shared loads. P needs no shuffle: within one
// 8-key k-step the key order is free, so the A fragment takes key 2*tig as its column tig and key 2*tig+1 as
// column tig+4 (exactly the S accumulators c0/c2 and c1/c3 a lane holds), and V's fragment reads the same keys.
//
// Test hooks: GTCO_ATTN_TEST_NO_RESCALE drops the exp(m_old - m_new) rescale of O and l in both families;
// GTCO_ATTN_TEST_NO_TF32_ROUND feeds the fp32 path's operands to the mma without cvt.rna (deliberate bugs the
// emulation tests must catch).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention/attention_args.h"
#include "gtco/launch.cuh"
#include "gtco/primitives.cuh"

namespace gtco {
namespace attn {

// A loop unrolled n times, not fully (the emulation build ignores it).
#if defined(GTCO_EMULATE)
#define GTCO_ATTN_UNROLL_BY(n)
#else
#define GTCO_ATTN_PRAGMA_STR(x) #x
#define GTCO_ATTN_UNROLL_BY(n) _Pragma(GTCO_ATTN_PRAGMA_STR(unroll n))
#endif

// Both kernels are __launch_bounds__(WARPS * 32, 1): without the explicit minimum of one block per SM, ptxas
// (CUDA 13.0) picks a register target for 2-5 resident blocks and spills a few words to meet it (seen at 80, 96,
// 128 and 168 registers). The Python check() keeps the live accumulators under a budget fitted to ptxas instead.
constexpr int kPad = 8;  // elements of padding per Kᵀ row, and per Q/K/V row of 16-bit T: keeps ldmatrix rows
                         // (16-bit) and the 4 x 8 words of an fp32 Kᵀ fragment load conflict-free
// Padding of the Q, K and V rows: 16 bytes for 16-bit T; 4 floats for fp32, so that the row stride is an odd
// multiple of 4 words and the 8 rows x 4 words of an ldmatrix matrix or fragment load hit distinct banks.
template <typename T>
constexpr int kRowPad = sizeof(T) == 4 ? 4 : kPad;
template <typename T>
constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte cp.async chunk / store

// An mma operand register of the fp32 path: the value rounded to tf32.
GTCO_DEVICE uint32_t tf32_operand(float x) {
#if defined(GTCO_ATTN_TEST_NO_TF32_ROUND)
    return __float_as_uint(x);
#else
    return to_tf32(x);
#endif
}
constexpr float kLog2e = 1.4426950408889634f;

struct alignas(16) Chunk {  // 16 bytes, one cp.async / one vector store
    uint32_t w[4];
};

// Compile-time shape of one instance.
template <typename T, int D, int BQ, int BKV, int WARPS, int STAGES, bool K_TRANS>
struct Shape {
    static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head dim must be a multiple of 16");
    static_assert(BKV % 16 == 0, "BKV must be a multiple of 16");
    static_assert(BQ % (16 * WARPS) == 0, "each warp owns whole 16-row m-tiles");
    static_assert(STAGES >= 2 && STAGES <= 4, "2..4 stages");
    static constexpr int kThreads = WARPS * 32;
    static constexpr int MT = BQ / (16 * WARPS);  // m-tiles per warp
    static constexpr int NB = BKV / 8;            // n-tiles of S per key tile
    static constexpr int ND = D / 8;              // n-tiles of O
    static constexpr int RS = D + kRowPad<T>;   // row stride of the Q, K and V tiles
    static constexpr int KTS = BKV + kPad;        // row stride of a Kᵀ tile ([D][BKV])
    static constexpr int kQElems = BQ * RS;
    static constexpr int kKElems = K_TRANS ? D * KTS : BKV * RS;
    static constexpr int kVElems = BKV * RS;
};

// ROWS rows of D elements (dim stride 1, 16-byte aligned rows) from src rows row0.. into dst (row stride
// D + kRowPad<T>) with cp.async; rows at or past `limit` are zero-filled.
template <typename T, int ROWS, int D, int THREADS>
GTCO_DEVICE void load_rows_async(T* dst, const T* src, int row_stride, int row0, int limit, int tid) {
    constexpr int CH = kChunkElems<T>, kChunks = ROWS * (D / CH), kIters = (kChunks + THREADS - 1) / THREADS;
    GTCO_UNROLL
    for (int i = 0; i < kIters; ++i) {
        const int c = tid + i * THREADS;
        if (kChunks % THREADS == 0 || c < kChunks) {
            const int r = c / (D / CH), col = (c % (D / CH)) * CH;
            const bool ok = row0 + r < limit;
            const T* p = ok ? src + ((row0 + r) * row_stride + col) : src;
            cp_async_16(dst + r * (D + kRowPad<T>) + col, p, ok);
        }
    }
}

// ROWS rows of a padded head (PAD_D): dst[r][c] = src[row0 + r][c] for c < dim, zero for c in dim .. D-1 and for
// rows at or past `limit`; plain element loads (the rows need no alignment), stored synchronously.
template <typename T, int ROWS, int D, int THREADS>
GTCO_DEVICE void load_rows_padded(T* dst, const T* src, int row_stride, int row0, int limit, int dim, int tid) {
    constexpr int kElems = ROWS * D, kIters = (kElems + THREADS - 1) / THREADS;
    GTCO_ATTN_UNROLL_BY(4)
    for (int i = 0; i < kIters; ++i) {
        const int e = tid + i * THREADS;
        if (kElems % THREADS == 0 || e < kElems) {
            const int r = e / D, c = e % D;
            dst[r * (D + kRowPad<T>) + c] =
                row0 + r < limit && c < dim ? src[(row0 + r) * row_stride + c] : from_f32<T>(0.0f);
        }
    }
}

// Rows of Q, K or V into shared memory: cp.async 16-byte chunks, or for a padded head (PAD_D) element loads of the
// head_dim leading dims with zeros after them.
template <typename T, int ROWS, int D, int THREADS, bool PAD_D>
GTCO_DEVICE void load_rows(T* dst, const T* src, int row_stride, int row0, int limit, int dim, int tid) {
    if constexpr (PAD_D) {
        load_rows_padded<T, ROWS, D, THREADS>(dst, src, row_stride, row0, limit, dim, tid);
    } else {
        load_rows_async<T, ROWS, D, THREADS>(dst, src, row_stride, row0, limit, tid);
    }
}

// A Kᵀ tile: dst[d][j] = K[key kv0 + j][dim d] for any strides, plain loads (keys past seq_k and dims past `dim`, a
// padded head's, are zero).
template <typename T, int D, int BKV, int THREADS>
GTCO_DEVICE void load_kt_tile(T* dst, const T* src, int ss, int sd, int kv0, int seq_k, int dim, int tid) {
    constexpr int kElems = D * BKV, kIters = (kElems + THREADS - 1) / THREADS;
    // Not fully unrolled: kIters reaches 128, and hoisting that many scattered loads ahead of their stores would
    // take as many registers and spill.
    GTCO_ATTN_UNROLL_BY(4)
    for (int i = 0; i < kIters; ++i) {
        const int e = tid + i * THREADS;
        if (kElems % THREADS == 0 || e < kElems) {
            const int d = e / BKV, j = e % BKV;
            dst[d * (BKV + kPad) + j] =
                kv0 + j < seq_k && d < dim ? src[(kv0 + j) * ss + d * sd] : from_f32<T>(0.0f);
        }
    }
}

// s[mt][n] = (Q rows of this warp) x (key tile)ᵀ for the n-tiles of one key tile. qs: the warp's first Q row in
// shared memory; ks: the key tile ([BKV][D + kPad], or [D][BKV + kPad] when K_TRANS).
template <typename T, int D, int BKV, int MT, bool K_TRANS>
GTCO_DEVICE void qk_tile(float (&s)[MT][BKV / 8][4], const T* qs, const T* ks, int lane) {
    constexpr int RS = D + kRowPad<T>, KTS = BKV + kPad;
    GTCO_UNROLL
    for (int mt = 0; mt < MT; ++mt)
        GTCO_UNROLL
        for (int n = 0; n < BKV / 8; ++n)
            GTCO_UNROLL
            for (int i = 0; i < 4; ++i) s[mt][n][i] = 0.0f;
    if constexpr (std::is_same<T, float>::value) {  // TF32: k-steps of 8 dims
        GTCO_UNROLL
        for (int kk = 0; kk < D / 8; ++kk) {
            uint32_t a[MT][4];
            // A matrices 0..3: (rows 0-7, dims 0-3), (rows 8-15, dims 0-3), (rows 0-7, dims 4-7), (rows 8-15, 4-7)
            GTCO_UNROLL
            for (int mt = 0; mt < MT; ++mt) {
                ldmatrix_x4(a[mt], qs + (mt * 16 + lane % 16) * RS + kk * 8 + (lane / 16) * 4);
                GTCO_UNROLL
                for (int i = 0; i < 4; ++i) a[mt][i] = tf32_operand(__uint_as_float(a[mt][i]));
            }
            GTCO_UNROLL
            for (int nb = 0; nb < BKV / 16; ++nb) {
                // b0 = K[key g][dim tig], b1 = K[key g][dim tig + 4] of n-tiles 2nb and 2nb+1
                uint32_t b[4];
                if constexpr (K_TRANS) {
                    const float* kt = ks + (kk * 8 + lane % 4) * KTS + nb * 16 + lane / 4;
                    b[0] = tf32_operand(kt[0]);
                    b[1] = tf32_operand(kt[4 * KTS]);
                    b[2] = tf32_operand(kt[8]);
                    b[3] = tf32_operand(kt[4 * KTS + 8]);
                } else {  // matrices (keys 0-7, dims 0-3), (keys 0-7, dims 4-7), (keys 8-15, 0-3), (keys 8-15, 4-7)
                    ldmatrix_x4(b, ks + (nb * 16 + (lane / 16) * 8 + lane % 8) * RS + kk * 8 + ((lane / 8) & 1) * 4);
                    GTCO_UNROLL
                    for (int i = 0; i < 4; ++i) b[i] = tf32_operand(__uint_as_float(b[i]));
                }
                const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                GTCO_UNROLL
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k8_tf32(s[mt][2 * nb], a[mt], b0);
                    mma_m16n8k8_tf32(s[mt][2 * nb + 1], a[mt], b1);
                }
            }
        }
    } else {  // f16 / bf16: k-steps of 16 dims
        GTCO_UNROLL
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[MT][4];
            // A matrices 0..3: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
            GTCO_UNROLL
            for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], qs + (mt * 16 + lane % 16) * RS + kk * 16 + (lane / 16) * 8);
            GTCO_UNROLL
            for (int nb = 0; nb < BKV / 16; ++nb) {
                // B matrices 0..3: (keys 0-7, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 0-7), (keys 8-15,
                // dims 8-15) of this 16-key pair of n-tiles: registers {0,1} feed n-tile 2nb, {2,3} n-tile 2nb+1.
                uint32_t b[4];
                if constexpr (K_TRANS) {
                    ldmatrix_x4_trans(b, ks + (kk * 16 + lane % 8 + ((lane / 8) & 1) * 8) * KTS + nb * 16 + (lane / 16) * 8);
                } else {
                    ldmatrix_x4(b, ks + (nb * 16 + (lane / 16) * 8 + lane % 8) * RS + kk * 16 + ((lane / 8) & 1) * 8);
                }
                const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                GTCO_UNROLL
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(s[mt][2 * nb], a[mt], b0);
                    mma_m16n8k16<T>(s[mt][2 * nb + 1], a[mt], b1);
                }
            }
        }
    }
}

// Scores in the log2 domain: s * scale * log2(e) + (mask * mask_scale + bias * bias_scale) * log2(e); keys at or past
// seq_k (and with BAND keys outside the row's band) become -inf. row0: the query row of the warp's first row; kv0:
// the tile's first key. mask/bias: already offset to (b, h).
template <typename T, int MT, int NB, bool MASK, bool BIAS, bool BAND>
GTCO_DEVICE void finish_scores(float (&s)[MT][NB][4], const gtco_attention_args& a, const T* mask, const T* bias,
                               int row0, int kv0, int lane, float scale_log2) {
    const int g = lane / 4, t = lane % 4;
    const float mask_log2 = a.mask_scale * kLog2e, bias_log2 = a.bias_scale * kLog2e;
    const int msq = static_cast<int>(a.m_sq), msk = static_cast<int>(a.m_sk);
    const int bsq = static_cast<int>(a.bias_sq), bsk = static_cast<int>(a.bias_sk);
    GTCO_UNROLL
    for (int mt = 0; mt < MT; ++mt)
        GTCO_UNROLL
        for (int n = 0; n < NB; ++n)
            GTCO_UNROLL
            for (int i = 0; i < 4; ++i) {
                const int row = row0 + mt * 16 + g + (i / 2) * 8, col = kv0 + n * 8 + 2 * t + (i & 1);
                float x = s[mt][n][i] * scale_log2;
                if constexpr (MASK || BIAS) {
                    if (row < a.seq_q && col < a.seq_k) {
                        if constexpr (MASK) x += to_f32(mask[row * msq + col * msk]) * mask_log2;
                        if constexpr (BIAS) x += to_f32(bias[row * bsq + col * bsk]) * bias_log2;
                    }
                }
                s[mt][n][i] = col < a.seq_k && (!BAND || (col - row >= a.band_lo && col - row <= a.band_hi))
                                  ? x : -INFINITY;
            }
}

struct Block {
    int b, h, q0;
};

// REVERSED: block x takes q tile gridDim.x - 1 - x (banded attention: a causal band's longest tiles start first).
template <bool REVERSED = false>
GTCO_DEVICE Block block_coords(const gtco_attention_args& a, int bq) {
    const int bh = static_cast<int>(blockIdx.y);
    const int x = static_cast<int>(REVERSED ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    return {bh / a.heads, bh % a.heads, x * bq};
}

template <typename T>
GTCO_DEVICE const T* addend_base(const void* p, int b, int h, int bmod, int64_t sb, int64_t sh) {
    return p ? static_cast<const T*>(p) + static_cast<int64_t>(b % bmod) * sb + h * sh : nullptr;
}

// O += P V in TF32 for one key tile (fp32 path). K-step n covers the keys of S n-tile n; its A fragment takes
// key 2*tig as column tig and key 2*tig+1 as column tig+4 (the key order inside a k-step is free), which is
// a0 = c0, a1 = c2, a2 = c1, a3 = c3 of the lane's own S accumulators; b0 / b1 are V rows 2*tig / 2*tig+1 at
// dim column g. vs: the key tile of V ([BKV][D + kRowPad]).
template <int D, int BKV, int MT>
GTCO_DEVICE void pv_tile_tf32(float (&o)[MT][D / 8][4], const float (&p)[MT][BKV / 8][4], const float* vs,
                              int lane) {
    constexpr int RS = D + kRowPad<float>;
    GTCO_UNROLL
    for (int n = 0; n < BKV / 8; ++n) {
        uint32_t pa[MT][4];
        GTCO_UNROLL
        for (int mt = 0; mt < MT; ++mt) {
            pa[mt][0] = tf32_operand(p[mt][n][0]);
            pa[mt][1] = tf32_operand(p[mt][n][2]);
            pa[mt][2] = tf32_operand(p[mt][n][1]);
            pa[mt][3] = tf32_operand(p[mt][n][3]);
        }
        const float* const v = vs + (n * 8 + 2 * (lane % 4)) * RS + lane / 4;
        GTCO_UNROLL
        for (int nd = 0; nd < D / 8; ++nd) {
            const uint32_t b[2] = {tf32_operand(v[nd * 8]), tf32_operand(v[RS + nd * 8])};
            GTCO_UNROLL
            for (int mt = 0; mt < MT; ++mt) mma_m16n8k8_tf32(o[mt][nd], pa[mt], b);
        }
    }
}

// One tile of the online softmax over rows g (r = 0) and g + 8 (r = 1) of each m-tile (a quad holds one row): the
// running max m and this lane's share of the row sum l move on, and alpha is what rescales everything summed
// before this tile (0 on the first tile, where m = -inf). With WRITE_P each score becomes exp2(s - m), the P that
// multiplies V; without it (the two-pass kernel's pass 1) the scores are left as they are.
template <int MT, int NB, bool WRITE_P>
GTCO_DEVICE void online_softmax_step(float (&s)[MT][NB][4], float (&m)[MT][2], float (&l)[MT][2],
                                     float (&alpha)[MT][2]) {
    GTCO_UNROLL
    for (int mt = 0; mt < MT; ++mt)
        GTCO_UNROLL
        for (int r = 0; r < 2; ++r) {
            float mx = -INFINITY;
            GTCO_UNROLL
            for (int n = 0; n < NB; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
            const float m_new = fmaxf(m[mt][r], quad_max(mx));
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // all -inf so far: p = 0, not NaN
#if defined(GTCO_ATTN_TEST_NO_RESCALE)
            alpha[mt][r] = 1.0f;
#else
            alpha[mt][r] = exp2f(m[mt][r] - m_use);
#endif
            m[mt][r] = m_new;
            float sum = 0.0f;
            GTCO_UNROLL
            for (int n = 0; n < NB; ++n)
                GTCO_UNROLL
                for (int c = 0; c < 2; ++c) {
                    const float p = exp2f(s[mt][n][2 * r + c] - m_use);
                    if constexpr (WRITE_P) s[mt][n][2 * r + c] = p;
                    sum += p;
                }
            l[mt][r] = l[mt][r] * alpha[mt][r] + sum;  // this lane's share of the row; quad_sum at the end
        }
}

// ------------------------------------------------------------------------------------------------------------
// attention: FlashAttention-2 style online softmax
// ------------------------------------------------------------------------------------------------------------
template <typename T, int D, int BQ, int BKV, int WARPS, int STAGES, bool K_TRANS, bool MASK, bool BIAS, bool PAD_D,
          bool BAND>
__global__ void __launch_bounds__(WARPS * 32, 1) attention_kernel(const gtco_attention_args a) {
    grid_dep_wait();  // PDL: the grid ahead of this one has finished writing what this one reads (primitives.cuh)
    using S = Shape<T, D, BQ, BKV, WARPS, STAGES, K_TRANS>;
    constexpr int MT = S::MT, NB = S::NB, ND = S::ND, RS = S::RS, kThreads = S::kThreads;
    GTCO_DYNAMIC_SHARED(T, smem, S::kQElems + STAGES * (S::kKElems + S::kVElems));
    T* const qs = smem;
    T* const ks = qs + S::kQElems;
    T* const vs = ks + STAGES * S::kKElems;

    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = static_cast<int>(lane_id());
    const Block blk = block_coords<BAND>(a, BQ);
    const T* const qg = static_cast<const T*>(a.q) + a.q_off + blk.b * a.q_sb + blk.h * a.q_sh;
    const int kvh = blk.h / a.kv_group;  // the key / value head of query head h (GQA: kv_group query heads share it)
    const T* const kg = static_cast<const T*>(a.k) + a.k_off + blk.b * a.k_sb + kvh * a.k_sh;
    const T* const vg = static_cast<const T*>(a.v) + a.v_off + blk.b * a.v_sb + kvh * a.v_sh;
    const T* const mask = MASK ? addend_base<T>(a.mask, blk.b, blk.h, a.m_bmod, a.m_sb, a.m_sh) : nullptr;
    const T* const bias = BIAS ? addend_base<T>(a.bias, blk.b, blk.h, a.bias_bmod, a.bias_sb, a.bias_sh) : nullptr;
    // banded: the keys outside [q0 + band_lo, last row + band_hi] are -inf for every row of the tile, so only the key
    // tiles kt0 .. kt0 + nkt - 1 are walked
    int kt0 = 0, kt1 = (a.seq_k + BKV - 1) / BKV;
    if constexpr (BAND) {
        const int last = (blk.q0 + BQ < a.seq_q ? blk.q0 + BQ : a.seq_q) - 1;  // the tile's last query row
        const int64_t lo = int64_t{blk.q0} + a.band_lo, hi = int64_t{last} + a.band_hi + 1;  // keys [lo, hi)
        kt0 = lo <= 0 ? 0 : static_cast<int>(lo / BKV);
        if (hi < a.seq_k) kt1 = hi <= kt0 * int64_t{BKV} ? kt0 : static_cast<int>((hi + BKV - 1) / BKV);
    }
    const int nkt = kt1 > kt0 ? kt1 - kt0 : 0;
    const float scale_log2 = a.scale * kLog2e;
    const int k_ss = static_cast<int>(a.k_ss), k_sd = static_cast<int>(a.k_sd), v_ss = static_cast<int>(a.v_ss);
    const int dim = PAD_D ? a.head_dim : D;  // the dims a row holds; a padded head's are zero from here to D

    auto load_kv = [&](int tile) {  // the tile-th walked key tile
        const int stage = tile % STAGES, kv0 = (kt0 + tile) * BKV;
        if constexpr (K_TRANS) {
            load_kt_tile<T, D, BKV, kThreads>(ks + stage * S::kKElems, kg, k_ss, k_sd, kv0, a.seq_k, dim, tid);
        } else {
            load_rows<T, BKV, D, kThreads, PAD_D>(ks + stage * S::kKElems, kg, k_ss, kv0, a.seq_k, dim, tid);
        }
        load_rows<T, BKV, D, kThreads, PAD_D>(vs + stage * S::kVElems, vg, v_ss, kv0, a.seq_k, dim, tid);
    };

    // Prologue: Q and key tiles 0 .. STAGES-2, one commit group per tile (Q rides with tile 0).
    load_rows<T, BQ, D, kThreads, PAD_D>(qs, qg, static_cast<int>(a.q_ss), blk.q0, a.seq_q, dim, tid);
    GTCO_UNROLL
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < nkt) load_kv(t);
        cp_async_commit();
    }

    const int wrow = warp * 16 * MT;  // the warp's first row in the tile
    float o[MT][ND][4];
    float m[MT][2], l[MT][2];
    GTCO_UNROLL
    for (int mt = 0; mt < MT; ++mt) {
        GTCO_UNROLL
        for (int n = 0; n < ND; ++n)
            GTCO_UNROLL
            for (int i = 0; i < 4; ++i) o[mt][n][i] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    for (int tile = 0; tile < nkt; ++tile) {
        if (tile + STAGES - 1 < nkt) load_kv(tile + STAGES - 1);  // into the slot freed at the end of tile - 1
        cp_async_commit();                                         // possibly empty: uniform group count
        cp_async_wait<STAGES - 1>();                               // this tile's group has landed
        __syncthreads();
        const T* const kst = ks + (tile % STAGES) * S::kKElems;
        const T* const vst = vs + (tile % STAGES) * S::kVElems;

        float s[MT][NB][4];
        qk_tile<T, D, BKV, MT, K_TRANS>(s, qs + wrow * RS, kst, lane);
        finish_scores<T, MT, NB, MASK, BIAS, BAND>(s, a, mask, bias, blk.q0 + wrow, (kt0 + tile) * BKV, lane,
                                                   scale_log2);

        // Online softmax, then O rescaled by alpha per row.
        float alpha[MT][2];
        online_softmax_step<MT, NB, true>(s, m, l, alpha);
        GTCO_UNROLL
        for (int mt = 0; mt < MT; ++mt)
            GTCO_UNROLL
            for (int r = 0; r < 2; ++r)
                GTCO_UNROLL
                for (int n = 0; n < ND; ++n) {
                    o[mt][n][2 * r] *= alpha[mt][r];
                    o[mt][n][2 * r + 1] *= alpha[mt][r];
                }

        if constexpr (std::is_same<T, float>::value) {
            pv_tile_tf32<D, BKV, MT>(o, s, vst, lane);
        } else {
            // O += P V. The C fragments of n-tiles 2kb, 2kb+1 (keys 16kb..16kb+15) are the A fragment of k-step kb:
            // a0a1 = row g keys 2t.. (n-tile 2kb, c0c1), a2a3 = row g+8 (c2c3), a4..a7 the same of n-tile 2kb+1.
            GTCO_UNROLL
            for (int kb = 0; kb < BKV / 16; ++kb) {
                uint32_t pa[MT][4];
                GTCO_UNROLL
                for (int mt = 0; mt < MT; ++mt) {
                    pa[mt][0] = pack_b16(from_f32<T>(s[mt][2 * kb][0]), from_f32<T>(s[mt][2 * kb][1]));
                    pa[mt][1] = pack_b16(from_f32<T>(s[mt][2 * kb][2]), from_f32<T>(s[mt][2 * kb][3]));
                    pa[mt][2] = pack_b16(from_f32<T>(s[mt][2 * kb + 1][0]), from_f32<T>(s[mt][2 * kb + 1][1]));
                    pa[mt][3] = pack_b16(from_f32<T>(s[mt][2 * kb + 1][2]), from_f32<T>(s[mt][2 * kb + 1][3]));
                }
                GTCO_UNROLL
                for (int nd = 0; nd < D / 16; ++nd) {
                    // V rows are keys (the k of this mma), so .trans: matrices (keys 0-7, dims 0-7), (keys 8-15,
                    // dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 8-15).
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, vst + (kb * 16 + lane % 8 + ((lane / 8) & 1) * 8) * RS + nd * 16 + (lane / 16) * 8);
                    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                    GTCO_UNROLL
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_m16n8k16<T>(o[mt][2 * nd], pa[mt], b0);
                        mma_m16n8k16<T>(o[mt][2 * nd + 1], pa[mt], b1);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this slot before it is refilled
    }
    cp_async_wait<0>();

    // Epilogue: O / l into the warp's own rows of the Q tile (only this warp ever read them), then 16-byte stores.
    const int g = lane / 4, t = lane % 4;
    GTCO_UNROLL
    for (int mt = 0; mt < MT; ++mt)
        GTCO_UNROLL
        for (int r = 0; r < 2; ++r) {
            const float lsum = quad_sum(l[mt][r]);
            const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;  // l = 0: every key -inf, the row is zeros
            T* const row = qs + (wrow + mt * 16 + g + r * 8) * RS;
            GTCO_UNROLL
            for (int n = 0; n < ND; ++n) {
                if constexpr (std::is_same<T, float>::value) {
                    *reinterpret_cast<float2*>(row + n * 8 + 2 * t) =
                        make_float2(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
                } else {
                    *reinterpret_cast<uint32_t*>(row + n * 8 + 2 * t) =
                        pack_b16(from_f32<T>(o[mt][n][2 * r] * inv), from_f32<T>(o[mt][n][2 * r + 1] * inv));
                }
            }
        }
    __syncwarp();
    T* const og = static_cast<T*>(a.out) + blk.b * a.o_sb + blk.h * a.o_sh;
    const int o_ss = static_cast<int>(a.o_ss);
    if constexpr (PAD_D) {  // the head_dim leading columns, element by element (rows need no alignment)
        constexpr int kElems = 16 * MT * D;
        GTCO_ATTN_UNROLL_BY(4)
        for (int i = 0; i < kElems / 32; ++i) {
            const int e = lane + i * 32, r = e / D, col = e % D, row = blk.q0 + wrow + r;
            if (row < a.seq_q && col < dim) og[row * o_ss + col] = qs[(wrow + r) * RS + col];
        }
    } else {
        constexpr int CH = kChunkElems<T>, kChunks = 16 * MT * (D / CH);
        GTCO_UNROLL
        for (int i = 0; i < (kChunks + 31) / 32; ++i) {
            const int c = lane + i * 32;
            const int r = c / (D / CH), col = (c % (D / CH)) * CH, row = blk.q0 + wrow + r;
            if ((kChunks % 32 == 0 || c < kChunks) && row < a.seq_q)
                *reinterpret_cast<Chunk*>(og + (row * o_ss + col)) =
                    *reinterpret_cast<const Chunk*>(qs + (wrow + r) * RS + col);
        }
    }
}

// ------------------------------------------------------------------------------------------------------------
// bmm_softmax: two passes over the key tiles, exact softmax, P written out; any seq_k
// ------------------------------------------------------------------------------------------------------------
// Pass 1 streams the key tiles and keeps only the row statistics: the running row max m and the lane's share of
// the row sum l, rescaled by exp(m_old - m_new) when the max grows (the online softmax without O). Pass 2 streams
// the same tiles again through the same cp.async ring (steps nkt .. 2 nkt - 1), recomputes S and writes
// P = exp(s - m) / l. Only one S tile (MT x BKV / 8 x 4 floats) is live per thread, whatever seq_k is; the price
// is Q Kᵀ computed twice, cheap next to writing P.
template <typename T, int D, int BQ, int BKV, int WARPS, int STAGES, bool K_TRANS, bool MASK, bool BIAS, bool PAD_D,
          bool BAND>
__global__ void __launch_bounds__(WARPS * 32, 1) bmm_softmax_kernel(const gtco_attention_args a) {
    grid_dep_wait();  // PDL: the grid ahead of this one has finished writing what this one reads (primitives.cuh)
    using S = Shape<T, D, BQ, BKV, WARPS, STAGES, K_TRANS>;
    constexpr int MT = S::MT, NB = S::NB, RS = S::RS, kThreads = S::kThreads;
    GTCO_DYNAMIC_SHARED(T, smem, S::kQElems + STAGES * S::kKElems);
    T* const qs = smem;
    T* const ks = qs + S::kQElems;

    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = static_cast<int>(lane_id());
    const Block blk = block_coords(a, BQ);
    const T* const qg = static_cast<const T*>(a.q) + a.q_off + blk.b * a.q_sb + blk.h * a.q_sh;
    const T* const kg = static_cast<const T*>(a.k) + a.k_off + blk.b * a.k_sb + (blk.h / a.kv_group) * a.k_sh;
    const T* const mask = MASK ? addend_base<T>(a.mask, blk.b, blk.h, a.m_bmod, a.m_sb, a.m_sh) : nullptr;
    const T* const bias = BIAS ? addend_base<T>(a.bias, blk.b, blk.h, a.bias_bmod, a.bias_sb, a.bias_sh) : nullptr;
    const float scale_log2 = a.scale * kLog2e;
    const int k_ss = static_cast<int>(a.k_ss), k_sd = static_cast<int>(a.k_sd);
    const int nkt = (a.seq_k + BKV - 1) / BKV, steps = 2 * nkt;  // step i reads key tile i % nkt
    const int dim = PAD_D ? a.head_dim : D;  // the dims a row holds; a padded head's are zero from here to D

    auto load_k = [&](int step) {
        T* const dst = ks + (step % STAGES) * S::kKElems;
        const int kv0 = (step % nkt) * BKV;
        if constexpr (K_TRANS) {
            load_kt_tile<T, D, BKV, kThreads>(dst, kg, k_ss, k_sd, kv0, a.seq_k, dim, tid);
        } else {
            load_rows<T, BKV, D, kThreads, PAD_D>(dst, kg, k_ss, kv0, a.seq_k, dim, tid);
        }
    };
    // Prefetch step + STAGES - 1 into the slot freed at the end of step - 1, wait for this step's tile.
    auto begin_step = [&](int step) -> const T* {
        if (step + STAGES - 1 < steps) load_k(step + STAGES - 1);
        cp_async_commit();  // possibly empty: uniform group count
        cp_async_wait<STAGES - 1>();
        __syncthreads();
        return ks + (step % STAGES) * S::kKElems;
    };

    load_rows<T, BQ, D, kThreads, PAD_D>(qs, qg, static_cast<int>(a.q_ss), blk.q0, a.seq_q, dim, tid);
    GTCO_UNROLL
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < steps) load_k(t);
        cp_async_commit();
    }

    const int wrow = warp * 16 * MT;
    float m[MT][2], l[MT][2];
    GTCO_UNROLL
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    // Pass 1: row max and sum.
    for (int tile = 0; tile < nkt; ++tile) {
        const T* const kst = begin_step(tile);
        float s[MT][NB][4];
        qk_tile<T, D, BKV, MT, K_TRANS>(s, qs + wrow * RS, kst, lane);
        finish_scores<T, MT, NB, MASK, BIAS, BAND>(s, a, mask, bias, blk.q0 + wrow, tile * BKV, lane, scale_log2);
        float alpha[MT][2];
        online_softmax_step<MT, NB, false>(s, m, l, alpha);
        __syncthreads();  // every warp is done with this slot before it is refilled
    }

    // m -> the max to subtract, l -> 1 / row sum (0 when every key is -inf: the row is zeros).
    GTCO_UNROLL
    for (int mt = 0; mt < MT; ++mt)
        GTCO_UNROLL
        for (int r = 0; r < 2; ++r) {
            const float lsum = quad_sum(l[mt][r]);
            m[mt][r] = m[mt][r] == -INFINITY ? 0.0f : m[mt][r];
            l[mt][r] = lsum > 0.0f ? 1.0f / lsum : 0.0f;
        }

    // Pass 2: recompute each S tile and write P.
    const int g = lane / 4, t = lane % 4;
    T* const pg = static_cast<T*>(a.out) + blk.b * a.o_sb + blk.h * a.o_sh;
    const int o_ss = static_cast<int>(a.o_ss), o_sd = static_cast<int>(a.o_sd);
    for (int tile = 0; tile < nkt; ++tile) {
        const T* const kst = begin_step(nkt + tile);
        float s[MT][NB][4];
        qk_tile<T, D, BKV, MT, K_TRANS>(s, qs + wrow * RS, kst, lane);
        finish_scores<T, MT, NB, MASK, BIAS, BAND>(s, a, mask, bias, blk.q0 + wrow, tile * BKV, lane, scale_log2);
        GTCO_UNROLL
        for (int mt = 0; mt < MT; ++mt)
            GTCO_UNROLL
            for (int r = 0; r < 2; ++r) {
                const int row = blk.q0 + wrow + mt * 16 + g + r * 8;
                if (row < a.seq_q) {
                    T* const prow = pg + row * o_ss;
                    GTCO_UNROLL
                    for (int n = 0; n < NB; ++n)
                        GTCO_UNROLL
                        for (int c = 0; c < 2; ++c) {
                            const int col = tile * BKV + n * 8 + 2 * t + c;
                            if (col < a.seq_k)
                                prow[col * o_sd] = from_f32<T>(exp2f(s[mt][n][2 * r + c] - m[mt][r]) * l[mt][r]);
                        }
                }
            }
        __syncthreads();
    }
    cp_async_wait<0>();
}

// ------------------------------------------------------------------------------------------------------------
// Host launchers
// ------------------------------------------------------------------------------------------------------------
template <typename T>
inline bool aligned16(const void* p, int64_t off) {
    return (reinterpret_cast<uintptr_t>(static_cast<const T*>(p) + off) % 16) == 0;
}

// Strides that keep every row 16-byte aligned: multiples of one chunk (8 halves, 4 floats).
template <typename T>
inline bool chunk_strides(int64_t a, int64_t b, int64_t c) {
    constexpr int CH = kChunkElems<T>;
    return a % CH == 0 && b % CH == 0 && c % CH == 0;
}

// The shape checks both families share (and that the node is banded exactly when the instance is); K is checked for
// cp.async only when it is not gathered (K_TRANS), and nothing of a padded head (PAD_D, read element by element) for
// alignment.
template <typename T, int D, bool K_TRANS, bool MASK, bool BIAS, bool PAD_D, bool BAND>
inline bool common_ok(const gtco_attention_args* a) {
    if ((a->banded != 0) != BAND) return false;  // the node's causal / window attributes pick the instance
    if (BAND && a->band_lo > a->band_hi) return false;
    if (PAD_D ? (a->head_dim <= 0 || a->head_dim >= D) : a->head_dim != D) return false;
    if (a->batch <= 0 || a->heads <= 0 || a->seq_q <= 0 || a->seq_k <= 0) return false;
    if (a->kv_group <= 0 || a->heads % a->kv_group != 0) return false;
    if (static_cast<int64_t>(a->batch) * a->heads > 65535) return false;
    // Offsets inside one (batch, head) slice are 32-bit in the kernels.
    const int64_t lim = int64_t{1} << 31, sq = a->seq_q, sk = a->seq_k;
    if ((sq + 1) * a->q_ss >= lim || (sk + 1) * a->k_ss + D * a->k_sd >= lim || (sk + 1) * a->v_ss >= lim ||
        (sq + 1) * a->o_ss + sk * a->o_sd >= lim || sq * a->m_sq + sk * a->m_sk >= lim ||
        sq * a->bias_sq + sk * a->bias_sk >= lim)
        return false;
    if (!K_TRANS && a->k_sd != 1) return false;
    if (!PAD_D && (!aligned16<T>(a->q, a->q_off) || !chunk_strides<T>(a->q_sb, a->q_sh, a->q_ss))) return false;
    if (!PAD_D && !K_TRANS && (!aligned16<T>(a->k, a->k_off) || !chunk_strides<T>(a->k_sb, a->k_sh, a->k_ss)))
        return false;
    if (MASK && (a->mask == nullptr || a->m_bmod <= 0)) return false;
    if (BIAS && (a->bias == nullptr || a->bias_bmod <= 0)) return false;
    return true;
}

template <typename T, int D, int BQ, int BKV, int WARPS, int STAGES, bool K_TRANS>
constexpr int attention_smem_bytes() {
    using S = Shape<T, D, BQ, BKV, WARPS, STAGES, K_TRANS>;
    return static_cast<int>(sizeof(T)) * (S::kQElems + STAGES * (S::kKElems + S::kVElems));
}

template <typename T, int D, int BQ, int BKV, int WARPS, int STAGES, bool K_TRANS>
constexpr int bmm_softmax_smem_bytes() {
    using S = Shape<T, D, BQ, BKV, WARPS, STAGES, K_TRANS>;
    return static_cast<int>(sizeof(T)) * (S::kQElems + STAGES * S::kKElems);
}

}  // namespace attn

template <typename T, int D, int BQ, int BKV, int WARPS, int STAGES, bool K_TRANS, bool MASK, bool BIAS,
          bool PAD_D = false, bool BAND = false>
int attention_launch(const gtco_attention_args* a, void* stream) {
    if (!attn::common_ok<T, D, K_TRANS, MASK, BIAS, PAD_D, BAND>(a)) return GTCO_EBADSHAPE;
    if (a->o_sd != 1) return GTCO_EBADSHAPE;
    if (!PAD_D && (!attn::aligned16<T>(a->v, a->v_off) || !attn::chunk_strides<T>(a->v_sb, a->v_sh, a->v_ss) ||
                   !attn::aligned16<T>(a->out, 0) || !attn::chunk_strides<T>(a->o_sb, a->o_sh, a->o_ss)))
        return GTCO_EBADSHAPE;
    constexpr int smem = attn::attention_smem_bytes<T, D, BQ, BKV, WARPS, STAGES, K_TRANS>();
    const dim3 grid(static_cast<unsigned>((a->seq_q + BQ - 1) / BQ), static_cast<unsigned>(a->batch * a->heads));
    auto kernel = attn::attention_kernel<T, D, BQ, BKV, WARPS, STAGES, K_TRANS, MASK, BIAS, PAD_D, BAND>;
    return GTCO_LAUNCH_SMEM(kernel, grid, dim3(WARPS * 32), smem, stream, *a);
}

template <typename T, int D, int BQ, int BKV, int WARPS, int STAGES, bool K_TRANS, bool MASK, bool BIAS,
          bool PAD_D = false, bool BAND = false>
int bmm_softmax_launch(const gtco_attention_args* a, void* stream) {
    if (!attn::common_ok<T, D, K_TRANS, MASK, BIAS, PAD_D, BAND>(a)) return GTCO_EBADSHAPE;
    constexpr int smem = attn::bmm_softmax_smem_bytes<T, D, BQ, BKV, WARPS, STAGES, K_TRANS>();
    const dim3 grid(static_cast<unsigned>((a->seq_q + BQ - 1) / BQ), static_cast<unsigned>(a->batch * a->heads));
    auto kernel = attn::bmm_softmax_kernel<T, D, BQ, BKV, WARPS, STAGES, K_TRANS, MASK, BIAS, PAD_D, BAND>;
    return GTCO_LAUNCH_SMEM(kernel, grid, dim3(WARPS * 32), smem, stream, *a);
}

}  // namespace gtco
