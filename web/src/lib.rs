//! Cairn's browser worker: the engine compiled to wasm32, on the browser's WebGPU (or the
//! engine's CPU backend where WebGPU is missing).
//!
//! - [`join_page`] runs `web/www/join.html`: it shows what the device offers, waits for
//!   consent, joins the room through cairn-signal as a worker, answers the coordinator's
//!   WebRTC offer and serves layers through `cairn_engine::worker::StageServer`, the code
//!   native workers run.
//! - [`Engine`] and [`Model`] are the package on its own: run a kernel or a model in a page
//!   (`docs/browser.md`).
//!
//! Modules: `join` (the worker's flow and serving loop), `link` (the peer connection and
//! framing), `ice` (the STUN/TURN servers the coordinator shares), `signal` (the signaling socket), `fetch` (range requests and the weight cache),
//! `ui` (the page), `js` (bindings to `probe.js`), `api` (the standalone API), `offload`
//! (where the page's stage server runs: on the page, or for the CPU fallback in a Web
//! Worker), `stage_worker` (that Web Worker's side) and `team` (its thread team, in the
//! threaded package built with shared memory).

// The engine's APIs share a device as `Arc<Device>`; on wasm32 wgpu's handles are neither
// `Send` nor `Sync`, and the page is single-threaded.
#![allow(clippy::arc_with_non_send_sync)]

#[cfg(target_arch = "wasm32")]
mod api;
// Pure data: its tests run natively.
#[cfg(any(target_arch = "wasm32", test))]
mod cost;
#[cfg(target_arch = "wasm32")]
mod fetch;
#[cfg(target_arch = "wasm32")]
mod join;
// Pure data: its tests run natively.
#[cfg(any(target_arch = "wasm32", test))]
mod ice;
#[cfg(target_arch = "wasm32")]
mod js;
#[cfg(target_arch = "wasm32")]
mod link;
#[cfg(target_arch = "wasm32")]
mod offload;
#[cfg(target_arch = "wasm32")]
mod signal;
#[cfg(target_arch = "wasm32")]
mod stage_worker;
// The threaded package only (shared memory).
#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
mod team;
#[cfg(target_arch = "wasm32")]
mod ui;

#[cfg(target_arch = "wasm32")]
pub use api::{Engine, Model};

#[cfg(target_arch = "wasm32")]
use wasm_bindgen::prelude::*;

/// Runs the join page (reads `signal`, `room`, `token` and optionally `backend=cpu` from
/// the page's query). Resolves when the page leaves the room; failures show in `#status`.
#[cfg(target_arch = "wasm32")]
#[wasm_bindgen(js_name = joinPage)]
pub async fn join_page() -> Result<(), JsValue> {
    let result = async {
        let params = join::JoinParams::from_location()?;
        join::run(params).await
    }
    .await;
    if let Err(e) = &result {
        ui::set_status(&format!("error: {e}"));
    }
    result.map_err(|e| JsError::new(&e).into())
}
