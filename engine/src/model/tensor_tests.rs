//! Tensor-parallel stages over several cpu devices of one process (`tensor_split.rs`) against
//! the whole model on one device.
//!
//! The split sums each output and down product from partial sums, in another order than one
//! device does, so logits are compared within [`assert_close`]'s tolerance (1e-3 of the
//! largest magnitude) and greedy picks wherever the top two are further apart than that.

use std::sync::Arc;

use super::batch_tests::{alone, argmax, assert_close, config, logits, stack_steps};
use super::synthetic::SyntheticModel;
use super::tensor_split::plan;
use super::{
    ModelConfig, ModelError, Shard, ShardInput, ShardOutput, ShardStack, Split, StackItem,
    StackSeq, Want,
};
use crate::backend::Device;
use crate::gguf::{BytesGguf, TensorSource};
use crate::kernels::SampleParams;
use crate::worker::tests::cpu;

/// `n` cpu devices of their own (separate accounting), as a worker over several GPUs has.
fn devices(n: usize) -> Vec<(Arc<Device>, u64)> {
    (0..n).map(|_| (cpu(), 1 << 30)).collect()
}

fn tensor_stack(src: &dyn TensorSource, n: usize) -> Result<ShardStack, ModelError> {
    let layers = ModelConfig::from_gguf(src.gguf())?.n_layers;
    ShardStack::load_split(&devices(n), src, 0, layers, Split::Tensor, &mut |_, _| {})
}

/// Feeds `prompts` and then each sequence's tokens of `expect` (from [`alone`]) through
/// `stack` in batched passes, all sequences in each, checking every pass's logits.
fn stack_matches(
    stack: &ShardStack,
    prompts: &[Vec<u32>],
    expect: &[(Vec<Vec<f32>>, Vec<u32>)],
    what: &str,
) {
    let fed: Vec<Vec<u32>> = expect.iter().map(|e| e.1.clone()).collect();
    let passes = stack_steps(
        stack,
        prompts,
        &fed,
        |_| Want::Logits,
        &mut |stack, pool, items| pollster::block_on(stack.forward_batch(pool, items)),
    );
    for (step, outs) in passes.into_iter().enumerate() {
        for (s, out) in outs.into_iter().enumerate() {
            assert_close(
                &format!("{what}sequence {s} step {step}"),
                &logits(out),
                &expect[s].0[step],
            );
        }
    }
}

/// The SmolLM2-135M shape (3 layers): 3 key/value heads of 3 query heads each, Q4_1 matrices.
/// Over two devices the heads split 2 and 1 (6 and 3 query heads; the output product's
/// columns cut at 384, a block boundary), the feed-forward rows 768 and 768; over three, a
/// key/value head each. Three sequences prefill together and decode four steps together.
#[test]
fn a_tensor_split_matches_one_device() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 7);
    let one = Shard::load(cpu(), &model, 0, cfg.n_layers, 256, &mut |_, _| {}).unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        (0..5).map(|i| (i * 37 + 1) % 512).collect(),
        (0..11).map(|i| (i * 53 + 7) % 512).collect(),
        vec![300],
    ];
    let expect: Vec<_> = prompts.iter().map(|p| alone(&one, p, 4)).collect();
    for n in [2, 3] {
        let stack = tensor_stack(&model, n).unwrap();
        assert_eq!(stack.split(), Split::Tensor);
        assert_eq!(stack.pieces().len(), n);
        let heads: Vec<usize> = stack.pieces().iter().map(|p| p.local().heads).collect();
        let ffn: Vec<usize> = stack.pieces().iter().map(|p| p.local().ffn).collect();
        assert_eq!(heads.iter().sum::<usize>(), cfg.n_heads);
        assert_eq!(ffn.iter().sum::<usize>(), cfg.ffn_dim);
        if n == 2 {
            assert_eq!((heads, ffn), (vec![6, 3], vec![768, 768]));
        }
        // Every device holds its part of every layer (and, since session 19, a copy of the
        // embedding and its rows of the head; the first the head whole).
        let live: Vec<u64> = stack
            .pieces()
            .iter()
            .map(|p| p.device().live_bytes())
            .collect();
        assert!(live.iter().all(|&b| b > 0), "weights on every device");
        assert!(
            live[0] > live[n - 1],
            "the first device holds the whole head (and the first heads) as well: {live:?}"
        );
        // Each device's key/value pool holds its own heads only.
        let per_pos: Vec<u64> = stack
            .pieces()
            .iter()
            .map(|p| p.kv_bytes_per_position())
            .collect();
        assert_eq!(per_pos.iter().sum::<u64>(), one.kv_bytes_per_position());
        stack_matches(&stack, &prompts, &expect, &format!("{n} devices, "));
    }
}

