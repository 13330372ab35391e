//! Turns the cluster into a placement and loads it on the workers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_engine::placement::{self, DeviceProfile, Stage};
use cairn_engine::protocol::{Hop, LayerRange, Message};
use cairn_engine::worker::PeerKind;
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::Shared;
use super::core::{Debounce, Loading, Replace};
use super::state::{Active, ActiveStage, PlacementStatus, State};

/// The profiles placement sees: calibrated, online workers.
pub fn profiles(st: &State) -> Vec<DeviceProfile> {
    st.peers
        .iter()
        .filter(|(_, p)| p.online && p.sender.is_some())
        .filter_map(|(id, p)| {
            let c = p.calibration?;
            let stats = p.stats.as_ref().map(|s| s.borrow().clone());
            let rtt = stats
                .as_ref()
                .and_then(|s| s.rtt_smoothed.or(s.rtt))
                .map_or(1e-3, |d| d.as_secs_f64());
            let bw = stats
                .as_ref()
                .and_then(|s| s.throughput_bytes_per_s)
                .unwrap_or(50e6);
            Some(DeviceProfile {
                id: id.to_string(),
                memory_bytes: p.caps.memory_budget_bytes,
                decode_s_per_layer: c.decode_s_per_layer,
                prefill_s_per_layer_token: c.prefill_s_per_layer_token,
                call_overhead_s: c.call_overhead_s,
                head_s: c.head_s,
                link_rtt_s: rtt,
                link_bytes_per_s: bw,
                relayed: p.caps.kind != PeerKind::Native,
                slowdown: placement::slowdown(&p.condition()),
            })
        })
        .collect()
}

/// What the cluster should run now: the manual placement while it is
/// valid, else the best automatic one.
fn target(shared: &Shared) -> Result<Vec<Stage>, String> {
    let mut st = shared.state();
    st.placements_computed += 1;
    let devices = profiles(&st);
    if let Some(manual) = st.manual.clone() {
        match placement::evaluate(&devices, &shared.model.cost, &manual, 0) {
            Ok(_) => return Ok(manual),
            Err(e) => {
                let msg = format!("manual placement set aside ({e}); placing automatically");
                warn!("{msg}");
                st.warnings.push(msg);
            }
        }
    }
    if devices.is_empty() {
        return Err("no calibrated worker is online".into());
    }
    placement::place(&devices, &shared.model.cost).map_err(|e| e.to_string())
}

