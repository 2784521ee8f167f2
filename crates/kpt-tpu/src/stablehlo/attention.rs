//! Attention in StableHLO, with the semantics of kpt's reference: the dense forward pass
//! (causal, sliding window, additive mask, GQA, optional log-sum-exp output), packed
//! variable-length sequences (`cu_seqlens`), paged KV caches (block tables) and the
//! backward pass.
//!
//! Every variant is one computation over a dense `[B, Hkv, G, S, T]` score tensor:
//! queries as `[B, Hkv, G, S, D]` (query head `h` is kv head `h / G`, member `h % G`),
//! keys and values as `[B, Hkv, T, D]`, so each kv head meets its group without being
//! copied. What a query sees is a boolean "visible" tensor built from iotas (and, for
//! packed or paged batches, from the index inputs), broadcast over the heads.
//!
//! Products read q, k, v (and the gradients) in their own dtype with f32 accumulation:
//! 16-bit operands run on the matrix units and their products are exact in f32. As flash
//! attention kernels do, the probabilities (and in the backward pass `dS`) are rounded to
//! that dtype before the products that read them.

use kpt_core::graph::AttentionParams;
use kpt_core::rand::{PHILOX_KEY_STEP, PHILOX_MULTIPLIERS};
use kpt_core::{DType, Result};

use super::builder::{Builder, Cmp, Reduce, Val};
use super::lower::compute;

/// Which keys each query row sees: boolean `[S, T]` shared by the batch, or `[B, S, T]`.
struct Visible {
    mask: Val,
    per_batch: bool,
}

/// Where each score of a packed (variable-length) batch sits for dropout: its sequence,
/// and the query and key positions within it, i64 `[S, T]`.
struct Positions {
    seq: Val,
    i: Val,
    j: Val,
}

/// The dtypes of one attention: the output's, the arithmetic's and the products' operands.
#[derive(Clone, Copy)]
struct Types {
    out: DType,
    compute: DType,
    operand: DType,
}

impl Types {
    fn of(q: &Val, k: &Val, v: &Val) -> Types {
        let out = q.float();
        let compute = compute(out);
        let operand = if k.dtype == q.dtype && v.dtype == q.dtype {
            out
        } else {
            compute
        };
        Types {
            out,
            compute,
            operand,
        }
    }
}

/// `[B, S, Hq*D]` -> `[B, Hkv, G, S, D]` in `dtype`.
fn q_heads(b: &mut Builder, p: &AttentionParams, x: &Val, dtype: DType) -> Val {
    let (bs, s) = (x.shape[0], x.shape[1]);
    let (hkv, d) = (p.num_kv_heads, p.head_dim);
    let x = b.convert(x, dtype);
    let x = b.reshape(&x, &[bs, s, hkv, p.num_heads / hkv, d]);
    b.transpose(&x, &[0, 2, 3, 1, 4])
}

/// `[B, Hkv, G, S, D]` -> `[B, S, Hq*D]`.
fn merge_q_heads(b: &mut Builder, x: &Val) -> Val {
    let [bs, hkv, g, s, d] = x.shape[..] else {
        unreachable!("query heads are rank 5")
    };
    let x = b.transpose(x, &[0, 3, 1, 2, 4]);
    b.reshape(&x, &[bs, s, hkv * g * d])
}

/// `[B, T, Hkv*D]` -> `[B, Hkv, T, D]` in `dtype`.
fn kv_heads(b: &mut Builder, p: &AttentionParams, x: &Val, dtype: DType) -> Val {
    let (bs, t) = (x.shape[0], x.shape[1]);
    let x = b.convert(x, dtype);
    let x = b.reshape(&x, &[bs, t, p.num_kv_heads, p.head_dim]);
    b.transpose(&x, &[0, 2, 1, 3])
}

/// `[B, Hkv, T, D]` -> `[B, T, Hkv*D]`.
fn merge_kv_heads(b: &mut Builder, x: &Val) -> Val {
    let [bs, hkv, t, d] = x.shape[..] else {
        unreachable!("key heads are rank 4")
    };
    let x = b.transpose(x, &[0, 2, 1, 3]);
    b.reshape(&x, &[bs, t, hkv * d])
}

