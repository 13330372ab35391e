//! The library side of the `cairn` package, for the coordinator and the
//! integration tests: peer links over WebRTC data channels (`link`), and fetching a shard's
//! tensors from the coordinator over HTTP range requests (`model_fetch`), and the browser worker's
//! join page and wasm package the binary carries (`web_assets`).

pub mod audit;
pub mod coord;
pub mod link;
pub mod model_fetch;
pub mod state_dir;
pub mod web_assets;
pub mod worker;
