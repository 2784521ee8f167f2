//! kpt's FP8 (OCP e4m3fn / e5m2) as the FNUZ encodings of MI300's (CDNA 3, gfx940/941/942)
//! matrix cores and hipBLASLt's `HIP_R_8F_E4M3_FNUZ` / `HIP_R_8F_E5M2_FNUZ`.
//!
//! The two encodings of a format share sign, exponent and mantissa fields; FNUZ's
//! exponent bias is one larger (8 for e4m3, 16 for e5m2). So every finite non-zero OCP
//! byte, read as FNUZ, is exactly half the value, normals and subnormals alike, and
//! `value = fnuz(b) · 2·scale` for a tensor stored as `ocp(b) · scale`. Three kinds of
//! byte differ: OCP's negative zero (`0x80`) is FNUZ's only NaN, so it becomes `0x00`;
//! OCP's NaNs (e4m3: `0x7f`, `0xff`; e5m2: `0x7d..=0x7f` and the negatives) and e5m2's
//! infinities (`0x7c`, `0xfc`), which are finite values in FNUZ, become the NaN `0x80`
//! (kpt's quantizers saturate, so infinities only come from such input).
//!
//! The conversion runs on the device as a small HIP kernel ([`SOURCE`]) that hiprtc
//! compiles for the processor at run time (no FNUZ path exists without a ROCm that
//! knows gfx942, which brings hiprtc), checked like the shipped code objects.
//! [`ocp_to_fnuz`] is the same mapping on the host, tested over all 256 bytes.

use kpt_core::DType;
use kpt_kernels::artifacts::EntryPoint;

use crate::kernels::{Arg, Launch, Planner};
use crate::AmdError;

/// The kernel name of the conversion's code object (compiled at run time, never shipped).
pub const KERNEL: &str = "fp8_fnuz";

/// The HIP source of the conversion: one grid-stride loop per format.
pub const SOURCE: &str = r#"// kpt: OCP FP8 bytes to FNUZ bytes of half the value (see kpt-amd's fp8.rs).
extern "C" __global__ void __launch_bounds__(256)
kpt_fp8_ocp_to_fnuz_e4m3(const unsigned char* x, unsigned char* out, long n) {
    const long step = (long)blockDim.x * gridDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const unsigned char b = x[i];
        const unsigned char m = b & 0x7f;
        out[i] = m == 0 ? 0 : (m == 0x7f ? 0x80 : b);
    }
}

extern "C" __global__ void __launch_bounds__(256)
kpt_fp8_ocp_to_fnuz_e5m2(const unsigned char* x, unsigned char* out, long n) {
    const long step = (long)blockDim.x * gridDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const unsigned char b = x[i];
        const unsigned char m = b & 0x7f;
        out[i] = m == 0 ? 0 : (m >= 0x7c ? 0x80 : b);
    }
}
"#;

/// The entry points of [`SOURCE`] (256 threads, no dynamic LDS).
pub static ENTRY_POINTS: [EntryPoint; 2] = [
    EntryPoint {
        name: "kpt_fp8_ocp_to_fnuz_e4m3",
        block: 256,
        shared_bytes: 0,
        grid: "elements",
    },
    EntryPoint {
        name: "kpt_fp8_ocp_to_fnuz_e5m2",
        block: 256,
        shared_bytes: 0,
        grid: "elements",
    },
];

/// The FNUZ byte holding half the value of OCP byte `b` of `dtype` (f8e4m3 or f8e5m2);
/// NaN (`0x80`) for OCP NaN and infinity.
pub fn ocp_to_fnuz(dtype: DType, b: u8) -> Result<u8, AmdError> {
    let m = b & 0x7f;
    let special = match dtype {
        DType::F8E4M3 => m == 0x7f,
        DType::F8E5M2 => m >= 0x7c,
        d => return Err(AmdError::Invalid(format!("{d} is not an FP8 dtype"))),
    };
    Ok(if m == 0 {
        0
    } else if special {
        0x80
    } else {
        b
    })
}

