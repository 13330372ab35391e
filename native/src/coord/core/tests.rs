//! The request core driven with made-up time: every rule of a run (chain,
//! relays, timeouts, stalls, recovery, re-placement, admission) without a
//! process or a socket.

use std::time::{Duration, Instant};

use cairn_engine::kernels::SampleParams;
use cairn_engine::protocol::{DType, Message, Tensor, error_code};
use cairn_signal::protocol::PeerId;

use super::placing::{DEBOUNCE, Debounce, LOAD_TIMEOUT, Loading, URGENT_DEBOUNCE};
use super::request::{MAX_RETRIES, MIN_STALL, MIN_STEP, STEP_MARGIN};
use super::*;
use crate::coord::pipeline::{FinishReason, GenRequest};
use crate::coord::{StageFailure, StageReply};

const STEP_TIMEOUT: Duration = Duration::from_secs(60);
const WAIT_TIMEOUT: Duration = Duration::from_secs(30);
const EOG: u32 = 2;
const PROMPT: [u32; 3] = [10, 11, 12];

fn peer(name: &str) -> PeerId {
    PeerId(name.into())
}

/// A stage of `layers` on `name`; `direct` when its output goes straight on.
fn stage(name: &str, start: usize, end: usize, direct: bool) -> StageView {
    StageView {
        peer: peer(name),
        start,
        end,
        direct,
    }
}

fn placement(epoch: u64, stages: Vec<StageView>) -> Placement {
    Placement {
        epoch,
        stages,
        cost: None,
    }
}

/// A cluster serving `active` with `online` up.
fn cluster(active: Option<Placement>, online: &[&str]) -> ClusterView {
    ClusterView {
        active,
        online: online.iter().map(|p| peer(p)).collect(),
        message: "waiting for workers".into(),
        trusted: Default::default(),
    }
}

/// One native worker holding every layer (its own next stage).
fn single(epoch: u64) -> ClusterView {
    cluster(
        Some(placement(epoch, vec![stage("a", 0, 30, true)])),
        &["a"],
    )
}

/// Three native workers in a ring.
fn ring() -> ClusterView {
    cluster(
        Some(placement(
            1,
            vec![
                stage("a", 0, 10, true),
                stage("b", 10, 20, true),
                stage("c", 20, 30, true),
            ],
        )),
        &["a", "b", "c"],
    )
}

/// A native first and last stage with a browser in between: no hop but
/// the last one (c back to a) goes straight.
fn with_browser() -> ClusterView {
    cluster(
        Some(placement(
            1,
            vec![
                stage("a", 0, 10, false),
                stage("b", 10, 20, false),
                stage("c", 20, 30, true),
            ],
        )),
        &["a", "b", "c"],
    )
}

/// A request's core, a clock, and what it asked for so far.
struct Harness {
    core: Request,
    now: Instant,
    out: Vec<Output>,
}

impl Harness {
    fn new(max_tokens: usize) -> Harness {
        Harness::with(max_tokens, false)
    }

    fn with(max_tokens: usize, ignore_eos: bool) -> Harness {
        Harness::spot(max_tokens, ignore_eos, SpotConfig::off())
    }

    fn spot(max_tokens: usize, ignore_eos: bool, spot: SpotConfig) -> Harness {
        let now = Instant::now();
        let cfg = RequestConfig {
            id: 7,
            wait_timeout: WAIT_TIMEOUT,
            step_timeout: STEP_TIMEOUT,
            end_ids: vec![EOG, 900],
            spot,
        };
        let req = GenRequest {
            label: "test".into(),
            prompt: PROMPT.to_vec(),
            max_tokens,
            sample: SampleParams::default(),
            ignore_eos,
        };
        Harness {
            core: Request::new(cfg, req, now),
            now,
            out: Vec::new(),
        }
    }

    fn drain(&mut self) -> Vec<Output> {
        let mut v = Vec::new();
        while let Some(o) = self.core.poll_output() {
            v.push(o);
        }
        v
    }

    fn input(&mut self, input: Input) -> Vec<Output> {
        self.core.handle(input, self.now);
        let v = self.drain();
        self.out.extend(v.iter().map(clone_output));
        v
    }

    fn cluster(&mut self, view: ClusterView) -> Vec<Output> {
        self.input(Input::Cluster(view))
    }

    fn advance(&mut self, by: Duration) -> Vec<Output> {
        self.now += by;
        if self.core.poll_timeout().is_some_and(|t| t <= self.now) {
            self.core.handle_timeout(self.now);
        }
        let v = self.drain();
        self.out.extend(v.iter().map(clone_output));
        v
    }

    fn reply(&mut self, from: &str, seq: u32, reply: StageReply) -> Vec<Output> {
        self.input(Input::Reply {
            from: peer(from),
            seq,
            reply,
        })
    }

    /// The last stage reports the token of `step`.
    fn token(&mut self, from: &str, seq: u32, step: u32, id: u32, passed_on: bool) -> Vec<Output> {
        self.now += Duration::from_millis(10);
        self.reply(
            from,
            seq,
            Ok(Message::Token {
                request: 7,
                seq,
                step,
                id,
                passed_on,
            }),
        )
    }

    fn activations(&mut self, from: &str, seq: u32, pos0: u32) -> Vec<Output> {
        self.now += Duration::from_millis(10);
        let tensor = Tensor::from_values(DType::F32, vec![1, 2], &[1.0f32, 2.0]).unwrap();
        self.reply(
            from,
            seq,
            Ok(Message::Activations {
                request: 7,
                seq,
                pos0,
                tensor,
            }),
        )
    }

