//! Error functions: `erf`/`erfc` in f64 (< 1 ulp) and f32 (< 1 ulp), used by exact GELU.
//!
//! Ported from FreeBSD msun `s_erf.c` / `s_erff.c` (via the `libm` crate, MIT):
//!
//! > Copyright (C) 1993 by Sun Microsystems, Inc. All rights reserved.
//! > Developed at SunPro, a Sun Microsystems, Inc. business.
//! > Permission to use, copy, modify, and distribute this software is freely granted,
//! > provided that this notice is preserved.
//!
//! Method: on `|x| < 0.84375` a rational approximation of `(erf(x) - x) / x`; on
//! `[0.84375, 1.25)` one of `erf(1 + s) - erf(1)`; beyond, `erfc(x) = exp(-x² - 0.5625 +
//! R(1/x²)) / x`. The polynomial errors are below 2⁻⁵⁷, so the total error is about
//! one ulp (well under 1e-15 absolute in f64).

#![allow(clippy::excessive_precision, clippy::unreadable_literal)]

/// f64 coefficients.
mod c64 {
    pub(super) const ERX: f64 = 8.45062911510467529297e-01;
    pub(super) const EFX8: f64 = 1.02703333676410069053e+00;
    pub(super) const PP0: f64 = 1.28379167095512558561e-01;
    pub(super) const PP1: f64 = -3.25042107247001499370e-01;
    pub(super) const PP2: f64 = -2.84817495755985104766e-02;
    pub(super) const PP3: f64 = -5.77027029648944159157e-03;
    pub(super) const PP4: f64 = -2.37630166566501626084e-05;
    pub(super) const QQ1: f64 = 3.97917223959155352819e-01;
    pub(super) const QQ2: f64 = 6.50222499887672944485e-02;
    pub(super) const QQ3: f64 = 5.08130628187576562776e-03;
    pub(super) const QQ4: f64 = 1.32494738004321644526e-04;
    pub(super) const QQ5: f64 = -3.96022827877536812320e-06;
    pub(super) const PA0: f64 = -2.36211856075265944077e-03;
    pub(super) const PA1: f64 = 4.14856118683748331666e-01;
    pub(super) const PA2: f64 = -3.72207876035701323847e-01;
    pub(super) const PA3: f64 = 3.18346619901161753674e-01;
    pub(super) const PA4: f64 = -1.10894694282396677476e-01;
    pub(super) const PA5: f64 = 3.54783043256182359371e-02;
    pub(super) const PA6: f64 = -2.16637559486879084300e-03;
    pub(super) const QA1: f64 = 1.06420880400844228286e-01;
    pub(super) const QA2: f64 = 5.40397917702171048937e-01;
    pub(super) const QA3: f64 = 7.18286544141962662868e-02;
    pub(super) const QA4: f64 = 1.26171219808761642112e-01;
    pub(super) const QA5: f64 = 1.36370839120290507362e-02;
    pub(super) const QA6: f64 = 1.19844998467991074170e-02;
    pub(super) const RA0: f64 = -9.86494403484714822705e-03;
    pub(super) const RA1: f64 = -6.93858572707181764372e-01;
    pub(super) const RA2: f64 = -1.05586262253232909814e+01;
    pub(super) const RA3: f64 = -6.23753324503260060396e+01;
    pub(super) const RA4: f64 = -1.62396669462573470355e+02;
    pub(super) const RA5: f64 = -1.84605092906711035994e+02;
    pub(super) const RA6: f64 = -8.12874355063065934246e+01;
    pub(super) const RA7: f64 = -9.81432934416914548592e+00;
    pub(super) const SA1: f64 = 1.96512716674392571292e+01;
    pub(super) const SA2: f64 = 1.37657754143519042600e+02;
    pub(super) const SA3: f64 = 4.34565877475229228821e+02;
    pub(super) const SA4: f64 = 6.45387271733267880336e+02;
    pub(super) const SA5: f64 = 4.29008140027567833386e+02;
    pub(super) const SA6: f64 = 1.08635005541779435134e+02;
    pub(super) const SA7: f64 = 6.57024977031928170135e+00;
    pub(super) const SA8: f64 = -6.04244152148580987438e-02;
    pub(super) const RB0: f64 = -9.86494292470009928597e-03;
    pub(super) const RB1: f64 = -7.99283237680523006574e-01;
    pub(super) const RB2: f64 = -1.77579549177547519889e+01;
    pub(super) const RB3: f64 = -1.60636384855821916062e+02;
    pub(super) const RB4: f64 = -6.37566443368389627722e+02;
    pub(super) const RB5: f64 = -1.02509513161107724954e+03;
    pub(super) const RB6: f64 = -4.83519191608651397019e+02;
    pub(super) const SB1: f64 = 3.03380607434824582924e+01;
    pub(super) const SB2: f64 = 3.25792512996573918826e+02;
    pub(super) const SB3: f64 = 1.53672958608443695994e+03;
    pub(super) const SB4: f64 = 3.19985821950859553908e+03;
    pub(super) const SB5: f64 = 2.55305040643316442583e+03;
    pub(super) const SB6: f64 = 4.74528541206955367215e+02;
    pub(super) const SB7: f64 = -2.24409524465858183362e+01;
}

