// The CUDA dialect of kpt's kernels, spelled in HIP: what `kernels/cuda/*.cu` use of
// CUDA's headers and intrinsics, defined here so that the same sources compile with
// hipcc for AMD GPUs. `kernels/hip/*.hip` include this header, then a CUDA source; the
// shims `cuda_bf16.h` and `cuda_fp16.h` next to it make that source's own includes land
// here. The kernels' arithmetic is therefore the source tested on the H100, and the
// conversions defined here are CUDA's bit for bit (bf16 rounds to nearest even and keeps
// NaN quiet, as `__float2bfloat16_rn`). Library math (`rsqrtf`, `__expf`, `sincos`)
// comes from each vendor's device library and may differ in the last bits.
//
// Written against ROCm 5.2's HIP headers (Debian 12's libamdhip64-dev 5.2.3), which
// have neither `__hip_bfloat16` nor the `*_sync` shuffles of later ROCm releases.
#pragma once

// hiprtc (run-time compilation, `__HIPCC_RTC__`) provides the HIP headers itself.
#ifndef __HIPCC_RTC__
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <cstdint>
#else
// What the host's <cmath> and <cstdint> give and hiprtc's headers do not.
#ifndef INFINITY
#define INFINITY __builtin_huge_valf()
#endif
typedef __UINTPTR_TYPE__ uintptr_t;
#endif

// CUDA's 16-bit float is HIP's `__half`, with the same conversions.

// bf16 as CUDA lays it out: the upper 16 bits of an IEEE f32.
struct __nv_bfloat16 {
    unsigned short __x;
};

// f32 -> bf16, round to nearest even; NaN stays NaN (0x7fff), as CUDA's
// `__float2bfloat16_rn`.
__device__ __host__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned int u = __builtin_bit_cast(unsigned int, f);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.__x = 0x7fff;
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.__x = static_cast<unsigned short>(u >> 16);
    return r;
}

// bf16 -> f32: exact.
__device__ __host__ __forceinline__ float __bfloat162float(__nv_bfloat16 b) {
    return __builtin_bit_cast(float, static_cast<unsigned int>(b.__x) << 16);
}

// CUDA's warp shuffles with a lane mask, on HIP's with a width of 32: a CUDA warp is 32
// lanes, and HIP's shuffles then work within aligned groups of 32 lanes of the wave, so
// a source lane `t` or an xor offset below 32 means the same lanes on a wave of 64 (CDNA)
// as on a warp of 32 (NVIDIA) or a wave of 32 (RDNA). kpt's kernels pass the full mask.
#define __shfl_xor_sync(mask, var, lane_mask) __shfl_xor((var), (lane_mask), 32)
#define __shfl_sync(mask, var, src_lane) __shfl((var), (src_lane), 32)
#define __shfl_down_sync(mask, var, delta) __shfl_down((var), (delta), 32)

// `__syncwarp()`: the lanes of a warp see each other's shared-memory writes. A warp is
// part of one wavefront, which runs in lockstep; the fences keep the compiler and the
// LDS queue from reordering across the point (as later ROCm releases define it).
__device__ __forceinline__ void __syncwarp() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
