// CPU reference of the attention families (op types Attention_* and BmmSoftmax_*): plain C++, no ORT, no CUDA.
//
//     S = scale * Q Kᵀ [+ mask_scale * mask] [+ bias_scale * bias]          per (batch, head), [seq_q, seq_k]
//     P = softmax(S) over the keys                 (BmmSoftmax writes P)
//     O = P V                                      (Attention writes O)
//
// Operands are strided views (offset, batch, head, seq, dim element strides; the layouts of
// onnx_gtco/families/attention/kernel.py layout_strides): bhsd [B,H,S,D], bshd [B,S,H,D], bshd_merged [B,S,H*D],
// qkv_packed one [B,S,3*H*D] array for q, k and v (slot 0, 1, 2), bhds [B,H,D,S] (k only: Kᵀ as MatMul reads it).
// One batch dim: the glue only binds [B, H, Sq, Sk] score cores. mask / bias are additive [B',H',Sq',Sk'] arrays
// (right-aligned, rank <= 4, each dim 1 = broadcast, or full), given here as element strides (0 = broadcast); a
// mask with a period P (Swin's shifted windows) is read at batch row b % P. Each carries the factor the graph scales
// it by after adding it (softmax((Q Kᵀ + M) * s) adds s * M to s * Q Kᵀ; 1 otherwise).
//
// Numerics follow the unfused ONNX subgraph: math in fp32 (the softmax sum accumulates in double);
// the scores stay fp32 through scale, mask and bias (ORT itself fuses MatMul and scale, and rounding them to a
// 16-bit T each step was measured further from both fp64 and ORT's own result), while P is rounded to T before
// P V as the graph stores it, and O is stored as T (both no-ops for float). Softmax subtracts the row max. A row whose scores hold a NaN, or whose max is +inf or -inf
// (every key masked with -inf), is NaN throughout, as ONNX Softmax gives it; with nan_guard (the graph's
// Where(IsNaN(P), 0, P)) those NaNs become zeros, so O is zero for such rows. banded: key j of query i is masked
// (-inf) outside band_lo <= j - i <= band_hi (causal, upper-left aligned as ONNX Attention's is_causal: band_hi = 0;
// a sliding window: both finite). seq_k == 0: P is empty and O is zero (an empty
// MatMul reduction).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "parallel.h"

