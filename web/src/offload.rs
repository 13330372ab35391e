//! Where the join page's stage server runs: on the page itself (WebGPU: the GPU does the
//! work and the page only waits on it) or, for the CPU fallback, in a dedicated Web Worker
//! (`stage_worker`), so the page's thread stays free for the link, its heartbeat and the UI.
//!
//! Threads: where the page is cross-origin isolated and `cairn` carries the threaded package
//! (built with shared memory by a nightly toolchain, native/build.rs), the worker runs that
//! package with a team of Web Workers (`team`, `stage_worker.js`); otherwise the
//! single-thread package, on the worker's one thread.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use cairn_engine::protocol::{LayerRange, Message, Telemetry};
use cairn_engine::worker::{LoadPlan, ShardSlot, StageServer};
use futures::channel::mpsc::UnboundedSender;
use futures::channel::oneshot;
use js_sys::{Array, Object, Uint8Array};
use wasm_bindgen::prelude::*;
use web_sys::{ErrorEvent, MessageEvent};

use crate::fetch::{Header, ShardBytes};
use crate::js::js_error_text;
use crate::stage_worker::{field, set};

#[wasm_bindgen(module = "/src/stage_worker.js")]
extern "C" {
    #[wasm_bindgen(js_name = spawnStageWorker, catch)]
    fn spawn_stage_worker(threads: u32) -> Result<web_sys::Worker, JsValue>;
}

/// What the Web Worker says later, for the serving loop.
pub enum FromStage {
    /// The answer to a stage message that came on link `session` (`None`: nothing to send).
    Reply {
        session: String,
        kind: &'static str,
        reply: Result<Option<Message>, String>,
    },
    /// The stage's telemetry, to send with the page's own condition.
    Telemetry(Telemetry),
    /// The worker failed or died: the page cannot serve.
    Failed(String),
}

/// An answer from the worker.
struct Answer {
    msg: Option<Message>,
    telemetry: Option<String>,
    error: Option<String>,
}

/// Who waits for an answer.
enum Waiter {
    /// An `await` on the loop (loads: the loop waits for them anyway).
    Now(oneshot::Sender<Result<Answer, String>>),
    /// The loop hears of it as a [`FromStage`].
    Later {
        session: String,
        kind: &'static str,
    },
    Telemetry,
}

struct Shared {
    pending: RefCell<HashMap<u64, Waiter>>,
    layers: Cell<Option<(usize, usize)>>,
    /// Rows the worker's stage has run, as of its last answer.
    served: Cell<u64>,
    events: UnboundedSender<FromStage>,
}

impl Shared {
    fn on_message(&self, data: &JsValue) {
        if let Some(why) = field(data, "failed").and_then(|v| v.as_string()) {
            self.fail(format!("the CPU worker failed to start: {why}"));
            return;
        }
        let Some(id) = field(data, "id").and_then(|v| v.as_f64()) else {
            return; // `ready`, read by `CpuWorker::spawn`
        };
        let layers = field(data, "layers")
            .map(|v| Array::from(&v))
            .and_then(|a| {
                let n = |i| a.get(i).as_f64().map(|v| v as usize);
                Some((n(0)?, n(1)?))
            });
        self.layers.set(layers);
        if let Some(n) = field(data, "served").and_then(|v| v.as_f64()) {
            self.served.set(n as u64);
        }
        // For the browser tests and a look in DevTools: whether the team's workers run
        // tasks (they compute what one thread would, so only this shows they do).
        if let Some(n) = field(data, "teamJoins") {
            let _ = js_sys::Reflect::set(
                &js_sys::global(),
                &JsValue::from_str("cairnCpuTeamJoins"),
                &n,
            );
        }
        let msg = field(data, "msg")
            .and_then(|m| m.dyn_into::<Uint8Array>().ok())
            .map(|m| Message::from_bytes(m.to_vec()).map_err(|e| e.to_string()));
        let (msg, decode_error) = match msg {
            Some(Ok(m)) => (Some(m), None),
            Some(Err(e)) => (None, Some(format!("the CPU worker's reply: {e}"))),
            None => (None, None),
        };
        let answer = Answer {
            msg,
            telemetry: field(data, "telemetry").and_then(|v| v.as_string()),
            error: field(data, "error")
                .and_then(|v| v.as_string())
                .or(decode_error),
        };
        let Some(waiter) = self.pending.borrow_mut().remove(&(id as u64)) else {
            return;
        };
        match waiter {
            Waiter::Now(tx) => {
                let _ = tx.send(Ok(answer));
            }
            Waiter::Later { session, kind } => {
                let reply = match answer.error {
                    Some(e) => Err(e),
                    None => Ok(answer.msg),
                };
                let _ = self.events.unbounded_send(FromStage::Reply {
                    session,
                    kind,
                    reply,
                });
            }
            Waiter::Telemetry => {
                if let Some(t) = answer
                    .telemetry
                    .and_then(|t| serde_json::from_str::<Telemetry>(&t).ok())
                {
                    let _ = self.events.unbounded_send(FromStage::Telemetry(t));
                }
            }
        }
    }

