// CPU emulation of the CUDA surface that gtco kernels use, so kernel numerics can be checked without a GPU.
//
// Compile a kernel source with `g++ -std=c++17 -pthread -DGTCO_EMULATE -x c++ kernel.cu`. Each block's threads
// run as real std::threads; __syncthreads is a reusable barrier; warp collectives (mma, ldmatrix, shuffles)
// exchange registers through a per-warp buffer. The fragment layouts follow the PTX ISA text (sections named at
// each function). README.md in this folder says what this can and cannot catch.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../include/gtco/half_bits.h"  // the fp16 / bf16 conversions (shared with plugins/cpu)

// ---------------------------------------------------------------------------------------------------------------
// CUDA keywords and built-in variables
// ---------------------------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// A plain `__shared__` declaration would be per-thread here; kernels declare shared memory with GTCO_SHARED.
#define __shared__ GTCO_EMU_ERROR_declare_shared_memory_with_GTCO_SHARED
#define GTCO_DEVICE inline
#define GTCO_UNROLL
#define GTCO_SHARED(type, name, count) type* const name = ::gtco::emu::shared_alloc<type>(count)
// Dynamic shared memory: `count` elements the launch provides (GTCO_LAUNCH_SMEM); carved from the same arena here.
#define GTCO_DYNAMIC_SHARED(type, name, count) type* const name = ::gtco::emu::shared_alloc<type>(count)

struct uint3 {
    unsigned x, y, z;
};

struct alignas(8) float2 {  // CUDA's 8-byte vector type (an fp32 pair in one access)
    float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------------------------
// __half and __nv_bfloat16 stand-ins: bit-exact storage, round-to-nearest-even conversions from float
// ---------------------------------------------------------------------------------------------------------------
namespace gtco::emu {
using bits::bf16_bits_to_f32;
using bits::bits_f32;
using bits::f16_bits_to_f32;
using bits::f32_bits;
using bits::f32_to_bf16_bits;
using bits::f32_to_f16_bits;
}  // namespace gtco::emu

struct __half {
    uint16_t __x;
    __half() = default;
    __half(float f) : __x(gtco::emu::f32_to_f16_bits(f)) {}  // NOLINT: implicit, as in cuda_fp16.h
    operator float() const { return gtco::emu::f16_bits_to_f32(__x); }
};

struct __nv_bfloat16 {
    uint16_t __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(gtco::emu::f32_to_bf16_bits(f)) {}  // NOLINT: implicit, as in cuda_bf16.h
    operator float() const { return gtco::emu::bf16_bits_to_f32(__x); }
};

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) {
    __half h;
    h.__x = u;
    return h;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return static_cast<float>(b); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 b;
    b.__x = u;
    return b;
}

inline float __uint_as_float(unsigned u) { return gtco::emu::bits_f32(u); }
inline unsigned __float_as_uint(float f) { return gtco::emu::f32_bits(f); }

