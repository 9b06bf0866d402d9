// What every instance's entry point shares: the return codes. Each family declares its C argument struct in its own
// folder (plugins/families/<family>/<family>_args.h: plain C types, filled by the g++-built ORT glue and read by the
// nvcc-built instances, mirrored field for field by the family's args_fields); each includes this file.
#pragma once

#include <stdint.h>

// What an instance's entry point returns (gtco/launch.cuh).
#define GTCO_OK 0
#define GTCO_EBADSHAPE 1    // a size differs from the one the instance was built for, or breaks its divisibility
#define GTCO_ELAUNCH 2      // the launch itself failed (cudaGetLastError after the launch)
