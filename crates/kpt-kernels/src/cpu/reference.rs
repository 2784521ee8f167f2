//! f64 reference implementations: naive loops, written to be obviously correct.
//!
//! Tensors are row-major contiguous `&[f64]` slices; the argument conventions are those
//! of the fast kernels (see each function). Every length is validated first.

// Index loops are the point here: they mirror the math.
#![allow(clippy::needless_range_loop)]

use kpt_core::graph::{rope_frequencies, rope_seq_len, RopeScaling};
use kpt_core::{DType, KptError, Result};

use super::shapes::AttentionShape;
use super::{check_add_norm, check_len, check_linear, check_rows, checked_product, Act};

/// `out[m,n] = a[m,k] · b[k,n]`.
pub fn matmul(a: &[f64], b: &[f64], out: &mut [f64], m: usize, k: usize, n: usize) -> Result<()> {
    const OP: &str = "matmul";
    check_len(
        OP,
        "a [m, k]",
        a.len(),
        checked_product(OP, "[m, k]", &[m, k])?,
    )?;
    check_len(
        OP,
        "b [k, n]",
        b.len(),
        checked_product(OP, "[k, n]", &[k, n])?,
    )?;
    check_len(
        OP,
        "out [m, n]",
        out.len(),
        checked_product(OP, "[m, n]", &[m, n])?,
    )?;
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0;
            for p in 0..k {
                s += a[i * k + p] * b[p * n + j];
            }
            out[i * n + j] = s;
        }
    }
    Ok(())
}

/// `out[m,n] = x[m,k] · w[n,k]ᵀ + bias[n]` (PyTorch `Linear` weight layout).
pub fn linear(
    x: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    out: &mut [f64],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    linear_act(x, w, bias, None, out, m, k, n)
}

/// [`linear`] followed by the activation `act` (if any).
#[allow(clippy::too_many_arguments)]
pub fn linear_act(
    x: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    act: Option<Act>,
    out: &mut [f64],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "linear";
    check_linear(
        OP,
        x.len(),
        w.len(),
        bias.map(<[f64]>::len),
        out.len(),
        m,
        k,
        n,
    )?;
    for i in 0..m {
        for j in 0..n {
            let mut s = bias.map_or(0.0, |b| b[j]);
            for p in 0..k {
                s += x[i * k + p] * w[j * k + p];
            }
            out[i * n + j] = act.map_or(s, |a| a.apply_f64(s));
        }
    }
    Ok(())
}

/// `out[i] = act(x[i])`.
pub fn activation(x: &[f64], out: &mut [f64], act: Act) -> Result<()> {
    check_len("activation", "out", out.len(), x.len())?;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = act.apply_f64(v);
    }
    Ok(())
}

/// Gated activation over rows of `2 * n`: `out[r, c] = act(x[r, c]) * x[r, n + c]`.
pub fn act_and_mul(x: &[f64], out: &mut [f64], n: usize, act: Act) -> Result<()> {
    let rows = out.len().checked_div(n).unwrap_or(0);
    check_len("act_and_mul", "out [rows, n]", out.len(), rows * n)?;
    check_len("act_and_mul", "x [rows, 2n]", x.len(), rows * 2 * n)?;
    for (o, row) in out.chunks_exact_mut(n).zip(x.chunks_exact(2 * n)) {
        let (gate, up) = row.split_at(n);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = act.apply_f64(g) * u;
        }
    }
    Ok(())
}

/// RMS norm over the last axis: `y = x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(
    x: &[f64],
    w: &[f64],
    out: &mut [f64],
    rows: usize,
    dim: usize,
    eps: f64,
) -> Result<()> {
    check_rows(
        "rms_norm",
        &[("x [rows, dim]", x.len()), ("out [rows, dim]", out.len())],
        &[("w [dim]", w.len())],
        rows,
        dim,
    )?;
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for c in 0..dim {
            out[r * dim + c] = row[c] * inv * w[c];
        }
    }
    Ok(())
}

