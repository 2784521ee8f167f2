//! The ops of the graph IR, with shape and dtype inference.
//!
//! Layout conventions (row-major, last dimension is the feature dimension):
//! - `Linear`: x `[.., K]`, weight `[N, K]` (PyTorch layout), bias `[N]` -> `[.., N]`.
//! - `MatMul`: a `[.., M, K]`, b `[K, N]` or `[.., K, N]` with the same batch dims -> `[.., M, N]`.
//! - `Attention`: q `[B, S, Hq*D]`, k and v `[B, T, Hkv*D]`, optional additive mask `[S, T]`
//!   -> `[B, S, Hq*D]`. Causal masking is bottom-right aligned (query `i` sees keys `j <= i + T - S`).
//!   Variable-length (`varlen`): sequences packed into `B = 1`, q `[1, total_q, Hq*D]`, k and v
//!   `[1, total_k, Hkv*D]`, then `cu_seqlens_q` and `cu_seqlens_k` `[n + 1]` (i32/i64, from 0
//!   to the totals, non-decreasing): sequence `s` is queries `cu_q[s]..cu_q[s+1]` against keys
//!   `cu_k[s]..cu_k[s+1]`, causal bottom-right within the sequence.
//!   Paged KV cache (`paged`, vLLM's block tables): k and v are caches
//!   `[num_blocks, block_size, Hkv*D]`, then `block_table` `[B, max_blocks]` and `seq_lens`
//!   `[B]` (i32/i64): sequence `b`'s key `j` is row `j % block_size` of block
//!   `block_table[b][j / block_size]`, for `j < seq_lens[b]`.
//!   With `lse` (dense batches only, float inputs): a second output, the softmax's
//!   log-sum-exp per query row, f32 (f64 for f64 inputs) `[B, Hq, S]` in natural log
//!   (FlashAttention's `softmax_lse`): `lse[b, h, i] = ln Σ_j exp(scale · q_i·k_j + mask[i, j])`
//!   over the keys query `i` sees, `+inf` for a row that sees none (so that `exp(s - lse)`
//!   is 0 there).
//!   With `dropout` (training; dense or variable-length batches, no FP8): each
//!   probability `P[b, h, i, j]` (after the softmax's normalization) is kept and scaled by
//!   `1 / (1 - p)` or zeroed, as [`AttentionDropout::keeps`] decides from Philox4x32-10:
//!   the same decisions on every backend, reproducible from the seed; `b` is the sequence
//!   of a variable-length batch and `i`, `j` positions within it. The log-sum-exp is the
//!   softmax's, before dropout.
//! - `AttentionBackward`: q, k, v, the forward output, its gradient, the mask when `mask`,
//!   then with `lse` the forward's log-sum-exp `[B, Hq, S]`, or with `varlen` (no mask, no
//!   log-sum-exp) the forward's `cu_seqlens_q` and `cu_seqlens_k` -> (dq, dk, dv). Given
//!   the log-sum-exp, kernels take the probabilities as `exp(s - lse)` instead of
//!   recomputing the softmax statistics. A variable-length batch's sequences are
//!   independent: each one's keys get the gradients of its own queries.
//! - `Rotary`: x `[.., S, H*D]` (rank >= 2), positions (i32/i64) `[S]`, shared by every
//!   sequence, or one per token, shaped like x's leading dims (`[B, S]` for x `[B, S, H*D]`:
//!   batched decode of sequences at different lengths) -> same shape as x (NeoX "rotate
//!   half"), frequencies from [`rope_frequencies`](super::rope_frequencies) (with optional
//!   scaling).
//! - `SplitRotary`: qkv `[.., S, q+k+v]`, positions as for `Rotary` -> (q `[.., S, q]`
//!   rotated, k `[.., S, k]` rotated, v `[.., S, v]`): `Split` on the last axis followed by
//!   `Rotary` on q and on k, in one op. With `cache`, the k and v caches and slots follow
//!   (as for `CacheWrite`) and the outputs are (q, k cache, v cache) with the rotated k
//!   and the v rows written at the slots.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::rope::RopeScaling;
use crate::dtype::DType;
use crate::error::{KptError, Result};

/// Element-wise activation functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// max(x, 0).
    Relu,
    /// x * Φ(x) with the exact error function.
    GeluErf,
    /// The tanh approximation of GELU.
    GeluTanh,
    /// x * sigmoid(x) (a.k.a. swish).
    Silu,
}

impl Activation {
    /// Every activation.
    pub const ALL: [Activation; 4] = [
        Activation::Relu,
        Activation::GeluErf,
        Activation::GeluTanh,
        Activation::Silu,
    ];

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::GeluErf => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Silu => "silu",
        }
    }
}

/// Dropout of attention probabilities (training), reproducible on every backend: the
/// probability of query `i` for key `j` of head `h` in batch `b` is kept iff the 16-bit
/// number `j % 8` ([`random16`](Self::random16)) of
/// [`philox4x32_10`](crate::rand::philox4x32_10) with counter `[j / 8, i, h, b]` and key
/// `[seed as u32, (seed >> 32) as u32]` is at least [`threshold`](Self::threshold); kept
/// probabilities are scaled by [`scale`](Self::scale) (`1 / (1 - p)`), as PyTorch's and
/// FlashAttention's dropout do. A new seed per training step gives new decisions. One
/// Philox call decides eight keys (FlashAttention-2 takes 8-bit numbers, sixteen keys).
///
/// ```
/// use kpt_core::graph::AttentionDropout;
/// let d = AttentionDropout { p: 0.25, seed: 7 };
/// let kept = (0..4000).filter(|&j| d.keeps(0, 0, 0, j)).count();
/// assert!((2800..3200).contains(&kept));
/// assert_eq!(d.scale(), 1.0 / 0.75);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionDropout {
    /// Probability of dropping a probability, in `[0, 1)`.
    pub p: f32,
    /// Seed of the keep decisions.
    pub seed: u64,
}

impl AttentionDropout {
    /// Checks that `p` is in `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(KptError::InvalidArgument(format!(
                "attention dropout probability must be in [0, 1), got {}",
                self.p
            )));
        }
        Ok(())
    }

    /// Keys one Philox call decides.
    pub const KEYS_PER_CALL: usize = 8;

    /// A probability is kept iff its 16-bit random number is at least this:
    /// `floor(p * 2^16)`.
    pub fn threshold(&self) -> u32 {
        (f64::from(self.p) * 65_536.0).floor().min(65_535.0) as u32
    }

    /// The 16-bit random number of key `k` (0..8) of a call's eight keys: word `k / 2`,
    /// its low half for even `k`, its high half for odd `k`.
    pub fn random16(words: &[u32; 4], k: usize) -> u32 {
        (words[k / 2] >> (16 * (k % 2))) & 0xFFFF
    }

    /// The factor of kept probabilities, `1 / (1 - p)`.
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - f64::from(self.p))
    }

    /// Whether the probability of query `query` for key `key` of head `head` in batch
    /// (or sequence) `batch` is kept.
    pub fn keeps(&self, batch: usize, head: usize, query: usize, key: usize) -> bool {
        let words = self.words(batch, head, query, key / Self::KEYS_PER_CALL);
        Self::random16(&words, key % Self::KEYS_PER_CALL) >= self.threshold()
    }

    /// The random words of keys `8 group .. 8 group + 7` of a query row (one Philox call).
    pub fn words(&self, batch: usize, head: usize, query: usize, group: usize) -> [u32; 4] {
        crate::rand::philox4x32_10(
            [group as u32, query as u32, head as u32, batch as u32],
            [self.seed as u32, (self.seed >> 32) as u32],
        )
    }
}

/// Parameters of the attention op.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionParams {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when smaller than `num_heads`; must divide it).
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Causal (bottom-right aligned) masking.
    pub causal: bool,
    /// Softmax scale; `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Whether a fourth input, an additive `[S, T]` mask, is given.
    pub mask: bool,
    /// Packed variable-length sequences: two more inputs, `cu_seqlens_q` and
    /// `cu_seqlens_k` (see the module docs); excludes `mask`.
    #[serde(default)]
    pub varlen: bool,
    /// Sliding window (Mistral's `sliding_window`): query `i` sees only the `w` keys up to
    /// its aligned position, `j > i + T - S - w`. At least 1.
    #[serde(default)]
    pub window: Option<usize>,
    /// Keys and values in a paged cache: two more inputs, `block_table` and `seq_lens`
    /// (see the module docs); excludes `mask` and `varlen`.
    #[serde(default)]
    pub paged: bool,
    /// Log-sum-exp of the softmax rows (see the module docs): [`Op::Attention`] gives it
    /// as a second output, [`Op::AttentionBackward`] takes it as its last input. Dense
    /// batches only (excludes `varlen` and `paged`), no FP8 inputs.
    #[serde(default)]
    pub lse: bool,
    /// Dropout of the probabilities (training; see the module docs): dense or
    /// variable-length batches, 16-bit or wider inputs. [`Op::AttentionBackward`] with the
    /// same parameters applies the same decisions.
    #[serde(default)]
    pub dropout: Option<AttentionDropout>,
}

