//! The stage server against a whole-model run on the CPU backend: two
//! stages fed through encoded messages must draw the same greedy tokens.

use std::sync::Arc;

use super::*;
use crate::backend::Device;
use crate::kernels::SampleParams;
use crate::model::synthetic::SyntheticModel;
use crate::model::{ModelConfig, Shard, ShardInput, ShardOutput, Want};
use crate::placement::StageSplit;
use crate::protocol::{
    Chain, DType, Deframer, Framer, Hop, LayerRange, Limits, Message, Tensor, error_code,
};

/// The cpu device, for tests of this module and its host.
pub(crate) fn cpu() -> Arc<Device> {
    let sel = crate::Selection {
        backend: Some("cpu".into()),
        device: None,
    };
    Arc::new(
        crate::device::discover_blocking()
            .open_blocking(&sel)
            .expect("cpu backend"),
    )
}

pub(super) fn small_config() -> ModelConfig {
    let mut cfg = ModelConfig::synthetic("135m").expect("135m shape");
    cfg.n_layers = 4;
    cfg.vocab_size = 512;
    cfg
}

/// Sends a message through the real encoder and decoder, as a link would.
fn wire(m: Message) -> Message {
    let mut framer = Framer::new(64 * 1024);
    let mut deframer = Deframer::new(Limits::default());
    let frames = framer.encode(&m).expect("encodes");
    let mut out = Vec::new();
    for f in frames {
        out.extend(deframer.push(&f).expect("decodes"));
    }
    assert_eq!(out.len(), 1);
    out.pop().expect("one message")
}

#[test]
fn two_stages_match_one_shard() {
    pollster::block_on(async {
        let cfg = small_config();
        let model = SyntheticModel::new(&cfg, 3);
        let dev = cpu();
        let whole = Shard::load(dev.clone(), &model, 0, 4, 32, &mut |_, _| {}).unwrap();
        let prompt = [5u32, 9, 17, 2, 33];
        let greedy = SampleParams::default();
        let mut cache = whole.new_cache(16).unwrap();
        let mut expect = Vec::new();
        let mut input = prompt.to_vec();
        for _ in 0..4 {
            let ShardOutput::Token(t) = whole
                .forward(&mut cache, ShardInput::Tokens(&input), Want::Sample(greedy))
                .await
                .unwrap()
            else {
                panic!("no token")
            };
            expect.push(t);
            input = vec![t];
        }

        let (a, _) = load_shard(dev.clone(), &model, 0, 2).await.unwrap();
        let (b, loaded) = load_shard(dev.clone(), &model, 2, 4).await.unwrap();
        assert!(
            matches!(loaded, Message::ShardLoaded { layers, .. } if layers.start == 2 && layers.end == 4)
        );
        let mut first = StageServer::new(dev.clone());
        let mut last = StageServer::new(dev.clone());
        first.set_shard(a);
        last.set_shard(b);
        let mut got = Vec::new();
        let mut pos = 0u32;
        let mut input = prompt.to_vec();
        let seq = 1;
        for step in 0..4u32 {
            let fwd = Message::Forward {
                request: 7,
                seq,
                layers: LayerRange { start: 0, end: 2 },
                pos0: pos,
                max_len: 16,
                sample: None,
                chain: None,
                tensor: Tensor::from_values(DType::U32, vec![input.len() as u64], &input).unwrap(),
            };
            let Some(Outgoing::Reply(Message::Activations { tensor, pos0, .. })) =
                first.handle(wire(fwd)).await
            else {
                panic!("first stage gave no activations")
            };
            assert_eq!(pos0, pos);
            let fwd = Message::Forward {
                request: 7,
                seq,
                layers: LayerRange { start: 2, end: 4 },
                pos0: pos,
                max_len: 16,
                sample: Some(SampleParams { step, ..greedy }),
                chain: None,
                tensor,
            };
            let Some(Outgoing::Reply(Message::Token {
                id,
                seq: s,
                step: at,
                passed_on: false,
                ..
            })) = last.handle(wire(fwd)).await
            else {
                panic!("last stage gave no token")
            };
            assert_eq!((s, at), (seq, step));
            got.push(id);
            pos += input.len() as u32;
            input = vec![id];
        }
        assert_eq!(got, expect);
        // The prompt's 5 tokens and 3 generated ones fed back; telemetry windows do not
        // reset the running count.
        let _ = first.telemetry();
        assert_eq!((first.tokens_served(), last.tokens_served()), (8, 8));

        // Rewinding to position 0 and replaying gives the same first token (recovery path).
        let fwd = Message::Forward {
            request: 7,
            seq: 9,
            layers: LayerRange { start: 0, end: 2 },
            pos0: 0,
            max_len: 16,
            sample: None,
            chain: None,
            tensor: Tensor::from_values(DType::U32, vec![prompt.len() as u64], &prompt).unwrap(),
        };
        let Some(Outgoing::Reply(Message::Activations { tensor, .. })) = first.handle(fwd).await
        else {
            panic!()
        };
        let fwd = Message::Forward {
            request: 7,
            seq: 9,
            layers: LayerRange { start: 2, end: 4 },
            pos0: 0,
            max_len: 16,
            sample: None,
            chain: None,
            tensor,
        };
        assert!(
            matches!(last.handle(fwd).await, Some(Outgoing::Reply(Message::Token { id, .. })) if id == expect[0])
        );
    });
}

