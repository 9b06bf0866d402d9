// The GEMM and QKV families' ORT glue: op types Gemm_f32 / Gemm_f16 / Gemm_bf16 and Qkv_f32 / Qkv_f16 / Qkv_bf16.
//
// A Gemm_f16 / Gemm_bf16 node whose output the model declares float (a graph output the conversion folded into it,
// onnx_gtco/precision.py) writes y, and reads its residual, in fp32: the reference stores fp32, the device path
// launches the instance built with out_dtype f32 (the build chose it from the same output type).
// Gemm node attributes (onnx_gtco/families/gemm/rule.py): m, n, k (ints, or strings such as "N*197" when the optimizer
// saw a symbolic size: then any size is accepted), batch (the output's batch dims of a batched GEMM; absent for a
// weight GEMM), trans_b, trans_a (Gemm's transA, absent when 0), alpha, beta (Gemm's, absent when 1), bias,
// residual, layer_scale (ints; layer_scale: LayerScale, a [N] factor per column after the activation, before the
// residual), activation (string, a name of onnx_gtco/patterns/_act.py), precision (string), layernorm (int) and
// gated (int: B interleaves a gated MLP's gate and up columns, y has N / 2 columns, act(gate) * up of each pair;
// families/gemm/rule.py GatedGemmPattern), epsilon (float): the LayerNorm over each row of y in the node
// (families/gemm/rule.py GemmLayerNormPattern), inputs
// gamma and beta [N], output norm = (y - mean) / sqrt(var + epsilon) * gamma + beta computed from y rounded to the
// node's dtype (what the unfused LayerNorm reads); y is then an output only where the model reads it.
// Qkv node attributes (onnx_gtco/families/gemm/qkv_rule.py): k, m, n_out (ints or strings), ns (ints: N of each
// projection, in output order), bias (int), precision.
// The roles of the node's inputs and outputs come from the generated node table (onnx_gtco/families/gemm/bind.py
// works them out from the node's model-local function). Inputs the group swallowed that are no role (the scalar
// constants of a decomposed activation, e.g. sqrt(2), 1, 0.5 of erf GELU) are not read: the binder checked, at
// build time, that the chain computes the named activation.
//
// CPU EP: plugins/families/gemm/gemm_ref.h. Device: the node's GEMM instance (gemm/gemm.cuh) with GemmArgs filled from the
// plan below. It takes what the reference takes except: a transposed A, a beta other than 1, a bias other
// than a row of N, and batch dims that do not step A and B by one stride each (a broadcast inner batch dim); those
// are run-time errors naming the shapes (the build gives such nodes no instance where it can tell). A Qkv node
// launches the one instance once per projection, with that projection's N. The instance may be a cuBLASLt one
// (gemm/cublaslt.h, the same entry-point ABI): where cuBLASLt cannot run, gemm_glue::run_gemm launches the node's mma
// fallback instead (NodeSpec::fallback_fn) and notes why once, or, without one, reports cuBLASLt's reason.
#pragma once

#include <atomic>
#include <cstdio>
#include <exception>
#include <string>

#include "gemm/gemm_args.h"
#include "gemm/gemm_ref.h"
#include "layernorm/layernorm_ref.h"
#include "gemm/cublaslt_shape.h"
#include "gtco_ort.h"