/// Layer norm over the last axis: `y = (x - mean) / sqrt(var + eps) * w + b` (biased var).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    x: &[f64],
    w: &[f64],
    b: &[f64],
    out: &mut [f64],
    rows: usize,
    dim: usize,
    eps: f64,
) -> Result<()> {
    check_rows(
        "layer_norm",
        &[("x [rows, dim]", x.len()), ("out [rows, dim]", out.len())],
        &[("w [dim]", w.len()), ("b [dim]", b.len())],
        rows,
        dim,
    )?;
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let mean = row.iter().sum::<f64>() / dim as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for c in 0..dim {
            out[r * dim + c] = (row[c] - mean) * inv * w[c] + b[c];
        }
    }
    Ok(())
}

/// `sum_out = x + residual`, `norm_out = rms_norm(sum_out)`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    x: &[f64],
    residual: &[f64],
    w: &[f64],
    sum_out: &mut [f64],
    norm_out: &mut [f64],
    rows: usize,
    dim: usize,
    eps: f64,
) -> Result<()> {
    check_add_norm(
        "add_rms_norm",
        [x.len(), residual.len(), sum_out.len(), norm_out.len()],
        &[("w [dim]", w.len())],
        rows,
        dim,
    )?;
    for (s, (a, r)) in sum_out.iter_mut().zip(x.iter().zip(residual)) {
        *s = a + r;
    }
    rms_norm(sum_out, w, norm_out, rows, dim, eps)
}

/// `sum_out = x + residual`, `norm_out = layer_norm(sum_out)`.
#[allow(clippy::too_many_arguments)]
pub fn add_layer_norm(
    x: &[f64],
    residual: &[f64],
    w: &[f64],
    b: &[f64],
    sum_out: &mut [f64],
    norm_out: &mut [f64],
    rows: usize,
    dim: usize,
    eps: f64,
) -> Result<()> {
    check_add_norm(
        "add_layer_norm",
        [x.len(), residual.len(), sum_out.len(), norm_out.len()],
        &[("w [dim]", w.len()), ("b [dim]", b.len())],
        rows,
        dim,
    )?;
    for (s, (a, r)) in sum_out.iter_mut().zip(x.iter().zip(residual)) {
        *s = a + r;
    }
    layer_norm(sum_out, w, b, norm_out, rows, dim, eps)
}

/// Checks the positions of rotary embeddings over `batch × seq` tokens: `[seq]` (shared
/// by every sequence) or `[batch, seq]` (one per token).
fn check_positions(op: &str, positions: usize, batch: usize, seq: usize) -> Result<()> {
    if positions == seq || Some(positions) == batch.checked_mul(seq) {
        return Ok(());
    }
    Err(KptError::shape(
        op,
        format!(
            "positions must have {seq} ([seq]) or {} ([batch, seq]) entries, got {positions}",
            batch.saturating_mul(seq)
        ),
    ))
}

/// Checks the arguments of rotary embeddings (shared with the fast kernel).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_rotary(
    x: usize,
    positions: usize,
    out: usize,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "rotary";
    if !head_dim.is_multiple_of(2) {
        return Err(KptError::shape(
            OP,
            format!("head_dim must be even, got {head_dim}"),
        ));
    }
    let total = checked_product(
        OP,
        "[batch, seq, heads, head_dim]",
        &[batch, seq, heads, head_dim],
    )?;
    check_len(OP, "x [batch, seq, heads*head_dim]", x, total)?;
    check_positions(OP, positions, batch, seq)?;
    check_len(OP, "out [batch, seq, heads*head_dim]", out, total)
}

