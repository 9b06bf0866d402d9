// CPU reference of the LayerNorm family (op types Layernorm_f32 / _f16 / _bf16): plain C++, no ORT, no CUDA.
//
//     s = a [+ b]                                   (the residual Add, when the group has one)
//     y = (s - mean(s)) / sqrt(var(s) + eps) [* gamma] [+ beta]   over the trailing `hidden` elements of each row
//
// Without `center`, RMSNorm's (the rmsnorm family, Rmsnorm_*): the mean is taken as 0, so var(s) is mean(s^2).
//
// Math is fp32 (mean and variance accumulate in double, two passes); inputs and outputs are stored as T and
// converted through the caller's load/store. With a residual, the sum is rounded to T first (as the unfused
// graph's Add would) and the normalisation reads that rounded sum; `sum` (optional) receives it.
// gamma / beta hold either `hidden` elements or one (a broadcast scalar), or are absent (nullptr).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace gtco {
namespace ref {

template <class T, class Load, class Store>
void layernorm(const T* a, const T* b, const T* gamma, int64_t gamma_n, const T* beta, int64_t beta_n, T* y,
               T* sum, int64_t rows, int64_t hidden, float eps, Load load, Store store, bool center = true) {
    std::vector<float> s(static_cast<size_t>(hidden));
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = r * hidden;
        double acc = 0.0;
        for (int64_t i = 0; i < hidden; ++i) {
            float v = load(a[base + i]);
            if (b != nullptr) {
                const T rounded = store(v + load(b[base + i]));
                if (sum != nullptr) sum[base + i] = rounded;
                v = load(rounded);
            }
            s[static_cast<size_t>(i)] = v;
            acc += v;
        }
        const double mean = hidden > 0 && center ? acc / static_cast<double>(hidden) : 0.0;
        double var = 0.0;
        for (int64_t i = 0; i < hidden; ++i) {
            const double d = static_cast<double>(s[static_cast<size_t>(i)]) - mean;
            var += d * d;
        }
        var = hidden > 0 ? var / static_cast<double>(hidden) : 0.0;
        const float inv_std = 1.0f / std::sqrt(static_cast<float>(var) + eps);
        const float m = static_cast<float>(mean);
        for (int64_t i = 0; i < hidden; ++i) {
            float v = (s[static_cast<size_t>(i)] - m) * inv_std;
            if (gamma != nullptr) v *= load(gamma[gamma_n == 1 ? 0 : i]);
            if (beta != nullptr) v += load(beta[beta_n == 1 ? 0 : i]);
            y[base + i] = store(v);
        }
    }
}

}  // namespace ref
}  // namespace gtco
