//! Launch plans of kpt's own kernels on AMD GPUs: the CUDA sources of `kernels/cuda`
//! built for AMD by hipcc (`kernels/hip/*.hip`), and the Triton RMSNorm.
//!
//! A [`Launch`] names a code object (`kpt_kernels::artifacts`' kernel name, e.g.
//! `rms_norm` or `triton_rms_norm_bf16_4096`), an entry point, a grid and the entry
//! point's arguments in the order and types its source declares. Planning needs no
//! GPU: [`Planner`] only knows the device's compute units. [`Launch::layout`] is where
//! `hipModuleLaunchKernel` puts each argument in the kernel argument segment (C layout:
//! each argument at the next multiple of its alignment); the tests check it against the
//! `.args` metadata of every shipped code object, so an argument list that disagrees
//! with a kernel's source fails here, on a machine without a GPU, not on the device.

use std::ffi::c_void;

use kpt_core::graph::Activation;
use kpt_core::DType;

use crate::AmdError;

/// Row blocks of the Triton norm specializations (`kernels/triton/rms_norm.py`).
pub const TRITON_ROW_BLOCKS: [usize; 4] = [1024, 2048, 4096, 8192];

/// Rows (32-lane groups) per block of the attention kernel (`kWarps` of
/// `kernels/cuda/attention.cu`).
const ATTENTION_ROWS_PER_BLOCK: usize = 4;
/// Largest head dimension of the attention kernel.
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// Threads per block of the element-wise kernels (`kBlock` of `elementwise.cu` and
/// `quantize.cu`): a grid-stride loop covers the rest.
const STRIDE_BLOCK: usize = 256;
/// Blocks per compute unit a grid-stride launch asks for at most.
const STRIDE_BLOCKS_PER_CU: usize = 16;

/// One kernel argument, by value, as the kernel's source declares it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device address (`T*`, 8 bytes).
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long` / `long long` (8 bytes on the LP64 device ABI).
    I64(i64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// `kpt::AttentionDims` (`kernels/cuda/attention_dims.cuh`), passed by value.
    Dims(AttentionDims),
}

impl Arg {
    /// `(size, alignment)` in bytes.
    pub fn size_align(&self) -> (u32, u32) {
        match self {
            Arg::Ptr(_) | Arg::I64(_) | Arg::F64(_) => (8, 8),
            Arg::I32(_) | Arg::F32(_) => (4, 4),
            Arg::Dims(_) => (
                std::mem::size_of::<AttentionDims>() as u32,
                std::mem::align_of::<AttentionDims>() as u32,
            ),
        }
    }

    /// The pointer `hipModuleLaunchKernel` reads the value through.
    fn as_param(&self) -> *mut c_void {
        match self {
            Arg::Ptr(v) => (v as *const u64).cast_mut().cast(),
            Arg::I32(v) => (v as *const i32).cast_mut().cast(),
            Arg::I64(v) => (v as *const i64).cast_mut().cast(),
            Arg::F32(v) => (v as *const f32).cast_mut().cast(),
            Arg::F64(v) => (v as *const f64).cast_mut().cast(),
            Arg::Dims(v) => (v as *const AttentionDims).cast_mut().cast(),
        }
    }
}

/// One kernel launch: which code object, which entry point, how many blocks, and the
/// arguments. The block size and dynamic LDS come from the manifest entry of the code
/// object selected for the device's processor.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The code object's kernel name in `kpt_kernels::artifacts` (e.g. `softmax`).
    pub kernel: String,
    /// The entry point (e.g. `kpt_softmax_bf16`).
    pub entry: String,
    /// Blocks along x.
    pub grid: u32,
    /// The arguments in declaration order.
    pub args: Vec<Arg>,
}

impl Launch {
    fn new(kernel: impl Into<String>, entry: impl Into<String>, grid: u32, args: Vec<Arg>) -> Self {
        Launch {
            kernel: kernel.into(),
            entry: entry.into(),
            grid,
            args,
        }
    }

    /// `(offset, size)` of each argument in the kernel argument segment: each at the
    /// next multiple of its alignment, as the C ABI (and the compiler's `.args`
    /// metadata) lays them out.
    pub fn layout(&self) -> Vec<(u32, u32)> {
        let mut end = 0u32;
        self.args
            .iter()
            .map(|a| {
                let (size, align) = a.size_align();
                let offset = end.div_ceil(align) * align;
                end = offset + size;
                (offset, size)
            })
            .collect()
    }

    /// Checks [`Launch::layout`] against a kernel's metadata: the same number of
    /// explicit arguments at the same offsets with the same sizes.
    pub fn check_layout(&self, metadata: &crate::KernelMetadata) -> Result<(), AmdError> {
        let ours = self.layout();
        let theirs = metadata.explicit_args();
        if ours == theirs {
            return Ok(());
        }
        Err(AmdError::CodeObject(format!(
            "{}: the launcher passes arguments at (offset, size) {ours:?}, the code object \
             declares {theirs:?}",
            self.entry
        )))
    }

    /// One pointer per argument, for `hipModuleLaunchKernel`'s `kernelParams`; valid
    /// while `self` is neither moved nor changed.
    pub(crate) fn params(&self) -> Vec<*mut c_void> {
        self.args.iter().map(Arg::as_param).collect()
    }
}

/// The sizes of one attention call, passed to `kpt_attention_*` by value (the layout of
/// `kpt::AttentionDims` in `kernels/cuda/attention_dims.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionDims {
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
    /// Attention dropout's fields of `attention_dims.cuh` (threshold, seed, scale, batch
    /// offset); this backend's kernels apply no dropout, so they hold "none".
    dropout_threshold: u32,
    seed_lo: u32,
    seed_hi: u32,
    dropout_scale: f32,
    batch_offset: i32,
}

