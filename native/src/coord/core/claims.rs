//! A worker's claims against what it shows. A worker says how much memory
//! it offers; the coordinator cannot look inside it, but it knows what the
//! layers it placed there weigh, and the worker reports what loading them
//! took (`ShardLoaded::weight_bytes`). A report far from what the layers
//! weigh (nothing at all, or terabytes) means the worker does not say what
//! it does: it is evicted like one a spot check catches. (A worker that keeps the
//! layers it already held reports 0, which says nothing.) Speed is not
//! taken from the worker either: placement uses the calibration the
//! coordinator asks for and times over the link, screened by
//! `placement::screen`.

use cairn_engine::placement::ModelCost;

/// How far a worker's loaded bytes may stray from the layers' weight:
/// backends repack weights (int8 products, dequantized copies), so within
/// this factor either way is believed.
pub const LOAD_FACTOR: u64 = 4;
/// Slack on top, for small stages whose buffers and tables weigh more than
/// their weights.
pub const LOAD_SLACK: u64 = 16 << 20;

/// What layers `start..end` of the model weigh, with the embedding on the
/// first stage and the output head on the last.
pub fn stage_bytes(cost: &ModelCost, start: usize, end: usize) -> u64 {
    let mut bytes = end.saturating_sub(start) as u64 * cost.layer_weight_bytes;
    if start == 0 {
        bytes += cost.first_extra_bytes;
    }
    if end == cost.n_layers {
        bytes += cost.last_extra_bytes;
    }
    bytes
}

/// Whether a worker that loaded a stage of `expected` bytes may say it took
/// `reported`; why not, when not. Zero says nothing: a worker that already
/// holds the layers asked for keeps them and measures no load.
pub fn judge_load(expected: u64, reported: u64) -> Result<(), String> {
    if reported == 0 {
        return Ok(());
    }
    let low = expected / LOAD_FACTOR;
    let high = expected
        .saturating_mul(LOAD_FACTOR)
        .saturating_add(LOAD_SLACK);
    if (low..=high).contains(&reported) {
        Ok(())
    } else {
        Err(format!(
            "it reported {reported} bytes loaded for layers that weigh {expected} (believed: {low} to {high})"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loaded_bytes_near_the_layers_weight_are_believed_and_absurd_ones_not() {
        // What the cpu backend reported for the default model's stages.
        assert!(judge_load(69_000_000, 69_374_468).is_ok());
        assert!(judge_load(40_000_000, 40_562_948).is_ok());
        assert!(
            judge_load(2_000_000, 9_000_000).is_ok(),
            "small stages get slack"
        );
        let tiny = judge_load(69_000_000, 1).unwrap_err();
        assert!(tiny.contains("reported 1 bytes"), "{tiny}");
        assert!(
            judge_load(69_000_000, 0).is_ok(),
            "a shard kept says nothing"
        );
        assert!(judge_load(69_000_000, 1 << 40).is_err());
        assert!(judge_load(u64::MAX, u64::MAX).is_ok(), "no overflow");
    }
}
