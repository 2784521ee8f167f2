//! Rotary scaling: the inverse-frequency table of [`Op::Rotary`](super::Op::Rotary).
//!
//! [`rope_frequencies`] is the one place that turns `(head_dim, theta, scaling)` into
//! the per-pair inverse frequencies and the factor applied to cos/sin; the f64
//! reference, the CPU kernel and the CUDA backend all call it, so they cannot disagree.
//! The formulas are those of Hugging Face transformers' `modeling_rope_utils.py`
//! (`default`, `linear`, `dynamic`, `llama3`, `yarn`), evaluated in f64.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use crate::error::Result;

/// How a rotary embedding's frequencies are scaled for contexts longer than the
/// trained one (Hugging Face's `rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear {
        /// Scale factor (> 0).
        factor: f64,
    },
    /// Dynamic NTK: once the running sequence (the largest position + 1) is longer
    /// than `max_position_embeddings`, the base grows to
    /// `theta * (factor * len / max - (factor - 1))^(d / (d - 2))`. The table depends
    /// on the positions of each call.
    Dynamic {
        /// Scale factor (> 0).
        factor: f64,
        /// The model's `max_position_embeddings`.
        max_position_embeddings: usize,
    },
    /// LLaMA 3.1: wavelengths above `original / low_freq_factor` are divided by
    /// `factor`, those below `original / high_freq_factor` kept, and the band between
    /// interpolated smoothly.
    Llama3 {
        /// Scale factor (> 0).
        factor: f64,
        /// Bound of the scaled (long-wavelength) band; > 0.
        low_freq_factor: f64,
        /// Bound of the unscaled (short-wavelength) band; > `low_freq_factor`.
        high_freq_factor: f64,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
    },
    /// YaRN: a ramp between interpolated (divided by `factor`) and extrapolated
    /// frequencies over the dimensions between the `beta_fast` and `beta_slow`
    /// rotation counts, and cos/sin multiplied by an attention factor.
    Yarn {
        /// Scale factor (> 0).
        factor: f64,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
        /// Rotations that bound the extrapolated band (Hugging Face's default 32).
        #[serde(default = "default_beta_fast")]
        beta_fast: f64,
        /// Rotations that bound the interpolated band (Hugging Face's default 1).
        #[serde(default = "default_beta_slow")]
        beta_slow: f64,
        /// The cos/sin factor; `None` derives it from `factor`, `mscale` and
        /// `mscale_all_dim` as Hugging Face does.
        #[serde(default)]
        attention_factor: Option<f64>,
        /// DeepSeek-style numerator scale of the derived attention factor.
        #[serde(default)]
        mscale: Option<f64>,
        /// DeepSeek-style denominator scale of the derived attention factor.
        #[serde(default)]
        mscale_all_dim: Option<f64>,
        /// Whether the ramp's bounds are rounded to whole dimensions (Hugging Face's
        /// default `true`).
        #[serde(default = "default_truncate")]
        truncate: bool,
    },
}

fn default_beta_fast() -> f64 {
    32.0
}

fn default_beta_slow() -> f64 {
    1.0
}

fn default_truncate() -> bool {
    true
}

/// A rotary scaling that cannot be evaluated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RopeScalingError {
    /// `factor` is not a finite number > 0.
    #[error("{kind} rope scaling: factor must be finite and > 0, got {factor}")]
    Factor {
        /// The scaling type.
        kind: &'static str,
        /// The factor given.
        factor: f64,
    },
    /// LLaMA 3's band bounds are not `0 < low_freq_factor < high_freq_factor`.
    #[error(
        "llama3 rope scaling: need 0 < low_freq_factor < high_freq_factor, got {low} and {high}"
    )]
    FreqFactors {
        /// `low_freq_factor`.
        low: f64,
        /// `high_freq_factor`.
        high: f64,
    },
    /// Another parameter out of its domain.
    #[error("{kind} rope scaling: {field} {message}")]
    Parameter {
        /// The scaling type.
        kind: &'static str,
        /// The parameter.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// `theta` is not finite and > 0 (or is 1 for YaRN, whose ramp divides by ln theta).
    #[error("rotary theta must be finite and > 0 (and not 1 for yarn), got {0}")]
    Theta(f64),
    /// `head_dim` is zero or odd (or 2 for dynamic NTK, whose base exponent is d / (d - 2)).
    #[error("rotary head_dim must be even and non-zero (and > 2 for dynamic), got {0}")]
    HeadDim(usize),
}

