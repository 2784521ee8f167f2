// FlashAttention-3 style forward attention for Hopper (sm_90a only): asynchronous warpgroup
// MMA (wgmma) on shared-memory operands, a producer warpgroup feeding K/V tiles through an
// mbarrier ring, and two consumer warpgroups that take turns on the tensor cores. bf16 and f16,
// head dim 64 or 128. The same contract, arguments and Dims as flash_attention.cu (GQA, optional
// additive f32 mask [seq_q, seq_kv], bottom-right causal: query i sees key j iff
// j <= i + seq_kv - seq_q; rows that see no key give zeros; q and out [batch, seq_q, heads * d],
// k and v [batch, seq_kv, kv_heads * d]). Sliding windows (Dims::window) are taken by the
// `_window_` entries only (kWindow, compiled into those alone; the forward's without an
// additive mask or dropout, the backward's without dropout): their work starts at the key
// tile of the first row's first visible key, and tiles crossing a window's start mask per
// element.
//
// Block: one producer warpgroup and two consumer warpgroups of 64 query rows (384 threads,
// 128 query rows of one (batch, head)), or for bf16/f16 at d = 64 three consumers (512
// threads, 192 rows): there one exp2 per score costs as many cycles on the MUFU units as the
// two matrix products take on the tensor cores, and a consumer's softmax has the GEMMs of two
// others to hide under instead of one.
//   * Warpgroup 0 (producer, setmaxnreg down to 40 or 32 registers): copies the Q tile once, then
//     K(t) and V(t) tiles of 128 keys into a ring of kStages stages (3 for d = 128, 4 for
//     d = 64) with 16-byte cp.async (rows past the end are zero-filled). Each copy lands in the
//     128-byte-swizzled layout wgmma reads: a tile of R rows x d is d / 64 column blocks of
//     R rows x 128 bytes, and 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row
//     (every block starts 1024-byte aligned, as the swizzle works on address bits). Completion
//     is signalled with cp.async.mbarrier.arrive.noinc on the stage's "full" mbarrier (128
//     arrivals), so the producer never waits for its own copies. The `_tma_` entry points
//     (launched wherever the driver encodes the tensor maps) instead have one producer thread
//     issue each tile as TMA boxes of 128-byte column blocks (same swizzle, zeros outside the
//     tensor) after arming the stage's "full" mbarrier with the tile's byte count.
//   * Warpgroups 1.. (consumers, setmaxnreg up to 232, or 160 with three): 64 rows each. After an
//     mbarrier wait, a fence.proxy.async makes the cp.async (generic proxy) data visible to
//     wgmma (async proxy). S = Q K^T is wgmma m64n128k16 with both operands in shared memory
//     (K-major descriptors, d / 16 instructions); O += P V is wgmma m64n{d}k16 with P from
//     registers (the accumulator layout of S is the A-fragment layout, so P is S re-packed to
//     16 bits) and V in shared memory read transposed (MN-major descriptor). Every consumer
//     thread arrives on the stage's "empty" mbarrier (256 arrivals) once the wgmma that read
//     it completed (128 per consumer).
//   * Overlap inside a warpgroup (FA3's intra-warpgroup pipelining): iteration t issues
//     S(t) = Q K(t)^T and O += P(t-1) V(t-1) back to back, waits for S(t) only
//     (wgmma.wait_group 1) and runs the online softmax of tile t while P V still runs. With
//     three consumers, and with dropout, iteration t instead waits for both products and
//     rescales O and packs P(t) between the softmax's exp2s (kSerial).
//   * Overlap between the warpgroups (FA3's ping-pong): named barriers 1.. make the consumers
//     issue their GEMMs in turn (round robin), so the softmax of one runs under the GEMMs of
//     the others.
// Online softmax in the log2 domain (exp2) as in flash_attention.cu; element masks only on
// tiles that cross the diagonal or the end of the cache, or with an additive mask (a separate
// instantiation, so that the mask's loads do not add to the registers of unmasked calls).
// Query tiles end at seq_q, seq_q - kBlockM, ...: a partial tile is the first one (rows
// before 0 are zeros, never stored). A consumer whose rows are all before 0, or, under a
// causal mask, before the block's last key tiles, skips those tiles' GEMMs and softmax and
// only takes its turns and releases the stages.
// Block order (blocks start roughly in x order): x walks sections of G (batch, head) pairs
// whose K and V together take about kL2Budget bytes, so that the blocks in flight read the
// same few heads' K/V and find them in L2 (in (batch, head)-major order 132 blocks would
// stream 132 heads' K/V from memory); inside a section, query tiles go last-first across its
// heads, so that the longest causal blocks start first. kL2Budget is 8 MiB (16 MiB read
// 0.8 % slower at d = 128, S = 2048; attention-h200-notes.md).
//
// Persistent grid: with fewer blocks than tiles, a block runs work tiles x = blockIdx.x,
// blockIdx.x + gridDim.x, ... in the order above, and the producer and the consumers carry
// the K/V ring from one work tile to the next, so the next tile's Q and K/V copies run while
// the consumers finish the last tile and store its output. The Q tile has its own "empty"
// mbarrier: the consumers release it once their last Q K^T of the work tile completed. Under
// a causal mask tiles differ in length, so the stride walks items of two paired tiles, a
// long one and a short one (paired_tile), which all walk about the same number of key tiles.
// Without one, partial query tiles (seq_q not a multiple of kBlockM) come after all whole
// ones: in the sectioned order a stride of 132 handed them to the same blocks every time
// (at d = 64, S = 1024: one tile in six, each about 0.6 of a whole one, so the SMs' work
// differed by +-10 %).
// A grid of one block per tile runs one work tile per block.
// Variable-length batches (the `_varlen_` entries, kVarlen: cp.async copies, no mask,
// dropout or window): p.batch sequences packed into p.seq_q query and p.seq_kv key rows,
// offsets read on the device. The block order is sequence-major (varlen_work), each
// sequence laid out as a dense call of batch 1, and the persistent grid walks it as above
// (a stride of single tiles); each warp finds a tile's sequence by scanning the offsets
// from where its previous tile's scan stopped. The zero-filled copies past a sequence's
// rows and the masks at its last key keep sequences apart.
//
// Launch: grid = 1 to ceil(seq_q / kBlockM) * batch * heads blocks (the tile count; kBlockM =
// 192 for bf16/f16 at d = 64, else 128; fewer blocks run the persistent grid above), the
// `block=` threads below, and the `shared=` bytes as dynamic shared memory (more than 48 KiB:
// the function needs CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES set to it first). Only the
// sm_90a cubin computes; the sm_80 cubin and the compute_80 PTX of this file trap.
// When `lse` is not null (bf16/f16 entries), each row's log-sum-exp of the scaled scores
// (natural log, f32 [batch, heads, seq_q], +inf for rows that see no key) is written there
// too, for the backward pass; the FP8 entry writes none.
// Dropout (training, the `_tma_dropout_` entries, bf16/f16 at d = 64 or 128, two consumers
// at both): after the online softmax of a tile took its row sums, the dropped probabilities
// are zeroed (Philox keep bits from kpt::dropout_keep8, shared by a quad of lanes) and P V
// runs on the rest; the kept ones' 1 / (1 - p) goes into the final normalization. The
// log-sum-exp stays the softmax's.
// Tuning switches for standalone builds (target/fa3test): KPT_FA3_STAGES_D64/_D128,
// KPT_FA3_PINGPONG, KPT_FA3_PROXY_FENCE, KPT_FA3_POLY_FP8, KPT_FA3_POLY_D64, KPT_FA3_POLY_D128;
// the artifacts use the defaults.
//
// kpt:launch kpt_flash_attention_sm90_bf16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_bf16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_f16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_f16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_e4m3_d128 block=384 shared=148624 grid=tiles
// kpt:launch kpt_flash_attention_sm90_varlen_bf16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_varlen_bf16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_varlen_f16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_varlen_f16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_bf16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_bf16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_f16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_f16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_window_bf16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_window_bf16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_window_f16_d64 block=512 shared=156816 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_window_f16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_e4m3_d128 block=384 shared=148624 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_dropout_bf16_d64 block=384 shared=148624 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_dropout_bf16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_dropout_f16_d64 block=384 shared=148624 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_dropout_f16_d128 block=384 shared=230512 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_n192_e4m3_d128 block=384 shared=189552 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_n192_causal_e4m3_d128 block=384 shared=222320 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_n192_x2_e4m3_d128 block=384 shared=189552 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_n176_x2_bf16_d128 block=384 shared=214096 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_n176_x2_f16_d128 block=384 shared=214096 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_n160_carry_bf16_d128 block=384 shared=230480 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_n160_carry_f16_d128 block=384 shared=230480 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_carry_bf16_d64 block=512 shared=181392 grid=tiles
// kpt:launch kpt_flash_attention_sm90_tma_carry_f16_d64 block=512 shared=181392 grid=tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_bf16_d64 block=384 shared=67624 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_bf16_d128 block=384 shared=133160 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_f16_d64 block=384 shared=67624 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_f16_d128 block=384 shared=133160 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_bf16_d64 block=384 shared=99400 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_bf16_d128 block=384 shared=197704 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_f16_d64 block=384 shared=99400 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_f16_d128 block=384 shared=197704 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_dropout_bf16_d64 block=384 shared=67624 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_dropout_bf16_d128 block=384 shared=133160 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_dropout_f16_d64 block=384 shared=67624 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_dropout_f16_d128 block=384 shared=133160 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_dropout_bf16_d64 block=384 shared=99400 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_dropout_bf16_d128 block=384 shared=197704 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_dropout_f16_d64 block=384 shared=99400 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_dropout_f16_d128 block=384 shared=197704 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_window_bf16_d64 block=384 shared=67624 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_window_bf16_d128 block=384 shared=133160 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_window_f16_d64 block=384 shared=67624 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dkdv_window_f16_d128 block=384 shared=133160 grid=key_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_window_bf16_d64 block=384 shared=99400 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_window_bf16_d128 block=384 shared=197704 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_window_f16_d64 block=384 shared=99400 grid=query_tiles
// kpt:launch kpt_flash_attention_sm90_bwd_dq_lse_window_f16_d128 block=384 shared=197704 grid=query_tiles
// kpt:launch kpt_attention_fp8_v_transpose_d128 block=256 shared=0 grid=tiles
//
// FP8 (e4m3) inputs, head dim 128, bf16 output (kpt_flash_attention_sm90_e4m3_d128): the same
// pipeline with byte elements. Q K^T is wgmma m64n128k32 e4m3 (a 128-byte row of Q or K is one
// swizzle block, so the smem geometry is that of bf16 at d = 64). wgmma takes 8-bit operands
// K-major only, so P V needs V^T with keys contiguous: kpt_attention_fp8_v_transpose_d128 writes
// it first, [batch, kv_heads, 128, seq_kv rounded up to 128] with zeros past seq_kv. P goes
// to the tensor cores from registers as e4m3; its A fragment holds, per 32 keys, columns
// 4 tig .. 4 tig + 3 and 16 + 4 tig .. 16 + 4 tig + 3 of rows g and g + 8, while the S
// accumulator holds keys 8 j + 2 tig + {0, 1}: instead of shuffling registers, each thread packs
// the keys it holds in place and the transpose stores V^T in the matching key order (logical
// column L of a 32-key block holds key 16 (L / 16) + 8 ((L / 2) % 2) + 2 ((L / 4) % 4) + L % 2).
// The sum over keys does not depend on their order. P is exp2(s - max + 5) (at most 32, so
// small probabilities keep their mantissa bits, and a tile whose max exceeds the running max
// by up to 3.5 still fits e4m3's 448); the factor cancels in the normalization. With the
// tensor cores twice as fast as for bf16, the softmax bounds the FP8 kernel. The 192-key
// entries start a tile's exp2s against the running max before the tile's max is known and
// check afterwards that no P left e4m3's range (softmax_tile_spec; O keeps its scale, with
// no rescale, when it held), and the causal entry takes one n8 block of scores in eight's
// exp2 from a polynomial on the FMA units (exp2_fma) instead of the MUFU units (one in four
// measured slower: the FMA units' extra instructions then cost more than the MUFU time
// saved). Per-tensor scales: the host folds q_scale * k_scale into
// Dims::scale and passes v_scale to multiply the output.

#include <cstdint>
#include <type_traits>

#include "attention_dims.cuh"
#include "common.cuh"
#include "mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KPT_FLASH_SM90A 1
#endif

