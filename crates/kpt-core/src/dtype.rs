//! Element types and the FP8 / int8 conversions with scale factors.
//!
//! FP8 follows the OCP 8-bit floating point spec: `F8E4M3` is the "fn" variant
//! (no infinities, one NaN pattern, max finite 448) and `F8E5M2` is IEEE-like
//! (max finite 57344). Conversions from wider types round to nearest, ties to
//! even, and **saturate**: values beyond the largest finite value become that
//! value (as NVIDIA's `__NV_SATFINITE` and Transformer Engine do). NaN stays NaN.

use std::fmt;
use std::str::FromStr;

use crate::error::KptError;

/// The element type of a tensor.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 64-bit float (reference computations).
    F64,
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// FP8 with 4 exponent and 3 mantissa bits, finite-only ("e4m3fn").
    F8E4M3,
    /// FP8 with 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// Signed 8-bit integer (symmetric quantization).
    I8,
    /// 32-bit integer (token ids, positions).
    I32,
    /// 64-bit integer (token ids, positions).
    I64,
}

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 9] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I8,
        DType::I32,
        DType::I64,
    ];

    /// Size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 => 1,
        }
    }

    /// Whether the dtype is a floating point type (FP8 included).
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::I8 | DType::I32 | DType::I64)
    }

    /// Whether values of this dtype carry a scale factor (quantized types).
    pub const fn is_quantized(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2 | DType::I8)
    }

    /// Whether the dtype can hold token ids or positions.
    pub const fn is_index(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// Largest finite value (for quantized types, before scaling).
    pub fn max_finite(self) -> f64 {
        match self {
            DType::F64 => f64::MAX,
            DType::F32 => f32::MAX as f64,
            DType::F16 => half::f16::MAX.to_f64(),
            DType::BF16 => half::bf16::MAX.to_f64(),
            DType::F8E4M3 => 448.0,
            DType::F8E5M2 => 57344.0,
            DType::I8 => 127.0,
            DType::I32 => i32::MAX as f64,
            DType::I64 => i64::MAX as f64,
        }
    }

    /// Unit roundoff (half the distance from 1.0 to the next value); 0 for integers.
    pub fn epsilon(self) -> f64 {
        match self {
            DType::F64 => f64::EPSILON / 2.0,
            DType::F32 => f32::EPSILON as f64 / 2.0,
            DType::F16 => 2f64.powi(-11),
            DType::BF16 => 2f64.powi(-8),
            DType::F8E4M3 => 2f64.powi(-4),
            DType::F8E5M2 => 2f64.powi(-3),
            DType::I8 | DType::I32 | DType::I64 => 0.0,
        }
    }

    /// Canonical lower-case name, as accepted by [`FromStr`].
    pub const fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = KptError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        let dtype = match lower.as_str() {
            "f64" | "float64" | "double" => DType::F64,
            "f32" | "fp32" | "float32" | "float" => DType::F32,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f8e4m3" | "fp8" | "fp8_e4m3" | "e4m3" | "float8_e4m3fn" | "f8e4m3fn" => DType::F8E4M3,
            "f8e5m2" | "fp8_e5m2" | "e5m2" | "float8_e5m2" => DType::F8E5M2,
            "i8" | "int8" => DType::I8,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            _ => return Err(KptError::UnknownDType(s.to_string())),
        };
        Ok(dtype)
    }
}

/// Converts `x` to FP8 E4M3 bits: round to nearest even, saturate to ±448, NaN stays NaN.
pub fn f32_to_f8e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return float8::F8E4M3::NAN.to_bits();
    }
    float8::F8E4M3::from_f32(x.clamp(-448.0, 448.0)).to_bits()
}

/// Converts FP8 E4M3 bits to `f32` (exact).
pub fn f8e4m3_to_f32(bits: u8) -> f32 {
    float8::F8E4M3::from_bits(bits).to_f32()
}

/// Converts `x` to FP8 E5M2 bits: round to nearest even, saturate to ±57344, NaN stays NaN.
pub fn f32_to_f8e5m2(x: f32) -> u8 {
    if x.is_nan() {
        return float8::F8E5M2::NAN.to_bits();
    }
    float8::F8E5M2::from_f32(x.clamp(-57344.0, 57344.0)).to_bits()
}

/// Converts FP8 E5M2 bits to `f32` (exact).
pub fn f8e5m2_to_f32(bits: u8) -> f32 {
    float8::F8E5M2::from_bits(bits).to_f32()
}

