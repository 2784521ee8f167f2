//! The benchmark cases: what each one computes on the kpt side, the matching request for
//! the PyTorch worker, and the accuracy check against the f64 reference.

use half::bf16;
use kpt_core::rand::SplitMix64;
use kpt_core::{DType, Result};
use kpt_kernels::cpu::{self, reference as r, tolerance, Act, AttentionShape, WeightsRef};
use serde_json::{json, Value};

/// Storage precision of a case's operands and result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prec {
    /// f32 in and out.
    F32,
    /// bf16 in and out (f32 accumulation).
    BF16,
}

impl Prec {
    fn name(self) -> &'static str {
        match self {
            Prec::F32 => "f32",
            Prec::BF16 => "bf16",
        }
    }

    fn dtype(self) -> DType {
        match self {
            Prec::F32 => DType::F32,
            Prec::BF16 => DType::BF16,
        }
    }
}

/// What a case computes.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// `a[m,k] · b[k,n]`.
    Gemm { m: usize, k: usize, n: usize },
    /// `gelu_tanh(x[m,k] · w[n,k]ᵀ + bias)`.
    LinearGelu { m: usize, k: usize, n: usize },
    /// Self-attention, `seq` queries and keys.
    Attention {
        batch: usize,
        heads: usize,
        seq: usize,
        head_dim: usize,
        causal: bool,
    },
    /// RMS norm of `[rows, dim]`.
    RmsNorm { rows: usize, dim: usize },
    /// Layer norm of `[rows, dim]`.
    LayerNorm { rows: usize, dim: usize },
    /// Softmax over the last axis of `[rows, dim]`.
    Softmax { rows: usize, dim: usize },
    /// Rotary embedding of a `[batch, heads, seq, head_dim]` tensor.
    Rotary {
        batch: usize,
        heads: usize,
        seq: usize,
        head_dim: usize,
    },
}

const EPS: f32 = 1e-5;
const THETA: f32 = 10_000.0;

/// One benchmark case.
#[derive(Debug, Clone)]
pub struct Case {
    /// Row name in the report.
    pub name: String,
    /// The computation.
    pub kind: Kind,
    /// Operand precision.
    pub prec: Prec,
    /// kpt/torch throughput ratio to reach.
    pub target_ratio: f64,
}

/// The cases of the report; `quick` shrinks every shape (a smoke test of the harness).
pub fn all(quick: bool) -> Vec<Case> {
    let sz = |full: usize, small: usize| if quick { small } else { full };
    let mut cases = Vec::new();
    for prec in [Prec::F32, Prec::BF16] {
        for n in [512, 1024, 2048] {
            let n = sz(n, n / 16 + 1);
            cases.push(Case {
                name: format!("gemm_{}_{n}", prec.name()),
                kind: Kind::Gemm { m: n, k: n, n },
                prec,
                target_ratio: 0.95,
            });
        }
        let (m, k, n) = (sz(2048, 65), sz(2048, 33), sz(5632, 77));
        cases.push(Case {
            name: format!("gemm_{}_mlp_{m}x{k}x{n}", prec.name()),
            kind: Kind::Gemm { m, k, n },
            prec,
            target_ratio: 0.95,
        });
    }
    let (m, k, n) = (sz(2048, 47), sz(2048, 64), sz(8192, 95));
    cases.push(Case {
        name: format!("linear_gelu_f32_{m}x{k}x{n}"),
        kind: Kind::LinearGelu { m, k, n },
        prec: Prec::F32,
        target_ratio: 1.1,
    });
    for prec in [Prec::F32, Prec::BF16] {
        for (heads, seq, head_dim) in [(8, 1024, 64), (16, 2048, 128)] {
            let seq = sz(seq, seq / 32 + 3);
            for causal in [true, false] {
                cases.push(Case {
                    name: format!(
                        "attention_{}_b1h{heads}s{seq}d{head_dim}_{}",
                        prec.name(),
                        if causal { "causal" } else { "full" }
                    ),
                    kind: Kind::Attention {
                        batch: 1,
                        heads,
                        seq,
                        head_dim,
                        causal,
                    },
                    prec,
                    target_ratio: 1.0,
                });
            }
        }
    }
    let (rows, dim) = (sz(4096, 37), sz(4096, 300));
    for (name, kind) in [
        ("rms_norm", Kind::RmsNorm { rows, dim }),
        ("layer_norm", Kind::LayerNorm { rows, dim }),
        ("softmax", Kind::Softmax { rows, dim }),
    ] {
        cases.push(Case {
            name: format!("{name}_f32_{rows}x{dim}"),
            kind,
            prec: Prec::F32,
            target_ratio: 3.0,
        });
    }
    let (heads, seq) = (sz(32, 3), sz(2048, 17));
    cases.push(Case {
        name: format!("rotary_f32_1x{heads}x{seq}x128"),
        kind: Kind::Rotary {
            batch: 1,
            heads,
            seq,
            head_dim: 128,
        },
        prec: Prec::F32,
        target_ratio: 3.0,
    });
    cases
}