namespace gtco {

namespace gemm_glue {

// An int attribute that may be a symbolic size (a string): -1 when not a known positive size.
inline int64_t size_attr(const OrtKernelInfo* info, const char* name) {
    int64_t v = -1;
    if (!attr_int(info, name, v) || v < 0) return -1;
    return v;
}

template <DType D>
inline OrtStatus* check_type(const NodeRef& ref, const Input& t, const char* role) {
    using S = Storage<D>;
    if (t.present && t.type != S::onnx) {
        return ref.fail(std::string("input ") + role + " of type " + type_str(t.type) + " " + shape_str(t.shape) +
                        "; this kernel takes " + S::name + " only");
    }
    return nullptr;
}

// "m=197 (built for 196)" style check of one size attribute; nullptr when it matches or is unknown. `ctx()`
// describes the operands (a callable: built on failure only, like every message here).
template <class Describe>
inline OrtStatus* check_size(const NodeRef& ref, const char* what, int64_t got, int64_t built, const Describe& ctx) {
    if (built >= 0 && got != built) {
        return ref.fail(ctx() + " give " + what + "=" + std::to_string(got) + "; the kernel was built for " + what +
                        "=" + std::to_string(built));
    }
    return nullptr;
}

// GemmArgs sizes and batch strides of a planned GEMM for the device kernel (pointers left to the caller), or the
// error when the kernel cannot run it (see the top of this file).
template <class Describe>
inline OrtStatus* device_args(const NodeRef& ref, const ref::GemmPlan& p, bool trans_a, float alpha, float beta,
                              bool has_bias, int64_t bias_m, int64_t bias_n, const Describe& operands,
                              GemmArgs& args) {
    if (trans_a) return ref.fail("the device kernel reads A row-major; this node transposes A (" + operands() + ")");
    if (beta != 1.0f) {
        return ref.fail("the device kernel does not scale the bias (beta=" + std::to_string(beta) + ")");
    }
    if (has_bias && (bias_m != 1 || bias_n != p.n)) {
        return ref.fail("the device kernel adds a bias row of N=" + std::to_string(p.n) + "; this bias is [" +
                        std::to_string(bias_m) + ", " + std::to_string(bias_n) + "] over " + operands());
    }
    // one stride per operand: entry e of A (B) starts at e * stride (B may be shared: stride 0)
    auto stride = [&](const std::vector<int64_t>& off, int64_t& s) {
        s = off.size() > 1 ? off[1] - off[0] : 0;
        for (size_t e = 0; e < off.size(); ++e) {
            if (off[e] != static_cast<int64_t>(e) * s) return false;
        }
        return true;
    };
    int64_t sa = 0, sb = 0;
    if (!stride(p.a_off, sa) || !stride(p.b_off, sb) || (p.batch > 1 && sa == 0)) {
        return ref.fail(operands() + ": the batch dims broadcast in a way the device kernel cannot stride (it "
                        "steps A per batch entry and B per entry or not at all)");
    }
    args.batch = p.batch, args.m = p.m, args.n = p.n, args.k = p.k;
    args.stride_a = p.batch > 1 ? sa : p.m * p.k;
    args.stride_b = sb;
    args.stride_y = p.m * p.n;
    args.alpha = alpha;
    return nullptr;
}

// The one warning (ORT's logger, the session's; stderr where that fails) that a node's cuBLASLt instance could not
// run and the node runs its mma fallback from now on: the node, cuBLASLt's reason and the fallback instance.
inline void note_fallback(Ort::KernelContext& ctx, const NodeRef& ref, const std::string& why) {
    const std::string msg = ref.where() + ": cuBLASLt instance " + ref.fn_name + " cannot run (" + why +
                            "); the node runs its mma fallback " + ref.fallback->fn_name + " from now on";
    try {
        Ort::Status st = ctx.GetLogger().LogMessage(ORT_LOGGING_LEVEL_WARNING, __FILE__, __LINE__, __func__,
                                                    msg.c_str());
        if (st.IsOK()) return;
    } catch (const std::exception&) {
        // no logger for this kernel: stderr below
    }
    std::fprintf(stderr, "gtco: %s\n", msg.c_str());
}

// run_instance, and where the node's chosen implementation is cuBLASLt (gemm/cublaslt.h), what happens when it
// cannot run. GTCO_ELIBRARY (libcublasLt absent, no algorithm of the chosen rank, a plan that cannot be made, a first
// call under graph capture) on a node with an mma fallback in this slot (NodeRef::fallback): the fallback on the same
// arguments and stream, the reason noted once per node (note_fallback), and from then on the fallback directly, with
// no cuBLASLt call (a CUDA graph captured after the failure records the mma kernel). Every thread that sees the
// failure before the flag is set launches the fallback too; one of them notes it. A failure of the fallback is the
// node's error; so is every other code of the cuBLASLt instance (GTCO_EBADSHAPE: the arguments, GTCO_ELAUNCH:
// cublasLtMatmul itself), and GTCO_ELIBRARY without a fallback, each with cuBLASLt's reason.
template <class Describe>
OrtStatus* run_gemm(Ort::KernelContext& ctx, const NodeRef& ref, const GemmArgs& args, const Describe& operands) {
    if (ref.fallback != nullptr && ref.fell_back->load(std::memory_order_acquire)) {
        return run_instance(ctx, *ref.fallback, args, operands);
    }
    if (ref.fn == nullptr || !lt::is_instance(ref.fn_name)) return run_instance(ctx, ref, args, operands);
    lt::last_error().clear();
    const int rc = launch_instance(ctx, ref, args);
    if (rc == GTCO_OK) return nullptr;
    if (rc == GTCO_ELIBRARY && ref.fallback != nullptr) {
        if (!ref.fell_back->exchange(true, std::memory_order_acq_rel)) note_fallback(ctx, ref, lt::last_error());
        return run_instance(ctx, *ref.fallback, args, operands);
    }
    if (lt::last_error().empty()) return instance_status(ref, rc, operands);
    return ref.fail("cuBLASLt instance " + ref.fn_name + " on " + operands() + ": " + lt::last_error(), ORT_FAIL);
}

}  // namespace gemm_glue

struct Gemm {
    enum InRole { IN_A = 0, IN_B = 1, IN_BIAS = 2, IN_RESIDUAL = 3, IN_LAYER_SCALE = 4, IN_GAMMA = 5, IN_BETA = 6,
                  IN_SCALES = 7 };  // IN_SCALES: [s_a, s_b] of an fp8 node's E4M3 operands (onnx_gtco/fp8.py)
    enum OutRole { OUT_Y = 0, OUT_NORM = 1 };

