//! The cluster's core driven with made-up time: workers linking and
//! calibrating, placing after the debounce, loading a placement on its
//! workers, failures and retries, losses, pauses and manual placements,
//! without a process or a socket.

use std::time::{Duration, Instant};

use cairn_engine::placement::{ModelCost, SplitTiming, Stage, StageSplit};
use cairn_engine::protocol::{Battery, Calibration, Hop, LayerRange, Message, Telemetry};
use cairn_engine::session::SessionStats;
use cairn_signal::protocol::PeerId;

use super::cluster::{FORGET_AFTER, RETRY};
use super::placing::{DEBOUNCE, URGENT_DEBOUNCE, load_timeout};
use super::*;
use crate::coord::state::PlacementStatus;

const MB: u64 = 1 << 20;
const LAYERS: usize = 30;
/// Enough for every layer on one worker.
const WHOLE: u64 = 1024 * MB;
/// Enough for about two thirds of the layers: two such workers split them.
const TWO_THIRDS: u64 = 210 * MB;
const MODEL_CONFIG: &str = r#"{"n_layers":30}"#;
const SOURCE: &str = "http://coordinator:8080/models/m1";

fn peer(name: &str) -> PeerId {
    PeerId(name.into())
}

fn cost() -> ModelCost {
    ModelCost {
        n_layers: LAYERS,
        layer_weight_bytes: 10 * MB,
        kv_bytes_per_layer: 0,
        first_extra_bytes: 0,
        last_extra_bytes: 0,
        scratch_bytes: MB,
        activation_bytes: 4096,
        token_bytes: 4,
        concurrency: 1,
    }
}

/// A worker's hello capabilities: `kind` (`native` or `browser`) offering
/// `budget` bytes.
fn capabilities(role: &str, kind: &str, budget: u64) -> String {
    serde_json::json!({
        "role": role,
        "kind": kind,
        "backend": "cpu",
        "device": {
            "id": "cpu",
            "name": "test cpu",
            "vendor": "test",
            "backend": "cpu",
            "api": "cpu",
            "device_type": "cpu",
            "driver": "test",
            "memory_bytes": budget,
            "memory_exact": true,
            "support": "full",
            "support_reason": "test",
            "features": [],
            "limits": {
                "max_buffer_size": 0,
                "max_storage_buffer_binding_size": 0,
                "max_storage_buffers_per_shader_stage": 0,
                "max_compute_workgroup_storage_size": 0,
                "max_compute_invocations_per_workgroup": 0,
                "max_compute_workgroup_size_x": 0,
                "max_compute_workgroups_per_dimension": 0,
                "min_uniform_buffer_offset_alignment": 0,
                "subgroup_min_size": 0,
                "subgroup_max_size": 0,
            },
        },
        "memory_budget_bytes": budget,
        "version": "test",
    })
    .to_string()
}

fn calibration() -> Calibration {
    Calibration {
        decode_s_per_layer: 1e-3,
        prefill_s_per_layer_token: 1e-4,
        call_overhead_s: 1e-4,
        head_s: 1e-3,
        tensor: None,
    }
}

/// One `LoadShard` as the core sent it.
#[derive(Debug, PartialEq)]
struct Load {
    peer: PeerId,
    generation: u64,
    layers: (u32, u32),
    next: Option<Hop>,
    prev: Option<String>,
    split: StageSplit,
}

/// The cluster's core, a clock, and what it asked for so far.
struct Harness {
    core: Cluster,
    now: Instant,
    out: Vec<ClusterOutput>,
    generation: u64,
}

impl Harness {
    fn new() -> Harness {
        Harness::with_manual(None)
    }

    fn with_manual(manual: Option<Vec<Stage>>) -> Harness {
        Harness::with(manual, false)
    }

    fn with(manual: Option<Vec<Stage>>, approve_workers: bool) -> Harness {
        let cfg = ClusterConfig {
            model_config: MODEL_CONFIG.into(),
            model_id: "m1".into(),
            source: SOURCE.into(),
            cost: cost(),
            approve_workers,
        };
        let now = Instant::now();
        Harness {
            core: Cluster::new(cfg, manual),
            now,
            out: Vec::new(),
            generation: 0,
        }
    }

    fn drain(&mut self) {
        while let Some(o) = self.core.poll_output() {
            self.out.push(o);
        }
    }

    fn input(&mut self, input: ClusterInput) {
        self.core.handle(input, self.now);
        self.drain();
    }

