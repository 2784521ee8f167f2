//! Shape descriptions shared by the reference and the fast kernels.

use kpt_core::graph::AttentionDropout;
use kpt_core::{KptError, Result};

use super::{check_len, checked_product};

/// The dimensions of a (grouped-query) attention call.
///
/// Layouts, row-major: `q` and `out` are `[batch, seq_q, num_heads * head_dim]`, `k` and
/// `v` are `[batch, seq_kv, num_kv_heads * head_dim]`, the optional additive mask is
/// `[seq_q, seq_kv]` (shared by every batch and head). Query head `h` reads kv head
/// `h / (num_heads / num_kv_heads)`. With `causal`, the mask is aligned bottom-right:
/// query `i` may attend key `j` iff `j <= i + (seq_kv - seq_q)`. With a sliding `window`
/// of `w` keys, only keys `j > i + (seq_kv - seq_q) - w` are visible (the `w` keys up to
/// the query's aligned position). A key whose additive mask is `-inf` is excluded too; a
/// query with no key left outputs zeros.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Batch size.
    pub batch: usize,
    /// Number of query positions.
    pub seq_q: usize,
    /// Number of key/value positions.
    pub seq_kv: usize,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Bottom-right aligned causal masking.
    pub causal: bool,
    /// Factor applied to `q · k` before the softmax, usually `1/√head_dim`.
    pub scale: f64,
    /// Sliding window: how many keys up to its aligned position a query sees.
    pub window: Option<usize>,
    /// Dropout of the probabilities (`apply_dropout`, `dropout_factor`).
    pub dropout: Option<ShapeDropout>,
}

/// Attention dropout as a shape carries it: the op's decisions and where the shape sits
/// in the op's call (a sequence of a variable-length batch runs as a batch of one, and
/// its decisions are those of its index in the packed batch; a check of a call's last
/// queries runs them as a shorter call).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapeDropout {
    /// The op's dropout.
    pub mask: AttentionDropout,
    /// Batch (sequence) index of batch 0 of the shape.
    pub first_batch: usize,
    /// Query index of query 0 of the shape.
    pub first_query: usize,
}

impl ShapeDropout {
    /// The random words of keys `8 group .. 8 group + 7` of the shape's query `i` of head
    /// `h` in batch `b` (positions counted in the op's call).
    fn words(&self, b: usize, h: usize, i: usize, group: usize) -> [u32; 4] {
        self.mask
            .words(self.first_batch + b, h, self.first_query + i, group)
    }

    /// Whether the shape's query `i` of head `h` in batch `b` keeps key `j`.
    fn keeps(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        self.mask
            .keeps(self.first_batch + b, h, self.first_query + i, j)
    }
}

impl AttentionShape {
    /// A shape with the usual scale `1/√head_dim` (1 when `head_dim` is 0).
    pub fn new(
        batch: usize,
        seq_q: usize,
        seq_kv: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        causal: bool,
    ) -> Self {
        Self {
            batch,
            seq_q,
            seq_kv,
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            scale: 1.0 / (head_dim.max(1) as f64).sqrt(),
            window: None,
            dropout: None,
        }
    }

    /// Multiplies `p[n * stride]`, the probability of query `i` for key `j0 + n` of head
    /// `h` in batch `b`, by its dropout factor, for every `n` the slice holds (one Philox
    /// call per eight keys); nothing without dropout.
    pub fn apply_dropout(
        &self,
        (b, h, i): (usize, usize, usize),
        j0: usize,
        p: &mut [f32],
        stride: usize,
    ) {
        let Some(d) = &self.dropout else { return };
        let (threshold, scale) = (d.mask.threshold(), d.mask.scale() as f32);
        const KEYS: usize = AttentionDropout::KEYS_PER_CALL;
        let mut words = (usize::MAX, [0u32; 4]);
        for (n, x) in p.iter_mut().step_by(stride).enumerate() {
            let j = j0 + n;
            if words.0 != j / KEYS {
                words = (j / KEYS, d.words(b, h, i, j / KEYS));
            }
            *x = if AttentionDropout::random16(&words.1, j % KEYS) >= threshold {
                *x * scale
            } else {
                0.0
            };
        }
    }

    /// The factor dropout gives the probability of query `i` for key `j` of head `h` in
    /// batch `b`: 1 without dropout, else `1 / (1 - p)` or 0.
    pub fn dropout_factor(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        match &self.dropout {
            None => 1.0,
            Some(d) if d.keeps(b, h, i, j) => d.mask.scale(),
            Some(_) => 0.0,
        }
    }