impl AttentionDims {
    /// Checked sizes: heads divisible by kv heads, head_dim in 1..=256, all within i32,
    /// a window of at least one key.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        batch: usize,
        seq_q: usize,
        seq_kv: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        causal: bool,
        scale: f32,
        window: Option<usize>,
    ) -> Result<Self, AmdError> {
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(invalid(format!(
                "attention: {heads} query heads do not group over {kv_heads} kv heads"
            )));
        }
        if head_dim == 0 || head_dim > ATTENTION_MAX_HEAD_DIM {
            return Err(invalid(format!(
                "attention: head_dim {head_dim} is outside 1..={ATTENTION_MAX_HEAD_DIM}"
            )));
        }
        let rows = batch
            .checked_mul(seq_q)
            .and_then(|r| r.checked_mul(heads))
            .ok_or_else(|| invalid("attention: too many rows"))?;
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
            window: match window {
                None => 0,
                Some(0) => return Err(invalid("attention: window must be at least 1 key")),
                Some(w) => int("window", w)?,
            },
            dropout_threshold: 0,
            seed_lo: 0,
            seed_hi: 0,
            dropout_scale: 1.0,
            batch_offset: 0,
        })
    }

    fn rows(&self) -> usize {
        self.batch as usize * self.seq_q as usize * self.heads as usize
    }
}

/// Where a quantization kernel finds its per-tensor scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QuantScale {
    /// An f32 in device memory (computed there from the amax).
    OnDevice(u64),
    /// A value known on the host, passed as a kernel argument.
    Value(f32),
}

/// The element-wise binary ops of `kpt_binary_*` (its `op` argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// `a + b`.
    Add = 0,
    /// `a * b`.
    Mul = 1,
}

/// The row ops of `softmax.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOp {
    /// `kpt_softmax_*`.
    Softmax,
    /// `kpt_argmax_*` (i64 output).
    ArgMax,
}

/// Which build of the RMS norm runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormImpl {
    /// `kernels/cuda/rms_norm.cu` built by hipcc.
    Hip,
    /// `kernels/triton/rms_norm.py` built by Triton.
    Triton,
}

fn invalid(message: impl Into<String>) -> AmdError {
    AmdError::Invalid(message.into())
}

/// The entry-point suffix of a float dtype the kernels take.
pub fn float_name(dtype: DType) -> Result<&'static str, AmdError> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        d => Err(invalid(format!(
            "the AMD kernels take f32, bf16 or f16, not {d}"
        ))),
    }
}

