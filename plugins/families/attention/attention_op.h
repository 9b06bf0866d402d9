// The attention families' ORT glue: op types Attention_{f32,f16,bf16} (gtco::Attention) and
// BmmSoftmax_{f32,f16,bf16} (gtco::BmmSoftmax).
//
//     Attention:   out   = softmax(scale * Q Kᵀ [+ mask] [+ bias]) V     in out_layout
//     BmmSoftmax:  probs = softmax(scale * Q Kᵀ [+ mask] [+ bias])       [B, H, Sq, Sk]
//
// Node attributes (onnx_gtco/families/attention/rule.py): heads, head_dim (ints; the binder refuses nodes where either
// is symbolic), kv_heads (int, absent: heads; fewer with grouped-query attention, k and v then hold kv_heads heads,
// each read by heads / kv_heads query heads), seq_q, seq_k (int, or a string when symbolic: then only the inputs'
// consistency is checked),
// scale (float; 1/sqrt(head_dim) when absent), mask_scale, bias_scale (floats, 1 when absent: the graph's scale
// after adding the mask / bias, which multiplies that term), mask, bias, nan_guard, causal (ints; causal: key j > query
// i masked, upper-left as ONNX Attention's is_causal without past_key; from that op, or from a constant causal mask
// the rule recognized, which the node then keeps as an input no kernel reads), window (ints [left, right], absent:
// none; a constant sliding-window mask the rule recognized: key j of query i kept where i - left <= j <= i + right),
// batch_dims (ints, or strings when symbolic: then not checked), q_layout, k_layout, v_layout, out_layout (strings: bhsd, bshd, bshd_merged,
// qkv_packed, bhds (k only); out: bhsd, bshd, bshd_merged), precision (string; the CPU reference computes in fp32
// whatever it says).
//
// Input roles (both families, the same numbering; onnx_gtco/families/attention/bind.py IN_ROLES): IN_Q, IN_K, IN_V
// (absent for BmmSoftmax), IN_MASK, IN_BIAS. With qkv_packed, IN_Q, IN_K and IN_V are the same node input. The
// node's other inputs (the head split's shape constants, Gather indices, the scale constant) are constants the
// binder checked at build time; the kernel does not read them. Output role: OUT_Y (out or probs).
//
// Shapes: one batch dim (the binder binds [B, H, Sq, Sk] score cores only); mask / bias of rank <= 4, right-aligned
// against the scores [B, H, Sq, Sk], each dim 1 or full. mask_period P (int attribute, 0 when absent; Swin's shifted
// windows): the mask, of rank <= 5, broadcasts to [B / P, P, H, Sq, Sk] with a leading dim of 1, and batch row b
// reads its row b % P.
//
// CPU EP: plugins/families/attention/attention_ref.h. Device: the node's attention / bmm_softmax instance
// (attention/attention.cuh), its gtco_attention_args filled with the same layout and addend strides the reference uses.
// The device kernels generate a causal or windowed node's mask (a BAND instance), and a row whose every key is masked
// with -inf gives zeros there whatever nan_guard says (the graph without the guard gives NaN).
#pragma once

#include "attention/attention_args.h"
#include "attention/attention_ref.h"
#include "gtco_ort.h"

#include <algorithm>
#include <cmath>

namespace gtco {

template <bool WithV>
struct AttentionGlue {
    enum InRole { IN_Q = 0, IN_K = 1, IN_V = 2, IN_MASK = 3, IN_BIAS = 4 };
    enum OutRole { OUT_Y = 0 };

    struct Attrs {
        int64_t heads = -1;      // -1: symbolic or absent
        int64_t kv_heads = -1;   // heads of k and v (GQA, MQA: fewer); -1: as many as q
        int64_t head_dim = -1;
        int64_t seq_q = -1;
        int64_t seq_k = -1;
        float scale = 0.0f;
        bool has_scale = false;
        float mask_scale = 1.0f, bias_scale = 1.0f;
        int64_t mask = 0, bias = 0, nan_guard = 0, causal = 0;
        int64_t mask_period = 0;          // > 0: the mask is read at batch row b % mask_period
        std::vector<int64_t> window;      // [left, right]: key j of query i kept only where i - left <= j <= i + right
        std::vector<int64_t> batch_dims;  // empty: symbolic or absent
        std::string q_layout, k_layout, v_layout, out_layout, precision;
    };

    static const char* family() { return WithV ? "attention" : "bmm_softmax"; }

