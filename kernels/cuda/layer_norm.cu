// LayerNorm over the last dimension: out = (x - mean) / sqrt(var + eps) * w + b, with
// the biased variance. One block per row; rows that fit the block's registers are read
// once (exact two-pass statistics from registers), others take a strided loop.
// Matches kpt_kernels::cpu::reference::layer_norm.
//
// kpt:launch kpt_layer_norm_f32 block=256 shared=0 grid=rows
// kpt:launch kpt_layer_norm_bf16 block=256 shared=0 grid=rows
// kpt:launch kpt_layer_norm_f16 block=256 shared=0 grid=rows

#include "common.cuh"

namespace {

constexpr int kBlock = 256;
constexpr int kChunks = 4;

using kpt::from_float;
using kpt::to_float;

template <typename T>
__device__ void layer_norm(const T* __restrict__ x, const T* __restrict__ w,
                           const T* __restrict__ b, T* __restrict__ out, int dim, float eps) {
    const long base = static_cast<long>(blockIdx.x) * dim;
    x += base;
    out += base;
    const float n = static_cast<float>(dim);
    using Row = kpt::RowRegs<T, kBlock, kChunks>;
    if (Row::fits(dim)) {
        Row row, wv, bv;
        row.load(x, dim);
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
    for (int i = threadIdx.x; i < dim; i += kBlock) s += to_float(x[i]);
    const float mean = kpt::block_sum<kBlock>(s) / n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        const float d = to_float(x[i]) - mean;
        ss += d * d;
    }
    const float inv = rsqrtf(kpt::block_sum<kBlock>(ss) / n + eps);
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        out[i] = from_float<T>((to_float(x[i]) - mean) * inv * to_float(w[i]) + to_float(b[i]));
    }
}

}  // namespace

#define KPT_LAYER_NORM(NAME, T)                                                          \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_layer_norm_##NAME(          \
        const T* x, const T* w, const T* b, T* out, int dim, float eps) {                \
        layer_norm<T>(x, w, b, out, dim, eps);                                           \
    }

KPT_LAYER_NORM(f32, float)
KPT_LAYER_NORM(bf16, __nv_bfloat16)
KPT_LAYER_NORM(f16, __half)
