// Split-KV ("flash-decoding") attention for short queries against long KV caches: the
// same contract as attention.cu (GQA, additive [seq_q, seq_kv] f32 mask, bottom-right
// causal; q and out [batch, seq_q, heads * d], k and v [batch, seq_kv, kv_heads * d]).
//
// kpt_attention_split_*: one block per (batch, kv head, run of key tiles), scoring every
// query row of the kv head's group (rows = seq_q x heads / kv_heads, r = i * group + hh)
// against each tile, so the cache is read once per kv head. Each (row, run) leaves its
// max, its sum of exponentials and its unnormalized P.V in a f32 workspace (d + 2 floats);
// kpt_attention_combine_* merges the runs of each row (one warp per row, 32 runs at a
// time, eight runs' loads in flight) and writes the output.
//
// bf16 / f16 (tc::split): both products on tensor cores (mma.sync m16n8k16, f32
// accumulators; sm_80+). A tile is 4096 / D keys for the head-dim class D = 64, 128 or 256
// (d <= D, d % 16 == 0): 8 KiB of K and 8 KiB of V per stage, copied by 16-byte cp.async
// (zero-filled past the cache's end) into two stages, so tile t + 1 is in flight while
// tile t is computed. Rows of 16-byte chunks are XOR-swizzled (chunk c of row r at c ^ (r
// % 8)), so every ldmatrix phase hits 32 distinct banks. Keys go on the M side, query rows
// on N: S^T[key, row] = K Q^T (A = K by ldmatrix, B = Q from shared memory), then
// O^T[dim, row] += V^T P^T (A = V^T by ldmatrix.trans; B = P^T is the score accumulator
// rounded to T with its 8x8 halves transposed across the warp by movmatrix). The rows form
// up to four n-tiles of 8, and the 4 warps split n-tiles x dims (1 n-tile: every warp
// scores the whole tile and accumulates a quarter of the dims; 2: halves; 3-4: one n-tile
// each, all dims), so softmax state never crosses warps: a lane keeps the max and its part
// of the sum for two rows, the max over a tile's keys (which lie on lane / 4) takes 3
// shuffles, and the sums are reduced once at the end. Scores are scaled in f32. 48 KiB of
// static shared memory (2 stages + 32 x 256 query elements) and <= 128 registers: four
// blocks an SM, and the host plans at most one wave of them.
//
// f32 (split): scalar. For each tile the block copies K and V into shared memory (16-byte
// loads) and every warp keeps an online softmax for its rows (kept scaled in shared
// memory) across the run.
//
// kpt_attention_split_cluster_* and kpt_attention_split_paged_cluster_* (bf16 / f16,
// sm_90): the same blocks launched as thread-block clusters of one kv group's runs (at
// most 8), which merge their runs through distributed shared memory and write the output
// themselves (see merge_in_cluster): no workspace and no combine launch. The host takes
// them where a group's tiles fit 8 runs of at most two tiles (short caches: decode).
//
// kpt_attention_split_wide_* and kpt_attention_split_paged_wide_* (bf16 / f16, head dims
// up to 128): the same blocks for 33 to 64 query rows a kv group (e.g. 9 to 16 queries at
// 4 q heads per kv head, as speculative decoding verifies): 8 n-tiles, warp w taking
// n-tiles w and w + 4 with all dims, each K and V fragment feeding both; 168 registers,
// three blocks an SM; no cluster entries (the combine pass merges their runs).
//
// The host takes the split path when the group's rows fit (<= 32, or <= 64 on the wide
// entries; f32: 32 and kQFloats) and the cache spans at least two tiles; bf16 / f16 need
// d % 16 == 0, f32 rows of whole 16-byte vectors. See kpt-nvidia's `AttentionDims::split`.
//
// kpt_attention_split_paged_*: the same kernels over a paged KV cache (vLLM's layout, k
// and v [num_blocks, block_size, kv_heads * d]), nothing read on the host: key j of batch
// b is row j % block_size of block table[b][j / block_size], and batch b's length is
// lens[b] (both i32 or i64 in device memory, see `Paged`). The host plans the splits for
// the table's capacity (sd.p.seq_kv = max_blocks * block_size); runs past a sequence's
// length leave an empty partial (max -inf, sum 0, P.V 0), which the combine pass weighs
// 0. Causal alignment is against the sequence's own length (query i sees keys j <= i +
// len - seq_q). Guards, since the host cannot check these values: a length is clamped to
// 0..capacity, and a block id outside 0..num_blocks is never dereferenced: its rows are
// masked like keys past the length (zeros in shared memory, no probability). The
// tensor-core kernel looks block ids up one tile ahead: every warp holds the cache rows
// of the next tile's keys (two per lane at 64-key tiles, -1 for a masked key; 32-bit, the
// host checks that the cache's rows fit), the loading threads take their rows by shuffle
// and scale them onto pointers to their chunk, and a ballot of the current tile's rows
// gives the mask of keys to score.
// The f32 kernel looks them up per row as it copies the tile and marks each row in the
// padding word after its K.
//
// kpt:launch kpt_attention_split_f32 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_bf16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_f16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_paged_f32 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_paged_bf16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_paged_f16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_cluster_bf16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_cluster_f16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_paged_cluster_bf16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_paged_cluster_f16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_wide_bf16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_wide_f16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_paged_wide_bf16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_paged_wide_f16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_combine_f32 block=128 shared=0 grid=rows
// kpt:launch kpt_attention_combine_bf16 block=128 shared=0 grid=rows
// kpt:launch kpt_attention_combine_f16 block=128 shared=0 grid=rows

#include <cooperative_groups.h>
#include <type_traits>