/// Converts `x` to int8: round half to even, saturate to [-127, 127] (symmetric).
pub fn f32_to_i8(x: f32) -> i8 {
    if x.is_nan() {
        return 0;
    }
    x.round_ties_even().clamp(-127.0, 127.0) as i8
}

/// The per-tensor scale that maps `amax` onto the largest finite value of `dtype`.
///
/// Quantized values are `stored = x / scale`, dequantized `x = stored * scale`.
/// Returns 1.0 for an all-zero tensor or a non-quantized dtype.
pub fn quant_scale(amax: f32, dtype: DType) -> f32 {
    if !dtype.is_quantized() || amax <= 0.0 || !amax.is_finite() {
        return 1.0;
    }
    (amax as f64 / dtype.max_finite()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest representable value by exhaustive search over all 256 codes, ties to even code.
    fn nearest(x: f64, decode: fn(u8) -> f32, max: f64) -> f64 {
        let x = x.clamp(-max, max);
        let mut best: Option<(f64, u8)> = None;
        for code in 0..=255u8 {
            let v = decode(code) as f64;
            if !v.is_finite() {
                continue;
            }
            let d = (v - x).abs();
            best = match best {
                None => Some((d, code)),
                Some((bd, bc)) if d < bd || (d == bd && code % 2 == 0 && bc % 2 == 1) => {
                    Some((d, code))
                }
                b => b,
            };
        }
        decode(best.expect("some finite code").1) as f64
    }

    #[test]
    fn e4m3_round_trip_every_code() {
        for code in 0..=255u8 {
            let v = f8e4m3_to_f32(code);
            if v.is_nan() {
                continue;
            }
            assert_eq!(f8e4m3_to_f32(f32_to_f8e4m3(v)), v, "code {code:#x}");
        }
    }

    #[test]
    fn e5m2_round_trip_every_finite_code() {
        for code in 0..=255u8 {
            let v = f8e5m2_to_f32(code);
            if !v.is_finite() {
                continue;
            }
            assert_eq!(f8e5m2_to_f32(f32_to_f8e5m2(v)), v, "code {code:#x}");
        }
    }

    #[test]
    fn fp8_saturates_and_keeps_nan() {
        assert_eq!(f8e4m3_to_f32(f32_to_f8e4m3(1e6)), 448.0);
        assert_eq!(f8e4m3_to_f32(f32_to_f8e4m3(-1e6)), -448.0);
        assert_eq!(f8e4m3_to_f32(f32_to_f8e4m3(f32::INFINITY)), 448.0);
        assert_eq!(f8e5m2_to_f32(f32_to_f8e5m2(1e9)), 57344.0);
        assert!(f8e4m3_to_f32(f32_to_f8e4m3(f32::NAN)).is_nan());
        assert!(f8e5m2_to_f32(f32_to_f8e5m2(f32::NAN)).is_nan());
    }

    #[test]
    fn int8_rounds_half_even_and_saturates() {
        assert_eq!(f32_to_i8(2.5), 2);
        assert_eq!(f32_to_i8(3.5), 4);
        assert_eq!(f32_to_i8(-300.0), -127);
        assert_eq!(f32_to_i8(f32::NAN), 0);
    }

    #[test]
    fn scale_maps_amax_to_max_finite() {
        let s = quant_scale(896.0, DType::F8E4M3);
        assert_eq!(s, 2.0);
        assert_eq!(quant_scale(0.0, DType::I8), 1.0);
        assert_eq!(quant_scale(5.0, DType::F32), 1.0);
    }

    #[test]
    fn dtype_names_parse_back() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!(matches!(
            "f7".parse::<DType>(),
            Err(KptError::UnknownDType(_))
        ));
    }

    proptest::proptest! {
        #[test]
        fn e4m3_is_nearest(x in -600.0f32..600.0) {
            let got = f8e4m3_to_f32(f32_to_f8e4m3(x)) as f64;
            let want = nearest(x as f64, f8e4m3_to_f32, 448.0);
            proptest::prop_assert_eq!(got, want);
        }

        #[test]
        fn e5m2_is_nearest(x in -70000.0f32..70000.0) {
            let got = f8e5m2_to_f32(f32_to_f8e5m2(x)) as f64;
            let want = nearest(x as f64, f8e5m2_to_f32, 57344.0);
            proptest::prop_assert_eq!(got, want);
        }
    }
}