    /// Every token streamed so far.
    fn streamed(&self) -> Vec<u32> {
        self.out
            .iter()
            .filter_map(|o| match o {
                Output::Token(t) => Some(*t),
                _ => None,
            })
            .collect()
    }

    fn counted(&self, c: Count) -> usize {
        self.out
            .iter()
            .filter(|o| matches!(o, Output::Count(x) if *x == c))
            .count()
    }

    fn finished(&self) -> Option<&Result<(FinishReason, u32), String>> {
        self.out.iter().find_map(|o| match o {
            Output::Finished(r) => Some(r),
            _ => None,
        })
    }
}

fn clone_output(o: &Output) -> Output {
    match o {
        Output::Send { epoch, peer, msg } => Output::Send {
            epoch: *epoch,
            peer: peer.clone(),
            msg: msg.clone(),
        },
        Output::Token(t) => Output::Token(*t),
        Output::Status {
            state,
            generated,
            recoveries,
        } => Output::Status {
            state,
            generated: *generated,
            recoveries: *recoveries,
        },
        Output::Count(c) => Output::Count(*c),
        Output::Blame { peer, why } => Output::Blame {
            peer: peer.clone(),
            why: why.clone(),
        },
        Output::Check(c) => Output::Check(c.clone()),
        Output::Prefetch { request, context } => Output::Prefetch {
            request: *request,
            context: context.clone(),
        },
        Output::Evict { peers, why } => Output::Evict {
            peers: peers.clone(),
            why: why.clone(),
        },
        Output::Finished(r) => Output::Finished(r.clone()),
    }
}

/// A `Forward` among `outputs`: to whom, of which epoch, and its fields.
struct Step {
    epoch: u64,
    to: PeerId,
    seq: u32,
    pos0: u32,
    step: u32,
    chained: bool,
    tokens: Option<Vec<u32>>,
    layers: (u32, u32),
}

fn steps(outputs: &[Output]) -> Vec<Step> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Send {
                epoch,
                peer,
                msg:
                    Message::Forward {
                        seq,
                        pos0,
                        sample,
                        chain,
                        tensor,
                        layers,
                        ..
                    },
            } => Some(Step {
                epoch: *epoch,
                to: peer.clone(),
                seq: *seq,
                pos0: *pos0,
                step: sample.map_or(u32::MAX, |s| s.step),
                chained: chain.is_some(),
                tokens: (tensor.dtype() == DType::U32).then(|| tensor.to_values().unwrap()),
                layers: (layers.start, layers.end),
            }),
            _ => None,
        })
        .collect()
}

fn ends(outputs: &[Output]) -> Vec<PeerId> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Send {
                peer,
                msg: Message::EndRequest { request: 7 },
                ..
            } => Some(peer.clone()),
            _ => None,
        })
        .collect()
}

fn blamed(outputs: &[Output]) -> Vec<PeerId> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Blame { peer, .. } => Some(peer.clone()),
            _ => None,
        })
        .collect()
}

fn prompt_and(out: &[u32]) -> Vec<u32> {
    let mut v = PROMPT.to_vec();
    v.extend_from_slice(out);
    v
}

#[test]
fn a_single_stage_runs_the_prompt_then_streams_until_the_length() {
    let mut h = Harness::new(3);
    let o = h.cluster(single(1));
    let s = steps(&o);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].to, peer("a"));
    assert_eq!((s[0].epoch, s[0].seq, s[0].pos0, s[0].step), (1, 1, 0, 0));
    assert!(s[0].chained);
    assert_eq!(s[0].tokens.as_deref(), Some(&PROMPT[..]));
    assert_eq!(s[0].layers, (0, 30));
    assert_eq!(h.core.run(), Some((1, vec![peer("a")])));
    // The worker passes each token on to itself: nothing to send.
    assert!(steps(&h.token("a", 1, 0, 100, true)).is_empty());
    assert!(steps(&h.token("a", 1, 1, 101, true)).is_empty());
    let o = h.token("a", 1, 2, 102, true);
    assert_eq!(ends(&o), vec![peer("a")]);
    assert_eq!(h.streamed(), vec![100, 101, 102]);
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Length, 0))));
    assert!(h.core.is_done());
    assert_eq!(h.core.poll_timeout(), None);
    assert_eq!(h.counted(Count::Generated), 3);
    assert_eq!(h.counted(Count::PassedOn), 3);
    assert_eq!(h.counted(Count::Relayed), 0);
}

#[test]
fn a_chain_sends_only_the_prompt_and_takes_tokens_from_the_last_stage() {
    let mut h = Harness::new(4);
    let o = h.cluster(ring());
    let s = steps(&o);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].to, peer("a"));
    assert_eq!(s[0].layers, (0, 10));
    for step in 0..3 {
        let o = h.token("c", 1, step, 200 + step, true);
        assert!(steps(&o).is_empty(), "the chain carries step {step}");
    }
    // The first stage reporting a token is a broken chain, not output.
    let o = h.token("a", 1, 3, 999, true);
    assert!(
        matches!(h.finished(), Some(Err(m)) if m.contains("where step 3 of the last stage was due"))
    );
    assert_eq!(ends(&o).len(), 3, "every stage forgets the request");
    assert_eq!(h.streamed(), vec![200, 201, 202]);
}