/// f32 coefficients.
mod c32 {
    pub(super) const ERX: f32 = 8.4506291151e-01;
    pub(super) const EFX8: f32 = 1.0270333290e+00;
    pub(super) const PP0: f32 = 1.2837916613e-01;
    pub(super) const PP1: f32 = -3.2504209876e-01;
    pub(super) const PP2: f32 = -2.8481749818e-02;
    pub(super) const PP3: f32 = -5.7702702470e-03;
    pub(super) const PP4: f32 = -2.3763017452e-05;
    pub(super) const QQ1: f32 = 3.9791721106e-01;
    pub(super) const QQ2: f32 = 6.5022252500e-02;
    pub(super) const QQ3: f32 = 5.0813062117e-03;
    pub(super) const QQ4: f32 = 1.3249473704e-04;
    pub(super) const QQ5: f32 = -3.9602282413e-06;
    pub(super) const PA0: f32 = -2.3621185683e-03;
    pub(super) const PA1: f32 = 4.1485610604e-01;
    pub(super) const PA2: f32 = -3.7220788002e-01;
    pub(super) const PA3: f32 = 3.1834661961e-01;
    pub(super) const PA4: f32 = -1.1089469492e-01;
    pub(super) const PA5: f32 = 3.5478305072e-02;
    pub(super) const PA6: f32 = -2.1663755178e-03;
    pub(super) const QA1: f32 = 1.0642088205e-01;
    pub(super) const QA2: f32 = 5.4039794207e-01;
    pub(super) const QA3: f32 = 7.1828655899e-02;
    pub(super) const QA4: f32 = 1.2617121637e-01;
    pub(super) const QA5: f32 = 1.3637083583e-02;
    pub(super) const QA6: f32 = 1.1984500103e-02;
    pub(super) const RA0: f32 = -9.8649440333e-03;
    pub(super) const RA1: f32 = -6.9385856390e-01;
    pub(super) const RA2: f32 = -1.0558626175e+01;
    pub(super) const RA3: f32 = -6.2375331879e+01;
    pub(super) const RA4: f32 = -1.6239666748e+02;
    pub(super) const RA5: f32 = -1.8460508728e+02;
    pub(super) const RA6: f32 = -8.1287437439e+01;
    pub(super) const RA7: f32 = -9.8143291473e+00;
    pub(super) const SA1: f32 = 1.9651271820e+01;
    pub(super) const SA2: f32 = 1.3765776062e+02;
    pub(super) const SA3: f32 = 4.3456588745e+02;
    pub(super) const SA4: f32 = 6.4538726807e+02;
    pub(super) const SA5: f32 = 4.2900814819e+02;
    pub(super) const SA6: f32 = 1.0863500214e+02;
    pub(super) const SA7: f32 = 6.5702495575e+00;
    pub(super) const SA8: f32 = -6.0424413532e-02;
    pub(super) const RB0: f32 = -9.8649431020e-03;
    pub(super) const RB1: f32 = -7.9928326607e-01;
    pub(super) const RB2: f32 = -1.7757955551e+01;
    pub(super) const RB3: f32 = -1.6063638306e+02;
    pub(super) const RB4: f32 = -6.3756646729e+02;
    pub(super) const RB5: f32 = -1.0250950928e+03;
    pub(super) const RB6: f32 = -4.8351919556e+02;
    pub(super) const SB1: f32 = 3.0338060379e+01;
    pub(super) const SB2: f32 = 3.2579251099e+02;
    pub(super) const SB3: f32 = 1.5367296143e+03;
    pub(super) const SB4: f32 = 3.1998581543e+03;
    pub(super) const SB5: f32 = 2.5530502930e+03;
    pub(super) const SB6: f32 = 4.7452853394e+02;
    pub(super) const SB7: f32 = -2.2440952301e+01;
}