/// Tokens drawn on the device by a tensor-parallel stage, one sequence at a time and free
/// running: the greedy tokens of the whole model on one device.
#[test]
fn a_tensor_split_draws_the_greedy_tokens_of_one_device() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 9);
    let one = Shard::load(cpu(), &model, 0, cfg.n_layers, 256, &mut |_, _| {}).unwrap();
    let prompt = vec![3u32, 1, 4, 1, 5, 9, 2, 6];
    let steps = 6;
    let (_, want) = alone(&one, &prompt, steps);
    let stack = tensor_stack(&model, 2).unwrap();
    let mut pool = stack.new_pool(|_| 8 << 20).unwrap();
    let mut seq = StackSeq::new(2, 64);
    let mut got = Vec::new();
    let mut input = prompt.clone();
    pollster::block_on(async {
        for step in 0..steps {
            let mut items = [StackItem {
                seq: &mut seq,
                input: ShardInput::Tokens(&input),
                want: Want::Sample(SampleParams {
                    temperature: 0.0,
                    top_k: 0,
                    top_p: 1.0,
                    seed: 0,
                    step: step as u32,
                }),
            }];
            let out = stack.forward_batch(&mut pool, &mut items).await.unwrap();
            let Ok(ShardOutput::Token(t)) = out.into_iter().next().unwrap() else {
                panic!("a token expected");
            };
            got.push(t);
            input = vec![t];
        }
    });
    assert_eq!(got, want);
    assert_eq!(seq.len(), prompt.len() + steps - 1);
}

/// A stage of the later layers takes hidden states, and the tensor split of layers 1..3
/// gives the hidden rows one device gives, and the head's logits.
#[test]
fn a_later_stage_splits_too() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 5);
    let first = Shard::load(cpu(), &model, 0, 1, 256, &mut |_, _| {}).unwrap();
    let rest = Shard::load(cpu(), &model, 1, cfg.n_layers, 256, &mut |_, _| {}).unwrap();
    let split = ShardStack::load_split(
        &devices(3),
        &model,
        1,
        cfg.n_layers,
        Split::Tensor,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(split.range(), (1, cfg.n_layers));
    let prompt = [7u32, 8, 9, 10];
    pollster::block_on(async {
        let mut cache = first.new_cache(16).unwrap();
        let ShardOutput::Hidden(h) = first
            .forward(&mut cache, ShardInput::Tokens(&prompt), Want::Hidden)
            .await
            .unwrap()
        else {
            panic!("hidden rows expected");
        };
        let mut cache = rest.new_cache(16).unwrap();
        let want = logits(
            rest.forward(&mut cache, ShardInput::Hidden(&h), Want::Logits)
                .await
                .unwrap(),
        );
        let mut pool = split.new_pool(|_| 8 << 20).unwrap();
        let mut seq = StackSeq::new(3, 16);
        let mut items = [StackItem {
            seq: &mut seq,
            input: ShardInput::Hidden(&h),
            want: Want::Logits,
        }];
        let out = split.forward_batch(&mut pool, &mut items).await.unwrap();
        let got = logits(out.into_iter().next().unwrap().unwrap());
        assert_close("layers 1..3 split by tensors", &got, &want);
        assert_eq!(argmax(&got), argmax(&want));
    });
}