    /// Every waiter hears `why`; the loop too.
    fn fail(&self, why: String) {
        for (_, waiter) in self.pending.borrow_mut().drain() {
            if let Waiter::Now(tx) = waiter {
                let _ = tx.send(Err(why.clone()));
            }
        }
        let _ = self.events.unbounded_send(FromStage::Failed(why));
    }
}

/// The page's handle on the CPU fallback's Web Worker.
pub struct CpuWorker {
    worker: web_sys::Worker,
    /// The threads its engine runs on (its team's size; 1 without one).
    threads: u32,
    shared: Rc<Shared>,
    next_id: Cell<u64>,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_error: Closure<dyn FnMut(ErrorEvent)>,
}

impl Drop for CpuWorker {
    fn drop(&mut self) {
        self.worker.terminate();
    }
}

impl CpuWorker {
    /// Starts the worker and waits until its engine is up. With `threads` above 1 it runs
    /// the threaded package on that many threads where the page can (see the module).
    pub async fn spawn(
        events: UnboundedSender<FromStage>,
        threads: u32,
    ) -> Result<CpuWorker, String> {
        let worker = spawn_stage_worker(threads)
            .map_err(|e| format!("cannot start the CPU worker: {}", js_error_text(&e)))?;
        let shared = Rc::new(Shared {
            pending: RefCell::new(HashMap::new()),
            layers: Cell::new(None),
            served: Cell::new(0),
            events,
        });
        let (ready_tx, ready_rx) = oneshot::channel::<Result<u32, String>>();
        let ready_tx = Rc::new(RefCell::new(Some(ready_tx)));
        let on_message = Closure::<dyn FnMut(MessageEvent)>::new({
            let shared = Rc::clone(&shared);
            let ready_tx = Rc::clone(&ready_tx);
            move |e: MessageEvent| {
                let data = e.data();
                if let Some(tx) = ready_tx.borrow_mut().take_if(|_| {
                    field(&data, "ready").is_some() || field(&data, "failed").is_some()
                }) {
                    let failed = field(&data, "failed").and_then(|v| v.as_string());
                    let threads = field(&data, "threads")
                        .and_then(|v| v.as_f64())
                        .map_or(1, |n| n as u32);
                    let _ = tx.send(failed.map_or(Ok(threads), Err));
                    return;
                }
                shared.on_message(&data);
            }
        });
        let on_error = Closure::<dyn FnMut(ErrorEvent)>::new({
            let shared = Rc::clone(&shared);
            let ready_tx = Rc::clone(&ready_tx);
            move |e: ErrorEvent| {
                let why = format!("the CPU worker failed: {}", e.message());
                if let Some(tx) = ready_tx.borrow_mut().take() {
                    let _ = tx.send(Err(why));
                } else {
                    shared.fail(why);
                }
            }
        });
        worker.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        worker.set_onerror(Some(on_error.as_ref().unchecked_ref()));
        let mut this = CpuWorker {
            worker,
            threads: 1,
            shared,
            next_id: Cell::new(0),
            _on_message: on_message,
            _on_error: on_error,
        };
        match ready_rx.await {
            Ok(Ok(threads)) => {
                this.threads = threads;
                Ok(this)
            }
            Ok(Err(why)) => Err(why),
            Err(_) => Err("the CPU worker went away before it started".into()),
        }
    }

    /// The threads the worker's engine runs on.
    pub fn threads(&self) -> u32 {
        self.threads
    }

    /// The layers the worker's stage holds, as of its last answer.
    pub fn layers(&self) -> Option<(usize, usize)> {
        self.shared.layers.get()
    }

    /// Rows the worker's stage has run, as of its last answer.
    pub fn tokens_served(&self) -> u64 {
        self.shared.served.get()
    }

    fn post(&self, request: &Object, transfer: &Array, waiter: Waiter) -> Result<(), String> {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        set(request, "id", &JsValue::from_f64(id as f64));
        self.shared.pending.borrow_mut().insert(id, waiter);
        self.worker
            .post_message_with_transfer(request, transfer)
            .map_err(|e| {
                self.shared.pending.borrow_mut().remove(&id);
                format!("cannot reach the CPU worker: {}", js_error_text(&e))
            })
    }

    async fn call(&self, request: &Object, transfer: &Array) -> Result<Answer, String> {
        let (tx, rx) = oneshot::channel();
        self.post(request, transfer, Waiter::Now(tx))?;
        let answer = rx
            .await
            .map_err(|_| "the CPU worker went away".to_owned())??;
        match answer.error {
            Some(e) => Err(e),
            None => Ok(answer),
        }
    }

    /// A request with `op` and, if any, a message's bytes (moved, not copied).
    fn request(op: &str, msg: Option<&Message>) -> Result<(Object, Array), String> {
        let request = Object::new();
        set(&request, "op", &JsValue::from_str(op));
        let transfer = Array::new();
        if let Some(m) = msg {
            let bytes = Uint8Array::from(m.to_bytes().map_err(|e| e.to_string())?.as_slice());
            transfer.push(&bytes.buffer());
            set(&request, "msg", &bytes.into());
        }
        Ok((request, transfer))
    }