namespace {

using Dims = kpt::AttentionDims;

// An FP8 e4m3 element (its bits); the conversions are PTX cvt instructions.
struct E4M3 {
    uint8_t bits;
};
template <typename T>
constexpr bool kFp8 = std::is_same_v<T, E4M3>;
// The output element: bf16 for FP8 inputs, else the input type.
template <typename T>
using OutT = std::conditional_t<kFp8<T>, __nv_bfloat16, T>;

constexpr int kBlockN = 128;  // keys per K/V tile

// A TMA tensor map (the driver's CUtensorMap, 128 opaque bytes), passed by value as a
// __grid_constant__ kernel parameter so that its address is valid for the copies.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};
// The Q, K and V (FP8: V^T) maps of one call (see the TMA entry points at the end).
struct Maps {
    const TensorMap* q;
    const TensorMap* k;
    const TensorMap* v;
    // The output's map (boxes of one 128-byte column block by 64 rows), for kStaged.
    const TensorMap* o = nullptr;
};
// A variable-length batch (the `_varlen_` entries): offsets cu_q and cu_k [p.batch + 1] of
// 32-bit (idx64 = 0) or 64-bit integers, and the flag that invalid offsets set.
struct Varlen {
    const void* cu_q = nullptr;
    const void* cu_k = nullptr;
    int idx64 = 0;
    int* bad = nullptr;
};

// Consumer warpgroups (64 query rows each) per block: three for 16-bit d = 64, whose softmax
// (one exp2 per score, as many MUFU cycles as the two matrix products take on the tensor
// cores) needs the GEMMs of two other warpgroups to hide under; two otherwise, and with
// dropout, whose Philox calls need the registers of the larger consumers.
template <typename T, int D, bool kDropout = false>
constexpr int kConsumers = (sizeof(T) == 2 && D == 64 && !kDropout) ? 3 : 2;
// Threads per block: the producer warpgroup and the consumers.
template <typename T, int D, bool kDropout = false>
constexpr int kThreads = 128 * (1 + kConsumers<T, D, kDropout>);
template <int C>
struct Regs;
// 384 threads: the launch gives every thread 168 registers (65536 / 384, rounded down to 8);
// setmaxnreg moves them from the producer to the consumers.
template <>
struct Regs<2> {
    static constexpr int kProducer = 40, kConsumer = 232, kLaunch = 168;
};
// 512 threads: 128 each at launch.
template <>
struct Regs<3> {
    static constexpr int kProducer = 32, kConsumer = 160, kLaunch = 128;
};
static_assert(Regs<2>::kProducer * 128 + Regs<2>::kConsumer * 256 <= Regs<2>::kLaunch * 384,
              "register pool");
static_assert(Regs<3>::kProducer * 128 + Regs<3>::kConsumer * 384 <= Regs<3>::kLaunch * 512,
              "register pool");

// Ring depth and the ping-pong can be overridden when the file is compiled on its own for
// tuning (target/fa3test); the artifacts use the defaults, which the kpt:launch lines match.
#if !defined(KPT_FA3_STAGES_D64) && !defined(KPT_FA3_STAGES_D128)
#define KPT_FA3_DEFAULT_CONFIG 1
#endif
#ifndef KPT_FA3_STAGES_D64
#define KPT_FA3_STAGES_D64 4
#endif
#ifndef KPT_FA3_STAGES_D128
#define KPT_FA3_STAGES_D128 3
#endif
#ifndef KPT_FA3_PINGPONG
#define KPT_FA3_PINGPONG 1
#endif
// FP8: one n8 block of scores in KPT_FA3_POLY_FP8 takes its exp2 on the FMA units (0: none);
// the 192-key entry for calls without a causal mask takes none (measured faster there).
#ifndef KPT_FA3_POLY_FP8
#define KPT_FA3_POLY_FP8 8
#endif
// 16-bit: the same for head dims 64 and 128 (0: none).
#ifndef KPT_FA3_POLY_D64
#define KPT_FA3_POLY_D64 0
#endif
#ifndef KPT_FA3_POLY_D128
#define KPT_FA3_POLY_D128 0
#endif
// The consumers' fence.proxy.async after each "full" wait (see fence_proxy_async).
#ifndef KPT_FA3_PROXY_FENCE
#define KPT_FA3_PROXY_FENCE 1
#endif

// The shared-memory geometry depends on the bytes of a row: 128 (bf16/f16 at d = 64, FP8 at
// d = 128) or 256 (bf16/f16 at d = 128); the stage switches are named after the 16-bit sizes.
template <typename T, int D, int BN = kBlockN, bool kDropout = false, bool kStaged = false>
struct Config {
    static constexpr int kConsumers = ::kConsumers<T, D, kDropout>;
    static constexpr int kBlockM = 64 * kConsumers;  // query rows per block
    static constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
    // Key tiles of more than 128 keys (d = 128): two stages fit, three of FP8's byte tiles.
    static constexpr int kStages = BN != kBlockN ? (kFp8<T> ? 3 : 2)
                                   : (kRowBytes == 128 ? KPT_FA3_STAGES_D64 : KPT_FA3_STAGES_D128);
    static constexpr int kQBytes = kBlockM * kRowBytes;
    // A K tile.
    static constexpr int kTileBytes = BN * kRowBytes;
    // A V tile: as a K tile, or for FP8 a V^T tile of D rows by BN keys, one 128-byte column
    // block (D rows, 16 KiB) per 128 keys (the last one's columns past BN unused).
    static constexpr int kVTileBytes = kFp8<T> ? (BN + 127) / 128 * D * 128 : kTileBytes;
    static_assert(!kFp8<T> || (D == 128 && BN % 64 == 0), "FP8: d = 128, whole k-steps");
    // kStaged: each consumer's 64 output rows, swizzled as a Q tile, for the TMA store.
    static constexpr int kOutOffset = kQBytes + kStages * (kTileBytes + kVTileBytes);
    static constexpr int kOutBytes = kStaged ? kBlockM * D * 2 : 0;
    // full_q, empty_q, then full_k, empty_k, full_v, empty_v of each stage.
    static constexpr int kBarriers = 2 + 4 * kStages;
    static constexpr int kBarOffset = kOutOffset + kOutBytes;
    // + 1024: the dynamic shared memory is aligned up to 1024 bytes at run time.
    static constexpr int kSmemBytes = kBarOffset + kBarriers * 8 + 1024;
};
#ifdef KPT_FA3_DEFAULT_CONFIG
static_assert(Config<__nv_bfloat16, 64>::kSmemBytes == 156816,
              "keep the kpt:launch shared= values in step");
static_assert(Config<__nv_bfloat16, 64, kBlockN, false, true>::kSmemBytes == 181392,
              "keep the kpt:launch shared= values in step");
static_assert(Config<E4M3, 128, 192, false, true>::kSmemBytes == 222320,
              "keep the kpt:launch shared= values in step");
static_assert(Config<__nv_bfloat16, 128>::kSmemBytes == 230512,
              "keep the kpt:launch shared= values in step");
static_assert(Config<E4M3, 128>::kSmemBytes == 148624,
              "keep the kpt:launch shared= values in step");
static_assert(Config<E4M3, 128, 192>::kSmemBytes == 189552,
              "keep the kpt:launch shared= values in step");
static_assert(Config<__nv_bfloat16, 128, 176>::kSmemBytes == 214096,
              "keep the kpt:launch shared= values in step");
static_assert(Config<__nv_bfloat16, 128, 160, false, true>::kSmemBytes == 230480,
              "keep the kpt:launch shared= values in step");
static_assert(Config<__nv_bfloat16, 64, kBlockN, true>::kSmemBytes == 148624,
              "keep the kpt:launch shared= values in step");
#endif
static_assert(Config<__nv_bfloat16, 128>::kSmemBytes <= 227 * 1024 &&
                  Config<__nv_bfloat16, 128, 160, false, true>::kSmemBytes <= 227 * 1024,
              "one block per SM must fit in the 227 KiB of dynamic shared memory");
// k-steps of P V per K/V tile: 16 keys for bf16/f16, 32 for FP8 (32 bytes of A per row).
template <typename T, int BN = kBlockN>
constexpr int kPSteps = BN * static_cast<int>(sizeof(T)) / 32;

#ifdef KPT_FLASH_SM90A

constexpr float kLog2e = 1.4426950408889634f;
// K/V bytes of the (batch, head) pairs whose blocks are scheduled together (see the top).
constexpr long kL2Budget = 8L << 20;

using kpt::smem_u32;

// ---- mbarriers -------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, unsigned parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts its
// "previous" phase, parity 1, as completed).
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued so far has landed. The barrier's
// count includes this arrival (.noinc).
__device__ __forceinline__ void mbar_arrive_on_copies(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// cp.async writes through the generic proxy, wgmma reads through the async proxy: after a
// consumer observed the copies (mbarrier wait), this orders them before its wgmma reads.
// (CUTLASS's cp.async + GMMA mainloop goes without; kept for the memory model's sake.)
__device__ __forceinline__ void fence_proxy_async() {
    if (KPT_FA3_PROXY_FENCE) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// 16 bytes global -> shared; zero-filled when !valid.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

// Arms `bar` for `bytes` of TMA copies and arrives on it (the full barriers of the TMA entry
// points count one arrival, the producer's).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// One box of a 3-D tensor map (coordinates innermost first; rows outside the tensor,
// negative ones too, are zeros) into shared memory at `dst`, completing on `bar`. The maps
// use the 128-byte swizzle, which is the layout the wgmma descriptors read.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TensorMap* map, int x, int y, int z,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

// The same box copied into the shared memory of every block of the cluster in `mask` (bit r:
// rank r), at `dst` of each, completing on the barrier at `bar` of each.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const TensorMap* map, int x,
                                                      int y, int z, uint32_t bar, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar), "h"(mask)
        : "memory");
}
// Arrives on the barrier at `bar` of cluster block `rank`, with the arrive's default
// semantics (release at CTA scope, as CUTLASS's ClusterBarrier): what it orders is this
// thread's completed reads of its own shared memory, which the other block's TMA copies
// overwrite next. (`.release.cluster` compiles to a MEMBAR.ALL.GPU before each arrival.)
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar, unsigned rank) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
        : "memory");
}
// Every thread of the cluster's blocks meets here.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// This thread's warpgroup, through a shuffle from lane 0 (as CUTLASS's
// canonical_warp_group_idx) so that the compiler knows it, and all that derives from it (tile
// counts, ring positions, wgmma descriptors), is warp-uniform and keeps it in uniform
// registers: no R2UR left in the 160-key loop, 59 fewer instructions per key tile, spills
// down from 32 to 20 bytes at d128 and 68 to 20 at d64, and 6-11 % more throughput on the
// H200 (docs/reports/attention-h200-notes.md).
__device__ __forceinline__ int warpgroup_index() {
    return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}

// Named barriers of the consumer ping-pong (0 is __syncthreads).
constexpr int kSchedBarrier = 1;
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Named barriers of each consumer warpgroup's staged output store (kStaged).
template <int kConsumers>
constexpr int kStoreBarrier = kSchedBarrier + kConsumers;

// ---- staged output store (kStaged) -----------------------------------------------------

// Four 8 x 8 matrices of 16-bit values from registers in the mma accumulator layout (lane l:
// row l / 4, columns 2 (l % 4) and + 1 of each) to the rows whose addresses lanes 8 i .. 8 i + 7
// give for matrix i.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}
// One box of a 3-D tensor map from shared memory at `src` to global memory, in this thread's
// current bulk group. Elements past the tensor's end are not written, but unlike a TMA load
// the box may not start at a negative coordinate: the store faults (illegal instruction).
__device__ __forceinline__ void tma_store_3d(const TensorMap* map, uint32_t src, int x, int y,
                                             int z) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::
            "l"(reinterpret_cast<uint64_t>(map)),
        "r"(x), "r"(y), "r"(z), "r"(src)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until this thread's bulk groups have read their shared memory (the buffer may be
// written again).
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Waits until this thread's bulk groups have completed (their writes are done).
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// ---- wgmma -----------------------------------------------------------------------------

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins registers that an asynchronous wgmma reads or writes: the compiler may not move a use
// of them across this point (placed around issues and after waits).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Matrix descriptor of a wgmma shared-memory operand: bits 0-13 start address >> 4, 16-29
// leading byte offset >> 4, 32-45 stride byte offset >> 4, 49-51 base offset (0: every
// swizzle atom starts 1024-byte aligned), 62-63 layout (1 = 128-byte swizzle).
// K-major (Q and K: rows of the M/N dimension, the reduction dimension contiguous): 8-row
// groups 1024 bytes apart (stride offset); the leading offset is unused with a swizzle (1).
// A k-step of 16 elements inside a 64-element column block adds 32 bytes to the start.
constexpr uint64_t kDescK = (1ull << 62) | (uint64_t(1024 >> 4) << 32) | (uint64_t(16 >> 4) << 16);
// MN-major (V read as B = V[keys][d] with d contiguous, "transposed" B): 8-key groups 1024
// bytes apart (stride offset), 64-column blocks of d BN * 128 bytes apart (leading
// offset). A k-step of 16 keys adds 2048 bytes to the start.
template <int BN>
constexpr uint64_t kDescV =
    (1ull << 62) | (uint64_t(1024 >> 4) << 32) | (uint64_t((BN * 128) >> 4) << 16);
__device__ __forceinline__ uint64_t make_desc(uint64_t bits, uint32_t addr) {
    return bits | static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
}

#define KPT_ACC8(i)                                                                        \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),           \
        "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define KPT_REGS32                                                                         \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define KPT_REGS64                                                                         \
    KPT_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
               "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, " \
               "%61, %62, %63"

// d[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B K-major in shared memory; scale_d = 0
// ignores d's old value.
#define KPT_WGMMA_SS_N128(TY)                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" KPT_REGS64  \
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                        \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24), KPT_ACC8(32),     \
                   KPT_ACC8(40), KPT_ACC8(48), KPT_ACC8(56)                                \
                 : "l"(a), "l"(b), "r"(scale_d))
// The FP8 form: k32, and 8-bit operands take no transpose flags (both are K-major).
#define KPT_WGMMA_SS_N128_E4M3                                                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" KPT_REGS64      \
                 "}, %64, %65, p, 1, 1;\n}\n"                                               \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24), KPT_ACC8(32),     \
                   KPT_ACC8(40), KPT_ACC8(48), KPT_ACC8(56)                                \
                 : "l"(a), "l"(b), "r"(scale_d))
template <typename T>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t a, uint64_t b,
                                              int scale_d) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        KPT_WGMMA_SS_N128("bf16");
    } else if constexpr (kFp8<T>) {
        KPT_WGMMA_SS_N128_E4M3;
    } else {
        KPT_WGMMA_SS_N128("f16");
    }
}

// d[64 x N] (+)= A[64 x 16] B[16 x N]: the S tiles of 160- and 176-key tiles (d = 128).
#define KPT_REGS80                                                                         \
    KPT_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "  \
               "%78, %79"
#define KPT_REGS88 KPT_REGS80 ", %80, %81, %82, %83, %84, %85, %86, %87"
#define KPT_WGMMA_SS_N160(TY)                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n160k16.f32." TY "." TY " {" KPT_REGS80  \
                 "}, %80, %81, p, 1, 1, 0, 0;\n}\n"                                        \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24), KPT_ACC8(32),     \
                   KPT_ACC8(40), KPT_ACC8(48), KPT_ACC8(56), KPT_ACC8(64), KPT_ACC8(72)    \
                 : "l"(a), "l"(b), "r"(scale_d))
#define KPT_WGMMA_SS_N176(TY)                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32." TY "." TY " {" KPT_REGS88  \
                 "}, %88, %89, p, 1, 1, 0, 0;\n}\n"                                        \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24), KPT_ACC8(32),     \
                   KPT_ACC8(40), KPT_ACC8(48), KPT_ACC8(56), KPT_ACC8(64), KPT_ACC8(72),   \
                   KPT_ACC8(80)                                                            \
                 : "l"(a), "l"(b), "r"(scale_d))
// The S tile of the wide 16-bit key tiles: 160 or 176 keys.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_wide(float (&d)[N / 2], uint64_t a, uint64_t b,
                                              int scale_d) {
    static_assert(sizeof(T) == 2 && (N == 160 || N == 176), "wide tiles: bf16 / f16");
    constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    if constexpr (N == 160 && kBf16) {
        KPT_WGMMA_SS_N160("bf16");
    } else if constexpr (N == 160) {
        KPT_WGMMA_SS_N160("f16");
    } else if constexpr (kBf16) {
        KPT_WGMMA_SS_N176("bf16");
    } else {
        KPT_WGMMA_SS_N176("f16");
    }
}

// d[64 x 192] (+)= A[64 x 32] B[32 x 192], e4m3: the S tile of FP8's 192-key tiles.
#define KPT_REGS96                                                                         \
    KPT_REGS88 ", %88, %89, %90, %91, %92, %93, %94, %95"
template <typename T>
__device__ __forceinline__ void wgmma_ss_n192_e4m3(float (&d)[96], uint64_t a, uint64_t b,
                                                   int scale_d) {
    static_assert(kFp8<T>, "192-key tiles are for FP8");
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {" KPT_REGS96
                 "}, %96, %97, p, 1, 1;\n}\n"
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24), KPT_ACC8(32),
                   KPT_ACC8(40), KPT_ACC8(48), KPT_ACC8(56), KPT_ACC8(64), KPT_ACC8(72),
                   KPT_ACC8(80), KPT_ACC8(88)
                 : "l"(a), "l"(b), "r"(scale_d));
}

// d[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B K-major in shared memory (the backward's
// S^T = K Q^T and dP^T = V dO^T).
#define KPT_WGMMA_SS_N64(TY)                                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" KPT_REGS32   \
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                        \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24)                    \
                 : "l"(a), "l"(b), "r"(scale_d))
template <typename T>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        KPT_WGMMA_SS_N64("bf16");
    } else {
        KPT_WGMMA_SS_N64("f16");
    }
}

// d[64 x N] += A[64 x 16] B[16 x N], A in registers (4 per thread), B MN-major in shared
// memory (imm-trans-b = 1).
#define KPT_WGMMA_RS_N128(TY)                                                              \
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" KPT_REGS64  \
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"                             \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24), KPT_ACC8(32),     \
                   KPT_ACC8(40), KPT_ACC8(48), KPT_ACC8(56)                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
#define KPT_WGMMA_RS_N64(TY)                                                               \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" KPT_REGS32   \
                 "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"                             \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24)                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
// d[64 x 128] += A[64 x 32] B[32 x 128] with e4m3 A in registers (16 per thread) and B K-major.
#define KPT_WGMMA_RS_N128_E4M3                                                             \
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" KPT_REGS64      \
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"                                \
                 : KPT_ACC8(0), KPT_ACC8(8), KPT_ACC8(16), KPT_ACC8(24), KPT_ACC8(32),     \
                   KPT_ACC8(40), KPT_ACC8(48), KPT_ACC8(56)                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
    static_assert(N == 64 || N == 128, "P V is m64n64k16 or m64n128k16");
    static_assert(!kFp8<T> || N == 128, "FP8 P V is m64n128k32");
    if constexpr (kFp8<T>) {
        KPT_WGMMA_RS_N128_E4M3;
    } else if constexpr (N == 128) {
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            KPT_WGMMA_RS_N128("bf16");
        } else {
            KPT_WGMMA_RS_N128("f16");
        }
    } else {
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            KPT_WGMMA_RS_N64("bf16");
        } else {
            KPT_WGMMA_RS_N64("f16");
        }
    }
}

using kpt::pack2;

// ---- producer --------------------------------------------------------------------------

// Copies `rows` rows (from src, `stride` elements apart) of D elements into the swizzled
// tile of kRows rows at shared address `tile`; rows past `rows` become zeros. Thread tp of
// the producer warpgroup always copies the same 16-byte column chunk c of rows r0,
// r0 + kStep, ...; kStep is a multiple of 8, so the swizzled chunk is the same for all.
// Rows before `row_lo` are zeros too (the first query tile may start before row 0); their
// source is never read (cp.async of 0 bytes from `safe`).
template <typename T, int D, int kRows>
__device__ __forceinline__ void load_tile(uint32_t tile, const T* src, const T* safe, long stride,
                                          int row_lo, int rows, int tp) {
    constexpr int kElems = 16 / static_cast<int>(sizeof(T));  // elements per chunk
    constexpr int kChunks = D / kElems;   // 16-byte chunks per row
    constexpr int kStep = 128 / kChunks;  // rows per pass of the 128 producer threads
    static_assert(kStep % 8 == 0 && kRows % kStep == 0, "swizzle phase must repeat");
    const int c = tp % kChunks, r0 = tp / kChunks;
    const uint32_t dst =
        tile + (c / 8) * (kRows * 128) + r0 * 128 + (((c % 8) ^ (r0 % 8)) << 4);
    const T* s = src + r0 * stride + c * kElems;
    const long step = kStep * stride;
    // Not unrolled fully: ptxas would hoist every pass's 64-bit offset out of the tile loop
    // and spill them at the producer's 40 registers.
#pragma unroll 4
    for (int i = 0; i < kRows / kStep; ++i) {
        const bool ok = r0 + i * kStep < rows && r0 + i * kStep >= row_lo;
        cp_async16(dst + i * kStep * 128, ok ? s : safe, ok);
        s += step;
    }
}

