//! Launchers of kpt's own CUDA kernels (`kernels/cuda/*.cu`, embedded by
//! `kpt_kernels::artifacts`). Each takes device addresses and sizes; the backend checks
//! buffers against shapes before it calls them.

use std::ffi::c_void;

use cudarc::driver::DeviceRepr;
use kpt_core::graph::{Activation, AttentionDropout};
use kpt_core::DType;

use crate::gpu::Gpu;
use crate::tma::{tensor_map_3d, TensorMap, TmaElem};
use crate::NvidiaError;

/// Launches `entry` of kernel source `kernel` on `grid` blocks with the block size and
/// shared memory its manifest records, passing each argument by value ([`Gpu::launch`]:
/// a programmatic launch where the kernel's image waits for its producer).
macro_rules! launch {
    ($gpu:expr, $kernel:expr, $entry:expr, $grid:expr; $($arg:expr),* $(,)?) => {{
        launch!($gpu, $kernel, $entry, $grid, cluster 1; $($arg),*)
    }};
    // Thread-block clusters of `$cluster` consecutive blocks (1: none).
    ($gpu:expr, $kernel:expr, $entry:expr, $grid:expr, cluster $cluster:expr;
     $($arg:expr),* $(,)?) => {{
        let f = $gpu.function($kernel, &$entry)?;
        let grid = crate::gpu::LaunchGrid { blocks: $grid, cluster: $cluster };
        launch!(@bind $gpu, f, grid; []; $($arg),*)
    }};
    // Binds each argument to a local (each expansion's `arg` is a distinct variable) that
    // lives until the launch has returned...
    (@bind $gpu:expr, $f:ident, $grid:ident; [$($bound:ident)*]; $a:expr $(, $rest:expr)*) => {{
        let arg = $a;
        launch!(@bind $gpu, $f, $grid; [$($bound)* arg]; $($rest),*)
    }};
    // ...then passes the driver one pointer to each.
    (@bind $gpu:expr, $f:ident, $grid:ident; [$($bound:ident)*];) => {{
        let mut params = [$(kernel_param(&$bound)),*];
        // SAFETY: the entry point's parameters match the arguments in order and type
        // (see the kernel source), `params` points at locals that outlive the call, and
        // the backend checked every buffer against the sizes passed.
        unsafe { $gpu.launch(&$f, $grid, &mut params) }?
    }};
}

/// The pointer the driver reads a kernel argument through.
fn kernel_param<T: DeviceRepr>(value: &T) -> *mut c_void {
    (value as *const T).cast_mut().cast()
}

/// Query rows per block of `flash_attention.cu` and `flash_attention_sm90.cu` (their
/// kBlockM; the sm90 kernel's 16-bit d = 64 entries run three consumer warpgroups, 192 rows).
const FLASH_BLOCK_M: usize = 64;
/// Head dims of `flash_attention.cu`'s mma.sync kernel (the Hopper kernels: 64 and 128).
const FLASH_HEAD_DIMS: [i32; 4] = [64, 128, 192, 256];
const FLASH_SM90_BLOCK_M: usize = 128;
const FLASH_SM90_BLOCK_M_D64: usize = 192;

/// Query rows per block of `flash_attention_sm90.cu`'s forward at head dim `d` (its
/// `Config::kBlockM`: three consumer warpgroups for 16-bit d = 64 without dropout).
fn sm90_block_m(d: i32, dropout: bool) -> usize {
    if d == 64 && !dropout {
        FLASH_SM90_BLOCK_M_D64
    } else {
        FLASH_SM90_BLOCK_M
    }
}
/// Keys per block of the wgmma dk / dv kernel of `flash_attention_sm90.cu` (its kBwdKeys)
/// and query rows per block of its dq kernel (kDqRows).
const FLASH_SM90_BWD_KEYS: usize = 128;
const FLASH_SM90_BWD_ROWS: usize = 128;
/// Keys per K/V tile of `flash_attention_sm90.cu` (its kBlockN).
const FLASH_SM90_BLOCK_N: usize = 128;
/// Keys per K/V tile of its `_tma_n160_carry_` entries: bf16/f16 at head dim 128 without
/// an additive mask.
const FLASH_SM90_BLOCK_N_WIDE: usize = 160;
/// Keys per K/V tile of its `_tma_n176_x2_` entries (clusters of two blocks sharing K/V,
/// [`Gpu::kv_multicast`]).
const FLASH_SM90_BLOCK_N_PAIR: usize = 176;
/// Keys per K/V tile of its `_tma_n192_` FP8 entries: FP8 without an additive mask.
const FLASH_SM90_BLOCK_N_FP8_WIDE: usize = 192;
/// Most query tiles of a causal call that runs on the persistent grid (paired tiles):
/// at 32 (S4096, d128) it measured 2 % faster than a block per tile on an H200, at 128
/// (S16384) 2 % slower.
const CAUSAL_PAIRED_TILES: usize = 32;

/// Row blocks of the Triton norm specializations (`kernels/triton/rms_norm.py`).
const TRITON_ROW_BLOCKS: [usize; 4] = [1024, 2048, 4096, 8192];

/// Which build of a kernel runs: CUDA C++ (`kernels/cuda`) or Triton (`kernels/triton`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Impl {
    /// The CUDA C++ kernel.
    Cuda,
    /// The Triton kernel.
    Triton,
}

/// Where a quantization kernel finds its per-tensor scale.
#[derive(Debug, Clone, Copy)]
pub(crate) enum QuantScale {
    /// An f32 in device memory (computed there, e.g. from the amax).
    OnDevice(u64),
    /// A value known on the host, passed as a kernel argument.
    Value(f32),
}

/// The entry-point suffix of a float dtype the kernels take.
pub(crate) fn float_name(dtype: DType) -> Result<&'static str, NvidiaError> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        d => Err(NvidiaError::Invalid(format!(
            "CUDA kernels take f32, bf16 or f16, not {d}"
        ))),
    }
}

fn index_name(dtype: DType) -> Result<&'static str, NvidiaError> {
    match dtype {
        DType::I32 => Ok("i32"),
        DType::I64 => Ok("i64"),
        d => Err(NvidiaError::Invalid(format!(
            "indices must be i32 or i64, not {d}"
        ))),
    }
}

fn quant_name(dtype: DType) -> Result<&'static str, NvidiaError> {
    match dtype {
        DType::F8E4M3 => Ok("e4m3"),
        DType::F8E5M2 => Ok("e5m2"),
        DType::I8 => Ok("i8"),
        d => Err(NvidiaError::Invalid(format!(
            "quantized dtypes are f8e4m3, f8e5m2 and i8, not {d}"
        ))),
    }
}

fn int(what: &str, v: usize) -> Result<i32, NvidiaError> {
    i32::try_from(v).map_err(|_| NvidiaError::Invalid(format!("{what} = {v} exceeds 2^31 - 1")))
}

fn long(v: usize) -> i64 {
    // Buffer sizes come from allocations, which are far below i64::MAX.
    v as i64
}

fn grid(what: &str, v: usize) -> Result<u32, NvidiaError> {
    if v == 0 {
        return Err(NvidiaError::Invalid(format!("{what} is empty")));
    }
    u32::try_from(v)
        .map_err(|_| NvidiaError::Invalid(format!("{what} = {v} exceeds 2^32 - 1 blocks")))
}

/// The rotary kernels' limits: an even `head_dim` of at most 512 (their shared cos/sin
/// tables), and `period` positions that divide the `tokens`.
fn check_rotary_dims(tokens: usize, period: usize, head_dim: usize) -> Result<(), NvidiaError> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > 512 {
        return Err(NvidiaError::Invalid(format!(
            "rotary head_dim must be even, non-zero and at most 512, got {head_dim}"
        )));
    }
    if tokens > 0 && (period == 0 || !tokens.is_multiple_of(period)) {
        return Err(NvidiaError::Invalid(format!(
            "rotary positions ({period}) must divide the tokens ({tokens})"
        )));
    }
    Ok(())
}

fn act_code(act: Activation) -> i32 {
    match act {
        Activation::Relu => 0,
        Activation::GeluErf => 1,
        Activation::GeluTanh => 2,
        Activation::Silu => 3,
    }
}

/// The element-wise binary ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Binary {
    Add = 0,
    Mul = 1,
}

/// The sizes of one attention call, passed to `kpt_attention_*` by value (the layout of
/// `kpt::AttentionDims` in `kernels/cuda/attention_dims.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionDims {
    batch: i32,
    seq_q: i32,
    seq_kv: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    causal: i32,
    scale: f32,
    /// Sliding window in keys; 0 = none.
    window: i32,
    /// Dropout: keep iff the 16-bit Philox number is at least this; 0 = no dropout.
    dropout_threshold: u32,
    seed_lo: u32,
    seed_hi: u32,
    /// The factor of kept probabilities, `1 / (1 - p)`.
    dropout_scale: f32,
    /// Dropout's batch index of batch entry 0 (a varlen sequence's index).
    batch_offset: i32,
}

// SAFETY: a `repr(C)` struct of 32-bit integers and floats, laid out like the kernel's
// `Dims`; any bit pattern is a valid value.
unsafe impl cudarc::driver::DeviceRepr for AttentionDims {}

/// Rows (warps) per block of the attention kernel.
const ATTENTION_ROWS_PER_BLOCK: usize = 4;
/// Largest head dimension of the attention kernel.
pub(crate) const ATTENTION_MAX_HEAD_DIM: usize = 256;

