//! The library side of the `cairn` package, for the coordinator and the
//! integration tests: peer links over WebRTC data channels (`link`).

pub mod coord;
pub mod link;
pub mod worker;
