// ORT side of the custom-op library: the op/kernel templates every family's glue shares.
//
// Built with g++ only (nvcc cannot compile the ORT C++ headers), C++17 or later (the generated glue is C++20),
// -fvisibility=hidden, ORT_API_MANUAL_INIT: the library never links libonnxruntime; RegisterCustomOps (register.inc)
// calls Ort::InitApi with the API the loading runtime hands over.
//
// One fused op type (e.g. Layernorm_f32) is one FusedOp<Family, dtype, cuda> object per execution provider. Its
// schema is one variadic input of any type and one variadic output of the op's dtype (of any type where a node writes another: FusedOp), because nodes of the same op
// type can differ in arity (residual or not, affine or not, constants the group swallowed). Which node input plays
// which role is decided at build time from the node's model-local function and written into the generated node
// table (NodeSpec); the kernel looks its node up by name once, reads its attributes once (Family::Attrs), and then
// checks every call's shapes and dtypes, returning an ORT error that names the op, the node and the shapes.
//
// Two kernels per op type: Cuda = false is the plain C++ reference (plugins/cpu/, registered for the CPU EP);
// Cuda = true fills the family's C argument struct (families/<f>/<f>_args.h) and calls the node's generated instance
// (NodeSpec::cuda_fn, the entry point for the GPU's generation, chosen when the kernel is created) on the
// session's compute stream (KernelContext::GetGPUComputeStream), registered for the CUDA EP. A glue built with
// GTCO_EMULATED_DEVICE links the same instances compiled for the CPU emulation (g++ -DGTCO_EMULATE) and registers
// the Cuda = true kernels for the CPU EP: the whole device path (argument structs, strides, dispatch, the
// instances' own checks) then runs in an ordinary CPU session, which is how CI tests it without a GPU.
//
// Dynamic shapes: before either kernel runs, FusedKernel checks the node's declared ranges (NodeSpec::ranges, from
// the model's gtco.dynamic metadata) and a device kernel with a dispatch table (NodeSpec::dispatch) launches the
// entry for the call's run-time extent (NodeSpec::extent) instead of cuda_fn.
//
// Fallback: a GEMM node whose instance is a cuBLASLt one has an mma instance per arch slot beside it
// (NodeSpec::fallback_fn, NodeRef::fallback) that gemm_glue::run_gemm launches when cuBLASLt cannot run, and from
// then on in its place.
#pragma once

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "gtco/args.h"
#include "gtco/pdl.h"

#define GTCO_ORT_EXPORT extern "C" __attribute__((visibility("default")))

#if defined(GTCO_EMULATED_DEVICE)
#define GTCO_DEVICE_EP "CPUExecutionProvider"
#else
#define GTCO_DEVICE_EP "CUDAExecutionProvider"
#endif

// Compute capability of the current device as major * 10 + minor (86 for sm_86), or -(cudaError_t) when the CUDA
// runtime cannot tell. Defined by plugins/cuda/probe.cu (CUDA builds) or the generated glue (emulated builds).
extern "C" int gtco_device_cc();