/// The causal and window rule on i64 tensors of one shape: query position `i` sees key
/// position `j` when `j <= i + off` (causal) and `j > i + off - window`; `None` when
/// the attention has neither.
fn window_rule(b: &mut Builder, p: &AttentionParams, i: &Val, j: &Val, off: &Val) -> Option<Val> {
    if !p.causal && p.window.is_none() {
        return None;
    }
    let aligned = b.binary("add", i, off);
    let causal = p.causal.then(|| b.compare(j, &aligned, Cmp::Le));
    let window = p.window.map(|w| {
        let wv = b.splat_int(w as i64, &i.shape, DType::I64);
        let low = b.binary("subtract", &aligned, &wv);
        b.compare(j, &low, Cmp::Gt)
    });
    match (causal, window) {
        (Some(c), Some(w)) => Some(b.binary("and", &c, &w)),
        (c, w) => c.or(w),
    }
}

/// `a && b` where `b` may be absent.
fn and(b: &mut Builder, x: Val, y: Option<Val>) -> Val {
    match y {
        Some(y) => b.binary("and", &x, &y),
        None => x,
    }
}

/// `j + max(-c, 0) <dir> i + max(c, 0)`, i.e. `j <dir> i + c` with no negative constant:
/// XLA's CPU plugin folds a comparison of constants against a negative i64 wrongly
/// (`0 > -1` gave false for `[1, 1]` tensors, where every operand is a constant).
fn compare_shifted(b: &mut Builder, j: &Val, i: &Val, c: i64, dir: Cmp) -> Val {
    let shift = |b: &mut Builder, x: &Val, by: i64| {
        if by > 0 {
            let k = b.splat_int(by, &x.shape, DType::I64);
            b.binary("add", x, &k)
        } else {
            x.clone()
        }
    };
    let (lhs, rhs) = (shift(b, j, -c), shift(b, i, c));
    b.compare(&lhs, &rhs, dir)
}

/// A dense batch: bottom-right causal masking (`j <= i + T - S`) and the window
/// (`j > i + T - S - w`) over `[S, T]`.
fn dense_visible(b: &mut Builder, p: &AttentionParams, s: usize, t: usize) -> Option<Visible> {
    let shape = [s, t];
    let i = b.iota(&shape, 0, DType::I64);
    let j = b.iota(&shape, 1, DType::I64);
    let off = t as i64 - s as i64;
    let causal = p.causal.then(|| compare_shifted(b, &j, &i, off, Cmp::Le));
    let window = p
        .window
        .map(|w| compare_shifted(b, &j, &i, off - w as i64, Cmp::Gt));
    let mask = match (causal, window) {
        (Some(c), Some(w)) => b.binary("and", &c, &w),
        (c, w) => c.or(w)?,
    };
    Some(Visible {
        mask,
        per_batch: false,
    })
}

/// Element `idx[i]` of the vector `v` (XLA clamps an index outside `v`).
fn take(b: &mut Builder, v: &Val, idx: &Val) -> Val {
    let n = idx.shape[0];
    let table = b.reshape(v, &[v.shape[0], 1]);
    let rows = b.gather_rows(&table, idx);
    b.reshape(&rows, &[n])
}

/// For each of `total` packed rows: the index of its sequence in `cu` (`[n + 1]`, i64),
/// `n` for a row past `cu[n]`.
fn sequence_of(b: &mut Builder, cu: &Val, total: usize) -> Result<Val> {
    let n = cu.shape[0] - 1;
    let ends = b.slice_axis(cu, 0, 1, n + 1);
    let rows = b.iota(&[total, n], 0, DType::I64);
    let ends = b.broadcast(&ends, &[total, n], &[1]);
    let past = b.compare(&rows, &ends, Cmp::Ge);
    let past = b.convert(&past, DType::I64);
    b.reduce(&past, &[1], Reduce::Sum)
}

