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
    // `_dropout_` entries of flash_attention_sm90.cu): query i's probability for key j of
    // head h in batch entry b is kept iff 16-bit half j % 2 (low first) of word (j % 8) / 2
    // of Philox4x32-10 with counter (j / 8, i, h, batch_offset + b) and key
    // (seed_lo, seed_hi) is at least dropout_threshold (< 2^16), and kept ones are scaled
    // by dropout_scale. dropout_threshold 0 keeps everything (no dropout).
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

// The 8 keep bits of one Philox call: bit 2 w + e is half e of word w (keys 8 g + 2 w + e).
__device__ __forceinline__ uint32_t keep_bits8(uint4 w, unsigned threshold) {
    const unsigned hi = threshold << 16;  // half 1 >= threshold iff the word >= this
    return ((w.x & 0xFFFFu) >= threshold ? 0x01u : 0u) | (w.x >= hi ? 0x02u : 0u) |
           ((w.y & 0xFFFFu) >= threshold ? 0x04u : 0u) | (w.y >= hi ? 0x08u : 0u) |
           ((w.z & 0xFFFFu) >= threshold ? 0x10u : 0u) | (w.z >= hi ? 0x20u : 0u) |
           ((w.w & 0xFFFFu) >= threshold ? 0x40u : 0u) | (w.w >= hi ? 0x80u : 0u);
}

// Keep bits of eight n8 blocks of an m16n8 accumulator (mma.sync, or one warp's rows of a
// wgmma m64 accumulator) of head h, batch entry b: block j holds keys n0 + 8 j + 2 tig +
// {0, 1} of rows qi0 and qi0 + 8 (tig = lane % 4, n0 % 8 == 0), and bit 4 j + e of the
// result is element e of block j (row e / 2, key e % 2). One Philox call decides a row's
// eight keys of a block, which the quad's four lanes share (lane tig holds word tig), so
// the quad's 16 calls are made four per lane: lane c the calls of row c % 2 and blocks
// 2 m + c / 2 (byte m of its bits), and three shuffles give every lane the others'. Every
// lane of the warp must call it.
__device__ __forceinline__ uint32_t dropout_keep8(const AttentionDims& p, int b, int h, int qi0,
                                                  int n0, int tig) {
    const unsigned row = static_cast<unsigned>(qi0 + 8 * (tig & 1));
    const unsigned col = static_cast<unsigned>(n0) / 8u + static_cast<unsigned>(tig >> 1);
    const unsigned bat = static_cast<unsigned>(p.batch_offset + b);
    uint32_t own = 0;
#pragma unroll 2
    for (int m = 0; m < 4; ++m) {
        const uint4 w = philox4x32_10(make_uint4(col + 2u * m, row, static_cast<unsigned>(h), bat),
                                      p.seed_lo, p.seed_hi);
        own |= keep_bits8(w, p.dropout_threshold) << (8 * m);
    }
    // v[x]: the bits of lane tig ^ x, whose calls are those of c = tig ^ x. This lane's
    // keys are bits 2 tig, 2 tig + 1 of each byte; they go to bits 2 c, 2 c + 1 of the
    // byte (as 4 s + 2 r + e of block 2 m + s, row r = c % 2, s = c / 2).
    uint32_t v[4];
    v[0] = own;
    v[1] = __shfl_xor_sync(0xffffffffu, own, 1);
    v[2] = __shfl_xor_sync(0xffffffffu, own, 2);
    v[3] = __shfl_xor_sync(0xffffffffu, v[1], 2);
    uint32_t keep = 0;
#pragma unroll
    for (int x = 0; x < 4; ++x)
        keep |= ((v[x] >> (2 * tig)) & 0x03030303u) << (2 * (tig ^ x));
    return keep;
}

// Multiplies the eight n8 blocks x[j][e] of an m16n8 accumulator laid out as dropout_keep8's
// by their dropout factors: p.dropout_scale or 0. Every lane of the warp must call it.
__device__ __forceinline__ void apply_dropout8(float (&x)[8][4], const AttentionDims& p, int b,
                                               int h, int qi0, int n0, int tig) {
    const uint32_t keep = dropout_keep8(p, b, h, qi0, n0, tig);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            x[j][e] = (keep >> (4 * j + e)) & 1u ? x[j][e] * p.dropout_scale : 0.0f;
    }
}

// The same for a transposed accumulator (rows keys, columns queries: the dk / dv passes):
// rows k0 + g and k0 + g + 8 (k0 % 16 == 0, g = lane / 4), eight n8 blocks of queries
// q0 + 8 j + 2 tig + {0, 1}; bit 4 j + e of the result is element e of block j (key row
// e / 2, query e % 2). A call decides one query's keys of an 8-key block, bit g for row g,
// so the eight lanes of a column (one tig) need 32 calls, four per lane: lane g makes
// those of query 2 tig + g % 2, key block (g / 2) % 2 and n8 blocks g / 4 + 2 m (byte m),
// and eight shuffles within the column hand them out. Every lane of the warp must call it.
__device__ __forceinline__ uint32_t dropout_keep8_t(const AttentionDims& p, int b, int h, int k0,
                                                    int q0, int g, int tig) {
    const unsigned kb = static_cast<unsigned>(k0) / 8u + static_cast<unsigned>((g >> 1) & 1);
    const unsigned q = static_cast<unsigned>(q0 + 2 * tig + (g & 1) + 8 * (g >> 2));
    const unsigned bat = static_cast<unsigned>(p.batch_offset + b);
    uint32_t own = 0;
#pragma unroll 2
    for (int m = 0; m < 4; ++m) {
        const uint4 w = philox4x32_10(make_uint4(kb, q + 16u * m, static_cast<unsigned>(h), bat),
                                      p.seed_lo, p.seed_hi);
        own |= keep_bits8(w, p.dropout_threshold) << (8 * m);
    }
    uint32_t keep = 0;
#pragma unroll
    for (int src = 0; src < 8; ++src) {
        // Lane g = src of this column made the calls of query offset src % 2, key row
        // (src / 2) % 2 and n8 blocks src / 4 + 2 m; this lane's key is bit g of each byte.
        const uint32_t v = __shfl_sync(0xffffffffu, own, 4 * src + tig);
        keep |= ((v >> g) & 0x01010101u) << (4 * (src >> 2) + 2 * ((src >> 1) & 1) + (src & 1));
    }
    return keep;
}

}  // namespace kpt
