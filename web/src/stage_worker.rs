//! The CPU fallback's Web Worker: the engine's [`StageServer`] on the cpu device, off the
//! page's thread, so a long prefill blocks neither the page nor the link's heartbeat (the
//! link session answers pings on the page, in the data channel's handler).
//!
//! The page ([`crate::offload`]) posts requests; the worker serves them one at a time, in the
//! order they came, and answers each with the same `id`. Messages for the stage cross as
//! [`Message::to_bytes`]; a shard's bytes cross as transferred buffers (no copy).
//!
//! Request: `{id, op, msg?, header?, fileLen?, offsets?, pieces?}` with `op` one of
//! `stage` (`msg`: a message for the stage server), `reuse` (`msg`: a `LoadShard` the worker
//! may already hold), `load` (`msg`: the `LoadShard`; `header`: the GGUF header's bytes,
//! `fileLen`; `pieces[i]`: the bytes at file offset `offsets[i]`), `clear`, `telemetry`.
//! Answer: `{id, msg?, telemetry?, error?, layers, served, teamJoins?}`: `msg` the reply to
//! send the coordinator (if any), `telemetry` the stage's as JSON, `layers` `[start, end]` or
//! null, `teamJoins` (threaded package) the ops its team's workers have taken part in.
//! Before the first request the worker says `{ready: true, threads}` (the threads its
//! engine runs on: 1, or the team's size in the threaded package), or `{failed: why}`.

use std::sync::Arc;

use cairn_engine::EngineOptions;
use cairn_engine::gguf::{HeaderProgress, PartialGguf, parse_header};
use cairn_engine::protocol::Message;
use cairn_engine::worker::{LoadPlan, ShardSlot, StageServer};
use futures::StreamExt as _;
use futures::channel::mpsc::unbounded;
use js_sys::{Array, Object, Reflect, Uint8Array};
use wasm_bindgen::prelude::*;
use web_sys::{DedicatedWorkerGlobalScope, MessageEvent};

use crate::js::js_error_text;

/// What the page asks of the worker.
pub enum Op {
    Stage(Message),
    Reuse(LoadPlan),
    Load {
        plan: LoadPlan,
        header: Vec<u8>,
        file_len: u64,
        pieces: Vec<(u64, Vec<u8>)>,
    },
    Clear,
    Telemetry,
}

/// The field of a JS object, if it has one.
pub fn field(object: &JsValue, key: &str) -> Option<JsValue> {
    Reflect::get(object, &JsValue::from_str(key))
        .ok()
        .filter(|v| !v.is_undefined() && !v.is_null())
}

pub fn set(object: &Object, key: &str, value: &JsValue) {
    let _ = Reflect::set(object, &JsValue::from_str(key), value);
}

fn bytes_field(object: &JsValue, key: &str) -> Result<Vec<u8>, String> {
    field(object, key)
        .and_then(|v| v.dyn_into::<Uint8Array>().ok())
        .map(|a| a.to_vec())
        .ok_or_else(|| format!("the request has no `{key}` bytes"))
}

fn message_field(object: &JsValue) -> Result<Message, String> {
    Message::from_bytes(bytes_field(object, "msg")?).map_err(|e| e.to_string())
}

fn plan_field(object: &JsValue) -> Result<LoadPlan, String> {
    LoadPlan::from_message(message_field(object)?)
}

