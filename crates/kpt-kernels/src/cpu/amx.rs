//! bf16 matrix products on Intel AMX tiles (Sapphire Rapids and later): the matmul
//! behind [`matmul_bf16`](super::matmul_bf16), and [`Tiles`], the bounds-checked tile
//! products that the AMX attention builds on. Used when the CPU and the OS offer AMX.
//!
//! The tile loads read A in place, row-major: each 16-row tile is 16 rows of 32 bf16 at
//! A's row stride. Only blocks that cannot be read that way are copied, zero-padded
//! (rows not a multiple of 32 elements, the last partial 32-row block, and, when B is
//! wide, row strides that would pile a block's rows into a few L1 sets, see
//! [`spreads_in_l1`] and [`COPY_A_MIN_N`]). B is packed
//! into 1 KiB tiles in the pair-interleaved ("VNNI") layout `TDPBF16PS` reads: 16 rows of
//! k-pairs, each holding 16 columns × 2 consecutive k, a column panel's k tiles one after
//! the other. The micro-kernel keeps a 32 × 32 f32 output block in four accumulator tiles
//! (`tmm0..3`); per 32-wide k step it loads two A tiles (`tmm4..5`) and two B tiles
//! (`tmm6..7`) back to back, so that their latencies overlap, then issues the four
//! `TDPBF16PS` (f32 accumulation of bf16 products, like the portable path), with
//! prefetches of the B tiles two steps ahead between them. The tile loads, not the
//! products, bound the kernel: on a 16-vCPU Sapphire Rapids VM the products alone ran
//! 2.5-3x faster than the loop with its loads; loads issued back to back beat loads
//! interleaved with the products, and the prefetches added about 20% with all threads
//! busy.
//! Tasks own a 128 × 128 output rectangle each (64 × 64 when that leaves fewer than
//! four tasks per thread), run by [`for_each_task`](super::par::for_each_task), and
//! accumulate it in f32 over passes of 512 k: within a pass one 32-row A block (32 KiB)
//! stays in L1 while it meets the task's B blocks (in L2). A 64 × 64 task prefetches the
//! next A block into L2 while the current one meets its two column blocks. Each task
//! packs the B panels it needs that no other task did yet ([`LazyPanels`]), into
//! [`Scratch`] buffers; the A blocks that are copied are copied before the tasks start.
//!
//! CPUs with AVX-512-BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake) run the
//! same driver, packing and task split with `VDPBF16PS` on zmm registers in place of the
//! tile products ([`Engine::Dp`]): a B tile row is exactly one zmm of 16 columns × 2 k,
//! and each A row's k pair is broadcast to all lanes. On a 2-core Zen 4 it ran 512² to
//! 2048 × 2048 × 5632 at 360-420 GFLOP/s, against 90-185 for widening to f32.
//!
//! The tile instructions are written as inline assembly: Rust's AMX intrinsics are not
//! stable. Linux only grants the tile state to a process that asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`] asks once.

use half::bf16;

use super::panels::LazyPanels;
use super::par::for_each_row;
use super::scratch::Scratch;
use super::sgemm::Epilogue;
use super::simd::{dispatch, Encode};

/// Rows / columns of one output micro-block (two tiles each way).
const MB: usize = 32;
/// k elements per tile step.
const KB: usize = 32;
/// bf16 elements in one 1 KiB tile.
pub(crate) const TILE: usize = 512;
/// Output rows / columns per rayon task (halved for small products, see `task_size`).
const TASK: usize = 128;
/// k tiles per pass over a task's blocks: one A block (32 × 512 bf16, 32 KiB) then stays
/// in L1 while it meets the task's B blocks (in L2).
const KSTEPS: usize = 16;

/// Columns of B from which A's blocks are copied when their rows pile into a few L1
/// sets (see [`spreads_in_l1`]). The copy is a parallel phase of its own that reads and
/// writes A once; it pays only when each A block meets many column blocks. On the
/// 16-core Xeon VM, reading in place ran 1024² 6-33% faster, 2048² -3% to +34%, and the
/// MLP shape (n = 5632) about 6% slower than copying.
const COPY_A_MIN_N: usize = 4096;

/// Whether AMX-BF16 can run in this process: the CPU has it, the OS saves its state and
/// granted this process the tile data permission, and `KPT_CPU_AMX` is not `off` (or
/// `0`), which makes kpt use its AVX-512 / AVX2 kernels instead.
pub(crate) fn available() -> bool {
    imp::available()
}

/// `out[m, n] = a[m, k] · b[k, n]` on AMX tiles (row-major, lengths checked by the
/// caller), f32 accumulation and one rounding to `T`. Returns false (and does nothing)
/// when neither AMX ([`available`]) nor AVX-512-BF16 can run it.
pub(crate) fn matmul_bf16<T: Encode>(
    a: &[bf16],
    b: &[bf16],
    out: &mut [T],
    m: usize,
    k: usize,
    n: usize,
) -> bool {
    engine().is_some_and(|e| {
        matmul_with(e, a, b, BLayout::KByN, out, (m, k, n), None);
        true
    })
}

/// `out[m, n] = a[m, k] · w[n, k]ᵀ` (a linear layer's product, `w` in PyTorch's layout)
/// as [`matmul_bf16`] computes it, with `epilogue(segment, first column)` applied to
/// each f32 output row segment before it is stored. Returns false (and does nothing)
/// when this CPU has no bf16 engine.
pub(crate) fn linear_bf16(
    a: &[bf16],
    w: &[bf16],
    out: &mut [f32],
    (m, k, n): (usize, usize, usize),
    epilogue: Option<Epilogue<'_>>,
) -> bool {
    engine().is_some_and(|e| {
        matmul_with(e, a, w, BLayout::NByK, out, (m, k, n), epilogue);
        true
    })
}

/// Whether this CPU runs bf16 products (AMX or AVX-512-BF16).
pub(crate) fn bf16_products() -> bool {
    engine().is_some()
}

/// The fastest engine this CPU runs.
fn engine() -> Option<Engine> {
    if available() {
        Some(Engine::Amx)
    } else if imp::dp_available() {
        Some(Engine::Dp)
    } else {
        None
    }
}

/// How B is stored.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum BLayout {
    /// `k × n`, row-major.
    KByN,
    /// `n × k`, row-major (Bᵀ; a linear layer's weight).
    NByK,
}

