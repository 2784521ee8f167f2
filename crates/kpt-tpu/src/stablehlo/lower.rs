//! Each op of kpt's graph IR in StableHLO, with the semantics of the f64 reference
//! (`kpt_kernels::CpuReference`): f32 arithmetic for 16-bit floats (f64 for f64), one
//! rounding to the output dtype.

use kpt_core::graph::{rope_frequencies, Activation, Op, RopeScaling};
use kpt_core::{DType, KptError, Result};

use super::attention;
use super::builder::{Builder, Cmp, Reduce, Val};

/// The dtype arithmetic runs in for values of `d`.
pub(super) fn compute(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The outputs of `op` applied to `ins`.
pub(crate) fn lower(b: &mut Builder, op: &Op, ins: &[Val]) -> Result<Vec<Val>> {
    Ok(match op {
        Op::Add | Op::Mul => {
            let name = if matches!(op, Op::Add) {
                "add"
            } else {
                "multiply"
            };
            let out = ins[0].float();
            let c = compute(out);
            let x = b.convert(&ins[0], c);
            let y = b.convert(&ins[1], c);
            let y = b.broadcast_trailing(&y, &x.shape);
            let r = b.binary(name, &x, &y);
            vec![b.convert(&r, out)]
        }
        Op::MatMul => vec![matmul(b, &ins[0], &ins[1])],
        Op::Linear { bias } => {
            let bias = bias.then(|| &ins[2]);
            vec![linear(b, &ins[0], &ins[1], bias, None)?]
        }
        Op::LinearAct { bias, act } => {
            let bias = bias.then(|| &ins[2]);
            vec![linear(b, &ins[0], &ins[1], bias, Some(*act))?]
        }
        Op::Activation { act } => {
            let out = ins[0].float();
            let x = b.convert(&ins[0], compute(out));
            let r = activation(b, &x, *act)?;
            vec![b.convert(&r, out)]
        }
        Op::ActAndMul { act } => {
            let x = &ins[0];
            let out = x.float();
            let x = b.convert(x, compute(out));
            let last = x.rank() - 1;
            let n = x.shape[last] / 2;
            let gate = b.slice_axis(&x, last, 0, n);
            let up = b.slice_axis(&x, last, n, 2 * n);
            let g = activation(b, &gate, *act)?;
            let r = b.binary("multiply", &g, &up);
            vec![b.convert(&r, out)]
        }
        Op::Softmax => {
            let out = ins[0].float();
            let x = b.convert(&ins[0], compute(out));
            let r = softmax(b, &x)?;
            vec![b.convert(&r, out)]
        }
        Op::RmsNorm { eps } => vec![rms_norm(b, &ins[0], &ins[1], *eps)?],
        Op::LayerNorm { eps } => vec![layer_norm(b, &ins[0], &ins[1], &ins[2], *eps)?],
        Op::AddRmsNorm { eps } => {
            let sum = residual_sum(b, &ins[0], &ins[1]);
            let norm = rms_norm(b, &sum, &ins[2], *eps)?;
            vec![sum, norm]
        }
        Op::AddLayerNorm { eps } => {
            let sum = residual_sum(b, &ins[0], &ins[1]);
            let norm = layer_norm(b, &sum, &ins[2], &ins[3], *eps)?;
            vec![sum, norm]
        }
        Op::Cast { dtype } => vec![b.convert(&ins[0], *dtype)],
        Op::Concat { axis } => vec![b.concatenate(&[&ins[0], &ins[1]], *axis)],
        Op::Split { axis, sizes } => {
            let mut at = 0;
            sizes
                .iter()
                .map(|&s| {
                    let part = b.slice_axis(&ins[0], *axis, at, at + s);
                    at += s;
                    part
                })
                .collect()
        }
        Op::Embedding => {
            let (ids, table) = (&ins[0], &ins[1]);
            let n: usize = ids.shape.iter().product();
            let flat = b.reshape(ids, &[n]);
            // A table of rank > 2 (rows of an activation) as the [rows, dim] it is.
            let (r, dim) = (
                table.shape[..table.shape.len() - 1].iter().product(),
                table.shape[table.shape.len() - 1],
            );
            let table = b.reshape(table, &[r, dim]);
            let rows = b.gather_rows(&table, &flat);
            let mut shape = ids.shape.clone();
            shape.push(dim);
            vec![b.reshape(&rows, &shape)]
        }
        Op::ArgMax => vec![argmax(b, &ins[0])?],
        Op::Rotary {
            head_dim,
            theta,
            scaling,
        } => vec![rotary(
            b,
            &ins[0],
            &ins[1],
            *head_dim,
            *theta,
            scaling.as_ref(),
        )?],
        Op::SplitRotary {
            head_dim,
            theta,
            scaling,
            sizes,
            cache,
        } => {
            let x = &ins[0];
            let last = x.rank() - 1;
            let q = b.slice_axis(x, last, 0, sizes[0]);
            let k = b.slice_axis(x, last, sizes[0], sizes[0] + sizes[1]);
            let v = b.slice_axis(x, last, sizes[0] + sizes[1], x.shape[last]);
            let q = rotary(b, &q, &ins[1], *head_dim, *theta, scaling.as_ref())?;
            let k = rotary(b, &k, &ins[1], *head_dim, *theta, scaling.as_ref())?;
            if *cache {
                let k = cache_write(b, &ins[2], &k, &ins[4]);
                vec![q, k, cache_write(b, &ins[3], &v, &ins[4])]
            } else {
                vec![q, k, v]
            }
        }
        Op::Attention(p) => attention::forward(b, p, ins)?,
        Op::AttentionBackward(p) => attention::backward(b, p, ins)?,
        Op::Quantize { dtype, scale } => vec![quantize(b, &ins[0], *dtype, *scale)?],
        // The scale of the input comes after it (see `emit_graph`).
        Op::Dequantize { dtype } => vec![dequantize(b, &ins[0], &ins[1], *dtype)],
        Op::CacheWrite => vec![cache_write(b, &ins[0], &ins[1], &ins[2])],
    })
}

/// `a · b` for a `[.., M, K]` and b `[K, N]` or `[.., K, N]`, f32 accumulation.
/// `cache` with row `slots[i]` (counted over its leading dims) replaced by row `i` of
/// `rows`. A negative slot (padding) is skipped, as XLA skips every index outside the
/// cache (the reference rejects one past its end).
fn cache_write(b: &mut Builder, cache: &Val, rows: &Val, slots: &Val) -> Val {
    let width = cache.shape.last().copied().unwrap_or(1).max(1);
    let count = cache.shape.iter().product::<usize>() / width;
    let n = slots.shape.iter().product::<usize>();
    let c2 = b.reshape(cache, &[count, width]);
    let r2 = b.convert(rows, cache.float());
    let r2 = b.reshape(&r2, &[n, width]);
    let idx = b.convert(slots, DType::I64);
    let idx = b.reshape(&idx, &[n, 1]);
    let out = b.scatter_rows(&c2, &idx, &r2);
    b.reshape(&out, &cache.shape)
}

fn matmul(b: &mut Builder, x: &Val, y: &Val) -> Val {
    let out = x.float();
    let r = x.rank();
    let acc = if y.rank() == 2 {
        b.dot_general(x, y, (&[], &[]), (&[r - 1], &[0]), compute(out))
    } else {
        let batch: Vec<usize> = (0..r - 2).collect();
        b.dot_general(x, y, (&batch, &batch), (&[r - 1], &[r - 2]), compute(out))
    };
    b.convert(&acc, out)
}

/// `act(x · wᵀ + bias)`.
fn linear(
    b: &mut Builder,
    x: &Val,
    w: &Val,
    bias: Option<&Val>,
    act: Option<Activation>,
) -> Result<Val> {
    let out = x.float();
    let c = compute(out);
    // Weights in another float dtype than x (bf16 weights, f32 activations) are widened.
    let w = if w.dtype == x.dtype {
        w.clone()
    } else {
        b.convert(w, c)
    };
    let xv = if w.dtype == x.dtype {
        x.clone()
    } else {
        b.convert(x, c)
    };
    let mut y = b.dot_general(&xv, &w, (&[], &[]), (&[x.rank() - 1], &[1]), c);
    if let Some(bias) = bias {
        let bias = b.convert(bias, c);
        let bias = b.broadcast_trailing(&bias, &y.shape);
        y = b.binary("add", &y, &bias);
    }
    if let Some(act) = act {
        y = activation(b, &y, act)?;
    }
    Ok(b.convert(&y, out))
}

/// An activation in the dtype of `x`.
fn activation(b: &mut Builder, x: &Val, act: Activation) -> Result<Val> {
    let d = x.float();
    Ok(match act {
        Activation::Relu => {
            let zero = b.splat(0.0, &x.shape, d)?;
            b.binary("maximum", x, &zero)
        }
        Activation::Silu => {
            let s = b.unary("logistic", x);
            b.binary("multiply", x, &s)
        }
        Activation::GeluTanh => {
            // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            let x3 = b.binary("multiply", x, x);
            let x3 = b.binary("multiply", &x3, x);
            let c = b.splat(0.044715, &x.shape, d)?;
            let t = b.binary("multiply", &x3, &c);
            let t = b.binary("add", x, &t);
            let k = b.splat((2.0 / std::f64::consts::PI).sqrt(), &x.shape, d)?;
            let t = b.binary("multiply", &t, &k);
            let t = b.unary("tanh", &t);
            half_x_one_plus(b, x, &t)?
        }
        Activation::GeluErf => {
            // 0.5 x (1 + erf(x / sqrt 2))
            let k = b.splat(std::f64::consts::FRAC_1_SQRT_2, &x.shape, d)?;
            let t = b.binary("multiply", x, &k);
            let t = b.chlo_unary("erf", &t);
            half_x_one_plus(b, x, &t)?
        }
    })
}

/// `0.5 x (1 + t)`.
fn half_x_one_plus(b: &mut Builder, x: &Val, t: &Val) -> Result<Val> {
    let d = x.float();
    let one = b.splat(1.0, &x.shape, d)?;
    let half = b.splat(0.5, &x.shape, d)?;
    let t = b.binary("add", t, &one);
    let t = b.binary("multiply", &t, x);
    Ok(b.binary("multiply", &t, &half))
}

/// Softmax over the last dim of `x` (in its dtype).
fn softmax(b: &mut Builder, x: &Val) -> Result<Val> {
    let max = b.reduce_last_keep(x, Reduce::Max)?;
    let e = b.binary("subtract", x, &max);
    let e = b.unary("exponential", &e);
    let sum = b.reduce_last_keep(&e, Reduce::Sum)?;
    Ok(b.binary("divide", &e, &sum))
}

/// Mean over the last dim, broadcast back.
fn mean_last(b: &mut Builder, x: &Val) -> Result<Val> {
    let n = x.shape[x.rank() - 1];
    let sum = b.reduce_last_keep(x, Reduce::Sum)?;
    let inv = b.splat(1.0 / n as f64, &x.shape, x.float())?;
    Ok(b.binary("multiply", &sum, &inv))
}

/// `x / sqrt(mean(x²) + eps) * w`.
fn rms_norm(b: &mut Builder, x: &Val, w: &Val, eps: f32) -> Result<Val> {
    let out = x.float();
    let c = compute(out);
    let xc = b.convert(x, c);
    let sq = b.binary("multiply", &xc, &xc);
    let ms = mean_last(b, &sq)?;
    let e = b.splat(f64::from(eps), &xc.shape, c)?;
    let ms = b.binary("add", &ms, &e);
    let r = b.unary("rsqrt", &ms);
    let y = b.binary("multiply", &xc, &r);
    let wc = b.convert(w, c);
    let wc = b.broadcast_trailing(&wc, &xc.shape);
    let y = b.binary("multiply", &y, &wc);
    Ok(b.convert(&y, out))
}

/// `(x - mean) / sqrt(var + eps) * w + bias`.
fn layer_norm(b: &mut Builder, x: &Val, w: &Val, bias: &Val, eps: f32) -> Result<Val> {
    let out = x.float();
    let c = compute(out);
    let xc = b.convert(x, c);
    let mean = mean_last(b, &xc)?;
    let d = b.binary("subtract", &xc, &mean);
    let sq = b.binary("multiply", &d, &d);
    let var = mean_last(b, &sq)?;
    let e = b.splat(f64::from(eps), &xc.shape, c)?;
    let var = b.binary("add", &var, &e);
    let r = b.unary("rsqrt", &var);
    let y = b.binary("multiply", &d, &r);
    let wc = b.convert(w, c);
    let wc = b.broadcast_trailing(&wc, &xc.shape);
    let bc = b.convert(bias, c);
    let bc = b.broadcast_trailing(&bc, &xc.shape);
    let y = b.binary("multiply", &y, &wc);
    let y = b.binary("add", &y, &bc);
    Ok(b.convert(&y, out))
}

/// `x + residual`, rounded to x's dtype (the first output of the fused norms).
fn residual_sum(b: &mut Builder, x: &Val, r: &Val) -> Val {
    let out = x.float();
    let c = compute(out);
    let xc = b.convert(x, c);
    let rc = b.convert(r, c);
    let s = b.binary("add", &xc, &rc);
    b.convert(&s, out)
}

/// Index of the largest element of each last-dim row, the lowest on ties, -1 for a row
/// with a NaN (i64).
fn argmax(b: &mut Builder, x: &Val) -> Result<Val> {
    let last = x.rank() - 1;
    let n = x.shape[last];
    let max = b.reduce_last_keep(x, Reduce::Max)?;
    let is_max = b.compare(x, &max, Cmp::Eq);
    let idx = b.iota(&x.shape, last, DType::I64);
    let none = b.splat_int(n as i64, &x.shape, DType::I64);
    let cand = b.select(&is_max, &idx, &none);
    let first = b.reduce(&cand, &[last], Reduce::Min)?;
    let nan = b.compare(x, x, Cmp::Ne);
    let any_nan = b.reduce(&nan, &[last], Reduce::Or)?;
    let minus_one = b.splat_int(-1, &first.shape, DType::I64);
    Ok(b.select(&any_nan, &minus_one, &first))
}

/// Rotary embedding ("rotate half") of x `[.., S, H*D]` at `positions` (`[S]` or x's
/// leading dims).
fn rotary(
    b: &mut Builder,
    x: &Val,
    positions: &Val,
    head_dim: usize,
    theta: f32,
    scaling: Option<&RopeScaling>,
) -> Result<Val> {
    let out = x.float();
    let c = compute(out);
    let table = rope_frequencies(head_dim, f64::from(theta), scaling, 0)?;
    let half = head_dim / 2;
    let r = x.rank();
    let seq = x.shape[r - 2];
    let heads = x.shape[r - 1] / head_dim;
    // x as [lead.., S, H, D].
    let mut split = x.shape[..r - 1].to_vec();
    split.extend([heads, head_dim]);
    let xc = b.convert(x, c);
    let xh = b.reshape(&xc, &split);
    // Angles [lead.., S, 1, D/2] from positions ([S] shared or per token).
    let mut ang_shape = x.shape[..r - 1].to_vec();
    ang_shape.extend([1, half]);
    let pos_dims: Vec<usize> = if positions.rank() == 1 {
        vec![r - 2]
    } else {
        (0..r - 1).collect()
    };
    debug_assert_eq!(positions.shape.last(), Some(&seq));
    let (cos, sin) = if b.no_f64 {
        if scaling.is_some_and(RopeScaling::depends_on_positions) {
            return Err(KptError::Backend {
                backend: "xla".into(),
                message: "dynamic NTK rope scaling needs f64 arithmetic, which this XLA target \
                          lacks"
                    .into(),
            });
        }
        let (cos, sin) = angles_f32(b, positions, &pos_dims, &ang_shape, &table.inv_freq)?;
        let factor = b.splat(table.attention_factor, &ang_shape, DType::F32)?;
        (
            b.binary("multiply", &cos, &factor),
            b.binary("multiply", &sin, &factor),
        )
    } else {
        // The angles and their cos / sin in f64, as kpt's CUDA kernels build their
        // tables: in f32, `position * inv_freq` loses ~1e-3 rad at position 32K.
        let pos = b.convert(positions, DType::F64);
        let pos = b.broadcast(&pos, &ang_shape, &pos_dims);
        let freq = match scaling {
            Some(&RopeScaling::Dynamic {
                factor,
                max_position_embeddings,
            }) => dynamic_inv_freq(
                b,
                positions,
                (head_dim, f64::from(theta)),
                (factor, max_position_embeddings),
            )?,
            _ => b.vector(&table.inv_freq, DType::F64)?,
        };
        let freq = b.broadcast(&freq, &ang_shape, &[r]);
        let ang = b.binary("multiply", &pos, &freq);
        let factor = b.splat(table.attention_factor, &ang_shape, DType::F64)?;
        let cos = b.unary("cosine", &ang);
        let sin = b.unary("sine", &ang);
        (
            b.binary("multiply", &cos, &factor),
            b.binary("multiply", &sin, &factor),
        )
    };
    let cos = b.convert(&cos, c);
    let sin = b.convert(&sin, c);
    // x as [lead.., S, H, 2, D/2]: y = x · cos + swap_halves(x) · (-sin, +sin), with no
    // slices of x (a reverse of the size-2 dim fuses into the elementwise loop).
    let mut pair_shape = split.clone();
    pair_shape[r] = 2;
    pair_shape.push(half);
    let xp = b.reshape(&xh, &pair_shape);
    let swapped = b.reverse(&xp, &[r]);
    let neg = b.unary("negate", &sin);
    let signed = b.concatenate(&[&neg, &sin], r);
    let mut table_shape = ang_shape.clone();
    table_shape[r] = 1;
    table_shape.push(half);
    let mut signed_shape = table_shape.clone();
    signed_shape[r] = 2;
    let signed = b.reshape(&signed, &signed_shape);
    let cos = b.reshape(&cos, &table_shape);
    let dims: Vec<usize> = (0..=r + 1).collect();
    let cos = b.broadcast(&cos, &pair_shape, &dims);
    let signed = b.broadcast(&signed, &pair_shape, &dims);
    let a = b.binary("multiply", &xp, &cos);
    let s = b.binary("multiply", &swapped, &signed);
    let y = b.binary("add", &a, &s);
    let y = b.reshape(&y, &x.shape);
    Ok(b.convert(&y, out))
}

/// Dynamic NTK's inverse frequencies `[D/2]` (f64), computed in the program from the
/// call's positions as `rope_frequencies` does on the host: `len = max(max position +
/// 1, max_position_embeddings)`, `base = theta * (factor * len / max - (factor - 1))^(d /
/// (d - 2))`, `inv_freq[i] = base^(-2i / d)`.
fn dynamic_inv_freq(
    b: &mut Builder,
    positions: &Val,
    (head_dim, theta): (usize, f64),
    (factor, max): (f64, usize),
) -> Result<Val> {
    let d = head_dim as f64;
    let all: Vec<usize> = (0..positions.rank()).collect();
    let pos = b.convert(positions, DType::I64);
    let top = b.reduce(&pos, &all, Reduce::Max)?;
    let one = b.splat_int(1, &[], DType::I64);
    let len = b.binary("add", &top, &one);
    let len = b.convert(&len, DType::F64);
    let max = b.splat(max as f64, &[], DType::F64)?;
    let len = b.binary("maximum", &len, &max);
    let per = b.binary("divide", &len, &max);
    let f = b.splat(factor, &[], DType::F64)?;
    let ratio = b.binary("multiply", &per, &f);
    let f1 = b.splat(factor - 1.0, &[], DType::F64)?;
    let ratio = b.binary("subtract", &ratio, &f1);
    let ln_ratio = b.unary("log", &ratio);
    let power = b.splat(d / (d - 2.0), &[], DType::F64)?;
    let ln_base = b.binary("multiply", &ln_ratio, &power);
    let ln_theta = b.splat(theta.ln(), &[], DType::F64)?;
    let ln_base = b.binary("add", &ln_base, &ln_theta);
    let half = head_dim / 2;
    let exps: Vec<f64> = (0..half).map(|i| -2.0 * i as f64 / d).collect();
    let exps = b.vector(&exps, DType::F64)?;
    let ln_base = b.broadcast(&ln_base, &[half], &[]);
    let x = b.binary("multiply", &exps, &ln_base);
    Ok(b.unary("exponential", &x))
}

/// `x / scale` stored as `dtype` (FP8 or int8), as kpt quantizes everywhere: saturated
/// to the largest finite value, rounded to nearest even; int8 maps NaN to 0, FP8 keeps
/// it.
fn quantize(b: &mut Builder, x: &Val, dtype: DType, scale: f32) -> Result<Val> {
    if !dtype.is_quantized() {
        return Err(KptError::dtype("quantize", "f8e4m3, f8e5m2 or i8", dtype));
    }
    let shape = x.shape.clone();
    let xc = b.convert(x, DType::F32);
    let s = b.splat(f64::from(scale), &shape, DType::F32)?;
    let q = b.binary("divide", &xc, &s);
    let max = dtype.max_finite();
    let lo = b.splat(-max, &shape, DType::F32)?;
    let hi = b.splat(max, &shape, DType::F32)?;
    let q = b.binary("maximum", &q, &lo);
    let mut q = b.binary("minimum", &q, &hi);
    if dtype == DType::I8 {
        // `convert` to an integer truncates: round first.
        let r = b.unary("round_nearest_even", &q);
        let nan = b.compare(&q, &q, Cmp::Ne);
        let zero = b.splat(0.0, &shape, DType::F32)?;
        q = b.select(&nan, &zero, &r);
    }
    Ok(b.convert(&q, dtype))
}

/// Stored FP8 / int8 values times their `scale` (an f32 scalar), as `dtype`.
pub(super) fn dequantize(b: &mut Builder, x: &Val, scale: &Val, dtype: DType) -> Val {
    let xc = b.convert(x, DType::F32);
    let s = b.broadcast(scale, &x.shape, &[]);
    let y = b.binary("multiply", &xc, &s);
    b.convert(&y, dtype)
}

/// `x` rounded to its 12 leading significant bits (so that the product with an integer
/// below 2^12 is exact in f32).
fn leading_12_bits(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let e = x.abs().log2().floor() as i32;
    let unit = 2f64.powi(e - 11);
    (x / unit).round() * unit
}

/// `x` as three f32 values whose sum is `x` to ~2^-36 relative: two of 12 significant
/// bits, then the f32 rounding of the rest.
fn split3(x: f64) -> [f64; 3] {
    let a = leading_12_bits(x);
    let b = leading_12_bits(x - a);
    [a, b, f64::from((x - a - b) as f32)]
}

/// cos and sin `[lead.., S, 1, D/2]` (f32) of `position * inv_freq` without f64 (XLA:TPU
/// has none), accurate to ~1e-6 rad for positions below 2^24 where plain f32 loses ~1e-3
/// rad at 32K: angles are taken in turns (`g = inv_freq / 2π`); a position splits exactly
/// into `4096 p_hi + p_lo` (integer ops) and each constant into pieces of 12 significant
/// bits, so the large products are exact in f32; each is reduced to its centered
/// fraction of a turn (`x - round(x)`, exact) and the fractions are summed with a
/// reduction after every step, so no sum grows past one turn.
fn angles_f32(
    b: &mut Builder,
    positions: &Val,
    pos_dims: &[usize],
    ang_shape: &[usize],
    inv_freq: &[f64],
) -> Result<(Val, Val)> {
    let r = ang_shape.len() - 1;
    let pos = b.convert(positions, DType::I64);
    let shift = b.splat_int(12, &pos.shape, DType::I64);
    let low_mask = b.splat_int(4095, &pos.shape, DType::I64);
    let hi = b.binary("shift_right_arithmetic", &pos, &shift);
    let lo = b.binary("and", &pos, &low_mask);
    let as_f32 = |b: &mut Builder, v: &Val| {
        let v = b.convert(v, DType::F32);
        b.broadcast(&v, ang_shape, pos_dims)
    };
    let (hi, lo) = (as_f32(b, &hi), as_f32(b, &lo));
    let turns: Vec<f64> = inv_freq.iter().map(|w| w / std::f64::consts::TAU).collect();
    let piece = |b: &mut Builder, scale: f64, k: usize| -> Result<Val> {
        let v: Vec<f64> = turns.iter().map(|g| split3(g * scale)[k]).collect();
        let v = b.vector(&v, DType::F32)?;
        Ok(b.broadcast(&v, ang_shape, &[r]))
    };
    let frac = |b: &mut Builder, x: &Val| {
        let n = b.unary("round_nearest_even", x);
        b.binary("subtract", x, &n)
    };
    let mut t: Option<Val> = None;
    let mut small: Option<Val> = None;
    for (p, scale) in [(&hi, 4096.0), (&lo, 1.0)] {
        for k in 0..3 {
            let c = piece(b, scale, k)?;
            let prod = b.binary("multiply", p, &c);
            if k == 2 {
                small = Some(match small {
                    Some(s) => b.binary("add", &s, &prod),
                    None => prod,
                });
                continue;
            }
            let f = frac(b, &prod);
            t = Some(match t {
                Some(acc) => {
                    let sum = b.binary("add", &acc, &f);
                    frac(b, &sum)
                }
                None => f,
            });
        }
    }
    let (t, small) = (
        t.expect("two exact products per part"),
        small.expect("one small product per part"),
    );
    let t = b.binary("add", &t, &small);
    let tau = b.splat(std::f64::consts::TAU, ang_shape, DType::F32)?;
    let ang = b.binary("multiply", &t, &tau);
    Ok((b.unary("cosine", &ang), b.unary("sine", &ang)))
}
