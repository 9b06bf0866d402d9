// Test-only C entry point over plugins/families/attention/attention_ref.h (no ORT): tests/families/attention/test_attention_glue.py builds
// this as a shared library with g++ and calls it through ctypes. It does what gtco::AttentionGlue::compute does
// on the CPU EP, minus ORT: parse the layouts, read batch / seq from the operands' shapes, compute the strides and
// run the reference. dtype 0: float storage; 1: bfloat16 stored as uint16 (round to nearest even).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention/attention_ref.h"

namespace {

float bf16_load(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t bf16_store(float f) {
    if (std::isnan(f)) return 0x7fc0u;
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

float f32_load(float v) { return v; }
float f32_store(float v) { return v; }

std::vector<int64_t> dims(const int64_t* shape, int rank) { return std::vector<int64_t>(shape, shape + rank); }

void set_error(char* err, int len, const std::string& msg) {
    if (err == nullptr || len <= 0) return;
    std::strncpy(err, msg.c_str(), static_cast<size_t>(len - 1));
    err[len - 1] = '\0';
}

template <class T, class Load, class Store>
int run(int with_v, const void* q, const int64_t* q_shape, int q_rank, const void* k, const int64_t* k_shape,
        int k_rank, const void* v, const int64_t* v_shape, int v_rank, const void* mask, const int64_t* mask_shape,
        int mask_rank, const void* bias, const int64_t* bias_shape, int bias_rank, void* out, int64_t heads,
        int64_t head_dim, const char* ql, const char* kl, const char* vl, const char* ol, float scale, int causal,
        int nan_guard, float mask_scale, float bias_scale, char* err, int err_len, Load load, Store store) {
    using namespace gtco::ref;
    const Layout lq = parse_layout(ql), lk = parse_layout(kl), lv = parse_layout(vl), lo = parse_layout(ol);
    int64_t b = 0, sq = 0, bk = 0, sk = 0, bv = 0, sv = 0;
    if (!layout_dims(lq, dims(q_shape, q_rank), heads, head_dim, b, sq)) return set_error(err, err_len, "q"), 1;
    if (!layout_dims(lk, dims(k_shape, k_rank), heads, head_dim, bk, sk)) return set_error(err, err_len, "k"), 1;
    if (with_v && !layout_dims(lv, dims(v_shape, v_rank), heads, head_dim, bv, sv))
        return set_error(err, err_len, "v"), 1;
    if (bk != b || (with_v && (bv != b || sv != sk))) return set_error(err, err_len, "batch/seq"), 1;
    Problem pr;
    pr.batch = b, pr.heads = heads, pr.seq_q = sq, pr.seq_k = sk, pr.head_dim = head_dim;
    pr.scale = scale, pr.nan_guard = nan_guard != 0;
    pr.banded = causal != 0, pr.band_lo = -(int64_t{1} << 30), pr.band_hi = 0;  // causal: the band (-inf, 0]
    Addend<T> am, ab;
    int64_t st[4];
    if (mask != nullptr) {
        if (!addend_strides(dims(mask_shape, mask_rank), b, heads, sq, sk, st)) return set_error(err, err_len, "mask"), 1;
        am = Addend<T>{static_cast<const T*>(mask), st[0], st[1], st[2], st[3]};
        am.scale = mask_scale;
    }
    if (bias != nullptr) {
        if (!addend_strides(dims(bias_shape, bias_rank), b, heads, sq, sk, st)) return set_error(err, err_len, "bias"), 1;
        ab = Addend<T>{static_cast<const T*>(bias), st[0], st[1], st[2], st[3]};
        ab.scale = bias_scale;
    }
    Operand<T> oq{static_cast<const T*>(q), layout_strides(lq, heads, sq, head_dim, 0)};
    Operand<T> ok{static_cast<const T*>(k), layout_strides(lk, heads, sk, head_dim, 1)};
    if (with_v) {
        Operand<T> ov{static_cast<const T*>(v), layout_strides(lv, heads, sk, head_dim, 2)};
        attention<T>(pr, oq, ok, ov, am, ab, static_cast<T*>(out), layout_strides(lo, heads, sq, head_dim), load,
                     store);
    } else {
        bmm_softmax<T>(pr, oq, ok, am, ab, static_cast<T*>(out), Strides{0, heads * sq * sk, sq * sk, sk, 1}, load,
                       store);
    }
    return 0;
}

}  // namespace

extern "C" int gtco_attention_ref(int dtype, int with_v, const void* q, const int64_t* q_shape, int q_rank,
                                  const void* k, const int64_t* k_shape, int k_rank, const void* v,
                                  const int64_t* v_shape, int v_rank, const void* mask, const int64_t* mask_shape,
                                  int mask_rank, const void* bias, const int64_t* bias_shape, int bias_rank,
                                  void* out, int64_t heads, int64_t head_dim, const char* q_layout,
                                  const char* k_layout, const char* v_layout, const char* out_layout, float scale,
                                  int causal, int nan_guard, float mask_scale, float bias_scale, char* err,
                                  int err_len) {
    if (dtype == 0)
        return run<float>(with_v, q, q_shape, q_rank, k, k_shape, k_rank, v, v_shape, v_rank, mask, mask_shape,
                          mask_rank, bias, bias_shape, bias_rank, out, heads, head_dim, q_layout, k_layout, v_layout,
                          out_layout, scale, causal, nan_guard, mask_scale, bias_scale, err, err_len, f32_load,
                          f32_store);
    return run<uint16_t>(with_v, q, q_shape, q_rank, k, k_shape, k_rank, v, v_shape, v_rank, mask, mask_shape,
                         mask_rank, bias, bias_shape, bias_rank, out, heads, head_dim, q_layout, k_layout, v_layout,
                         out_layout, scale, causal, nan_guard, mask_scale, bias_scale, err, err_len, bf16_load,
                         bf16_store);
}