    struct Attrs {
        int64_t m = -1, n = -1, k = -1;  // -1: not known when the library was built (symbolic)
        bool batch_known = false;         // batch holds the output's batch dims (empty: a weight GEMM)
        std::vector<int64_t> batch;
        int64_t trans_a = 0, trans_b = 0, bias = 0, residual = 0, layer_scale = 0, layernorm = 0, gated = 0;
        float alpha = 1.0f, beta = 1.0f, epsilon = 1e-5f;
        float a_scale = 0.0f;  // an fp8 node's s_a on the device path (GemmArgs::a_scale), set per call
        std::string activation;
        bool act_known = false;
        ref::Act act = ref::Act::kNone;
        std::string precision;
        // the node's output type as the model declares it: float on a half op type is the fused output cast (y
        // and the residual fp32, the instance built with out_dtype f32); UNDEFINED when the model does not say
        ONNXTensorElementDataType out_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    };

    static Attrs read_attrs(const OrtKernelInfo* info) {
        Attrs a;
        Ort::ConstKernelInfo ki(info);
        if (ki.GetOutputCount() > 0) {
            Ort::TypeInfo t = ki.GetOutputTypeInfo(0);
            if (t.GetONNXType() == ONNX_TYPE_TENSOR) a.out_type = t.GetTensorTypeAndShapeInfo().GetElementType();
        }
        a.m = gemm_glue::size_attr(info, "m");
        a.n = gemm_glue::size_attr(info, "n");
        a.k = gemm_glue::size_attr(info, "k");
        // absent for a weight GEMM (the rewrite drops empty lists); strings when symbolic: then not checked
        a.batch_known = attr_ints(info, "batch", a.batch);
        attr_int(info, "trans_a", a.trans_a);
        attr_int(info, "trans_b", a.trans_b);
        attr_int(info, "bias", a.bias);
        attr_int(info, "residual", a.residual);
        attr_int(info, "layer_scale", a.layer_scale);
        attr_int(info, "layernorm", a.layernorm);
        attr_int(info, "gated", a.gated);
        attr_float(info, "epsilon", a.epsilon);
        attr_float(info, "alpha", a.alpha);
        attr_float(info, "beta", a.beta);
        a.activation = attr_string(info, "activation", "none");
        a.act_known = ref::parse_act(a.activation, a.act);
        a.precision = attr_string(info, "precision", "fp32");
        return a;
    }

