// Numpy broadcasting over a flattened index, at compile time: what the Elementwise family's device instances
// (elementwise/elementwise.cuh) and the host functions of the ORT glue (plugins/families/elementwise/elementwise_ref.h) share. Plain C++17,
// no CUDA, so that the g++-built glue includes it as well as nvcc and the emulation.
//
// The generated program describes its iteration space and operands as types (onnx_gtco/families/elementwise/kernel.py
// collapses the iteration shape first: dims of 1 dropped, neighbours every operand walks alike merged):
//     Shape<D0, D1, ...>           the collapsed iteration dims, outermost first (none: one element)
//     In<E, S0, S1, ...>           an operand of element type E with element strides S over those dims (0: the
//                                  operand is broadcast along that dim)
//     Shifted<B, In<E, S...>>      the same operand read from element B on: a view of its tensor that starts
//                                  inside it (a Slice, or one part of a split)
//     Rolled<Op, Roll<...>...>     Op plus one term per Roll<N, R, Q, M, S, W...>: ((sum_j i_j * W_j + R) % N / Q % M)
//                                  * S over the iteration indices i_j: a torch.roll (Slice + Slice + Concat) of a
//                                  source dim (Q = 1, M = N), which may since have been split over several iteration
//                                  dims (window partition), or one of the dims a reshape merged although their strides
//                                  do not merge (window reverse)
//     Inputs<In<...>, In<...>>     the program's operands, kernel input i being the i-th
// The strides of an operand that a layout op (Transpose, Slice, Reshape of a strided view) reads are any element
// strides of its tensor, not only those of a broadcast: the index map of the view, folded into the load.
// and In<...>::offset<Shape>(e) is the operand's element offset at flat output index e: a sum of terms
// (e / pos_j % D_j) * S_j with every divisor and modulus a constant, e itself when the operand has the iteration
// shape, 0 when it is broadcast everywhere.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__CUDACC__)
#define GTCO_HD __host__ __device__ __forceinline__
#else
#define GTCO_HD inline
#endif

namespace gtco {
namespace ew {

template <uint64_t... D>
struct Shape {
    static constexpr int rank = sizeof...(D);
    static constexpr uint64_t n = (uint64_t{1} * ... * D);  // elements (1 for rank 0)
    GTCO_HD static constexpr uint64_t dim(int j) {
        constexpr uint64_t d[] = {D..., 1};
        return d[j];
    }
    // elements of one step along dim j: the product of the dims after it
    GTCO_HD static constexpr uint64_t pos(int j) {
        uint64_t p = 1;
        for (int k = j + 1; k < rank; ++k) p *= dim(k);
        return p;
    }
};

template <typename E, uint64_t... S>
struct In {
    using type = E;
    static constexpr int rank = sizeof...(S);
    static constexpr uint64_t base = 0;  // element offset of the view (Shifted)
    static constexpr bool rolls_inner = false;  // a Roll walks the innermost dim (Rolled)
    GTCO_HD static constexpr uint64_t stride(int j) {
        constexpr uint64_t s[] = {S..., 0};
        return s[j];
    }
    // broadcast along every dim: one element
    GTCO_HD static constexpr bool scalar() {
        for (int j = 0; j < rank; ++j)
            if (stride(j) != 0) return false;
        return true;
    }
    // the iteration shape itself, dense: offset(e) = e
    template <class Sh>
    GTCO_HD static constexpr bool dense() {
        for (int j = 0; j < rank; ++j)
            if (stride(j) != Sh::pos(j)) return false;
        return true;
    }

    template <class Sh, typename I>
    GTCO_HD static I offset(I e) {
        static_assert(rank == Sh::rank, "an operand has one stride per collapsed dim");
        if constexpr (scalar()) {
            return 0;
        } else if constexpr (dense<Sh>()) {
            return e;
        } else {
            return terms<Sh>(e, std::make_integer_sequence<int, rank>{});
        }
    }

    // every stride but the innermost a multiple of V: a V-aligned run along the innermost dim starts V-aligned
    template <uint64_t V>
    GTCO_HD static constexpr bool outer_multiple_of() {
        for (int j = 0; j + 1 < rank; ++j)
            if (stride(j) % V != 0) return false;
        return true;
    }

