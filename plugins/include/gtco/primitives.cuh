// Device building blocks of gtco's Tensor Core kernels: mma.m16n8k16 (f16 / bf16), mma.m16n8k8 (tf32), the tf32
// rounding, ldmatrix, cp.async, warp reductions and the conversions between fp32 and each element type.
//
// Built by nvcc, these are inline PTX (sm_80 and later). With GTCO_EMULATE defined (a g++ build), the same
// names come from plugins/emu/gtco_emu.h, which runs them on the CPU. Fragment layouts are those of the PTX ISA,
// section "Matrix Fragments for mma.m16n8k16 with floating point type":
//   groupID = lane >> 2, threadID_in_group (tig) = lane % 4; element i sits in register i / 2, low 16 bits first.
//   A (16x16, row): a0,a1 row g cols 2*tig+{0,1};  a2,a3 row g+8;  a4..a7 as a0..a3 with cols + 8.
//   B (16x8, col):  b0,b1 rows (k) 2*tig+{0,1}, col (n) g;  b2,b3 rows + 8.
//   C/D (16x8 f32): c0,c1 row g cols 2*tig+{0,1};  c2,c3 row g+8.
// and of "Matrix Fragments for mma.m16n8k8" (.tf32: one element per 32-bit register):
//   A (16x8, row):  a0 row g col tig;  a1 row g+8 col tig;  a2, a3 as a0, a1 with col + 4.
//   B (8x8, col):   b0 row (k) tig, col (n) g;  b1 row tig+4.
//   C/D: as above.
// ldmatrix (.b16) on fp32 data moves 32-bit words whole: an 8x8 .b16 matrix is 8 rows of 4 floats, and lane l
// receives row l/4, float column l%4, the A / B(n-major) fragment layout of m16n8k8.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(GTCO_EMULATE)
#include "../../emu/gtco_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define GTCO_DEVICE __device__ __forceinline__
#define GTCO_SHARED(type, name, count) __shared__ __align__(16) type name[count]
// Dynamic shared memory of `count` elements (the launch passes the bytes: GTCO_LAUNCH_SMEM in gtco/launch.cuh).
// At most one per kernel, declared after every GTCO_SHARED.
#define GTCO_DYNAMIC_SHARED(type, name, count)                                  \
    extern __shared__ __align__(16) unsigned char gtco_dynamic_smem_[];         \
    type* const name = reinterpret_cast<type*>(gtco_dynamic_smem_)
#define GTCO_UNROLL _Pragma("unroll")

namespace gtco {

GTCO_DEVICE unsigned lane_id() {
    unsigned lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
}

GTCO_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// D = A * B + C; d may alias c.
GTCO_DEVICE void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                  const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

GTCO_DEVICE void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                   const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// D = A * B + C with tf32 A and B (fp32 registers whose low 13 mantissa bits the Tensor Core ignores: round them
// with round_tf32 / to_tf32 first) and fp32 products and accumulation; d may alias c.
GTCO_DEVICE void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// The bits of an fp32 value rounded to tf32 (10 mantissa bits): cvt.rna, to nearest with ties away from zero.
GTCO_DEVICE uint32_t round_tf32(uint32_t f32_bits) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(f32_bits)));
    return r;
}

// ldmatrix (.m8n8, .b16): lanes 8j..8j+7 pass the shared-memory addresses of rows 0..7 of matrix j (16-byte
// aligned); for .x2 only lanes 0..15 are read, but every lane must pass a valid shared address. Register j of
// lane l holds row l/4, columns 2*(l%4)+{0,1} of matrix j; .trans gives rows 2*(l%4)+{0,1} of column l/4.
GTCO_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem_row)));
}

GTCO_DEVICE void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(smem_row)));
}

GTCO_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem_row)));
}

GTCO_DEVICE void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(smem_row)));
}

// cp.async.cg (L2 only, 16 bytes). With pred false, src-size is 0: nothing is read from gmem_src and the 16
// destination bytes are zero-filled ("cp.async", PTX ISA). Both addresses must be 16-byte aligned.
GTCO_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src) : "memory");
}

