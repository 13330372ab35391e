//! Spot checks of placed workers, without IO: which steps to check, how a
//! worker's token is judged against a trusted recomputation, and whom a
//! wrong one blames.
//!
//! A worker could compute its layers wrongly (a broken device, or on
//! purpose) and nothing it reports would show it. So now and then
//! ([`SpotConfig::rate`] of the steps, chosen by a hash the workers cannot
//! predict) the coordinator holds a step's token back, recomputes the logits
//! after the same tokens on a device it trusts (its own engine, holding the
//! whole model), and samples them with the same parameters. Different
//! backends round differently, so a token that differs is still right when
//! its logit is within [`SpotConfig::tolerance`] of the trusted choice's (a
//! near tie); anything else is wrong, and every untrusted stage of the
//! placement that made it is evicted: the check sees the chain's end result
//! only, so it cannot tell which of several untrusted stages erred.

use cairn_engine::kernels::SampleParams;
use cairn_engine::kernels::sample::sample;
use cairn_signal::protocol::PeerId;

use super::view::Placement;

/// How often and how strictly steps are checked (`--spot-check-rate`,
/// `--spot-check-tolerance`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpotConfig {
    /// The share of steps checked, 0 (never) to 1 (every step).
    pub rate: f64,
    /// How far below the trusted choice's logit a different token's logit
    /// may be and still count as a near tie.
    pub tolerance: f32,
    /// Mixed into the choice of steps, so no worker can tell which of its
    /// steps will be checked.
    pub seed: u64,
}

impl SpotConfig {
    /// One step in a hundred; logits within 0.5 of each other tie (the cpu,
    /// wgpu, vulkan and cuda backends agree to about 0.1 on the models
    /// tested).
    pub const DEFAULT_RATE: f64 = 0.01;
    pub const DEFAULT_TOLERANCE: f32 = 0.5;

    pub fn off() -> SpotConfig {
        SpotConfig {
            rate: 0.0,
            tolerance: Self::DEFAULT_TOLERANCE,
            seed: 0,
        }
    }

