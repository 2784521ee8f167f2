// Linear with few rows (decode): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for
// x [M, K], w [N, K] row-major (kpt's Linear layout), M <= 32. At such M a GEMM is
// bound by reading the weights once, so the kernel is built for bandwidth.
//
// CUDA-core classes (kMaxM 1, 2, 4; for f32 also 8, 16, 32): two warps per weight row
// (kSplit; 1.1B LLaMA's down projection has only 2048 rows, and one warp per row left too
// few bytes in flight), each lane reading 16-byte vectors of it (kUnroll = 8 loads in
// flight before the first use, 4 at 32 rows) with a streaming cache hint, so each warp
// reads contiguous 512-byte runs of the row; the two warps' sums meet in shared memory;
// the M activation rows (a few KiB, cached in L1/L2) are read with the same vectors and
// every weight element meets every row in an f32 FMA.
//
// Tensor-core classes (kMaxM 8, 16, 32 for bf16 / f16): M FMAs per weight element make
// the CUDA cores, not memory, the limit from a few rows on (and each activation vector
// is read from L1 once per weight vector and row), so these classes run on m16n8k16
// MMAs: a block takes 16 weight rows, the A operand, and the activations are B in one,
// two or four n-tiles of 8 rows. The reduction order within a 16-element MMA step is
// free, so each lane loads whole 16-byte vectors of weights and activations straight
// from global memory into its fragments (lane g, u of a warp holds weight rows g and
// g + 8 and activation rows 8j + g at the same 8 k, which serve as the fragments'
// columns 2u..2u+1 and 2u+8..2u+9 of two MMAs): no shared memory, no ldmatrix. Weights
// bypass L1 so that the activations, read by every block, stay there. The 8 warps of a
// block split K in steps of 256 (8 vectors of each of its two rows in flight per lane,
// four lanes reading 64 contiguous bytes of a row per vector) and meet in shared memory.
//
// Weights that no kernel writes (`preload`: the model's parameters) are read before the
// 16-bit kernels wait for their producer: under programmatic dependent launch a block that
// is resident early issues its first batch of weight loads (the whole row run of a small
// projection) while the kernel before it still runs, and only the activation reads wait.
//
// The staged one-row classes (kpt_gemv_staged_*_m1, bf16 / f16, K <= 8192; the
// launcher's choice for one row): the activation row converted to f32 in shared memory
// once per block, batches of 4 weight vectors summed without a bounds branch (see gemv).
// bf16 elements are unpacked with one shift or mask each (unpack16).
//
// f32 accumulation, one rounding of the sum plus bias to the output dtype (as cuBLASLt's
// epilogue). Rows whose bytes are not whole 16-byte vectors, or unaligned buffers
// (`vec` = 0), take a scalar loop. The launcher picks the smallest class >= M.
//
// kpt:launch kpt_gemv_f32_m1 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m2 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m4 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m8 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m16 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f32_m32 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m1 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m2 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m4 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_bf16_m8 block=256 shared=0 grid=row_tiles
// kpt:launch kpt_gemv_bf16_m16 block=256 shared=0 grid=row_tiles
// kpt:launch kpt_gemv_bf16_m32 block=256 shared=0 grid=row_tiles
// kpt:launch kpt_gemv_f16_m1 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m2 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m4 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_f16_m8 block=256 shared=0 grid=row_tiles
// kpt:launch kpt_gemv_f16_m16 block=256 shared=0 grid=row_tiles
// kpt:launch kpt_gemv_f16_m32 block=256 shared=0 grid=row_tiles
// kpt:launch kpt_gemv_staged_bf16_m1 block=256 shared=0 grid=rows
// kpt:launch kpt_gemv_staged_f16_m1 block=256 shared=0 grid=rows

#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
// Warps per weight row (a split of its K), and rows per block.
constexpr int kSplit = 2;
constexpr int kRowsPerBlock = kWarps / kSplit;
constexpr int kUnroll = 8;

using kpt::to_float;

// Sizes of one call (the launcher's GemvDims).
struct GemvDims {
    int m;    // activation rows, 1..=kMaxM
    int n;    // weight rows = output columns
    int k;    // reduction length
    int vec;  // 1: rows are whole 16-byte vectors and every buffer is aligned
    int preload;  // 1: no kernel writes w, so it may be read before the producer is done
};