namespace gtco {
namespace ref {

enum class Layout { bhsd, bshd, bshd_merged, qkv_packed, bhds, invalid };

inline Layout parse_layout(const std::string& s) {
    if (s == "bhsd") return Layout::bhsd;
    if (s == "bshd") return Layout::bshd;
    if (s == "bshd_merged") return Layout::bshd_merged;
    if (s == "qkv_packed") return Layout::qkv_packed;
    if (s == "bhds") return Layout::bhds;
    return Layout::invalid;
}

inline const char* layout_name(Layout l) {
    switch (l) {
        case Layout::bhsd: return "bhsd";
        case Layout::bshd: return "bshd";
        case Layout::bshd_merged: return "bshd_merged";
        case Layout::qkv_packed: return "qkv_packed";
        case Layout::bhds: return "bhds";
        default: return "invalid";
    }
}

// Array shape of one operand in layout l (qkv_packed: the whole packed array).
inline std::vector<int64_t> layout_shape(Layout l, int64_t b, int64_t h, int64_t s, int64_t d) {
    switch (l) {
        case Layout::bhsd: return {b, h, s, d};
        case Layout::bshd: return {b, s, h, d};
        case Layout::bshd_merged: return {b, s, h * d};
        case Layout::qkv_packed: return {b, s, 3 * h * d};
        case Layout::bhds: return {b, h, d, s};
        default: return {};
    }
}

// What the shape of an operand must be, in words, for messages: "[B,S,H*D=192]".
inline std::string layout_pattern(Layout l, int64_t h, int64_t d) {
    const std::string H = std::to_string(h), D = std::to_string(d);
    switch (l) {
        case Layout::bhsd: return "[B," + H + ",S," + D + "]";
        case Layout::bshd: return "[B,S," + H + "," + D + "]";
        case Layout::bshd_merged: return "[B,S," + std::to_string(h * d) + "]";
        case Layout::qkv_packed: return "[B,S," + std::to_string(3 * h * d) + "]";
        case Layout::bhds: return "[B," + H + "," + D + ",S]";
        default: return "[?]";
    }
}

// Reads batch and seq of an operand of layout l from its run-time shape; false when the shape does not fit.
inline bool layout_dims(Layout l, const std::vector<int64_t>& shape, int64_t h, int64_t d, int64_t& b, int64_t& s) {
    const std::vector<int64_t> probe = layout_shape(l, 1, h, 1, d);
    if (probe.empty() || shape.size() != probe.size()) return false;
    for (int64_t v : shape)
        if (v < 0) return false;
    b = shape[0];
    s = (l == Layout::bhsd || l == Layout::bhds) ? shape[l == Layout::bhsd ? 2 : 3] : shape[1];
    return shape == layout_shape(l, b, h, s, d);
}

struct Strides {
    int64_t off = 0, sb = 0, sh = 0, ss = 0, sd = 0;
};

// (offset, batch, head, seq, dim) element strides of a contiguous operand; `which` picks q/k/v of qkv_packed.
inline Strides layout_strides(Layout l, int64_t h, int64_t s, int64_t d, int which = 0) {
    switch (l) {
        case Layout::bhsd: return {0, h * s * d, s * d, d, 1};
        case Layout::bshd:
        case Layout::bshd_merged: return {0, s * h * d, d, h * d, 1};
        case Layout::qkv_packed: return {which * h * d, s * 3 * h * d, d, 3 * h * d, 1};
        case Layout::bhds: return {0, h * d * s, d * s, 1, s};
        default: return {};
    }
}

// Element strides of an additive [B',H',Sq',Sk'] operand of rank <= 4 against scores [b,h,sq,sk] (right-aligned,
// 0 for broadcast dims); false when a dim is neither 1 nor the scores' size.
inline bool addend_strides(const std::vector<int64_t>& shape, int64_t b, int64_t h, int64_t sq, int64_t sk,
                           int64_t st[4]) {
    if (shape.size() > 4) return false;
    const int64_t full[4] = {b, h, sq, sk};
    int64_t dims[4] = {1, 1, 1, 1};
    const size_t lead = 4 - shape.size();
    for (size_t i = 0; i < shape.size(); ++i) dims[lead + i] = shape[i];
    int64_t stride = 1;
    for (int i = 3; i >= 0; --i) {
        if (dims[i] != 1 && dims[i] != full[i]) return false;
        st[i] = dims[i] == 1 ? 0 : stride;
        stride *= dims[i];
    }
    return true;
}

// addend_strides for a mask read at batch row b % period: its shape (rank <= 5) broadcasts to
// [b / period, period, h, sq, sk] with a leading dim of 1 (Swin's shifted-window mask [1, nW, 1|H, N, N]); false
// when it does not, or when period does not divide b.
inline bool period_addend_strides(const std::vector<int64_t>& shape, int64_t period, int64_t b, int64_t h,
                                  int64_t sq, int64_t sk, int64_t st[4]) {
    if (period <= 0 || b % period != 0 || shape.size() > 5 || (shape.size() == 5 && shape[0] != 1)) return false;
    const std::vector<int64_t> tail(shape.end() - static_cast<std::ptrdiff_t>(std::min<size_t>(shape.size(), 4)),
                                    shape.end());
    return addend_strides(tail, period, h, sq, sk, st);
}

struct Problem {
    int64_t batch = 0, heads = 0, seq_q = 0, seq_k = 0, head_dim = 0;
    int64_t kv_group = 1;  // query heads per key / value head (GQA): k and v have heads / kv_group heads
    float scale = 1.0f;
    bool banded = false;  // key j of query i kept only where band_lo <= j - i <= band_hi (causal: band_hi = 0)
    int64_t band_lo = 0, band_hi = 0;
    bool nan_guard = false;
};

template <class T>
struct Operand {
    const T* data = nullptr;
    Strides st;
    const T* at(int64_t b, int64_t h, int64_t s, int64_t d) const {
        return data + st.off + b * st.sb + h * st.sh + s * st.ss + d * st.sd;
    }
};

// Reads batch row b % bmod (bmod 0: row b): Swin's window mask [nW, ...] over batch rows (image, window).
template <class T>
struct Addend {
    const T* data = nullptr;  // nullptr: absent
    int64_t sb = 0, sh = 0, sq = 0, sk = 0;
    int64_t bmod = 0;
    float scale = 1.0f;  // the factor the graph applies to this term (a scale after its Add)
    int64_t row(int64_t b) const { return bmod > 0 ? b % bmod : b; }
};

// One head's operand [seq][head_dim] as contiguous fp32 (the dot products then run over contiguous memory).
template <class T, class Load>
void load_head(const Operand<T>& x, int64_t b, int64_t h, int64_t seq, int64_t dim, std::vector<float>& out,
               Load load) {
    out.resize(static_cast<size_t>(seq * dim));
    for (int64_t s = 0; s < seq; ++s)
        for (int64_t d = 0; d < dim; ++d) out[static_cast<size_t>(s * dim + d)] = load(*x.at(b, h, s, d));
}

inline float dot(const float* a, const float* b, int64_t n) {
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; ++u) part[u] += a[i + u] * b[i + u];
    float sum = 0.0f;
    for (; i < n; ++i) sum += a[i] * b[i];
    for (int u = 0; u < 8; ++u) sum += part[u];
    return sum;
}

// One row of P (scores of query i of (b, h)) into p[0..seq_k), rounded to T as the graph stores it. qi: the query
// row, kh: the head's keys [seq_k][head_dim], both fp32.
template <class T, class Load, class Store>
void probs_row(const Problem& pr, const float* qi, const float* kh, const Addend<T>& mask, const Addend<T>& bias,
               int64_t b, int64_t h, int64_t i, std::vector<float>& p, Load load, Store store) {
    auto rnd = [&](float x) { return load(store(x)); };
    const float inf = std::numeric_limits<float>::infinity();
    bool bad = false;
    float mx = -inf;
    for (int64_t j = 0; j < pr.seq_k; ++j) {
        float s = dot(qi, kh + j * pr.head_dim, pr.head_dim) * pr.scale;
        for (const Addend<T>* a : {&mask, &bias}) {
            if (a->data != nullptr)
                s += load(a->data[a->row(b) * a->sb + h * a->sh + i * a->sq + j * a->sk]) * a->scale;
        }
        if (pr.banded && (j - i < pr.band_lo || j - i > pr.band_hi)) s = -inf;
        if (std::isnan(s)) bad = true;
        if (s > mx) mx = s;
        p[static_cast<size_t>(j)] = s;
    }
    if (bad || std::isinf(mx)) {
        const float fill = pr.nan_guard ? 0.0f : std::numeric_limits<float>::quiet_NaN();
        for (int64_t j = 0; j < pr.seq_k; ++j) p[static_cast<size_t>(j)] = fill;
        return;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < pr.seq_k; ++j) {
        const float e = std::exp(p[static_cast<size_t>(j)] - mx);
        p[static_cast<size_t>(j)] = e;
        sum += e;
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < pr.seq_k; ++j) {
        float v = rnd(p[static_cast<size_t>(j)] * inv);
        if (pr.nan_guard && std::isnan(v)) v = 0.0f;
        p[static_cast<size_t>(j)] = v;
    }
}

// fn(b, h) for every head, the heads split over the machine's cores (the reference runs inside one ORT kernel).
template <class Fn>
void for_each_head(const Problem& pr, Fn fn) {
    const int64_t heads = pr.batch * pr.heads;
    const int64_t threads = worth_threads(heads, heads * pr.seq_q * pr.seq_k * std::max<int64_t>(pr.head_dim, 1));
    parallel_for(threads, [&](int64_t t) {
        for (int64_t x = t; x < heads; x += threads) fn(x / pr.heads, x % pr.heads);
    });
}

// Attention: out[b,h,i,:] (strides `os`: sb, sh, ss (query), sd) = P V.
template <class T, class Load, class Store>
void attention(const Problem& pr, const Operand<T>& q, const Operand<T>& k, const Operand<T>& v,
               const Addend<T>& mask, const Addend<T>& bias, T* out, const Strides& os, Load load, Store store) {
    const int64_t dim = pr.head_dim;
    for_each_head(pr, [&](int64_t b, int64_t h) {
        std::vector<float> qh, kh, vh, p(static_cast<size_t>(pr.seq_k)), acc(static_cast<size_t>(dim));
        load_head(q, b, h, pr.seq_q, dim, qh, load);
        load_head(k, b, h / pr.kv_group, pr.seq_k, dim, kh, load);
        load_head(v, b, h / pr.kv_group, pr.seq_k, dim, vh, load);
        for (int64_t i = 0; i < pr.seq_q; ++i) {
            probs_row(pr, qh.data() + i * dim, kh.data(), mask, bias, b, h, i, p, load, store);
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t j = 0; j < pr.seq_k; ++j) {
                const float pj = p[static_cast<size_t>(j)];
                const float* vj = vh.data() + j * dim;
                for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] += pj * vj[d];
            }
            T* o = out + os.off + b * os.sb + h * os.sh + i * os.ss;
            for (int64_t d = 0; d < dim; ++d) o[d * os.sd] = store(acc[static_cast<size_t>(d)]);
        }
    });
}

// BmmSoftmax: probs[b,h,i,j] (strides `os`: sb, sh, ss (query), sd (key)) = P.
template <class T, class Load, class Store>
void bmm_softmax(const Problem& pr, const Operand<T>& q, const Operand<T>& k, const Addend<T>& mask,
                 const Addend<T>& bias, T* probs, const Strides& os, Load load, Store store) {
    const int64_t dim = pr.head_dim;
    for_each_head(pr, [&](int64_t b, int64_t h) {
        std::vector<float> qh, kh, p(static_cast<size_t>(pr.seq_k));
        load_head(q, b, h, pr.seq_q, dim, qh, load);
        load_head(k, b, h / pr.kv_group, pr.seq_k, dim, kh, load);
        for (int64_t i = 0; i < pr.seq_q; ++i) {
            probs_row(pr, qh.data() + i * dim, kh.data(), mask, bias, b, h, i, p, load, store);
            T* o = probs + os.off + b * os.sb + h * os.sh + i * os.ss;
            for (int64_t j = 0; j < pr.seq_k; ++j) o[j * os.sd] = store(p[static_cast<size_t>(j)]);
        }
    });
}

}  // namespace ref
}  // namespace gtco
