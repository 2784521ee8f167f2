// Shared device helpers of kpt's CUDA kernels: programmatic dependent launch, dtype
// conversion, 16-byte vector loads and stores, warp and block reductions. Every kernel
// computes in f32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kpt {

// Programmatic dependent launch (Hopper and newer). On sm_90+ the host launches kpt's
// kernels with programmatic stream serialization, so a kernel may start while the one
// before it on the stream still runs. Every entry point therefore calls
// `wait_for_producer()` first, before it reads or writes global memory: it returns once
// the previous grid has completed and its writes are visible (at once when the launch was
// an ordinary one). Because every kernel waits so, the grid before that one had also
// completed, and so on down the stream. `let_dependents_launch()` then allows the next
// kernel of the stream to be scheduled (it still waits for this whole grid in its own
// `wait_for_producer()`), so its launch overlaps this kernel's work. Both compile to
// nothing below sm_90 (the sm_80 cubin and the compute_80 PTX have neither).
__device__ __forceinline__ void wait_for_producer() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The prologue of every kpt entry point: wait for the previous kernel, then let the next
// one launch.
__device__ __forceinline__ void dependent_launch_prologue() {
    wait_for_producer();
    let_dependents_launch();
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
    return __float2half_rn(v);
}

// Elements of T in one 16-byte vector.
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };

// Loads the 16-byte-aligned vector at p as floats.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[Vec<T>::N]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < Vec<T>::N; ++i) out[i] = to_float(e[i]);
}

// Stores floats as the 16-byte-aligned vector at p.
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[Vec<T>::N]) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < Vec<T>::N; ++i) e[i] = from_float<T>(in[i]);
    *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of v over a block of kBlock threads, returned to every thread.
template <int kBlock>
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[kBlock / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < kBlock / 32 ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// Maximum of v over a block of kBlock threads, returned to every thread.
template <int kBlock>
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[kBlock / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_max(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < kBlock / 32 ? partial[lane] : -INFINITY;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// One row of `dim` elements held in registers: thread t owns vectors t, t + kBlock,
// ... (kChunks of them). `fits(dim)` says whether a row can be held this way.
template <typename T, int kBlock, int kChunks>
struct RowRegs {
    static constexpr int N = Vec<T>::N;
    float v[kChunks][N];

    static __device__ __forceinline__ bool fits(int dim) {
        return dim % N == 0 && dim <= kBlock * kChunks * N;
    }
    // Element index of chunk c's first element for this thread.
    static __device__ __forceinline__ int at(int c) { return (c * kBlock + threadIdx.x) * N; }

    __device__ __forceinline__ void load(const T* row, int dim) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            if (at(c) < dim) load_vec(row + at(c), v[c]);
        }
    }
    __device__ __forceinline__ void store(T* row, int dim) const {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            if (at(c) < dim) store_vec(row + at(c), v[c]);
        }
    }
};

}  // namespace kpt