/// Checks the arguments of the fused split + rotary (shared with the fast kernel):
/// `qkv [batch, seq, q + k + v]` and outputs `[batch, seq, width]` for the widths of
/// `sizes`, `head_dim` even and dividing q and k.
pub(crate) fn check_split_rotary(
    qkv: usize,
    positions: usize,
    outs: [usize; 3],
    batch: usize,
    seq: usize,
    sizes: [usize; 3],
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "split_rotary";
    if head_dim == 0
        || !head_dim.is_multiple_of(2)
        || !sizes[0].is_multiple_of(head_dim)
        || !sizes[1].is_multiple_of(head_dim)
    {
        return Err(KptError::shape(
            OP,
            format!(
                "head_dim {head_dim} must be even, non-zero and divide the q and k widths \
                 {} and {}",
                sizes[0], sizes[1]
            ),
        ));
    }
    let width = sizes
        .iter()
        .try_fold(0usize, |a, &w| a.checked_add(w))
        .ok_or_else(|| KptError::shape(OP, format!("sizes {sizes:?} overflow")))?;
    let total = checked_product(OP, "[batch, seq, q+k+v]", &[batch, seq, width])?;
    check_len(OP, "qkv [batch, seq, q+k+v]", qkv, total)?;
    check_positions(OP, positions, batch, seq)?;
    for ((len, w), what) in outs.into_iter().zip(sizes).zip(["q", "k", "v"]) {
        let want = checked_product(OP, "[batch, seq, width]", &[batch, seq, w])?;
        check_len(OP, &format!("{what} [batch, seq, {w}]"), len, want)?;
    }
    Ok(())
}

/// Rotary position embedding, NeoX / LLaMA "rotate half" layout.
///
/// `x` is `[batch, seq, heads * head_dim]`, `positions` is `[seq]` (the same for every
/// batch) or `[batch, seq]` (one per token). With `inv_freq` and `attention_factor` from
/// [`rope_frequencies`]`(head_dim, theta, scaling, rope_seq_len(positions))`, for
/// `i < head_dim/2`, `angle = pos * inv_freq[i]`, `cos` and `sin` of it times the
/// attention factor: `out[i] = x[i] cos - x[i + h/2] sin`,
/// `out[i + h/2] = x[i + h/2] cos + x[i] sin`.
#[allow(clippy::too_many_arguments)]
pub fn rotary(
    x: &[f64],
    positions: &[i64],
    out: &mut [f64],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
) -> Result<()> {
    check_rotary(
        x.len(),
        positions.len(),
        out.len(),
        batch,
        seq,
        heads,
        head_dim,
    )?;
    if x.is_empty() {
        return Ok(());
    }
    let table = rope_frequencies(head_dim, theta, scaling, rope_seq_len(positions))?;
    let half = head_dim / 2;
    let per_token = positions.len() != seq;
    for b in 0..batch {
        for s in 0..seq {
            let pos = if per_token {
                positions[b * seq + s]
            } else {
                positions[s]
            };
            for h in 0..heads {
                let base = ((b * seq + s) * heads + h) * head_dim;
                for (i, &freq) in table.inv_freq.iter().enumerate() {
                    let angle = pos as f64 * freq;
                    let (sin, cos) = angle.sin_cos();
                    let (cos, sin) = (cos * table.attention_factor, sin * table.attention_factor);
                    let (x0, x1) = (x[base + i], x[base + i + half]);
                    out[base + i] = x0 * cos - x1 * sin;
                    out[base + i + half] = x1 * cos + x0 * sin;
                }
            }
        }
    }
    Ok(())
}

/// Index of the largest element of each row of `x [rows, dim]` into `out [rows]`: the
/// lowest index on ties, -1 for a row that holds a NaN.
pub fn argmax(x: &[f64], out: &mut [f64], rows: usize, dim: usize) -> Result<()> {
    check_rows("argmax", &[("x [rows, dim]", x.len())], &[], rows, dim)?;
    check_len("argmax", "out [rows]", out.len(), rows)?;
    for (r, o) in out.iter_mut().enumerate() {
        let row = &x[r * dim..(r + 1) * dim];
        *o = if row.iter().any(|v| v.is_nan()) {
            -1.0
        } else {
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] {
                    best = i;
                }
            }
            best as f64
        };
    }
    Ok(())
}