pub async fn run(shared: Arc<Shared>) {
    let mut debounce = Debounce::default();
    loop {
        let due = debounce.poll_timeout().map(tokio::time::Instant::from_std);
        tokio::select! {
            () = shared.replace.notified() => {
                let urgent = shared
                    .urgent
                    .swap(false, std::sync::atomic::Ordering::Relaxed);
                let replace = if urgent { Replace::Now } else { Replace::Soon };
                replace.poke(&mut debounce, Instant::now());
            }
            () = sleep_until(due) => {}
        }
        if !debounce.fire(Instant::now()) {
            continue;
        }
        let wanted = match target(&shared) {
            Ok(t) => t,
            Err(msg) => {
                warn!(%msg, "no placement");
                let mut st = shared.state();
                if st.active.is_none() {
                    st.status = if st.peers.values().any(|p| p.online) {
                        PlacementStatus::NoFit
                    } else {
                        PlacementStatus::Waiting
                    };
                    st.message = msg;
                    st.target = None;
                    st.prediction = None;
                }
                drop(st);
                shared.touch();
                continue;
            }
        };
        let unchanged = {
            let st = shared.state();
            st.active.as_ref().is_some_and(|a| {
                a.stages.len() == wanted.len()
                    && a.stages.iter().zip(&wanted).all(|(s, w)| {
                        s.peer.to_string() == w.device && s.start == w.start && s.end == w.end
                    })
            })
        };
        if unchanged {
            shared.touch();
            continue;
        }
        if let Err(msg) = load(&shared, &wanted).await {
            warn!(%msg, "placement failed; trying again");
            {
                let mut st = shared.state();
                st.status = PlacementStatus::NoFit;
                st.message = msg;
            }
            shared.touch();
            let again = shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(2)).await;
                again.replace();
            });
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Loads `stages` on their workers and makes them the active placement.
async fn load(shared: &Arc<Shared>, stages: &[Stage]) -> Result<(), String> {
    let mut senders = Vec::new();
    let mut waits = Vec::new();
    {
        let mut st = shared.state();
        st.active = None;
        st.status = PlacementStatus::Placing;
        st.message = format!("loading {}", describe(stages));
        st.target = Some(stages.to_vec());
        st.prediction = placement::evaluate(&profiles(&st), &shared.model.cost, stages, 64).ok();
        for s in stages {
            let (id, p) = st
                .peers
                .iter_mut()
                .find(|(id, _)| id.to_string() == s.device)
                .ok_or_else(|| format!("{} is not in the cluster", s.device))?;
            let sender = p
                .sender
                .clone()
                .ok_or_else(|| format!("{} has no link", s.device))?;
            p.loading = true;
            senders.push((
                id.clone(),
                s.clone(),
                sender,
                p.caps.kind == PeerKind::Native,
            ));
        }
    }
    let routes = chain_routes(
        &senders
            .iter()
            .map(|(peer, s, _, native)| (peer.to_string(), s, *native))
            .collect::<Vec<_>>(),
    );
    shared.touch();
    info!(placement = %describe(stages), "loading placement");
    let source = format!(
        "{}{}",
        shared.opts.public_url.trim_end_matches('/'),
        crate::model_fetch::model_route(&shared.model.id)
    );
    let mut loading = Loading::new(
        senders.iter().map(|(peer, ..)| peer.clone()).collect(),
        Instant::now(),
    );
    for ((peer, s, sender, _), (next, prev)) in senders.iter().zip(routes) {
        let (tx, rx) = oneshot::channel();
        shared
            .loads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(peer.clone(), tx);
        let msg = Message::LoadShard {
            model_hash: shared.model.id.clone(),
            layers: LayerRange {
                start: s.start as u32,
                end: s.end as u32,
            },
            source: source.clone(),
            next,
            prev,
        };
        if let Err(e) = sender.send(msg).await {
            return Err(format!("{peer}: {e}"));
        }
        waits.push((peer.clone(), rx));
    }
    let deadline = tokio::time::Instant::from_std(loading.poll_timeout());
    let mut timed_out = false;
    for (peer, rx) in waits {
        let r = match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err("the link went away".into()),
            // The load's outcome names what did not come in time.
            Err(_) => {
                timed_out = true;
                break;
            }
        };
        if let Some(p) = shared.state().peers.get_mut(&peer) {
            p.loading = false;
        }
        loading.answer(&peer, r);
    }
    {
        let mut st = shared.state();
        for (peer, ..) in &senders {
            if let Some(p) = st.peers.get_mut(peer) {
                p.loading = false;
            }
        }
    }
    let now = if timed_out {
        loading.poll_timeout()
    } else {
        Instant::now()
    };
    match loading.outcome(now) {
        Some(Ok(())) => {}
        Some(Err(e)) => return Err(e),
        None => return Err("loading ended before every worker answered".into()),
    }
    let mut st = shared.state();
    // A worker may have gone while the others loaded.
    if senders
        .iter()
        .any(|(p, _, _, _)| !st.peers.get(p).is_some_and(|p| p.online))
    {
        return Err("a worker went away while loading".into());
    }
    st.epoch += 1;
    let epoch = st.epoch;
    let n = senders.len();
    let native: Vec<bool> = senders.iter().map(|(_, _, _, native)| *native).collect();
    st.active = Some(Active {
        epoch,
        stages: senders
            .into_iter()
            .enumerate()
            .map(|(i, (peer, s, sender, _))| ActiveStage {
                peer,
                start: s.start,
                end: s.end,
                sender,
                direct: native[i] && native[(i + 1) % n],
            })
            .collect(),
    });
    st.status = PlacementStatus::Ready;
    st.message = format!("serving: {}", describe(stages));
    drop(st);
    info!(epoch, placement = %describe(stages), "placement ready");
    shared.touch();
    Ok(())
}

/// Each stage's `next` and `prev` for `LoadShard`, from the stages in
/// order with whether each runs on a native worker: a hop between two native
/// workers goes over a link between them (the last stage's back to the
/// first; a single native stage is its own next); a hop to or from a browser
/// (which keeps only its coordinator link) is relayed by the coordinator.
fn chain_routes(stages: &[(String, &Stage, bool)]) -> Vec<(Option<Hop>, Option<String>)> {
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

pub fn describe(stages: &[Stage]) -> String {
    stages
        .iter()
        .map(|s| format!("{}:{}-{}", s.device, s.start, s.end.saturating_sub(1)))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(device: &str, start: usize, end: usize) -> Stage {
        Stage {
            device: device.into(),
            start,
            end,
        }
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
