// Softmax over the last dimension, subtracting the row maximum first; a row of only
// -inf gives zeros. One block per row; rows that fit the block's registers are read
// once, others take a strided loop. Matches kpt_kernels::cpu::reference::softmax.
//
// kpt:launch kpt_softmax_f32 block=256 shared=0 grid=rows
// kpt:launch kpt_softmax_bf16 block=256 shared=0 grid=rows
// kpt:launch kpt_softmax_f16 block=256 shared=0 grid=rows
//
// Argmax over the last dimension (greedy decoding): one block per row, each thread the
// first maximum of its strided elements, then (value, index) pairs reduced by warp
// shuffles and shared memory, ties to the lower index; a row holding a NaN gives -1.
// Matches kpt_kernels::cpu::reference::argmax.
//
// kpt:launch kpt_argmax_f32 block=512 shared=0 grid=rows
// kpt:launch kpt_argmax_bf16 block=512 shared=0 grid=rows
// kpt:launch kpt_argmax_f16 block=512 shared=0 grid=rows

#include "common.cuh"

namespace {

constexpr int kBlock = 256;
constexpr int kChunks = 4;

using kpt::from_float;
using kpt::to_float;

template <typename T>
__device__ void softmax(const T* __restrict__ x, T* __restrict__ out, int dim) {
    const long base = static_cast<long>(blockIdx.x) * dim;
    x += base;
    out += base;
    using Row = kpt::RowRegs<T, kBlock, kChunks>;
    if (Row::fits(dim)) {
        Row row;
        row.load(x, dim);
        float m = -INFINITY;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            if (Row::at(c) < dim)
#pragma unroll
                for (int j = 0; j < Row::N; ++j) m = fmaxf(m, row.v[c][j]);
        m = kpt::block_max<kBlock>(m);
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            if (Row::at(c) < dim)
#pragma unroll
                for (int j = 0; j < Row::N; ++j) {
                    row.v[c][j] = m == -INFINITY ? 0.0f : __expf(row.v[c][j] - m);
                    s += row.v[c][j];
                }
        s = kpt::block_sum<kBlock>(s);
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
#pragma unroll
            for (int j = 0; j < Row::N; ++j) row.v[c][j] *= inv;
        row.store(out, dim);
        return;
    }
    float m = -INFINITY;
    for (int i = threadIdx.x; i < dim; i += kBlock) m = fmaxf(m, to_float(x[i]));
    m = kpt::block_max<kBlock>(m);
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += kBlock)
        s += m == -INFINITY ? 0.0f : __expf(to_float(x[i]) - m);
    s = kpt::block_sum<kBlock>(s);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        const float e = m == -INFINITY ? 0.0f : __expf(to_float(x[i]) - m);
        out[i] = from_float<T>(e * inv);
    }
}

constexpr int kArgBlock = 512;
constexpr int kNoIndex = 0x7fffffff;

// Whether (v, i) comes before (best, at): larger, or equal at a lower index.
__device__ __forceinline__ bool before(float v, int i, float best, int at) {
    return v > best || (v == best && i < at);
}

template <typename T>
__device__ void argmax(const T* __restrict__ x, long long* __restrict__ out, int dim) {
    __shared__ float best_v[kArgBlock / 32];
    __shared__ int best_i[kArgBlock / 32];
    x += static_cast<long>(blockIdx.x) * dim;
    float best = -INFINITY;
    int at = kNoIndex;
    int nan = 0;
#pragma unroll 4
    for (int i = threadIdx.x; i < dim; i += kArgBlock) {
        const float v = to_float(x[i]);
        nan |= v != v;
        if (before(v, i, best, at)) {
            best = v;
            at = i;
        }
    }
    nan = __syncthreads_or(nan);
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const int i = __shfl_xor_sync(0xffffffffu, at, o);
        if (before(v, i, best, at)) {
            best = v;
            at = i;
        }
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        best_v[warp] = best;
        best_i[warp] = at;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < kArgBlock / 32 ? best_v[lane] : -INFINITY;
        at = lane < kArgBlock / 32 ? best_i[lane] : kNoIndex;
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, best, o);
            const int i = __shfl_xor_sync(0xffffffffu, at, o);
            if (before(v, i, best, at)) {
                best = v;
                at = i;
            }
        }
        if (lane == 0) out[blockIdx.x] = nan ? -1 : at;
    }
}

}  // namespace

#define KPT_ARGMAX(NAME, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(kArgBlock)                                \
        kpt_argmax_##NAME(const T* x, long long* out, int dim) {                           \
        kpt::dependent_launch_prologue();                                                   \
        argmax<T>(x, out, dim);                                                             \
    }

KPT_ARGMAX(f32, float)
KPT_ARGMAX(bf16, __nv_bfloat16)
KPT_ARGMAX(f16, __half)

#define KPT_SOFTMAX(NAME, T)                                                                \
    extern "C" __global__ void __launch_bounds__(kBlock)                                   \
        kpt_softmax_##NAME(const T* x, T* out, int dim) {                                  \
        kpt::dependent_launch_prologue();                                                   \
        softmax<T>(x, out, dim);                                                            \
    }

KPT_SOFTMAX(f32, float)
KPT_SOFTMAX(bf16, __nv_bfloat16)
KPT_SOFTMAX(f16, __half)