#include "attention_dims.cuh"
#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxDim = 256;
constexpr int kPerLane = kMaxDim / 32;
// f32 kernel: scaled query rows of one kv group, f32 (8 KiB), and one tile's K and V as
// 32-bit words (16 KiB; rows padded by one word, see tile_at). kpt-nvidia's
// SPLIT_Q_FLOATS and SPLIT_KV_WORDS.
constexpr int kQFloats = 2048;
constexpr int kKvWords = 4096;
// A tile holds at most 64 keys, two per lane (kpt-nvidia's SPLIT_MAX_TILE).
// Query rows of a kv group a warp keeps running sums for (kpt-nvidia's SPLIT_MAX_ROWS / 4).
constexpr int kRowsPerWarp = 8;

using kpt::from_float;
using kpt::to_float;

// Layout shared with kpt-nvidia's SplitDims.
using Dims = kpt::AttentionDims;
struct SplitDims {
    Dims p;
    int tile, tiles, splits;
};

// A paged KV cache (kpt_attention_split_paged_*); layout shared with kpt-nvidia's
// `PagedSplit`. Unused (zero) for dense calls.
struct Paged {
    const void* table;  // [batch, max_blocks] block ids, i64 when table_i64, else i32
    const void* lens;   // [batch] keys per sequence, i64 when lens_i64, else i32
    int table_i64, lens_i64;
    int block_size;
    int block_shift;  // log2(block_size) when it is a power of two, else -1
    int max_blocks, num_blocks;
};

// Keys of batch b, clamped to 0..capacity.
__device__ __forceinline__ int paged_len(const Paged& pg, long b, int capacity) {
    const long long n = pg.lens_i64 ? static_cast<const long long*>(pg.lens)[b]
                                    : static_cast<const int*>(pg.lens)[b];
    return static_cast<int>(n < 0 ? 0 : (n > capacity ? capacity : n));
}

// The cache block holding key j (< the clamped length) of batch b, or -1 where the
// table's entry is not a block of the cache.
__device__ __forceinline__ int paged_block(const Paged& pg, long b, int j) {
    const int slot = pg.block_shift >= 0 ? j >> pg.block_shift : j / pg.block_size;
    const long at = b * pg.max_blocks + slot;
    const long long id = pg.table_i64 ? static_cast<const long long*>(pg.table)[at]
                                      : static_cast<const int*>(pg.table)[at];
    return id >= 0 && id < pg.num_blocks ? static_cast<int>(id) : -1;
}

// The cache row of key j of a sequence, in block `id`.
__device__ __forceinline__ long paged_row(const Paged& pg, int id, int j) {
    const int in = pg.block_shift >= 0 ? (j & (pg.block_size - 1)) : j % pg.block_size;
    return static_cast<long>(id) * pg.block_size + in;
}

// Element c of row j of a tile stored with `words` 32-bit words per row. The extra word
// per row puts key j's word w in bank (j + w) % 32, so lanes scoring one key each read
// distinct banks.
template <typename T>
__device__ __forceinline__ float tile_at(const unsigned* s, int words, int j, int c) {
    const T* row = reinterpret_cast<const T*>(s + j * words);
    return to_float(row[c]);
}

