//! The signaling messages: what the server reads from a peer
//! (`ClientMessage`) and what a peer reads from the server
//! (`ServerMessage`). Any bytes give a message or an error, never a panic.
#![no_main]

use cairn_signal::protocol::{ClientMessage, ServerMessage};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<ClientMessage>(data);
    let _ = serde_json::from_slice::<ServerMessage>(data);
});
