// Gathers one sequence's rows out of a paged KV cache (vLLM's layout): row j of the
// sequence is row j % block_size of cache block table[j / block_size], for j < len; the
// rows land contiguous in `out`, ready for the dense attention kernels. A row is
// `row_units` units of 16, 4 or 2 bytes (the largest that divides the row); `table` holds
// the sequence's block ids as i32 or i64 (`table_i64`). Block ids were checked on the host.
//
//
// kpt_cache_write_*: the opposite direction (Op::CacheWrite, vLLM's reshape_and_cache):
// row i of `rows` goes to row slots[i] of the cache, counted over all its leading dims. A
// negative slot skips its row; so does one past the cache's `cache_rows`, which the
// kernel cannot report, so that no slot writes outside the cache.
//
// kpt:launch kpt_paged_gather_16 block=256 shared=0 grid=elements
// kpt:launch kpt_paged_gather_4 block=256 shared=0 grid=elements
// kpt:launch kpt_paged_gather_2 block=256 shared=0 grid=elements
// kpt:launch kpt_cache_write_16 block=256 shared=0 grid=elements
// kpt:launch kpt_cache_write_4 block=256 shared=0 grid=elements
// kpt:launch kpt_cache_write_2 block=256 shared=0 grid=elements

#include <cstdint>

#include "common.cuh"

namespace {

template <typename U>
__device__ void gather(const U* __restrict__ cache, U* __restrict__ out, const void* table,
                       int table_i64, int len, int block_size, int row_units) {
    const long total = static_cast<long>(len) * row_units;
    for (long x = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; x < total;
         x += static_cast<long>(gridDim.x) * blockDim.x) {
        const int j = static_cast<int>(x / row_units), c = static_cast<int>(x % row_units);
        const int slot = j / block_size;
        const long block = table_i64 ? static_cast<const long long*>(table)[slot]
                                     : static_cast<const int*>(table)[slot];
        out[x] = cache[(block * block_size + j % block_size) * row_units + c];
    }
}

template <typename U>
__device__ void write(const U* __restrict__ rows, U* __restrict__ cache, const void* slots,
                      int slots_i64, int n, long cache_rows, int row_units) {
    const long total = static_cast<long>(n) * row_units;
    for (long x = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; x < total;
         x += static_cast<long>(gridDim.x) * blockDim.x) {
        const int i = static_cast<int>(x / row_units), c = static_cast<int>(x % row_units);
        const long slot = slots_i64 ? static_cast<const long long*>(slots)[i]
                                    : static_cast<const int*>(slots)[i];
        if (slot >= 0 && slot < cache_rows) cache[slot * row_units + c] = rows[x];
    }
}

}  // namespace

#define KPT_PAGED_GATHER(BYTES, U)                                                          \
    extern "C" __global__ void __launch_bounds__(256) kpt_paged_gather_##BYTES(            \
        const U* cache, U* out, const void* table, int table_i64, int len, int block_size, \
        int row_units) {                                                                    \
        kpt::dependent_launch_prologue();                                                  \
        gather<U>(cache, out, table, table_i64, len, block_size, row_units);               \
    }

KPT_PAGED_GATHER(16, uint4)
KPT_PAGED_GATHER(4, unsigned)
KPT_PAGED_GATHER(2, unsigned short)

#define KPT_CACHE_WRITE(BYTES, U)                                                          \
    extern "C" __global__ void __launch_bounds__(256) kpt_cache_write_##BYTES(             \
        const U* rows, U* cache, const void* slots, int slots_i64, int n, long cache_rows, \
        int row_units) {                                                                   \
        kpt::dependent_launch_prologue();                                                 \
        write<U>(rows, cache, slots, slots_i64, n, cache_rows, row_units);                \
    }

KPT_CACHE_WRITE(16, uint4)
KPT_CACHE_WRITE(4, unsigned)
KPT_CACHE_WRITE(2, unsigned short)
