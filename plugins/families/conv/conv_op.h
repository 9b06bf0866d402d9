// The Conv family's ORT glue: op types Conv_f32 / Conv_f16 / Conv_bf16.
//
//     y = post_act(act(affine(conv(x, w) + bias)) + residual)
//
// affine is v * scale + shift (either alone), or with batchnorm=1 (v - mean) * scale / sqrt(var + epsilon) + shift.
// Node attributes (onnx_gtco/families/conv/rule.py): kernel, stride, pads, dilations (ints, ONNX Conv's), auto_pad
// (ONNX Conv's string: SAME_UPPER / SAME_LOWER pads come from x's shape on every run, for both EPs), groups,
// bias, scale, shift, batchnorm, residual (ints: whether the node has that operand), epsilon (float), activation,
// post_activation (strings, names of onnx_gtco/patterns/_act.py), precision. Roles come from the generated node
// table (onnx_gtco/families/conv/bind.py). Inputs the group swallowed that are no role (the constants of a
// decomposed activation) are not read: the binder checked, at build time, that the chain computes the named one.
//
// CPU EP: plugins/families/conv/conv_ref.h (the per-channel constants are folded into fp32 per-channel a, b here). Device:
// the node's instance (conv/conv.cuh: the implicit GEMM for groups == 1, the direct kernel for grouped and depthwise
// convs) with ConvArgs filled from the same plan; it folds the constants itself, in its epilogue, reading them from
// device memory (one value or one per channel: a step of 0 or 1). It takes what the reference takes.
#pragma once

#include "conv/conv_args.h"
#include "conv/conv_ref.h"
#include "gtco_ort.h"

namespace gtco {

struct Conv {
    enum InRole { IN_X = 0, IN_W, IN_BIAS, IN_SCALE, IN_SHIFT, IN_MEAN, IN_VAR, IN_RESIDUAL };
    enum OutRole { OUT_Y = 0 };

    struct Attrs {
        std::vector<int64_t> kernel, stride, pads, dilations;
        int64_t groups = 1, bias = 0, scale = 0, shift = 0, batchnorm = 0, residual = 0;
        float epsilon = 1e-5f;
        std::string activation, post_activation, auto_pad;
        bool acts_known = false, pad_known = false;
        ref::Act act = ref::Act::kNone, post_act = ref::Act::kNone;
        ref::AutoPad pad_mode = ref::AutoPad::kNotSet;
    };

    static Attrs read_attrs(const OrtKernelInfo* info) {
        Attrs a;
        attr_ints(info, "kernel", a.kernel);
        attr_ints(info, "stride", a.stride);
        attr_ints(info, "pads", a.pads);
        attr_ints(info, "dilations", a.dilations);
        attr_int(info, "groups", a.groups);
        attr_int(info, "bias", a.bias);
        attr_int(info, "scale", a.scale);
        attr_int(info, "shift", a.shift);
        attr_int(info, "batchnorm", a.batchnorm);
        attr_int(info, "residual", a.residual);
        attr_float(info, "epsilon", a.epsilon);
        a.activation = attr_string(info, "activation", "none");
        a.post_activation = attr_string(info, "post_activation", "none");
        a.acts_known = ref::parse_act(a.activation, a.act) && ref::parse_act(a.post_activation, a.post_act);
        a.auto_pad = attr_string(info, "auto_pad", "NOTSET");
        a.pad_known = ref::parse_auto_pad(a.auto_pad, a.pad_mode);
        return a;
    }

    // Whether a per-channel operand agrees with the node's attribute and is one value or one per channel (`step`:
    // 0 or 1), else the error.
    static OrtStatus* check_channels(const NodeRef& ref, const Input& in, const char* role, bool wanted, int64_t oc,
                                     size_t rank, int64_t& step) {
        step = 0;
        if (wanted != in.present) {
            return ref.fail(std::string("the node's attributes ") + (wanted ? "name" : "rule out") + " a " + role +
                            " input but the node " + (in.present ? "has one" : "has none"));
        }
        if (in.present && !ref::plan_channels(in.shape, oc, rank, step)) {
            return ref.fail(std::string(role) + " " + shape_str(in.shape) + " is neither one value nor one per "
                            "output channel (" + std::to_string(oc) + ")");
        }
        return nullptr;
    }

    // A checked per-channel operand's values in fp32, read on the host (the CPU EP's tensors).
    template <DType D>
    static void channel_values(const Input& in, int64_t oc, int64_t step, std::vector<float>& out) {
        using S = Storage<D>;
        out.clear();
        if (!in.present) return;
        const auto* v = static_cast<const typename S::type*>(in.data);
        out.resize(static_cast<size_t>(step ? oc : 1));
        for (size_t i = 0; i < out.size(); ++i) out[i] = S::load(v[i]);
    }