// ---- consumer --------------------------------------------------------------------------

// S[64 x 128] = Q[64 x D] K[128 x D]^T, in k-steps of 32 bytes (16 or 32 elements).
template <typename T, int D, int BN = kBlockN>
__device__ __forceinline__ void gemm_qk(float (&s)[BN / 2], uint64_t qdesc, uint64_t kdesc) {
    constexpr int kBlockM = Config<T, D>::kBlockM;
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Config<T, D>::kRowBytes / 32; ++kk) {
        // Column block kk / 4 of the tile, 32 bytes per k-step inside it.
        const uint32_t qo = ((kk / 4) * (kBlockM * 128) + (kk % 4) * 32) >> 4;
        const uint32_t ko = ((kk / 4) * (BN * 128) + (kk % 4) * 32) >> 4;
        if constexpr (BN == 192) {
            wgmma_ss_n192_e4m3<T>(s, qdesc + qo, kdesc + ko, kk > 0 ? 1 : 0);
        } else if constexpr (BN == 160 || BN == 176) {
            wgmma_ss_wide<T, BN>(s, qdesc + qo, kdesc + ko, kk > 0 ? 1 : 0);
        } else {
            wgmma_ss_n128<T>(s, qdesc + qo, kdesc + ko, kk > 0 ? 1 : 0);
        }
    }
    wgmma_commit();
    fence_regs(s);
}

// O[64 x D] += P[64 x 128] V[128 x D]. A k-step is 16 keys, 16 rows of the MN-major V tile
// (2048 bytes), or for FP8 32 keys, 32 bytes into each row of the K-major V^T tile.
template <typename T, int D, int BN = kBlockN>
__device__ __forceinline__ void gemm_pv(float (&o)[D / 2], uint32_t (&pf)[kPSteps<T, BN>][4],
                                        uint64_t vdesc) {
    fence_regs(o);
    fence_regs(pf);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < kPSteps<T, BN>; ++kc) {
        // FP8: 32 bytes into the rows of V^T column block kc / 4 (D * 128 bytes each).
        const uint32_t off = kFp8<T> ? ((kc / 4) * D * 128 + (kc % 4) * 32) >> 4 : kc * (2048 >> 4);
        wgmma_rs<T, D>(o, pf[kc], vdesc + off);
    }
    wgmma_commit();
    fence_regs(o);
    fence_regs(pf);
}

// 2^x on the FMA units (x <= 127): x = i + f with i the nearest integer (the 1.5 * 2^23
// rounding trick) and f in [-0.5, 0.5], 2^f from a degree-3 polynomial (relative error
// 7.5e-5, minimax), i added to its exponent. Inputs below -120 give 2^-120.
__device__ __forceinline__ float exp2_fma(float x) {
    x = fmaxf(x, -120.0f);
    const float t = x + 12582912.0f;  // 1.5 * 2^23: its low mantissa bits hold round(x)
    const float f = x - (t - 12582912.0f);
    float p = fmaf(0.0551713765f, f, 0.242611211f);
    p = fmaf(p, f, 0.693261031f);
    p = fmaf(p, f, 0.99992807f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Online softmax of one S tile for this thread's two rows (qi0: elements 4j, 4j + 1; qi0 + 8:
// elements 4j + 2, 4j + 3; keys n0 + 8j + 2 tig + {0, 1}). S becomes the unnormalized P,
// alpha the factor that rescales the rows' old O. kEdge: scale and mask each element (any
// scale sign); otherwise the tile is fully visible and scale2 > 0, so the max of the raw
// scores gives the max and one FMA per element scales and subtracts it. P is scaled by
// 2^kPOffset (see the FP8 notes at the top). kPoly > 0: on fully visible tiles, every
// kPoly-th n8 block of scores takes exp2_fma instead of the MUFU units' exp2.
// after(j, alpha) runs once n8 block j of P is final (kSerial: P's packing and a share of O's
// rescale, placed between the exp2s).
struct NoAfter {
    __device__ __forceinline__ void operator()(int, const float (&)[2]) const {}
};
template <bool kEdge, bool kMask, int kPOffset, int BN = kBlockN, int kPoly = 0,
          bool kWindow = false, typename After = NoAfter>
__device__ __forceinline__ void softmax_tile(float (&s)[BN / 2], float (&m_run)[2],
                                             float (&l_run)[2], float (&alpha)[2], float scale2,
                                             int n0, int qi0, int tig, const Dims& p,
                                             const float* __restrict__ mask,
                                             After after = After{}) {
    float mx[2] = {m_run[0], m_run[1]};
    if constexpr (kEdge) {
        // Element (j, e) is key n0 + 2 tig + c with c = 8 j + (e & 1), a constant: it is
        // visible iff c < cols (end of the cache), c <= lim[row] (causal diagonal) and, with
        // kWindow, c >= lo[row] (the sliding window's first key).
        const int cols = p.seq_kv - n0 - 2 * tig;
        int lim[2], lo[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int diag = qi0 + 8 * r + (p.seq_kv - p.seq_q) - n0 - 2 * tig;
            lim[r] = p.causal ? diag : cols;
            lo[r] = kWindow ? diag + 1 - p.window : 0;
        }
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int cc = 8 * j + (e & 1);
                const bool visible =
                    cc < cols && cc <= lim[e >> 1] && (!kWindow || cc >= lo[e >> 1]);
                s[4 * j + e] = visible ? s[4 * j + e] * scale2 : -INFINITY;
            }
        }
        if constexpr (kMask) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int qi = qi0 + 8 * r;
                if (qi < 0 || qi >= p.seq_q) continue;
                const float* mrow = mask + static_cast<long>(qi) * p.seq_kv + n0 + 2 * tig;
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int cc = 8 * j + e;
                        if (cc < cols && cc <= lim[r]) s[4 * j + 2 * r + e] += mrow[cc] * kLog2e;
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
        }
    } else {
        float r[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            r[0] = fmaxf(r[0], fmaxf(s[4 * j], s[4 * j + 1]));
            r[1] = fmaxf(r[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        mx[0] = fmaxf(mx[0], r[0] * scale2);
        mx[1] = fmaxf(mx[1], r[1] * scale2);
    }
    float base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        // The quad of lanes sharing a row holds its BN columns.
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        // With nothing visible yet, exponents of -inf must give 0, not NaN.
        base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];
        alpha[r] = exp2f(m_run[r] - base[r]);
        m_run[r] = mx[r];
        if constexpr (kPOffset != 0) base[r] -= kPOffset;
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float b = base[e >> 1];
            float x;
            if constexpr (kEdge) {
                x = exp2f(s[4 * j + e] - b);
            } else if (kPoly > 0 && j % (kPoly > 0 ? kPoly : 1) == kPoly - 1) {
                x = exp2_fma(fmaf(s[4 * j + e], scale2, -b));
            } else {
                x = exp2f(fmaf(s[4 * j + e], scale2, -b));
            }
            s[4 * j + e] = x;
            sum[e >> 1] += x;
        }
        after(j, alpha);
    }
    l_run[0] = l_run[0] * alpha[0] + sum[0];
    l_run[1] = l_run[1] * alpha[1] + sum[1];
}

// Four floats as e4m3 bytes, a in the lowest byte (cvt puts its first source in the high half).
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// 16-bit P's n8 block j (keys 8 j ..): registers 2 (j % 2) and 2 (j % 2) + 1 of k-step j / 2.
template <typename T, int BN = kBlockN>
__device__ __forceinline__ void pack_p_block(const float (&s)[BN / 2],
                                             uint32_t (&pf)[kPSteps<T, BN>][4], int j) {
    pf[j / 2][2 * (j % 2)] = pack2<T>(s[4 * j], s[4 * j + 1]);
    pf[j / 2][2 * (j % 2) + 1] = pack2<T>(s[4 * j + 2], s[4 * j + 3]);
}

// P as the A fragments of P V. bf16/f16: k-step kc (keys 16 kc ..) is n8 blocks 2 kc and
// 2 kc + 1 of S, i.e. elements 8 kc .. 8 kc + 7 in order. FP8: k-step kc (keys 32 kc ..) is
// n8 blocks 4 kc .. 4 kc + 3; registers 0 / 1 take rows g / g + 8 of blocks 4 kc and 4 kc + 1,
// registers 2 / 3 those of blocks 4 kc + 2 and 4 kc + 3 (V^T's key order matches).
template <typename T, int BN = kBlockN>
__device__ __forceinline__ void pack_p(const float (&s)[BN / 2],
                                       uint32_t (&pf)[kPSteps<T, BN>][4]) {
#pragma unroll
    for (int kc = 0; kc < kPSteps<T, BN>; ++kc) {
        if constexpr (kFp8<T>) {
            const float* b = s + 16 * kc;  // blocks 4 kc .. 4 kc + 3, four floats each
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = 8 * (i / 2) + 2 * (i % 2);  // first float of the row in block pair
                pf[kc][i] = pack4_e4m3(b[j], b[j + 1], b[j + 4], b[j + 5]);
            }
        } else {
            pack_p_block<T, BN>(s, pf, 2 * kc);
            pack_p_block<T, BN>(s, pf, 2 * kc + 1);
        }
    }
}

// FP8 on a fully visible tile after the first (kSpec): the exp2s start at once against the
// running max instead of after the tile's max. P = exp2(S scale2 - m_run + kPOffset) is taken,
// summed and packed (e4m3) in one pass: the first half of P into registers of its own, the
// second into pf once P(t - 1) V(t - 1) has read it (wait_pv). The guess holds when every P
// is at most kSpecMax (inside e4m3's range; O then needs no rescale: alpha = 1). After each
// half a warp vote checks the thread's sums of the half's P per row, which bound every P in
// them; only where a sum exceeds kSpecMax (rows of many near-equal scores) are the half's
// scores compared with m_run + log2(kSpecMax) - kPOffset. When that fails, s is as it was and
// softmax(), the caller's softmax_tile, runs on it before P is packed again. The votes also
// read the packed words (a sign bit is a NaN), so that the packing of each half stays ahead of
// them (ptxas sinks work whose result only one branch uses into that branch), and each path
// waits for P V once, so that ptxas keeps the wgmmas asynchronous. Returns whether the guess
// held (warp-uniform, from the votes).
constexpr float kSpecMax = 362.0f;  // 2^8.5 < e4m3's 448
template <int kPOffset, int BN, int kPoly, typename WaitPv, typename Softmax>
__device__ __forceinline__ bool softmax_tile_spec(float (&s)[BN / 2], const float (&m_run)[2],
                                                  float (&l_run)[2], float (&alpha)[2],
                                                  float scale2,
                                                  uint32_t (&pf)[kPSteps<E4M3, BN>][4],
                                                  WaitPv wait_pv, Softmax softmax) {
    constexpr int kSteps = kPSteps<E4M3, BN>, kHalf = kSteps / 2;
    const float b[2] = {m_run[0] - kPOffset, m_run[1] - kPOffset};
    float sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // [half][row]
    uint32_t head[kHalf][4];
    uint32_t bits = 0;  // the packed words or'ed
    auto step = [&](int kc, uint32_t(&dst)[4]) {
        float x[16];  // n8 blocks 4 kc .. 4 kc + 3
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int j = 4 * kc + i / 4, r = (i % 4) >> 1;
            const float a = fmaf(s[16 * kc + i], scale2, -b[r]);
            // (A score far above the running max must still give a large P, which the vote
            // catches: exp2f gives +inf, exp2_fma takes at most 127.)
            x[i] = kPoly > 0 && j % (kPoly > 0 ? kPoly : 1) == kPoly - 1
                       ? exp2_fma(fminf(a, 127.0f))
                       : exp2f(a);
            sum[kc / kHalf][r] += x[i];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = 8 * (i / 2) + 2 * (i % 2);  // as in pack_p
            dst[i] = pack4_e4m3(x[j], x[j + 1], x[j + 4], x[j + 5]);
            bits |= dst[i];
        }
    };
    // Whether half h broke the guess for some row of the warp.
    auto failed = [&](int h) -> bool {
        const bool nan = !(sum[h][0] + sum[h][1] >= 0.0f) || (bits & 0x80808080u) != 0;
        if (__any_sync(0xffffffffu, nan || sum[h][0] > kSpecMax || sum[h][1] > kSpecMax) == 0)
            return false;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 16 * kHalf * h; i < 16 * kHalf * (h + 1); ++i)
            mx[(i % 4) >> 1] = fmaxf(mx[(i % 4) >> 1], s[i]);
        constexpr float kMargin = 8.5f - kPOffset;  // log2(kSpecMax) - kPOffset, rounded up
        return __any_sync(0xffffffffu, nan || mx[0] * scale2 > m_run[0] + kMargin ||
                                           mx[1] * scale2 > m_run[1] + kMargin) != 0;
    };
#pragma unroll
    for (int kc = 0; kc < kHalf; ++kc) step(kc, head[kc]);
    if (failed(0)) {
        softmax();
        wait_pv();
        pack_p<E4M3, BN>(s, pf);
        return false;
    }
    wait_pv();
#pragma unroll
    for (int kc = kHalf; kc < kSteps; ++kc) step(kc, pf[kc]);
    if (failed(1)) {
        softmax();
        pack_p<E4M3, BN>(s, pf);
        return false;
    }
#pragma unroll
    for (int kc = 0; kc < kHalf; ++kc)
#pragma unroll
        for (int i = 0; i < 4; ++i) pf[kc][i] = head[kc][i];
    l_run[0] += sum[0][0] + sum[1][0];
    l_run[1] += sum[0][1] + sum[1][1];
    alpha[0] = alpha[1] = 1.0f;
    return true;
}

// O's n8 block j times its rows' factors.
template <int D>
__device__ __forceinline__ void rescale_o_block(float (&o)[D / 2], const float (&alpha)[2],
                                                int j) {
    o[4 * j] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
}
template <int D>
__device__ __forceinline__ void rescale_o(float (&o)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) rescale_o_block<D>(o, alpha, j);
}

// One work tile: query rows [m0, m0 + kBlockM) of (batch b, head h), which walks n_tiles
// key tiles from tile t0 (past 0 under a sliding window).
struct Work {
    int m0, b, h, t0, n_tiles;
    // kVarlen: the sequence's lengths and first rows (b is the sequence, -1 past the last).
    int seq_q, seq_kv;
    long q_row, kv_row;
};

// Work tile x of the block order (see the top): a section of `pairs` (batch, head) pairs, then
// the query tile counted from the last (major) and the pair in the section (minor); the last
// section may hold fewer pairs. partial_last: the partial query tiles (the first of each pair)
// come after all whole ones, one per pair in order, so that a static stride over the SMs
// hands the cheap tiles out last instead of to the same blocks every time.
template <int kBlockM, int BN = kBlockN, bool kWindow = false>
__device__ __forceinline__ Work work_tile(long x, const Dims& p, int tiles_m, int pairs,
                                          bool partial_last) {
    const int bh_count = p.batch * p.heads;
    const int tiles = partial_last ? tiles_m - 1 : tiles_m;  // in the sectioned order
    const long whole = static_cast<long>(tiles) * bh_count;
    int bh, qt;  // qt: the query tile counted from the last
    if (x >= whole) {
        bh = static_cast<int>(x - whole);
        qt = tiles_m - 1;
    } else {
        const long section = static_cast<long>(pairs) * tiles;
        const int first = static_cast<int>(x / section) * pairs;
        const int in_section = min(pairs, bh_count - first);
        const int r = static_cast<int>(x % section);
        bh = first + r % in_section;
        qt = r / in_section;
    }
    Work w;
    // Query tiles end at seq_q - i * kBlockM: a partial tile is the first one, whose rows
    // before 0 are zeros and never stored (under a causal mask it is also the shortest).
    w.m0 = p.seq_q - (qt + 1) * kBlockM;
    w.h = bh % p.heads;
    w.b = bh / p.heads;
    // Keys j <= i + seq_kv - seq_q are visible to query i (causal, bottom-right aligned).
    int kv_end = p.seq_kv;
    if (p.causal) kv_end = max(0, min(p.seq_kv, w.m0 + kBlockM + p.seq_kv - p.seq_q));
    // With a sliding window of w keys (kWindow), query i sees keys j >= i + seq_kv - seq_q +
    // 1 - w: the tile starts at the tile of its first row's first key.
    const int kv_start = kWindow ? max(0, w.m0 + p.seq_kv - p.seq_q + 1 - p.window) : 0;
    w.t0 = kWindow ? min(kv_start, kv_end) / BN : 0;
    w.n_tiles = (kv_end + BN - 1) / BN - w.t0;
    return w;
}

