//! bf16 matrix products on Intel AMX tiles (Sapphire Rapids and later): the matmul
//! behind [`matmul_bf16`](super::matmul_bf16), and [`Tiles`], the bounds-checked tile
//! products that the AMX attention builds on. Used when the CPU and the OS offer AMX.
//!
//! Both operands are packed once into 1 KiB tiles, zero-padded to multiples of 32:
//! A as `[m / 16][k / 32]` tiles of 16 rows × 32 bf16, B as `[n / 16][k / 32]` tiles in
//! the pair-interleaved ("VNNI") layout `TDPBF16PS` reads: 16 rows of k-pairs, each
//! holding 16 columns × 2 consecutive k. A tile's k-step successor is the next 1 KiB,
//! so the inner loop streams both operands linearly. The micro-kernel keeps a 32 × 32
//! f32 output block in four accumulator tiles (`tmm0..3`), loads two A tiles
//! (`tmm4..5`) and two B tiles (`tmm6..7`) per 32-wide k step and issues four
//! `TDPBF16PS` (f32 accumulation of bf16 products, like the portable path), each as
//! soon as its two operand tiles are loaded.
//! Rayon tasks own a 128 × 128 output rectangle each (64 × 64 when that leaves fewer than
//! four tasks per thread), accumulated in f32 over passes of 512 k: within a pass one 32-row A block (32 KiB) stays in L1 while it meets the
//! task's four B blocks (128 KiB, in L2). Each task packs the 16-row / 16-column panels
//! it needs that no other task packed yet ([`LazyPanels`]), into [`Scratch`] buffers.
//!
//! The tile instructions are written as inline assembly: Rust's AMX intrinsics are not
//! stable. Linux only grants the tile state to a process that asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`] asks once.

use half::bf16;

use super::panels::LazyPanels;
use super::scratch::Scratch;
use super::simd::Encode;

/// Rows / columns of one output micro-block (two tiles each way).
const MB: usize = 32;
/// k elements per tile step.
const KB: usize = 32;
/// bf16 elements in one 1 KiB tile.
pub(crate) const TILE: usize = 512;
/// Output rows / columns per rayon task (halved for small products, see `task_size`).
const TASK: usize = 128;

/// Whether AMX-BF16 can run in this process: the CPU has it, the OS saves its state and
/// granted this process the tile data permission, and `KPT_CPU_AMX` is not `off` (or
/// `0`), which makes kpt use its AVX-512 / AVX2 kernels instead.
pub(crate) fn available() -> bool {
    imp::available()
}