    /// Moves the clock by `d`, waking the core at every deadline on the way.
    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        while let Some(at) = self.core.poll_timeout().filter(|at| *at <= end) {
            self.now = self.now.max(at);
            self.core.handle_timeout(self.now);
            self.drain();
        }
        self.now = end;
        self.core.handle_timeout(self.now);
        self.drain();
    }

    fn take(&mut self) -> Vec<ClusterOutput> {
        std::mem::take(&mut self.out)
    }

    /// A new link to `name`; its generation.
    fn link(&mut self, name: &str, kind: &str, budget: u64) -> u64 {
        self.generation += 1;
        let generation = self.generation;
        self.input(ClusterInput::LinkUp {
            peer: peer(name),
            capabilities: capabilities("worker", kind, budget),
            generation,
        });
        generation
    }

    fn say(&mut self, name: &str, msg: Message) {
        self.input(ClusterInput::FromPeer {
            peer: peer(name),
            msg,
        });
    }

    /// A native worker linked and calibrated.
    fn join(&mut self, name: &str, budget: u64) {
        self.join_as(name, "native", budget);
    }

    fn join_as(&mut self, name: &str, kind: &str, budget: u64) {
        self.link(name, kind, budget);
        self.say(name, Message::Calibration(calibration()));
    }

    /// The `LoadShard`s sent since the last take, taking every output.
    fn loads(&mut self) -> Vec<Load> {
        self.take()
            .into_iter()
            .filter_map(|o| match o {
                ClusterOutput::Send {
                    peer,
                    generation,
                    msg:
                        Message::LoadShard {
                            model_hash,
                            layers,
                            source,
                            next,
                            prev,
                            split,
                        },
                } => {
                    assert_eq!(model_hash, "m1");
                    assert_eq!(source, SOURCE);
                    Some(Load {
                        peer,
                        generation,
                        layers: (layers.start, layers.end),
                        next,
                        prev,
                        split,
                    })
                }
                _ => None,
            })
            .collect()
    }

    fn loaded(&mut self, load: &Load) {
        self.say(
            load.peer.as_str(),
            Message::ShardLoaded {
                layers: LayerRange {
                    start: load.layers.0,
                    end: load.layers.1,
                },
                weight_bytes: super::claims::stage_bytes(
                    &cost(),
                    load.layers.0 as usize,
                    load.layers.1 as usize,
                ),
                load_ms: 1,
            },
        );
    }

    /// Places after the debounce and answers every `LoadShard`; the loads.
    fn place_and_load(&mut self) -> Vec<Load> {
        self.take();
        self.advance(DEBOUNCE);
        let loads = self.loads();
        assert!(!loads.is_empty(), "a placement was loaded");
        for l in &loads {
            self.loaded(l);
        }
        loads
    }

    fn st(&self) -> &crate::coord::state::State {
        self.core.state()
    }

    fn epoch(&self) -> Option<u64> {
        self.st().active.as_ref().map(|a| a.epoch)
    }

    /// The active placement as (peer, start, end, direct).
    fn active(&self) -> Vec<(String, usize, usize, bool)> {
        self.st()
            .active
            .iter()
            .flat_map(|a| &a.stages)
            .map(|s| (s.peer.to_string(), s.start, s.end, s.direct))
            .collect()
    }

    fn failed_runs(&self) -> Vec<(String, String)> {
        self.out
            .iter()
            .filter_map(|o| match o {
                ClusterOutput::FailRuns { peer, why } => Some((peer.to_string(), why.clone())),
                _ => None,
            })
            .collect()
    }
}

fn telemetry() -> Telemetry {
    Telemetry::default()
}

#[test]
fn a_worker_in_the_room_is_linked_and_anyone_else_is_not() {
    let mut h = Harness::new();
    h.input(ClusterInput::PeerJoined {
        peer: peer("w"),
        worker: true,
    });
    h.input(ClusterInput::PeerJoined {
        peer: peer("someone"),
        worker: false,
    });
    assert_eq!(h.take(), vec![ClusterOutput::Connect(peer("w"))]);
}

#[test]
fn linked_workers_are_calibrated_placed_after_the_debounce_and_loaded_as_a_ring() {
    let mut h = Harness::new();
    let ga = h.link("a", "native", TWO_THIRDS);
    let out = h.take();
    assert!(out.contains(&ClusterOutput::Send {
        peer: peer("a"),
        generation: ga,
        msg: Message::Calibrate {
            config: MODEL_CONFIG.into()
        },
    }));
    assert!(
        out.contains(&ClusterOutput::Changed),
        "the dashboard hears of it"
    );
    assert_eq!(
        h.core.poll_timeout(),
        None,
        "nothing to place before calibration"
    );
    let gb = h.link("b", "native", TWO_THIRDS);
    let t_cal = h.now;
    h.say("a", Message::Calibration(calibration()));
    h.advance(Duration::from_millis(50));
    h.say("b", Message::Calibration(calibration()));
    assert_eq!(
        h.core.poll_timeout(),
        Some(t_cal + DEBOUNCE),
        "both calibrations are placed once, after the first one's debounce"
    );
    h.take();
    h.advance(DEBOUNCE - Duration::from_millis(51));
    assert!(h.loads().is_empty(), "not before the debounce");
    h.advance(Duration::from_millis(1));
    let loads = h.loads();
    assert_eq!(
        loads.len(),
        2,
        "neither worker holds every layer: {loads:?}"
    );
    assert_eq!(h.st().placements_computed, 1);
    assert_eq!(h.st().status, PlacementStatus::Placing);
    assert!(h.st().peers.values().all(|p| p.loading));
    // The stages cover the model in order, each on its own link.
    assert_eq!(loads[0].layers.0, 0);
    assert_eq!(loads[0].layers.1, loads[1].layers.0);
    assert_eq!(loads[1].layers.1, LAYERS as u32);
    let generation_of = |p: &PeerId| if p == &peer("a") { ga } else { gb };
    for l in &loads {
        assert_eq!(l.generation, generation_of(&l.peer));
    }
    // Two native workers: each hands its output to the other.
    for (i, l) in loads.iter().enumerate() {
        let other = &loads[1 - i];
        assert_eq!(
            l.next,
            Some(Hop {
                peer: other.peer.to_string(),
                layers: LayerRange {
                    start: other.layers.0,
                    end: other.layers.1
                },
            })
        );
        assert_eq!(l.prev, Some(other.peer.to_string()));
    }
    h.loaded(&loads[1]);
    assert_eq!(h.epoch(), None, "not before every worker loaded");
    h.loaded(&loads[0]);
    assert_eq!(h.epoch(), Some(1));
    assert_eq!(h.st().status, PlacementStatus::Ready);
    assert!(
        h.st().message.starts_with("serving: "),
        "{}",
        h.st().message
    );
    assert!(h.st().peers.values().all(|p| !p.loading));
    let active = h.active();
    assert_eq!(active.len(), 2);
    assert!(active.iter().all(|s| s.3), "both hops go straight");
    assert_eq!(active[0].0, loads[0].peer.to_string());
    let stage = &h.st().active.as_ref().map(|a| a.stages[1].generation);
    assert_eq!(*stage, Some(generation_of(&loads[1].peer)));
}

