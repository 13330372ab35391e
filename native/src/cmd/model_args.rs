//! The model a benchmark runs: a GGUF file, or random weights in a known shape.

use std::path::PathBuf;

use anyhow::{Context, Result};
use cairn_engine::model::ModelConfig;

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model (default: $CAIRN_MODEL, then the default model's cache location).
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// A model of random weights in a known shape instead of a file: 135m (SmolLM2-135M),
    /// 1b (Llama-3.2-1B), 8b (Llama-3.1-8B), 8b-thin (two layers of the 8B's shape, its
    /// width and vocabulary: what an 8B token costs between stages, on a cpu), wide (two
    /// layers of width 2048), or tiny (8 layers of width 128: what remains is the cost of
    /// everything but the arithmetic); Q4_1 matrices and a Q8_0 embedding, with a stand-in
    /// vocabulary.
    #[arg(long)]
    pub synthetic: Option<String>,
}

impl ModelArgs {
    /// The synthetic shape asked for, if any.
    pub fn synthetic_config(&self) -> Result<Option<(&str, ModelConfig)>> {
        let Some(name) = self.synthetic.as_deref() else {
            return Ok(None);
        };
        let cfg = ModelConfig::synthetic(name).with_context(|| {
            format!("no synthetic model '{name}'; choose 135m, 1b, 8b, 8b-thin, wide or tiny")
        })?;
        Ok(Some((name, cfg)))
    }

    /// The model file: the one given, `$CAIRN_MODEL`, or the default model's.
    pub fn path(&self) -> Result<PathBuf> {
        crate::model_path::resolve(self.model.clone())
    }
}