// ---------------------------------------------------------------------------------------------------------------
// Runtime: per-thread context, barriers, block-local shared memory, launch
// ---------------------------------------------------------------------------------------------------------------
namespace gtco::emu {

#ifndef GTCO_EMU_SMEM_BYTES
#define GTCO_EMU_SMEM_BYTES (227 * 1024)  // the sm_90 per-block opt-in maximum
#endif
#ifndef GTCO_EMU_TIMEOUT_S
#define GTCO_EMU_TIMEOUT_S 60  // a barrier that waits longer than this is reported as a deadlock
#endif

struct ThreadCtx;
inline thread_local ThreadCtx* t_ctx = nullptr;

[[noreturn]] inline void fail(const char* what);

// A reusable barrier. drop() removes an exited thread from the count, as the hardware does for exited warps.
class Barrier {
public:
    void reset(int n) {
        expected_ = n;
        arrived_ = 0;
        dropped_ = 0;
        released_dropped_ = 0;
    }
    // Returns how many threads had exited (dropped) when this barrier generation was released.
    int wait(const char* what) {
        std::unique_lock<std::mutex> lk(m_);
        const uint64_t gen = gen_;
        if (++arrived_ == expected_) {
            release();
            return released_dropped_;
        }
        if (!cv_.wait_for(lk, std::chrono::seconds(GTCO_EMU_TIMEOUT_S), [&] { return gen_ != gen; })) {
            lk.unlock();
            fail(what);
        }
        return released_dropped_;  // no later generation can be released before this thread arrives again
    }
    void drop() {
        std::lock_guard<std::mutex> lk(m_);
        --expected_;
        ++dropped_;
        if (arrived_ > 0 && arrived_ == expected_) release();
    }

private:
    void release() {
        released_dropped_ = dropped_;
        arrived_ = 0;
        ++gen_;
        cv_.notify_all();
    }
    std::mutex m_;
    std::condition_variable cv_;
    int expected_ = 0, arrived_ = 0, dropped_ = 0, released_dropped_ = 0;
    uint64_t gen_ = 0;
};

constexpr int kSlotWords = 12;  // per lane: mma needs 4 + 2 + 4 words, then one word for the op tag

struct Warp {
    Barrier bar;
    int lanes = 32;                          // threads of the block that fall in this warp
    uint32_t slot[2][32][kSlotWords] = {};  // double-buffered: one barrier per collective is enough
};

struct Block {
    Barrier bar;
    std::vector<Warp> warps;
    unsigned char* smem = nullptr;  // 128-byte aligned arena, poisoned with 0xff (NaN) before every block
};

struct CpAsyncCopy {
    void* dst;
    const void* src;
    int bytes;      // bytes read from src
    int fill;       // total bytes written to dst (the rest of fill is zeros)
};

struct ThreadCtx {
    Block* block = nullptr;
    Warp* warp = nullptr;
    int tid = 0, lane = 0, phase = 0;
    size_t smem_offset = 0;
    std::vector<CpAsyncCopy> cp_open;                  // issued since the last commit_group
    std::vector<std::vector<CpAsyncCopy>> cp_groups;  // committed, oldest first
};

inline ThreadCtx& ctx() {
    if (t_ctx == nullptr) {
        std::fprintf(stderr, "gtco-emu: error: a device primitive was called outside gtco::emu::launch\n");
        std::_Exit(3);
    }
    return *t_ctx;
}

inline std::atomic<bool> g_failed{false};

[[noreturn]] inline void fail(const char* what) {
    if (g_failed.exchange(true))  // one report per process: the first failing thread prints and exits
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::fprintf(stderr, "gtco-emu: error: %s (block (%u,%u,%u), thread (%u,%u,%u))\n", what, blockIdx.x, blockIdx.y,
                 blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    std::fflush(stderr);
    std::_Exit(3);
}

inline bool in_shared(const void* p, size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(p);
    const unsigned char* base = ctx().block->smem;
    return c >= base && c + bytes <= base + GTCO_EMU_SMEM_BYTES;
}

inline void check_shared(const void* p, size_t bytes, size_t align, const char* what) {
    if (!in_shared(p, bytes)) fail(what);
    if (reinterpret_cast<uintptr_t>(p) % align != 0) fail(what);
}

// Every thread of the block runs the same GTCO_SHARED declarations in the same order, so a per-thread bump
// offset gives all of them the same address.
inline void finish_thread(ThreadCtx& t);

template <typename T>
T* shared_alloc(size_t count) {
    ThreadCtx& t = ctx();
    const size_t align = alignof(T) > 16 ? alignof(T) : 16;
    t.smem_offset = (t.smem_offset + align - 1) / align * align;
    T* p = reinterpret_cast<T*>(t.block->smem + t.smem_offset);
    t.smem_offset += sizeof(T) * count;
    if (t.smem_offset > GTCO_EMU_SMEM_BYTES) fail("GTCO_SHARED: shared memory exceeds GTCO_EMU_SMEM_BYTES");
    return p;
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) {
    static_assert(sizeof...(P) == sizeof...(A), "launch: argument count differs from the kernel's parameters");
    const std::tuple<std::decay_t<P>...> params(static_cast<std::decay_t<P>>(std::forward<A>(args))...);
    const int nthreads = static_cast<int>(block.x * block.y * block.z);
    if (nthreads <= 0 || nthreads > 1024) {
        std::fprintf(stderr, "gtco-emu: error: launch with %d threads per block (1..1024)\n", nthreads);
        std::_Exit(3);
    }
    const int nwarps = (nthreads + 31) / 32;
    Block blk;
    blk.warps = std::vector<Warp>(static_cast<size_t>(nwarps));
    std::vector<unsigned char> arena(GTCO_EMU_SMEM_BYTES + 128);
    blk.smem = arena.data() + (128 - reinterpret_cast<uintptr_t>(arena.data()) % 128) % 128;
    Barrier phase;  // separates blocks: every thread finished block b before block b+1 starts
    phase.reset(nthreads);
    auto prepare = [&] {
        blk.bar.reset(nthreads);
        for (int w = 0; w < nwarps; ++w) {
            blk.warps[w].lanes = (w + 1) * 32 <= nthreads ? 32 : nthreads - w * 32;
            blk.warps[w].bar.reset(blk.warps[w].lanes);
        }
        std::memset(blk.smem, 0xff, GTCO_EMU_SMEM_BYTES);
    };
    prepare();
    auto body = [&](int tid) {
        ThreadCtx t;
        t.block = &blk;
        t.tid = tid;
        t.warp = &blk.warps[tid / 32];
        t.lane = tid % 32;
        t_ctx = &t;
        threadIdx = uint3{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
        blockDim = block;
        gridDim = grid;
        for (unsigned bz = 0; bz < grid.z; ++bz)
            for (unsigned by = 0; by < grid.y; ++by)
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    blockIdx = uint3{bx, by, bz};
                    t.smem_offset = 0;
                    t.phase = 0;
                    phase.wait("deadlock before a block started");
                    std::apply(kernel, params);
                    finish_thread(t);
                    phase.wait("deadlock at the end of a block");
                    if (tid == 0) prepare();
                }
        t_ctx = nullptr;
    };
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(nthreads - 1));
    for (int tid = 1; tid < nthreads; ++tid) pool.emplace_back(body, tid);
    body(0);
    for (auto& th : pool) th.join();
}

// ---------------------------------------------------------------------------------------------------------------
// cp.async: copies are deferred until the cp.async.wait_group that must complete them, so a kernel that reads
// shared memory before waiting sees the poison (NaN), not the data. Define GTCO_EMU_SYNC_CP_ASYNC to copy at issue.
// ---------------------------------------------------------------------------------------------------------------
inline void do_copy(const CpAsyncCopy& c) {
    if (c.bytes > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
    if (c.fill > c.bytes) std::memset(static_cast<char*>(c.dst) + c.bytes, 0, static_cast<size_t>(c.fill - c.bytes));
}

inline void finish_thread(ThreadCtx& t) {
    for (auto& g : t.cp_groups)
        for (auto& c : g) do_copy(c);
    for (auto& c : t.cp_open) do_copy(c);
    t.cp_groups.clear();
    t.cp_open.clear();
    t.block->bar.drop();
    t.warp->bar.drop();
}

inline void cp_async_issue(void* dst, const void* src, int src_bytes, int bytes) {
    check_shared(dst, static_cast<size_t>(bytes), 16, "cp.async: destination is not 16-byte aligned shared memory");
    if (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % 16 != 0) fail("cp.async: source is not 16-byte aligned");
    const CpAsyncCopy c{dst, src, src_bytes, bytes};
#ifdef GTCO_EMU_SYNC_CP_ASYNC
    do_copy(c);
#else
    ctx().cp_open.push_back(c);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Warp collectives
// ---------------------------------------------------------------------------------------------------------------
enum Op : uint32_t { kShfl = 1, kLdsm, kMma, kSync };

// Deposit this lane's words, wait for the whole warp, and return the 32 lanes' slots to read from.
inline const uint32_t (*exchange(Op op, const uint32_t* words, int n))[kSlotWords] {
    ThreadCtx& t = ctx();
    Warp& w = *t.warp;
    if (w.lanes != 32) fail("warp collective in a warp with fewer than 32 threads (blockDim not a multiple of 32)");
    uint32_t(*buf)[kSlotWords] = w.slot[t.phase];
    t.phase ^= 1;
    for (int i = 0; i < n; ++i) buf[t.lane][i] = words[i];
    buf[t.lane][kSlotWords - 1] = op;
    if (w.bar.wait("deadlock in a warp collective (did every lane of the warp reach it?)") != 0)
        fail("warp collective after some lanes of the warp exited");
    for (int l = 0; l < 32; ++l)
        if (buf[l][kSlotWords - 1] != op) fail("lanes of one warp are in different warp collectives");
    return buf;
}

inline int lane_id() { return ctx().lane; }

template <typename T>
T shfl_xor(T v, int lane_mask) {
    static_assert(sizeof(T) == 4, "emulated shuffles move 4-byte values");
    uint32_t word;
    std::memcpy(&word, &v, 4);
    const auto* buf = exchange(kShfl, &word, 1);
    const int src = (ctx().lane ^ lane_mask) & 31;
    T out;
    std::memcpy(&out, &buf[src][0], 4);
    return out;
}

template <typename T>
T shfl_idx(T v, int src_lane) {
    static_assert(sizeof(T) == 4, "emulated shuffles move 4-byte values");
    uint32_t word;
    std::memcpy(&word, &v, 4);
    const auto* buf = exchange(kShfl, &word, 1);
    T out;
    std::memcpy(&out, &buf[src_lane & 31][0], 4);
    return out;
}

// PTX ISA, "Warp-level matrix load instruction: ldmatrix" (.m8n8, .b16): lanes 8j..8j+7 give the addresses of
// rows 0..7 of matrix j. Lane l receives, in register j, row l/4 and columns 2*(l%4), 2*(l%4)+1 of matrix j (the
// lower column in the low 16 bits); with .trans it receives rows 2*(l%4), 2*(l%4)+1 of column l/4 instead.
template <int NUM, bool TRANS>
void ldmatrix(uint32_t* r, const void* row_addr) {
    const auto a = reinterpret_cast<uintptr_t>(row_addr);
    const uint32_t words[2] = {static_cast<uint32_t>(a), static_cast<uint32_t>(static_cast<uint64_t>(a) >> 32)};
    const auto* buf = exchange(kLdsm, words, 2);
    const int lane = ctx().lane;
    auto row = [&](int src) {
        const uintptr_t p = static_cast<uintptr_t>(buf[src][0]) | (static_cast<uintptr_t>(buf[src][1]) << 32);
        const auto* q = reinterpret_cast<const uint16_t*>(p);
        check_shared(q, 16, 16, "ldmatrix: a row address is not 16-byte aligned shared memory");
        return q;
    };
    for (int j = 0; j < NUM; ++j) {
        uint16_t e[2];
        for (int h = 0; h < 2; ++h)
            e[h] = TRANS ? row(8 * j + 2 * (lane % 4) + h)[lane / 4] : row(8 * j + lane / 4)[2 * (lane % 4) + h];
        r[j] = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
    }
}

// PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (.f16/.bf16 A and B, .f32 C/D).
// groupID = lane >> 2, threadID_in_group = lane % 4; element i of a fragment sits in register i/2, low half first.
struct Coord {
    int row, col;
};
inline Coord a_coord(int lane, int i) {  // a0..a7 of the 16x16 A
    const int g = lane >> 2, t = lane % 4;
    return {g + ((i >= 2 && i < 4) || i >= 6 ? 8 : 0), t * 2 + (i & 1) + (i >= 4 ? 8 : 0)};
}
inline Coord b_coord(int lane, int i) {  // b0..b3 of the 16x8 B (row = k, col = n)
    const int g = lane >> 2, t = lane % 4;
    return {t * 2 + (i & 1) + (i >= 2 ? 8 : 0), g};
}
inline Coord c_coord(int lane, int i) {  // c0..c3 of the 16x8 C/D
    const int g = lane >> 2, t = lane % 4;
    return {g + (i >= 2 ? 8 : 0), t * 2 + (i & 1)};
}

// The warp's operands of one mma, exchanged so that every lane sees all of them: per lane a0..a3, b0, b1, then the
// bits of c0..c3 (the register counts of m16n8k16 with 16-bit inputs and of m16n8k8 with tf32 alike).
inline const uint32_t (*mma_exchange(const uint32_t* a, const uint32_t* b, const float* c))[kSlotWords] {
    uint32_t words[10];
    for (int i = 0; i < 4; ++i) words[i] = a[i];
    words[4] = b[0];
    words[5] = b[1];
    for (int i = 0; i < 4; ++i) words[6 + i] = f32_bits(c[i]);
    return exchange(kMma, words, 10);
}

// This lane's four D = A * B + C elements from the warp's whole A (16 x K) and B (K x 8): fp32 products summed in
// fp32, k ascending, then this lane's C (from mma_exchange's `buf`) added.
template <int K>
void mma_lane_result(float* d, const float (&A)[16][K], const float (&B)[K][8], const uint32_t (*buf)[kSlotWords]) {
    const int lane = ctx().lane;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const Coord p = c_coord(lane, i);
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) acc += A[p.row][k] * B[k][p.col];
        out[i] = acc + bits_f32(buf[lane][6 + i]);
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// D = A * B + C with 16-bit inputs and fp32 products summed in fp32, k ascending (the hardware's internal order
// and alignment differ: compare against a reference with a tolerance, not bit for bit).
template <bool BF16>
void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    const auto* buf = mma_exchange(a, b, c);
    auto elem = [](uint32_t reg, int i) {
        const auto h = static_cast<uint16_t>(i & 1 ? reg >> 16 : reg & 0xffffu);
        return BF16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
    };
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 8; ++i) {
            const Coord p = a_coord(l, i);
            A[p.row][p.col] = elem(buf[l][i / 2], i);
        }
        for (int i = 0; i < 4; ++i) {
            const Coord p = b_coord(l, i);
            B[p.row][p.col] = elem(buf[l][4 + i / 2], i);
        }
    }
    mma_lane_result(d, A, B, buf);
}