/// `erfc(|x|)` for `0.84375 <= |x| < 28` (f64).
fn erfc_tail(x: f64) -> f64 {
    use c64::*;
    let ax = x.abs();
    if ax < 1.25 {
        let s = ax - 1.0;
        let p = PA0 + s * (PA1 + s * (PA2 + s * (PA3 + s * (PA4 + s * (PA5 + s * PA6)))));
        let q = 1.0 + s * (QA1 + s * (QA2 + s * (QA3 + s * (QA4 + s * (QA5 + s * QA6)))));
        return 1.0 - ERX - p / q;
    }
    let s = 1.0 / (ax * ax);
    let (r, big_s) = if ax < 1.0 / 0.35 {
        (
            RA0 + s * (RA1 + s * (RA2 + s * (RA3 + s * (RA4 + s * (RA5 + s * (RA6 + s * RA7)))))),
            1.0 + s
                * (SA1
                    + s * (SA2
                        + s * (SA3 + s * (SA4 + s * (SA5 + s * (SA6 + s * (SA7 + s * SA8))))))),
        )
    } else {
        (
            RB0 + s * (RB1 + s * (RB2 + s * (RB3 + s * (RB4 + s * (RB5 + s * RB6))))),
            1.0 + s * (SB1 + s * (SB2 + s * (SB3 + s * (SB4 + s * (SB5 + s * (SB6 + s * SB7)))))),
        )
    };
    // z = ax with the low 32 bits cleared, so that z*z is exact.
    let z = f64::from_bits(ax.to_bits() & 0xffff_ffff_0000_0000);
    (-z * z - 0.5625).exp() * ((z - ax) * (z + ax) + r / big_s).exp() / ax
}

/// `(erf(x) - x) / x` for `|x| < 0.84375` (f64).
fn erf_small_ratio(x: f64) -> f64 {
    use c64::*;
    let z = x * x;
    let r = PP0 + z * (PP1 + z * (PP2 + z * (PP3 + z * PP4)));
    let s = 1.0 + z * (QQ1 + z * (QQ2 + z * (QQ3 + z * (QQ4 + z * QQ5))));
    r / s
}

/// The error function `erf(x) = 2/√π ∫₀ˣ e^(-t²) dt` in f64 (about 1 ulp).
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    if ax < 0.84375 {
        if ax < 2f64.powi(-28) {
            return 0.125 * (8.0 * x + c64::EFX8 * x);
        }
        return x + x * erf_small_ratio(x);
    }
    let y = if ax < 6.0 { 1.0 - erfc_tail(ax) } else { 1.0 };
    y.copysign(x)
}

/// The complementary error function `erfc(x) = 1 - erf(x)` in f64, accurate (about
/// 1 ulp) also where `erf(x)` is close to 1.
pub fn erfc(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    if ax < 0.84375 {
        if ax < 2f64.powi(-56) {
            return 1.0 - x;
        }
        let y = erf_small_ratio(x);
        if x < 0.25 {
            return 1.0 - (x + x * y);
        }
        return 0.5 - (x - 0.5 + x * y);
    }
    if ax < 28.0 {
        let t = erfc_tail(ax);
        return if x < 0.0 { 2.0 - t } else { t };
    }
    if x < 0.0 {
        2.0
    } else {
        0.0
    }
}

