//! Where a worker's weights come from: its own copy of the model file when
//! the coordinator names that model, else the coordinator over HTTP.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use cairn_engine::gguf::{MODEL_ID_PREFIX_BYTES, MappedGguf, TensorSource, model_id};

pub struct ShardSource {
    /// The local model file and its id.
    pub local: Option<(PathBuf, String)>,
    pub cache_dir: Option<PathBuf>,
}

/// The id (`gguf::model_id`) of a model file on disk.
pub fn local_model_id(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut prefix = Vec::new();
    (&mut f)
        .take(MODEL_ID_PREFIX_BYTES.min(len))
        .read_to_end(&mut prefix)?;
    Ok(model_id(&prefix, len))
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
        let (partial, id) =
            crate::model_fetch::fetch_shard(url, start, end, self.cache_dir.as_deref(), |_, _| {})
                .await?;
        if id != model {
            bail!("{url} serves model {id}, not {model}");
        }
        Ok(Box::new(partial))
    }
}