namespace gtco {

// f8: a GEMM on E4M3 operands with fp16 I/O (onnx_gtco/fp8.py): its Storage is fp16's, its B and scales its own.
enum class DType { f32, f16, bf16, f8 };

template <DType D>
struct Storage;
template <>
struct Storage<DType::f32> {
    using type = float;
    static constexpr ONNXTensorElementDataType onnx = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    static constexpr const char* name = "float";
    static float load(float v) { return v; }
    static float store(float v) { return v; }
};
template <>
struct Storage<DType::f16> {
    using type = Ort::Float16_t;
    static constexpr ONNXTensorElementDataType onnx = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    static constexpr const char* name = "float16";
    static float load(Ort::Float16_t v) { return v.ToFloat(); }
    static Ort::Float16_t store(float v) { return Ort::Float16_t(v); }
};
template <>
struct Storage<DType::f8> : Storage<DType::f16> {};
template <>
struct Storage<DType::bf16> {
    using type = Ort::BFloat16_t;
    static constexpr ONNXTensorElementDataType onnx = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    static constexpr const char* name = "bfloat16";
    static float load(Ort::BFloat16_t v) { return v.ToFloat(); }
    static Ort::BFloat16_t store(float v) { return Ort::BFloat16_t(v); }
};

constexpr int kMaxRoles = 8;

// A generated instance's entry point, `int gtco_<name>(const <Family>Args*, void* stream)` (gtco/launch.cuh).
using InstanceFn = int (*)(const void* args, void* stream);

// Instances per GPU generation: slot 0 is built for sm_80 and runs on every 8.x GPU (A100, A10, L4, L40, ...),
// slot 1 for sm_90 (9.x), slot 2 for sm_90a, the arch-specific code (wgmma) that runs on 9.0 only (H100, H200); a
// node without sm_90a code of its own has its sm_90 instance there. Other generations have no instance (-1).
constexpr int kArchSlots = 3;
inline int arch_slot(int cc) {
    if (cc >= 80 && cc < 90) return 0;
    if (cc == 90) return 2;
    if (cc > 90 && cc < 100) return 1;
    return -1;
}

// A declared range of a symbolic dim (the model's gtco.dynamic metadata) on one input axis of a node: every call
// checks lo <= shape[axis] <= hi, on the CPU and the device path alike (gtco::check_ranges).
struct DimRange {
    int input;        // node input index
    int axis;         // axis of that input
    int64_t lo, hi;   // the declared range, inclusive
    const char* dim;  // the dim's name, for messages
};

// One factor of a node's run-time extent (onnx_gtco.kernels.dynamic): the size of input `input` along `axis`
// (negative: from the end).
struct DimRef {
    int input;
    int axis;
};

// One entry of a node's dispatch table: the instances (per arch slot) a call whose extent is at most max_extent
// launches. The table is in ascending max_extent; the last entry has INT64_MAX and takes everything above.
struct DispatchEntry {
    int64_t max_extent;
    InstanceFn fn[kArchSlots];
    const char* name[kArchSlots];
};

// One fused node of the model the library was built for: the table kNodes, generated from plugins/ort/glue.cc.j2
// with designated initializers (.op_type = ..., .in = ...), so a field moved here fails the glue's build instead
// of shifting the values after it; a field left out takes its default below.
struct NodeSpec {
    const char* op_type;
    const char* node;                    // node name in the model
    int n_inputs;
    int n_outputs;
    int in[kMaxRoles];                   // family input role -> node input index, -1 when the node has no such input
    int out[kMaxRoles];                  // family output role -> node output index, -1 when absent
    InstanceFn cuda_fn[kArchSlots];      // the node's instance per arch slot; nullptr: none (CPU-only op type)
    const char* cuda_name[kArchSlots];   // their names, for messages
    const void* node_data;               // family-specific per-node data of the glue (nullptr: none); the
                                         // Elementwise family's gtco::ElementwiseNode, with its host function
    // Dynamic shapes (left out, a node has none: the defaults)
    const DimRange* ranges = nullptr;        // declared ranges checked on every call (n_ranges of them)
    int n_ranges = 0;
    const DimRef* extent = nullptr;          // the factors of the run-time extent (n_extent of them)
    int n_extent = 0;
    const DispatchEntry* dispatch = nullptr; // the dispatch table (n_dispatch entries; 0: cuda_fn is the instance)
    int n_dispatch = 0;
    std::atomic<int64_t>* launches = nullptr;  // launches per dispatch entry (gtco_dispatch_launches, register.inc)
    // Programmatic dependent launch per arch slot (left out: never). The library build sets it where the slot is
    // sm_90 or later, every instance of the node in that slot (cuda_fn and the dispatch entries) is a gtco kernel
    // (never CUTLASS or cuBLASLt, which do not wait in griddepcontrol.wait), and every input of the node that is not
    // a constant is written by another fused node whose instances in that slot are gtco kernels too
    // (onnx_gtco/plugin/pdl.py). The kernel uses it when the device is 9.0 or later and the session allows it
    // (gtco.pdl, register.inc): see NodeRef::pdl.
    bool pdl[kArchSlots] = {};
    // The generated mma instance per arch slot that the slot's cuBLASLt instance (cuda_fn) falls back to when it
    // returns GTCO_ELIBRARY: libcublasLt absent, no algorithm of the chosen rank, a plan that cannot be made
    // (gemm/cublaslt.h; onnx_gtco/plugin/device.py mma_fallbacks). Left out, or nullptr: none, and such a failure is
    // the node's error. Dispatch entries keep no fallback: a node with a dispatch table has none.
    InstanceFn fallback_fn[kArchSlots] = {};
    const char* fallback_name[kArchSlots] = {};
};

extern const NodeSpec kNodes[];
extern const size_t kNodeCount;

inline const NodeSpec* find_node(const std::string& op_type, const std::string& node) {
    for (size_t i = 0; i < kNodeCount; ++i)
        if (op_type == kNodes[i].op_type && node == kNodes[i].node) return &kNodes[i];
    return nullptr;
}

inline std::string shape_str(const std::vector<int64_t>& shape) {
    std::ostringstream s;
    s << '[';
    for (size_t i = 0; i < shape.size(); ++i) s << (i ? "," : "") << shape[i];
    s << ']';
    return s.str();
}

inline const char* type_str(ONNXTensorElementDataType t) {
    switch (t) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float";
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "double";
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
        default: return "other";
    }
}