    /// Hands `message` (from link `session`) to the stage; its reply comes as a
    /// [`FromStage::Reply`], after those of the messages before it.
    pub fn stage(&self, session: &str, message: &Message) -> Result<(), String> {
        let kind = message.kind();
        let (request, transfer) = Self::request("stage", Some(message))?;
        self.post(
            &request,
            &transfer,
            Waiter::Later {
                session: session.to_owned(),
                kind,
            },
        )
    }

    /// Asks for the stage's telemetry, which comes as a [`FromStage::Telemetry`].
    pub fn request_telemetry(&self) -> Result<(), String> {
        let (request, transfer) = Self::request("telemetry", None)?;
        self.post(&request, &transfer, Waiter::Telemetry)
    }

    /// Whether the worker holds what `plan` asks for already: then its `ShardLoaded`.
    pub async fn reuse(&self, plan: &LoadPlan) -> Result<Option<Message>, String> {
        let (request, transfer) = Self::request("reuse", Some(&load_shard(plan)))?;
        Ok(self.call(&request, &transfer).await?.msg)
    }

    /// Loads `plan`'s layers from the fetched bytes; the reply for the coordinator.
    pub async fn load(&self, plan: &LoadPlan, header: &Header, shard: ShardBytes) -> Message {
        let loaded = async {
            let (request, transfer) = Self::request("load", Some(&load_shard(plan)))?;
            set(
                &request,
                "header",
                &Uint8Array::from(header.bytes.as_slice()).into(),
            );
            set(
                &request,
                "fileLen",
                &JsValue::from_f64(header.file_len as f64),
            );
            let offsets = Array::new();
            let pieces = Array::new();
            for (offset, bytes) in shard.pieces {
                offsets.push(&JsValue::from_f64(offset as f64));
                let piece = Uint8Array::from(bytes.as_slice());
                transfer.push(&piece.buffer());
                pieces.push(&piece);
            }
            set(&request, "offsets", &offsets);
            set(&request, "pieces", &pieces);
            self.call(&request, &transfer)
                .await?
                .msg
                .ok_or_else(|| "the CPU worker answered the load with nothing".to_owned())
        }
        .await;
        loaded.unwrap_or_else(|e| plan.failed(e))
    }

    /// Frees the worker's shard; the requests before it are served first.
    pub fn clear(&self) {
        if let Ok((request, transfer)) = Self::request("clear", None) {
            let (tx, _) = oneshot::channel();
            let _ = self.post(&request, &transfer, Waiter::Now(tx));
        }
        self.shared.layers.set(None);
    }
}

/// The `LoadShard` a plan was read from (the worker reads the plan from it again).
fn load_shard(plan: &LoadPlan) -> Message {
    Message::LoadShard {
        model_hash: plan.model.clone(),
        layers: LayerRange {
            start: plan.start as u32,
            end: plan.end as u32,
        },
        source: plan.source.clone(),
        next: plan.route.next.clone(),
        prev: plan.route.prev.clone(),
        split: plan.split,
    }
}

/// The page's stage server, wherever it runs.
pub enum PageStage {
    /// On the page's own thread.
    Here {
        server: Box<StageServer>,
        slot: ShardSlot,
    },
    /// In the CPU fallback's Web Worker.
    Worker(CpuWorker),
}

impl PageStage {
    pub fn here(server: StageServer) -> PageStage {
        PageStage::Here {
            server: Box::new(server),
            slot: ShardSlot::default(),
        }
    }

    pub fn layers(&self) -> Option<(usize, usize)> {
        match self {
            PageStage::Here { server, .. } => server.layers(),
            PageStage::Worker(w) => w.layers(),
        }
    }

    /// Rows the stage has run since it started (the join page's "tokens served").
    pub fn tokens_served(&self) -> u64 {
        match self {
            PageStage::Here { server, .. } => server.tokens_served(),
            PageStage::Worker(w) => w.tokens_served(),
        }
    }

    /// Frees the shard.
    pub fn clear(&mut self) {
        match self {
            PageStage::Here { server, slot } => slot.clear(server),
            PageStage::Worker(w) => w.clear(),
        }
    }

    /// `ShardLoaded` when the stage holds what `plan` asks for already (only its caches
    /// go); `None`: fetch and [`PageStage::load`] it.
    pub async fn reuse(&mut self, plan: &LoadPlan) -> Result<Option<Message>, String> {
        match self {
            PageStage::Here { server, slot } => Ok(slot.reuse(server, plan)),
            PageStage::Worker(w) => w.reuse(plan).await,
        }
    }

    /// Loads `plan`'s layers from the fetched bytes: `ShardLoaded` or `Error`.
    pub async fn load(&mut self, plan: LoadPlan, header: Header, shard: ShardBytes) -> Message {
        match self {
            PageStage::Here { server, slot } => {
                let source = shard.into_source(header.file);
                slot.load(server, plan, &source).await
            }
            PageStage::Worker(w) => w.load(&plan, &header, shard).await,
        }
    }
}
