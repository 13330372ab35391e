//! Random and mutated JSON bodies for the tests that feed parsers garbage (this crate's
//! signaling messages, the coordinator's API bodies): the same generator the `fuzz/` targets
//! stand in for, so a decoder's "errors, never a panic" is checked in the normal suite.

use rand::{Rng, SeedableRng};

/// `count` bodies from a fixed `seed`: every other one random bytes (up to 200), the rest a
/// seed body with one to five bytes changed, removed, or inserted from JSON's punctuation.
pub fn bodies(seeds: &[&str], count: usize, seed: u64) -> impl Iterator<Item = Vec<u8>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let seeds: Vec<Vec<u8>> = seeds.iter().map(|s| s.as_bytes().to_vec()).collect();
    (0..count).map(move |i| {
        if i % 2 == 0 || seeds.is_empty() {
            let n = rng.random_range(0..200);
            return (0..n).map(|_| rng.random()).collect();
        }
        let mut b = seeds[i % seeds.len()].clone();
        for _ in 0..rng.random_range(1..6) {
            if b.is_empty() {
                break;
            }
            let at = rng.random_range(0..b.len());
            match rng.random_range(0..3) {
                0 => b[at] = rng.random(),
                1 => {
                    b.remove(at);
                }
                _ => {
                    const PIECES: &[u8] = br#"{}[]",:0-e.9\u"#;
                    b.insert(at, PIECES[rng.random_range(0..PIECES.len())]);
                }
            }
        }
        b
    })
}
