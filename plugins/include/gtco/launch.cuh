// How a generated instantiation launches its kernel, so one source serves nvcc (the real launch on the caller's
// stream) and the CPU emulation (g++ -DGTCO_EMULATE: gtco::emu::launch runs the grid on host threads).
//
// Every instantiation exports one C entry point:
//     extern "C" int <symbol>(const <Args>* args, void* stream);
// returning 0 on success, or a GTCO_E* code when the arguments do not fit what the instance was built for (the
// caller turns it into an error naming the op and the shapes). <Args> is a plain C struct of pointers and
// integer/float scalars declared in gtco/args.h, mirrored field for field by the family's Python side.
#pragma once

#include "gtco/args.h"
#include "gtco/primitives.cuh"


#if defined(GTCO_EMULATE)
#define GTCO_EXPORT extern "C" __attribute__((visibility("default")))
#define GTCO_LAUNCH(kernel, grid, block, stream, ...) (gtco::emu::launch((kernel), (grid), (block), __VA_ARGS__), 0)
#define GTCO_LAUNCH_SMEM(kernel, grid, block, smem_bytes, stream, ...)                                    \
    ((smem_bytes) > GTCO_EMU_SMEM_BYTES ? GTCO_ELAUNCH                                                    \
                                        : (gtco::emu::launch((kernel), (grid), (block), __VA_ARGS__), 0))
#else
#include <cuda_runtime.h>

#include "gtco/smem_opt_in.h"
#define GTCO_EXPORT extern "C" __attribute__((visibility("default")))
// A launch does nothing else on the host: no allocation, no synchronization, no string, so ORT can capture it in a
// CUDA graph (enable_cuda_graph) and replay it.
#define GTCO_LAUNCH(kernel, grid, block, stream, ...)                                                     \
    ((kernel)<<<(grid), (block), 0, static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__),                    \
     cudaGetLastError() == cudaSuccess ? 0 : GTCO_ELAUNCH)
// With dynamic shared memory; above 48 KiB the kernel opts in first, once per kernel and device
// (gtco/smem_opt_in.h: the site's record is the static of a lambda of this expansion).
#define GTCO_LAUNCH_SMEM(kernel, grid, block, smem_bytes, stream, ...)                                    \
    (!gtco::smem_opt_in([]() -> gtco::SmemOptIn& { static gtco::SmemOptIn site; return site; }(),         \
                        (kernel), (smem_bytes))                                                           \
         ? GTCO_ELAUNCH                                                                                   \
         : ((kernel)<<<(grid), (block), (smem_bytes), static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__),    \
            cudaGetLastError() == cudaSuccess ? 0 : GTCO_ELAUNCH))
#endif
