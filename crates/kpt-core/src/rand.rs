//! Deterministic random numbers: a small stream (splitmix64) for test data, benchmark
//! inputs and synthetic weights, and the counter-based Philox4x32-10 generator that
//! attention dropout draws its keep decisions from (the same bits on every backend). Not
//! for cryptography.

/// The splitmix64 generator: a 64-bit state advanced by a fixed odd increment and mixed.
///
/// ```
/// use kpt_core::rand::SplitMix64;
/// let mut a = SplitMix64::new(7);
/// let mut b = SplitMix64::new(7);
/// assert_eq!(a.next_u64(), b.next_u64());
/// let x = a.uniform(-1.0, 1.0);
/// assert!((-1.0..1.0).contains(&x));
/// ```
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A stream starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform f32 in `[lo, hi)` (24 random bits).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    /// `len` values uniform in `[lo, hi)`.
    pub fn vec(&mut self, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Uniform in `0..n` (`n > 0`; slightly biased for huge `n`, fine for test data).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// The multipliers of Philox4x32's rounds (of counter words 0 and 2).
pub const PHILOX_MULTIPLIERS: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// What Philox4x32 adds to the two key words after each round (the Weyl sequence).
pub const PHILOX_KEY_STEP: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011;
/// the generator of cuRAND's and PyTorch's dropout): four 32-bit random words from a
/// 128-bit `counter` and a 64-bit `key`, ten rounds. A pure function, so any device can
/// compute the words of any counter independently.
///
/// ```
/// use kpt_core::rand::philox4x32_10;
/// // Random123's known-answer vector.
/// assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
/// ```
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [
                k[0].wrapping_add(PHILOX_KEY_STEP[0]),
                k[1].wrapping_add(PHILOX_KEY_STEP[1]),
            ];
        }
        let p0 = u64::from(PHILOX_MULTIPLIERS[0]) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_MULTIPLIERS[1]) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_random123_known_answers() {
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn matches_the_published_splitmix64_sequence() {
        // First outputs of splitmix64 seeded with 1234567 (reference implementation).
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
    }

    #[test]
    fn uniform_stays_in_range_and_spreads() {
        let mut r = SplitMix64::new(3);
        let v = r.vec(10_000, -2.0, 3.0);
        assert!(v.iter().all(|x| (-2.0..3.0).contains(x)));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        assert!((mean - 0.5).abs() < 0.1, "mean {mean}");
        assert!((0..100).all(|_| r.below(7) < 7));
    }
}