    // The CPU reference's operands and epilogue (its bias_m / bias_n are planned apart).
    template <class T, class TO>
    static void fill_io(ref::GemmIO<T, TO>& io, const Attrs& at, const Input& a, const Input& b, const Input& bias,
                        const Input& scale, const Input& res, TO* y) {
        io.a = static_cast<const T*>(a.data);
        io.b = static_cast<const T*>(b.data);
        io.bias = static_cast<const T*>(bias.data);
        io.layer_scale = static_cast<const T*>(scale.data);
        io.residual = static_cast<const TO*>(res.data);
        io.y = y;
        io.alpha = at.alpha;
        io.beta = at.beta;
        io.act = at.act;
        io.gated = at.gated != 0;
    }

    // y of the op's dtype, or fp32 where the node's output is float on a half op type (the fused output cast)
    template <DType D, bool Cuda>
    static OrtStatus* compute(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at) {
        if constexpr (D == DType::f8) {
            return compute_f8<Cuda>(ctx, ref, spec, at);
        } else {
            return compute_typed<D, Cuda>(ctx, ref, spec, at);
        }
    }

    template <DType D, bool Cuda>
    static OrtStatus* compute_typed(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec,
                                    const Attrs& at) {
        if (D != DType::f32 && at.out_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && at.layernorm == 0) {
            return compute_out<D, DType::f32, Cuda>(ctx, ref, spec, at);
        }
        if (at.out_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED && at.out_type != Storage<D>::onnx) {
            return ref.fail(std::string("output y is ") + type_str(at.out_type) + "; this kernel writes " +
                            Storage<D>::name + " or float");
        }
        return compute_out<D, D, Cuda>(ctx, ref, spec, at);
    }

    template <DType D, DType DOut, bool Cuda>
    static OrtStatus* compute_out(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec,
                                  const Attrs& at) {
        return compute_with<D, DOut, Cuda>(ctx, ref, spec, at, get_input(ctx, spec.in[IN_A]),
                                           get_input(ctx, spec.in[IN_B]), get_input(ctx, spec.in[IN_BIAS]),
                                           get_input(ctx, spec.in[IN_RESIDUAL]),
                                           get_input(ctx, spec.in[IN_LAYER_SCALE]), get_input(ctx, spec.in[IN_GAMMA]),
                                           get_input(ctx, spec.in[IN_BETA]));
    }