impl AttentionParams {
    /// Dense attention with `num_heads` query heads over `num_kv_heads` kv heads of
    /// `head_dim`, the default scale, no mask, window or paging.
    pub fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize, causal: bool) -> Self {
        Self {
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            scale: None,
            mask: false,
            varlen: false,
            window: None,
            paged: false,
            lse: false,
            dropout: None,
        }
    }

    /// The shape of the log-sum-exp output for queries `q [B, S, Hq*D]`: `[B, Hq, S]`.
    pub fn lse_shape(&self, q: &[usize]) -> [usize; 3] {
        [
            q.first().copied().unwrap_or(0),
            self.num_heads,
            q.get(1).copied().unwrap_or(0),
        ]
    }

    /// An error for a kernel that applies no dropout when these parameters ask for it.
    pub fn require_no_dropout(&self, kernel: &str) -> Result<()> {
        match self.dropout {
            Some(_) => Err(KptError::InvalidArgument(format!(
                "{kernel} applies no attention dropout; the reference kernel does"
            ))),
            None => Ok(()),
        }
    }

    /// The scale actually applied to `q·k`.
    pub fn effective_scale(&self) -> f32 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f32).sqrt())
    }
}

/// One operation of the graph IR.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Row lookup: ids (i32/i64) and table `[.., D]` -> `[ids.., D]`, row `ids[i]` of the
    /// table's rows counted over all its leading dims (a `[V, D]` embedding table, or
    /// the `[1, S, D]` activation of a prefill whose last rows feed the logits).
    Embedding,
    /// Matrix product.
    MatMul,
    /// `x w^T (+ b)`.
    Linear {
        /// Whether a bias input follows the weight.
        bias: bool,
    },
    /// Element-wise activation.
    Activation {
        /// Which function.
        act: Activation,
    },
    /// Fused `act(x w^T + b)`.
    LinearAct {
        /// Whether a bias input follows the weight.
        bias: bool,
        /// The fused activation.
        act: Activation,
    },
    /// RMS normalization over the last dim: x, weight `[D]`.
    RmsNorm {
        /// Added to the mean square.
        eps: f32,
    },
    /// Layer normalization over the last dim: x, weight `[D]`, bias `[D]`.
    LayerNorm {
        /// Added to the variance.
        eps: f32,
    },
    /// Fused residual add + RMS norm: x, residual, weight -> (x + residual, rms_norm(x + residual)).
    AddRmsNorm {
        /// Added to the mean square.
        eps: f32,
    },
    /// Fused residual add + layer norm: x, residual, weight, bias ->
    /// (x + residual, layer_norm(x + residual)).
    AddLayerNorm {
        /// Added to the variance.
        eps: f32,
    },
    /// Rotary position embedding (NeoX / LLaMA "rotate half" layout): pair `i` of each
    /// head turns by `position * inv_freq[i]`, cos and sin times the attention factor,
    /// both from [`rope_frequencies`](super::rope_frequencies)`(head_dim, theta, scaling)`.
    Rotary {
        /// Size of one head (even).
        head_dim: usize,
        /// Frequency base (10000 for LLaMA 2).
        theta: f32,
        /// Frequency scaling for long contexts; `None` for plain rotary.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scaling: Option<RopeScaling>,
    },
    /// Fused last-axis [`Op::Split`] into q, k and v followed by [`Op::Rotary`] on q and
    /// on k with one positions input: qkv `[.., S, q+k+v]`, positions -> (q rotated, k
    /// rotated, v copied). What the optimizer makes of a merged QKV projection's split.
    SplitRotary {
        /// Size of one head (even; divides the q and k widths).
        head_dim: usize,
        /// Frequency base (10000 for LLaMA 2).
        theta: f32,
        /// Frequency scaling for long contexts; `None` for plain rotary.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scaling: Option<RopeScaling>,
        /// Widths of q, k and v along the last axis (three parts summing to it).
        sizes: Vec<usize>,
        /// Whether k and v go into caches instead of their own outputs: inputs qkv,
        /// positions, k cache, v cache, slots (as for [`Op::CacheWrite`]) -> (q, k cache,
        /// v cache). What the optimizer makes of a split + rotary whose k and v are only
        /// written into caches (a decode step); executors run it in place
        /// ([`Backend::split_rotary_into_caches`](crate::backend::Backend::split_rotary_into_caches)).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cache: bool,
    },
    /// Softmax over the last dim.
    Softmax,
    /// Scaled dot-product attention. q, k and v share a float dtype, or are all FP8 e4m3
    /// (each with its per-tensor scale), which gives a bf16 output.
    Attention(AttentionParams),
    /// Gradients of [`Op::Attention`] (training): q, k, v, the forward output, its
    /// gradient, then the mask when `mask`, then the forward's log-sum-exp when `lse` ->
    /// (dq, dk, dv). Dense batches only (no `varlen`, no `paged`).
    AttentionBackward(AttentionParams),
    /// Element-wise sum; the right operand broadcasts over leading dims.
    Add,
    /// Element-wise product; the right operand broadcasts over leading dims.
    Mul,
    /// Float -> FP8/int8 with a per-tensor scale (stored = x / scale).
    Quantize {
        /// Target dtype (f8e4m3, f8e5m2 or i8).
        dtype: DType,
        /// Per-tensor scale.
        scale: f32,
    },
    /// FP8/int8 -> float (x = stored * scale, scale carried by the input).
    Dequantize {
        /// Target float dtype.
        dtype: DType,
    },
    /// Float -> float conversion.
    Cast {
        /// Target dtype.
        dtype: DType,
    },
    /// Concatenation of two tensors along `axis` (e.g. appending to a KV cache).
    Concat {
        /// The axis to join along.
        axis: usize,
    },
    /// Splits one tensor along `axis` into parts of `sizes` (which sum to that dim); one
    /// output per part (e.g. q, k and v out of a fused QKV projection).
    Split {
        /// The axis to cut.
        axis: usize,
        /// Length of each part along `axis`.
        sizes: Vec<usize>,
    },
    /// Gated activation: x `[.., 2N]` -> `act(x[.., :N]) * x[.., N:]` `[.., N]` (SwiGLU
    /// with SiLU, GeGLU with GELU) after a fused gate/up projection.
    ActAndMul {
        /// Applied to the first half.
        act: Activation,
    },
    /// Writes rows into a KV cache (vLLM's `reshape_and_cache`): a float cache `[.., row]`,
    /// rows `[.., row]` of the cache's dtype, slots `[n]` (i32/i64, one per row of `rows`) ->
    /// the cache with row `slots[i]` (counted over all of the cache's leading dims, e.g.
    /// `block * block_size + offset` for a paged cache `[blocks, block_size, row]`)
    /// replaced by row `i`; a negative slot skips its row (padding). Executors run it in
    /// place when the cache is theirs to change ([`Backend::write_rows`](crate::backend::Backend::write_rows)).
    CacheWrite,
    /// Index of the largest element along the last dim: float `[.., N]` (N >= 1) -> i64
    /// `[..]` (greedy decoding without sending logits to the host). Ties go to the lowest
    /// index; a row that holds a NaN gives -1, so that a caller refuses it rather than
    /// pick a token from it.
    ArgMax,
}

/// The kind of an op without its parameters: the key of the op catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// See [`Op::Embedding`].
    Embedding,
    /// See [`Op::MatMul`].
    MatMul,
    /// See [`Op::Linear`].
    Linear,
    /// See [`Op::Activation`].
    Activation,
    /// See [`Op::LinearAct`].
    LinearAct,
    /// See [`Op::RmsNorm`].
    RmsNorm,
    /// See [`Op::LayerNorm`].
    LayerNorm,
    /// See [`Op::AddRmsNorm`].
    AddRmsNorm,
    /// See [`Op::AddLayerNorm`].
    AddLayerNorm,
    /// See [`Op::Rotary`].
    Rotary,
    /// See [`Op::SplitRotary`].
    SplitRotary,
    /// See [`Op::Softmax`].
    Softmax,
    /// See [`Op::Attention`].
    Attention,
    /// See [`Op::AttentionBackward`].
    AttentionBackward,
    /// See [`Op::Add`].
    Add,
    /// See [`Op::Mul`].
    Mul,
    /// See [`Op::Quantize`].
    Quantize,
    /// See [`Op::Dequantize`].
    Dequantize,
    /// See [`Op::Cast`].
    Cast,
    /// See [`Op::Concat`].
    Concat,
    /// See [`Op::Split`].
    Split,
    /// See [`Op::ActAndMul`].
    ActAndMul,
    /// See [`Op::CacheWrite`].
    CacheWrite,
    /// See [`Op::ArgMax`].
    ArgMax,
}