// Streaming 16-byte load: weights are read once per call, so they should not evict
// the activations.
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

// 16-byte weight load of the tensor-core path, not allocated in L1: there the activations
// (up to 32 rows of K) are read again by every block and should stay in L1.
__device__ __forceinline__ uint4 load_no_l1(const uint4* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// The 8 elements of a 16-byte vector of T as f32. bf16 is the upper half of an f32, so
// each element is one shift or mask of its 32-bit word (the generic conversion takes two
// instructions for every upper element).
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& v, float (&f)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            f[2 * j] = __uint_as_float(w[j] << 16);
            f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        } else {
            const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
            f[2 * j] = h.x;
            f[2 * j + 1] = h.y;
        }
    }
}

// Dot product of a 16-byte vector of 16-bit T with 8 f32 elements (lo: 0-3, hi: 4-7),
// accumulated into acc in element order.
template <typename T>
__device__ __forceinline__ float dot16_f32(const uint4& a, const float4& lo, const float4& hi,
                                           float acc) {
    float fa[8];
    unpack16<T>(a, fa);
    const float fb[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(fa[i], fb[i], acc);
    return acc;
}

// Dot product of two 16-byte vectors of T, accumulated into acc in element order (for
// 16-bit T, dot16_f32 of b's elements: the staged classes' sums are the same bits).
template <typename T>
__device__ __forceinline__ float dot16(const uint4& a, const uint4& b, float acc) {
    if constexpr (sizeof(T) == 2) {
        float fb[8];
        unpack16<T>(b, fb);
        return dot16_f32<T>(a, make_float4(fb[0], fb[1], fb[2], fb[3]),
                            make_float4(fb[4], fb[5], fb[6], fb[7]), acc);
    } else {
        const T* ea = reinterpret_cast<const T*>(&a);
        const T* eb = reinterpret_cast<const T*>(&b);
#pragma unroll
        for (int i = 0; i < kpt::Vec<T>::N; ++i) acc = fmaf(to_float(ea[i]), to_float(eb[i]), acc);
        return acc;
    }
}

// 16-byte activation vectors the one-row 16-bit classes stage in shared memory as f32
// (32 KiB): K up to 8192.
constexpr int kStageVecs = 1024;

template <typename T, int kMaxM, bool kStage = false>
__device__ void gemv(const T* __restrict__ x, const T* __restrict__ w,
                     const T* __restrict__ bias, T* __restrict__ out, GemvDims d) {
    static_assert(!kStage || (sizeof(T) == 2 && kMaxM == 1), "one 16-bit row is staged");
    __shared__ float partial[kWarps][kMaxM];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const long row = static_cast<long>(blockIdx.x) * kRowsPerBlock + warp / kSplit;
    // The kSplit warps of a row act as one group of kSplit * 32 lanes.
    const int glane = (warp % kSplit) * 32 + lane;
    constexpr int kGroup = kSplit * 32;
    const bool active = row < d.n;
    float acc[kMaxM];
#pragma unroll
    for (int r = 0; r < kMaxM; ++r) acc[r] = 0.0f;
    // Weight vectors in flight per lane: at 32 rows the accumulators take the registers
    // that half of them would (f32's 32-row class; the others run on tensor cores). The
    // staged class reads batches of 4 (a 2048-wide row gives each lane exactly 4
    // vectors; 46 registers, five blocks an SM) and sums them without a bounds branch:
    // vectors past the row are zero weights against the zero vector at xs[.][kStageVecs].
    constexpr int kU = kStage || kMaxM > 16 ? kUnroll / 2 : kUnroll;
    constexpr int kV = kpt::Vec<T>::N;
    const int vecs = d.k / kV;
    const uint4* w_row = reinterpret_cast<const uint4*>(w + row * d.k);
    const uint4* x_vec = reinterpret_cast<const uint4*>(x);
    // Batches of kU weight vectors of the row from `base` on, and their sums against the
    // activations at the same k. f32 forms the pointers inside (hoisted, they cost its
    // 32-row class 80 registers), bf16 / f16 outside (inside, 6 more at one row).
    constexpr bool kHoist = sizeof(T) == 2;
    auto load_batch = [&](uint4(&v)[kU], int base) {
        const uint4* wr = kHoist ? w_row : reinterpret_cast<const uint4*>(w + row * d.k);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int i = base + u * kGroup;
            v[u] = i < vecs ? load_stream(wr + i) : make_uint4(0, 0, 0, 0);
        }
    };
    // kStage (kpt_gemv_staged_*): the activation row converted to f32 once per block,
    // vector i's elements 0-3 in xs[0][i], 4-7 in xs[1][i] (consecutive lanes read
    // consecutive 16 bytes), so a weight vector costs two shared loads instead of a
    // global load and eight conversions. K <= 8 kStageVecs (the launcher's rule; longer
    // rows would take the scalar loop).
    __shared__ float4 xs[2][kStage ? kStageVecs + 1 : 1];
    const bool staged = kStage && d.vec && vecs <= kStageVecs;  // uniform over the block
    auto consume = [&](const uint4(&v)[kU], int base) {
        const uint4* xr = kHoist ? x_vec : reinterpret_cast<const uint4*>(x);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int i = base + u * kGroup;
            if constexpr (kStage) {
                const int at = i < vecs ? i : kStageVecs;
                acc[0] = dot16_f32<T>(v[u], xs[0][at], xs[1][at], acc[0]);
            } else if (i < vecs) {
#pragma unroll
                for (int r = 0; r < kMaxM; ++r)
                    if (r < d.m)
                        acc[r] = dot16<T>(v[u], __ldg(xr + static_cast<long>(r) * vecs + i),
                                          acc[r]);
            }
        }
    };
    // The 16-bit classes peel the first batch so that it can be issued before the wait;
    // f32 keeps one loop (peeled, its wider classes took more registers).
    const bool vector = active && d.vec && (!kStage || staged);
    if constexpr (sizeof(T) == 2) {
        uint4 first[kU];
        if (vector && d.preload) load_batch(first, glane);
        kpt::dependent_launch_prologue();
        if (staged) {
            for (int i = threadIdx.x; i < vecs; i += kBlock) {
                float e[8];
                unpack16<T>(__ldg(x_vec + i), e);
                xs[0][i] = make_float4(e[0], e[1], e[2], e[3]);
                xs[1][i] = make_float4(e[4], e[5], e[6], e[7]);
            }
            if (threadIdx.x == 0) xs[0][kStageVecs] = xs[1][kStageVecs] = make_float4(0, 0, 0, 0);
            __syncthreads();
        }
        if (vector) {
            if (!d.preload) load_batch(first, glane);
            consume(first, glane);
        }
    } else {
        kpt::dependent_launch_prologue();
    }
    if (vector) {
        for (int base = glane + (sizeof(T) == 2 ? kGroup * kU : 0); base < vecs;
             base += kGroup * kU) {
            uint4 v[kU];
            load_batch(v, base);
            consume(v, base);
        }
    } else if (active) {
        const T* wr = w + row * d.k;
        for (int i = glane; i < d.k; i += kGroup) {
            const float wi = to_float(wr[i]);
#pragma unroll
            for (int r = 0; r < kMaxM; ++r)
                if (r < d.m) acc[r] = fmaf(wi, to_float(x[static_cast<long>(r) * d.k + i]), acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < kMaxM; ++r) {
        const float s = kpt::warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = s;
    }
    __syncthreads();
    if (!active || warp % kSplit != 0) return;
    const float b = bias ? to_float(bias[row]) : 0.0f;
    for (int r = lane; r < d.m; r += 32) {
        float s = b;
#pragma unroll
        for (int j = 0; j < kSplit; ++j) s += partial[warp + j][r];
        out[static_cast<long>(r) * d.n + row] = kpt::from_float<T>(s);
    }
}

// The tensor-core path: weight rows per block (the MMA's M), 16-byte vectors of each of
// a lane's two weight rows in flight, and the k one warp covers per step (four lanes of
// 8 elements per vector).
constexpr int kTileRows = 16;
constexpr int kTcUnroll = 8;
constexpr int kTcStep = 4 * 8 * kTcUnroll;

// Scalar loop of the tensor-core classes (rows not of whole vectors, unaligned buffers):
// warp w of the block takes weight rows 2w and 2w + 1 of its tile, lane l every 32nd k.
template <typename T, int kMaxM>
__device__ void gemv_tile_scalar(const T* __restrict__ x, const T* __restrict__ w,
                                 const T* __restrict__ bias, T* __restrict__ out,
                                 GemvDims d) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    static_assert(kTileRows == 2 * kWarps, "two weight rows per warp");
    for (int half = 0; half < 2; ++half) {
        const long row = static_cast<long>(blockIdx.x) * kTileRows + 2 * warp + half;
        if (row >= d.n) return;
        float acc[kMaxM];
#pragma unroll
        for (int r = 0; r < kMaxM; ++r) acc[r] = 0.0f;
        const T* wr = w + row * d.k;
        for (int i = lane; i < d.k; i += 32) {
            const float wi = to_float(wr[i]);
#pragma unroll
            for (int r = 0; r < kMaxM; ++r)
                if (r < d.m) acc[r] = fmaf(wi, to_float(x[static_cast<long>(r) * d.k + i]), acc[r]);
        }
        const float b = bias ? to_float(bias[row]) : 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxM; ++r) {
            const float s = kpt::warp_sum(acc[r]);
            if (lane == r && r < d.m) out[static_cast<long>(r) * d.n + row] = kpt::from_float<T>(b + s);
        }
    }
}