// Work tile `half` (0 or 1) of item `item` of a causal persistent grid, as an index of the
// block order, or -1 (the middle tile of an odd count has no partner). Item pr of a section
// pairs query tile pr counted from the last (the longest under the mask) with tile
// tiles_m - 1 - pr (a short one), so that every item walks about as many key tiles as the
// longest tile and a static stride of items over the SMs is balanced.
__device__ __forceinline__ long paired_tile(long item, int half, int tiles_m, int pairs,
                                            int bh_count) {
    const long full = static_cast<long>(pairs) * ((tiles_m + 1) / 2);  // items of a section
    const long sec = item / full;
    const int in_section = min(pairs, bh_count - static_cast<int>(sec) * pairs);
    const int ri = static_cast<int>(item % full);
    const int pr = ri / in_section, pair = ri % in_section;
    const int u = half == 0 ? pr : tiles_m - 1 - pr;
    if (half == 1 && u == pr) return -1;
    return sec * pairs * tiles_m + static_cast<long>(u) * in_section + pair;
}

// ---- variable-length batches -----------------------------------------------------------

// Offset i of a cu_seqlens array of 32-bit (idx64 = 0) or 64-bit integers.
__device__ __forceinline__ long cu_at(const void* cu, int idx64, int i) {
    return idx64 ? static_cast<long>(static_cast<const long long*>(cu)[i])
                 : static_cast<long>(static_cast<const int*>(cu)[i]);
}

// Where a warp's scan of the offsets stopped: the chunk of 32 sequences it is in and the
// work tiles of the sequences before that chunk. A block's work tiles only grow, so each
// call of varlen_work resumes there.
struct VarlenCursor {
    int s0 = 0;
    long before = 0;
};

// Work tile x of a variable-length batch (p.batch sequences packed into p.seq_q query and
// p.seq_kv key rows): sequence s has ceil(lq / kBlockM) * heads work tiles, sequences in
// order, inside one its query tiles from the last (major) and its heads (minor), each as
// work_tile lays out a dense call of batch 1. Offsets are clamped to [0, rows] and lengths
// to at least 0, so that no offsets make a block read or write outside the packed rows
// (varlen_check reports invalid ones). b = -1 past the last tile. Every lane of the warp
// calls it; it reads the offsets 32 sequences at a time.
template <int kBlockM, int BN>
__device__ __forceinline__ Work varlen_work(long x, const Dims& p, const Varlen& vl,
                                            VarlenCursor& cur) {
    const int lane = threadIdx.x % 32;
    auto at = [&](const void* cu, int i, int rows) {
        return min(max(cu_at(cu, vl.idx64, i), 0L), static_cast<long>(rows));
    };
    Work w;
    w.b = -1;
    for (; cur.s0 < p.batch; cur.s0 += 32) {
        const int s = cur.s0 + lane;
        long tiles = 0;
        if (s < p.batch) {
            const long rows = at(vl.cu_q, s + 1, p.seq_q) - at(vl.cu_q, s, p.seq_q);
            tiles = (max(rows, 0L) + kBlockM - 1) / kBlockM * p.heads;
        }
        long end = tiles;  // inclusive prefix over the chunk's lanes
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const long up = __shfl_up_sync(0xffffffffu, end, o);
            if (lane >= o) end += up;
        }
        end += cur.before;
        const unsigned hit = __ballot_sync(0xffffffffu, end > x);
        if (hit != 0) {
            const int l = __ffs(hit) - 1, seq = cur.s0 + l;
            const long first = __shfl_sync(0xffffffffu, end - tiles, l);
            Dims ps = p;
            ps.batch = 1;
            const long q0 = at(vl.cu_q, seq, p.seq_q), k0 = at(vl.cu_k, seq, p.seq_kv);
            ps.seq_q = static_cast<int>(max(at(vl.cu_q, seq + 1, p.seq_q) - q0, 0L));
            ps.seq_kv = static_cast<int>(max(at(vl.cu_k, seq + 1, p.seq_kv) - k0, 0L));
            const int tiles_m = (ps.seq_q + kBlockM - 1) / kBlockM;
            w = work_tile<kBlockM, BN>(x - first, ps, tiles_m, p.heads, false);
            w.b = seq;
            w.seq_q = ps.seq_q;
            w.seq_kv = ps.seq_kv;
            w.q_row = q0;
            w.kv_row = k0;
            return w;
        }
        cur.before = __shfl_sync(0xffffffffu, end, 31);
    }
    return w;
}

// Sets *vl.bad to 1 unless both offset arrays start at 0, never decrease and end at their
// row counts (p.seq_q, p.seq_kv). Every lane of the warp calls it.
__device__ __forceinline__ void varlen_check(const Dims& p, const Varlen& vl) {
    bool ok = true;
    for (int i = threadIdx.x % 32; i <= p.batch; i += 32) {
        const long q = cu_at(vl.cu_q, vl.idx64, i), k = cu_at(vl.cu_k, vl.idx64, i);
        if (i == 0) {
            ok = ok && q == 0 && k == 0;
        } else {
            ok = ok && q >= cu_at(vl.cu_q, vl.idx64, i - 1) &&
                 k >= cu_at(vl.cu_k, vl.idx64, i - 1);
        }
        if (i == p.batch) ok = ok && q == p.seq_q && k == p.seq_kv;
    }
    if (!__all_sync(0xffffffffu, ok) && threadIdx.x % 32 == 0) *vl.bad = 1;
}

// For FP8, v is the V^T buffer of kpt_attention_fp8_v_transpose_d128; out_scale multiplies
// the output (v_scale for FP8, 1 otherwise). kDropout (16-bit, 128-key tiles): each P tile
// loses its dropped probabilities after the softmax took its sum (dropout_keep8: one Philox
// call per row and eight keys, shared by the quad of lanes) and the kept ones are scaled at
// the store, with the normalization. kPair (TMA, launched in clusters of two): the blocks of
// a cluster take neighbouring query tiles of one (batch, head) and share its K/V tiles: each
// copies half of every tile into both (TMA multicast), and a stage is free once the
// consumers of both released it.
template <typename T, int D, bool kMask, bool kTma, int BN = kBlockN, bool kCarry = false,
          int kPolyFp8 = KPT_FA3_POLY_FP8, bool kDropout = false, bool kPair = false,
          bool kStaged = false, bool kWindow = false, bool kVarlen = false>