#[test]
fn bad_forwards_get_request_errors() {
    pollster::block_on(async {
        let cfg = small_config();
        let model = SyntheticModel::new(&cfg, 3);
        let dev = cpu();
        let mut server = StageServer::new(dev.clone());
        let tokens = Tensor::from_values(DType::U32, vec![1], &[1u32]).unwrap();
        let fwd = |pos0, tensor: Tensor| Message::Forward {
            request: 1,
            seq: 0,
            layers: LayerRange { start: 0, end: 2 },
            pos0,
            max_len: 8,
            sample: None,
            chain: None,
            tensor,
        };
        let code = |m: Option<Outgoing>| match m {
            Some(Outgoing::Reply(Message::RequestError { code, .. })) => code,
            other => panic!("expected a request error, got {other:?}"),
        };
        assert_eq!(
            code(server.handle(fwd(0, tokens.clone())).await),
            error_code::UNSUPPORTED
        );
        let (shard, _) = load_shard(dev.clone(), &model, 0, 2).await.unwrap();
        server.set_shard(shard);
        // Hidden states sent to the first shard.
        let hidden = Tensor::from_f32(vec![1, cfg.dim as u64], &vec![0.0; cfg.dim]).unwrap();
        assert_eq!(
            code(server.handle(fwd(0, hidden)).await),
            error_code::BAD_REQUEST
        );
        // A token outside the vocabulary.
        let forged = Tensor::from_values(DType::U32, vec![1], &[99_999u32]).unwrap();
        assert_eq!(
            code(server.handle(fwd(0, forged)).await),
            error_code::BAD_REQUEST
        );
        // An unknown request that does not start at 0 (its cache went): the
        // coordinator rebuilds it, so the request is not at fault.
        assert_eq!(
            code(server.handle(fwd(3, tokens.clone())).await),
            error_code::UNSUPPORTED
        );
        // Past the cache's capacity.
        let long = Tensor::from_values(DType::U32, vec![9], &[1u32; 9]).unwrap();
        assert_eq!(
            code(server.handle(fwd(0, long)).await),
            error_code::BAD_REQUEST
        );
        // Layers this peer does not hold (a placement moved under the step).
        let moved = Message::Forward {
            request: 2,
            seq: 0,
            layers: LayerRange { start: 0, end: 3 },
            pos0: 0,
            max_len: 8,
            sample: None,
            chain: None,
            tensor: tokens.clone(),
        };
        assert_eq!(code(server.handle(moved).await), error_code::UNSUPPORTED);
        // And a good one still works afterwards.
        assert!(matches!(
            server.handle(fwd(0, tokens)).await,
            Some(Outgoing::Reply(Message::Activations { .. }))
        ));
    });
}

#[test]
fn calibration_is_measured_and_positive() {
    pollster::block_on(async {
        let c = calibrate(cpu(), &small_config()).await.unwrap();
        assert!(c.decode_s_per_layer > 0.0 && c.decode_s_per_layer.is_finite());
        assert!(c.prefill_s_per_layer_token > 0.0 && c.prefill_s_per_layer_token.is_finite());
        assert!(c.call_overhead_s >= 0.0);
        assert_eq!(c.tensor, None, "one device has no tensor split to offer");
    });
}

