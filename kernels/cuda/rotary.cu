// Rotary position embedding, NeoX / LLaMA "rotate half" layout, on x [batch, seq,
// heads * head_dim] with positions [seq] (i32 or i64). One block per (batch, seq) row:
// the cos/sin of the row's position are computed once in f64 (exact for long
// positions) into shared memory, then every head of the row is rotated, with 16-byte
// loads when half a head is a multiple of 16 bytes. head_dim <= 512.
// Plain rotary (inv_freq == nullptr) computes theta^(-2i/head_dim) itself; scaled
// rotary reads the head_dim/2 inverse frequencies from inv_freq (f64, computed on the
// host by kpt_core::graph::rope_frequencies) and multiplies cos and sin by
// attention_factor (1 unless YaRN).
// Matches kpt_kernels::cpu::reference::rotary.
//
// kpt:launch kpt_rotary_f32_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_f32_i64 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_bf16_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_bf16_i64 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_f16_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_f16_i64 block=256 shared=0 grid=rows

#include "common.cuh"

namespace {

constexpr int kBlock = 256;
constexpr int kMaxHalf = 256;

using kpt::from_float;
using kpt::to_float;

template <typename T, typename I>
__device__ void rotary(const T* __restrict__ x, const I* __restrict__ positions,
                       T* __restrict__ out, int seq, int heads, int head_dim, float theta,
                       const double* __restrict__ inv_freq, double attention_factor) {
    __shared__ float cos_t[kMaxHalf], sin_t[kMaxHalf];
    const int half = head_dim / 2;
    const long row = blockIdx.x;
    const double pos = static_cast<double>(positions[row % seq]);
    for (int i = threadIdx.x; i < half; i += kBlock) {
        const double freq = inv_freq != nullptr
                                ? inv_freq[i]
                                : pow(static_cast<double>(theta), -2.0 * i / head_dim);
        double s, c;
        sincos(pos * freq, &s, &c);
        cos_t[i] = static_cast<float>(c * attention_factor);
        sin_t[i] = static_cast<float>(s * attention_factor);
    }
    __syncthreads();
    const long base = row * heads * head_dim;
    x += base;
    out += base;
    constexpr int N = kpt::Vec<T>::N;
    if (half % N == 0) {
        const int per_head = half / N;
        for (int k = threadIdx.x; k < heads * per_head; k += kBlock) {
            const int i = (k % per_head) * N;
            const long at = static_cast<long>(k / per_head) * head_dim + i;
            float a[N], b[N], ra[N], rb[N];
            kpt::load_vec(x + at, a);
            kpt::load_vec(x + at + half, b);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                ra[j] = a[j] * cos_t[i + j] - b[j] * sin_t[i + j];
                rb[j] = b[j] * cos_t[i + j] + a[j] * sin_t[i + j];
            }
            kpt::store_vec(out + at, ra);
            kpt::store_vec(out + at + half, rb);
        }
        return;
    }
    for (int k = threadIdx.x; k < heads * half; k += kBlock) {
        const int i = k % half;
        const long at = static_cast<long>(k / half) * head_dim + i;
        const float a = to_float(x[at]), b = to_float(x[at + half]);
        out[at] = from_float<T>(a * cos_t[i] - b * sin_t[i]);
        out[at + half] = from_float<T>(b * cos_t[i] + a * sin_t[i]);
    }
}

}  // namespace

#define KPT_ROTARY(NAME, T, INAME, I)                                                    \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_rotary_##NAME##_##INAME(   \
        const T* x, const I* positions, T* out, int seq, int heads, int head_dim,       \
        float theta, const double* inv_freq, double attention_factor) {                  \
        rotary<T, I>(x, positions, out, seq, heads, head_dim, theta, inv_freq,           \
                     attention_factor);                                                  \
    }

KPT_ROTARY(f32, float, i32, int)
KPT_ROTARY(f32, float, i64, long long)
KPT_ROTARY(bf16, __nv_bfloat16, i32, int)
KPT_ROTARY(bf16, __nv_bfloat16, i64, long long)
KPT_ROTARY(f16, __half, i32, int)
KPT_ROTARY(f16, __half, i64, long long)
