//! The trusted device spot checks recompute on: the coordinator's own
//! engine on the cpu, holding the whole model, loaded at the first check
//! (a coordinator that never checks never pays for it). The rules (which
//! step, how to judge, whom to blame) are in `core/spot.rs`; this only
//! computes logits.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use cairn_engine::gguf::MappedGguf;
use cairn_engine::model::shard::DEFAULT_MAX_BATCH;
use cairn_engine::model::{ModelConfig, Shard, ShardInput, ShardOutput, Want};
use cairn_engine::{Device, EngineOptions, Selection};

use super::core::{SpotCheck, Verdict, judge};

pub struct Verifier {
    path: PathBuf,
    options: EngineOptions,
    tolerance: f32,
    /// The model once loaded, or why it could not be (not tried again).
    loaded: Mutex<Option<Result<Trusted, String>>>,
}

struct Trusted {
    _device: Arc<Device>,
    shard: Shard,
}

impl Verifier {
    pub fn new(path: PathBuf, options: EngineOptions, tolerance: f32) -> Verifier {
        Verifier {
            path,
            options,
            tolerance,
            loaded: Mutex::new(None),
        }
    }

    /// Recomputes `check`'s step and judges the workers' token. Blocking:
    /// call it off the async threads. Checks run one at a time.
    pub fn check(&self, check: &SpotCheck) -> Verdict {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        let trusted = loaded.get_or_insert_with(|| self.load());
        let trusted = match trusted {
            Ok(t) => t,
            Err(e) => return Verdict::Unchecked(format!("the trusted model did not load: {e}")),
        };
        match logits(&trusted.shard, &check.context) {
            Ok(l) => judge(&l, &check.sample, check.claimed, self.tolerance),
            Err(e) => Verdict::Unchecked(format!("the trusted device failed: {e}")),
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
        device.sync_blocking().map_err(|e| e.to_string())?;
        tracing::info!(
            load_s = format!("{:.2}", t0.elapsed().as_secs_f64()),
            "the spot checks' trusted model is loaded (cpu)"
        );
        Ok(Trusted {
            _device: device,
            shard,
        })
    }
}

/// The logits after `context`, computed afresh.
fn logits(shard: &Shard, context: &[u32]) -> Result<Vec<f32>, String> {
    if context.is_empty() {
        return Err("no tokens".into());
    }
    let mut cache = shard.new_cache(context.len()).map_err(|e| e.to_string())?;
    let out =
        pollster::block_on(shard.forward(&mut cache, ShardInput::Tokens(context), Want::Logits))
            .map_err(|e| e.to_string())?;
    match out {
        ShardOutput::Logits(l) => Ok(l),
        _ => Err("the shard did not return logits".into()),
    }
}
