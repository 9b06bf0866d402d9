// CPU reference of the GEMM and QKV families (op types Gemm_f32 / _f16 / _bf16, Qkv_*): plain C++, no ORT, no CUDA.
//
//     Gemm:  y[b] = act(alpha * A[b] @ op(B[b]) + beta * bias) * layer_scale + residual[b]
//                                                           (bias, act, layer_scale, residual optional)
//     Qkv:   y_p  = A @ W_p (+ bias_p)          for each projection p (one A, several [K, N_p] weights)
//
// Shapes follow ONNX: MatMul's batch broadcasting (A [..., M, K], B [..., K, N], the leading dims broadcast
// numpy-style; a 2-D B is one weight shared by every row of A, whose leading dims then fold into M) and Gemm's
// 2-D transA / transB. bias is a broadcast [bm, bn] matrix (bm in {1, M}, bn in {1, N}: a scalar, a row of N
// values, a column of M, or a full [M, N]); layer_scale (LayerScale: one factor per column, after the activation) is
// one value per column of y, [N] or [1, .., 1, N] (plan_layer_scale); residual has y's shape. plan_gemm / plan_bias
// check the shapes and
// say what is wrong (an empty string when nothing is); the glue (plugins/families/gemm/gemm_op.h) and the test harness
// both use them.
//
// Math is fp32 (products accumulate in float, as ONNX Runtime's CPU GEMM does; the epilogue runs in float);
// inputs are stored as T, y and the residual as TOut (T, or float for a half GEMM with its output cast fused in),
// converted through the caller's load/store, and y is rounded to TOut once, as a fused kernel does (the
// unfused graph would round after the MatMul, the bias Add and each activation node too). Activations compute
// what _act.py's REFERENCE says, in the order the ONNX decompositions do (erf GELU divides by sqrt(2)).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "parallel.h"