/// `erfc(|x|)` for `0.84375 <= |x| < 28` (f32).
fn erfcf_tail(x: f32) -> f32 {
    use c32::*;
    let ax = x.abs();
    if ax < 1.25 {
        let s = ax - 1.0;
        let p = PA0 + s * (PA1 + s * (PA2 + s * (PA3 + s * (PA4 + s * (PA5 + s * PA6)))));
        let q = 1.0 + s * (QA1 + s * (QA2 + s * (QA3 + s * (QA4 + s * (QA5 + s * QA6)))));
        return 1.0 - ERX - p / q;
    }
    let s = 1.0 / (ax * ax);
    let (r, big_s) = if ax < 1.0 / 0.35 {
        (
            RA0 + s * (RA1 + s * (RA2 + s * (RA3 + s * (RA4 + s * (RA5 + s * (RA6 + s * RA7)))))),
            1.0 + s
                * (SA1
                    + s * (SA2
                        + s * (SA3 + s * (SA4 + s * (SA5 + s * (SA6 + s * (SA7 + s * SA8))))))),
        )
    } else {
        (
            RB0 + s * (RB1 + s * (RB2 + s * (RB3 + s * (RB4 + s * (RB5 + s * RB6))))),
            1.0 + s * (SB1 + s * (SB2 + s * (SB3 + s * (SB4 + s * (SB5 + s * (SB6 + s * SB7)))))),
        )
    };
    let z = f32::from_bits(ax.to_bits() & 0xffff_e000);
    (-z * z - 0.5625).exp() * ((z - ax) * (z + ax) + r / big_s).exp() / ax
}

/// `(erf(x) - x) / x` for `|x| < 0.84375` (f32).
fn erff_small_ratio(x: f32) -> f32 {
    use c32::*;
    let z = x * x;
    let r = PP0 + z * (PP1 + z * (PP2 + z * (PP3 + z * PP4)));
    let s = 1.0 + z * (QQ1 + z * (QQ2 + z * (QQ3 + z * (QQ4 + z * QQ5))));
    r / s
}

/// The error function in f32 (about 1 ulp).
pub fn erff(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    if ax < 0.84375 {
        if ax < 2f32.powi(-28) {
            return 0.125 * (8.0 * x + c32::EFX8 * x);
        }
        return x + x * erff_small_ratio(x);
    }
    let y = if ax < 6.0 { 1.0 - erfcf_tail(ax) } else { 1.0 };
    y.copysign(x)
}

/// The complementary error function in f32 (about 1 ulp relative, also in the tail).
#[inline]
pub fn erfcf(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    if ax < 0.84375 {
        if ax < 2f32.powi(-56) {
            return 1.0 - x;
        }
        let y = erff_small_ratio(x);
        if x < 0.25 {
            return 1.0 - (x + x * y);
        }
        return 0.5 - (x - 0.5 + x * y);
    }
    if ax < 28.0 {
        let t = erfcf_tail(ax);
        return if x < 0.0 { 2.0 - t } else { t };
    }
    if x < 0.0 {
        2.0
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf by the everywhere-positive series `2/√π e^(-x²) Σ 2ⁿ x^(2n+1) / (2n+1)!!`.
    fn erf_series(x: f64) -> f64 {
        let mut term = x;
        let mut sum = x;
        let mut n = 0.0;
        while term.abs() > 1e-18 * sum.abs() {
            n += 1.0;
            term *= 2.0 * x * x / (2.0 * n + 1.0);
            sum += term;
        }
        2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp() * sum
    }

    #[test]
    fn erf_f64_matches_series() {
        let mut worst = 0.0f64;
        for i in -4000..=4000 {
            let x = i as f64 * 1e-3;
            let d = (erf(x) - erf_series(x)).abs();
            worst = worst.max(d);
            assert!((erfc(x) - (1.0 - erf_series(x))).abs() < 1e-14, "erfc({x})");
        }
        assert!(worst < 1e-14, "max |erf - series| = {worst:e}");
        assert_eq!(erf(0.0), 0.0);
        assert_eq!(erf(f64::INFINITY), 1.0);
        assert_eq!(erf(f64::NEG_INFINITY), -1.0);
        assert!(erf(f64::NAN).is_nan());
        assert!((erf(1.0) - 0.842_700_792_949_714_9).abs() < 1e-16);
        // Tail: erfc(5) = 1.5374597944280348e-12.
        assert!((erfc(5.0) / 1.537_459_794_428_034_8e-12 - 1.0).abs() < 1e-14);
    }

    #[test]
    fn erf_f32_is_accurate() {
        for i in -6000..=6000 {
            let x = i as f32 * 1e-3;
            let want = erf(x as f64);
            let got = erff(x) as f64;
            assert!(
                (got - want).abs() <= 1.2e-7 * want.abs().max(1e-30) + 1e-30,
                "erff({x})"
            );
            let want_c = erfc(x as f64);
            let got_c = erfcf(x) as f64;
            assert!(
                (got_c - want_c).abs() <= 2.4e-7 * want_c,
                "erfcf({x}): {got_c} vs {want_c}"
            );
        }
    }
}