// Tensor-core GEMV for kTiles * 8 activation rows (bf16 / f16); see the file comment.
template <typename T, int kTiles>
__device__ void gemv_tc(const T* __restrict__ x, const T* __restrict__ w,
                        const T* __restrict__ bias, T* __restrict__ out, GemvDims d) {
    constexpr int kM = kTiles * 8;
    if (!d.vec) {
        kpt::dependent_launch_prologue();
        gemv_tile_scalar<T, kM>(x, w, bias, out, d);
        return;
    }
    // Per warp, its sums for the tile's 16 weight rows x kM activation rows (padded
    // against bank conflicts).
    __shared__ float partial[kWarps][kTileRows][kM + 1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int u4 = lane & 3;
    const long row0 = static_cast<long>(blockIdx.x) * kTileRows;
    const long ra = row0 + g;
    const long rb = ra + 8;
    const bool oka = ra < d.n;
    const bool okb = rb < d.n;
    const T* wa_row = w + (oka ? ra : 0) * d.k;
    const T* wb_row = w + (okb ? rb : 0) * d.k;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float c[kTiles][4];
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[j][e] = 0.0f;
    // The weight vectors of the k-step from k0 on.
    uint4 wa[kTcUnroll];
    uint4 wb[kTcUnroll];
    auto load_step = [&](int k0) {
#pragma unroll
        for (int u = 0; u < kTcUnroll; ++u) {
            // d.k is a multiple of 8 here, so a vector is wholly inside or outside.
            const int kk = k0 + u * 32 + u4 * 8;
            const bool in = kk < d.k;
            wa[u] = in && oka ? load_no_l1(reinterpret_cast<const uint4*>(wa_row + kk)) : zero;
            wb[u] = in && okb ? load_no_l1(reinterpret_cast<const uint4*>(wb_row + kk)) : zero;
        }
    };
    if (d.preload) load_step(warp * kTcStep);
    kpt::dependent_launch_prologue();
    if (!d.preload) load_step(warp * kTcStep);
    for (int k0 = warp * kTcStep; k0 < d.k; k0 += kWarps * kTcStep) {
        if (k0 != warp * kTcStep) load_step(k0);
#pragma unroll
        for (int u = 0; u < kTcUnroll; ++u) {
            if (k0 + u * 32 >= d.k) break;
            const int kk = k0 + u * 32 + u4 * 8;
            const bool in = kk < d.k;
            // This step's activation vectors of every n-tile first, then the MMAs.
            uint4 xv[kTiles];
#pragma unroll
            for (int j = 0; j < kTiles; ++j) {
                const int r = j * 8 + g;
                xv[j] = in && r < d.m ? __ldg(reinterpret_cast<const uint4*>(
                                            x + static_cast<long>(r) * d.k + kk))
                                      : zero;
            }
            const unsigned lo[4] = {wa[u].x, wb[u].x, wa[u].y, wb[u].y};
            const unsigned hi[4] = {wa[u].z, wb[u].z, wa[u].w, wb[u].w};
#pragma unroll
            for (int j = 0; j < kTiles; ++j) {
                if (j * 8 >= d.m) break;
                kpt::mma<T>(c[j], lo, xv[j].x, xv[j].y);
                kpt::mma<T>(c[j], hi, xv[j].z, xv[j].w);
            }
        }
    }
    // c[j] = {(row g, x rows 8j + 2u, +1), (row g + 8, the same x rows)}.
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
        const int r = j * 8 + 2 * u4;
        partial[warp][g][r] = c[j][0];
        partial[warp][g][r + 1] = c[j][1];
        partial[warp][g + 8][r] = c[j][2];
        partial[warp][g + 8][r + 1] = c[j][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kTileRows * kM; i += kBlock) {
        const int r = i / kTileRows;
        const int t = i % kTileRows;
        const long row = row0 + t;
        if (r >= d.m || row >= d.n) continue;
        float s = bias ? to_float(bias[row]) : 0.0f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v) s += partial[v][t][r];
        out[static_cast<long>(r) * d.n + row] = kpt::from_float<T>(s);
    }
}

}  // namespace

