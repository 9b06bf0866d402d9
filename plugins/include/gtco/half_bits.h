// fp16 / bf16 storage bits <-> fp32, round to nearest even: plain C++ shared by the CPU emulation's __half and
// __nv_bfloat16 stand-ins (plugins/emu/gtco_emu.h) and the CPU references' fp16 / bf16 storage
// (plugins/families/elementwise/elementwise_ref.h), so both round exactly as __float2half_rn / __float2bfloat16_rn do.
#pragma once

#include <cstdint>
#include <cstring>

namespace gtco::bits {

inline uint32_t f32_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    return x;
}

inline float bits_f32(uint32_t x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

// IEEE binary32 -> binary16, round to nearest, ties to even; subnormals, infinities and NaN (kept quiet) included.
inline uint16_t f32_to_f16_bits(float f) {
    const uint32_t x = f32_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));
    const int e = static_cast<int>(exp) - 127 + 15;  // biased binary16 exponent
    if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
    if (e <= 0) {                                     // binary16 subnormal (or zero)
        if (e < -10) return static_cast<uint16_t>(sign);  // below half of the smallest subnormal
        man |= 0x800000u;
        const int shift = 14 - e;  // 24-bit significand -> multiples of 2^-24
        uint32_t q = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) ++q;  // a carry into 0x400 is the smallest normal: correct
        return static_cast<uint16_t>(sign | q);
    }
    uint32_t q = (static_cast<uint32_t>(e) << 10) | (man >> 13);
    const uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;  // a carry into the exponent rounds up to inf: correct
    return static_cast<uint16_t>(sign | q);
}

inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
        return bits_f32(f32_bits(mag) | sign);
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
    return bits_f32(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

inline uint16_t f32_to_bf16_bits(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

}  // namespace gtco::bits
