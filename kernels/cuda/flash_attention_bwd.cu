// FlashAttention-2 style attention backward on tensor cores (mma.sync m16n8k16, sm_80 and
// newer) for bf16 and f16 with head dim 64 or 128: the gradients dq, dk, dv of
// flash_attention.cu's forward (GQA, additive [seq_q, seq_kv] f32 mask, bottom-right
// causal; q, out, dout and dq [batch, seq_q, heads * d], k, v, dk and dv
// [batch, seq_kv, kv_heads * d]). No sliding window (the host declines it).
//
// The op passes no log-sum-exp, so three launches:
// 1. kpt_flash_attention_bwd_prep_*: per (64 query rows, head, batch) a pass over the
//    visible keys like the forward's, computing S = Q K^T only, keeps each row's running
//    max and sum in the log2 domain and writes lse2 = max + log2(sum) (+inf for a row
//    that sees no key, so that its recomputed probabilities are all 0), and
//    D = rowsum(dout o out) (0 for such rows). Both are f32 [batch * heads, seq_pad] with
//    seq_pad = seq_q rounded up to 64; padding rows hold +inf and 0.
// 2. kpt_flash_attention_bwd_*: one block of 4 warps per (64 keys, kv head, batch); warp
//    w owns keys 16w..16w+15. K and V stay in shared memory; the block walks every query
//    head of its kv group and every query tile of 64 that sees its keys (causal blocks
//    start at the first such tile). Per query tile, with Q, dO, lse2 and D in shared
//    memory (cp.async, the next tile's loads overlapping the end of this one):
//      S^T = K Q^T, P^T = exp2(S^T scale log2e (+ mask log2e) - lse2)   (16 x 64 / warp)
//      dP^T = V dO^T, dV += P^T dO, dS^T = P^T o (dP^T - D), dK += dS^T Q
//    all in registers (accumulator layouts of two n-tiles re-packed as A fragments, as
//    the forward does with P), dK and dV summed over the whole loop (so the heads of a
//    GQA group add up without atomics). dS^T also goes to shared memory, and
//    dQ = dS K for the tile (warp w: query rows 16w..16w+15) is added to an f32 scratch
//    copy of dq with atomicAdd (FlashAttention-2's dQ accumulation). dk = scale dK and dv
//    are stored at the end. Shared rows are padded by 16 bytes so that the eight rows an
//    ldmatrix reads fall in distinct banks. Blocks are ordered key tile major, tile 0
//    first, which has the most query tiles under a causal mask.
// 3. kpt_flash_attention_bwd_dq_*: dq = scale * the f32 scratch, converted.
//
// kpt:launch kpt_flash_attention_bwd_prep_bf16_d64 block=128 shared=0 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_prep_bf16_d128 block=128 shared=0 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_prep_f16_d64 block=128 shared=0 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_prep_f16_d128 block=128 shared=0 grid=query_tiles
// kpt:launch kpt_flash_attention_bwd_bf16_d64 block=128 shared=47104 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_bf16_d128 block=128 shared=79872 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_f16_d64 block=128 shared=47104 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_f16_d128 block=128 shared=79872 grid=key_tiles
// kpt:launch kpt_flash_attention_bwd_dq_bf16 block=256 shared=0 grid=elements
// kpt:launch kpt_flash_attention_bwd_dq_f16 block=256 shared=0 grid=elements

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

// 16 bytes global -> shared; zero-filled when !valid (rows past the end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    kpt::cp_async16(kpt::smem_u32(dst), src, valid ? 16 : 0);
}
__device__ __forceinline__ void ldsm(unsigned (&r)[4], const void* p) {
    kpt::ldsm_x4(r, kpt::smem_u32(p));
}
__device__ __forceinline__ void ldsm_t(unsigned (&r)[4], const void* p) {
    kpt::ldsm_x4_t(r, kpt::smem_u32(p));
}

// Copies `rows` rows (from `src`, `stride` elements apart) of D elements into a tile of
// kRows rows with `ld` elements per row; rows past `rows` are zeros.
template <typename T, int D, int kRows>
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

// seq_q rounded up to whole query tiles: the row length of the lse2 and D buffers.
__device__ __forceinline__ int seq_pad(const Dims& p) {
    return (p.seq_q + kBlockM - 1) / kBlockM * kBlockM;
}

// ---------------------------------------------------------------------------------------
// 1. Per-row lse2 and D.