#[test]
fn a_browser_stage_is_relayed_both_ways() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join_as("b", "browser", TWO_THIRDS);
    let loads = h.place_and_load();
    assert_eq!(loads.len(), 2);
    for l in &loads {
        assert_eq!(l.next, None, "no hop goes straight to or from a browser");
        assert_eq!(l.prev, None);
    }
    assert_eq!(h.epoch(), Some(1));
    assert!(h.active().iter().all(|s| !s.3));
}

#[test]
fn a_worker_that_cannot_load_leaves_no_placement_and_it_is_tried_again_after_2_s() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    assert_eq!(loads.len(), 2);
    h.say(
        loads[1].peer.as_str(),
        Message::Error {
            code: 5,
            text: "out of memory".into(),
        },
    );
    assert_eq!(
        h.st().status,
        PlacementStatus::Placing,
        "the other still loads"
    );
    h.loaded(&loads[0]);
    let failed_at = h.now;
    assert_eq!(h.epoch(), None);
    assert_eq!(h.st().status, PlacementStatus::NoFit);
    assert!(
        h.st()
            .message
            .contains("could not load its layers: error 5: out of memory"),
        "{}",
        h.st().message
    );
    assert!(h.st().peers.values().all(|p| !p.loading));
    h.take();
    h.advance(RETRY + DEBOUNCE - Duration::from_millis(1));
    assert!(
        h.loads().is_empty(),
        "not before the retry and its debounce"
    );
    h.advance(Duration::from_millis(1));
    assert_eq!(h.now - failed_at, RETRY + DEBOUNCE);
    let again = h.loads();
    assert_eq!(again.len(), 2, "placed and loaded again");
    for l in &again {
        h.loaded(l);
    }
    assert_eq!(h.epoch(), Some(1));
}

#[test]
fn a_load_shard_without_answer_times_out() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    assert_eq!(loads.len(), 1);
    let sent = h.now;
    // The whole model on one worker: its 300 MiB of layers at the slowest rate allowed
    // (2 MB/s) after the base 20 s, well under the 300 s cap.
    let timeout = load_timeout(LAYERS as u64 * 10 * MB, None);
    assert_eq!(timeout, Duration::from_secs(20 + 314_572_800 / 2_000_000));
    assert_eq!(h.core.poll_timeout(), Some(sent + timeout));
    h.advance(timeout - Duration::from_millis(1));
    assert_eq!(h.st().status, PlacementStatus::Placing);
    h.advance(Duration::from_millis(1));
    assert_eq!(h.st().status, PlacementStatus::NoFit);
    assert!(
        h.st().message.contains("no answer within"),
        "{}",
        h.st().message
    );
    assert!(!h.st().peers[&peer("a")].loading);
    // A late answer belongs to no load.
    h.loaded(&loads[0]);
    assert_eq!(h.epoch(), None);
    h.take();
    h.advance(RETRY + DEBOUNCE);
    assert_eq!(h.loads().len(), 1, "tried again");
}