// cvt.rna.tf32.f32 (PTX ISA, "cvt"): fp32 rounded to 10 mantissa bits, to nearest with ties away from zero (add
// half an ulp of tf32 to the magnitude, truncate); the 13 low bits of the result are zero. A carry into the
// exponent is the correct rounding (up to infinity past the largest tf32). Infinities stay; NaN is canonical.
inline uint32_t round_tf32(uint32_t u) {
    if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? 0x7fffffffu : u;
    return (u + 0x1000u) & 0xffffe000u;
}

// PTX ISA, "Matrix Fragments for mma.m16n8k8" (.tf32 A and B, one element per register; .f32 C/D as m16n8k16).
inline Coord a_coord_tf32(int lane, int i) {  // a0..a3 of the 16x8 A
    return {(lane >> 2) + (i & 1) * 8, lane % 4 + (i >> 1) * 4};
}
inline Coord b_coord_tf32(int lane, int i) {  // b0, b1 of the 8x8 B (row = k, col = n)
    return {lane % 4 + i * 4, lane >> 2};
}

// D = A * B + C with tf32 A and B. The Tensor Core reads the 19 high bits of each operand register (sign, exponent,
// 10 mantissa bits): the low 13 bits are dropped here, so a kernel that skips the cvt.rna rounding computes with
// truncated operands, as the hardware would. Products of two tf32 values are exact in fp32; they are summed in
// fp32, k ascending, then C is added (the hardware's order differs: compare with a tolerance).
inline void mma_m16n8k8_tf32(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    const auto* buf = mma_exchange(a, b, c);
    auto elem = [](uint32_t reg) { return bits_f32(reg & 0xffffe000u); };
    float A[16][8], B[8][8];
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 4; ++i) {
            const Coord p = a_coord_tf32(l, i);
            A[p.row][p.col] = elem(buf[l][i]);
        }
        for (int i = 0; i < 2; ++i) {
            const Coord p = b_coord_tf32(l, i);
            B[p.row][p.col] = elem(buf[l][4 + i]);
        }
    }
    mma_lane_result(d, A, B, buf);
}

}  // namespace gtco::emu

