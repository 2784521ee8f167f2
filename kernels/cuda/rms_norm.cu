// RMSNorm over the last dimension: out[r, i] = x[r, i] / sqrt(mean(x[r, :]^2) + eps) * w[i].
// One thread block per row; f32 accumulation for every dtype. Matches
// kpt_kernels::cpu::reference::rms_norm.
//
// kpt:launch kpt_rms_norm_f32 block=256 shared=0 grid=rows
// kpt:launch kpt_rms_norm_bf16 block=256 shared=0 grid=rows

#include <cuda_bf16.h>

namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of `v` over the block, returned to every thread.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[kWarps];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < kWarps ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, long i) {
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, long i, float v) {
    p[i] = __float2bfloat16_rn(v);
}

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w,
                         T* __restrict__ out, int rows, int dim, float eps) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const T* xr = x + static_cast<long>(r) * dim;
    T* orow = out + static_cast<long>(r) * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        const float v = load(xr, i);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss) / static_cast<float>(dim) + eps);
    for (int i = threadIdx.x; i < dim; i += kBlock) {
        store(orow, i, load(xr, i) * inv * load(w, i));
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kBlock)
kpt_rms_norm_f32(const float* x, const float* w, float* out, int rows, int dim, float eps) {
    rms_norm(x, w, out, rows, dim, eps);
}

extern "C" __global__ void __launch_bounds__(kBlock)
kpt_rms_norm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* out,
                  int rows, int dim, float eps) {
    rms_norm(x, w, out, rows, dim, eps);
}
