// Split-KV ("flash-decoding") attention for short queries against long KV caches: the
// same contract as attention.cu (GQA, additive [seq_q, seq_kv] f32 mask, bottom-right
// causal; q and out [batch, seq_q, heads * d], k and v [batch, seq_kv, kv_heads * d]).
//
// kpt_attention_split_*: one block per (batch, kv head, tile of keys). The block copies
// the tile's K and V into shared memory once (16-byte global loads) and scores them
// against every query row of that kv head's group (seq_q x heads / kv_heads rows, kept
// scaled in shared memory), so the cache is read once per kv head instead of once per
// query head. Each (row, tile) leaves its max, its sum of exponentials and its
// unnormalized P.V in a f32 workspace. kpt_attention_combine_* merges the tiles of each
// row (one warp per row) and writes the output. The host takes this path when the
// group's queries fit kQFloats, d * sizeof(T) is a multiple of 16 and the cache spans
// at least two tiles; see kpt-nvidia's `Gpu::attention`.
//
// kpt:launch kpt_attention_split_f32 block=128 shared=0 grid=tiles
// kpt:launch kpt_attention_split_bf16 block=128 shared=0 grid=tiles
// kpt:launch kpt_attention_split_f16 block=128 shared=0 grid=tiles
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

using kpt::from_float;
using kpt::to_float;

// Layout shared with kpt-nvidia's AttentionDims / SplitDims.
struct Dims {
    int batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal;
    float scale;
};
struct SplitDims {
    Dims p;
    int tile, tiles;
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
// as 32-bit words), one word at a time.
template <typename T>
__device__ __forceinline__ float dot_row(const float* qr, const unsigned* krow, int d) {
    float acc = 0.0f;
    if constexpr (sizeof(T) == 4) {
        for (int c = 0; c < d; ++c) acc = fmaf(qr[c], __uint_as_float(krow[c]), acc);
    } else {
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
            acc = fmaf(qr[2 * w], lo, fmaf(qr[2 * w + 1], hi, acc));
        }
    }
    return acc;
}

template <typename T>
__device__ void split(const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, const float* __restrict__ mask,
                      float* __restrict__ part, const SplitDims sd) {
    __shared__ float qs[kQFloats];
    __shared__ unsigned kv[kKvWords];
    const Dims& p = sd.p;
    const int d = p.head_dim, group = p.heads / p.kv_heads, rows = p.seq_q * group;
    const int t = static_cast<int>(blockIdx.x % sd.tiles);
    const long bg = blockIdx.x / sd.tiles;  // b * kv_heads + g
    const int g = static_cast<int>(bg % p.kv_heads);
    const long b = bg / p.kv_heads;
    const int j0 = t * sd.tile, nk = min(sd.tile, p.seq_kv - j0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Query rows r = i * group + hh (query i, head g * group + hh), scaled.
    for (int x = threadIdx.x; x < rows * d; x += kThreads) {
        const int r = x / d, c = x % d, i = r / group, hh = r % group;
        const long qo = ((b * p.seq_q + i) * p.heads + g * group + hh) * static_cast<long>(d) + c;
        qs[x] = to_float(q[qo]) * p.scale;
    }
    // The tile's K then V rows, 16 bytes at a time (d * sizeof(T) is a multiple of 16).
    const int words = d * static_cast<int>(sizeof(T)) / 4 + 1;
    const int chunks = d * static_cast<int>(sizeof(T)) / 16;
    const long kv_row = static_cast<long>(p.kv_heads) * d;
    const long base = (b * p.seq_kv + j0) * kv_row + static_cast<long>(g) * d;
    unsigned* ks = kv;
    unsigned* vs = kv + sd.tile * words;
    for (int x = threadIdx.x; x < 2 * nk * chunks; x += kThreads) {
        const int which = x / (nk * chunks), y = x % (nk * chunks);
        const int j = y / chunks, ch = y % chunks;
        const T* src = (which == 0 ? k : v) + base + j * kv_row;
        const uint4 w = reinterpret_cast<const uint4*>(src)[ch];
        unsigned* dst = (which == 0 ? ks : vs) + j * words + ch * 4;
        dst[0] = w.x;
        dst[1] = w.y;
        dst[2] = w.z;
        dst[3] = w.w;
    }
    __syncthreads();

    const int stride = d + 2;
    for (int r = warp; r < rows; r += kWarps) {
        const int i = r / group, h = g * group + r % group;
        int limit = nk;
        if (p.causal) {
            const long l = static_cast<long>(i) + 1 + p.seq_kv - p.seq_q - j0;
            limit = l < 0 ? 0 : (l > nk ? nk : static_cast<int>(l));
        }
        const float* mrow = mask ? mask + static_cast<long>(i) * p.seq_kv + j0 : nullptr;
        const float* qr = qs + r * d;
        float s[2], m = -INFINITY;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = lane + 32 * u;
            s[u] = -INFINITY;
            if (j < limit) {
                s[u] = dot_row<T>(qr, ks + j * words, d) + (mrow ? mrow[j] : 0.0f);
            }
            m = fmaxf(m, s[u]);
        }
        m = kpt::warp_max(m);
        float l = 0.0f;
        float o[kPerLane];
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) o[c] = 0.0f;
        if (m != -INFINITY) {
            float pj[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                pj[u] = s[u] == -INFINITY ? 0.0f : __expf(s[u] - m);
                l += pj[u];
            }
            l = kpt::warp_sum(l);
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int n = min(32, limit - 32 * u);
                for (int jj = 0; jj < n; ++jj) {
                    const float pt = __shfl_sync(0xffffffffu, pj[u], jj);
#pragma unroll
                    for (int c = 0; c < kPerLane; ++c) {
                        const int dim = lane + 32 * c;
                        if (dim < d) o[c] = fmaf(pt, tile_at<T>(vs, words, 32 * u + jj, dim), o[c]);
                    }
                }
            }
        }
        const long row = (b * p.seq_q + i) * p.heads + h;
        float* out = part + (row * sd.tiles + t) * stride;
        if (lane == 0) {
            out[0] = m;
            out[1] = l;
        }
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
            const int dim = lane + 32 * c;
            if (dim < d) out[2 + dim] = o[c];
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
    const float* pr = part + row * sd.tiles * stride;
    float m = -INFINITY;
    for (int t = lane; t < sd.tiles; t += 32) m = fmaxf(m, pr[t * stride]);
    m = kpt::warp_max(m);
    float l = 0.0f;
    float o[kPerLane];
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) o[c] = 0.0f;
    if (m != -INFINITY) {
        for (int t = 0; t < sd.tiles; ++t) {
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