/// Packed sequences: query row `i` of sequence `s` (rows `cu_q[s]..cu_q[s+1]`) sees key
/// row `j` of the same sequence under the causal / window rule with positions counted
/// from the sequence's start, bottom-right aligned within it.
fn varlen_visible(
    b: &mut Builder,
    p: &AttentionParams,
    cu_q: &Val,
    cu_k: &Val,
    s: usize,
    t: usize,
) -> Result<(Visible, Positions)> {
    let cu_q = b.convert(cu_q, DType::I64);
    let cu_k = b.convert(cu_k, DType::I64);
    let n = cu_q.shape[0] - 1;
    let one = b.splat_int(1, &[s], DType::I64);
    let seq_q = sequence_of(b, &cu_q, s)?;
    let next_q = b.binary("add", &seq_q, &one);
    let start_q = take(b, &cu_q, &seq_q);
    let end_q = take(b, &cu_q, &next_q);
    let start_kq = take(b, &cu_k, &seq_q);
    let end_kq = take(b, &cu_k, &next_q);
    let len_q = b.binary("subtract", &end_q, &start_q);
    let len_k = b.binary("subtract", &end_kq, &start_kq);
    let off = b.binary("subtract", &len_k, &len_q);
    let seq_k = sequence_of(b, &cu_k, t)?;
    let start_k = take(b, &cu_k, &seq_k);

    let shape = [s, t];
    let rows = |b: &mut Builder, x: &Val| b.broadcast(x, &shape, &[0]);
    let cols = |b: &mut Builder, x: &Val| b.broadcast(x, &shape, &[1]);
    let (sq, sk) = (rows(b, &seq_q), cols(b, &seq_k));
    let same = b.compare(&sq, &sk, Cmp::Eq);
    let count = b.splat_int(n as i64, &shape, DType::I64);
    let inside = b.compare(&sq, &count, Cmp::Lt);
    let i = b.iota(&shape, 0, DType::I64);
    let sqs = rows(b, &start_q);
    let i = b.binary("subtract", &i, &sqs);
    let j = b.iota(&shape, 1, DType::I64);
    let sks = cols(b, &start_k);
    let j = b.binary("subtract", &j, &sks);
    let off = rows(b, &off);
    let rule = window_rule(b, p, &i, &j, &off);
    let mask = b.binary("and", &same, &inside);
    Ok((
        Visible {
            mask: and(b, mask, rule),
            per_batch: false,
        },
        Positions { seq: sq, i, j },
    ))
}

/// A paged cache `[blocks, block_size, W]` as each sequence's keys `[B, M * block_size,
/// W]`, block by block from `block_table` `[B, M]`.
fn paged_rows(b: &mut Builder, cache: &Val, table: &Val) -> Val {
    let (blocks, size, width) = (cache.shape[0], cache.shape[1], cache.shape[2]);
    let (bs, m) = (table.shape[0], table.shape[1]);
    let flat = b.reshape(table, &[bs * m]);
    let cache = b.reshape(cache, &[blocks, size * width]);
    let rows = b.gather_rows(&cache, &flat);
    b.reshape(&rows, &[bs, m * size, width])
}

/// A paged batch: sequence `b` sees its first `seq_lens[b]` keys, bottom-right aligned.
fn paged_visible(
    b: &mut Builder,
    p: &AttentionParams,
    seq_lens: &Val,
    s: usize,
    t: usize,
) -> Visible {
    let bs = seq_lens.shape[0];
    let shape = [bs, s, t];
    let lens = b.convert(seq_lens, DType::I64);
    let lens = b.broadcast(&lens, &shape, &[0]);
    let i = b.iota(&shape, 1, DType::I64);
    let j = b.iota(&shape, 2, DType::I64);
    let sv = b.splat_int(s as i64, &shape, DType::I64);
    let off = b.binary("subtract", &lens, &sv);
    let stored = b.compare(&j, &lens, Cmp::Lt);
    let rule = window_rule(b, p, &i, &j, &off);
    Visible {
        mask: and(b, stored, rule),
        per_batch: true,
    }
}

