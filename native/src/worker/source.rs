//! Where a worker's weights come from: its own copy of the model file when
//! the coordinator names that model, else the coordinator over HTTP.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use cairn_engine::gguf::{MappedGguf, TensorSource};

pub struct ShardSource {
    /// The local model file and its id.
    pub local: Option<(PathBuf, String)>,
    pub cache_dir: Option<PathBuf>,
}

impl ShardSource {
    pub async fn open(
        &self,
        model: &str,
        url: &str,
        start: usize,
        end: usize,
    ) -> Result<Box<dyn TensorSource + Send>> {
        if let Some((path, id)) = &self.local
            && id == model
        {
            let file =
                MappedGguf::open(path).with_context(|| format!("opening {}", path.display()))?;
            return Ok(Box::new(file));
        }
        if url.is_empty() {
            bail!("model {model} is not on this machine and the coordinator gave no URL for it");
        }
        let mut shown = 0u64;
        let progress = move |done: u64, total: u64| {
            // A line every quarter: workers run headless, so no bar.
            let quarter = if total == 0 { 4 } else { done * 4 / total };
            if quarter > shown {
                shown = quarter;
                tracing::info!(
                    start,
                    end,
                    mib = done >> 20,
                    total_mib = total >> 20,
                    "fetching layers from the coordinator: {}%",
                    quarter * 25
                );
            }
        };
        let (partial, id) =
            crate::model_fetch::fetch_shard(url, start, end, self.cache_dir.as_deref(), progress)
                .await?;
        if id != model {
            bail!("{url} serves model {id}, not {model}");
        }
        Ok(Box::new(partial))
    }
}