__device__ __forceinline__ void flash_sm90(const T* __restrict__ q, const T* __restrict__ k,
                                           const T* __restrict__ v,
                                           const float* __restrict__ mask,
                                           OutT<T>* __restrict__ out,
                                           float* __restrict__ lse, const Dims& p,
                                           float out_scale, Maps maps, Varlen vl = Varlen{}) {
    using C = Config<T, D, BN, kDropout, kStaged>;
    static_assert(!kStaged || (kTma && sizeof(OutT<T>) == 2 && D % 64 == 0),
                  "staged store: TMA entries, 16-bit output");
    constexpr int kBlockM = C::kBlockM;
    constexpr int kConsumers = C::kConsumers;
    using R = Regs<kConsumers>;
    constexpr int kPOffset = kFp8<T> ? 5 : 0;
    // FP8: the tensor cores take half the cycles of bf16 for the same tile, and one exp2 per
    // score costs as many on the MUFU units; part of them go to the FMA units.
    constexpr int kPoly = kFp8<T> ? kPolyFp8 : D == 64 ? KPT_FA3_POLY_D64 : KPT_FA3_POLY_D128;
    constexpr int kStages = C::kStages;
    static_assert(!kDropout || (!kFp8<T> && BN % 64 == 0), "dropout: 16-bit, whole keep words");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sq = base;
    const uint32_t sk = base + C::kQBytes;
    const uint32_t sv = sk + kStages * C::kTileBytes;  // V stages of kVTileBytes
    const uint32_t bars = base + C::kBarOffset;
    const uint32_t full_q = bars;
    const uint32_t empty_q = bars + 8u;
    auto full_k = [&](int s) { return bars + 8u * (2 + s); };
    auto empty_k = [&](int s) { return bars + 8u * (2 + kStages + s); };
    auto full_v = [&](int s) { return bars + 8u * (2 + 2 * kStages + s); };
    auto empty_v = [&](int s) { return bars + 8u * (2 + 3 * kStages + s); };

    const int bh_count = p.batch * p.heads;
    const int tiles_m = (p.seq_q + kBlockM - 1) / kBlockM;
    const long total = static_cast<long>(tiles_m) * bh_count;
    static_assert(!kPair || kTma, "K/V multicast: TMA copies");
    // kPair: cluster x / 2 walks items of two query tiles (counted from the last, so that
    // with an odd count the first item's rank-0 tile lies before row 0 and computes
    // nothing), gridDim.x / 2 apart.
    const unsigned rank = kPair ? blockIdx.x % 2 : 0;
    const long block = kPair ? blockIdx.x / 2 : blockIdx.x;
    const long grid = kPair ? gridDim.x / 2 : gridDim.x;
    const int tiles_m2 = (tiles_m + 1) / 2;
    static_assert(!kVarlen || !(kPair || kStaged || kFp8<T> || kDropout || kMask || kTma),
                  "variable-length batches: the cp.async kernel without a mask or dropout");
    // kVarlen: p.batch sequences packed into p.seq_q query rows have at most this many work
    // tiles (each sequence at most one partial query tile); work() tells where they end.
    const long varlen_tiles = (static_cast<long>(tiles_m) + p.batch) * p.heads;
    if (block >= (kPair ? static_cast<long>(tiles_m2) * bh_count : kVarlen ? varlen_tiles : total))
        return;
    // A persistent grid (fewer blocks than tiles) walks items gridDim.x apart: a tile each,
    // or under a causal mask two paired tiles (paired_tile).
    const bool paired = !kPair && !kVarlen && p.causal && gridDim.x < total;
    const bool partial_last =
        !kPair && !kVarlen && !paired && gridDim.x < total && p.seq_q % kBlockM != 0;
    const long items = paired ? static_cast<long>(bh_count) * ((tiles_m + 1) / 2)
                       : kPair    ? static_cast<long>(tiles_m2) * bh_count
                       : kVarlen  ? varlen_tiles
                                  : total;
    const long kv_bytes = 2L * p.seq_kv * D * static_cast<long>(sizeof(T));
    const int pairs = static_cast<int>(
        max(1L, min(static_cast<long>(bh_count), kL2Budget / max(kv_bytes, 1L))));
    // The n-th work tile of this block (an index of the block order), -1 for none, or -2
    // past the last.
    auto tile_of = [&](long n) -> long {
        const long item = block + (paired ? n / 2 : n) * grid;
        if (item >= items) return -2;
        return paired ? paired_tile(item, static_cast<int>(n % 2), tiles_m, pairs, bh_count)
                      : item;
    };
    // Work tile x (kPair: this block's half of item x, a work tile of twice the rows;
    // kVarlen: see varlen_work, b = -1 past the last).
    VarlenCursor cursor;
    auto work = [&](long x) {
        if constexpr (kVarlen) {
            return varlen_work<kBlockM, BN>(x, p, vl, cursor);
        } else if constexpr (kPair) {
            Work w = work_tile<2 * kBlockM, BN, kWindow>(x, p, tiles_m2, pairs, false);
            w.m0 += static_cast<int>(rank) * kBlockM;
            return w;
        } else {
            return work_tile<kBlockM, BN, kWindow>(x, p, tiles_m, pairs, partial_last);
        }
    };
    const int group = p.heads / p.kv_heads;
    const int offset = p.seq_kv - p.seq_q;
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    // FP8: V^T of a (batch, kv head), D rows of seq_kv rounded up to 128 keys.
    const long vt_stride = static_cast<long>((p.seq_kv + kBlockN - 1) / kBlockN) * kBlockN;
    // A work tile's query and key counts and the rows before its first: its sequence's
    // (kVarlen) or its batch entry's.
    auto len_q = [&](const Work& w) { return kVarlen ? w.seq_q : p.seq_q; };
    auto len_kv = [&](const Work& w) { return kVarlen ? w.seq_kv : p.seq_kv; };
    auto row_q = [&](const Work& w) {
        return kVarlen ? w.q_row : static_cast<long>(w.b) * p.seq_q;
    };
    auto row_kv = [&](const Work& w) {
        return kVarlen ? w.kv_row : static_cast<long>(w.b) * p.seq_kv;
    };
    if constexpr (kVarlen) {
        if (blockIdx.x == 0 && threadIdx.x / 32 == 1) varlen_check(p, vl);
    }

    // Full barriers: the 128 producer threads' cp.async arrivals, or the one arrival (with
    // its byte count) of the thread that issues the TMA copies.
    // kPair: the K/V stages' empty barriers count one arrival per consumer warp of both blocks.
    constexpr unsigned kFills = kTma ? 1 : 128;
    constexpr unsigned kReleases = kPair ? 2 * 4 * kConsumers : 128 * kConsumers;
    if (threadIdx.x == 0) {
        mbar_init(full_q, kFills);
        mbar_init(empty_q, 128 * kConsumers);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_k(s), kFills);
            mbar_init(empty_k(s), kReleases);
            mbar_init(full_v(s), kFills);
            mbar_init(empty_v(s), kReleases);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // kPair: the other block's barriers are ready before any copy or arrival reaches them,
    // and no block leaves while the other may still copy into it or arrive on its barriers.
    if constexpr (kPair) {
        cluster_sync();
    } else {
        __syncthreads();
    }

    const int wg = warpgroup_index();
    if (wg == 0) {
        // ---- producer warpgroup ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R::kProducer));
        const int tp = threadIdx.x;
        // TMA: one thread issues every copy, as boxes of the tensor maps (128-byte column
        // blocks of the swizzled tiles; rows outside the tensor, Q's before 0 too, are
        // zeros), arming each full barrier with the bytes it waits for.
        if (kTma && tp != 0) {
            if constexpr (kPair) cluster_sync();
            return;
        }
        constexpr int kBoxCols = 128 / static_cast<int>(sizeof(T));  // elements of a block
        constexpr int kColBlocks = D / kBoxCols;
        auto tma_tile = [&](uint32_t dst, const TensorMap* map, int rows, int col, int row, int z,
                            uint32_t bar) {
#pragma unroll
            for (int cb = 0; cb < kColBlocks; ++cb)
                tma_load_3d(dst + cb * rows * 128, map, col + cb * kBoxCols, row, z, bar);
        };
        // kPair: this block's half of a K/V tile into both blocks: column block `rank` of
        // two, or with one column block (FP8's K: the map's boxes are BN / 2 rows) rows
        // [rank BN / 2, (rank + 1) BN / 2).
        auto tma_half = [&](uint32_t dst, const TensorMap* map, int col, int row, int z,
                            uint32_t bar) {
            static_assert(kColBlocks <= 2 && (BN / 2) % 8 == 0, "halves of whole swizzle atoms");
            if constexpr (kColBlocks == 2) {
                tma_load_3d_multicast(dst + rank * BN * 128, map, col + rank * kBoxCols, row, z,
                                      bar, 3);
            } else {
                tma_load_3d_multicast(dst + rank * (BN / 2) * 128, map, col,
                                      row + rank * (BN / 2), z, bar, 3);
            }
        };
        int s = 0;
        unsigned phase = 0, q_phase = 0;
        for (long n = 0;; ++n) {
            const long x = tile_of(n);
            if (x == -2) break;
            if (x < 0) continue;
            const Work w = work(x);
            if (kVarlen && w.b < 0) break;
            const int hk = w.h / group;
            const T* qb = q + (row_q(w) + w.m0) * q_stride + static_cast<long>(w.h) * D;
            const T* kb = k + row_kv(w) * kv_stride + static_cast<long>(hk) * D;
            const T* vb = kFp8<T> ? v + (static_cast<long>(w.b) * p.kv_heads + hk) * D * vt_stride
                                  : v + row_kv(w) * kv_stride + static_cast<long>(hk) * D;
            for (int t = 0; t < w.n_tiles; ++t) {
                const int n0 = (w.t0 + t) * BN;
                const int rows = min(BN, len_kv(w) - n0);
                const uint32_t ks = sk + s * C::kTileBytes, vs = sv + s * C::kVTileBytes;
                // Stage s is free once every consumer released its previous tile.
                mbar_wait(empty_k(s), phase ^ 1);
                if constexpr (kPair) {
                    mbar_expect_tx(full_k(s), C::kTileBytes);
                    tma_half(ks, maps.k, hk * D, n0, w.b, full_k(s));
                } else if constexpr (kTma) {
                    mbar_expect_tx(full_k(s), C::kTileBytes);
                    tma_tile(ks, maps.k, BN, hk * D, n0, w.b, full_k(s));
                } else {
                    load_tile<T, D, BN>(ks, kb + n0 * kv_stride, kb, kv_stride, 0, rows, tp);
                    mbar_arrive_on_copies(full_k(s));
                }
                if (t == 0) {
                    // The Q tile is free once every consumer finished its Q K^T products of
                    // the previous work tile (K(0) is already on its way).
                    mbar_wait(empty_q, q_phase ^ 1);
                    if constexpr (kTma) {
                        mbar_expect_tx(full_q, C::kQBytes);
                        tma_tile(sq, maps.q, kBlockM, w.h * D, w.m0, w.b, full_q);
                    } else {
                        load_tile<T, D, kBlockM>(sq, qb, q, q_stride, max(0, -w.m0), kBlockM, tp);
                        mbar_arrive_on_copies(full_q);
                    }
                    q_phase ^= 1;
                }
                mbar_wait(empty_v(s), phase ^ 1);
                if constexpr (kTma) {
                    mbar_expect_tx(full_v(s), C::kVTileBytes);
                    if constexpr (kFp8<T> && kPair) {
                        // V^T's two column blocks: this block's one into both.
                        static_assert(C::kVTileBytes == 2 * D * 128, "two V^T column blocks");
                        tma_load_3d_multicast(vs + rank * D * 128, maps.v, n0 + rank * 128, 0,
                                              w.b * p.kv_heads + hk, full_v(s), 3);
                    } else if constexpr (kFp8<T>) {
                        // V^T: D rows of 128 keys per column block (keys past the tensor
                        // read as zeros).
#pragma unroll
                        for (int cb = 0; cb < C::kVTileBytes / (D * 128); ++cb)
                            tma_load_3d(vs + cb * D * 128, maps.v, n0 + cb * 128, 0,
                                        w.b * p.kv_heads + hk, full_v(s));
                    } else if constexpr (kPair) {
                        tma_half(vs, maps.v, hk * D, n0, w.b, full_v(s));
                    } else {
                        tma_tile(vs, maps.v, BN, hk * D, n0, w.b, full_v(s));
                    }
                } else {
                    if constexpr (kFp8<T>) {
                        load_tile<T, BN, D>(vs, vb + n0, vb, vt_stride, 0, D, tp);
                    } else {
                        load_tile<T, D, BN>(vs, vb + n0 * kv_stride, vb, kv_stride, 0, rows,
                                                 tp);
                    }
                    mbar_arrive_on_copies(full_v(s));
                }
                if (++s == kStages) {
                    s = 0;
                    phase ^= 1;
                }
            }
        }
        if constexpr (!kTma) asm volatile("cp.async.wait_all;\n" ::: "memory");
        if constexpr (kPair) cluster_sync();
        return;
    }

    // ---- consumer warpgroups ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R::kConsumer));
    const int c = wg - 1;  // 64 rows each
    const int t128 = threadIdx.x % 128, warp = t128 / 32, lane = t128 % 32;
    const int g = lane / 4, tig = lane % 4;
    // Releases a K or V stage: every consumer thread, or with kPair one lane per warp on the
    // barriers of both blocks.
    auto release = [&](uint32_t bar) {
        if constexpr (kPair) {
            __syncwarp();
            if (lane == 0) {
                mbar_arrive(bar);
                mbar_arrive_remote(bar, rank ^ 1u);
            }
        } else {
            mbar_arrive(bar);
        }
    };
    const float scale2 = p.scale * kLog2e;
    const bool fast = scale2 > 0.0f && !kMask;
    const uint64_t qdesc = make_desc(kDescK, sq + c * 64 * 128);
    const uint64_t kdesc = make_desc(kDescK, sk);
    const uint64_t vdesc = make_desc(kFp8<T> ? kDescK : kDescV<BN>, sv);
    constexpr uint32_t kStageDesc = C::kTileBytes >> 4;
    constexpr uint32_t kVStageDesc = C::kVTileBytes >> 4;
    // Ping-pong (round robin with three): warpgroup c issues its GEMMs after sync on
    // barrier 1 + c and then lets the next go (arrive on 1 + (c + 1) % kConsumers);
    // consumer 0 starts. Every sync meets exactly one arrive. By default each work tile
    // starts and ends the round anew: the last consumer skips its arrive of the last tile
    // and gives consumer 0 its first turn of the next. With kCarry (the unmasked entries,
    // where it measured faster) the round runs on across a block's work tiles: the last
    // consumer's last turn of one lets consumer 0 begin the next, whose Q K^T then runs
    // while the others finish their softmax, P V and stores; the round starts once, before
    // the first work tile, and consumer 0's sync after the last meets the one arrive left
    // over.
    constexpr bool kPingPong = KPT_FA3_PINGPONG != 0;
    // The consumers' order within a key tile. Two consumers run a tile's softmax under their
    // own P V of the previous tile (FA3's intra-warpgroup overlap). Three (16-bit d = 64),
    // and with dropout, wait for both GEMMs instead, then rescale O and pack P between the
    // softmax's exp2s (kSerial, cuDNN's order): there the other consumers' GEMMs hide the
    // softmax (measured +2-4 % at d = 64 and +1 % with dropout, -1 % at d = 128 and FP8).
    constexpr bool kSerial = kConsumers == 3 || kDropout;
    // FP8's 192-key entries guess each tile's max (softmax_tile_spec): the softmax, not the
    // tensor cores, bounds them (the 128-key entries, for masked calls, keep their registers).
    constexpr bool kSpec = kFp8<T> && !kSerial && BN > kBlockN;
    constexpr int kLast = kConsumers - 1;
    const int my_turn = kSchedBarrier + c;
    const int other_turn = kSchedBarrier + (c + 1) % kConsumers;
    if constexpr (kPingPong && kCarry) {
        if (c == kLast) named_arrive(kSchedBarrier, 256);
    }
    // The ring position, carried across work tiles: advanced before every key tile.
    int s = kStages - 1;
    unsigned phase = 1, q_phase = 0;
    auto advance = [&] {
        if (++s == kStages) {
            s = 0;
            phase ^= 1;
        }
    };

    for (long n = 0;; ++n) {
        const long x = tile_of(n);
        if (x == -2) break;
        if (x < 0) continue;
        const Work w = work(x);
        if (kVarlen && w.b < 0) break;
        // kVarlen: the work tile's sequence as a dense call (batch entry 0 of its rows).
        Dims pw;
        if constexpr (kVarlen) {
            pw = p;
            pw.seq_q = w.seq_q;
            pw.seq_kv = w.seq_kv;
        }
        const Dims& pt = kVarlen ? pw : p;
        const int off = kVarlen ? w.seq_kv - w.seq_q : offset;
        const int n_tiles = w.n_tiles;
        const int n_first = w.t0 * BN;  // the first key tile's first key
        // The two query rows of this thread's accumulators: qi0 and qi0 + 8.
        const int qi0 = w.m0 + c * 64 + warp * 16 + g;

        float o[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
        float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

        if (n_tiles > 0) {
            float s_acc[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) s_acc[i] = 0.0f;
            uint32_t pf[kPSteps<T, BN>][4];
            float alpha[2];
            bool kept = false;  // kSpec: the last tile kept the max (alpha = 1, O as it is)
            const int row_first = w.m0 + c * 64;  // first query row of this warpgroup
            // Whether tile n0 needs per-element work (scale sign, mask, end of cache, diagonal,
            // a sliding window's start before this warpgroup's last row's).
            auto edge = [&](int n0) {
                return !fast || n0 + BN > len_kv(w) ||
                       (p.causal && n0 + BN - 1 > row_first + off) ||
                       (kWindow && n0 < row_first + 64 + off - p.window);
            };
            // Dropout: the keep bits of tile n0 (64 keys per word) do not depend on the
            // scores; they are drawn while its Q K^T runs on the tensor cores and applied
            // after its softmax (the rows are bound by the Philox calls' multiplies, wherever
            // they run: attention-h200-notes.md).
            uint32_t keep[kDropout ? BN / 64 : 1];
            auto draw = [&](int n0) {
                if constexpr (kDropout) {
#pragma unroll
                    for (int q64 = 0; q64 < BN / 64; ++q64)
                        keep[q64] = kpt::dropout_keep8(p, w.b, w.h, qi0, n0 + 64 * q64, tig);
                }
            };
            auto drop = [&] {
                if constexpr (kDropout) {
#pragma unroll
                    for (int e = 0; e < BN / 2; ++e)
                        if (!((keep[e / 32] >> (e % 32)) & 1u)) s_acc[e] = 0.0f;
                }
            };
            auto softmax = [&](int n0) {
                if (edge(n0)) {
                    softmax_tile<true, kMask, kPOffset, BN, 0, kWindow>(
                        s_acc, m_run, l_run, alpha, scale2, n0, qi0, tig, pt, mask);
                } else {
                    softmax_tile<false, false, kPOffset, BN, kPoly>(s_acc, m_run, l_run, alpha,
                                                                    scale2, n0, qi0, tig, pt, mask);
                }
            };
            // kSerial without dropout: P's n8 block j is packed as soon as it is final, and O's
            // rescale is spread over the blocks (kShare of its n8 blocks after each).
            constexpr int kShare = (D / 8 + BN / 8 - 1) / (BN / 8);
            auto after = [&](int j, const float (&a)[2]) {
                if constexpr (!kFp8<T>) pack_p_block<T, BN>(s_acc, pf, j);
#pragma unroll
                for (int i = 0; i < kShare; ++i) {
                    if (j * kShare + i < D / 8) rescale_o_block<D>(o, a, j * kShare + i);
                }
            };
            // (kSerial entries are 16-bit: three consumers or dropout.)
            auto softmax_serial = [&](int n0) {
                if (kDropout || edge(n0)) {
                    softmax(n0);
                    drop();
                    pack_p<T, BN>(s_acc, pf);
                    rescale_o<D>(o, alpha);
                } else {
                    softmax_tile<false, false, kPOffset, BN, kPoly>(
                        s_acc, m_run, l_run, alpha, scale2, n0, qi0, tig, pt, mask, after);
                }
            };
            if (kPingPong && !kCarry && c == kLast) named_arrive(kSchedBarrier, 256);

            // Key tiles this warpgroup computes: under a causal mask the block's last tiles can
            // be past every row of its lower warpgroups. Those skip the GEMMs and the softmax but
            // still take their turns and release the stages (after the stage filled, so that the
            // release counts for this round).
            // Warpgroups whose rows all lie before row 0 (in a partial first tile) compute none.
            int my_tiles = row_first + 64 > 0 ? n_tiles : 0;
            if (p.causal) {
                const int seen = max(0, min(len_kv(w), row_first + 64 + off));
                // (seen > the first row's window start, so this is at least 0.)
                my_tiles = min(my_tiles, (seen + BN - 1) / BN - w.t0);
            }
            // Every consumer waits for this work tile's Q before it releases it, so that a
            // release never counts for the previous one.
            mbar_wait(full_q, q_phase);
            q_phase ^= 1;
            if (my_tiles > 0) {
                // Tile 0: S and the softmax only.
                advance();
                mbar_wait(full_k(s), phase);
                fence_proxy_async();
                if (kPingPong) named_sync(my_turn, 256);
                gemm_qk<T, D, BN>(s_acc, qdesc, kdesc + s * kStageDesc);
                if (kPingPong && (kCarry || !(c == kLast && n_tiles == 1)))
                    named_arrive(other_turn, 256);
                draw(n_first);
                wgmma_wait<0>();
                fence_regs(s_acc);
                release(empty_k(s));
                if (my_tiles == 1) mbar_arrive(empty_q);
                softmax(n_first);
                drop();
                pack_p<T, BN>(s_acc, pf);
                if constexpr (kSerial) rescale_o<D>(o, alpha);

                // Tile t: S(t) and P(t - 1) V(t - 1) in flight together. The softmax of t runs
                // under P V; with kSerial the consumer waits for both, and its softmax rescales
                // O and packs P(t) between its exp2s.
                for (int t = 1; t < my_tiles; ++t) {
                    const int sp = s;  // stage of tile t - 1
                    const unsigned pp = phase;
                    advance();
                    mbar_wait(full_k(s), phase);
                    fence_proxy_async();
                    if (kPingPong) named_sync(my_turn, 256);
                    gemm_qk<T, D, BN>(s_acc, qdesc, kdesc + s * kStageDesc);
                    if constexpr (!kSerial) {
                        if (!kSpec || !kept) rescale_o<D>(o, alpha);
                    }
                    mbar_wait(full_v(sp), pp);
                    fence_proxy_async();
                    gemm_pv<T, D, BN>(o, pf, vdesc + sp * kVStageDesc);
                    if (kPingPong && (kCarry || !(c == kLast && t == n_tiles - 1)))
                        named_arrive(other_turn, 256);
                    draw(n_first + t * BN);
                    if constexpr (kSerial) {
                        wgmma_wait<0>();
                        fence_regs(s_acc);
                        fence_regs(o);
                        fence_regs(pf);
                        release(empty_k(s));
                        if (t == my_tiles - 1) mbar_arrive(empty_q);
                        release(empty_v(sp));
                        softmax_serial(n_first + t * BN);
                    } else {
                        wgmma_wait<1>();  // S(t) is done
                        fence_regs(s_acc);
                        release(empty_k(s));
                        if (t == my_tiles - 1) mbar_arrive(empty_q);
                        const int n0 = n_first + t * BN;
                        // P V of t - 1 is done: pf and the stage of V(t - 1) are free.
                        auto wait_pv = [&] {
                            wgmma_wait<0>();
                            fence_regs(o);
                            fence_regs(pf);
                            release(empty_v(sp));
                        };
                        auto plain = [&] {
                            softmax(n0);
                            drop();
                            wait_pv();
                            pack_p<T, BN>(s_acc, pf);
                        };
                        if constexpr (kSpec) {
                            kept = false;
                            if (edge(n0)) {
                                plain();
                            } else {
                                kept = softmax_tile_spec<kPOffset, BN, kPoly>(
                                    s_acc, m_run, l_run, alpha, scale2, pf, wait_pv,
                                    [&] { softmax(n0); });
                            }
                        } else {
                            plain();
                        }
                    }
                }
                if constexpr (!kSerial) {
                    if (!kSpec || !kept) rescale_o<D>(o, alpha);
                }
                mbar_wait(full_v(s), phase);
                fence_proxy_async();
                gemm_pv<T, D, BN>(o, pf, vdesc + s * kVStageDesc);
                wgmma_wait<0>();
                fence_regs(o);
                fence_regs(pf);
                release(empty_v(s));
            } else {
                mbar_arrive(empty_q);
            }
            // The tiles past this warpgroup's rows.
            for (int t = my_tiles; t < n_tiles; ++t) {
                advance();
                mbar_wait(full_k(s), phase);
                if (kPingPong) named_sync(my_turn, 256);
                if (kPingPong && (kCarry || !(c == kLast && t == n_tiles - 1)))
                    named_arrive(other_turn, 256);
                release(empty_k(s));
                mbar_wait(full_v(s), phase);
                release(empty_v(s));
            }
        }

        // Normalize and store: the quad of lanes of a row holds its partial sums. Rows that saw
        // no key (l = 0) give zeros.
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_run[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[r] = l > 0.0f ? (kDropout ? out_scale * p.dropout_scale : out_scale) / l : 0.0f;
            const int qi = qi0 + r * 8;
            if (!kVarlen && lse != nullptr && tig == 0 && qi >= 0 && qi < p.seq_q) {
                // m_run and the scores are in the log2 domain (P carries 2^kPOffset).
                lse[(static_cast<long>(w.b) * p.heads + w.h) * p.seq_q + qi] =
                    l > 0.0f && m_run[r] != -INFINITY
                        ? (m_run[r] + log2f(l) - kPOffset) * 0.6931471805599453f
                        : INFINITY;
            }
        }
        // The staged store takes whole boxes of rows from 0 on (a TMA store at a negative row
        // faults); a consumer of a partial first tile with rows before 0 stores directly.
        if (kStaged && w.m0 + c * 64 >= 0) {
            // Through shared memory: stmatrix into this consumer's buffer (the Q tile's
            // swizzled layout), then one thread stores it with TMA while the warpgroup goes
            // on. The buffer's previous store must have read it first.
            const uint32_t so = base + C::kOutOffset + c * 64 * D * 2;
            if (t128 == 0) bulk_wait_read();
            named_sync(kStoreBarrier<kConsumers> + c, 128);
            const int mi = lane / 8, rr = lane % 8;  // this lane's matrix and its row
            const uint32_t row_addr = so + (warp * 16 + (mi % 2) * 8 + rr) * 128;
#pragma unroll
            for (int j = 0; j < D / 8; j += 2) {
                const int jc = j + mi / 2;  // this lane's 16-byte column chunk
                stmatrix_x4(row_addr + (jc / 8) * 64 * 128 + (((jc % 8) ^ rr) << 4),
                            pack2<OutT<T>>(o[4 * j] * inv[0], o[4 * j + 1] * inv[0]),
                            pack2<OutT<T>>(o[4 * j + 2] * inv[1], o[4 * j + 3] * inv[1]),
                            pack2<OutT<T>>(o[4 * j + 4] * inv[0], o[4 * j + 5] * inv[0]),
                            pack2<OutT<T>>(o[4 * j + 6] * inv[1], o[4 * j + 7] * inv[1]));
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_sync(kStoreBarrier<kConsumers> + c, 128);
            if (t128 == 0) {
#pragma unroll
                for (int cb = 0; cb < D / 64; ++cb)
                    tma_store_3d(maps.o, so + cb * 64 * 128, w.h * D + cb * 64, w.m0 + c * 64,
                                 w.b);
                bulk_commit();
            }
        } else {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int qi = qi0 + r * 8;
                if (qi < 0 || qi >= len_q(w)) continue;
                OutT<T>* orow = out + (row_q(w) + qi) * q_stride + static_cast<long>(w.h) * D +
                                tig * 2;
#pragma unroll
                for (int j = 0; j < D / 8; ++j) {
                    *reinterpret_cast<uint32_t*>(orow + j * 8) =
                        pack2<OutT<T>>(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
                }
            }
        }
    }
    // The last output stores have completed.
    if constexpr (kStaged) {
        if (t128 == 0) bulk_wait();
    }
    // Under kCarry, the last consumer's last arrive (or the start's, for a block without
    // work).
    if constexpr (kPingPong && kCarry) {
        if (c == 0) named_sync(my_turn, 256);
    }
    if constexpr (kPair) cluster_sync();
}

// ---- backward: shared pieces --------------------------------------------------------------

// The backward kernels' barriers: `once` for the tiles copied once and full / empty of each
// ring stage (the 128 producer threads' copies fill, the 256 consumer threads release), then
// a block-wide sync.
template <int kStages, typename Full, typename Empty>
__device__ __forceinline__ void bwd_barriers(uint32_t once, Full full, Empty empty) {
    if (threadIdx.x == 0) {
        mbar_init(once, 128);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 128);
            mbar_init(empty(s), 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// st = A1 B1^T and dpt = A2 B2^T for one 64 x 64 block, both K-major in shared memory: A1 / A2
// are 64 rows of tiles of kARows rows (64-column blocks kARows * 128 bytes apart), B1 / B2
// tiles of 64 rows; k-steps of 16 of the D dims. Waits for both.
template <typename T, int D, int kARows>
__device__ __forceinline__ void bwd_scores(float (&st)[32], float (&dpt)[32], uint64_t a1,
                                           uint64_t b1, uint64_t a2, uint64_t b2) {
    fence_regs(st);
    fence_regs(dpt);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t ao = ((kk / 4) * (kARows * 128) + (kk % 4) * 32) >> 4;
        const uint32_t bo = ((kk / 4) * (64 * 128) + (kk % 4) * 32) >> 4;
        wgmma_ss_n64<T>(st, a1 + ao, b1 + bo, kk > 0 ? 1 : 0);
        wgmma_ss_n64<T>(dpt, a2 + ao, b2 + bo, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(st);
    fence_regs(dpt);
}

// st becomes P = exp2(S scale2 (+ mask log2e) - lse2) and dpt dS = P o (dP - D), element
// 4j + 2r + e of the 64 x 64 block: at(j, r, e) gives its (key, query), stats(j, r, e) its
// query's (lse2, D). With `edge`, keys the query does not see (past the cache, causal, with
// kWindow before its sliding window) and queries past seq_q give P = 0; otherwise every
// element is visible. kDropout: bit i of
// `keep` is element i's decision (kpt::dropout_keep8 / _keep8_t); st becomes P Z and dpt
// P (Z dP - D), Z = p.dropout_scale or 0.
template <bool kDropout, bool kWindow, typename At, typename Stats>
__device__ __forceinline__ void bwd_probs(float (&st)[32], float (&dpt)[32], bool edge,
                                          float scale2, const Dims& p,
                                          const float* __restrict__ mask, At at, Stats stats,
                                          uint32_t keep) {
    const int offset = p.seq_kv - p.seq_q;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 4 * j + 2 * r + e;
                float x = st[i] * scale2;
                if (edge) {
                    const int2 kq = at(j, r, e);
                    bool visible = kq.x < p.seq_kv && kq.y < p.seq_q;
                    if (p.causal) visible = visible && kq.x <= kq.y + offset;
                    if (kWindow) visible = visible && kq.x >= kq.y + offset + 1 - p.window;
                    if (visible && mask) x += mask[static_cast<long>(kq.y) * p.seq_kv + kq.x] * kLog2e;
                    x = visible ? x : -INFINITY;
                }
                const float2 ld = stats(j, r, e);
                const float pr = exp2f(x - ld.x);
                if constexpr (kDropout) {
                    const float z = (keep >> i) & 1u ? p.dropout_scale : 0.0f;
                    st[i] = pr * z;
                    dpt[i] = pr * (z * dpt[i] - ld.y);
                } else {
                    st[i] = pr;
                    dpt[i] = pr * (dpt[i] - ld.y);
                }
            }
        }
    }
}

// ---- backward: dk and dv per key tile ----------------------------------------------------
//
// kpt_flash_attention_sm90_bwd_dkdv_*: the second launch of the attention backward
// (flash_attention_bwd.cu's kv_pass, same arguments and results) on wgmma. One block per
// (128 keys, kv head, batch): a producer warpgroup copies K and V once, then for every
// query head of the kv group and every query tile of 64 that sees the keys, Q, dO and the
// rows' lse2 and D (written by the first launch) into a ring of kBwdStages stages; each of
// the two consumer warpgroups owns 64 keys and per query tile computes
//   S^T = K Q^T, dP^T = V dO^T               (wgmma m64n64k16, both operands in shared memory)
//   P^T = exp2(S^T scale log2e (+ mask log2e) - lse2), dS^T = P^T o (dP^T - D)
//   dV += P^T dO, dK += dS^T Q               (wgmma m64n{D}k16, P^T / dS^T from registers,
//                                             dO and Q read MN-major)
// and at the end stores dk = scale dK and dv = dV. Keys past the cache hold zeros in K and V;
// their rows of dk and dv are never stored, so they need no mask; queries past seq_q have
// lse2 = +inf (P = 0) and D = 0.
constexpr int kBwdKeys = 128;   // keys per block, 64 per consumer warpgroup
constexpr int kBwdRows = 64;    // queries per tile
constexpr int kBwdStages = 2;

template <int D>
struct BwdConfig {
    static constexpr int kKvBytes = kBwdKeys * D * 2;  // a K (or V) tile
    static constexpr int kRowBytes = kBwdRows * D * 2;  // a Q (or dO) tile
    static constexpr int kStageBytes = 2 * kRowBytes;  // Q, then dO
    static constexpr int kStatsOffset = 2 * kKvBytes + kBwdStages * kStageBytes;
    // lse2 and D of each stage (kBwdRows floats each), then the barriers.
    static constexpr int kBarOffset = kStatsOffset + kBwdStages * 2 * kBwdRows * 4;
    static constexpr int kBarriers = 1 + 2 * kBwdStages;  // full_kv, full[s], empty[s]
    static constexpr int kSmemBytes = kBarOffset + kBarriers * 8 + 1024;
};
static_assert(BwdConfig<64>::kSmemBytes == 67624, "keep the kpt:launch shared= values in step");
static_assert(BwdConfig<128>::kSmemBytes == 133160, "keep the kpt:launch shared= values in step");

// MN-major descriptor of a tile of `rows` rows of D elements read as B with the rows as the
// reduction dimension: 64-column blocks rows * 128 bytes apart, a k-step of 16 rows adds
// 2048 bytes to the start.
__device__ __forceinline__ uint64_t mn_desc(uint32_t addr, int rows) {
    return make_desc((1ull << 62) | (uint64_t(1024 >> 4) << 32) |
                         (static_cast<uint64_t>((rows * 128) >> 4) << 16),
                     addr);
}

template <typename T, int D, bool kDropout, bool kWindow>
__device__ __forceinline__ void bwd_dkdv_sm90(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v,
                                              const float* __restrict__ mask,
                                              const T* __restrict__ dout,
                                              const float* __restrict__ lse,
                                              const float* __restrict__ delta, T* __restrict__ dk,
                                              T* __restrict__ dv, const Dims& p) {
    using C = BwdConfig<D>;
    using R = Regs<2>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sk = base, sv = base + C::kKvBytes;
    auto sq = [&](int s) { return base + 2 * C::kKvBytes + s * C::kStageBytes; };
    auto sdo = [&](int s) { return sq(s) + C::kRowBytes; };
    auto lse_at = [&](int s) { return base + C::kStatsOffset + s * 2 * kBwdRows * 4; };
    const uint32_t bars = base + C::kBarOffset;
    const uint32_t full_kv = bars;
    auto full = [&](int s) { return bars + 8u * (1 + s); };
    auto empty = [&](int s) { return bars + 8u * (1 + kBwdStages + s); };
    const float* stats = reinterpret_cast<const float*>(smem_raw + (base - smem_u32(smem_raw)) +
                                                        C::kStatsOffset);

    const int groups = p.batch * p.kv_heads;
    const int bg = static_cast<int>(blockIdx.x % groups);
    const int n0 = static_cast<int>(blockIdx.x / groups) * kBwdKeys;
    const int hk = bg % p.kv_heads, b = bg / p.kv_heads;
    const int group = p.heads / p.kv_heads;
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    const long kv_at =
        (static_cast<long>(b) * p.seq_kv + n0) * kv_stride + static_cast<long>(hk) * D;
    const int nk = min(kBwdKeys, p.seq_kv - n0);
    const int offset = p.seq_kv - p.seq_q;
    const int pad = (p.seq_q + kBwdRows - 1) / kBwdRows * kBwdRows;  // the first launch's seq_pad
    // Query i sees key j iff j <= i + offset: the first query tile that sees key n0. With a
    // sliding window of w keys (kWindow) also iff i <= j - offset - 1 + w: m_end past the
    // last query that sees key n0 + nk - 1.
    const int m_begin = p.causal ? max(0, n0 - offset) / kBwdRows * kBwdRows : 0;
    const int m_end = kWindow ? max(0, min(p.seq_q, n0 + nk - 1 - offset + p.window)) : p.seq_q;
    const int tiles_m = m_begin < m_end ? (m_end - m_begin + kBwdRows - 1) / kBwdRows : 0;
    const int iters = group * tiles_m;

    bwd_barriers<kBwdStages>(full_kv, full, empty);

    const int wg = warpgroup_index();
    if (wg == 0) {
        // ---- producer: K and V once, then Q, dO, lse2 and D per (head, query tile) ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R::kProducer));
        const int tp = threadIdx.x;
        load_tile<T, D, kBwdKeys>(sk, k + kv_at, k, kv_stride, 0, nk, tp);
        load_tile<T, D, kBwdKeys>(sv, v + kv_at, v, kv_stride, 0, nk, tp);
        mbar_arrive_on_copies(full_kv);
        int s = 0;
        unsigned phase = 0;
        for (int it = 0; it < iters; ++it) {
            const int h = hk * group + it / tiles_m;
            const int m0 = m_begin + (it % tiles_m) * kBwdRows;
            const int rows = min(kBwdRows, p.seq_q - m0);
            const long at =
                (static_cast<long>(b) * p.seq_q + m0) * q_stride + static_cast<long>(h) * D;
            mbar_wait(empty(s), phase ^ 1);
            load_tile<T, D, kBwdRows>(sq(s), q + at, q, q_stride, 0, rows, tp);
            load_tile<T, D, kBwdRows>(sdo(s), dout + at, dout, q_stride, 0, rows, tp);
            // lse2 and D of the tile's rows (padded to whole tiles by the first launch).
            const long r_at = static_cast<long>(b * p.heads + h) * pad + m0;
            if (tp < kBwdRows / 4) {
                cp_async16(lse_at(s) + 16 * tp, lse + r_at + 4 * tp, true);
            } else if (tp < kBwdRows / 2) {
                const int y = tp - kBwdRows / 4;
                cp_async16(lse_at(s) + kBwdRows * 4 + 16 * y, delta + r_at + 4 * y, true);
            }
            mbar_arrive_on_copies(full(s));
            if (++s == kBwdStages) {
                s = 0;
                phase ^= 1;
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // ---- consumers: 64 keys each ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R::kConsumer));
    const int c = wg - 1;
    const int t128 = threadIdx.x % 128, warp = t128 / 32, lane = t128 % 32;
    const int g = lane / 4, tig = lane % 4;
    const int kr0 = c * 64 + warp * 16 + g;  // this thread's keys: kr0 and kr0 + 8
    const float scale2 = p.scale * kLog2e;
    const uint64_t kdesc = make_desc(kDescK, sk + c * 64 * 128);
    const uint64_t vdesc = make_desc(kDescK, sv + c * 64 * 128);
    float dka[D / 2], dva[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dka[i] = dva[i] = 0.0f;
    mbar_wait(full_kv, 0);
    fence_proxy_async();
    int s = 0;
    unsigned phase = 0;
    for (int it = 0; it < iters; ++it) {
        const int m0 = m_begin + (it % tiles_m) * kBwdRows;
        mbar_wait(full(s), phase);
        fence_proxy_async();
        // Dropout's decisions of this warp's 16 keys and the 64 queries (query head h).
        uint32_t keep = ~0u;
        if constexpr (kDropout)
            keep = kpt::dropout_keep8_t(p, b, hk * group + it / tiles_m, n0 + c * 64 + warp * 16,
                                        m0, g, tig);
        const uint64_t qk = make_desc(kDescK, sq(s)), dok = make_desc(kDescK, sdo(s));
        // S^T = K Q^T and dP^T = V dO^T (64 keys x 64 queries).
        float st[32], dpt[32];
        bwd_scores<T, D, kBwdKeys>(st, dpt, kdesc, make_desc(kDescK, sq(s)), vdesc,
                                   make_desc(kDescK, sdo(s)));
        // P^T and dS^T: element 4j + 2r + e is key kr0 + 8r, query m0 + 8j + 2tig + e.
        const float* lrow = stats + s * 2 * kBwdRows;
        // The tile's last query has the latest window start.
        const bool edge = mask != nullptr || (p.causal && n0 + c * 64 + 63 > m0 + offset) ||
                          (kWindow && n0 + c * 64 < m0 + kBwdRows + offset - p.window);
        bwd_probs<kDropout, kWindow>(
            st, dpt, edge, scale2, p, mask,
            [&](int j, int r, int e) { return make_int2(n0 + kr0 + 8 * r, m0 + 8 * j + 2 * tig + e); },
            [&](int j, int, int e) {
                const int col = 8 * j + 2 * tig + e;
                return make_float2(lrow[col], lrow[kBwdRows + col]);
            },
            keep);
        // P^T and dS^T as A fragments (k-steps of 16 queries), then dV += P^T dO and
        // dK += dS^T Q with dO and Q read MN-major.
        uint32_t pf[4][4], sf[4][4];
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                pf[kc][i] = pack2<T>(st[8 * kc + 2 * i], st[8 * kc + 2 * i + 1]);
                sf[kc][i] = pack2<T>(dpt[8 * kc + 2 * i], dpt[8 * kc + 2 * i + 1]);
            }
        }
        const uint64_t qmn = mn_desc(sq(s), kBwdRows), domn = mn_desc(sdo(s), kBwdRows);
        fence_regs(dva);
        fence_regs(dka);
        fence_regs(pf);
        fence_regs(sf);
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
            wgmma_rs<T, D>(dva, pf[kc], domn + kc * (2048 >> 4));
            wgmma_rs<T, D>(dka, sf[kc], qmn + kc * (2048 >> 4));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dva);
        fence_regs(dka);
        fence_regs(pf);
        fence_regs(sf);
        mbar_arrive(empty(s));
        if (++s == kBwdStages) {
            s = 0;
            phase ^= 1;
        }
    }

    // dk = scale dK, dv = dV: element 4j + 2r + e is key kr0 + 8r, dim 8j + 2tig + e.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = kr0 + 8 * r;  // within the tile
        if (key >= nk) continue;
        const long at = kv_at + static_cast<long>(key) * kv_stride;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int d = 8 * j + 2 * tig;
            *reinterpret_cast<uint32_t*>(dk + at + d) =
                pack2<T>(dka[4 * j + 2 * r] * p.scale, dka[4 * j + 2 * r + 1] * p.scale);
            *reinterpret_cast<uint32_t*>(dv + at + d) =
                pack2<T>(dva[4 * j + 2 * r], dva[4 * j + 2 * r + 1]);
        }
    }
}

// ---- backward: dq given the forward's log-sum-exp ------------------------------------------
//
// kpt_flash_attention_sm90_bwd_dq_lse_*: the backward's first launch given the forward's
// log-sum-exp (flash_attention_bwd.cu's dq_pass with kGivenLse, same arguments and
// results) on wgmma. One block per (128 query rows, head, batch), query tiles last-first: a
// producer warpgroup copies Q and dO once, then K and V tiles of 64 keys into a ring of
// kDqStages stages; each of the two consumer warpgroups owns 64 rows, computes D =
// rowsum(dO o O) and lse2 = lse log2e of its rows (written for the dk / dv launch), and per
// key tile
//   S = Q K^T, dP = dO V^T                     (wgmma m64n64k16, both in shared memory)
//   P = exp2(S scale log2e (+ mask log2e) - lse2), dS = P o (dP - D)
//   dQ += dS K                                 (wgmma m64n{D}k16, dS from registers, K MN-major)
// and at the end stores dq = scale dQ. Keys past the cache are zeros in K and V, so their
// dS meets zero rows of K and adds nothing.
constexpr int kDqRows = 128;  // query rows per block, 64 per consumer warpgroup
constexpr int kDqKeys = 64;   // keys per K / V tile
constexpr int kDqStages = 4;

template <int D>
struct DqConfig {
    static constexpr int kRowsBytes = kDqRows * D * 2;  // the Q (or dO) tile
    static constexpr int kTileBytes = kDqKeys * D * 2;  // a K (or V) tile
    static constexpr int kRingOffset = 2 * kRowsBytes;
    static constexpr int kBarOffset = kRingOffset + kDqStages * 2 * kTileBytes;
    static constexpr int kBarriers = 1 + 2 * kDqStages;  // full_q, full[s], empty[s]
    static constexpr int kSmemBytes = kBarOffset + kBarriers * 8 + 1024;
};
static_assert(DqConfig<64>::kSmemBytes == 99400, "keep the kpt:launch shared= values in step");
static_assert(DqConfig<128>::kSmemBytes == 197704, "keep the kpt:launch shared= values in step");

template <typename T, int D, bool kDropout, bool kWindow>
__device__ __forceinline__ void bwd_dq_sm90(const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v,
                                            const float* __restrict__ mask,
                                            const T* __restrict__ out, const T* __restrict__ dout,
                                            const float* __restrict__ lse_in, T* __restrict__ dq,
                                            float* __restrict__ lse, float* __restrict__ delta,
                                            const Dims& p) {
    using C = DqConfig<D>;
    using R = Regs<2>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sq = base, sdo = base + C::kRowsBytes;
    auto sk = [&](int s) { return base + C::kRingOffset + s * 2 * C::kTileBytes; };
    auto sv = [&](int s) { return sk(s) + C::kTileBytes; };
    const uint32_t bars = base + C::kBarOffset;
    const uint32_t full_q = bars;
    auto full = [&](int s) { return bars + 8u * (1 + s); };
    auto empty = [&](int s) { return bars + 8u * (1 + kDqStages + s); };

    const int tiles_m = (p.seq_q + kDqRows - 1) / kDqRows;
    const int bh = static_cast<int>(blockIdx.x % (p.batch * p.heads));
    const int m0 = (tiles_m - 1 - static_cast<int>(blockIdx.x / (p.batch * p.heads))) * kDqRows;
    const int h = bh % p.heads, b = bh / p.heads;
    const int hk = h / (p.heads / p.kv_heads);
    const long q_stride = static_cast<long>(p.heads) * D;
    const long kv_stride = static_cast<long>(p.kv_heads) * D;
    const long q_at = (static_cast<long>(b) * p.seq_q + m0) * q_stride + static_cast<long>(h) * D;
    const T* kb = k + static_cast<long>(b) * p.seq_kv * kv_stride + static_cast<long>(hk) * D;
    const T* vb = v + static_cast<long>(b) * p.seq_kv * kv_stride + static_cast<long>(hk) * D;
    const int rows = min(kDqRows, p.seq_q - m0);
    const int offset = p.seq_kv - p.seq_q;
    const int kv_end = p.causal ? max(0, min(p.seq_kv, m0 + rows + offset)) : p.seq_kv;
    // A sliding window of w keys (kWindow): the keys start at the tile of the first row's
    // first one.
    const int n_first =
        kWindow ? min(max(0, m0 + offset + 1 - p.window), kv_end) / kDqKeys * kDqKeys : 0;
    const int tiles_n = (kv_end - n_first + kDqKeys - 1) / kDqKeys;
    // lse2 and D rows: the first launch's layout, seq_q rounded up to 64.
    const int pad = (p.seq_q + 63) / 64 * 64;
    const long row_at = static_cast<long>(bh) * pad + m0;

    bwd_barriers<kDqStages>(full_q, full, empty);

    const int wg = warpgroup_index();
    if (wg == 0) {
        // ---- producer: Q and dO once, then K and V per key tile ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R::kProducer));
        const int tp = threadIdx.x;
        load_tile<T, D, kDqRows>(sq, q + q_at, q, q_stride, 0, rows, tp);
        load_tile<T, D, kDqRows>(sdo, dout + q_at, dout, q_stride, 0, rows, tp);
        mbar_arrive_on_copies(full_q);
        int s = 0;
        unsigned phase = 0;
        for (int t = 0; t < tiles_n; ++t) {
            const int n0 = n_first + t * kDqKeys;
            const int nk = min(kDqKeys, p.seq_kv - n0);
            mbar_wait(empty(s), phase ^ 1);
            load_tile<T, D, kDqKeys>(sk(s), kb + n0 * kv_stride, kb, kv_stride, 0, nk, tp);
            load_tile<T, D, kDqKeys>(sv(s), vb + n0 * kv_stride, vb, kv_stride, 0, nk, tp);
            mbar_arrive_on_copies(full(s));
            if (++s == kDqStages) {
                s = 0;
                phase ^= 1;
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // ---- consumers: 64 rows each ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R::kConsumer));
    const int c = wg - 1;
    const int t128 = threadIdx.x % 128, warp = t128 / 32, lane = t128 % 32;
    const int g = lane / 4, tig = lane % 4;
    const int r0 = c * 64 + warp * 16 + g;  // this thread's rows: r0 and r0 + 8 of the block
    const float scale2 = p.scale * kLog2e;
    // D = rowsum(dO o O) and lse2 of the two rows (four lanes per row, D / 4 elements
    // each); +inf and 0 past seq_q, +inf for a log-sum-exp that is not finite.
    float dsum[2], lse2[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r, qi = m0 + row;
        float acc = 0.0f;
        if (qi < p.seq_q) {
            constexpr int N = kpt::Vec<T>::N;
            const long at = q_at + row * q_stride + tig * (D / 4);
#pragma unroll
            for (int x = 0; x < D / 4; x += N) {
                float a[N], o[N];
                kpt::load_vec(dout + at + x, a);
                kpt::load_vec(out + at + x, o);
#pragma unroll
                for (int e = 0; e < N; ++e) acc += a[e] * o[e];
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        const float l = qi < p.seq_q ? lse_in[static_cast<long>(bh) * p.seq_q + qi] : INFINITY;
        dsum[r] = acc;
        lse2[r] = isfinite(l) ? l * kLog2e : INFINITY;
        if (tig == 0 && m0 + row < pad) {
            lse[row_at + row] = lse2[r];
            delta[row_at + row] = acc;
        }
    }

    const uint64_t qdesc = make_desc(kDescK, sq + c * 64 * 128);
    const uint64_t dodesc = make_desc(kDescK, sdo + c * 64 * 128);
    float dqa[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dqa[i] = 0.0f;
    mbar_wait(full_q, 0);
    fence_proxy_async();
    const int row_first = m0 + c * 64;  // the warpgroup's first row
    int s = 0;
    unsigned phase = 0;
    for (int t = 0; t < tiles_n; ++t) {
        const int n0 = n_first + t * kDqKeys;
        mbar_wait(full(s), phase);
        fence_proxy_async();
        // S = Q K^T and dP = dO V^T (64 rows x 64 keys).
        float st[32], dpt[32];
        bwd_scores<T, D, kDqRows>(st, dpt, qdesc, make_desc(kDescK, sk(s)), dodesc,
                                  make_desc(kDescK, sv(s)));
        // P and dS: element 4j + 2r + e is row r0 + 8r, key n0 + 8j + 2tig + e.
        const bool edge = mask != nullptr ||
                          (p.causal && n0 + kDqKeys - 1 > row_first + offset) ||
                          (kWindow && n0 < row_first + 64 + offset - p.window);
        uint32_t keep = ~0u;
        if constexpr (kDropout) keep = kpt::dropout_keep8(p, b, h, m0 + r0, n0, tig);
        bwd_probs<kDropout, kWindow>(
            st, dpt, edge, scale2, p, mask,
            [&](int j, int r, int e) { return make_int2(n0 + 8 * j + 2 * tig + e, m0 + r0 + 8 * r); },
            [&](int, int r, int) { return make_float2(lse2[r], dsum[r]); }, keep);
        uint32_t sf[4][4];
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
#pragma unroll
            for (int i = 0; i < 4; ++i) sf[kc][i] = pack2<T>(dpt[8 * kc + 2 * i], dpt[8 * kc + 2 * i + 1]);
        }
        const uint64_t kmn = mn_desc(sk(s), kDqKeys);
        fence_regs(dqa);
        fence_regs(sf);
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) wgmma_rs<T, D>(dqa, sf[kc], kmn + kc * (2048 >> 4));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dqa);
        fence_regs(sf);
        mbar_arrive(empty(s));
        if (++s == kDqStages) {
            s = 0;
            phase ^= 1;
        }
    }

    // dq = scale dQ: element 4j + 2r + e is row r0 + 8r, dim 8j + 2tig + e.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r;
        if (m0 + row >= p.seq_q) continue;
        T* dst = dq + q_at + static_cast<long>(row) * q_stride;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            *reinterpret_cast<uint32_t*>(dst + 8 * j + 2 * tig) =
                pack2<T>(dqa[4 * j + 2 * r] * p.scale, dqa[4 * j + 2 * r + 1] * p.scale);
        }
    }
}

#else  // not sm_90a: wgmma, setmaxnreg and these barriers do not exist; never launch it there.

template <typename T, int D, bool kMask, bool kTma, int BN = kBlockN, bool kCarry = false,
          int kPolyFp8 = KPT_FA3_POLY_FP8, bool kDropout = false, bool kPair = false,
          bool kStaged = false, bool kWindow = false, bool kVarlen = false>
__device__ __forceinline__ void flash_sm90(const T*, const T*, const T*, const float*, OutT<T>*,
                                           float*, const Dims&, float, Maps, Varlen = Varlen{}) {
    __trap();
}
template <typename T, int D, bool kDropout, bool kWindow>
__device__ __forceinline__ void bwd_dkdv_sm90(const T*, const T*, const T*, const float*,
                                              const T*, const float*, const float*, T*, T*,
                                              const Dims&) {
    __trap();
}
template <typename T, int D, bool kDropout, bool kWindow>
__device__ __forceinline__ void bwd_dq_sm90(const T*, const T*, const T*, const float*, const T*,
                                            const T*, const float*, T*, float*, float*,
                                            const Dims&) {
    __trap();
}

#endif

// The masked and unmasked kernels are separate code: the mask's loads would otherwise add to
// the register pressure of every call (at three consumer warpgroups, 160 registers each).
// kWindow: the sliding-window kernel, which takes no mask (the host sends masked windows to
// flash_attention.cu).
template <typename T, int D, bool kTma = false, bool kDropout = false, bool kWindow = false>
__device__ __forceinline__ void flash_sm90_entry(const T* q, const T* k, const T* v,
                                                 const float* mask, OutT<T>* out, float* lse,
                                                 const Dims& p, float out_scale,
                                                 Maps maps = Maps{}) {
    constexpr int kPoly = KPT_FA3_POLY_FP8;
    if constexpr (kWindow) {
        flash_sm90<T, D, false, kTma, kBlockN, false, kPoly, kDropout, false, false, true>(
            q, k, v, nullptr, out, lse, p, out_scale, maps);
    } else if (mask != nullptr) {
        flash_sm90<T, D, true, kTma, kBlockN, false, kPoly, kDropout>(q, k, v, mask, out, lse, p,
                                                                      out_scale, maps);
    } else {
        flash_sm90<T, D, false, kTma, kBlockN, false, kPoly, kDropout>(q, k, v, nullptr, out, lse,
                                                                       p, out_scale, maps);
    }
}

}  // namespace

#define KPT_FLASH_SM90(NAME, T, D)                                                         \
    extern "C" __global__ void __launch_bounds__(kThreads<T, D>, 1)                         \
        kpt_flash_attention_sm90_##NAME##_d##D(const T* q, const T* k, const T* v,         \
                                               const float* mask, T* out, float* lse,      \
                                               const Dims p) {                             \
        kpt::dependent_launch_prologue();                                                  \
        flash_sm90_entry<T, D>(q, k, v, mask, out, lse, p, 1.0f);                          \
    }