inline OrtStatus* make_status(OrtErrorCode code, const std::string& msg) {
    return Ort::GetApi().CreateStatus(code, msg.c_str());
}

// What a node's kernel knows about itself: its name for messages ("Layernorm_f32 node 'gtco/layernorm/ln'") and,
// for a device kernel, the instance it launches.
struct NodeRef {
    std::string op_type;
    std::string node;
    InstanceFn fn = nullptr;
    std::string fn_name;
    int slot = -1;  // the device's arch slot (device kernels)
    // Launch with programmatic dependent launch (gtco/pdl.h): the node's NodeSpec::pdl for this slot, on a device
    // of compute capability 9.0 or later (read once, when the kernel is created), in a session that allows it.
    //
    // Why only after our own kernels. The attribute relaxes the dependency on the kernel just ahead in the stream
    // only, and only as far as that kernel allows: it may start once that grid triggers (launch_dependents, or its
    // completion, the implicit trigger), and its grid_dep_wait() returns once that grid has completed. No gtco
    // kernel triggers early (primitives.cuh), so whatever runs after a gtco producer, ORT's kernels in between
    // included, starts only after the producer completed, and the consumer's wait on its immediate predecessor
    // covers the producer. A producer that is an ORT kernel (or cuBLAS / CUTLASS, whose kernels may be PDL launches
    // of their own that trigger early) gives no such guarantee once another kernel sits between it and this node:
    // that kernel may finish first, and the wait covers only it. Where the producer is the immediate predecessor
    // and never triggers early, a PDL launch would be safe but gains nothing (it starts at the producer's
    // completion anyway). So inputs from graph inputs or non-gtco nodes keep the node on a plain launch.
    bool pdl = false;
    // The node's fallback where its instance is a cuBLASLt one with an mma fallback in this slot (NodeSpec::
    // fallback_fn), else nullptr: the NodeRef that launches the fallback, and the flag set once the instance failed
    // for want of its library, after which the node launches the fallback directly (gemm_glue::run_gemm). Both point
    // into the node's FusedKernel, which outlives every call; the flag is atomic because ORT may run one kernel
    // object from several threads at once.
    const NodeRef* fallback = nullptr;
    std::atomic<bool>* fell_back = nullptr;
    std::string where() const { return op_type + " node '" + node + "'"; }
    OrtStatus* fail(const std::string& msg, OrtErrorCode code = ORT_INVALID_ARGUMENT) const {
        return make_status(code, where() + ": " + msg);
    }
};

// A tensor input as the families see it: shape, element type, data (host or device pointer per the EP).
struct Input {
    bool present = false;
    std::vector<int64_t> shape;
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    const void* data = nullptr;
    int64_t numel() const {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        return n;
    }
};

inline Input get_input(Ort::KernelContext& ctx, int index) {
    Input in;
    if (index < 0) return in;
    Ort::ConstValue v = ctx.GetInput(static_cast<size_t>(index));
    if (v == nullptr) return in;
    auto info = v.GetTensorTypeAndShapeInfo();
    in.present = true;
    in.shape = info.GetShape();
    in.type = info.GetElementType();
    in.data = v.GetTensorRawData();
    return in;
}

// The node's instance (ref.fn, not null) on `args` on the session's compute stream (no stream in an emulated build):
// its return code, GTCO_OK or a GTCO_E* (gtco/args.h, gemm/cublaslt_shape.h).
template <class Args>
int launch_instance(Ort::KernelContext& ctx, const NodeRef& ref, const Args& args) {
#if defined(GTCO_EMULATED_DEVICE)
    void* stream = nullptr;
    (void)ctx;
#else
    void* stream = ctx.GetGPUComputeStream();
#endif
    const PdlScope pdl(ref.pdl);  // read by the instance's launch (gtco/launch.cuh)
    return ref.fn(&args, stream);
}

