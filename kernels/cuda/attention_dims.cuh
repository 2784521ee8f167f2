// Sizes of one attention call, passed by value to every attention kernel; the layout is
// kpt-nvidia's and kpt-amd's `AttentionDims` (#[repr(C)]), so a field added here is added
// there too.
#pragma once

#include <cstdint>

namespace kpt {

struct AttentionDims {
    int batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal;
    float scale;
    int window;  // sliding window in keys, 0 = none
    // Dropout (training; kernels that take it: flash_attention.cu, its backward and the
    // `_dropout_` entries of flash_attention_sm90.cu):
    // query i's probability for key j of head h in batch entry b is kept iff word j % 4
    // of Philox4x32-10 with counter (j / 4, i, h, batch_offset + b) and key
    // (seed_lo, seed_hi) is at least dropout_threshold, and kept ones are scaled by
    // dropout_scale. dropout_threshold 0 keeps everything (no dropout).
    unsigned dropout_threshold, seed_lo, seed_hi;
    float dropout_scale;
    int batch_offset;
};

// Philox4x32-10 (Salmon et al. 2011; kpt_core::rand::philox4x32_10 on the host).
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// The dropout factors of keys 4 (j / 4) + {lo, lo + 1} (lo = j % 4, even) of query i, head
// h, batch entry b: 0 or p.dropout_scale each.
__device__ __forceinline__ float2 dropout_pair(const AttentionDims& p, int b, int h, int i,
                                               int j) {
    const uint4 w = philox4x32_10(
        make_uint4(static_cast<unsigned>(j) / 4u, static_cast<unsigned>(i),
                   static_cast<unsigned>(h), static_cast<unsigned>(p.batch_offset + b)),
        p.seed_lo, p.seed_hi);
    const bool hi = (j & 2) != 0;
    const unsigned a = hi ? w.z : w.x, c = hi ? w.w : w.y;
    return make_float2(a >= p.dropout_threshold ? p.dropout_scale : 0.0f,
                       c >= p.dropout_threshold ? p.dropout_scale : 0.0f);
}

// The dropout factor of key j of query i, head h, batch entry b: 0 or p.dropout_scale.
__device__ __forceinline__ float dropout_one(const AttentionDims& p, int b, int h, int i, int j) {
    const float2 f = dropout_pair(p, b, h, i, j & ~1);
    return (j & 1) ? f.y : f.x;
}

// Keep bits of eight n8 blocks of an m16n8 accumulator (mma.sync, or one warp's rows of a
// wgmma m64 accumulator) of head h, batch entry b: block j holds keys n0 + 8 j + 2 tig +
// {0, 1} of rows qi0 and qi0 + 8 (tig = lane % 4, n0 % 4 == 0), and bit 4 j + e of the
// result is element e of block j (row e / 2, key e % 2). Lanes tig and tig ^ 1 need the
// same two Philox calls per block (keys 4 (n0 / 4 + 2 j + tig / 2) .., rows qi0 and
// qi0 + 8), so each makes one (the even lane row qi0, the odd one row qi0 + 8) and they
// trade the halves: half the calls of dropout_pair. Every lane of the warp must call it.
__device__ __forceinline__ uint32_t dropout_keep8(const AttentionDims& p, int b, int h, int qi0,
                                                  int n0, int tig) {
    const bool odd = (tig & 1) != 0;
    const unsigned row = static_cast<unsigned>(qi0 + (odd ? 8 : 0));
    const unsigned col = static_cast<unsigned>(n0) / 4u + static_cast<unsigned>(tig >> 1);
    const unsigned bat = static_cast<unsigned>(p.batch_offset + b);
    uint32_t own = 0;
#pragma unroll 2
    for (int j = 0; j < 8; ++j) {
        const uint4 w = philox4x32_10(make_uint4(col + 2u * j, row, static_cast<unsigned>(h), bat),
                                      p.seed_lo, p.seed_hi);
        own |= (w.x >= p.dropout_threshold ? 1u : 0u) << (4 * j);
        own |= (w.y >= p.dropout_threshold ? 2u : 0u) << (4 * j);
        own |= (w.z >= p.dropout_threshold ? 4u : 0u) << (4 * j);
        own |= (w.w >= p.dropout_threshold ? 8u : 0u) << (4 * j);
    }
    // The even lane's elements are words 0, 1 of its row qi0 (own) and of row qi0 + 8 (the
    // odd lane's); the odd lane's words 2, 3 of row qi0 (the even lane's) and of its own.
    const uint32_t other = __shfl_xor_sync(0xffffffffu, own, 1);
    return odd ? ((other >> 2) & 0x33333333u) | (own & 0xCCCCCCCCu)
               : (own & 0x33333333u) | ((other & 0x33333333u) << 2);
}

}  // namespace kpt
