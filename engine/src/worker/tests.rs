//! The stage server against a whole-model run on the CPU backend: two
//! stages fed through encoded messages must draw the same greedy tokens.

use std::sync::Arc;

use super::*;
use crate::backend::Device;
use crate::kernels::SampleParams;
use crate::model::synthetic::SyntheticModel;
use crate::model::{ModelConfig, Shard, ShardInput, ShardOutput, Want};
use crate::protocol::{Deframer, Framer, LayerRange, Limits, Message, Tensor, error_code};

fn cpu() -> Arc<Device> {
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

fn small_config() -> ModelConfig {
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
        for seq in 0..4u32 {
            let fwd = Message::Forward {
                request: 7,
                seq,
                layers: LayerRange { start: 0, end: 2 },
                pos0: pos,
                max_len: 16,
                sample: None,
                tensor: Tensor::from_values(
                    crate::protocol::DType::U32,
                    vec![input.len() as u64],
                    &input,
                )
                .unwrap(),
            };
            let Some(Message::Activations { tensor, pos0, .. }) = first.handle(wire(fwd)).await
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
                sample: Some(greedy),
                tensor,
            };
            let Some(Message::Token { id, seq: s, .. }) = last.handle(wire(fwd)).await else {
                panic!("last stage gave no token")
            };
            assert_eq!(s, seq);
            got.push(id);
            pos += input.len() as u32;
            input = vec![id];
        }
        assert_eq!(got, expect);

        // Rewinding to position 0 and replaying gives the same first token (recovery path).
        let fwd = Message::Forward {
            request: 7,
            seq: 9,
            layers: LayerRange { start: 0, end: 2 },
            pos0: 0,
            max_len: 16,
            sample: None,
            tensor: Tensor::from_values(
                crate::protocol::DType::U32,
                vec![prompt.len() as u64],
                &prompt,
            )
            .unwrap(),
        };
        let Some(Message::Activations { tensor, .. }) = first.handle(fwd).await else {
            panic!()
        };
        let fwd = Message::Forward {
            request: 7,
            seq: 9,
            layers: LayerRange { start: 2, end: 4 },
            pos0: 0,
            max_len: 16,
            sample: None,
            tensor,
        };
        assert!(
            matches!(last.handle(fwd).await, Some(Message::Token { id, .. }) if id == expect[0])
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
        let tokens = Tensor::from_values(crate::protocol::DType::U32, vec![1], &[1u32]).unwrap();
        let fwd = |pos0, tensor: Tensor| Message::Forward {
            request: 1,
            seq: 0,
            layers: LayerRange { start: 0, end: 2 },
            pos0,
            max_len: 8,
            sample: None,
            tensor,
        };
        let code = |m: Option<Message>| match m {
            Some(Message::RequestError { code, .. }) => code,
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
        let forged =
            Tensor::from_values(crate::protocol::DType::U32, vec![1], &[99_999u32]).unwrap();
        assert_eq!(
            code(server.handle(fwd(0, forged)).await),
            error_code::BAD_REQUEST
        );
        // An unknown request that does not start at 0.
        assert_eq!(
            code(server.handle(fwd(3, tokens.clone())).await),
            error_code::BAD_REQUEST
        );
        // Past the cache's capacity.
        let long = Tensor::from_values(crate::protocol::DType::U32, vec![9], &[1u32; 9]).unwrap();
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
            tensor: tokens.clone(),
        };
        assert_eq!(code(server.handle(moved).await), error_code::UNSUPPORTED);
        // And a good one still works afterwards.
        assert!(matches!(
            server.handle(fwd(0, tokens)).await,
            Some(Message::Activations { .. })
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
    });
}