/// A worker over two devices offers both ways to placement when left to choose, only
/// layers when told `--split layers`, and only the tensor split's timings (as its main
/// ones) when told `--split tensor`.
#[test]
fn a_worker_over_two_devices_calibrates_each_split_it_may_run() {
    use crate::model::Split;
    pollster::block_on(async {
        let cfg = small_config();
        let two = vec![(cpu(), 1u64 << 30), (cpu(), 1u64 << 30)];
        let positive = |t: f64| t > 0.0 && t.is_finite();
        let auto = calibrate_devices(&two, &cfg, Split::Auto).await.unwrap();
        assert!(positive(auto.decode_s_per_layer));
        let tensor = auto
            .tensor
            .expect("two devices split the synthetic shape by tensors");
        assert!(positive(tensor.decode_s_per_layer));
        assert!(positive(tensor.prefill_s_per_layer_token));
        assert!(tensor.call_overhead_s >= 0.0 && tensor.head_s >= 0.0);
        let layers = calibrate_devices(&two, &cfg, Split::Layers).await.unwrap();
        assert_eq!(layers.tensor, None);
        let forced = calibrate_devices(&two, &cfg, Split::Tensor).await.unwrap();
        assert_eq!(forced.tensor, None);
        assert!(positive(forced.decode_s_per_layer));
        // More devices than the shape's key/value heads: no tensor split to offer.
        let many: Vec<_> = (0..cfg.n_kv_heads + 1)
            .map(|_| (cpu(), 1u64 << 30))
            .collect();
        let c = calibrate_devices(&many, &cfg, Split::Auto).await.unwrap();
        assert_eq!(c.tensor, None);
    });
}

/// Greedy tokens of the whole model on one shard: what every chain must give.
pub(super) async fn whole_model_tokens(
    model: &SyntheticModel,
    dev: &Arc<Device>,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let whole = Shard::load(dev.clone(), model, 0, 4, 32, &mut |_, _| {}).unwrap();
    let mut cache = whole.new_cache((prompt.len() + n).max(32)).unwrap();
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    for _ in 0..n {
        let ShardOutput::Token(t) = whole
            .forward(
                &mut cache,
                ShardInput::Tokens(&input),
                Want::Sample(SampleParams::default()),
            )
            .await
            .unwrap()
        else {
            panic!("no token")
        };
        out.push(t);
        input = vec![t];
    }
    out
}

fn hop(peer: &str, start: u32, end: u32) -> Hop {
    Hop {
        peer: peer.into(),
        layers: LayerRange { start, end },
    }
}

fn first_step(prompt: &[u32], seq: u32, chain: Option<Chain>) -> Message {
    Message::Forward {
        request: 5,
        seq,
        layers: LayerRange { start: 0, end: 2 },
        pos0: 0,
        max_len: 32,
        sample: Some(SampleParams::default()),
        chain,
        tensor: Tensor::from_values(DType::U32, vec![prompt.len() as u64], prompt).unwrap(),
    }
}

/// Two stages of a 4-layer synthetic model, A (layers 0..2) and B (2..4),
/// each the other's next; with `prevs`, each serves only the other's steps.
/// Also the prompt and the whole model's first `n` greedy tokens for it.
async fn two_stage_ring(prevs: bool, n: usize) -> (StageServer, StageServer, Vec<u32>, Vec<u32>) {
    let cfg = small_config();
    let model = SyntheticModel::new(&cfg, 5);
    let dev = cpu();
    let prompt = vec![3u32, 14, 15, 92, 65];
    let expect = whole_model_tokens(&model, &dev, &prompt, n).await;
    let mut a = StageServer::new(dev.clone());
    let mut b = StageServer::new(dev.clone());
    a.set_shard(load_shard(dev.clone(), &model, 0, 2).await.unwrap().0);
    b.set_shard(load_shard(dev.clone(), &model, 2, 4).await.unwrap().0);
    a.set_route(Route {
        next: Some(hop("B", 2, 4)),
        prev: prevs.then(|| "B".into()),
    });
    b.set_route(Route {
        next: Some(hop("A", 0, 2)),
        prev: prevs.then(|| "A".into()),
    });
    (a, b, prompt, expect)
}

