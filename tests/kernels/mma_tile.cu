// Test kernels for plugins/include/gtco/primitives.cuh, built two ways:
//   g++ -std=c++17 -pthread -DGTCO_EMULATE -I plugins/include -x c++ mma_tile.cu -o mma_tile   (CPU emulation)
//   nvcc -arch=sm_80 -std=c++17 -I plugins/include -Xptxas -v -c mma_tile.cu                   (resource report)
//
// gemm_tile: D[M][N] (fp32) = A[M][K] @ B, A row-major, B either [K][N] row-major (ldmatrix .trans) or [N][K]
// (ldmatrix without .trans). One warp computes one 16x8 tile; a block has WM x WN warps. Tiles are staged through
// shared memory with cp.async (zero-filled outside the matrix, 2 stages), loaded with ldmatrix, multiplied with
// mma.m16n8k16. Requires K % 8 == 0 and, for [K][N] B, N % 8 == 0 (16-byte cp.async chunks).
//
// GTCO_TEST_PERMUTE=1|2|3 deliberately breaks the A, B or C/D fragment mapping, and GTCO_TEST_NO_WAIT drops the
// cp.async wait before the tile is read; the tests check that the emulation then gives a wrong answer.
#include "gtco/primitives.cuh"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef GTCO_TEST_PERMUTE
#define GTCO_TEST_PERMUTE 0
#endif

