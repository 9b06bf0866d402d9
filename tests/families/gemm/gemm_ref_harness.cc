// Test-only C entry points over plugins/families/gemm/gemm_ref.h (no ORT): tests/families/gemm/test_gemm_glue.py builds this as a
// shared library with g++ and calls it through ctypes. dtype 0: float storage, 1: bfloat16 stored as uint16
// (round to nearest even), to show the reference is generic over its storage.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gemm/gemm_ref.h"

namespace {

float bf16_load(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t bf16_store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

float f32_load(float v) { return v; }
float f32_store(float v) { return v; }

std::vector<int64_t> dims(const int64_t* shape, int rank) {
    return rank < 0 ? std::vector<int64_t>{} : std::vector<int64_t>(shape, shape + rank);
}

int fail(const std::string& msg, char* err, int err_cap) {
    if (err != nullptr && err_cap > 0) {
        std::strncpy(err, msg.c_str(), static_cast<size_t>(err_cap - 1));
        err[err_cap - 1] = '\0';
    }
    return 1;
}

template <class T, class Load, class Store>
void run(const gtco::ref::GemmPlan& p, const void* a, const void* b, const void* bias, int64_t bm, int64_t bn,
         const void* scale, const void* res, float alpha, float beta, gtco::ref::Act act, void* y, Load load,
         Store store) {
    gtco::ref::GemmIO<T> io;
    io.a = static_cast<const T*>(a);
    io.b = static_cast<const T*>(b);
    io.bias = static_cast<const T*>(bias);
    io.layer_scale = static_cast<const T*>(scale);
    io.bias_m = bm;
    io.bias_n = bn;
    io.residual = static_cast<const T*>(res);
    io.y = static_cast<T*>(y);
    io.alpha = alpha;
    io.beta = beta;
    io.act = act;
    gtco::ref::gemm<T>(p, io, load, store);
}

}  // namespace

// Plans and runs one GEMM. bias_rank < 0: no bias; scale_rank < 0: no layer_scale; res: y-shaped or null. y_cap:
// elements y can hold; y_shape (8 dims) and y_rank receive y's shape. Returns 0, or 1 with the planner's message in
// err.
extern "C" int gtco_test_gemm(int dtype, const void* a, const int64_t* a_shape, int a_rank, const void* b,
                              const int64_t* b_shape, int b_rank, const void* bias, const int64_t* bias_shape,
                              int bias_rank, const void* scale, const int64_t* scale_shape, int scale_rank,
                              const void* res, int trans_a, int trans_b, float alpha, float beta,
                              const char* act_name, void* y, int64_t y_cap, int64_t* y_shape, int* y_rank, char* err,
                              int err_cap) {
    gtco::ref::Act act;
    if (!gtco::ref::parse_act(act_name, act)) return fail(std::string("unknown activation ") + act_name, err, err_cap);
    gtco::ref::GemmPlan p;
    std::string why = gtco::ref::plan_gemm(dims(a_shape, a_rank), dims(b_shape, b_rank), trans_a != 0,
                                           trans_b != 0, p);
    if (!why.empty()) return fail(why, err, err_cap);
    int64_t bm = 1, bn = 1;
    if (bias_rank >= 0) {
        why = gtco::ref::plan_bias(dims(bias_shape, bias_rank), p, bm, bn);
        if (!why.empty()) return fail(why, err, err_cap);
    }
    if (scale_rank >= 0) {
        why = gtco::ref::plan_layer_scale(dims(scale_shape, scale_rank), p);
        if (!why.empty()) return fail(why, err, err_cap);
    }
    if (p.out_shape.size() > 8) return fail("output rank > 8", err, err_cap);
    int64_t numel = 1;
    for (size_t i = 0; i < p.out_shape.size(); ++i) {
        y_shape[i] = p.out_shape[i];
        numel *= p.out_shape[i];
    }
    *y_rank = static_cast<int>(p.out_shape.size());
    if (numel > y_cap) return fail("output of " + std::to_string(numel) + " elements does not fit", err, err_cap);
    const void* bias_data = bias_rank >= 0 ? bias : nullptr;
    const void* scale_data = scale_rank >= 0 ? scale : nullptr;
    if (dtype == 0) {
        run<float>(p, a, b, bias_data, bm, bn, scale_data, res, alpha, beta, act, y, f32_load, f32_store);
    } else {
        run<uint16_t>(p, a, b, bias_data, bm, bn, scale_data, res, alpha, beta, act, y, bf16_load, bf16_store);
    }
    return 0;
}

// The activation alone, elementwise on n floats (the epilogue's function, for a direct check against numpy).
extern "C" int gtco_test_activate(const char* act_name, const float* x, float* y, int64_t n) {
    gtco::ref::Act act;
    if (!gtco::ref::parse_act(act_name, act)) return 1;
    for (int64_t i = 0; i < n; ++i) y[i] = gtco::ref::activate(act, x[i]);
    return 0;
}