// An instance's return code as the node's status: nullptr for GTCO_OK, else the error naming the instance (and,
// for GTCO_EBADSHAPE, the operands: `what()`, see run_instance).
template <class Describe>
OrtStatus* instance_status(const NodeRef& ref, int rc, const Describe& what) {
    if (rc == GTCO_OK) return nullptr;
    if (rc == GTCO_EBADSHAPE) {
        return ref.fail("instance " + ref.fn_name + " does not take " + what() +
                        " (a size it was not built for, a misaligned operand or a missing one)");
    }
    return ref.fail("instance " + ref.fn_name + " failed to launch (code " + std::to_string(rc) + ")", ORT_FAIL);
}

// Launch the node's instance on `args` on the session's compute stream (no stream in an emulated build). `what()`
// describes the operands for the message when the instance refuses them (GTCO_EBADSHAPE: a size it was not built
// for, a misaligned pointer or stride, an operand it expects missing). It is a callable, called on that failure
// only: the success path of a call builds no string (CUDA graph capture, ORT's enable_cuda_graph, wants a launch
// path with no avoidable host work; see also launch.cuh).
template <class Args, class Describe>
OrtStatus* run_instance(Ort::KernelContext& ctx, const NodeRef& ref, const Args& args, const Describe& what) {
    static_assert(std::is_invocable_r_v<std::string, const Describe&>,
                  "run_instance: describe the operands with a callable (a lambda), built on failure only");
    if (ref.fn == nullptr) return ref.fail("no device instance was chosen for this node", ORT_FAIL);
    return instance_status(ref, launch_instance(ctx, ref, args), what);
}

// The instance of `spec` for this process's device (the kernel is created on the thread and device of its session).
inline void choose_instance(const NodeSpec& spec, NodeRef& ref) {
    const int cc = gtco_device_cc();
    const int slot = arch_slot(cc);
    if (cc < 0) {
        throw std::runtime_error("the CUDA runtime cannot query the device (cudaError " + std::to_string(-cc) + ")");
    }
    if (slot < 0 || spec.cuda_fn[slot] == nullptr) {
        throw std::runtime_error("no instance for this GPU (compute capability " + std::to_string(cc / 10) + "." +
                                 std::to_string(cc % 10) + "); the library was built for sm_80 (8.x) and sm_90 (9.x)");
    }
    for (int e = 0; e < spec.n_dispatch; ++e) {
        if (spec.dispatch[e].fn[slot] == nullptr) {
            throw std::runtime_error("dispatch entry " + std::to_string(e) + " has no instance for this GPU");
        }
    }
    ref.slot = slot;
    ref.pdl = cc >= 90 && spec.pdl[slot];
    ref.fn = spec.cuda_fn[slot];
    ref.fn_name = spec.cuda_name[slot] ? spec.cuda_name[slot] : "?";
}

// Size of input `input` along `axis` (negative: from the end) in this call; -1 when it has no such input or axis.
inline int64_t dim_of(Ort::KernelContext& ctx, int input, int axis) {
    if (input < 0 || static_cast<size_t>(input) >= ctx.GetInputCount()) return -1;
    Ort::ConstValue v = ctx.GetInput(static_cast<size_t>(input));
    if (v == nullptr) return -1;
    const std::vector<int64_t> shape = v.GetTensorTypeAndShapeInfo().GetShape();
    const int rank = static_cast<int>(shape.size());
    const int a = axis < 0 ? axis + rank : axis;
    return a >= 0 && a < rank ? shape[static_cast<size_t>(a)] : -1;
}

// The declared ranges of the node's symbolic dims: an error naming the dim, its value and the range, or nullptr.
inline OrtStatus* check_ranges(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec) {
    for (int r = 0; r < spec.n_ranges; ++r) {
        const DimRange& d = spec.ranges[r];
        const int64_t got = dim_of(ctx, d.input, d.axis);
        if (got >= 0 && (got < d.lo || got > d.hi)) {
            return ref.fail(std::string("dim '") + d.dim + "' is " + std::to_string(got) + " (input " +
                            std::to_string(d.input) + " axis " + std::to_string(d.axis) +
                            "), outside the declared range " + d.dim + "=" + std::to_string(d.lo) + ":" +
                            std::to_string(d.hi) + " the model was optimized for (gtco.dynamic; optimize it again "
                            "with a wider --dynamic range)");
        }
    }
    return nullptr;
}

