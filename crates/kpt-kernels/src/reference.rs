//! [`CpuReference`]: the f64 reference of every op on whole tensors, used by the
//! validator and as the last fallback kernel on the CPU.

use kpt_core::graph::{Activation, AttentionParams, Op};
use kpt_core::validate::ReferenceOps;
use kpt_core::{DType, Result, Tensor, TensorSpec};

use crate::cpu::{self, reference as r, Act};

/// The f64 reference (naive loops, no parallelism): slow and obviously correct.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuReference;

/// Maps the graph IR's activation onto the kernels' activation.
pub fn act(a: Activation) -> Act {
    match a {
        Activation::Relu => Act::Relu,
        Activation::GeluErf => Act::GeluErf,
        Activation::GeluTanh => Act::GeluTanh,
        Activation::Silu => Act::Silu,
    }
}

/// The kernels' attention shape for packed `q [B, S, Hq*D]` and `k [B, T, Hkv*D]`.
pub(crate) fn attention_shape(
    p: &AttentionParams,
    q: &[usize],
    k: &[usize],
) -> cpu::AttentionShape {
    cpu::AttentionShape {
        batch: q[0],
        seq_q: q[1],
        seq_kv: k[1],
        num_heads: p.num_heads,
        num_kv_heads: p.num_kv_heads,
        head_dim: p.head_dim,
        causal: p.causal,
        scale: p.effective_scale() as f64,
        window: p.window,
        dropout: p.dropout.map(|mask| cpu::ShapeDropout {
            mask,
            first_batch: 0,
            first_query: 0,
        }),
    }
}

fn ids(t: &Tensor) -> Vec<i64> {
    t.to_f64_vec().into_iter().map(|x| x as i64).collect()
}

/// Rows (product of all but the last dim) and the last dim of a shape.
pub(crate) fn rows_dim(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&dim, rest)) => (rest.iter().product(), dim),
        None => (1, 1),
    }
}

/// `(batch, seq, width)` of a rotary op's x `[.., seq, width]`: `batch` is the product
/// of the dims before `seq` (1 for rank 2).
pub(crate) fn rotary_dims(shape: &[usize]) -> (usize, usize, usize) {
    match shape {
        [lead @ .., seq, width] => (lead.iter().product(), *seq, *width),
        [width] => (1, 1, *width),
        [] => (1, 1, 1),
    }
}

/// The three widths of [`Op::SplitRotary`]'s `sizes`, or a shape error.
pub(crate) fn split_rotary_sizes(sizes: &[usize]) -> Result<[usize; 3]> {
    sizes.try_into().map_err(|_| {
        kpt_core::KptError::shape(
            "split_rotary",
            format!("sizes {sizes:?} must be three widths (q, k, v)"),
        )
    })
}