/// [`matmul_bf16`] on `engine`, which this CPU runs, with B stored as `layout` says.
fn matmul_with<T: Encode>(
    engine: Engine,
    a: &[bf16],
    b: &[bf16],
    layout: BLayout,
    out: &mut [T],
    (m, k, n): (usize, usize, usize),
    epilogue: Option<Epilogue<'_>>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        let mut zero = vec![0f32; n];
        for row in out[..m * n].chunks_exact_mut(n) {
            zero.fill(0.0);
            if let Some(epi) = epilogue {
                epi(&mut zero, 0);
            }
            T::encode_slice(&zero, row);
        }
        return;
    }
    let kt = k.div_ceil(KB);
    let in_place = if k.is_multiple_of(KB) && (n < COPY_A_MIN_N || spreads_in_l1(k, kt)) {
        m / MB
    } else {
        0
    };
    // A few lines past the padded length spread (see the tests); else take the padded one.
    let lda = (kt * KB..)
        .step_by(KB)
        .take(4)
        .find(|&l| spreads_in_l1(l, kt))
        .unwrap_or(kt * KB);
    let mut ap = Scratch::new((m.div_ceil(MB) - in_place) * MB * lda);
    let a = ABlocks::new(bytemuck::cast_slice(a), (m, k), in_place, lda, &mut ap);
    let mut bp = Scratch::new(n.next_multiple_of(MB) / 16 * kt * TILE);
    let b = BPanels {
        b,
        layout,
        k,
        n,
        packed: LazyPanels::new(&mut bp, kt * TILE),
    };
    imp::run(&a, &b, out, (m, n, kt), engine, epilogue);
}

/// What computes the 32 × 32 output blocks of [`matmul_bf16`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    /// AMX tiles.
    Amx,
    /// AVX-512-BF16 `VDPBF16PS` on zmm registers, for CPUs without AMX (Zen 4,
    /// Cooper Lake): same operand layouts, a pair of k per instruction.
    Dp,
    /// Tests: the tile products in scalar code, so that the driver (task split, A
    /// blocks, B panels, rounding into the output) is checked on any CPU.
    #[cfg(test)]
    Emulated,
}

/// Whether the 32 rows of an A block, `lda` elements apart, spread over the L1 data
/// cache (64 sets of 12 64-byte lines, as on Sapphire Rapids): a pass reads up to
/// `KSTEPS` of the `kt` k tiles, a line each, of every row, and no set may hold more than
/// 10 of them (two ways stay for B and C). Row strides that are multiples of 2 KiB pile
/// the rows into a few sets, which evict each other on every pass.
fn spreads_in_l1(lda: usize, kt: usize) -> bool {
    let mut per_set = [0u8; 64];
    for r in 0..MB {
        for line in 0..kt.min(KSTEPS) {
            per_set[(r * lda * 2 / 64 + line) % 64] += 1;
        }
    }
    per_set.iter().all(|&c| c <= 10)
}

/// A's 32-row blocks as the tile loads read them, row-major with rows a multiple of 32
/// elements long: blocks `..in_place` in place (when `k` is a multiple of 32 and the
/// rows [spread in L1](spreads_in_l1), the full blocks), the others zero-padded copies
/// with rows `lda` apart.
struct ABlocks<'a> {
    /// A (`m × k`) as bf16 bits.
    a: &'a [u16],
    k: usize,
    in_place: usize,
    lda: usize,
    /// Blocks `in_place..`, `32 × lda` elements each.
    copied: &'a [u16],
}

impl<'a> ABlocks<'a> {
    /// The blocks of `a` (`m × k`), those from `in_place` on copied into `buf` (`32 ×
    /// lda` elements per block) by all threads. The copies get a parallel phase of
    /// their own: copied on first use by the tasks, every task after the first queued
    /// behind the one thread copying a block (1024² on 16 threads: a quarter of the
    /// threads' time went to those waits).
    fn new(
        a: &'a [u16],
        (m, k): (usize, usize),
        in_place: usize,
        lda: usize,
        buf: &'a mut [u16],
    ) -> Self {
        for_each_row(buf, MB * lda, MB * k, |p, dst| {
            for (r, row) in dst.chunks_exact_mut(lda).enumerate() {
                let src = (in_place + p) * MB + r;
                if src < m {
                    row[..k].copy_from_slice(&a[src * k..][..k]);
                    row[k..].fill(0);
                } else {
                    row.fill(0);
                }
            }
        });
        ABlocks {
            a,
            k,
            in_place,
            lda,
            copied: buf,
        }
    }

    /// Block `i` (rows `32i..32i + 32`) and its row length in elements; `k.div_ceil(32)`
    /// tiles of 32 elements are readable in each of its 32 rows.
    fn block(&self, i: usize) -> (&[u16], usize) {
        if i < self.in_place {
            return (&self.a[i * MB * self.k..][..MB * self.k], self.k);
        }
        let len = MB * self.lda;
        (&self.copied[(i - self.in_place) * len..][..len], self.lda)
    }
}

/// B's 16-column panels in the tile layout `TDPBF16PS` reads, packed by the tasks on
/// first use ([`pack_b_tiles`]).
struct BPanels<'a> {
    b: &'a [bf16],
    layout: BLayout,
    k: usize,
    n: usize,
    packed: LazyPanels<'a, u16>,
}

impl BPanels<'_> {
    /// Panels `range` (columns `16 * range.start..16 * range.end`), `k.div_ceil(32)`
    /// tiles each.
    fn panels(&self, range: std::ops::Range<usize>) -> &[u16] {
        self.packed.get(range, |t, dst| match self.layout {
            BLayout::KByN => pack_b_tiles(dst, t, self.b, self.n, self.k, self.n),
            BLayout::NByK => pack_bt_tiles(dst, t, self.b, self.k, self.k, self.n),
        })
    }
}

dispatch!(
    /// Packs columns `16t..16t + 16` of B (`k × n`, row `kk` at `b[kk * ldb..]`) into the
    /// `k.div_ceil(32)` tiles of `dst` as 16 k-pairs × 16 columns × 2 (bf16 bits),
    /// zero-padded: element `(p, c)` of column `c` at k = 2p + s sits at
    /// `p * 32 + c * 2 + s` (the pair-interleaved "VNNI" layout). Writes all of `dst`.
    pub(crate) fn pack_b_tiles(dst: &mut [u16], t: usize, b: &[bf16], ldb: usize, k: usize, n: usize)
        => pack_b_tiles_body
);

