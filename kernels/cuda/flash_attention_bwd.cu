// FlashAttention-2 style attention backward on tensor cores (mma.sync m16n8k16, sm_80 and
// newer) for bf16 and f16 with head dim 64, 128, 192 or 256: the gradients dq, dk, dv of
// flash_attention.cu's forward (GQA, additive [seq_q, seq_kv] f32 mask, bottom-right
// causal; q, out, dout and dq [batch, seq_q, heads * d], k, v, dk and dv
// [batch, seq_kv, kv_heads * d], sliding window: both launches walk only the tiles inside
// it and mask per element where a tile crosses a row's window start, as the Hopper wgmma
// launches of flash_attention_sm90.cu do).
//
// The op passes no log-sum-exp, and two launches need no atomics:
// 1. kpt_flash_attention_bwd_dq_*: one block of 4 warps per (64 query rows, head, batch),
//    each warp owning 16 rows, walks the visible key tiles like the forward (K and V
//    double-buffered by cp.async, the next tile loading during this one) and computes
//    S = Q K^T and dP = dO V^T per tile with an online softmax in the log2 domain. With
//    D = rowsum(dout o out) (computed first, from out and dout), the unnormalized
//    dS~ = exp2(s - running max) (dP - D) is added into dq's accumulator as dS~ K and
//    rescaled like the forward's O when the max grows, so at the end
//    dq = scale * acc / sum is exact without a separate log-sum-exp pass. The block also
//    writes each row's lse2 = max + log2(sum) and D (f32 [batch * heads, seq_pad],
//    seq_pad = seq_q rounded up to 64; +inf and 0 for rows that see no key or lie past
//    seq_q, so that their recomputed probabilities, and gradients, are 0).
//    kpt_flash_attention_bwd_dq_lse_*: the same launch when the forward's log-sum-exp is
//    given (natural log, f32 [batch, heads, seq_q], +inf for rows that see no key, as
//    flash_attention.cu and flash_attention_sm90.cu write it): each row's lse2 = lse log2e
//    is known up front, so there is no online softmax: P = exp2(s - lse2) directly,
//    dS = P (dP - D) goes into dq's accumulator with no rescaling, and dq = scale * acc.
//    It still writes lse2 and D for launch 2.
// 2. kpt_flash_attention_bwd_dkdv_*: one block of 4 warps per (64 keys, kv head, batch);
//    warp w owns keys 16w..16w+15. K and V stay in shared memory; the block walks every
//    query head of its kv group and every query tile of 64 that sees its keys (causal
//    blocks start at the first such tile), with Q, dO, lse2 and D double-buffered:
//      S^T = K Q^T, P^T = exp2(S^T scale log2e (+ mask log2e) - lse2)   (16 x 64 / warp)
//      dP^T = V dO^T, dV += P^T dO, dS^T = P^T o (dP^T - D), dK += dS^T Q
//    in registers (accumulators of two n-tiles re-packed as A fragments, as the forward
//    does with P); dK and dV accumulate over the whole walk, so the heads of a GQA group
//    add up without atomics; dk = scale dK and dv are stored at the end.
// With dropout (Dims::dropout_threshold > 0, see attention_dims.cuh) both launches
// recompute the forward's decisions: dP becomes Z dP (dS = P (Z dP - D), D from the
// forward's output, which holds the dropout) and dV takes P Z.
// Head dims 192 and 256 (kSlices = 2): an accumulator of 16 rows x d a warp would not fit
// the registers next to S and dP, so each block takes half of the head dim's columns of dq
// (or dk and dv): blocks x and x + half_blocks (the blocks of one half) compute the same S
// and dP over the whole head dim, each accumulating its half. That recomputes S and dP
// once more (1.5x the matrix work of the dk / dv launch, 1.7x of dq's) instead of sending
// the gradients to the host. At 256 the K / V (launch 1) and Q / dO (launch 2) tiles are
// single-buffered (kBuffers = 1), so that the shared memory fits an A100's 164 KiB.
// Shared rows are padded by 16 bytes so that the eight rows an ldmatrix reads fall in
// distinct banks. Causal query tiles of launch 1 are scheduled last-first, key tiles of
// launch 2 first-first: the blocks with the most work start first.
//
// kpt:launch kpt_flash_attention_bwd_dq_bf16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_bf16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_f16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_f16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_bf16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_bf16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_f16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_f16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_bf16_d64 block=128 shared=56320 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_bf16_d128 block=128 shared=105472 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_f16_d64 block=128 shared=56320 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_f16_d128 block=128 shared=105472 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_bf16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_bf16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_f16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_f16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_bf16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_bf16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_f16_d64 block=128 shared=55552 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_f16_d128 block=128 shared=104704 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_bf16_d64 block=128 shared=56320 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_bf16_d128 block=128 shared=105472 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_f16_d64 block=128 shared=56320 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_f16_d128 block=128 shared=105472 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_bf16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_bf16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_bf16_d192 block=128 shared=154624 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_f16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_f16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_f16_d192 block=128 shared=154624 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_bf16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_bf16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_bf16_d256 block=128 shared=135680 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_f16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_f16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_f16_d256 block=128 shared=135680 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_bf16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_bf16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_bf16_d192 block=128 shared=154624 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_f16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_f16_d192 block=128 shared=153856 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_f16_d192 block=128 shared=154624 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_bf16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_bf16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_bf16_d256 block=128 shared=135680 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_window_f16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dq_lse_window_f16_d256 block=128 shared=135424 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_dkdv_window_f16_d256 block=128 shared=135680 grid=key_tiles