// The dot product of a scaled query row with key row `krow` (d elements of T stored
// as 32-bit words), one word at a time into four independent sums (the chain of one
// sum would bound the loop by FMA latency).
template <typename T>
__device__ __forceinline__ float dot_row(const float* qr, const unsigned* krow, int d) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (sizeof(T) == 4) {
#pragma unroll 4
        for (int c = 0; c < d; ++c) acc[c & 3] = fmaf(qr[c], __uint_as_float(krow[c]), acc[c & 3]);
    } else {
#pragma unroll 4
        for (int w = 0; w < d / 2; ++w) {
            const unsigned x = krow[w];
            float lo, hi;
            if constexpr (std::is_same_v<T, __nv_bfloat16>) {
                lo = __uint_as_float(x << 16);
                hi = __uint_as_float(x & 0xffff0000u);
            } else {
                lo = __half2float(__ushort_as_half(static_cast<unsigned short>(x & 0xffffu)));
                hi = __half2float(__ushort_as_half(static_cast<unsigned short>(x >> 16)));
            }
            acc[w & 3] = fmaf(qr[2 * w], lo, fmaf(qr[2 * w + 1], hi, acc[w & 3]));
        }
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <typename T, bool kPaged>
__device__ void split(const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, const float* __restrict__ mask,
                      float* __restrict__ part, const SplitDims sd, const Paged& pg) {
    __shared__ float qs[kQFloats];
    __shared__ unsigned kv[kKvWords];
    const Dims& p = sd.p;
    const int d = p.head_dim, group = p.heads / p.kv_heads, rows = p.seq_q * group;
    const int split = static_cast<int>(blockIdx.x % sd.splits);
    const long bg = blockIdx.x / sd.splits;  // b * kv_heads + g
    const int g = static_cast<int>(bg % p.kv_heads);
    const long b = bg / p.kv_heads;
    const int per = (sd.tiles + sd.splits - 1) / sd.splits;
    // Keys of this batch: the cache's, or (paged) the sequence's own length.
    const int len = kPaged ? paged_len(pg, b, p.seq_kv) : p.seq_kv;
    const int tiles = kPaged ? (len + sd.tile - 1) / sd.tile : sd.tiles;
    const int t0 = split * per, t1 = min(tiles, t0 + per);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Query rows r = i * group + hh (query i, head g * group + hh), scaled.
    for (int x = threadIdx.x; x < rows * d; x += kThreads) {
        const int r = x / d, c = x % d, i = r / group, hh = r % group;
        const long qo = ((b * p.seq_q + i) * p.heads + g * group + hh) * static_cast<long>(d) + c;
        qs[x] = to_float(q[qo]) * p.scale;
    }
    // Running max, sum and P.V of this warp's rows r = warp + kWarps * ri.
    float m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][kPerLane];
#pragma unroll
    for (int ri = 0; ri < kRowsPerWarp; ++ri) {
        m[ri] = -INFINITY;
        l[ri] = 0.0f;
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) o[ri][c] = 0.0f;
    }
    const int words = d * static_cast<int>(sizeof(T)) / 4 + 1;
    const int chunks = d * static_cast<int>(sizeof(T)) / 16;
    const long kv_row = static_cast<long>(p.kv_heads) * d;
    unsigned* ks = kv;
    unsigned* vs = kv + sd.tile * words;
    for (int t = t0; t < t1; ++t) {
        const int j0 = t * sd.tile, nk = min(sd.tile, len - j0);
        const long base = (b * p.seq_kv + j0) * kv_row + static_cast<long>(g) * d;
        __syncthreads();  // the previous tile is consumed
        // K and V rows, 16 bytes at a time (d * sizeof(T) is a multiple of 16).
        for (int x = threadIdx.x; x < nk * chunks; x += kThreads) {
            const int j = x / chunks, ch = x % chunks;
            long off = base + j * kv_row;
            if constexpr (kPaged) {
                // Rows of a bad block id are zeros, flagged 0 in K's padding word.
                const int id = paged_block(pg, b, j0 + j);
                if (ch == 0) ks[j * words + words - 1] = id >= 0;
                if (id < 0) {
                    unsigned* dk = ks + j * words + ch * 4;
                    unsigned* dv = vs + j * words + ch * 4;
                    dk[0] = dk[1] = dk[2] = dk[3] = 0u;
                    dv[0] = dv[1] = dv[2] = dv[3] = 0u;
                    continue;
                }
                off = paged_row(pg, id, j0 + j) * kv_row + static_cast<long>(g) * d;
            }
            const uint4 wk = reinterpret_cast<const uint4*>(k + off)[ch];
            const uint4 wv = reinterpret_cast<const uint4*>(v + off)[ch];
            unsigned* dk = ks + j * words + ch * 4;
            unsigned* dv = vs + j * words + ch * 4;
            dk[0] = wk.x, dk[1] = wk.y, dk[2] = wk.z, dk[3] = wk.w;
            dv[0] = wv.x, dv[1] = wv.y, dv[2] = wv.z, dv[3] = wv.w;
        }
        __syncthreads();
#pragma unroll
        for (int ri = 0; ri < kRowsPerWarp; ++ri) {
            const int r = warp + kWarps * ri;
            if (r >= rows) break;
            const int i = r / group;
            int limit = nk;
            if (p.causal) {
                const long vis = static_cast<long>(i) + 1 + len - p.seq_q - j0;
                limit = vis < 0 ? 0 : (vis > nk ? nk : static_cast<int>(vis));
            }
            const float* mrow = mask ? mask + static_cast<long>(i) * p.seq_kv + j0 : nullptr;
            const float* qr = qs + r * d;
            float s[2], mt = -INFINITY;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int j = lane + 32 * u;
                const bool ok = j < limit && (!kPaged || ks[j * words + words - 1] != 0u);
                s[u] = ok ? dot_row<T>(qr, ks + j * words, d) + (mrow ? mrow[j] : 0.0f)
                          : -INFINITY;
                mt = fmaxf(mt, s[u]);
            }
            const float m_new = fmaxf(m[ri], kpt::warp_max(mt));
            if (m_new == -INFINITY) continue;  // nothing visible yet (uniform over the warp)
            const float alpha = m[ri] == -INFINITY ? 0.0f : __expf(m[ri] - m_new);
            float pj[2], sum = 0.0f;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                pj[u] = s[u] == -INFINITY ? 0.0f : __expf(s[u] - m_new);
                sum += pj[u];
            }
            l[ri] = l[ri] * alpha + kpt::warp_sum(sum);
            m[ri] = m_new;
#pragma unroll
            for (int c = 0; c < kPerLane; ++c) o[ri][c] *= alpha;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int n = min(32, limit - 32 * u);
#pragma unroll 4
                for (int jj = 0; jj < n; ++jj) {
                    const float pt = __shfl_sync(0xffffffffu, pj[u], jj);
#pragma unroll
                    for (int c = 0; c < kPerLane; ++c) {
                        const int dim = lane + 32 * c;
                        if (dim < d) o[ri][c] = fmaf(pt, tile_at<T>(vs, words, 32 * u + jj, dim), o[ri][c]);
                    }
                }
            }
        }
    }
    const int stride = d + 2;
#pragma unroll
    for (int ri = 0; ri < kRowsPerWarp; ++ri) {
        const int r = warp + kWarps * ri;
        if (r >= rows) break;
        const long row = (b * p.seq_q + r / group) * p.heads + g * group + r % group;
        float* out = part + (row * sd.splits + split) * stride;
        if (lane == 0) {
            out[0] = m[ri];
            out[1] = l[ri];
        }
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
            const int dim = lane + 32 * c;
            if (dim < d) out[2 + dim] = o[ri][c];
        }
    }
}