impl Case {
    /// The throughput unit and the work (FLOPs or bytes) of one call.
    pub fn metric(&self) -> (&'static str, f64) {
        let f = |x: usize| x as f64;
        let es = f(self.prec.dtype().size_in_bytes());
        match self.kind {
            Kind::Gemm { m, k, n } | Kind::LinearGelu { m, k, n } => {
                ("GFLOP/s", 2.0 * f(m) * f(k) * f(n))
            }
            Kind::Attention {
                batch,
                heads,
                seq,
                head_dim,
                causal,
            } => {
                // Two products of seq × seq × head_dim per head; causal needs about half.
                let pairs = if causal {
                    f(seq) * (f(seq) + 1.0) / 2.0
                } else {
                    f(seq) * f(seq)
                };
                ("GFLOP/s", 4.0 * f(batch) * f(heads) * pairs * f(head_dim))
            }
            Kind::RmsNorm { rows, dim }
            | Kind::LayerNorm { rows, dim }
            | Kind::Softmax { rows, dim } => ("GB/s", 2.0 * f(rows) * f(dim) * es),
            Kind::Rotary {
                batch,
                heads,
                seq,
                head_dim,
            } => ("GB/s", 2.0 * f(batch * heads * seq * head_dim) * es),
        }
    }

    /// The request for the PyTorch worker (without timing parameters).
    pub fn torch_request(&self) -> Value {
        let mut req = match self.kind {
            Kind::Gemm { m, k, n } => json!({"kind": "gemm", "m": m, "k": k, "n": n}),
            Kind::LinearGelu { m, k, n } => {
                json!({"kind": "linear_gelu", "m": m, "k": k, "n": n})
            }
            Kind::Attention {
                batch,
                heads,
                seq,
                head_dim,
                causal,
            } => json!({"kind": "attention", "batch": batch, "heads": heads, "seq": seq,
                        "head_dim": head_dim, "causal": causal}),
            Kind::RmsNorm { rows, dim } => {
                json!({"kind": "rms_norm", "rows": rows, "dim": dim, "eps": EPS})
            }
            Kind::LayerNorm { rows, dim } => {
                json!({"kind": "layer_norm", "rows": rows, "dim": dim, "eps": EPS})
            }
            Kind::Softmax { rows, dim } => json!({"kind": "softmax", "rows": rows, "dim": dim}),
            Kind::Rotary {
                batch,
                heads,
                seq,
                head_dim,
            } => json!({"kind": "rotary", "batch": batch, "heads": heads, "seq": seq,
                        "head_dim": head_dim, "theta": THETA}),
        };
        req["dtype"] = json!(self.prec.name());
        req
    }

    /// Allocates random inputs and the output of the kpt side.
    pub fn prepare(&self, seed: u64) -> Box<dyn Workload> {
        let mut rng = SplitMix64::new(seed);
        match (self.kind, self.prec) {
            (Kind::Gemm { m, k, n }, Prec::F32) => {
                Box::new(Gemm::<f32>::new(&mut rng, m, k, n, cpu::matmul_f32))
            }
            (Kind::Gemm { m, k, n }, Prec::BF16) => {
                Box::new(Gemm::<bf16>::new(&mut rng, m, k, n, cpu::matmul_bf16))
            }
            (Kind::LinearGelu { m, k, n }, _) => Box::new(LinearGelu::new(&mut rng, m, k, n)),
            (
                Kind::Attention {
                    batch,
                    heads,
                    seq,
                    head_dim,
                    causal,
                },
                prec,
            ) => {
                let shape = AttentionShape::new(batch, seq, seq, heads, heads, head_dim, causal);
                match prec {
                    Prec::F32 => Box::new(Attention::<f32>::new(
                        &mut rng,
                        shape,
                        cpu::attention,
                        |_, _, _, s| tolerance(DType::F32, s.seq_kv + s.head_dim),
                    )),
                    Prec::BF16 => Box::new(Attention::<bf16>::new(
                        &mut rng,
                        shape,
                        cpu::attention_bf16,
                        cpu::attention_bf16_tolerance,
                    )),
                }
            }
            (Kind::RmsNorm { rows, dim }, _) => {
                Box::new(RowOp::new(&mut rng, RowKind::Rms, rows, dim))
            }
            (Kind::LayerNorm { rows, dim }, _) => {
                Box::new(RowOp::new(&mut rng, RowKind::Layer, rows, dim))
            }
            (Kind::Softmax { rows, dim }, _) => {
                Box::new(RowOp::new(&mut rng, RowKind::Softmax, rows, dim))
            }
            (
                Kind::Rotary {
                    batch,
                    heads,
                    seq,
                    head_dim,
                },
                _,
            ) => Box::new(Rotary::new(&mut rng, batch, heads, seq, head_dim)),
        }
    }
}