#[test]
fn a_chain_loops_through_its_stages_without_the_coordinator() {
    pollster::block_on(async {
        let (mut a, mut b, prompt, expect) = two_stage_ring(true, 6).await;
        assert!(a.serves_forwards_from("B") && !a.serves_forwards_from("C"));

        // Five steps in all: the last stage stops the loop after step 4.
        let chain = Chain {
            max_steps: 5,
            end_ids: vec![],
        };
        let mut tokens = Vec::new();
        let mut msg = first_step(&prompt, 1, Some(chain));
        let mut coordinator_heard = Vec::new();
        let mut at = "A";
        // What each hop puts on the wire, in bytes, after the prompt's first pass.
        let mut hop_bytes = Vec::new();
        let dim = small_config().dim;
        loop {
            let server = if at == "A" { &mut a } else { &mut b };
            match server.handle(wire(msg)).await.expect("an output") {
                Outgoing::Pass(pass) => {
                    if let Some(note) = pass.delivered() {
                        coordinator_heard.push(note);
                    }
                    let bytes: usize = Framer::new(64 * 1024)
                        .encode(&pass.forward)
                        .expect("encodes")
                        .iter()
                        .map(Vec::len)
                        .sum();
                    hop_bytes.push((pass.to.clone(), bytes));
                    at = if pass.to == "A" { "A" } else { "B" };
                    if let Message::Forward { tensor, .. } = &pass.forward
                        && at == "A"
                    {
                        tokens.push(tensor.to_values::<u32>().unwrap()[0]);
                    }
                    msg = pass.forward;
                }
                Outgoing::Reply(last) => {
                    coordinator_heard.push(last);
                    break;
                }
            }
        }
        let heard: Vec<(u32, u32, bool)> = coordinator_heard
            .iter()
            .map(|m| match m {
                Message::Token {
                    step,
                    id,
                    passed_on,
                    seq: 1,
                    request: 5,
                } => (*step, *id, *passed_on),
                other => panic!("the coordinator heard {other:?}"),
            })
            .collect();
        let want: Vec<(u32, u32, bool)> = expect[..5]
            .iter()
            .enumerate()
            .map(|(i, &t)| (i as u32, t, i < 4))
            .collect();
        assert_eq!(
            heard, want,
            "every token, in order, the last one not passed on"
        );
        assert_eq!(
            tokens,
            expect[..4],
            "the tokens fed back to the first stage"
        );
        // A decode step's hops carry one row of hidden state forward and one token id back:
        // nothing that grows with the vocabulary or the context (a 4,096-wide model's hop is
        // 16 KiB plus a header).
        for (to, bytes) in &hop_bytes[1..] {
            let most = if to == "B" { 4 * dim + 256 } else { 256 };
            assert!(
                *bytes <= most,
                "a decode hop to {to} put {bytes} bytes on the wire"
            );
        }
    });
}

#[test]
fn a_chain_stops_at_an_end_token_and_falls_back_to_the_coordinator() {
    pollster::block_on(async {
        let (mut a, mut b, prompt, expect) = two_stage_ring(false, 2).await;
        let chain = |end_ids| {
            Some(Chain {
                max_steps: 100,
                end_ids,
            })
        };
        let through = |out: Option<Outgoing>| match out {
            Some(Outgoing::Pass(p)) => p,
            other => panic!("expected a pass, got {other:?}"),
        };

        // The first token ends generation: the last stage does not go on.
        let p = through(
            a.handle(first_step(&prompt, 1, chain(vec![expect[0]])))
                .await,
        );
        let Some(Outgoing::Reply(end)) = b.handle(p.forward).await else {
            panic!("the end token did not stop the chain")
        };
        assert_eq!(
            end,
            Message::Token {
                request: 5,
                seq: 1,
                step: 0,
                id: expect[0],
                passed_on: false
            }
        );

        // Next stages that cannot be reached: the coordinator gets what it relays.
        let p = through(a.handle(first_step(&prompt, 2, chain(vec![]))).await);
        let p = through(b.handle(p.forward).await);
        assert_eq!(
            p.undelivered(),
            Message::Token {
                request: 5,
                seq: 2,
                step: 0,
                id: expect[0],
                passed_on: false
            }
        );
        let next = Message::Forward {
            request: 5,
            seq: 2,
            layers: LayerRange { start: 0, end: 2 },
            pos0: prompt.len() as u32,
            max_len: 32,
            sample: Some(SampleParams {
                step: 1,
                ..SampleParams::default()
            }),
            chain: chain(vec![]),
            tensor: Tensor::from_values(DType::U32, vec![1], &[expect[0]]).unwrap(),
        };
        let p = through(a.handle(next).await);
        assert!(
            p.delivered().is_none(),
            "a middle hop has no token to report"
        );
        let Message::Forward { tensor, .. } = &p.forward else {
            panic!()
        };
        let sent = tensor.clone();
        assert_eq!(
            p.undelivered(),
            Message::Activations {
                request: 5,
                seq: 2,
                pos0: prompt.len() as u32,
                tensor: sent
            }
        );

        // Without a next stage every output goes to the coordinator, chain or not.
        a.set_route(Route::default());
        assert!(matches!(
            a.handle(first_step(&prompt, 3, chain(vec![]))).await,
            Some(Outgoing::Reply(Message::Activations { seq: 3, .. }))
        ));
    });
}