impl RopeScaling {
    /// The scaling type's name (Hugging Face's `rope_type`).
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// The scale factor.
    pub fn factor(&self) -> f64 {
        match *self {
            RopeScaling::Linear { factor }
            | RopeScaling::Dynamic { factor, .. }
            | RopeScaling::Llama3 { factor, .. }
            | RopeScaling::Yarn { factor, .. } => factor,
        }
    }

    /// Whether the table depends on the positions of each call (dynamic NTK).
    pub fn depends_on_positions(&self) -> bool {
        matches!(self, RopeScaling::Dynamic { .. })
    }

    /// Checks every parameter against `head_dim` and `theta`.
    pub fn validate(&self, head_dim: usize, theta: f64) -> Result<(), RopeScalingError> {
        check_base(head_dim, theta)?;
        let kind = self.name();
        let factor = self.factor();
        if !factor.is_finite() || factor <= 0.0 {
            return Err(RopeScalingError::Factor { kind, factor });
        }
        let positive_len = |field: &'static str, v: usize| {
            if v == 0 {
                Err(RopeScalingError::Parameter {
                    kind,
                    field,
                    message: "must be > 0".into(),
                })
            } else {
                Ok(())
            }
        };
        let finite_positive = |field: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(RopeScalingError::Parameter {
                    kind,
                    field,
                    message: format!("must be finite and > 0, got {v}"),
                })
            }
        };
        match *self {
            RopeScaling::Linear { .. } => Ok(()),
            RopeScaling::Dynamic {
                max_position_embeddings,
                ..
            } => {
                if head_dim <= 2 {
                    return Err(RopeScalingError::HeadDim(head_dim));
                }
                positive_len("max_position_embeddings", max_position_embeddings)
            }
            RopeScaling::Llama3 {
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings,
                ..
            } => {
                if !(low.is_finite() && high.is_finite() && low > 0.0 && low < high) {
                    return Err(RopeScalingError::FreqFactors { low, high });
                }
                positive_len(
                    "original_max_position_embeddings",
                    original_max_position_embeddings,
                )
            }
            RopeScaling::Yarn {
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                ..
            } => {
                if theta == 1.0 {
                    return Err(RopeScalingError::Theta(theta));
                }
                positive_len(
                    "original_max_position_embeddings",
                    original_max_position_embeddings,
                )?;
                finite_positive("beta_fast", beta_fast)?;
                finite_positive("beta_slow", beta_slow)?;
                if let Some(a) = attention_factor {
                    finite_positive("attention_factor", a)?;
                }
                for (field, v) in [("mscale", mscale), ("mscale_all_dim", mscale_all_dim)] {
                    if v.is_some_and(|v| !v.is_finite()) {
                        return Err(RopeScalingError::Parameter {
                            kind,
                            field,
                            message: format!("must be finite, got {v:?}"),
                        });
                    }
                }
                // The derived factor divides by get_mscale(factor, mscale_all_dim).
                if yarn_attention_factor(factor, attention_factor, mscale, mscale_all_dim) <= 0.0 {
                    return Err(RopeScalingError::Parameter {
                        kind,
                        field: "mscale",
                        message: "gives an attention factor <= 0".into(),
                    });
                }
                Ok(())
            }
        }
    }
}

fn check_base(head_dim: usize, theta: f64) -> Result<(), RopeScalingError> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(RopeScalingError::HeadDim(head_dim));
    }
    if !theta.is_finite() || theta <= 0.0 {
        return Err(RopeScalingError::Theta(theta));
    }
    Ok(())
}

/// Hugging Face's `get_mscale`: `0.1 * mscale * ln(scale) + 1` for `scale > 1`, else 1.
fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// YaRN's cos/sin factor: the given one, else the ratio of `get_mscale` with `mscale`
/// and `mscale_all_dim` when both are set and non-zero (Python truthiness), else
/// `get_mscale(factor, 1)`.
fn yarn_attention_factor(
    factor: f64,
    attention_factor: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
) -> f64 {
    if let Some(a) = attention_factor {
        return a;
    }
    match (mscale, mscale_all_dim) {
        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
            get_mscale(factor, m) / get_mscale(factor, all)
        }
        _ => get_mscale(factor, 1.0),
    }
}

/// The table a rotary kernel needs: for pair `i < head_dim / 2` the angle at position
/// `p` is `p * inv_freq[i]`, and the outputs use `cos * attention_factor` and
/// `sin * attention_factor`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFrequencies {
    /// One inverse frequency per rotated pair (`head_dim / 2` entries).
    pub inv_freq: Vec<f64>,
    /// Factor on cos and sin (1 except for YaRN).
    pub attention_factor: f64,
}