/// The value of FNUZ byte `b` of `dtype` (f8e4m3 or f8e5m2): bias 8 or 16, no
/// infinities, `0x80` the only NaN.
pub fn fnuz_value(dtype: DType, b: u8) -> Result<f64, AmdError> {
    let (mantissa_bits, bias) = match dtype {
        DType::F8E4M3 => (3, 8),
        DType::F8E5M2 => (2, 16),
        d => return Err(AmdError::Invalid(format!("{d} is not an FP8 dtype"))),
    };
    if b == 0x80 {
        return Ok(f64::NAN);
    }
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b & 0x7f) >> mantissa_bits);
    let m = f64::from(b & ((1 << mantissa_bits) - 1)) / f64::from(1u8 << mantissa_bits);
    let v = if e == 0 {
        m * 2f64.powi(1 - bias)
    } else {
        (1.0 + m) * 2f64.powi(e - bias)
    };
    Ok(sign * v)
}

/// The launch converting `n` OCP bytes of `dtype` at `x` to FNUZ at `out`.
pub fn plan(
    planner: &Planner,
    dtype: DType,
    [x, out]: [u64; 2],
    n: usize,
) -> Result<Launch, AmdError> {
    let entry = match dtype {
        DType::F8E4M3 => "kpt_fp8_ocp_to_fnuz_e4m3",
        DType::F8E5M2 => "kpt_fp8_ocp_to_fnuz_e5m2",
        d => return Err(AmdError::Invalid(format!("{d} is not an FP8 dtype"))),
    };
    if n == 0 {
        return Err(AmdError::Invalid("nothing to convert".into()));
    }
    let n = i64::try_from(n).map_err(|_| AmdError::Invalid(format!("{n} bytes")))?;
    let most = planner.compute_units.max(1) as usize * 16;
    let grid = (n as usize).div_ceil(256 * 16).clamp(1, most) as u32;
    Ok(Launch {
        kernel: KERNEL.into(),
        entry: entry.into(),
        grid,
        args: vec![Arg::Ptr(x), Arg::Ptr(out), Arg::I64(n)],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kpt_core::tensor::Tensor;

    /// Every OCP byte of both formats, decoded by kpt-core, against the FNUZ decode of
    /// its converted byte at twice the scale.
    #[test]
    fn every_byte_keeps_its_value_at_twice_the_scale() {
        for dtype in [DType::F8E4M3, DType::F8E5M2] {
            let bytes: Vec<u8> = (0..=255).collect();
            let ocp = Tensor::from_bytes(&bytes, dtype, &[256])
                .unwrap()
                .to_f64_vec();
            for (b, want) in bytes.iter().zip(ocp) {
                let got = 2.0 * fnuz_value(dtype, ocp_to_fnuz(dtype, *b).unwrap()).unwrap();
                if want.is_nan() || want.is_infinite() {
                    assert!(got.is_nan(), "{dtype} {b:#04x}: {want} -> {got}");
                } else {
                    // Negative zero becomes +0 (FNUZ has none); -0.0 == 0.0.
                    assert_eq!(got, want, "{dtype} {b:#04x}");
                }
            }
        }
        // The largest finite values: 448 (e4m3fn) and 57344 (e5m2).
        assert_eq!(2.0 * fnuz_value(DType::F8E4M3, 0x7e).unwrap(), 448.0);
        assert_eq!(2.0 * fnuz_value(DType::F8E5M2, 0x7b).unwrap(), 57344.0);
        assert!(ocp_to_fnuz(DType::BF16, 0).is_err());
    }

    /// The kernel source encodes the same mapping as [`ocp_to_fnuz`]: its two special
    /// cases, byte for byte.
    #[test]
    fn the_source_names_both_entry_points_and_the_same_special_bytes() {
        for e in &ENTRY_POINTS {
            assert!(SOURCE.contains(&format!("{}(", e.name)), "{}", e.name);
        }
        assert!(SOURCE.contains("m == 0x7f ? 0x80 : b"));
        assert!(SOURCE.contains("m >= 0x7c ? 0x80 : b"));
        let p = Planner { compute_units: 304 };
        let l = plan(&p, DType::F8E4M3, [16, 32], 1 << 20).unwrap();
        assert_eq!(l.layout(), [(0, 8), (8, 8), (16, 8)]);
        assert_eq!(l.grid, 256);
        assert!(plan(&p, DType::I8, [16, 32], 4).is_err());
    }
}