namespace gtco {
namespace ref {

// E4M3 (FN: no infinities, largest finite 448, subnormals down to 2^-9), the operands of an fp8 GEMM
// (onnx_gtco/fp8.py). round_e4m3: x rounded to the nearest E4M3 value, ties to even, saturated to +-448 (ONNX
// QuantizeLinear with saturate=1); NaN stays NaN. e4m3_to_float: the value of an E4M3 byte.
inline float round_e4m3(float x) {
    if (std::isnan(x)) return x;
    const float a = std::fabs(x);
    if (a >= 448.0f) return std::copysign(448.0f, x);
    int e = 0;
    std::frexp(a, &e);                               // a = f * 2^e, f in [0.5, 1): a's binade is 2^(e-1)
    const int step = std::max(e - 1, -6) - 3;        // 3 mantissa bits; below 2^-6 the subnormal step 2^-9
    const float q = std::ldexp(std::nearbyint(std::ldexp(a, -step)), step);  // nearbyint: ties to even
    return std::copysign(std::min(q, 448.0f), x);
}

inline float e4m3_to_float(uint8_t v) {
    const int exp = (v >> 3) & 0xF, man = v & 0x7;
    const float sign = (v & 0x80) != 0 ? -1.0f : 1.0f;
    if (exp == 0xF && man == 0x7) return std::nanf("");
    if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -9);
    return sign * std::ldexp(static_cast<float>(8 + man), exp - 10);
}

// Epilogue activations, named as in onnx_gtco/patterns/_act.py; same order as gtco::Act in gemm/gemm.cuh.
enum class Act : int { kNone = 0, kRelu, kGeluErf, kGeluTanh, kSilu, kQuickGelu, kSigmoid, kTanh, kRelu6 };

inline bool parse_act(const std::string& name, Act& out) {
    static const struct { const char* name; Act act; } kActs[] = {
        {"none", Act::kNone},           {"relu", Act::kRelu},       {"gelu_erf", Act::kGeluErf},
        {"gelu_tanh", Act::kGeluTanh},  {"silu", Act::kSilu},       {"quick_gelu", Act::kQuickGelu},
        {"sigmoid", Act::kSigmoid},     {"tanh", Act::kTanh},       {"relu6", Act::kRelu6},
    };
    for (const auto& a : kActs) {
        if (name == a.name) {
            out = a.act;
            return true;
        }
    }
    return false;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline float activate(Act act, float x) {
    switch (act) {
        case Act::kNone: return x;
        case Act::kRelu: return std::max(x, 0.0f);
        case Act::kGeluErf: return x * (std::erf(x / 1.41421356237309505f) + 1.0f) * 0.5f;
        case Act::kGeluTanh:
            return x * (std::tanh((x + 0.044715f * (x * x * x)) * 0.79788456080286536f) + 1.0f) * 0.5f;
        case Act::kSilu: return x * sigmoid(x);
        case Act::kQuickGelu: return x * sigmoid(1.702f * x);
        case Act::kSigmoid: return sigmoid(x);
        case Act::kTanh: return std::tanh(x);
        case Act::kRelu6: return std::min(std::max(x, 0.0f), 6.0f);
    }
    return x;
}

inline std::string dims_str(const std::vector<int64_t>& shape) {
    std::ostringstream s;
    s << '[';
    for (size_t i = 0; i < shape.size(); ++i) s << (i ? "," : "") << shape[i];
    s << ']';
    return s.str();
}

// How one (batched) GEMM walks its operands: y is [batch..., m, n] row-major, dense.
struct GemmPlan {
    int64_t batch = 1, m = 0, n = 0, k = 0;
    bool trans_a = false, trans_b = false;
    std::vector<int64_t> out_shape;   // y's shape
    std::vector<int64_t> batch_dims;  // y's leading (batch) dims; empty for a 2-D or folded weight GEMM
    std::vector<int64_t> a_off, b_off;  // per batch entry: element offset of its A and B matrices
};

// Plans y = A @ op(B). Returns "" or what is wrong with the shapes.
inline std::string plan_gemm(const std::vector<int64_t>& a, const std::vector<int64_t>& b, bool trans_a,
                             bool trans_b, GemmPlan& p) {
    p = GemmPlan{};
    p.trans_a = trans_a;
    p.trans_b = trans_b;
    for (const auto* s : {&a, &b}) {
        for (int64_t d : *s) {
            if (d < 0) return "input " + dims_str(*s) + " has a negative dim";
        }
    }
    if (a.size() < 2 || b.size() < 2) {
        return "A " + dims_str(a) + " and B " + dims_str(b) + ": both must have rank >= 2 (1-D operands are a GEMV)";
    }
    // a transposed A (Gemm's transA) takes 2-D operands; a transposed B a 2-D weight, which every row of A shares
    if ((trans_a && (a.size() != 2 || b.size() != 2)) || (trans_b && b.size() != 2)) {
        return "A " + dims_str(a) + " and B " + dims_str(b) + ": a transposed operand (Gemm) needs both 2-D";
    }
    const size_t ra = a.size(), rb = b.size();
    const int64_t ka = trans_a ? a[ra - 2] : a[ra - 1];
    const int64_t kb = trans_b ? b[rb - 1] : b[rb - 2];
    if (ka != kb) {
        return "A " + dims_str(a) + (trans_a ? " (transposed)" : "") + " and B " + dims_str(b) +
               (trans_b ? " (transposed)" : "") + " disagree on K: " + std::to_string(ka) + " vs " +
               std::to_string(kb);
    }
    p.k = ka;
    p.n = trans_b ? b[rb - 2] : b[rb - 1];
    if (rb == 2) {  // one weight for every row of A: A's leading dims fold into M
        p.m = 1;
        if (trans_a) {
            p.m = a[1];
        } else {
            for (size_t i = 0; i + 1 < ra; ++i) p.m *= a[i];
        }
        p.out_shape.assign(a.begin(), a.end() - 1);
        if (trans_a) p.out_shape = {a[1]};
        p.out_shape.push_back(p.n);
        p.a_off = {0};
        p.b_off = {0};
        return "";
    }
    p.m = a[ra - 2];
    // numpy broadcasting of the batch dims, right-aligned
    const size_t ba = ra - 2, bb = rb - 2, nb = std::max(ba, bb);
    p.batch_dims.assign(nb, 1);
    for (size_t i = 0; i < nb; ++i) {
        const int64_t da = i + ba >= nb ? a[i + ba - nb] : 1;
        const int64_t db = i + bb >= nb ? b[i + bb - nb] : 1;
        if (da != db && da != 1 && db != 1) {
            return "A " + dims_str(a) + " and B " + dims_str(b) + ": batch dims do not broadcast";
        }
        p.batch_dims[i] = da == 1 ? db : da;
    }
    p.batch = 1;
    for (int64_t d : p.batch_dims) p.batch *= d;
    p.out_shape = p.batch_dims;
    p.out_shape.push_back(p.m);
    p.out_shape.push_back(p.n);
    // element strides of each batch dim in A and B (0 where broadcast)
    std::vector<int64_t> sa(nb, 0), sb(nb, 0);
    int64_t step_a = a[ra - 2] * a[ra - 1], step_b = b[rb - 2] * b[rb - 1];
    for (size_t i = nb; i-- > 0;) {
        if (i + ba >= nb) {
            const int64_t d = a[i + ba - nb];
            sa[i] = d == 1 ? 0 : step_a;
            step_a *= d;
        }
        if (i + bb >= nb) {
            const int64_t d = b[i + bb - nb];
            sb[i] = d == 1 ? 0 : step_b;
            step_b *= d;
        }
    }
    p.a_off.assign(static_cast<size_t>(p.batch), 0);
    p.b_off.assign(static_cast<size_t>(p.batch), 0);
    for (int64_t e = 0; e < p.batch; ++e) {
        int64_t rest = e, oa = 0, ob = 0;
        for (size_t i = nb; i-- > 0;) {
            const int64_t idx = p.batch_dims[i] ? rest % p.batch_dims[i] : 0;
            rest = p.batch_dims[i] ? rest / p.batch_dims[i] : 0;
            oa += idx * sa[i];
            ob += idx * sb[i];
        }
        p.a_off[static_cast<size_t>(e)] = oa;
        p.b_off[static_cast<size_t>(e)] = ob;
    }
    return "";
}

// The bias as a broadcast [bm, bn] matrix over y (see the top). Returns "" or what is wrong.
inline std::string plan_bias(const std::vector<int64_t>& bias, const GemmPlan& p, int64_t& bm, int64_t& bn) {
    const std::vector<int64_t>& y = p.out_shape;
    const std::string why = "bias " + dims_str(bias) + " does not broadcast over the output " + dims_str(y) +
                            " as one value, a row of N=" + std::to_string(p.n) + ", a column of M=" +
                            std::to_string(p.m) + " or an [M, N] matrix";
    if (bias.size() > y.size()) return why;
    for (size_t i = 0; i + 2 < bias.size(); ++i) {
        if (bias[i] != 1) return why;
    }
    bn = bias.empty() ? 1 : bias.back();
    bm = bias.size() >= 2 ? bias[bias.size() - 2] : 1;
    if (bn != 1 && bn != p.n) return why;
    if (bm != 1) {
        // a per-row bias needs y's row dim to be M (not folded from several leading dims of A)
        if (y.size() < 2 || y[y.size() - 2] != p.m || bm != p.m) return why;
    }
    return "";
}

// layer_scale [N] (or [1, .., 1, N]) against y: "" or what is wrong.
inline std::string plan_layer_scale(const std::vector<int64_t>& scale, const GemmPlan& p) {
    int64_t lead = 1;
    for (size_t i = 0; i + 1 < scale.size(); ++i) lead *= scale[i];
    if (scale.empty() || lead != 1 || scale.back() != p.n) {
        return "layer_scale " + dims_str(scale) + " is not one value per column of the output " +
               dims_str(p.out_shape) + " ([N=" + std::to_string(p.n) + "])";
    }
    return "";
}

// TOut: y's type and the residual's (T, or float for a half GEMM whose output cast is fused in).
template <class T, class TOut = T>
struct GemmIO {
    const T* a = nullptr;
    const T* b = nullptr;
    const T* bias = nullptr;         // broadcast [bias_m, bias_n] (each 1 or M / N), nullptr: none
    const T* layer_scale = nullptr;  // [N], nullptr: none
    const TOut* residual = nullptr;  // y's shape, nullptr: none
    TOut* y = nullptr;
    int64_t bias_m = 1, bias_n = 1;
    float alpha = 1.0f, beta = 1.0f;
    Act act = Act::kNone;
    bool gated = false;  // B's columns interleave a gated MLP's gate and up: y [.., N / 2] = act(gate) * up
};

// Rows [i0, i1) of one batch entry: fp32 accumulation like ONNX Runtime's own CPU GEMM, in loops the compiler
// vectorizes: four rows of A share each row of B (an axpy per row), or, with B transposed, dot products with eight
// partial sums.
// load reads T, store writes TOut, load_out reads TOut (the residual).
template <class T, class TOut, class Load, class Store, class LoadOut>
void gemm_rows(const GemmPlan& p, const GemmIO<T, TOut>& io, int64_t e, int64_t i0, int64_t i1, Load load, Store store,
               LoadOut load_out) {
    constexpr int64_t R = 4;
    const int64_t m = p.m, n = p.n, k = p.k;
    const T* a = io.a + p.a_off[static_cast<size_t>(e)];
    const T* b = io.b + p.b_off[static_cast<size_t>(e)];
    const int64_t ny = io.gated ? n / 2 : n;  // y's columns
    TOut* y = io.y + e * m * ny;
    const TOut* res = io.residual != nullptr ? io.residual + e * m * n : nullptr;
    std::vector<float> acc(static_cast<size_t>(R * n)), arow(static_cast<size_t>(R * k));
    for (int64_t i = i0; i < i1; i += R) {
        const int64_t rows = std::min<int64_t>(R, i1 - i);
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t q = 0; q < k; ++q) {
                arow[static_cast<size_t>(r * k + q)] = load(p.trans_a ? a[q * m + i + r] : a[(i + r) * k + q]);
            }
        }
        if (p.trans_b) {
            for (int64_t r = 0; r < rows; ++r) {
                const float* ar = arow.data() + r * k;
                for (int64_t j = 0; j < n; ++j) {
                    const T* brow = b + j * k;
                    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    int64_t q = 0;
                    for (; q + 8 <= k; q += 8) {
                        for (int u = 0; u < 8; ++u) part[u] += ar[q + u] * load(brow[q + u]);
                    }
                    float sum = 0.0f;
                    for (; q < k; ++q) sum += ar[q] * load(brow[q]);
                    for (int u = 0; u < 8; ++u) sum += part[u];
                    acc[static_cast<size_t>(r * n + j)] = sum;
                }
            }
        } else {
            std::fill(acc.begin(), acc.end(), 0.0f);
            float* c0 = acc.data();
            float* c1 = c0 + n;
            float* c2 = c1 + n;
            float* c3 = c2 + n;
            for (int64_t q = 0; q < k; ++q) {
                const T* brow = b + q * n;
                const float a0 = arow[static_cast<size_t>(q)];
                const float a1 = rows > 1 ? arow[static_cast<size_t>(k + q)] : 0.0f;
                const float a2 = rows > 2 ? arow[static_cast<size_t>(2 * k + q)] : 0.0f;
                const float a3 = rows > 3 ? arow[static_cast<size_t>(3 * k + q)] : 0.0f;
                for (int64_t j = 0; j < n; ++j) {
                    const float bv = load(brow[j]);
                    c0[j] += a0 * bv;
                    c1[j] += a1 * bv;
                    c2[j] += a2 * bv;
                    c3[j] += a3 * bv;
                }
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = i + r;
            auto value = [&](int64_t j) {
                float v = io.alpha * acc[static_cast<size_t>(r * n + j)];
                if (io.bias != nullptr) {
                    const int64_t bi = (io.bias_m == 1 ? 0 : row) * io.bias_n + (io.bias_n == 1 ? 0 : j);
                    v += io.beta * load(io.bias[bi]);
                }
                return v;
            };
            if (io.gated) {
                for (int64_t j = 0; j < ny; ++j) {
                    y[row * ny + j] = store(activate(io.act, value(2 * j)) * value(2 * j + 1));
                }
                continue;
            }
            for (int64_t j = 0; j < n; ++j) {
                float v = activate(io.act, value(j));
                if (io.layer_scale != nullptr) v *= load(io.layer_scale[j]);
                if (res != nullptr) v += load_out(res[row * n + j]);
                y[row * n + j] = store(v);
            }
        }
    }
}

// The whole GEMM, its rows split over the machine's cores (the reference runs inside one ORT kernel call).
template <class T, class TOut, class Load, class Store, class LoadOut>
void gemm(const GemmPlan& p, const GemmIO<T, TOut>& io, Load load, Store store, LoadOut load_out) {
    const int64_t work = p.batch * p.m;
    const int64_t threads = worth_threads((work + 3) / 4, work * p.n * p.k);
    auto run = [&](int64_t t) {
        // contiguous chunks of (batch entry, row) in multiples of 4 rows
        const int64_t per = ((work + threads - 1) / threads + 3) / 4 * 4;
        for (int64_t w = t * per; w < std::min(work, (t + 1) * per);) {
            const int64_t e = w / p.m, i = w % p.m;
            const int64_t i1 = std::min(p.m, i + (std::min(work, (t + 1) * per) - w));
            gemm_rows(p, io, e, i, i1, load, store, load_out);
            w += i1 - i;
        }
    };
    parallel_for(threads, run);
}

// y of the operands' type T.
template <class T, class Load, class Store>
void gemm(const GemmPlan& p, const GemmIO<T>& io, Load load, Store store) {
    gemm(p, io, load, store, load);
}

}  // namespace ref
}  // namespace gtco