    // An fp8 node. The CPU reference: A rounded to E4M3 at s_a and B (E4M3) decoded, both held in fp16 (which holds
    // every E4M3 value exactly), and the fp16 reference run with alpha * s_a * s_b: the E4M3 GEMM with fp32
    // accumulation, its epilogue (and LayerNorm) as the fp16 node's. The device: the node's FP8 instance (gemm.cuh)
    // on A as it is and B's E4M3 bytes, a_scale = s_a, alpha * s_a * s_b.
    template <bool Cuda>
    static OrtStatus* compute_f8(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at) {
        const Input scales = get_input(ctx, spec.in[IN_SCALES]);
        if (!scales.present || scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || scales.numel() != 2) {
            return ref.fail("an fp8 GEMM needs its scales input: float [s_a, s_b]");
        }
        const Input a = get_input(ctx, spec.in[IN_A]);
        const Input b = get_input(ctx, spec.in[IN_B]);
        if (!a.present || a.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
            return ref.fail("input A of an fp8 GEMM is " + std::string(a.present ? type_str(a.type) : "missing") +
                            "; it takes float16");
        }
        if (!b.present || b.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN) {
            return ref.fail("input B of an fp8 GEMM is " + std::string(b.present ? type_str(b.type) : "missing") +
                            "; it takes float8e4m3fn");
        }
        const float* s = static_cast<const float*>(scales.data);
        Attrs scaled = at;
        scaled.alpha = at.alpha * s[0] * s[1];
        scaled.a_scale = s[0];
        const Input bias = get_input(ctx, spec.in[IN_BIAS]), res = get_input(ctx, spec.in[IN_RESIDUAL]);
        const Input scale = get_input(ctx, spec.in[IN_LAYER_SCALE]), gamma = get_input(ctx, spec.in[IN_GAMMA]);
        const Input beta = get_input(ctx, spec.in[IN_BETA]);
        const bool f32_out = at.out_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && at.layernorm == 0;
        if constexpr (Cuda) {  // the instance reads B's bytes: B passes the fp16 operand checks by its shape only
            Input b8 = b;
            b8.type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
            if (f32_out) {
                return compute_with<DType::f16, DType::f32, true>(ctx, ref, spec, scaled, a, b8, bias, res, scale,
                                                                   gamma, beta);
            }
            return compute_with<DType::f16, DType::f16, true>(ctx, ref, spec, scaled, a, b8, bias, res, scale, gamma,
                                                               beta);
        }
        std::vector<Ort::Float16_t> qa(static_cast<size_t>(a.numel())), qb(static_cast<size_t>(b.numel()));
        const auto* ha = static_cast<const Ort::Float16_t*>(a.data);
        const auto* b8 = static_cast<const uint8_t*>(b.data);
        for (size_t i = 0; i < qa.size(); ++i) qa[i] = Ort::Float16_t(ref::round_e4m3(ha[i].ToFloat() / s[0]));
        for (size_t i = 0; i < qb.size(); ++i) qb[i] = Ort::Float16_t(ref::e4m3_to_float(b8[i]));
        Input a16 = a, b16 = b;
        a16.data = qa.data();
        b16.type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
        b16.data = qb.data();
        if (f32_out) {
            return compute_with<DType::f16, DType::f32, false>(ctx, ref, spec, scaled, a16, b16, bias, res, scale,
                                                                gamma, beta);
        }
        return compute_with<DType::f16, DType::f16, false>(ctx, ref, spec, scaled, a16, b16, bias, res, scale, gamma,
                                                            beta);
    }