impl AttentionDims {
    /// Checked sizes: heads divisible by kv heads, head_dim in 1..=256, all within i32.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        batch: usize,
        seq_q: usize,
        seq_kv: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        causal: bool,
        scale: f32,
    ) -> Result<Self, NvidiaError> {
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(NvidiaError::Invalid(format!(
                "attention: {heads} query heads do not group over {kv_heads} kv heads"
            )));
        }
        if head_dim == 0 || head_dim > ATTENTION_MAX_HEAD_DIM {
            return Err(NvidiaError::Invalid(format!(
                "attention: head_dim {head_dim} is outside 1..={ATTENTION_MAX_HEAD_DIM}"
            )));
        }
        // Element offsets inside the kernel are 64-bit; the row count must fit a grid.
        let rows = batch
            .checked_mul(seq_q)
            .and_then(|r| r.checked_mul(heads))
            .ok_or_else(|| NvidiaError::Invalid("attention: too many rows".into()))?;
        int("attention rows", rows)?;
        Ok(Self {
            batch: int("batch", batch)?,
            seq_q: int("seq_q", seq_q)?,
            seq_kv: int("seq_kv", seq_kv)?,
            heads: int("heads", heads)?,
            kv_heads: int("kv_heads", kv_heads)?,
            head_dim: int("head_dim", head_dim)?,
            causal: i32::from(causal),
            scale,
            window: 0,
            dropout_threshold: 0,
            seed_lo: 0,
            seed_hi: 0,
            dropout_scale: 1.0,
            batch_offset: 0,
        })
    }

    /// The same sizes with attention dropout (`attention_dims.cuh`); the tensor-core
    /// kernels apply it (`flash_attention*.cu`; the Hopper ones in their `_dropout_`
    /// entries).
    pub(crate) fn with_dropout(self, dropout: Option<AttentionDropout>) -> Self {
        match dropout {
            None => self,
            Some(d) => Self {
                dropout_threshold: d.threshold(),
                seed_lo: d.seed as u32,
                seed_hi: (d.seed >> 32) as u32,
                dropout_scale: d.scale() as f32,
                ..self
            },
        }
    }

    /// Whether these sizes drop probabilities.
    pub(crate) fn dropout(&self) -> bool {
        self.dropout_threshold != 0
    }

    /// The same sizes whose batch entry 0 takes dropout decisions as entry `offset` (a
    /// sequence of a variable-length batch, run on its own).
    pub(crate) fn with_batch_offset(self, offset: usize) -> Result<Self, NvidiaError> {
        Ok(Self {
            batch_offset: int("batch offset", offset)?,
            ..self
        })
    }

    /// The sizes of a variable-length batch of `sequences` packed into the rows of these
    /// (built with batch 1): the `_varlen_` kernels' `Dims`.
    pub(crate) fn packed(self, sequences: usize) -> Result<Self, NvidiaError> {
        Ok(Self {
            batch: int("sequences", sequences)?,
            ..self
        })
    }

    /// The same sizes with a sliding window of `window` keys (at least 1).
    pub(crate) fn with_window(self, window: Option<usize>) -> Result<Self, NvidiaError> {
        Ok(Self {
            window: match window {
                None => 0,
                Some(0) => {
                    return Err(NvidiaError::Invalid(
                        "attention: window must be at least 1 key".into(),
                    ))
                }
                Some(w) => int("window", w)?,
            },
            ..self
        })
    }

    /// The same sizes with the softmax scale multiplied by `factor` (FP8 descaling).
    pub(crate) fn scaled(self, factor: f32) -> Self {
        Self {
            scale: self.scale * factor,
            ..self
        }
    }

    fn rows(&self) -> usize {
        self.batch as usize * self.seq_q as usize * self.heads as usize
    }

    /// The split-KV plan for these sizes (`kernels/cuda/attention_split.cu`), or `None`
    /// when the general kernel should run (always with a sliding window, which the split
    /// kernels do not take): the kv group's query rows must fit the split
    /// kernel ([`SPLIT_MAX_ROWS`], or [`SPLIT_MAX_ROWS_WIDE`] on the wide 16-bit entries at
    /// head dims up to 128), the cache must span at least two tiles, and the head
    /// dim must suit the dtype's kernel: bf16 and f16 run on tensor cores in k-steps of 16
    /// dims, with a tile of [`SPLIT_STAGE_ELEMS`] / D keys for the head-dim class D (64,
    /// 128 or 256); f32 runs the scalar kernel, whose rows must be whole 16-byte vectors
    /// and whose query rows must fit its shared memory. Tiles are dealt out in runs: about
    /// [`SPLIT_TARGET_BLOCKS`] blocks for f32; for bf16 / f16 at most one wave,
    /// [`SPLIT_WAVE_BLOCKS`] (wide: [`SPLIT_WAVE_BLOCKS_WIDE`]; one run per kv group when
    /// there are more groups).
    fn split(&self, dtype: DType) -> Option<SplitDims> {
        self.split_plan(dtype, 2)
    }

    /// [`split`](Self::split) with at least `min_tiles` tiles of keys: 2 for dense
    /// caches (below that the general and tensor-core kernels read the few keys as fast),
    /// 1 for paged ones, where the split kernel is the path without a host readback.
    fn split_plan(&self, dtype: DType, min_tiles: usize) -> Option<SplitDims> {
        let (d, size) = (self.head_dim as usize, dtype.size_in_bytes());
        let rows = self.seq_q as usize * (self.heads / self.kv_heads) as usize;
        let max_rows = if dtype == DType::F32 || d > 128 {
            SPLIT_MAX_ROWS
        } else {
            SPLIT_MAX_ROWS_WIDE
        };
        if rows > max_rows || self.window != 0 {
            return None;
        }
        let tile = if dtype == DType::F32 {
            if rows * d > SPLIT_Q_FLOATS || !(d * size).is_multiple_of(16) {
                return None;
            }
            let words = d * size / 4 + 1;
            (SPLIT_KV_WORDS / (2 * words)).min(SPLIT_MAX_TILE)
        } else {
            if !d.is_multiple_of(16) {
                return None;
            }
            SPLIT_STAGE_ELEMS / d.next_power_of_two().max(64)
        };
        let tiles = (self.seq_kv as usize).div_ceil(tile);
        let groups = self.batch as usize * self.kv_heads as usize;
        if tiles < min_tiles.max(1) || groups == 0 {
            return None;
        }
        let runs = if dtype == DType::F32 {
            SPLIT_TARGET_BLOCKS.div_ceil(groups)
        } else if rows > SPLIT_MAX_ROWS {
            SPLIT_WAVE_BLOCKS_WIDE / groups
        } else {
            SPLIT_WAVE_BLOCKS / groups
        };
        let per = tiles.div_ceil(runs.clamp(1, tiles));
        Some(SplitDims {
            dims: *self,
            tile: tile as i32,
            tiles: tiles as i32,
            splits: tiles.div_ceil(per) as i32,
        })
    }

    /// The plan of a cluster launch (`kpt_attention_split_*cluster_*`), where `plan` (of
    /// [`split_plan`](Self::split_plan)) is of a 16-bit dtype and its cache fits
    /// [`SPLIT_CLUSTER_MAX`] runs of at most [`SPLIT_CLUSTER_TILES`] tiles: the runs of
    /// a kv group, one cluster, merge among themselves, so a decode step over a short
    /// cache needs no combine launch.
    fn cluster_plan(plan: SplitDims, dtype: DType) -> Option<SplitDims> {
        let tiles = plan.tiles as usize;
        if dtype == DType::F32 || plan.wide() || tiles > SPLIT_CLUSTER_MAX * SPLIT_CLUSTER_TILES {
            return None;
        }
        let per = tiles.div_ceil(SPLIT_CLUSTER_MAX);
        Some(SplitDims {
            splits: tiles.div_ceil(per) as i32,
            ..plan
        })
    }
}

/// Blocks of a kv group in a cluster launch of `attention_split.cu` (its
/// kMaxClusterSplits: the portable cluster size), and the most tiles each takes there.
const SPLIT_CLUSTER_MAX: usize = 8;
const SPLIT_CLUSTER_TILES: usize = 2;

/// Shared-memory budgets of the f32 kernel of `attention_split.cu` (its kQFloats and
/// kKvWords) and its largest tile (two keys per lane).
const SPLIT_Q_FLOATS: usize = 2048;
const SPLIT_KV_WORDS: usize = 4096;
const SPLIT_MAX_TILE: usize = 64;
/// K (and V) elements of one pipeline stage of the bf16 / f16 kernel (its
/// tc::kStageElems): 64, 32 or 16 keys of head-dim class 64, 128 or 256.
const SPLIT_STAGE_ELEMS: usize = 4096;
/// Query rows of one kv group the split kernels take (f32: 4 warps x kRowsPerWarp;
/// bf16 / f16: four n-tiles of 8).
const SPLIT_MAX_ROWS: usize = 32;
/// Query rows of one kv group the wide bf16 / f16 entries take at head dims up to 128
/// (`kpt_attention_split_wide_*`: eight n-tiles, two a warp), e.g. 16 queries at 4 q heads
/// per kv head.
const SPLIT_MAX_ROWS_WIDE: usize = 64;
/// Blocks the f32 split kernel aims for.
const SPLIT_TARGET_BLOCKS: usize = 1024;
/// Blocks the bf16 / f16 split kernel stays within: one wave of four blocks (48 KiB of
/// shared memory each) on each of an H100's 132 SMs. Fewer, longer runs beat two waves:
/// each run pays a pipeline fill and a share of the combine pass.
const SPLIT_WAVE_BLOCKS: usize = 528;
/// The same for the wide entries, of which three fit an SM (their registers).
const SPLIT_WAVE_BLOCKS_WIDE: usize = 396;

