// Kernels with deliberate bugs (and one legal corner case) for the checks of plugins/emu/gtco_emu.h.
// Built only for the emulation: g++ -std=c++17 -pthread -DGTCO_EMULATE -I plugins/include -x c++ emu_checks.cu
#include "gtco/primitives.cuh"

#include <cstdio>
#include <cstring>

namespace gtco_test {

// Legal: threads past n exit before __syncthreads; the barrier counts exited threads as arrived.
__global__ void early_exit_then_sync(float* out, int n) {
    GTCO_SHARED(float, buf, 64);
    const int t = static_cast<int>(threadIdx.x);
    if (t >= n) return;
    buf[t] = static_cast<float>(t);
    __syncthreads();
    out[t] = buf[n - 1 - t];
}

// Bug: half of the warp exits, the rest shuffles.
__global__ void shuffle_after_exit(float* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = gtco::warp_sum(1.0f);
}

// Bug: ldmatrix row addresses 8 bytes off 16-byte alignment.
__global__ void misaligned_ldmatrix(float* out) {
    GTCO_SHARED(__half, tile, 16 * 24);
    for (int i = static_cast<int>(threadIdx.x); i < 16 * 24; i += 32) tile[i] = __float2half(1.0f);
    __syncthreads();
    uint32_t r[4];
    gtco::ldmatrix_x4(r, tile + (threadIdx.x % 16) * 24 + 4);
    out[threadIdx.x] = static_cast<float>(r[0]);
}

// Bug: lanes of one warp reach different collectives.
__global__ void divergent_collectives(float* out) {
    uint32_t r[2];
    GTCO_SHARED(__half, tile, 16 * 8);
    if (threadIdx.x < 16) out[threadIdx.x] = gtco::warp_sum(1.0f);
    else gtco::ldmatrix_x2(r, tile + (threadIdx.x % 16) * 8);
}

// Bug: half of the warp waits in a shuffle, the other half at __syncthreads: neither can ever be released.
__global__ void deadlock(float* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = gtco::warp_sum(1.0f);
    else __syncthreads();
}

// Bug: more shared memory than a block can have.
__global__ void too_much_shared(float* out) {
    GTCO_SHARED(float, big, 64 * 1024);
    big[threadIdx.x] = 1.0f;
    out[threadIdx.x] = big[threadIdx.x];
}

}  // namespace gtco_test

int main(int argc, char** argv) {
    using namespace gtco_test;
    static float out[64];
    const char* mode = argc == 2 ? argv[1] : "";
    if (!std::strcmp(mode, "early_exit")) {
        gtco::emu::launch(early_exit_then_sync, dim3(1), dim3(64), out, 40);
        for (int t = 0; t < 40; ++t)
            if (out[t] != static_cast<float>(39 - t)) return std::fprintf(stderr, "wrong out[%d]\n", t), 1;
    } else if (!std::strcmp(mode, "shuffle_after_exit")) {
        gtco::emu::launch(shuffle_after_exit, dim3(1), dim3(32), out);
    } else if (!std::strcmp(mode, "misaligned_ldmatrix")) {
        gtco::emu::launch(misaligned_ldmatrix, dim3(1), dim3(32), out);
    } else if (!std::strcmp(mode, "divergent")) {
        gtco::emu::launch(divergent_collectives, dim3(1), dim3(32), out);
    } else if (!std::strcmp(mode, "deadlock")) {
        gtco::emu::launch(deadlock, dim3(1), dim3(32), out);
    } else if (!std::strcmp(mode, "too_much_shared")) {
        gtco::emu::launch(too_much_shared, dim3(1), dim3(32), out);
    } else {
        return std::fprintf(stderr, "unknown mode\n"), 2;
    }
    return 0;
}