template <typename T, int D>
__device__ void prep(const T* __restrict__ q, const T* __restrict__ k,
                     const float* __restrict__ mask, const T* __restrict__ out,
                     const T* __restrict__ dout, float* __restrict__ lse,
                     float* __restrict__ delta, const Dims p) {
    constexpr int kLd = D + 8;
    __shared__ __align__(16) T ks[2][kBlockN * kLd];  // K tiles; ks[1] first holds Q

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int bh = static_cast<int>(blockIdx.x % (p.batch * p.heads));
    const int m0 = static_cast<int>(blockIdx.x / (p.batch * p.heads)) * kBlockM;
    const int h = bh % p.heads, b = bh / p.heads;
    const int hk = h / (p.heads / p.kv_heads);
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    const long q_at = (static_cast<long>(b) * p.seq_q + m0) * q_stride + static_cast<long>(h) * D;
    const T* kb = k + static_cast<long>(b) * p.seq_kv * kv_stride + static_cast<long>(hk) * D;
    const int rows = min(kBlockM, p.seq_q - m0);
    const int offset = p.seq_kv - p.seq_q;
    int kv_end = p.seq_kv;
    if (p.causal) kv_end = max(0, min(p.seq_kv, m0 + rows + offset));
    const int tiles_n = (kv_end + kBlockN - 1) / kBlockN;

    static_assert(kBlockM <= kBlockN, "the Q tile is staged in a K buffer");
    load_tile<T, D, kBlockM>(ks[1], kLd, q + q_at, q_stride, rows);
    cp_async_commit();
    if (tiles_n > 0) {
        load_tile<T, D, kBlockN>(ks[0], kLd, kb, kv_stride, min(kBlockN, p.seq_kv));
    }
    cp_async_commit();

    // D = rowsum(dout o out): two threads per row, D / 2 elements each.
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
        if (half == 0) delta[static_cast<long>(bh) * seq_pad(p) + m0 + r] = acc;
    }

    cp_async_wait<1>();
    __syncthreads();
    unsigned qf[D / 16][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const int row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int col = kc * 16 + (lane / 16) * 8;
        ldsm(qf[kc], ks[1] + row * kLd + col);
    }
    __syncthreads();  // ks[1] is free

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    const float scale2 = p.scale * kLog2e;
    const int qi0 = m0 + warp * 16 + g, qi1 = qi0 + 8;

    for (int t = 0; t < tiles_n; ++t) {
        const int n0 = t * kBlockN;
        const int nk = min(kBlockN, p.seq_kv - n0);
        const T* kt = ks[t % 2];
        if (t + 1 < tiles_n) {
            const int n1 = n0 + kBlockN;
            load_tile<T, D, kBlockN>(ks[(t + 1) % 2], kLd, kb + n1 * kv_stride, kv_stride,
                                     min(kBlockN, p.seq_kv - n1));
        }
        cp_async_commit();
        cp_async_wait<1>();  // K(t) has landed
        __syncthreads();

        float s[kBlockN / 8][4];
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
            for (int jp = 0; jp < kBlockN / 16; ++jp) {
                unsigned bf[4];
                const int key = jp * 16 + (lane % 8) + (lane / 16) * 8;
                const int col = kc * 16 + ((lane / 8) % 2) * 8;
                ldsm(bf, kt + key * kLd + col);
                mma<T>(s[2 * jp], qf[kc], bf[0], bf[1]);
                mma<T>(s[2 * jp + 1], qf[kc], bf[2], bf[3]);
            }
        }
        __syncthreads();  // every warp is done with K(t) before K(t + 2) overwrites it

        const bool edge = nk < kBlockN || mask != nullptr ||
                          (p.causal && n0 + kBlockN - 1 > m0 + offset);
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
                    if (visible && mask) x += mask[static_cast<long>(qi) * p.seq_kv + key] * kLog2e;
                    x = visible ? x : -INFINITY;
                }
                s[j][e] = x;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m_run[r];
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float base = mx == -INFINITY ? 0.0f : mx;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
                sum += exp2f(s[j][2 * r] - base) + exp2f(s[j][2 * r + 1] - base);
            }
            l_run[r] = l_run[r] * exp2f(m_run[r] - base) + sum;
            m_run[r] = mx;
        }
    }
    cp_async_wait<0>();

    // lse2 of the two rows; +inf where nothing is visible (and for padding rows).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float v = (m_run[r] == -INFINITY || !(l > 0.0f)) ? INFINITY : m_run[r] + log2f(l);
        if (tig == 0) lse[static_cast<long>(bh) * seq_pad(p) + (r == 0 ? qi0 : qi1)] = v;
    }
}

