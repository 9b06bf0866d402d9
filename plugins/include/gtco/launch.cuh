// How a generated instantiation launches its kernel, so one source serves nvcc (the real launch on the caller's
// stream) and the CPU emulation (g++ -DGTCO_EMULATE: gtco::emu::launch runs the grid on host threads).
//
// Every instantiation exports one C entry point:
//     extern "C" int <symbol>(const <Args>* args, void* stream);
// returning 0 on success, or a GTCO_E* code when the arguments do not fit what the instance was built for (the
// caller turns it into an error naming the op and the shapes). <Args> is a plain C struct of pointers and
// integer/float scalars declared in the family's <family>_args.h, mirrored field for field by the family's Python side.
//
// Programmatic dependent launch (sm_90+): the instance launches with PDL when its caller asks through a
// gtco::PdlScope (gtco/pdl.h); the entry point's signature is the same either way.
#pragma once

#include "gtco/args.h"
#include "gtco/pdl.h"
#include "gtco/primitives.cuh"


#if defined(GTCO_EMULATE)
// The grid runs at once, in order (emu::launch); inside a PdlScope(true) the launch is checked as a PDL one
// (a global access before grid_dep_wait() fails: plugins/emu/gtco_emu.h).
#define GTCO_EXPORT extern "C" __attribute__((visibility("default")))
#define GTCO_LAUNCH(kernel, grid, block, stream, ...) (gtco::emu::launch((kernel), (grid), (block), __VA_ARGS__), 0)
#define GTCO_LAUNCH_SMEM(kernel, grid, block, smem_bytes, stream, ...)                                    \
    ((smem_bytes) > GTCO_EMU_SMEM_BYTES ? GTCO_ELAUNCH                                                    \
                                        : (gtco::emu::launch((kernel), (grid), (block), __VA_ARGS__), 0))
#else
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "gtco/smem_opt_in.h"
#define GTCO_EXPORT extern "C" __attribute__((visibility("default")))

namespace gtco {

// One launch of `kernel` on `stream`: a programmatic dependent one (cudaLaunchKernelEx with
// cudaLaunchAttributeProgrammaticStreamSerialization = 1: the kernel may start before the one ahead of it in the
// stream completes, and waits for it in grid_dep_wait()) inside a PdlScope(true) (gtco/pdl.h), else the plain
// <<<>>> launch. The caller decides PDL only for sm_90 and later (gtco_ort.h). Either way the launch does nothing
// else on the host: no allocation, no synchronization, no string, so ORT can capture it in a CUDA graph
// (enable_cuda_graph; a capture records the programmatic edge) and replay it. 0, or GTCO_ELAUNCH.
template <class... P, class... A>
inline int launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes, void* stream,
                         A&&... args) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (pdl_launch()) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = smem_bytes;
        cfg.stream = s;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
        (void)cudaGetLastError();  // clear the launch error, as the plain path does
        return err == cudaSuccess ? 0 : GTCO_ELAUNCH;
    }
    kernel<<<grid, block, smem_bytes, s>>>(std::forward<A>(args)...);
    return cudaGetLastError() == cudaSuccess ? 0 : GTCO_ELAUNCH;
}

}  // namespace gtco

#define GTCO_LAUNCH(kernel, grid, block, stream, ...) \
    gtco::launch_kernel((kernel), (grid), (block), 0, (stream), __VA_ARGS__)
// With dynamic shared memory; above 48 KiB the kernel opts in first, once per kernel and device
// (gtco/smem_opt_in.h: the site's record is the static of a lambda of this expansion).
#define GTCO_LAUNCH_SMEM(kernel, grid, block, smem_bytes, stream, ...)                                    \
    (!gtco::smem_opt_in([]() -> gtco::SmemOptIn& { static gtco::SmemOptIn site; return site; }(),         \
                        (kernel), (smem_bytes))                                                           \
         ? GTCO_ELAUNCH                                                                                   \
         : gtco::launch_kernel((kernel), (grid), (block), static_cast<size_t>(smem_bytes), (stream), __VA_ARGS__))
#endif