#[test]
fn a_load_is_given_time_by_its_workers_measured_link_speed() {
    let bytes = LAYERS as u64 * 10 * MB;
    // 40 MB/s measured counts as 10 MB/s: 51 s for 300 MiB instead of 177 s.
    assert_eq!(
        load_timeout(bytes, Some(40e6)),
        Duration::from_secs(20 + bytes / 10_000_000)
    );
    // However fast the probe, never more than 10 MB/s; however slow (or a NaN), no more time
    // than no measurement; and never over the cap.
    assert_eq!(
        load_timeout(bytes, Some(1e12)),
        load_timeout(bytes, Some(40e6))
    );
    for slow in [1e3, 0.0, -5.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            load_timeout(bytes, Some(slow)),
            load_timeout(bytes, None),
            "{slow}"
        );
    }
    assert_eq!(load_timeout(100 * bytes, None), Duration::from_secs(300));

    let fast = SessionStats {
        throughput_bytes_per_s: Some(40e6),
        ..SessionStats::default()
    };
    for (kind, expected) in [
        ("native", load_timeout(bytes, Some(40e6))),
        // A browser's load is bound by its device, not its link.
        ("browser", load_timeout(bytes, None)),
    ] {
        let mut h = Harness::new();
        let g = h.link("a", kind, WHOLE);
        h.core.set_link(&peer("a"), g, fast.clone());
        h.say("a", Message::Calibration(calibration()));
        h.advance(DEBOUNCE);
        assert_eq!(h.loads().len(), 1, "{kind}");
        let sent = h.now;
        assert_eq!(h.core.poll_timeout(), Some(sent + expected), "{kind}");
        h.advance(expected);
        assert_eq!(h.st().status, PlacementStatus::NoFit, "{kind}");
    }
}

#[test]
fn a_send_that_fails_fails_the_load_at_once() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    h.input(ClusterInput::SendFailed {
        peer: loads[0].peer.clone(),
        generation: loads[0].generation,
        why: "link closed".into(),
    });
    assert_eq!(h.st().status, PlacementStatus::NoFit);
    assert_eq!(
        h.st().message,
        format!("{}: link closed", loads[0].peer),
        "the failed send names the worker"
    );
    // An older link's failed send is not this load's.
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    h.input(ClusterInput::SendFailed {
        peer: peer("a"),
        generation: loads[0].generation + 7,
        why: "old link".into(),
    });
    assert_eq!(h.st().status, PlacementStatus::Placing);
}

#[test]
fn a_peer_that_is_no_worker_is_closed() {
    let mut h = Harness::new();
    h.input(ClusterInput::LinkUp {
        peer: peer("c"),
        capabilities: capabilities("coordinator", "native", WHOLE),
        generation: 3,
    });
    assert_eq!(
        h.take(),
        vec![ClusterOutput::Close {
            peer: peer("c"),
            generation: 3,
            reason: "this coordinator only links to workers".into(),
        }]
    );
    assert!(h.st().peers.is_empty());
}

#[test]
fn unreadable_capabilities_are_closed_saying_why() {
    let mut h = Harness::new();
    h.input(ClusterInput::LinkUp {
        peer: peer("x"),
        capabilities: "{\"role\":".into(),
        generation: 1,
    });
    let out = h.take();
    assert_eq!(out.len(), 1, "{out:?}");
    match &out[0] {
        ClusterOutput::Close {
            peer: p,
            generation: 1,
            reason,
        } => {
            assert_eq!(p, &peer("x"));
            assert!(reason.starts_with("unreadable capabilities: "), "{reason}");
        }
        other => panic!("expected a close, got {other:?}"),
    }
    assert!(h.st().peers.is_empty());
}

#[test]
fn losing_an_idle_worker_places_after_the_debounce_and_keeps_serving() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.place_and_load();
    assert_eq!(h.active().len(), 1);
    let holder = h.active()[0].0.clone();
    h.join("idle", TWO_THIRDS);
    h.place_and_load_if_any();
    h.take();
    let t = h.now;
    h.input(ClusterInput::PeerLeft { peer: peer("idle") });
    assert_eq!(h.epoch(), Some(1), "the placement stands");
    assert_eq!(h.active()[0].0, holder);
    assert_eq!(h.st().status, PlacementStatus::Ready);
    assert!(!h.st().peers[&peer("idle")].online);
    assert_eq!(
        h.failed_runs(),
        vec![("idle".to_string(), "left the room".to_string())]
    );
    assert_eq!(h.core.poll_timeout(), Some(t + DEBOUNCE), "no hurry");
    h.take();
    h.advance(DEBOUNCE);
    assert!(
        h.loads().is_empty(),
        "the same placement is not loaded again"
    );
}

impl Harness {
    /// Places after the debounce and loads whatever was chosen (perhaps
    /// nothing new).
    fn place_and_load_if_any(&mut self) {
        self.take();
        self.advance(DEBOUNCE);
        for l in self.loads() {
            self.loaded(&l);
        }
    }
}