/// Qwen3's per-head Q/K norms, split over two devices (the tiny files' head size of 128 puts
/// each device's output-product columns on the Q4_K blocks of 256): batched logits.
///
/// Gemma 3's post norms, GELU and windowed layers: the hidden rows of its first four layers
/// (five windowed, one global in all), within 1e-5 of their largest magnitude. Not its
/// logits: the tiny Gemma 3 file amplifies any difference past its fourth layer (layer 0's
/// rows nudged by 1e-6 of their size move its logits by 0.33 of 14 on one device, measured
/// 2026-11-26; the int8 activations' outlier rule is a step), while the split's own rows
/// differ by 3e-7 of their size there.
#[test]
fn tiny_families_split_by_tensors() {
    let file = BytesGguf::new(super::tiny::tiny_model("qwen3", 3).unwrap()).unwrap();
    let cfg = ModelConfig::from_gguf(file.gguf()).unwrap();
    let one = Shard::load(cpu(), &file, 0, cfg.n_layers, 256, &mut |_, _| {}).unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        (0..11).map(|i| (i * 37 + 1) % 320).collect(),
        vec![5, 17, 250],
    ];
    let expect: Vec<_> = prompts.iter().map(|p| alone(&one, p, 4)).collect();
    let stack = tensor_stack(&file, 2).unwrap();
    stack_matches(&stack, &prompts, &expect, "qwen3 ");

    let file = BytesGguf::new(super::tiny::tiny_model("gemma3", 3).unwrap()).unwrap();
    let layers = 4;
    // Products in f32 here: with activations rounded to int8, a last-bit difference between
    // the two sides (a sum in another order) can cross a rounding step, which this tiny
    // Gemma turns into a 0.7% difference (seen when attention's normalization changed from
    // `s / sum` to `s * (1 / sum)`). The int8 path is compared by the qwen3 case above.
    let f32_cpu = || {
        Arc::new(Device::new_cpu_with(
            cpu().info().clone(),
            crate::backend::cpu::CpuBackend::with_f32_linear(true),
        ))
    };
    let one = Shard::load(f32_cpu(), &file, 0, layers, 256, &mut |_, _| {}).unwrap();
    let two: Vec<(Arc<Device>, u64)> = (0..2).map(|_| (f32_cpu(), 1 << 30)).collect();
    let split =
        ShardStack::load_split(&two, &file, 0, layers, Split::Tensor, &mut |_, _| {}).unwrap();
    let mut pool = split.new_pool(|_| 8 << 20).unwrap();
    let mut seq = StackSeq::new(2, 64);
    let mut cache = one.new_cache(64).unwrap();
    // The prompt, then a decode step: 12 positions, past the window of 5.
    for input in [prompts[0].clone(), vec![42]] {
        pollster::block_on(async {
            let ShardOutput::Hidden(want) = one
                .forward(&mut cache, ShardInput::Tokens(&input), Want::Hidden)
                .await
                .unwrap()
            else {
                panic!("hidden rows expected");
            };
            let mut items = [StackItem {
                seq: &mut seq,
                input: ShardInput::Tokens(&input),
                want: Want::Hidden,
            }];
            let out = split.forward_batch(&mut pool, &mut items).await.unwrap();
            let Some(Ok(ShardOutput::Hidden(got))) = out.into_iter().next() else {
                panic!("hidden rows expected");
            };
            assert_eq!(got.len(), want.len());
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "gemma3 layers 0..4, value {i}: {a} split, {b} on one device"
                );
            }
        });
    }
}

