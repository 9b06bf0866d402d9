// The Elementwise family's ORT glue: op types Elementwise_f32 / Elementwise_f16 / Elementwise_bf16 (a chain or tree
// of elementwise ops, one fp32 expression per element with numpy broadcasting of the inputs).
//
// Node attributes (onnx_gtco/families/elementwise/rule.py): ops, precision; nothing the kernel needs. The program is
// built per node at build time (onnx_gtco/families/elementwise/bind.py) for the static shapes of its inputs, so the
// generated glue carries per node a gtco::ElementwiseNode (NodeSpec::node_data): the shapes and dtypes of every node
// input and output as built, the element count, and the program's host function. Roles come from the generated
// node table: kernel input i reads node input in[i], kernel output j writes node output out[j]; a scalar constant
// input is folded into the program and read by no role (its shape and dtype are still checked).
//
// CPU EP: the node's host function (onnx_gtco/families/elementwise/kernel.py ElementwiseFamily.host_function over
// plugins/families/elementwise/elementwise_ref.h). Device: the node's instance (elementwise/elementwise.cuh), built for the same program.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "elementwise/elementwise_args.h"
#include "elementwise/elementwise_ref.h"
#include "gtco_ort.h"
#include "parallel.h"

namespace gtco {

// What the library was built for, per Elementwise node (generated; see bind_elementwise.py).
struct ElementwiseNode {
    ref::ew::HostFn run;                      // the program on the host, over elements [begin, end)
    int64_t n;                                // elements of the iteration shape (0 for a program over run-time shapes)
    const ONNXTensorElementDataType* types;   // per node input
    const int* ranks;                         // per node input, then per node output
    const int64_t* dims;                      // their dims, concatenated in that order (< 0: symbol -1 - dim)
    // A program over run-time shapes (symbolic dims; n_symbols > 0, else the rest is unused): the symbols' names, the
    // iteration dims, the end of each collapsed dim's run of them (rank runs), each kernel input's tensor shape
    // (source_ranks dims each, concatenated) and per iteration dim the dim of that tensor it walks (-1: broadcast),
    // dims encoded as above (onnx_gtco/ir/elementwise.py RuntimeSpec).
    int n_symbols = 0;
    const char* const* symbols = nullptr;
    int iteration_rank = 0;
    const int64_t* iteration = nullptr;
    int rank = 0;
    const int* groups = nullptr;
    int n_kernel_inputs = 0;
    const int* source_ranks = nullptr;
    const int64_t* sources = nullptr;
    const int* perms = nullptr;
};

// The collapsed dims and each kernel input's strides of one call of a program over run-time shapes, into `args`:
// a collapsed dim is the product of its run of iteration dims, an input's stride over it the dense stride in its
// tensor of the dim it walks at the innermost iteration dim of the run larger than 1 (0 where it broadcasts). `sym`
// holds each symbol's size in this call.
inline void runtime_dims(const ElementwiseNode& node, const int64_t* sym, GtcoElementwiseArgs& args) {
    auto size = [sym](int64_t d) { return d >= 0 ? d : sym[-1 - d]; };
    const int r = node.iteration_rank;
    int64_t n = 1;
    int begin = 0;
    for (int c = 0; c < node.rank; ++c) {
        int64_t d = 1;
        for (int j = begin; j < node.groups[c]; ++j) d *= size(node.iteration[j]);
        args.dims[c] = d;
        n *= d;
        begin = node.groups[c];
    }
    args.n = n;
    const int64_t* source = node.sources;
    for (int i = 0; i < node.n_kernel_inputs && i < GTCO_EW_MAX_IN; ++i) {
        const int sr = node.source_ranks[i];
        const int* perm = node.perms + static_cast<ptrdiff_t>(i) * r;
        int64_t dense[GTCO_EW_MAX_RANK] = {};  // the tensor's own dense strides, 0 along its dims of 1
        int64_t acc = 1;
        for (int k = sr - 1; k >= 0; --k) {
            const int64_t d = size(source[k]);
            dense[k] = d == 1 ? 0 : acc;
            acc *= d;
        }
        begin = 0;
        for (int c = 0; c < node.rank; ++c) {
            args.strides[i][c] = 0;
            for (int j = node.groups[c] - 1; j >= begin; --j) {
                if (size(node.iteration[j]) > 1) {
                    args.strides[i][c] = perm[j] >= 0 ? dense[perm[j]] : 0;
                    break;
                }
            }
            begin = node.groups[c];
        }
        source += sr;
    }
}

struct Elementwise {
    struct Attrs {};

    static Attrs read_attrs(const OrtKernelInfo*) { return Attrs{}; }

    static constexpr int kMaxSymbols = 16;