#[test]
fn losing_a_stage_holder_drops_the_placement_fails_its_runs_and_places_at_once() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.join("c", TWO_THIRDS);
    h.place_and_load();
    assert_eq!(h.epoch(), Some(1));
    let holder = h.active()[0].0.clone();
    h.take();
    let t = h.now;
    h.input(ClusterInput::Lost {
        peer: peer(&holder),
        why: "step timed out".into(),
    });
    assert_eq!(h.epoch(), None);
    assert_eq!(h.st().status, PlacementStatus::Placing);
    assert_eq!(
        h.st().message,
        format!("{holder} was lost (step timed out); placing again")
    );
    assert_eq!(
        h.st().warnings.last(),
        Some(&format!("lost {holder}: step timed out"))
    );
    assert_eq!(
        h.failed_runs(),
        vec![(holder.clone(), "step timed out".to_string())]
    );
    assert_eq!(h.core.poll_timeout(), Some(t + URGENT_DEBOUNCE));
    h.take();
    h.advance(URGENT_DEBOUNCE);
    let loads = h.loads();
    assert!(!loads.is_empty());
    assert!(loads.iter().all(|l| l.peer.as_str() != holder));
    for l in &loads {
        h.loaded(l);
    }
    assert_eq!(
        h.epoch(),
        Some(2),
        "every loaded placement gets a new epoch"
    );
}

#[test]
fn the_last_worker_lost_leaves_the_cluster_waiting() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.place_and_load();
    h.input(ClusterInput::LinkDown {
        peer: peer("a"),
        generation: None,
        why: "ice failed".into(),
    });
    assert_eq!(h.epoch(), None);
    h.advance(URGENT_DEBOUNCE);
    assert_eq!(h.st().status, PlacementStatus::Waiting);
    assert_eq!(h.st().message, "no calibrated worker is online");
}

#[test]
fn the_end_of_an_older_link_leaves_its_successor_alone() {
    let mut h = Harness::new();
    let first = h.link("a", "native", WHOLE);
    h.say("a", Message::Calibration(calibration()));
    let second = h.link("a", "native", WHOLE);
    h.place_and_load();
    assert_eq!(
        h.st().active.as_ref().map(|a| a.stages[0].generation),
        Some(second)
    );
    h.take();
    h.input(ClusterInput::LinkDown {
        peer: peer("a"),
        generation: Some(first),
        why: "closed".into(),
    });
    assert!(h.take().is_empty(), "nothing happens");
    assert!(h.st().peers[&peer("a")].online);
    assert_eq!(h.epoch(), Some(1));
    // The current link's end is a loss.
    h.input(ClusterInput::LinkDown {
        peer: peer("a"),
        generation: Some(second),
        why: "closed".into(),
    });
    assert!(!h.st().peers[&peer("a")].online);
    assert_eq!(h.epoch(), None);
    // Its reader ending once more (or another late end) fails only what
    // was sent to it since.
    h.take();
    h.input(ClusterInput::LinkDown {
        peer: peer("a"),
        generation: Some(second),
        why: "closed".into(),
    });
    assert_eq!(
        h.take(),
        vec![ClusterOutput::FailRuns {
            peer: peer("a"),
            why: "closed".into()
        }]
    );
}

#[test]
fn a_worker_lost_while_loading_fails_the_load() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    h.loaded(&loads[0]);
    h.input(ClusterInput::PeerLeft {
        peer: loads[1].peer.clone(),
    });
    assert_eq!(h.epoch(), None);
    assert_eq!(h.st().status, PlacementStatus::NoFit);
    assert!(
        h.st().message.contains("went away: left the room"),
        "{}",
        h.st().message
    );
}

#[test]
fn a_worker_gone_after_loading_its_layers_fails_the_load() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    h.loaded(&loads[0]);
    // Its link ended after it answered; the other one answers last.
    h.input(ClusterInput::LinkDown {
        peer: loads[0].peer.clone(),
        generation: None,
        why: "closed".into(),
    });
    h.loaded(&loads[1]);
    assert_eq!(h.epoch(), None);
    assert_eq!(h.st().message, "a worker went away while loading");
}

#[test]
fn changes_during_a_load_are_placed_once_it_ends() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    h.advance(Duration::from_secs(1));
    h.join("b", WHOLE);
    assert_eq!(
        h.core.poll_timeout(),
        Some(h.now + load_timeout(LAYERS as u64 * 10 * MB, None) - Duration::from_secs(1)),
        "nothing is placed while a placement loads"
    );
    h.advance(Duration::from_secs(1));
    h.loaded(&loads[0]);
    assert_eq!(h.epoch(), Some(1));
    assert_eq!(h.core.poll_timeout(), Some(h.now + DEBOUNCE));
    let computed = h.st().placements_computed;
    h.advance(DEBOUNCE);
    assert_eq!(h.st().placements_computed, computed + 1);
}

#[test]
fn a_pause_places_around_the_worker_and_a_resume_places_again() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.join("c", TWO_THIRDS);
    h.place_and_load();
    let before: Vec<String> = h.active().into_iter().map(|s| s.0).collect();
    let paused = before[0].clone();
    h.take();
    let t = h.now;
    h.say(
        &paused,
        Message::Pause {
            reason: "on battery".into(),
        },
    );
    assert_eq!(h.core.poll_timeout(), Some(t + DEBOUNCE));
    let loads = h.place_and_load();
    assert!(loads.iter().all(|l| l.peer.as_str() != paused), "{loads:?}");
    assert_eq!(h.epoch(), Some(2));
    let computed = h.st().placements_computed;
    h.say(&paused, Message::Resume);
    assert!(h.st().peers[&peer(&paused)].paused.is_none());
    h.advance(DEBOUNCE);
    assert_eq!(h.st().placements_computed, computed + 1, "placed again");
}

