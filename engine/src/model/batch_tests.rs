//! Batched passes through a paged pool against each sequence run alone with its own cache,
//! on the cpu backend.

use super::kv_pool::SeqKv;
use super::shard::BatchItem;
use super::synthetic::SyntheticModel;
use super::{
    ModelConfig, ModelError, Shard, ShardInput, ShardOutput, ShardStack, StackItem, StackPool,
    StackSeq, Want,
};
use crate::kernels::SampleParams;
use crate::worker::tests::cpu;

pub(super) fn config() -> ModelConfig {
    let mut cfg = ModelConfig::synthetic("135m").expect("135m shape");
    cfg.n_layers = 3;
    cfg.vocab_size = 512;
    cfg
}

pub(super) fn logits(out: ShardOutput) -> Vec<f32> {
    match out {
        ShardOutput::Logits(l) => l,
        other => panic!("logits expected, got {other:?}"),
    }
}

pub(super) fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in l.iter().enumerate() {
        if *v > l[best] {
            best = i;
        }
    }
    best as u32
}

/// Each sequence alone: its prompt, then `steps` greedy decode steps; the logits after the
/// prompt and after each step, and the tokens fed.
pub(super) fn alone(shard: &Shard, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    pollster::block_on(async {
        let mut cache = shard.new_cache(64).unwrap();
        let mut all = vec![logits(
            shard
                .forward(&mut cache, ShardInput::Tokens(prompt), Want::Logits)
                .await
                .unwrap(),
        )];
        let mut fed = Vec::new();
        for _ in 0..steps {
            let t = argmax(all.last().unwrap());
            fed.push(t);
            all.push(logits(
                shard
                    .forward(&mut cache, ShardInput::Tokens(&[t]), Want::Logits)
                    .await
                    .unwrap(),
            ));
        }
        (all, fed)
    })
}

/// A pass over a stack: its pool and items in, each item's output out.
pub(super) type StackPass<'f> = dyn FnMut(
        &ShardStack,
        &mut StackPool,
        &mut [StackItem<'_>],
    ) -> Result<Vec<Result<ShardOutput, ModelError>>, ModelError>
    + 'f;

/// Every sequence through `stack` in one pass a step (`pass`): `prompts` prefilled together,
/// then `fed[s][k]` fed to sequence `s` at step `k + 1`, each asking `want(step)`; each
/// pass's outputs in order. Checks that every block went back to the pools at the end.
pub(super) fn stack_steps(
    stack: &ShardStack,
    prompts: &[Vec<u32>],
    fed: &[Vec<u32>],
    want: impl Fn(u32) -> Want,
    pass: &mut StackPass<'_>,
) -> Vec<Vec<ShardOutput>> {
    let mut pool = stack.new_pool(|_| 16 << 20).unwrap();
    let mut seqs: Vec<StackSeq> = prompts
        .iter()
        .map(|_| StackSeq::new(stack.pieces().len(), 64))
        .collect();
    let mut all = Vec::new();
    for step in 0..=fed[0].len() {
        let inputs: Vec<Vec<u32>> = (0..prompts.len())
            .map(|s| match step {
                0 => prompts[s].clone(),
                _ => vec![fed[s][step - 1]],
            })
            .collect();
        let mut items: Vec<StackItem> = seqs
            .iter_mut()
            .zip(&inputs)
            .map(|(seq, input)| StackItem {
                seq,
                input: ShardInput::Tokens(input),
                want: want(step as u32),
            })
            .collect();
        let outs = pass(stack, &mut pool, &mut items).unwrap();
        all.push(outs.into_iter().map(Result::unwrap).collect());
    }
    for s in &mut seqs {
        pool.release(s);
    }
    assert!(pool.each(|p| p.book().used()).iter().all(|u| *u == 0));
    all
}

/// The rows of a batched product sum in another order than one token's matrix-vector
/// product: logits within 1e-3 of the largest magnitude, the same argmax where the top two
/// are further apart than that.
pub(super) fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let scale = 1.0 + want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let tol = 1e-3 * scale;
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol,
            "{what}: logit {i}: {a} batched, {b} alone (allowed {tol})"
        );
    }
    let mut sorted = want.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if sorted[0] - sorted[1] > 2.0 * tol {
        assert_eq!(argmax(got), argmax(want), "{what}");
    }
}