#[test]
fn a_token_for_the_wrong_step_fails_the_request() {
    let mut h = Harness::new(4);
    h.cluster(single(1));
    h.token("a", 1, 0, 100, true);
    h.token("a", 1, 2, 101, true);
    assert!(matches!(h.finished(), Some(Err(m)) if m.contains("token of step 2")));
}

#[test]
fn hops_to_and_from_a_browser_are_relayed_by_the_coordinator() {
    let mut h = Harness::new(3);
    h.cluster(with_browser());
    let s = steps(&h.activations("a", 1, 0));
    assert_eq!(s.len(), 1);
    assert_eq!(
        (s[0].to.clone(), s[0].pos0, s[0].layers),
        (peer("b"), 0, (10, 20))
    );
    assert!(s[0].tokens.is_none(), "activations travel on as they came");
    let s = steps(&h.activations("b", 1, 0));
    assert_eq!((s[0].to.clone(), s[0].layers), (peer("c"), (20, 30)));
    // c hands its token straight to a.
    assert!(steps(&h.token("c", 1, 0, 300, true)).is_empty());
    // Step 1: a's activations at position 3 (the prompt's length).
    let s = steps(&h.activations("a", 1, 3));
    assert_eq!((s[0].to.clone(), s[0].pos0, s[0].step), (peer("b"), 3, 1));
    assert_eq!(h.counted(Count::Relayed), 3);
    // Activations from the last stage make no sense.
    h.activations("c", 1, 3);
    assert!(matches!(h.finished(), Some(Err(m)) if m.contains("activations out of turn")));
}

#[test]
fn a_token_not_passed_on_is_sent_to_the_first_stage() {
    let mut h = Harness::new(3);
    h.cluster(ring());
    let s = steps(&h.token("c", 1, 0, 400, false));
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].to, peer("a"));
    assert_eq!(s[0].tokens.as_deref(), Some(&[400][..]));
    assert_eq!((s[0].pos0, s[0].step), (PROMPT.len() as u32, 1));
    assert_eq!(h.counted(Count::Relayed), 1);
    assert_eq!(h.counted(Count::PassedOn), 0);
}

#[test]
fn a_step_timeout_blames_the_stage_that_must_answer() {
    // After a passed-on token the browser chain waits on a, which relays
    // to the browser: a is the one to blame.
    let mut h = Harness::new(5);
    h.cluster(with_browser());
    h.activations("a", 1, 0);
    h.activations("b", 1, 0);
    h.token("c", 1, 0, 300, true);
    assert!(
        h.advance(STEP_TIMEOUT - Duration::from_millis(1))
            .is_empty()
    );
    let o = h.advance(Duration::from_millis(1));
    assert_eq!(blamed(&o), vec![peer("a")]);
    assert_eq!(h.counted(Count::Recovery), 1);
    // The run is over and the request waits for a placement without a.
    assert_eq!(h.core.run(), None);
    let o = h.cluster(with_browser());
    assert!(steps(&o).is_empty(), "the old placement is not used again");

    // Waiting on the browser: b is blamed.
    let mut h = Harness::new(5);
    h.cluster(with_browser());
    h.activations("a", 1, 0);
    let o = h.advance(STEP_TIMEOUT);
    assert_eq!(blamed(&o), vec![peer("b")]);

    // The prompt of a chain goes on from worker to worker: a silence then
    // names nobody, and the run goes on through the coordinator.
    let mut h = Harness::new(5);
    h.cluster(ring());
    assert!(
        h.advance(STEP_TIMEOUT - Duration::from_millis(1))
            .is_empty()
    );
    let o = h.advance(Duration::from_millis(1));
    assert!(blamed(&o).is_empty());
    assert!(h.core.relay_all());
    assert_eq!(steps(&o)[0].seq, 2);
}

/// [`with_browser`] with a calibration that predicts `per_token` a token
/// and `per_prompt_token` a prompt token.
fn predicted(per_token: Duration, per_prompt_token: Duration) -> ClusterView {
    let mut c = with_browser();
    if let Some(p) = c.active.as_mut() {
        p.cost = Some(StepCost {
            per_token,
            per_prompt_token,
        });
    }
    c
}

