// Scaled dot-product attention with GQA, an optional additive [seq_q, seq_kv] f32 mask,
// bottom-right aligned causal masking and an optional sliding window (query i sees keys
// j > i + seq_kv - seq_q - window); q and out are [batch, seq_q, heads * d], k
// and v [batch, seq_kv, kv_heads * d]. Matches kpt_kernels::cpu::reference::attention.
//
// One warp per (batch, query, head) row, four rows per block. The warp walks the keys
// 32 at a time: each lane scores one key against the scaled query (kept in shared
// memory), the warp updates the running max and sum (online softmax), and every lane
// accumulates its own head dimensions (lane, lane + 32, ...) of P·V in registers.
// A row that no key is visible to gives zeros. f32 math for every dtype; head_dim <= 256.
// This is the general CUDA path (decode and small prefill); it reads K and V once per
// query row.
//
// kpt:launch kpt_attention_f32 block=128 shared=0 grid=rows
// kpt:launch kpt_attention_bf16 block=128 shared=0 grid=rows
// kpt:launch kpt_attention_f16 block=128 shared=0 grid=rows

#include "attention_dims.cuh"
#include "common.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kMaxDim = 256;
constexpr int kPerLane = kMaxDim / 32;

using kpt::from_float;
using kpt::to_float;

using Dims = kpt::AttentionDims;

template <typename T>
__device__ void attention(const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const float* __restrict__ mask,
                          T* __restrict__ out, const Dims p) {
    __shared__ float qs[kWarps][kMaxDim];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long row = static_cast<long>(blockIdx.x) * kWarps + warp;
    if (row >= static_cast<long>(p.batch) * p.seq_q * p.heads) return;
    const int d = p.head_dim;
    const int h = static_cast<int>(row % p.heads);
    const long bi = row / p.heads;  // b * seq_q + i
    const int i = static_cast<int>(bi % p.seq_q);
    const long b = bi / p.seq_q;
    const int g = h / (p.heads / p.kv_heads);

    const long q_off = row * d;  // (b * seq_q + i) * heads * d + h * d
    for (int c = lane; c < d; c += 32) qs[warp][c] = to_float(q[q_off + c]) * p.scale;
    __syncwarp();

    int limit = p.seq_kv;
    if (p.causal) {
        const long l = static_cast<long>(i) + 1 + p.seq_kv - p.seq_q;
        limit = l < 0 ? 0 : (l > p.seq_kv ? p.seq_kv : static_cast<int>(l));
    }
    // A sliding window of w keys starts at i + 1 + seq_kv - seq_q - w.
    int start = 0;
    if (p.window > 0) {
        const long st = static_cast<long>(i) + 1 + p.seq_kv - p.seq_q - p.window;
        start = st < 0 ? 0 : (st > p.seq_kv ? p.seq_kv : static_cast<int>(st));
    }
    const long kv_row = static_cast<long>(p.kv_heads) * d;
    const T* kb = k + b * p.seq_kv * kv_row + static_cast<long>(g) * d;
    const T* vb = v + b * p.seq_kv * kv_row + static_cast<long>(g) * d;
    const float* mrow = mask ? mask + static_cast<long>(i) * p.seq_kv : nullptr;

    float m = -INFINITY, l = 0.0f;
    float o[kPerLane];
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) o[c] = 0.0f;

    for (int j0 = start; j0 < limit; j0 += 32) {
        const int j = j0 + lane;
        float s = -INFINITY;
        if (j < limit) {
            const T* kj = kb + j * kv_row;
            float acc = 0.0f;
            for (int c = 0; c < d; ++c) acc = fmaf(qs[warp][c], to_float(kj[c]), acc);
            s = acc + (mrow ? mrow[j] : 0.0f);
        }
        const float m_new = fmaxf(m, kpt::warp_max(s));
        if (m_new == -INFINITY) continue;  // nothing visible yet (uniform over the warp)
        const float pj = s == -INFINITY ? 0.0f : __expf(s - m_new);
        const float alpha = m == -INFINITY ? 0.0f : __expf(m - m_new);
        l = l * alpha + kpt::warp_sum(pj);
        m = m_new;
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) o[c] *= alpha;
        const int nj = min(32, limit - j0);
        for (int t = 0; t < nj; ++t) {
            const float pt = __shfl_sync(0xffffffffu, pj, t);
            const T* vj = vb + (j0 + t) * kv_row;
#pragma unroll
            for (int c = 0; c < kPerLane; ++c) {
                const int dim = lane + 32 * c;
                if (dim < d) o[c] = fmaf(pt, to_float(vj[dim]), o[c]);
            }
        }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
        const int dim = lane + 32 * c;
        if (dim < d) out[q_off + dim] = from_float<T>(o[c] * inv);
    }
}

}  // namespace

#define KPT_ATTENTION(NAME, T)                                                              \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) kpt_attention_##NAME(         \
        const T* q, const T* k, const T* v, const float* mask, T* out, const Dims p) {      \
        kpt::dependent_launch_prologue();                                                   \
        attention<T>(q, k, v, mask, out, p);                                                \
    }

KPT_ATTENTION(f32, float)
KPT_ATTENTION(bf16, __nv_bfloat16)
KPT_ATTENTION(f16, __half)