namespace tc {

// K (and V) elements of one pipeline stage: a tile of kStageElems / D keys for the
// head-dim class D (kpt-nvidia's SPLIT_STAGE_ELEMS).
constexpr int kStageElems = 4096;
constexpr int kStages = 2;
// Query rows of a kv group: up to four n-tiles of 8 at head-dim class 256, eight at 64 and
// 128 (kpt-nvidia's SPLIT_MAX_ROWS and SPLIT_MAX_ROWS_WIDE); either way 16 KiB of query
// elements.
constexpr int kQElems = 32 * kMaxDim;
constexpr int kStageBytes = 2 * kStageElems * 2;  // K, then V
constexpr int kSmemBytes = kStages * kStageBytes + kQElems * 2;  // 48 KiB
constexpr int kMinBlocks = 4;  // an SM's shared memory holds four blocks
// The wide entries (two n-tiles a warp) need more registers: three blocks an SM.
constexpr int kMinBlocksWide = 3;

// Byte offset of 16-byte chunk c of row r in a tile of `chunks` chunks a row (a multiple
// of 8): the chunk index is XORed with r % 8, so the 8 rows an ldmatrix phase reads at
// one column, or the chunks of one row, fall into distinct groups of four banks.
__device__ __forceinline__ unsigned swz(int r, int c, int chunks) {
    return static_cast<unsigned>((r * chunks + (c ^ (r & 7))) * 16);
}

using kpt::cp_async16;
using kpt::cp_async_commit;
using kpt::ldsm_x4;
using kpt::ldsm_x4_t;
using kpt::mma;
using kpt::pack2;
using kpt::transpose8;

// Where a block's warp sits in the split kernel: its batch and kv head, and the n-tiles
// nt, nt + 4, ... (kNt of them, those below `ntiles` active) and dim tiles (dp, dp + nw,
// ...) whose sums it holds.
struct WarpPlace {
    long b;
    int g;
    int ntiles, nt, dp, nw;
};

// The end of a cluster launch (kpt_attention_split_cluster_*): the sd.splits blocks of a
// kv group form one thread-block cluster, so the runs are merged through distributed
// shared memory instead of a combine launch. Each block leaves its rows' max, sum and
// P.V (d + 2 floats a row) in its own shared memory; after a cluster barrier, block
// `split` merges rows split, split + splits, ... (a warp a row) from every block's copy
// with the combine kernel's arithmetic, and writes them; a second barrier keeps every
// block's shared memory alive until the others have read it.
template <typename T, int D, int kNt>
__device__ __forceinline__ void merge_in_cluster(const float (&o)[kNt][D / 16][4],
                                                 const float (&m)[kNt][2], float (&l)[kNt][2],
                                                 T* __restrict__ out, const SplitDims& sd,
                                                 const unsigned smem, const WarpPlace w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    // Blocks of a kv group in a cluster launch: the portable cluster size (kpt-nvidia's
    // SPLIT_CLUSTER_MAX).
    constexpr int kMaxClusterSplits = 8;
    const cg::cluster_group cluster = cg::this_cluster();
    const Dims& p = sd.p;
    const int d = p.head_dim, steps = d / 16, group = p.heads / p.kv_heads;
    const int rows = p.seq_q * group, stride = d + 2;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
    float* red = static_cast<float*>(__cvta_shared_to_generic(smem));
    __syncthreads();  // every warp is done with the stages and the query rows
#pragma unroll
    for (int u = 0; u < kNt; ++u) {
        const int nt = w.nt + 4 * u;
        if (nt >= w.ntiles) break;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float lc = l[u][c];
#pragma unroll
            for (int off = 4; off < 32; off *= 2) lc += __shfl_xor_sync(0xffffffffu, lc, off);
            const int r = nt * 8 + 2 * tig + c;
            if (r >= rows) continue;
            float* dst = red + r * stride;
            if (w.dp == 0 && gid == 0) {
                dst[0] = m[u][c];
                dst[1] = lc;
            }
#pragma unroll
            for (int i = 0; i < D / 16; ++i) {
                const int dt = w.dp + w.nw * i;
                if (dt >= steps) break;
                dst[2 + 16 * dt + gid] = o[u][i][c];
                dst[2 + 16 * dt + 8 + gid] = o[u][i][2 + c];
            }
        }
    }
    cluster.sync();
    const int splits = sd.splits, split = static_cast<int>(cluster.block_rank());
    for (int r = split + splits * warp; r < rows; r += splits * kWarps) {
        const float mt = lane < splits ? cluster.map_shared_rank(red, lane)[r * stride] : -INFINITY;
        const float lt = lane < splits ? cluster.map_shared_rank(red, lane)[r * stride + 1] : 0.0f;
        const float mx = kpt::warp_max(mt);
        const float wt = mt == -INFINITY ? 0.0f : __expf(mt - mx);
        const float sum = kpt::warp_sum(wt * lt);
        float x[kMaxClusterSplits][D / 32];
#pragma unroll
        for (int j = 0; j < kMaxClusterSplits; ++j) {
            const float* src = cluster.map_shared_rank(red, j < splits ? j : 0) + r * stride + 2;
#pragma unroll
            for (int c = 0; c < D / 32; ++c) {
                const int dim = lane + 32 * c;
                x[j][c] = j < splits && dim < d ? src[dim] : 0.0f;
            }
        }
        float acc[D / 32];
#pragma unroll
        for (int c = 0; c < D / 32; ++c) acc[c] = 0.0f;
#pragma unroll
        for (int j = 0; j < kMaxClusterSplits; ++j) {
            const float wj = __shfl_sync(0xffffffffu, wt, j);
#pragma unroll
            for (int c = 0; c < D / 32; ++c) acc[c] = fmaf(wj, x[j][c], acc[c]);
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const long row = (w.b * p.seq_q + r / group) * p.heads + w.g * group + r % group;
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
            const int dim = lane + 32 * c;
            if (dim < d) out[row * d + dim] = from_float<T>(acc[c] * inv);
        }
    }
    cluster.sync();
#else  // clusters need sm_90; the host launches these entries only there
    __trap();
#endif
}