    template <DType D, bool Cuda>
    static OrtStatus* compute(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at) {
        using S = Storage<D>;
        using T = typename S::type;
        {
            if (!at.acts_known) {
                return ref.fail("activation '" + at.activation + "' or '" + at.post_activation +
                                "' is not one this library implements", ORT_NOT_IMPLEMENTED);
            }
            if (!at.pad_known) {
                return ref.fail("auto_pad '" + at.auto_pad + "' is not one of ONNX Conv's", ORT_NOT_IMPLEMENTED);
            }
            Input in[IN_RESIDUAL + 1];
            static const char* const kNames[] = {"x", "w", "bias", "scale", "shift", "mean", "var", "residual"};
            for (int r = IN_X; r <= IN_RESIDUAL; ++r) {
                in[r] = get_input(ctx, spec.in[r]);
                if (in[r].present && in[r].type != S::onnx) {
                    return ref.fail(std::string("input ") + kNames[r] + " of type " + type_str(in[r].type) + " " +
                                    shape_str(in[r].shape) + "; this kernel takes " + S::name + " only");
                }
            }
            if (!in[IN_X].present || !in[IN_W].present) return ref.fail("input x or w is missing");
            ref::ConvPlan p;
            const std::string why = ref::plan_conv(in[IN_X].shape, in[IN_W].shape, at.kernel, at.stride, at.pads,
                                                   at.dilations, at.groups, p, at.pad_mode);
            if (!why.empty()) return ref.fail(why);
            const size_t rank = p.out_shape.size();
            int64_t steps[5] = {0, 0, 0, 0, 0};  // bias, scale, shift, mean, var
            const bool want[5] = {at.bias != 0, at.scale != 0, at.shift != 0, at.batchnorm != 0, at.batchnorm != 0};
            for (int i = 0; i < 5; ++i) {
                if (OrtStatus* st = check_channels(ref, in[IN_BIAS + i], kNames[IN_BIAS + i], want[i], p.oc, rank,
                                                   steps[i])) {
                    return st;
                }
            }
            const Input& res = in[IN_RESIDUAL];
            if ((at.residual != 0) != res.present) {
                return ref.fail(std::string("the node attribute residual=") + std::to_string(at.residual) +
                                " but the node " + (res.present ? "has" : "has no") + " residual input");
            }
            if (res.present && res.shape != p.out_shape) {
                return ref.fail("residual " + shape_str(res.shape) + " differs from the output shape " +
                                shape_str(p.out_shape));
            }
            if (spec.out[OUT_Y] < 0) return ref.fail("the node table binds no output y");
            T* y = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_Y]), p.out_shape).template GetTensorMutableData<T>();
            if constexpr (Cuda) {
                auto operands = [&] { return "x " + shape_str(in[IN_X].shape) + " and w " + shape_str(in[IN_W].shape); };
                ConvArgs args{};
                args.x = in[IN_X].data, args.w = in[IN_W].data, args.bias = in[IN_BIAS].data;
                args.scale = in[IN_SCALE].data, args.shift = in[IN_SHIFT].data, args.mean = in[IN_MEAN].data;
                args.var = in[IN_VAR].data, args.residual = res.data, args.y = y;
                args.n = p.n, args.c = p.c, args.in_h = p.h, args.in_w = p.w, args.oc = p.oc, args.kh = p.kh;
                args.kw = p.kw, args.oh = p.oh, args.ow = p.ow, args.stride_h = p.sh, args.stride_w = p.sw;
                args.pad_t = p.pad_t, args.pad_l = p.pad_l, args.dil_h = p.dh, args.dil_w = p.dw;
                args.groups = p.groups;  // the instance is the direct kernel where groups != 1
                args.bias_step = steps[0], args.scale_step = steps[1], args.shift_step = steps[2];
                args.mean_step = steps[3], args.var_step = steps[4];
                args.epsilon = at.epsilon;
                if (p.n * p.oh * p.ow == 0) return nullptr;  // an empty output: nothing to launch
                return run_instance(ctx, ref, args, operands);
            }
            std::vector<float> bias, vals[4];
            channel_values<D>(in[IN_BIAS], p.oc, steps[0], bias);
            for (int i = 0; i < 4; ++i) channel_values<D>(in[IN_SCALE + i], p.oc, steps[1 + i], vals[i]);
            const int64_t bias_step = steps[0];
            std::vector<float> bias_c(static_cast<size_t>(p.oc)), a, b;
            for (int64_t c = 0; c < p.oc; ++c) bias_c[static_cast<size_t>(c)] = bias.empty() ? 0.0f : bias[c * bias_step];
            ref::AffineIn aff;
            const float** ptrs[4] = {&aff.scale, &aff.shift, &aff.mean, &aff.var};
            int64_t* step_of[4] = {&aff.scale_step, &aff.shift_step, &aff.mean_step, &aff.var_step};
            for (int i = 0; i < 4; ++i) {
                *ptrs[i] = vals[i].empty() ? nullptr : vals[i].data();
                *step_of[i] = steps[1 + i];
            }
            ref::fold_affine(aff, at.batchnorm != 0, at.epsilon, p.oc, a, b);
            ref::ConvIO<T> io;
            io.x = static_cast<const T*>(in[IN_X].data);
            io.w = static_cast<const T*>(in[IN_W].data);
            io.residual = static_cast<const T*>(res.data);
            io.y = y;
            io.bias = bias_c.data(), io.a = a.data(), io.b = b.data();
            io.act = at.act, io.post_act = at.post_act;
            ref::conv(p, io, S::load, S::store);
            return nullptr;
        }
    }
};

}  // namespace gtco