/// The fused split + rotary, written as what it replaces: `qkv [batch, seq, q + k + v]`
/// (`sizes = [q, k, v]`) is split along its last axis into q, k and v, then q and k go
/// through [`rotary`] at `positions` (`[seq]` or `[batch, seq]`); v is the plain part.
#[allow(clippy::too_many_arguments)]
pub fn split_rotary(
    qkv: &[f64],
    positions: &[i64],
    (q, k, v): (&mut [f64], &mut [f64], &mut [f64]),
    batch: usize,
    seq: usize,
    sizes: [usize; 3],
    head_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
) -> Result<()> {
    check_split_rotary(
        qkv.len(),
        positions.len(),
        [q.len(), k.len(), v.len()],
        batch,
        seq,
        sizes,
        head_dim,
    )?;
    let [wq, wk, wv] = sizes;
    let width = wq + wk + wv;
    let (mut q_in, mut k_in) = (vec![0.0; q.len()], vec![0.0; k.len()]);
    for t in 0..batch * seq {
        let row = &qkv[t * width..(t + 1) * width];
        q_in[t * wq..(t + 1) * wq].copy_from_slice(&row[..wq]);
        k_in[t * wk..(t + 1) * wk].copy_from_slice(&row[wq..wq + wk]);
        v[t * wv..(t + 1) * wv].copy_from_slice(&row[wq + wk..]);
    }
    let (hq, hk) = (wq / head_dim, wk / head_dim);
    rotary(
        &q_in, positions, q, batch, seq, hq, head_dim, theta, scaling,
    )?;
    rotary(
        &k_in, positions, k, batch, seq, hk, head_dim, theta, scaling,
    )
}

/// Softmax over the last axis of `x [rows, dim]`, subtracting the row max first. A row
/// whose entries are all `-inf` gives zeros.
pub fn softmax(x: &[f64], out: &mut [f64], rows: usize, dim: usize) -> Result<()> {
    check_rows(
        "softmax",
        &[("x [rows, dim]", x.len()), ("out [rows, dim]", out.len())],
        &[],
        rows,
        dim,
    )?;
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let o = &mut out[r * dim..(r + 1) * dim];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            o.fill(0.0);
            continue;
        }
        let mut sum = 0.0;
        for (oi, &v) in o.iter_mut().zip(row) {
            *oi = (v - max).exp();
            sum += *oi;
        }
        for oi in o.iter_mut() {
            *oi /= sum;
        }
    }
    Ok(())
}

/// The scaled, masked scores of query `i` of head `h` in batch `b` over every key (`-inf`
/// for keys it does not see) and their maximum (`-inf` when it sees none).
fn row_scores(
    (q, k, mask): (&[f64], &[f64], Option<&[f64]>),
    s: &AttentionShape,
    (b, h, i): (usize, usize, usize),
    scores: &mut [f64],
) -> f64 {
    let d = s.head_dim;
    let g = h / s.group_size();
    let qi = &q[(b * s.seq_q + i) * s.q_row() + h * d..][..d];
    let (start, limit) = (s.key_start(i), s.key_limit(i));
    let mut max = f64::NEG_INFINITY;
    for (j, sc) in scores.iter_mut().enumerate() {
        *sc = f64::NEG_INFINITY;
        if j < start || j >= limit {
            continue;
        }
        let kj = &k[(b * s.seq_kv + j) * s.kv_row() + g * d..][..d];
        let dot: f64 = qi.iter().zip(kj).map(|(a, c)| a * c).sum();
        *sc = dot * s.scale + mask.map_or(0.0, |m| m[i * s.seq_kv + j]);
        max = max.max(*sc);
    }
    max
}

/// The softmax probabilities of query `i` of head `h` in batch `b` over every key (0 for
/// keys it does not see) and the row's log-sum-exp, or `None` (all zeros) when it sees no
/// key.
fn row_probs(
    ops: (&[f64], &[f64], Option<&[f64]>),
    s: &AttentionShape,
    at: (usize, usize, usize),
    probs: &mut [f64],
) -> Option<f64> {
    let max = row_scores(ops, s, at, probs);
    if max == f64::NEG_INFINITY {
        probs.fill(0.0);
        return None;
    }
    let mut sum = 0.0;
    for p in probs.iter_mut() {
        *p = if *p == f64::NEG_INFINITY {
            0.0
        } else {
            (*p - max).exp()
        };
        sum += *p;
    }
    probs.iter_mut().for_each(|p| *p /= sum);
    Some(max + sum.ln())
}