#[test]
fn step_timeouts_scale_with_the_calibrated_speed_and_the_steps_size() {
    let ms = Duration::from_millis;
    // A fast placement: a silent stage is blamed after MIN_STEP, in the
    // prompt and after it, not after the whole step timeout.
    let mut h = Harness::new(5);
    h.cluster(predicted(ms(20), ms(2)));
    assert_eq!(h.core.poll_timeout(), Some(h.now + MIN_STEP));
    h.activations("a", 1, 0);
    assert!(h.advance(MIN_STEP - ms(1)).is_empty());
    assert_eq!(blamed(&h.advance(ms(1))), vec![peer("b")]);

    let mut h = Harness::new(5);
    h.cluster(predicted(ms(20), ms(2)));
    h.activations("a", 1, 0);
    h.activations("b", 1, 0);
    h.token("c", 1, 0, 300, true);
    assert_eq!(h.core.poll_timeout(), Some(h.now + MIN_STEP));

    // A slow device: the prompt's step is given its predicted time many
    // times over (3 prompt tokens at 400 ms), a token step its own (1 s).
    let mut h = Harness::new(5);
    h.cluster(predicted(ms(1000), ms(400)));
    let prompt = ms(400) * PROMPT.len() as u32 * STEP_MARGIN;
    assert!(prompt > MIN_STEP && prompt < STEP_TIMEOUT);
    assert_eq!(h.core.poll_timeout(), Some(h.now + prompt));
    h.activations("a", 1, 0);
    h.activations("b", 1, 0);
    h.token("c", 1, 0, 300, true);
    let token = ms(1000) * STEP_MARGIN;
    assert!(token > MIN_STEP && token < prompt);
    assert_eq!(h.core.poll_timeout(), Some(h.now + token));

    // Never over the step timeout, and all of it without a prediction.
    let huge = Some(StepCost {
        per_token: Duration::from_secs(100),
        per_prompt_token: Duration::from_secs(100),
    });
    assert_eq!(request::step_limit(huge, 1, STEP_TIMEOUT), STEP_TIMEOUT);
    assert_eq!(request::step_limit(None, 1, STEP_TIMEOUT), STEP_TIMEOUT);
    // A token step is never under the stall limit of the tokens measured.
    let mut h = Harness::new(5);
    h.cluster(predicted(ms(1), ms(1)));
    h.activations("a", 1, 0);
    h.activations("b", 1, 0);
    h.token("c", 1, 0, 300, true);
    h.activations("a", 1, 1);
    h.activations("b", 1, 1);
    h.now += Duration::from_secs(1);
    h.token("c", 1, 1, 301, true);
    // 1.01 s since the last news (each event takes the harness 10 ms).
    let stall = request::stall_after(ms(1010), STEP_TIMEOUT);
    assert!(stall > MIN_STEP);
    assert_eq!(h.core.poll_timeout(), Some(h.now + stall));
}

#[test]
fn a_prediction_without_usable_numbers_gives_no_step_cost() {
    use cairn_engine::placement::Prediction;
    let p = |s_per_token: f64, prefill_s: f64, prompt_tokens: usize| Prediction {
        stages: Vec::new(),
        s_per_token,
        tokens_per_s: 1.0 / s_per_token,
        prefill_s,
        aggregate_tokens_per_s: 0.0,
        concurrency: 1,
        prompt_tokens,
    };
    let c = StepCost::from_prediction(&p(0.02, 0.64, 64)).expect("a cost");
    assert_eq!(c.per_token, Duration::from_millis(20));
    assert_eq!(c.per_prompt_token, Duration::from_millis(10));
    assert_eq!(c.step(1), Duration::from_millis(20));
    assert_eq!(c.step(100), Duration::from_secs(1));
    for bad in [
        p(f64::NAN, 0.64, 64),
        p(0.02, f64::INFINITY, 64),
        p(-1.0, 0.64, 64),
        p(0.02, 0.64, 0),
    ] {
        assert_eq!(StepCost::from_prediction(&bad), None, "{bad:?}");
    }
}

#[test]
fn a_silent_chain_stalls_and_goes_on_through_the_coordinator() {
    let mut h = Harness::new(10);
    h.cluster(ring());
    h.token("c", 1, 0, 500, true);
    h.token("c", 1, 1, 501, true);
    // The slowest token took 10 ms: the stall limit is the minimum.
    assert_eq!(h.core.poll_timeout(), Some(h.now + MIN_STALL));
    assert!(h.advance(MIN_STALL - Duration::from_millis(1)).is_empty());
    let o = h.advance(Duration::from_millis(1));
    assert!(blamed(&o).is_empty(), "nobody is known to be at fault");
    assert!(h.core.relay_all());
    let s = steps(&o);
    assert_eq!(s.len(), 1);
    assert_eq!(
        (s[0].seq, s[0].pos0, s[0].step, s[0].chained),
        (2, 0, 2, false)
    );
    assert_eq!(s[0].tokens.as_deref(), Some(&prompt_and(&[500, 501])[..]));
    assert_eq!(h.counted(Count::Recovery), 0);
    // Every hop now comes through the coordinator, and a silent stage is named.
    let s = steps(&h.activations("a", 2, 0));
    assert_eq!(s[0].to, peer("b"));
    let o = h.advance(STEP_TIMEOUT);
    assert_eq!(blamed(&o), vec![peer("b")]);
}

#[test]
fn the_stall_limit_grows_with_slow_tokens_up_to_the_step_timeout() {
    let mut h = Harness::new(10);
    h.cluster(ring());
    h.token("c", 1, 0, 500, true);
    h.now += Duration::from_secs(1);
    h.token("c", 1, 1, 501, true);
    // 1.01 s between tokens, twenty times over.
    let slowest = Duration::from_millis(1010);
    assert_eq!(h.core.poll_timeout(), Some(h.now + slowest * 20));
    assert_eq!(
        request::stall_after(Duration::from_secs(10), STEP_TIMEOUT),
        STEP_TIMEOUT
    );
}

