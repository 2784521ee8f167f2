// Embedding gather: out[i, :] = table[ids[i], :] for ids (i32 or i64) into a table
// [vocab, dim]. One block per id, 16-byte copies when a row is a multiple of 16 bytes.
// An id outside [0, vocab) writes a zero row and sets *bad to 1 (the caller reports
// it as an error). Matches kpt_kernels::cpu::reference::embedding.
//
// kpt:launch kpt_embedding_f32_i32 block=128 shared=0 grid=ids
// kpt:launch kpt_embedding_f32_i64 block=128 shared=0 grid=ids
// kpt:launch kpt_embedding_bf16_i32 block=128 shared=0 grid=ids
// kpt:launch kpt_embedding_bf16_i64 block=128 shared=0 grid=ids
// kpt:launch kpt_embedding_f16_i32 block=128 shared=0 grid=ids
// kpt:launch kpt_embedding_f16_i64 block=128 shared=0 grid=ids

#include "common.cuh"

namespace {

constexpr int kBlock = 128;

template <typename T, typename I>
__device__ void embedding(const I* __restrict__ ids, const T* __restrict__ table,
                          T* __restrict__ out, long vocab, int dim, int* bad) {
    const long id = static_cast<long>(ids[blockIdx.x]);
    T* dst = out + static_cast<long>(blockIdx.x) * dim;
    const bool ok = id >= 0 && id < vocab;
    if (!ok && threadIdx.x == 0) *bad = 1;
    const T* src = table + (ok ? id : 0) * dim;
    if (dim * sizeof(T) % 16 == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const int n = dim * sizeof(T) / 16;
        for (int i = threadIdx.x; i < n; i += kBlock) d[i] = ok ? s[i] : make_uint4(0, 0, 0, 0);
        return;
    }
    for (int i = threadIdx.x; i < dim; i += kBlock) dst[i] = ok ? src[i] : kpt::from_float<T>(0.0f);
}

}  // namespace

#define KPT_EMBEDDING(NAME, T, INAME, I)                                                  \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_embedding_##NAME##_##INAME(  \
        const I* ids, const T* table, T* out, long vocab, int dim, int* bad) {           \
        kpt::dependent_launch_prologue();                                                 \
        embedding<T, I>(ids, table, out, vocab, dim, bad);                                \
    }

KPT_EMBEDDING(f32, float, i32, int)
KPT_EMBEDDING(f32, float, i64, long long)
KPT_EMBEDDING(bf16, __nv_bfloat16, i32, int)
KPT_EMBEDDING(bf16, __nv_bfloat16, i64, long long)
KPT_EMBEDDING(f16, __half, i32, int)
KPT_EMBEDDING(f16, __half, i64, long long)