/// A request's id and what it asks (or why it cannot be read).
fn read_request(data: &JsValue) -> (f64, Result<Op, String>) {
    let id = field(data, "id").and_then(|v| v.as_f64()).unwrap_or(-1.0);
    let op = field(data, "op").and_then(|v| v.as_string());
    let op = match op.as_deref() {
        Some("stage") => message_field(data).map(Op::Stage),
        Some("reuse") => plan_field(data).map(Op::Reuse),
        Some("load") => (|| {
            let plan = plan_field(data)?;
            let header = bytes_field(data, "header")?;
            let file_len = field(data, "fileLen")
                .and_then(|v| v.as_f64())
                .ok_or("the load has no fileLen")? as u64;
            let offsets = field(data, "offsets")
                .map(|v| Array::from(&v))
                .unwrap_or_default();
            let pieces = field(data, "pieces")
                .map(|v| Array::from(&v))
                .unwrap_or_default();
            if offsets.length() != pieces.length() {
                return Err("the load's offsets and pieces differ in number".to_owned());
            }
            let pieces = offsets
                .iter()
                .zip(pieces.iter())
                .map(|(o, p)| {
                    let bytes = p
                        .dyn_into::<Uint8Array>()
                        .map_err(|_| "a piece is not bytes".to_owned())?;
                    let offset = o.as_f64().ok_or("an offset is not a number")?;
                    Ok((offset as u64, bytes.to_vec()))
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Op::Load {
                plan,
                header,
                file_len,
                pieces,
            })
        })(),
        Some("clear") => Ok(Op::Clear),
        Some("telemetry") => Ok(Op::Telemetry),
        other => Err(format!("unknown request {other:?}")),
    };
    (id, op)
}

/// The stage server and the shard it holds.
struct Stage {
    server: StageServer,
    slot: ShardSlot,
}

/// What an answer carries besides its id and the stage's layers.
#[derive(Default)]
struct Answer {
    msg: Option<Message>,
    telemetry: Option<String>,
    error: Option<String>,
}

impl Stage {
    async fn serve(&mut self, op: Op) -> Answer {
        match op {
            Op::Stage(message) => Answer {
                msg: self
                    .server
                    .handle(message)
                    .await
                    .map(|out| out.into_reply()),
                ..Answer::default()
            },
            Op::Reuse(plan) => Answer {
                msg: self.slot.reuse(&mut self.server, &plan),
                ..Answer::default()
            },
            Op::Load {
                plan,
                header,
                file_len,
                pieces,
            } => {
                let file = match parse_header(&header, file_len) {
                    Ok(HeaderProgress::Done(file)) => file,
                    Ok(HeaderProgress::NeedMore(_)) => {
                        return Answer {
                            msg: Some(plan.failed("the page sent part of the model header")),
                            ..Answer::default()
                        };
                    }
                    Err(e) => {
                        return Answer {
                            msg: Some(plan.failed(format!("the model header: {e}"))),
                            ..Answer::default()
                        };
                    }
                };
                let mut source = PartialGguf::new(file);
                for (offset, bytes) in pieces {
                    source.insert(offset, bytes);
                }
                Answer {
                    msg: Some(self.slot.load(&mut self.server, plan, &source).await),
                    ..Answer::default()
                }
            }
            Op::Clear => {
                self.slot.clear(&mut self.server);
                Answer::default()
            }
            Op::Telemetry => Answer {
                telemetry: serde_json::to_string(&self.server.telemetry()).ok(),
                ..Answer::default()
            },
        }
    }

    fn answer(&self, id: f64, answer: Answer) -> Result<Object, String> {
        let out = Object::new();
        set(&out, "id", &JsValue::from_f64(id));
        if let Some(m) = &answer.msg {
            let bytes = m.to_bytes().map_err(|e| e.to_string())?;
            set(&out, "msg", &Uint8Array::from(bytes.as_slice()).into());
        }
        if let Some(t) = &answer.telemetry {
            set(&out, "telemetry", &JsValue::from_str(t));
        }
        if let Some(e) = &answer.error {
            set(&out, "error", &JsValue::from_str(e));
        }
        let layers = match self.server.layers() {
            Some((a, b)) => {
                Array::of2(&JsValue::from_f64(a as f64), &JsValue::from_f64(b as f64)).into()
            }
            None => JsValue::NULL,
        };
        set(&out, "layers", &layers);
        set(
            &out,
            "served",
            &JsValue::from_f64(self.server.tokens_served() as f64),
        );
        #[cfg(target_feature = "atomics")]
        set(
            &out,
            "teamJoins",
            &JsValue::from_f64(cairn_engine::backend::cpu::wasm_team_joins() as f64),
        );
        Ok(out)
    }
}

fn post(scope: &DedicatedWorkerGlobalScope, out: &Object) {
    // The message's buffer moves to the page instead of being copied.
    let transfer = field(out, "msg")
        .and_then(|m| m.dyn_into::<Uint8Array>().ok())
        .map(|m| Array::of1(&m.buffer()))
        .unwrap_or_default();
    if let Err(e) = scope.post_message_with_transfer(out, &transfer) {
        web_sys::console::error_1(&format!("cairn cpu worker: {}", js_error_text(&e)).into());
    }
}

/// The Web Worker's entry point (`stage_worker.js` calls it once the package is loaded,
/// and in the threaded package once the team of `threads` is made).
#[wasm_bindgen(js_name = cpuWorkerMain)]
pub fn cpu_worker_main(threads: u32) -> Result<(), JsValue> {
    let scope: DedicatedWorkerGlobalScope = js_sys::global()
        .dyn_into()
        .map_err(|_| JsError::new("cpuWorkerMain runs in a dedicated Web Worker only"))?;
    let (tx, mut rx) = unbounded::<JsValue>();
    let on_message = Closure::<dyn FnMut(MessageEvent)>::new(move |e: MessageEvent| {
        let _ = tx.unbounded_send(e.data());
    });
    scope.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
    // The handler lives as long as the worker does.
    on_message.forget();
    let device = Arc::new(cairn_engine::device::open_cpu(&EngineOptions::default()));
    let mut stage = Stage {
        server: StageServer::new(device),
        slot: ShardSlot::default(),
    };
    let ready = Object::new();
    set(&ready, "ready", &JsValue::TRUE);
    set(
        &ready,
        "threads",
        &JsValue::from_f64(f64::from(threads.max(1))),
    );
    post(&scope, &ready);
    wasm_bindgen_futures::spawn_local(async move {
        while let Some(data) = rx.next().await {
            let (id, op) = read_request(&data);
            let answer = match op {
                Ok(op) => stage.serve(op).await,
                Err(error) => Answer {
                    error: Some(error),
                    ..Answer::default()
                },
            };
            let out = stage.answer(id, answer).unwrap_or_else(|error| {
                let out = Object::new();
                set(&out, "id", &JsValue::from_f64(id));
                set(&out, "error", &JsValue::from_str(&error));
                out
            });
            post(&scope, &out);
        }
    });
    Ok(())
}