#[test]
fn a_lost_worker_is_recovered_on_the_next_placement_with_the_same_output() {
    // What an unbroken run gives.
    let reference = [600, 601, 602, 603, 604];
    let mut h = Harness::new(5);
    h.cluster(ring());
    h.token("c", 1, 0, reference[0], true);
    h.token("c", 1, 1, reference[1], true);
    // b goes away: the shell drops the placement and b is offline.
    let o = h.cluster(cluster(None, &["a", "c"]));
    assert!(steps(&o).is_empty());
    assert_eq!(h.counted(Count::Recovery), 1);
    assert_eq!(h.core.run(), None);
    // A placement without b: the run starts over with what it has.
    let o = h.cluster(cluster(
        Some(placement(
            2,
            vec![stage("a", 0, 15, true), stage("c", 15, 30, true)],
        )),
        &["a", "c"],
    ));
    let s = steps(&o);
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].epoch, s[0].seq, s[0].pos0, s[0].step), (2, 2, 0, 2));
    assert_eq!(
        s[0].tokens.as_deref(),
        Some(&prompt_and(&reference[..2])[..])
    );
    // An answer of the old run is dropped.
    assert!(h.token("c", 1, 2, 999, true).is_empty());
    for (step, t) in reference.iter().enumerate().skip(2) {
        h.token("c", 2, step as u32, *t, true);
    }
    assert_eq!(h.streamed(), reference);
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Length, 1))));
    // Both placements may hold a cache of it; each worker is told once.
    let told = ends(&h.out);
    assert_eq!(told, vec![peer("a"), peer("b"), peer("c")]);
}

#[test]
fn a_reported_loss_waits_for_a_new_epoch() {
    let mut h = Harness::new(5);
    h.cluster(ring());
    h.token("c", 1, 0, 1, true);
    // The shell reports b lost and has already dropped it.
    h.core
        .handle(Input::Cluster(cluster(None, &["a", "c"])), h.now);
    h.drain();
    h.reply("b", 1, Err(StageFailure::Lost("link down".into())));
    // The same placement coming back (a stale view) is not used again.
    let o = h.cluster(ring());
    assert!(steps(&o).is_empty());
    let mut next = ring();
    if let Some(a) = &mut next.active {
        a.epoch = 2;
    }
    let s = steps(&h.cluster(next));
    assert_eq!((s[0].epoch, s[0].seq), (2, 2));
}

#[test]
fn a_placement_change_while_running_rebuilds_without_a_recovery() {
    let mut h = Harness::new(5);
    h.cluster(single(1));
    h.token("a", 1, 0, 700, true);
    // A worker joined and the placer chose a chain of two.
    let two = cluster(
        Some(placement(
            2,
            vec![stage("a", 0, 15, true), stage("d", 15, 30, true)],
        )),
        &["a", "d"],
    );
    let s = steps(&h.cluster(two));
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].epoch, s[0].seq, s[0].to.clone()), (2, 2, peer("a")));
    assert_eq!(s[0].tokens.as_deref(), Some(&prompt_and(&[700])[..]));
    assert_eq!(h.counted(Count::Recovery), 0);
    h.token("d", 2, 1, 701, true);
    assert_eq!(h.streamed(), vec![700, 701]);
}

#[test]
fn a_pause_that_moves_the_layers_is_a_new_placement() {
    // The paused worker stays online; only the placement changes.
    let mut h = Harness::new(3);
    h.cluster(ring());
    h.token("c", 1, 0, 1, true);
    let without_b = cluster(
        Some(placement(
            2,
            vec![stage("a", 0, 15, true), stage("c", 15, 30, true)],
        )),
        &["a", "b", "c"],
    );
    let s = steps(&h.cluster(without_b));
    assert_eq!((s[0].epoch, s[0].seq), (2, 2));
    assert_eq!(h.counted(Count::Recovery), 0);
    assert_eq!(h.core.recoveries(), 0);
}