#define KPT_GEMV_BOUNDED(NAME, T, M, BLOCKS_PER_SM)                                        \
    extern "C" __global__ void __launch_bounds__(kBlock, BLOCKS_PER_SM)                   \
        kpt_gemv_##NAME##_m##M(const T* x, const T* w, const T* bias, T* out, GemvDims d) { \
        gemv<T, M>(x, w, bias, out, d);                                                   \
    }
#define KPT_GEMV(NAME, T, M)                                                              \
    extern "C" __global__ void __launch_bounds__(kBlock)                                  \
        kpt_gemv_##NAME##_m##M(const T* x, const T* w, const T* bias, T* out, GemvDims d) { \
        gemv<T, M>(x, w, bias, out, d);                                                   \
    }

// The 8-, 16- and 32-row classes of bf16 / f16 on tensor cores (one, two and four
// n-tiles), two blocks per SM (at most 128 registers a thread).
#define KPT_GEMV_TC(NAME, T, M)                                                           \
    extern "C" __global__ void __launch_bounds__(kBlock, 2)                               \
        kpt_gemv_##NAME##_m##M(const T* x, const T* w, const T* bias, T* out, GemvDims d) { \
        gemv_tc<T, M / 8>(x, w, bias, out, d);                                            \
    }

#define KPT_GEMV_STAGED(NAME, T)                                                          \
    extern "C" __global__ void __launch_bounds__(kBlock) kpt_gemv_staged_##NAME##_m1(      \
        const T* x, const T* w, const T* bias, T* out, GemvDims d) {                       \
        gemv<T, 1, true>(x, w, bias, out, d);                                              \
    }