#[test]
fn telemetry_places_again_only_when_the_condition_changes() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.join("b", WHOLE);
    h.place_and_load_if_any();
    let holder = h.active()[0].0.clone();
    let computed = h.st().placements_computed;
    // A reading that changes nothing placement weighs.
    h.take();
    h.say(
        &holder,
        Message::Telemetry(Box::new(Telemetry {
            utilization: 0.9,
            ..telemetry()
        })),
    );
    assert_eq!(h.take(), vec![ClusterOutput::Changed]);
    assert_eq!(h.core.poll_timeout(), None);
    assert_eq!(h.st().peers[&peer(&holder)].utilization(), 0.9);
    // The holder turns critical: it is placed around.
    h.say(
        &holder,
        Message::Telemetry(Box::new(Telemetry {
            pressure: Some("critical".into()),
            ..telemetry()
        })),
    );
    assert_eq!(h.core.poll_timeout(), Some(h.now + DEBOUNCE));
    let loads = h.place_and_load();
    assert_eq!(h.st().placements_computed, computed + 1);
    assert!(loads.iter().all(|l| l.peer.as_str() != holder), "{loads:?}");
}

#[test]
fn telemetry_with_a_nan_battery_does_not_break_placement() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.say(
        "a",
        Message::Telemetry(Box::new(Telemetry {
            battery: Some(Battery {
                level: f64::NAN,
                charging: None,
            }),
            utilization: f64::NAN,
            ..telemetry()
        })),
    );
    h.place_and_load();
    assert_eq!(h.epoch(), Some(1));
    assert_eq!(h.active()[0].0, "a");
}

/// One lying or broken worker is left out; the others are still placed.
#[test]
fn a_worker_with_unbelievable_calibration_is_left_out_not_the_placement() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    for (name, bad) in [("nan", f64::NAN), ("neg", -1.0), ("huge", 1e9)] {
        h.link(name, "native", WHOLE);
        h.say(
            name,
            Message::Calibration(Calibration {
                decode_s_per_layer: bad,
                ..calibration()
            }),
        );
    }
    h.place_and_load();
    assert_eq!(h.epoch(), Some(1));
    let active = h.active();
    assert!(active.iter().all(|s| s.0 == "a"), "{active:?}");
}

#[test]
fn the_placement_served_is_not_loaded_again() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.place_and_load();
    let computed = h.st().placements_computed;
    h.take();
    h.input(ClusterInput::SetManual(None));
    h.advance(DEBOUNCE);
    assert_eq!(h.st().placements_computed, computed + 1, "placed again");
    assert!(h.loads().is_empty(), "the same placement is not reloaded");
    assert_eq!(h.epoch(), Some(1));
    assert_eq!(h.st().status, PlacementStatus::Ready);
}

fn stage(device: &str, start: usize, end: usize) -> Stage {
    Stage::new(device, start, end)
}

#[test]
fn a_valid_manual_placement_is_used() {
    let manual = vec![stage("b", 0, 12), stage("a", 12, 30)];
    let mut h = Harness::with_manual(Some(manual));
    h.join("a", WHOLE);
    h.join("b", WHOLE);
    let loads = h.place_and_load();
    let got: Vec<_> = loads
        .iter()
        .map(|l| (l.peer.to_string(), l.layers))
        .collect();
    assert_eq!(got, vec![("b".into(), (0, 12)), ("a".into(), (12, 30))]);
    assert_eq!(
        h.active(),
        vec![("b".into(), 0, 12, true), ("a".into(), 12, 30, true)]
    );
    assert!(h.st().warnings.is_empty());
}

#[test]
fn an_invalid_manual_placement_is_set_aside_with_a_warning() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.place_and_load();
    h.take();
    // "ghost" is not in the cluster.
    h.input(ClusterInput::SetManual(Some(vec![
        stage("ghost", 0, 15),
        stage("a", 15, 30),
    ])));
    assert_eq!(h.st().manual.as_ref().map(Vec::len), Some(2));
    h.advance(DEBOUNCE);
    assert_eq!(h.st().warnings.len(), 1);
    assert!(
        h.st().warnings[0].starts_with("manual placement set aside ("),
        "{:?}",
        h.st().warnings
    );
    assert!(h.loads().is_empty(), "the automatic placement stands");
    assert_eq!(h.active(), vec![("a".into(), 0, 30, true)]);
}

