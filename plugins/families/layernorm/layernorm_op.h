// The LayerNorm family's ORT glue: op types Layernorm_f32 / Layernorm_f16 / Layernorm_bf16.
//
// Node attributes (onnx_gtco/families/layernorm/rule.py): epsilon (float), axis (negative int: the normalised trailing
// axes start there), hidden (int, or the string "?" when the optimizer saw a symbolic size), residual, affine,
// decomposed (ints), precision (string). The roles of the node's inputs and outputs come from the generated node
// table (library.py works them out from the node's model-local function).
//
// CPU EP: plugins/families/layernorm/layernorm_ref.h. Device: the node's LayerNorm instance (layernorm/layernorm.cuh), built for the
// node's hidden size with its residual / residual-sum / gamma / beta operands; gamma and beta must have hidden
// elements (the reference also takes a scalar).
#pragma once

#include "layernorm/layernorm_args.h"
#include "gtco_ort.h"
#include "layernorm/layernorm_ref.h"

namespace gtco {

// The op of both normalisations: LayerNorm (CENTER) and, without the mean, RMSNorm (rmsnorm/rmsnorm_op.h: its
// roles are the first three of these; a node without beta leaves IN_BETA at -1).
template <bool CENTER>
struct NormGlue {
    enum InRole { IN_A = 0, IN_B = 1, IN_GAMMA = 2, IN_BETA = 3 };   // IN_A: x, or the residual Add's first addend
    enum OutRole { OUT_Y = 0, OUT_SUM = 1 };                          // OUT_SUM: the residual sum, when read outside

    struct Attrs {
        float epsilon = 1e-5f;
        int64_t axis = -1;
        int64_t hidden = -1;  // -1: not known when the library was built (symbolic); any size is then accepted
        int64_t residual = 0;
        int64_t affine = 0;
        std::string precision;
    };

    static Attrs read_attrs(const OrtKernelInfo* info) {
        Attrs a;
        attr_float(info, "epsilon", a.epsilon);
        attr_int(info, "axis", a.axis);
        if (!attr_int(info, "hidden", a.hidden) || a.hidden <= 0) a.hidden = -1;
        attr_int(info, "residual", a.residual);
        attr_int(info, "affine", a.affine);
        a.precision = attr_string(info, "precision", "fp32");
        return a;
    }

    template <DType D, bool Cuda>
    static OrtStatus* compute(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at) {
        using S = Storage<D>;
        using T = typename S::type;
        const Input a = get_input(ctx, spec.in[IN_A]);
        const Input b = get_input(ctx, spec.in[IN_B]);
        const Input gamma = get_input(ctx, spec.in[IN_GAMMA]);
        const Input beta = get_input(ctx, spec.in[IN_BETA]);
        if (!a.present) return ref.fail("input x is missing");
        for (const Input* t : {&a, &b, &gamma, &beta}) {
            if (t->present && t->type != S::onnx) {
                return ref.fail(std::string("input of type ") + type_str(t->type) + " " + shape_str(t->shape) +
                                "; this kernel takes " + S::name + " only");
            }
        }
        const int64_t rank = static_cast<int64_t>(a.shape.size());
        const int64_t axis = at.axis < 0 ? at.axis + rank : at.axis;
        if (axis < 0 || axis >= rank) {
            return ref.fail("input x " + shape_str(a.shape) + " has no axis " + std::to_string(at.axis) +
                            " to normalise from");
        }
        int64_t hidden = 1;
        for (int64_t i = axis; i < rank; ++i) hidden *= a.shape[static_cast<size_t>(i)];
        if (at.hidden > 0 && hidden != at.hidden) {
            return ref.fail("input x " + shape_str(a.shape) + " normalises " + std::to_string(hidden) +
                            " elements per row; the kernel was built for hidden=" + std::to_string(at.hidden));
        }
        if (b.present && b.shape != a.shape) {
            return ref.fail("residual addends have shapes " + shape_str(a.shape) + " and " + shape_str(b.shape) +
                            "; they must be equal");
        }
        for (const Input* t : {&gamma, &beta}) {
            if (t->present && t->numel() != hidden && t->numel() != 1) {
                return ref.fail(std::string(t == &gamma ? "scale" : "bias") + " of shape " + shape_str(t->shape) +
                                " does not match the " + std::to_string(hidden) + " normalised elements of x " +
                                shape_str(a.shape));
            }
        }
        const int64_t rows = hidden > 0 ? a.numel() / hidden : 0;
        T* y = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_Y]), a.shape).template GetTensorMutableData<T>();
        T* sum = nullptr;
        if (spec.out[OUT_SUM] >= 0) {
            sum = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_SUM]), a.shape).template GetTensorMutableData<T>();
        }
        if (Cuda) {
            for (const Input* g : {&gamma, &beta}) {
                if (g->present && g->numel() != hidden) {
                    return ref.fail(std::string(g == &gamma ? "scale " : "bias ") + shape_str(g->shape) +
                                    ": the device kernel takes " + std::to_string(hidden) + " elements");
                }
            }
            if (hidden > INT32_MAX) return ref.fail("hidden size " + std::to_string(hidden) + " is too large");
            GtcoLayerNormArgs args{a.data, b.data, gamma.data, beta.data, y, sum, rows,
                                   static_cast<int32_t>(hidden), at.epsilon};
            return run_instance(ctx, ref, args, [&] { return "x " + shape_str(a.shape); });
        }
        ref::layernorm<T>(static_cast<const T*>(a.data), static_cast<const T*>(b.data),
                          static_cast<const T*>(gamma.data), gamma.numel(), static_cast<const T*>(beta.data),
                          beta.numel(), y, sum, rows, hidden, at.epsilon, S::load, S::store, CENTER);
        return nullptr;
    }
};

struct LayerNorm : NormGlue<true> {};

}  // namespace gtco