/// Scaled scores `[B, Hkv, G, S, T]` in the compute dtype, `-inf` where a key is masked
/// out or not visible.
fn scores(
    b: &mut Builder,
    p: &AttentionParams,
    (qh, kh): (&Val, &Val),
    mask: Option<&Val>,
    visible: Option<&Visible>,
    c: DType,
) -> Result<Val> {
    let raw = b.dot_general(qh, kh, (&[0, 1], &[0, 1]), (&[4], &[3]), c);
    let scale = b.splat(f64::from(p.effective_scale()), &raw.shape, c)?;
    let mut scores = b.binary("multiply", &raw, &scale);
    let shape = scores.shape.clone();
    if let Some(m) = mask {
        let m = b.convert(m, c);
        let m = b.broadcast(&m, &shape, &[3, 4]);
        scores = b.binary("add", &scores, &m);
    }
    if let Some(v) = visible {
        let dims: &[usize] = if v.per_batch { &[0, 3, 4] } else { &[3, 4] };
        let ok = b.broadcast(&v.mask, &shape, dims);
        let ninf = b.splat(f64::NEG_INFINITY, &shape, c)?;
        scores = b.select(&ok, &scores, &ninf);
    }
    Ok(scores)
}

/// The softmax of `scores` over keys and its log-sum-exp (`[B, Hkv, G, S]`): a row that
/// sees no key gives zero probabilities and a log-sum-exp of `+inf`.
fn softmax_lse(b: &mut Builder, scores: &Val) -> Result<(Val, Val)> {
    let c = scores.float();
    let shape = scores.shape.clone();
    let rows = &shape[..shape.len() - 1];
    let last = shape.len() - 1;
    let dims: Vec<usize> = (0..last).collect();
    let max = b.reduce(scores, &[last], Reduce::Max)?;
    let ninf = b.splat(f64::NEG_INFINITY, rows, c)?;
    let zero = b.splat(0.0, rows, c)?;
    let dead = b.compare(&max, &ninf, Cmp::Eq);
    let max = b.select(&dead, &zero, &max);
    let max_b = b.broadcast(&max, &shape, &dims);
    let e = b.binary("subtract", scores, &max_b);
    let e = b.unary("exponential", &e);
    let sum = b.reduce(&e, &[last], Reduce::Sum)?;
    let one = b.splat(1.0, rows, c)?;
    let safe = b.select(&dead, &one, &sum);
    let safe_b = b.broadcast(&safe, &shape, &dims);
    let probs = b.binary("divide", &e, &safe_b);
    let log = b.unary("log", &safe);
    let lse = b.binary("add", &max, &log);
    let inf = b.splat(f64::INFINITY, rows, c)?;
    let lse = b.select(&dead, &inf, &lse);
    Ok((probs, lse))
}