#[test]
fn a_request_with_no_placement_waits_then_fails_after_its_timeout() {
    let mut h = Harness::new(3);
    assert!(steps(&h.cluster(cluster(None, &[]))).is_empty());
    assert!(!h.core.is_done());
    assert!(
        h.advance(WAIT_TIMEOUT - Duration::from_millis(1))
            .is_empty()
    );
    let o = h.advance(Duration::from_millis(1));
    assert!(ends(&o).is_empty(), "it never ran anywhere");
    match h.finished() {
        Some(Err(m)) => {
            assert!(m.starts_with("no placement could serve this request within 30s"));
            assert!(m.ends_with("waiting for workers"), "{m}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[test]
fn a_waiting_request_starts_when_a_placement_appears() {
    let mut h = Harness::new(3);
    h.cluster(cluster(None, &[]));
    h.advance(WAIT_TIMEOUT / 2);
    let s = steps(&h.cluster(single(1)));
    assert_eq!(s.len(), 1);
    // Its wait is over: the timer is now the step's.
    assert_eq!(h.core.poll_timeout(), Some(h.now + STEP_TIMEOUT));
}

#[test]
fn a_waiting_after_a_loss_has_its_own_deadline() {
    let mut h = Harness::new(3);
    h.cluster(single(1));
    h.advance(WAIT_TIMEOUT - Duration::from_secs(1));
    h.cluster(cluster(None, &[]));
    assert_eq!(h.core.poll_timeout(), Some(h.now + WAIT_TIMEOUT));
    assert!(h.finished().is_none());
}

#[test]
fn cancelling_frees_the_run_and_tells_the_stages() {
    let mut h = Harness::new(5);
    h.cluster(ring());
    h.token("c", 1, 0, 1, false);
    // The token's relay was queued; the client leaves before it goes.
    h.core.handle(
        Input::Reply {
            from: peer("c"),
            seq: 1,
            reply: Ok(Message::Token {
                request: 7,
                seq: 1,
                step: 1,
                id: 3,
                passed_on: false,
            }),
        },
        h.now,
    );
    let o = h.input(Input::Cancel);
    assert!(steps(&o).is_empty(), "a step for a gone client is not sent");
    assert_eq!(ends(&o).len(), 3);
    assert_eq!(h.core.run(), None);
    assert_eq!(h.core.poll_timeout(), None);
    assert_eq!(h.finished(), Some(&Err("the client went away".into())));
    // Nothing after the end.
    assert!(h.token("c", 1, 2, 3, true).is_empty());
    assert!(h.input(Input::Cancel).is_empty());
}

#[test]
fn a_refused_step_is_retried_then_fails_the_request() {
    let mut h = Harness::new(5);
    h.cluster(single(1));
    let refuse = |h: &mut Harness, seq| {
        h.reply(
            "a",
            seq,
            Err(StageFailure::Refused {
                code: error_code::INTERNAL,
                text: "out of memory".into(),
            }),
        )
    };
    for seq in 1..=MAX_RETRIES {
        let s = steps(&refuse(&mut h, seq));
        assert_eq!((s[0].seq, s[0].pos0), (seq + 1, 0), "retry {seq}");
    }
    refuse(&mut h, MAX_RETRIES + 1);
    assert!(
        matches!(h.finished(), Some(Err(m)) if m == "a stage kept failing: a failed the step: out of memory")
    );
}

#[test]
fn a_step_the_request_is_at_fault_for_fails_at_once() {
    let mut h = Harness::new(5);
    h.cluster(single(1));
    h.reply(
        "a",
        1,
        Err(StageFailure::Refused {
            code: error_code::BAD_REQUEST,
            text: "too long".into(),
        }),
    );
    assert_eq!(h.finished(), Some(&Err("a: too long".into())));
}

#[test]
fn a_refusal_after_the_placement_moved_is_a_rebuild() {
    let mut h = Harness::new(5);
    h.cluster(single(1));
    h.core.handle(Input::Cluster(single(2)), h.now);
    h.drain();
    // The new run's first stage refuses a step of the old one: stale.
    assert!(
        h.reply(
            "a",
            1,
            Err(StageFailure::Refused {
                code: error_code::BAD_REQUEST,
                text: "wrong layers".into(),
            }),
        )
        .is_empty()
    );
    assert!(h.finished().is_none());
}

#[test]
fn a_failed_send_on_a_standing_placement_counts_as_a_retry() {
    let mut h = Harness::new(5);
    h.cluster(single(1));
    for i in 1..=MAX_RETRIES {
        let s = steps(&h.input(Input::SendFailed {
            peer: peer("a"),
            error: "link closed".into(),
        }));
        assert_eq!(s[0].seq, i + 1);
    }
    h.input(Input::SendFailed {
        peer: peer("a"),
        error: "link closed".into(),
    });
    assert!(
        matches!(h.finished(), Some(Err(m)) if m.starts_with("a stage kept failing: a: link closed"))
    );
    assert_eq!(h.counted(Count::Recovery) as u32, MAX_RETRIES + 1);
}

#[test]
fn a_run_on_a_worker_already_gone_is_lost_at_once() {
    let mut h = Harness::new(3);
    let mut view = single(1);
    view.online.clear();
    let o = h.cluster(view);
    assert!(steps(&o).is_empty());
    assert_eq!(h.counted(Count::Recovery), 1);
    let s = steps(&h.cluster(single(2)));
    assert_eq!(s[0].epoch, 2);
}

#[test]
fn an_end_of_generation_token_stops_without_being_streamed() {
    let mut h = Harness::new(5);
    h.cluster(single(1));
    h.token("a", 1, 0, 1, true);
    h.token("a", 1, 1, EOG, true);
    assert_eq!(h.streamed(), vec![1]);
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Stop, 0))));
    assert_eq!(h.counted(Count::Generated), 2);

    let mut h = Harness::with(2, true);
    let s = steps(&h.cluster(single(1)));
    assert!(s[0].chained);
    h.token("a", 1, 0, EOG, true);
    h.token("a", 1, 1, EOG, true);
    assert_eq!(h.streamed(), vec![EOG, EOG]);
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Length, 0))));
}

#[test]
fn a_chain_carries_the_end_ids_unless_the_request_ignores_them() {
    let mut h = Harness::new(5);
    let o = h.cluster(single(1));
    let chain = o.iter().find_map(|o| match o {
        Output::Send {
            msg: Message::Forward { chain, .. },
            ..
        } => chain.clone(),
        _ => None,
    });
    let chain = chain.unwrap();
    assert_eq!((chain.max_steps, chain.end_ids), (5, vec![EOG, 900]));

    let mut h = Harness::with(5, true);
    let o = h.cluster(single(1));
    let ids = o.iter().find_map(|o| match o {
        Output::Send {
            msg: Message::Forward { chain, .. },
            ..
        } => chain.as_ref().map(|c| c.end_ids.clone()),
        _ => None,
    });
    assert_eq!(ids, Some(vec![]));
}

#[test]
fn an_answer_from_a_peer_outside_the_run_or_of_an_old_seq_is_dropped() {
    let mut h = Harness::new(5);
    h.cluster(single(1));
    assert!(h.token("z", 1, 0, 1, true).is_empty());
    assert!(h.token("a", 0, 0, 1, true).is_empty());
    assert!(h.finished().is_none());
    assert_eq!(h.streamed(), Vec::<u32>::new());
}

#[test]
fn a_request_of_zero_tokens_ends_without_running() {
    let mut h = Harness::new(0);
    let o = h.cluster(single(1));
    assert!(steps(&o).is_empty());
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Length, 0))));
}

