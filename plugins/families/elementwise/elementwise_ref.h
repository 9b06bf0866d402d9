// CPU reference of the Elementwise family (op types Elementwise_f32 / _f16 / _bf16): plain C++, no ORT, no CUDA.
//
// The program differs per node, so there is no one reference function: onnx_gtco/families/elementwise/kernel.py
// (ElementwiseFamily.host_function, from plugins/families/elementwise/elementwise.cu.j2) writes one host function per
// program into the generated glue: the program as a struct (its storage type, collapsed iteration shape and
// operands as in gtco/broadcast.h, and its fp32 body) and a function running it over a range of elements with
// gtco::ref::ew::run. This header holds what those functions share: that loop, with the same numpy-broadcast
// index arithmetic as the device instance (gtco/broadcast.h), the storage types and their fp32 conversions, and the
// math of the supported ONNX ops, the same formulas as gtco::ew in elementwise/elementwise.cuh (host libm instead of
// CUDA's, so results agree to rounding).
#pragma once

#include <cmath>
#include <cstdint>

#include "elementwise/elementwise_args.h"
#include "gtco/args.h"
#include "gtco/broadcast.h"
#include "gtco/half_bits.h"

namespace gtco {
namespace ref {
namespace ew {

// The signature of a generated host function: elements [begin, end) of the iteration shape, operands as in the
// instance's GtcoElementwiseArgs (in[i] the i-th kernel input, out[j] the j-th output).
using HostFn = void (*)(const GtcoElementwiseArgs* args, uint64_t begin, uint64_t end);

// fp16 / bf16 storage (the bits of ONNX FLOAT16 / BFLOAT16; distinct types so that overloads pick the right one)
struct f16 {
    uint16_t bits;
};
struct bf16 {
    uint16_t bits;
};

using bits::bf16_bits_to_f32;
using bits::f16_bits_to_f32;
using bits::f32_to_bf16_bits;
using bits::f32_to_f16_bits;

inline float to_f32(float x) { return x; }
inline float to_f32(f16 x) { return f16_bits_to_f32(x.bits); }
inline float to_f32(bf16 x) { return bf16_bits_to_f32(x.bits); }
inline float to_f32(uint8_t x) { return x ? 1.0f : 0.0f; }  // ONNX bool
inline float to_f32(int32_t x) { return static_cast<float>(x); }
inline float to_f32(int64_t x) { return static_cast<float>(x); }

template <typename T>
T from_f32(float x);
template <>
inline float from_f32<float>(float x) { return x; }
template <>
inline f16 from_f32<f16>(float x) { return f16{f32_to_f16_bits(x)}; }
template <>
inline bf16 from_f32<bf16>(float x) { return bf16{f32_to_bf16_bits(x)}; }

// ---- the math of the elementwise ONNX ops (fp32), as gtco::ew in elementwise/elementwise.cuh -------------------------
inline float relu(float x) { return x > 0.0f ? x : 0.0f; }
inline float leaky_relu(float x, float alpha) { return x >= 0.0f ? x : alpha * x; }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float gelu_erf(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f)); }
inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}
inline float where(float c, float a, float b) { return c != 0.0f ? a : b; }
inline float elu(float x, float alpha) { return x >= 0.0f ? x : alpha * std::expm1(x); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
inline float softsign(float x) { return x / (1.0f + std::fabs(x)); }
inline float hard_sigmoid(float x, float alpha, float beta) {
    return std::fmax(0.0f, std::fmin(1.0f, alpha * x + beta));
}
inline float hard_swish(float x) { return x * hard_sigmoid(x, 1.0f / 6.0f, 0.5f); }
inline float sign(float x) { return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x; }
inline float is_nan(float x) { return x != x ? 1.0f : 0.0f; }  // no fast-math here: NaN compares unequal
inline float sin(float x) { return std::sin(x); }
inline float cos(float x) { return std::cos(x); }
inline float truth(float x) { return x != 0.0f ? 1.0f : 0.0f; }
inline float lnot(float x) { return x != 0.0f ? 0.0f : 1.0f; }
inline float land(float a, float b) { return (a != 0.0f && b != 0.0f) ? 1.0f : 0.0f; }
inline float lor(float a, float b) { return (a != 0.0f || b != 0.0f) ? 1.0f : 0.0f; }
inline float lxor(float a, float b) { return ((a != 0.0f) != (b != 0.0f)) ? 1.0f : 0.0f; }
inline float round_f16(float x) { return f16_bits_to_f32(f32_to_f16_bits(x)); }
inline float round_bf16(float x) { return to_f32(bf16{f32_to_bf16_bits(x)}); }

// Program's body (gtco::ew::Elementwise in elementwise/elementwise.cuh describes Program) over elements [begin, end) of
// its iteration shape, one at a time: the generated host function of a program calls this.
template <class Program>
void run(const GtcoElementwiseArgs* a, uint64_t begin, uint64_t end) {
    using T = typename Program::T;
    using Shape = typename Program::Shape;
    using Inputs = typename Program::Inputs;
    constexpr int nin = Inputs::size;
    float x[nin], y[Program::NOUT];
    for (uint64_t e = begin; e < end; ++e) {
        gtco::ew::for_each<nin>([&](auto i) {
            using In = typename gtco::ew::input_at<decltype(i)::value, Inputs>::type;
            const auto* in = static_cast<const typename In::type*>(a->in[decltype(i)::value]);
            x[decltype(i)::value] = to_f32(in[In::template offset<Shape>(e)]);
        });
        Program::body(x, y);
        gtco::ew::for_each<Program::NOUT>([&](auto o) {
            using Out = typename gtco::ew::input_at<decltype(o)::value, typename Program::Outputs>::type;
            static_cast<T*>(a->out[decltype(o)::value])[Out::template offset<Shape>(e)] = from_f32<T>(y[decltype(o)::value]);
        });
    }
}

// The same for a program built for run-time shapes (gtco::ew::Dynamic in elementwise/elementwise.cuh describes its
// Program): the collapsed dims and each input's strides come with the call (args dims / strides; a rolled input's
// index along its rolled dim shifted, gtco::ew::Walk), outputs dense.
template <class Program>
void run_dynamic(const GtcoElementwiseArgs* a, uint64_t begin, uint64_t end) {
    using T = typename Program::T;
    using Inputs = typename Program::Inputs;
    constexpr int nin = Inputs::size, rank = Program::RANK;
    float x[nin], y[Program::NOUT];
    uint64_t c[rank];
    for (uint64_t e = begin; e < end; ++e) {
        uint64_t rest = e;
        for (int j = rank - 1; j > 0; --j) {
            c[j] = rest % static_cast<uint64_t>(a->dims[j]);
            rest /= static_cast<uint64_t>(a->dims[j]);
        }
        c[0] = rest;
        gtco::ew::for_each<nin>([&](auto i) {
            constexpr int X = decltype(i)::value;
            using In = typename gtco::ew::input_at<X, Inputs>::type;
            uint64_t off = 0;
            for (int j = 0; j < rank; ++j) off += In::index(j, c[j]) * static_cast<uint64_t>(a->strides[X][j]);
            x[X] = to_f32(static_cast<const typename In::type*>(a->in[X])[off]);
        });
        Program::body(x, y);
        for (int o = 0; o < Program::NOUT; ++o) static_cast<T*>(a->out[o])[e] = from_f32<T>(y[o]);
    }
}

}  // namespace ew
}  // namespace ref
}  // namespace gtco
