//! Which placement the cluster should run and how its stages reach each
//! other, without IO: the device profiles placement weighs (calibrated,
//! online workers with their condition and link), the manual placement
//! while it is valid, and each stage's `next` and `prev` for `LoadShard`.

use cairn_engine::placement::{self, DeviceProfile, ModelCost, Stage};
use cairn_engine::protocol::{Hop, LayerRange};
use cairn_engine::worker::PeerKind;

use crate::coord::state::{Active, State};

/// The round trip assumed for a link not measured yet.
const NOMINAL_RTT_S: f64 = 1e-3;
/// The throughput assumed for a link not probed yet.
const NOMINAL_BYTES_PER_S: f64 = 50e6;

/// The profiles placement sees: calibrated, online workers whose numbers
/// can be believed; a worker whose cannot is left out (and the log says
/// why), never failing the placement for the others.
pub fn profiles(st: &State) -> Vec<DeviceProfile> {
    let offered: Vec<DeviceProfile> = st
        .peers
        .iter()
        .filter(|(_, p)| p.online)
        .filter_map(|(id, p)| {
            let c = p.calibration?;
            let rtt = p
                .link
                .as_ref()
                .and_then(|s| s.rtt_smoothed.or(s.rtt))
                .map_or(NOMINAL_RTT_S, |d| d.as_secs_f64());
            let bw = p
                .link
                .as_ref()
                .and_then(|s| s.throughput_bytes_per_s)
                .unwrap_or(NOMINAL_BYTES_PER_S);
            Some(DeviceProfile {
                id: id.to_string(),
                memory_bytes: p.caps.memory_budget_bytes,
                decode_s_per_layer: c.decode_s_per_layer,
                prefill_s_per_layer_token: c.prefill_s_per_layer_token,
                call_overhead_s: c.call_overhead_s,
                head_s: c.head_s,
                tensor: c.tensor,
                link_rtt_s: rtt,
                link_bytes_per_s: bw,
                relayed: p.caps.kind != PeerKind::Native,
                slowdown: placement::slowdown(&p.condition()),
            })
        })
        .collect();
    let (kept, refused) = placement::screen(offered);
    for r in refused {
        tracing::warn!(peer = %r.device, reason = %r.reason, "worker left out of placement");
    }
    kept
}

/// What the cluster should run now: the manual placement while it is
/// valid, else the best automatic one. A manual placement set aside says
/// why in `st.warnings`.
pub fn target(st: &mut State, cost: &ModelCost) -> Result<Vec<Stage>, String> {
    st.placements_computed += 1;
    let devices = profiles(st);
    if let Some(manual) = st.manual.clone() {
        match placement::evaluate(&devices, cost, &manual, 0) {
            Ok(_) => return Ok(manual),
            Err(e) => {
                let msg = format!("manual placement set aside ({e}); placing automatically");
                tracing::warn!("{msg}");
                st.warnings.push(msg);
            }
        }
    }
    if devices.is_empty() {
        return Err("no calibrated worker is online".into());
    }
    placement::place(&devices, cost).map_err(|e| e.to_string())
}

/// Whether `active` already serves `wanted` (the same workers, the same layers, split
/// the same way).
pub fn unchanged(active: Option<&Active>, wanted: &[Stage]) -> bool {
    active.is_some_and(|a| {
        a.stages.len() == wanted.len()
            && a.stages.iter().zip(wanted).all(|(s, w)| {
                s.peer.to_string() == w.device
                    && s.start == w.start
                    && s.end == w.end
                    && s.split == w.split
            })
    })
}

/// Each stage's `next` and `prev` for `LoadShard`, from the stages in
/// order with whether each runs on a native worker: a hop between two native
/// workers goes over a link between them (the last stage's back to the
/// first; a single native stage is its own next); a hop to or from a browser
/// (which keeps only its coordinator link) is relayed by the coordinator.
pub fn chain_routes(stages: &[(String, &Stage, bool)]) -> Vec<(Option<Hop>, Option<String>)> {
    let n = stages.len();
    (0..n)
        .map(|i| {
            let (j, k) = ((i + 1) % n, (i + n - 1) % n);
            let next = (stages[i].2 && stages[j].2).then(|| Hop {
                peer: stages[j].0.clone(),
                layers: LayerRange {
                    start: stages[j].1.start as u32,
                    end: stages[j].1.end as u32,
                },
            });
            let prev = (k != i && stages[k].2 && stages[i].2).then(|| stages[k].0.clone());
            (next, prev)
        })
        .collect()
}

/// A placement as the logs and the dashboard's message write it.
pub fn describe(stages: &[Stage]) -> String {
    stages
        .iter()
        .map(|s| {
            let split = if s.split.is_layers() { "" } else { "/tensor" };
            format!(
                "{}:{}-{}{split}",
                s.device,
                s.start,
                s.end.saturating_sub(1)
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(device: &str, start: usize, end: usize) -> Stage {
        Stage::new(device, start, end)
    }

    #[test]
    fn native_stages_form_a_ring_and_browsers_are_relayed() {
        let (a, b, c) = (stage("a", 0, 10), stage("b", 10, 20), stage("c", 20, 30));
        let hop = |peer: &str, s: &Stage| {
            Some(Hop {
                peer: peer.into(),
                layers: LayerRange {
                    start: s.start as u32,
                    end: s.end as u32,
                },
            })
        };
        let ring = chain_routes(&[
            ("a".into(), &a, true),
            ("b".into(), &b, true),
            ("c".into(), &c, true),
        ]);
        assert_eq!(
            ring,
            vec![
                (hop("b", &b), Some("c".into())),
                (hop("c", &c), Some("a".into())),
                (hop("a", &a), Some("b".into())),
            ]
        );
        // b is a browser: nothing goes straight to it or from it.
        let mixed = chain_routes(&[
            ("a".into(), &a, true),
            ("b".into(), &b, false),
            ("c".into(), &c, true),
        ]);
        assert_eq!(
            mixed,
            vec![(None, Some("c".into())), (None, None), (hop("a", &a), None),]
        );
        let whole = stage("a", 0, 30);
        assert_eq!(
            chain_routes(&[("a".into(), &whole, true)]),
            vec![(hop("a", &whole), None)],
            "a single native stage loops on itself"
        );
        assert_eq!(
            chain_routes(&[("a".into(), &whole, false)]),
            vec![(None, None)]
        );
    }
}