    /// The same shape with a sliding window of `window` keys.
    pub fn with_window(self, window: Option<usize>) -> Self {
        Self { window, ..self }
    }

    /// Checks that the heads group evenly, the scale is finite and no buffer size
    /// overflows.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "attention";
        if self.num_kv_heads == 0 && self.num_heads > 0 {
            return Err(KptError::shape(
                OP,
                format!("num_kv_heads is 0 but num_heads is {}", self.num_heads),
            ));
        }
        if self.num_kv_heads > 0 && !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(KptError::shape(
                OP,
                format!(
                    "num_heads {} is not a multiple of num_kv_heads {}",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        if self.window == Some(0) {
            return Err(KptError::InvalidArgument(
                "attention window must be at least 1 key".into(),
            ));
        }
        if !self.scale.is_finite() {
            return Err(KptError::InvalidArgument(format!(
                "attention scale must be finite, got {}",
                self.scale
            )));
        }
        checked_product(
            OP,
            "q size [batch, seq_q, num_heads, head_dim]",
            &[self.batch, self.seq_q, self.num_heads, self.head_dim],
        )?;
        checked_product(
            OP,
            "k/v size [batch, seq_kv, num_kv_heads, head_dim]",
            &[self.batch, self.seq_kv, self.num_kv_heads, self.head_dim],
        )?;
        checked_product(OP, "mask size [seq_q, seq_kv]", &[self.seq_q, self.seq_kv])?;
        checked_product(
            OP,
            "scores per head [seq_q, seq_kv, head_dim]",
            &[self.seq_q, self.seq_kv, self.head_dim.max(1)],
        )?;
        Ok(())
    }

    /// Elements of `q` (and of `out`): `batch * seq_q * num_heads * head_dim`.
    pub fn q_len(&self) -> usize {
        self.batch
            .saturating_mul(self.seq_q)
            .saturating_mul(self.num_heads)
            .saturating_mul(self.head_dim)
    }

    /// Elements of `k` (and of `v`): `batch * seq_kv * num_kv_heads * head_dim`.
    pub fn kv_len(&self) -> usize {
        self.batch
            .saturating_mul(self.seq_kv)
            .saturating_mul(self.num_kv_heads)
            .saturating_mul(self.head_dim)
    }

    /// Elements of the log-sum-exp of the softmax rows (`[batch, num_heads, seq_q]`).
    pub fn lse_len(&self) -> usize {
        self.batch
            .saturating_mul(self.num_heads)
            .saturating_mul(self.seq_q)
    }

    /// Checks that a log-sum-exp buffer has [`lse_len`](Self::lse_len) elements.
    pub fn check_lse(&self, op: &str, len: usize) -> Result<()> {
        check_len(op, "lse [batch, num_heads, seq_q]", len, self.lse_len())
    }

    /// Elements of the optional mask: `seq_q * seq_kv`.
    pub fn mask_len(&self) -> usize {
        self.seq_q.saturating_mul(self.seq_kv)
    }

    /// Query heads per kv head (`num_heads / num_kv_heads`; 1 when there are no heads).
    pub fn group_size(&self) -> usize {
        self.num_heads
            .checked_div(self.num_kv_heads)
            .unwrap_or(1)
            .max(1)
    }

    /// Elements of one query/output row: `num_heads * head_dim`.
    pub fn q_row(&self) -> usize {
        self.num_heads.saturating_mul(self.head_dim)
    }

    /// Elements of one key/value row: `num_kv_heads * head_dim`.
    pub fn kv_row(&self) -> usize {
        self.num_kv_heads.saturating_mul(self.head_dim)
    }

    /// How many leading keys query `i` may attend (`seq_kv` unless causal).
    pub fn key_limit(&self, i: usize) -> usize {
        if !self.causal {
            return self.seq_kv;
        }
        // j <= i + seq_kv - seq_q  <=>  j < i + 1 + seq_kv - seq_q.
        (i + 1 + self.seq_kv)
            .saturating_sub(self.seq_q)
            .min(self.seq_kv)
    }

    /// The first key query `i` may attend (0 without a sliding window; at most `seq_kv`).
    pub fn key_start(&self, i: usize) -> usize {
        self.window.map_or(0, |w| {
            // j > i + seq_kv - seq_q - w  <=>  j >= i + 1 + seq_kv - seq_q - w.
            (i + 1 + self.seq_kv)
                .saturating_sub(self.seq_q + w)
                .min(self.seq_kv)
        })
    }

    /// [`validate`](Self::validate)s the shape and checks every buffer length.
    pub fn check_buffers(
        &self,
        op: &str,
        q: usize,
        k: usize,
        v: usize,
        mask: Option<usize>,
        out: usize,
    ) -> Result<()> {
        self.validate()?;
        let (ql, kvl) = (self.q_len(), self.kv_len());
        check_len(op, "q [batch, seq_q, num_heads*head_dim]", q, ql)?;
        check_len(op, "k [batch, seq_kv, num_kv_heads*head_dim]", k, kvl)?;
        check_len(op, "v [batch, seq_kv, num_kv_heads*head_dim]", v, kvl)?;
        if let Some(m) = mask {
            check_len(op, "mask [seq_q, seq_kv]", m, self.mask_len())?;
        }
        check_len(op, "out [batch, seq_q, num_heads*head_dim]", out, ql)
    }

    /// [`check_buffers`](Self::check_buffers) for the forward operands of a backward
    /// pass, then the lengths of `dout` and `dq` (like `q`) and `dk`, `dv` (like `k`).
    #[allow(clippy::too_many_arguments)]
    pub fn check_backward_buffers(
        &self,
        op: &str,
        (q, k, v, mask, out): (usize, usize, usize, Option<usize>, usize),
        (dout, dq, dk, dv): (usize, usize, usize, usize),
    ) -> Result<()> {
        self.check_buffers(op, q, k, v, mask, out)?;
        check_len(op, "dout (like q)", dout, self.q_len())?;
        check_len(op, "dq (like q)", dq, self.q_len())?;
        check_len(op, "dk (like k)", dk, self.kv_len())?;
        check_len(op, "dv (like v)", dv, self.kv_len())
    }
}

/// The query and key rows of each sequence of a variable-length attention batch, from
/// the cumulative offsets `cu_q` and `cu_k` (`[n + 1]`: 0 first, the totals last,
/// non-decreasing). Bad offsets are an [`InvalidArgument`](KptError::InvalidArgument)
/// error naming the first bad entry.
pub fn varlen_segments(
    cu_q: &[i64],
    cu_k: &[i64],
    total_q: usize,
    total_k: usize,
) -> Result<Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>> {
    let check = |what: &str, cu: &[i64], total: usize| -> Result<Vec<usize>> {
        let bad = |msg: String| KptError::InvalidArgument(format!("attention {what}: {msg}"));
        if cu.first() != Some(&0) {
            return Err(bad(format!("must start at 0, got {:?}", cu.first())));
        }
        if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1]) {
            return Err(bad(format!(
                "decreases at entry {i} ({} after {})",
                cu[i],
                cu[i - 1]
            )));
        }
        let last = *cu.last().unwrap_or(&0);
        if last != total as i64 {
            return Err(bad(format!("ends at {last}, but there are {total} rows")));
        }
        Ok(cu.iter().map(|&x| x as usize).collect())
    };
    if cu_q.len() != cu_k.len() {
        return Err(KptError::InvalidArgument(format!(
            "attention: cu_seqlens_q has {} entries, cu_seqlens_k {}",
            cu_q.len(),
            cu_k.len()
        )));
    }
    let (q, k) = (
        check("cu_seqlens_q", cu_q, total_q)?,
        check("cu_seqlens_k", cu_k, total_k)?,
    );
    Ok(q.windows(2)
        .zip(k.windows(2))
        .map(|(q, k)| (q[0]..q[1], k[0]..k[1]))
        .collect())
}