// One block of the split kernel for head dims d <= D (d % 16 == 0); `smem` is the shared
// address of kSmemBytes: stage s's K at s * kStageBytes, its V kStageElems * 2 further,
// the query rows after the stages. Every tile row and query row has D / 8 chunks. A warp
// holds kNt n-tiles of query rows: one for up to 32 rows, two for up to 64 (D <= 128).
template <typename T, int D, bool kPaged, bool kCluster, int kNt>
__device__ __forceinline__ void run(const T* __restrict__ q, const T* __restrict__ k,
                                    const T* __restrict__ v, const float* __restrict__ mask,
                                    float* __restrict__ part, T* __restrict__ out,
                                    const SplitDims& sd, const Paged& pg, const unsigned smem) {
    constexpr int kTile = kStageElems / D;  // keys a stage holds: 64, 32, 16
    constexpr int kKeyTiles = kTile / 16;   // m-tiles of keys of S^T
    constexpr int kSteps = D / 16;          // k-steps of S^T, m-tiles of dims of O^T
    constexpr int kChunks = D / 8;
    static_assert(kNt == 1 || (kNt == 2 && D <= 128), "query rows fit kQElems");
    const Dims& p = sd.p;
    const int d = p.head_dim, steps = d / 16, chunks = d / 8;
    const int group = p.heads / p.kv_heads, rows = p.seq_q * group;
    const int split = static_cast<int>(blockIdx.x % sd.splits);
    const long bg = blockIdx.x / sd.splits;  // b * kv_heads + g
    const int g = static_cast<int>(bg % p.kv_heads);
    const long b = bg / p.kv_heads;
    const int per = (sd.tiles + sd.splits - 1) / sd.splits;
    // Keys of this batch: the cache's, or (paged) the sequence's own length.
    const int len = kPaged ? paged_len(pg, b, p.seq_kv) : p.seq_kv;
    const int tiles = kPaged ? (len + sd.tile - 1) / sd.tile : sd.tiles;
    const int t0 = split * per, t1 = min(tiles, t0 + per);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    const long kv_row = static_cast<long>(p.kv_heads) * d;
    const unsigned qs = smem + kStages * kStageBytes;

    // The group's query rows, zero rows padding the last n-tile (first cp.async group,
    // with tile t0).
    const int ntiles = (rows + 7) / 8;
    for (int x = threadIdx.x; x < ntiles * 8 * kChunks; x += kThreads) {
        const int r = x / kChunks, c = x % kChunks;
        if (c >= chunks) continue;
        const bool ok = r < rows;
        const long i = ok ? r / group : 0, hh = ok ? r % group : 0;
        const long off = ((b * p.seq_q + i) * p.heads + g * group + hh) * d + c * 8;
        cp_async16(qs + swz(r, c, kChunks), q + (ok ? off : 0), ok ? 16 : 0);
    }
    // Paged: the cache rows of keys j0 + lane and j0 + 32 + lane of tile t: -1 past the
    // length, past the tile, or for an id that is not a cache block. Looked up once per
    // key, so that the copies only scale their row (32 bits: the host checks that the
    // cache's rows fit).
    auto cache_row = [&](int j) -> int {
        const int id = paged_block(pg, b, j);
        return id < 0 ? -1 : static_cast<int>(paged_row(pg, id, j));
    };
    auto fetch = [&](int t, int& lo, int& hi) {
        const int j0 = t * sd.tile;
        lo = hi = -1;
        if (t >= t1) return;
        if (lane < kTile && j0 + lane < len) lo = cache_row(j0 + lane);
        if (kTile > 32 && j0 + 32 + lane < len) hi = cache_row(j0 + 32 + lane);
    };
    // Keys j0.. of tile t into `stage`; rows past the cache's end (paged: past the
    // length, or of a bad block id, whose ids lo / hi are -1) are zeros, so that the zero
    // probabilities of those keys never meet garbage in V.
    // Paged copies: kThreads is a multiple of kChunks, so every thread copies the same
    // chunk c of its rows, from pointers to that chunk of this kv group's head.
    const int pc = threadIdx.x % kChunks;
    const long head = static_cast<long>(g) * d + pc * 8;
    const T* __restrict__ kc = k + head;
    const T* __restrict__ vc = v + head;
    auto load = [&](int t, int stage, int lo, int hi) {
        if constexpr (kPaged) {
            const unsigned ks = smem + stage * kStageBytes, vs = ks + kStageElems * 2;
            static_assert(kThreads % kChunks == 0 && kTile * kChunks % kThreads == 0);
#pragma unroll
            for (int i = 0; i < kTile * kChunks / kThreads; ++i) {
                const int j = threadIdx.x / kChunks + i * (kThreads / kChunks);
                // Every lane shuffles (before any leaves the iteration): key j's row.
                int row = __shfl_sync(0xffffffffu, lo, j % 32);
                if constexpr (kTile > 32) {
                    const int row_hi = __shfl_sync(0xffffffffu, hi, j % 32);
                    row = j < 32 ? row : row_hi;
                }
                if (pc >= chunks) continue;
                const bool ok = row >= 0;
                const long off = static_cast<long>(ok ? row : 0) * kv_row;
                cp_async16(ks + swz(j, pc, kChunks), kc + off, ok ? 16 : 0);
                cp_async16(vs + swz(j, pc, kChunks), vc + off, ok ? 16 : 0);
            }
        } else {
            const int j0 = t * sd.tile, nk = min(sd.tile, len - j0);
            const long base = (b * p.seq_kv + j0) * kv_row + static_cast<long>(g) * d;
            const unsigned ks = smem + stage * kStageBytes, vs = ks + kStageElems * 2;
#pragma unroll
            for (int x = threadIdx.x; x < kTile * kChunks; x += kThreads) {
                const int j = x / kChunks, c = x % kChunks;
                if (c >= chunks) continue;
                const bool ok = j < nk;
                const long off = base + (ok ? j * kv_row + c * 8 : 0);
                cp_async16(ks + swz(j, c, kChunks), k + off, ok ? 16 : 0);
                cp_async16(vs + swz(j, c, kChunks), v + off, ok ? 16 : 0);
            }
        }
    };

    // Warps per n-tile, this warp's first n-tile and its share of the dims: dim tiles dp,
    // dp + nw, ... With two n-tiles a warp, warp w takes n-tiles w and w + 4, all dims.
    // Warps past the last n-tile only load; n-tile slots past it compute nothing.
    const int nw = kNt == 2 || ntiles > 2 ? 1 : (ntiles == 1 ? 4 : 2);
    const int nt = kNt == 2 ? warp : warp / nw, dp = kNt == 2 ? 0 : warp % nw;
    const bool active = nt < ntiles;
    bool on[kNt];
#pragma unroll
    for (int u = 0; u < kNt; ++u) on[u] = nt + 4 * u < ntiles;
    // The lane's two rows of each n-tile, (nt + 4 u) * 8 + 2 tig + {0, 1} (padding rows
    // borrow the last row's query): their query index and last visible key under the
    // causal mask.
    int qi[kNt][2], lim[kNt][2];
#pragma unroll
    for (int u = 0; u < kNt; ++u) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            qi[u][c] = min((nt + 4 * u) * 8 + 2 * tig + c, rows - 1) / group;
            lim[u][c] = qi[u][c] + len - p.seq_q;
        }
    }
    // O^T tiles (16 dims x 8 rows), running max and this lane's part of the row sums.
    float o[kNt][kSteps][4];
    float m[kNt][2], l[kNt][2];
