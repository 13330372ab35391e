//! Token selection: argmax, and sampling with temperature, top-k and top-p.
//!
//! Sampling uses the Gumbel-max trick with a counter-based hash as the random source, so the
//! GPU kernel and this twin draw the same token from the same logits, seed and step, and a
//! device never needs host round-trips to sample.

use serde::{Deserialize, Serialize};

use super::op::{CountParams, OpSpec, Use, f32s, params};
use crate::backend::cpu::access::{f, rd, wr};
use crate::backend::{self, Buffer};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SampleParams {
    /// 0 (or less) means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: u32,
    /// 1.0 means no top-p cut.
    pub top_p: f32,
    pub seed: u64,
    /// The decode step; mixed into the random stream so each step draws afresh.
    pub step: u32,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            step: 0,
        }
    }
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// A monotonic map from f32 to u32 (NaNs sort beyond the infinities).
pub fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

pub fn pcg(v: u32) -> u32 {
    let state = v.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277_803_737);
    (word >> 22) ^ word
}

/// A uniform draw in (0, 1) for vocabulary entry `i`.
pub fn uniform(seed: u64, step: u32, i: u32) -> f32 {
    let h = pcg(i ^ pcg(step ^ pcg((seed as u32) ^ pcg((seed >> 32) as u32))));
    ((h >> 8) as f32 + 0.5) / 16_777_216.0
}

pub fn sample(logits: &[f32], p: &SampleParams) -> u32 {
    if p.temperature <= 0.0 || logits.is_empty() {
        return argmax(logits);
    }
    let keys: Vec<u32> = logits.iter().map(|v| order_key(*v)).collect();
    // Largest key K with at least top_k entries at or above it: the k-th largest logit.
    let kmin = if p.top_k == 0 || p.top_k as usize >= logits.len() {
        0
    } else {
        let mut k = 0u32;
        for bit in (0..32).rev() {
            let cand = k | (1 << bit);
            if keys.iter().filter(|&&x| x >= cand).count() >= p.top_k as usize {
                k = cand;
            }
        }
        k
    };
    let max = logits[argmax(logits) as usize];
    let mass = |kmin_: u32| -> f32 {
        logits
            .iter()
            .zip(&keys)
            .filter(|(_, k)| **k >= kmin_)
            .map(|(l, _)| (l - max).exp())
            .sum()
    };
    let pmin = if p.top_p >= 1.0 {
        kmin
    } else {
        let target = p.top_p.max(0.0) * mass(kmin);
        let mut k = kmin;
        for bit in (0..32).rev() {
            let cand = k | (1 << bit);
            if cand > k && mass(cand) >= target {
                k = cand;
            }
        }
        k
    };
    let inv_t = 1.0 / p.temperature;
    let mut best = (f32::NEG_INFINITY, 0u32);
    for (i, (l, k)) in logits.iter().zip(&keys).enumerate() {
        if *k < pmin {
            continue;
        }
        let u = uniform(p.seed, p.step, i as u32);
        let score = l * inv_t - (-u.ln()).ln();
        if score > best.0 {
            best = (score, i as u32);
        }
    }
    best.1
}

/// Index of the largest of `n` f32 values (the first on ties) into `out[0]` as u32.
#[derive(Debug, Clone, Copy)]
pub struct Argmax<'a> {
    pub x: &'a Buffer,
    pub n: u32,
    pub out: &'a Buffer,
}

impl<'a> OpSpec<'a> for Argmax<'a> {
    type Params = CountParams;

    fn name(&self) -> &'static str {
        "argmax"
    }

    fn check(&self) -> Result<(), String> {
        if self.n == 0 {
            return Err("no values".into());
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        vec![
            Use::read("x", self.x, f32s(&[self.n])),
            Use::write("out", self.out, Some(4)),
        ]
    }

    fn params(&self) -> CountParams {
        CountParams::new(self.n)
    }

    fn cpu(&self) -> backend::Result<()> {
        let (x, mut o) = (rd(self.x)?, wr(self.out)?);
        o[0] = argmax(&f(&x)[..self.n as usize]);
        Ok(())
    }
}

/// Draws a token from `n` logits with temperature, top-k and top-p into `out[0]`.
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    pub logits: &'a Buffer,
    pub n: u32,
    pub out: &'a Buffer,
    pub params: SampleParams,
}

params!(SampleKernelParams {
    n: u32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    seed_lo: u32,
    seed_hi: u32,
    step: u32,
    _pad: u32,
});

impl<'a> OpSpec<'a> for Sample<'a> {
    type Params = SampleKernelParams;

    fn name(&self) -> &'static str {
        "sample"
    }

    fn check(&self) -> Result<(), String> {
        if self.n == 0 {
            return Err("no logits".into());
        }
        if self.params.temperature.is_nan() || self.params.top_p.is_nan() {
            return Err("temperature and top_p must be numbers".into());
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        vec![
            Use::read("logits", self.logits, f32s(&[self.n])),
            Use::write("out", self.out, Some(4)),
        ]
    }

    fn params(&self) -> SampleKernelParams {
        let p = &self.params;
        SampleKernelParams {
            n: self.n,
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            seed_lo: p.seed as u32,
            seed_hi: (p.seed >> 32) as u32,
            step: p.step,
            _pad: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let (x, mut o) = (rd(self.logits)?, wr(self.out)?);
        o[0] = sample(&f(&x)[..self.n as usize], &self.params);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_key_is_monotonic() {
        let vals = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{} {}", w[0], w[1]);
        }
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_tiny_is_greedy() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 7919) % 101) as f32 * 0.1).collect();
        let best = argmax(&logits);
        for step in 0..20 {
            let mut p = SampleParams {
                temperature: 1.5,
                top_k: 1,
                top_p: 1.0,
                seed: 9,
                step,
            };
            assert_eq!(sample(&logits, &p), best);
            p.top_k = 0;
            p.top_p = 1e-6;
            assert_eq!(sample(&logits, &p), best);
        }
    }

    #[test]
    fn top_k_restricts_draws_and_frequencies_follow_softmax() {
        let logits = [0.0f32, 1.0, 2.0, -5.0];
        let mut counts = [0u32; 4];
        let n = 20000;
        for step in 0..n {
            let p = SampleParams {
                temperature: 1.0,
                top_k: 3,
                top_p: 1.0,
                seed: 1,
                step,
            };
            counts[sample(&logits, &p) as usize] += 1;
        }
        assert_eq!(counts[3], 0, "entry outside top-k was drawn");
        let z: f32 = logits[..3].iter().map(|l| l.exp()).sum();
        for i in 0..3 {
            let expected = logits[i].exp() / z;
            let got = counts[i] as f32 / n as f32;
            assert!(
                (expected - got).abs() < 0.02,
                "entry {i}: {got} vs {expected}"
            );
        }
    }
}
