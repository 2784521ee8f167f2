// Split-KV ("flash-decoding") attention for short queries against long KV caches: the
// same contract as attention.cu (GQA, additive [seq_q, seq_kv] f32 mask, bottom-right
// causal; q and out [batch, seq_q, heads * d], k and v [batch, seq_kv, kv_heads * d]).
//
// kpt_attention_split_*: one block per (batch, kv head, run of key tiles). For each tile
// the block copies K and V into shared memory once (16-byte global loads) and scores
// them against every query row of that kv head's group (seq_q x heads / kv_heads rows,
// kept scaled in shared memory), so the cache is read once per kv head instead of once
// per query head; each warp keeps an online softmax for its rows across the run. Each
// (row, run) leaves its max, its sum of exponentials and its unnormalized P.V in a f32
// workspace. kpt_attention_combine_* merges the runs of each row (one warp per row) and
// writes the output. The host takes this path when the
// group's queries fit kQFloats, d * sizeof(T) is a multiple of 16 and the cache spans
// at least two tiles; see kpt-nvidia's `Gpu::attention`.
//
// kpt:launch kpt_attention_split_f32 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_bf16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_split_f16 block=128 shared=0 grid=splits
// kpt:launch kpt_attention_combine_f32 block=128 shared=0 grid=rows
// kpt:launch kpt_attention_combine_bf16 block=128 shared=0 grid=rows
// kpt:launch kpt_attention_combine_f16 block=128 shared=0 grid=rows

#include <type_traits>

#include "common.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxDim = 256;
constexpr int kPerLane = kMaxDim / 32;
// Scaled query rows of one kv group, f32 (8 KiB), and one tile's K and V as 32-bit
// words (16 KiB; rows padded by one word, see tile_at): 24 KiB a block, so that nine
// blocks share an SM's shared memory and keep its loads in flight.
constexpr int kQFloats = 2048;
constexpr int kKvWords = 4096;
// A tile holds at most 64 keys, two per lane (kpt-nvidia's SPLIT_MAX_TILE).
// Query rows of a kv group a warp keeps running sums for (kpt-nvidia's SPLIT_MAX_ROWS / 4).
constexpr int kRowsPerWarp = 8;

using kpt::from_float;
using kpt::to_float;

// Layout shared with kpt-nvidia's AttentionDims / SplitDims.
struct Dims {
    int batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal;
    float scale;
};
struct SplitDims {
    Dims p;
    int tile, tiles, splits;
};

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

template <typename T>
__device__ void split(const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, const float* __restrict__ mask,
                      float* __restrict__ part, const SplitDims sd) {
    __shared__ float qs[kQFloats];
    __shared__ unsigned kv[kKvWords];
    const Dims& p = sd.p;
    const int d = p.head_dim, group = p.heads / p.kv_heads, rows = p.seq_q * group;
    const int split = static_cast<int>(blockIdx.x % sd.splits);
    const long bg = blockIdx.x / sd.splits;  // b * kv_heads + g
    const int g = static_cast<int>(bg % p.kv_heads);
    const long b = bg / p.kv_heads;
    const int per = (sd.tiles + sd.splits - 1) / sd.splits;
    const int t0 = split * per, t1 = min(sd.tiles, t0 + per);
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
        const int j0 = t * sd.tile, nk = min(sd.tile, p.seq_kv - j0);
        const long base = (b * p.seq_kv + j0) * kv_row + static_cast<long>(g) * d;
        __syncthreads();  // the previous tile is consumed
        // K and V rows, 16 bytes at a time (d * sizeof(T) is a multiple of 16).
        for (int x = threadIdx.x; x < nk * chunks; x += kThreads) {
            const int j = x / chunks, ch = x % chunks;
            const long off = base + j * kv_row;
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
                const long vis = static_cast<long>(i) + 1 + p.seq_kv - p.seq_q - j0;
                limit = vis < 0 ? 0 : (vis > nk ? nk : static_cast<int>(vis));
            }
            const float* mrow = mask ? mask + static_cast<long>(i) * p.seq_kv + j0 : nullptr;
            const float* qr = qs + r * d;
            float s[2], mt = -INFINITY;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int j = lane + 32 * u;
                s[u] = j < limit ? dot_row<T>(qr, ks + j * words, d) + (mrow ? mrow[j] : 0.0f)
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

template <typename T>
__device__ void combine(const float* __restrict__ part, T* __restrict__ out, const SplitDims sd) {
    const Dims& p = sd.p;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = p.head_dim;
    const long row = static_cast<long>(blockIdx.x) * kWarps + warp;
    if (row >= static_cast<long>(p.batch) * p.seq_q * p.heads) return;
    const int stride = d + 2;
    const float* pr = part + row * sd.splits * stride;
    float m = -INFINITY;
    for (int t = lane; t < sd.splits; t += 32) m = fmaxf(m, pr[t * stride]);
    m = kpt::warp_max(m);
    float l = 0.0f;
    float o[kPerLane];
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) o[c] = 0.0f;
    if (m != -INFINITY) {
        for (int t = 0; t < sd.splits; ++t) {
            const float mt = pr[t * stride];
            if (mt == -INFINITY) continue;
            const float w = __expf(mt - m);
            l = fmaf(w, pr[t * stride + 1], l);
#pragma unroll
            for (int c = 0; c < kPerLane; ++c) {
                const int dim = lane + 32 * c;
                if (dim < d) o[c] = fmaf(w, pr[t * stride + 2 + dim], o[c]);
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

#define KPT_ATTENTION_SPLIT(NAME, T)                                                        \
    extern "C" __global__ void __launch_bounds__(kThreads) kpt_attention_split_##NAME(      \
        const T* q, const T* k, const T* v, const float* mask, float* part,                 \
        const SplitDims sd) {                                                               \
        split<T>(q, k, v, mask, part, sd);                                                  \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(kThreads) kpt_attention_combine_##NAME(    \
        const float* part, T* out, const SplitDims sd) {                                    \
        combine<T>(part, out, sd);                                                          \
    }

KPT_ATTENTION_SPLIT(f32, float)
KPT_ATTENTION_SPLIT(bf16, __nv_bfloat16)
KPT_ATTENTION_SPLIT(f16, __half)