fn index_name(dtype: DType) -> Result<&'static str, AmdError> {
    match dtype {
        DType::I32 => Ok("i32"),
        DType::I64 => Ok("i64"),
        d => Err(invalid(format!("indices must be i32 or i64, not {d}"))),
    }
}

fn quant_name(dtype: DType) -> Result<&'static str, AmdError> {
    match dtype {
        DType::F8E4M3 => Ok("e4m3"),
        DType::F8E5M2 => Ok("e5m2"),
        DType::I8 => Ok("i8"),
        d => Err(invalid(format!(
            "quantized dtypes are f8e4m3, f8e5m2 and i8, not {d}"
        ))),
    }
}

fn int(what: &str, v: usize) -> Result<i32, AmdError> {
    i32::try_from(v).map_err(|_| invalid(format!("{what} = {v} exceeds 2^31 - 1")))
}

fn long(what: &str, v: usize) -> Result<i64, AmdError> {
    i64::try_from(v).map_err(|_| invalid(format!("{what} = {v} exceeds 2^63 - 1")))
}

fn grid(what: &str, v: usize) -> Result<u32, AmdError> {
    if v == 0 {
        return Err(invalid(format!("{what} is empty")));
    }
    u32::try_from(v).map_err(|_| invalid(format!("{what} = {v} exceeds 2^32 - 1 blocks")))
}

fn act_code(act: Activation) -> i32 {
    match act {
        Activation::Relu => 0,
        Activation::GeluErf => 1,
        Activation::GeluTanh => 2,
        Activation::Silu => 3,
    }
}

/// Plans launches for one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planner {
    /// Compute units of the device (bounds the grid of grid-stride kernels).
    pub compute_units: u32,
}

impl Planner {
    /// Blocks of a grid-stride kernel over `n` elements of `dtype_bytes` each (the
    /// kernels read 16-byte vectors where they can).
    fn stride_grid(&self, n: usize, dtype_bytes: usize) -> u32 {
        let vectors = n.div_ceil((16 / dtype_bytes.max(1)).max(1));
        let most = self.compute_units.max(1) as usize * STRIDE_BLOCKS_PER_CU;
        vectors.div_ceil(STRIDE_BLOCK).clamp(1, most) as u32
    }

    /// The Triton specialization for rows of `dim`: the smallest row block that holds a
    /// row; rows must be a multiple of 16 elements and buffers 16-byte aligned (what
    /// the specializations were compiled for).
    fn triton_norm(
        &self,
        name: &str,
        dtype: DType,
        dim: usize,
        pointers: &[u64],
    ) -> Result<String, AmdError> {
        let block = TRITON_ROW_BLOCKS
            .into_iter()
            .find(|&b| b >= dim)
            .ok_or_else(|| {
                invalid(format!(
                    "Triton {name}: rows of {dim} exceed {}",
                    TRITON_ROW_BLOCKS[TRITON_ROW_BLOCKS.len() - 1]
                ))
            })?;
        if !dim.is_multiple_of(16) || pointers.iter().any(|p| !p.is_multiple_of(16)) {
            return Err(invalid(format!(
                "Triton {name} needs rows of a multiple of 16 elements and 16-byte aligned \
                 buffers (row of {dim})"
            )));
        }
        Ok(format!("triton_{name}_{}_{block}", float_name(dtype)?))
    }

    /// RMS norm of `rows` rows of `dim`: `out = x / rms(x) * w`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        imp: NormImpl,
        dtype: DType,
        [x, w, out]: [u64; 3],
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<Launch, AmdError> {
        let g = grid("rows", rows)?;
        let d = int("dim", dim)?;
        Ok(match imp {
            NormImpl::Hip => Launch::new(
                "rms_norm",
                format!("kpt_rms_norm_{}", float_name(dtype)?),
                g,
                vec![
                    Arg::Ptr(x),
                    Arg::Ptr(w),
                    Arg::Ptr(out),
                    Arg::I32(d),
                    Arg::F32(eps),
                ],
            ),
            // Triton's kernels take two trailing scratch pointers (unused here: null).
            NormImpl::Triton => Launch::new(
                self.triton_norm("rms_norm", dtype, dim, &[x, w, out])?,
                "kpt_rms_norm",
                g,
                vec![
                    Arg::Ptr(x),
                    Arg::Ptr(w),
                    Arg::Ptr(out),
                    Arg::I32(d),
                    Arg::F32(eps),
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                ],
            ),
        })
    }