#[inline(always)]
fn pack_b_tiles_body<const SIMD: bool>(
    dst: &mut [u16],
    t: usize,
    b: &[bf16],
    ldb: usize,
    k: usize,
    n: usize,
) {
    let c0 = t * 16;
    let cols = n.saturating_sub(c0).min(16);
    let dst = &mut dst[..k.div_ceil(KB) * TILE];
    // Pairs of whole rows: 16 columns of rows 2p and 2p + 1, interleaved.
    let whole = if cols == 16 { k / 2 } else { 0 };
    for (p, pair) in dst[..whole * 32].chunks_exact_mut(32).enumerate() {
        let lo: &[bf16; 16] = b[2 * p * ldb + c0..][..16].try_into().unwrap();
        let hi: &[bf16; 16] = b[(2 * p + 1) * ldb + c0..][..16].try_into().unwrap();
        let pair: &mut [u16; 32] = pair.try_into().unwrap();
        for c in 0..16 {
            pair[2 * c] = lo[c].to_bits();
            pair[2 * c + 1] = hi[c].to_bits();
        }
    }
    // The rest (a last odd row, columns past n, padding rows) element by element.
    for (i, x) in dst[whole * 32..].iter_mut().enumerate() {
        let (p, c, s) = (whole + i / 32, (i % 32) / 2, i % 2);
        let kk = 2 * p + s;
        *x = if kk < k && c < cols {
            b[kk * ldb + c0 + c].to_bits()
        } else {
            0
        };
    }
}

/// Packs columns `16t..16t + 16` of B = Tᵀ, given T (`n × k`) with T[j, kk] =
/// `t[j * ldt + kk]`, into the `k.div_ceil(32)` tiles of `dst` as [`pack_b_tiles`] does
/// (a k-pair of a column is two neighbours in a row of T). Writes all of those tiles.
pub(crate) fn pack_bt_tiles(
    dst: &mut [u16],
    t: usize,
    src: &[bf16],
    ldt: usize,
    k: usize,
    n: usize,
) {
    let dst = &mut dst[..k.div_ceil(KB) * TILE];
    let cols = 16.min(n.saturating_sub(t * 16));
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if cols == 16 && super::simd::has_avx512() {
        let rows = &src[t * 16 * ldt..][..15 * ldt + k];
        // SAFETY: AVX-512F is present; `rows` holds the 16 rows of k elements.
        done = unsafe { gather_pairs(dst, rows, ldt, k) };
    }
    dst[done * 32..].fill(0);
    for c in 0..cols {
        let row = &src[(t * 16 + c) * ldt..][..k];
        for (p, pair) in row.chunks(2).enumerate().skip(done) {
            dst[p * 32 + 2 * c] = pair[0].to_bits();
            if let Some(x) = pair.get(1) {
                dst[p * 32 + 2 * c + 1] = x.to_bits();
            }
        }
    }
}

/// The whole k-pairs of [`pack_bt_tiles`] for 16 rows (`rows[c * ldt..][..k]`): tile
/// row `p` is the `p`-th pair of each row, one 16-lane gather. Returns the pairs
/// written (`k / 2`).
///
/// # Safety
/// The CPU has AVX-512F; `rows.len() >= 15 * ldt + k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gather_pairs(dst: &mut [u16], rows: &[bf16], ldt: usize, k: usize) -> usize {
    use std::arch::x86_64::*;
    let pairs = k / 2;
    assert!(rows.len() >= 15 * ldt + k && dst.len() >= pairs * 32);
    assert!(15 * ldt + k <= i32::MAX as usize);
    // Element offsets of the rows' first pairs (the gather scales them by 2 bytes).
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut idx = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(ldt as i32));
    let two = _mm512_set1_epi32(2);
    for p in 0..pairs {
        // SAFETY: lane c reads elements c·ldt + 2p and + 1 < 15·ldt + k (asserted); the
        // store writes dst[32p..32p + 32] (asserted).
        unsafe {
            let v = _mm512_i32gather_epi32::<2>(idx, rows.as_ptr().cast());
            _mm512_storeu_si512(dst.as_mut_ptr().add(p * 32).cast(), v);
        }
        idx = _mm512_add_epi32(idx, two);
    }
    pairs
}

/// This thread's AMX tile configuration, loaded while the value lives (released on
/// drop); the products it runs are bounds-checked.
pub(crate) struct Tiles {
    /// Tile state is per thread: keep the value on its thread.
    _not_send: std::marker::PhantomData<*const ()>,
    /// Tests: compute the products in scalar code instead (any CPU).
    #[cfg(test)]
    emulate: bool,
}

impl Tiles {
    /// Loads the configuration, or `None` when AMX is not [`available`].
    pub(crate) fn load() -> Option<Tiles> {
        imp::load().then_some(Tiles {
            _not_send: std::marker::PhantomData,
            #[cfg(test)]
            emulate: false,
        })
    }

    /// Tiles whose products run in scalar code with the same operand layouts, so that
    /// callers' packing and indexing are tested on any CPU.
    #[cfg(test)]
    pub(crate) fn emulated() -> Option<Tiles> {
        Some(Tiles {
            _not_send: std::marker::PhantomData,
            emulate: true,
        })
    }

