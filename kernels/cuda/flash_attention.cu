// FlashAttention-2 style forward attention on tensor cores (mma.sync m16n8k16, sm_80 and
// newer) for bf16 and f16 with head dim 64, 128, 192 or 256: the same contract as attention.cu
// (GQA, additive [seq_q, seq_kv] f32 mask, bottom-right causal, sliding window; q and out
// [batch, seq_q, heads * d], k and v [batch, seq_kv, kv_heads * d]).
//
// One block of 4 warps per (64 query rows, head, batch); each warp owns 16 rows. At head
// dim 64 and 128 the block's Q tile is staged through shared memory into registers once
// (A fragments) and K and V take static shared memory; at 192 and 256, where O's
// accumulators alone take 96-128 registers a thread, Q stays in its own shared tile and
// each k-step of Q K^T reads its fragment from there, and the three tiles (76-99 KiB) are
// dynamic shared memory. Key
// tiles of 64 are walked with K and V in shared memory (rows padded by 16 bytes, so the
// eight rows an ldmatrix reads fall in distinct banks), loaded with cp.async and
// overlapped as FlashAttention-2 does: V(t) loads while S = Q K(t)^T runs, K(t+1) while
// P V(t) runs. Scores stay in the mma accumulators; the online softmax works on them in
// the log2 domain (exp2), the quad of lanes that shares a row reduces its max with two
// shuffles, and the probabilities are re-packed in registers as the A fragments of
// P V (the accumulator layout of two n-tiles is the A layout of one k-step). Causal
// blocks stop at the last visible key tile, and element masks are applied only on tiles
// that cross the diagonal, the end of the cache, or carry an additive mask. Rows that no
// key is visible to give zeros. Query tiles are scheduled last-first so that the longest
// causal blocks start first (block x = tile from the last * batch * heads + b * heads + h).
// When `lse` is not null, each row's log-sum-exp of the scaled scores (natural log, f32
// [batch, heads, seq_q], +inf for rows that see no key) is written there too, for the
// backward pass. With dropout (Dims::dropout_threshold > 0, see attention_dims.cuh) each
// probability is multiplied by its dropout factor after the row's sum is taken and
// before P V (kpt::dropout_keep8: the quad of lanes of a row shares its Philox calls).
//
// kpt:launch kpt_flash_attention_bf16_d64 block=128 shared=0 grid=tiles
// kpt:launch kpt_flash_attention_bf16_d128 block=128 shared=0 grid=tiles
// kpt:launch kpt_flash_attention_f16_d64 block=128 shared=0 grid=tiles
// kpt:launch kpt_flash_attention_f16_d128 block=128 shared=0 grid=tiles
// kpt:launch kpt_flash_attention_bf16_d192 block=128 shared=76800 grid=tiles
// kpt:launch kpt_flash_attention_bf16_d256 block=128 shared=101376 grid=tiles
// kpt:launch kpt_flash_attention_f16_d192 block=128 shared=76800 grid=tiles
// kpt:launch kpt_flash_attention_f16_d256 block=128 shared=101376 grid=tiles

#include <type_traits>

#include "attention_dims.cuh"
#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = 64;  // query rows per block (16 per warp)
constexpr int kBlockN = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using Dims = kpt::AttentionDims;

using kpt::cp_async_commit;
using kpt::cp_async_wait;
using kpt::mma;
using kpt::pack2;

// Tiles of kThreads threads.
template <typename T, int D, int kRows>
__device__ __forceinline__ void load_tile(T* tile, int ld, const T* src, long stride,
                                          int rows) {
    kpt::load_tile<T, D, kRows, kThreads>(tile, ld, src, stride, rows);
}

// Head dims above this keep Q in shared memory (see the top).
constexpr int kMaxQInRegisters = 128;

// The block's tiles of D + 8 columns: K, then V (which first holds the Q tile), then for
// head dims above kMaxQInRegisters Q. Static shared memory up to that, dynamic above (the
// launch's `shared=` bytes: 3 * 64 * (D + 8) * sizeof(T)).
template <typename T, int D>
__device__ __forceinline__ T* flash_tiles() {
    constexpr int kTile = kBlockN * (D + 8);
    if constexpr (D > kMaxQInRegisters) {
        extern __shared__ __align__(16) unsigned char dynamic_tiles[];
        return reinterpret_cast<T*>(dynamic_tiles);
    } else {
        __shared__ __align__(16) T tiles[2 * kTile];
        return tiles;
    }
}

