//! The API's JSON bodies (OpenAI chat and completions, Ollama show,
//! generate and chat, a placement, a join token) and every check on them
//! that needs no cluster: any bytes parse or give an error, never a panic.
//!
//! `native/src/coord/api/bodies.rs` holds those bodies and checks with
//! only serde and serde_json beneath them, so this target compiles that
//! one file instead of the whole `cairn` crate (WebRTC, axum, wgpu).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../native/src/coord/api/bodies.rs"]
mod bodies;

fuzz_target!(|data: &[u8]| {
    let _ = bodies::parse_bodies(data);
});