/// Shapes that do not split are refused before anything loads, saying why: more devices
/// than key/value heads, and output-product columns that would cut a K-quant block (the
/// tiny llama's heads of 64 against Q4_K blocks of 256).
#[test]
fn shapes_that_do_not_split_are_refused() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 1);
    let Err(ModelError::TensorSplit(why)) = tensor_stack(&model, 4) else {
        panic!("4 devices for 3 key/value heads should be refused");
    };
    assert!(why.contains("3 key/value heads"), "{why}");
    let file = BytesGguf::new(super::tiny::tiny_model("llama", 3).unwrap()).unwrap();
    let tiny = ModelConfig::from_gguf(file.gguf()).unwrap();
    let Err(ModelError::TensorSplit(why)) = plan(file.gguf(), &tiny, 0, tiny.n_layers, 2) else {
        panic!("a cut through Q4_K blocks should be refused");
    };
    assert!(
        why.contains("blk.0.attn_output") && why.contains("Q4_K"),
        "{why}"
    );
    let Err(ModelError::TensorSplit(_)) = tensor_stack(&file, 2) else {
        panic!("loading it should be refused too");
    };
    // One device is no split at all; a split by layers of the same file loads.
    assert_eq!(
        plan(file.gguf(), &tiny, 0, tiny.n_layers, 1).unwrap().len(),
        1
    );
    let layers = ShardStack::load_split(&devices(2), &file, 0, 2, Split::Layers, &mut |_, _| {});
    assert_eq!(layers.map(|s| s.split()).ok(), Some(Split::Layers));
    // The automatic choice takes the layers where devices cannot read each other (cpu) and
    // the model is narrow, and never fails where a split by layers loads.
    let auto = ShardStack::load_split(&devices(2), &file, 0, 2, Split::Auto, &mut |_, _| {});
    assert_eq!(auto.map(|s| s.split()).ok(), Some(Split::Layers));
    assert_eq!("auto".parse::<Split>(), Ok(Split::Auto));
    assert!("rows".parse::<Split>().unwrap_err().contains("auto"));
}

/// The head split by vocabulary rows over the devices (`head_split.rs`) and the embedding
/// copied to every device (`embed_copies.rs`) give exactly the outputs of both on the first
/// device alone (a row's dot product is the same whichever device computes it; an embedding
/// row is looked up): the logits, and the tokens drawn at a temperature with top-k and top-p,
/// for three sequences batched; the second device held the embedding and rows of the head.
#[test]
fn a_tensor_splits_head_and_embedding_on_every_device_give_the_first_devices_outputs() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 21);
    let mut stack = tensor_stack(&model, 2).unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        vec![5, 6, 7],
        (0..9).map(|i| i * 31 % 512).collect(),
        vec![1],
    ];
    let sampled = |step: u32| {
        Want::Sample(SampleParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            seed: 7,
            step,
        })
    };
    // Every pass's logits, then the tokens of a few steps drawn at a temperature.
    let outputs = |stack: &ShardStack| -> Vec<ShardOutput> {
        let mut pool = stack.new_pool(|_| 8 << 20).unwrap();
        let mut seqs: Vec<StackSeq> = prompts.iter().map(|_| StackSeq::new(2, 64)).collect();
        let mut all = Vec::new();
        pollster::block_on(async {
            for step in 0..4u32 {
                let inputs: Vec<Vec<u32>> = match step {
                    0 => prompts.clone(),
                    s => (0..prompts.len() as u32)
                        .map(|i| vec![i * 100 + s])
                        .collect(),
                };
                let mut items: Vec<StackItem> = seqs
                    .iter_mut()
                    .zip(&inputs)
                    .enumerate()
                    .map(|(i, (seq, input))| StackItem {
                        seq,
                        input: ShardInput::Tokens(input),
                        want: if i == 1 { sampled(step) } else { Want::Logits },
                    })
                    .collect();
                let outs = stack.forward_batch(&mut pool, &mut items).await.unwrap();
                all.extend(outs.into_iter().map(Result::unwrap));
            }
        });
        all
    };
    let split = outputs(&stack);
    let with_rows = stack.pieces()[1].device().live_bytes();
    stack.without_head_split();
    stack.without_embed_copies();
    let on_first = outputs(&stack);
    assert!(
        split == on_first,
        "the split head's outputs differ from the first device's"
    );
    assert!(
        split.iter().any(|o| matches!(o, ShardOutput::Token(_))),
        "tokens were drawn"
    );
    // The embedding (512 rows) and half the head's rows (256), of 576 columns at least 4 bits
    // each, lived on the second device.
    let freed = with_rows.saturating_sub(stack.pieces()[1].device().live_bytes());
    assert!(
        freed >= 768 * 576 / 2,
        "{freed} bytes of the ends on the second device"
    );
}
