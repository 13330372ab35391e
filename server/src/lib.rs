//! cairn-signal