    /// `C (=|+=) A · B` for one 32 × 32 f32 block: `C[r, j] = c[r * ldc + j]`,
    /// A is 32 rows of `32 * steps` bf16 bits, row `r` at `a[r * lda..]`, and B is packed
    /// ([`pack_b_strided`]): `steps` tiles of the left 16 columns from `b[0]`, of the
    /// right 16 from `b[b_next]`. `accumulate` adds to C instead of overwriting it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn block(
        &self,
        a: &[u16],
        lda: usize,
        b: &[u16],
        b_next: usize,
        steps: usize,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) {
        assert!(steps >= 1 && lda >= KB * steps && ldc >= 32);
        assert!(a.len() >= 31 * lda + KB * steps);
        assert!(b.len() >= b_next + steps * TILE && b_next >= steps * TILE);
        assert!(c.len() >= 31 * ldc + 32);
        #[cfg(test)]
        if self.emulate {
            emulate(a, lda, b, b_next, steps, 32, c, ldc, accumulate);
            return;
        }
        // SAFETY: the configuration is loaded on this thread (`self` is not `Send`), and
        // the asserts above keep every load and store inside the three slices.
        unsafe {
            imp::block(
                a.as_ptr(),
                lda * 2,
                b.as_ptr(),
                b_next,
                steps,
                c.as_mut_ptr(),
                ldc * 4,
                accumulate,
            );
        }
    }

    /// `C = A · B` for a 32-row f32 block `C[r, j] = c[r * ldc + j]` of `16 * panels`
    /// columns, where A is 32 rows of 64 bf16 (two k tiles; row `r` at `a[r * lda..]`)
    /// and B is `panels` packed column panels of two k tiles each (panel `p` at
    /// `b[2 * p * TILE..]`). A's four tiles stay loaded while B streams past them: one
    /// tile load per two products instead of one per product as in [`Tiles::block`].
    pub(crate) fn block_k64(
        &self,
        a: &[u16],
        lda: usize,
        b: &[u16],
        panels: usize,
        c: &mut [f32],
        ldc: usize,
    ) {
        assert!(panels >= 1 && lda >= 2 * KB && ldc >= 16 * panels);
        assert!(a.len() >= 31 * lda + 2 * KB);
        assert!(b.len() >= 2 * panels * TILE);
        assert!(c.len() >= 31 * ldc + 16 * panels);
        #[cfg(test)]
        if self.emulate {
            emulate(a, lda, b, 2 * TILE, 2, 16 * panels, c, ldc, false);
            return;
        }
        // SAFETY: the configuration is loaded on this thread (`self` is not `Send`), and
        // the asserts above keep every load and store inside the three slices.
        unsafe {
            imp::block_k64(
                a.as_ptr(),
                lda * 2,
                b.as_ptr(),
                panels,
                c.as_mut_ptr(),
                ldc * 4,
            )
        }
    }
}