#pragma unroll
    for (int u = 0; u < kNt; ++u) {
#pragma unroll
        for (int i = 0; i < kSteps; ++i) o[u][i][0] = o[u][i][1] = o[u][i][2] = o[u][i][3] = 0.0f;
        m[u][0] = m[u][1] = -INFINITY;
        l[u][0] = l[u][1] = 0.0f;
    }

    // Paged: row offsets of the current tile's keys (cur) and of the next one's (nxt).
    int cur_lo = -1, cur_hi = -1, nxt_lo = -1, nxt_hi = -1;
    if constexpr (kPaged) {
        fetch(t0, cur_lo, cur_hi);
        fetch(t0 + 1, nxt_lo, nxt_hi);
    }
    load(t0, 0, cur_lo, cur_hi);
    cp_async_commit();
    for (int t = t0; t < t1; ++t) {
        const int stage = (t - t0) & 1;
        kpt::cp_async_wait<0>();
        __syncthreads();  // tile t is in; every warp is done with the other stage
        if (t + 1 < t1) load(t + 1, stage ^ 1, nxt_lo, nxt_hi);
        cp_async_commit();
        // Paged: bit `key` set where tile t's key has a block; the ids move on a tile.
        unsigned long long keys = 0;
        if constexpr (kPaged) {
            keys = __ballot_sync(0xffffffffu, cur_lo >= 0);
            if constexpr (kTile > 32)
                keys |= static_cast<unsigned long long>(__ballot_sync(0xffffffffu, cur_hi >= 0))
                        << 32;
            cur_lo = nxt_lo;
            cur_hi = nxt_hi;
            fetch(t + 2, nxt_lo, nxt_hi);
        }
        if (!active) continue;
        const unsigned ks = smem + stage * kStageBytes, vs = ks + kStageElems * 2;
        const int j0 = t * sd.tile, nk = min(sd.tile, len - j0);

        // S^T = K Q^T, each K fragment used by every n-tile of the warp. Q's ldmatrix
        // covers two k-steps: matrices of dims 16 kp + 8 i.
        float s[kNt][kKeyTiles][4];
#pragma unroll
        for (int u = 0; u < kNt; ++u) {
#pragma unroll
            for (int mt = 0; mt < kKeyTiles; ++mt)
                s[u][mt][0] = s[u][mt][1] = s[u][mt][2] = s[u][mt][3] = 0.0f;
        }
#pragma unroll
        for (int kp = 0; kp < kSteps; kp += 2) {
            if (kp >= steps) break;
            unsigned qf[kNt][4];
#pragma unroll
            for (int u = 0; u < kNt; ++u) {
                if (on[u])
                    ldsm_x4(qf[u], qs + swz((nt + 4 * u) * 8 + (lane & 7), 2 * kp + lane / 8,
                                            kChunks));
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (kp + h >= steps) break;
#pragma unroll
                for (int mt = 0; mt < kKeyTiles; ++mt) {
                    // A = K[16 mt.., 16 (kp + h)..]: matrices (keys +0, +8) x (dims +0, +8).
                    unsigned a[4];
                    ldsm_x4(a, ks + swz(16 * mt + (lane & 15), 2 * (kp + h) + lane / 16, kChunks));
#pragma unroll
                    for (int u = 0; u < kNt; ++u) {
                        if (on[u]) mma<T>(s[u][mt], a, qf[u][2 * h], qf[u][2 * h + 1]);
                    }
                }
            }
        }

        // Per n-tile: scaled scores plus mask (invisible keys and keys past the cache's
        // end are -inf; s[u][mt][e] is key 16 mt + gid + 8 (e / 2) of row 2 tig + e % 2),
        // the online softmax, and P^T as the B operand of O^T += V^T P^T: the accumulator's
        // 8x8 halves (keys +0 and +8 on gid, rows on tig) rounded to T and transposed (keys
        // on tig, rows on gid).
        unsigned pb[kNt][kKeyTiles][2];
        float alpha[kNt][2];
#pragma unroll
        for (int u = 0; u < kNt; ++u) {
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int mt = 0; mt < kKeyTiles; ++mt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = 16 * mt + gid + 8 * (e / 2), c = e % 2, j = j0 + key;
                    float x = -INFINITY;
                    if (key < nk && (!p.causal || j <= lim[u][c]) &&
                        (!kPaged || (keys >> key & 1))) {
                        x = s[u][mt][e] * p.scale;
                        if (mask) x += mask[static_cast<long>(qi[u][c]) * p.seq_kv + j];
                    }
                    s[u][mt][e] = x;
                    mx[c] = fmaxf(mx[c], x);
                }
            }
            // Keys lie on gid: the max over the 8 lanes of each tig.
            float ref[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
#pragma unroll
                for (int off = 4; off < 32; off *= 2)
                    mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], off));
                const float mn = fmaxf(m[u][c], mx[c]);
                ref[c] = mn == -INFINITY ? 0.0f : mn;  // nothing visible yet: p = 0, not NaN
                alpha[u][c] = __expf(m[u][c] - ref[c]);
                m[u][c] = mn;
                l[u][c] *= alpha[u][c];
            }