// The dispatch entry a call launches: the first whose max_extent is at least the call's extent.
inline int dispatch_entry(Ort::KernelContext& ctx, const NodeSpec& spec) {
    int64_t extent = 1;
    for (int i = 0; i < spec.n_extent; ++i) {
        const int64_t d = dim_of(ctx, spec.extent[i].input, spec.extent[i].axis);
        extent *= d > 0 ? d : 1;
    }
    int e = 0;
    while (e + 1 < spec.n_dispatch && spec.dispatch[e].max_extent < extent) ++e;
    return e;
}

// The kernel of one node: Family::Kernel<D, Cuda> holds the attributes and does the work.
template <class Family, DType D, bool Cuda>
struct FusedKernel {
    NodeRef ref;
    const NodeSpec* spec;
    typename Family::Attrs attrs;
    std::vector<NodeRef> entries;  // a device kernel's NodeRef per dispatch entry, made once (no copy per call)
    NodeRef fallback;              // the NodeRef launching the slot's fallback instance (ref.fallback points here)
    std::atomic<bool> fell_back{false};  // ref.fell_back points here

    // pdl_allowed: the session's gtco.pdl (FusedOp::pdl_allowed).
    FusedKernel(const OrtKernelInfo* info, const std::string& op_type, const NodeSpec* s, bool pdl_allowed = true)
        : spec(s), attrs(Family::read_attrs(info)) {
        ref.op_type = op_type;
        ref.node = Ort::ConstKernelInfo(info).GetNodeName();
        if (!Cuda) return;
        choose_instance(*spec, ref);
        ref.pdl = ref.pdl && pdl_allowed;
        for (int e = 0; e < spec->n_dispatch; ++e) {  // no fallback: see NodeSpec::fallback_fn
            NodeRef at = ref;
            at.fn = spec->dispatch[e].fn[ref.slot];
            at.fn_name = spec->dispatch[e].name[ref.slot] ? spec->dispatch[e].name[ref.slot] : "?";
            entries.push_back(std::move(at));
        }
        if (spec->n_dispatch == 0 && spec->fallback_fn[ref.slot] != nullptr) {
            fallback = ref;
            fallback.fn = spec->fallback_fn[ref.slot];
            fallback.fn_name = spec->fallback_name[ref.slot] ? spec->fallback_name[ref.slot] : "?";
            fallback.pdl = false;  // NodeSpec::pdl is the cuBLASLt instance's, which never launches with PDL
            ref.fallback = &fallback;
            ref.fell_back = &fell_back;
        }
    }
    // ref points into the object: never copied or moved (ORT holds it by pointer from CreateKernelV2 on)
    FusedKernel(const FusedKernel&) = delete;
    FusedKernel& operator=(const FusedKernel&) = delete;

    OrtStatusPtr ComputeV2(OrtKernelContext* context) {
        try {
            Ort::KernelContext ctx(context);
            if (ctx.GetInputCount() != static_cast<size_t>(spec->n_inputs) ||
                ctx.GetOutputCount() != static_cast<size_t>(spec->n_outputs)) {
                std::ostringstream m;
                m << "has " << ctx.GetInputCount() << " inputs and " << ctx.GetOutputCount()
                  << " outputs; the library was built for " << spec->n_inputs << " and " << spec->n_outputs;
                return ref.fail(m.str());
            }
            if (OrtStatus* st = check_ranges(ctx, ref, *spec)) return st;
            if (Cuda && spec->n_dispatch > 0) {  // a dynamic node: the entry for this call's extent
                const int e = dispatch_entry(ctx, *spec);
                if (spec->launches != nullptr) spec->launches[e].fetch_add(1, std::memory_order_relaxed);
                return Family::template compute<D, Cuda>(ctx, entries[static_cast<size_t>(e)], *spec, attrs);
            }
            return Family::template compute<D, Cuda>(ctx, ref, *spec, attrs);
        } catch (const Ort::Exception& e) {
            return ref.fail(e.what(), e.GetOrtErrorCode());
        } catch (const std::exception& e) {
            return ref.fail(e.what(), ORT_FAIL);
        }
    }
};