// The 16-bit one-row classes are held to five blocks an SM (48 registers), which the
// compiler would otherwise trade for unpacking weights ahead.
#define KPT_GEMV_CUDA_CORES(NAME, T) \
    KPT_GEMV_BOUNDED(NAME, T, 1, 5)  \
    KPT_GEMV(NAME, T, 2)             \
    KPT_GEMV(NAME, T, 4)

#define KPT_GEMV_TENSOR_CORES(NAME, T) \
    KPT_GEMV_TC(NAME, T, 8)            \
    KPT_GEMV_TC(NAME, T, 16)           \
    KPT_GEMV_TC(NAME, T, 32)

KPT_GEMV(f32, float, 1)
KPT_GEMV(f32, float, 2)
KPT_GEMV(f32, float, 4)
KPT_GEMV(f32, float, 8)
KPT_GEMV(f32, float, 16)
KPT_GEMV(f32, float, 32)
KPT_GEMV_CUDA_CORES(bf16, __nv_bfloat16)
KPT_GEMV_TENSOR_CORES(bf16, __nv_bfloat16)
KPT_GEMV_CUDA_CORES(f16, __half)
KPT_GEMV_TENSOR_CORES(f16, __half)
KPT_GEMV_STAGED(bf16, __nv_bfloat16)
KPT_GEMV_STAGED(f16, __half)
