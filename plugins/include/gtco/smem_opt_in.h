// Dynamic shared memory above 48 KiB: the kernel function must first opt in with cudaFuncSetAttribute
// (cudaFuncAttributeMaxDynamicSharedMemorySize). GTCO_LAUNCH_SMEM (gtco/launch.cuh) does it once per kernel and
// device, not on every launch: ORT's CUDA graphs (enable_cuda_graph) capture and replay the launches of a run, and
// a launch path that is captured should do no host work it can avoid. The attribute belongs to the function on one
// device and stays set, so the first launch on each device sets it and later ones only read an atomic.
//
// Plain C++ over the CUDA runtime API (no device code), so it also builds with g++ against a stand-in
// cuda_runtime.h that records the calls (tests/plugin/test_graph_safe.py).
#pragma once

#include <atomic>

#include <cuda_runtime.h>

namespace gtco {

constexpr int kSmemMaxDevices = 64;
constexpr int kSmemDefaultBytes = 48 * 1024;  // what every kernel may take without opting in

// What one launch site opted its kernel in to, per device. GTCO_LAUNCH_SMEM keeps one per expansion (a static of
// a lambda of its own), which is one per kernel instantiation of a launcher template. The site remembers the
// kernel it was first used with: a site that launches another kernel sets the attribute for that one each time
// (correct, only not cached).
struct SmemOptIn {
    std::atomic<const void*> kernel{nullptr};
    std::atomic<int> bytes[kSmemMaxDevices] = {};
};

// Let `kernel` take `smem_bytes` of dynamic shared memory on the current device; false when CUDA refuses.
template <class Kernel>
inline bool smem_opt_in(SmemOptIn& site, Kernel kernel, int smem_bytes) {
    if (smem_bytes <= kSmemDefaultBytes) return true;
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    const void* fn = reinterpret_cast<const void*>(kernel);
    const void* first = nullptr;
    const bool same = site.kernel.compare_exchange_strong(first, fn, std::memory_order_acq_rel) || first == fn;
    std::atomic<int>* done = same && device >= 0 && device < kSmemMaxDevices ? &site.bytes[device] : nullptr;
    if (done != nullptr && done->load(std::memory_order_acquire) >= smem_bytes) return true;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess) {
        return false;
    }
    if (done != nullptr) {  // keep the largest size set (two threads may race here: both set, both are right)
        int seen = done->load(std::memory_order_relaxed);
        while (seen < smem_bytes && !done->compare_exchange_weak(seen, smem_bytes, std::memory_order_acq_rel)) {
        }
    }
    return true;
}

}  // namespace gtco
