// CUDA header name, HIP definitions: the part of CUDA's FP8 API kpt's kernels use, on the
// conversions of fp8_convert.h (cuda_fp8.hpp's software path, bit for bit).
#pragma once
#include "hip_dialect.h"
#include "fp8_convert.h"

typedef unsigned char __nv_fp8_storage_t;
typedef enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE } __nv_saturation_t;
typedef enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 } __nv_fp8_interpretation_t;

// f32 -> FP8, round to nearest even (from the exact f64 value, as CUDA does).
__device__ __host__ inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(
    float x, __nv_saturation_t saturate, __nv_fp8_interpretation_t kind) {
    return kpt_fp8::from_double(static_cast<double>(x), saturate == __NV_SATFINITE,
                                kind == __NV_E4M3 ? kpt_fp8::E4M3 : kpt_fp8::E5M2);
}

// FP8 -> f16 bits, exact.
__device__ __host__ inline __half_raw __nv_cvt_fp8_to_halfraw(
    __nv_fp8_storage_t x, __nv_fp8_interpretation_t kind) {
    __half_raw r;
    r.x = kpt_fp8::to_half_bits(x, kind == __NV_E4M3 ? kpt_fp8::E4M3 : kpt_fp8::E5M2);
    return r;
}