    template <DType D, DType DOut, bool Cuda>
    static OrtStatus* compute_with(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec,
                                   const Attrs& at, const Input& a, const Input& b, const Input& bias,
                                   const Input& res, const Input& scale, const Input& gamma, const Input& beta) {
        using S = Storage<D>;
        using T = typename S::type;
        using SO = Storage<DOut>;
        using TO = typename SO::type;
        if (!at.act_known) {
            return ref.fail("activation '" + at.activation + "' is not one this library implements",
                            ORT_NOT_IMPLEMENTED);
        }
        if (!a.present) return ref.fail("input A is missing");
        if (!b.present) return ref.fail("input B is missing");
        const char* names[] = {"A", "B", "bias", "layer_scale", "gamma", "beta"};
        const Input* ins[] = {&a, &b, &bias, &scale, &gamma, &beta};
        for (int i = 0; i < 6; ++i) {
            if (OrtStatus* st = gemm_glue::check_type<D>(ref, *ins[i], names[i])) return st;
        }
        if (OrtStatus* st = gemm_glue::check_type<DOut>(ref, res, "residual (y's type)")) return st;
        ref::GemmPlan p;
        std::string why = ref::plan_gemm(a.shape, b.shape, at.trans_a != 0, at.trans_b != 0, p);
        if (!why.empty()) return ref.fail(why);
        auto operands = [&] { return "A " + shape_str(a.shape) + " and B " + shape_str(b.shape); };
        std::vector<int64_t> y_shape = p.out_shape;  // a gated GEMM: N / 2 columns, act(gate) * up of each pair
        if (at.gated != 0) {
            if (p.n % 2 != 0) {
                return ref.fail(operands() + " give N=" + std::to_string(p.n) + "; a gated GEMM's B interleaves "
                                "(gate, up) column pairs, so N is even");
            }
            if (res.present || scale.present || at.layernorm != 0) {
                return ref.fail("a gated GEMM takes no residual, layer_scale or LayerNorm");
            }
            y_shape.back() = p.n / 2;
        }
        if (OrtStatus* st = gemm_glue::check_size(ref, "m", p.m, at.m, operands)) return st;
        if (OrtStatus* st = gemm_glue::check_size(ref, "n", p.n, at.n, operands)) return st;
        if (OrtStatus* st = gemm_glue::check_size(ref, "k", p.k, at.k, operands)) return st;
        if (at.batch_known && !at.batch.empty() && at.batch != p.batch_dims) {
            return ref.fail(operands() + " give batch dims " + shape_str(p.batch_dims) +
                            "; the kernel was built for " + shape_str(at.batch));
        }
        if ((at.bias != 0) != bias.present) {
            return ref.fail(std::string("the node attribute bias=") + std::to_string(at.bias) + " but the node " +
                            (bias.present ? "has" : "has no") + " bias input");
        }
        if ((at.residual != 0) != res.present) {
            return ref.fail(std::string("the node attribute residual=") + std::to_string(at.residual) +
                            " but the node " + (res.present ? "has" : "has no") + " residual input");
        }
        if ((at.layer_scale != 0) != scale.present) {
            return ref.fail(std::string("the node attribute layer_scale=") + std::to_string(at.layer_scale) +
                            " but the node " + (scale.present ? "has" : "has no") + " layer_scale input");
        }
        if (scale.present) {
            why = ref::plan_layer_scale(scale.shape, p);
            if (!why.empty()) return ref.fail(why + " (" + operands() + ")");
        }
        ref::GemmIO<T, TO> io;
        if (bias.present) {
            why = ref::plan_bias(bias.shape, p, io.bias_m, io.bias_n);
            if (!why.empty()) return ref.fail(why + " (" + operands() + ")");
        }
        if (res.present && res.shape != p.out_shape) {
            return ref.fail("residual " + shape_str(res.shape) + " differs from the output shape " +
                            shape_str(p.out_shape) + " of " + operands());
        }
        const bool ln = at.layernorm != 0;
        if (ln) {
            if constexpr (D != DOut) {
                return ref.fail("a LayerNorm GEMM writes its own dtype only");
            } else {
                return compute_ln<D, Cuda>(ctx, ref, spec, at, a, b, bias, res, scale, gamma, beta, p, io,
                                           operands);
            }
        }
        if (gamma.present || beta.present) return ref.fail("gamma / beta inputs on a node without layernorm=1");
        if (spec.out[OUT_Y] < 0) return ref.fail("the node table binds no output y");
        TO* y = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_Y]), y_shape).template GetTensorMutableData<TO>();
        if (Cuda) {
            GemmArgs args{};
            if (OrtStatus* st = gemm_glue::device_args(ref, p, at.trans_a != 0, at.alpha, bias.present ? at.beta : 1.0f,
                                                       bias.present, io.bias_m, io.bias_n, operands, args)) {
                return st;
            }
            if (at.gated != 0) args.stride_y = p.m * (p.n / 2);
            args.a = a.data, args.b = b.data, args.bias = bias.data, args.residual = res.data, args.y = y;
            args.layer_scale = scale.data;
            args.a_scale = at.a_scale;
            return gemm_glue::run_gemm(ctx, ref, args, operands);
        }
        fill_io(io, at, a, b, bias, scale, res, y);
        ref::gemm(p, io, S::load, SO::store, SO::load);
        return nullptr;
    }

    // The LayerNorm GEMM: y (the node's output when bound, else a buffer of the kernel's: the norm output on the
    // device, written in place) then norm over each row of N.
    template <DType D, bool Cuda, class Describe>
    static OrtStatus* compute_ln(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at,
                                 const Input& a, const Input& b, const Input& bias, const Input& res,
                                 const Input& scale, const Input& gamma, const Input& beta, const ref::GemmPlan& p,
                                 ref::GemmIO<typename Storage<D>::type, typename Storage<D>::type>& io,
                                 const Describe& operands) {
        using S = Storage<D>;
        using T = typename S::type;
        if (!gamma.present || !beta.present) return ref.fail("a LayerNorm GEMM needs its gamma and beta inputs");
        const std::vector<int64_t> row{p.n};
        for (const Input* g : {&gamma, &beta}) {
            if (g->shape != row) {
                return ref.fail(std::string(g == &gamma ? "gamma " : "beta ") + shape_str(g->shape) +
                                " is not one value per column of the output (N=" + std::to_string(p.n) + ")");
            }
        }
        if (spec.out[OUT_NORM] < 0) return ref.fail("the node table binds no output norm");
        T* norm = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_NORM]), p.out_shape)
                      .template GetTensorMutableData<T>();
        T* y = spec.out[OUT_Y] >= 0
                   ? ctx.GetOutput(static_cast<size_t>(spec.out[OUT_Y]), p.out_shape).template GetTensorMutableData<T>()
                   : nullptr;
        if (Cuda) {
            GemmArgs args{};
            if (OrtStatus* st = gemm_glue::device_args(ref, p, at.trans_a != 0, at.alpha, bias.present ? at.beta : 1.0f,
                                                       bias.present, io.bias_m, io.bias_n, operands, args)) {
                return st;
            }
            args.a = a.data, args.b = b.data, args.bias = bias.data, args.residual = res.data;
            args.y = y != nullptr ? static_cast<void*>(y) : static_cast<void*>(norm);  // in place without y
            args.layer_scale = scale.data;
            args.ln_gamma = gamma.data, args.ln_beta = beta.data, args.ln_y = norm, args.ln_eps = at.epsilon;
            args.a_scale = at.a_scale;
            return gemm_glue::run_gemm(ctx, ref, args, operands);
        }
        const int64_t rows = p.batch * p.m;
        std::vector<T> own;
        if (y == nullptr) {
            own.resize(static_cast<size_t>(rows * p.n));
            y = own.data();
        }
        fill_io(io, at, a, b, bias, scale, res, y);
        ref::gemm(p, io, S::load, S::store, S::load);
        ref::layernorm<T>(y, nullptr, static_cast<const T*>(gamma.data), p.n, static_cast<const T*>(beta.data), p.n,
                          norm, nullptr, rows, p.n, at.epsilon, S::load, S::store);
        return nullptr;
    }
};