#include <type_traits>

#include "attention_dims.cuh"
#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // keys per tile (16 per warp in the main kernel)
constexpr float kLog2e = 1.4426950408889634f;

using Dims = kpt::AttentionDims;

using kpt::cp_async_commit;
using kpt::cp_async_wait;
using kpt::mma;
using kpt::pack2;

// Head-dim halves a block accumulates (see the top), and the buffers of the streamed tiles.
template <int D>
constexpr int kSlices = D > 128 ? 2 : 1;
template <int D>
constexpr int kBuffers = D > 192 ? 1 : 2;

// Tiles of kThreads threads.
template <typename T, int D, int kRows>
__device__ __forceinline__ void load_tile(T* tile, int ld, const T* src, long stride,
                                          int rows) {
    kpt::load_tile<T, D, kRows, kThreads>(tile, ld, src, stride, rows);
}

// seq_q rounded up to whole query tiles: the row length of the lse2 and D buffers.
__device__ __forceinline__ int seq_pad(const Dims& p) {
    return (p.seq_q + kBlockM - 1) / kBlockM * kBlockM;
}

// ---------------------------------------------------------------------------------------
// 1. dq, lse2 and D per query tile.

template <typename T, int D>
struct SmemQ {
    static constexpr int kLd = D + 8;  // padded rows
    static constexpr int kTile = kBlockN * kLd;
    // Q (staging), dO, K and V (kBuffers each); D of the tile's rows.
    static constexpr int kBytes = (2 + 2 * kBuffers<D>) * kTile * static_cast<int>(sizeof(T)) +
                                  kBlockM * static_cast<int>(sizeof(float));
};
static_assert(SmemQ<__nv_bfloat16, 64>::kBytes == 55552, "keep the kpt:launch shared= values in step");
static_assert(SmemQ<__nv_bfloat16, 128>::kBytes == 104704, "keep the kpt:launch shared= values in step");
static_assert(SmemQ<__half, 64>::kBytes == 55552, "keep the kpt:launch shared= values in step");
static_assert(SmemQ<__half, 128>::kBytes == 104704, "keep the kpt:launch shared= values in step");
static_assert(SmemQ<__half, 192>::kBytes == 153856, "keep the kpt:launch shared= values in step");
static_assert(SmemQ<__half, 256>::kBytes == 135424, "keep the kpt:launch shared= values in step");
static_assert(kBlockM == kBlockN, "Q and dO tiles use the K tile's size");

