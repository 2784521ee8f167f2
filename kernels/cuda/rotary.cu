// Rotary position embedding, NeoX / LLaMA "rotate half" layout, on x [tokens,
// heads * head_dim] with positions (i32 or i64) of `period` entries: token t takes
// positions[t % period], so positions [seq] shared by every sequence (period = seq) and
// one position per token (period = tokens) are the same kernel. One block per token:
// the cos/sin of its position are computed once in f64 (exact for long positions) into
// shared memory, then every head is rotated, with 16-byte loads when half a head is a
// multiple of 16 bytes. head_dim <= 512. The head_dim/2 inverse frequencies come from
// inv_freq (f64, computed on the host by kpt_core::graph::rope_frequencies, with or
// without scaling); cos and sin are multiplied by attention_factor (1 unless YaRN).
// Matches kpt_kernels::cpu::reference::rotary.
//
// kpt_split_rotary_*: the q/k/v split of a merged projection fused with the rotary of q
// and k. qkv [tokens, q + k + v] gives q [tokens, q] and k [tokens, k], rotated with the
// token's table as above, and v [tokens, v], copied: one launch for the three outputs.
// With `slots` (Op::SplitRotary with `cache`), k and v are caches and token t's rows go
// to row slots[t] of each (counted over all their leading dims; a negative slot, or one
// past `cache_rows`, skips the token's k and v as kpt_cache_write does). v is copied and
// each thread's first rotation loaded before the table is computed, so their loads
// overlap its math. 16-byte loads when half a head and v are multiples of 16 bytes.
// Matches kpt_kernels::cpu::reference::split_rotary (and cache_write).
//
// kpt:launch kpt_rotary_f32_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_f32_i64 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_bf16_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_bf16_i64 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_f16_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_rotary_f16_i64 block=256 shared=0 grid=rows
// kpt:launch kpt_split_rotary_f32_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_split_rotary_f32_i64 block=256 shared=0 grid=rows
// kpt:launch kpt_split_rotary_bf16_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_split_rotary_bf16_i64 block=256 shared=0 grid=rows
// kpt:launch kpt_split_rotary_f16_i32 block=256 shared=0 grid=rows
// kpt:launch kpt_split_rotary_f16_i64 block=256 shared=0 grid=rows

#include "common.cuh"

namespace {

constexpr int kBlock = 256;
constexpr int kMaxHalf = 256;

using kpt::from_float;
using kpt::to_float;

// cos and sin (times attention_factor) of pos * inv_freq[i] for i < half, in f64,
// rounded once into the block's shared tables. The caller synchronizes.
__device__ void fill_table(double pos, int head_dim, const double* __restrict__ inv_freq,
                           double attention_factor, float* cos_t, float* sin_t) {
    const int half = head_dim / 2;
    for (int i = threadIdx.x; i < half; i += kBlock) {
        double s, c;
        sincos(pos * inv_freq[i], &s, &c);
        cos_t[i] = static_cast<float>(c * attention_factor);
        sin_t[i] = static_cast<float>(s * attention_factor);
    }
}

// Rotates the N elements a (first half) and b (second half) at offset i of a head and
// stores them at dst and dst + half.
template <typename T>
__device__ __forceinline__ void rotate_store(const float (&a)[kpt::Vec<T>::N],
                                             const float (&b)[kpt::Vec<T>::N], T* dst, int i,
                                             int half, const float* cos_t, const float* sin_t) {
    constexpr int N = kpt::Vec<T>::N;
    float ra[N], rb[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        ra[j] = a[j] * cos_t[i + j] - b[j] * sin_t[i + j];
        rb[j] = b[j] * cos_t[i + j] + a[j] * sin_t[i + j];
    }
    kpt::store_vec(dst, ra);
    kpt::store_vec(dst + half, rb);
}

// Rotates N elements i..i+N of both halves of the head at src into dst.
template <typename T>
__device__ __forceinline__ void rotate_vec(const T* src, T* dst, int i, int half,
                                           const float* cos_t, const float* sin_t) {
    constexpr int N = kpt::Vec<T>::N;
    float a[N], b[N];
    kpt::load_vec(src, a);
    kpt::load_vec(src + half, b);
    rotate_store<T>(a, b, dst, i, half, cos_t, sin_t);
}

// Rotates element i of both halves of the head at src into dst.
template <typename T>
__device__ __forceinline__ void rotate_one(const T* src, T* dst, int i, int half,
                                           const float* cos_t, const float* sin_t) {
    const float a = to_float(src[i]), b = to_float(src[i + half]);
    dst[i] = from_float<T>(a * cos_t[i] - b * sin_t[i]);
    dst[i + half] = from_float<T>(b * cos_t[i] + a * sin_t[i]);
}

template <typename T, typename I>
__device__ void rotary(const T* __restrict__ x, const I* __restrict__ positions,
                       T* __restrict__ out, int period, int heads, int head_dim,
                       const double* __restrict__ inv_freq, double attention_factor) {
    __shared__ float cos_t[kMaxHalf], sin_t[kMaxHalf];
    const int half = head_dim / 2;
    const long row = blockIdx.x;
    fill_table(static_cast<double>(positions[row % period]), head_dim, inv_freq,
               attention_factor, cos_t, sin_t);
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
            rotate_vec(x + at, out + at, i, half, cos_t, sin_t);
        }
        return;
    }
    for (int k = threadIdx.x; k < heads * half; k += kBlock) {
        const long at = static_cast<long>(k / half) * head_dim;
        rotate_one(x + at, out + at, k % half, half, cos_t, sin_t);
    }
}