/// The running sequence length of dynamic NTK scaling for a call at `positions`: the
/// largest position + 1 (0 for no positions), as Hugging Face's `dynamic_rope_update`
/// takes it from `position_ids`.
pub fn rope_seq_len(positions: &[i64]) -> usize {
    positions
        .iter()
        .copied()
        .max()
        .map_or(0, |m| usize::try_from(m.saturating_add(1)).unwrap_or(0))
}

/// The inverse frequencies and cos/sin factor of a rotary embedding of `head_dim` with
/// base `theta` and optional `scaling`, in f64. `seq_len` is the running sequence length
/// ([`rope_seq_len`] of the call's positions); only dynamic NTK reads it.
///
/// Unscaled: `inv_freq[i] = theta^(-2i / head_dim)`. Errors: an odd or zero
/// `head_dim`, a `theta` that is not finite and positive, or any parameter that
/// [`RopeScaling::validate`] rejects.
pub fn rope_frequencies(
    head_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
    seq_len: usize,
) -> Result<RopeFrequencies> {
    check_base(head_dim, theta)?;
    if let Some(s) = scaling {
        s.validate(head_dim, theta)?;
    }
    let half = head_dim / 2;
    let d = head_dim as f64;
    let default =
        |base: f64| -> Vec<f64> { (0..half).map(|i| base.powf(-2.0 * i as f64 / d)).collect() };
    let mut attention_factor = 1.0;
    let inv_freq = match scaling.copied() {
        None => default(theta),
        Some(RopeScaling::Linear { factor }) => {
            default(theta).into_iter().map(|f| f / factor).collect()
        }
        Some(RopeScaling::Dynamic {
            factor,
            max_position_embeddings,
        }) => {
            let max = max_position_embeddings as f64;
            let len = (seq_len as f64).max(max);
            let base = theta * (factor * len / max - (factor - 1.0)).powf(d / (d - 2.0));
            default(base)
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old = original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            default(theta)
                .into_iter()
                .map(|f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor: given,
            mscale,
            mscale_all_dim,
            truncate,
        }) => {
            attention_factor = yarn_attention_factor(factor, given, mscale, mscale_all_dim);
            let orig = original_max_position_embeddings as f64;
            // The dimension at which a frequency makes `rotations` turns over `orig`.
            let correction_dim =
                |rotations: f64| d * (orig / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln());
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let mut high = high.min(d - 1.0);
            if low == high {
                high += 0.001;
            }
            (0..half)
                .map(|i| {
                    let extrapolation = theta.powf(-2.0 * i as f64 / d);
                    let interpolation = extrapolation / factor;
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    // 1 - ramp of the extrapolated frequency, ramp of the interpolated one.
                    interpolation * ramp + extrapolation * (1.0 - ramp)
                })
                .collect()
        }
    };
    Ok(RopeFrequencies {
        inv_freq,
        attention_factor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KptError;

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                ((g - w) / w).abs() < 1e-12,
                "entry {i}: got {g:e}, want {w:e}"
            );
        }
    }

    #[test]
    fn unscaled_is_theta_powers() {
        let t = rope_frequencies(8, 10_000.0, None, 0).unwrap();
        close(&t.inv_freq, &[1.0, 0.1, 0.01, 0.001]);
        assert_eq!(t.attention_factor, 1.0);
    }

    #[test]
    fn linear_divides_by_factor() {
        let s = RopeScaling::Linear { factor: 4.0 };
        let t = rope_frequencies(8, 10_000.0, Some(&s), 0).unwrap();
        close(&t.inv_freq, &[0.25, 0.025, 0.0025, 0.00025]);
    }

    #[test]
    fn llama3_matches_independent_values() {
        // LLaMA 3.1 8B's parameters: head_dim 128, theta 500000, factor 8, low 1,
        // high 4, original 8192. Expected values computed independently with Python 3
        // (math module, f64), from Hugging Face's `_compute_llama3_parameters`:
        //   inv = [500000 ** (-2*i/128) for i in range(64)]
        //   wl = 2*pi/f; keep if wl < 2048, f/8 if wl > 8192, else
        //   s = (8192/wl - 1)/3; (1-s)*f/8 + s*f
        // Entries 0, 15, 27 (kept: wavelength < 2048), 29, 31, 33 (the smoothed band)
        // and 63 (divided by 8).
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let t = rope_frequencies(128, 500_000.0, Some(&s), 0).unwrap();
        assert_eq!(t.inv_freq.len(), 64);
        let idx = [0, 15, 27, 29, 31, 33, 63];
        let got: Vec<f64> = idx.iter().map(|&i| t.inv_freq[i]).collect();
        close(&got, &LLAMA3_EXPECTED);
        assert_eq!(t.attention_factor, 1.0);
    }

    // See `llama3_matches_independent_values`.
    const LLAMA3_EXPECTED: [f64; 7] = [
        1.0,
        0.04616405026546052,
        0.003942276030116656,
        0.002166570763503359,
        0.0008567514129196321,
        0.00031269375038406517,
        3.068925988914511e-07,
    ];

    #[test]
    fn yarn_matches_independent_values() {
        // Qwen2.5-style YaRN: head_dim 128, theta 1e6, factor 4, original 32768,
        // beta 32/1, truncate. Expected values computed independently with Python 3
        // (math module, f64), from Hugging Face's `_compute_yarn_parameters`:
        //   cd(r) = 128*ln(32768/(r*2*pi))/(2*ln(1e6)); low = max(floor(cd(32)), 0),
        //   high = min(ceil(cd(1)), 127); ramp_i = clamp((i-low)/(high-low), 0, 1)
        //   inv_i = ext_i/4 * ramp_i + ext_i * (1 - ramp_i), ext_i = 1e6 ** (-2i/128)
        //   attention factor = 0.1*ln(4) + 1
        // (low = 23, high = 40: entries 0 and 23 extrapolated, 30 and 31 on the ramp,
        // 40 and 63 interpolated.)
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32_768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let t = rope_frequencies(128, 1e6, Some(&s), 0).unwrap();
        let idx = [0, 23, 30, 31, 40, 63];
        let got: Vec<f64> = idx.iter().map(|&i| t.inv_freq[i]).collect();
        close(&got, &YARN_EXPECTED);
        assert!((t.attention_factor - YARN_ATTENTION).abs() < 1e-15);
    }

    // See `yarn_matches_independent_values`.
    const YARN_EXPECTED: [f64; 6] = [
        1.0,
        0.006978305848598663,
        0.001064360981247002,
        0.0008029597275452302,
        4.445698525097307e-05,
        3.102344401879299e-07,
    ];
    const YARN_ATTENTION: f64 = 1.138629436111989;

    #[test]
    fn dynamic_grows_base_past_max_positions() {
        let s = RopeScaling::Dynamic {
            factor: 2.0,
            max_position_embeddings: 100,
        };
        // Within the trained length: unscaled.
        let short = rope_frequencies(8, 10_000.0, Some(&s), 100).unwrap();
        close(&short.inv_freq, &[1.0, 0.1, 0.01, 0.001]);
        // len 200: base = 10000 * (2*200/100 - 1)^(8/6) = 10000 * 3^(4/3).
        let long = rope_frequencies(8, 10_000.0, Some(&s), 200).unwrap();
        let base = 10_000.0 * 3f64.powf(4.0 / 3.0);
        let want: Vec<f64> = (0..4).map(|i| base.powf(-2.0 * i as f64 / 8.0)).collect();
        close(&long.inv_freq, &want);
    }

    #[test]
    fn seq_len_is_max_position_plus_one() {
        assert_eq!(rope_seq_len(&[3, 9, 2]), 10);
        assert_eq!(rope_seq_len(&[]), 0);
        assert_eq!(rope_seq_len(&[-5]), 0);
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        let bad = [
            RopeScaling::Linear { factor: 0.0 },
            RopeScaling::Linear { factor: f64::NAN },
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 4.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 0,
            },
            RopeScaling::Dynamic {
                factor: -1.0,
                max_position_embeddings: 10,
            },
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 100,
                beta_fast: 0.0,
                beta_slow: 1.0,
                attention_factor: None,
                mscale: None,
                mscale_all_dim: None,
                truncate: true,
            },
        ];
        for s in bad {
            let err = rope_frequencies(8, 10_000.0, Some(&s), 0).unwrap_err();
            assert!(matches!(err, KptError::RopeScaling(_)), "{s:?}: {err}");
        }
        let dynamic = RopeScaling::Dynamic {
            factor: 2.0,
            max_position_embeddings: 10,
        };
        assert!(matches!(
            dynamic.validate(2, 10_000.0),
            Err(RopeScalingError::HeadDim(2))
        ));
        assert!(matches!(
            rope_frequencies(7, 10_000.0, None, 0),
            Err(KptError::RopeScaling(RopeScalingError::HeadDim(7)))
        ));
        assert!(rope_frequencies(8, 0.0, None, 0).is_err());
    }

    #[test]
    fn serde_round_trip_with_defaults() {
        let s: RopeScaling = serde_json::from_str(
            r#"{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}"#,
        )
        .unwrap();
        assert_eq!(
            s,
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: None,
                mscale: None,
                mscale_all_dim: None,
                truncate: true,
            }
        );
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<RopeScaling>(&text).unwrap(), s);
    }
}