#[test]
fn link_measurements_reach_placement_and_only_from_the_current_link() {
    let mut h = Harness::new();
    let g = h.link("a", "native", WHOLE);
    let stats = SessionStats {
        rtt_smoothed: Some(Duration::from_millis(40)),
        throughput_bytes_per_s: Some(1e6),
        ..SessionStats::default()
    };
    h.core.set_link(&peer("a"), g + 1, stats.clone());
    assert!(h.st().peers[&peer("a")].link.is_none(), "not this link's");
    h.core.set_link(&peer("a"), g, stats);
    h.say("a", Message::Calibration(calibration()));
    let seen = profiles(h.st());
    assert_eq!(seen.len(), 1);
    assert!((seen[0].link_rtt_s - 0.04).abs() < 1e-9);
    assert_eq!(seen[0].link_bytes_per_s, 1e6);
    // Offline or uncalibrated workers are not placed.
    h.link("b", "native", WHOLE);
    assert_eq!(profiles(h.st()).len(), 1, "b is not calibrated");
    h.input(ClusterInput::PeerLeft { peer: peer("a") });
    assert!(profiles(h.st()).is_empty());
}

#[test]
fn a_worker_that_links_again_is_online_on_its_new_link_and_calibrated_again() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.place_and_load();
    h.input(ClusterInput::LinkDown {
        peer: peer("a"),
        generation: None,
        why: "heartbeat".into(),
    });
    assert!(!h.st().peers[&peer("a")].online);
    h.advance(URGENT_DEBOUNCE);
    h.take();
    let g = h.link("a", "native", WHOLE);
    let a = &h.st().peers[&peer("a")];
    assert!(a.online);
    assert_eq!(a.link_gen, g);
    assert!(
        a.calibration.is_some(),
        "the last calibration stands until the new one"
    );
    assert!(h.take().contains(&ClusterOutput::Send {
        peer: peer("a"),
        generation: g,
        msg: Message::Calibrate {
            config: MODEL_CONFIG.into()
        },
    }));
    h.say("a", Message::Calibration(calibration()));
    let loads = h.place_and_load();
    assert_eq!(loads[0].generation, g, "loaded over the new link");
    assert_eq!(h.epoch(), Some(2));
}

/// Peers coming and going cannot grow the state without end: a lost one is
/// listed as offline for a while, then forgotten; one back in time stays.
#[test]
fn a_departed_peer_is_forgotten_after_the_grace_period_unless_it_returns() {
    let mut h = Harness::new();
    h.join("a", WHOLE);
    h.join("b", WHOLE);
    h.place_and_load();
    for name in ["a", "b"] {
        h.input(ClusterInput::PeerLeft { peer: peer(name) });
    }
    h.advance(FORGET_AFTER / 2);
    assert_eq!(h.st().peers.len(), 2, "both still listed, offline");
    assert!(h.st().peers.values().all(|p| !p.online));
    h.join("b", WHOLE);
    h.advance(FORGET_AFTER / 2);
    let left: Vec<String> = h.st().peers.keys().map(ToString::to_string).collect();
    assert_eq!(left, ["b"], "a is forgotten, b came back");
    h.advance(FORGET_AFTER * 2);
    assert_eq!(h.st().peers.len(), 1, "an online peer is never forgotten");
}

#[test]
fn with_approval_a_worker_waits_unplaced_until_approved_and_a_rejected_one_stays_out() {
    let mut h = Harness::with(None, true);
    let ga = h.link("a", "native", WHOLE);
    let gb = h.link("b", "native", WHOLE);
    let out = h.take();
    assert!(
        !out.iter().any(|o| matches!(o, ClusterOutput::Send { .. })),
        "a worker waiting for approval is not calibrated: {out:?}"
    );
    assert!(
        out.contains(&ClusterOutput::Changed),
        "the dashboard shows it"
    );
    assert_eq!(
        h.core.pending().keys().cloned().collect::<Vec<_>>(),
        vec![peer("a"), peer("b")]
    );
    assert!(h.st().peers.is_empty(), "not in the placement's peers");
    assert!(h.st().message.contains("approval"), "{}", h.st().message);
    assert_eq!(h.core.poll_timeout(), None, "nothing to place");

    let rejected = peer("b");
    h.input(ClusterInput::Approve {
        peer: rejected.clone(),
        approved: false,
    });
    h.input(ClusterInput::Approve {
        peer: peer("a"),
        approved: true,
    });
    let out = h.take();
    assert!(out.contains(&ClusterOutput::Send {
        peer: peer("a"),
        generation: ga,
        msg: Message::Calibrate {
            config: MODEL_CONFIG.into()
        },
    }));
    assert!(
        !out.iter()
            .any(|o| matches!(o, ClusterOutput::Send { peer, .. } if peer == &rejected)),
        "the rejected worker is not calibrated"
    );
    assert!(h.core.pending().is_empty());
    h.say("a", Message::Calibration(calibration()));
    h.say("b", Message::Calibration(calibration()));
    let loads = h.place_and_load();
    assert!(
        loads.iter().all(|l| l.peer == peer("a")),
        "only the approved worker is placed: {loads:?}"
    );
    assert_eq!(h.epoch(), Some(1));
    let _ = gb;

    // Approved ahead of its link (a token approved before): it goes on at once.
    h.input(ClusterInput::Approve {
        peer: peer("c"),
        approved: true,
    });
    h.take();
    let gc = h.link("c", "native", WHOLE);
    assert!(h.take().contains(&ClusterOutput::Send {
        peer: peer("c"),
        generation: gc,
        msg: Message::Calibrate {
            config: MODEL_CONFIG.into()
        },
    }));
    // A waiting worker whose link ends stops waiting.
    let gd = h.link("d", "native", WHOLE);
    assert_eq!(h.core.pending().len(), 1);
    h.input(ClusterInput::LinkDown {
        peer: peer("d"),
        generation: Some(gd),
        why: "gone".into(),
    });
    assert!(h.core.pending().is_empty());
    assert!(!h.st().peers.contains_key(&peer("d")));
    // An approval ends with the peer's time in the room.
    h.input(ClusterInput::Approve {
        peer: peer("e"),
        approved: true,
    });
    h.input(ClusterInput::PeerLeft { peer: peer("e") });
    h.link("e", "native", WHOLE);
    assert_eq!(h.core.pending().len(), 1, "asked again after leaving");
}