// kGivenLse: lse_in holds the forward's log-sum-exp (see the top of the file); otherwise
// it is unused and the row statistics come from an online softmax.
template <typename T, int D, bool kGivenLse, bool kWindow = false>
__device__ void dq_pass(const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, const float* __restrict__ mask,
                        const T* __restrict__ out, const T* __restrict__ dout,
                        const float* __restrict__ lse_in, T* __restrict__ dq,
                        float* __restrict__ lse, float* __restrict__ delta, const Dims p) {
    using S = SmemQ<T, D>;
    constexpr int kLd = S::kLd;
    constexpr int kBufs = kBuffers<D>, DA = D / kSlices<D>;  // DA: dq's columns here
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* qs = reinterpret_cast<T*>(smem_raw);
    T* dos = qs + S::kTile;
    T* kbuf = dos + S::kTile;          // [kBufs] K tiles
    T* vbuf = kbuf + kBufs * S::kTile;  // [kBufs] V tiles
    float* dsm = reinterpret_cast<float*>(vbuf + kBufs * S::kTile);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    // Block x = (query tile counted from the last) * batch * heads + b * heads + h, plus
    // the head-dim half times the blocks of one half.
    const int tiles_m = (p.seq_q + kBlockM - 1) / kBlockM;
    const unsigned half_blocks = static_cast<unsigned>(tiles_m * p.batch * p.heads);
    const unsigned bx = DA < D ? blockIdx.x % half_blocks : blockIdx.x;
    const int d0 = DA < D ? static_cast<int>(blockIdx.x / half_blocks) * DA : 0;
    const int bh = static_cast<int>(bx % (p.batch * p.heads));
    const int m0 = (tiles_m - 1 - static_cast<int>(bx / (p.batch * p.heads))) * kBlockM;
    const int h = bh % p.heads, b = bh / p.heads;
    const int hk = h / (p.heads / p.kv_heads);
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    const long q_at = (static_cast<long>(b) * p.seq_q + m0) * q_stride + static_cast<long>(h) * D;
    const T* kb = k + static_cast<long>(b) * p.seq_kv * kv_stride + static_cast<long>(hk) * D;
    const T* vb = v + static_cast<long>(b) * p.seq_kv * kv_stride + static_cast<long>(hk) * D;
    const int rows = min(kBlockM, p.seq_q - m0);
    const int offset = p.seq_kv - p.seq_q;
    int kv_end = p.seq_kv;
    if (p.causal) kv_end = max(0, min(p.seq_kv, m0 + rows + offset));
    // A sliding window of w keys: query i sees keys j >= i + offset + 1 - w, so the tile's
    // keys start at its first query's first one.
    const int kv_start = kWindow ? max(0, m0 + offset + 1 - p.window) : 0;
    const int n_first = kWindow ? min(kv_start, kv_end) / kBlockN * kBlockN : 0;
    const int tiles_n = (kv_end - n_first + kBlockN - 1) / kBlockN;
    const long row_at = static_cast<long>(bh) * seq_pad(p) + m0;  // lse2 and D

    load_tile<T, D, kBlockM>(qs, kLd, q + q_at, q_stride, rows);
    load_tile<T, D, kBlockM>(dos, kLd, dout + q_at, q_stride, rows);
    if (tiles_n > 0) {
        const int nk = min(kBlockN, p.seq_kv - n_first);
        load_tile<T, D, kBlockN>(kbuf, kLd, kb + n_first * kv_stride, kv_stride, nk);
        load_tile<T, D, kBlockN>(vbuf, kLd, vb + n_first * kv_stride, kv_stride, nk);
    }
    cp_async_commit();

    // D = rowsum(dout o out): two threads per row, D / 2 elements each; 0 past seq_q.
    {
        constexpr int N = kpt::Vec<T>::N;
        const int r = threadIdx.x / 2, half = threadIdx.x % 2;
        float acc = 0.0f;
        if (r < rows) {
            const long at = q_at + r * q_stride + half * (D / 2);
#pragma unroll
            for (int c = 0; c < D / 2; c += N) {
                float a[N], o[N];
                kpt::load_vec(dout + at + c, a);
                kpt::load_vec(out + at + c, o);
#pragma unroll
                for (int e = 0; e < N; ++e) acc += a[e] * o[e];
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        if (half == 0) {
            dsm[r] = acc;
            if (d0 == 0) delta[row_at + r] = acc;
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // A fragments of this warp's 16 rows: Q in registers, dO reloaded per tile.
    const int a_row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int a_col = (lane / 16) * 8;
    unsigned qf[D / 16][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) kpt::ldsm_x4(qf[kc], qs + a_row * kLd + kc * 16 + a_col);
    const float dr[2] = {dsm[warp * 16 + g], dsm[warp * 16 + g + 8]};

    float acc[DA / 8][4];  // dq's columns d0 ..
#pragma unroll
    for (int i = 0; i < DA / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    const float scale2 = p.scale * kLog2e;
    const int qi0 = m0 + warp * 16 + g, qi1 = qi0 + 8;
    // With the forward's log-sum-exp: lse2 of the two rows (+inf past seq_q and for
    // anything but a finite value, so that those rows' probabilities are 0).
    float lse2[2] = {INFINITY, INFINITY};
    if constexpr (kGivenLse) {
        const long at = static_cast<long>(bh) * p.seq_q;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int qi = r == 0 ? qi0 : qi1;
            const float x = qi < p.seq_q ? lse_in[at + qi] : INFINITY;
            lse2[r] = isfinite(x) ? x * kLog2e : INFINITY;
        }
    }

    // K and V of key tile n into buffer buf.
    auto load_kv = [&](int n, int buf) {
        const int nk = min(kBlockN, p.seq_kv - n);
        load_tile<T, D, kBlockN>(kbuf + buf * S::kTile, kLd, kb + n * kv_stride, kv_stride, nk);
        load_tile<T, D, kBlockN>(vbuf + buf * S::kTile, kLd, vb + n * kv_stride, kv_stride, nk);
    };
    for (int t = 0; t < tiles_n; ++t) {
        if constexpr (kBufs == 2) {
            if (t > 0) {
                cp_async_wait<0>();  // K(t) and V(t) have landed
                __syncthreads();     // and every warp is done with tile t - 1
            }
        } else if (t > 0) {
            __syncthreads();  // every warp is done with tile t - 1
            load_kv(n_first + t * kBlockN, 0);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
        }
        const int n0 = n_first + t * kBlockN;
        const int nk = min(kBlockN, p.seq_kv - n0);
        if constexpr (kBufs == 2) {
            if (t + 1 < tiles_n) load_kv(n0 + kBlockN, (t + 1) % 2);
            cp_async_commit();
        }
        const T* kt = kbuf + (t % kBufs) * S::kTile;
        const T* vt = vbuf + (t % kBufs) * S::kTile;

        // S = Q K^T and dP = dO V^T for 16 rows x 64 keys.
        float s[kBlockN / 8][4], dp[kBlockN / 8][4];
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
        }
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            unsigned of[4];
            kpt::ldsm_x4(of, dos + a_row * kLd + kc * 16 + a_col);
#pragma unroll
            for (int jp = 0; jp < kBlockN / 16; ++jp) {
                const int key = jp * 16 + (lane % 8) + (lane / 16) * 8;
                const int col = kc * 16 + ((lane / 8) % 2) * 8;
                unsigned bf[4];
                kpt::ldsm_x4(bf, kt + key * kLd + col);
                mma<T>(s[2 * jp], qf[kc], bf[0], bf[1]);
                mma<T>(s[2 * jp + 1], qf[kc], bf[2], bf[3]);
                kpt::ldsm_x4(bf, vt + key * kLd + col);
                mma<T>(dp[2 * jp], of, bf[0], bf[1]);
                mma<T>(dp[2 * jp + 1], of, bf[2], bf[3]);
            }
        }

        // The last row has the latest window start.
        const bool edge = nk < kBlockN || mask != nullptr ||
                          (p.causal && n0 + kBlockN - 1 > m0 + offset) ||
                          (kWindow && n0 < m0 + rows + offset - p.window);
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
                    if (kWindow) visible = visible && key >= qi + offset + 1 - p.window;
                    if (visible && mask) x += mask[static_cast<long>(qi) * p.seq_kv + key] * kLog2e;
                    x = visible ? x : -INFINITY;
                }
                s[j][e] = x;
            }
        }
        // Dropout: dS = P (Z dP - D), with Z the forward's factors.
        static_assert(kBlockN == 64, "one keep word per key tile");
        if (p.dropout_threshold != 0) kpt::apply_dropout8(dp, p, b, h, qi0, n0, tig);
        if constexpr (kGivenLse) {
            // dS = P (dP - D) with P = exp2(s - lse2): nothing to rescale.
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pr = exp2f(s[j][e] - lse2[e >> 1]);
                    dp[j][e] = pr * (dp[j][e] - dr[e >> 1]);
                }
            }
        }
        // Online softmax (r = 0: elements 0, 1; r = 1: elements 2, 3); the unnormalized
        // dS = exp2(s - max) (dP - D) goes into dq's accumulator, rescaled as O is in the
        // forward, and the final sum normalizes it.
