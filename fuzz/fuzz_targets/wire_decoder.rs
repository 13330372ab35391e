//! The wire protocol's decoder: bytes as a link delivers them, cut into
//! pushes at points the input chooses, through a `Deframer` with small
//! limits. It must return messages or errors, never panic, and never
//! buffer past its limit.
#![no_main]

use cairn_engine::protocol::{Deframer, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_message_bytes: 1 << 20,
        ..Limits::default()
    };
    let mut d = Deframer::new(limits);
    // The first byte says where to cut the rest into pushes.
    let (cut, rest) = match data.split_first() {
        Some((c, r)) => (usize::from(*c).max(1), r),
        None => return,
    };
    for chunk in rest.chunks(cut) {
        match d.push(chunk) {
            Ok(_) => {}
            Err(_) => break,
        }
        assert!(d.buffered_bytes() as u64 <= limits.max_buffered_bytes());
    }
});