// Q/K/V (or gate/up) projections that share their input, as one op: y_p = A @ W_p (+ bias_p).
struct Qkv {
    static constexpr int kMaxProj = 3;
    static constexpr const char* kWeight[kMaxProj] = {"W0", "W1", "W2"};  // role names, for messages
    static constexpr const char* kBias[kMaxProj] = {"bias0", "bias1", "bias2"};
    enum InRole { IN_A = 0, IN_W0 = 1, IN_W1 = 2, IN_W2 = 3, IN_BIAS0 = 4, IN_BIAS1 = 5, IN_BIAS2 = 6 };
    enum OutRole { OUT_Y0 = 0, OUT_Y1 = 1, OUT_Y2 = 2 };

    struct Attrs {
        int64_t m = -1, k = -1, n_out = -1;  // -1: symbolic when the library was built
        bool ns_known = false;
        std::vector<int64_t> ns;
        int64_t bias = 0;
        std::string precision;
    };

    static Attrs read_attrs(const OrtKernelInfo* info) {
        Attrs a;
        a.m = gemm_glue::size_attr(info, "m");
        a.k = gemm_glue::size_attr(info, "k");
        a.n_out = gemm_glue::size_attr(info, "n_out");
        a.ns_known = attr_ints(info, "ns", a.ns);
        attr_int(info, "bias", a.bias);
        a.precision = attr_string(info, "precision", "fp32");
        return a;
    }