/// Three sequences of 5, 11 and 1 prompt tokens prefill together (17 rows over a batch limit
/// of 8: three passes, the second sequence split across them), then decode four steps
/// together, teacher-forced with the tokens each drew alone.
#[test]
fn a_batch_of_sequences_matches_each_run_alone() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 7);
    let shard = Shard::load(cpu(), &model, 0, cfg.n_layers, 8, &mut |_, _| {}).unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        (0..5).map(|i| (i * 37 + 1) % 512).collect(),
        (0..11).map(|i| (i * 53 + 7) % 512).collect(),
        vec![300],
    ];
    let steps = 4;
    let expect: Vec<_> = prompts.iter().map(|p| alone(&shard, p, steps)).collect();
    let mut pool = shard.new_pool(64 << 20).unwrap();
    let mut seqs: Vec<SeqKv> = (0..3).map(|_| SeqKv::new(64)).collect();
    batched_matches(&shard, &mut pool, &mut seqs, &prompts, &expect, "");
    assert_eq!(seqs[1].len(), 11 + steps);
    // Blocks come back when a sequence ends, and a new sequence on reused blocks sees none
    // of the old one's keys.
    let used = pool.book().used();
    pool.release(&mut seqs[1]);
    assert!(pool.book().used() < used);
    let fresh = [9u32, 8, 7, 6, 5, 4, 3];
    let mut seq = SeqKv::new(64);
    let out = pollster::block_on(shard.forward_batch(
        &mut pool,
        &mut [BatchItem {
            seq: &mut seq,
            input: ShardInput::Tokens(&fresh),
            want: Want::Logits,
        }],
    ))
    .unwrap();
    let got = logits(out.into_iter().next().unwrap().unwrap());
    assert_close("reused blocks", &got, &alone(&shard, &fresh, 0).0[0]);
}

/// Feeds `prompts` and then each sequence's tokens of `expect` (from [`alone`]) to `seqs` in
/// batched passes, checking each pass's logits against the run alone.
fn batched_matches(
    shard: &Shard,
    pool: &mut super::kv_pool::KvPool,
    seqs: &mut [SeqKv],
    prompts: &[Vec<u32>],
    expect: &[(Vec<Vec<f32>>, Vec<u32>)],
    what: &str,
) {
    let steps = expect[0].1.len();
    pollster::block_on(async {
        for step in 0..=steps {
            let inputs: Vec<Vec<u32>> = (0..prompts.len())
                .map(|s| match step {
                    0 => prompts[s].clone(),
                    _ => vec![expect[s].1[step - 1]],
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
            let outs = shard.forward_batch(pool, &mut items).await.unwrap();
            for (s, out) in outs.into_iter().enumerate() {
                let got = logits(out.unwrap());
                assert_close(
                    &format!("{what}sequence {s} step {step}"),
                    &got,
                    &expect[s].0[step],
                );
            }
        }
    });
}

/// Gemma's windowed, soft-capped attention through the paged pool (the tiny models: a window
/// of 5, which the longer prompt passes in its prefill and the shorter one while decoding).
#[test]
fn tiny_gemma_batches_match_each_run_alone() {
    use crate::gguf::{BytesGguf, TensorSource};
    for arch in ["gemma2", "gemma3"] {
        let file = BytesGguf::new(super::tiny::tiny_model(arch, 3).unwrap()).unwrap();
        let cfg = ModelConfig::from_gguf(file.gguf()).unwrap();
        let shard = Shard::load(cpu(), &file, 0, cfg.n_layers, 8, &mut |_, _| {}).unwrap();
        let prompts: Vec<Vec<u32>> = vec![
            (0..11).map(|i| (i * 37 + 1) % 320).collect(),
            vec![5, 17, 250],
        ];
        let expect: Vec<_> = prompts.iter().map(|p| alone(&shard, p, 4)).collect();
        let mut pool = shard.new_pool(16 << 20).unwrap();
        let mut seqs: Vec<SeqKv> = (0..2).map(|_| SeqKv::new(64)).collect();
        batched_matches(
            &shard,
            &mut pool,
            &mut seqs,
            &prompts,
            &expect,
            &format!("{arch} "),
        );
    }
}

/// Two shards, the first passing each sequence's hidden rows to the second, drawing greedy
/// tokens on the device: the tokens each sequence draws alone.
#[test]
fn batched_stages_draw_the_tokens_of_a_whole_model_run() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 9);
    let dev = cpu();
    let whole = Shard::load(dev.clone(), &model, 0, cfg.n_layers, 16, &mut |_, _| {}).unwrap();
    let a = Shard::load(dev.clone(), &model, 0, 1, 16, &mut |_, _| {}).unwrap();
    let b = Shard::load(dev.clone(), &model, 1, cfg.n_layers, 16, &mut |_, _| {}).unwrap();
    let prompts = [vec![3u32, 1, 4, 1, 5], vec![2, 7, 1, 8, 2, 8, 1, 8, 2]];
    let steps = 5;
    let expect: Vec<_> = prompts.iter().map(|p| alone(&whole, p, steps).1).collect();
    let (mut pa, mut pb) = (a.new_pool(8 << 20).unwrap(), b.new_pool(8 << 20).unwrap());
    let mut sa: Vec<SeqKv> = (0..2).map(|_| SeqKv::new(64)).collect();
    let mut sb: Vec<SeqKv> = (0..2).map(|_| SeqKv::new(64)).collect();
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    let mut drawn: Vec<Vec<u32>> = vec![Vec::new(); 2];
    pollster::block_on(async {
        for _ in 0..steps {
            let mut items: Vec<BatchItem> = sa
                .iter_mut()
                .zip(&inputs)
                .map(|(seq, i)| BatchItem {
                    seq,
                    input: ShardInput::Tokens(i),
                    want: Want::Hidden,
                })
                .collect();
            let hidden: Vec<Vec<f32>> = a
                .forward_batch(&mut pa, &mut items)
                .await
                .unwrap()
                .into_iter()
                .map(|o| match o.unwrap() {
                    ShardOutput::Hidden(h) => h,
                    other => panic!("hidden expected, got {other:?}"),
                })
                .collect();
            let mut items: Vec<BatchItem> = sb
                .iter_mut()
                .zip(&hidden)
                .map(|(seq, h)| BatchItem {
                    seq,
                    input: ShardInput::Hidden(h),
                    want: Want::Sample(SampleParams::default()),
                })
                .collect();
            let outs = b.forward_batch(&mut pb, &mut items).await.unwrap();
            for (s, o) in outs.into_iter().enumerate() {
                let ShardOutput::Token(t) = o.unwrap() else {
                    panic!("a token expected")
                };
                drawn[s].push(t);
                inputs[s] = vec![t];
            }
        }
    });
    assert_eq!(drawn, expect);
}