/// The kpt side of a case: inputs and output buffers, ready to run.
pub trait Workload: Send {
    /// One call of the kernel.
    fn run(&mut self) -> Result<()>;
    /// Compares the output of the last run with the f64 reference.
    fn check(&self) -> Result<Check>;
}

/// The outcome of [`Workload::check`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Check {
    /// Largest `|got - want|`.
    pub max_abs_err: f64,
    /// Elements outside the kernel's tolerance (`|err| > abs + rel·|want|`).
    pub failures: usize,
    /// Elements compared.
    pub compared: usize,
}

impl Check {
    fn add(&mut self, got: f64, want: f64, (abs, rel): (f64, f64)) {
        let err = (got - want).abs();
        // NaN compares false: a NaN anywhere counts as a failure and as an infinite error.
        let within = err <= abs + rel * want.abs();
        if !within {
            self.failures += 1;
        }
        self.max_abs_err = if err.is_nan() {
            f64::INFINITY
        } else {
            self.max_abs_err.max(err)
        };
        self.compared += 1;
    }
}

/// An element type of the kpt side's operands.
trait Elem: Copy + Default + Send + Sync + 'static {
    const DTYPE: DType;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Elem for bf16 {
    const DTYPE: DType = DType::BF16;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

fn random<T: Elem>(rng: &mut SplitMix64, len: usize, lo: f32, hi: f32) -> Vec<T> {
    (0..len).map(|_| T::from_f32(rng.uniform(lo, hi))).collect()
}

fn f64s<T: Elem>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// Up to `count` row indices spread evenly over `0..rows` (first and last included).
fn sample_rows(rows: usize, count: usize) -> Vec<usize> {
    let count = count.min(rows);
    if count <= 1 {
        return (0..count).collect();
    }
    (0..count).map(|i| i * (rows - 1) / (count - 1)).collect()
}

/// The rows `idx` of a row-major `[_, cols]` matrix, as f64.
fn gather_rows<T: Elem>(x: &[T], cols: usize, idx: &[usize]) -> Vec<f64> {
    idx.iter()
        .flat_map(|&i| x[i * cols..(i + 1) * cols].iter().map(|v| v.to_f64()))
        .collect()
}

/// Rows of large products checked against the reference (the reference is O(k·n) per row).
const CHECKED_ROWS: usize = 24;

type MatmulFn<T> = fn(&[T], &[T], &mut [T], usize, usize, usize) -> Result<()>;

struct Gemm<T> {
    a: Vec<T>,
    b: Vec<T>,
    out: Vec<T>,
    dims: (usize, usize, usize),
    f: MatmulFn<T>,
}

impl<T: Elem> Gemm<T> {
    fn new(rng: &mut SplitMix64, m: usize, k: usize, n: usize, f: MatmulFn<T>) -> Self {
        Self {
            a: random(rng, m * k, -1.0, 1.0),
            b: random(rng, k * n, -1.0, 1.0),
            out: vec![T::default(); m * n],
            dims: (m, k, n),
            f,
        }
    }
}

impl<T: Elem> Workload for Gemm<T> {
    fn run(&mut self) -> Result<()> {
        let (m, k, n) = self.dims;
        (self.f)(&self.a, &self.b, &mut self.out, m, k, n)
    }

    fn check(&self) -> Result<Check> {
        let (m, k, n) = self.dims;
        let idx = sample_rows(m, CHECKED_ROWS);
        let a = gather_rows(&self.a, k, &idx);
        let mut want = vec![0f64; idx.len() * n];
        r::matmul(&a, &f64s(&self.b), &mut want, idx.len(), k, n)?;
        let got = gather_rows(&self.out, n, &idx);
        let mut c = Check::default();
        let tol = tolerance(T::DTYPE, k);
        got.iter().zip(&want).for_each(|(&g, &w)| c.add(g, w, tol));
        Ok(c)
    }
}

struct LinearGelu {
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
    out: Vec<f32>,
    dims: (usize, usize, usize),
}

impl LinearGelu {
    fn new(rng: &mut SplitMix64, m: usize, k: usize, n: usize) -> Self {
        let bound = 1.0 / (k.max(1) as f32).sqrt();
        Self {
            x: rng.vec(m * k, -1.0, 1.0),
            w: rng.vec(n * k, -bound, bound),
            bias: rng.vec(n, -bound, bound),
            out: vec![0.0; m * n],
            dims: (m, k, n),
        }
    }
}

impl Workload for LinearGelu {
    fn run(&mut self) -> Result<()> {
        let (m, k, n) = self.dims;
        cpu::linear(
            &self.x,
            WeightsRef::F32(&self.w),
            Some(&self.bias),
            Some(Act::GeluTanh),
            &mut self.out,
            m,
            k,
            n,
        )
    }

    fn check(&self) -> Result<Check> {
        let (m, k, n) = self.dims;
        let idx = sample_rows(m, CHECKED_ROWS);
        let x = gather_rows(&self.x, k, &idx);
        let mut want = vec![0f64; idx.len() * n];
        r::linear_act(
            &x,
            &f64s(&self.w),
            Some(&f64s(&self.bias)),
            Some(Act::GeluTanh),
            &mut want,
            idx.len(),
            k,
            n,
        )?;
        let got = gather_rows(&self.out, n, &idx);
        let mut c = Check::default();
        let tol = tolerance(DType::F32, k);
        got.iter().zip(&want).for_each(|(&g, &w)| c.add(g, w, tol));
        Ok(c)
    }
}

type AttentionFn<T> =
    fn(&[T], &[T], &[T], Option<&[f32]>, &mut [T], &AttentionShape, usize, usize) -> Result<()>;

/// The kernel's error bound `(abs, rel)` for the given q, k, v.
type AttentionTol<T> = fn(&[T], &[T], &[T], &AttentionShape) -> (f64, f64);

struct Attention<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    out: Vec<T>,
    shape: AttentionShape,
    f: AttentionFn<T>,
    tol: (f64, f64),
}