/// The TMA maps of the Hopper attention kernel's Q, K and V tiles for query tiles of
/// `block_m` rows and key tiles of `block_n` (the producer of `flash_attention_sm90.cu`):
/// Q `[batch, seq_q, heads * d]` and K, V `[batch, seq_kv, kv_heads * d]`, read in boxes of
/// one 128-byte column block by `block_m` (Q) or `block_n` (K, V) rows of one sequence, so
/// rows past a sequence's end (and Q rows before 0) read as zeros. FP8 (`TmaElem::Byte`): `v` is the
/// V^T of `kpt_attention_fp8_v_transpose_d128`, `[batch * kv_heads, d, keys]` with keys
/// rounded up to 128, read in boxes of d rows by 128 keys (a 192-key tile takes two, keys
/// past the end reading as zeros). `None` where the driver refuses a map (the cp.async
/// kernel runs instead).
fn sm90_tensor_maps(
    elem: TmaElem,
    [q, k, v]: [u64; 3],
    dims: AttentionDims,
    block_m: usize,
    block_n: usize,
) -> Option<[TensorMap; 3]> {
    let esize: u64 = if elem == TmaElem::Byte { 1 } else { 2 };
    let d = dims.head_dim as u64;
    let (batch, seq_q, seq_kv) = (dims.batch as u64, dims.seq_q as u64, dims.seq_kv as u64);
    let (q_row, kv_row) = (dims.heads as u64 * d, dims.kv_heads as u64 * d);
    let cols = (128 / esize) as u32;
    let tile = block_n as u64;
    let rows = |row: u64, seq: u64| ([row, seq, batch], [row * esize, seq * row * esize]);
    let (qd, qs) = rows(q_row, seq_q);
    let tq = tensor_map_3d(elem, q, qd, qs, [cols, block_m as u32, 1])?;
    let (kd, ks) = rows(kv_row, seq_kv);
    let tk = tensor_map_3d(elem, k, kd, ks, [cols, tile as u32, 1])?;
    let tv = if elem == TmaElem::Byte {
        let vt_tile = FLASH_SM90_BLOCK_N as u64;
        let keys = seq_kv.div_ceil(vt_tile) * vt_tile;
        let groups = batch * dims.kv_heads as u64;
        tensor_map_3d(
            elem,
            v,
            [keys, d, groups],
            [keys, d * keys],
            [vt_tile as u32, d as u32, 1],
        )?
    } else {
        tensor_map_3d(elem, v, kd, ks, [cols, tile as u32, 1])?
    };
    Some([tq, tk, tv])
}

/// The TMA map through which the Hopper attention kernel's staged entries (`_tma_n160_carry_`,
/// `_tma_carry_` at head dim 64, FP8's `_tma_n192_`) store their 16-bit output
/// `[batch, seq_q, heads * d]`: boxes of 64 columns by the 64 rows of a consumer warpgroup,
/// so rows past a sequence's end are not written (the kernel stores boxes that would start
/// before row 0 directly). `None` where the driver refuses the map.
fn sm90_out_map(elem: TmaElem, out: u64, dims: AttentionDims) -> Option<TensorMap> {
    let row = dims.heads as u64 * dims.head_dim as u64;
    let (seq_q, batch) = (dims.seq_q as u64, dims.batch as u64);
    tensor_map_3d(
        elem,
        out,
        [row, seq_q, batch],
        [row * 2, seq_q * row * 2],
        [64, 64, 1],
    )
}

/// The row reductions of `softmax.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowOp {
    /// Softmax over the row.
    Softmax,
    /// Index of the row's maximum.
    ArgMax,
}

/// Row classes of `gemv.cu` (its kMaxM instantiations) and the largest.
const GEMV_ROW_CLASSES: [usize; 6] = [1, 2, 4, 8, 16, 32];
/// The most activation rows the GEMV kernel takes.
pub(crate) const GEMV_MAX_ROWS: usize = 32;
/// Weight rows per block of `gemv.cu`'s CUDA-core classes (two warps per row, its
/// kRowsPerBlock).
const GEMV_ROWS_PER_BLOCK: usize = 4;
/// Weight rows per block of its tensor-core classes (one MMA tile of 16 rows, its
/// kTileRows).
const GEMV_TILE_ROWS: usize = 16;
/// The longest activation row `kpt_gemv_staged_*_m1` stages in shared memory (its
/// 8 * kStageVecs).
const GEMV_STAGE_MAX_K: usize = 8192;
/// The smallest row class that runs on tensor cores for bf16 and f16 (8, 16 and 32 do).
const GEMV_TENSOR_CORE_CLASS: usize = 8;

/// Sizes of one GEMV call (the kernel's `GemvDims`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemvDims {
    m: i32,
    n: i32,
    k: i32,
    vec: i32,
    preload: i32,
}

// SAFETY: `repr(C)` of five i32, laid out like the kernel's `GemvDims`; any bit pattern
// is a valid value.
unsafe impl cudarc::driver::DeviceRepr for GemvDims {}

/// Sizes of one split-KV attention call (the kernel's `SplitDims`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SplitDims {
    dims: AttentionDims,
    tile: i32,
    tiles: i32,
    splits: i32,
}

// SAFETY: `repr(C)` of an `AttentionDims` and three i32, laid out like the kernel's
// `SplitDims`; any bit pattern is a valid value.
unsafe impl cudarc::driver::DeviceRepr for SplitDims {}

impl SplitDims {
    /// Whether the kv group's query rows need the wide entries (more than
    /// [`SPLIT_MAX_ROWS`]).
    fn wide(&self) -> bool {
        let d = &self.dims;
        d.seq_q as usize * (d.heads / d.kv_heads) as usize > SPLIT_MAX_ROWS
    }

    /// The split kernel's entry for `name` (the dtype), `paged` or dense.
    fn entry(&self, name: &str, paged: bool) -> String {
        let paged = if paged { "paged_" } else { "" };
        let wide = if self.wide() { "wide_" } else { "" };
        format!("kpt_attention_split_{paged}{wide}{name}")
    }

    /// Blocks of a split launch: one per kv group and run.
    fn blocks(&self) -> usize {
        self.dims.batch as usize * self.dims.kv_heads as usize * self.splits as usize
    }
}

/// A paged KV cache in device memory, as [`Gpu::paged_attention`] takes it: the caches
/// `[num_blocks, block_size, kv_heads * head_dim]`, the block table `[batch, max_blocks]`
/// and the sequence lengths `[batch]` (i32 or i64 each). Nothing here is read on the
/// host.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PagedCache {
    /// Block table: address and index dtype.
    pub table: (u64, DType),
    /// Sequence lengths: address and index dtype.
    pub lens: (u64, DType),
    pub block_size: usize,
    pub max_blocks: usize,
    pub num_blocks: usize,
}

/// The kernel's `Paged` (`attention_split.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PagedSplit {
    table: u64,
    lens: u64,
    table_i64: i32,
    lens_i64: i32,
    block_size: i32,
    /// log2(block_size) when it is a power of two, else -1.
    block_shift: i32,
    max_blocks: i32,
    num_blocks: i32,
}

// SAFETY: `repr(C)` of two u64 then six i32 (40 bytes, no padding), laid out like the
// kernel's `Paged` (two pointers, six ints); any bit pattern is a valid value.
unsafe impl cudarc::driver::DeviceRepr for PagedSplit {}

/// Query rows and keys per tile of `flash_attention_bwd.cu` (its kBlockM and kBlockN).
const FLASH_BWD_TILE: usize = 64;

/// One call of the tensor-core attention backward (`flash_attention_bwd.cu`): its sizes,
/// checked, and its grids.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlashBackward {
    dims: AttentionDims,
    /// Entry-point dtype suffix.
    name: &'static str,
    /// Blocks of the dq kernel: query tiles x batch x heads x head-dim halves.
    query_tiles: usize,
    /// Blocks of the dk / dv kernel: key tiles x batch x kv heads x head-dim halves.
    key_tiles: usize,
}

impl FlashBackward {
    /// The plan for `dims` in `dtype`, or why the kernels do not take them: bf16 or f16,
    /// head dim 64, 128, 192 or 256. Above 128 each block accumulates half of the head
    /// dim's columns (twice the blocks; `flash_attention_bwd.cu`).
    pub(crate) fn new(dtype: DType, dims: AttentionDims) -> Result<Self, NvidiaError> {
        let name = match dtype {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            d => {
                return Err(NvidiaError::Invalid(format!(
                    "flash attention backward takes bf16 or f16, not {d}"
                )))
            }
        };
        if ![64, 128, 192, 256].contains(&dims.head_dim) {
            return Err(NvidiaError::Invalid(format!(
                "flash attention backward takes head dim 64, 128, 192 or 256, not {}",
                dims.head_dim
            )));
        }
        let halves = if dims.head_dim > 128 { 2 } else { 1 };
        let (batch, seq_q, seq_kv) = (
            dims.batch as usize,
            dims.seq_q as usize,
            dims.seq_kv as usize,
        );
        let (heads, kv_heads) = (dims.heads as usize, dims.kv_heads as usize);
        let plan = Self {
            dims,
            name,
            query_tiles: seq_q.div_ceil(FLASH_BWD_TILE) * batch * heads * halves,
            key_tiles: seq_kv.div_ceil(FLASH_BWD_TILE) * batch * kv_heads * halves,
        };
        // The kernels index the padded statistics with i32 row numbers.
        int("flash backward rows", plan.padded_rows())?;
        Ok(plan)
    }

    /// Rows of the per-row statistics: batch x heads x seq_q rounded up to whole tiles.
    fn padded_rows(&self) -> usize {
        let d = &self.dims;
        (d.seq_q as usize).div_ceil(FLASH_BWD_TILE)
            * FLASH_BWD_TILE
            * d.batch as usize
            * d.heads as usize
    }
}

/// The widest copy unit of `paged.cu` (16, 4 or 2 bytes) that divides a cache row of
/// `row_bytes`, and the row's length in those units.
fn row_units(row_bytes: usize) -> Result<(usize, usize), NvidiaError> {
    [16, 4, 2]
        .into_iter()
        .find(|u| row_bytes.is_multiple_of(*u))
        .map(|u| (u, row_bytes / u))
        .ok_or_else(|| NvidiaError::Invalid(format!("cache rows of {row_bytes} bytes")))
}