/// Dropout's factors `[B, Hkv, G, S, T]` in `c` (`1 / (1 - p)` or 0, see
/// `AttentionDropout`), or `None` without dropout: Philox4x32-10 on i64 tensors holding
/// 32-bit words (products wrap in 64 bits, and the high word is a logical shift), its
/// round keys constants, then each key's 16 bits of its word. Batch entry and positions
/// come from iotas over the score shape, or for a packed batch from `positions`
/// (sequence, and positions within it).
fn dropout_factors(
    b: &mut Builder,
    p: &AttentionParams,
    shape: &[usize],
    positions: Option<&Positions>,
    c: DType,
) -> Result<Option<Val>> {
    let Some(d) = p.dropout else { return Ok(None) };
    let i64 = DType::I64;
    let groups = shape[2] as i64;
    let int = |b: &mut Builder, x: i64| b.splat_int(x, shape, i64);
    let (batch, i, j) = match positions {
        Some(pos) => {
            let spread = |b: &mut Builder, x: &Val| b.broadcast(x, shape, &[3, 4]);
            (spread(b, &pos.seq), spread(b, &pos.i), spread(b, &pos.j))
        }
        None => (
            b.iota(shape, 0, i64),
            b.iota(shape, 3, i64),
            b.iota(shape, 4, i64),
        ),
    };
    let (kv, member) = (b.iota(shape, 1, i64), b.iota(shape, 2, i64));
    let g = int(b, groups);
    let head = b.binary("multiply", &kv, &g);
    let head = b.binary("add", &head, &member);
    let (eight, two, sixteen) = (int(b, 8), int(b, 2), int(b, 16));
    let group = b.binary("divide", &j, &eight);
    let within = b.binary("remainder", &j, &eight);
    let lane = b.binary("divide", &within, &two);
    let low = int(b, 0xFFFF_FFFF);
    let thirty_two = int(b, 32);
    let [m0, m1] = PHILOX_MULTIPLIERS.map(|m| int(b, i64::from(m)));
    let mut ctr = [group, i, head, batch];
    let (mut k0, mut k1) = (d.seed as u32, (d.seed >> 32) as u32);
    let hi = |b: &mut Builder, x: &Val| b.binary("shift_right_logical", x, &thirty_two);
    let lo = |b: &mut Builder, x: &Val| b.binary("and", x, &low);
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(PHILOX_KEY_STEP[0]);
            k1 = k1.wrapping_add(PHILOX_KEY_STEP[1]);
        }
        let p0 = b.binary("multiply", &ctr[0], &m0);
        let p1 = b.binary("multiply", &ctr[2], &m1);
        let (hi0, lo0, hi1, lo1) = (hi(b, &p0), lo(b, &p0), hi(b, &p1), lo(b, &p1));
        let key0 = int(b, i64::from(k0));
        let key1 = int(b, i64::from(k1));
        let x0 = b.binary("xor", &hi1, &ctr[1]);
        let x0 = b.binary("xor", &x0, &key0);
        let x2 = b.binary("xor", &hi0, &ctr[3]);
        let x2 = b.binary("xor", &x2, &key1);
        ctr = [x0, lo1, x2, lo0];
    }
    // Word (j % 8) / 2 of the four, then its low (even j) or high (odd j) 16 bits.
    let mut word = ctr[3].clone();
    for w in (0..3).rev() {
        let at = int(b, w as i64);
        let is = b.compare(&lane, &at, Cmp::Eq);
        word = b.select(&is, &ctr[w], &word);
    }
    let half = b.binary("remainder", &j, &two);
    let shift = b.binary("multiply", &half, &sixteen);
    let word = b.binary("shift_right_logical", &word, &shift);
    let mask16 = int(b, 0xFFFF);
    let word = b.binary("and", &word, &mask16);
    let threshold = int(b, i64::from(d.threshold()));
    let keep = b.compare(&word, &threshold, Cmp::Ge);
    let scale = b.splat(d.scale(), shape, c)?;
    let zero = b.splat(0.0, shape, c)?;
    Ok(Some(b.select(&keep, &scale, &zero)))
}

/// The forward pass: q, k, v, then the mask, `cu_seqlens_q` / `cu_seqlens_k` or
/// `block_table` / `seq_lens` as the params say -> the output, then the log-sum-exp
/// `[B, Hq, S]` when `p.lse`.
pub(super) fn forward(b: &mut Builder, p: &AttentionParams, ins: &[Val]) -> Result<Vec<Val>> {
    let q = &ins[0];
    let s = q.shape[1];
    // A paged cache never comes with dropout (the op's inference refuses it).
    let (k, v, mask, visible, positions) = if p.paged {
        let k = paged_rows(b, &ins[1], &ins[3]);
        let v = paged_rows(b, &ins[2], &ins[3]);
        let t = k.shape[1];
        let visible = paged_visible(b, p, &ins[4], s, t);
        (k, v, None, Some(visible), None)
    } else if p.varlen {
        let t = ins[1].shape[1];
        let (visible, positions) = varlen_visible(b, p, &ins[3], &ins[4], s, t)?;
        (
            ins[1].clone(),
            ins[2].clone(),
            None,
            Some(visible),
            Some(positions),
        )
    } else {
        let t = ins[1].shape[1];
        let visible = dense_visible(b, p, s, t);
        (
            ins[1].clone(),
            ins[2].clone(),
            p.mask.then(|| &ins[3]),
            visible,
            None,
        )
    };
    let ty = Types::of(q, &k, &v);
    let qh = q_heads(b, p, q, ty.operand);
    let kh = kv_heads(b, p, &k, ty.operand);
    let vh = kv_heads(b, p, &v, ty.operand);
    let scores = scores(b, p, (&qh, &kh), mask, visible.as_ref(), ty.compute)?;
    let (probs, lse) = softmax_lse(b, &scores)?;
    let probs = match dropout_factors(b, p, &probs.shape, positions.as_ref(), ty.compute)? {
        Some(z) => b.binary("multiply", &probs, &z),
        None => probs,
    };
    let probs = b.convert(&probs, ty.operand);
    let o = b.dot_general(&probs, &vh, (&[0, 1], &[0, 1]), (&[4], &[2]), ty.compute);
    let o = merge_q_heads(b, &o);
    let mut outs = vec![b.convert(&o, ty.out)];
    if p.lse {
        outs.push(b.reshape(&lse, &[q.shape[0], p.num_heads, s]));
    }
    Ok(outs)
}