KPT_FLASH_SM90(bf16, __nv_bfloat16, 64)
KPT_FLASH_SM90(bf16, __nv_bfloat16, 128)
KPT_FLASH_SM90(f16, __half, 64)
KPT_FLASH_SM90(f16, __half, 128)

// Variable-length batches in one launch (kVarlen; the cp.async kernel without a mask,
// dropout or window): q and out [p.seq_q, heads * d], k and v [p.seq_kv, kv_heads * d],
// p.batch sequences at offsets cu_q and cu_k, int32 (idx64 = 0) or int64 [p.batch + 1];
// *bad (zeroed by the host) becomes 1 on invalid offsets. Grid: up to the
// (ceil(p.seq_q / kBlockM) + p.batch) * heads that bound the work tiles, fewer run the
// persistent grid (a block walks work tiles gridDim.x apart, carrying the K/V ring).
#define KPT_FLASH_SM90_VARLEN(NAME, T, D)                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads<T, D>, 1)                         \
        kpt_flash_attention_sm90_varlen_##NAME##_d##D(                                       \
            const T* q, const T* k, const T* v, T* out, const Dims p, const void* cu_q,     \
            const void* cu_k, int idx64, int* bad) {                                        \
        kpt::dependent_launch_prologue();                                                  \
        flash_sm90<T, D, false, false, kBlockN, false, KPT_FA3_POLY_FP8, false, false,      \
                   false, false, true>(q, k, v, nullptr, out, nullptr, p, 1.0f, Maps{},     \
                                       Varlen{cu_q, cu_k, idx64, bad});                    \
    }