#[test]
fn changes_together_are_placed_once_after_the_debounce() {
    let t0 = Instant::now();
    let mut d = Debounce::default();
    assert_eq!(d.poll_timeout(), None);
    assert!(!d.fire(t0 + Duration::from_secs(10)), "nothing changed");
    d.poke(t0, false);
    d.poke(t0 + Duration::from_millis(150), false);
    assert_eq!(
        d.poll_timeout(),
        Some(t0 + DEBOUNCE),
        "a later change does not put it off"
    );
    assert!(!d.fire(t0 + DEBOUNCE - Duration::from_millis(1)));
    assert!(d.fire(t0 + DEBOUNCE));
    assert!(!d.fire(t0 + DEBOUNCE), "the pokes are used up");
    assert_eq!(d.poll_timeout(), None);
}

#[test]
fn a_loss_that_leaves_requests_unplaced_is_placed_at_once() {
    let t0 = Instant::now();
    let mut d = Debounce::default();
    d.poke(t0, false);
    d.poke(t0 + Duration::from_millis(5), true);
    assert_eq!(
        d.poll_timeout(),
        Some(t0 + Duration::from_millis(5) + URGENT_DEBOUNCE)
    );
    assert!(d.fire(t0 + Duration::from_millis(15)));
}

#[test]
fn a_load_ends_when_every_worker_loaded_its_layers() {
    let t0 = Instant::now();
    let mut l = Loading::new(vec![peer("a"), peer("b")], t0, LOAD_TIMEOUT);
    assert_eq!(l.outcome(t0), None);
    l.answer(&peer("b"), Ok(()));
    assert_eq!(l.outcome(t0), None, "a still loads");
    l.answer(&peer("z"), Err("not in this placement".into()));
    l.answer(&peer("a"), Ok(()));
    assert_eq!(l.outcome(t0), Some(Ok(())));
}

#[test]
fn a_worker_that_fails_load_shard_fails_the_load_after_the_others_answer() {
    let t0 = Instant::now();
    let mut l = Loading::new(vec![peer("a"), peer("b"), peer("c")], t0, LOAD_TIMEOUT);
    l.answer(&peer("c"), Err("error 5: out of memory".into()));
    assert_eq!(l.outcome(t0), None, "the others are still loading");
    l.answer(&peer("b"), Err("b went away: left the room".into()));
    // A second answer of a worker is not one the load waits for.
    l.answer(&peer("b"), Ok(()));
    l.answer(&peer("a"), Ok(()));
    assert_eq!(
        l.outcome(t0),
        Some(Err(
            "b could not load its layers: b went away: left the room".into()
        )),
        "the first failure in stage order"
    );
}

#[test]
fn a_load_that_takes_too_long_fails_naming_the_silent_worker() {
    let t0 = Instant::now();
    let mut l = Loading::new(vec![peer("a"), peer("b")], t0, LOAD_TIMEOUT);
    l.answer(&peer("a"), Ok(()));
    assert_eq!(l.poll_timeout(), t0 + LOAD_TIMEOUT);
    assert_eq!(
        l.outcome(t0 + LOAD_TIMEOUT - Duration::from_millis(1)),
        None
    );
    assert_eq!(
        l.outcome(t0 + LOAD_TIMEOUT),
        Some(Err(
            "b could not load its layers: no answer within 300s".into()
        ))
    );
}

/// Every step checked: what a test of the rules needs.
fn every_step() -> SpotConfig {
    SpotConfig {
        rate: 1.0,
        tolerance: 0.5,
        seed: 1,
    }
}

fn checks(outputs: &[Output]) -> Vec<SpotCheck> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Check(c) => Some(c.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_checked_step_holds_its_tokens_until_the_verdict_and_then_they_go_out() {
    let mut h = Harness::spot(4, false, every_step());
    h.cluster(ring());
    let o = h.token("c", 1, 0, 600, true);
    let c = checks(&o);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].step, 0);
    assert_eq!(c[0].claimed, 600);
    assert_eq!(c[0].context, PROMPT.to_vec());
    assert_eq!(c[0].sample.step, 0);
    assert_eq!(c[0].epoch, 1);
    assert_eq!(c[0].suspects, vec![peer("a"), peer("b"), peer("c")]);
    // Tokens keep coming but none goes out, and no second check starts.
    let o = h.token("c", 1, 1, 601, true);
    assert!(checks(&o).is_empty());
    assert!(h.streamed().is_empty());
    h.input(Input::Checked {
        step: 0,
        verdict: Verdict::Right,
    });
    assert_eq!(h.streamed(), vec![600, 601]);
    // The next token starts the next check, with the tokens before it.
    let o = h.token("c", 1, 2, 602, true);
    let c = checks(&o);
    assert_eq!(
        (c[0].step, c[0].context.clone()),
        (2, prompt_and(&[600, 601]))
    );
    assert_eq!(h.streamed(), vec![600, 601]);
    // The run ends while a check is out: the request waits for it.
    h.token("c", 1, 3, 603, true);
    assert_eq!(h.finished(), None);
    // A verdict for another step changes nothing.
    h.input(Input::Checked {
        step: 1,
        verdict: Verdict::Wrong("x".into()),
    });
    assert_eq!(h.finished(), None);
    h.input(Input::Checked {
        step: 2,
        verdict: Verdict::Unchecked("the trusted model did not load".into()),
    });
    assert_eq!(h.streamed(), vec![600, 601, 602, 603]);
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Length, 0))));
    assert!(!h.out.iter().any(|o| matches!(o, Output::Evict { .. })));
}