    static Attrs read_attrs(const OrtKernelInfo* info) {
        Attrs a;
        if (!attr_int(info, "heads", a.heads) || a.heads <= 0) a.heads = -1;
        if (!attr_int(info, "head_dim", a.head_dim) || a.head_dim <= 0) a.head_dim = -1;
        if (!attr_int(info, "kv_heads", a.kv_heads) || a.kv_heads <= 0) a.kv_heads = -1;
        if (!attr_int(info, "seq_q", a.seq_q) || a.seq_q < 0) a.seq_q = -1;
        if (!attr_int(info, "seq_k", a.seq_k) || a.seq_k < 0) a.seq_k = -1;
        a.has_scale = attr_float(info, "scale", a.scale);
        attr_float(info, "mask_scale", a.mask_scale);
        attr_float(info, "bias_scale", a.bias_scale);
        attr_int(info, "mask", a.mask);
        attr_int(info, "bias", a.bias);
        attr_int(info, "nan_guard", a.nan_guard);
        attr_int(info, "causal", a.causal);
        attr_ints(info, "window", a.window);
        attr_int(info, "mask_period", a.mask_period);
        attr_ints(info, "batch_dims", a.batch_dims);  // stays empty when absent or symbolic (strings)
        a.q_layout = attr_string(info, "q_layout", "bhsd");
        a.k_layout = attr_string(info, "k_layout", "bhds");
        a.v_layout = attr_string(info, "v_layout", "bhsd");
        a.out_layout = attr_string(info, "out_layout", "bhsd");
        a.precision = attr_string(info, "precision", "fp32");
        return a;
    }

