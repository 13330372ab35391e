//! The trusted device spot checks recompute on: the coordinator's own
//! engine on the cpu, holding the whole model, loaded at the first check
//! (a coordinator that never checks never pays for it). The rules (which
//! step, how to judge, whom to blame) are in `core/spot.rs`; this only
//! computes logits.
//!
//! A check holds its request's tokens back until its verdict, so what it
//! costs is a stall of the stream. Each request that was checked keeps its
//! keys and values here (one sequence of a paged pool with a byte budget),
//! so its next check runs only the tokens since the last one instead of the
//! whole prefix again: the first check of a request prefills its prompt and
//! tokens so far, each later one about `1 / rate` tokens. The pool is
//! bounded: when it is full, the sequences checked least recently give their
//! blocks back (their next check starts over), and a context larger than the
//! whole budget is computed afresh without being kept. A request's sequence
//! is dropped when the request ends (`forget`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cairn_engine::gguf::MappedGguf;
use cairn_engine::model::shard::{BatchItem, DEFAULT_MAX_BATCH};
use cairn_engine::model::{
    KvPool, ModelConfig, ModelError, SeqKv, Shard, ShardInput, ShardOutput, Want,
};
use cairn_engine::{Device, EngineOptions, Selection};

use super::core::{SpotCheck, Verdict, judge};

/// What the checked requests' keys and values may take on the coordinator
/// (the 135M model: about 23,000 positions; an 8B: 4,096).
pub const CHECK_KV_BYTES: u64 = 1 << 30;

/// Tokens a prefetch runs before letting a waiting check go first: enough that the head's
/// one row a pass costs little beside them.
const PREFETCH_CHUNK: usize = 128;

pub struct Verifier {
    path: PathBuf,
    options: EngineOptions,
    tolerance: f32,
    kv_budget: u64,
    /// Checks waiting for the model: prefetches let them go first.
    checks_waiting: AtomicUsize,
    /// The model once loaded, or why it could not be (not tried again).
    loaded: Mutex<Option<Result<Trusted, String>>>,
}

struct Trusted {
    _device: Arc<Device>,
    shard: Shard,
    pool: KvPool,
    /// Per checked request: its sequence in `pool` and the tokens it holds.
    seqs: HashMap<u64, Cached>,
    /// Counts checks, to find the sequence checked least recently.
    clock: u64,
}

struct Cached {
    kv: SeqKv,
    tokens: Vec<u32>,
    last_used: u64,
}

/// Logits after a context, and how many of its tokens were run for them.
pub struct Recomputed {
    pub logits: Vec<f32>,
    pub rows_run: usize,
}

impl Verifier {
    pub fn new(path: PathBuf, options: EngineOptions, tolerance: f32) -> Verifier {
        Self::with_kv_budget(path, options, tolerance, CHECK_KV_BYTES)
    }

    /// As [`Verifier::new`], the checked requests' keys and values bounded by `kv_budget`
    /// bytes.
    pub fn with_kv_budget(
        path: PathBuf,
        options: EngineOptions,
        tolerance: f32,
        kv_budget: u64,
    ) -> Verifier {
        Verifier {
            path,
            options,
            tolerance,
            kv_budget,
            checks_waiting: AtomicUsize::new(0),
            loaded: Mutex::new(None),
        }
    }

    /// Recomputes `check`'s step and judges the workers' token. Blocking:
    /// call it off the async threads. Checks run one at a time.
    pub fn check(&self, check: &SpotCheck) -> Verdict {
        let t0 = std::time::Instant::now();
        match self.recompute(check.request, &check.context) {
            Ok(r) => {
                tracing::debug!(
                    request = check.request,
                    step = check.step,
                    rows_run = r.rows_run,
                    ms = format!("{:.1}", t0.elapsed().as_secs_f64() * 1e3),
                    "spot check recomputed"
                );
                judge(&r.logits, &check.sample, check.claimed, self.tolerance)
            }
            Err(e) => Verdict::Unchecked(e),
        }
    }

    /// The logits after `context`, running only what request `request`'s kept sequence
    /// does not already hold (everything after the first token where they differ).
    /// Blocking.
    pub fn recompute(&self, request: u64, context: &[u32]) -> Result<Recomputed, String> {
        // A check holds a stream's tokens back: prompts computed ahead step aside for it.
        self.checks_waiting.fetch_add(1, Ordering::SeqCst);
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        self.checks_waiting.fetch_sub(1, Ordering::SeqCst);
        let trusted = loaded.get_or_insert_with(|| self.load());
        let trusted = match trusted {
            Ok(t) => t,
            Err(e) => return Err(format!("the trusted model did not load: {e}")),
        };
        trusted
            .logits(request, context)
            .map_err(|e| format!("the trusted device failed: {e}"))
    }

