// Tensor-core building blocks of kpt's attention kernels (sm_80 and newer): cp.async
// copies into shared memory (single chunks and whole tiles), ldmatrix / movmatrix fragment loads, and the m16n8k16 MMA
// with f32 accumulators. Fragment layouts (PTX ISA, "mma.m16n8k16"): lane l, with
// g = l / 4 and u = l % 4, holds a = {A[g][2u..], A[g+8][2u..], A[g][2u+8..],
// A[g+8][2u+8..]}, b = {B[2u..][g], B[2u+8..][g]}, c = {C[g][2u], C[g][2u+1],
// C[g+8][2u], C[g+8][2u+1]}.
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kpt {

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; `bytes` = 0 fills zeros (reads nothing).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 matrices of 16-bit elements; lanes 8i..8i+7 address the rows of matrix i.
// Plain: lane l gets row l / 4, columns 2 (l % 4) + {0, 1}; .trans: the transpose.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Transposes an 8x8 matrix of 16-bit elements held as ldmatrix leaves it.
__device__ __forceinline__ unsigned transpose8(unsigned x) {
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Two floats as a pair of T (bf16 or f16), lo in the low half.
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const unsigned*>(&h);
    } else {
        const __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const unsigned*>(&h);
    }
}

// c += a b on a 16x8x16 tile (A row-major, B column-major, f32 accumulators).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// The same at a generic pointer into shared memory: 16 bytes, zero-filled when !valid
// (rows past the end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    cp_async16(smem_u32(dst), src, valid ? 16 : 0);
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) { ldsm_x4(r, smem_u32(p)); }
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
    ldsm_x4_t(r, smem_u32(p));
}

// Copies `rows` rows (from `src`, `stride` elements apart) of D elements into a tile of
// kRows rows with `ld` elements per row, spread over kThreads threads; rows past `rows`
// are zeros.
template <typename T, int D, int kRows, int kThreads>
__device__ __forceinline__ void load_tile(T* tile, int ld, const T* src, long stride,
                                          int rows) {
    constexpr int kChunks = D * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
#pragma unroll
    for (int x = threadIdx.x; x < kRows * kChunks; x += kThreads) {
        const int r = x / kChunks, c = x % kChunks;
        const bool valid = r < rows;
        const T* s = src + (valid ? r : 0) * stride + c * (16 / sizeof(T));
        cp_async16(tile + r * ld + c * (16 / sizeof(T)), s, valid);
    }
}

}  // namespace kpt