    /// Residual add and RMS norm: `sum = x + residual`, `out = rms_norm(sum) * w`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        imp: NormImpl,
        dtype: DType,
        [x, residual, w]: [u64; 3],
        [sum, out]: [u64; 2],
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<Launch, AmdError> {
        let g = grid("rows", rows)?;
        let d = int("dim", dim)?;
        let mut args = vec![
            Arg::Ptr(x),
            Arg::Ptr(residual),
            Arg::Ptr(w),
            Arg::Ptr(sum),
            Arg::Ptr(out),
            Arg::I32(d),
            Arg::F32(eps),
        ];
        Ok(match imp {
            NormImpl::Hip => Launch::new(
                "rms_norm",
                format!("kpt_add_rms_norm_{}", float_name(dtype)?),
                g,
                args,
            ),
            NormImpl::Triton => {
                let kernel =
                    self.triton_norm("add_rms_norm", dtype, dim, &[x, residual, w, sum, out])?;
                args.extend([Arg::Ptr(0), Arg::Ptr(0)]);
                Launch::new(kernel, "kpt_add_rms_norm", g, args)
            }
        })
    }

    /// Layer norm of `rows` rows of `dim` with weight and bias.
    pub fn layer_norm(
        &self,
        dtype: DType,
        [x, w, b, out]: [u64; 4],
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<Launch, AmdError> {
        Ok(Launch::new(
            "layer_norm",
            format!("kpt_layer_norm_{}", float_name(dtype)?),
            grid("rows", rows)?,
            vec![
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(b),
                Arg::Ptr(out),
                Arg::I32(int("dim", dim)?),
                Arg::F32(eps),
            ],
        ))
    }

    /// Residual add and layer norm.
    pub fn add_layer_norm(
        &self,
        dtype: DType,
        [x, residual, w, b]: [u64; 4],
        [sum, out]: [u64; 2],
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<Launch, AmdError> {
        Ok(Launch::new(
            "layer_norm",
            format!("kpt_add_layer_norm_{}", float_name(dtype)?),
            grid("rows", rows)?,
            vec![
                Arg::Ptr(x),
                Arg::Ptr(residual),
                Arg::Ptr(w),
                Arg::Ptr(b),
                Arg::Ptr(sum),
                Arg::Ptr(out),
                Arg::I32(int("dim", dim)?),
                Arg::F32(eps),
            ],
        ))
    }

    /// Softmax or argmax of each row (argmax writes i64).
    pub fn row_op(
        &self,
        op: RowOp,
        dtype: DType,
        [x, out]: [u64; 2],
        rows: usize,
        dim: usize,
    ) -> Result<Launch, AmdError> {
        let name = match op {
            RowOp::Softmax => "softmax",
            RowOp::ArgMax => "argmax",
        };
        Ok(Launch::new(
            "softmax",
            format!("kpt_{name}_{}", float_name(dtype)?),
            grid("rows", rows)?,
            vec![Arg::Ptr(x), Arg::Ptr(out), Arg::I32(int("dim", dim)?)],
        ))
    }

    /// Dense attention: q `[batch, seq_q, heads * d]`, k and v `[batch, seq_kv,
    /// kv_heads * d]`, an optional f32 mask (0 = none).
    pub fn attention(
        &self,
        dtype: DType,
        [q, k, v, mask, out]: [u64; 5],
        dims: AttentionDims,
    ) -> Result<Launch, AmdError> {
        let blocks = grid(
            "attention rows",
            dims.rows().div_ceil(ATTENTION_ROWS_PER_BLOCK),
        )?;
        Ok(Launch::new(
            "attention",
            format!("kpt_attention_{}", float_name(dtype)?),
            blocks,
            vec![
                Arg::Ptr(q),
                Arg::Ptr(k),
                Arg::Ptr(v),
                Arg::Ptr(mask),
                Arg::Ptr(out),
                Arg::Dims(dims),
            ],
        ))
    }

    /// Element-wise activation of `n` values.
    pub fn activation(
        &self,
        dtype: DType,
        [x, out]: [u64; 2],
        n: usize,
        act: Activation,
    ) -> Result<Launch, AmdError> {
        Ok(Launch::new(
            "elementwise",
            format!("kpt_activation_{}", float_name(dtype)?),
            self.stride_grid(n, dtype.size_in_bytes()),
            vec![
                Arg::Ptr(x),
                Arg::Ptr(out),
                Arg::I64(long("n", n)?),
                Arg::I32(act_code(act)),
            ],
        ))
    }

    /// Gated activation: `x [rows, 2d]` -> `act(x[.., :d]) * x[.., d:]`.
    pub fn act_and_mul(
        &self,
        dtype: DType,
        [x, out]: [u64; 2],
        rows: usize,
        d: usize,
        act: Activation,
    ) -> Result<Launch, AmdError> {
        let n = rows
            .checked_mul(d)
            .ok_or_else(|| invalid("act_and_mul: too many elements"))?;
        Ok(Launch::new(
            "elementwise",
            format!("kpt_act_and_mul_{}", float_name(dtype)?),
            self.stride_grid(n, dtype.size_in_bytes()),
            vec![
                Arg::Ptr(x),
                Arg::Ptr(out),
                Arg::I64(long("rows", rows)?),
                Arg::I64(long("d", d)?),
                Arg::I32(act_code(act)),
            ],
        ))
    }

    /// `out = a op b` with `b` of `nb` elements broadcast over the `n` of `a`.
    #[allow(clippy::too_many_arguments)]
    pub fn binary(
        &self,
        dtype: DType,
        [a, b, out]: [u64; 3],
        n: usize,
        nb: usize,
        op: Binary,
    ) -> Result<Launch, AmdError> {
        if nb == 0 || !n.is_multiple_of(nb) {
            return Err(invalid(format!("cannot broadcast {nb} elements over {n}")));
        }
        Ok(Launch::new(
            "elementwise",
            format!("kpt_binary_{}", float_name(dtype)?),
            self.stride_grid(n, dtype.size_in_bytes()),
            vec![
                Arg::Ptr(a),
                Arg::Ptr(b),
                Arg::Ptr(out),
                Arg::I64(long("n", n)?),
                Arg::I64(long("nb", nb)?),
                Arg::I32(op as i32),
            ],
        ))
    }

    /// Conversion between two different float dtypes.
    pub fn cast(
        &self,
        from: DType,
        to: DType,
        [x, out]: [u64; 2],
        n: usize,
    ) -> Result<Launch, AmdError> {
        if from == to {
            return Err(invalid(format!("cast from {from} to itself is a copy")));
        }
        Ok(Launch::new(
            "elementwise",
            format!("kpt_cast_{}_{}", float_name(from)?, float_name(to)?),
            self.stride_grid(n, from.size_in_bytes()),
            vec![Arg::Ptr(x), Arg::Ptr(out), Arg::I64(long("n", n)?)],
        ))
    }

    /// NeoX rotary of `(tokens, period, heads, head_dim)`; `inv_freq` is a device table
    /// of f64 frequencies (0: computed from `theta`) and `attention_factor` scales cos
    /// and sin.
    #[allow(clippy::too_many_arguments)]
    pub fn rotary(
        &self,
        dtype: DType,
        index: DType,
        [x, positions, out]: [u64; 3],
        (tokens, period, heads, head_dim): (usize, usize, usize, usize),
        (inv_freq, attention_factor): (u64, f64),
    ) -> Result<Launch, AmdError> {
        check_rotary_dims(tokens, period, head_dim)?;
        Ok(Launch::new(
            "rotary",
            format!("kpt_rotary_{}_{}", float_name(dtype)?, index_name(index)?),
            grid("tokens", tokens)?,
            vec![
                Arg::Ptr(x),
                Arg::Ptr(positions),
                Arg::Ptr(out),
                Arg::I32(int("period", period)?),
                Arg::I32(int("heads", heads)?),
                Arg::I32(int("head_dim", head_dim)?),
                Arg::Ptr(inv_freq),
                Arg::F64(attention_factor),
            ],
        ))
    }

    /// Split of a fused `qkv` row into q, k, v with rotary on q and k.
    #[allow(clippy::too_many_arguments)]
    pub fn split_rotary(
        &self,
        dtype: DType,
        index: DType,
        [qkv, positions]: [u64; 2],
        [q, k, v]: [u64; 3],
        (tokens, period, sizes, head_dim): (usize, usize, [usize; 3], usize),
        (inv_freq, attention_factor): (u64, f64),
    ) -> Result<Launch, AmdError> {
        check_rotary_dims(tokens, period, head_dim)?;
        let [wq, wk, wv] = sizes;
        if !wq.is_multiple_of(head_dim) || !wk.is_multiple_of(head_dim) {
            return Err(invalid(format!(
                "split_rotary head_dim {head_dim} must divide the q and k widths {wq} and {wk}"
            )));
        }
        int("q + k + v", wq + wk + wv)?;
        Ok(Launch::new(
            "rotary",
            format!(
                "kpt_split_rotary_{}_{}",
                float_name(dtype)?,
                index_name(index)?
            ),
            grid("tokens", tokens)?,
            vec![
                Arg::Ptr(qkv),
                Arg::Ptr(positions),
                Arg::Ptr(q),
                Arg::Ptr(k),
                Arg::Ptr(v),
                // No slots: k and v are outputs of their own (the cache form runs as
                // this launch and two cache writes).
                Arg::Ptr(0),
                Arg::I32(0),
                Arg::I64(0),
                Arg::I32(int("period", period)?),
                Arg::I32(int("q heads", wq / head_dim)?),
                Arg::I32(int("k heads", wk / head_dim)?),
                Arg::I32(int("v width", wv)?),
                Arg::I32(int("head_dim", head_dim)?),
                Arg::Ptr(inv_freq),
                Arg::F64(attention_factor),
            ],
        ))
    }

    /// Row gather of `n` ids from a `[vocab, dim]` table; `bad` is an i32 flag on the
    /// device the kernel sets for an id outside the table.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        dtype: DType,
        index: DType,
        [ids, table, out, bad]: [u64; 4],
        n: usize,
        vocab: usize,
        dim: usize,
    ) -> Result<Launch, AmdError> {
        Ok(Launch::new(
            "embedding",
            format!(
                "kpt_embedding_{}_{}",
                float_name(dtype)?,
                index_name(index)?
            ),
            grid("ids", n)?,
            vec![
                Arg::Ptr(ids),
                Arg::Ptr(table),
                Arg::Ptr(out),
                Arg::I64(long("vocab", vocab)?),
                Arg::I32(int("dim", dim)?),
                Arg::Ptr(bad),
            ],
        ))
    }

    /// The largest magnitude of `n` values, max-reduced into the f32 at `amax`.
    pub fn amax(&self, dtype: DType, x: u64, n: usize, amax: u64) -> Result<Launch, AmdError> {
        Ok(Launch::new(
            "quantize",
            format!("kpt_amax_{}", float_name(dtype)?),
            self.stride_grid(n, dtype.size_in_bytes()),
            vec![Arg::Ptr(x), Arg::I64(long("n", n)?), Arg::Ptr(amax)],
        ))
    }

    /// Turns the amax at `slot` into the scale `amax / max_finite(target)` in place.
    pub fn amax_to_scale(&self, slot: u64, target: DType) -> Result<Launch, AmdError> {
        quant_name(target)?;
        self.amax_to_scale_of(slot, target.max_finite() as f32)
    }

    /// Turns the amax at `slot` into `amax / max` in place (1 for a zero or non-finite
    /// amax).
    pub fn amax_to_scale_of(&self, slot: u64, max: f32) -> Result<Launch, AmdError> {
        if !(max > 0.0 && max.is_finite()) {
            return Err(invalid(format!("amax_to_scale divides by {max}")));
        }
        Ok(Launch::new(
            "quantize",
            "kpt_amax_to_scale",
            1,
            vec![Arg::Ptr(slot), Arg::F32(max)],
        ))
    }

    /// Saturating quantization of `n` values to `to` with a per-tensor scale.
    pub fn quantize(
        &self,
        from: DType,
        to: DType,
        [x, out]: [u64; 2],
        n: usize,
        scale: QuantScale,
    ) -> Result<Launch, AmdError> {
        let (scale_ptr, scale) = match scale {
            QuantScale::OnDevice(p) => (p, 0.0f32),
            QuantScale::Value(v) => (0u64, v),
        };
        Ok(Launch::new(
            "quantize",
            format!("kpt_quantize_{}_{}", float_name(from)?, quant_name(to)?),
            self.stride_grid(n, from.size_in_bytes()),
            vec![
                Arg::Ptr(x),
                Arg::Ptr(out),
                Arg::I64(long("n", n)?),
                Arg::Ptr(scale_ptr),
                Arg::F32(scale),
            ],
        ))
    }

    /// `out = decode(q) * scale`.
    pub fn dequantize(
        &self,
        from: DType,
        to: DType,
        [q, out]: [u64; 2],
        n: usize,
        scale: f32,
    ) -> Result<Launch, AmdError> {
        Ok(Launch::new(
            "quantize",
            format!("kpt_dequantize_{}_{}", quant_name(from)?, float_name(to)?),
            self.stride_grid(n, 1),
            vec![
                Arg::Ptr(q),
                Arg::Ptr(out),
                Arg::I64(long("n", n)?),
                Arg::F32(scale),
            ],
        ))
    }
}

/// The rotary kernels' limits: an even `head_dim` of at most 512 (their shared cos/sin
/// tables), and `period` positions that divide the `tokens`.
fn check_rotary_dims(tokens: usize, period: usize, head_dim: usize) -> Result<(), AmdError> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > 512 {
        return Err(invalid(format!(
            "rotary head_dim must be even, non-zero and at most 512, got {head_dim}"
        )));
    }
    if tokens > 0 && (period == 0 || !tokens.is_multiple_of(period)) {
        return Err(invalid(format!(
            "rotary positions ({period}) must divide the tokens ({tokens})"
        )));
    }
    Ok(())
}