template <typename T, int D>
__device__ void flash(const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, const float* __restrict__ mask,
                      T* __restrict__ out, float* __restrict__ lse, const Dims p) {
    constexpr int kLd = D + 8;  // padded row: 16 extra bytes
    constexpr bool kQShared = D > kMaxQInRegisters;
    T* ks = flash_tiles<T, D>();
    T* vs = ks + kBlockN * kLd;
    // Q's tile: V's buffer until the fragments are in registers, or its own.
    T* qs = kQShared ? vs + kBlockN * kLd : vs;
    static_assert(kBlockM <= kBlockN, "the Q tile is staged in the V buffer");

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;  // mma fragment row group and column pair
    // Block x = (query tile counted from the last) * batch * heads + b * heads + h.
    const int tiles_m = (p.seq_q + kBlockM - 1) / kBlockM;
    const int bh = static_cast<int>(blockIdx.x % (p.batch * p.heads));
    const int m0 = (tiles_m - 1 - static_cast<int>(blockIdx.x / (p.batch * p.heads))) * kBlockM;
    const int h = bh % p.heads, b = bh / p.heads;
    const int hk = h / (p.heads / p.kv_heads);
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    const T* qb = q + (static_cast<long>(b) * p.seq_q + m0) * q_stride + static_cast<long>(h) * D;
    const T* kb = k + static_cast<long>(b) * p.seq_kv * kv_stride + static_cast<long>(hk) * D;
    const T* vb = v + static_cast<long>(b) * p.seq_kv * kv_stride + static_cast<long>(hk) * D;
    // Keys j <= i + offset are visible to query i (causal, bottom-right aligned).
    const int offset = p.seq_kv - p.seq_q;
    int kv_end = p.seq_kv;
    if (p.causal) kv_end = max(0, min(p.seq_kv, min(m0 + kBlockM, p.seq_q) + offset));
    // With a sliding window of w keys, query i sees keys j >= i + offset + 1 - w: the
    // block starts at the tile of its first query's first key.
    const int kv_start = p.window > 0 ? max(0, m0 + offset + 1 - p.window) : 0;
    const int t_begin = min(kv_start, kv_end) / kBlockN;
    const int tiles_n = (kv_end + kBlockN - 1) / kBlockN;

    load_tile<T, D, kBlockM>(qs, kLd, qb, q_stride, min(kBlockM, p.seq_q - m0));
    cp_async_commit();
    if (t_begin < tiles_n) {
        const int n0 = t_begin * kBlockN;
        load_tile<T, D, kBlockN>(ks, kLd, kb + n0 * kv_stride, kv_stride,
                                 min(kBlockN, p.seq_kv - n0));
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    // Q fragments of this warp's 16 rows: one A fragment per 16 columns of d, in
    // registers (the V buffer is then free) or read from Q's tile at each k-step.
    const T* q_frag = qs + (warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * kLd + (lane / 16) * 8;
    unsigned qf[kQShared ? 1 : D / 16][4];
    if constexpr (!kQShared) {
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) kpt::ldsm_x4(qf[kc], q_frag + kc * 16);
        __syncthreads();
    }

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    const float scale2 = p.scale * kLog2e;
    // The two query rows of this thread's accumulators.
    const int qi0 = m0 + warp * 16 + g, qi1 = qi0 + 8;

    for (int t = t_begin; t < tiles_n; ++t) {
        const int n0 = t * kBlockN;
        const int nk = min(kBlockN, p.seq_kv - n0);
        load_tile<T, D, kBlockN>(vs, kLd, vb + n0 * kv_stride, kv_stride, nk);
        cp_async_commit();
        cp_async_wait<1>();  // K(t) has landed
        __syncthreads();

        // S = Q K^T for 16 rows x 64 keys: 8 n-tiles of 8 keys.
        float s[kBlockN / 8][4];
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            unsigned a[4];
            if constexpr (kQShared) {
                kpt::ldsm_x4(a, q_frag + kc * 16);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = qf[kc][i];
            }
#pragma unroll
            for (int jp = 0; jp < kBlockN / 16; ++jp) {
                unsigned bf[4];
                const int key = jp * 16 + (lane % 8) + (lane / 16) * 8;
                const int col = kc * 16 + ((lane / 8) % 2) * 8;
                kpt::ldsm_x4(bf, ks + key * kLd + col);
                mma<T>(s[2 * jp], a, bf[0], bf[1]);
                mma<T>(s[2 * jp + 1], a, bf[2], bf[3]);
            }
        }
        __syncthreads();  // every warp is done with K(t)
        if (t + 1 < tiles_n) {
            const int n1 = n0 + kBlockN;
            load_tile<T, D, kBlockN>(ks, kLd, kb + n1 * kv_stride, kv_stride,
                                     min(kBlockN, p.seq_kv - n1));
        }
        cp_async_commit();

        // Scale into the log2 domain, then mask where this tile needs it.
        // The last query of the block has the latest window start.
        const bool edge = nk < kBlockN || mask != nullptr ||
                          (p.causal && n0 + kBlockN - 1 > m0 + offset) ||
                          (p.window > 0 && n0 < m0 + kBlockM - 1 + offset + 1 - p.window);
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[j][e] * scale2;
                if (edge) {
                    const int key = n0 + j * 8 + tig * 2 + (e & 1);
                    const int qi = e < 2 ? qi0 : qi1;
                    bool visible = key < p.seq_kv && qi < p.seq_q;
                    if (p.causal) visible = visible && key <= qi + offset;
                    if (p.window > 0) visible = visible && key >= qi + offset + 1 - p.window;
                    if (visible && mask) x += mask[static_cast<long>(qi) * p.seq_kv + key] * kLog2e;
                    x = visible ? x : -INFINITY;
                }
                s[j][e] = x;
            }
        }
        // Online softmax for the two rows (r = 0: elements 0, 1; r = 1: elements 2, 3).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m_run[r];
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // With nothing visible yet, exponents of -inf must give 0, not NaN.
            const float base = mx == -INFINITY ? 0.0f : mx;
            const float alpha = exp2f(m_run[r] - base);
            m_run[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
                s[j][2 * r] = exp2f(s[j][2 * r] - base);
                s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - base);
                sum += s[j][2 * r] + s[j][2 * r + 1];
            }
            l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o[i][2 * r] *= alpha;
                o[i][2 * r + 1] *= alpha;
            }
        }
        // Dropout (after the sums, which are the softmax's): P V takes P Z.
        static_assert(kBlockN == 64, "one keep word per key tile");
        if (p.dropout_threshold != 0) kpt::apply_dropout8(s, p, b, h, qi0, n0, tig);

        cp_async_wait<1>();  // V(t) has landed (K(t+1) may still be in flight)
        __syncthreads();
        // O += P V: P's accumulators of n-tiles 2kc and 2kc + 1 are the A fragment of
        // k-step kc.