    /// Computes `context` of `request` ahead of a check (its prompt, while the workers
    /// prefill it), so the check runs only what comes after. Blocking. It runs
    /// [`PREFETCH_CHUNK`] tokens at a time and lets every check waiting go first between
    /// them: many long prompts computed ahead never hold a stream's check for long.
    pub fn prefetch(&self, request: u64, context: &[u32]) {
        let t0 = std::time::Instant::now();
        let mut rows = 0;
        loop {
            while self.checks_waiting.load(Ordering::SeqCst) > 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
            let trusted = match loaded.get_or_insert_with(|| self.load()) {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!(request, %e, "the trusted model did not load for a prefetch");
                    return;
                }
            };
            let held = trusted.seqs.get(&request).map_or(0, |c| {
                c.tokens
                    .iter()
                    .zip(context)
                    .take_while(|(a, b)| a == b)
                    .count()
            });
            if held >= context.len() {
                break;
            }
            let upto = context.len().min(held + PREFETCH_CHUNK);
            match trusted.logits(request, &context[..upto]) {
                // Not kept (more than the whole pool holds): the check computes it.
                Ok(_)
                    if trusted
                        .seqs
                        .get(&request)
                        .is_none_or(|c| c.tokens.len() < upto) =>
                {
                    return;
                }
                Ok(r) => rows += r.rows_run,
                Err(e) => {
                    tracing::debug!(request, %e, "computing a prompt ahead of a spot check failed");
                    return;
                }
            }
        }
        tracing::debug!(
            request,
            rows_run = rows,
            ms = format!("{:.1}", t0.elapsed().as_secs_f64() * 1e3),
            "prompt computed ahead of a spot check"
        );
    }

    /// Drops what is kept for `request` (it ended). Blocking: waits for a check under way.
    pub fn forget(&self, request: u64) {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(Ok(t)) = loaded.as_mut()
            && let Some(mut c) = t.seqs.remove(&request)
        {
            t.pool.release(&mut c.kv);
        }
    }

    /// Requests with a kept sequence, and the pool's blocks in use.
    #[cfg(test)]
    pub fn kept(&self) -> (usize, usize) {
        let loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        match loaded.as_ref() {
            Some(Ok(t)) => (t.seqs.len(), t.pool.book().used()),
            _ => (0, 0),
        }
    }

    fn load(&self) -> Result<Trusted, String> {
        let t0 = std::time::Instant::now();
        let found = cairn_engine::device::discover_blocking_with(self.options.clone());
        let device = found
            .open_blocking(&Selection {
                backend: Some("cpu".into()),
                device: None,
            })
            .map_err(|e| e.to_string())?;
        let device = Arc::new(device);
        let file = MappedGguf::open(&self.path).map_err(|e| e.to_string())?;
        let n_layers = ModelConfig::from_gguf(&file.file)
            .map_err(|e| e.to_string())?
            .n_layers;
        let shard = Shard::load(
            device.clone(),
            &file,
            0,
            n_layers,
            DEFAULT_MAX_BATCH,
            &mut |_, _| {},
        )
        .map_err(|e| e.to_string())?;
        let pool = shard.new_pool(self.kv_budget).map_err(|e| e.to_string())?;
        device.sync_blocking().map_err(|e| e.to_string())?;
        tracing::info!(
            load_s = format!("{:.2}", t0.elapsed().as_secs_f64()),
            "the spot checks' trusted model is loaded (cpu)"
        );
        Ok(Trusted {
            _device: device,
            shard,
            pool,
            seqs: HashMap::new(),
            clock: 0,
        })
    }
}