/// The probabilities `exp(s - lse)` of query `i` of head `h` in batch `b` from the given
/// log-sum-exp of its row (0 for keys it does not see, and everywhere when `lse` is
/// `+inf`); `false` when they are all 0.
fn row_probs_from_lse(
    ops: (&[f64], &[f64], Option<&[f64]>),
    s: &AttentionShape,
    at: (usize, usize, usize),
    lse: f64,
    probs: &mut [f64],
) -> bool {
    let max = row_scores(ops, s, at, probs);
    if max == f64::NEG_INFINITY || lse == f64::INFINITY {
        probs.fill(0.0);
        return false;
    }
    for p in probs.iter_mut() {
        *p = if *p == f64::NEG_INFINITY {
            0.0
        } else {
            (*p - lse).exp()
        };
    }
    true
}

/// Scaled dot-product attention with GQA, optional additive mask and bottom-right causal
/// masking; see [`AttentionShape`] for layouts and semantics.
pub fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: Option<&[f64]>,
    out: &mut [f64],
    shape: &AttentionShape,
) -> Result<()> {
    attention_lse(q, k, v, mask, out, None, shape)
}

/// [`attention`] that also gives each softmax row's log-sum-exp in `lse`
/// (`[batch, num_heads, seq_q]`, natural log, `+inf` for a row that sees no key) when
/// given.
pub fn attention_lse(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: Option<&[f64]>,
    out: &mut [f64],
    mut lse: Option<&mut [f64]>,
    shape: &AttentionShape,
) -> Result<()> {
    shape.check_buffers(
        "attention",
        q.len(),
        k.len(),
        v.len(),
        mask.map(<[f64]>::len),
        out.len(),
    )?;
    if let Some(l) = lse.as_deref() {
        shape.check_lse("attention", l.len())?;
    }
    let s = *shape;
    let d = s.head_dim;
    let mut probs = vec![0.0; s.seq_kv];
    for b in 0..s.batch {
        for h in 0..s.num_heads {
            let g = h / s.group_size();
            for i in 0..s.seq_q {
                let o = &mut out[(b * s.seq_q + i) * s.q_row() + h * d..][..d];
                o.fill(0.0);
                let row_lse = row_probs((q, k, mask), &s, (b, h, i), &mut probs);
                if let Some(l) = lse.as_deref_mut() {
                    l[(b * s.num_heads + h) * s.seq_q + i] = row_lse.unwrap_or(f64::INFINITY);
                }
                if row_lse.is_none() {
                    continue;
                }
                for (j, &p) in probs.iter().enumerate().filter(|(_, &p)| p != 0.0) {
                    let p = p * s.dropout_factor(b, h, i, j);
                    let vj = &v[(b * s.seq_kv + j) * s.kv_row() + g * d..][..d];
                    o.iter_mut().zip(vj).for_each(|(oc, vc)| *oc += p * vc);
                }
            }
        }
    }
    Ok(())
}