#pragma unroll
            for (int mt = 0; mt < kKeyTiles; ++mt) {
                float e4[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    e4[e] = __expf(s[u][mt][e] - ref[e % 2]);
                    l[u][e % 2] += e4[e];
                }
                pb[u][mt][0] = transpose8(pack2<T>(e4[0], e4[1]));
                pb[u][mt][1] = transpose8(pack2<T>(e4[2], e4[3]));
            }
        }
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
            const int dt = dp + nw * i;
            if (dt >= steps) break;
#pragma unroll
            for (int u = 0; u < kNt; ++u) {
                o[u][i][0] *= alpha[u][0];
                o[u][i][1] *= alpha[u][1];
                o[u][i][2] *= alpha[u][0];
                o[u][i][3] *= alpha[u][1];
            }
#pragma unroll
            for (int mt = 0; mt < kKeyTiles; ++mt) {
                // A = V^T[16 dt.., 16 mt..]: matrices (dims +0, +8) x (keys +0, +8), each
                // the transpose of V's 8 keys x 8 dims.
                unsigned a[4];
                ldsm_x4_t(a, vs + swz(16 * mt + (lane & 7) + 8 * (lane / 16),
                                      2 * dt + (lane / 8) % 2, kChunks));
#pragma unroll
                for (int u = 0; u < kNt; ++u) {
                    if (on[u]) mma<T>(o[u][i], a, pb[u][mt][0], pb[u][mt][1]);
                }
            }
        }
    }
    if constexpr (kPaged || kCluster) kpt::cp_async_wait<0>();  // an empty run's query rows
    if constexpr (kCluster) {
        merge_in_cluster<T, D, kNt>(o, m, l, out, sd, smem, {b, g, ntiles, nt, dp, nw});
        return;
    }
    const int stride = d + 2;
#pragma unroll
    for (int u = 0; u < kNt; ++u) {
        if (!on[u]) break;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
            for (int off = 4; off < 32; off *= 2)
                l[u][c] += __shfl_xor_sync(0xffffffffu, l[u][c], off);
            const int r = (nt + 4 * u) * 8 + 2 * tig + c;
            if (r >= rows) continue;
            const long row = (b * p.seq_q + r / group) * p.heads + g * group + r % group;
            float* out = part + (row * sd.splits + split) * stride;
            if (dp == 0 && gid == 0) {
                out[0] = m[u][c];
                out[1] = l[u][c];
            }
#pragma unroll
            for (int i = 0; i < kSteps; ++i) {
                const int dt = dp + nw * i;
                if (dt >= steps) break;
                out[2 + 16 * dt + gid] = o[u][i][c];
                out[2 + 16 * dt + 8 + gid] = o[u][i][2 + c];
            }
        }
    }
}

// `part` gets the runs' partials, or (kCluster) the merged rows go straight to `out`.
// kWide: 33 to 64 query rows a kv group, head dims up to 128, two n-tiles a warp (no
// cluster launch).
template <typename T, bool kPaged, bool kCluster = false, bool kWide = false>
__device__ void split(const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, const float* __restrict__ mask,
                      float* __restrict__ part, T* __restrict__ out, const SplitDims sd,
                      const Paged& pg) {
    __shared__ __align__(128) unsigned char smem[kSmemBytes];
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int d = sd.p.head_dim;
    if constexpr (kWide) {
        if (d <= 64) {
            run<T, 64, kPaged, false, 2>(q, k, v, mask, part, out, sd, pg, s);
        } else {
            run<T, 128, kPaged, false, 2>(q, k, v, mask, part, out, sd, pg, s);
        }
    } else if (d <= 64) {
        run<T, 64, kPaged, kCluster, 1>(q, k, v, mask, part, out, sd, pg, s);
    } else if (d <= 128) {
        run<T, 128, kPaged, kCluster, 1>(q, k, v, mask, part, out, sd, pg, s);
    } else {
        run<T, 256, kPaged, kCluster, 1>(q, k, v, mask, part, out, sd, pg, s);
    }
}

}  // namespace tc