#pragma unroll
        for (int r = 0; r < 2 && !kGivenLse; ++r) {
            float mx = m_run[r];
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float base = mx == -INFINITY ? 0.0f : mx;
            const float alpha = exp2f(m_run[r] - base);
            m_run[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    const float pr = exp2f(s[j][e] - base);
                    sum += pr;
                    dp[j][e] = pr * (dp[j][e] - dr[r]);
                }
            }
            l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
            for (int i = 0; i < DA / 8; ++i) {
                acc[i][2 * r] *= alpha;
                acc[i][2 * r + 1] *= alpha;
            }
        }
        // dq += dS K: dS's accumulators of n-tiles 2kc, 2kc + 1 are the A fragment of
        // k-step kc; K^T's B fragments by transposed ldmatrix.
#pragma unroll
        for (int kc = 0; kc < kBlockN / 16; ++kc) {
            const unsigned sa[4] = {
                pack2<T>(dp[2 * kc][0], dp[2 * kc][1]),
                pack2<T>(dp[2 * kc][2], dp[2 * kc][3]),
                pack2<T>(dp[2 * kc + 1][0], dp[2 * kc + 1][1]),
                pack2<T>(dp[2 * kc + 1][2], dp[2 * kc + 1][3]),
            };
#pragma unroll
            for (int dpi = 0; dpi < DA / 16; ++dpi) {
                const int key = kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                const int col = d0 + dpi * 16 + (lane / 16) * 8;
                unsigned bf[4];
                kpt::ldsm_x4_t(bf, kt + key * kLd + col);
                mma<T>(acc[2 * dpi], sa, bf[0], bf[1]);
                mma<T>(acc[2 * dpi + 1], sa, bf[2], bf[3]);
            }
        }
    }
    cp_async_wait<0>();

    // dq = scale * acc / sum; lse2 = max + log2(sum), +inf where nothing is visible and
    // past seq_q. With the given log-sum-exp, acc is already normalized.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int qi = r == 0 ? qi0 : qi1;
        float f, row_lse2;
        if constexpr (kGivenLse) {
            row_lse2 = lse2[r];
            f = p.scale;
        } else {
            float l = l_run[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const bool seen = m_run[r] != -INFINITY && l > 0.0f;
            row_lse2 = seen && qi < p.seq_q ? m_run[r] + log2f(l) : INFINITY;
            f = seen ? p.scale / l : 0.0f;
        }
        if (tig == 0 && d0 == 0) lse[row_at + qi - m0] = row_lse2;
        if (qi >= p.seq_q) continue;
        T* row = dq + q_at + static_cast<long>(qi - m0) * q_stride + d0;
#pragma unroll
        for (int i = 0; i < DA / 8; ++i) {
            *reinterpret_cast<unsigned*>(row + i * 8 + tig * 2) =
                pack2<T>(acc[i][2 * r] * f, acc[i][2 * r + 1] * f);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 2. dk and dv per key tile.

template <typename T, int D>
struct SmemKv {
    static constexpr int kLd = D + 8;  // padded rows
    static constexpr int kTile = kBlockN * kLd;
    // K, V; Q, dO, lse2 and D (kBuffers each).
    static constexpr int kBytes = (2 + 2 * kBuffers<D>) * kTile * static_cast<int>(sizeof(T)) +
                                  2 * kBuffers<D> * kBlockM * static_cast<int>(sizeof(float));
};
static_assert(SmemKv<__nv_bfloat16, 64>::kBytes == 56320, "keep the kpt:launch shared= values in step");
static_assert(SmemKv<__nv_bfloat16, 128>::kBytes == 105472, "keep the kpt:launch shared= values in step");
static_assert(SmemKv<__half, 64>::kBytes == 56320, "keep the kpt:launch shared= values in step");
static_assert(SmemKv<__half, 128>::kBytes == 105472, "keep the kpt:launch shared= values in step");
static_assert(SmemKv<__half, 192>::kBytes == 154624, "keep the kpt:launch shared= values in step");
static_assert(SmemKv<__half, 256>::kBytes == 135680, "keep the kpt:launch shared= values in step");

template <typename T, int D, bool kWindow = false>
__device__ void kv_pass(const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, const float* __restrict__ mask,
                        const T* __restrict__ dout, const float* __restrict__ lse,
                        const float* __restrict__ delta, T* __restrict__ dk,
                        T* __restrict__ dv, const Dims p) {
    using S = SmemKv<T, D>;
    constexpr int kLd = S::kLd;
    constexpr int kBufs = kBuffers<D>, DA = D / kSlices<D>;  // DA: dk's and dv's columns here
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* ks = reinterpret_cast<T*>(smem_raw);
    T* vs = ks + S::kTile;
    T* qbuf = vs + S::kTile;             // [kBufs] Q tiles
    T* dobuf = qbuf + kBufs * S::kTile;  // [kBufs] dO tiles
    float* lses = reinterpret_cast<float*>(dobuf + kBufs * S::kTile);  // [kBufs][kBlockM]
    float* dsb = lses + kBufs * kBlockM;                                // D, [kBufs][kBlockM]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int groups = p.batch * p.kv_heads;
    // Block x = key tile * groups + group, plus the head-dim half times the blocks of one.
    const unsigned half_blocks = static_cast<unsigned>((p.seq_kv + kBlockN - 1) / kBlockN * groups);
    const unsigned bx = DA < D ? blockIdx.x % half_blocks : blockIdx.x;
    const int d0 = DA < D ? static_cast<int>(blockIdx.x / half_blocks) * DA : 0;
    const int bg = static_cast<int>(bx % groups);
    const int n0 = static_cast<int>(bx / groups) * kBlockN;
    const int hk = bg % p.kv_heads, b = bg / p.kv_heads;
    const int group = p.heads / p.kv_heads;
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    const long kv_at = (static_cast<long>(b) * p.seq_kv + n0) * kv_stride + static_cast<long>(hk) * D;
    const int nk = min(kBlockN, p.seq_kv - n0);
    const int offset = p.seq_kv - p.seq_q;
    const int pad = seq_pad(p);
    // Query i sees key j iff j <= i + offset: the first query tile that sees key n0. With a
    // sliding window of w keys also iff i <= j - offset - 1 + w: m_end past the last query
    // that sees key n0 + nk - 1.
    const int m_begin = p.causal ? max(0, n0 - offset) / kBlockM * kBlockM : 0;
    const int m_end = kWindow ? max(0, min(p.seq_q, n0 + nk - 1 - offset + p.window))
                                   : p.seq_q;
    const int tiles_m = m_begin < m_end ? (m_end - m_begin + kBlockM - 1) / kBlockM : 0;
    const int iters = group * tiles_m;

    // Loads the (head, query tile) of iteration it into buffer buf: Q, dO, lse2, D (the
    // last two padded to whole tiles, so always whole 16-byte chunks).
    auto load_iter = [&](int it, int buf) {
        const int h = hk * group + it / tiles_m;
        const int m0 = m_begin + (it % tiles_m) * kBlockM;
        const int rows = min(kBlockM, p.seq_q - m0);
        const long at = (static_cast<long>(b) * p.seq_q + m0) * q_stride + static_cast<long>(h) * D;
        load_tile<T, D, kBlockM>(qbuf + buf * S::kTile, kLd, q + at, q_stride, rows);
        load_tile<T, D, kBlockM>(dobuf + buf * S::kTile, kLd, dout + at, q_stride, rows);
        const long r_at = static_cast<long>(b * p.heads + h) * pad + m0;
        const int x = threadIdx.x;
        if (x < kBlockM / 4) {
            kpt::cp_async16(lses + buf * kBlockM + 4 * x, lse + r_at + 4 * x, true);
        } else if (x < kBlockM / 2) {
            const int y = x - kBlockM / 4;
            kpt::cp_async16(dsb + buf * kBlockM + 4 * y, delta + r_at + 4 * y, true);
        }
    };

    load_tile<T, D, kBlockN>(ks, kLd, k + kv_at, kv_stride, nk);
    load_tile<T, D, kBlockN>(vs, kLd, v + kv_at, kv_stride, nk);
    if (iters > 0) load_iter(0, 0);
    cp_async_commit();

    float dka[DA / 8][4], dva[DA / 8][4];  // columns d0 ..
#pragma unroll
    for (int i = 0; i < DA / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[i][e] = dva[i][e] = 0.0f;
    }
    const float scale2 = p.scale * kLog2e;
    const int kr0 = warp * 16 + g;  // this thread's accumulator keys: kr0 and kr0 + 8
    // A-fragment addresses of this warp's 16 rows of K and V (ldmatrix, non-transposed).
    const int a_row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int a_col = (lane / 16) * 8;

    for (int it = 0; it < iters; ++it) {
        const int buf = it % kBufs;
        const int h = hk * group + it / tiles_m;  // the query head (dropout's decisions)
        const int m0 = m_begin + (it % tiles_m) * kBlockM;
        if constexpr (kBufs == 2) {
            cp_async_wait<0>();  // iteration it's tiles have landed
            __syncthreads();     // and every warp is done with iteration it - 1's buffer
            if (it + 1 < iters) load_iter(it + 1, buf ^ 1);
            cp_async_commit();
        } else {
            if (it > 0) {
                __syncthreads();  // every warp is done with iteration it - 1
                load_iter(it, 0);
                cp_async_commit();
            }
            cp_async_wait<0>();
            __syncthreads();
        }
        const T* qs = qbuf + buf * S::kTile;
        const T* dos = dobuf + buf * S::kTile;

        // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries per warp.
        float st[kBlockM / 8][4], dpt[kBlockM / 8][4];
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
        }
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            unsigned kf[4], vf[4];
            kpt::ldsm_x4(kf, ks + a_row * kLd + kc * 16 + a_col);
            kpt::ldsm_x4(vf, vs + a_row * kLd + kc * 16 + a_col);
#pragma unroll
            for (int jp = 0; jp < kBlockM / 16; ++jp) {
                const int row = jp * 16 + (lane % 8) + (lane / 16) * 8;
                const int col = kc * 16 + ((lane / 8) % 2) * 8;
                unsigned bf[4];
                kpt::ldsm_x4(bf, qs + row * kLd + col);
                mma<T>(st[2 * jp], kf, bf[0], bf[1]);
                mma<T>(st[2 * jp + 1], kf, bf[2], bf[3]);
                kpt::ldsm_x4(bf, dos + row * kLd + col);
                mma<T>(dpt[2 * jp], vf, bf[0], bf[1]);
                mma<T>(dpt[2 * jp + 1], vf, bf[2], bf[3]);
            }
        }

        // P^T = exp2(S^T scale log2e (+ mask log2e) - lse2); invisible pairs give 0, and so
        // do rows whose lse2 is +inf (nothing visible, or past seq_q).
        const bool edge = nk < kBlockN || mask != nullptr ||
                          (p.causal && n0 + kBlockN - 1 > m0 + offset) ||
                          (kWindow && n0 < m0 + kBlockM + offset - p.window);
        const float* lrow = lses + buf * kBlockM;
        const float* drow = dsb + buf * kBlockM;
        // Dropout: dV takes P Z, dS = P (Z dP - D).
        const uint32_t keep = p.dropout_threshold != 0
                                  ? kpt::dropout_keep8_t(p, b, h, n0 + warp * 16, m0, g, tig)
                                  : ~0u;
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
            const int c = j * 8 + tig * 2;  // query column within the tile (and c + 1)
            const float2 l2 = *reinterpret_cast<const float2*>(lrow + c);
            const float2 d2 = *reinterpret_cast<const float2*>(drow + c);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = st[j][e] * scale2;
                if (edge) {
                    const int key = n0 + kr0 + (e >> 1) * 8;
                    const int qi = m0 + c + (e & 1);
                    bool visible = key < p.seq_kv && qi < p.seq_q;
                    if (p.causal) visible = visible && key <= qi + offset;
                    if (kWindow) visible = visible && key >= qi + offset + 1 - p.window;
                    if (visible && mask) x += mask[static_cast<long>(qi) * p.seq_kv + key] * kLog2e;
                    x = visible ? x : -INFINITY;
                }
                const float pr = exp2f(x - ((e & 1) ? l2.y : l2.x));
                const float z = (keep >> (4 * j + e)) & 1u ? p.dropout_scale : 0.0f;
                st[j][e] = pr * z;
                dpt[j][e] = pr * (z * dpt[j][e] - ((e & 1) ? d2.y : d2.x));  // dS^T (unscaled)
            }
        }

        // dV += P^T dO and dK += dS^T Q: the accumulators of n-tiles 2kc, 2kc + 1 are the
        // A fragment of k-step kc (queries 16kc..16kc+15).