/// Runs dense attention, `run(q, k, v, out, shape)` on one sequence at batch 1, over
/// each sequence of a variable-length batch packed as `shape` (batch 1); sequences
/// without keys output zeros.
pub fn for_each_sequence<T: Copy + Default>(
    shape: &AttentionShape,
    cu_q: &[i64],
    cu_k: &[i64],
    (q, k, v): (&[T], &[T], &[T]),
    out: &mut [T],
    mut run: impl FnMut(&[T], &[T], &[T], &mut [T], &AttentionShape) -> Result<()>,
) -> Result<()> {
    let (qr, kr) = (shape.q_row(), shape.kv_row());
    check_len("attention", "q", q.len(), shape.q_len())?;
    check_len("attention", "k", k.len(), shape.kv_len())?;
    check_len("attention", "v", v.len(), shape.kv_len())?;
    check_len("attention", "out", out.len(), shape.q_len())?;
    for (seq, (qs, ks)) in varlen_segments(cu_q, cu_k, shape.seq_q, shape.seq_kv)?
        .into_iter()
        .enumerate()
    {
        let o = &mut out[qs.start * qr..qs.end * qr];
        if ks.is_empty() {
            o.fill(T::default());
            continue;
        }
        if qs.is_empty() {
            continue;
        }
        let sub = sequence_shape(shape, seq, qs.len(), ks.len());
        let (kk, vv) = (
            &k[ks.start * kr..ks.end * kr],
            &v[ks.start * kr..ks.end * kr],
        );
        run(&q[qs.start * qr..qs.end * qr], kk, vv, o, &sub)?;
    }
    Ok(())
}