#[test]
fn steps_of_an_older_run_are_dropped() {
    pollster::block_on(async {
        let cfg = small_config();
        let model = SyntheticModel::new(&cfg, 5);
        let dev = cpu();
        let mut a = StageServer::new(dev.clone());
        a.set_shard(load_shard(dev.clone(), &model, 0, 2).await.unwrap().0);
        let prompt = [3u32, 14, 15];
        let step = |seq, pos0| Message::Forward {
            request: 5,
            seq,
            layers: LayerRange { start: 0, end: 2 },
            pos0,
            max_len: 32,
            sample: None,
            chain: None,
            tensor: Tensor::from_values(DType::U32, vec![1], &[7u32]).unwrap(),
        };
        assert!(matches!(
            a.handle(first_step(&prompt, 4, None)).await,
            Some(Outgoing::Reply(Message::Activations { seq: 4, .. }))
        ));
        // A step of run 3 still in flight when run 4 started: dropped without a word.
        assert!(a.handle(step(3, 3)).await.is_none());
        assert!(a.handle(first_step(&prompt, 3, None)).await.is_none());
        // A later run that does not start at 0 is refused; run 4 goes on.
        assert!(matches!(
            a.handle(step(5, 3)).await,
            Some(Outgoing::Reply(Message::RequestError { code, seq: 5, .. })) if code == error_code::UNSUPPORTED
        ));
        assert!(matches!(
            a.handle(first_step(&prompt, 4, None)).await,
            Some(Outgoing::Reply(Message::Activations { seq: 4, .. }))
        ));
        assert!(matches!(
            a.handle(step(4, 3)).await,
            Some(Outgoing::Reply(Message::Activations {
                seq: 4,
                pos0: 3,
                ..
            }))
        ));
    });
}