#pragma unroll
        for (int kc = 0; kc < kBlockM / 16; ++kc) {
            const unsigned pa[4] = {
                pack2<T>(st[2 * kc][0], st[2 * kc][1]),
                pack2<T>(st[2 * kc][2], st[2 * kc][3]),
                pack2<T>(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                pack2<T>(st[2 * kc + 1][2], st[2 * kc + 1][3]),
            };
            const unsigned sa[4] = {
                pack2<T>(dpt[2 * kc][0], dpt[2 * kc][1]),
                pack2<T>(dpt[2 * kc][2], dpt[2 * kc][3]),
                pack2<T>(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                pack2<T>(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3]),
            };
#pragma unroll
            for (int dpi = 0; dpi < DA / 16; ++dpi) {
                const int row = kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                const int col = d0 + dpi * 16 + (lane / 16) * 8;
                unsigned bf[4];
                kpt::ldsm_x4_t(bf, dos + row * kLd + col);
                mma<T>(dva[2 * dpi], pa, bf[0], bf[1]);
                mma<T>(dva[2 * dpi + 1], pa, bf[2], bf[3]);
                kpt::ldsm_x4_t(bf, qs + row * kLd + col);
                mma<T>(dka[2 * dpi], sa, bf[0], bf[1]);
                mma<T>(dka[2 * dpi + 1], sa, bf[2], bf[3]);
            }
        }
    }
    cp_async_wait<0>();

    // dk = scale dK, dv = dV: rows kr0 and kr0 + 8 of the tile.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = kr0 + r * 8;
        if (key >= nk) continue;
        const long at = kv_at + static_cast<long>(key) * kv_stride;
