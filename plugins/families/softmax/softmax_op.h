// The Softmax family's ORT glue: op types Softmax_f32 / Softmax_f16 / Softmax_bf16 (one Softmax over the last axis).
//
// Node attributes (onnx_gtco/families/softmax/rule.py): axis (-1), rows, cols (ints, or strings for symbolic sizes),
// precision. Roles come from the generated node table: input IN_X, output OUT_Y.
//
// CPU EP: plugins/families/softmax/softmax_ref.h. Device: the node's Softmax instance (softmax/softmax.cuh), built for its row
// length, without scale or mask (a fused node's softmax has neither).
#pragma once

#include "softmax/softmax_args.h"
#include "gtco_ort.h"
#include "softmax/softmax_ref.h"

namespace gtco {

struct Softmax {
    enum InRole { IN_X = 0 };
    enum OutRole { OUT_Y = 0 };

    struct Attrs {
        int64_t cols = -1;  // -1: symbolic when the library was built; any size is then accepted
    };

    static Attrs read_attrs(const OrtKernelInfo* info) {
        Attrs a;
        if (!attr_int(info, "cols", a.cols) || a.cols <= 0) a.cols = -1;
        return a;
    }

    template <DType D, bool Cuda>
    static OrtStatus* compute(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at) {
        using S = Storage<D>;
        using T = typename S::type;
        const Input x = get_input(ctx, spec.in[IN_X]);
        if (!x.present) return ref.fail("input x is missing");
        if (x.type != S::onnx) {
            return ref.fail(std::string("input of type ") + type_str(x.type) + " " + shape_str(x.shape) +
                            "; this kernel takes " + S::name + " only");
        }
        if (x.shape.empty()) return ref.fail("input x is a scalar; Softmax needs at least one axis");
        const int64_t cols = x.shape.back();
        if (at.cols > 0 && cols != at.cols) {
            return ref.fail("input x " + shape_str(x.shape) + " has rows of " + std::to_string(cols) +
                            " elements; the kernel was built for cols=" + std::to_string(at.cols));
        }
        const int64_t rows = cols > 0 ? x.numel() / cols : 0;
        T* y = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_Y]), x.shape).template GetTensorMutableData<T>();
        if (Cuda) {
            if (cols > INT32_MAX) return ref.fail("rows of " + std::to_string(cols) + " elements are too long");
            GtcoSoftmaxArgs args{x.data, nullptr, y, rows, static_cast<int32_t>(cols), 1.0f, 1, 1, 1};
            return run_instance(ctx, ref, args, [&] { return "x " + shape_str(x.shape); });
        }
        ref::softmax<T>(static_cast<const T*>(x.data), y, rows, cols, S::load, S::store);
        return nullptr;
    }
};

}  // namespace gtco