    /// Whether step `step` of request `request` is to be checked.
    pub fn chosen(&self, request: u64, step: u32) -> bool {
        if self.rate <= 0.0 {
            return false;
        }
        if self.rate >= 1.0 {
            return true;
        }
        let h = splitmix(self.seed ^ splitmix(request ^ splitmix(u64::from(step))));
        // The top 53 bits as a uniform draw in [0, 1).
        ((h >> 11) as f64 / (1u64 << 53) as f64) < self.rate
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One step to recompute: the tokens before it, the token the workers gave
/// and how it was sampled.
#[derive(Clone, Debug, PartialEq)]
pub struct SpotCheck {
    /// The request it checks: the trusted device keeps each checked request's keys and
    /// values, so its next check runs only the tokens since this one.
    pub request: u64,
    /// The request's step (tokens generated before it).
    pub step: u32,
    /// The prompt and the tokens before this step.
    pub context: Vec<u32>,
    /// What the placement's last stage sampled.
    pub claimed: u32,
    pub sample: SampleParams,
    /// The placement's epoch and its stages not on a trusted device: whom a
    /// wrong token blames.
    pub epoch: u64,
    pub suspects: Vec<PeerId>,
}

/// What a check found.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Right,
    /// The token cannot come from the model: why, in words.
    Wrong(String),
    /// The trusted device could not recompute (it could not load the
    /// model, say): nobody is blamed and the token goes out.
    Unchecked(String),
}

/// Judges `claimed` against the trusted `logits` after the same tokens,
/// sampled with `params`.
pub fn judge(logits: &[f32], params: &SampleParams, claimed: u32, tolerance: f32) -> Verdict {
    if logits.is_empty() || logits.iter().any(|l| !l.is_finite()) {
        return Verdict::Unchecked("the trusted logits are not finite".into());
    }
    let Some(&theirs) = logits.get(claimed as usize) else {
        return Verdict::Wrong(format!(
            "token {claimed} is beyond the vocabulary of {}",
            logits.len()
        ));
    };
    let ours = sample(logits, params);
    if ours == claimed {
        return Verdict::Right;
    }
    let best = logits[ours as usize];
    if best - theirs <= tolerance {
        Verdict::Right
    } else {
        Verdict::Wrong(format!(
            "token {claimed} (logit {theirs:.3}) where the trusted device samples {ours} (logit {best:.3}), beyond the tolerance of {tolerance}"
        ))
    }
}

/// The stages of `placement` whose workers are not trusted.
pub fn suspects(
    placement: &Placement,
    trusted: &std::collections::BTreeSet<PeerId>,
) -> Vec<PeerId> {
    let mut out: Vec<PeerId> = Vec::new();
    for s in &placement.stages {
        if !trusted.contains(&s.peer) && !out.contains(&s.peer) {
            out.push(s.peer.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::coord::core::view::StageView;

    fn greedy() -> SampleParams {
        SampleParams {
            temperature: 0.0,
            ..SampleParams::default()
        }
    }

    #[test]
    fn the_rate_is_the_share_of_steps_checked_and_the_seed_moves_them() {
        let cfg = |rate, seed| SpotConfig {
            rate,
            tolerance: 0.5,
            seed,
        };
        let count = |c: SpotConfig| {
            (0..100u64)
                .flat_map(|r| (0..100u32).map(move |s| (r, s)))
                .filter(|&(r, s)| c.chosen(r, s))
                .count()
        };
        assert_eq!(count(cfg(0.0, 1)), 0);
        assert_eq!(count(cfg(1.0, 1)), 10_000);
        let n = count(cfg(0.01, 1));
        assert!((50..=150).contains(&n), "{n} of 10,000 at 1%");
        let n = count(cfg(0.25, 7));
        assert!((2_250..=2_750).contains(&n), "{n} of 10,000 at 25%");
        let picks = |seed| {
            (0..1_000u32)
                .filter(|&s| cfg(0.1, seed).chosen(3, s))
                .collect::<Vec<_>>()
        };
        assert_ne!(picks(1), picks(2), "another seed checks other steps");
        assert_eq!(picks(1), picks(1));
    }

    #[test]
    fn the_trusted_choice_and_near_ties_are_right_and_anything_else_wrong() {
        let logits = [0.0, 5.0, 4.8, 1.0];
        assert_eq!(judge(&logits, &greedy(), 1, 0.5), Verdict::Right);
        // 4.8 against 5.0: backends may round either way.
        assert_eq!(judge(&logits, &greedy(), 2, 0.5), Verdict::Right);
        assert!(matches!(
            judge(&logits, &greedy(), 2, 0.1),
            Verdict::Wrong(_)
        ));
        match judge(&logits, &greedy(), 3, 0.5) {
            Verdict::Wrong(why) => assert!(why.contains("token 3"), "{why}"),
            v => panic!("{v:?}"),
        }
        assert!(matches!(
            judge(&logits, &greedy(), 99, 0.5),
            Verdict::Wrong(_)
        ));
        assert!(matches!(
            judge(&[1.0, f32::NAN], &greedy(), 0, 0.5),
            Verdict::Unchecked(_)
        ));
    }

    #[test]
    fn a_sampled_token_is_judged_with_the_same_draw() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.9).collect();
        let params = SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
            step: 3,
        };
        let drawn = sample(&logits, &params);
        assert_eq!(judge(&logits, &params, drawn, 0.0), Verdict::Right);
        let lowest = (0..50u32)
            .find(|&i| logits[i as usize] == 0.0 && i != drawn)
            .unwrap_or(0);
        assert!(matches!(
            judge(&logits, &params, lowest, 0.5),
            Verdict::Wrong(_)
        ));
    }

    #[test]
    fn only_untrusted_stages_are_suspects() {
        let stage = |peer: &str, start, end| StageView {
            peer: PeerId(peer.into()),
            start,
            end,
            direct: true,
        };
        let p = Placement {
            epoch: 3,
            stages: vec![
                stage("local", 0, 10),
                stage("a", 10, 20),
                stage("b", 20, 30),
            ],
            cost: None,
        };
        let trusted: BTreeSet<PeerId> = [PeerId("local".into())].into();
        assert_eq!(
            suspects(&p, &trusted),
            vec![PeerId("a".into()), PeerId("b".into())]
        );
        let all: BTreeSet<PeerId> = ["local", "a", "b"]
            .into_iter()
            .map(|p| PeerId(p.into()))
            .collect();
        assert!(suspects(&p, &all).is_empty());
    }
}
