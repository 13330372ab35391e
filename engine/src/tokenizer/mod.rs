//! Tokenizer built from model metadata, and chat-template rendering.

mod spec;

pub use spec::TokenizerSpec;
