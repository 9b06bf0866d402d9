// Programmatic dependent launch (PDL, sm_90 and later): whether the instance called next on this host thread
// launches its kernel with cudaLaunchAttributeProgrammaticStreamSerialization.
//
// The choice is the caller's (the ORT glue decides it per node: gtco_ort.h, NodeSpec::pdl) and travels to the
// instance through this thread-local flag instead of an argument, so the entry point keeps its ABI
// `int symbol(const Args*, void* stream)`: the glue wraps the call in a PdlScope and the instance's launch
// (GTCO_LAUNCH / GTCO_LAUNCH_SMEM, gtco/launch.cuh) reads pdl_launch(). The flag is an inline variable: the glue
// (g++) and the instances (nvcc's host pass, or g++ -DGTCO_EMULATE) are linked into one shared library, where the
// linker keeps one copy of it. Outside a PdlScope it is false: a plain launch, as before.
//
// A kernel launched with the attribute may start while its predecessor in the stream is still running, so every
// gtco kernel calls gtco::grid_dep_wait() (gtco/primitives.cuh) before it touches global memory; see there.
#pragma once

namespace gtco {

inline thread_local bool t_pdl_launch = false;

inline bool pdl_launch() { return t_pdl_launch; }

// Sets the flag for the calls made while it lives, and restores the previous value.
class PdlScope {
public:
    explicit PdlScope(bool on) : prev_(t_pdl_launch) { t_pdl_launch = on; }
    ~PdlScope() { t_pdl_launch = prev_; }
    PdlScope(const PdlScope&) = delete;
    PdlScope& operator=(const PdlScope&) = delete;

private:
    bool prev_;
};

}  // namespace gtco