/// `out[m, n] = a[m, k] · b[k, n]` on AMX tiles (row-major, lengths checked by the
/// caller), f32 accumulation and one rounding to `T`. Returns false (and does nothing)
/// when [`available`] is false.
pub(crate) fn matmul_bf16<T: Encode>(
    a: &[bf16],
    b: &[bf16],
    out: &mut [T],
    m: usize,
    k: usize,
    n: usize,
) -> bool {
    if !available() {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    if k == 0 {
        out[..m * n].fill(T::encode(0.0));
        return true;
    }
    let (mt, kt, nt) = (
        m.next_multiple_of(MB) / 16,
        k.div_ceil(KB),
        n.next_multiple_of(MB) / 16,
    );
    let mut ap = Scratch::new(mt * kt * TILE);
    let mut bp = Scratch::new(nt * kt * TILE);
    imp::run(
        &LazyPanels::new(&mut ap, kt * TILE),
        &LazyPanels::new(&mut bp, kt * TILE),
        |t, dst| pack_a_panel(a, m, k, t, dst),
        |t, dst| pack_b_panel(b, k, n, t, dst),
        out,
        m,
        n,
        kt,
    );
    true
}

/// Packs rows `16t..16t + 16` of A (`m × k`) into `dst` (`k.div_ceil(32)` tiles) as
/// tiles of 16 rows × 32 columns (bf16 bits), zero-padded.
fn pack_a_panel(a: &[bf16], m: usize, k: usize, t: usize, dst: &mut [u16]) {
    dst.fill(0);
    for r in 0..16.min(m.saturating_sub(t * 16)) {
        let row = &a[(t * 16 + r) * k..][..k];
        for (s, chunk) in row.chunks(KB).enumerate() {
            let d = &mut dst[s * TILE + r * KB..][..chunk.len()];
            for (o, x) in d.iter_mut().zip(chunk) {
                *o = x.to_bits();
            }
        }
    }
}

/// Packs columns `16t..16t + 16` of B (`k × n`) into `dst` (`k.div_ceil(32)` tiles) as
/// tiles of 16 k-pairs × 16 columns × 2 (bf16 bits), zero-padded: element `(p, c)` of
/// column `c` at k = 2p + s sits at `p * 32 + c * 2 + s`.
fn pack_b_panel(b: &[bf16], k: usize, n: usize, t: usize, dst: &mut [u16]) {
    dst.fill(0);
    pack_b_tiles(dst, t, k, n, |kk, c0, cols| &b[kk * n + c0..][..cols]);
}

/// Packs the `kt` tiles of tile column `t` (columns `16t..`) into `dst` (zeroed):
/// `row(kk, c0, cols)` gives B's row `kk` from column `c0`, `cols` long.
fn pack_b_tiles<'a>(
    dst: &mut [u16],
    t: usize,
    k: usize,
    n: usize,
    row: impl Fn(usize, usize, usize) -> &'a [bf16],
) {
    let c0 = t * 16;
    let cols = n.saturating_sub(c0).min(16);
    if cols == 0 {
        return;
    }
    // Two k rows at a time, interleaved: (k, k + 1) of each column side by side.
    for kk in (0..k).step_by(2) {
        let base = (kk / KB) * TILE + ((kk % KB) / 2) * 32;
        let pairs = dst[base..][..2 * cols].chunks_exact_mut(2);
        let lo = row(kk, c0, cols);
        if kk + 1 < k {
            for ((pair, l), h) in pairs.zip(lo).zip(row(kk + 1, c0, cols)) {
                pair[0] = l.to_bits();
                pair[1] = h.to_bits();
            }
        } else {
            for (pair, l) in pairs.zip(lo) {
                pair[0] = l.to_bits();
            }
        }
    }
}

/// Packs the `k × n` matrix B with B[kk, j] = `b[kk * ldb + j]` into `dst`
/// (`n.div_ceil(16) * k.div_ceil(32)` tiles, zeroed by the caller) as [`pack_b_panel`] does.
pub(crate) fn pack_b_strided(b: &[bf16], ldb: usize, k: usize, n: usize, dst: &mut [u16]) {
    let kt = k.div_ceil(KB);
    for (t, tiles) in dst.chunks_exact_mut(kt * TILE).enumerate() {
        pack_b_tiles(tiles, t, k, n, |kk, c0, cols| &b[kk * ldb + c0..][..cols]);
    }
}