namespace gtco_test {

constexpr int kBK = 16;
constexpr int kPad = 8;  // halves of padding per shared row: keeps rows 16-byte aligned, spreads banks

template <typename T, int WM, int WN, bool B_NK>
__global__ void __launch_bounds__(WM * WN * 32)
    gemm_tile(const T* __restrict__ A, const T* __restrict__ B, float* __restrict__ D, int M, int N, int K) {
    constexpr int BM = 16 * WM, BN = 8 * WN, kThreads = WM * WN * 32;
    constexpr int kAStride = kBK + kPad, kBStride = B_NK ? kBK + kPad : BN + kPad;
    constexpr int kBRows = B_NK ? BN : kBK;
    GTCO_SHARED(T, As, 2 * BM * kAStride);
    GTCO_SHARED(T, Bs, 2 * kBRows * kBStride);

    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = static_cast<int>(gtco::lane_id());
    const int wm = warp % WM, wn = warp / WM;
    const int m0 = static_cast<int>(blockIdx.y) * BM, n0 = static_cast<int>(blockIdx.x) * BN;
    const int ktiles = (K + kBK - 1) / kBK;

    auto load = [&](int stage, int kt) {
        const int k0 = kt * kBK;
        T* as = As + stage * BM * kAStride;
        T* bs = Bs + stage * kBRows * kBStride;
        for (int c = tid; c < BM * 2; c += kThreads) {  // 16-byte chunks: 2 per A row of 16
            const int r = c / 2, kc = (c % 2) * 8;
            const bool ok = m0 + r < M && k0 + kc < K;
            gtco::cp_async_16(as + r * kAStride + kc, ok ? A + (m0 + r) * K + k0 + kc : A, ok);
        }
        if constexpr (B_NK) {
            for (int c = tid; c < BN * 2; c += kThreads) {
                const int r = c / 2, kc = (c % 2) * 8;
                const bool ok = n0 + r < N && k0 + kc < K;
                gtco::cp_async_16(bs + r * kBStride + kc, ok ? B + (n0 + r) * K + k0 + kc : B, ok);
            }
        } else {
            for (int c = tid; c < kBK * (BN / 8); c += kThreads) {
                const int r = c / (BN / 8), nc = (c % (BN / 8)) * 8;
                const bool ok = k0 + r < K && n0 + nc < N;
                gtco::cp_async_16(bs + r * kBStride + nc, ok ? B + (k0 + r) * N + n0 + nc : B, ok);
            }
        }
    };

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    load(0, 0);
    gtco::cp_async_commit();
    for (int kt = 0; kt < ktiles; ++kt) {
        if (kt + 1 < ktiles) load((kt + 1) % 2, kt + 1);
        gtco::cp_async_commit();  // possibly empty: keeps the group count uniform for wait<1>
#ifndef GTCO_TEST_NO_WAIT
        gtco::cp_async_wait<1>();
#endif
        __syncthreads();
        const T* as = As + (kt % 2) * BM * kAStride;
        const T* bs = Bs + (kt % 2) * kBRows * kBStride;
        uint32_t a[4], b[2];
        // A: matrices 0..3 = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
        gtco::ldmatrix_x4(a, as + (wm * 16 + lane % 16) * kAStride + (lane / 16) * 8);
        if constexpr (B_NK) {  // rows of Bs are n: matrix 0 = k 0-7, matrix 1 = k 8-15, no transpose
            gtco::ldmatrix_x2(b, bs + (wn * 8 + lane % 8) * kBStride + ((lane / 8) % 2) * 8);
        } else {  // rows of Bs are k: lanes 0-15 give k = 0..15, transposed into the col-major B fragment
            gtco::ldmatrix_x2_trans(b, bs + (lane % 16) * kBStride + wn * 8);
        }
#if GTCO_TEST_PERMUTE == 1
        const uint32_t t = a[1];
        a[1] = a[2];
        a[2] = t;
#elif GTCO_TEST_PERMUTE == 2
        const uint32_t t = b[0];
        b[0] = b[1];
        b[1] = t;
#endif
        gtco::mma_m16n8k16<T>(acc, a, b);
        __syncthreads();
    }
    gtco::cp_async_wait<0>();

    const int g = lane / 4, tig = lane % 4;
    for (int i = 0; i < 4; ++i) {
#if GTCO_TEST_PERMUTE == 3
        const int row = m0 + wm * 16 + g + (i & 1) * 8, col = n0 + wn * 8 + tig * 2 + i / 2;
#else
        const int row = m0 + wm * 16 + g + (i / 2) * 8, col = n0 + wn * 8 + tig * 2 + (i & 1);
#endif
        if (row < M && col < N) D[row * N + col] = acc[i];
    }
}

// tf32_tile: D[M][N] (fp32) = A[M][K] @ B[K][N], fp32 row-major in global memory, one warp per 16x8 tile of D and
// mma.m16n8k8 .tf32 over K in steps of 8 (M % 16 == 0, N % 8 == 0, K % 8 == 0). The fragments are read straight
// from global memory in the PTX ISA layout ("Matrix Fragments for mma.m16n8k8", .tf32), so the result checks the
// emulated mma's fragment layout. ROUND: operands go through round_tf32 (cvt.rna); else their raw fp32 bits.
template <bool ROUND>
__global__ void tf32_tile(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ D, int M,
                          int N, int K) {
    const int lane = static_cast<int>(gtco::lane_id()), g = lane / 4, tig = lane % 4;
    const int m0 = static_cast<int>(blockIdx.y) * 16, n0 = static_cast<int>(blockIdx.x) * 8;
    auto op = [](float x) { return ROUND ? gtco::to_tf32(x) : __float_as_uint(x); };
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k0 = 0; k0 < K; k0 += 8) {
        uint32_t a[4], b[2];
        a[0] = op(A[(m0 + g) * K + k0 + tig]);
        a[1] = op(A[(m0 + g + 8) * K + k0 + tig]);
        a[2] = op(A[(m0 + g) * K + k0 + tig + 4]);
        a[3] = op(A[(m0 + g + 8) * K + k0 + tig + 4]);
        b[0] = op(B[(k0 + tig) * N + n0 + g]);
        b[1] = op(B[(k0 + tig + 4) * N + n0 + g]);
#if GTCO_TEST_PERMUTE == 1
        const uint32_t t = a[1];
        a[1] = a[2];
        a[2] = t;
#elif GTCO_TEST_PERMUTE == 2
        const uint32_t t = b[0];
        b[0] = b[1];
        b[1] = t;
#endif
        gtco::mma_m16n8k8_tf32(acc, a, b);
    }
    for (int i = 0; i < 4; ++i) D[(m0 + g + (i / 2) * 8) * N + n0 + 2 * tig + (i & 1)] = acc[i];
}

// Per lane: warp_max, warp_sum, quad_max, quad_sum of the warp's 32 inputs.
__global__ void reduce_test(const float* __restrict__ x, float* __restrict__ out) {
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    const float v = x[i];
    out[4 * i + 0] = gtco::warp_max(v);
    out[4 * i + 1] = gtco::warp_sum(v);
    out[4 * i + 2] = gtco::quad_max(v);
    out[4 * i + 3] = gtco::quad_sum(v);
}