impl<T: Elem> Attention<T> {
    fn new(
        rng: &mut SplitMix64,
        shape: AttentionShape,
        f: AttentionFn<T>,
        tol: AttentionTol<T>,
    ) -> Self {
        let q = random(rng, shape.q_len(), -1.0, 1.0);
        let k = random(rng, shape.kv_len(), -1.0, 1.0);
        let v = random(rng, shape.kv_len(), -1.0, 1.0);
        Self {
            tol: tol(&q, &k, &v, &shape),
            q,
            k,
            v,
            out: vec![T::default(); shape.q_len()],
            shape,
            f,
        }
    }

    /// Head `h` of batch `b` of a `[batch, seq, heads * head_dim]` tensor, as f64.
    fn head(&self, x: &[T], b: usize, h: usize) -> Vec<f64> {
        let s = &self.shape;
        let d = s.head_dim;
        (0..s.seq_q)
            .flat_map(|i| {
                let row = (b * s.seq_q + i) * s.q_row() + h * d;
                x[row..row + d].iter().map(|v| v.to_f64())
            })
            .collect()
    }
}

impl<T: Elem> Workload for Attention<T> {
    fn run(&mut self) -> Result<()> {
        (self.f)(
            &self.q,
            &self.k,
            &self.v,
            None,
            &mut self.out,
            &self.shape,
            cpu::DEFAULT_BLOCK_Q,
            cpu::DEFAULT_BLOCK_KV,
        )
    }

    /// The first and last head of the last batch, every query, against the reference.
    fn check(&self) -> Result<Check> {
        let s = self.shape;
        let one = AttentionShape {
            batch: 1,
            num_heads: 1,
            num_kv_heads: 1,
            ..s
        };
        let tol = self.tol;
        let mut c = Check::default();
        let b = s.batch - 1;
        for h in [0, s.num_heads - 1] {
            let mut want = vec![0f64; one.q_len()];
            r::attention(
                &self.head(&self.q, b, h),
                &self.head(&self.k, b, h),
                &self.head(&self.v, b, h),
                None,
                &mut want,
                &one,
            )?;
            let got = self.head(&self.out, b, h);
            got.iter().zip(&want).for_each(|(&g, &w)| c.add(g, w, tol));
        }
        Ok(c)
    }
}

#[derive(Clone, Copy)]
enum RowKind {
    Rms,
    Layer,
    Softmax,
}