/// The tile products of [`Tiles::block`] and [`Tiles::block_k64`] in scalar code: `C (=|+=)
/// A · B` for 32 rows and `cols` columns over `steps` k tiles, column `j`'s tile for k
/// step `s` at `b[(j / 16) * panel_stride + s * TILE..]`.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn emulate(
    a: &[u16],
    lda: usize,
    b: &[u16],
    panel_stride: usize,
    steps: usize,
    cols: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let f = |h: u16| bf16::from_bits(h).to_f32();
    for r in 0..32 {
        for j in 0..cols {
            let bt = &b[(j / 16) * panel_stride + (j % 16) * 2..];
            let mut acc = if accumulate { c[r * ldc + j] } else { 0.0 };
            for s in 0..steps {
                for e in 0..KB {
                    let bv = bt[s * TILE + (e / 2) * 32 + e % 2];
                    acc += f(a[r * lda + s * KB + e]) * f(bv);
                }
            }
            c[r * ldc + j] = acc;
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        #[cfg(test)]
        if self.emulate {
            return;
        }
        imp::release();
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use std::arch::asm;
    use std::sync::OnceLock;

    use super::{ABlocks, BPanels, Encode, Engine, Epilogue, Scratch, KB, KSTEPS, MB, TASK, TILE};
    use crate::cpu::par::for_each_task;

    /// Whether the CPU has AVX-512-BF16 (and the AVX-512 set kpt's kernels use), and
    /// `KPT_CPU_BF16DP` is not `off` (or `0`).
    pub(super) fn dp_available() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            crate::cpu::simd::has_avx512()
                && std::arch::is_x86_feature_detected!("avx512bf16")
                && !std::env::var("KPT_CPU_BF16DP").is_ok_and(|v| v == "off" || v == "0")
        })
    }

    /// Rows of the output block that [`dp_block`] keeps in registers at a time: 8 rows
    /// × 32 columns = 16 zmm accumulators.
    const DP_ROWS: usize = 8;

    /// [`block`] on AVX-512-BF16 instead of AMX tiles, same arguments and layouts: per
    /// 8-row group, each k pair of a B tile row (16 columns × 2 k, one zmm) meets the
    /// k pair of each A row broadcast to all lanes (`VDPBF16PS`: f32 lanes += the two
    /// products of bf16 pairs).
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512-BF16 ([`dp_available`]); `steps >= 1`; all rows
    /// of A, the `steps` tiles at `b0` and `b0 + b_next`, and the 32 × 32 f32 at `c` (rows
    /// `cs` bytes apart) are in bounds.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dp_block(
        a0: *const u16,
        lda: usize,
        b0: *const u16,
        b_next: usize,
        steps: usize,
        c: *mut f32,
        cs: usize,
        accumulate: bool,
    ) {
        use std::arch::x86_64::*;
        for r0 in (0..MB).step_by(DP_ROWS) {
            let mut acc = [[_mm512_setzero_ps(); 2]; DP_ROWS];
            if accumulate {
                for (r, acc) in acc.iter_mut().enumerate() {
                    for (h, v) in acc.iter_mut().enumerate() {
                        // SAFETY: row r0 + r of the block, columns 16h..16h + 16 (contract).
                        *v = unsafe { _mm512_loadu_ps(c.byte_add((r0 + r) * cs).add(16 * h)) };
                    }
                }
            }
            // SAFETY (loads): k tiles t < steps of both B columns, and k pair p of
            // rows r0 + r of A, are in bounds (contract).
            for t in 0..steps {
                let (bl, br) = unsafe { (b0.add(t * TILE), b0.add(b_next + t * TILE)) };
                for p in 0..KB / 2 {
                    let (l, r) = unsafe {
                        (
                            _mm512_loadu_si512(bl.add(2 * 16 * p).cast()),
                            _mm512_loadu_si512(br.add(2 * 16 * p).cast()),
                        )
                    };
                    // SAFETY: both are 64 bytes of plain lanes.
                    let (l, r) = unsafe {
                        (
                            std::mem::transmute::<__m512i, __m512bh>(l),
                            std::mem::transmute::<__m512i, __m512bh>(r),
                        )
                    };
                    for (row, acc) in acc.iter_mut().enumerate() {
                        let pair = unsafe {
                            a0.byte_add((r0 + row) * lda)
                                .add(t * KB + 2 * p)
                                .cast::<i32>()
                                .read_unaligned()
                        };
                        // SAFETY: as above.
                        let a = unsafe {
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair))
                        };
                        acc[0] = _mm512_dpbf16_ps(acc[0], a, l);
                        acc[1] = _mm512_dpbf16_ps(acc[1], a, r);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (h, &v) in acc.iter().enumerate() {
                    // SAFETY: as for the loads above.
                    unsafe { _mm512_storeu_ps(c.byte_add((r0 + r) * cs).add(16 * h), v) };
                }
            }
        }
    }

    /// `arch_prctl` request for extra xstate components, and the tile data component.
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;

    pub(super) fn available() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            let f = kpt_core::hardware::cpu_info().features;
            if !(f.amx_tile && f.amx_bf16) {
                return false;
            }
            if std::env::var("KPT_CPU_AMX").is_ok_and(|v| v == "off" || v == "0") {
                tracing::debug!("AMX disabled by KPT_CPU_AMX");
                return false;
            }
            // SAFETY: a plain system call with integer arguments; it only changes this
            // process's permitted xstate set.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            };
            if rc != 0 {
                tracing::debug!("AMX tile data permission refused (arch_prctl rc {rc})");
            }
            rc == 0
        })
    }

    /// Palette 1, tiles 0..8 all 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    impl TileConfig {
        fn new() -> Self {
            let mut c = [0u8; 64];
            c[0] = 1;
            for t in 0..8 {
                c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
                c[48 + t] = 16;
            }
            TileConfig(c)
        }
    }

    /// A pointer to the output that tasks share; each writes its own rectangle.
    #[derive(Clone, Copy)]
    struct OutPtr<T>(*mut T);
    // SAFETY: tasks write disjoint elements (see `run`), and `T: Send`.
    unsafe impl<T: Send> Send for OutPtr<T> {}
    // SAFETY: as above; the pointer itself is never used to read.
    unsafe impl<T: Send> Sync for OutPtr<T> {}

    impl<T> OutPtr<T> {
        /// The `len` elements from element `i`.
        ///
        /// # Safety
        /// They are in bounds of the output and no other thread accesses them while the
        /// slice lives.
        #[allow(clippy::mut_from_ref)]
        unsafe fn row(&self, i: usize, len: usize) -> &mut [T] {
            // SAFETY: per the function contract.
            unsafe { std::slice::from_raw_parts_mut(self.0.add(i), len) }
        }
    }

    pub(super) fn load() -> bool {
        if !available() {
            return false;
        }
        let cfg = TileConfig::new();
        // SAFETY: AMX is available and the configuration is valid.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
        true
    }

    pub(super) fn release() {
        // SAFETY: only called after `load` succeeded on this thread; no tile is live.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// `C += A · B` over `steps` k tiles for one 32 × 32 f32 block `C` at `c` (rows `cs`
    /// bytes apart), or `C =` unless `accumulate`. A is row-major bf16: 32 rows `lda`
    /// bytes apart from `a0`, each k tile 64 bytes further; B is packed tiles, 1 KiB per
    /// k step, the right tile column `b_next` elements after the left one at `b0`.
    ///
    /// # Safety
    /// The configuration is loaded on this thread, `steps >= 1`, and all rows of A, the
    /// `steps` tiles at `b0` and `b0 + b_next`, and the 32 × 32 f32 at `c` (rows `cs`
    /// bytes apart) are in bounds.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        a0: *const u16,
        lda: usize,
        b0: *const u16,
        b_next: usize,
        steps: usize,
        c: *mut f32,
        cs: usize,
        accumulate: bool,
    ) {
        // SAFETY: per the function contract.
        unsafe {
            asm!(
                "test {acc}, {acc}",
                "jnz 3f",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "jmp 2f",
                "3:",
                "tileloadd tmm0, [{c} + {cs}*1]",
                "tileloadd tmm1, [{c} + {cs}*1 + 64]",
                "tileloadd tmm2, [{c1} + {cs}*1]",
                "tileloadd tmm3, [{c1} + {cs}*1 + 64]",
                "2:",
                "tileloadd tmm4, [{a0} + {lda}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tileloadd tmm5, [{a1} + {lda}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "prefetcht0 [{b0} + 2048]\nprefetcht0 [{b0} + 2112]\nprefetcht0 [{b0} + 2176]\nprefetcht0 [{b0} + 2240]\nprefetcht0 [{b0} + 2304]\nprefetcht0 [{b0} + 2368]\nprefetcht0 [{b0} + 2432]\nprefetcht0 [{b0} + 2496]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "prefetcht0 [{b0} + 2560]\nprefetcht0 [{b0} + 2624]\nprefetcht0 [{b0} + 2688]\nprefetcht0 [{b0} + 2752]\nprefetcht0 [{b0} + 2816]\nprefetcht0 [{b0} + 2880]\nprefetcht0 [{b0} + 2944]\nprefetcht0 [{b0} + 3008]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "prefetcht0 [{b1} + 2048]\nprefetcht0 [{b1} + 2112]\nprefetcht0 [{b1} + 2176]\nprefetcht0 [{b1} + 2240]\nprefetcht0 [{b1} + 2304]\nprefetcht0 [{b1} + 2368]\nprefetcht0 [{b1} + 2432]\nprefetcht0 [{b1} + 2496]",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "prefetcht0 [{b1} + 2560]\nprefetcht0 [{b1} + 2624]\nprefetcht0 [{b1} + 2688]\nprefetcht0 [{b1} + 2752]\nprefetcht0 [{b1} + 2816]\nprefetcht0 [{b1} + 2880]\nprefetcht0 [{b1} + 2944]\nprefetcht0 [{b1} + 3008]",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {cs}*1], tmm0",
                "tilestored [{c} + {cs}*1 + 64], tmm1",
                "tilestored [{c1} + {cs}*1], tmm2",
                "tilestored [{c1} + {cs}*1 + 64], tmm3",
                acc = in(reg) usize::from(accumulate),
                a0 = inout(reg) a0 => _,
                a1 = inout(reg) a0.byte_add(16 * lda) => _,
                lda = in(reg) lda,
                b0 = inout(reg) b0 => _,
                b1 = inout(reg) b0.add(b_next) => _,
                n = inout(reg) steps => _,
                s = in(reg) 64usize,
                c = in(reg) c,
                c1 = in(reg) c.byte_add(16 * cs),
                cs = in(reg) cs,
                options(nostack),
            );
        }
    }

    /// `C = A · B` for a 32-row block of `16 · panels` f32 columns at `c` (rows `cs`
    /// bytes apart): A's 32 rows of two k tiles (`lda` bytes apart from `a0`) held in
    /// tmm4-7, B's column panels of two 1 KiB tiles each, 2 KiB apart from `b0`.
    ///
    /// # Safety
    /// The configuration is loaded on this thread, `panels >= 1`, and A's 32 rows of 128
    /// bytes, the `2 · panels` tiles at `b0` and the block at `c` are in bounds.
    pub(super) unsafe fn block_k64(
        a0: *const u16,
        lda: usize,
        b0: *const u16,
        panels: usize,
        c: *mut f32,
        cs: usize,
    ) {
        // SAFETY: per the function contract.
        unsafe {
            asm!(
                "tileloadd tmm4, [{a0} + {lda}*1]",
                "tileloadd tmm5, [{a0} + {lda}*1 + 64]",
                "tileloadd tmm6, [{a1} + {lda}*1]",
                "tileloadd tmm7, [{a1} + {lda}*1 + 64]",
                "2:",
                "tileloadd tmm2, [{b} + {s}*1]",
                "tileloadd tmm3, [{b} + {s}*1 + 1024]",
                "tilezero tmm0",
                "tilezero tmm1",
                "tdpbf16ps tmm0, tmm4, tmm2",
                "tdpbf16ps tmm1, tmm6, tmm2",
                "tdpbf16ps tmm0, tmm5, tmm3",
                "tdpbf16ps tmm1, tmm7, tmm3",
                "tilestored [{c} + {cs}*1], tmm0",
                "tilestored [{c1} + {cs}*1], tmm1",
                "add {b}, 2048",
                "add {c}, 64",
                "add {c1}, 64",
                "dec {n}",
                "jnz 2b",
                a0 = in(reg) a0,
                a1 = in(reg) a0.byte_add(16 * lda),
                lda = in(reg) lda,
                b = inout(reg) b0 => _,
                n = inout(reg) panels => _,
                s = in(reg) 64usize,
                c = inout(reg) c => _,
                c1 = inout(reg) c.byte_add(16 * cs) => _,
                cs = in(reg) cs,
                options(nostack),
            );
        }
    }

    /// [`block`] in scalar code ([`Engine::Emulated`]), same arguments.
    ///
    /// # Safety
    /// As for [`block`], less the tile configuration.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn emulated_block(
        a0: *const u16,
        lda: usize,
        b0: *const u16,
        b_next: usize,
        steps: usize,
        c: *mut f32,
        cs: usize,
        accumulate: bool,
    ) {
        let (lda, ldc) = (lda / 2, cs / 4);
        // SAFETY: per the function contract: A's 32 rows, B's two tile columns and C's
        // 32 rows of 32 f32 are in bounds, C accessed by no one else.
        let (a, b, c) = unsafe {
            (
                std::slice::from_raw_parts(a0, 31 * lda + steps * KB),
                std::slice::from_raw_parts(b0, b_next + steps * TILE),
                std::slice::from_raw_parts_mut(c, 31 * ldc + 32),
            )
        };
        super::emulate(a, lda, b, b_next, steps, 32, c, ldc, accumulate);
    }

    /// Runs the product: each task computes one rectangle of `out` from A's row blocks
    /// and B's column panels (`kt` k tiles each), packing the panels it needs on first
    /// use.
    pub(super) fn run<T: Encode>(
        a: &ABlocks<'_>,
        b: &BPanels<'_>,
        out: &mut [T],
        (m, n, kt): (usize, usize, usize),
        engine: Engine,
        epilogue: Option<Epilogue<'_>>,
    ) {
        let (mb, nb) = (m.next_multiple_of(MB), n.next_multiple_of(MB));
        assert!(out.len() >= m * n && kt >= 1);
        let dst = OutPtr(out.as_mut_ptr());
        let threads = rayon::current_num_threads();
        let task = task_size(mb, nb, threads);
        let (tr, tc) = (mb.div_ceil(task), nb.div_ceil(task));
        // Column-major task order: each thread starts on a run of consecutive tasks,
        // which then share their B panels (packed once, kept in that core's L2).
        for_each_task(tr * tc, &|t| {
            let (r0, c0) = ((t % tr) * task, (t / tr) * task);
            let (rows, cols) = (task.min(mb - r0), task.min(nb - c0));
            let bt = b.panels(c0 / 16..(c0 + cols) / 16);
            // In 64 × 64 tasks an A block meets only two column blocks, so the first
            // tile loads of each block (from other cores' caches) are a large share of
            // the task: those tasks prefetch the next block.
            let prefetch = task < TASK;
            let (rows, cols) = ((r0, rows), (c0, cols));
            let job = (engine, prefetch, epilogue);
            run_task(a, bt, &dst, (m, n, kt), rows, cols, job);
        });
    }

    /// One task: output rows `r0..r0 + rows` and columns `c0..c0 + cols` (multiples of
    /// 32, within the 32-padded output) of `out` (`m × n`, `kt` k tiles), with `bt` the
    /// packed B panels of those columns. `prefetch`: each A block's tile products
    /// prefetch the next block into L2, a share of its rows per column block.
    /// `epilogue` runs on each finished f32 row segment before it is stored.
    fn run_task<T: Encode>(
        a: &ABlocks<'_>,
        bt: &[u16],
        dst: &OutPtr<T>,
        (m, n, kt): (usize, usize, usize),
        (r0, rows): (usize, usize),
        (c0, cols): (usize, usize),
        (engine, prefetch, epilogue): (Engine, bool, Option<Epilogue<'_>>),
    ) {
        assert!(bt.len() >= cols / 16 * kt * TILE);
        let blocks: Vec<(&[u16], usize)> =
            (r0 / MB..(r0 + rows) / MB).map(|i| a.block(i)).collect();
        // The rectangle's f32 accumulators, [rows][cols].
        let mut acc = Scratch::<f32>::new(rows * cols);
        // `matmul_bf16` checked `available()`, so the configuration loads.
        let amx = engine == Engine::Amx;
        assert!(!amx || load(), "AMX tile configuration failed to load");
        for k0 in (0..kt).step_by(KSTEPS) {
            let steps = KSTEPS.min(kt - k0);
            for (bi, &(ablk, lda)) in blocks.iter().enumerate() {
                assert!(ablk.len() >= (MB - 1) * lda + kt * KB);
                // The A block that comes next: the next block, or the first one of the
                // next pass.
                let next = if bi + 1 < blocks.len() {
                    Some((blocks[bi + 1], k0))
                } else if k0 + KSTEPS < kt {
                    Some((blocks[0], k0 + KSTEPS))
                } else {
                    None
                };
                let jn = cols / MB;
                for j in (0..cols).step_by(MB) {
                    if let Some(((nblk, nlda), nk0)) = next.filter(|_| prefetch) {
                        let jj = j / MB;
                        let nsteps = KSTEPS.min(kt - nk0);
                        for r in MB * jj / jn..MB * (jj + 1) / jn {
                            for st in 0..nsteps {
                                let line = &nblk[r * nlda + (nk0 + st) * KB];
                                // SAFETY: a prefetch never faults; the address is in A.
                                unsafe {
                                    std::arch::x86_64::_mm_prefetch::<
                                        { std::arch::x86_64::_MM_HINT_T1 },
                                    >(
                                        (line as *const u16).cast()
                                    )
                                };
                            }
                        }
                    }
                    // SAFETY: the A block has 32 rows of lda >= 32 kt elements, the
                    // panels j / 16 and + 1 exist with kt k tiles each (j < cols is a
                    // multiple of 32, asserted above), k0 + steps <= kt; the block (32
                    // bi, j) of 32 × 32 lies in `acc`; the config is loaded for AMX, and
                    // `dp_available` held for the other engine.
                    unsafe {
                        let kernel = match engine {
                            Engine::Amx => block,
                            Engine::Dp => dp_block,
                            #[cfg(test)]
                            Engine::Emulated => emulated_block,
                        };
                        kernel(
                            ablk.as_ptr().add(k0 * KB),
                            lda * 2,
                            bt.as_ptr().add((j / 16 * kt + k0) * TILE),
                            kt * TILE,
                            steps,
                            acc.as_mut_ptr().add(bi * MB * cols + j),
                            cols * 4,
                            k0 > 0,
                        );
                    }
                }
            }
        }
        if amx {
            release();
        }
        let width = cols.min(n - c0);
        for r in 0..rows.min(m - r0) {
            // SAFETY: row r0 + r, columns c0..c0 + width lie in `out` ((r0 + r, c0 + width
            // - 1) < (m, n)), and no other caller accesses them: rectangles are disjoint.
            let row = unsafe { dst.row((r0 + r) * n + c0, width) };
            let seg = &mut acc[r * cols..][..width];
            if let Some(epi) = epilogue {
                epi(seg, c0);
            }
            T::encode_slice(seg, row);
        }
    }

    /// Output rows / columns per task: 128, or 64 when that leaves fewer than four
    /// tasks per thread (on the Xeon VM's 16 threads, 1024² ran 30-45% faster in 64
    /// tasks of 128² than in 256 of 64², and 512² 15% slower in 16 of 128²).
    fn task_size(mb: usize, nb: usize, threads: usize) -> usize {
        if mb.div_ceil(TASK) * nb.div_ceil(TASK) >= 4 * threads {
            TASK
        } else {
            TASK / 2
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod imp {
    use super::{ABlocks, BPanels, Encode, Engine};

    pub(super) fn available() -> bool {
        false
    }

    pub(super) fn dp_available() -> bool {
        false
    }

    pub(super) fn load() -> bool {
        false
    }

    pub(super) fn release() {}

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        _: *const u16,
        _: usize,
        _: *const u16,
        _: usize,
        _: usize,
        _: *mut f32,
        _: usize,
        _: bool,
    ) {
        unreachable!("AMX is never available on this target")
    }

    pub(super) unsafe fn block_k64(
        _: *const u16,
        _: usize,
        _: *const u16,
        _: usize,
        _: *mut f32,
        _: usize,
    ) {
        unreachable!("AMX is never available on this target")
    }

    pub(super) fn run<T: Encode>(
        _: &ABlocks<'_>,
        _: &BPanels<'_>,
        _: &mut [T],
        _: (usize, usize, usize),
        _: Engine,
        _: Option<super::Epilogue<'_>>,
    ) {
        unreachable!("AMX is never available on this target")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kpt_core::rand::SplitMix64;

    fn random_bf16(rng: &mut SplitMix64, len: usize) -> Vec<bf16> {
        (0..len)
            .map(|_| bf16::from_f32(rng.uniform(-1.0, 1.0)))
            .collect()
    }

    /// `a · b` in f64 from the bf16 values.
    fn reference(a: &[bf16], b: &[bf16], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut want = vec![0f64; m * n];
        for i in 0..m {
            for p in 0..k {
                let x = a[i * k + p].to_f64();
                for j in 0..n {
                    want[i * n + j] += x * b[p * n + j].to_f64();
                }
            }
        }
        want
    }

    fn assert_close(got: &[f32], want: &[f64], k: usize) {
        assert_eq!(got.len(), want.len());
        let tol = 1e-6 * k as f64 + 1e-6;
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= tol, "element {i}: {g} vs {w}");
        }
    }

    const SHAPES: [(usize, usize, usize); 7] = [
        (1, 1, 1),
        (17, 33, 45),
        (40, 70, 31),
        (130, 100, 150),
        (257, 64, 33),
        (64, 96, 64),
        (96, 64, 300),
    ];

    /// Packed B, multiplied by A the way `TDPBF16PS` pairs them, gives `a · b`: checks
    /// the packing on any CPU.
    #[test]
    fn packed_tiles_multiply_to_the_product() {
        let mut rng = SplitMix64::new(7);
        for (m, k, n) in SHAPES {
            let a = random_bf16(&mut rng, m * k);
            let b = random_bf16(&mut rng, k * n);
            let (kt, nt) = (k.div_ceil(KB), n.next_multiple_of(MB) / 16);
            let mut bp = vec![1; nt * kt * TILE];
            for (t, dst) in bp.chunks_exact_mut(kt * TILE).enumerate() {
                pack_b_tiles(dst, t, &b, n, k, n);
            }
            assert!(bp[(n.div_ceil(16) * kt) * TILE..].iter().all(|&x| x == 0));
            // Tᵀ packed from T = Bᵀ gives the same tiles.
            let bt: Vec<bf16> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let mut bp_t = vec![1; nt * kt * TILE];
            for (t, dst) in bp_t.chunks_exact_mut(kt * TILE).enumerate() {
                pack_bt_tiles(dst, t, &bt, k, k, n);
            }
            assert_eq!(bp, bp_t);
            let f = |h: u16| bf16::from_bits(h).to_f32();
            let mut got = vec![0f32; m * n];
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0f32;
                    for s in 0..kt {
                        let bt = &bp[((j / 16) * kt + s) * TILE..][..TILE];
                        for e in 0..KB.min(k - s * KB) {
                            let x = a[i * k + s * KB + e].to_f32();
                            acc += x * f(bt[(e / 2) * 32 + (j % 16) * 2 + e % 2]);
                        }
                        for e in k.min((s + 1) * KB) - s * KB..KB {
                            assert_eq!(bt[(e / 2) * 32 + (j % 16) * 2 + e % 2], 0);
                        }
                    }
                    got[i * n + j] = acc;
                }
            }
            assert_close(&got, &reference(&a, &b, m, k, n), k);
        }
    }

    /// A's blocks are A's own rows where they can be read in place, else zero-padded
    /// copies with the same values.
    #[test]
    fn a_blocks_hold_the_rows_of_a() {
        let cases: [(usize, usize, usize, usize); 3] =
            [(70, 512, 2, 512), (40, 70, 0, 96), (64, 1024, 0, 1056)];
        for (m, k, in_place, lda) in cases {
            let a: Vec<u16> = (0..m * k).map(|i| (i % 60_000) as u16 + 1).collect();
            let mut buf = vec![7; (m.div_ceil(MB) - in_place) * MB * lda];
            let blocks = ABlocks::new(&a, (m, k), in_place, lda, &mut buf);
            for i in 0..m.div_ceil(MB) {
                let (blk, ld) = blocks.block(i);
                assert_eq!(ld, if i < in_place { k } else { lda });
                assert_eq!(i < in_place, blk.as_ptr() == a[i * MB * k..].as_ptr());
                for r in 0..MB {
                    for c in 0..ld {
                        let want = if i * MB + r < m && c < k {
                            a[(i * MB + r) * k + c]
                        } else {
                            0
                        };
                        assert_eq!(blk[r * ld + c], want, "block {i} row {r} col {c}");
                    }
                }
            }
        }
    }

    /// Row strides that are multiples of 2 KiB pile into a few L1 sets; the packed
    /// stride is found a few lines further.
    #[test]
    fn row_strides_that_alias_in_l1_are_padded() {
        let spreads = |k: usize| spreads_in_l1(k, k.div_ceil(KB));
        assert!(spreads(512) && spreads(1536) && spreads(5632) && spreads(96) && spreads(1056));
        assert!(!spreads(1024) && !spreads(2048) && !spreads(3072) && !spreads(4096));
        for kt in 1..300 {
            let lda = (kt * KB..)
                .step_by(KB)
                .take(4)
                .find(|&l| spreads_in_l1(l, kt));
            assert!(lda.is_some(), "k tiles {kt}");
        }
    }

    /// The tile kernel itself (where this CPU has AMX; elsewhere `matmul_bf16` must
    /// decline so that the portable path runs).
    #[test]
    fn amx_product_matches_reference() {
        let mut rng = SplitMix64::new(11);
        for (m, k, n) in SHAPES {
            let a = random_bf16(&mut rng, m * k);
            let b = random_bf16(&mut rng, k * n);
            let mut got = vec![f32::NAN; m * n];
            let ran = matmul_bf16(&a, &b, &mut got, m, k, n);
            assert_eq!(ran, available() || imp::dp_available());
            if ran {
                assert_close(&got, &reference(&a, &b, m, k, n), k);
            } else {
                assert!(got.iter().all(|x| x.is_nan()), "declined but wrote output");
            }
        }
    }

    /// The driver on the scalar engine (any CPU): task split, A blocks read in place and
    /// copied, B panels, several k passes, and rounding to bf16 in the output.
    #[test]
    fn emulated_driver_matches_reference() {
        // The driver (`imp::run`) exists on x86-64 Linux only.
        if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            return;
        }
        let mut rng = SplitMix64::new(13);
        let shapes = SHAPES.iter().copied().chain([
            (40, 700, 50),
            (100, 1024, 96),
            // Rows that alias in L1 and a wide B: A's blocks are copied.
            (33, 1024, COPY_A_MIN_N + 1),
            (33, 512, 200),
            (300, 96, 260),
        ]);
        for (m, k, n) in shapes {
            let a = random_bf16(&mut rng, m * k);
            let b = random_bf16(&mut rng, k * n);
            let want = reference(&a, &b, m, k, n);
            let mut got = vec![f32::NAN; m * n];
            matmul_with(
                Engine::Emulated,
                &a,
                &b,
                BLayout::KByN,
                &mut got,
                (m, k, n),
                None,
            );
            assert_close(&got, &want, k);
            let mut got16 = vec![bf16::from_f32(f32::NAN); m * n];
            matmul_with(
                Engine::Emulated,
                &a,
                &b,
                BLayout::KByN,
                &mut got16,
                (m, k, n),
                None,
            );
            for (i, (&g, &w)) in got16.iter().zip(&want).enumerate() {
                let tol = 1e-6 * k as f64 + w.abs() / 256.0;
                assert!(
                    (g.to_f64() - w).abs() <= tol,
                    "{m}x{k}x{n} element {i}: {g} vs {w}"
                );
            }
        }
    }

    /// A linear layer's product: B given as Bᵀ (`n × k`), an epilogue on each output
    /// segment (a column-dependent shift, so that a wrong column offset shows), on the
    /// scalar engine and, where the CPU has it, AVX-512-BF16.
    #[test]
    fn transposed_b_with_an_epilogue_matches_reference() {
        if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            return;
        }
        let mut rng = SplitMix64::new(14);
        let shift = |seg: &mut [f32], c0: usize| {
            for (j, v) in seg.iter_mut().enumerate() {
                *v += (c0 + j) as f32;
            }
        };
        let mut engines = vec![Engine::Emulated];
        if imp::dp_available() {
            engines.push(Engine::Dp);
        }
        for (m, k, n) in SHAPES.iter().copied().chain([(33, 0, 40), (70, 1024, 200)]) {
            let a = random_bf16(&mut rng, m * k);
            let b = random_bf16(&mut rng, k * n);
            let bt: Vec<bf16> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let mut want = reference(&a, &b, m, k, n);
            for (i, w) in want.iter_mut().enumerate() {
                *w += (i % n) as f64;
            }
            for &engine in &engines {
                let mut got = vec![f32::NAN; m * n];
                let job = (m, k, n);
                matmul_with(engine, &a, &bt, BLayout::NByK, &mut got, job, Some(&shift));
                assert_close(&got, &want, k);
            }
        }
    }

    /// The AVX-512-BF16 engine, also on CPUs that would pick AMX.
    #[test]
    fn dp_product_matches_reference() {
        if !imp::dp_available() {
            return;
        }
        let mut rng = SplitMix64::new(12);
        for (m, k, n) in SHAPES {
            let a = random_bf16(&mut rng, m * k);
            let b = random_bf16(&mut rng, k * n);
            let mut got = vec![f32::NAN; m * n];
            matmul_with(Engine::Dp, &a, &b, BLayout::KByN, &mut got, (m, k, n), None);
            assert_close(&got, &reference(&a, &b, m, k, n), k);
        }
    }
}