// ---------------------------------------------------------------------------------------
// 2. dK, dV per key tile; dQ by atomics.

template <typename T, int D>
struct Smem {
    static constexpr int kLd = D + 8;        // K, V, Q, dO rows
    static constexpr int kLdS = kBlockM + 8;  // dS^T rows (one per key)
    static constexpr int kTile = kBlockN * kLd;
    static constexpr int kBytes = (4 * kTile + kBlockN * kLdS) * static_cast<int>(sizeof(T)) +
                                  4 * kBlockM * static_cast<int>(sizeof(float));
};
static_assert(Smem<__nv_bfloat16, 64>::kBytes == 47104, "keep the kpt:launch shared= values in step");
static_assert(Smem<__nv_bfloat16, 128>::kBytes == 79872, "keep the kpt:launch shared= values in step");
static_assert(Smem<__half, 64>::kBytes == 47104, "keep the kpt:launch shared= values in step");
static_assert(Smem<__half, 128>::kBytes == 79872, "keep the kpt:launch shared= values in step");
static_assert(kBlockM == kBlockN, "Q and dO tiles use the K tile's size");

template <typename T, int D>
__device__ void bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const float* __restrict__ mask, const T* __restrict__ dout,
                    const float* __restrict__ lse, const float* __restrict__ delta,
                    float* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv,
                    const Dims p) {
    using S = Smem<T, D>;
    constexpr int kLd = S::kLd, kLdS = S::kLdS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* ks = reinterpret_cast<T*>(smem_raw);
    T* vs = ks + S::kTile;
    T* qs = vs + S::kTile;
    T* dos = qs + S::kTile;
    T* dss = dos + S::kTile;                                        // dS^T [key][query]
    float* lses = reinterpret_cast<float*>(dss + kBlockN * kLdS);  // [2][kBlockM]
    float* ds_ = lses + 2 * kBlockM;                                // D, [2][kBlockM]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;
    const int groups = p.batch * p.kv_heads;
    const int bg = static_cast<int>(blockIdx.x % groups);
    const int n0 = static_cast<int>(blockIdx.x / groups) * kBlockN;
    const int hk = bg % p.kv_heads, b = bg / p.kv_heads;
    const int group = p.heads / p.kv_heads;
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    const long kv_at = (static_cast<long>(b) * p.seq_kv + n0) * kv_stride + static_cast<long>(hk) * D;
    const int nk = min(kBlockN, p.seq_kv - n0);
    const int offset = p.seq_kv - p.seq_q;
    const int pad = seq_pad(p);
    // Query i sees key j iff j <= i + offset: the first query tile that sees key n0.
    const int m_begin = p.causal ? max(0, n0 - offset) / kBlockM * kBlockM : 0;
    const int tiles_m = m_begin < p.seq_q ? (p.seq_q - m_begin + kBlockM - 1) / kBlockM : 0;
    const int iters = group * tiles_m;

    // The (head, query tile) of iteration it.
    auto tile_of = [&](int it, int& h, int& m0) {
        h = hk * group + it / tiles_m;
        m0 = m_begin + (it % tiles_m) * kBlockM;
    };
    auto q_at = [&](int h, int m0) {
        return (static_cast<long>(b) * p.seq_q + m0) * q_stride + static_cast<long>(h) * D;
    };
    // lse2 and D of a query tile (padded rows, so always whole 16-byte chunks).
    auto load_rows = [&](int h, int m0, int buf) {
        const long at = static_cast<long>(b * p.heads + h) * pad + m0;
        const int x = threadIdx.x;
        if (x < kBlockM / 4) {
            cp_async16(lses + buf * kBlockM + 4 * x, lse + at + 4 * x, true);
        } else if (x < kBlockM / 2) {
            const int y = x - kBlockM / 4;
            cp_async16(ds_ + buf * kBlockM + 4 * y, delta + at + 4 * y, true);
        }
    };

    load_tile<T, D, kBlockN>(ks, kLd, k + kv_at, kv_stride, nk);
    load_tile<T, D, kBlockN>(vs, kLd, v + kv_at, kv_stride, nk);
    if (iters > 0) {
        int h, m0;
        tile_of(0, h, m0);
        const int rows = min(kBlockM, p.seq_q - m0);
        load_tile<T, D, kBlockM>(qs, kLd, q + q_at(h, m0), q_stride, rows);
        load_tile<T, D, kBlockM>(dos, kLd, dout + q_at(h, m0), q_stride, rows);
        load_rows(h, m0, 0);
    }
    cp_async_commit();

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[i][e] = dva[i][e] = 0.0f;
    }
    const float scale2 = p.scale * kLog2e;
    // The two keys of this thread's accumulator rows.
    const int kr0 = warp * 16 + g;  // and kr0 + 8
    // A-fragment addresses of this warp's 16 rows of K and V (ldmatrix, non-transposed).
    const int a_row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int a_col = (lane / 16) * 8;

    for (int it = 0; it < iters; ++it) {
        int h, m0;
        tile_of(it, h, m0);
        const int buf = it % 2;
        cp_async_wait<0>();
        __syncthreads();

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
            ldsm(kf, ks + a_row * kLd + kc * 16 + a_col);
            ldsm(vf, vs + a_row * kLd + kc * 16 + a_col);
#pragma unroll
            for (int jp = 0; jp < kBlockM / 16; ++jp) {
                const int row = jp * 16 + (lane % 8) + (lane / 16) * 8;
                const int col = kc * 16 + ((lane / 8) % 2) * 8;
                unsigned bf[4];
                ldsm(bf, qs + row * kLd + col);
                mma<T>(st[2 * jp], kf, bf[0], bf[1]);
                mma<T>(st[2 * jp + 1], kf, bf[2], bf[3]);
                ldsm(bf, dos + row * kLd + col);
                mma<T>(dpt[2 * jp], vf, bf[0], bf[1]);
                mma<T>(dpt[2 * jp + 1], vf, bf[2], bf[3]);
            }
        }

        // P^T = exp2(S^T scale log2e (+ mask log2e) - lse2); invisible pairs give 0, and so
        // do rows whose lse2 is +inf (nothing visible, or padding).
        const bool edge = nk < kBlockN || mask != nullptr ||
                          (p.causal && n0 + kBlockN - 1 > m0 + offset);
        const float* lrow = lses + buf * kBlockM;
        const float* drow = ds_ + buf * kBlockM;
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
                    if (visible && mask) x += mask[static_cast<long>(qi) * p.seq_kv + key] * kLog2e;
                    x = visible ? x : -INFINITY;
                }
                const float pr = exp2f(x - ((e & 1) ? l2.y : l2.x));
                st[j][e] = pr;
                dpt[j][e] = pr * (dpt[j][e] - ((e & 1) ? d2.y : d2.x));  // dS^T (unscaled)
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
            // dS^T to shared memory for dQ: rows kr0 and kr0 + 8, queries 16kc + 2tig (+ 8).
            T* srow = dss + kr0 * kLdS + kc * 16 + tig * 2;
            *reinterpret_cast<unsigned*>(srow) = sa[0];
            *reinterpret_cast<unsigned*>(srow + 8 * kLdS) = sa[1];
            *reinterpret_cast<unsigned*>(srow + 8) = sa[2];
            *reinterpret_cast<unsigned*>(srow + 8 * kLdS + 8) = sa[3];
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                const int row = kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                const int col = dp * 16 + (lane / 16) * 8;
                unsigned bf[4];
                ldsm_t(bf, dos + row * kLd + col);
                mma<T>(dva[2 * dp], pa, bf[0], bf[1]);
                mma<T>(dva[2 * dp + 1], pa, bf[2], bf[3]);
                ldsm_t(bf, qs + row * kLd + col);
                mma<T>(dka[2 * dp], sa, bf[0], bf[1]);
                mma<T>(dka[2 * dp + 1], sa, bf[2], bf[3]);
            }
        }
        __syncthreads();  // Q and dO are free, dS^T is complete

        // The next tile's loads overlap dQ.
        if (it + 1 < iters) {
            int h1, m1;
            tile_of(it + 1, h1, m1);
            const int rows = min(kBlockM, p.seq_q - m1);
            load_tile<T, D, kBlockM>(qs, kLd, q + q_at(h1, m1), q_stride, rows);
            load_tile<T, D, kBlockM>(dos, kLd, dout + q_at(h1, m1), q_stride, rows);
            load_rows(h1, m1, buf ^ 1);
        }
        cp_async_commit();

        // dQ (unscaled) += dS K for this warp's 16 queries, in chunks of 64 dims.
        const int qr0 = m0 + warp * 16 + g;  // and qr0 + 8
        float* dq0 = dq + q_at(h, 0) + static_cast<long>(qr0) * q_stride;
        float* dq1 = dq0 + 8 * q_stride;
        const bool ok0 = qr0 < p.seq_q, ok1 = qr0 + 8 < p.seq_q;