/// Gradients of [`attention`] for the upstream gradient `dout` (FlashAttention's backward
/// contract): with `P` the probabilities recomputed from `q`, `k` and the mask (as
/// `exp(s - lse)` from the forward's log-sum-exp when `lse` is given, see
/// [`attention_lse`]), `Z` the dropout factors (1 without dropout) and `D_i = dout_i ·
/// out_i` from the given forward output, `dv = (P ∘ Z)ᵀ dout`, `dS = P ∘ (Z ∘ (dout vᵀ) -
/// D)`, `dq = scale · dS k`, `dk = scale · dSᵀ q`; the query heads of a kv group add into
/// its `dk` and `dv`.
#[allow(clippy::type_complexity)]
pub fn attention_backward(
    (q, k, v, mask): (&[f64], &[f64], &[f64], Option<&[f64]>),
    (out, dout, lse): (&[f64], &[f64], Option<&[f64]>),
    (dq, dk, dv): (&mut [f64], &mut [f64], &mut [f64]),
    shape: &AttentionShape,
) -> Result<()> {
    let s = *shape;
    s.check_backward_buffers(
        "attention_backward",
        (q.len(), k.len(), v.len(), mask.map(<[f64]>::len), out.len()),
        (dout.len(), dq.len(), dk.len(), dv.len()),
    )?;
    if let Some(l) = lse {
        s.check_lse("attention_backward", l.len())?;
    }
    let d = s.head_dim;
    let (q_row, kv_row) = (s.q_row(), s.kv_row());
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    let mut probs = vec![0.0; s.seq_kv];
    for b in 0..s.batch {
        for h in 0..s.num_heads {
            let g = h / s.group_size();
            for i in 0..s.seq_q {
                let at = (b, h, i);
                let seen = match lse {
                    Some(l) => {
                        let row = l[(b * s.num_heads + h) * s.seq_q + i];
                        row_probs_from_lse((q, k, mask), &s, at, row, &mut probs)
                    }
                    None => row_probs((q, k, mask), &s, at, &mut probs).is_some(),
                };
                if !seen {
                    continue;
                }
                let at_q = (b * s.seq_q + i) * q_row + h * d;
                let (qi, oi, doi) = (&q[at_q..][..d], &out[at_q..][..d], &dout[at_q..][..d]);
                let delta: f64 = doi.iter().zip(oi).map(|(a, c)| a * c).sum();
                for (j, &p) in probs.iter().enumerate().filter(|(_, &p)| p != 0.0) {
                    let at_k = (b * s.seq_kv + j) * kv_row + g * d;
                    // Dropout: out = Σ P Z v, so dv takes P Z and dP = Z (dout · v).
                    let z = s.dropout_factor(b, h, i, j);
                    let dp: f64 = z * doi
                        .iter()
                        .zip(&v[at_k..][..d])
                        .map(|(a, c)| a * c)
                        .sum::<f64>();
                    let ds = p * (dp - delta) * s.scale;
                    for c in 0..d {
                        dv[at_k + c] += p * z * doi[c];
                        dq[at_q + c] += ds * k[at_k + c];
                        dk[at_k + c] += ds * qi[c];
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks embedding arguments and ids (shared with the fast kernel).
pub(crate) fn check_embedding(
    ids: &[i64],
    table: usize,
    out: usize,
    vocab: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "embedding";
    check_len(
        OP,
        "table [vocab, dim]",
        table,
        checked_product(OP, "[vocab, dim]", &[vocab, dim])?,
    )?;
    check_len(
        OP,
        "out [ids, dim]",
        out,
        checked_product(OP, "[ids, dim]", &[ids.len(), dim])?,
    )?;
    if let Some((pos, id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as u64 >= vocab as u64)
    {
        return Err(KptError::InvalidArgument(format!(
            "embedding: id {id} at position {pos} is out of range for vocab size {vocab}"
        )));
    }
    Ok(())
}

/// Row lookup: `out[i, :] = table[ids[i], :]`; an id outside `0..vocab` is an error.
pub fn embedding(
    ids: &[i64],
    table: &[f64],
    out: &mut [f64],
    vocab: usize,
    dim: usize,
) -> Result<()> {
    check_embedding(ids, table.len(), out.len(), vocab, dim)?;
    for (i, &id) in ids.iter().enumerate() {
        let id = id as usize;
        out[i * dim..(i + 1) * dim].copy_from_slice(&table[id * dim..(id + 1) * dim]);
    }
    Ok(())
}

/// Checks a broadcasting binary op: `b.len()` divides `a.len()`, `out` matches `a`.
pub(crate) fn check_broadcast(op: &str, a: usize, b: usize, out: usize) -> Result<()> {
    if (b == 0 && a != 0) || (b != 0 && !a.is_multiple_of(b)) {
        return Err(KptError::shape(
            op,
            format!(
                "b has {b} elements, which must divide a's {a} \
                 (b broadcasts over a's leading rows)"
            ),
        ));
    }
    check_len(op, "out", out, a)
}

/// `out = a + b`, `b` repeated over the leading rows of `a` (`a.len() % b.len() == 0`).
pub fn add(a: &[f64], b: &[f64], out: &mut [f64]) -> Result<()> {
    check_broadcast("add", a.len(), b.len(), out.len())?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = a[i] + b[i % b.len()];
    }
    Ok(())
}

/// `out = a * b`, `b` repeated over the leading rows of `a` (`a.len() % b.len() == 0`).
pub fn mul(a: &[f64], b: &[f64], out: &mut [f64]) -> Result<()> {
    check_broadcast("mul", a.len(), b.len(), out.len())?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = a[i] * b[i % b.len()];
    }
    Ok(())
}

/// Checks a quantization scale: finite and positive.
pub(crate) fn check_scale(op: &str, scale: f64) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(KptError::InvalidArgument(format!(
            "{op}: scale must be finite and > 0, got {scale}"
        )))
    }
}

/// `v` rounded to f32 with round-to-odd: an inexact result gets an odd last mantissa bit.
///
/// Rounding that value once more to any format with at least two fewer mantissa bits
/// (f16, bf16, FP8, int8 range) gives the correctly rounded result of `v` itself, which
/// converting through a plain `v as f32` (double rounding) or `half`'s `from_f64`
/// (truncates the low 32 bits first) does not always.
pub fn f64_to_f32_round_odd(v: f64) -> f32 {
    let r = v as f32;
    if !r.is_finite() || r as f64 == v || r.to_bits() & 1 == 1 {
        return r;
    }
    // Inexact with an even last bit: step one ulp towards `v` (same sign as `r`).
    let bits = r.to_bits();
    if v.abs() > (r as f64).abs() {
        f32::from_bits(bits + 1)
    } else {
        f32::from_bits(bits - 1)
    }
}

/// Rounds `x / scale` to the grid of `dtype` and writes the stored values (not scaled
/// back): round to nearest, ties to even, computed exactly from the f64 quotient
/// (through [`f64_to_f32_round_odd`]); FP8 and int8 saturate like the `kpt_core::dtype`
/// conversions, which do the final rounding. Dequantize with [`dequantize`].
pub fn quantize(x: &[f64], dtype: DType, scale: f64, out: &mut [f64]) -> Result<()> {
    const OP: &str = "quantize";
    check_scale(OP, scale)?;
    check_len(OP, "out", out.len(), x.len())?;
    let round: fn(f64) -> f64 = match dtype {
        DType::F32 => |v| v as f32 as f64,
        DType::F16 => |v| half::f16::from_f32(f64_to_f32_round_odd(v)).to_f64(),
        DType::BF16 => |v| half::bf16::from_f32(f64_to_f32_round_odd(v)).to_f64(),
        DType::F8E4M3 => |v| {
            kpt_core::dtype::f8e4m3_to_f32(kpt_core::dtype::f32_to_f8e4m3(f64_to_f32_round_odd(v)))
                as f64
        },
        DType::F8E5M2 => |v| {
            kpt_core::dtype::f8e5m2_to_f32(kpt_core::dtype::f32_to_f8e5m2(f64_to_f32_round_odd(v)))
                as f64
        },
        DType::I8 => |v| kpt_core::dtype::f32_to_i8(f64_to_f32_round_odd(v)) as f64,
        other => {
            return Err(KptError::dtype(
                OP,
                "f32, f16, bf16, f8e4m3, f8e5m2 or i8",
                other,
            ))
        }
    };
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round(v / scale);
    }
    Ok(())
}

/// `out = stored * scale`.
pub fn dequantize(stored: &[f64], scale: f64, out: &mut [f64]) -> Result<()> {
    check_len("dequantize", "out", out.len(), stored.len())?;
    for (o, &v) in out.iter_mut().zip(stored) {
        *o = v * scale;
    }
    Ok(())
}