/// One launch of every entry point kpt's launchers use, with placeholder addresses and
/// small sizes: what the layout tests check against each code object's metadata.
pub fn every_launch(planner: &Planner) -> Result<Vec<Launch>, AmdError> {
    let p = planner;
    let floats = [DType::F32, DType::BF16, DType::F16];
    let indices = [DType::I32, DType::I64];
    let mut out = Vec::new();
    let a = 0x1000;
    for dt in floats {
        for imp in [NormImpl::Hip, NormImpl::Triton] {
            for dim in TRITON_ROW_BLOCKS {
                out.push(p.rms_norm(imp, dt, [a; 3], 2, dim, 1e-5)?);
                out.push(p.add_rms_norm(imp, dt, [a; 3], [a; 2], 2, dim, 1e-5)?);
                if imp == NormImpl::Hip {
                    break;
                }
            }
        }
        out.push(p.layer_norm(dt, [a; 4], 2, 64, 1e-5)?);
        out.push(p.add_layer_norm(dt, [a; 4], [a; 2], 2, 64, 1e-5)?);
        for op in [RowOp::Softmax, RowOp::ArgMax] {
            out.push(p.row_op(op, dt, [a; 2], 2, 64)?);
        }
        let dims = AttentionDims::new(1, 2, 2, 4, 2, 64, true, 0.125, None)?;
        out.push(p.attention(dt, [a; 5], dims)?);
        out.push(p.activation(dt, [a; 2], 64, Activation::Silu)?);
        out.push(p.act_and_mul(dt, [a; 2], 2, 32, Activation::GeluTanh)?);
        out.push(p.binary(dt, [a; 3], 64, 8, Binary::Add)?);
        for to in floats.into_iter().filter(|&t| t != dt) {
            out.push(p.cast(dt, to, [a; 2], 64)?);
        }
        for ix in indices {
            out.push(p.rotary(dt, ix, [a; 3], (4, 4, 2, 64), (a, 1.0))?);
            out.push(p.split_rotary(
                dt,
                ix,
                [a; 2],
                [a; 3],
                (4, 4, [128, 64, 64], 64),
                (a, 1.0),
            )?);
            out.push(p.embedding(dt, ix, [a; 4], 4, 16, 64)?);
        }
        out.push(p.amax(dt, a, 64, a)?);
        for q in [DType::F8E4M3, DType::F8E5M2, DType::I8] {
            out.push(p.quantize(dt, q, [a; 2], 64, QuantScale::Value(0.5))?);
            out.push(p.dequantize(q, dt, [a; 2], 64, 0.5)?);
        }
    }
    out.push(p.amax_to_scale(a, DType::F8E4M3)?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Planner = Planner { compute_units: 104 };

    #[test]
    fn arguments_are_laid_out_like_c() {
        let l = P
            .rotary(DType::F32, DType::I32, [1, 2, 3], (4, 4, 2, 64), (0, 1.0))
            .unwrap();
        // Three pointers, three 4-byte values, a pointer aligned to 40, then the double.
        assert_eq!(
            l.layout(),
            [
                (0, 8),
                (8, 8),
                (16, 8),
                (24, 4),
                (28, 4),
                (32, 4),
                (40, 8),
                (48, 8)
            ]
        );
        // The attention kernel's dims struct: fourteen 4-byte fields after five pointers.
        assert_eq!(std::mem::size_of::<AttentionDims>(), 56);
        let dims = AttentionDims::new(1, 1, 1, 1, 1, 64, false, 1.0, None).unwrap();
        let l = P.attention(DType::BF16, [8; 5], dims).unwrap();
        assert_eq!(l.layout().last(), Some(&(40, 56)));
        assert_eq!(l.params().len(), 6);
    }

    #[test]
    fn bad_sizes_are_typed_errors() {
        assert!(AttentionDims::new(1, 1, 1, 6, 4, 64, false, 1.0, None).is_err());
        assert!(AttentionDims::new(1, 1, 1, 4, 4, 512, false, 1.0, None).is_err());
        assert!(AttentionDims::new(1, 1, 1, 4, 4, 64, false, 1.0, Some(0)).is_err());
        assert!(P
            .rms_norm(NormImpl::Hip, DType::F64, [0; 3], 1, 8, 1e-5)
            .is_err());
        assert!(P
            .rms_norm(NormImpl::Hip, DType::F32, [0; 3], 0, 8, 1e-5)
            .is_err());
        let e = P
            .rms_norm(NormImpl::Triton, DType::F32, [16; 3], 1, 8192 + 16, 1e-5)
            .unwrap_err();
        assert!(e.to_string().contains("exceed 8192"), "{e}");
        let e = P
            .rms_norm(NormImpl::Triton, DType::F32, [16, 16, 8], 1, 64, 1e-5)
            .unwrap_err();
        assert!(e.to_string().contains("aligned"), "{e}");
        assert!(P.binary(DType::F32, [0; 3], 10, 3, Binary::Add).is_err());
        assert!(P.cast(DType::F32, DType::F32, [0; 2], 4).is_err());
        assert!(P
            .rotary(DType::F32, DType::I32, [0; 3], (4, 3, 1, 64), (0, 1.0))
            .is_err());
        assert!(P
            .rotary(DType::F32, DType::F32, [0; 3], (4, 4, 1, 64), (0, 1.0))
            .is_err());
        assert!(P
            .quantize(DType::F32, DType::BF16, [0; 2], 4, QuantScale::Value(1.0))
            .is_err());
    }

    #[test]
    fn grids_follow_the_sizes() {
        // A Triton specialization per row block; the smallest that holds the row.
        let l = P
            .rms_norm(NormImpl::Triton, DType::BF16, [16; 3], 7, 1040, 1e-5)
            .unwrap();
        assert_eq!(
            (l.kernel.as_str(), l.grid),
            ("triton_rms_norm_bf16_2048", 7)
        );
        // Attention: four rows per block.
        let dims = AttentionDims::new(2, 3, 5, 4, 2, 64, true, 0.1, Some(2)).unwrap();
        assert_eq!(P.attention(DType::F32, [8; 5], dims).unwrap().grid, 6);
        // Grid-stride kernels: one block per 256 vectors, at most 16 per CU.
        assert_eq!(P.stride_grid(1, 4), 1);
        assert_eq!(P.stride_grid(4 * 256 * 3, 4), 3);
        assert_eq!(P.stride_grid(usize::MAX / 2, 2), 104 * 16);
    }
}
