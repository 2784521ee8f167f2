// Linear with few rows (decode): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for
// x [M, K], w [N, K] row-major (kpt's Linear layout), M <= 16. At such M a GEMM is
// bound by reading the weights once, so the kernel is built for bandwidth: two warps
// per weight row (kSplit; 1.1B LLaMA's down projection has only 2048 rows, and one warp
// per row left too few bytes in flight), each lane reading 16-byte vectors of it
// (kUnroll = 8 loads in flight before the first use) with a streaming cache hint, so each
// warp reads contiguous 512-byte runs of the row; the two warps' sums meet in shared
// memory; the M activation rows (a few KiB, cached in L1/L2) are read
// with the same vectors. f32 accumulation, one rounding of the sum plus bias to the
// output dtype (as cuBLASLt's epilogue). Rows whose bytes are not whole 16-byte vectors,
// or unaligned buffers (`vec` = 0), take a scalar loop. Entry points per dtype and
// row class kMaxM (1, 2, 4, 8, 16): the launcher picks the smallest class >= M.
//
// kpt:launch kpt_gemv_f32_m1 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m2 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m4 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m8 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m16 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m1 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m2 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m4 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m8 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m16 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m1 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m2 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m4 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m8 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m16 block=256 shared=0 grid=rows

#include "common.cuh"

namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
// Warps per weight row (a split of its K), and rows per block.
constexpr int kSplit = 2;
constexpr int kRowsPerBlock = kWarps / kSplit;
constexpr int kUnroll = 8;

using kpt::to_float;

// Sizes of one call (the launcher's GemvDims).
struct GemvDims {
    int m;    // activation rows, 1..=kMaxM
    int n;    // weight rows = output columns
    int k;    // reduction length
    int vec;  // 1: rows are whole 16-byte vectors and every buffer is aligned
};

// Streaming 16-byte load: weights are read once per call, so they should not evict
// the activations.
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

// Dot product of two 16-byte vectors of T, accumulated into acc.
template <typename T>
__device__ __forceinline__ float dot16(const uint4& a, const uint4& b, float acc) {
    const T* ea = reinterpret_cast<const T*>(&a);
    const T* eb = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int i = 0; i < kpt::Vec<T>::N; ++i) acc = fmaf(to_float(ea[i]), to_float(eb[i]), acc);
    return acc;
}

template <typename T, int kMaxM>
__device__ void gemv(const T* __restrict__ x, const T* __restrict__ w,
                     const T* __restrict__ bias, T* __restrict__ out, GemvDims d) {
    __shared__ float partial[kWarps][kMaxM];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const long row = static_cast<long>(blockIdx.x) * kRowsPerBlock + warp / kSplit;
    // The kSplit warps of a row act as one group of kSplit * 32 lanes.
    const int glane = (warp % kSplit) * 32 + lane;
    constexpr int kGroup = kSplit * 32;
    const bool active = row < d.n;
    float acc[kMaxM];
#pragma unroll
    for (int r = 0; r < kMaxM; ++r) acc[r] = 0.0f;
    if (active && d.vec) {
        constexpr int kV = kpt::Vec<T>::N;
        const int vecs = d.k / kV;
        const uint4* wr = reinterpret_cast<const uint4*>(w + row * d.k);
        const uint4* xr = reinterpret_cast<const uint4*>(x);
        for (int base = glane; base < vecs; base += kGroup * kUnroll) {
            uint4 wv[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kGroup;
                wv[u] = i < vecs ? load_stream(wr + i) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kGroup;
                if (i < vecs) {
#pragma unroll
                    for (int r = 0; r < kMaxM; ++r)
                        if (r < d.m)
                            acc[r] = dot16<T>(wv[u], __ldg(xr + static_cast<long>(r) * vecs + i),
                                              acc[r]);
                }
            }
        }
    } else if (active) {
        const T* wr = w + row * d.k;
        for (int i = glane; i < d.k; i += kGroup) {
            const float wi = to_float(wr[i]);
#pragma unroll
            for (int r = 0; r < kMaxM; ++r)
                if (r < d.m) acc[r] = fmaf(wi, to_float(x[static_cast<long>(r) * d.k + i]), acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < kMaxM; ++r) {
        const float s = kpt::warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = s;
    }
    __syncthreads();
    if (!active || warp % kSplit != 0) return;
    const float b = bias ? to_float(bias[row]) : 0.0f;
    for (int r = lane; r < d.m; r += 32) {
        float s = b;
#pragma unroll
        for (int j = 0; j < kSplit; ++j) s += partial[warp + j][r];
        out[static_cast<long>(r) * d.n + row] = kpt::from_float<T>(s);
    }
}

}  // namespace

#define KPT_GEMV(NAME, T, M)                                                              \
    extern "C" __global__ void __launch_bounds__(kBlock)                                  \
        kpt_gemv_##NAME##_m##M(const T* x, const T* w, const T* bias, T* out, GemvDims d) { \
        gemv<T, M>(x, w, bias, out, d);                                                   \
    }

#define KPT_GEMV_ALL(NAME, T) \
    KPT_GEMV(NAME, T, 1)      \
    KPT_GEMV(NAME, T, 2)      \
    KPT_GEMV(NAME, T, 4)      \
    KPT_GEMV(NAME, T, 8)      \
    KPT_GEMV(NAME, T, 16)

KPT_GEMV_ALL(f32, float)
KPT_GEMV_ALL(bf16, __nv_bfloat16)
KPT_GEMV_ALL(f16, __half)