// The cache row of token `row`'s k and v: slots[row], -1 (skip) for a negative slot or
// one past cache_rows; without slots (k and v outputs), the token's own row.
__device__ __forceinline__ long kv_row(long row, const void* slots, int slots_i64,
                                       long cache_rows) {
    if (slots == nullptr) return row;
    const long slot = slots_i64 ? static_cast<const long long*>(slots)[row]
                                : static_cast<const int*>(slots)[row];
    return slot >= 0 && slot < cache_rows ? slot : -1;
}

template <typename T, typename I>
__device__ void split_rotary(const T* __restrict__ qkv, const I* __restrict__ positions,
                             T* __restrict__ q, T* __restrict__ k, T* __restrict__ v,
                             const void* slots, int slots_i64, long cache_rows, int period,
                             int q_heads, int k_heads, int v_width, int head_dim,
                             const double* __restrict__ inv_freq, double attention_factor) {
    __shared__ float cos_t[kMaxHalf], sin_t[kMaxHalf];
    const int half = head_dim / 2;
    const long row = blockIdx.x;
    const long q_width = static_cast<long>(q_heads) * head_dim;
    const long k_width = static_cast<long>(k_heads) * head_dim;
    const long kv = kv_row(row, slots, slots_i64, cache_rows);
    // q's heads, then k's, are contiguous at the start of the token's qkv row.
    const T* src = qkv + row * (q_width + k_width + v_width);
    T* dst_q = q + row * q_width;
    T* dst_k = k + max(kv, 0L) * k_width;
    const T* src_v = src + q_width + k_width;
    T* dst_v = v + max(kv, 0L) * v_width;
    // A skipped slot leaves k's heads (and v) alone.
    const int heads = kv >= 0 ? q_heads + k_heads : q_heads;
    const double pos = static_cast<double>(positions[row % period]);
    constexpr int N = kpt::Vec<T>::N;
    if (half % N == 0 && v_width % N == 0) {
        const int per_head = half / N;
        const int items = heads * per_head;
        const int first = threadIdx.x;
        float a[N], b[N];
        if (first < items) {
            const T* at = src + static_cast<long>(first / per_head) * head_dim +
                          (first % per_head) * N;
            kpt::load_vec(at, a);
            kpt::load_vec(at + half, b);
        }
        if (kv >= 0) {
            for (int j = threadIdx.x * N; j < v_width; j += kBlock * N) {
                *reinterpret_cast<uint4*>(dst_v + j) = *reinterpret_cast<const uint4*>(src_v + j);
            }
        }
        fill_table(pos, head_dim, inv_freq, attention_factor, cos_t, sin_t);
        __syncthreads();
        for (int t = first; t < items; t += kBlock) {
            const int h = t / per_head;
            const int i = (t % per_head) * N;
            if (t != first) {
                kpt::load_vec(src + static_cast<long>(h) * head_dim + i, a);
                kpt::load_vec(src + static_cast<long>(h) * head_dim + i + half, b);
            }
            T* dst = h < q_heads ? dst_q + static_cast<long>(h) * head_dim
                                 : dst_k + static_cast<long>(h - q_heads) * head_dim;
            rotate_store<T>(a, b, dst + i, i, half, cos_t, sin_t);
        }
        return;
    }
    if (kv >= 0) {
        for (int j = threadIdx.x; j < v_width; j += kBlock) dst_v[j] = src_v[j];
    }
    fill_table(pos, head_dim, inv_freq, attention_factor, cos_t, sin_t);
    __syncthreads();
    for (int t = threadIdx.x; t < heads * half; t += kBlock) {
        const int h = t / half;
        T* dst = h < q_heads ? dst_q + static_cast<long>(h) * head_dim
                             : dst_k + static_cast<long>(h - q_heads) * head_dim;
        rotate_one(src + static_cast<long>(h) * head_dim, dst, t % half, half, cos_t, sin_t);
    }
}

}  // namespace

#define KPT_ROTARY(NAME, T, INAME, I)                                                    \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_rotary_##NAME##_##INAME(   \
        const T* x, const I* positions, T* out, int period, int heads, int head_dim,    \
        const double* inv_freq, double attention_factor) {                               \
        kpt::dependent_launch_prologue();                                                \
        rotary<T, I>(x, positions, out, period, heads, head_dim, inv_freq,               \
                     attention_factor);                                                  \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(kBlock)                                 \
        kpt_split_rotary_##NAME##_##INAME(                                               \
            const T* qkv, const I* positions, T* q, T* k, T* v, const void* slots,       \
            int slots_i64, long cache_rows, int period, int q_heads, int k_heads,        \
            int v_width, int head_dim, const double* inv_freq, double attention_factor) { \
        kpt::dependent_launch_prologue();                                                \
        split_rotary<T, I>(qkv, positions, q, k, v, slots, slots_i64, cache_rows, period, \
                           q_heads, k_heads, v_width, head_dim, inv_freq,                \
                           attention_factor);                                            \
    }

KPT_ROTARY(f32, float, i32, int)
KPT_ROTARY(f32, float, i64, long long)
KPT_ROTARY(bf16, __nv_bfloat16, i32, int)
KPT_ROTARY(bf16, __nv_bfloat16, i64, long long)
KPT_ROTARY(f16, __half, i32, int)
KPT_ROTARY(f16, __half, i64, long long)