impl Gpu {
    /// Blocks for a grid-stride loop over `n` elements of 16-byte vectors: enough to
    /// fill the device, never more than the work.
    fn stride_grid(&self, n: usize, dtype_bytes: usize) -> u32 {
        let vectors = n.div_ceil((16 / dtype_bytes).max(1));
        let most = self.properties().sm_count.max(1) as usize * 16;
        vectors.div_ceil(256).clamp(1, most) as u32
    }

    /// The Triton norm specialization of `name` for `dtype` and rows of `dim`, after
    /// checking the assumptions it was compiled with (see `kernels/triton/rms_norm.py`).
    fn triton_norm(
        &self,
        name: &str,
        dtype: DType,
        dim: usize,
        pointers: &[u64],
    ) -> Result<String, NvidiaError> {
        let block = TRITON_ROW_BLOCKS
            .into_iter()
            .find(|&b| b >= dim)
            .ok_or_else(|| {
                NvidiaError::Invalid(format!(
                    "Triton {name}: rows of {dim} exceed {}",
                    TRITON_ROW_BLOCKS[TRITON_ROW_BLOCKS.len() - 1]
                ))
            })?;
        if !dim.is_multiple_of(16) || pointers.iter().any(|p| !p.is_multiple_of(16)) {
            return Err(NvidiaError::Invalid(format!(
                "Triton {name} needs rows of a multiple of 16 elements and 16-byte aligned \
                 buffers (row of {dim})"
            )));
        }
        Ok(format!("triton_{name}_{}_{block}", float_name(dtype)?))
    }

