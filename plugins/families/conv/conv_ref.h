// CPU reference of the Conv family (op types Conv_f32 / _f16 / _bf16): plain C++, no ORT, no CUDA.
//
//     y = post_act(act((conv(x, w) + bias) * a + b) + residual)          (every step optional)
//
// conv is ONNX Conv over NCHW (a 1-D conv, x [N, C, W], runs as H = 1) with groups, strides, pads (explicit, or
// by auto_pad from x's shape) and dilations; w is [OC, C / groups, KH, KW]. bias, a and b are per output channel,
// in fp32: the glue (plugins/families/conv/conv_op.h) folds the node's per-channel constants into them (fold_affine: a Mul /
// Add pair, or a BatchNormalization's scale / sqrt(var + epsilon) and shift - mean * that). residual has y's shape.
//
// Math is fp32: x and w are loaded from their storage type, the products accumulate in float over the
// (input channel, kh, kw) positions of the output pixel's window, the epilogue runs in float and y is rounded to
// its storage type once, as a fused kernel does. The loop is an im2col GEMM per (image, group, tile of output
// pixels): the tile's window columns are gathered into fp32 once and every output channel of the group sweeps them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gemm/gemm_ref.h"
#include "parallel.h"

namespace gtco {
namespace ref {

// One convolution's sizes (x [n, c, h, w] -> y [n, oc, oh, ow]); a 1-D conv has h = kh = oh = 1.
struct ConvPlan {
    int64_t n = 0, c = 0, h = 1, w = 0;
    int64_t oc = 0, kh = 1, kw = 0, groups = 1;
    int64_t sh = 1, sw = 1, dh = 1, dw = 1, pad_t = 0, pad_l = 0;
    int64_t oh = 1, ow = 0;
    std::vector<int64_t> out_shape;  // y's shape, x's rank
    int64_t cg() const { return c / groups; }                // input channels per group
    int64_t ocg() const { return oc / groups; }              // output channels per group
    int64_t k() const { return cg() * kh * kw; }             // the GEMM's reduction length
    int64_t pixels() const { return oh * ow; }
};

// ONNX Conv's auto_pad. SAME_UPPER / SAME_LOWER pads depend on x's spatial size (TF exports are full of them), so
// they are computed per run from x's shape, never fixed when the library is built: output = ceil(in / stride), the
// total pad (out - 1) * stride + (k - 1) * dilation + 1 - in (at least 0), its odd unit at the end (UPPER) or the
// beginning (LOWER). VALID is no pad; NOTSET takes the node's pads.
enum class AutoPad { kNotSet, kValid, kSameUpper, kSameLower };

inline bool parse_auto_pad(const std::string& s, AutoPad& out) {
    if (s == "NOTSET" || s.empty()) return out = AutoPad::kNotSet, true;
    if (s == "VALID") return out = AutoPad::kValid, true;
    if (s == "SAME_UPPER") return out = AutoPad::kSameUpper, true;
    if (s == "SAME_LOWER") return out = AutoPad::kSameLower, true;
    return false;
}

// The (begin, end) pad along one axis of input size `in` under a SAME auto_pad.
inline void same_pad(int64_t in, int64_t k, int64_t stride, int64_t dilation, bool upper, int64_t& begin,
                     int64_t& end) {
    const int64_t out = (in + stride - 1) / stride;
    const int64_t total = std::max<int64_t>(0, (out - 1) * stride + (k - 1) * dilation + 1 - in);
    begin = upper ? total / 2 : total - total / 2;
    end = total - begin;
}

// Check x / w against the node's attributes (kernel, strides, pads as ONNX orders them: begins then ends,
// dilations; empty: ONNX's defaults; auto_pad other than kNotSet: the pads from x's shape, `pads` ignored) and
// fill the plan; an empty string, or what is wrong.
inline std::string plan_conv(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                             const std::vector<int64_t>& kernel, const std::vector<int64_t>& strides,
                             const std::vector<int64_t>& pads_attr, const std::vector<int64_t>& dilations,
                             int64_t groups, ConvPlan& p, AutoPad auto_pad = AutoPad::kNotSet) {
    const std::string operands = "x " + dims_str(x) + " and w " + dims_str(w);
    if (x.size() != 3 && x.size() != 4) return operands + ": the conv kernel takes 1-D and 2-D convolutions only";
    if (w.size() != x.size()) return operands + ": w's rank differs from x's";
    const size_t sp = x.size() - 2;
    auto fits = [&](const std::vector<int64_t>& v, size_t n) { return v.empty() || v.size() == n; };
    if (!fits(kernel, sp) || !fits(strides, sp) || !fits(dilations, sp) || !fits(pads_attr, 2 * sp)) {
        return operands + ": kernel, strides, dilations or pads do not have one entry per spatial axis";
    }
    auto at = [](const std::vector<int64_t>& v, size_t i, int64_t def) { return v.empty() ? def : v[i]; };
    std::vector<int64_t> pads = auto_pad == AutoPad::kNotSet ? pads_attr : std::vector<int64_t>(2 * sp, 0);
    for (size_t i = 0; i < sp; ++i) {
        if (!kernel.empty() && kernel[i] != w[2 + i]) return operands + ": w's spatial dims differ from kernel_shape";
        if (at(strides, i, 1) < 1 || at(dilations, i, 1) < 1) return operands + ": a stride or dilation below 1";
        if (at(pads, i, 0) < 0 || at(pads, sp + i, 0) < 0) return operands + ": a negative pad";
        if (auto_pad == AutoPad::kSameUpper || auto_pad == AutoPad::kSameLower) {
            same_pad(x[2 + i], w[2 + i], at(strides, i, 1), at(dilations, i, 1), auto_pad == AutoPad::kSameUpper,
                     pads[i], pads[sp + i]);
        }
    }
    if (groups < 1 || x[1] % groups != 0 || w[0] % groups != 0 || w[1] * groups != x[1]) {
        return operands + ": " + std::to_string(groups) + " groups do not split x's channels into w's dim 1 (" +
               "x has C=" + std::to_string(x[1]) + ", w takes " + std::to_string(w[1]) + " per group)";
    }
    p.n = x[0], p.c = x[1], p.oc = w[0], p.groups = groups;
    p.w = x[sp + 1], p.kw = w[sp + 1];
    p.sw = at(strides, sp - 1, 1), p.dw = at(dilations, sp - 1, 1), p.pad_l = at(pads, sp - 1, 0);
    int64_t pad_r = at(pads, 2 * sp - 1, 0), pad_b = 0;
    if (sp == 2) {
        p.h = x[2], p.kh = w[2], p.sh = at(strides, 0, 1), p.dh = at(dilations, 0, 1);
        p.pad_t = at(pads, 0, 0), pad_b = at(pads, 2, 0);
    }
    const int64_t eh = p.h + p.pad_t + pad_b - p.dh * (p.kh - 1) - 1;
    const int64_t ew = p.w + p.pad_l + pad_r - p.dw * (p.kw - 1) - 1;
    if (eh < 0 || ew < 0) return operands + ": the dilated kernel is larger than the padded input";
    p.oh = eh / p.sh + 1, p.ow = ew / p.sw + 1;
    p.out_shape = sp == 2 ? std::vector<int64_t>{p.n, p.oc, p.oh, p.ow} : std::vector<int64_t>{p.n, p.oc, p.ow};
    return "";
}

// Whether a per-channel constant of `shape` gives one value (numel 1) or one per channel of y (`channels`): a
// 1-D [C] (a Conv bias, BatchNormalization's inputs), or a tensor broadcast against y's `rank` dims whose only
// dim other than 1 is y's axis 1 ([C, 1, 1], [1, C, 1, 1]). Sets `step` to 0 (one value) or 1.
inline bool plan_channels(const std::vector<int64_t>& shape, int64_t channels, size_t rank, int64_t& step) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    step = numel == 1 ? 0 : 1;
    if (numel == 1) return true;
    if (shape.size() == 1) return shape[0] == channels;
    if (shape.size() > rank) return false;
    for (size_t i = 0; i < shape.size(); ++i) {
        const size_t pos = rank - shape.size() + i;
        if (shape[i] != 1 && !(pos == 1 && shape[i] == channels)) return false;
    }
    return true;
}

// y = v * a + b per channel from the node's affine constants, each of `oc` values or one (step 0) or absent
// (nullptr): a Mul scale and an Add shift, or with batchnorm BatchNormalization's scale, shift, mean and var.
struct AffineIn {
    const float *scale = nullptr, *shift = nullptr, *mean = nullptr, *var = nullptr;
    int64_t scale_step = 0, shift_step = 0, mean_step = 0, var_step = 0;
};

inline void fold_affine(const AffineIn& in, bool batchnorm, float epsilon, int64_t oc, std::vector<float>& a,
                        std::vector<float>& b) {
    a.assign(static_cast<size_t>(oc), 1.0f);
    b.assign(static_cast<size_t>(oc), 0.0f);
    for (int64_t c = 0; c < oc; ++c) {
        const float s = in.scale ? in.scale[c * in.scale_step] : 1.0f;
        const float t = in.shift ? in.shift[c * in.shift_step] : 0.0f;
        if (batchnorm) {
            const float k = s / std::sqrt(in.var[c * in.var_step] + epsilon);
            a[static_cast<size_t>(c)] = k;
            b[static_cast<size_t>(c)] = t - in.mean[c * in.mean_step] * k;
        } else {
            a[static_cast<size_t>(c)] = s;
            b[static_cast<size_t>(c)] = t;
        }
    }
}

// The operands of one conv: x, w and residual stored as T, y as T; bias, a, b fp32 per output channel (nullptr:
// 0, 1, 0).
template <class T>
struct ConvIO {
    const T* x = nullptr;
    const T* w = nullptr;
    const T* residual = nullptr;
    T* y = nullptr;
    const float* bias = nullptr;
    const float* a = nullptr;
    const float* b = nullptr;
    Act act = Act::kNone, post_act = Act::kNone;
};

// The fp32 window columns of output pixels [p0, p0 + np) of image n, group g: col[k * np + j].
template <class T, class Load>
void gather_cols(const ConvPlan& p, const T* x, int64_t n, int64_t g, int64_t p0, int64_t np, Load load,
                 std::vector<float>& col) {
    col.assign(static_cast<size_t>(p.k() * np), 0.0f);
    for (int64_t ci = 0; ci < p.cg(); ++ci) {
        const T* plane = x + ((n * p.c) + g * p.cg() + ci) * p.h * p.w;
        for (int64_t ky = 0; ky < p.kh; ++ky) {
            for (int64_t kx = 0; kx < p.kw; ++kx) {
                float* row = col.data() + ((ci * p.kh + ky) * p.kw + kx) * np;
                for (int64_t j = 0; j < np; ++j) {
                    const int64_t oy = (p0 + j) / p.ow, ox = (p0 + j) % p.ow;
                    const int64_t iy = oy * p.sh - p.pad_t + ky * p.dh, ix = ox * p.sw - p.pad_l + kx * p.dw;
                    if (iy >= 0 && iy < p.h && ix >= 0 && ix < p.w) row[j] = load(plane[iy * p.w + ix]);
                }
            }
        }
    }
}

// Output channels [o0, o0 + R) of a tile: acc[r * np + j] = sum_k wf[(o0 + r) * K + k] * col[k * np + j], summed in
// k order. R rows by kJ pixels stay in registers for the whole sum.
template <int R>
void tile_rows(const float* wf, int64_t kk, const float* col, int64_t np, float* acc) {
    constexpr int64_t kJ = 8;
    int64_t j0 = 0;
    for (; j0 + kJ <= np; j0 += kJ) {
        float a[R][kJ] = {};
        for (int64_t k = 0; k < kk; ++k) {
            const float* c = col + k * np + j0;
            for (int r = 0; r < R; ++r) {
                const float wv = wf[r * kk + k];
                for (int64_t j = 0; j < kJ; ++j) a[r][j] += wv * c[j];
            }
        }
        for (int r = 0; r < R; ++r) std::copy(a[r], a[r] + kJ, acc + r * np + j0);
    }
    for (; j0 < np; ++j0) {
        for (int r = 0; r < R; ++r) {
            float sum = 0.0f;
            for (int64_t k = 0; k < kk; ++k) sum += wf[r * kk + k] * col[k * np + j0];
            acc[r * np + j0] = sum;
        }
    }
}

template <class T, class Load, class Store>
void conv(const ConvPlan& p, const ConvIO<T>& io, Load load, Store store) {
    const int64_t kk = p.k(), pixels = p.pixels();
    if (p.n == 0 || p.oc == 0 || pixels == 0) return;
    std::vector<float> wf(static_cast<size_t>(p.oc * kk));
    for (size_t i = 0; i < wf.size(); ++i) wf[i] = load(io.w[i]);
    constexpr int64_t kTile = 64;  // output pixels per task
    const int64_t tiles = (pixels + kTile - 1) / kTile, tasks = p.n * p.groups * tiles;
    const int64_t threads = worth_threads(tasks, p.n * p.oc * pixels * kk);
    parallel_for(threads, [&](int64_t t) {
        std::vector<float> col, acc(static_cast<size_t>(4 * kTile));
        for (int64_t task = t; task < tasks; task += threads) {
            const int64_t n = task / (p.groups * tiles), g = task / tiles % p.groups, p0 = task % tiles * kTile;
            const int64_t np = std::min(kTile, pixels - p0);
            gather_cols(p, io.x, n, g, p0, np, load, col);
            for (int64_t o = 0; o < p.ocg(); o += 4) {
                const int64_t rows = std::min<int64_t>(4, p.ocg() - o), oc0 = g * p.ocg() + o;
                const float* w0 = wf.data() + oc0 * kk;
                if (rows == 4) {
                    tile_rows<4>(w0, kk, col.data(), np, acc.data());
                } else {
                    for (int64_t r = 0; r < rows; ++r) tile_rows<1>(w0 + r * kk, kk, col.data(), np, acc.data() + r * np);
                }
                for (int64_t r = 0; r < rows; ++r) {
                    const int64_t ch = oc0 + r, base = (n * p.oc + ch) * pixels + p0;
                    const float bias = io.bias ? io.bias[ch] : 0.0f, a = io.a ? io.a[ch] : 1.0f;
                    const float b = io.b ? io.b[ch] : 0.0f;
                    for (int64_t j = 0; j < np; ++j) {
                        float v = activate(io.act, (acc[static_cast<size_t>(r * np + j)] + bias) * a + b);
                        if (io.residual) v += load(io.residual[base + j]);
                        io.y[base + j] = store(activate(io.post_act, v));
                    }
                }
            }
        }
    });
}

}  // namespace ref
}  // namespace gtco
