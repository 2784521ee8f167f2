// FP8 (e4m3, e5m2) and int8 quantization with per-tensor scales:
//   amax:        *amax = max |x| (atomic across blocks; *amax starts at 0)
//   amax_to_scale: *s = amax / max_finite (1 when amax is 0 or not finite), in place
//   quantize:    q = round_to_nearest_even(x / scale), saturated to the finite range
//   dequantize:  x = q * scale
// x / scale is a correctly rounded f32 division, then rounded to the 8-bit type (the
// CPU kernels round once from f64; the two differ only on rare double-rounding ties).
// Grid-stride loops. Match kpt_kernels::cpu::elementwise.
//
// kpt:launch kpt_amax_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_amax_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_amax_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_amax_to_scale block=1 shared=0 grid=one
// kpt:launch kpt_quantize_f32_e4m3 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_f32_e5m2 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_f32_i8 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_bf16_e4m3 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_bf16_e5m2 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_bf16_i8 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_f16_e4m3 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_f16_e5m2 block=256 shared=0 grid=elements
// kpt:launch kpt_quantize_f16_i8 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_e4m3_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_e5m2_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_i8_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_e4m3_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_e5m2_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_i8_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_e4m3_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_e5m2_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_dequantize_i8_f16 block=256 shared=0 grid=elements

#include <cuda_fp8.h>

#include "common.cuh"

namespace {

constexpr int kBlock = 256;

using kpt::from_float;
using kpt::to_float;

__device__ __forceinline__ long first_thread() {
    return static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long all_threads() {
    return static_cast<long>(gridDim.x) * blockDim.x;
}

template <typename T>
__device__ void amax(const T* __restrict__ x, long n, float* out) {
    float m = 0.0f;
    for (long i = first_thread(); i < n; i += all_threads()) m = fmaxf(m, fabsf(to_float(x[i])));
    m = kpt::block_max<kBlock>(m);
    // Non-negative floats order like their bit patterns.
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

struct E4m3 {
    using Q = __nv_fp8_storage_t;
    static __device__ Q encode(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }
    static __device__ float decode(Q q) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3))); }
};
struct E5m2 {
    using Q = __nv_fp8_storage_t;
    static __device__ Q encode(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2); }
    static __device__ float decode(Q q) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E5M2))); }
};
struct I8 {
    using Q = signed char;
    static __device__ Q encode(float v) { return static_cast<Q>(min(max(__float2int_rn(v), -127), 127)); }
    static __device__ float decode(Q q) { return static_cast<float>(q); }
};

template <typename T, typename F>
__device__ void quantize(const T* __restrict__ x, typename F::Q* __restrict__ out, long n,
                         const float* __restrict__ scale) {
    const float s = *scale;
    for (long i = first_thread(); i < n; i += all_threads())
        out[i] = F::encode(__fdiv_rn(to_float(x[i]), s));
}

template <typename F, typename T>
__device__ void dequantize(const typename F::Q* __restrict__ q, T* __restrict__ out, long n,
                           float scale) {
    for (long i = first_thread(); i < n; i += all_threads())
        out[i] = from_float<T>(F::decode(q[i]) * scale);
}

}  // namespace

extern "C" __global__ void kpt_amax_to_scale(float* amax_then_scale, float max_finite) {
    const float a = *amax_then_scale;
    *amax_then_scale = a > 0.0f && isfinite(a) ? a / max_finite : 1.0f;
}

#define KPT_AMAX(NAME, T)                                                                \
    extern "C" __global__ void __launch_bounds__(kBlock)                                \
        kpt_amax_##NAME(const T* x, long n, float* out) {                               \
        amax<T>(x, n, out);                                                              \
    }

#define KPT_QUANT(NAME, T, QNAME, F)                                                        \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_quantize_##NAME##_##QNAME(    \
        const T* x, F::Q* out, long n, const float* scale) {                               \
        quantize<T, F>(x, out, n, scale);                                                   \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_dequantize_##QNAME##_##NAME(  \
        const F::Q* q, T* out, long n, float scale) {                                      \
        dequantize<F, T>(q, out, n, scale);                                                 \
    }

#define KPT_QUANT_ALL(NAME, T)                                                             \
    KPT_AMAX(NAME, T)                                                                      \
    KPT_QUANT(NAME, T, e4m3, E4m3)                                                         \
    KPT_QUANT(NAME, T, e5m2, E5m2)                                                         \
    KPT_QUANT(NAME, T, i8, I8)

KPT_QUANT_ALL(f32, float)
KPT_QUANT_ALL(bf16, __nv_bfloat16)
KPT_QUANT_ALL(f16, __half)