    /// RMSNorm of `rows` rows of `dim` with the kernel built by `imp`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm(
        &self,
        imp: Impl,
        dtype: DType,
        x: u64,
        w: u64,
        out: u64,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), NvidiaError> {
        let grid = grid("rows", rows)?;
        let dim_arg = int("dim", dim)?;
        match imp {
            Impl::Cuda => {
                let entry = format!("kpt_rms_norm_{}", float_name(dtype)?);
                launch!(self, "rms_norm", entry, grid; x, w, out, dim_arg, eps);
            }
            Impl::Triton => {
                let kernel = self.triton_norm("rms_norm", dtype, dim, &[x, w, out])?;
                // Triton kernels take two trailing scratch pointers (unused here: null).
                launch!(self, &kernel, "kpt_rms_norm", grid; x, w, out, dim_arg, eps, 0u64, 0u64);
            }
        }
        Ok(())
    }

    /// `sum = x + residual`, `out = rms_norm(sum)` with the kernel built by `imp`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_rms_norm(
        &self,
        imp: Impl,
        dtype: DType,
        x: u64,
        residual: u64,
        w: u64,
        sum: u64,
        out: u64,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), NvidiaError> {
        let grid = grid("rows", rows)?;
        let dim_arg = int("dim", dim)?;
        match imp {
            Impl::Cuda => {
                let entry = format!("kpt_add_rms_norm_{}", float_name(dtype)?);
                launch!(self, "rms_norm", entry, grid;
                    x, residual, w, sum, out, dim_arg, eps);
            }
            Impl::Triton => {
                let ptrs = [x, residual, w, sum, out];
                let kernel = self.triton_norm("add_rms_norm", dtype, dim, &ptrs)?;
                launch!(self, &kernel, "kpt_add_rms_norm", grid;
                    x, residual, w, sum, out, dim_arg, eps, 0u64, 0u64);
            }
        }
        Ok(())
    }

    /// LayerNorm of `rows` rows of `dim`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm(
        &self,
        dtype: DType,
        x: u64,
        w: u64,
        b: u64,
        out: u64,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), NvidiaError> {
        let entry = format!("kpt_layer_norm_{}", float_name(dtype)?);
        launch!(self, "layer_norm", entry, grid("rows", rows)?;
            x, w, b, out, int("dim", dim)?, eps);
        Ok(())
    }

    /// `sum = x + residual`, `out = layer_norm(sum)` of `rows` rows of `dim`, from the
    /// inputs `[x, residual, w, b]` into the outputs `[sum, out]`.
    pub(crate) fn add_layer_norm(
        &self,
        dtype: DType,
        [x, residual, w, b]: [u64; 4],
        [sum, out]: [u64; 2],
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), NvidiaError> {
        let entry = format!("kpt_add_layer_norm_{}", float_name(dtype)?);
        launch!(self, "layer_norm", entry, grid("rows", rows)?;
            x, residual, w, b, sum, out, int("dim", dim)?, eps);
        Ok(())
    }

    /// A row reduction of `softmax.cu` over `rows` rows of `dim`: `Softmax` (out like
    /// x) or `ArgMax` (i64 `out [rows]`, -1 for a row with a NaN).
    pub(crate) fn row_op(
        &self,
        op: RowOp,
        dtype: DType,
        x: u64,
        out: u64,
        rows: usize,
        dim: usize,
    ) -> Result<(), NvidiaError> {
        let name = match op {
            RowOp::Softmax => "softmax",
            RowOp::ArgMax => "argmax",
        };
        let entry = format!("kpt_{name}_{}", float_name(dtype)?);
        launch!(self, "softmax", entry, grid("rows", rows)?; x, out, int("dim", dim)?);
        Ok(())
    }

    /// Attention over `q [batch, seq_q, heads * d]`, `k`, `v [batch, seq_kv, kv_heads * d]`
    /// into `out` (like `q`), with an additive f32 `[seq_q, seq_kv]` mask at `mask` (0:
    /// none).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        dtype: DType,
        q: u64,
        k: u64,
        v: u64,
        mask: u64,
        out: u64,
        dims: AttentionDims,
    ) -> Result<(), NvidiaError> {
        let name = float_name(dtype)?;
        let blocks = grid(
            "attention rows",
            dims.rows().div_ceil(ATTENTION_ROWS_PER_BLOCK),
        )?;
        let Some(split) = dims.split(dtype) else {
            let entry = format!("kpt_attention_{name}");
            launch!(self, "attention", entry, blocks; q, k, v, mask, out, dims);
            return Ok(());
        };
        if let Some(c) = self.cluster_split(split, dtype) {
            let split_blocks = grid("attention splits", c.blocks())?;
            let entry = format!("kpt_attention_split_cluster_{name}");
            launch!(self, "attention_split", entry, split_blocks, cluster c.splits as u32;
                q, k, v, mask, out, c);
            return Ok(());
        }
        // Per (row, run of tiles): max, sum, P·V of head_dim floats.
        let splits = split.splits as usize;
        let part = self.alloc(dims.rows() * splits * (dims.head_dim as usize + 2) * 4)?;
        let split_blocks = grid("attention splits", split.blocks())?;
        let entry = split.entry(name, false);
        launch!(self, "attention_split", entry, split_blocks; q, k, v, mask, part.ptr(), split);
        let entry = format!("kpt_attention_combine_{name}");
        launch!(self, "attention_split", entry, blocks; part.ptr(), out, split);
        Ok(())
    }

    /// The cluster plan for `split` ([`AttentionDims::cluster_plan`]) where
    /// [`Gpu::cluster_attention`] is on and its blocks fit within one block per SM: with
    /// many kv groups (batched decode) clusters of 8 blocks of 48 KiB schedule worse than
    /// the plain grid and the combine launch weighs little (B32 decode of the 1.1B LLaMA:
    /// attention 0.79 against 0.58 ms a step; clusters of a group's 4 runs: 1.20 against
    /// 1.74 TB/s).
    fn cluster_split(&self, split: SplitDims, dtype: DType) -> Option<SplitDims> {
        if !self.cluster_attention() {
            return None;
        }
        let plan = AttentionDims::cluster_plan(split, dtype)?;
        (plan.blocks() <= self.properties().sm_count as usize).then_some(plan)
    }

    /// Attention of `q [batch, seq_q, heads * d]` over a paged KV cache on the split-KV
    /// kernels (`kpt_attention_split_paged_*` of `attention_split.cu`) with no host
    /// readback, so that the launches can be captured into a CUDA graph: the split count
    /// is planned for the table's capacity (`dims.seq_kv` must be `max_blocks *
    /// block_size`), each block takes its sequence's length and block ids from device
    /// memory. Lengths are clamped to the capacity and rows of block ids outside the cache
    /// are masked on the device (the host cannot check them without a synchronous copy).
    /// Returns `Ok(false)` without launching where the split kernels do not take the shape
    /// (the kv group's query rows, the head dim, a sliding window, an empty table), which
    /// the caller gathers instead.
    pub(crate) fn paged_attention(
        &self,
        dtype: DType,
        [q, k, v]: [u64; 3],
        out: u64,
        cache: PagedCache,
        dims: AttentionDims,
    ) -> Result<bool, NvidiaError> {
        let name = float_name(dtype)?;
        if dims.seq_kv as usize != cache.max_blocks * cache.block_size {
            return Err(NvidiaError::Invalid(format!(
                "paged attention: {} keys planned for a table of {} blocks of {}",
                dims.seq_kv, cache.max_blocks, cache.block_size
            )));
        }
        let Some(split) = dims.split_plan(dtype, 1) else {
            return Ok(false);
        };
        if dims.rows() == 0 {
            return Ok(true);
        }
        let index_i64 = |dt: DType| -> Result<i32, NvidiaError> {
            index_name(dt).map(|n| i32::from(n == "i64"))
        };
        let bs = cache.block_size;
        // The kernels index cache rows (block * block_size + slot) in 32 bits.
        int("cache rows", cache.num_blocks.saturating_mul(bs))?;
        let pg = PagedSplit {
            table: cache.table.0,
            lens: cache.lens.0,
            table_i64: index_i64(cache.table.1)?,
            lens_i64: index_i64(cache.lens.1)?,
            block_size: int("block size", bs)?,
            block_shift: if bs.is_power_of_two() {
                bs.trailing_zeros() as i32
            } else {
                -1
            },
            max_blocks: int("max blocks", cache.max_blocks)?,
            num_blocks: int("cache blocks", cache.num_blocks)?,
        };
        if let Some(c) = self.cluster_split(split, dtype) {
            let split_blocks = grid("attention splits", c.blocks())?;
            let entry = format!("kpt_attention_split_paged_cluster_{name}");
            launch!(self, "attention_split", entry, split_blocks, cluster c.splits as u32;
                q, k, v, out, c, pg);
            return Ok(true);
        }
        let splits = split.splits as usize;
        let part = self.alloc(dims.rows() * splits * (dims.head_dim as usize + 2) * 4)?;
        let split_blocks = grid("attention splits", split.blocks())?;
        let entry = split.entry(name, true);
        launch!(self, "attention_split", entry, split_blocks; q, k, v, part.ptr(), split, pg);
        let blocks = grid(
            "attention rows",
            dims.rows().div_ceil(ATTENTION_ROWS_PER_BLOCK),
        )?;
        let entry = format!("kpt_attention_combine_{name}");
        launch!(self, "attention_split", entry, blocks; part.ptr(), out, split);
        Ok(true)
    }

    /// Blocks of `flash_attention_sm90.cu` for query tiles of `block_m` rows: a persistent
    /// grid of one block per SM ([`Gpu::attention_blocks`]), each walking every
    /// grid-size-th work item so that an item's loads overlap the previous one's end.
    /// Without a causal mask an item is a tile; with one, a pair of tiles (a long and a
    /// short) of about equal length, and only where there are at least four items per
    /// block and at most [`CAUSAL_PAIRED_TILES`] query tiles: with fewer items the static
    /// stride would leave SMs idle, and with long sequences a block per tile, which the
    /// hardware hands to SMs as they free up (the longest first), balances better and its
    /// fill and drain cost little (docs/decisions.md, "Persistent attention grid").
    fn sm90_attention_grid(&self, dims: AttentionDims, block_m: usize) -> Result<u32, NvidiaError> {
        let tiles_m = (dims.seq_q as usize).div_ceil(block_m);
        let pairs = dims.batch as usize * dims.heads as usize;
        let tiles = tiles_m * pairs;
        let most = self.attention_blocks();
        let per_tile = dims.causal != 0
            && (tiles_m > CAUSAL_PAIRED_TILES || pairs * tiles_m.div_ceil(2) < 4 * most);
        grid(
            "flash attention tiles",
            if per_tile { tiles } else { tiles.min(most) },
        )
    }

    /// Blocks of a cluster launch of `entry` (`flash_attention_sm90.cu`'s `_x2_` entries,
    /// clusters of two blocks that take neighbouring query tiles of `block_m` rows of one
    /// head) where [`Gpu::kv_multicast`] is on and such clusters fit: a persistent grid of
    /// the clusters that run at once ([`Gpu::max_active_clusters`], within
    /// [`Gpu::attention_blocks`]), or fewer where the call has fewer pairs of tiles.
    /// `None`: launch the entry without clusters.
    fn sm90_pair_grid(
        &self,
        entry: &str,
        dims: AttentionDims,
        block_m: usize,
    ) -> Result<Option<u32>, NvidiaError> {
        if !self.kv_multicast() {
            return Ok(None);
        }
        let fit = self.max_active_clusters("flash_attention_sm90", entry, 2)?;
        if fit == 0 {
            return Ok(None);
        }
        let items =
            (dims.seq_q as usize).div_ceil(2 * block_m) * dims.batch as usize * dims.heads as usize;
        let most = fit.min(self.attention_blocks() / 2).max(1);
        grid("flash attention tile pairs", 2 * items.min(most)).map(Some)
    }

    /// Tensor-core attention for bf16 and f16 with head dim 64 or 128: with `hopper`, the
    /// wgmma kernel of `flash_attention_sm90.cu` where its sm_90a cubin is loaded (a sliding
    /// window on its `_tma_window_` entries, without an additive mask or dropout), else the
    /// mma.sync kernel of `flash_attention.cu`.
    /// Decode-shaped calls take the split-KV kernels and other dtypes or head dims the
    /// general kernel, as in [`Gpu::attention`]. With `lse` (non-zero) the rows'
    /// log-sum-exp (f32 `[batch, heads, seq_q]`) is written there too: then the
    /// tensor-core kernels run every shape (decode shapes included), and other dtypes or
    /// head dims are an error.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn flash_attention(
        &self,
        dtype: DType,
        [q, k, v, mask]: [u64; 4],
        out: u64,
        lse: u64,
        dims: AttentionDims,
        hopper: bool,
    ) -> Result<(), NvidiaError> {
        let d = dims.head_dim;
        let name = match dtype {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            _ => "",
        };
        let tensor_cores = !name.is_empty() && FLASH_HEAD_DIMS.contains(&d);
        if lse != 0 && !tensor_cores {
            return Err(NvidiaError::Invalid(format!(
                "attention log-sum-exp needs bf16 or f16 with head dim 64, 128, 192 or 256, not \
                 {dtype} with head dim {d}"
            )));
        }
        if dims.dropout() && !tensor_cores {
            return Err(NvidiaError::Invalid(format!(
                "attention dropout needs bf16 or f16 with head dim 64, 128, 192 or 256, not \
                 {dtype} with head dim {d}"
            )));
        }
        // Dropout runs on the tensor-core kernels, for every shape.
        if !tensor_cores || (lse == 0 && !dims.dropout() && dims.split(dtype).is_some()) {
            return self.attention(dtype, q, k, v, mask, out, dims);
        }
        let tiles = |rows: usize| {
            (dims.seq_q as usize).div_ceil(rows) * dims.batch as usize * dims.heads as usize
        };
        const SM90: &str = "flash_attention_sm90";
        let windowed = dims.window != 0;
        if hopper
            && d <= 128
            && (!windowed || (mask == 0 && !dims.dropout()))
            && dims.seq_kv > 0
            && self.loaded_target(SM90)? == "sm_90a"
        {
            // Dropout: the `_tma_dropout_` entries (two consumer warpgroups at both head
            // dims), or where no tensor maps can be made the mma.sync kernel below.
            let dropout = dims.dropout();
            let block_m = sm90_block_m(d, dropout);
            let blocks = self.sm90_attention_grid(dims, block_m)?;
            let elem = if dtype == DType::BF16 {
                TmaElem::Bf16
            } else {
                TmaElem::F16
            };
            if windowed {
                // Only the TMA entries take a window; without tensor maps the mma.sync
                // kernel below runs.
                let maps = sm90_tensor_maps(elem, [q, k, v], dims, block_m, FLASH_SM90_BLOCK_N);
                if let Some([tq, tk, tv]) = maps {
                    let entry = format!("kpt_flash_attention_sm90_tma_window_{name}_d{d}");
                    launch!(self, SM90, entry, blocks; q, k, v, mask, out, lse, dims, tq, tk, tv);
                    return Ok(());
                }
            }
            // Without an additive mask the consumers' ping-pong runs across a block's work
            // tiles, on 128-key tiles at head dim 64 and 160-key tiles at 128, and the output
            // is stored by TMA; at head dim 128 calls without a causal mask take 176-key
            // tiles in clusters of two blocks that share K/V instead where
            // [`Gpu::kv_multicast`] is on.
            let unmasked = mask == 0 && !dropout && !windowed;
            let wide = unmasked && d == 128;
            let pair = if wide && dims.causal == 0 {
                let entry = format!("kpt_flash_attention_sm90_tma_n176_x2_{name}_d{d}");
                self.sm90_pair_grid(&entry, dims, block_m)?
                    .map(|blocks| (entry, blocks))
            } else {
                None
            };
            let block_n = match (wide, pair.is_some()) {
                (true, true) => FLASH_SM90_BLOCK_N_PAIR,
                (true, false) => FLASH_SM90_BLOCK_N_WIDE,
                (false, _) => FLASH_SM90_BLOCK_N,
            };
            if let Some([tq, tk, tv]) = sm90_tensor_maps(elem, [q, k, v], dims, block_m, block_n) {
                if let Some((entry, blocks)) = pair {
                    launch!(
                        self, SM90, entry, blocks, cluster 2;
                        q, k, v, mask, out, lse, dims, tq, tk, tv
                    );
                    return Ok(());
                }
                if !unmasked {
                    let tile = if dropout { "dropout_" } else { "" };
                    let entry = format!("kpt_flash_attention_sm90_tma_{tile}{name}_d{d}");
                    launch!(self, SM90, entry, blocks; q, k, v, mask, out, lse, dims, tq, tk, tv);
                    return Ok(());
                }
                if let Some(to) = sm90_out_map(elem, out, dims) {
                    let tile = if wide { "n160_carry_" } else { "carry_" };
                    let entry = format!("kpt_flash_attention_sm90_tma_{tile}{name}_d{d}");
                    launch!(
                        self, SM90, entry, blocks;
                        q, k, v, mask, out, lse, dims, tq, tk, tv, to
                    );
                    return Ok(());
                }
            }
            if !dropout && !windowed {
                let entry = format!("kpt_flash_attention_sm90_{name}_d{d}");
                launch!(self, SM90, entry, blocks; q, k, v, mask, out, lse, dims);
                return Ok(());
            }
        }
        let blocks = grid("flash attention tiles", tiles(FLASH_BLOCK_M))?;
        let entry = format!("kpt_flash_attention_{name}_d{d}");
        launch!(self, "flash_attention", entry, blocks; q, k, v, mask, out, lse, dims);
        Ok(())
    }

    /// A variable-length batch in one launch on Hopper: `dims.batch` sequences packed into
    /// `dims.seq_q` query and `dims.seq_kv` key rows, with offsets `cu` (q then k, each
    /// `[batch + 1]` of `index`, i32 or i64) read on the device, so the call needs no host
    /// copy of the offsets before it (`flash_attention_sm90.cu`'s `_varlen_` entries on a
    /// persistent grid that walks the sequences' work tiles; [`Gpu::varlen_launch`]).
    /// bf16 / f16 at head dim 64 or 128, without an additive mask, dropout or window. The
    /// kernel flags invalid offsets (not from 0, a decrease, not ending at the row counts),
    /// checked after it as the embedding's ids are (after each replay inside a captured
    /// graph). Returns `Ok(false)` without launching anything where that kernel does not
    /// apply.
    pub(crate) fn flash_attention_varlen(
        &self,
        dtype: DType,
        [q, k, v]: [u64; 3],
        out: u64,
        (cu, index): ([u64; 2], DType),
        dims: AttentionDims,
    ) -> Result<bool, NvidiaError> {
        const SM90: &str = "flash_attention_sm90";
        let d = dims.head_dim;
        let name = match dtype {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            _ => return Ok(false),
        };
        let idx64 = match index {
            DType::I32 => 0i32,
            DType::I64 => 1,
            _ => return Ok(false),
        };
        if !self.varlen_launch()
            || !(d == 64 || d == 128)
            || dims.batch == 0
            || dims.seq_q == 0
            || dims.dropout()
            || dims.window != 0
            || self.loaded_target(SM90)? != "sm_90a"
        {
            return Ok(false);
        }
        let block_m = sm90_block_m(d, false);
        // Every sequence's work tiles: its whole query tiles plus at most one partial; a
        // persistent grid walks them.
        let bound =
            ((dims.seq_q as usize).div_ceil(block_m) + dims.batch as usize) * dims.heads as usize;
        let blocks = grid("varlen attention tiles", bound.min(self.attention_blocks()))?;
        let bad = self.alloc_zeroed(4)?;
        let entry = format!("kpt_flash_attention_sm90_varlen_{name}_d{d}");
        let [cu_q, cu_k] = cu;
        launch!(self, SM90, entry, blocks; q, k, v, out, dims, cu_q, cu_k, idx64, bad.ptr());
        let message = format!(
            "attention: cu_seqlens must run from 0 to the {} query and {} key rows without \
             decreasing",
            dims.seq_q, dims.seq_kv
        );
        self.check_flag(bad, message)?;
        Ok(true)
    }

    /// FP8 (e4m3) attention on Hopper, head dim 128, bf16 output: V is first transposed
    /// into scratch (`kpt_attention_fp8_v_transpose_d128`), then the wgmma kernel of
    /// `flash_attention_sm90.cu` runs. `dims.scale` must already include
    /// `q_scale * k_scale`; `v_scale` multiplies the output. Returns `Ok(false)` without
    /// launching anything where that kernel does not apply (no sm_90a cubin loaded, another
    /// head dim, a sliding window, an empty cache, or a decode shape, which the split-KV
    /// kernels serve better after dequantization).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn flash_attention_fp8(
        &self,
        q: u64,
        k: u64,
        v: u64,
        mask: u64,
        out: u64,
        dims: AttentionDims,
        v_scale: f32,
    ) -> Result<bool, NvidiaError> {
        const SM90: &str = "flash_attention_sm90";
        if dims.head_dim != 128
            || dims.window != 0
            || dims.seq_kv == 0
            || dims.seq_q == 0
            || dims.split(DType::BF16).is_some()
            || self.loaded_target(SM90)? != "sm_90a"
        {
            return Ok(false);
        }
        let (batch, kv_heads) = (dims.batch as usize, dims.kv_heads as usize);
        let key_tiles = (dims.seq_kv as usize).div_ceil(FLASH_SM90_BLOCK_N);
        let groups = batch * kv_heads;
        let vt = self.alloc(groups * 128 * key_tiles * FLASH_SM90_BLOCK_N)?;
        let blocks = grid("fp8 V transpose tiles", groups * key_tiles)?;
        launch!(self, SM90, "kpt_attention_fp8_v_transpose_d128", blocks; v, vt.ptr(), dims);
        let blocks = self.sm90_attention_grid(dims, FLASH_SM90_BLOCK_M)?;
        let vt_ptr = vt.ptr();
        // Without an additive mask: tiles of 192 keys, the output stored by TMA through the
        // map `to`; without a causal mask either, in clusters of two blocks that share K/V
        // ([`Gpu::kv_multicast`]), each copying 96 of a K tile's rows (the K map's boxes; the
        // V^T map's are 128 keys regardless).
        let to = if mask == 0 {
            sm90_out_map(TmaElem::Bf16, out, dims)
        } else {
            None
        };
        let wide = to.is_some();
        const PAIR: &str = "kpt_flash_attention_sm90_tma_n192_x2_e4m3_d128";
        let pair = if wide && dims.causal == 0 {
            self.sm90_pair_grid(PAIR, dims, FLASH_SM90_BLOCK_M)?
        } else {
            None
        };
        let block_n = match (wide, pair.is_some()) {
            (true, true) => FLASH_SM90_BLOCK_N_FP8_WIDE / 2,
            (true, false) => FLASH_SM90_BLOCK_N_FP8_WIDE,
            (false, _) => FLASH_SM90_BLOCK_N,
        };
        if let Some([tq, tk, tv]) = sm90_tensor_maps(
            TmaElem::Byte,
            [q, k, vt_ptr],
            dims,
            FLASH_SM90_BLOCK_M,
            block_n,
        ) {
            let Some(to) = to else {
                launch!(
                    self, SM90, "kpt_flash_attention_sm90_tma_e4m3_d128", blocks;
                    q, k, vt_ptr, mask, out, dims, v_scale, tq, tk, tv
                );
                return Ok(true);
            };
            if let Some(blocks) = pair {
                launch!(
                    self, SM90, PAIR, blocks, cluster 2;
                    q, k, vt_ptr, mask, out, dims, v_scale, tq, tk, tv, to
                );
                return Ok(true);
            }
            let entry = if dims.causal != 0 {
                "kpt_flash_attention_sm90_tma_n192_causal_e4m3_d128"
            } else {
                "kpt_flash_attention_sm90_tma_n192_e4m3_d128"
            };
            launch!(
                self, SM90, entry, blocks;
                q, k, vt_ptr, mask, out, dims, v_scale, tq, tk, tv, to
            );
            return Ok(true);
        }
        launch!(
            self, SM90, "kpt_flash_attention_sm90_e4m3_d128", blocks;
            q, k, vt_ptr, mask, out, dims, v_scale
        );
        Ok(true)
    }

    /// Gradients `[dq, dk, dv]` of attention on tensor cores (`flash_attention_bwd.cu`)
    /// from `[q, k, v, out, dout]`, an optional f32 mask and the forward's optional
    /// log-sum-exp (f32 `[batch, heads, seq_q]`; 0: none), for the sizes
    /// [`FlashBackward::new`] accepts: dq per query tile (which also leaves each row's
    /// log-sum-exp and `rowsum(dout o out)` in scratch; with the given log-sum-exp it
    /// skips the online softmax), then dk and dv per key tile. On Hopper the wgmma kernels
    /// of `flash_attention_sm90.cu` run both launches (dq only when the log-sum-exp is
    /// given), 128 query rows or keys per block.
    pub(crate) fn flash_attention_backward(
        &self,
        plan: &FlashBackward,
        [q, k, v, out, dout]: [u64; 5],
        [mask, lse_in]: [u64; 2],
        [dq, dk, dv]: [u64; 3],
    ) -> Result<(), NvidiaError> {
        let FlashBackward {
            dims,
            name,
            query_tiles,
            key_tiles,
        } = *plan;
        let d = dims.head_dim;
        // lse2 and D: f32 [batch * heads, seq_pad] each.
        let rows = plan.padded_rows();
        let stats = self.alloc((2 * rows).max(4) * 4)?;
        let (lse, delta) = (stats.ptr(), stats.ptr() + rows as u64 * 4);
        const SM90: &str = "flash_attention_sm90";
        // Sliding windows take `_window_` entries (their own code), on wgmma without dropout.
        let window = if dims.window != 0 { "window_" } else { "" };
        let hopper = self.wgmma_backward()
            && d <= 128
            && (window.is_empty() || !dims.dropout())
            && self.loaded_target(SM90)? == "sm_90a";
        // The wgmma kernels' entries with dropout or a window are their own code.
        let tag = if dims.dropout() { "dropout_" } else { window };
        if query_tiles > 0 && lse_in != 0 && hopper {
            // The wgmma dq kernel: 128 query rows per block.
            let pairs = dims.batch as usize * dims.heads as usize;
            let tiles = (dims.seq_q as usize).div_ceil(FLASH_SM90_BWD_ROWS) * pairs;
            let entry = format!("kpt_flash_attention_sm90_bwd_dq_lse_{tag}{name}_d{d}");
            launch!(self, SM90, entry, grid("query tiles", tiles)?;
                q, k, v, mask, out, dout, lse_in, dq, lse, delta, dims);
        } else if query_tiles > 0 && lse_in != 0 {
            let entry = format!("kpt_flash_attention_bwd_dq_lse_{window}{name}_d{d}");
            launch!(self, "flash_attention_bwd", entry, grid("query tiles", query_tiles)?;
                q, k, v, mask, out, dout, lse_in, dq, lse, delta, dims);
        } else if query_tiles > 0 {
            let entry = format!("kpt_flash_attention_bwd_dq_{window}{name}_d{d}");
            launch!(self, "flash_attention_bwd", entry, grid("query tiles", query_tiles)?;
                q, k, v, mask, out, dout, dq, lse, delta, dims);
        }
        if key_tiles > 0 {
            if hopper {
                // The wgmma dk / dv kernel: 128 keys per block.
                let groups = dims.batch as usize * dims.kv_heads as usize;
                let tiles = (dims.seq_kv as usize).div_ceil(FLASH_SM90_BWD_KEYS) * groups;
                let entry = format!("kpt_flash_attention_sm90_bwd_dkdv_{tag}{name}_d{d}");
                launch!(self, SM90, entry, grid("key tiles", tiles)?;
                    q, k, v, mask, dout, lse, delta, dk, dv, dims);
                return Ok(());
            }
            let entry = format!("kpt_flash_attention_bwd_dkdv_{window}{name}_d{d}");
            launch!(self, "flash_attention_bwd", entry, grid("key tiles", key_tiles)?;
                q, k, v, mask, dout, lse, delta, dk, dv, dims);
        }
        Ok(())
    }

    /// Copies `len` rows of `row_bytes` out of a paged cache into `out` (contiguous):
    /// row j is row `j % block_size` of block `table[j / block_size]`, where `table` is the
    /// sequence's row of the block table (i32 or i64 ids, already checked against the
    /// cache). See `kernels/cuda/paged.cu`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn paged_gather(
        &self,
        cache: u64,
        out: u64,
        table: u64,
        table_dtype: DType,
        len: usize,
        block_size: usize,
        row_bytes: usize,
    ) -> Result<(), NvidiaError> {
        if len == 0 {
            return Ok(());
        }
        let (unit, units) = row_units(row_bytes)?;
        let entry = format!("kpt_paged_gather_{unit}");
        let g = self.stride_grid(len * units, 16);
        let table_i64 = i32::from(table_dtype == DType::I64);
        let (len, block_size, units) = (
            int("paged rows", len)?,
            int("block size", block_size)?,
            int("row units", units)?,
        );
        launch!(self, "paged", entry, g; cache, out, table, table_i64, len, block_size, units);
        Ok(())
    }

    /// Writes `n` rows of `row_bytes` from `rows` into the cache at `slots` (i32 or i64
    /// row indices over the cache's `cache_rows`; negative ones and ones past the end
    /// are skipped). See `kernels/cuda/paged.cu`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cache_write(
        &self,
        rows: u64,
        cache: u64,
        slots: u64,
        slots_dtype: DType,
        n: usize,
        cache_rows: usize,
        row_bytes: usize,
    ) -> Result<(), NvidiaError> {
        if n == 0 {
            return Ok(());
        }
        let (unit, units) = row_units(row_bytes)?;
        let entry = format!("kpt_cache_write_{unit}");
        let g = self.stride_grid(n * units, 16);
        let slots_i64 = i32::from(slots_dtype == DType::I64);
        let cache_rows = i64::try_from(cache_rows)
            .map_err(|_| NvidiaError::Invalid(format!("{cache_rows} cache rows")))?;
        let (n, units) = (int("cache rows written", n)?, int("row units", units)?);
        launch!(self, "paged", entry, g; rows, cache, slots, slots_i64, n, cache_rows, units);
        Ok(())
    }

    /// `out = act(x)` over `n` elements.
    pub(crate) fn activation(
        &self,
        dtype: DType,
        x: u64,
        out: u64,
        n: usize,
        act: Activation,
    ) -> Result<(), NvidiaError> {
        let entry = format!("kpt_activation_{}", float_name(dtype)?);
        let g = self.stride_grid(n, dtype.size_in_bytes());
        launch!(self, "elementwise", entry, g; x, out, long(n), act_code(act));
        Ok(())
    }

    /// Linear with few rows (`kernels/cuda/gemv.cu`): `out [m, n] = x [m, k] · w [n, k]ᵀ
    /// (+ bias [n])`, all of `dtype`, for `m` in `1..=`[`GEMV_MAX_ROWS`]; `bias` 0 means
    /// none. Rows of whole 16-byte vectors with aligned buffers take the vector loop
    /// (for bf16 / f16 at 5..=32 rows: the tensor-core loop), others a scalar loop.
    /// `w_constant` promises that no kernel writes `w` (a model parameter): the 16-bit
    /// kernels then issue their first weight loads before waiting for the kernel before them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv(
        &self,
        dtype: DType,
        [x, w, bias]: [u64; 3],
        w_constant: bool,
        out: u64,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), NvidiaError> {
        let class = GEMV_ROW_CLASSES
            .into_iter()
            .find(|&c| m <= c)
            .filter(|_| m > 0)
            .ok_or_else(|| {
                NvidiaError::Invalid(format!("gemv takes 1..={GEMV_MAX_ROWS} rows, not {m}"))
            })?;
        let size = dtype.size_in_bytes();
        let aligned = |p: u64| p.is_multiple_of(16);
        let vec = (k * size).is_multiple_of(16) && aligned(x) && aligned(w) && aligned(out);
        let dims = GemvDims {
            m: int("gemv rows", m)?,
            n: int("gemv n", n)?,
            k: int("gemv k", k)?,
            vec: i32::from(vec),
            preload: i32::from(w_constant && self.gemv_preload()),
        };
        let staged =
            class == 1 && dtype != DType::F32 && vec && k <= GEMV_STAGE_MAX_K && self.gemv_stage();
        let entry = if staged {
            format!("kpt_gemv_staged_{}_m1", float_name(dtype)?)
        } else {
            format!("kpt_gemv_{}_m{class}", float_name(dtype)?)
        };
        let rows_per_block = if class >= GEMV_TENSOR_CORE_CLASS && dtype != DType::F32 {
            GEMV_TILE_ROWS
        } else {
            GEMV_ROWS_PER_BLOCK
        };
        let blocks = grid("gemv rows", n.div_ceil(rows_per_block))?;
        launch!(self, "gemv", entry, blocks; x, w, bias, out, dims);
        Ok(())
    }

    /// Gated activation: `x [rows, 2d]` -> `act(x[:, :d]) * x[:, d:]`.
    pub(crate) fn act_and_mul(
        &self,
        dtype: DType,
        x: u64,
        out: u64,
        rows: usize,
        d: usize,
        act: Activation,
    ) -> Result<(), NvidiaError> {
        let entry = format!("kpt_act_and_mul_{}", float_name(dtype)?);
        let g = self.stride_grid(rows * d, dtype.size_in_bytes());
        launch!(self, "elementwise", entry, g; x, out, long(rows), long(d), act_code(act));
        Ok(())
    }

    /// `out[i] = a[i] op b[i % nb]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn binary(
        &self,
        dtype: DType,
        a: u64,
        b: u64,
        out: u64,
        n: usize,
        nb: usize,
        op: Binary,
    ) -> Result<(), NvidiaError> {
        if nb == 0 || !n.is_multiple_of(nb) {
            return Err(NvidiaError::Invalid(format!(
                "cannot broadcast {nb} elements over {n}"
            )));
        }
        let entry = format!("kpt_binary_{}", float_name(dtype)?);
        let g = self.stride_grid(n, dtype.size_in_bytes());
        launch!(self, "elementwise", entry, g; a, b, out, long(n), long(nb), op as i32);
        Ok(())
    }

    /// Float conversion of `n` elements.
    pub(crate) fn cast(
        &self,
        from: DType,
        to: DType,
        x: u64,
        out: u64,
        n: usize,
    ) -> Result<(), NvidiaError> {
        if from == to {
            return self.copy(x, out, n * from.size_in_bytes());
        }
        let entry = format!("kpt_cast_{}_{}", float_name(from)?, float_name(to)?);
        let g = self.stride_grid(n, from.size_in_bytes());
        launch!(self, "elementwise", entry, g; x, out, long(n));
        Ok(())
    }

    /// Rotary embedding of `x [tokens, heads * head_dim]` at `period` positions: token
    /// `t` takes position `t % period` (`period = seq` for positions `[seq]` shared by
    /// every sequence, `period = tokens` for one position per token). `inv_freq` is the
    /// device address of `head_dim / 2` f64 inverse frequencies; cos and sin are
    /// multiplied by `attention_factor`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rotary(
        &self,
        dtype: DType,
        index: DType,
        x: u64,
        positions: u64,
        out: u64,
        (tokens, period, heads, head_dim): (usize, usize, usize, usize),
        (inv_freq, attention_factor): (u64, f64),
    ) -> Result<(), NvidiaError> {
        check_rotary_dims(tokens, period, head_dim)?;
        if tokens == 0 || heads == 0 {
            return Ok(());
        }
        let entry = format!("kpt_rotary_{}_{}", float_name(dtype)?, index_name(index)?);
        launch!(self, "rotary", entry, grid("tokens", tokens)?;
            x, positions, out, int("period", period)?, int("heads", heads)?,
            int("head_dim", head_dim)?, inv_freq, attention_factor);
        Ok(())
    }

    /// The q/k/v split of `qkv [tokens, q + k + v]` fused with the rotary of q and k, in
    /// one launch: `sizes = [q, k, v]` (q and k multiples of `head_dim`), outputs
    /// `[q, k, v]` of `[tokens, width]` each; positions, `period` and the frequencies as
    /// for [`Gpu::rotary`]. With `slots` (address, dtype, rows of the caches), `k` and `v`
    /// are caches and token `t`'s rows go to row `slots[t]` of each (skipped for a
    /// negative slot or one past the caches' rows).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn split_rotary(
        &self,
        dtype: DType,
        index: DType,
        qkv: u64,
        positions: u64,
        [q, k, v]: [u64; 3],
        (tokens, period, sizes, head_dim): (usize, usize, [usize; 3], usize),
        slots: Option<(u64, DType, usize)>,
        (inv_freq, attention_factor): (u64, f64),
    ) -> Result<(), NvidiaError> {
        check_rotary_dims(tokens, period, head_dim)?;
        let [wq, wk, wv] = sizes;
        if !wq.is_multiple_of(head_dim) || !wk.is_multiple_of(head_dim) {
            return Err(NvidiaError::Invalid(format!(
                "split_rotary head_dim {head_dim} must divide the q and k widths {wq} and {wk}"
            )));
        }
        int("q + k + v", wq + wk + wv)?;
        if tokens == 0 || wq + wk + wv == 0 {
            return Ok(());
        }
        let entry = format!(
            "kpt_split_rotary_{}_{}",
            float_name(dtype)?,
            index_name(index)?
        );
        let (slots, slots_i64, cache_rows) = match slots {
            Some((at, dtype, rows)) => (
                at,
                i32::from(dtype == DType::I64),
                i64::try_from(rows)
                    .map_err(|_| NvidiaError::Invalid(format!("{rows} cache rows")))?,
            ),
            None => (0, 0, 0),
        };
        launch!(self, "rotary", entry, grid("tokens", tokens)?;
            qkv, positions, q, k, v, slots, slots_i64, cache_rows, int("period", period)?,
            int("q heads", wq / head_dim)?, int("k heads", wk / head_dim)?,
            int("v width", wv)?, int("head_dim", head_dim)?, inv_freq, attention_factor);
        Ok(())
    }

    /// Gathers rows of `table [vocab, dim]`; an id outside the table is an error.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn embedding(
        &self,
        dtype: DType,
        index: DType,
        ids: u64,
        table: u64,
        out: u64,
        n: usize,
        vocab: usize,
        dim: usize,
    ) -> Result<(), NvidiaError> {
        let entry = format!(
            "kpt_embedding_{}_{}",
            float_name(dtype)?,
            index_name(index)?
        );
        let bad = self.alloc_zeroed(4)?;
        launch!(self, "embedding", entry, grid("ids", n)?;
            ids, table, out, long(vocab), int("dim", dim)?, bad.ptr());
        let message = format!("embedding: an id is outside the table of {vocab} rows");
        self.check_flag(bad, message)
    }

    /// Writes `max |x|` of `n` elements to the f32 at `amax` (which must hold 0).
    pub(crate) fn amax(
        &self,
        dtype: DType,
        x: u64,
        n: usize,
        amax: u64,
    ) -> Result<(), NvidiaError> {
        let entry = format!("kpt_amax_{}", float_name(dtype)?);
        let g = self.stride_grid(n, dtype.size_in_bytes());
        launch!(self, "quantize", entry, g; x, long(n), amax);
        Ok(())
    }

    /// Turns the amax at `slot` into the scale that maps it to `target`'s largest value.
    pub(crate) fn amax_to_scale(&self, slot: u64, target: DType) -> Result<(), NvidiaError> {
        let max = target.max_finite() as f32;
        launch!(self, "quantize", "kpt_amax_to_scale", 1; slot, max);
        Ok(())
    }

    /// `out = quantize(x / scale)` over `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn quantize(
        &self,
        from: DType,
        to: DType,
        x: u64,
        out: u64,
        n: usize,
        scale: QuantScale,
    ) -> Result<(), NvidiaError> {
        let entry = format!("kpt_quantize_{}_{}", float_name(from)?, quant_name(to)?);
        let g = self.stride_grid(n, from.size_in_bytes());
        let (scale_ptr, scale) = match scale {
            QuantScale::OnDevice(p) => (p, 0.0f32),
            QuantScale::Value(v) => (0u64, v),
        };
        launch!(self, "quantize", entry, g; x, out, long(n), scale_ptr, scale);
        Ok(())
    }

    /// `out = q * scale` over `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dequantize(
        &self,
        from: DType,
        to: DType,
        q: u64,
        out: u64,
        n: usize,
        scale: f32,
    ) -> Result<(), NvidiaError> {
        let entry = format!("kpt_dequantize_{}_{}", quant_name(from)?, float_name(to)?);
        let g = self.stride_grid(n, 1);
        launch!(self, "quantize", entry, g; q, out, long(n), scale);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(seq_q: usize, seq_kv: usize, d: usize) -> AttentionDims {
        AttentionDims::new(2, seq_q, seq_kv, 8, 2, d, true, 0.125).unwrap()
    }

    #[test]
    fn flash_backward_takes_bf16_and_f16_at_head_dims_64_to_256() {
        for dt in [DType::BF16, DType::F16] {
            for (d, halves) in [(64, 1), (128, 1), (192, 2), (256, 2)] {
                let plan = FlashBackward::new(dt, dims(65, 1, d)).unwrap();
                // 2 query tiles x 2 batches x 8 heads; 1 key tile x 2 batches x 2 kv heads;
                // each twice above 128 (a block per half of the head dim).
                assert_eq!(
                    (plan.query_tiles, plan.key_tiles),
                    (32 * halves, 4 * halves)
                );
                assert_eq!(plan.padded_rows(), 128 * 2 * 8);
            }
        }
    }

    #[test]
    fn flash_backward_declines_other_dtypes_and_head_dims() {
        assert!(FlashBackward::new(DType::F32, dims(3, 3, 64)).is_err());
        for d in [32, 96, 160] {
            assert!(FlashBackward::new(DType::BF16, dims(3, 3, d)).is_err());
        }
        // Sliding windows: the mma.sync kernels take them.
        let windowed = dims(3, 3, 64).with_window(Some(2)).unwrap();
        assert!(FlashBackward::new(DType::F16, windowed).is_ok());
    }

    #[test]
    fn flash_backward_of_empty_sequences_launches_nothing() {
        let plan = FlashBackward::new(DType::BF16, dims(0, 5, 64)).unwrap();
        assert_eq!((plan.query_tiles, plan.padded_rows()), (0, 0));
        assert_eq!(plan.key_tiles, 4);
        let plan = FlashBackward::new(DType::BF16, dims(7, 0, 128)).unwrap();
        assert_eq!((plan.query_tiles, plan.key_tiles), (16, 0));
    }

    #[test]
    fn paged_decode_plans_the_split_kernels_from_one_tile() {
        // 32 keys (one tile at head dim 128): dense calls leave it to the other kernels,
        // paged ones take the split kernel (the path without a host readback).
        let one_tile = dims(1, 32, 128);
        assert!(one_tile.split(DType::BF16).is_none());
        let plan = one_tile.split_plan(DType::BF16, 1).unwrap();
        assert_eq!((plan.tile, plan.tiles, plan.splits), (32, 1, 1));
        // The same plan as dense calls above one tile; none for an empty table, a
        // window or too many query rows.
        let long = dims(4, 8192, 128);
        let (a, b) = (
            long.split(DType::F16).unwrap(),
            long.split_plan(DType::F16, 1).unwrap(),
        );
        assert_eq!((a.tile, a.tiles, a.splits), (b.tile, b.tiles, b.splits));
        assert!(dims(1, 0, 128).split_plan(DType::BF16, 1).is_none());
        let windowed = long.with_window(Some(16)).unwrap();
        assert!(windowed.split_plan(DType::BF16, 1).is_none());
        // 9 to 16 queries at 4 q heads per kv head: the wide entries (bf16 / f16, head
        // dims up to 128), three blocks an SM, no clusters; 17 are too many, as are 9 at
        // head dim 256 or in f32.
        let wide = dims(9, 8192, 128).split_plan(DType::BF16, 1).unwrap();
        assert_eq!(
            wide.entry("bf16", true),
            "kpt_attention_split_paged_wide_bf16"
        );
        assert_eq!(
            long.split(DType::F16).unwrap().entry("f16", false),
            "kpt_attention_split_f16"
        );
        assert!(wide.blocks() <= SPLIT_WAVE_BLOCKS_WIDE);
        assert!(AttentionDims::cluster_plan(
            dims(16, 512, 64).split(DType::BF16).unwrap(),
            DType::BF16
        )
        .is_none());
        assert!(dims(17, 8192, 128).split_plan(DType::BF16, 1).is_none());
        assert!(dims(9, 8192, 256).split_plan(DType::BF16, 1).is_none());
        assert!(dims(9, 8192, 128).split_plan(DType::F32, 1).is_none());
        // The kernel's `Paged`: two pointers and six ints.
        assert_eq!(std::mem::size_of::<PagedSplit>(), 40);
    }

    #[test]
    fn cluster_plans_take_short_16_bit_caches_in_at_most_8_runs() {
        // Head dim 64: tiles of 64 keys. 512 keys: 8 runs of one tile, as the plain plan.
        let plan = |keys| dims(1, keys, 64).split(DType::BF16).unwrap();
        let c = AttentionDims::cluster_plan(plan(512), DType::BF16).unwrap();
        assert_eq!((c.tiles, c.splits), (8, 8));
        assert_eq!(plan(512).splits, 8);
        // 1024 keys: 8 runs of two tiles (the plain plan has 16 runs of one); 600 keys
        // (10 tiles): 5 runs of two; 3 tiles: 3 runs.
        let c = AttentionDims::cluster_plan(plan(1024), DType::F16).unwrap();
        assert_eq!((c.tiles, c.splits), (16, 8));
        let c = AttentionDims::cluster_plan(plan(600), DType::BF16).unwrap();
        assert_eq!((c.tiles, c.splits), (10, 5));
        let c = AttentionDims::cluster_plan(plan(129), DType::BF16).unwrap();
        assert_eq!((c.tiles, c.splits), (3, 3));
        // Longer caches and f32 keep the combine launch.
        assert!(AttentionDims::cluster_plan(plan(1025), DType::BF16).is_none());
        let f32_plan = dims(1, 512, 64).split(DType::F32).unwrap();
        assert!(AttentionDims::cluster_plan(f32_plan, DType::F32).is_none());
    }
}