#[test]
fn an_evicted_worker_is_placed_around_closed_and_never_linked_again() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.join("c", TWO_THIRDS);
    h.place_and_load();
    let holder = h.active()[0].0.clone();
    let generation = h.st().peers[&peer(&holder)].link_gen;
    h.take();
    h.input(ClusterInput::Evict {
        peer: peer(&holder),
        why: "a spot check found a wrong token".into(),
    });
    assert_eq!(h.epoch(), None);
    assert_eq!(
        h.st().evicted.get(&peer(&holder)).map(String::as_str),
        Some("a spot check found a wrong token")
    );
    let out = h.take();
    assert!(
        out.iter().any(
            |o| matches!(o, ClusterOutput::Close { peer: p, generation: g, reason }
            if p.as_str() == holder && *g == generation && reason.contains("evicted"))
        ),
        "{out:?}"
    );
    assert!(
        out.iter()
            .any(|o| matches!(o, ClusterOutput::FailRuns { peer: p, .. } if p.as_str() == holder))
    );
    h.advance(URGENT_DEBOUNCE);
    let loads = h.loads();
    assert!(!loads.is_empty());
    assert!(loads.iter().all(|l| l.peer.as_str() != holder));
    for l in &loads {
        h.loaded(l);
    }
    assert_eq!(h.epoch(), Some(2));
    // It links again: closed at once, neither calibrated nor placed.
    h.take();
    let g = h.link(&holder, "native", TWO_THIRDS);
    let out = h.take();
    assert_eq!(
        out,
        vec![ClusterOutput::Close {
            peer: peer(&holder),
            generation: g,
            reason: "evicted: a spot check found a wrong result".into(),
        }]
    );
    assert!(!h.st().peers[&peer(&holder)].online);
}

#[test]
fn a_worker_whose_loaded_bytes_cannot_be_believed_is_evicted_and_placed_around() {
    let mut h = Harness::new();
    h.join("a", TWO_THIRDS);
    h.join("b", TWO_THIRDS);
    h.join("c", TWO_THIRDS);
    h.advance(DEBOUNCE);
    let loads = h.loads();
    assert!(loads.len() >= 2, "{loads:?}");
    let liar = loads[0].peer.clone();
    h.say(
        liar.as_str(),
        Message::ShardLoaded {
            layers: LayerRange {
                start: loads[0].layers.0,
                end: loads[0].layers.1,
            },
            weight_bytes: 1,
            load_ms: 1,
        },
    );
    let why = h.st().evicted.get(&liar).cloned().unwrap_or_default();
    assert!(why.contains("reported 1 bytes"), "{why}");
    for l in &loads[1..] {
        h.loaded(l);
    }
    assert_eq!(h.epoch(), None, "the load with the liar does not serve");
    h.advance(RETRY);
    let loads = h.loads();
    assert!(!loads.is_empty());
    assert!(loads.iter().all(|l| l.peer != liar), "{loads:?}");
    for l in &loads {
        h.loaded(l);
    }
    assert!(h.epoch().is_some());
}

/// A worker over several devices whose calibration offers a faster tensor split is told to
/// split its stage that way (`LoadShard::split`), the placement says so, and a later
/// calibration that makes the tensor split slower moves it back to layers.
#[test]
fn a_worker_is_told_to_split_by_tensors_where_that_is_predicted_faster() {
    let mut h = Harness::new();
    h.link("gpus", "native", 1 << 40);
    let faster = SplitTiming {
        decode_s_per_layer: 0.5e-3,
        prefill_s_per_layer_token: 0.5e-4,
        call_overhead_s: 2e-4,
        head_s: 1e-3,
        devices: 2,
    };
    h.say(
        "gpus",
        Message::Calibration(Calibration {
            tensor: Some(faster),
            ..calibration()
        }),
    );
    let loads = h.place_and_load();
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0].split, StageSplit::Tensor);
    assert!(h.st().message.contains("/tensor"), "{}", h.st().message);
    let slower = SplitTiming {
        decode_s_per_layer: 2e-3,
        ..faster
    };
    h.say(
        "gpus",
        Message::Calibration(Calibration {
            tensor: Some(slower),
            ..calibration()
        }),
    );
    let loads = h.place_and_load();
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0].split, StageSplit::Layers);
}