/// Sequence `seq` of a variable-length batch as a dense batch of one: `seq_q` queries,
/// `seq_kv` keys, dropout decisions drawn as batch entry `seq`.
fn sequence_shape(
    shape: &AttentionShape,
    seq: usize,
    seq_q: usize,
    seq_kv: usize,
) -> AttentionShape {
    AttentionShape {
        batch: 1,
        seq_q,
        seq_kv,
        dropout: shape.dropout.map(|d| ShapeDropout {
            first_batch: d.first_batch + seq,
            ..d
        }),
        ..*shape
    }
}

/// [`for_each_sequence`] for the backward pass: `run` gets each sequence's q, k, v, forward
/// output and its gradient, and its rows of dq, dk and dv (a sequence's keys get its own
/// queries' gradients only); queries without keys get a zero dq, keys without queries
/// zero dk and dv.
#[allow(clippy::type_complexity)]
pub fn for_each_sequence_backward<T: Copy + Default>(
    shape: &AttentionShape,
    cu_q: &[i64],
    cu_k: &[i64],
    (q, k, v, out, dout): (&[T], &[T], &[T], &[T], &[T]),
    (dq, dk, dv): (&mut [T], &mut [T], &mut [T]),
    mut run: impl FnMut(
        (&[T], &[T], &[T], &[T], &[T]),
        (&mut [T], &mut [T], &mut [T]),
        &AttentionShape,
    ) -> Result<()>,
) -> Result<()> {
    let (qr, kr) = (shape.q_row(), shape.kv_row());
    for (what, len, want) in [
        ("q", q.len(), shape.q_len()),
        ("k", k.len(), shape.kv_len()),
        ("v", v.len(), shape.kv_len()),
        ("out", out.len(), shape.q_len()),
        ("dout", dout.len(), shape.q_len()),
        ("dq", dq.len(), shape.q_len()),
        ("dk", dk.len(), shape.kv_len()),
        ("dv", dv.len(), shape.kv_len()),
    ] {
        check_len("attention_backward", what, len, want)?;
    }
    dq.fill(T::default());
    dk.fill(T::default());
    dv.fill(T::default());
    for (seq, (qs, ks)) in varlen_segments(cu_q, cu_k, shape.seq_q, shape.seq_kv)?
        .into_iter()
        .enumerate()
    {
        if qs.is_empty() || ks.is_empty() {
            continue;
        }
        let sub = sequence_shape(shape, seq, qs.len(), ks.len());
        let (qrows, krows) = (qs.start * qr..qs.end * qr, ks.start * kr..ks.end * kr);
        run(
            (
                &q[qrows.clone()],
                &k[krows.clone()],
                &v[krows.clone()],
                &out[qrows.clone()],
                &dout[qrows.clone()],
            ),
            (&mut dq[qrows], &mut dk[krows.clone()], &mut dv[krows]),
            &sub,
        )?;
    }
    Ok(())
}

/// A paged KV cache (vLLM's layout): `num_blocks` blocks of `block_size` rows each, every
/// sequence's keys listed block by block in its row of the block table.
#[derive(Debug, Clone, Copy)]
pub struct PagedKv<'a> {
    /// Rows per block.
    pub block_size: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// `[batch, max_blocks]`: the cache block of each sequence's `j / block_size`-th keys.
    pub block_table: &'a [i64],
    /// `[batch]`: keys of each sequence.
    pub seq_lens: &'a [i64],
}

