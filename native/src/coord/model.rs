//! The model the coordinator serves: its metadata, tokenizer and the costs
//! placement weighs. The coordinator never loads weights itself.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use cairn_engine::gguf::MappedGguf;
use cairn_engine::model::ModelConfig;
use cairn_engine::model::weights::shard_weight_bytes;
use cairn_engine::placement::ModelCost;
use cairn_engine::tokenizer::Tokenizer;

pub struct ServedModel {
    pub path: PathBuf,
    /// `gguf::model_id` of the file.
    pub id: String,
    /// What `/v1/models` lists and requests name.
    pub name: String,
    pub file_bytes: u64,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub cost: ModelCost,
}

impl ServedModel {
    pub fn open(path: &Path, ctx: usize, parallel: usize) -> Result<ServedModel> {
        let file = MappedGguf::open(path).with_context(|| format!("opening {}", path.display()))?;
        let config = ModelConfig::from_gguf(&file.file)?;
        let tokenizer = Tokenizer::from_spec(&file.file.tokenizer_spec()?)
            .with_context(|| format!("building the tokenizer of {}", path.display()))?;
        let id = crate::worker::local_model_id(path)?;
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .map(|s| s.split('.').next().unwrap_or(s).to_owned())
            .unwrap_or_else(|| "model".into());
        let n = config.n_layers;
        let layers = shard_weight_bytes(&file, &config, 1.min(n - 1), n.max(2) - 1)
            / (n.max(3) - 2).max(1) as u64;
        // Shard 0..n minus the middle layers gives the embedding and head.
        let whole = shard_weight_bytes(&file, &config, 0, n);
        let first_only = shard_weight_bytes(&file, &config, 0, 1).saturating_sub(layers);
        let last_only = shard_weight_bytes(&file, &config, n - 1, n).saturating_sub(layers);
        let ctx = ctx.clamp(1, config.context_length.max(1));
        let kv_bytes_per_layer = config.kv_bytes_per_token_layer() * (ctx * parallel.max(1)) as u64;
        // Most backends' rows a pass. A cuda device's shard takes twice as many
        // (`CUDA_MAX_BATCH`), whose extra scratch (54 MB for an 8B model) is small against a
        // GPU's memory; counting it for every device would refuse placements on small ones.
        let max_batch = cairn_engine::model::shard::DEFAULT_MAX_BATCH as u64;
        let dim = config.dim as u64;
        let scratch_bytes = 4
            * (max_batch * (5 * dim + 2 * config.ffn_dim as u64 + config.q_dim() as u64)
                + config.vocab_size as u64
                + (config.n_heads * ctx) as u64 * max_batch.min(64));
        let cost = ModelCost {
            n_layers: n,
            layer_weight_bytes: layers.max(1),
            kv_bytes_per_layer,
            first_extra_bytes: first_only,
            last_extra_bytes: last_only,
            scratch_bytes,
            activation_bytes: dim * 4,
            token_bytes: 4,
            concurrency: parallel.max(1),
        };
        tracing::debug!(whole, ?cost, "model cost");
        Ok(ServedModel {
            path: path.to_owned(),
            id,
            name,
            file_bytes: std::fs::metadata(path)?.len(),
            config,
            tokenizer,
            cost,
        })
    }
}