#pragma unroll
        for (int c0 = 0; c0 < D; c0 += 64) {
            float acc[8][4];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < kBlockN / 16; ++kc) {
                unsigned af[4];
                const int key = kc * 16 + (lane % 8) + (lane / 16) * 8;
                const int qc = warp * 16 + ((lane / 8) % 2) * 8;
                ldsm_t(af, dss + key * kLdS + qc);
#pragma unroll
                for (int dp = 0; dp < 4; ++dp) {
                    const int row = kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                    const int col = c0 + dp * 16 + (lane / 16) * 8;
                    unsigned bf[4];
                    ldsm_t(bf, ks + row * kLd + col);
                    mma<T>(acc[2 * dp], af, bf[0], bf[1]);
                    mma<T>(acc[2 * dp + 1], af, bf[2], bf[3]);
                }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int d = c0 + i * 8 + tig * 2;
                if (ok0) {
                    atomicAdd(dq0 + d, acc[i][0]);
                    atomicAdd(dq0 + d + 1, acc[i][1]);
                }
                if (ok1) {
                    atomicAdd(dq1 + d, acc[i][2]);
                    atomicAdd(dq1 + d + 1, acc[i][3]);
                }
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
        for (int i = 0; i < D / 8; ++i) {
            const int d = i * 8 + tig * 2;
            *reinterpret_cast<unsigned*>(dk + at + d) =
                pack2<T>(dka[i][2 * r] * p.scale, dka[i][2 * r + 1] * p.scale);
            *reinterpret_cast<unsigned*>(dv + at + d) = pack2<T>(dva[i][2 * r], dva[i][2 * r + 1]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 3. dq = scale * the f32 accumulator (n a multiple of 8: whole rows of 64 or 128).

template <typename T>
__device__ void dq_convert(const float* __restrict__ acc, T* __restrict__ dq, long n,
                           float scale) {
    constexpr int N = 8;
    const long vecs = n / N;
    for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < vecs;
         i += static_cast<long>(gridDim.x) * blockDim.x) {
        const float4 a = reinterpret_cast<const float4*>(acc)[2 * i];
        const float4 c = reinterpret_cast<const float4*>(acc)[2 * i + 1];
        uint4 w;
        w.x = pack2<T>(a.x * scale, a.y * scale);
        w.y = pack2<T>(a.z * scale, a.w * scale);
        w.z = pack2<T>(c.x * scale, c.y * scale);
        w.w = pack2<T>(c.z * scale, c.w * scale);
        reinterpret_cast<uint4*>(dq)[i] = w;
    }
}

}  // namespace

#define KPT_FLASH_BWD(NAME, T, D)                                                            \
    extern "C" __global__ void __launch_bounds__(kThreads)                                   \
        kpt_flash_attention_bwd_prep_##NAME##_d##D(const T* q, const T* k, const float* mask, \
                                                   const T* out, const T* dout, float* lse,   \
                                                   float* delta, const Dims p) {              \
        prep<T, D>(q, k, mask, out, dout, lse, delta, p);                                    \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(kThreads) kpt_flash_attention_bwd_##NAME##_d##D( \
        const T* q, const T* k, const T* v, const float* mask, const T* dout,                \
        const float* lse, const float* delta, float* dq, T* dk, T* dv, const Dims p) {       \
        bwd<T, D>(q, k, v, mask, dout, lse, delta, dq, dk, dv, p);                           \
    }

KPT_FLASH_BWD(bf16, __nv_bfloat16, 64)
KPT_FLASH_BWD(bf16, __nv_bfloat16, 128)
KPT_FLASH_BWD(f16, __half, 64)
KPT_FLASH_BWD(f16, __half, 128)

extern "C" __global__ void __launch_bounds__(256)
    kpt_flash_attention_bwd_dq_bf16(const float* acc, __nv_bfloat16* dq, long n, float scale) {
    dq_convert(acc, dq, n, scale);
}
extern "C" __global__ void __launch_bounds__(256)
    kpt_flash_attention_bwd_dq_f16(const float* acc, __half* dq, long n, float scale) {
    dq_convert(acc, dq, n, scale);
}
