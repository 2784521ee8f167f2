// Element-wise kernels: activations, gated activations (SwiGLU / GeGLU), broadcasting
// add and multiply, and float casts. Grid-stride loops over 16-byte vectors when the
// sizes allow, single elements otherwise. Match kpt_kernels::cpu::reference.
//
// Activation codes: 0 relu, 1 gelu (erf), 2 gelu (tanh), 3 silu.
// Binary op codes: 0 add, 1 multiply.
//
// kpt:launch kpt_activation_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_activation_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_activation_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_act_and_mul_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_act_and_mul_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_act_and_mul_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_binary_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_binary_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_binary_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_cast_f32_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_cast_f32_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_cast_bf16_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_cast_f16_f32 block=256 shared=0 grid=elements
// kpt:launch kpt_cast_bf16_f16 block=256 shared=0 grid=elements
// kpt:launch kpt_cast_f16_bf16 block=256 shared=0 grid=elements

#include "common.cuh"

namespace {

constexpr int kBlock = 256;

using kpt::from_float;
using kpt::to_float;

// f32 outputs evaluate tanh and exp in f64: the fast-math f32 versions are off by
// more than f32's tolerance; 16-bit outputs cannot see that error.
template <typename T>
__device__ __forceinline__ float activate(float x, int act) {
    constexpr bool kExact = sizeof(T) == 4;
    switch (act) {
        case 0:
            return fmaxf(x, 0.0f);
        case 1:
            return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        case 2: {
            const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            const float t = kExact ? static_cast<float>(tanh(static_cast<double>(u))) : tanhf(u);
            return 0.5f * x * (1.0f + t);
        }
        default:
            return kExact ? static_cast<float>(x / (1.0 + exp(-static_cast<double>(x))))
                          : x / (1.0f + __expf(-x));
    }
}

__device__ __forceinline__ long first_thread() {
    return static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long all_threads() {
    return static_cast<long>(gridDim.x) * blockDim.x;
}

template <typename T>
__device__ void activation(const T* __restrict__ x, T* __restrict__ out, long n, int act) {
    constexpr int N = kpt::Vec<T>::N;
    if (n % N == 0) {
        for (long v = first_thread(); v < n / N; v += all_threads()) {
            float a[N];
            kpt::load_vec(x + v * N, a);
#pragma unroll
            for (int j = 0; j < N; ++j) a[j] = activate<T>(a[j], act);
            kpt::store_vec(out + v * N, a);
        }
        return;
    }
    for (long i = first_thread(); i < n; i += all_threads())
        out[i] = from_float<T>(activate<T>(to_float(x[i]), act));
}

// x is [rows, 2 * d]: the gate is x[r, :d], the up projection x[r, d:];
// out[r, i] = act(gate[r, i]) * up[r, i].
template <typename T>
__device__ void act_and_mul(const T* __restrict__ x, T* __restrict__ out, long rows, long d,
                            int act) {
    constexpr int N = kpt::Vec<T>::N;
    if (d % N == 0) {
        const long per_row = d / N;
        for (long v = first_thread(); v < rows * per_row; v += all_threads()) {
            const long r = v / per_row, c = (v % per_row) * N;
            float g[N], u[N];
            kpt::load_vec(x + r * 2 * d + c, g);
            kpt::load_vec(x + r * 2 * d + d + c, u);
#pragma unroll
            for (int j = 0; j < N; ++j) g[j] = activate<T>(g[j], act) * u[j];
            kpt::store_vec(out + r * d + c, g);
        }
        return;
    }
    for (long i = first_thread(); i < rows * d; i += all_threads()) {
        const long r = i / d, c = i % d;
        out[i] = from_float<T>(activate<T>(to_float(x[r * 2 * d + c]), act) *
                               to_float(x[r * 2 * d + d + c]));
    }
}

// out[i] = a[i] (+ or *) b[i % nb]: b broadcasts over the leading dimensions of a.
template <typename T>
__device__ void binary(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                       long n, long nb, int op) {
    constexpr int N = kpt::Vec<T>::N;
    if (n % N == 0 && nb % N == 0) {
        for (long v = first_thread(); v < n / N; v += all_threads()) {
            float x[N], y[N];
            kpt::load_vec(a + v * N, x);
            kpt::load_vec(b + (v * N) % nb, y);
#pragma unroll
            for (int j = 0; j < N; ++j) x[j] = op == 0 ? x[j] + y[j] : x[j] * y[j];
            kpt::store_vec(out + v * N, x);
        }
        return;
    }
    for (long i = first_thread(); i < n; i += all_threads()) {
        const float x = to_float(a[i]), y = to_float(b[i % nb]);
        out[i] = from_float<T>(op == 0 ? x + y : x * y);
    }
}

template <typename S, typename D>
__device__ void cast(const S* __restrict__ x, D* __restrict__ out, long n) {
    for (long i = first_thread(); i < n; i += all_threads()) out[i] = from_float<D>(to_float(x[i]));
}

}  // namespace

#define KPT_ELEMENTWISE(NAME, T)                                                          \
    extern "C" __global__ void __launch_bounds__(kBlock)                                 \
        kpt_activation_##NAME(const T* x, T* out, long n, int act) {                     \
        kpt::dependent_launch_prologue();                                                 \
        activation<T>(x, out, n, act);                                                    \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(kBlock)                                 \
        kpt_act_and_mul_##NAME(const T* x, T* out, long rows, long d, int act) {         \
        kpt::dependent_launch_prologue();                                                 \
        act_and_mul<T>(x, out, rows, d, act);                                             \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(kBlock)                                 \
        kpt_binary_##NAME(const T* a, const T* b, T* out, long n, long nb, int op) {     \
        kpt::dependent_launch_prologue();                                                 \
        binary<T>(a, b, out, n, nb, op);                                                  \
    }

KPT_ELEMENTWISE(f32, float)
KPT_ELEMENTWISE(bf16, __nv_bfloat16)
KPT_ELEMENTWISE(f16, __half)

#define KPT_CAST(SN, S, DN, D)                                                            \
    extern "C" __global__ void __launch_bounds__(kBlock)                                 \
        kpt_cast_##SN##_##DN(const S* x, D* out, long n) {                               \
        kpt::dependent_launch_prologue();                                                 \
        cast<S, D>(x, out, n);                                                            \
    }

KPT_CAST(f32, float, bf16, __nv_bfloat16)
KPT_CAST(f32, float, f16, __half)
KPT_CAST(bf16, __nv_bfloat16, f32, float)
KPT_CAST(f16, __half, f32, float)
KPT_CAST(bf16, __nv_bfloat16, f16, __half)
KPT_CAST(f16, __half, bf16, __nv_bfloat16)