impl OpKind {
    /// Every op kind, in catalog order.
    pub const ALL: [OpKind; 24] = [
        OpKind::Embedding,
        OpKind::MatMul,
        OpKind::Linear,
        OpKind::Activation,
        OpKind::LinearAct,
        OpKind::RmsNorm,
        OpKind::LayerNorm,
        OpKind::AddRmsNorm,
        OpKind::AddLayerNorm,
        OpKind::Rotary,
        OpKind::SplitRotary,
        OpKind::Softmax,
        OpKind::Attention,
        OpKind::AttentionBackward,
        OpKind::Add,
        OpKind::Mul,
        OpKind::Quantize,
        OpKind::Dequantize,
        OpKind::Cast,
        OpKind::Concat,
        OpKind::Split,
        OpKind::ActAndMul,
        OpKind::CacheWrite,
        OpKind::ArgMax,
    ];

    /// snake_case name, as accepted by [`FromStr`].
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::Embedding => "embedding",
            OpKind::MatMul => "matmul",
            OpKind::Linear => "linear",
            OpKind::Activation => "activation",
            OpKind::LinearAct => "linear_act",
            OpKind::RmsNorm => "rms_norm",
            OpKind::LayerNorm => "layer_norm",
            OpKind::AddRmsNorm => "add_rms_norm",
            OpKind::AddLayerNorm => "add_layer_norm",
            OpKind::Rotary => "rotary",
            OpKind::SplitRotary => "split_rotary",
            OpKind::Softmax => "softmax",
            OpKind::Attention => "attention",
            OpKind::AttentionBackward => "attention_backward",
            OpKind::Add => "add",
            OpKind::Mul => "mul",
            OpKind::Quantize => "quantize",
            OpKind::Dequantize => "dequantize",
            OpKind::Cast => "cast",
            OpKind::Concat => "concat",
            OpKind::Split => "split",
            OpKind::ActAndMul => "act_and_mul",
            OpKind::CacheWrite => "cache_write",
            OpKind::ArgMax => "argmax",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OpKind {
    type Err = KptError;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase().replace('-', "_");
        OpKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or(KptError::UnknownOp(s))
    }
}

/// Shape and dtype of a value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
}

impl TensorSpec {
    /// A spec from a shape and dtype.
    pub fn new(shape: &[usize], dtype: DType) -> Self {
        Self {
            shape: shape.to_vec(),
            dtype,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }

    /// Rows and row length: the product of the leading dims and the last dim (a scalar
    /// is one row of one).
    pub fn rows_and_width(&self) -> (usize, usize) {
        let width = self.shape.last().copied().unwrap_or(1);
        let rows = self.shape[..self.shape.len().saturating_sub(1)]
            .iter()
            .product();
        (rows, width)
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.dtype, self.shape)
    }
}

/// The dtype of attention's log-sum-exp for inputs of `dtype`: f32, or f64 for f64 inputs.
pub fn lse_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Floating point types that ops compute in.
fn is_compute(d: DType) -> bool {
    matches!(d, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
}

/// Checks what [`Op::Rotary`] and [`Op::SplitRotary`] share: a float x of rank >= 2,
/// an even non-zero `head_dim`, a valid `theta` and scaling, and positions (i32/i64)
/// `[S]` or shaped like x's leading dims.
fn check_rotary(
    name: &str,
    x: &TensorSpec,
    pos: &TensorSpec,
    head_dim: usize,
    theta: f32,
    scaling: Option<&RopeScaling>,
) -> Result<()> {
    if !is_compute(x.dtype) {
        return Err(KptError::dtype(name, "f64, f32, f16 or bf16", x.dtype));
    }
    if !pos.dtype.is_index() {
        return Err(KptError::dtype(name, "i32 or i64 positions", pos.dtype));
    }
    let rank = x.shape.len();
    if rank < 2 {
        return Err(KptError::shape(
            name,
            format!("x must be [.., seq, heads*head_dim], got {:?}", x.shape),
        ));
    }
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(KptError::shape(
            name,
            format!("head_dim {head_dim} must be even and non-zero"),
        ));
    }
    if theta.is_nan() || theta <= 0.0 {
        return Err(KptError::InvalidArgument(format!(
            "rotary theta must be > 0, got {theta}"
        )));
    }
    if let Some(s) = scaling {
        s.validate(head_dim, f64::from(theta))?;
    }
    let lead = &x.shape[..rank - 1];
    if pos.shape != [x.shape[rank - 2]] && pos.shape != lead {
        return Err(KptError::shape(
            name,
            format!(
                "positions must be [{}] (shared by every sequence) or {lead:?} (one per \
                 token), got {:?}",
                x.shape[rank - 2],
                pos.shape
            ),
        ));
    }
    Ok(())
}

