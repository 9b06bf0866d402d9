// CPU emulation of the CUDA surface that gtco kernels use, so kernel numerics can be checked without a GPU.
//
// Compile a kernel source with `g++ -std=c++17 -pthread -DGTCO_EMULATE -x c++ kernel.cu`. Each block's threads
// run as fibers, one at a time; __syncthreads is a reusable barrier; warp collectives (mma, ldmatrix, shuffles)
// exchange registers through a per-warp buffer. The fragment layouts follow the PTX ISA text (sections named at
// each function). README.md in this folder says what this can and cannot catch.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include "../include/gtco/half_bits.h"  // the fp16 / bf16 conversions (shared with plugins/cpu)
#include "../include/gtco/pdl.h"        // gtco::pdl_launch: the launch is a programmatic dependent one

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
// A global-memory access by a helper that both builds share (elementwise/elementwise.cuh): for the PDL check.
#define GTCO_EMU_NOTE_GLOBAL(p, what) ::gtco::emu::note_global((p), (what))

struct uint3 {
    unsigned x, y, z;
};

struct alignas(8) float2 {  // CUDA's 8-byte vector type (an fp32 pair in one access)
    float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct alignas(16) float4 {  // CUDA's 16-byte vector types (one 16-byte access)
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

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
// Runtime: the block's threads as fibers, barriers, block-local shared memory, launch
//
// A launch runs the block's threads as fibers (user-space contexts, each on a stack of its own) on the calling OS
// thread, one at a time: a thread runs until it waits at a barrier (__syncthreads, a warp collective, the end of a
// block), then the next runnable thread runs. A cooperative switch costs tens of nanoseconds where waking an OS
// thread costs microseconds, and every warp collective takes 32 of them: this is what decides how large a model
// the emulation can run. A wait that no runnable thread can release is a deadlock, and is reported at once.
// ---------------------------------------------------------------------------------------------------------------
namespace gtco::emu {

#ifndef GTCO_EMU_SMEM_BYTES
#define GTCO_EMU_SMEM_BYTES (227 * 1024)  // the sm_90 per-block opt-in maximum
#endif
#ifndef GTCO_EMU_STACK_BYTES
#define GTCO_EMU_STACK_BYTES (256 * 1024)  // per emulated thread, above a guard page
#endif

// A fiber is first entered with makecontext/setcontext (or swapcontext). Later switches save with _setjmp and
// resume with _longjmp, which, unlike swapcontext, make no system call for the signal mask. Under _FORTIFY_SOURCE
// (whose longjmp check refuses a jump to another stack) and AddressSanitizer (which follows stack switches through
// swapcontext) every switch is a swapcontext instead: slower, equally correct.
#if (defined(_FORTIFY_SOURCE) && _FORTIFY_SOURCE > 0) || defined(__SANITIZE_ADDRESS__)
#define GTCO_EMU_SWAPCONTEXT 1
#else
#define GTCO_EMU_SWAPCONTEXT 0
#endif

struct ThreadCtx;
struct Scheduler;
inline thread_local ThreadCtx* t_ctx = nullptr;
inline thread_local Scheduler* t_sched = nullptr;

[[noreturn]] inline void fail(const char* what);

// A reusable barrier over the block's fibers. drop() removes an exited thread from the count, as the hardware does
// for exited warps. A waiting thread is parked until the last arrival of its generation releases it.
class Barrier {
public:
    void reset(int n) {
        expected_ = n;
        arrived_ = 0;
        dropped_ = 0;
        released_dropped_ = 0;
        waiters_.clear();
    }
    // Returns how many threads had exited (dropped) when this barrier generation was released.
    inline int wait(const char* what);
    inline void drop();

private:
    inline void release();
    int expected_ = 0, arrived_ = 0, dropped_ = 0, released_dropped_ = 0;
    std::vector<int> waiters_;  // the parked fibers of this generation, in arrival order
};

constexpr int kSlotWords = 12;  // per lane: mma needs 4 + 2 + 4 words, then one word for the op tag

struct Warp {
    Barrier bar;
    int lanes = 32;                          // threads of the block that fall in this warp
    uint32_t slot[2][32][kSlotWords] = {};  // double-buffered: one barrier per collective is enough
    uint64_t mma_seq[2] = {0, 0};            // the collective (ThreadCtx::seq) whose D mma_d[buffer] holds
    float mma_d[2][16][8] = {};              // an mma's D, computed once by the first lane of the warp to read it
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
    uint64_t seq = 0;  // warp collectives entered in this block (the same count on every lane of a warp)
    bool dep_waited = false;  // called grid_dep_wait() in this block
    size_t smem_offset = 0;
    std::vector<CpAsyncCopy> cp_open;                  // issued since the last commit_group
    std::vector<std::vector<CpAsyncCopy>> cp_groups;  // committed, oldest first
};

struct Fiber {
    ucontext_t uc{};
#if !GTCO_EMU_SWAPCONTEXT
    jmp_buf jb{};
#endif
    void* stack = nullptr;  // GTCO_EMU_STACK_BYTES above a guard page (StackPool)
    bool started = false;
    ThreadCtx t;
    uint3 thread_idx{0, 0, 0}, block_idx{0, 0, 0};
};

// One launch: its fibers, the queue of runnable ones, and the launching code's context to return to.
struct Scheduler {
    std::vector<Fiber> fibers;
    std::deque<int> ready;
    int current = -1;
    int live = 0;  // fibers not finished
    ucontext_t host{};
    std::function<void(int)> run;  // a fiber's whole life: every block of the grid, for one thread index
    bool pdl_check = false;        // a global access before grid_dep_wait() fails (pdl_check_enabled)
};

// Fiber stacks, kept for the next launch on this OS thread (a launch per kernel call adds up to many).
class StackPool {
public:
    static constexpr size_t kGuard = 4096;
    void* take() {
        if (!free_.empty()) {
            void* s = free_.back();
            free_.pop_back();
            return s;
        }
        void* m = mmap(nullptr, kGuard + GTCO_EMU_STACK_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED || mprotect(m, kGuard, PROT_NONE) != 0) {
            std::fprintf(stderr, "gtco-emu: error: cannot map a thread's stack\n");
            std::_Exit(3);
        }
        return static_cast<char*>(m) + kGuard;
    }
    void give(void* s) { free_.push_back(s); }
    ~StackPool() {
        for (void* s : free_) munmap(static_cast<char*>(s) - kGuard, kGuard + GTCO_EMU_STACK_BYTES);
    }

private:
    std::vector<void*> free_;
};
inline thread_local StackPool t_stacks;

inline ThreadCtx& ctx() {
    if (t_ctx == nullptr) {
        std::fprintf(stderr, "gtco-emu: error: a device primitive was called outside gtco::emu::launch\n");
        std::_Exit(3);
    }
    return *t_ctx;
}

inline std::atomic<bool> g_failed{false};

[[noreturn]] inline void fail(const char* what) {
    if (g_failed.exchange(true))  // one report per process: launches on other OS threads may fail at once too
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::fprintf(stderr, "gtco-emu: error: %s (block (%u,%u,%u), thread (%u,%u,%u))\n", what, blockIdx.x, blockIdx.y,
                 blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    std::fflush(stderr);
    std::_Exit(3);
}

// The CUDA built-ins belong to the OS thread: the fiber about to run gets its own.
inline void enter(Scheduler& s, int next) {
    Fiber& f = s.fibers[static_cast<size_t>(next)];
    s.current = next;
    t_ctx = &f.t;
    threadIdx = f.thread_idx;
    blockIdx = f.block_idx;
}

inline void switch_away(Scheduler& s, const char* deadlock);

inline void fiber_main(int lo, int hi) {
    auto& s = *reinterpret_cast<Scheduler*>(static_cast<uintptr_t>(static_cast<unsigned>(lo)) |
                                            (static_cast<uintptr_t>(static_cast<unsigned>(hi)) << 32));
    s.run(s.current);
    --s.live;
    switch_away(s, "deadlock: a thread finished while the others wait at a barrier it cannot reach");
}

inline void make_fiber(Scheduler& s, Fiber& f) {
    f.started = true;
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = GTCO_EMU_STACK_BYTES;
    f.uc.uc_link = nullptr;
    const auto p = reinterpret_cast<uintptr_t>(&s);
    makecontext(&f.uc, reinterpret_cast<void (*)()>(fiber_main), 2, static_cast<int>(p & 0xffffffffu),
                static_cast<int>(p >> 32));
}

// Leave the running fiber (parked at a barrier, or finished) for the next runnable one; when every fiber has
// finished, return to the launching code. Returns when the fiber is resumed.
inline void switch_away(Scheduler& s, const char* deadlock) {
    if (s.ready.empty()) {
        if (s.live > 0) fail(deadlock);  // every live thread waits, and none of them can release the others
        setcontext(&s.host);
    }
    const int next = s.ready.front();
    s.ready.pop_front();
    Fiber& cur = s.fibers[static_cast<size_t>(s.current)];
    cur.block_idx = blockIdx;
    if (next == s.current) return;  // released by itself (drop): runs on
    Fiber& to = s.fibers[static_cast<size_t>(next)];
    const bool fresh = !to.started;
    if (fresh) make_fiber(s, to);
#if GTCO_EMU_SWAPCONTEXT
    enter(s, next);
    swapcontext(&cur.uc, &to.uc);
#else
    if (_setjmp(cur.jb) == 0) {
        enter(s, next);
        if (fresh) setcontext(&to.uc);
        _longjmp(to.jb, 1);
    }
#endif
}

inline int Barrier::wait(const char* what) {
    if (++arrived_ == expected_) {
        release();
        return released_dropped_;
    }
    Scheduler& s = *t_sched;
    waiters_.push_back(s.current);
    switch_away(s, what);      // resumed by release()
    return released_dropped_;  // no later generation can be released before this thread arrives again
}

inline void Barrier::drop() {
    --expected_;
    ++dropped_;
    if (arrived_ > 0 && arrived_ == expected_) release();
}

inline void Barrier::release() {
    released_dropped_ = dropped_;
    arrived_ = 0;
    Scheduler& s = *t_sched;
    for (int w : waiters_) s.ready.push_back(w);
    waiters_.clear();
}

// Every thread of the block runs the same GTCO_SHARED declarations in the same order, so a per-thread bump
// offset gives all of them the same address.
inline void finish_thread(ThreadCtx& t);

// The PDL check. Launches run one after another here, so griddepcontrol.wait is always satisfied; what can be
// checked is the order a kernel keeps: with the check on, a thread of a launched kernel that reads or writes global
// memory through an emulated primitive (cp.async, ld_cg / st_cg, atomic_add_u32, the vector loads and stores of
// elementwise/elementwise.cuh: GTCO_EMU_NOTE_GLOBAL) before it called grid_dep_wait() in its block fails. On: every launch
// while set_pdl_check(true) or the environment variable GTCO_EMU_PDL_CHECK=1 (read once), as if each were a PDL
// launch, and any launch inside a gtco::PdlScope(true). Plain pointer dereferences are not seen: the source test
// (tests/kernels/test_pdl.py) checks that the wait is each kernel's first statement.
inline bool& pdl_check_flag() {
    static bool on = [] {
        const char* e = std::getenv("GTCO_EMU_PDL_CHECK");
        return e != nullptr && *e != '\0' && std::strcmp(e, "0") != 0;
    }();
    return on;
}
inline void set_pdl_check(bool on) { pdl_check_flag() = on; }

inline bool in_shared(const void* p, size_t bytes);

inline void note_global(const void* p, const char* what) {
    if (t_ctx == nullptr || t_sched == nullptr || !t_sched->pdl_check || t_ctx->dep_waited) return;
    if (in_shared(p, 1)) return;  // the same helpers also move shared memory
    fail(what);
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
    if (t_sched != nullptr) {
        std::fprintf(stderr, "gtco-emu: error: a launch from inside a kernel (dynamic parallelism is not emulated)\n");
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
            Warp& wp = blk.warps[static_cast<size_t>(w)];
            wp.lanes = (w + 1) * 32 <= nthreads ? 32 : nthreads - w * 32;
            wp.bar.reset(wp.lanes);
            wp.mma_seq[0] = wp.mma_seq[1] = 0;  // a block's collectives count from 1
        }
        std::memset(blk.smem, 0xff, GTCO_EMU_SMEM_BYTES);
    };
    prepare();
    Scheduler s;
    s.pdl_check = pdl_check_flag() || ::gtco::pdl_launch();
    s.fibers = std::vector<Fiber>(static_cast<size_t>(nthreads));
    for (int tid = 0; tid < nthreads; ++tid) {
        Fiber& f = s.fibers[static_cast<size_t>(tid)];
        f.stack = t_stacks.take();
        f.thread_idx = uint3{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
        f.t.block = &blk;
        f.t.tid = tid;
        f.t.warp = &blk.warps[static_cast<size_t>(tid / 32)];
        f.t.lane = tid % 32;
        s.ready.push_back(tid);
    }
    s.live = nthreads;
    s.run = [&](int tid) {
        ThreadCtx& t = s.fibers[static_cast<size_t>(tid)].t;
        for (unsigned bz = 0; bz < grid.z; ++bz)
            for (unsigned by = 0; by < grid.y; ++by)
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    blockIdx = uint3{bx, by, bz};
                    t.smem_offset = 0;
                    t.phase = 0;
                    t.seq = 0;
                    t.dep_waited = false;
                    phase.wait("deadlock before a block started");
                    std::apply(kernel, params);
                    finish_thread(t);
                    phase.wait("deadlock at the end of a block");
                    if (tid == 0) prepare();
                }
    };
    blockDim = block;
    gridDim = grid;
    t_sched = &s;
    const int first = s.ready.front();
    s.ready.pop_front();
    Fiber& f0 = s.fibers[static_cast<size_t>(first)];
    make_fiber(s, f0);
    enter(s, first);
    swapcontext(&s.host, &f0.uc);  // back here when every fiber has finished
    t_sched = nullptr;
    t_ctx = nullptr;
    threadIdx = uint3{0, 0, 0};
    blockIdx = uint3{0, 0, 0};
    for (Fiber& f : s.fibers) t_stacks.give(f.stack);
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
    note_global(src, "PDL: cp.async from global memory before grid_dep_wait()");
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
    ++t.seq;
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

// D = A * B + C for the whole warp from its A (16 x K), B (K x 8) and every lane's C (from mma_exchange's `buf`):
// fp32 products summed in fp32, k ascending, then C added. Computed once per collective, by the first lane of the
// warp that asks (the lanes run one at a time); the others read it. `decode` fills A and B from `buf`.
template <int K, typename Decode>
void mma_lane_result(float* d, const uint32_t (*buf)[kSlotWords], Decode decode) {
    ThreadCtx& t = ctx();
    Warp& w = *t.warp;
    const int b = t.phase ^ 1;  // the exchange buffer this collective used
    float (&D)[16][8] = w.mma_d[b];
    if (w.mma_seq[b] != t.seq) {
        float A[16][K], B[K][8];
        decode(A, B);
        typedef float Quad __attribute__((vector_size(16)));  // 4 columns at once, in fp32 (SSE on any x86-64)
        for (int r = 0; r < 16; ++r) {
            Quad lo = {}, hi = {};
            for (int k = 0; k < K; ++k) {
                Quad b0, b1;
                std::memcpy(&b0, &B[k][0], sizeof b0);
                std::memcpy(&b1, &B[k][4], sizeof b1);
                const float a = A[r][k];
                lo += a * b0;  // products and sums rounded to fp32 one by one (ISO C++: no contraction)
                hi += a * b1;
            }
            float sum[8];
            std::memcpy(sum, &lo, sizeof lo);
            std::memcpy(sum + 4, &hi, sizeof hi);
            for (int c = 0; c < 8; ++c)  // C of (r, c): element (r / 8) * 2 + c % 2 of lane (r % 8) * 4 + c / 2
                D[r][c] = sum[c] + bits_f32(buf[(r % 8) * 4 + c / 2][6 + (r / 8) * 2 + c % 2]);
        }
        w.mma_seq[b] = t.seq;
    }
    for (int i = 0; i < 4; ++i) {
        const Coord p = c_coord(t.lane, i);
        d[i] = D[p.row][p.col];
    }
}

// D = A * B + C with 16-bit inputs and fp32 products summed in fp32, k ascending (the hardware's internal order
// and alignment differ: compare against a reference with a tolerance, not bit for bit).
template <bool BF16>
void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    const auto* buf = mma_exchange(a, b, c);
    static const std::vector<float> f16_table = [] {  // every fp16 value in fp32: decoding is a load
        std::vector<float> t(65536);
        for (uint32_t h = 0; h < 65536; ++h) t[h] = f16_bits_to_f32(static_cast<uint16_t>(h));
        return t;
    }();
    const float* f16 = f16_table.data();
    auto elem = [f16](uint32_t reg, int i) {
        const auto h = static_cast<uint16_t>(i & 1 ? reg >> 16 : reg & 0xffffu);
        return BF16 ? bf16_bits_to_f32(h) : f16[h];
    };
    mma_lane_result<16>(d, buf, [&](float (&A)[16][16], float (&B)[16][8]) {
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
    });
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
    mma_lane_result<8>(d, buf, [&](float (&A)[16][8], float (&B)[8][8]) {
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
    });
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

// Blocks run one after another on one host thread, so the global-memory primitives of a cross-block reduction
// (split-K) are plain accesses; the order they give is the one the kernel must not depend on anyway.
inline void fence_gpu() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomic_add_u32(unsigned* p, unsigned v) {
    emu::note_global(p, "PDL: atomic_add_u32 on global memory before grid_dep_wait()");
    const unsigned old = *p;
    *p = old + v;
    return old;
}
inline float ld_cg(const float* p) {
    emu::note_global(p, "PDL: ld_cg from global memory before grid_dep_wait()");
    return *p;
}
inline void st_cg(float* p, float v) {
    emu::note_global(p, "PDL: st_cg to global memory before grid_dep_wait()");
    *p = v;
}
inline uint4 ld_cg_16(const void* p) {
    emu::note_global(p, "PDL: ld_cg_16 from global memory before grid_dep_wait()");
    return *static_cast<const uint4*>(p);
}

// griddepcontrol.wait: the grids run one after another, so the wait is satisfied at once; it is recorded for the
// PDL check (emu::note_global).
inline void grid_dep_wait() { emu::ctx().dep_waited = true; }

// Workspace of a launch (gtco/scratch.h's stream_scratch_zeroed on a GPU): zero-filled when first made or grown,
// kept for the process; blocks that use it leave it zeroed again (split-K's tile counters).
inline void* scratch_zeroed(size_t bytes) {
    static std::vector<unsigned char>* buf = new std::vector<unsigned char>();
    if (buf->size() < bytes) buf->assign(bytes, 0);
    return buf->data();
}

}  // namespace gtco