KPT_FLASH_SM90_VARLEN(bf16, __nv_bfloat16, 64)
KPT_FLASH_SM90_VARLEN(bf16, __nv_bfloat16, 128)
KPT_FLASH_SM90_VARLEN(f16, __half, 64)
KPT_FLASH_SM90_VARLEN(f16, __half, 128)

// The same kernels with the K/V and Q tiles copied by TMA (one producer thread) from the
// tensor maps tq, tk, tv (128-byte swizzle, boxes of 128-byte column blocks by kBlockN
// or kBlockM rows by one batch; see the producer warpgroup in flash_sm90).
// TAG window_: the kernels for sliding windows (Dims::window; kWindow), without an additive
// mask or dropout (the host sends those to flash_attention.cu): each work tile starts at the
// key tile of its first row's first key, and tiles that cross a window's start mask per
// element.
#define KPT_FLASH_SM90_TMA(NAME, T, D, TAG, WINDOW)                                        \
    extern "C" __global__ void __launch_bounds__(kThreads<T, D>, 1)                         \
        kpt_flash_attention_sm90_tma_##TAG##NAME##_d##D(                                     \
            const T* q, const T* k, const T* v, const float* mask, T* out, float* lse,      \
            const Dims p, const __grid_constant__ TensorMap tq,                             \
            const __grid_constant__ TensorMap tk, const __grid_constant__ TensorMap tv) {   \
        kpt::dependent_launch_prologue();                                                  \
        flash_sm90_entry<T, D, true, false, WINDOW>(q, k, v, mask, out, lse, p, 1.0f,       \
                                                    Maps{&tq, &tk, &tv});                  \
    }