#pragma unroll
        for (int i = 0; i < DA / 8; ++i) {
            const int d = d0 + i * 8 + tig * 2;
            *reinterpret_cast<unsigned*>(dk + at + d) =
                pack2<T>(dka[i][2 * r] * p.scale, dka[i][2 * r + 1] * p.scale);
            *reinterpret_cast<unsigned*>(dv + at + d) = pack2<T>(dva[i][2 * r], dva[i][2 * r + 1]);
        }
    }
}

}  // namespace

#define KPT_FLASH_BWD(NAME, T, D, TAG, WINDOW)                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads) kpt_flash_attention_bwd_dq_##TAG##NAME##_d##D( \
        const T* q, const T* k, const T* v, const float* mask, const T* out, const T* dout,     \
        T* dq, float* lse, float* delta, const Dims p) {                                        \
        kpt::dependent_launch_prologue();                                                       \
        dq_pass<T, D, false, WINDOW>(q, k, v, mask, out, dout, nullptr, dq, lse, delta, p);     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(kThreads)                                      \
        kpt_flash_attention_bwd_dq_lse_##TAG##NAME##_d##D(                                      \
            const T* q, const T* k, const T* v, const float* mask, const T* out,                \
            const T* dout, const float* lse_in, T* dq, float* lse, float* delta,                \
            const Dims p) {                                                                     \
        kpt::dependent_launch_prologue();                                                       \
        dq_pass<T, D, true, WINDOW>(q, k, v, mask, out, dout, lse_in, dq, lse, delta, p);       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(kThreads)                                      \
        kpt_flash_attention_bwd_dkdv_##TAG##NAME##_d##D(const T* q, const T* k, const T* v,     \
                                                   const float* mask, const T* dout,            \
                                                   const float* lse, const float* delta,        \
                                                   T* dk, T* dv, const Dims p) {                \
        kpt::dependent_launch_prologue();                                                       \
        kv_pass<T, D, WINDOW>(q, k, v, mask, dout, lse, delta, dk, dv, p);                      \
    }