#pragma unroll
        for (int kc = 0; kc < kBlockN / 16; ++kc) {
            const unsigned pa[4] = {
                pack2<T>(s[2 * kc][0], s[2 * kc][1]),
                pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3]),
            };
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned bf[4];
                const int key = kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                const int col = dp * 16 + (lane / 16) * 8;
                kpt::ldsm_x4_t(bf, vs + key * kLd + col);
                mma<T>(o[2 * dp], pa, bf[0], bf[1]);
                mma<T>(o[2 * dp + 1], pa, bf[2], bf[3]);
            }
        }
        __syncthreads();  // every warp is done with V(t)
    }
    cp_async_wait<0>();

    // Normalize and store: the quad of lanes of a row holds its partial sums.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int qi = r == 0 ? qi0 : qi1;
        if (qi >= p.seq_q) continue;
        if (lse != nullptr && tig == 0) {
            // m_run and the scores are in the log2 domain: ln = (max + log2 sum) ln 2.
            lse[(static_cast<long>(b) * p.heads + h) * p.seq_q + qi] =
                l > 0.0f && m_run[r] != -INFINITY ? (m_run[r] + log2f(l)) * kLn2 : INFINITY;
        }
        T* orow = out + (static_cast<long>(b) * p.seq_q + qi) * q_stride + static_cast<long>(h) * D;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            const unsigned w = pack2<T>(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
            *reinterpret_cast<unsigned*>(orow + i * 8 + tig * 2) = w;
        }
    }
}

}  // namespace

#define KPT_FLASH(NAME, T, D)                                                              \
    extern "C" __global__ void __launch_bounds__(kThreads) kpt_flash_attention_##NAME##_d##D( \
        const T* q, const T* k, const T* v, const float* mask, T* out, float* lse,         \
        const Dims p) {                                                                    \
        kpt::dependent_launch_prologue();                                                  \
        flash<T, D>(q, k, v, mask, out, lse, p);                                           \
    }

KPT_FLASH(bf16, __nv_bfloat16, 64)
KPT_FLASH(bf16, __nv_bfloat16, 128)
KPT_FLASH(f16, __half, 64)
KPT_FLASH(f16, __half, 128)
KPT_FLASH(bf16, __nv_bfloat16, 192)
KPT_FLASH(bf16, __nv_bfloat16, 256)
KPT_FLASH(f16, __half, 192)
KPT_FLASH(f16, __half, 256)
