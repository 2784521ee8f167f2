// RMSNorm over the last dimension, alone and fused with the residual add:
//   out[r, i] = x[r, i] / sqrt(mean(x[r, :]^2) + eps) * w[i]
//   add_rms_norm: sum = x + residual (stored), out = rms_norm(sum) (of the stored sum).
// One block per row. Rows whose size is a multiple of 16 bytes and fits the block's
// registers are read once with 16-byte loads; other rows take a strided loop that reads
// them twice. f32 accumulation for every dtype. Matches kpt_kernels::cpu::reference.
//
// kpt:launch kpt_rms_norm_f32 block=128 shared=0 grid=rows
// kpt:launch kpt_rms_norm_bf16 block=128 shared=0 grid=rows
// kpt:launch kpt_rms_norm_f16 block=128 shared=0 grid=rows
// kpt:launch kpt_add_rms_norm_f32 block=128 shared=0 grid=rows
// kpt:launch kpt_add_rms_norm_bf16 block=128 shared=0 grid=rows
// kpt:launch kpt_add_rms_norm_f16 block=128 shared=0 grid=rows

#include "common.cuh"

namespace {

constexpr int kBlock = 128;
constexpr int kChunks = 8;

using kpt::from_float;
using kpt::to_float;

// `residual` and `sum` are null for plain RMSNorm.
template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ residual,
                         const T* __restrict__ w, T* __restrict__ sum, T* __restrict__ out,
                         int dim, float eps) {
    const long base = static_cast<long>(blockIdx.x) * dim;
    x += base;
    out += base;
    if (residual) {
        residual += base;
        sum += base;
    }
    using Row = kpt::RowRegs<T, kBlock, kChunks>;
    if (Row::fits(dim)) {
        Row row, other;
        row.load(x, dim);
        if (residual) {
            other.load(residual, dim);
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
#pragma unroll
                for (int j = 0; j < Row::N; ++j)
                    row.v[c][j] = to_float(from_float<T>(row.v[c][j] + other.v[c][j]));
            row.store(sum, dim);
        }
        // The weight's loads overlap the reduction.
        other.load(w, dim);
        float ss = 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            if (Row::at(c) < dim)
#pragma unroll
                for (int j = 0; j < Row::N; ++j) ss += row.v[c][j] * row.v[c][j];
        const float inv = rsqrtf(kpt::block_sum<kBlock>(ss) / static_cast<float>(dim) + eps);
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
#pragma unroll
            for (int j = 0; j < Row::N; ++j) row.v[c][j] *= inv * other.v[c][j];
        row.store(out, dim);
        return;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        float v = to_float(x[i]);
        if (residual) {
            const T s = from_float<T>(v + to_float(residual[i]));
            sum[i] = s;
            v = to_float(s);
        }
        ss += v * v;
    }
    const float inv = rsqrtf(kpt::block_sum<kBlock>(ss) / static_cast<float>(dim) + eps);
    // With a residual, each thread re-reads only the sums it wrote itself.
    const T* src = residual ? sum : x;
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        out[i] = from_float<T>(to_float(src[i]) * inv * to_float(w[i]));
    }
}

}  // namespace

#define KPT_RMS_NORM(NAME, T)                                                              \
    extern "C" __global__ void __launch_bounds__(kBlock)                                  \
        kpt_rms_norm_##NAME(const T* x, const T* w, T* out, int dim, float eps) {         \
        kpt::dependent_launch_prologue();                                                  \
        rms_norm<T>(x, nullptr, w, nullptr, out, dim, eps);                                \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_add_rms_norm_##NAME(          \
        const T* x, const T* residual, const T* w, T* sum, T* out, int dim, float eps) {   \
        kpt::dependent_launch_prologue();                                                  \
        rms_norm<T>(x, residual, w, sum, out, dim, eps);                                   \
    }

KPT_RMS_NORM(f32, float)
KPT_RMS_NORM(bf16, __nv_bfloat16)
KPT_RMS_NORM(f16, __half)