GTCO_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src, bool pred) {
    const int src_size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
                 "r"(src_size)
                 : "memory");
}

// Global-memory accesses of a reduction across blocks (split-K, the GEMM LayerNorm's row panels): through L2 (.cg),
// never a stale L1 line, with a device-wide fence between a block's partial results and its arrival count.
GTCO_DEVICE void fence_gpu() { __threadfence(); }
GTCO_DEVICE unsigned atomic_add_u32(unsigned* p, unsigned v) { return atomicAdd(p, v); }
GTCO_DEVICE float ld_cg(const float* p) { return __ldcg(p); }
GTCO_DEVICE void st_cg(float* p, float v) { __stcg(p, v); }
GTCO_DEVICE uint4 ld_cg_16(const void* p) { return __ldcg(static_cast<const uint4*>(p)); }  // 16 bytes

GTCO_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Programmatic dependent launch (PTX ISA, "griddepcontrol"; sm_90 and later). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (gtco/pdl.h, gtco/launch.cuh) may start before the kernel
// ahead of it in the stream has finished; grid_dep_wait() blocks until that grid has completed and its memory
// operations are visible. Every gtco kernel calls it as the first statement of its body, before any global-memory
// read or write (tests/kernels/test_pdl.py checks the sources). Without the attribute, or on sm_80 (where it
// compiles to nothing), it returns at once.
GTCO_DEVICE void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// No gtco kernel triggers its dependent early (griddepcontrol.launch_dependents), on purpose, so a grid triggers
// implicitly when it completes: (1) the glue's rule (gtco_ort.h, NodeRef::pdl) relies on "a gtco producer never
// triggers early", so that any kernel after it, ORT's included, starts only after it completed and a consumer's wait
// on its immediate predecessor covers the producer even when a foreign kernel (itself a PDL launch that need not
// wait) sits between them; (2) the dependent's blocks would take SM slots, registers and shared memory only to spin
// in grid_dep_wait while this grid's tail runs, which pays off only where measured on a GPU. The overlap PDL gives
// without it: the dependent's launch processing and block scheduling against this grid's last blocks.

// Marks a global-memory access for the emulation's PDL check (plugins/emu/gtco_emu.h); nothing on the GPU.
#define GTCO_EMU_NOTE_GLOBAL(p, what) ((void)0)

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
GTCO_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace gtco
#endif  // GTCO_EMULATE

namespace gtco {

// Element type of an mma operand: __half -> .f16, __nv_bfloat16 -> .bf16.
template <typename T>
GTCO_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    if constexpr (std::is_same<T, __half>::value) {
        mma_m16n8k16_f16(d, a, b, c);
    } else {
        static_assert(std::is_same<T, __nv_bfloat16>::value, "mma_m16n8k16: T must be __half or __nv_bfloat16");
        mma_m16n8k16_bf16(d, a, b, c);
    }
}

// acc += A * B
template <typename T>
GTCO_DEVICE void mma_m16n8k16(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mma_m16n8k16<T>(acc, a, b, acc);
}

// acc += A * B, tf32 operands (already rounded)
GTCO_DEVICE void mma_m16n8k8_tf32(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mma_m16n8k8_tf32(acc, a, b, acc);
}

// ---- conversions: every family computes in fp32 and stores in its element type T ----------------------------
GTCO_DEVICE float to_f32(float x) { return x; }
GTCO_DEVICE float to_f32(__half x) { return __half2float(x); }
GTCO_DEVICE float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
GTCO_DEVICE float to_f32(uint8_t x) { return x ? 1.0f : 0.0f; }  // ONNX bool
GTCO_DEVICE float to_f32(int32_t x) { return static_cast<float>(x); }
GTCO_DEVICE float to_f32(int64_t x) { return static_cast<float>(x); }

// Rounded to nearest even.
template <typename T>
GTCO_DEVICE T from_f32(float x);
template <>
GTCO_DEVICE float from_f32<float>(float x) { return x; }
template <>
GTCO_DEVICE __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
GTCO_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// An fp32 value as a tf32 mma operand (round_tf32 of its bits).
GTCO_DEVICE uint32_t to_tf32(float x) { return round_tf32(__float_as_uint(x)); }