// any_output_type: the op's outputs are declared of any type, not of D, for an op type one of whose nodes writes
// another dtype (a half GEMM writing an fp32 graph output). ORT's type inference for custom ops gives up on a
// variadic output that is not homogeneous, so each node's output type is the one the model declares for it
// (graph outputs and value_info; the rewritten model records both), and the kernel reads it from its KernelInfo.
template <class Family, DType D, bool Cuda>
struct FusedOp : Ort::CustomOpBase<FusedOp<Family, D, Cuda>, FusedKernel<Family, D, Cuda>, true> {
    using Kernel = FusedKernel<Family, D, Cuda>;
    std::string name;
    bool any_output_type = false;
    // Whether this op's kernels may launch with PDL: false in the ops registered for sessions whose config has
    // gtco.pdl=0 (register.inc registers a second set of op objects for them).
    bool pdl_allowed = true;

    explicit FusedOp(std::string op_type, bool any_output = false)
        : name(std::move(op_type)), any_output_type(any_output) {}

    OrtStatusPtr CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info, void** kernel) const {
        std::string node = "?";
        try {
            node = Ort::ConstKernelInfo(info).GetNodeName();
            const NodeSpec* spec = find_node(name, node);
            if (spec == nullptr) {
                return make_status(ORT_INVALID_GRAPH,
                                   name + " node '" + node + "' is not a node this gtco library was built for "
                                   "(rebuild it for this model with onnx_gtco.plugin.library.build_library, or set the "
                                   "session config entry gtco.register=none to run the model-local functions)");
            }
            *kernel = new Kernel(info, name, spec, pdl_allowed);
            return nullptr;
        } catch (const Ort::Exception& e) {
            return make_status(e.GetOrtErrorCode(), name + " node '" + node + "': " + e.what());
        } catch (const std::exception& e) {
            return make_status(ORT_FAIL, name + " node '" + node + "': " + e.what());
        }
    }

    const char* GetName() const { return name.c_str(); }
    const char* GetExecutionProviderType() const {
        return Cuda ? GTCO_DEVICE_EP : "CPUExecutionProvider";
    }

    size_t GetInputTypeCount() const { return 1; }
    ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
    OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const {
        return OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_VARIADIC;
    }
    int GetVariadicInputMinArity() const { return 1; }
    bool GetVariadicInputHomogeneity() const { return false; }

    size_t GetOutputTypeCount() const { return 1; }
    ONNXTensorElementDataType GetOutputType(size_t) const {
        return any_output_type ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : Storage<D>::onnx;
    }
    OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const {
        return OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_VARIADIC;
    }
    int GetVariadicOutputMinArity() const { return 1; }
    bool GetVariadicOutputHomogeneity() const { return !any_output_type; }
};

// Attribute readers that return the default when the node lacks the attribute or has another type.
inline bool attr_int(const OrtKernelInfo* info, const char* name, int64_t& out) {
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &out);
    if (st == nullptr) return true;
    Ort::GetApi().ReleaseStatus(st);
    return false;
}
inline bool attr_float(const OrtKernelInfo* info, const char* name, float& out) {
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &out);
    if (st == nullptr) return true;
    Ort::GetApi().ReleaseStatus(st);
    return false;
}
// An ints attribute; false when absent or of another type (e.g. strings for symbolic dims).
inline bool attr_ints(const OrtKernelInfo* info, const char* name, std::vector<int64_t>& out) {
    size_t size = 0;
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
    if (st != nullptr) {
        Ort::GetApi().ReleaseStatus(st);
        return false;
    }
    out.assign(size, 0);
    if (size == 0) return true;
    st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, out.data(), &size);
    if (st != nullptr) {
        Ort::GetApi().ReleaseStatus(st);
        out.clear();
        return false;
    }
    out.resize(size);
    return true;
}

inline std::string attr_string(const OrtKernelInfo* info, const char* name, const std::string& def) {
    size_t size = 0;
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
    if (st != nullptr) {
        Ort::GetApi().ReleaseStatus(st);
        return def;
    }
    std::string out(size, '\0');
    st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, &out[0], &size);
    if (st != nullptr) {
        Ort::GetApi().ReleaseStatus(st);
        return def;
    }
    if (!out.empty() && out.back() == '\0') out.pop_back();
    return out;
}

}  // namespace gtco
