//! The CPU fallback's thread team, in the threaded package only (built with shared memory:
//! native/build.rs). The stage's Web Worker makes the team ([`cpu_team_start`]) and starts
//! `threads - 1` more Web Workers (`stage_worker.js`), each instantiating this same module
//! over the same memory and serving as one of the team's workers ([`cpu_team_worker`]) for
//! its whole life. The engine's ops then split their tasks over them as the native team's
//! threads do (engine/src/backend/cpu/team.rs).

use js_sys::Object;
use wasm_bindgen::prelude::*;

use crate::stage_worker::set;

/// Makes the team of `threads` (this thread and `threads - 1` workers to come). Returns what
/// each worker instantiates the package with, `{module, memory, failedAt}`, or `null` where
/// no team was made (`threads` below 2, or a team exists already). `failedAt` is the byte
/// address of a 32-bit flag in the memory that a worker whose call into the module failed
/// sets to 1 (`Atomics.store`): a task that panics traps on wasm32, and the op's caller would
/// otherwise wait for it forever.
#[wasm_bindgen(js_name = cpuTeamStart)]
pub fn cpu_team_start(threads: u32) -> JsValue {
    if !cairn_engine::backend::cpu::start_wasm_team(threads as usize) {
        return JsValue::NULL;
    }
    let shared = Object::new();
    set(&shared, "module", &wasm_bindgen::module());
    set(&shared, "memory", &wasm_bindgen::memory());
    set(
        &shared,
        "failedAt",
        &JsValue::from_f64(cairn_engine::backend::cpu::wasm_team_failed_flag() as f64),
    );
    shared.into()
}

/// Serves as one of the team's workers until the team ends (the worker's whole life);
/// `false` at once where this instance's memory holds no team. It waits between ops with
/// `Atomics.wait`, so it runs in a Web Worker (or a Node worker thread) only.
#[wasm_bindgen(js_name = cpuTeamWorker)]
pub fn cpu_team_worker() -> bool {
    cairn_engine::backend::cpu::serve_wasm_team()
}

/// How long the team's waiting threads spin before they sleep between checks, in
/// microseconds (0: after 1,024 checks, session 17's waits; the default 100;
/// engine/src/backend/cpu/team.rs says why): for comparing budgets in one package
/// (scripts/bench-wasm.sh's `WASM_SPINS`).
#[wasm_bindgen(js_name = cpuTeamSpin)]
pub fn cpu_team_spin(us: u32) {
    cairn_engine::backend::cpu::set_wasm_team_spin(us);
}

/// What a hand-off to the team costs (engine's `wasm_team_probe`): `ops` ops of `tasks` small
/// tasks, each followed by `gapUs` of serial work; resolves to `[us per op, share of ops a
/// worker joined]`, or `null` without a team. For scripts/bench-wasm.sh.
#[wasm_bindgen(js_name = cpuTeamProbe)]
pub fn cpu_team_probe(ops: u32, tasks: u32, gap_us: f64) -> JsValue {
    match cairn_engine::backend::cpu::wasm_team_probe(ops, tasks as usize, gap_us) {
        Some((us, joined)) => {
            js_sys::Array::of2(&JsValue::from_f64(us), &JsValue::from_f64(joined)).into()
        }
        None => JsValue::NULL,
    }
}