impl ReferenceOps for CpuReference {
    fn eval(&self, op: &Op, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        if let (Op::SplitRotary { cache: true, .. }, [qkv, pos, k_cache, v_cache, slots]) =
            (op, inputs)
        {
            // The split + rotary, then both cache writes.
            let plain = op.split_rotary_with_cache(false)?;
            let [q, k, v]: [Tensor; 3] = self
                .eval(&plain, &[qkv.clone(), pos.clone()])?
                .try_into()
                .map_err(|_| kpt_core::KptError::Graph("split_rotary gave no q, k, v".into()))?;
            let mut outs = vec![q];
            for (cache, rows) in [(k_cache, k), (v_cache, v)] {
                outs.extend(self.eval(&Op::CacheWrite, &[cache.clone(), rows, slots.clone()])?);
            }
            return Ok(outs);
        }
        // The reference computes on real values in f64, whatever the stored dtypes.
        let specs: Vec<TensorSpec> = inputs
            .iter()
            .map(|t| {
                let dtype = if t.dtype().is_index() {
                    t.dtype()
                } else {
                    DType::F64
                };
                TensorSpec::new(t.shape(), dtype)
            })
            .collect();
        let out_specs = match op {
            Op::Dequantize { .. } => vec![TensorSpec::new(inputs[0].shape(), DType::F64)],
            _ => op.infer(&specs)?,
        };
        let x: Vec<Vec<f64>> = inputs.iter().map(Tensor::to_f64_vec).collect();
        let mut outs: Vec<Vec<f64>> = out_specs.iter().map(|s| vec![0.0; s.numel()]).collect();
        let first = &inputs[0];
        match op {
            Op::Embedding => {
                let (rows, dim) = specs[1].rows_and_width();
                r::embedding(&ids(first), &x[1], &mut outs[0], rows, dim)?
            }
            Op::MatMul => {
                let (a, b) = (first.shape(), inputs[1].shape());
                let (m, k, n) = (a[a.len() - 2], a[a.len() - 1], b[b.len() - 1]);
                let batches = first.numel() / (m * k).max(1);
                let b_batched = b.len() > 2;
                for i in 0..batches {
                    let bb = if b_batched {
                        &x[1][i * k * n..(i + 1) * k * n]
                    } else {
                        &x[1][..]
                    };
                    r::matmul(
                        &x[0][i * m * k..(i + 1) * m * k],
                        bb,
                        &mut outs[0][i * m * n..(i + 1) * m * n],
                        m,
                        k,
                        n,
                    )?;
                }
            }
            Op::Linear { bias } | Op::LinearAct { bias, .. } => {
                let a = match op {
                    Op::LinearAct { act: a, .. } => Some(act(*a)),
                    _ => None,
                };
                let (m, k) = rows_dim(first.shape());
                let n = inputs[1].shape()[0];
                let b = if *bias { Some(&x[2][..]) } else { None };
                r::linear_act(&x[0], &x[1], b, a, &mut outs[0], m, k, n)?
            }
            Op::Activation { act: a } => r::activation(&x[0], &mut outs[0], act(*a))?,
            Op::RmsNorm { eps } => {
                let (rows, dim) = rows_dim(first.shape());
                r::rms_norm(&x[0], &x[1], &mut outs[0], rows, dim, *eps as f64)?
            }
            Op::LayerNorm { eps } => {
                let (rows, dim) = rows_dim(first.shape());
                r::layer_norm(&x[0], &x[1], &x[2], &mut outs[0], rows, dim, *eps as f64)?
            }
            Op::AddRmsNorm { eps } => {
                let (rows, dim) = rows_dim(first.shape());
                let (sum, norm) = outs.split_at_mut(1);
                r::add_rms_norm(
                    &x[0],
                    &x[1],
                    &x[2],
                    &mut sum[0],
                    &mut norm[0],
                    rows,
                    dim,
                    *eps as f64,
                )?
            }
            Op::AddLayerNorm { eps } => {
                let (rows, dim) = rows_dim(first.shape());
                let (sum, norm) = outs.split_at_mut(1);
                r::add_layer_norm(
                    &x[0],
                    &x[1],
                    &x[2],
                    &x[3],
                    &mut sum[0],
                    &mut norm[0],
                    rows,
                    dim,
                    *eps as f64,
                )?
            }
            Op::Rotary {
                head_dim,
                theta,
                scaling,
            } => {
                let (batch, seq, width) = rotary_dims(first.shape());
                r::rotary(
                    &x[0],
                    &ids(&inputs[1]),
                    &mut outs[0],
                    batch,
                    seq,
                    width / head_dim,
                    *head_dim,
                    *theta as f64,
                    scaling.as_ref(),
                )?
            }
            Op::SplitRotary {
                head_dim,
                theta,
                scaling,
                sizes,
                ..
            } => {
                let (batch, seq, _) = rotary_dims(first.shape());
                let [q, k, v] = &mut outs[..] else {
                    unreachable!("split_rotary infers three outputs")
                };
                r::split_rotary(
                    &x[0],
                    &ids(&inputs[1]),
                    (q, k, v),
                    batch,
                    seq,
                    split_rotary_sizes(sizes)?,
                    *head_dim,
                    *theta as f64,
                    scaling.as_ref(),
                )?
            }
            Op::Softmax => {
                let (rows, dim) = rows_dim(first.shape());
                r::softmax(&x[0], &mut outs[0], rows, dim)?
            }
            Op::ArgMax => {
                let (rows, dim) = rows_dim(first.shape());
                r::argmax(&x[0], &mut outs[0], rows, dim)?
            }
            Op::AttentionBackward(p) if p.varlen => {
                let shape = attention_shape(p, first.shape(), inputs[1].shape());
                let [dq, dk, dv] = &mut outs[..] else {
                    unreachable!("attention_backward infers three outputs")
                };
                cpu::for_each_sequence_backward(
                    &shape,
                    &ids(&inputs[5]),
                    &ids(&inputs[6]),
                    (&x[0], &x[1], &x[2], &x[3], &x[4]),
                    (dq, dk, dv),
                    |(q, k, v, out, dout), grads, s| {
                        r::attention_backward((q, k, v, None), (out, dout, None), grads, s)
                    },
                )?
            }
            Op::AttentionBackward(p) => {
                let shape = attention_shape(p, first.shape(), inputs[1].shape());
                let mask = if p.mask { Some(&x[5][..]) } else { None };
                let lse = if p.lse {
                    Some(&x[5 + usize::from(p.mask)][..])
                } else {
                    None
                };
                let [dq, dk, dv] = &mut outs[..] else {
                    unreachable!("attention_backward infers three outputs")
                };
                r::attention_backward(
                    (&x[0], &x[1], &x[2], mask),
                    (&x[3], &x[4], lse),
                    (dq, dk, dv),
                    &shape,
                )?
            }
            Op::Attention(p) if p.paged => {
                let shape = attention_shape(p, first.shape(), inputs[1].shape());
                let cache = inputs[1].shape();
                cpu::for_each_paged_sequence(
                    &shape,
                    &cpu::PagedKv {
                        block_size: cache[1],
                        num_blocks: cache[0],
                        block_table: &ids(&inputs[3]),
                        seq_lens: &ids(&inputs[4]),
                    },
                    (&x[0], &x[1], &x[2]),
                    &mut outs[0],
                    |q, k, v, out, s| r::attention(q, k, v, None, out, s),
                )?
            }
            Op::Attention(p) if p.varlen => {
                let shape = attention_shape(p, first.shape(), inputs[1].shape());
                cpu::for_each_sequence(
                    &shape,
                    &ids(&inputs[3]),
                    &ids(&inputs[4]),
                    (&x[0], &x[1], &x[2]),
                    &mut outs[0],
                    |q, k, v, out, s| r::attention(q, k, v, None, out, s),
                )?
            }
            Op::Attention(p) => {
                let shape = attention_shape(p, first.shape(), inputs[1].shape());
                let mask = if p.mask { Some(&x[3][..]) } else { None };
                let (out, lse) = match &mut outs[..] {
                    [out, lse] => (out, Some(&mut lse[..])),
                    [out] => (out, None),
                    _ => unreachable!("attention infers one or two outputs"),
                };
                r::attention_lse(&x[0], &x[1], &x[2], mask, out, lse, &shape)?
            }
            Op::Add => r::add(&x[0], &x[1], &mut outs[0])?,
            Op::Mul => r::mul(&x[0], &x[1], &mut outs[0])?,
            Op::Quantize { dtype, scale } => {
                // Reference tensors hold real values: scale the stored values back.
                let mut stored = vec![0.0; x[0].len()];
                r::quantize(&x[0], *dtype, *scale as f64, &mut stored)?;
                r::dequantize(&stored, *scale as f64, &mut outs[0])?;
            }
            Op::Dequantize { .. } | Op::Cast { .. } => outs[0].copy_from_slice(&x[0]),
            Op::Concat { axis } => {
                let (a, b) = (first.shape(), inputs[1].shape());
                let inner: usize = a[axis + 1..].iter().product();
                let (na, nb) = (a[*axis] * inner, b[*axis] * inner);
                let outer: usize = a[..*axis].iter().product();
                for o in 0..outer {
                    let row = &mut outs[0][o * (na + nb)..(o + 1) * (na + nb)];
                    row[..na].copy_from_slice(&x[0][o * na..(o + 1) * na]);
                    row[na..].copy_from_slice(&x[1][o * nb..(o + 1) * nb]);
                }
            }
            Op::Split { axis, sizes } => {
                let s = first.shape();
                let inner: usize = s[axis + 1..].iter().product();
                let row = s[*axis] * inner;
                let mut start = 0;
                for (out, &size) in outs.iter_mut().zip(sizes) {
                    let n = size * inner;
                    if n == 0 {
                        continue;
                    }
                    // n > 0, so row >= n > 0.
                    for (o, chunk) in out.chunks_exact_mut(n).zip(x[0].chunks(row)) {
                        o.copy_from_slice(&chunk[start..start + n]);
                    }
                    start += n;
                }
            }
            Op::ActAndMul { act: a } => {
                let n = first.shape().last().copied().unwrap_or(0) / 2;
                r::act_and_mul(&x[0], &mut outs[0], n, act(*a))?
            }
            Op::CacheWrite => {
                let row = first.shape().last().copied().unwrap_or(1);
                let rows = outs[0].len() / row.max(1);
                outs[0].copy_from_slice(&x[0]);
                for (i, slot) in ids(&inputs[2]).into_iter().enumerate() {
                    match usize::try_from(slot) {
                        Err(_) => continue,
                        Ok(s) if s < rows => outs[0][s * row..(s + 1) * row]
                            .copy_from_slice(&x[1][i * row..(i + 1) * row]),
                        Ok(s) => {
                            return Err(kpt_core::KptError::InvalidArgument(format!(
                                "cache_write slot {s} is past the cache's {rows} rows"
                            )))
                        }
                    }
                }
            }
        }
        // Index outputs (argmax) keep their integer dtype.
        outs.into_iter()
            .zip(out_specs)
            .map(|(v, s)| match s.dtype {
                DType::I64 => Tensor::from_vec(v.into_iter().map(|i| i as i64).collect(), &s.shape),
                _ => Tensor::from_vec(v, &s.shape),
            })
            .collect()
    }
}
