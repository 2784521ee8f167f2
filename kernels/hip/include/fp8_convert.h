// FP8 <-> f32 / f16 conversions exactly as CUDA's cuda_fp8.hpp computes them in software
// (the path of kpt's sm_80 builds): round to nearest even from the f64 value, with
// __NV_SATFINITE saturating finite overflow and infinities to +-max, NaN kept NaN. Plain
// C++ so that the host can check it: kpt checked it over every f32 input against the
// `float8` crate (a port of the same code) that kpt-core's FP8 conversions use.
#pragma once

#ifndef KPT_HD
#if defined(__HIPCC__) || defined(__CUDACC__)
#define KPT_HD __host__ __device__
#else
#define KPT_HD
#endif
#endif

namespace kpt_fp8 {

enum Kind { E4M3 = 0, E5M2 = 1 };

// f64 -> FP8 bits; `satfinite` saturates overflow to the largest finite value.
KPT_HD inline unsigned char from_double(double x, bool satfinite, Kind kind) {
    unsigned long long xbits = __builtin_bit_cast(unsigned long long, x);
    const bool e4m3 = kind == E4M3;
    const unsigned char maxnorm = e4m3 ? 0x7E : 0x7B;
    const unsigned char mantissa_mask = e4m3 ? 0x7 : 0x3;
    const unsigned short exp_bias = e4m3 ? 7 : 15;
    const unsigned long long significand_bits = e4m3 ? 4 : 3;
    const unsigned long long mindenorm_o2 = e4m3 ? 0x3F50000000000000ULL : 0x3EE0000000000000ULL;
    const unsigned long long overflow_threshold =
        e4m3 ? 0x407D000000000000ULL : 0x40EE000000000000ULL - 1ULL;
    const unsigned long long minnorm = e4m3 ? 0x3F90000000000000ULL : 0x3F10000000000000ULL;
    const unsigned long long dp_inf_bits = 0x7FF0000000000000ULL;
    const unsigned long long half_ulp = 1ULL << (53ULL - significand_bits - 1ULL);
    const unsigned char sign = static_cast<unsigned char>((xbits >> 63ULL) << 7U);
    const unsigned char exp = static_cast<unsigned char>(
        ((static_cast<unsigned short>(xbits >> 52ULL)) & 0x7FFU) - 1023U + exp_bias);
    unsigned char mantissa =
        static_cast<unsigned char>(xbits >> (53ULL - significand_bits)) & mantissa_mask;
    const unsigned long long absx = xbits & 0x7FFFFFFFFFFFFFFFULL;
    unsigned char res;
    if (absx <= mindenorm_o2) {
        res = 0;
    } else if (absx > dp_inf_bits) {
        res = e4m3 ? 0x7F : static_cast<unsigned char>(0x7E | mantissa);
    } else if (absx > overflow_threshold) {
        res = satfinite ? maxnorm : (e4m3 ? 0x7F : 0x7C);
    } else if (absx >= minnorm) {
        res = static_cast<unsigned char>((exp << (significand_bits - 1U)) | mantissa);
        const unsigned long long round = xbits & ((half_ulp << 1ULL) - 1ULL);
        if (round > half_ulp || (round == half_ulp && (mantissa & 1U))) res += 1;
    } else {
        const unsigned char shift = static_cast<unsigned char>(1U - exp);
        mantissa |= static_cast<unsigned char>(1U << (significand_bits - 1U));
        res = static_cast<unsigned char>(mantissa >> shift);
        const unsigned long long round =
            (xbits | (1ULL << (53ULL - 1ULL))) & ((half_ulp << (shift + 1ULL)) - 1ULL);
        if (round > (half_ulp << shift) || (round == (half_ulp << shift) && (res & 1U))) {
            res += 1;
        }
    }
    return static_cast<unsigned char>(res | sign);
}

// FP8 bits -> f16 bits (exact; NaN becomes the canonical f16 NaN 0x7FFF).
KPT_HD inline unsigned short to_half_bits(unsigned char x, Kind kind) {
    unsigned short ur = static_cast<unsigned short>(x << 8U);
    if (kind == E5M2) {
        if ((ur & 0x7FFFU) > 0x7C00U) ur = 0x7FFFU;
        return ur;
    }
    const unsigned short sign = ur & 0x8000U;
    unsigned short exponent = static_cast<unsigned short>(((ur & 0x7800U) >> 1U) + 0x2000U);
    unsigned short mantissa = (ur & 0x0700U) >> 1U;
    const unsigned char absx = 0x7FU & x;
    if (absx == 0x7FU) return 0x7FFFU;
    if (exponent == 0x2000U) {
        if (mantissa != 0U) {
            mantissa <<= 1U;
            while ((mantissa & 0x0400U) == 0U) {
                mantissa <<= 1U;
                exponent -= 0x0400U;
            }
            mantissa &= 0x03FFU;
        } else {
            exponent = 0U;
        }
    }
    return static_cast<unsigned short>(sign | exponent | mantissa);
}

}  // namespace kpt_fp8