    template <DType D, bool Cuda>
    static OrtStatus* compute(Ort::KernelContext& ctx, const NodeRef& ref, const NodeSpec& spec, const Attrs& at) {
        using S = Storage<D>;
        using T = typename S::type;
        using ref::Layout;
        const Input q = get_input(ctx, spec.in[IN_Q]);
        const Input k = get_input(ctx, spec.in[IN_K]);
        const Input v = WithV ? get_input(ctx, spec.in[IN_V]) : Input{};
        const Input mask = get_input(ctx, spec.in[IN_MASK]);
        const Input bias = get_input(ctx, spec.in[IN_BIAS]);
        if (!q.present) return ref.fail("input q is missing");
        if (!k.present) return ref.fail("input k is missing");
        if (WithV && !v.present) return ref.fail("input v is missing");
        if (spec.out[OUT_Y] < 0) return ref.fail("the node table gives no output for the result", ORT_FAIL);
        const char* names[] = {"q", "k", "v", "mask", "bias"};
        const Input* ins[] = {&q, &k, &v, &mask, &bias};
        for (int r = 0; r < 5; ++r) {
            const Input* t = ins[r];
            if (t->present && t->type != S::onnx) {
                return ref.fail(std::string("input ") + names[r] + " is " + type_str(t->type) + " " +
                                shape_str(t->shape) + "; this kernel takes " + S::name + " only");
            }
        }
        // attributes
        const int64_t H = at.heads, Dh = at.head_dim;
        if (H <= 0 || Dh <= 0) {
            return ref.fail("heads and head_dim must be known positive ints (attributes heads=" + std::to_string(H) +
                            ", head_dim=" + std::to_string(Dh) + ")");
        }
        const int64_t Hkv = at.kv_heads > 0 ? at.kv_heads : H;  // heads of k and v
        if (H % Hkv != 0) {
            return ref.fail("kv_heads=" + std::to_string(Hkv) + " does not divide heads=" + std::to_string(H));
        }
        const Layout lq = ref::parse_layout(at.q_layout), lk = ref::parse_layout(at.k_layout);
        const Layout lv = WithV ? ref::parse_layout(at.v_layout) : Layout::bhsd;
        const Layout lo = WithV ? ref::parse_layout(at.out_layout) : Layout::bhsd;
        if (lq == Layout::invalid || lq == Layout::bhds) return ref.fail("unsupported q_layout '" + at.q_layout + "'");
        if (lk == Layout::invalid) return ref.fail("unsupported k_layout '" + at.k_layout + "'");
        if (lv == Layout::invalid || lv == Layout::bhds) return ref.fail("unsupported v_layout '" + at.v_layout + "'");
        if (lo != Layout::bhsd && lo != Layout::bshd && lo != Layout::bshd_merged)
            return ref.fail("unsupported out_layout '" + at.out_layout + "'");
        const bool packed = lq == Layout::qkv_packed;
        if (packed != (lk == Layout::qkv_packed) || (WithV && packed != (lv == Layout::qkv_packed)))
            return ref.fail("qkv_packed must be the layout of all of q, k" + std::string(WithV ? ", v" : "") +
                            " (q_layout=" + at.q_layout + ", k_layout=" + at.k_layout +
                            (WithV ? ", v_layout=" + at.v_layout : std::string()) + ")");
        if (packed && Hkv != H) return ref.fail("qkv_packed with kv_heads=" + std::to_string(Hkv) + " < heads");
        if (packed && (spec.in[IN_K] != spec.in[IN_Q] || (WithV && spec.in[IN_V] != spec.in[IN_Q])))
            return ref.fail("qkv_packed q, k and v must be one node input; the node table gives different ones",
                            ORT_FAIL);
        // operand shapes
        int64_t bq = 0, sq = 0, bk = 0, sk = 0, bv = 0, sv = 0;
        auto bad = [&](const char* what, const Input& t, Layout l, int64_t heads) {
            return ref.fail(std::string("input ") + what + " " + shape_str(t.shape) + " does not fit " +
                            ref::layout_name(l) + " " + ref::layout_pattern(l, heads, Dh) + " (heads=" +
                            std::to_string(heads) + ", head_dim=" + std::to_string(Dh) + ")");
        };
        if (!ref::layout_dims(lq, q.shape, H, Dh, bq, sq)) return bad("q", q, lq, H);
        if (!ref::layout_dims(lk, k.shape, Hkv, Dh, bk, sk)) return bad("k", k, lk, Hkv);
        if (WithV && !ref::layout_dims(lv, v.shape, Hkv, Dh, bv, sv)) return bad("v", v, lv, Hkv);
        auto shapes = [&] {  // for messages only
            return "q " + shape_str(q.shape) + ", k " + shape_str(k.shape) +
                   (WithV ? ", v " + shape_str(v.shape) : std::string());
        };
        if (bk != bq || (WithV && bv != bq)) return ref.fail("batch sizes differ: " + shapes());
        if (WithV && sv != sk) return ref.fail("k and v have different sequence lengths: " + shapes());
        if (at.seq_q >= 0 && sq != at.seq_q)
            return ref.fail(shapes() + " give seq_q=" + std::to_string(sq) + "; the node says seq_q=" +
                            std::to_string(at.seq_q));
        if (at.seq_k >= 0 && sk != at.seq_k)
            return ref.fail(shapes() + " give seq_k=" + std::to_string(sk) + "; the node says seq_k=" +
                            std::to_string(at.seq_k));
        if (!at.batch_dims.empty() && (at.batch_dims.size() != 1 || at.batch_dims[0] != bq))
            return ref.fail(shapes() + " give batch " + std::to_string(bq) + "; the node says batch_dims=" +
                            shape_str(at.batch_dims));
        // additive terms
        if (mask.present && !at.mask) return ref.fail("has a mask input but its attribute mask=0", ORT_FAIL);
        if (bias.present != (at.bias != 0))
            return ref.fail(std::string("attribute bias=") + std::to_string(at.bias) + " but the node " +
                            (bias.present ? "has" : "has no") + " bias input", ORT_FAIL);
        const bool banded = at.causal != 0 || !at.window.empty();  // the kernel generates that mask
        if (at.mask && !mask.present && !banded)
            return ref.fail("attribute mask=1 but the node has no mask input and neither causal nor a window",
                            ORT_FAIL);
        ref::Addend<T> am, ab;
        const std::vector<int64_t> scores = {bq, H, sq, sk};
        for (int r = 0; r < 2; ++r) {
            const Input& t = r == 0 ? mask : bias;
            ref::Addend<T>& a = r == 0 ? am : ab;
            if (!t.present) continue;
            int64_t st[4];
            const int64_t period = r == 0 ? at.mask_period : 0;
            if (period > 0 && !ref::period_addend_strides(t.shape, period, bq, H, sq, sk, st)) {
                return ref.fail("mask " + shape_str(t.shape) + " with mask_period=" + std::to_string(period) +
                                " does not broadcast to [1, " + std::to_string(period) + ", " + std::to_string(H) +
                                ", " + std::to_string(sq) + ", " + std::to_string(sk) + "] (window rows of the " +
                                "scores " + shape_str(scores) + "; the period must divide the batch)");
            }
            if (period <= 0 && !ref::addend_strides(t.shape, bq, H, sq, sk, st)) {
                return ref.fail(std::string(r == 0 ? "mask " : "bias ") + shape_str(t.shape) +
                                " does not broadcast to the scores " + shape_str(scores) +
                                " (rank <= 4, each dim 1 or the scores' size)");
            }
            a.data = static_cast<const T*>(t.data);
            a.sb = st[0], a.sh = st[1], a.sq = st[2], a.sk = st[3];
            a.bmod = period > 0 ? period : 0;
            a.scale = r == 0 ? at.mask_scale : at.bias_scale;
        }
        // causal and sliding-window masks: key j of query i kept only where band_lo <= j - i <= band_hi
        if (!at.window.empty() && (at.window.size() != 2 || at.window[0] < 0 || at.window[1] < 0))
            return ref.fail("attribute window " + shape_str(at.window) + " is not [left, right] of two counts >= 0",
                            ORT_FAIL);
        const int64_t kFar = int64_t{1} << 30;  // past any sequence the kernels take
        int64_t band_lo = at.window.empty() ? -kFar : -std::min(at.window[0], kFar);
        int64_t band_hi = at.window.empty() ? kFar : std::min(at.window[1], kFar);
        if (at.causal) band_hi = std::min<int64_t>(band_hi, 0);
        // output
        const std::vector<int64_t> out_shape = WithV ? ref::layout_shape(lo, bq, H, sq, Dh) : scores;
        T* out = ctx.GetOutput(static_cast<size_t>(spec.out[OUT_Y]), out_shape).template GetTensorMutableData<T>();
        if (Cuda) {
            gtco_attention_args args{};
            const ref::Strides sq_ = ref::layout_strides(lq, H, sq, Dh, 0);
            const ref::Strides sk_ = ref::layout_strides(lk, Hkv, sk, Dh, 1);
            const ref::Strides sv_ = WithV ? ref::layout_strides(lv, Hkv, sk, Dh, 2) : ref::Strides{};
            const ref::Strides so_ = WithV ? ref::layout_strides(lo, H, sq, Dh)
                                           : ref::Strides{0, H * sq * sk, sq * sk, sk, 1};
            args.q = q.data, args.k = k.data, args.v = WithV ? v.data : nullptr, args.out = out;
            args.mask = mask.data, args.bias = bias.data;
            args.q_off = sq_.off, args.k_off = sk_.off, args.v_off = sv_.off;
            args.q_sb = sq_.sb, args.q_sh = sq_.sh, args.q_ss = sq_.ss;
            args.k_sb = sk_.sb, args.k_sh = sk_.sh, args.k_ss = sk_.ss, args.k_sd = sk_.sd;
            args.v_sb = sv_.sb, args.v_sh = sv_.sh, args.v_ss = sv_.ss;
            args.o_sb = so_.sb, args.o_sh = so_.sh, args.o_ss = so_.ss, args.o_sd = so_.sd;
            const ref::Addend<T>* adds[] = {&am, &ab};
            int64_t* dst[] = {&args.m_sb, &args.bias_sb};
            int32_t* bmod[] = {&args.m_bmod, &args.bias_bmod};
            for (int r = 0; r < 2; ++r) {
                const ref::Addend<T>& a = *adds[r];
                dst[r][0] = a.sb, dst[r][1] = a.sh, dst[r][2] = a.sq, dst[r][3] = a.sk;
                // a windowed addend: b % period; per-batch: b % B; else b % 1 = 0
                *bmod[r] = a.sb == 0 ? 1 : static_cast<int32_t>(a.bmod > 0 ? a.bmod : bq);
            }
            if (bq > INT32_MAX || sq > INT32_MAX || sk > INT32_MAX) return ref.fail("sizes too large: " + shapes());
            args.batch = static_cast<int32_t>(bq), args.heads = static_cast<int32_t>(H);
            args.seq_q = static_cast<int32_t>(sq), args.seq_k = static_cast<int32_t>(sk);
            args.head_dim = static_cast<int32_t>(Dh);
            args.kv_group = static_cast<int32_t>(H / Hkv);
            args.banded = banded ? 1 : 0;
            args.band_lo = static_cast<int32_t>(band_lo), args.band_hi = static_cast<int32_t>(band_hi);
            args.scale = at.has_scale ? at.scale : 1.0f / std::sqrt(static_cast<float>(Dh));
            args.mask_scale = at.mask_scale, args.bias_scale = at.bias_scale;
            return run_instance(ctx, ref, args, shapes);
        }
        ref::Problem pr;
        pr.batch = bq, pr.heads = H, pr.seq_q = sq, pr.seq_k = sk, pr.head_dim = Dh, pr.kv_group = H / Hkv;
        pr.scale = at.has_scale ? at.scale : 1.0f / std::sqrt(static_cast<float>(Dh));
        pr.banded = banded, pr.band_lo = band_lo, pr.band_hi = band_hi;
        pr.nan_guard = at.nan_guard != 0;
        ref::Operand<T> oq{static_cast<const T*>(q.data), ref::layout_strides(lq, H, sq, Dh, 0)};
        ref::Operand<T> ok{static_cast<const T*>(k.data), ref::layout_strides(lk, Hkv, sk, Dh, 1)};
        if (WithV) {
            ref::Operand<T> ov{static_cast<const T*>(v.data), ref::layout_strides(lv, Hkv, sk, Dh, 2)};
            ref::attention<T>(pr, oq, ok, ov, am, ab, out, ref::layout_strides(lo, H, sq, Dh), S::load, S::store);
        } else {
            const ref::Strides os{0, H * sq * sk, sq * sk, sk, 1};
            ref::bmm_softmax<T>(pr, oq, ok, am, ab, out, os, S::load, S::store);
        }
        return nullptr;
    }
};

using Attention = AttentionGlue<true>;
using BmmSoftmax = AttentionGlue<false>;

}  // namespace gtco