impl PagedKv<'_> {
    /// The number of keys of sequence `b`, after checking it against the table's capacity
    /// and every block id it uses against the cache: an
    /// [`InvalidArgument`](KptError::InvalidArgument) error names the first bad entry.
    pub fn checked_len(&self, b: usize) -> Result<usize> {
        let bad = |msg: String| KptError::InvalidArgument(format!("paged attention: {msg}"));
        let max_blocks = self.max_blocks();
        let len = self.seq_lens[b];
        let capacity = max_blocks * self.block_size;
        if len < 0 || len as usize > capacity {
            return Err(bad(format!(
                "seq_lens[{b}] = {len} is outside 0..={capacity} ({max_blocks} blocks of {})",
                self.block_size
            )));
        }
        let used = (len as usize).div_ceil(self.block_size.max(1));
        let row = &self.block_table[b * max_blocks..b * max_blocks + used];
        if let Some((i, id)) = row
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= self.num_blocks)
        {
            return Err(bad(format!(
                "block_table[{b}][{i}] = {id} is not one of the {} cache blocks",
                self.num_blocks
            )));
        }
        Ok(len as usize)
    }

    /// Block-table entries per sequence.
    pub fn max_blocks(&self) -> usize {
        self.block_table
            .len()
            .checked_div(self.seq_lens.len())
            .unwrap_or(0)
    }

    /// The first cache row of sequence `b`'s `len` keys when its blocks follow each
    /// other in the cache (one block per sequence, say), so that its keys are one run of
    /// rows; `None` otherwise. Block ids must have been checked.
    pub fn contiguous_start(&self, b: usize, len: usize) -> Option<usize> {
        let max_blocks = self.max_blocks();
        let used = len.div_ceil(self.block_size.max(1));
        let ids = &self.block_table[b * max_blocks..b * max_blocks + used];
        let first = *ids.first()?;
        ids.iter()
            .zip(first..)
            .all(|(&id, want)| id == want)
            .then_some(first as usize * self.block_size)
    }

    /// Copies the rows (of `row` elements) of sequence `b` out of `cache` into `dst`
    /// (cleared first), a block's run of rows at a time, after [`checked_len`](Self::checked_len).
    pub fn gather<T: Copy>(
        &self,
        cache: &[T],
        row: usize,
        b: usize,
        dst: &mut Vec<T>,
    ) -> Result<()> {
        let len = self.checked_len(b)?;
        let max_blocks = self.max_blocks();
        dst.clear();
        let mut j = 0;
        while j < len {
            let block = self.block_table[b * max_blocks + j / self.block_size] as usize;
            let slot = j % self.block_size;
            let n = (self.block_size - slot).min(len - j);
            let start = (block * self.block_size + slot) * row;
            dst.extend_from_slice(&cache[start..start + n * row]);
            j += n;
        }
        Ok(())
    }
}

/// Runs dense attention, `run(q, k, v, out, shape)` on one sequence at batch 1, over each
/// sequence of a batch whose keys and values live in a paged cache: `shape` gives the
/// batch, queries per sequence and heads (its `seq_kv` is ignored); each sequence's keys
/// are read in place when its blocks follow each other in the cache, else gathered into
/// contiguous rows first.
pub fn for_each_paged_sequence<T: Copy + Default>(
    shape: &AttentionShape,
    paged: &PagedKv<'_>,
    (q, k_cache, v_cache): (&[T], &[T], &[T]),
    out: &mut [T],
    mut run: impl FnMut(&[T], &[T], &[T], &mut [T], &AttentionShape) -> Result<()>,
) -> Result<()> {
    let (qr, kr) = (shape.q_row(), shape.kv_row());
    let per_seq = shape.seq_q * qr;
    let cache_len = paged.num_blocks * paged.block_size * kr;
    check_len("paged attention", "q", q.len(), shape.batch * per_seq)?;
    check_len("paged attention", "out", out.len(), shape.batch * per_seq)?;
    check_len("paged attention", "k cache", k_cache.len(), cache_len)?;
    check_len("paged attention", "v cache", v_cache.len(), cache_len)?;
    check_len(
        "paged attention",
        "seq_lens",
        paged.seq_lens.len(),
        shape.batch,
    )?;
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for b in 0..shape.batch {
        let len = paged.checked_len(b)?;
        let (ks, vs) = match paged.contiguous_start(b, len) {
            Some(first) => {
                let rows = first * kr..(first + len) * kr;
                (&k_cache[rows.clone()], &v_cache[rows])
            }
            None => {
                paged.gather(k_cache, kr, b, &mut k)?;
                paged.gather(v_cache, kr, b, &mut v)?;
                (&k[..], &v[..])
            }
        };
        let sub = AttentionShape {
            batch: 1,
            seq_kv: len,
            ..*shape
        };
        let o = &mut out[b * per_seq..(b + 1) * per_seq];
        if len == 0 {
            o.fill(T::default());
            continue;
        }
        run(&q[b * per_seq..(b + 1) * per_seq], ks, vs, o, &sub)?;
    }
    Ok(())
}
