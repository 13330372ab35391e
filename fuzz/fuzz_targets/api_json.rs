//! The API's JSON bodies (OpenAI chat and completions, Ollama show,
//! generate and chat, a placement): any bytes parse or give an error,
//! never a panic. Build with `--features api`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = cairn_native::coord::api::parse_bodies(data);
});