// ---------------------------------------------------------------------------------------------------------------
// Host driver: reads inputs from files, runs a kernel, writes the output file.
// ---------------------------------------------------------------------------------------------------------------
std::vector<char> read_file(const char* path) {
    std::FILE* f = std::fopen(path, "rb");
    if (!f) {
        std::fprintf(stderr, "cannot read %s\n", path);
        std::exit(2);
    }
    std::vector<char> data;
    char buf[65536];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) data.insert(data.end(), buf, buf + n);
    std::fclose(f);
    return data;
}

void write_file(const char* path, const void* data, size_t bytes) {
    std::FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(data, 1, bytes, f) != bytes) {
        std::fprintf(stderr, "cannot write %s\n", path);
        std::exit(2);
    }
    std::fclose(f);
}

#ifdef GTCO_EMULATE
template <typename T>
T* to_device(const std::vector<char>& host) {
    T* p = static_cast<T*>(std::malloc(host.size()));
    std::memcpy(p, host.data(), host.size());
    return p;
}
template <typename T>
void from_device(void* host, const T* dev, size_t bytes) {
    std::memcpy(host, dev, bytes);
}
template <typename... P, typename... Args>
void run(void (*kernel)(P...), dim3 grid, dim3 block, Args... args) {
    gtco::emu::launch(kernel, grid, block, args...);
}
void release(void* p) { std::free(p); }
#else
void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
        std::exit(1);
    }
}
template <typename T>
T* to_device(const std::vector<char>& host) {
    void* p = nullptr;
    check(cudaMalloc(&p, host.size()), "cudaMalloc");
    check(cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    return static_cast<T*>(p);
}
template <typename T>
void from_device(void* host, const T* dev, size_t bytes) {
    check(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}
template <typename... P, typename... Args>
void run(void (*kernel)(P...), dim3 grid, dim3 block, Args... args) {
    kernel<<<grid, block>>>(args...);
    check(cudaGetLastError(), "launch");
    check(cudaDeviceSynchronize(), "kernel");
}
void release(void* p) { cudaFree(p); }
#endif

template <typename T, int WM, int WN, bool B_NK>
void run_gemm(int M, int N, int K, const char* a_path, const char* b_path, const char* d_path) {
    const std::vector<char> a = read_file(a_path), b = read_file(b_path);
    if (a.size() != sizeof(T) * M * K || b.size() != sizeof(T) * K * N) {
        std::fprintf(stderr, "input sizes do not match M=%d N=%d K=%d\n", M, N, K);
        std::exit(2);
    }
    T* da = to_device<T>(a);
    T* db = to_device<T>(b);
    float* dd = to_device<float>(std::vector<char>(sizeof(float) * M * N, 0));
    const dim3 grid((N + 8 * WN - 1) / (8 * WN), (M + 16 * WM - 1) / (16 * WM));
    run(gemm_tile<T, WM, WN, B_NK>, grid, dim3(WM * WN * 32), static_cast<const T*>(da), static_cast<const T*>(db),
        dd, M, N, K);
    std::vector<float> d(static_cast<size_t>(M) * N);
    from_device(d.data(), dd, sizeof(float) * d.size());
    write_file(d_path, d.data(), sizeof(float) * d.size());
    release(da);
    release(db);
    release(dd);
}

void run_tf32(bool round, int M, int N, int K, char** paths) {
    const std::vector<char> a = read_file(paths[0]), b = read_file(paths[1]);
    if (M % 16 || N % 8 || K % 8 || a.size() != sizeof(float) * M * K || b.size() != sizeof(float) * K * N) {
        std::fprintf(stderr, "tf32: M %% 16, N %% 8, K %% 8 must be 0 and the inputs M x K, K x N floats\n");
        std::exit(2);
    }
    float* da = to_device<float>(a);
    float* db = to_device<float>(b);
    float* dd = to_device<float>(std::vector<char>(sizeof(float) * M * N, 0));
    const dim3 grid(N / 8, M / 16);
    run(round ? tf32_tile<true> : tf32_tile<false>, grid, dim3(32), static_cast<const float*>(da),
        static_cast<const float*>(db), dd, M, N, K);
    std::vector<float> d(static_cast<size_t>(M) * N);
    from_device(d.data(), dd, sizeof(float) * d.size());
    write_file(paths[2], d.data(), sizeof(float) * d.size());
    release(da);
    release(db);
    release(dd);
}

template <typename T>
void dispatch_gemm(const char* config, int M, int N, int K, char** paths) {
    if (!std::strcmp(config, "w1")) return run_gemm<T, 1, 1, false>(M, N, K, paths[0], paths[1], paths[2]);
    if (!std::strcmp(config, "w4")) return run_gemm<T, 2, 2, false>(M, N, K, paths[0], paths[1], paths[2]);
    if (!std::strcmp(config, "w1nk")) return run_gemm<T, 1, 1, true>(M, N, K, paths[0], paths[1], paths[2]);
    if (!std::strcmp(config, "w4nk")) return run_gemm<T, 2, 2, true>(M, N, K, paths[0], paths[1], paths[2]);
    std::fprintf(stderr, "unknown config %s (w1, w4, w1nk, w4nk)\n", config);
    std::exit(2);
}

void run_reduce(const char* in_path, const char* out_path) {
    const std::vector<char> x = read_file(in_path);
    const int n = static_cast<int>(x.size() / sizeof(float));
    if (n == 0 || n % 32 != 0) {
        std::fprintf(stderr, "reduce: input must hold a multiple of 32 floats\n");
        std::exit(2);
    }
    float* dx = to_device<float>(x);
    float* dout = to_device<float>(std::vector<char>(sizeof(float) * 4 * n, 0));
    run(reduce_test, dim3(n / 32), dim3(32), static_cast<const float*>(dx), dout);
    std::vector<float> out(4 * static_cast<size_t>(n));
    from_device(out.data(), dout, sizeof(float) * out.size());
    write_file(out_path, out.data(), sizeof(float) * out.size());
    release(dx);
    release(dout);
}

// float32 -> (fp16 bits, bf16 bits) with the device conversions.
void run_convert(const char* in_path, const char* out_path) {
    const std::vector<char> x = read_file(in_path);
    const size_t n = x.size() / sizeof(float);
    std::vector<uint16_t> out(2 * n);
    for (size_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, x.data() + 4 * i, 4);
        out[i] = __half_as_ushort(__float2half_rn(f));
        out[n + i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
    write_file(out_path, out.data(), sizeof(uint16_t) * out.size());
}

#ifdef GTCO_EMULATE
// float32 bits -> their tf32 rounding (round_tf32, the emulated cvt.rna.tf32.f32).
void run_round_tf32(const char* in_path, const char* out_path) {
    const std::vector<char> x = read_file(in_path);
    std::vector<uint32_t> out(x.size() / 4);
    for (size_t i = 0; i < out.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, x.data() + 4 * i, 4);
        out[i] = gtco::round_tf32(u);
    }
    write_file(out_path, out.data(), sizeof(uint32_t) * out.size());
}
#endif

}  // namespace gtco_test

int main(int argc, char** argv) {
    using namespace gtco_test;
    if (argc == 10 && !std::strcmp(argv[1], "gemm")) {
        const int M = std::atoi(argv[4]), N = std::atoi(argv[5]), K = std::atoi(argv[6]);
        if (!std::strcmp(argv[2], "f16")) dispatch_gemm<__half>(argv[3], M, N, K, argv + 7);
        else if (!std::strcmp(argv[2], "bf16")) dispatch_gemm<__nv_bfloat16>(argv[3], M, N, K, argv + 7);
        else return std::fprintf(stderr, "dtype must be f16 or bf16\n"), 2;
        return 0;
    }
    if (argc == 9 && !std::strcmp(argv[1], "tf32")) {
        run_tf32(!std::strcmp(argv[2], "round"), std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), argv + 6);
        return 0;
    }
#ifdef GTCO_EMULATE
    if (argc == 4 && !std::strcmp(argv[1], "round_tf32")) return run_round_tf32(argv[2], argv[3]), 0;
#endif
    if (argc == 4 && !std::strcmp(argv[1], "reduce")) return run_reduce(argv[2], argv[3]), 0;
    if (argc == 4 && !std::strcmp(argv[1], "convert")) return run_convert(argv[2], argv[3]), 0;
    std::fprintf(stderr,
                 "usage: %s gemm f16|bf16 w1|w4|w1nk|w4nk M N K a.bin b.bin d.bin\n"
                 "       %s tf32 round|raw M N K a.bin b.bin d.bin\n"
                 "       %s round_tf32 x.bin out.bin   (emulation only)\n"
                 "       %s reduce x.bin out.bin\n"
                 "       %s convert x.bin out.bin\n",
                 argv[0], argv[0], argv[0], argv[0], argv[0]);
    return 2;
}