/// A stage over three local devices (its layers split over them, hidden states handed on
/// inside the process) draws the same greedy tokens as the whole model on one device, for
/// ten requests batched in each pass (run as a pipeline of two micro-batches,
/// `model/pipeline.rs`); their blocks are held and given back on every piece.
/// Greedy tokens of every prompt, all requests batched into each `handle_forwards` pass;
/// `step(request, pos0, ids)` makes a request's `Forward`.
async fn batched_greedy(
    server: &mut StageServer,
    step: &dyn Fn(u64, usize, &[u32]) -> Message,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<Vec<u32>> {
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    let mut pos = vec![0usize; prompts.len()];
    for _ in 0..steps {
        let msgs = (0..prompts.len())
            .map(|r| wire(step(r as u64, pos[r], &inputs[r])))
            .collect();
        for out in server.handle_forwards(msgs).await {
            let Outgoing::Reply(Message::Token { request, id, .. }) = out else {
                panic!("expected a token, got {out:?}");
            };
            let r = request as usize;
            pos[r] += inputs[r].len();
            got[r].push(id);
            inputs[r] = vec![id];
        }
    }
    got
}

#[test]
fn a_stage_over_several_devices_matches_one_device() {
    pollster::block_on(async {
        let cfg = small_config();
        let model = SyntheticModel::new(&cfg, 5);
        let prompts = [
            vec![3u32, 14, 15, 92, 65],
            vec![2u32, 7, 1, 8],
            vec![400u32],
            vec![9u32, 9, 9],
            vec![1u32, 2, 3, 4, 5, 6, 7],
            vec![300u32, 301],
            vec![42u32, 43, 44],
            vec![128u32],
            vec![7u32, 77, 177, 277],
            vec![500u32, 5],
        ];
        let steps = 6;
        let dev = cpu();
        let mut expect = Vec::new();
        for p in &prompts {
            expect.push(whole_model_tokens(&model, &dev, p, steps).await);
        }
        // Three devices of their own (separate accounting), the first offering twice the bytes.
        let devices = vec![
            (cpu(), 2_000_000_000),
            (cpu(), 1_000_000_000),
            (cpu(), 1_000_000_000),
        ];
        let mut server = StageServer::with_devices(devices.clone());
        let (stack, loaded) = load_stack(&devices, &model, 0, 4).await.unwrap();
        let ranges: Vec<(usize, usize)> = stack.pieces().iter().map(|p| p.range()).collect();
        assert_eq!(
            ranges,
            vec![(0, 2), (2, 3), (3, 4)],
            "split by the bytes offered"
        );
        for (piece, (d, _)) in stack.pieces().iter().zip(&devices) {
            assert!(
                Arc::ptr_eq(piece.device(), d),
                "each piece on its own device"
            );
            assert!(d.live_bytes() > 0, "weights on every device");
        }
        assert!(matches!(loaded, Message::ShardLoaded { weight_bytes, .. } if weight_bytes > 0));
        server.set_stack(stack);
        let step = |request: u64, pos0: usize, ids: &[u32]| Message::Forward {
            request,
            seq: 1,
            layers: LayerRange { start: 0, end: 4 },
            pos0: pos0 as u32,
            max_len: 32,
            sample: Some(SampleParams::default()),
            chain: None,
            tensor: Tensor::from_values(DType::U32, vec![ids.len() as u64], ids).unwrap(),
        };
        let got = batched_greedy(&mut server, &step, &prompts, steps).await;
        assert_eq!(got, expect);
        let t = server.telemetry();
        let kv = t.kv.expect("pool report");
        assert!(kv.blocks_used > 0);
        assert_eq!(t.mean_batch, Some(10.0));
        let total: u64 = devices.iter().map(|(d, _)| d.info().memory_bytes).sum();
        assert_eq!(t.memory_total_bytes, total, "memory over every device");
        for request in 0..prompts.len() as u64 {
            server.handle(Message::EndRequest { request }).await;
        }
        assert_eq!(server.telemetry().kv.map(|k| k.blocks_used), Some(0));
    });
}

/// A prompt longer than a chunk runs a chunk per round: a decode step of another request
/// arriving meanwhile is answered in the first round, before the prompt is through, and the
/// prompt's token, when it comes, is the one its whole prefill gives.
#[test]
fn a_long_prompt_runs_in_chunks_between_other_steps() {
    pollster::block_on(async {
        let mut cfg = small_config();
        cfg.context_length = 2048;
        let model = SyntheticModel::new(&cfg, 5);
        let dev = cpu();
        let long: Vec<u32> = (0..(2 * PREFILL_CHUNK + 40) as u32)
            .map(|i| (i * 7 + 3) % 500)
            .collect();
        let short = vec![3u32, 14, 15];
        let expect_long = whole_model_tokens(&model, &dev, &long, 1).await;
        let expect_short = whole_model_tokens(&model, &dev, &short, 4).await;
        let mut server = StageServer::new(dev.clone());
        server.set_shard(load_shard(dev.clone(), &model, 0, 4).await.unwrap().0);
        let step = |request: u64, pos0: usize, ids: &[u32]| Message::Forward {
            request,
            seq: 1,
            layers: LayerRange { start: 0, end: 4 },
            pos0: pos0 as u32,
            max_len: 1024,
            sample: Some(SampleParams::default()),
            chain: None,
            tensor: Tensor::from_values(DType::U32, vec![ids.len() as u64], ids).unwrap(),
        };
        let tokens = |outs: Vec<Outgoing>| -> Vec<(u64, u32)> {
            outs.into_iter()
                .map(|o| match o {
                    Outgoing::Reply(Message::Token { request, id, .. }) => (request, id),
                    other => panic!("expected a token, got {other:?}"),
                })
                .collect()
        };
        // Round 1: the short prompt and the long one's first chunk.
        let outs = server
            .step_forwards(vec![step(1, 0, &long), step(2, 0, &short)])
            .await;
        assert_eq!(tokens(outs), vec![(2, expect_short[0])]);
        assert!(server.has_partial());
        // Rounds 2 and 3: the short request's decode steps beside the next chunks.
        let mut got_long = Vec::new();
        for i in 1..3 {
            let pos = short.len() + i - 1;
            let outs = server
                .step_forwards(vec![step(2, pos, &[expect_short[i - 1]])])
                .await;
            for (request, id) in tokens(outs) {
                if request == 1 {
                    got_long.push(id);
                } else {
                    assert_eq!(id, expect_short[i]);
                }
            }
        }
        assert!(!server.has_partial(), "three chunks cover the long prompt");
        assert_eq!(got_long, expect_long, "the chunked prefill's token");
        // The whole call keeps its meaning: every step answered.
        let outs = server.handle_forwards(vec![step(3, 0, &long)]).await;
        assert_eq!(tokens(outs), vec![(3, expect_long[0])]);
    });
}

/// A stage told to split by tensors (`cairn worker --split tensor`) loads its layers that way
/// through the worker's `ShardSlot` and draws, for two requests batched in each pass, the
/// greedy tokens of the whole model on one device; a model whose heads do not split over
/// the devices (three key/value heads, four devices) is served split by layers instead.
#[test]
fn a_stage_split_by_tensors_matches_one_device() {
    use crate::model::Split;
    use crate::worker::{LoadPlan, ShardSlot};
    pollster::block_on(async {
        let cfg = small_config();
        let model = SyntheticModel::new(&cfg, 5);
        let prompts = [vec![3u32, 14, 15, 92, 65], vec![2u32, 7, 1, 8]];
        let steps = 5;
        let dev = cpu();
        let mut expect = Vec::new();
        for p in &prompts {
            expect.push(whole_model_tokens(&model, &dev, p, steps).await);
        }
        let plan = LoadPlan {
            model: "m".into(),
            start: 0,
            end: 4,
            source: String::new(),
            route: Route::default(),
            split: StageSplit::Layers,
        };
        let devices = vec![(cpu(), 1_000_000_000), (cpu(), 1_000_000_000)];
        let mut server = StageServer::with_devices(devices.clone());
        server.set_split(Split::Tensor);
        let mut slot = ShardSlot::default();
        let loaded = slot.load(&mut server, plan.clone(), &model).await;
        assert!(matches!(loaded, Message::ShardLoaded { weight_bytes, .. } if weight_bytes > 0));
        assert!(devices.iter().all(|(d, _)| d.live_bytes() > 0));
        let step = |request: u64, pos0: usize, ids: &[u32]| Message::Forward {
            request,
            seq: 1,
            layers: LayerRange { start: 0, end: 4 },
            pos0: pos0 as u32,
            max_len: 32,
            sample: Some(SampleParams::default()),
            chain: None,
            tensor: Tensor::from_values(DType::U32, vec![ids.len() as u64], ids).unwrap(),
        };
        let got = batched_greedy(&mut server, &step, &prompts, steps).await;
        assert_eq!(got, expect);
        assert_eq!(server.telemetry().mean_batch, Some(2.0));
        // A worker left to choose (`--split auto`) splits as placement says; one told
        // `--split tensor` keeps that whatever placement says.
        for (own, placed, loaded) in [
            (Split::Auto, StageSplit::Tensor, Split::Tensor),
            (Split::Auto, StageSplit::Layers, Split::Layers),
            (Split::Tensor, StageSplit::Layers, Split::Tensor),
            (Split::Layers, StageSplit::Tensor, Split::Layers),
        ] {
            server.set_split(own);
            let plan = LoadPlan {
                split: placed,
                ..plan.clone()
            };
            let out = slot.load(&mut server, plan, &model).await;
            assert!(matches!(out, Message::ShardLoaded { .. }), "{out:?}");
            assert_eq!(server.loaded_split(), Some(loaded), "{own} told {placed}");
        }
        // Four devices for three key/value heads: split by layers, and still served.
        let four: Vec<_> = (0..4).map(|_| (cpu(), 1_000_000_000)).collect();
        let mut server = StageServer::with_devices(four);
        server.set_split(Split::Tensor);
        let loaded = slot.load(&mut server, plan, &model).await;
        assert!(matches!(loaded, Message::ShardLoaded { .. }), "{loaded:?}");
        let out = server.handle(wire(step(9, 0, &prompts[0]))).await;
        assert!(
            matches!(out, Some(Outgoing::Reply(Message::Token { id, .. })) if id == expect[0][0]),
            "{out:?}"
        );
    });
}
