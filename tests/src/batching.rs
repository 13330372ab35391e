//! The batching check the kernel and model tests share: sequences decoded together through a
//! stage's paged pool give each sequence the logits it gets alone.

use std::sync::Arc;

use cairn_engine::Device;
use cairn_engine::model::shard::BatchItem;
use cairn_engine::model::synthetic::SyntheticModel;
use cairn_engine::model::{ModelConfig, SeqKv, Shard, ShardInput, ShardOutput, Want};

/// On `dev`, three sequences of the tiny synthetic model, prefilled together (prompts of 5, 9
/// and 1 tokens) and then decoded together for three steps (one pass a step), against each
/// sequence run alone through its own cache: within 1e-3 of the largest logit's magnitude
/// (plus one), the batched pass summing in another order than one sequence's kernels.
/// `label` names the device's kernel family in a failure.
pub fn synthetic_batches_match_each_sequence_alone(dev: Arc<Device>, label: &str) {
    let cfg = ModelConfig::synthetic("tiny").expect("synthetic shape");
    let model = SyntheticModel::new(&cfg, 13);
    let prompts: [Vec<u32>; 3] = [
        (0..5).map(|i| (i * 37 + 5) % 512).collect(),
        (0..9).map(|i| (i * 53 + 2) % 512).collect(),
        vec![99],
    ];
    let feed = [[11u32, 400, 3], [250, 7, 77], [1, 2, 3]];
    let logits = |o: ShardOutput| match o {
        ShardOutput::Logits(l) => l,
        other => panic!("logits expected, got {other:?}"),
    };
    let shard = Shard::load(dev.clone(), &model, 0, cfg.n_layers, 8, &mut |_, _| {})
        .expect("load synthetic model");
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for (p, f) in prompts.iter().zip(&feed) {
        let mut cache = shard.new_cache(32).expect("cache");
        let mut steps = Vec::new();
        for input in std::iter::once(p.clone()).chain(f.iter().map(|&t| vec![t])) {
            let out = pollster::block_on(shard.forward(
                &mut cache,
                ShardInput::Tokens(&input),
                Want::Logits,
            ))
            .expect("forward alone");
            steps.push(logits(out));
        }
        alone.push(steps);
    }
    let mut pool = shard.new_pool(16 << 20).expect("pool");
    let mut seqs: Vec<SeqKv> = (0..3).map(|_| SeqKv::new(32)).collect();
    for step in 0..=feed[0].len() {
        let inputs: Vec<Vec<u32>> = (0..3)
            .map(|s| match step {
                0 => prompts[s].clone(),
                _ => vec![feed[s][step - 1]],
            })
            .collect();
        let mut items: Vec<BatchItem> = seqs
            .iter_mut()
            .zip(&inputs)
            .map(|(seq, input)| BatchItem {
                seq,
                input: ShardInput::Tokens(input),
                want: Want::Logits,
            })
            .collect();
        let outs =
            pollster::block_on(shard.forward_batch(&mut pool, &mut items)).expect("batched pass");
        for (s, out) in outs.into_iter().enumerate() {
            let got = logits(out.expect("batch item"));
            let want = &alone[s][step];
            let scale = 1.0 + want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-3 * scale,
                "{} ({}) {label}: sequence {s} step {step}: batched logits differ from alone by {worst} (allowed {})",
                dev.info().id,
                dev.info().name,
                1e-3 * scale
            );
        }
    }
}