struct RowOp {
    kind: RowKind,
    x: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    out: Vec<f32>,
    rows: usize,
    dim: usize,
}

impl RowOp {
    fn new(rng: &mut SplitMix64, kind: RowKind, rows: usize, dim: usize) -> Self {
        let (lo, hi) = match kind {
            RowKind::Softmax => (-5.0, 5.0),
            _ => (-3.0, 3.0),
        };
        Self {
            kind,
            x: rng.vec(rows * dim, lo, hi),
            w: rng.vec(dim, 0.5, 1.5),
            b: rng.vec(dim, -0.5, 0.5),
            out: vec![0.0; rows * dim],
            rows,
            dim,
        }
    }
}

impl Workload for RowOp {
    fn run(&mut self) -> Result<()> {
        let (x, rows, dim) = (&self.x, self.rows, self.dim);
        match self.kind {
            RowKind::Rms => cpu::rms_norm(x, &self.w, &mut self.out, rows, dim, EPS),
            RowKind::Layer => cpu::layer_norm(x, &self.w, &self.b, &mut self.out, rows, dim, EPS),
            RowKind::Softmax => cpu::softmax(x, &mut self.out, rows, dim),
        }
    }

    fn check(&self) -> Result<Check> {
        let (rows, dim) = (self.rows, self.dim);
        let x = f64s(&self.x);
        let mut want = vec![0f64; x.len()];
        match self.kind {
            RowKind::Rms => r::rms_norm(&x, &f64s(&self.w), &mut want, rows, dim, EPS as f64)?,
            RowKind::Layer => r::layer_norm(
                &x,
                &f64s(&self.w),
                &f64s(&self.b),
                &mut want,
                rows,
                dim,
                EPS as f64,
            )?,
            RowKind::Softmax => r::softmax(&x, &mut want, rows, dim)?,
        }
        let mut c = Check::default();
        let tol = tolerance(DType::F32, dim);
        self.out
            .iter()
            .zip(&want)
            .for_each(|(&g, &w)| c.add(g as f64, w, tol));
        Ok(c)
    }
}

struct Rotary {
    x: Vec<f32>,
    positions: Vec<i64>,
    out: Vec<f32>,
    dims: (usize, usize, usize, usize),
}

impl Rotary {
    fn new(rng: &mut SplitMix64, batch: usize, heads: usize, seq: usize, head_dim: usize) -> Self {
        let len = batch * heads * seq * head_dim;
        Self {
            x: rng.vec(len, -1.0, 1.0),
            positions: (0..seq as i64).collect(),
            out: vec![0.0; len],
            dims: (batch, heads, seq, head_dim),
        }
    }
}

impl Workload for Rotary {
    fn run(&mut self) -> Result<()> {
        let (batch, heads, seq, head_dim) = self.dims;
        cpu::rotary(
            &self.x,
            &self.positions,
            &mut self.out,
            batch,
            seq,
            heads,
            head_dim,
            THETA,
            None,
        )
    }

    fn check(&self) -> Result<Check> {
        let (batch, heads, seq, head_dim) = self.dims;
        let mut want = vec![0f64; self.x.len()];
        r::rotary(
            &f64s(&self.x),
            &self.positions,
            &mut want,
            batch,
            seq,
            heads,
            head_dim,
            THETA as f64,
            None,
        )?;
        let mut c = Check::default();
        let tol = tolerance(DType::F32, 2);
        self.out
            .iter()
            .zip(&want)
            .for_each(|(&g, &w)| c.add(g as f64, w, tol));
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_rows_cover_both_ends() {
        assert_eq!(sample_rows(1, 24), vec![0]);
        assert_eq!(sample_rows(3, 24), vec![0, 1, 2]);
        let s = sample_rows(2048, 24);
        assert_eq!((s.len(), s[0], s[23]), (24, 0, 2047));
    }

    #[test]
    fn every_quick_case_runs_and_matches_the_reference() {
        for case in all(true) {
            let mut w = case.prepare(1);
            w.run().unwrap();
            let c = w.check().unwrap();
            assert!(c.compared > 0, "{}", case.name);
            assert_eq!(c.failures, 0, "{}: {c:?}", case.name);
            let (_, work) = case.metric();
            assert!(work > 0.0, "{}", case.name);
        }
    }

    #[test]
    fn a_wrong_result_is_caught() {
        let case = &all(true)[0];
        let w = case.prepare(1);
        // Never ran: the output is still zeros, which the reference disagrees with.
        let c = w.check().unwrap();
        assert!(c.failures > 0);
    }
}