impl Trusted {
    fn logits(&mut self, request: u64, context: &[u32]) -> Result<Recomputed, String> {
        if context.is_empty() {
            return Err("no tokens".into());
        }
        self.clock += 1;
        let mut c = self.seqs.remove(&request).unwrap_or_else(|| Cached {
            // The pool's budget bounds a sequence; this limit never binds first.
            kv: SeqKv::new(usize::MAX / 2),
            tokens: Vec::new(),
            last_used: 0,
        });
        // What the kept sequence holds of this context; at least the last token runs
        // again, for its logits.
        let same = c
            .tokens
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        c.kv.truncate(same);
        c.tokens.truncate(same);
        let new = &context[same..];
        loop {
            let out = {
                let mut items = [BatchItem {
                    seq: &mut c.kv,
                    input: ShardInput::Tokens(new),
                    want: Want::Logits,
                }];
                pollster::block_on(self.shard.forward_batch(&mut self.pool, &mut items))
                    .map_err(|e| e.to_string())?
                    .pop()
                    .ok_or("no result")?
            };
            match out {
                Ok(ShardOutput::Logits(logits)) => {
                    c.tokens.extend_from_slice(new);
                    c.last_used = self.clock;
                    self.seqs.insert(request, c);
                    return Ok(Recomputed {
                        logits,
                        rows_run: new.len(),
                    });
                }
                Ok(_) => {
                    self.pool.release(&mut c.kv);
                    return Err("the shard did not return logits".into());
                }
                Err(ModelError::PoolFull(_)) => {
                    // The request checked least recently gives its blocks back; with none
                    // left to give, this context is computed afresh and not kept.
                    let oldest = self
                        .seqs
                        .iter()
                        .min_by_key(|(_, s)| s.last_used)
                        .map(|(&r, _)| r);
                    match oldest.and_then(|r| self.seqs.remove(&r)) {
                        Some(mut old) => self.pool.release(&mut old.kv),
                        None => {
                            self.pool.release(&mut c.kv);
                            return Ok(Recomputed {
                                logits: dense_logits(&self.shard, context)?,
                                rows_run: context.len(),
                            });
                        }
                    }
                }
                Err(e) => {
                    // The sequence may hold half a step: drop it.
                    self.pool.release(&mut c.kv);
                    return Err(e.to_string());
                }
            }
        }
    }
}

/// The logits after `context`, computed afresh in a cache of its own.
fn dense_logits(shard: &Shard, context: &[u32]) -> Result<Vec<f32>, String> {
    let mut cache = shard.new_cache(context.len()).map_err(|e| e.to_string())?;
    let out =
        pollster::block_on(shard.forward(&mut cache, ShardInput::Tokens(context), Want::Logits))
            .map_err(|e| e.to_string())?;
    match out {
        ShardOutput::Logits(l) => Ok(l),
        _ => Err("the shard did not return logits".into()),
    }
}

#[cfg(test)]
mod tests {
    use cairn_engine::model::synthetic::SyntheticModel;

    use super::*;

    /// A verifier over the synthetic `tiny` model written to a file in `dir`.
    fn tiny(dir: &std::path::Path, kv_budget: u64) -> (Verifier, usize) {
        let cfg = ModelConfig::synthetic("tiny").expect("the tiny shape");
        // A file per verifier: another one's model stays mapped while it lives.
        let path = dir.join(format!("tiny-{kv_budget}.gguf"));
        let file = std::fs::File::create(&path).expect("a temporary file");
        SyntheticModel::new(&cfg, 3)
            .write_gguf(std::io::BufWriter::new(file))
            .expect("writing the model");
        (
            Verifier::with_kv_budget(path, EngineOptions::default(), 0.5, kv_budget),
            cfg.vocab_size,
        )
    }