KPT_FLASH_SM90_TMA(bf16, __nv_bfloat16, 64, , false)
KPT_FLASH_SM90_TMA(bf16, __nv_bfloat16, 128, , false)
KPT_FLASH_SM90_TMA(f16, __half, 64, , false)
KPT_FLASH_SM90_TMA(f16, __half, 128, , false)
KPT_FLASH_SM90_TMA(bf16, __nv_bfloat16, 64, window_, true)
KPT_FLASH_SM90_TMA(bf16, __nv_bfloat16, 128, window_, true)
KPT_FLASH_SM90_TMA(f16, __half, 64, window_, true)
KPT_FLASH_SM90_TMA(f16, __half, 128, window_, true)

// The TMA kernels with attention dropout (Dims' dropout fields; see flash_sm90), for
// training: the host sends every dropout call on Hopper here (with or without a mask). Two
// consumer warpgroups at both head dims (128 query rows per block).
#define KPT_FLASH_SM90_TMA_DROPOUT(NAME, T, D)                                             \
    extern "C" __global__ void __launch_bounds__(kThreads<T, D, true>, 1)                   \
        kpt_flash_attention_sm90_tma_dropout_##NAME##_d##D(                                  \
            const T* q, const T* k, const T* v, const float* mask, T* out, float* lse,      \
            const Dims p, const __grid_constant__ TensorMap tq,                             \
            const __grid_constant__ TensorMap tk, const __grid_constant__ TensorMap tv) {   \
        kpt::dependent_launch_prologue();                                                  \
        flash_sm90_entry<T, D, true, true>(q, k, v, mask, out, lse, p, 1.0f,                \
                                           Maps{&tq, &tk, &tv});                           \
    }

KPT_FLASH_SM90_TMA_DROPOUT(bf16, __nv_bfloat16, 64)
KPT_FLASH_SM90_TMA_DROPOUT(bf16, __nv_bfloat16, 128)
KPT_FLASH_SM90_TMA_DROPOUT(f16, __half, 64)
KPT_FLASH_SM90_TMA_DROPOUT(f16, __half, 128)

// Entries without an additive mask (`mask` is ignored: the host sends masked calls to the
// entries above), each its own code, so that ptxas allocates registers for the unmasked path
// alone:
// - `carry_`, d = 64: the consumers' ping-pong running across a block's work tiles (kCarry;
//   ptxas spills 20 bytes there against 144 in the entries above);
// - `n160_carry_`, d = 128: the same on tiles of 160 keys, in two stages: fewer, longer key
//   tiles per work tile (ptxas spills 20 bytes, outside the key-tile loop; the 176-key tiles
//   of FlashAttention-3 spill 132 with the carry and were 0-5 % slower without it; 128-key
//   tiles with the carry were as fast at 2048 causal keys and 4 % slower at 16384);
//   both store their output through shared memory by TMA (kStaged; the map `to` has boxes
//   of one 128-byte column block by 64 rows);
// - `n176_x2_`, d = 128: 176-key tiles in clusters of two blocks that share their K/V
//   tiles (kPair), for calls without a causal mask where Gpu::kv_multicast is on;
//   launched with a cluster dimension of 2.
#define KPT_FLASH_SM90_TMA_PAIR(NAME, T)                                                   \
    extern "C" __global__ void __launch_bounds__(kThreads<T, 128>, 1)                       \
        kpt_flash_attention_sm90_tma_n176_x2_##NAME##_d128(                                  \
            const T* q, const T* k, const T* v, const float* mask, T* out, float* lse,      \
            const Dims p, const __grid_constant__ TensorMap tq,                             \
            const __grid_constant__ TensorMap tk, const __grid_constant__ TensorMap tv) {   \
        kpt::dependent_launch_prologue();                                                  \
        flash_sm90<T, 128, false, true, 176, false, KPT_FA3_POLY_FP8, false, true>(        \
            q, k, v, nullptr, out, lse, p, 1.0f, Maps{&tq, &tk, &tv});                      \
    }

KPT_FLASH_SM90_TMA_PAIR(bf16, __nv_bfloat16)
KPT_FLASH_SM90_TMA_PAIR(f16, __half)

#define KPT_FLASH_SM90_TMA_STAGED(TILE, NAME, T, D, BN)                                     \
    extern "C" __global__ void __launch_bounds__(kThreads<T, D>, 1)                         \
        kpt_flash_attention_sm90_tma_##TILE##NAME##_d##D(                                    \
            const T* q, const T* k, const T* v, const float* mask, T* out, float* lse,      \
            const Dims p, const __grid_constant__ TensorMap tq,                             \
            const __grid_constant__ TensorMap tk, const __grid_constant__ TensorMap tv,     \
            const __grid_constant__ TensorMap to) {                                         \
        kpt::dependent_launch_prologue();                                                  \
        flash_sm90<T, D, false, true, BN, true, KPT_FA3_POLY_FP8, false, false, true>(     \
            q, k, v, nullptr, out, lse, p, 1.0f, Maps{&tq, &tk, &tv, &to});                 \
    }

KPT_FLASH_SM90_TMA_STAGED(carry_, bf16, __nv_bfloat16, 64, kBlockN)
KPT_FLASH_SM90_TMA_STAGED(carry_, f16, __half, 64, kBlockN)
KPT_FLASH_SM90_TMA_STAGED(n160_carry_, bf16, __nv_bfloat16, 128, 160)
KPT_FLASH_SM90_TMA_STAGED(n160_carry_, f16, __half, 128, 160)

// FP8 with tiles of 192 keys (1.5 of the 128-key tile: half again as many scores per
// max, shuffle, O rescale and barrier), in three stages, the consumers' ping-pong running
// across a block's work tiles (kCarry). TMA only, and no additive mask (`mask` is ignored:
// the host sends masked calls to the 128-key entry). Two entries that differ in the exp2
// split alone: `_n192_` for calls without a causal mask takes every exp2 on the MUFU units,
// `_n192_causal_` one n8 block in KPT_FA3_POLY_FP8 on the FMA units (each measured faster
// for its calls, by 3 and 1.5 %). `_n192_x2_`: `_n192_`'s calls in clusters of two blocks
// that share their K/V tiles (kPair; the K map's boxes are 96 rows). All take the bf16
// output's map `to` (boxes of 64 columns by 64 rows); `_n192_causal_` stores through shared
// memory by TMA (kStaged: +1 % there; for `_n192_`'s calls -2 % and +-0 in two runs).
#define KPT_FLASH_SM90_FP8_N192(TILE, POLY, PAIR, STAGED)                                  \
    extern "C" __global__ void __launch_bounds__(kThreads<E4M3, 128>, 1)                    \
        kpt_flash_attention_sm90_tma_##TILE##e4m3_d128(                                      \
            const E4M3* q, const E4M3* k, const E4M3* vt, const float* mask,                \
            __nv_bfloat16* out, const Dims p, float v_scale,                                \
            const __grid_constant__ TensorMap tq, const __grid_constant__ TensorMap tk,     \
            const __grid_constant__ TensorMap tv, const __grid_constant__ TensorMap to) {   \
        kpt::dependent_launch_prologue();                                                  \
        flash_sm90<E4M3, 128, false, true, 192, true, POLY, false, PAIR, STAGED>(           \
            q, k, vt, nullptr, out, nullptr, p, v_scale, Maps{&tq, &tk, &tv, &to});         \
    }

KPT_FLASH_SM90_FP8_N192(n192_, 0, false, false)
KPT_FLASH_SM90_FP8_N192(n192_causal_, KPT_FA3_POLY_FP8, false, true)
KPT_FLASH_SM90_FP8_N192(n192_x2_, 0, true, false)

// The backward's dk / dv launch on wgmma (see bwd_dkdv_sm90): the arguments of
// flash_attention_bwd.cu's kpt_flash_attention_bwd_dkdv_*, 128 keys per block; and its dq
// launch given the forward's log-sum-exp. `_dropout_` entries apply Dims' dropout (separate
// code, so that the entries without it stay as they were).
#define KPT_FLASH_SM90_BWD(NAME, T, D, DROP, DROPOUT, WINDOW)                              \
    extern "C" __global__ void __launch_bounds__(384, 1)                                    \
        kpt_flash_attention_sm90_bwd_dkdv_##DROP##NAME##_d##D(                               \
            const T* q, const T* k, const T* v, const float* mask, const T* dout,           \
            const float* lse, const float* delta, T* dk, T* dv, const Dims p) {             \
        kpt::dependent_launch_prologue();                                                  \
        bwd_dkdv_sm90<T, D, DROPOUT, WINDOW>(q, k, v, mask, dout, lse, delta, dk, dv, p);  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(384, 1)                                    \
        kpt_flash_attention_sm90_bwd_dq_lse_##DROP##NAME##_d##D(                             \
            const T* q, const T* k, const T* v, const float* mask, const T* out,            \
            const T* dout, const float* lse_in, T* dq, float* lse, float* delta,            \
            const Dims p) {                                                                 \
        kpt::dependent_launch_prologue();                                                  \
        bwd_dq_sm90<T, D, DROPOUT, WINDOW>(q, k, v, mask, out, dout, lse_in, dq, lse, delta, \
                                           p);                                             \
    }

KPT_FLASH_SM90_BWD(bf16, __nv_bfloat16, 64, , false, false)
KPT_FLASH_SM90_BWD(bf16, __nv_bfloat16, 128, , false, false)
KPT_FLASH_SM90_BWD(f16, __half, 64, , false, false)
KPT_FLASH_SM90_BWD(f16, __half, 128, , false, false)
KPT_FLASH_SM90_BWD(bf16, __nv_bfloat16, 64, dropout_, true, false)
KPT_FLASH_SM90_BWD(bf16, __nv_bfloat16, 128, dropout_, true, false)
KPT_FLASH_SM90_BWD(f16, __half, 64, dropout_, true, false)
KPT_FLASH_SM90_BWD(f16, __half, 128, dropout_, true, false)
// Under a sliding window without dropout (kWindow; separate code, so that the entries above
// keep theirs): dq walks the key tiles inside its rows' windows, dk / dv the query tiles
// whose windows reach its keys. Windows with dropout run on flash_attention_bwd.cu.
KPT_FLASH_SM90_BWD(bf16, __nv_bfloat16, 64, window_, false, true)
KPT_FLASH_SM90_BWD(bf16, __nv_bfloat16, 128, window_, false, true)
KPT_FLASH_SM90_BWD(f16, __half, 64, window_, false, true)
KPT_FLASH_SM90_BWD(f16, __half, 128, window_, false, true)

// q, k [batch, seq, heads * 128] e4m3, vt from kpt_attention_fp8_v_transpose_d128, out bf16;
// p.scale includes q_scale * k_scale.
extern "C" __global__ void __launch_bounds__(kThreads<E4M3, 128>, 1)
    kpt_flash_attention_sm90_e4m3_d128(const E4M3* q, const E4M3* k, const E4M3* vt,
                                       const float* mask, __nv_bfloat16* out, const Dims p,
                                       float v_scale) {
    kpt::dependent_launch_prologue();
    flash_sm90_entry<E4M3, 128>(q, k, vt, mask, out, nullptr, p, v_scale);
}

extern "C" __global__ void __launch_bounds__(kThreads<E4M3, 128>, 1)
    kpt_flash_attention_sm90_tma_e4m3_d128(const E4M3* q, const E4M3* k, const E4M3* vt,
                                           const float* mask, __nv_bfloat16* out, const Dims p,
                                           float v_scale, const __grid_constant__ TensorMap tq,
                                           const __grid_constant__ TensorMap tk,
                                           const __grid_constant__ TensorMap tv) {
    kpt::dependent_launch_prologue();
    flash_sm90_entry<E4M3, 128, true>(q, k, vt, mask, out, nullptr, p, v_scale,
                                      Maps{&tq, &tk, &tv});
}

// V [batch, seq_kv, kv_heads * 128] (bytes) -> V^T [batch, kv_heads, 128, seq_kv rounded up to
// 128], keys of each 32-key block in the order of the FP8 P fragment (see the top of the file)
// and zeros past seq_kv. Block x: (batch * kv_heads + kv head) * key tiles + key tile, 128 keys.
// The 4 bytes at logical columns 4 m .. 4 m + 3 of a V^T row hold keys kb, kb + 1, kb + 8 and
// kb + 9 (kb = 32 (m / 8) + 16 ((m / 4) % 2) + 2 (m % 4)), so thread (m, c) = (x % 32, x / 32)
// loads one 16-byte chunk c (16 dimensions) of those four keys, transposes the 4 x 16 bytes in
// registers with byte permutes and stores 16 words, one per dimension; a warp (one c) writes
// 128 contiguous bytes of a V^T row per store. No shared memory.
// Grid: batch * kv_heads * ceil(seq_kv / 128) blocks of 256 threads; any arch.
extern "C" __global__ void __launch_bounds__(256)
    kpt_attention_fp8_v_transpose_d128(const uint8_t* __restrict__ v, uint8_t* __restrict__ vt,
                                       const Dims p) {
    kpt::dependent_launch_prologue();
    constexpr int kD = 128, kKeys = 128;
    const int tiles = (p.seq_kv + kKeys - 1) / kKeys;
    const int t = blockIdx.x % tiles;
    const int bh = blockIdx.x / tiles;  // batch * kv_heads + kv head
    if (bh >= p.batch * p.kv_heads) return;
    const int b = bh / p.kv_heads, hk = bh % p.kv_heads;
    const int n0 = t * kKeys;
    const int m = threadIdx.x % 32, c = threadIdx.x / 32;
    const int kb = n0 + 32 * (m / 8) + 16 * ((m / 4) % 2) + 2 * (m % 4);
    const long kv_stride = static_cast<long>(p.kv_heads) * kD;
    uint4 x[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int key = kb + r % 2 + 8 * (r / 2);
        x[r] = key < p.seq_kv
                   ? *reinterpret_cast<const uint4*>(
                         v + (static_cast<long>(b) * p.seq_kv + key) * kv_stride +
                         static_cast<long>(hk) * kD + c * 16)
                   : make_uint4(0, 0, 0, 0);
    }
    const long pad = static_cast<long>(tiles) * kKeys;
    uint8_t* dst = vt + (static_cast<long>(bh) * kD + 16 * c) * pad + n0 + 4 * m;
    const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&x[0]);
    const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&x[1]);
    const uint32_t* w2 = reinterpret_cast<const uint32_t*>(&x[2]);
    const uint32_t* w3 = reinterpret_cast<const uint32_t*>(&x[3]);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        // Bytes j of word w of keys kb, kb + 1 | kb + 8, kb + 9, interleaved.
        const uint32_t ab_lo = __byte_perm(w0[w], w1[w], 0x5140);
        const uint32_t ab_hi = __byte_perm(w0[w], w1[w], 0x7362);
        const uint32_t cd_lo = __byte_perm(w2[w], w3[w], 0x5140);
        const uint32_t cd_hi = __byte_perm(w2[w], w3[w], 0x7362);
        const uint32_t out[4] = {__byte_perm(ab_lo, cd_lo, 0x5410), __byte_perm(ab_lo, cd_lo, 0x7632),
                                 __byte_perm(ab_hi, cd_hi, 0x5410), __byte_perm(ab_hi, cd_hi, 0x7632)};
#pragma unroll
        for (int j = 0; j < 4; ++j)
            *reinterpret_cast<uint32_t*>(dst + static_cast<long>(4 * w + j) * pad) = out[j];
    }
}