/// A sequence the pool cannot hold, or whose input is wrong, fails alone; the others run.
#[test]
fn one_item_failing_leaves_the_others_running() {
    let cfg = config();
    let model = SyntheticModel::new(&cfg, 5);
    let shard = Shard::load(cpu(), &model, 0, cfg.n_layers, 8, &mut |_, _| {}).unwrap();
    // Room for 4 blocks (64 positions) at most.
    let budget = 4 * shard.kv_bytes_per_position() * super::KV_BLOCK as u64;
    let mut pool = shard.new_pool(budget).unwrap();
    let long: Vec<u32> = (0..60).map(|i| i % 512).collect();
    let (mut s1, mut s2, mut s3, mut s4) = (
        SeqKv::new(100),
        SeqKv::new(100),
        SeqKv::new(100),
        SeqKv::new(3),
    );
    let mut items = [
        BatchItem {
            seq: &mut s1,
            input: ShardInput::Tokens(&long),
            want: Want::Logits,
        },
        BatchItem {
            seq: &mut s2,
            input: ShardInput::Tokens(&[1, 2, 3, 4, 5]),
            want: Want::Logits,
        },
        BatchItem {
            seq: &mut s3,
            input: ShardInput::Tokens(&[1, 9999]),
            want: Want::Logits,
        },
        BatchItem {
            seq: &mut s4,
            input: ShardInput::Tokens(&[1, 2, 3, 4]),
            want: Want::Logits,
        },
    ];
    let outs = pollster::block_on(shard.forward_batch(&mut pool, &mut items)).unwrap();
    assert!(outs[0].is_ok());
    assert!(
        matches!(outs[1], Err(ModelError::PoolFull(_))),
        "{:?}",
        outs[1]
    );
    assert!(matches!(
        outs[2],
        Err(ModelError::BadToken { id: 9999, .. })
    ));
    assert!(matches!(
        outs[3],
        Err(ModelError::ContextFull {
            needed: 4,
            capacity: 3
        })
    ));
    assert_eq!(s1.len(), 60);
    assert!(s2.is_empty() && s3.is_empty());
}