template <typename T>
__device__ void combine(const float* __restrict__ part, T* __restrict__ out, const SplitDims sd) {
    const Dims& p = sd.p;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = p.head_dim;
    const long row = static_cast<long>(blockIdx.x) * kWarps + warp;
    if (row >= static_cast<long>(p.batch) * p.seq_q * p.heads) return;
    const int stride = d + 2;
    const float* pr = part + row * sd.splits * stride;
    // 32 runs at a time, merged online: lane u holds run t0 + u's max and sum, the warp
    // sums the runs' P.V with each run's weight broadcast, so no load waits for another.
    // A run with nothing visible (m = -inf, l = 0, P.V = 0) weighs 0.
    float m = -INFINITY, l = 0.0f;
    float o[kPerLane];
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) o[c] = 0.0f;
    for (int t0 = 0; t0 < sd.splits; t0 += 32) {
        const int t = t0 + lane, n = min(32, sd.splits - t0);
        const float mt = t < sd.splits ? pr[t * stride] : -INFINITY;
        const float lt = t < sd.splits ? pr[t * stride + 1] : 0.0f;
        const float mn = fmaxf(m, kpt::warp_max(mt));
        if (mn == -INFINITY) continue;  // nothing visible so far (uniform over the warp)
        const float alpha = m == -INFINITY ? 0.0f : __expf(m - mn);
        const float w = mt == -INFINITY ? 0.0f : __expf(mt - mn);
        l = fmaf(l, alpha, kpt::warp_sum(w * lt));
        m = mn;
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) o[c] *= alpha;
        // Eight runs' P.V loaded before any is used.
        for (int u0 = 0; u0 < n; u0 += 8) {
            float x[8][kPerLane];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const float* src = pr + (t0 + u0 + u) * stride + 2;
#pragma unroll
                for (int c = 0; c < kPerLane; ++c) {
                    const int dim = lane + 32 * c;
                    x[u][c] = u0 + u < n && dim < d ? src[dim] : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const float wu = __shfl_sync(0xffffffffu, w, (u0 + u) % 32);
#pragma unroll
                for (int c = 0; c < kPerLane; ++c) o[c] = fmaf(wu, x[u][c], o[c]);
            }
        }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
        const int dim = lane + 32 * c;
        if (dim < d) out[row * d + dim] = from_float<T>(o[c] * inv);
    }
}

}  // namespace

#define KPT_ATTENTION_COMBINE(NAME, T)                                                      \
    extern "C" __global__ void __launch_bounds__(kThreads) kpt_attention_combine_##NAME(    \
        const float* part, T* out, const SplitDims sd) {                                    \
        kpt::dependent_launch_prologue();                                                   \
        combine<T>(part, out, sd);                                                          \
    }

extern "C" __global__ void __launch_bounds__(kThreads) kpt_attention_split_f32(
    const float* q, const float* k, const float* v, const float* mask, float* part,
    const SplitDims sd) {
    kpt::dependent_launch_prologue();
    split<float, false>(q, k, v, mask, part, sd, Paged{});
}
extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocks) kpt_attention_split_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const float* mask,
    float* part, const SplitDims sd) {
    kpt::dependent_launch_prologue();
    tc::split<__nv_bfloat16, false>(q, k, v, mask, part, nullptr, sd, Paged{});
}
extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocks) kpt_attention_split_f16(
    const __half* q, const __half* k, const __half* v, const float* mask, float* part,
    const SplitDims sd) {
    kpt::dependent_launch_prologue();
    tc::split<__half, false>(q, k, v, mask, part, nullptr, sd, Paged{});
}

// 33 to 64 query rows a kv group (head dims up to 128).
#define KPT_ATTENTION_SPLIT_WIDE(NAME, T)                                                    \
    extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocksWide)               \
        kpt_attention_split_wide_##NAME(const T* q, const T* k, const T* v,                  \
                                        const float* mask, float* part, const SplitDims sd) { \
        kpt::dependent_launch_prologue();                                                    \
        tc::split<T, false, false, true>(q, k, v, mask, part, nullptr, sd, Paged{});         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocksWide)               \
        kpt_attention_split_paged_wide_##NAME(const T* q, const T* k, const T* v,            \
                                              float* part, const SplitDims sd,               \
                                              const Paged pg) {                              \
        kpt::dependent_launch_prologue();                                                    \
        tc::split<T, true, false, true>(q, k, v, nullptr, part, nullptr, sd, pg);            \
    }
KPT_ATTENTION_SPLIT_WIDE(bf16, __nv_bfloat16)
KPT_ATTENTION_SPLIT_WIDE(f16, __half)

// Paged KV cache: no mask (the op excludes one).
extern "C" __global__ void __launch_bounds__(kThreads) kpt_attention_split_paged_f32(
    const float* q, const float* k, const float* v, float* part, const SplitDims sd,
    const Paged pg) {
    kpt::dependent_launch_prologue();
    split<float, true>(q, k, v, nullptr, part, sd, pg);
}
extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocks)
    kpt_attention_split_paged_bf16(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                   const __nv_bfloat16* v, float* part, const SplitDims sd,
                                   const Paged pg) {
    kpt::dependent_launch_prologue();
    tc::split<__nv_bfloat16, true>(q, k, v, nullptr, part, nullptr, sd, pg);
}
extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocks)
    kpt_attention_split_paged_f16(const __half* q, const __half* k, const __half* v,
                                  float* part, const SplitDims sd, const Paged pg) {
    kpt::dependent_launch_prologue();
    tc::split<__half, true>(q, k, v, nullptr, part, nullptr, sd, pg);
}

// Cluster launches (cluster dims sd.splits, at most kMaxClusterSplits): no workspace, no
// combine launch.
#define KPT_ATTENTION_SPLIT_CLUSTER(NAME, T)                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocks)                   \
        kpt_attention_split_cluster_##NAME(const T* q, const T* k, const T* v,               \
                                           const float* mask, T* out, const SplitDims sd) {  \
        kpt::dependent_launch_prologue();                                                    \
        tc::split<T, false, true>(q, k, v, mask, nullptr, out, sd, Paged{});                 \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(kThreads, tc::kMinBlocks)                   \
        kpt_attention_split_paged_cluster_##NAME(const T* q, const T* k, const T* v, T* out, \
                                                 const SplitDims sd, const Paged pg) {       \
        kpt::dependent_launch_prologue();                                                    \
        tc::split<T, true, true>(q, k, v, nullptr, nullptr, out, sd, pg);                    \
    }

KPT_ATTENTION_SPLIT_CLUSTER(bf16, __nv_bfloat16)
KPT_ATTENTION_SPLIT_CLUSTER(f16, __half)

KPT_ATTENTION_COMBINE(f32, float)
KPT_ATTENTION_COMBINE(bf16, __nv_bfloat16)
KPT_ATTENTION_COMBINE(f16, __half)
