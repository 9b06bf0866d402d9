// Elementwise family: one thread computes VEC consecutive elements of a generated fp32 expression program.
//
// The instance (.cu written by onnx_gtco/families/elementwise/kernel.py from plugins/families/elementwise/elementwise.cu.j2) holds
// only what differs per program: a struct with the storage type T, the collapsed iteration shape and the operands
// as types (gtco/broadcast.h) and the program body, `body(const float (&x)[NIN], float (&y)[NOUT])`; a
// __global__ wrapper calling Elementwise<Program, THREADS, VEC>::thread; and the entry point calling its launch.
// This header holds the rest: the loop over the VEC elements of a thread (a vector path with one access of at most
// 16 bytes per operand where its layout allows, and a scalar path for the ragged tail and misaligned pointers),
// the broadcast index of every operand (gtco/broadcast.h), the checks and the launch; and what the other row-wise
// families (layernorm.cuh, softmax.cuh) reuse: vector loads and stores of VEC elements, and the math of the
// supported ONNX ops. The conversions between fp32 and each element type are gtco/primitives.cuh's.
#pragma once

#include <cmath>
#include <cstdint>

#include "elementwise/elementwise_args.h"
#include "gtco/broadcast.h"
#include "gtco/launch.cuh"

namespace gtco {

// ---- vector access: N elements of T in one aligned access (N * sizeof(T) <= 16) ------------------------------
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <typename T, int N>
GTCO_DEVICE void load_vec(float (&out)[N], const T* p) {
    static_assert(sizeof(T) * N <= 16 && (N & (N - 1)) == 0, "load_vec: one access of at most 16 bytes");
    GTCO_EMU_NOTE_GLOBAL(p, "PDL: load_vec from global memory before grid_dep_wait()");
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
    GTCO_UNROLL
    for (int k = 0; k < N; ++k) out[k] = to_f32(v.v[k]);
}

// Loads N elements into out[0..N) starting at out[at]: for rows held as float regs[ITEMS * N].
template <typename T, int N>
GTCO_DEVICE void load_vec_at(float* out, const T* p) {
    GTCO_EMU_NOTE_GLOBAL(p, "PDL: load_vec_at from global memory before grid_dep_wait()");
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
    GTCO_UNROLL
    for (int k = 0; k < N; ++k) out[k] = to_f32(v.v[k]);
}

template <typename T, int N>
GTCO_DEVICE void store_vec_at(T* p, const float* in) {
    static_assert(sizeof(T) * N <= 16 && (N & (N - 1)) == 0, "store_vec: one access of at most 16 bytes");
    GTCO_EMU_NOTE_GLOBAL(p, "PDL: store_vec_at to global memory before grid_dep_wait()");
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
GTCO_DEVICE float is_nan(float x) { return x != x ? 1.0f : 0.0f; }  // no fast-math here: NaN compares unequal
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

// ---- the instance: Program's body over the iteration shape --------------------------------------------------
namespace ew {

// The first NIN inputs and NOUT outputs of `a`, the outputs as T: what a thread of an instance reads and writes.
template <int NIN, int NOUT, typename T>
GTCO_DEVICE void operands(const GtcoElementwiseArgs& a, const void* __restrict__ (&in)[NIN],
                          T* __restrict__ (&out)[NOUT]) {
    GTCO_UNROLL
    for (int i = 0; i < NIN; ++i) in[i] = a.in[i];
    GTCO_UNROLL
    for (int o = 0; o < NOUT; ++o) out[o] = static_cast<T*>(a.out[o]);
}

// How the vector path reads an operand for the VEC consecutive elements of a thread (their first index is a multiple
// of VEC): `vec`, one access of at most 16 bytes at the first element's offset (operands of the kernel's storage
// type with the iteration shape, or walking the innermost dim contiguously when that dim is a multiple of VEC: a
// bias [N]); `one`, one load for all VEC (operands broadcast along the innermost dim when VEC divides it, so the
// VEC elements lie in one row: a per-row scale; or broadcast everywhere); `gather`, one load per element.
enum class Access { vec, one, gather };

template <class Sh, class Op, typename T, int VEC>
GTCO_HD constexpr Access access() {
    constexpr bool storage = std::is_same<typename Op::type, T>::value;
    constexpr bool inner = Sh::rank > 0 && Sh::dim(Sh::rank - 1) % VEC == 0;
    constexpr uint64_t last = Sh::rank > 0 ? Op::stride(Sh::rank - 1) : 0;
    // a view (Shifted, permuted strides) is vector-read only where every run of VEC starts aligned
    constexpr bool aligned = Op::base % VEC == 0;
    constexpr bool walks_inner = inner && last == 1 && Op::template outer_multiple_of<VEC>();
    if (storage && aligned && (Op::template dense<Sh>() || walks_inner)) return Access::vec;
    if (Op::scalar() || (inner && last == 0 && !Op::rolls_inner)) return Access::one;
    return Access::gather;
}

// Program: T (storage of the outputs and of the float operands), Shape, Inputs (gtco/broadcast.h), NOUT, Outputs (an
// In<T, strides...> per output: where element e is stored; dense but for an output a Transpose folds into the
// store) and `static void body(const float (&x)[NIN], float (&y)[NOUT])`.
template <class Program, int THREADS, int VEC>
struct Elementwise {
    using T = typename Program::T;
    using Sh = typename Program::Shape;
    using Ins = typename Program::Inputs;
    static constexpr int NIN = Ins::size;
    static constexpr int NOUT = Program::NOUT;
    static constexpr uint64_t N = Sh::n;
    using idx_t = typename std::conditional<(N < (uint64_t{1} << 31)), uint32_t, uint64_t>::type;
    template <int I>
    using Op = typename input_at<I, Ins>::type;
    template <int I>
    using E = typename Op<I>::type;
    template <int I>
    static constexpr Access access_of = access<Sh, Op<I>, T, VEC>();
    template <int O>
    using Out = typename input_at<O, typename Program::Outputs>::type;
    template <int... O>
    static constexpr bool all_dense(std::integer_sequence<int, O...>) {
        return (Out<O>::template dense<Sh>() && ...);
    }
    // the vector path stores VEC consecutive elements at once only where every output is dense
    static constexpr bool dense_out = all_dense(std::make_integer_sequence<int, NOUT>{});
    // only the vector path needs aligned pointers, and it never runs when N < VEC
    static constexpr bool vector_path = VEC > 1 && N >= static_cast<uint64_t>(VEC);
    // bit i: the vector path reads input i with vector loads
    template <int... I>
    static constexpr uint32_t vec_loaded(std::integer_sequence<int, I...>) {
        return (0u | ... | (access_of<I> == Access::vec ? 1u << I : 0u));
    }
    static constexpr uint32_t kVecLoaded = vector_path ? vec_loaded(std::make_integer_sequence<int, NIN>{}) : 0u;
    static_assert(NIN >= 1 && NIN <= GTCO_EW_MAX_IN && NOUT >= 1 && NOUT <= GTCO_EW_MAX_OUT, "operand counts");
    static_assert(sizeof(T) * VEC <= 16, "one vector access is at most 16 bytes");

    template <int I>
    GTCO_DEVICE static float load(const void* const __restrict__ (&in)[NIN], idx_t e) {
        return to_f32(static_cast<const E<I>*>(in[I])[Op<I>::template offset<Sh>(e)]);
    }

    // the thread's VEC elements; vec_ok: every pointer the vector path reads or writes is aligned to VEC elements
    GTCO_DEVICE static void thread(const GtcoElementwiseArgs& a, bool vec_ok) {
        const void* __restrict__ in[NIN];
        T* __restrict__ out[NOUT];
        operands(a, in, out);
        const idx_t base = (static_cast<idx_t>(blockIdx.x) * THREADS + threadIdx.x) * VEC;
        if (base >= N) return;
        float x[NIN], y[NOUT];
        if constexpr (VEC > 1) {
            if (vec_ok && base + VEC <= N) {
                float xv[NIN][VEC], yv[NOUT][VEC];
                for_each<NIN>([&](auto i) {
                    constexpr int I = decltype(i)::value;
                    if constexpr (access_of<I> == Access::vec) {
                        load_vec_at<T, VEC>(xv[I], static_cast<const T*>(in[I]) + Op<I>::template offset<Sh>(base));
                    } else if constexpr (access_of<I> == Access::one) {
                        xv[I][0] = load<I>(in, base);
                    }
                });
                GTCO_UNROLL
                for (int k = 0; k < VEC; ++k) {
                    const idx_t e = base + k;
                    for_each<NIN>([&](auto i) {
                        constexpr int I = decltype(i)::value;
                        if constexpr (access_of<I> == Access::vec) {
                            x[I] = xv[I][k];
                        } else if constexpr (access_of<I> == Access::one) {
                            x[I] = xv[I][0];
                        } else {
                            x[I] = load<I>(in, e);
                        }
                    });
                    Program::body(x, y);
                    GTCO_UNROLL
                    for (int o = 0; o < NOUT; ++o) yv[o][k] = y[o];
                }
                if constexpr (dense_out) {
                    GTCO_UNROLL
                    for (int o = 0; o < NOUT; ++o) store_vec_at<T, VEC>(out[o] + base, yv[o]);
                } else {
                    GTCO_UNROLL
                    for (int k = 0; k < VEC; ++k) {
                        for_each<NOUT>([&](auto o) {
                            constexpr int O = decltype(o)::value;
                            out[O][Out<O>::template offset<Sh>(static_cast<idx_t>(base + k))] = from_f32<T>(yv[O][k]);
                        });
                    }
                }
                return;
            }
        }
        for (idx_t e = base; e < N && e < base + VEC; ++e) {
            for_each<NIN>([&](auto i) { x[decltype(i)::value] = load<decltype(i)::value>(in, e); });
            Program::body(x, y);
            for_each<NOUT>([&](auto o) {
                constexpr int O = decltype(o)::value;
                out[O][Out<O>::template offset<Sh>(e)] = from_f32<T>(y[O]);
            });
        }
    }

    // The entry point: GTCO_EBADSHAPE unless args has the instance's element count and every operand it reads and
    // writes; launches `kernel` (the instance's __global__ wrapper of thread) over ceil(N / (THREADS * VEC))
    // blocks, on the scalar path everywhere when a pointer of the vector path is not aligned to VEC elements.
    static int launch(void (*kernel)(GtcoElementwiseArgs, bool), const GtcoElementwiseArgs* args, void* stream) {
        if (args == nullptr || args->n != static_cast<int64_t>(N)) return GTCO_EBADSHAPE;
        bool vec_ok = true;
        for (int i = 0; i < NIN; ++i)
            if (args->in[i] == nullptr) return GTCO_EBADSHAPE;
        for (int o = 0; o < NOUT; ++o) {
            if (args->out[o] == nullptr) return GTCO_EBADSHAPE;
            vec_ok = vec_ok && (!vector_path || !dense_out || aligned_to(args->out[o], sizeof(T) * VEC));
        }
        for (int i = 0; i < NIN; ++i)
            vec_ok = vec_ok && (!(kVecLoaded >> i & 1u) || aligned_to(args->in[i], sizeof(T) * VEC));
        const unsigned blocks = static_cast<unsigned>((N + THREADS * VEC - 1) / (THREADS * VEC));
        return GTCO_LAUNCH(kernel, dim3(blocks), dim3(THREADS), stream, *args, vec_ok);
    }
};

// Program built for run-time shapes (a program over symbolic dims, onnx_gtco/families/elementwise/kernel.py): T,
// RANK (collapsed iteration dims), Inputs (a Walk<E, bits> per input), NOUT and body, as Elementwise's Program but
// for the shape: the dims and every input's strides come with each call (GtcoElementwiseArgs dims / strides,
// filled by the glue from the tensors' shapes), and the outputs are dense. A thread's VEC elements share every
// index but the innermost when the innermost dim is a multiple of VEC (checked at launch, else the scalar path
// runs): one decomposition of the flat index per thread, a vector access for inputs of the storage type walking
// the innermost dim (stride 1: an input's own dense shape; a roll of it where the shift and the size are multiples
// of VEC), one load for inputs broadcast along it, a load per element for the rest.
template <class Program, int THREADS, int VEC>
struct Dynamic {
    using T = typename Program::T;
    static constexpr int R = Program::RANK;
    using Ins = typename Program::Inputs;
    static constexpr int NIN = Ins::size;
    static constexpr int NOUT = Program::NOUT;
    template <int I>
    using Op = typename input_at<I, Ins>::type;
    template <int I>
    using E = typename Op<I>::type;
    template <int I>
    static constexpr bool vec_read = std::is_same<E<I>, T>::value && Op<I>::walks(R - 1) && !Op<I>::gather &&
                                     Op<I>::template runs_contiguous<R, VEC>();
    template <int I>
    static constexpr bool one_read = !Op<I>::walks(R - 1);
    template <int... I>
    static constexpr uint32_t vec_loaded(std::integer_sequence<int, I...>) {
        return (0u | ... | (vec_read<I> ? 1u << I : 0u));
    }
    static constexpr uint32_t kVecLoaded = VEC > 1 ? vec_loaded(std::make_integer_sequence<int, NIN>{}) : 0u;
    static_assert(R >= 1 && R <= GTCO_EW_MAX_RANK, "collapsed rank");
    static_assert(NIN >= 1 && NIN <= GTCO_EW_MAX_IN && NOUT >= 1 && NOUT <= GTCO_EW_MAX_OUT, "operand counts");
    static_assert(sizeof(T) * VEC <= 16, "one vector access is at most 16 bytes");

    // the index of flat element e along each collapsed dim
    template <typename I>
    GTCO_DEVICE static void coords(const GtcoElementwiseArgs& a, I e, I (&c)[R]) {
        GTCO_UNROLL
        for (int j = R - 1; j > 0; --j) {
            const I d = static_cast<I>(a.dims[j]);
            c[j] = e % d;
            e /= d;
        }
        c[0] = e;
    }
    // the element input X reads at indices c, the innermost one plus k (k < VEC stays in the row)
    template <int X, typename I>
    GTCO_DEVICE static I offset(const GtcoElementwiseArgs& a, const I (&c)[R], int k = 0) {
        I off = 0;
        GTCO_UNROLL
        for (int j = 0; j < R; ++j) {
            const I i = j == R - 1 ? c[j] + static_cast<I>(k) : c[j];
            if (Op<X>::walks(j)) off += Op<X>::index(j, i) * static_cast<I>(a.strides[X][j]);
        }
        return off;
    }
    template <int X, typename I>
    GTCO_DEVICE static float load(const void* const __restrict__ (&in)[NIN], I off) {
        return to_f32(static_cast<const E<X>*>(in[X])[off]);
    }

    template <typename I>
    GTCO_DEVICE static void thread(const GtcoElementwiseArgs& a, bool vec_ok) {
        const void* __restrict__ in[NIN];
        T* __restrict__ out[NOUT];
        operands(a, in, out);
        const I n = static_cast<I>(a.n);
        const I base = (static_cast<I>(blockIdx.x) * THREADS + threadIdx.x) * VEC;
        if (base >= n) return;
        float x[NIN], y[NOUT];
        I c[R];
        if constexpr (VEC > 1) {
            if (vec_ok && base + VEC <= n) {
                coords(a, base, c);
                float xv[NIN][VEC], yv[NOUT][VEC];
                for_each<NIN>([&](auto i) {
                    constexpr int X = decltype(i)::value;
                    const I off = offset<X>(a, c);
                    if constexpr (vec_read<X>) {
                        load_vec_at<T, VEC>(xv[X], static_cast<const T*>(in[X]) + off);
                    } else if constexpr (one_read<X>) {
                        xv[X][0] = load<X>(in, off);
                    } else {
                        xv[X][0] = load<X>(in, off);
                        GTCO_UNROLL
                        for (int k = 1; k < VEC; ++k) xv[X][k] = load<X>(in, offset<X>(a, c, k));
                    }
                });
                GTCO_UNROLL
                for (int k = 0; k < VEC; ++k) {
                    for_each<NIN>([&](auto i) {
                        constexpr int X = decltype(i)::value;
                        x[X] = one_read<X> ? xv[X][0] : xv[X][k];
                    });
                    Program::body(x, y);
                    GTCO_UNROLL
                    for (int o = 0; o < NOUT; ++o) yv[o][k] = y[o];
                }
                GTCO_UNROLL
                for (int o = 0; o < NOUT; ++o) store_vec_at<T, VEC>(out[o] + base, yv[o]);
                return;
            }
        }
        for (I e = base; e < n && e < base + VEC; ++e) {
            coords(a, e, c);
            for_each<NIN>([&](auto i) {
                constexpr int X = decltype(i)::value;
                x[X] = load<X>(in, offset<X>(a, c));
            });
            Program::body(x, y);
            GTCO_UNROLL
            for (int o = 0; o < NOUT; ++o) out[o][e] = from_f32<T>(y[o]);
        }
    }

    // The entry point: GTCO_EBADSHAPE unless the call's dims are non-negative, multiply to its n, and every operand
    // is there; nothing to do for n = 0; launches the 32-bit-index wrapper `k32` below 2^31 elements, else `k64`,
    // on the scalar path everywhere where the innermost dim is no multiple of VEC or a pointer of the vector path is
    // not aligned to VEC elements.
    static int launch(void (*k32)(GtcoElementwiseArgs, bool), void (*k64)(GtcoElementwiseArgs, bool),
                      const GtcoElementwiseArgs* args, void* stream) {
        if (args == nullptr) return GTCO_EBADSHAPE;
        int64_t n = 1;
        for (int j = 0; j < R; ++j) {
            if (args->dims[j] < 0) return GTCO_EBADSHAPE;
            n *= args->dims[j];
        }
        if (n != args->n) return GTCO_EBADSHAPE;
        for (int i = 0; i < NIN; ++i)
            if (args->in[i] == nullptr) return GTCO_EBADSHAPE;
        for (int o = 0; o < NOUT; ++o)
            if (args->out[o] == nullptr) return GTCO_EBADSHAPE;
        if (n == 0) return GTCO_OK;
        bool vec_ok = VEC > 1 && args->dims[R - 1] % VEC == 0;
        for (int o = 0; o < NOUT; ++o) vec_ok = vec_ok && aligned_to(args->out[o], sizeof(T) * VEC);
        for (int i = 0; i < NIN; ++i) {
            if (!(kVecLoaded >> i & 1u)) continue;
            // a vector-read input walks the innermost dim at stride 1, every run of VEC starting aligned
            vec_ok = vec_ok && aligned_to(args->in[i], sizeof(T) * VEC) && args->strides[i][R - 1] == 1;
            for (int j = 0; j + 1 < R; ++j) vec_ok = vec_ok && args->strides[i][j] % VEC == 0;
        }
        const int64_t blocks = (n + THREADS * VEC - 1) / (THREADS * VEC);
        if (blocks > int64_t{0x7fffffff}) return GTCO_EBADSHAPE;
        return GTCO_LAUNCH(n < (int64_t{1} << 31) ? k32 : k64, dim3(static_cast<unsigned>(blocks)), dim3(THREADS),
                           stream, *args, vec_ok);
    }
};

}  // namespace ew
}  // namespace gtco