#[test]
fn a_wrong_token_evicts_the_untrusted_stages_and_the_request_recovers_from_before_it() {
    let mut h = Harness::spot(3, false, every_step());
    let mut trusted_ring = ring();
    trusted_ring.trusted = [peer("a")].into();
    h.cluster(trusted_ring);
    h.token("c", 1, 0, 666, true);
    h.token("c", 1, 1, 667, true);
    let o = h.input(Input::Checked {
        step: 0,
        verdict: Verdict::Wrong("token 666 where the trusted device samples 600".into()),
    });
    // Nothing wrong went out; the trusted stage is not blamed.
    assert!(h.streamed().is_empty());
    let evicted: Vec<_> = o
        .iter()
        .filter_map(|o| match o {
            Output::Evict { peers, why } => Some((peers.clone(), why.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(evicted.len(), 1);
    assert_eq!(evicted[0].0, vec![peer("b"), peer("c")]);
    assert!(evicted[0].1.contains("step 0"), "{}", evicted[0].1);
    assert_eq!(h.counted(Count::Recovery), 1);
    assert_eq!(h.core.run(), None, "it waits for a placement without them");
    // The old placement still shows until the cluster drops it: not used.
    assert!(steps(&h.cluster(ring())).is_empty());
    let mut honest = cluster(Some(placement(2, vec![stage("a", 0, 30, true)])), &["a"]);
    honest.trusted = [peer("a")].into();
    let o = h.cluster(honest);
    let s = steps(&o);
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].epoch, s[0].pos0, s[0].step), (2, 0, 0));
    assert_eq!(s[0].tokens.as_deref(), Some(&PROMPT[..]));
    // On a trusted worker alone nothing is checked.
    let mut o = h.token("a", 2, 0, 600, true);
    o.extend(h.token("a", 2, 1, 601, true));
    o.extend(h.token("a", 2, 2, 602, true));
    assert!(checks(&o).is_empty());
    assert_eq!(h.streamed(), vec![600, 601, 602]);
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Length, 1))));
}

#[test]
fn a_wrong_last_token_found_after_the_run_ended_is_recomputed() {
    let mut h = Harness::spot(2, false, every_step());
    h.cluster(single(1));
    h.token("a", 1, 0, 600, true);
    h.input(Input::Checked {
        step: 0,
        verdict: Verdict::Right,
    });
    h.token("a", 1, 1, EOG, true);
    assert_eq!(h.finished(), None, "the end waits for its check");
    h.input(Input::Checked {
        step: 1,
        verdict: Verdict::Wrong("an end where the model goes on".into()),
    });
    assert_eq!(h.finished(), None);
    let mut other = cluster(Some(placement(2, vec![stage("z", 0, 30, true)])), &["z"]);
    other.trusted = [peer("z")].into();
    let s = steps(&h.cluster(other));
    assert_eq!(s[0].tokens.as_deref(), Some(&prompt_and(&[600])[..]));
    h.token("z", 2, 1, 601, true);
    assert_eq!(h.streamed(), vec![600, 601]);
    assert_eq!(h.finished(), Some(&Ok((FinishReason::Length, 1))));
}

fn prefetches(outputs: &[Output]) -> Vec<(u64, Vec<u32>)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Prefetch { request, context } => Some((*request, context.clone())),
            _ => None,
        })
        .collect()
}

/// A request that will be checked has the trusted device compute its prompt as its first
/// run starts (once: a later run does not ask again); one that will not, or runs on trusted
/// workers alone, or with checks off, asks nothing.
#[test]
fn a_request_to_be_checked_has_its_prompt_computed_ahead_once() {
    let mut h = Harness::spot(4, false, every_step());
    let o = h.cluster(ring());
    assert_eq!(prefetches(&o), vec![(7, PROMPT.to_vec())]);
    h.token("c", 1, 0, 600, true);
    // A new placement: another run, no second prefetch.
    let mut moved = ring();
    if let Some(a) = moved.active.as_mut() {
        a.epoch = 2;
    }
    let o = h.cluster(moved);
    assert_eq!(steps(&o).len(), 1, "a new run on the new placement");
    assert!(prefetches(&o).is_empty());

    let mut trusted_only = Harness::spot(4, false, every_step());
    let mut honest = cluster(Some(placement(1, vec![stage("a", 0, 30, true)])), &["a"]);
    honest.trusted = [peer("a")].into();
    assert!(prefetches(&trusted_only.cluster(honest)).is_empty());

    let mut off = Harness::new(4);
    assert!(prefetches(&off.cluster(ring())).is_empty());

    // At a rate that checks none of this request's 3 steps, nothing is computed ahead.
    let rare = SpotConfig {
        rate: 1e-9,
        tolerance: 0.5,
        seed: 1,
    };
    assert!((0..3).all(|s| !rare.chosen(7, s)));
    let mut unchecked = Harness::spot(3, false, rare);
    assert!(prefetches(&unchecked.cluster(ring())).is_empty());
}

#[test]
fn with_checks_off_no_token_is_held() {
    let mut h = Harness::new(3);
    h.cluster(ring());
    for step in 0..3 {
        assert!(checks(&h.token("c", 1, step, 600 + step, true)).is_empty());
    }
    assert_eq!(h.streamed(), vec![600, 601, 602]);
}
