// CPU reference of the Softmax family (op types Softmax_f32 / _f16 / _bf16): plain C++, no ORT, no CUDA.
//
//     y[r, :] = exp(x[r, :] - max x[r, :]) / sum exp(x[r, :] - max x[r, :])      for each of `rows` rows of `cols`
//
// Math is fp32 with the sum accumulated in double; inputs and outputs are stored as T and converted through the
// caller's load/store. A row that is all -inf gives NaN, as ONNX Softmax does.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace gtco {
namespace ref {

template <class T, class Load, class Store>
void softmax(const T* x, T* y, int64_t rows, int64_t cols, Load load, Store store) {
    std::vector<float> e(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        float m = -INFINITY;
        for (int64_t i = 0; i < cols; ++i) m = std::fmax(m, load(xr[i]));
        double sum = 0.0;
        for (int64_t i = 0; i < cols; ++i) {
            const float v = std::exp(load(xr[i]) - m);
            e[static_cast<size_t>(i)] = v;
            sum += v;
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t i = 0; i < cols; ++i) yr[i] = store(e[static_cast<size_t>(i)] * inv);
    }
}

}  // namespace ref
}  // namespace gtco
