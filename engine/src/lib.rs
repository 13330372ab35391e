//! Cairn's portable inference engine.
//!
//! The same crate builds natively and for `wasm32-unknown-unknown`: device discovery, the
//! backend abstraction with its `wgpu` and `cpu` backends, GGML block formats, the GGUF
//! reader, the tokenizer, and Llama-architecture model shards over a layer range.

pub mod backend;
pub mod device;
pub mod gguf;
pub mod kernels;
pub mod model;
pub mod options;
pub mod placement;
pub mod protocol;
pub mod quant;
pub mod session;
pub mod tokenizer;
pub mod worker;

pub use backend::{BackendError, BackendKind, Buffer, Device};
pub use device::{DeviceInfo, Selection, Support, discover, discover_with};
pub use kernels::Op;
pub use options::EngineOptions;
