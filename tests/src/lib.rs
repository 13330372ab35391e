//! Helpers shared by the integration tests in `tests/tests/`.

pub mod batching;
pub mod families;
pub mod impaired_relay;
pub mod procs;
pub mod turn_server;

use std::path::PathBuf;

/// The default model, from `$CAIRN_MODEL` or the cache location `scripts/fetch-model.sh` fills.
/// Tests that need it fail (never skip) when it is missing, saying how to get it.
pub fn model_path() -> PathBuf {
    let path = std::env::var_os("CAIRN_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"));
            cache.join("cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.exists(),
        "the default model is missing at {}: run scripts/fetch-model.sh (or set CAIRN_MODEL)",
        path.display()
    );
    path
}

/// `tests/data/reference.json`: llama.cpp's tokens, greedy continuations and logit margins,
/// made by `tools/reference/make_reference.py`.
pub fn reference() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/reference.json");
    let text = std::fs::read_to_string(path).expect("tests/data/reference.json");
    serde_json::from_str(&text).expect("reference.json is JSON")
}
