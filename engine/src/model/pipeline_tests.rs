//! A stage split by layers over several cpu devices of one process, run as a pipeline of
//! micro-batches (`pipeline.rs`), against the whole model on one device and against the
//! same stage run as one batch.
//!
//! Every row's arithmetic is the same whichever micro-batch it runs in, so the pipelined
//! logits must equal the one-batch logits exactly; against one device (another pass shape)
//! they are compared within [`assert_close`]'s tolerance (1e-3 of the largest magnitude).

use std::sync::Arc;

use super::batch_tests::{alone, assert_close, config, logits, stack_steps};
use super::synthetic::SyntheticModel;
use super::{ModelError, Shard, ShardInput, ShardOutput, ShardStack, StackItem, StackSeq, Want};
use crate::backend::Device;
use crate::kernels::SampleParams;
use crate::worker::tests::cpu;

/// The 3-layer SmolLM2-shaped model by layers over three cpu devices of their own, a layer
/// each.
fn layer_stack(model: &SyntheticModel) -> ShardStack {
    let devices: Vec<(Arc<Device>, u64)> = (0..3).map(|_| (cpu(), 1 << 30)).collect();
    let stack = ShardStack::load(&devices, model, 0, 3, &mut |_, _| {}).unwrap();
    assert_eq!(stack.pieces().len(), 3);
    stack
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|s| {
            (0..(2 + s % 5))
                .map(|i| ((i * 37 + s * 11 + 1) % 512) as u32)
                .collect()
        })
        .collect()
}

/// Each pass's outputs of `prompts` prefilled together and then fed `fed[s]` one token a
/// step, every pass pipelined as `micro` micro-batches; `want(step)` says what each asks.
fn run(
    stack: &ShardStack,
    prompts: &[Vec<u32>],
    fed: &[Vec<u32>],
    micro: usize,
    want: impl Fn(u32) -> Want,
) -> Vec<Vec<ShardOutput>> {
    stack_steps(stack, prompts, fed, want, &mut |stack, pool, items| {
        stack.forward_pipelined(pool, items, micro)
    })
}

/// Seven sequences, prefilled together and decoded four steps together, as one micro-batch
/// and as two, three and seven (micro-batches of different sequences in flight on different
/// devices at once): every pass's logits are the one-batch pass's, and within tolerance of
/// each sequence alone on one device.
#[test]
fn a_pipelined_layer_split_matches_one_batch_and_one_device() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 11);
    let one = Shard::load(cpu(), &model, 0, cfg.n_layers, 256, &mut |_, _| {}).unwrap();
    let prompts = prompts(7);
    let expect: Vec<_> = prompts.iter().map(|p| alone(&one, p, 4)).collect();
    let fed: Vec<Vec<u32>> = expect.iter().map(|e| e.1.clone()).collect();
    let stack = layer_stack(&model);
    let whole = run(&stack, &prompts, &fed, 1, |_| Want::Logits);
    for (step, outs) in whole.iter().enumerate() {
        for (s, out) in outs.iter().enumerate() {
            assert_close(
                &format!("sequence {s} step {step}"),
                &logits(out.clone()),
                &expect[s].0[step],
            );
        }
    }
    for micro in [2, 3, 7] {
        let got = run(&stack, &prompts, &fed, micro, |_| Want::Logits);
        assert!(got == whole, "{micro} micro-batches differ from one batch");
    }
}

/// Nine sequences drawing greedy tokens on the device, pipelined as three micro-batches:
/// each sequence's tokens are the ones the whole model on one device picks.
#[test]
fn a_pipelined_layer_split_draws_the_greedy_tokens_of_one_device() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 12);
    let one = Shard::load(cpu(), &model, 0, cfg.n_layers, 256, &mut |_, _| {}).unwrap();
    let prompts = prompts(9);
    let steps = 5;
    let expect: Vec<_> = prompts.iter().map(|p| alone(&one, p, steps)).collect();
    let fed: Vec<Vec<u32>> = expect.iter().map(|e| e.1[..steps - 1].to_vec()).collect();
    let greedy = |step| {
        Want::Sample(SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            step,
        })
    };
    let got = run(&layer_stack(&model), &prompts, &fed, 3, greedy);
    for (s, e) in expect.iter().enumerate() {
        let tokens: Vec<u32> = got
            .iter()
            .map(|outs| match outs[s] {
                ShardOutput::Token(t) => t,
                ref other => panic!("a token expected, got {other:?}"),
            })
            .collect();
        assert_eq!(tokens, e.1, "sequence {s}");
    }
}

/// An item the first piece refuses (a token outside the vocabulary) fails alone, in the
/// middle of its micro-batch; a device that fails mid-pass fails the whole call, naming the
/// device, and the pipeline's other threads stop instead of waiting for it.
#[test]
fn a_pipelined_pass_fails_an_item_alone_and_a_device_whole() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 13);
    let stack = layer_stack(&model);
    let mut pool = stack.new_pool(|_| 8 << 20).unwrap();
    let mut seqs: Vec<StackSeq> = (0..5).map(|_| StackSeq::new(3, 64)).collect();
    let inputs: Vec<Vec<u32>> = vec![vec![1, 2], vec![3], vec![9999], vec![4, 5, 6], vec![7]];
    let mut items: Vec<StackItem> = seqs
        .iter_mut()
        .zip(&inputs)
        .map(|(seq, input)| StackItem {
            seq,
            input: ShardInput::Tokens(input),
            want: Want::Logits,
        })
        .collect();
    let outs = stack.forward_pipelined(&mut pool, &mut items, 2).unwrap();
    for (i, out) in outs.iter().enumerate() {
        match i {
            2 => assert!(
                matches!(out, Err(ModelError::BadToken { id: 9999, .. })),
                "{out:?}"
            ),
            _ => assert!(
                matches!(out, Ok(ShardOutput::Logits(l)) if l.len() == 512),
                "{out:?}"
            ),
        }
    }
    assert_eq!(seqs[2].len(), 0, "the refused item holds no positions");
    assert_eq!(seqs[3].len(), 3);
    for (piece, fail) in [(0, 4), (1, 5), (2, 6)] {
        let mut seqs: Vec<StackSeq> = (0..4).map(|_| StackSeq::new(3, 64)).collect();
        let mut parts: Vec<Vec<&mut super::SeqKv>> = (0..3).map(|_| Vec::new()).collect();
        for s in seqs.iter_mut() {
            for (p, kv) in parts.iter_mut().zip(s.parts_mut()) {
                p.push(kv);
            }
        }
        let inputs = [ShardInput::Tokens(&[1, 2, 3]); 4];
        let wants = [Want::Logits; 4];
        let mut pools: Vec<_> = stack
            .pieces()
            .iter()
            .map(|p| p.new_pool(8 << 20).unwrap())
            .collect();
        let mut pools: Vec<&mut super::KvPool> = pools.iter_mut().collect();
        let got = super::pipeline::forward(
            stack.pieces(),
            &mut pools,
            parts,
            &inputs,
            &wants,
            4,
            Some((piece, fail)),
        );
        match got {
            Err((p, ModelError::DeviceFailed { index, .. })) => {
                assert_eq!((p, index), (piece, fail));
            }
            other => panic!("piece {piece}'s failure expected, got {other:?}"),
        }
    }
}