/// Packs B = Tᵀ, given T (`n × k`) with T[j, kk] = `t[j * ldt + kk]`, into `dst`
/// (`n.div_ceil(16) * k.div_ceil(32)` tiles, zeroed by the caller) as [`pack_b_panel`] does.
pub(crate) fn pack_bt_strided(t: &[bf16], ldt: usize, k: usize, n: usize, dst: &mut [u16]) {
    let kt = k.div_ceil(KB);
    for (nt, tiles) in dst.chunks_exact_mut(kt * TILE).enumerate() {
        for c in 0..16.min(n.saturating_sub(nt * 16)) {
            let src = &t[(nt * 16 + c) * ldt..][..k];
            for (kk, x) in src.iter().enumerate() {
                tiles[(kk / KB) * TILE + ((kk % KB) / 2) * 32 + c * 2 + kk % 2] = x.to_bits();
            }
        }
    }
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
            let f = |h: u16| bf16::from_bits(h).to_f32();
            for r in 0..32 {
                for j in 0..32 {
                    let bt = &b[(j / 16) * b_next + (j % 16) * 2..];
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
            return;
        }
        // SAFETY: the configuration is loaded on this thread (`self` is not `Send`), and
        // the asserts above keep every load and store inside the three slices.
        unsafe {
            imp::block_rm(
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

    use rayon::prelude::*;

    use super::{Encode, LazyPanels, Scratch, MB, TASK, TILE};

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

    /// `C += Σ_s A(a0, a1)[s] · B(b0, b1)[s]` over `steps` k tiles for one 32 × 32 f32
    /// block `C` at `c` (rows `cs` bytes apart), or `C =` when `first`. `a0` / `b0`
    /// point at the first k tile of the upper / left tile row; the second tile row
    /// starts `stride` tiles later.
    ///
    /// # Safety
    /// The tile configuration of [`TileConfig::new`] is loaded on this thread, AMX is
    /// [`available`], `steps >= 1`, `a0` and `b0` have `stride + steps` readable tiles,
    /// and `c` has 32 rows of 32 f32, `cs` bytes apart, readable and writable.
    #[inline(always)]
    unsafe fn block(
        a0: *const u16,
        b0: *const u16,
        stride: usize,
        steps: usize,
        c: *mut f32,
        cs: usize,
        first: bool,
    ) {
        // SAFETY: per the function contract; each tile load reads 16 rows of 64 bytes,
        // C loads / stores touch the 32 × 32 block at `c`.
        unsafe {
            asm!(
                "test {first}, {first}",
                "jz 3f",
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
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 1024",
                "add {a1}, 1024",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {cs}*1], tmm0",
                "tilestored [{c} + {cs}*1 + 64], tmm1",
                "tilestored [{c1} + {cs}*1], tmm2",
                "tilestored [{c1} + {cs}*1 + 64], tmm3",
                first = in(reg) usize::from(first),
                a0 = inout(reg) a0 => _,
                a1 = inout(reg) a0.add(stride * TILE) => _,
                b0 = inout(reg) b0 => _,
                b1 = inout(reg) b0.add(stride * TILE) => _,
                n = inout(reg) steps => _,
                s = in(reg) 64usize,
                c = in(reg) c,
                c1 = in(reg) c.byte_add(16 * cs),
                cs = in(reg) cs,
                options(nostack),
            );
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

    /// As [`block`], but A is row-major: 32 rows `lda` bytes apart, each step 64 bytes
    /// further; the right B tile column starts `b_next` elements after `b0`.
    ///
    /// # Safety
    /// The configuration is loaded on this thread, `steps >= 1`, and all rows of A, the
    /// `steps` tiles at `b0` and `b0 + b_next`, and the 32 × 32 f32 at `c` (rows `cs`
    /// bytes apart) are in bounds.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block_rm(
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
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {lda}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
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

    /// k tiles per pass over a task's blocks: one A block row (32 × 512 bf16, 32 KiB)
    /// then stays in L1 while it meets the task's B blocks (in L2).
    const KSTEPS: usize = 16;

    /// Runs the product on packed panels of 16 rows of A (`ap`) and 16 columns of B
    /// (`bp`), `kt` tiles each, that the tasks pack on first use with `pack_a` /
    /// `pack_b`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run<T: Encode>(
        ap: &LazyPanels<'_, u16>,
        bp: &LazyPanels<'_, u16>,
        pack_a: impl Fn(usize, &mut [u16]) + Sync,
        pack_b: impl Fn(usize, &mut [u16]) + Sync,
        out: &mut [T],
        m: usize,
        n: usize,
        kt: usize,
    ) {
        let (mb, nb) = (m.next_multiple_of(MB), n.next_multiple_of(MB));
        assert!(out.len() >= m * n && kt >= 1);
        let task = task_size(mb, nb, rayon::current_num_threads());
        let (tr, tc) = (mb.div_ceil(task), nb.div_ceil(task));
        let dst = OutPtr(out.as_mut_ptr());
        (0..tr * tc).into_par_iter().for_each(|t| {
            let (r0, c0) = ((t / tc) * task, (t % tc) * task);
            let (rows, cols) = (task.min(mb - r0), task.min(nb - c0));
            // This task's panels: rows r0.. of A, columns c0.. of B (`get` checks that
            // they exist), kt tiles each.
            let a = ap.get(r0 / 16..(r0 + rows) / 16, &pack_a);
            let b = bp.get(c0 / 16..(c0 + cols) / 16, &pack_b);
            // The task's f32 accumulators, [rows][task].
            let mut acc = Scratch::<f32>::new(rows * task);
            // `matmul_bf16` checked `available()`, so the configuration loads.
            assert!(load(), "AMX tile configuration failed to load");
            for k0 in (0..kt).step_by(KSTEPS) {
                let steps = KSTEPS.min(kt - k0);
                for i in (0..rows).step_by(MB) {
                    for j in (0..cols).step_by(MB) {
                        // SAFETY: panels i/16 and +1 of `a`, j/16 and +1 of `b` exist
                        // with kt k tiles each (i < rows, j < cols are multiples of
                        // 32), k0 + steps <= kt; the block (i.., j..) of 32 × 32 lies
                        // in `acc`; the config is loaded.
                        unsafe {
                            block(
                                a.as_ptr().add((i / 16 * kt + k0) * TILE),
                                b.as_ptr().add((j / 16 * kt + k0) * TILE),
                                kt,
                                steps,
                                acc.as_mut_ptr().add(i * task + j),
                                task * 4,
                                k0 == 0,
                            );
                        }
                    }
                }
            }
            release();
            let width = cols.min(n - c0);
            for r in 0..rows.min(m - r0) {
                // SAFETY: row r0 + r, columns c0..c0 + width lie in `out` ((r0 + r, c0 +
                // width - 1) < (m, n)), and no other task accesses them: tasks own
                // disjoint rectangles.
                let row = unsafe { dst.row((r0 + r) * n + c0, width) };
                for (o, &v) in row.iter_mut().zip(&acc[r * task..][..width]) {
                    *o = T::encode(v);
                }
            }
        });
    }

    /// Output rows / columns per task: 128, or 64 when that leaves fewer than four
    /// tasks per thread.
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
    use super::{Encode, LazyPanels};

    pub(super) fn available() -> bool {
        false
    }

    pub(super) fn load() -> bool {
        false
    }

    pub(super) fn release() {}

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block_rm(
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run<T: Encode>(
        _: &LazyPanels<'_, u16>,
        _: &LazyPanels<'_, u16>,
        _: impl Fn(usize, &mut [u16]) + Sync,
        _: impl Fn(usize, &mut [u16]) + Sync,
        _: &mut [T],
        _: usize,
        _: usize,
        _: usize,
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

    const SHAPES: [(usize, usize, usize); 5] = [
        (1, 1, 1),
        (17, 33, 45),
        (40, 70, 31),
        (130, 100, 150),
        (257, 64, 33),
    ];

    /// The packed layouts, multiplied the way `TDPBF16PS` pairs them, give `a · b`:
    /// checks the packing on any CPU.
    #[test]
    fn packed_tiles_multiply_to_the_product() {
        let mut rng = SplitMix64::new(7);
        for (m, k, n) in SHAPES {
            let a = random_bf16(&mut rng, m * k);
            let b = random_bf16(&mut rng, k * n);
            let (mt, kt, nt) = (
                m.next_multiple_of(MB) / 16,
                k.div_ceil(KB),
                n.next_multiple_of(MB) / 16,
            );
            let (mut ap, mut bp) = (vec![1; mt * kt * TILE], vec![1; nt * kt * TILE]);
            for (t, dst) in ap.chunks_mut(kt * TILE).enumerate() {
                pack_a_panel(&a, m, k, t, dst);
            }
            for (t, dst) in bp.chunks_mut(kt * TILE).enumerate() {
                pack_b_panel(&b, k, n, t, dst);
            }
            let f = |h: u16| bf16::from_bits(h).to_f32();
            let mut got = vec![0f32; m * n];
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0f32;
                    for s in 0..kt {
                        let at = &ap[((i / 16) * kt + s) * TILE + (i % 16) * KB..][..KB];
                        let bt = &bp[((j / 16) * kt + s) * TILE..][..TILE];
                        for p in 0..16 {
                            for sub in 0..2 {
                                acc += f(at[2 * p + sub]) * f(bt[p * 32 + (j % 16) * 2 + sub]);
                            }
                        }
                    }
                    got[i * n + j] = acc;
                }
            }
            assert_close(&got, &reference(&a, &b, m, k, n), k);
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
            assert_eq!(ran, available());
            if ran {
                assert_close(&got, &reference(&a, &b, m, k, n), k);
            } else {
                assert!(got.iter().all(|x| x.is_nan()), "declined but wrote output");
            }
        }
    }
}