KPT_FLASH_BWD(bf16, __nv_bfloat16, 64, , false)
KPT_FLASH_BWD(bf16, __nv_bfloat16, 128, , false)
KPT_FLASH_BWD(f16, __half, 64, , false)
KPT_FLASH_BWD(f16, __half, 128, , false)
KPT_FLASH_BWD(bf16, __nv_bfloat16, 192, , false)
KPT_FLASH_BWD(bf16, __nv_bfloat16, 256, , false)
KPT_FLASH_BWD(f16, __half, 192, , false)
KPT_FLASH_BWD(f16, __half, 256, , false)
// Under a sliding window (Dims::window; kWindow): separate code, so that the entries above
// keep theirs.
KPT_FLASH_BWD(bf16, __nv_bfloat16, 64, window_, true)
KPT_FLASH_BWD(bf16, __nv_bfloat16, 128, window_, true)
KPT_FLASH_BWD(f16, __half, 64, window_, true)
KPT_FLASH_BWD(f16, __half, 128, window_, true)
KPT_FLASH_BWD(bf16, __nv_bfloat16, 192, window_, true)
KPT_FLASH_BWD(bf16, __nv_bfloat16, 256, window_, true)
KPT_FLASH_BWD(f16, __half, 192, window_, true)
KPT_FLASH_BWD(f16, __half, 256, window_, true)
