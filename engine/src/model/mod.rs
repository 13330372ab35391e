//! Dense decoder models (the llama, qwen2, qwen3 and phi3 families) over a layer range: config, weights, KV cache, forward pass and
//! generation.

pub mod cache;
pub mod config;
mod embed_copies;
pub mod family;
pub mod generate;
mod head_split;
pub mod kv_pool;
mod pipeline;
pub mod shard;
pub mod stack;
pub mod synthetic;
pub mod tensor_split;
pub mod tiny;
pub mod weights;

#[cfg(test)]
mod batch_tests;
#[cfg(test)]
mod pipeline_tests;
#[cfg(test)]
mod tensor_tests;

pub use cache::KvCache;
pub use config::ModelConfig;
pub use kv_pool::{KV_BLOCK, KvPool, SeqKv};
pub use shard::{Shard, ShardInput, ShardOutput, Want};
pub use stack::{ShardStack, Split, StackItem, StackPool, StackSeq};

use crate::backend::BackendError;
use crate::gguf::GgufError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model file: {0}")]
    Gguf(#[from] GgufError),
    #[error("device: {0}")]
    Backend(#[from] BackendError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("architecture '{arch}' is not supported: {why}")]
    UnsupportedArchitecture { arch: String, why: String },
    #[error("model shape: {0}")]
    BadShape(String),
    #[error("layer range {start}..{end} is not within the model's {n_layers} blocks")]
    BadRange {
        start: usize,
        end: usize,
        n_layers: usize,
    },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("context full: {needed} positions needed, the cache holds {capacity}")]
    ContextFull { needed: usize, capacity: usize },
    /// The stage's key/value pool cannot hold more now (other sequences hold it).
    #[error("{0}")]
    PoolFull(String),
    #[error("{0}")]
    WrongInput(&'static str),
    /// One device of a stage split over several failed a pass (`index` in the stage's list).
    #[error("device {index} of the stage failed: {text}")]
    DeviceFailed { index: usize, text: String },
    /// A stage's layers cannot be split by tensors over the devices asked for.
    #[error("tensor split: {0}")]
    TensorSplit(String),
}