    fn context(len: usize, vocab: usize) -> Vec<u32> {
        (0..len)
            .map(|i| ((1000 + 7919 * i) % vocab) as u32)
            .collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The logits of the whole context run afresh (another request id: no kept sequence).
    fn afresh(v: &Verifier, ctx: &[u32]) -> Vec<f32> {
        let fresh = v.recompute(u64::MAX, ctx).expect("a fresh recompute");
        assert_eq!(fresh.rows_run, ctx.len());
        v.forget(u64::MAX);
        fresh.logits
    }

    // The paged pass against the dense one, both on the cpu, of logits of size about 1 to 10:
    // attention summed in another order, and a check's few new tokens run through the decode
    // kernels where the whole prompt afresh runs through the prompt tiles (the same int8 sums,
    // their float steps in another order; since session 18's shared row arithmetic the two
    // differ by up to 0.0032 here). A kept cache read at wrong positions is off by whole units.
    const TOLERANCE: f32 = 1e-2;

    #[test]
    fn a_second_check_of_a_request_runs_only_the_tokens_since_the_first() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (v, vocab) = tiny(dir.path(), CHECK_KV_BYTES);
        let ctx = context(40, vocab);

        let first = v.recompute(7, &ctx[..30]).expect("the first check");
        assert_eq!(first.rows_run, 30, "the first check runs the whole prefix");
        let second = v.recompute(7, &ctx).expect("the second check");
        assert_eq!(
            second.rows_run, 10,
            "the second runs only the 10 new tokens"
        );
        let d = max_diff(&second.logits, &afresh(&v, &ctx));
        assert!(d < TOLERANCE, "kept sequence against afresh: {d}");
        let d = max_diff(&first.logits, &afresh(&v, &ctx[..30]));
        assert!(d < TOLERANCE, "first check against afresh: {d}");

        // A wrong token dropped, the request went on from before it with another one: the
        // context differs from position 35 on, and only that much runs again.
        let mut other = ctx.clone();
        other[35] = (other[35] + 1) % vocab as u32;
        let third = v.recompute(7, &other).expect("the third check");
        assert_eq!(third.rows_run, 5);
        let d = max_diff(&third.logits, &afresh(&v, &other));
        assert!(d < TOLERANCE, "after a divergence: {d}");

        // The same context again still gives its logits (its last token runs again).
        let again = v.recompute(7, &other).expect("the same context");
        assert_eq!(again.rows_run, 1);
        assert!(max_diff(&again.logits, &third.logits) < TOLERANCE);

        // Another request keeps its own sequence; a request's end frees its blocks.
        v.recompute(8, &ctx[..20]).expect("another request");
        let (requests, blocks) = v.kept();
        assert_eq!(requests, 2);
        assert!(
            blocks >= 3 + 2,
            "40 and 20 positions in blocks of 16: {blocks}"
        );
        v.forget(7);
        v.forget(8);
        assert_eq!(v.kept(), (0, 0), "ended requests keep nothing");
    }

    #[test]
    fn a_prompt_computed_ahead_leaves_its_check_the_rest_and_never_cuts_a_longer_one() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (v, vocab) = tiny(dir.path(), CHECK_KV_BYTES);
        let ctx = context(40, vocab);
        v.prefetch(1, &ctx[..32]);
        let check = v.recompute(1, &ctx[..36]).expect("the check");
        assert_eq!(check.rows_run, 4, "the prompt was computed ahead");
        let d = max_diff(&check.logits, &afresh(&v, &ctx[..36]));
        assert!(d < TOLERANCE, "{d}");
        // A prefetch that comes after a check ran further keeps what the check ran.
        v.prefetch(1, &ctx[..32]);
        assert_eq!(v.recompute(1, &ctx).expect("the next check").rows_run, 4);
        // A prompt longer than a chunk runs in chunks, all of it.
        let long = context(2 * PREFETCH_CHUNK + 44, vocab);
        v.prefetch(2, &long[..2 * PREFETCH_CHUNK + 40]);
        let check = v.recompute(2, &long).expect("the check of the long one");
        assert_eq!(check.rows_run, 4);
        let d = max_diff(&check.logits, &afresh(&v, &long));
        assert!(d < TOLERANCE, "{d}");
    }

    #[test]
    fn a_full_pool_gives_back_the_least_recently_checked_and_still_answers() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let cfg = ModelConfig::synthetic("tiny").expect("the tiny shape");
        // Room for 64 positions (4 blocks): K and V, every layer, f32.
        let per_position = (2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4) as u64;
        let (v, vocab) = tiny(dir.path(), 64 * per_position);
        let ctx = context(100, vocab);
        v.recompute(1, &ctx[..40]).expect("request 1");
        v.recompute(2, &ctx[..20]).expect("request 2");
        // 40 more positions for request 2: request 1's blocks go back.
        let r = v.recompute(2, &ctx[..60]).expect("request 2 grows");
        assert_eq!(r.rows_run, 40);
        assert_eq!(v.kept().0, 1, "request 1 gave its blocks back");
        let r = v.recompute(1, &ctx[..45]).expect("request 1 starts over");
        assert_eq!(r.rows_run, 45);
        // Larger than the whole budget: computed afresh (as a pool with room computes it),
        // and not kept.
        let r = v.recompute(3, &ctx).expect("a context past the budget");
        assert_eq!(r.rows_run, 100);
        // Nor does computing it ahead keep it (or loop).
        v.prefetch(3, &ctx);
        assert_eq!(
            v.kept(),
            (0, 0),
            "nothing kept once the pool had to give all back"
        );
        let roomy = tiny(dir.path(), CHECK_KV_BYTES).0;
        let d = max_diff(&r.logits, &afresh(&roomy, &ctx));
        assert!(d < TOLERANCE, "{d}");
    }
}
