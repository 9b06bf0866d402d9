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
    int64_t n;                                // elements of the iteration shape
    const ONNXTensorElementDataType* types;   // per node input
    const int* ranks;                         // per node input, then per node output
    const int64_t* dims;                      // their dims, concatenated in that order
};

struct Elementwise {
    struct Attrs {};

    static Attrs read_attrs(const OrtKernelInfo*) { return Attrs{}; }

    static std::string describe(ONNXTensorElementDataType type, const std::vector<int64_t>& shape) {
        return std::string(type_str(type)) + " " + shape_str(shape);
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
        bool ok = true;
        for (int i = 0; i < spec.n_inputs; ++i) {
            const size_t u = static_cast<size_t>(i);
            ins[u] = get_input(ctx, i);
            want[u] = next_shape(node->ranks[i]);
            ok = ok && ins[u].present && ins[u].type == node->types[i] && ins[u].shape == want[u];
        }
        // the operands as the call gives them, for messages only (no string on the success path)
        auto got = [&] {
            std::string s;
            for (size_t i = 0; i < ins.size(); ++i)
                s += (i ? ", " : "") + (ins[i].present ? describe(ins[i].type, ins[i].shape) : "(missing)");
            return "inputs " + s;
        };
        if (!ok) {
            std::string built;
            for (size_t i = 0; i < ins.size(); ++i) built += (i ? ", " : "") + describe(node->types[i], want[i]);
            return ref.fail(got() + "; the kernel was built for " + built +
                            " (the elementwise program is generated per static shape)");
        }
        std::vector<void*> outs(static_cast<size_t>(spec.n_outputs));
        for (int k = 0; k < spec.n_outputs; ++k) {
            const std::vector<int64_t> shape = next_shape(node->ranks[spec.n_inputs + k]);
            outs[static_cast<size_t>(k)] =
                ctx.GetOutput(static_cast<size_t>(k), shape).template GetTensorMutableData<T>();
        }
        GtcoElementwiseArgs args{};
        for (int r = 0; r < GTCO_EW_MAX_IN && r < kMaxRoles; ++r)
            if (spec.in[r] >= 0) args.in[r] = ins[static_cast<size_t>(spec.in[r])].data;
        for (int r = 0; r < GTCO_EW_MAX_OUT && r < kMaxRoles; ++r)
            if (spec.out[r] >= 0) args.out[r] = outs[static_cast<size_t>(spec.out[r])];
        args.n = node->n;
        if (Cuda) return run_instance(ctx, ref, args, got);
        if (node->run == nullptr) return ref.fail("the library has no host function for this node", ORT_FAIL);
        const uint64_t n = static_cast<uint64_t>(node->n);
        constexpr int64_t kChunk = 1 << 14;
        const int64_t threads = gtco::ref::worth_threads((node->n + kChunk - 1) / kChunk, node->n * 16);
        gtco::ref::parallel_for(threads, [&](int64_t t) {
            const uint64_t per = (n + static_cast<uint64_t>(threads) - 1) / static_cast<uint64_t>(threads);
            const uint64_t begin = std::min(n, per * static_cast<uint64_t>(t));
            node->run(&args, begin, std::min(n, begin + per));
        });
        return nullptr;
    }
};

}  // namespace gtco