// Reductions over LANES consecutive lanes (4: the quad that shares one mma row; 32: the warp). Every lane of the
// warp must call them; each group of LANES lanes gets its own result.
template <int LANES = 32>
GTCO_DEVICE float warp_max(float v) {
    static_assert(LANES == 2 || LANES == 4 || LANES == 8 || LANES == 16 || LANES == 32, "LANES: power of 2 <= 32");
    GTCO_UNROLL
    for (int m = LANES / 2; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

template <int LANES = 32>
GTCO_DEVICE float warp_sum(float v) {
    static_assert(LANES == 2 || LANES == 4 || LANES == 8 || LANES == 16 || LANES == 32, "LANES: power of 2 <= 32");
    GTCO_UNROLL
    for (int m = LANES / 2; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// Two 16-bit values in one 32-bit register, lo in the low half (the order of fragment elements).
GTCO_DEVICE uint32_t pack_b16(__half lo, __half hi) {
    return static_cast<uint32_t>(__half_as_ushort(lo)) | (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}
GTCO_DEVICE uint32_t pack_b16(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

GTCO_DEVICE float quad_max(float v) { return warp_max<4>(v); }
GTCO_DEVICE float quad_sum(float v) { return warp_sum<4>(v); }

// ---- E4M3 (fp8 E4M3FN: largest finite 448, subnormals down to 2^-9) for the fp8 GEMM (onnx_gtco/fp8.py) -------
// Every E4M3 value is exact in fp16, so the fp8 GEMM runs the f16 mma on E4M3 values held in halves.
// x rounded to the nearest E4M3 value (ties to even), saturated to +-448 (QuantizeLinear's saturate=1), in fp32.
// Plain arithmetic, the same on every arch and in the emulation (plugins/families/gemm/gemm_ref.h round_e4m3).
GTCO_DEVICE float round_e4m3(float x) {
    const float a = fabsf(x);
    if (!(a < 448.0f)) return a >= 448.0f ? copysignf(448.0f, x) : x;  // saturated; NaN stays NaN
    int e = 0;
    frexpf(a, &e);                                    // a = f * 2^e, f in [0.5, 1): its binade is 2^(e-1)
    const int step = (e - 1 > -6 ? e - 1 : -6) - 3;   // 3 mantissa bits; below 2^-6 the subnormal step 2^-9
    return copysignf(ldexpf(rintf(ldexpf(a, -step)), step), x);  // rintf: ties to even
}

// The two halves of `h2` (an A fragment register) divided by `scale` and rounded to E4M3, as halves.
GTCO_DEVICE uint32_t quantize_e4m3x2(uint32_t h2, float scale) {
    const float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xffffu)));
    const float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 >> 16)));
    return pack_b16(__float2half_rn(round_e4m3(lo / scale)), __float2half_rn(round_e4m3(hi / scale)));
}

// Two E4M3 bytes (the low one first) as two halves: the byte's sign, exponent and mantissa moved into a half's
// fields (exponent bias 15 against 7: the half is the value / 2^8, subnormals included), then scaled by 2^8.
GTCO_DEVICE uint32_t e4m3x2_to_half2(uint32_t two) {
    uint32_t out = 0;
    GTCO_UNROLL
    for (int i = 0; i < 2; ++i) {
        const uint32_t b = (two >> (8 * i)) & 0xffu;
        const auto bits = static_cast<unsigned short>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
        const float v = __half2float(__ushort_as_half(bits)) * 256.0f;
        out |= static_cast<uint32_t>(__half_as_ushort(__float2half_rn(v))) << (16 * i);
    }
    return out;
}

// 1 / sqrt(x): the hardware approximation on the GPU (what LayerNorm kernels use), the exact quotient here.
GTCO_DEVICE float fast_rsqrt(float x) {
#if defined(GTCO_EMULATE)
    return 1.0f / std::sqrt(x);
#else
    return rsqrtf(x);
#endif
}

}  // namespace gtco