  private:
    // (e / pos_j % D_j) * S_j, without the division by 1, the modulus of the outermost dim (e < n) or the
    // multiplication by 1
    template <uint64_t Pos, uint64_t Dim, uint64_t Stride, bool Outer, typename I>
    GTCO_HD static I term(I e) {
        if constexpr (Stride == 0) {
            return 0;
        } else {
            I t = Pos == 1 ? e : e / static_cast<I>(Pos);
            if constexpr (!Outer) t = t % static_cast<I>(Dim);
            return Stride == 1 ? t : t * static_cast<I>(Stride);
        }
    }
    template <class Sh, typename I, int... J>
    GTCO_HD static I terms(I e, std::integer_sequence<int, J...>) {
        return (term<Sh::pos(J), Sh::dim(J), stride(J), J == 0>(e) + ...);
    }
};

template <uint64_t Base, class Op>
struct Shifted : Op {
    static constexpr uint64_t base = Base;
    template <class Sh, typename I>
    GTCO_HD static I offset(I e) {
        return static_cast<I>(Base) + Op::template offset<Sh>(e);
    }
};

// ((sum_j i_j * W_j + R) % N / Q % M) * S, i_j the index along collapsed iteration dim j
template <uint64_t N, uint64_t R, uint64_t Q, uint64_t M, uint64_t S, uint64_t... W>
struct Roll {
    GTCO_HD static constexpr uint64_t weight(int j) {
        constexpr uint64_t w[] = {W..., 0};
        return w[j];
    }
    template <class Sh, typename I, int... J>
    GTCO_HD static I term(I e, std::integer_sequence<int, J...>) {
        I t = (index<Sh, J>(e) + ... + static_cast<I>(R)) % static_cast<I>(N);
        if constexpr (Q != 1) t = t / static_cast<I>(Q);
        if constexpr (M * Q < N) t = t % static_cast<I>(M);
        return t * static_cast<I>(S);
    }
    // a run of V consecutive elements along the innermost dim keeps the term, a multiple of V
    template <uint64_t V, int Rank>
    GTCO_HD static constexpr bool aligned() {
        return (Rank == 0 || weight(Rank - 1) == 0) && S % V == 0;
    }

  private:
    template <class Sh, int J, typename I>
    GTCO_HD static I index(I e) {
        if constexpr (weight(J) == 0) {
            return 0;
        } else {
            I t = Sh::pos(J) == 1 ? e : e / static_cast<I>(Sh::pos(J));
            if constexpr (J > 0) t = t % static_cast<I>(Sh::dim(J));
            return t * static_cast<I>(weight(J));
        }
    }
};

template <class Op, class... Rolls>
struct Rolled : Op {
    static constexpr bool rolls_inner = ((Op::rank > 0 && Rolls::weight(Op::rank - 1) != 0) || ...);
    GTCO_HD static constexpr bool scalar() { return false; }
    template <class Sh>
    GTCO_HD static constexpr bool dense() {
        return false;
    }
    template <uint64_t V>
    GTCO_HD static constexpr bool outer_multiple_of() {
        return Op::template outer_multiple_of<V>() && (Rolls::template aligned<V, Op::rank>() && ...);
    }
    template <class Sh, typename I>
    GTCO_HD static I offset(I e) {
        constexpr auto dims = std::make_integer_sequence<int, Op::rank>{};
        return Op::template offset<Sh>(e) + (Rolls::template term<Sh>(e, dims) + ...);
    }
};

// An operand of a program built for run-time shapes (a program over symbolic dims): element type E, and bit j of
// Walks set where it walks collapsed iteration dim j (clear: broadcast along it). Its strides and the dims come with
// each call (GtcoElementwiseArgs dims / strides); the bits let the compiler drop the terms of broadcast dims and
// choose its vector access. RollDim >= 0: the operand is a torch.roll of its tensor along that collapsed dim, a
// static one of N: index i of it reads element (i + Shift) % N. Gather: its innermost walked dim is not its
// tensor's innermost (a Transpose folded into the load), so it is read one element at a time.
template <typename E, uint32_t Walks, int RollDim = -1, uint64_t Shift = 0, uint64_t N = 0, bool Gather = false>
struct Walk {
    using type = E;
    static constexpr int roll_dim = RollDim;
    static constexpr bool gather = Gather;
    GTCO_HD static constexpr bool walks(int j) { return (Walks >> j & 1u) != 0; }
    // the index an operand reads along dim j for iteration index i
    template <typename I>
    GTCO_HD static I index(int j, I i) {
        if constexpr (RollDim >= 0) {
            if (j == RollDim) {
                const I k = i + static_cast<I>(Shift);
                return k >= static_cast<I>(N) ? k - static_cast<I>(N) : k;
            }
        }
        return i;
    }
    // a run of V consecutive elements along the innermost dim (of the R collapsed dims) starting at a multiple of V
    // reads V consecutive elements
    template <int R, uint64_t V>
    GTCO_HD static constexpr bool runs_contiguous() {
        return RollDim != R - 1 || (Shift % V == 0 && N % V == 0);
    }
};

template <class... Ins>
struct Inputs {
    static constexpr int size = sizeof...(Ins);
};

template <int I, class L>
struct input_at;
template <int I, class First, class... Rest>
struct input_at<I, Inputs<First, Rest...>> : input_at<I - 1, Inputs<Rest...>> {};
template <class First, class... Rest>
struct input_at<0, Inputs<First, Rest...>> {
    using type = First;
};

// f(std::integral_constant<int, I>{}) for I = 0 .. N-1, in order
template <int N, class F, int... I>
GTCO_HD void for_each(F&& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
GTCO_HD void for_each(F&& f) {
    for_each<N>(static_cast<F&&>(f), std::make_integer_sequence<int, N>{});
}

}  // namespace ew
}  // namespace gtco
