// Elementwise family: one thread computes VEC consecutive elements of a generated fp32 expression program.
//
// The instance (.cu written by onnx_gtco/kernels/elementwise.py) holds the program itself: a device function
// `body(const float (&x)[NIN], float (&y)[NOUT])`, the broadcast index of every input as constant arithmetic on
// the flattened output index, and the kernel (its `vec_ok` argument, false when a vector-loaded pointer is not
// aligned to VEC elements, sends every element down the scalar path). This header holds what every instance
// shares, and what the other row-wise families (layernorm.cuh, softmax.cuh) reuse: the 16/32-bit <-> fp32
// conversions, vector loads and stores of VEC elements (one 16-byte access at most), and the math of the
// supported ONNX ops.
#pragma once

#include <cmath>
#include <cstdint>

#include "gtco/launch.cuh"

namespace gtco {

// ---- conversions: every family does its math in fp32 ---------------------------------------------------------
GTCO_DEVICE float to_f32(float x) { return x; }
GTCO_DEVICE float to_f32(__half x) { return __half2float(x); }
GTCO_DEVICE float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
GTCO_DEVICE float to_f32(uint8_t x) { return x ? 1.0f : 0.0f; }  // ONNX bool
GTCO_DEVICE float to_f32(int32_t x) { return static_cast<float>(x); }
GTCO_DEVICE float to_f32(int64_t x) { return static_cast<float>(x); }

template <typename T>
GTCO_DEVICE T from_f32(float x);
template <>
GTCO_DEVICE float from_f32<float>(float x) { return x; }
template <>
GTCO_DEVICE __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
GTCO_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---- vector access: N elements of T in one aligned access (N * sizeof(T) <= 16) ------------------------------
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <typename T, int N>
GTCO_DEVICE void load_vec(float (&out)[N], const T* p) {
    static_assert(sizeof(T) * N <= 16 && (N & (N - 1)) == 0, "load_vec: one access of at most 16 bytes");
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
    GTCO_UNROLL
    for (int k = 0; k < N; ++k) out[k] = to_f32(v.v[k]);
}

// Loads N elements into out[0..N) starting at out[at]: for rows held as float regs[ITEMS * N].
template <typename T, int N>
GTCO_DEVICE void load_vec_at(float* out, const T* p) {
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
    GTCO_UNROLL
    for (int k = 0; k < N; ++k) out[k] = to_f32(v.v[k]);
}

template <typename T, int N>
GTCO_DEVICE void store_vec_at(T* p, const float* in) {
    static_assert(sizeof(T) * N <= 16 && (N & (N - 1)) == 0, "store_vec: one access of at most 16 bytes");
    Vec<T, N> v;
    GTCO_UNROLL
    for (int k = 0; k < N; ++k) v.v[k] = from_f32<T>(in[k]);
    *reinterpret_cast<Vec<T, N>*>(p) = v;
}

template <typename T, int N>
GTCO_DEVICE void store_vec(T* p, const float (&in)[N]) {
    store_vec_at<T, N>(p, in);
}

__host__ __device__ inline bool aligned_to(const void* p, int bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

GTCO_DEVICE float fast_rsqrt(float x) {
#if defined(GTCO_EMULATE)
    return 1.0f / std::sqrt(x);
#else
    return rsqrtf(x);
#endif
}

// ---- the math of the elementwise ONNX ops (fp32) --------------------------------------------------------------
namespace ew {

GTCO_DEVICE float relu(float x) { return x > 0.0f ? x : 0.0f; }
GTCO_DEVICE float leaky_relu(float x, float alpha) { return x >= 0.0f ? x : alpha * x; }
GTCO_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
GTCO_DEVICE float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
GTCO_DEVICE float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}
GTCO_DEVICE float where(float c, float a, float b) { return c != 0.0f ? a : b; }
GTCO_DEVICE float elu(float x, float alpha) { return x >= 0.0f ? x : alpha * expm1f(x); }
// log(1 + e^x); above 20 it is x to fp32 precision (and e^x would overflow past 88)
GTCO_DEVICE float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
GTCO_DEVICE float softsign(float x) { return x / (1.0f + fabsf(x)); }
GTCO_DEVICE float hard_sigmoid(float x, float alpha, float beta) {
    return fmaxf(0.0f, fminf(1.0f, alpha * x + beta));
}
GTCO_DEVICE float hard_swish(float x) { return x * hard_sigmoid(x, 1.0f / 6.0f, 0.5f); }
GTCO_DEVICE float sign(float x) { return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x; }  // keeps 0 and NaN
// sin / cos without the local-memory (stack frame) slow path of CUDA's sinf / cosf for huge arguments: Cody-Waite
// reduction by pi/2 (two-part constant with fma, accurate while |x| / (pi/2) stays well below 2^16) and the
// single-precision minimax polynomials of Cephes on [-pi/4, pi/4]; NaN and infinities give NaN.
GTCO_DEVICE float sin_poly(float r, float z) {
    return fmaf(r * z, fmaf(z, fmaf(z, -1.9515295891e-4f, 8.3321608736e-3f), -1.6666654611e-1f), r);
}
GTCO_DEVICE float cos_poly(float z) {
    return fmaf(z * z, fmaf(z, fmaf(z, 2.443315711809948e-5f, -1.388731625493765e-3f), 4.166664568298827e-2f),
                fmaf(-0.5f, z, 1.0f));
}
// quadrant q of x (0..3, NaN for non-finite x) and the remainder r = x - k * pi/2 in [-pi/4, pi/4]
GTCO_DEVICE float reduce_half_pi(float x, float& q) {
    const float k = rintf(x * 0.63661977236758134f);
    q = k - 4.0f * floorf(k * 0.25f);
    const float r = fmaf(-k, 1.57079637050628662109375f, x);
    return fmaf(-k, -4.37113900018624283e-8f, r);
}
GTCO_DEVICE float sin(float x) {
    float q;
    const float r = reduce_half_pi(x, q), z = r * r;
    const float s = sin_poly(r, z), c = cos_poly(z);
    return q == 0.0f ? s : q == 1.0f ? c : q == 2.0f ? -s : q == 3.0f ? -c : r;
}
GTCO_DEVICE float cos(float x) {
    float q;
    const float r = reduce_half_pi(x, q), z = r * r;
    const float s = sin_poly(r, z), c = cos_poly(z);
    return q == 0.0f ? c : q == 1.0f ? -s : q == 2.0f ? -c : q == 3.0f ? s : r;
}
// booleans are 1.0f / 0.0f; any nonzero value reads as true (ONNX bool inputs load as 1 / 0)
GTCO_DEVICE float truth(float x) { return x != 0.0f ? 1.0f : 0.0f; }
GTCO_DEVICE float lnot(float x) { return x != 0.0f ? 0.0f : 1.0f; }
GTCO_DEVICE float land(float a, float b) { return (a != 0.0f && b != 0.0f) ? 1.0f : 0.0f; }
GTCO_DEVICE float lor(float a, float b) { return (a != 0.0f || b != 0.0f) ? 1.0f : 0.0f; }
GTCO_DEVICE float lxor(float a, float b) { return ((a != 0.0f) != (b != 0.0f)) ? 1.0f : 0.0f; }
GTCO_DEVICE float round_f16(float x) { return to_f32(__float2half_rn(x)); }
GTCO_DEVICE float round_bf16(float x) { return to_f32(__float2bfloat16_rn(x)); }

}  // namespace ew
}  // namespace gtco
