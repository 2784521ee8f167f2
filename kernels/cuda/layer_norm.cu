// LayerNorm over the last dimension, alone and fused with the residual add:
//   out = (x - mean) / sqrt(var + eps) * w + b, with the biased variance;
//   add_layer_norm: sum = x + residual (stored), out = layer_norm(sum) (of the stored sum).
// One block per row; rows that fit the block's registers are read once (exact two-pass
// statistics from registers), others take a strided loop. f32 accumulation for every
// dtype. Matches kpt_kernels::cpu::reference::{layer_norm, add_layer_norm}.
//
// kpt:launch kpt_layer_norm_f32 block=256 shared=0 grid=rows
// kpt:launch kpt_layer_norm_bf16 block=256 shared=0 grid=rows
// kpt:launch kpt_layer_norm_f16 block=256 shared=0 grid=rows
// kpt:launch kpt_add_layer_norm_f32 block=256 shared=0 grid=rows
// kpt:launch kpt_add_layer_norm_bf16 block=256 shared=0 grid=rows
// kpt:launch kpt_add_layer_norm_f16 block=256 shared=0 grid=rows

#include "common.cuh"

namespace {

constexpr int kBlock = 256;
constexpr int kChunks = 4;

using kpt::from_float;
using kpt::to_float;

// `residual` and `sum` are null for plain LayerNorm.
template <typename T>
__device__ void layer_norm(const T* __restrict__ x, const T* __restrict__ residual,
                           const T* __restrict__ w, const T* __restrict__ b,
                           T* __restrict__ sum, T* __restrict__ out, int dim, float eps) {
    const long base = static_cast<long>(blockIdx.x) * dim;
    x += base;
    out += base;
    if (residual) {
        residual += base;
        sum += base;
    }
    const float n = static_cast<float>(dim);
    using Row = kpt::RowRegs<T, kBlock, kChunks>;
    if (Row::fits(dim)) {
        Row row, wv, bv;
        row.load(x, dim);
        if (residual) {
            // `wv` holds the residual until the weight is needed.
            wv.load(residual, dim);
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
#pragma unroll
                for (int j = 0; j < Row::N; ++j)
                    row.v[c][j] = to_float(from_float<T>(row.v[c][j] + wv.v[c][j]));
            row.store(sum, dim);
        }
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            if (Row::at(c) < dim)
#pragma unroll
                for (int j = 0; j < Row::N; ++j) s += row.v[c][j];
        const float mean = kpt::block_sum<kBlock>(s) / n;
        float ss = 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            if (Row::at(c) < dim)
#pragma unroll
                for (int j = 0; j < Row::N; ++j) {
                    const float d = row.v[c][j] - mean;
                    ss += d * d;
                }
        const float inv = rsqrtf(kpt::block_sum<kBlock>(ss) / n + eps);
        wv.load(w, dim);
        bv.load(b, dim);
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
#pragma unroll
            for (int j = 0; j < Row::N; ++j)
                row.v[c][j] = (row.v[c][j] - mean) * inv * wv.v[c][j] + bv.v[c][j];
        row.store(out, dim);
        return;
    }
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        float v = to_float(x[i]);
        if (residual) {
            const T t = from_float<T>(v + to_float(residual[i]));
            sum[i] = t;
            v = to_float(t);
        }
        s += v;
    }
    const float mean = kpt::block_sum<kBlock>(s) / n;
    // With a residual, each thread re-reads only the sums it wrote itself.
    const T* src = residual ? sum : x;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        const float d = to_float(src[i]) - mean;
        ss += d * d;
    }
    const float inv = rsqrtf(kpt::block_sum<kBlock>(ss) / n + eps);
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        out[i] = from_float<T>((to_float(src[i]) - mean) * inv * to_float(w[i]) + to_float(b[i]));
    }
}

}  // namespace

#define KPT_LAYER_NORM(NAME, T)                                                            \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_layer_norm_##NAME(            \
        const T* x, const T* w, const T* b, T* out, int dim, float eps) {                  \
        kpt::dependent_launch_prologue();                                                  \
        layer_norm<T>(x, nullptr, w, b, nullptr, out, dim, eps);                           \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_add_layer_norm_##NAME(        \
        const T* x, const T* residual, const T* w, const T* b, T* sum, T* out, int dim,    \
        float eps) {                                                                       \
        kpt::dependent_launch_prologue();                                                  \
        layer_norm<T>(x, residual, w, b, sum, out, dim, eps);                              \
    }

KPT_LAYER_NORM(f32, float)
KPT_LAYER_NORM(bf16, __nv_bfloat16)
KPT_LAYER_NORM(f16, __half)