    template <DType D, bool Cuda>
    static OrtStatus* compute(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at) {
        using S = Storage<D>;
        using T = typename S::type;
        const Input a = get_input(ctx, spec.in[IN_A]);
        if (!a.present) return ref.fail("input A is missing");
        if (OrtStatus* st = gemm_glue::check_type<D>(ref, a, "A")) return st;
        int np = 0;
        while (np < kMaxProj && spec.out[OUT_Y0 + np] >= 0) ++np;
        if (np == 0) return ref.fail("the node table binds no output");
        if (at.ns_known && at.ns.size() != static_cast<size_t>(np)) {
            return ref.fail("the node has " + std::to_string(np) + " projections but its attribute ns " +
                            shape_str(at.ns) + " lists " + std::to_string(at.ns.size()));
        }
        Input w[kMaxProj], bias[kMaxProj];
        ref::GemmPlan plan[kMaxProj];
        int64_t bias_n[kMaxProj] = {1, 1, 1}, bias_m[kMaxProj] = {1, 1, 1};
        int64_t n_sum = 0;
        for (int i = 0; i < np; ++i) {
            const char* wn = kWeight[i];
            const char* bn = kBias[i];
            w[i] = get_input(ctx, spec.in[IN_W0 + i]);
            bias[i] = get_input(ctx, spec.in[IN_BIAS0 + i]);
            if (!w[i].present) return ref.fail(std::string("input ") + wn + " is missing");
            if (OrtStatus* st = gemm_glue::check_type<D>(ref, w[i], wn)) return st;
            if (OrtStatus* st = gemm_glue::check_type<D>(ref, bias[i], bn)) return st;
            if (w[i].shape.size() != 2) {
                return ref.fail(std::string("weight ") + wn + " " + shape_str(w[i].shape) + " is not 2-D [K, N]");
            }
            std::string why = ref::plan_gemm(a.shape, w[i].shape, false, false, plan[i]);
            if (!why.empty()) return ref.fail(why);
            auto operands = [&] { return "A " + shape_str(a.shape) + " and " + wn + " " + shape_str(w[i].shape); };
            if (OrtStatus* st = gemm_glue::check_size(ref, "m", plan[i].m, at.m, operands)) return st;
            if (OrtStatus* st = gemm_glue::check_size(ref, "k", plan[i].k, at.k, operands)) return st;
            if (at.ns_known) {
                if (OrtStatus* st = gemm_glue::check_size(ref, "n", plan[i].n, at.ns[static_cast<size_t>(i)],
                                                          operands)) {
                    return st;
                }
            }
            n_sum += plan[i].n;
            if ((at.bias != 0) != bias[i].present) {
                return ref.fail(std::string("the node attribute bias=") + std::to_string(at.bias) + " but " +
                                "projection " + std::to_string(i) + (bias[i].present ? " has" : " has no") +
                                " bias input");
            }
            if (bias[i].present) {
                why = ref::plan_bias(bias[i].shape, plan[i], bias_m[i], bias_n[i]);
                if (!why.empty()) return ref.fail(bn + (": " + why));
            }
        }
        if (at.n_out >= 0 && n_sum != at.n_out) {
            return ref.fail("the weights give N=" + std::to_string(n_sum) + " in all; the kernel was built for "
                            "n_out=" + std::to_string(at.n_out));
        }
        T* y[kMaxProj] = {nullptr, nullptr, nullptr};
        for (int i = 0; i < np; ++i) {
            y[i] = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_Y0 + i]), plan[i].out_shape)
                       .template GetTensorMutableData<T>();
        }
        if (Cuda) {
            for (int i = 0; i < np; ++i) {
                auto operands = [&] { return "A " + shape_str(a.shape) + " and " + kWeight[i] + " " +
                                             shape_str(w[i].shape); };
                GemmArgs args{};
                if (OrtStatus* st = gemm_glue::device_args(ref, plan[i], false, 1.0f, 1.0f, bias[i].present,
                                                           bias_m[i], bias_n[i], operands, args)) {
                    return st;
                }
                args.a = a.data, args.b = w[i].data, args.bias = bias[i].data, args.y = y[i];
                if (OrtStatus* st = gemm_glue::run_gemm(ctx, ref, args, operands)) return st;
            }
            return nullptr;
        }
        for (int i = 0; i < np; ++i) {
            ref::GemmIO<T> io;
            io.a = static_cast<const T*>(a.data);
            io.b = static_cast<const T*>(w[i].data);
            io.bias = static_cast<const T*>(bias[i].data);
            io.bias_m = bias_m[i];
            io.bias_n = bias_n[i];
            io.y = y[i];
            ref::gemm<T>(plan[i], io, S::load, S::store);
        }
        return nullptr;
    }
};

}  // namespace gtco