/// The backward pass of a dense batch: q, k, v, the forward output, its gradient, the
/// mask when `p.mask`, the forward's log-sum-exp when `p.lse` -> (dq, dk, dv).
///
/// With `P` the probabilities (`exp(s - lse)` when the log-sum-exp is given) and
/// `Δ = rowsum(dO ∘ O)`: `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ - Δ)`, `dQ = scale · dS K`,
/// `dK = scale · dSᵀ Q`, summed over each kv head's query group.
pub(super) fn backward(b: &mut Builder, p: &AttentionParams, ins: &[Val]) -> Result<Vec<Val>> {
    let (q, k, v, o, dout) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
    let mask = p.mask.then(|| &ins[5]);
    let (s, t) = (q.shape[1], k.shape[1]);
    let ty = Types::of(q, k, v);
    let c = ty.compute;
    let qh = q_heads(b, p, q, ty.operand);
    let kh = kv_heads(b, p, k, ty.operand);
    let vh = kv_heads(b, p, v, ty.operand);
    let visible = dense_visible(b, p, s, t);
    let scores = scores(b, p, (&qh, &kh), mask, visible.as_ref(), c)?;
    let shape = scores.shape.clone();
    let row_dims: Vec<usize> = (0..4).collect();
    let probs = if p.lse {
        let lse = b.convert(&ins[5 + usize::from(p.mask)], c);
        let lse = b.reshape(&lse, &shape[..4]);
        let lse = b.broadcast(&lse, &shape, &row_dims);
        let d = b.binary("subtract", &scores, &lse);
        b.unary("exponential", &d)
    } else {
        softmax_lse(b, &scores)?.0
    };
    let doh = q_heads(b, p, dout, ty.operand);
    let oh = q_heads(b, p, o, c);
    let doc = b.convert(&doh, c);
    let prod = b.binary("multiply", &doc, &oh);
    let delta = b.reduce(&prod, &[4], Reduce::Sum)?;
    let delta = b.broadcast(&delta, &shape, &row_dims);
    let dp = b.dot_general(&doh, &vh, (&[0, 1], &[0, 1]), (&[4], &[3]), c);
    // Dropout: O = (P ∘ Z) V, so dV takes P ∘ Z and dP = Z ∘ (dO Vᵀ).
    let (dp, dropped) = match dropout_factors(b, p, &shape, None, c)? {
        Some(z) => (
            b.binary("multiply", &dp, &z),
            Some(b.binary("multiply", &probs, &z)),
        ),
        None => (dp, None),
    };
    let ds = b.binary("subtract", &dp, &delta);
    let ds = b.binary("multiply", &probs, &ds);
    let scale = b.splat(f64::from(p.effective_scale()), &shape, c)?;
    let ds = b.binary("multiply", &ds, &scale);
    let ds = b.convert(&ds, ty.operand);
    let probs = b.convert(dropped.as_ref().unwrap_or(&probs), ty.operand);
    let dq = b.dot_general(&ds, &kh, (&[0, 1], &[0, 1]), (&[4], &[2]), c);
    let dk = b.dot_general(&ds, &qh, (&[0, 1], &[0, 1]), (&[2, 3], &[2, 3]), c);
    let dv = b.dot_general(&probs, &doh, (&[0, 1], &[0, 1]), (&[2, 3], &[2, 3]), c);
    let dq = merge_q_heads(b, &dq);
    let dk = merge_kv_heads(b, &dk);
    let dv = merge_kv_heads(b, &dv);
    Ok(vec![
        b.convert(&dq, q.float()),
        b.convert(&dk, k.float()),
        b.convert(&dv, v.float()),
    ])
}
