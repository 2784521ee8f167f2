// FP8 (e4m3, e5m2) and int8 quantization with per-tensor scales:
//   amax:        *amax = max |x| (atomic across blocks; *amax starts at 0)
//   amax_to_scale: *s = amax / max_finite (1 when amax is 0 or not finite), in place
//   quantize:    q = round_to_nearest_even(x / scale), saturated to the finite range;
//                scale is *scale_ptr, or the value `scale` when scale_ptr is null
//   dequantize:  x = q * scale
// x / scale is a correctly rounded f32 division, then rounded to the 8-bit type (the
// CPU kernels round once from f64; the two differ only on rare double-rounding ties).
// Grid-stride loops over 16-byte vectors (8-byte packed stores for bf16/f16) when the
// buffers are aligned, then the remaining elements one by one. Match
// kpt_kernels::cpu::elementwise.
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

#include <cstdint>

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

// True when x and out allow 16-byte loads of T and the matching 8-bit stores.
template <typename T>
__device__ __forceinline__ bool vector_aligned(const T* x, const void* out) {
    return reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(out) % kpt::Vec<T>::N == 0;
}

template <typename T>
__device__ void amax(const T* __restrict__ x, long n, float* out) {
    constexpr int N = kpt::Vec<T>::N;
    float m = 0.0f;
    long tail = 0;
    if (vector_aligned(x, x)) {
        const long vectors = n / N;
        for (long v = first_thread(); v < vectors; v += all_threads()) {
            float f[N];
            kpt::load_vec(x + v * N, f);
#pragma unroll
            for (int j = 0; j < N; ++j) m = fmaxf(m, fabsf(f[j]));
        }
        tail = vectors * N;
    }
    for (long i = tail + first_thread(); i < n; i += all_threads()) m = fmaxf(m, fabsf(to_float(x[i])));
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

// N quantized bytes stored at once.
template <int N>
struct alignas(N) Packed {
    unsigned char b[N];
};

template <typename T, typename F>
__device__ void quantize(const T* __restrict__ x, typename F::Q* __restrict__ out, long n,
                         const float* __restrict__ scale_ptr, float scale) {
    static_assert(sizeof(typename F::Q) == 1, "8-bit quantized types");
    constexpr int N = kpt::Vec<T>::N;
    const float s = scale_ptr ? *scale_ptr : scale;
    long tail = 0;
    if (vector_aligned(x, out)) {
        const long vectors = n / N;
        for (long v = first_thread(); v < vectors; v += all_threads()) {
            float f[N];
            kpt::load_vec(x + v * N, f);
            Packed<N> p;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const typename F::Q q = F::encode(__fdiv_rn(f[j], s));
                p.b[j] = reinterpret_cast<const unsigned char&>(q);
            }
            *reinterpret_cast<Packed<N>*>(out + v * N) = p;
        }
        tail = vectors * N;
    }
    for (long i = tail + first_thread(); i < n; i += all_threads())
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
    kpt::dependent_launch_prologue();
    const float a = *amax_then_scale;
    *amax_then_scale = a > 0.0f && isfinite(a) ? a / max_finite : 1.0f;
}

#define KPT_AMAX(NAME, T)                                                                \
    extern "C" __global__ void __launch_bounds__(kBlock)                                \
        kpt_amax_##NAME(const T* x, long n, float* out) {                               \
        kpt::dependent_launch_prologue();                                                \
        amax<T>(x, n, out);                                                              \
    }

#define KPT_QUANT(NAME, T, QNAME, F)                                                        \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_quantize_##NAME##_##QNAME(    \
        const T* x, F::Q* out, long n, const float* scale_ptr, float scale) {              \
        kpt::dependent_launch_prologue();                                                   \
        quantize<T, F>(x, out, n, scale_ptr, scale);                                        \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_dequantize_##QNAME##_##NAME(  \
        const F::Q* q, T* out, long n, float scale) {                                      \
        kpt::dependent_launch_prologue();                                                   \
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