impl Op {
    /// The op's kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Embedding => OpKind::Embedding,
            Op::MatMul => OpKind::MatMul,
            Op::Linear { .. } => OpKind::Linear,
            Op::Activation { .. } => OpKind::Activation,
            Op::LinearAct { .. } => OpKind::LinearAct,
            Op::RmsNorm { .. } => OpKind::RmsNorm,
            Op::LayerNorm { .. } => OpKind::LayerNorm,
            Op::AddRmsNorm { .. } => OpKind::AddRmsNorm,
            Op::AddLayerNorm { .. } => OpKind::AddLayerNorm,
            Op::Rotary { .. } => OpKind::Rotary,
            Op::SplitRotary { .. } => OpKind::SplitRotary,
            Op::Softmax => OpKind::Softmax,
            Op::Attention(_) => OpKind::Attention,
            Op::AttentionBackward(_) => OpKind::AttentionBackward,
            Op::Add => OpKind::Add,
            Op::Mul => OpKind::Mul,
            Op::Quantize { .. } => OpKind::Quantize,
            Op::Dequantize { .. } => OpKind::Dequantize,
            Op::Cast { .. } => OpKind::Cast,
            Op::Concat { .. } => OpKind::Concat,
            Op::Split { .. } => OpKind::Split,
            Op::ActAndMul { .. } => OpKind::ActAndMul,
            Op::CacheWrite => OpKind::CacheWrite,
            Op::ArgMax => OpKind::ArgMax,
        }
    }

    /// This [`Op::SplitRotary`] with its `cache` flag set to `cache` (false: k and v as
    /// outputs); an error for any other op.
    pub fn split_rotary_with_cache(&self, cache: bool) -> Result<Op> {
        match self {
            Op::SplitRotary {
                head_dim,
                theta,
                scaling,
                sizes,
                ..
            } => Ok(Op::SplitRotary {
                head_dim: *head_dim,
                theta: *theta,
                scaling: *scaling,
                sizes: sizes.clone(),
                cache,
            }),
            other => Err(KptError::Graph(format!("{other} is not split_rotary"))),
        }
    }

    /// How many inputs the op takes.
    pub fn num_inputs(&self) -> usize {
        match self {
            Op::Activation { .. }
            | Op::Softmax
            | Op::Quantize { .. }
            | Op::Dequantize { .. }
            | Op::Cast { .. }
            | Op::Split { .. }
            | Op::ActAndMul { .. }
            | Op::ArgMax => 1,
            Op::Embedding | Op::MatMul | Op::RmsNorm { .. } => 2,
            Op::Rotary { .. } | Op::SplitRotary { cache: false, .. } => 2,
            Op::SplitRotary { cache: true, .. } => 5,
            Op::Add | Op::Mul | Op::Concat { .. } => 2,
            Op::Linear { bias } | Op::LinearAct { bias, .. } => 2 + usize::from(*bias),
            Op::LayerNorm { .. } | Op::AddRmsNorm { .. } | Op::CacheWrite => 3,
            Op::AddLayerNorm { .. } => 4,
            Op::Attention(p) => {
                3 + usize::from(p.mask) + 2 * usize::from(p.varlen) + 2 * usize::from(p.paged)
            }
            Op::AttentionBackward(p) => {
                5 + usize::from(p.mask) + usize::from(p.lse) + 2 * usize::from(p.varlen)
            }
        }
    }

    /// Floating point operations for one run with these inputs (for throughput reports).
    pub fn flops(&self, inputs: &[TensorSpec]) -> f64 {
        let numel = |i: usize| inputs.get(i).map_or(0, TensorSpec::numel) as f64;
        match self {
            Op::Linear { .. } | Op::LinearAct { .. } => {
                let n = inputs.get(1).map_or(0, |w| w.shape[0]) as f64;
                2.0 * numel(0) * n
            }
            Op::MatMul => {
                let n = inputs
                    .get(1)
                    .and_then(|b| b.shape.last())
                    .copied()
                    .unwrap_or(0) as f64;
                2.0 * numel(0) * n
            }
            // The backward pass: five products of the forward's size against its two.
            Op::AttentionBackward(p) => 2.5 * Op::Attention(*p).flops(inputs),
            Op::Attention(p) => {
                let (Some(q), Some(k)) = (inputs.first(), inputs.get(1)) else {
                    return 0.0;
                };
                let (b, s, t) = (q.shape[0] as f64, q.shape[1] as f64, k.shape[1] as f64);
                let full = 4.0 * b * s * t * (p.num_heads * p.head_dim) as f64;
                if p.causal {
                    full / 2.0
                } else {
                    full
                }
            }
            Op::CacheWrite => numel(1),
            _ => numel(0),
        }
    }

    /// Infers the output specs from the input specs; a typed error names what is wrong.
    pub fn infer(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let name = self.kind().name();
        if inputs.len() != self.num_inputs() {
            return Err(KptError::Graph(format!(
                "{name} takes {} input(s), got {}",
                self.num_inputs(),
                inputs.len()
            )));
        }
        let shape_err = |msg: String| KptError::shape(name, msg);
        let want_compute = |s: &TensorSpec| -> Result<()> {
            if is_compute(s.dtype) {
                Ok(())
            } else {
                Err(KptError::dtype(name, "f64, f32, f16 or bf16", s.dtype))
            }
        };
        let same_dtype = |a: &TensorSpec, b: &TensorSpec| -> Result<()> {
            if a.dtype == b.dtype {
                Ok(())
            } else {
                Err(KptError::dtype(name, a.dtype.name(), b.dtype))
            }
        };
        let rank_at_least = |s: &TensorSpec, r: usize, what: &str| -> Result<()> {
            if s.shape.len() >= r {
                Ok(())
            } else {
                Err(KptError::shape(
                    name,
                    format!("{what} must have rank >= {r}, got shape {:?}", s.shape),
                ))
            }
        };
        let x = &inputs[0];
        match self {
            Op::Embedding => {
                let (ids, table) = (&inputs[0], &inputs[1]);
                if !ids.dtype.is_index() {
                    return Err(KptError::dtype(name, "i32 or i64 ids", ids.dtype));
                }
                want_compute(table)?;
                rank_at_least(table, 2, "table")?;
                let mut shape = ids.shape.clone();
                shape.push(table.shape[table.shape.len() - 1]);
                Ok(vec![TensorSpec::new(&shape, table.dtype)])
            }
            Op::MatMul => {
                let b = &inputs[1];
                want_compute(x)?;
                same_dtype(x, b)?;
                rank_at_least(x, 2, "a")?;
                rank_at_least(b, 2, "b")?;
                let (m, k) = (x.shape[x.shape.len() - 2], x.shape[x.shape.len() - 1]);
                let (kb, n) = (b.shape[b.shape.len() - 2], b.shape[b.shape.len() - 1]);
                if k != kb {
                    return Err(shape_err(format!(
                        "inner dims differ: a is {:?}, b is {:?} ({k} != {kb})",
                        x.shape, b.shape
                    )));
                }
                let batch_a = &x.shape[..x.shape.len() - 2];
                let batch_b = &b.shape[..b.shape.len() - 2];
                if !batch_b.is_empty() && batch_a != batch_b {
                    return Err(shape_err(format!(
                        "batch dims differ: a is {:?}, b is {:?}",
                        x.shape, b.shape
                    )));
                }
                let mut shape = batch_a.to_vec();
                shape.extend([m, n]);
                Ok(vec![TensorSpec::new(&shape, x.dtype)])
            }
            Op::Linear { bias } | Op::LinearAct { bias, .. } => {
                let w = &inputs[1];
                want_compute(x)?;
                if !(w.dtype.is_float() || w.dtype == DType::I8) {
                    return Err(KptError::dtype(name, "a float or i8 weight", w.dtype));
                }
                rank_at_least(x, 1, "x")?;
                if w.shape.len() != 2 {
                    return Err(shape_err(format!(
                        "weight must be [out, in], got {:?}",
                        w.shape
                    )));
                }
                let k = x.shape[x.shape.len() - 1];
                if w.shape[1] != k {
                    return Err(shape_err(format!(
                        "x has {k} features but weight {:?} expects {}",
                        w.shape, w.shape[1]
                    )));
                }
                if *bias {
                    let b = &inputs[2];
                    same_dtype(x, b)?;
                    if b.shape != [w.shape[0]] {
                        return Err(shape_err(format!(
                            "bias must be [{}], got {:?}",
                            w.shape[0], b.shape
                        )));
                    }
                }
                let mut shape = x.shape.clone();
                *shape.last_mut().unwrap_or(&mut 0) = w.shape[0];
                Ok(vec![TensorSpec::new(&shape, x.dtype)])
            }
            Op::Activation { .. } | Op::Softmax => {
                want_compute(x)?;
                if matches!(self, Op::Softmax) {
                    rank_at_least(x, 1, "x")?;
                }
                Ok(vec![x.clone()])
            }
            Op::RmsNorm { .. }
            | Op::LayerNorm { .. }
            | Op::AddRmsNorm { .. }
            | Op::AddLayerNorm { .. } => {
                want_compute(x)?;
                rank_at_least(x, 1, "x")?;
                let dim = x.shape[x.shape.len() - 1];
                let fused = matches!(self, Op::AddRmsNorm { .. } | Op::AddLayerNorm { .. });
                if fused {
                    let r = &inputs[1];
                    same_dtype(x, r)?;
                    if r.shape != x.shape {
                        return Err(shape_err(format!(
                            "residual {:?} must match x {:?}",
                            r.shape, x.shape
                        )));
                    }
                }
                // Weight (and bias) follow x, and the residual when there is one.
                let params = &inputs[1 + usize::from(fused)..];
                for p in params {
                    same_dtype(x, p)?;
                    if p.shape != [dim] {
                        return Err(shape_err(format!(
                            "weight/bias must be [{dim}], got {:?}",
                            p.shape
                        )));
                    }
                }
                if fused {
                    Ok(vec![x.clone(), x.clone()])
                } else {
                    Ok(vec![x.clone()])
                }
            }
            Op::Rotary {
                head_dim,
                theta,
                scaling,
            } => {
                check_rotary(name, x, &inputs[1], *head_dim, *theta, scaling.as_ref())?;
                let width = x.shape[x.shape.len() - 1];
                if !width.is_multiple_of(*head_dim) {
                    return Err(shape_err(format!(
                        "head_dim {head_dim} must divide the last dim of {:?}",
                        x.shape
                    )));
                }
                Ok(vec![x.clone()])
            }
            Op::SplitRotary {
                head_dim,
                theta,
                scaling,
                sizes,
                cache,
            } => {
                check_rotary(name, x, &inputs[1], *head_dim, *theta, scaling.as_ref())?;
                let width = x.shape[x.shape.len() - 1];
                let [q, k, _] = sizes[..] else {
                    return Err(shape_err(format!(
                        "sizes {sizes:?} must be three widths (q, k, v)"
                    )));
                };
                if sizes.iter().sum::<usize>() != width {
                    return Err(shape_err(format!(
                        "sizes {sizes:?} must sum to the last dim of {:?}",
                        x.shape
                    )));
                }
                if !q.is_multiple_of(*head_dim) || !k.is_multiple_of(*head_dim) {
                    return Err(shape_err(format!(
                        "head_dim {head_dim} must divide the q and k widths {q} and {k}"
                    )));
                }
                let parts: Vec<TensorSpec> = sizes
                    .iter()
                    .map(|&n| {
                        let mut shape = x.shape.clone();
                        *shape.last_mut().unwrap_or(&mut 0) = n;
                        TensorSpec::new(&shape, x.dtype)
                    })
                    .collect();
                if !cache {
                    return Ok(parts);
                }
                let slots = &inputs[4];
                let k_cache =
                    Op::CacheWrite.infer(&[inputs[2].clone(), parts[1].clone(), slots.clone()])?;
                let v_cache =
                    Op::CacheWrite.infer(&[inputs[3].clone(), parts[2].clone(), slots.clone()])?;
                Ok(vec![
                    parts[0].clone(),
                    k_cache[0].clone(),
                    v_cache[0].clone(),
                ])
            }
            Op::Attention(p) => {
                let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
                // FP8 e4m3 q, k, v (with per-tensor scales) give a bf16 output.
                if q.dtype != DType::F8E4M3 {
                    want_compute(q)?;
                }
                same_dtype(q, k)?;
                same_dtype(q, v)?;
                if p.num_heads == 0 || p.num_kv_heads == 0 || p.head_dim == 0 {
                    return Err(shape_err(
                        "num_heads, num_kv_heads and head_dim must be > 0".into(),
                    ));
                }
                if p.window == Some(0) {
                    return Err(KptError::InvalidArgument(
                        "attention window must be at least 1 key".into(),
                    ));
                }
                if let Some(d) = &p.dropout {
                    d.validate()?;
                    if p.paged || q.dtype == DType::F8E4M3 {
                        return Err(KptError::InvalidArgument(
                            "attention dropout is for training: not with a paged KV cache or \
                             FP8 inputs"
                                .into(),
                        ));
                    }
                }
                if p.num_heads % p.num_kv_heads != 0 {
                    return Err(shape_err(format!(
                        "num_heads {} is not a multiple of num_kv_heads {}",
                        p.num_heads, p.num_kv_heads
                    )));
                }
                for (t, what, heads) in [
                    (q, "q", p.num_heads),
                    (k, "k", p.num_kv_heads),
                    (v, "v", p.num_kv_heads),
                ] {
                    if t.shape.len() != 3 || t.shape[2] != heads * p.head_dim {
                        return Err(shape_err(format!(
                            "{what} must be [batch, seq, {}], got {:?}",
                            heads * p.head_dim,
                            t.shape
                        )));
                    }
                }
                if k.shape[..2] != v.shape[..2] || (!p.paged && k.shape[0] != q.shape[0]) {
                    return Err(shape_err(format!(
                        "batch/seq of q {:?}, k {:?}, v {:?} disagree",
                        q.shape, k.shape, v.shape
                    )));
                }
                if p.paged {
                    if p.mask || p.varlen {
                        return Err(KptError::InvalidArgument(
                            "a paged KV cache excludes a mask and variable-length packing".into(),
                        ));
                    }
                    let (table, lens) = (&inputs[3], &inputs[4]);
                    for t in [table, lens] {
                        if !t.dtype.is_index() {
                            return Err(KptError::dtype(
                                name,
                                "i32 or i64 block_table and seq_lens",
                                t.dtype,
                            ));
                        }
                    }
                    if table.shape.len() != 2
                        || table.shape[0] != q.shape[0]
                        || lens.shape != [q.shape[0]]
                    {
                        return Err(shape_err(format!(
                            "block_table {:?} must be [{b}, max_blocks] and seq_lens {:?} [{b}]",
                            table.shape,
                            lens.shape,
                            b = q.shape[0]
                        )));
                    }
                }
                if p.varlen {
                    if p.mask {
                        return Err(KptError::InvalidArgument(
                            "attention takes a mask or variable-length sequences, not both".into(),
                        ));
                    }
                    if q.shape[0] != 1 {
                        return Err(shape_err(format!(
                            "variable-length sequences are packed into batch 1, got q {:?}",
                            q.shape
                        )));
                    }
                    let (cq, ck) = (&inputs[3], &inputs[4]);
                    for c in [cq, ck] {
                        if !c.dtype.is_index() {
                            return Err(KptError::dtype(name, "i32 or i64 cu_seqlens", c.dtype));
                        }
                    }
                    if cq.shape.len() != 1 || cq.shape != ck.shape || cq.shape[0] == 0 {
                        return Err(shape_err(format!(
                            "cu_seqlens_q {:?} and cu_seqlens_k {:?} must both be [sequences + 1]",
                            cq.shape, ck.shape
                        )));
                    }
                }
                if p.mask {
                    let m = &inputs[3];
                    want_compute(m)?;
                    if m.shape != [q.shape[1], k.shape[1]] {
                        return Err(shape_err(format!(
                            "mask must be [{}, {}], got {:?}",
                            q.shape[1], k.shape[1], m.shape
                        )));
                    }
                }
                if q.dtype == DType::F8E4M3 {
                    if p.lse {
                        return Err(KptError::InvalidArgument(
                            "attention gives no log-sum-exp for FP8 inputs (the backward \
                             pass takes no FP8)"
                                .into(),
                        ));
                    }
                    return Ok(vec![TensorSpec::new(&q.shape, DType::BF16)]);
                }
                if p.lse {
                    if p.varlen || p.paged {
                        return Err(KptError::InvalidArgument(
                            "attention gives a log-sum-exp for dense batches only (no varlen, \
                             no paged cache)"
                                .into(),
                        ));
                    }
                    let lse = TensorSpec::new(&p.lse_shape(&q.shape), lse_dtype(q.dtype));
                    return Ok(vec![q.clone(), lse]);
                }
                Ok(vec![q.clone()])
            }
            Op::AttentionBackward(p) => {
                if inputs[0].dtype.is_quantized() {
                    return Err(KptError::dtype(
                        name,
                        "f64, f32, f16 or bf16",
                        inputs[0].dtype,
                    ));
                }
                if p.paged {
                    return Err(KptError::InvalidArgument(
                        "attention_backward takes dense or variable-length batches (no paged \
                         cache)"
                            .into(),
                    ));
                }
                if p.varlen && (p.mask || p.lse) {
                    return Err(KptError::InvalidArgument(
                        "a variable-length attention_backward takes no mask and no log-sum-exp"
                            .into(),
                    ));
                }
                let mut forward = vec![inputs[0].clone(), inputs[1].clone(), inputs[2].clone()];
                if p.mask {
                    forward.push(inputs[5].clone());
                }
                if p.varlen {
                    forward.extend([inputs[5].clone(), inputs[6].clone()]);
                }
                let out = Op::Attention(*p).infer(&forward)?;
                for (t, what) in [(&inputs[3], "out"), (&inputs[4], "dout")] {
                    if *t != out[0] {
                        return Err(shape_err(format!(
                            "{what} must be {} like q, got {t}",
                            out[0]
                        )));
                    }
                }
                if p.lse {
                    let lse = &inputs[5 + usize::from(p.mask)];
                    if *lse != out[1] {
                        return Err(shape_err(format!(
                            "lse must be {} ([batch, heads, seq_q]), got {lse}",
                            out[1]
                        )));
                    }
                }
                Ok(vec![
                    inputs[0].clone(),
                    inputs[1].clone(),
                    inputs[2].clone(),
                ])
            }
            Op::Add | Op::Mul => {
                let b = &inputs[1];
                want_compute(x)?;
                same_dtype(x, b)?;
                if b.shape.len() > x.shape.len() || !x.shape.ends_with(&b.shape) {
                    return Err(shape_err(format!(
                        "right operand {:?} must equal or be a trailing suffix of {:?}",
                        b.shape, x.shape
                    )));
                }
                Ok(vec![x.clone()])
            }
            Op::Quantize { dtype, scale } => {
                want_compute(x)?;
                if !dtype.is_quantized() {
                    return Err(KptError::dtype(name, "f8e4m3, f8e5m2 or i8 target", *dtype));
                }
                if !(scale.is_finite() && *scale > 0.0) {
                    return Err(KptError::InvalidArgument(format!(
                        "quantize scale must be finite and > 0, got {scale}"
                    )));
                }
                Ok(vec![TensorSpec::new(&x.shape, *dtype)])
            }
            Op::Dequantize { dtype } => {
                if !x.dtype.is_quantized() {
                    return Err(KptError::dtype(name, "f8e4m3, f8e5m2 or i8 input", x.dtype));
                }
                if !is_compute(*dtype) {
                    return Err(KptError::dtype(name, "a float target", *dtype));
                }
                Ok(vec![TensorSpec::new(&x.shape, *dtype)])
            }
            Op::Cast { dtype } => {
                want_compute(x)?;
                if !is_compute(*dtype) {
                    return Err(KptError::dtype(
                        name,
                        "a float target (use quantize for fp8/int8)",
                        *dtype,
                    ));
                }
                Ok(vec![TensorSpec::new(&x.shape, *dtype)])
            }
            Op::Concat { axis } => {
                let b = &inputs[1];
                same_dtype(x, b)?;
                let rank = x.shape.len();
                if *axis >= rank || b.shape.len() != rank {
                    return Err(shape_err(format!(
                        "axis {axis} invalid for shapes {:?} and {:?}",
                        x.shape, b.shape
                    )));
                }
                let mut shape = x.shape.clone();
                for d in 0..rank {
                    if d != *axis && x.shape[d] != b.shape[d] {
                        return Err(shape_err(format!(
                            "shapes {:?} and {:?} differ outside axis {axis}",
                            x.shape, b.shape
                        )));
                    }
                }
                shape[*axis] += b.shape[*axis];
                Ok(vec![TensorSpec::new(&shape, x.dtype)])
            }
            Op::Split { axis, sizes } => {
                let rank = x.shape.len();
                if *axis >= rank {
                    return Err(shape_err(format!(
                        "axis {axis} invalid for shape {:?}",
                        x.shape
                    )));
                }
                if sizes.is_empty() || sizes.iter().sum::<usize>() != x.shape[*axis] {
                    return Err(shape_err(format!(
                        "sizes {sizes:?} must be non-empty and sum to dim {axis} of {:?}",
                        x.shape
                    )));
                }
                Ok(sizes
                    .iter()
                    .map(|&n| {
                        let mut shape = x.shape.clone();
                        shape[*axis] = n;
                        TensorSpec::new(&shape, x.dtype)
                    })
                    .collect())
            }
            Op::ActAndMul { .. } => {
                want_compute(x)?;
                rank_at_least(x, 1, "x")?;
                let mut shape = x.shape.clone();
                let last = shape.len() - 1;
                if !shape[last].is_multiple_of(2) {
                    return Err(shape_err(format!(
                        "the last dim of {:?} must be even (gate and up halves)",
                        x.shape
                    )));
                }
                shape[last] /= 2;
                Ok(vec![TensorSpec::new(&shape, x.dtype)])
            }
            Op::CacheWrite => {
                let (rows, slots) = (&inputs[1], &inputs[2]);
                want_compute(x)?;
                same_dtype(x, rows)?;
                rank_at_least(x, 2, "cache")?;
                rank_at_least(rows, 1, "rows")?;
                if !slots.dtype.is_index() {
                    return Err(KptError::dtype(name, "i32 or i64 slots", slots.dtype));
                }
                let row = x.shape[x.shape.len() - 1];
                let n = match rows.shape.split_last() {
                    Some((&r, lead)) if r == row => lead.iter().product::<usize>(),
                    _ => {
                        return Err(shape_err(format!(
                            "rows {:?} must end in the cache's row size {row}",
                            rows.shape
                        )))
                    }
                };
                if slots.shape != [n] {
                    return Err(shape_err(format!(
                        "slots must be [{n}] (one per row of {:?}), got {:?}",
                        rows.shape, slots.shape
                    )));
                }
                Ok(vec![x.clone()])
            }
            Op::ArgMax => {
                want_compute(x)?;
                match x.shape.split_last() {
                    Some((&n, lead)) if n > 0 => Ok(vec![TensorSpec::new(lead, DType::I64)]),
                    _ => Err(shape_err(format!(
                        "x {:?} needs a last dim of at least one element",
                        x.shape
                    ))),
                }
            }
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Activation { act } => write!(f, "activation({})", act.name()),
            Op::LinearAct { act, .. } => write!(f, "linear_act({})", act.name()),
            Op::ActAndMul { act } => write!(f, "act_and_mul({})", act.name()),
            Op::Quantize { dtype, .. } => write!(f, "quantize({dtype})"),
            Op::Dequantize { dtype } | Op::Cast { dtype } => write!(f, "{}({dtype})", self.kind()),
            Op::Attention(p) if p.causal => f.write_str("attention(causal)"),
            Op::AttentionBackward(p) if p.causal => f.write_str("attention_backward(causal)"),
            Op::SplitRotary { cache: true, .. } => f.write_str("split_rotary(cache)"),
            _ => f.write_str(self.kind().name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(shape: &[usize], dtype: DType) -> TensorSpec {
        TensorSpec::new(shape, dtype)
    }

    #[test]
    fn dropout_thresholds_and_checks() {
        let d = |p: f32| AttentionDropout { p, seed: 0 };
        assert_eq!(d(0.0).threshold(), 0);
        assert_eq!(d(0.5).threshold(), 1 << 15);
        assert_eq!(d(0.999_999).threshold(), 65_535);
        assert!((0..64).all(|j| d(0.0).keeps(1, 2, 3, j)));
        // Key j takes half j % 2 of word (j % 8) / 2 of the call of keys 8 (j / 8) ..
        let words = d(0.0).words(1, 2, 3, 1);
        assert_eq!(AttentionDropout::random16(&words, 0), words[0] & 0xFFFF);
        assert_eq!(AttentionDropout::random16(&words, 7), words[3] >> 16);
        let t = d(0.3).threshold();
        let want: Vec<bool> = (0..8)
            .map(|k| AttentionDropout::random16(&words, k) >= t)
            .collect();
        let got: Vec<bool> = (8..16).map(|j| d(0.3).keeps(1, 2, 3, j)).collect();
        assert_eq!(got, want);
        assert!(d(0.999).validate().is_ok());
        assert!(d(1.0).validate().is_err());
        let paged = AttentionParams {
            paged: true,
            dropout: Some(d(0.1)),
            ..AttentionParams::new(2, 2, 4, false)
        };
        let specs = [
            s(&[2, 1, 8], DType::F32),
            s(&[4, 16, 8], DType::F32),
            s(&[4, 16, 8], DType::F32),
            s(&[2, 2], DType::I32),
            s(&[2], DType::I32),
        ];
        let err = Op::Attention(paged).infer(&specs).unwrap_err();
        assert!(err.to_string().contains("dropout"), "{err}");
        assert!(Op::Attention(AttentionParams {
            dropout: None,
            ..paged
        })
        .infer(&specs)
        .is_ok());
    }

    #[test]
    fn argmax_drops_the_last_dim() {
        let out = Op::ArgMax.infer(&[s(&[4, 1, 32000], DType::BF16)]).unwrap();
        assert_eq!(out, vec![s(&[4, 1], DType::I64)]);
        assert_eq!(
            Op::ArgMax.infer(&[s(&[7], DType::F32)]).unwrap(),
            vec![s(&[], DType::I64)]
        );
        for bad in [
            s(&[3, 0], DType::F32),
            s(&[], DType::F32),
            s(&[3], DType::I64),
        ] {
            assert!(
                Op::ArgMax.infer(std::slice::from_ref(&bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn embedding_takes_rows_of_any_leading_dims() {
        let out = Op::Embedding
            .infer(&[s(&[1, 3], DType::I64), s(&[1, 9, 16], DType::BF16)])
            .unwrap();
        assert_eq!(out, vec![s(&[1, 3, 16], DType::BF16)]);
        assert_eq!(
            s(&[2, 9, 16], DType::F32).rows_and_width(),
            (18, 16),
            "rows over the leading dims"
        );
        for bad in [s(&[16], DType::F32), s(&[4, 16], DType::I64)] {
            assert!(
                Op::Embedding
                    .infer(&[s(&[3], DType::I64), bad.clone()])
                    .is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn cache_write_keeps_the_cache_spec() {
        let cache = s(&[4, 16, 8], DType::BF16);
        let out = Op::CacheWrite
            .infer(&[
                cache.clone(),
                s(&[2, 1, 8], DType::BF16),
                s(&[2], DType::I64),
            ])
            .unwrap();
        assert_eq!(out, vec![cache.clone()]);
        for bad in [
            [s(&[2, 1, 8], DType::F32), s(&[2], DType::I64)],
            [s(&[2, 1, 6], DType::BF16), s(&[2], DType::I64)],
            [s(&[2, 1, 8], DType::BF16), s(&[3], DType::I64)],
            [s(&[2, 1, 8], DType::BF16), s(&[2], DType::F32)],
        ] {
            let ins = [cache.clone(), bad[0].clone(), bad[1].clone()];
            assert!(Op::CacheWrite.infer(&ins).is_err(), "{ins:?}");
        }
        assert!(Op::CacheWrite
            .infer(&[
                s(&[8], DType::F32),
                s(&[1, 8], DType::F32),
                s(&[1], DType::I32)
            ])
            .is_err());
    }

    #[test]
    fn linear_infers_and_rejects() {
        let op = Op::Linear { bias: true };
        let out = op
            .infer(&[
                s(&[2, 3, 8], DType::F32),
                s(&[5, 8], DType::BF16),
                s(&[5], DType::F32),
            ])
            .unwrap();
        assert_eq!(out, vec![s(&[2, 3, 5], DType::F32)]);
        let err = op
            .infer(&[
                s(&[2, 7], DType::F32),
                s(&[5, 8], DType::F32),
                s(&[5], DType::F32),
            ])
            .unwrap_err();
        assert!(matches!(err, KptError::Shape { .. }), "{err}");
        assert!(err.to_string().contains("7 features"));
        let err = op
            .infer(&[s(&[2, 8], DType::F32), s(&[5, 8], DType::F32)])
            .unwrap_err();
        assert!(matches!(err, KptError::Graph(_)));
        let err = op
            .infer(&[
                s(&[2, 8], DType::I32),
                s(&[5, 8], DType::F32),
                s(&[5], DType::F32),
            ])
            .unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }));
    }

    #[test]
    fn attention_checks_gqa_and_mask() {
        let p = AttentionParams {
            mask: true,
            ..AttentionParams::new(8, 2, 4, true)
        };
        let op = Op::Attention(p);
        let ok = op.infer(&[
            s(&[1, 3, 32], DType::F32),
            s(&[1, 5, 8], DType::F32),
            s(&[1, 5, 8], DType::F32),
            s(&[3, 5], DType::F32),
        ]);
        assert_eq!(ok.unwrap(), vec![s(&[1, 3, 32], DType::F32)]);
        let bad = Op::Attention(AttentionParams {
            num_kv_heads: 3,
            ..p
        })
        .infer(&[
            s(&[1, 3, 32], DType::F32),
            s(&[1, 5, 12], DType::F32),
            s(&[1, 5, 12], DType::F32),
            s(&[3, 5], DType::F32),
        ]);
        assert!(matches!(bad, Err(KptError::Shape { .. })));
    }

    #[test]
    fn varlen_attention_takes_cu_seqlens() {
        let p = AttentionParams {
            varlen: true,
            ..AttentionParams::new(4, 2, 8, true)
        };
        let op = Op::Attention(p);
        assert_eq!(op.num_inputs(), 5);
        let (q, kv) = (s(&[1, 7, 32], DType::F32), s(&[1, 9, 16], DType::F32));
        let cu = s(&[3], DType::I32);
        let out = op.infer(&[q.clone(), kv.clone(), kv.clone(), cu.clone(), cu.clone()]);
        assert_eq!(out.unwrap(), vec![q.clone()]);
        // Batch > 1, mismatched or float offsets, and a mask are errors.
        let batched = s(&[2, 7, 32], DType::F32);
        let kv2 = s(&[2, 9, 16], DType::F32);
        let err = op
            .infer(&[batched, kv2.clone(), kv2, cu.clone(), cu.clone()])
            .unwrap_err();
        assert!(err.to_string().contains("batch 1"), "{err}");
        let err = op
            .infer(&[
                q.clone(),
                kv.clone(),
                kv.clone(),
                cu.clone(),
                s(&[4], DType::I32),
            ])
            .unwrap_err();
        assert!(matches!(err, KptError::Shape { .. }), "{err}");
        let err = op
            .infer(&[
                q.clone(),
                kv.clone(),
                kv.clone(),
                cu.clone(),
                s(&[3], DType::F32),
            ])
            .unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }), "{err}");
        let both = Op::Attention(AttentionParams { mask: true, ..p });
        let err = both
            .infer(&[q, kv.clone(), kv, s(&[7, 9], DType::F32), cu.clone(), cu])
            .unwrap_err();
        assert!(matches!(err, KptError::InvalidArgument(_)), "{err}");
    }

    #[test]
    fn paged_attention_takes_block_tables() {
        let p = AttentionParams {
            paged: true,
            ..AttentionParams::new(4, 2, 8, true)
        };
        let op = Op::Attention(p);
        assert_eq!(op.num_inputs(), 5);
        let (q, cache) = (s(&[3, 1, 32], DType::F32), s(&[10, 16, 16], DType::F32));
        let (table, lens) = (s(&[3, 4], DType::I32), s(&[3], DType::I64));
        let ok = op.infer(&[
            q.clone(),
            cache.clone(),
            cache.clone(),
            table.clone(),
            lens.clone(),
        ]);
        assert_eq!(ok.unwrap(), vec![q.clone()]);
        let err = op
            .infer(&[
                q.clone(),
                cache.clone(),
                cache.clone(),
                s(&[2, 4], DType::I32),
                lens,
            ])
            .unwrap_err();
        assert!(err.to_string().contains("block_table"), "{err}");
        let err = op
            .infer(&[q, cache.clone(), cache, table, s(&[3], DType::F32)])
            .unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }), "{err}");
    }

    #[test]
    fn fp8_attention_gives_bf16() {
        let op = Op::Attention(AttentionParams::new(4, 2, 8, false));
        let (q, kv) = (s(&[2, 3, 32], DType::F8E4M3), s(&[2, 5, 16], DType::F8E4M3));
        assert_eq!(
            op.infer(&[q.clone(), kv.clone(), kv.clone()]).unwrap(),
            vec![s(&[2, 3, 32], DType::BF16)]
        );
        let err = op
            .infer(&[q.clone(), kv.clone(), s(&[2, 5, 16], DType::BF16)])
            .unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }), "{err}");
        let e5m2 = s(&[2, 5, 16], DType::F8E5M2);
        let err = op
            .infer(&[s(&[2, 3, 32], DType::F8E5M2), e5m2.clone(), e5m2])
            .unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }), "{err}");
        let backward = Op::AttentionBackward(AttentionParams::new(4, 2, 8, false));
        let bf16 = s(&[2, 3, 32], DType::BF16);
        let err = backward
            .infer(&[q, kv.clone(), kv, bf16.clone(), bf16])
            .unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }), "{err}");
    }

    #[test]
    fn attention_backward_infers_gradients_like_its_inputs() {
        let p = AttentionParams::new(4, 2, 8, true);
        let op = Op::AttentionBackward(p);
        assert_eq!(op.num_inputs(), 5);
        let (q, kv) = (s(&[2, 3, 32], DType::BF16), s(&[2, 5, 16], DType::BF16));
        let ins = [q.clone(), kv.clone(), kv.clone(), q.clone(), q.clone()];
        assert_eq!(
            op.infer(&ins).unwrap(),
            vec![q.clone(), kv.clone(), kv.clone()]
        );
        assert!(op.flops(&ins) > Op::Attention(p).flops(&ins[..3]));
        let err = op
            .infer(&[
                q.clone(),
                kv.clone(),
                kv.clone(),
                q.clone(),
                s(&[2, 3, 16], DType::BF16),
            ])
            .unwrap_err();
        assert!(err.to_string().contains("dout"), "{err}");
        let paged = Op::AttentionBackward(AttentionParams { paged: true, ..p });
        assert!(matches!(
            paged.infer(&ins),
            Err(KptError::Graph(_) | KptError::InvalidArgument(_))
        ));
        // A variable-length batch: the offsets follow dout.
        let varlen = Op::AttentionBackward(AttentionParams { varlen: true, ..p });
        assert_eq!(varlen.num_inputs(), 7);
        let (q, kv) = (s(&[1, 7, 32], DType::BF16), s(&[1, 9, 16], DType::BF16));
        let cu = s(&[3], DType::I64);
        let ins = [
            q.clone(),
            kv.clone(),
            kv.clone(),
            q.clone(),
            q.clone(),
            cu.clone(),
            cu,
        ];
        assert_eq!(varlen.infer(&ins).unwrap(), vec![q, kv.clone(), kv]);
        let masked = Op::AttentionBackward(AttentionParams {
            varlen: true,
            mask: true,
            ..p
        });
        let err = masked.infer(&[ins.to_vec(), vec![s(&[7, 9], DType::F32)]].concat());
        assert!(err.unwrap_err().to_string().contains("no mask"));
    }

    #[test]
    fn attention_lse_is_a_second_output_and_a_last_backward_input() {
        let p = AttentionParams {
            lse: true,
            mask: true,
            ..AttentionParams::new(4, 2, 8, true)
        };
        let (q, kv) = (s(&[2, 3, 32], DType::BF16), s(&[2, 5, 16], DType::BF16));
        let mask = s(&[3, 5], DType::F32);
        let lse = s(&[2, 4, 3], DType::F32);
        // f64 inputs (the reference's evaluation) give an f64 log-sum-exp.
        let q64 = s(&[2, 3, 32], DType::F64);
        let kv64 = s(&[2, 5, 16], DType::F64);
        let m64 = s(&[3, 5], DType::F64);
        assert_eq!(
            Op::Attention(p)
                .infer(&[q64.clone(), kv64.clone(), kv64, m64])
                .unwrap()[1],
            s(&[2, 4, 3], DType::F64)
        );
        let fwd = Op::Attention(p);
        assert_eq!(fwd.num_inputs(), 4);
        assert_eq!(
            fwd.infer(&[q.clone(), kv.clone(), kv.clone(), mask.clone()])
                .unwrap(),
            vec![q.clone(), lse.clone()]
        );
        let bwd = Op::AttentionBackward(p);
        assert_eq!(bwd.num_inputs(), 7);
        let ins = [
            q.clone(),
            kv.clone(),
            kv.clone(),
            q.clone(),
            q.clone(),
            mask.clone(),
            lse.clone(),
        ];
        assert_eq!(
            bwd.infer(&ins).unwrap(),
            vec![q.clone(), kv.clone(), kv.clone()]
        );
        // A log-sum-exp of the wrong shape or dtype.
        for bad in [s(&[2, 3, 4], DType::F32), s(&[2, 4, 3], DType::BF16)] {
            let mut ins = ins.clone();
            ins[6] = bad;
            let err = bwd.infer(&ins).unwrap_err();
            assert!(err.to_string().contains("lse"), "{err}");
        }
        // Without the mask the log-sum-exp is input 5.
        let nomask = Op::AttentionBackward(AttentionParams { mask: false, ..p });
        assert_eq!(nomask.num_inputs(), 6);
        let ins = [q.clone(), kv.clone(), kv.clone(), q.clone(), q.clone(), lse];
        assert!(nomask.infer(&ins).is_ok());
        // Packed, paged and FP8 forwards give none.
        let varlen = Op::Attention(AttentionParams {
            varlen: true,
            mask: false,
            ..p
        });
        let cu = s(&[2], DType::I32);
        let err = varlen
            .infer(&[
                s(&[1, 3, 32], DType::BF16),
                s(&[1, 5, 16], DType::BF16),
                s(&[1, 5, 16], DType::BF16),
                cu.clone(),
                cu,
            ])
            .unwrap_err();
        assert!(matches!(err, KptError::InvalidArgument(_)), "{err}");
        let fp8 = Op::Attention(AttentionParams { mask: false, ..p });
        let (q8, kv8) = (s(&[2, 3, 32], DType::F8E4M3), s(&[2, 5, 16], DType::F8E4M3));
        let err = fp8.infer(&[q8, kv8.clone(), kv8]).unwrap_err();
        assert!(matches!(err, KptError::InvalidArgument(_)), "{err}");
        // Old serialized params (no `lse` field) still parse, with it off.
        let json = r#"{"num_heads":4,"num_kv_heads":2,"head_dim":8,"causal":true,"scale":null,"mask":false}"#;
        let old: AttentionParams = serde_json::from_str(json).unwrap();
        assert!(!old.lse);
    }

    #[test]
    fn add_layer_norm_infers_two_outputs_and_rejects() {
        let op = Op::AddLayerNorm { eps: 1e-5 };
        let x = s(&[2, 3, 8], DType::BF16);
        let p = s(&[8], DType::BF16);
        let out = op.infer(&[x.clone(), x.clone(), p.clone(), p.clone()]);
        assert_eq!(out.unwrap(), vec![x.clone(), x.clone()]);
        let err = op
            .infer(&[x.clone(), s(&[2, 8], DType::BF16), p.clone(), p.clone()])
            .unwrap_err();
        assert!(err.to_string().contains("residual"), "{err}");
        let err = op
            .infer(&[x.clone(), x.clone(), p.clone(), s(&[7], DType::BF16)])
            .unwrap_err();
        assert!(matches!(err, KptError::Shape { .. }), "{err}");
        let err = op
            .infer(&[x.clone(), x.clone(), p.clone(), s(&[8], DType::F32)])
            .unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }), "{err}");
        let err = op.infer(&[x.clone(), x, p]).unwrap_err();
        assert!(matches!(err, KptError::Graph(_)), "{err}");
    }

    #[test]
    fn op_names_parse() {
        for k in OpKind::ALL {
            assert_eq!(k.name().parse::<OpKind>().unwrap(), k);
        }
        assert!(matches!(
            "convolution".parse::<OpKind>(),
            Err(KptError::UnknownOp(_))
        ));
    }

    #[test]
    fn concat_and_broadcast() {
        let out = Op::Concat { axis: 1 }
            .infer(&[s(&[1, 4, 8], DType::F32), s(&[1, 1, 8], DType::F32)])
            .unwrap();
        assert_eq!(out[0].shape, vec![1, 5, 8]);
        assert!(Op::Add
            .infer(&[s(&[2, 8], DType::F32), s(&[8], DType::F32)])
            .is_ok());
        assert!(Op::Add
            .infer(&[s(&[2, 8], DType::F32), s(&[2], DType::F32)])
            .is_err());
    }

    #[test]
    fn split_and_act_and_mul_infer() {
        let x = s(&[1, 3, 12], DType::BF16);
        let out = Op::Split {
            axis: 2,
            sizes: vec![8, 2, 2],
        }
        .infer(std::slice::from_ref(&x))
        .unwrap();
        let shapes: Vec<_> = out.iter().map(|o| o.shape.clone()).collect();
        assert_eq!(shapes, vec![vec![1, 3, 8], vec![1, 3, 2], vec![1, 3, 2]]);
        assert!(out.iter().all(|o| o.dtype == DType::BF16));
        for bad in [
            Op::Split {
                axis: 2,
                sizes: vec![8, 2],
            },
            Op::Split {
                axis: 3,
                sizes: vec![12],
            },
            Op::Split {
                axis: 2,
                sizes: vec![],
            },
        ] {
            let err = bad.infer(std::slice::from_ref(&x)).unwrap_err();
            assert!(matches!(err, KptError::Shape { .. }), "{err}");
        }
        let op = Op::ActAndMul {
            act: Activation::Silu,
        };
        assert_eq!(op.infer(&[x]).unwrap(), vec![s(&[1, 3, 6], DType::BF16)]);
        let err = op.infer(&[s(&[4, 7], DType::F32)]).unwrap_err();
        assert!(err.to_string().contains("even"), "{err}");
        let err = op.infer(&[s(&[4, 8], DType::I8)]).unwrap_err();
        assert!(matches!(err, KptError::DTypeMismatch { .. }), "{err}");
    }

    #[test]
    fn rotary_takes_shared_or_per_token_positions() {
        let op = Op::Rotary {
            head_dim: 4,
            theta: 10000.0,
            scaling: None,
        };
        let x = s(&[2, 3, 8], DType::BF16);
        for pos in [s(&[3], DType::I64), s(&[2, 3], DType::I32)] {
            assert_eq!(op.infer(&[x.clone(), pos]).unwrap(), vec![x.clone()]);
        }
        // Rank 2 (tokens, width) and rank 4 with matching leading dims.
        let flat = s(&[5, 8], DType::F32);
        assert!(op.infer(&[flat.clone(), s(&[5], DType::I64)]).is_ok());
        let deep = s(&[2, 2, 3, 8], DType::F32);
        assert!(op.infer(&[deep.clone(), s(&[3], DType::I64)]).is_ok());
        assert!(op.infer(&[deep, s(&[2, 2, 3], DType::I64)]).is_ok());
        for bad in [
            s(&[2], DType::I64),
            s(&[3, 2], DType::I64),
            s(&[1, 3], DType::I64),
            s(&[2, 3, 1], DType::I64),
            s(&[], DType::I64),
        ] {
            let err = op.infer(&[x.clone(), bad.clone()]).unwrap_err();
            assert!(matches!(err, KptError::Shape { .. }), "{bad}: {err}");
            assert!(err.to_string().contains("positions"), "{err}");
        }
        let err = op.infer(&[s(&[8], DType::F32), s(&[1], DType::I64)]);
        assert!(matches!(err, Err(KptError::Shape { .. })));
        let err = op.infer(&[s(&[2, 3, 6], DType::F32), s(&[3], DType::I64)]);
        assert!(matches!(err, Err(KptError::Shape { .. })));
        let err = op.infer(&[x, s(&[3], DType::F32)]);
        assert!(matches!(err, Err(KptError::DTypeMismatch { .. })));
    }

    #[test]
    fn split_rotary_infers_q_k_v() {
        let op = |sizes: Vec<usize>| Op::SplitRotary {
            head_dim: 4,
            theta: 10000.0,
            scaling: None,
            sizes,
            cache: false,
        };
        let x = s(&[2, 3, 22], DType::F16);
        let pos = s(&[2, 3], DType::I64);
        let out = op(vec![8, 4, 10]).infer(&[x.clone(), pos.clone()]).unwrap();
        assert_eq!(
            out,
            vec![
                s(&[2, 3, 8], DType::F16),
                s(&[2, 3, 4], DType::F16),
                s(&[2, 3, 10], DType::F16)
            ]
        );
        assert_eq!(op(vec![8, 4, 10]).num_inputs(), 2);
        assert_eq!(op(vec![8, 4, 10]).kind(), OpKind::SplitRotary);
        for bad in [vec![8, 4], vec![8, 4, 9], vec![6, 6, 10], vec![8, 2, 12]] {
            let err = op(bad.clone())
                .infer(&[x.clone(), pos.clone()])
                .unwrap_err();
            assert!(matches!(err, KptError::Shape { .. }), "{bad:?}: {err}");
        }
        let err = op(vec![8, 4, 10])
            .infer(&[x.clone(), s(&[3, 2], DType::I64)])
            .unwrap_err();
        assert!(err.to_string().contains("positions"), "{err}");
        let json = serde_json::to_string(&op(vec![8, 4, 10])).unwrap();
        let back: Op = serde_json::from_str(&json).unwrap();
        assert_eq!(back, op(vec![8, 4, 10]));
    }

    #[test]
    fn split_rotary_into_caches_infers_q_and_the_caches() {
        let op = Op::SplitRotary {
            head_dim: 4,
            theta: 10000.0,
            scaling: None,
            sizes: vec![8, 4, 6],
            cache: true,
        };
        let x = s(&[1, 2, 18], DType::BF16);
        let pos = s(&[2], DType::I64);
        let (kc, vc) = (s(&[3, 16, 4], DType::BF16), s(&[3, 16, 6], DType::BF16));
        let slots = s(&[2], DType::I64);
        let ins = [
            x.clone(),
            pos.clone(),
            kc.clone(),
            vc.clone(),
            slots.clone(),
        ];
        assert_eq!(op.num_inputs(), 5);
        assert_eq!(
            op.infer(&ins).unwrap(),
            vec![s(&[1, 2, 8], DType::BF16), kc.clone(), vc.clone()]
        );
        assert_eq!(op.to_string(), "split_rotary(cache)");
        // Caches whose rows are not k's and v's widths, a cache of another dtype, one
        // slot per token.
        for bad in [
            [
                x.clone(),
                pos.clone(),
                vc.clone(),
                kc.clone(),
                slots.clone(),
            ],
            [
                x.clone(),
                pos.clone(),
                s(&[3, 16, 4], DType::F32),
                vc.clone(),
                slots.clone(),
            ],
            [
                x.clone(),
                pos.clone(),
                kc.clone(),
                vc.clone(),
                s(&[1], DType::I64),
            ],
        ] {
            assert!(
                matches!(
                    op.infer(&bad),
                    Err(KptError::Shape { .. } | KptError::DTypeMismatch { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(op.infer(&ins[..2]).is_err());
        let json = serde_json::to_string(&op).unwrap();
        assert!(json.contains("\"cache\":true"), "{json}");
        assert_eq!(serde_json::from_str::<Op>(&json).unwrap(), op);
        let plain = serde_json::to_string(&op.split_rotary_with_cache(false).unwrap()).unwrap();
        assert!(!plain.contains("cache"), "{plain}");
    }
}