inline void __syncthreads() { gtco::emu::ctx().block->bar.wait("deadlock in __syncthreads (did every thread reach it?)"); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) gtco::emu::fail("__syncwarp: the emulation supports only the full-warp mask");
    gtco::emu::exchange(gtco::emu::kSync, nullptr, 0);
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    if (mask != 0xffffffffu || width != 32) gtco::emu::fail("__shfl_xor_sync: only mask 0xffffffff, width 32");
    return gtco::emu::shfl_xor(v, lane_mask);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    if (mask != 0xffffffffu || width != 32) gtco::emu::fail("__shfl_sync: only mask 0xffffffff, width 32");
    return gtco::emu::shfl_idx(v, src_lane);
}

// ---------------------------------------------------------------------------------------------------------------
// The gtco primitives (same names and signatures as the PTX versions in plugins/include/gtco/primitives.cuh)
// ---------------------------------------------------------------------------------------------------------------
namespace gtco {

inline unsigned lane_id() { return static_cast<unsigned>(emu::lane_id()); }

inline void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    emu::mma_m16n8k16<false>(d, a, b, c);
}
inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    emu::mma_m16n8k16<true>(d, a, b, c);
}

inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    emu::mma_m16n8k8_tf32(d, a, b, c);
}
inline uint32_t round_tf32(uint32_t f32_bits) { return emu::round_tf32(f32_bits); }

inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) { emu::ldmatrix<4, false>(r, smem_row); }
inline void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) { emu::ldmatrix<2, false>(r, smem_row); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) { emu::ldmatrix<4, true>(r, smem_row); }
inline void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) { emu::ldmatrix<2, true>(r, smem_row); }

inline void cp_async_16(void* smem_dst, const void* gmem_src) { emu::cp_async_issue(smem_dst, gmem_src, 16, 16); }
inline void cp_async_16(void* smem_dst, const void* gmem_src, bool pred) {
    emu::cp_async_issue(smem_dst, gmem_src, pred ? 16 : 0, 16);
}
inline void cp_async_commit() {
    emu::ThreadCtx& t = emu::ctx();
    t.cp_groups.push_back(std::move(t.cp_open));
    t.cp_open.clear();
}
template <int N>
inline void cp_async_wait() {
    emu::ThreadCtx& t = emu::ctx();
    while (t.cp_groups.size() > static_cast<size_t>(N)) {
        for (auto& c : t.cp_groups.front()) emu::do_copy(c);
        t.cp_groups.erase(t.cp_groups.begin());
    }
}

}  // namespace gtco
