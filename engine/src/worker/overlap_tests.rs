//! Passes in flight across steps ([`StageServer::begin_forwards`]) over a stage split by
//! layers over two and three cpu devices of their own, driven as the native stage loop
//! drives them: requests of different lengths joining and leaving while other requests'
//! passes run, each request's greedy tokens those of the whole model on one device, and a
//! request ended while its pass is in flight giving its blocks back.

use std::collections::HashMap;
use std::sync::Arc;

use super::tests::{cpu, small_config, whole_model_tokens};
use super::*;
use crate::backend::Device;
use crate::kernels::SampleParams;
use crate::model::synthetic::SyntheticModel;
use crate::protocol::{DType, LayerRange, Message, Tensor};

fn forward(request: u64, pos0: usize, ids: &[u32]) -> Message {
    Message::Forward {
        request,
        seq: 1,
        layers: LayerRange { start: 0, end: 4 },
        pos0: pos0 as u32,
        max_len: 1024,
        sample: Some(SampleParams::default()),
        chain: None,
        tensor: Tensor::from_values(DType::U32, vec![ids.len() as u64], ids).unwrap(),
    }
}

/// One request of the run: its prompt, the tokens it asks for, the turn it joins at, and
/// the token after which it is ended while its next pass is in flight (a cancellation).
struct Req {
    prompt: Vec<u32>,
    tokens: usize,
    joins: usize,
    cancel_after: Option<usize>,
}

fn requests() -> Vec<Req> {
    let prompt = |n: usize, k: u32| (0..n as u32).map(|i| (i * 37 + k * 11 + 1) % 500).collect();
    // (prompt length, tokens, turn it joins at, ended after this many tokens)
    let table: [(usize, usize, usize, Option<usize>); 9] = [
        (5, 9, 0, None),
        (2, 4, 0, None),
        (11, 7, 0, Some(3)),
        (1, 6, 1, None),
        (7, 3, 2, None),
        // Longer than a chunk: its prefill runs a chunk a pass, beside the others' steps.
        (PREFILL_CHUNK + 30, 4, 3, None),
        (3, 8, 4, None),
        (4, 5, 6, None),
        (9, 6, 9, None),
    ];
    table
        .iter()
        .enumerate()
        .map(|(k, &(len, tokens, joins, cancel_after))| Req {
            prompt: prompt(len, k as u32),
            tokens,
            joins,
            cancel_after,
        })
        .collect()
}

/// The tokens each request got, its passes started as the native stage loop starts them: up
/// to as many passes in flight as `server` has pieces, each taking an even share of the
/// waiting steps whose request has no pass in flight; a request's next step waits for its
/// token. Returns them with the most passes that were in flight at once.
fn drive(server: &mut StageServer, reqs: &[Req]) -> (HashMap<u64, Vec<u32>>, usize) {
    let pieces = server.overlap();
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut pos = vec![0usize; reqs.len()];
    let mut waiting: Vec<Message> = Vec::new();
    let mut ended = vec![false; reqs.len()];
    let mut most_in_flight = 0;
    for turn in 0.. {
        for (r, q) in reqs.iter().enumerate() {
            if q.joins == turn {
                waiting.push(forward(r as u64, 0, &q.prompt));
            }
        }
        while server.passes_in_flight() < pieces && (!waiting.is_empty() || server.has_partial()) {
            let share = waiting.len().div_ceil(pieces).max(1);
            let (group, rest): (Vec<_>, Vec<_>) =
                waiting.drain(..).enumerate().partition(|(i, m)| {
                    let Message::Forward { request, .. } = m else {
                        return false;
                    };
                    *i < share && !server.in_flight(*request)
                });
            waiting = rest.into_iter().map(|(_, m)| m).collect();
            if group.is_empty() && !server.has_partial() {
                break;
            }
            let group: Vec<Message> = group.into_iter().map(|(_, m)| m).collect();
            let members: Vec<u64> = group
                .iter()
                .filter_map(|m| match m {
                    Message::Forward { request, .. } => Some(*request),
                    _ => None,
                })
                .collect();
            let refused = server.begin_forwards(group, || {});
            assert!(refused.is_empty(), "{refused:?}");
            most_in_flight = most_in_flight.max(server.passes_in_flight());
            // A cancellation while the pass runs: the request's output never comes.
            for r in members {
                let q = &reqs[r as usize];
                if q.cancel_after == Some(got.get(&r).map_or(0, Vec::len)) {
                    assert!(server.in_flight(r));
                    pollster::block_on(server.handle(Message::EndRequest { request: r }));
                    ended[r as usize] = true;
                }
            }
        }
        if server.passes_in_flight() == 0
            && waiting.is_empty()
            && !server.has_partial()
            && reqs.iter().all(|q| q.joins < turn)
        {
            break;
        }
        for out in server.finish_passes(true) {
            let Outgoing::Reply(Message::Token { request, id, .. }) = out else {
                panic!("a token expected, got {out:?}");
            };
            let r = request as usize;
            assert!(!ended[r], "request {r} ended, yet its token came");
            let mine = got.entry(request).or_default();
            mine.push(id);
            pos[r] += if mine.len() == 1 {
                reqs[r].prompt.len()
            } else {
                1
            };
            if mine.len() == reqs[r].tokens {
                // The coordinator ends a request at its last token.
                pollster::block_on(server.handle(Message::EndRequest { request }));
                ended[r] = true;
            } else {
                waiting.push(forward(request, pos[r], &[id]));
            }
        }
    }
    (got, most_in_flight)
}

#[test]
fn passes_in_flight_over_two_and_three_devices_give_one_devices_tokens() {
    pollster::block_on(async {
        let mut cfg = small_config();
        cfg.context_length = 2048;
        let model = SyntheticModel::new(&cfg, 5);
        let reqs = requests();
        let dev = cpu();
        let mut expect = Vec::new();
        for q in &reqs {
            expect.push(whole_model_tokens(&model, &dev, &q.prompt, q.tokens).await);
        }
        for n in [2, 3] {
            let devices: Vec<(Arc<Device>, u64)> = (0..n).map(|_| (cpu(), 1 << 30)).collect();
            let mut server = StageServer::with_devices(devices.clone());
            let (stack, _) = load_stack(&devices, &model, 0, 4).await.unwrap();
            server.set_stack(stack);
            server.set_overlap(false);
            assert_eq!(server.overlap(), 1, "off: one pass at a time");
            server.set_overlap(true);
            assert_eq!(server.overlap(), n, "a pass in flight per piece");
            let (got, most) = drive(&mut server, &reqs);
            assert_eq!(most, n, "{n} devices: every piece had a pass");
            for (r, q) in reqs.iter().enumerate() {
                let mine = got.get(&(r as u64)).cloned().unwrap_or_default();
                match q.cancel_after {
                    None => assert_eq!(mine, expect[r], "{n} devices, request {r}"),
                    Some(k) => assert_eq!(mine, expect[r][..k], "{n} devices, request {r}"),
                }
            }
            let t = server.telemetry();
            assert_eq!(
                t.kv.map(|k| k.blocks_used),
                Some(0),
                "{n} devices: blocks back"
            );
            assert_eq!(t.requests, 0);
        }
    });
}