    static std::string describe(ONNXTensorElementDataType type, const std::vector<int64_t>& shape) {
        return std::string(type_str(type)) + " " + shape_str(shape);
    }
    // node input i as built: its dtype and dims, a symbol by its name
    static std::string built_shape(const ElementwiseNode& node, size_t i, const std::vector<int64_t>& dims) {
        std::string s = std::string(type_str(node.types[i])) + " [";
        for (size_t j = 0; j < dims.size(); ++j) {
            s += j ? "," : "";
            s += dims[j] >= 0 ? std::to_string(dims[j]) : std::string(node.symbols[-1 - dims[j]]);
        }
        return s + "]";
    }

    template <DType D, bool Cuda>
    static OrtStatus* compute(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs&) {
        using T = typename Storage<D>::type;
        const auto* node = static_cast<const ElementwiseNode*>(spec.node_data);
        if (node == nullptr) return ref.fail("the library has no description of this node (node_data)", ORT_FAIL);
        const int64_t* dims = node->dims;
        auto next_shape = [&dims](int rank) {
            std::vector<int64_t> s(dims, dims + rank);
            dims += rank;
            return s;
        };
        std::vector<Input> ins(static_cast<size_t>(spec.n_inputs));
        std::vector<std::vector<int64_t>> want(static_cast<size_t>(spec.n_inputs));
        // a program over run-time shapes: each symbol's size in this call, from the first input dim naming it
        int64_t sym[kMaxSymbols];
        std::fill(sym, sym + kMaxSymbols, int64_t{-1});
        bool ok = node->n_symbols <= kMaxSymbols;
        for (int i = 0; i < spec.n_inputs; ++i) {
            const size_t u = static_cast<size_t>(i);
            ins[u] = get_input(ctx, i);
            want[u] = next_shape(node->ranks[i]);
            ok = ok && ins[u].present && ins[u].type == node->types[i] && ins[u].shape.size() == want[u].size();
            for (size_t j = 0; ok && j < want[u].size(); ++j) {
                const int64_t d = want[u][j], got = ins[u].shape[j];
                if (d >= 0) {
                    ok = got == d;
                } else if (sym[-1 - d] < 0) {
                    sym[-1 - d] = got;
                } else {
                    ok = sym[-1 - d] == got;
                }
            }
        }
        for (int k = 0; ok && k < node->n_symbols; ++k) ok = sym[k] >= 0;
        // the operands as the call gives them, for messages only (no string on the success path)
        auto got = [&] {
            std::string s;
            for (size_t i = 0; i < ins.size(); ++i)
                s += (i ? ", " : "") + (ins[i].present ? describe(ins[i].type, ins[i].shape) : "(missing)");
            return "inputs " + s;
        };
        if (!ok) {
            std::string built;
            for (size_t i = 0; i < ins.size(); ++i) built += (i ? ", " : "") + built_shape(*node, i, want[i]);
            return ref.fail(got() + "; the kernel was built for " + built +
                            (node->n_symbols ? " (each named dim one size in a call)"
                                             : " (the elementwise program is generated per static shape)"));
        }
        std::vector<void*> outs(static_cast<size_t>(spec.n_outputs));
        for (int k = 0; k < spec.n_outputs; ++k) {
            std::vector<int64_t> shape = next_shape(node->ranks[spec.n_inputs + k]);
            for (int64_t& d : shape) d = d >= 0 ? d : sym[-1 - d];
            outs[static_cast<size_t>(k)] =
                ctx.GetOutput(static_cast<size_t>(k), shape).template GetTensorMutableData<T>();
        }
        GtcoElementwiseArgs args{};
        for (int r = 0; r < GTCO_EW_MAX_IN && r < kMaxRoles; ++r)
            if (spec.in[r] >= 0) args.in[r] = ins[static_cast<size_t>(spec.in[r])].data;
        for (int r = 0; r < GTCO_EW_MAX_OUT && r < kMaxRoles; ++r)
            if (spec.out[r] >= 0) args.out[r] = outs[static_cast<size_t>(spec.out[r])];
        args.n = node->n;
        if (node->n_symbols > 0) runtime_dims(*node, sym, args);
        if (args.n == 0) return nullptr;  // empty outputs: nothing to compute
        if (Cuda) return run_instance(ctx, ref, args, got);
        if (node->run == nullptr) return ref.fail("the library has no host function for this node", ORT_FAIL);
        const uint64_t n = static_cast<uint64_t>(args.n);
        constexpr int64_t kChunk = 1 << 14;
        const int64_t threads = gtco::ref::worth_threads((args.n + kChunk - 1) / kChunk, args.n * 16);
        gtco::ref::parallel_for(threads, [&](int64_t t) {
            const uint64_t per = (n + static_cast<uint64_t>(threads) - 1) / static_cast<uint64_t>(threads);
            const uint64_t begin = std::min(n, per * static_cast<uint64_t>(t));
            node->run(&args, begin, std::min(n, begin + per));
        });
        return nullptr;
    }
};

}  // namespace gtco
