//! The join page's worker: environment and consent, the room, the link to the coordinator,
//! and the serving loop that hands the coordinator's messages to the engine's
//! [`StageServer`], the same one native workers run.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use cairn_engine::device::{DeviceInfo, Discovery};
use cairn_engine::protocol::{Hello, Message, Visibility};
use cairn_engine::worker::{
    Capabilities, HostAction, LoadPlan, PeerKind, PressureRule, StageServer, WorkerHost,
};
use cairn_engine::{BackendKind, Support};
use futures::StreamExt as _;
use futures::channel::mpsc::{UnboundedSender, unbounded};
use serde_json::{Map, Value, json};
use wasm_bindgen::prelude::*;
use web_sys::{Event, HtmlButtonElement};

use crate::cost;
use crate::fetch;
use crate::js;
use crate::link::{self, LinkEvent, PeerLink, SignalPayload};
use crate::offload::{CpuWorker, FromStage, PageStage};
use crate::signal::{SignalEvent, SignalSocket, ws_url};
use crate::ui;

/// Largest message we reassemble (told to the peer in `Hello`).
const MAX_MESSAGE_BYTES: u64 = 256 * 1024 * 1024;

/// What the page was opened with (`/join?signal=…&room=…&token=…[&backend=cpu]`).
pub struct JoinParams {
    pub signal: String,
    pub room: String,
    pub token: String,
    /// `cpu` forces the CPU backend even where WebGPU exists.
    pub backend: Option<String>,
    /// `pressure=ignore`: report compute pressure but never pause for it (a machine known
    /// to be busy: tests, benchmarks).
    pub ignore_pressure: bool,
    /// `cpu-threads=N`: the CPU fallback's threads (1: the single-thread package); by
    /// default [`cpu_threads`] chooses.
    pub cpu_threads: Option<u32>,
}

impl JoinParams {
    pub fn from_location() -> Result<JoinParams, String> {
        let search = web_sys::window()
            .ok_or("no window")?
            .location()
            .search()
            .map_err(|e| js::js_error_text(&e))?;
        let q =
            web_sys::UrlSearchParams::new_with_str(&search).map_err(|e| js::js_error_text(&e))?;
        let need = |k: &str| {
            q.get(k)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("the join link has no `{k}` parameter"))
        };
        Ok(JoinParams {
            signal: need("signal")?,
            room: need("room")?,
            token: need("token")?,
            backend: q.get("backend").filter(|b| !b.is_empty()),
            ignore_pressure: q.get("pressure").as_deref() == Some("ignore"),
            cpu_threads: match q.get("cpu-threads").filter(|v| !v.is_empty()) {
                Some(v) => Some(
                    v.parse::<u32>()
                        .ok()
                        .filter(|n| (1..=MAX_CPU_THREADS).contains(n))
                        .ok_or_else(|| {
                            format!("cpu-threads={v}: say a number from 1 to {MAX_CPU_THREADS}")
                        })?,
                ),
                None => None,
            },
        })
    }
}

/// The most threads the CPU fallback runs on (a phone or laptop lending its CPU keeps some).
const MAX_CPU_THREADS: u32 = 8;

/// The CPU fallback's threads: `asked`, else the cores the browser reports (at most
/// [`MAX_CPU_THREADS`]). More than one only where the page is cross-origin isolated (shared
/// memory exists: the coordinator's headers, `native/src/web_assets.rs`); the worker falls
/// back to one where it cannot run them (`stage_worker.js`).
fn cpu_threads(asked: Option<u32>, env: &Value) -> u32 {
    let isolated =
        js_sys::Reflect::get(&js_sys::global(), &JsValue::from_str("crossOriginIsolated"))
            .ok()
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
    if !isolated {
        return 1;
    }
    asked.unwrap_or_else(|| {
        env["hardwareConcurrency"]
            .as_u64()
            .map_or(1, |n| n.clamp(1, u64::from(MAX_CPU_THREADS)) as u32)
    })
}

/// The device the page will serve with, chosen before consent (no weights yet).
struct Chosen {
    discovery: Discovery,
    info: DeviceInfo,
    /// Why not WebGPU, when the CPU was chosen.
    fallback_reason: Option<String>,
}

fn choose_device(discovery: Discovery, env: &Value, backend: Option<&str>) -> Chosen {
    let webgpu = discovery
        .devices
        .iter()
        .find(|d| d.backend == BackendKind::Wgpu && d.support != Support::Unsupported)
        .cloned();
    let cpu = discovery
        .devices
        .iter()
        .find(|d| d.backend == BackendKind::Cpu)
        .cloned()
        .expect("discovery always lists the CPU");
    let reason = if backend.is_some_and(|b| b.eq_ignore_ascii_case("cpu")) {
        Some("the CPU backend was asked for".to_owned())
    } else if webgpu.is_none() {
        Some(
            env["webgpu"]["reason"]
                .as_str()
                .unwrap_or("no usable WebGPU adapter")
                .to_owned(),
        )
    } else {
        None
    };
    match (reason, webgpu) {
        (None, Some(info)) => Chosen {
            discovery,
            info,
            fallback_reason: None,
        },
        (reason, _) => Chosen {
            discovery,
            info: cpu,
            fallback_reason: reason,
        },
    }
}

fn describe(info: &DeviceInfo, env: &Value, fallback_reason: Option<&str>) -> String {
    match fallback_reason {
        Some(reason) => format!(
            "CPU fallback: the engine's CPU backend ({reason}){}",
            env["hardwareConcurrency"]
                .as_u64()
                .map(|n| format!("; {n} logical cores"))
                .unwrap_or_default()
        ),
        None => {
            let gpu = &env["webgpu"];
            let text = |k: &str| gpu[k].as_str().unwrap_or("").trim().to_owned();
            let mut parts = vec![format!("WebGPU: {}", adapter_name(info, env))];
            let detail = [text("device"), text("description")]
                .into_iter()
                .filter(|s| !s.is_empty() && !info.name.contains(s.as_str()))
                .collect::<Vec<_>>()
                .join(" ");
            if !detail.is_empty() {
                parts.push(detail);
            }
            if gpu["isFallbackAdapter"].as_bool() == Some(true) || info.is_software() {
                parts.push("software adapter".into());
            }
            parts.join(" · ")
        }
    }
}

/// A name for the adapter: the engine's, else what WebGPU's adapter info says.
fn adapter_name(info: &DeviceInfo, env: &Value) -> String {
    if !info.name.trim().is_empty() {
        return info.name.clone();
    }
    let gpu = &env["webgpu"];
    let text = |k: &str| gpu[k].as_str().unwrap_or("").trim().to_owned();
    let who = [text("vendor"), text("architecture")]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    if who.is_empty() {
        "an unnamed adapter".into()
    } else {
        who
    }
}

fn env_rows(env: &Value, info: &DeviceInfo) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    let gpu = &env["webgpu"];
    if gpu["available"].as_bool() == Some(true) {
        let text = |k: &str| gpu[k].as_str().unwrap_or("").to_owned();
        rows.push((
            "WebGPU adapter".into(),
            [
                text("vendor"),
                text("architecture"),
                text("device"),
                text("description"),
            ]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(" · "),
        ));
        let limit = |k: &str| gpu["limits"][k].as_u64().unwrap_or(0);
        rows.push((
            "WebGPU limits".into(),
            format!(
                "max buffer {}, storage binding {}, {} invocations per workgroup",
                ui::human_bytes(limit("maxBufferSize")),
                ui::human_bytes(limit("maxStorageBufferBindingSize")),
                limit("maxComputeInvocationsPerWorkgroup")
            ),
        ));
        let features: Vec<&str> = gpu["features"]
            .as_array()
            .map(|a| a.iter().filter_map(|f| f.as_str()).collect())
            .unwrap_or_default();
        rows.push((
            "WebGPU features".into(),
            if features.is_empty() {
                "none".into()
            } else {
                features.join(", ")
            },
        ));
    } else {
        rows.push((
            "WebGPU".into(),
            format!(
                "not available: {}",
                gpu["reason"].as_str().unwrap_or("unknown reason")
            ),
        ));
    }
    rows.push((
        "Memory".into(),
        env["deviceMemoryGiB"]
            .as_f64()
            .map(|g| format!("about {g} GiB (navigator.deviceMemory)"))
            .unwrap_or_else(|| "not reported by this browser".into()),
    ));
    rows.push((
        "CPU cores".into(),
        env["hardwareConcurrency"]
            .as_u64()
            .map(|n| n.to_string())
            .unwrap_or_else(|| "not reported".into()),
    ));
    rows.push(("Battery".into(), battery_text(&env["battery"])));
    rows.push((
        "Visibility".into(),
        env["visibility"].as_str().unwrap_or("unknown").to_owned(),
    ));
    rows.push((
        "Compute pressure".into(),
        if env["pressureSupported"].as_bool() == Some(true) {
            "observed (the tab pauses at serious or critical)".into()
        } else {
            "not available in this browser".into()
        },
    ));
    rows.push((
        "Engine backend".into(),
        match info.backend {
            BackendKind::Cpu => "the CPU backend".to_owned(),
            _ => format!(
                "wgpu on {} (support: {:?})",
                adapter_name(info, env),
                info.support
            ),
        },
    ));
    rows
}

fn battery_text(b: &Value) -> String {
    match (b["level"].as_f64(), b["charging"].as_bool()) {
        (Some(level), charging) => format!(
            "{:.0}%{}",
            level * 100.0,
            match charging {
                Some(true) => ", charging",
                Some(false) => ", on battery",
                None => "",
            }
        ),
        _ => "not reported (no Battery API)".into(),
    }
}

/// Resolves when the consent button is clicked.
async fn wait_for_consent() -> Result<(), String> {
    let doc = web_sys::window()
        .and_then(|w| w.document())
        .ok_or("no document")?;
    let button = doc
        .get_element_by_id("consent")
        .ok_or("the page has no #consent button")?
        .dyn_into::<HtmlButtonElement>()
        .map_err(|_| "#consent is not a button")?;
    let (tx, mut rx) = unbounded::<()>();
    let on_click = Closure::<dyn FnMut()>::new(move || {
        let _ = tx.unbounded_send(());
    });
    button.set_onclick(Some(on_click.as_ref().unchecked_ref()));
    button.set_disabled(false);
    rx.next().await;
    button.set_onclick(None);
    button.set_disabled(true);
    Ok(())
}

/// Everything the serving loop reacts to.
enum Input {
    Signal(SignalEvent),
    Link(LinkEvent),
    Tick,
    Visibility {
        hidden: bool,
    },
    Pressure(String),
    PageHide,
    /// The CPU fallback's Web Worker answered.
    Stage(FromStage),
}

/// Runs the join page: probe, consent, join, serve. Errors end up in `#status`.
pub async fn run(params: JoinParams) -> Result<(), String> {
    ui::set_status("checking this device…");
    let env = js::probe_environment().await;
    let discovery = cairn_engine::discover().await;
    let chosen = choose_device(discovery, &env, params.backend.as_deref());
    ui::set_text(
        "device",
        &describe(&chosen.info, &env, chosen.fallback_reason.as_deref()),
    );
    ui::set_rows("env", &env_rows(&env, &chosen.info));
    show_cost(chosen.info.memory_bytes, &env).await;
    ui::set_status("ready: press the button to join (nothing is downloaded before)");
    wait_for_consent().await?;
    ui::set_hidden("consent-box", true);

    ui::set_status("opening the device…");
    let mut fallback_reason = chosen.fallback_reason.clone();
    let device = match chosen.discovery.open_info(chosen.info.clone()).await {
        Ok(d) => d,
        Err(e) => {
            let reason = format!("WebGPU device failed to open: {e}");
            ui::log(&reason);
            let cpu = chosen
                .discovery
                .devices
                .iter()
                .find(|d| d.backend == BackendKind::Cpu)
                .cloned()
                .ok_or("no CPU device")?;
            fallback_reason = Some(reason);
            chosen
                .discovery
                .open_info(cpu)
                .await
                .map_err(|e| e.to_string())?
        }
    };
    let device = Arc::new(device);
    ui::set_text(
        "device",
        &describe(device.info(), &env, fallback_reason.as_deref()),
    );
    let mut caps = Capabilities::worker(PeerKind::Browser, device.info(), 0.5);
    if caps.device.name.trim().is_empty() {
        caps.device.name = adapter_name(device.info(), &env);
    }
    caps.memory_budget_bytes = cost::memory_budget(device.info().memory_bytes, &env);
    let mut extra = env.clone();
    if let Some(reason) = &fallback_reason {
        extra["cpu_fallback"] = Value::String(reason.clone());
    }
    caps.extra = extra;

    let (misc_tx, misc_rx) = unbounded::<Input>();
    let (signal_tx, signal_rx) = unbounded::<SignalEvent>();
    let (link_tx, link_rx) = unbounded::<LinkEvent>();
    let (stage_tx, stage_rx) = unbounded::<FromStage>();
    let stage = if device.kind() == BackendKind::Cpu {
        // The CPU does the work on whatever thread calls it: not the page's, which keeps
        // the link's heartbeat and the UI.
        ui::set_status("starting the CPU worker…");
        match CpuWorker::spawn(stage_tx, cpu_threads(params.cpu_threads, &env)).await {
            Ok(w) => {
                ui::log(&format!(
                    "the CPU worker runs on {} thread{}",
                    w.threads(),
                    if w.threads() == 1 { "" } else { "s" }
                ));
                PageStage::Worker(w)
            }
            Err(e) => {
                ui::log(&format!("{e}; serving on the page's thread instead"));
                PageStage::here(StageServer::new(Arc::clone(&device)))
            }
        }
    } else {
        PageStage::here(StageServer::new(Arc::clone(&device)))
    };
    let url = ws_url(&params.signal, &params.room, &params.token)?;
    ui::set_status("joining the room…");
    let signal = Rc::new(SignalSocket::open(&url, signal_tx)?);
    let current: Rc<RefCell<Option<Rc<PeerLink>>>> = Rc::new(RefCell::new(None));
    let _watchers = install_watchers(&misc_tx, &signal, &current);
    let mut inputs = futures::stream::select(
        futures::stream::select(signal_rx.map(Input::Signal), link_rx.map(Input::Link)),
        futures::stream::select(misc_rx, stage_rx.map(Input::Stage)),
    );

    let mut host = WorkerHost::new(if params.ignore_pressure {
        PressureRule::Ignore
    } else {
        PressureRule::Pause
    })
    .with_backend(device.kind().name());
    host.set_battery(serde_json::from_value(env["battery"].clone()).ok());
    let _ = host.set_pressure("nominal");
    // Now, not as the probe before consent saw it (the tab may have come to the
    // front since). Not linked yet: a pause now is told the coordinator once linked.
    let hidden = web_sys::window()
        .and_then(|w| w.document())
        .is_some_and(|d| d.visibility_state() == web_sys::VisibilityState::Hidden);
    let _ = host.set_visibility(if hidden {
        Visibility::Hidden
    } else {
        Visibility::Visible
    });
    let mut w = Worker {
        stage,
        caps,
        signal,
        link_events: link_tx,
        current,
        my_id: None,
        peers: HashMap::new(),
        meta: Map::new(),
        link_up: false,
        joined_once: false,
        host,
        telemetry_asked: false,
        ticks: 0,
        last_tick_ms: 0.0,
        shown_tokens: 0,
    };
    w.meta.insert("role".into(), json!("worker"));
    w.meta.insert("kind".into(), json!("browser"));
    while let Some(input) = inputs.next().await {
        if !w.on_input(input).await {
            break;
        }
    }
    Ok(())
}

/// Fills the consent box's cost lines: the coordinator's estimate for a device offering
/// what this one would, and the battery. Without an estimate (a page not served by a
/// coordinator) the page's general wording stays.
async fn show_cost(device_bytes: u64, env: &Value) {
    let budget = cost::memory_budget(device_bytes, env);
    let estimate = js::fetch_json(&format!("/join/cost?memory={budget}")).await;
    match cost::share_lines(&estimate, budget) {
        Some((download, memory)) => {
            ui::set_text("cost-download", &download);
            ui::set_text("cost-memory", &memory);
        }
        None => ui::log("the server gave no cost estimate for this device"),
    }
    let battery = serde_json::from_value(env["battery"].clone()).ok();
    ui::set_text("cost-power", &cost::power_line(battery.as_ref()));
}

/// Page-level event sources: the telemetry tick, visibility, pressure, pagehide.
struct Watchers {
    _tick: Closure<dyn FnMut()>,
    _visibility: Closure<dyn FnMut(Event)>,
    _pagehide: Closure<dyn FnMut(Event)>,
}

fn install_watchers(
    tx: &UnboundedSender<Input>,
    signal: &Rc<SignalSocket>,
    current: &Rc<RefCell<Option<Rc<PeerLink>>>>,
) -> Option<Watchers> {
    let window = web_sys::window()?;
    let document = window.document()?;
    let tick = Closure::<dyn FnMut()>::new({
        let tx = tx.clone();
        move || {
            let _ = tx.unbounded_send(Input::Tick);
        }
    });
    let _ = window.set_interval_with_callback_and_timeout_and_arguments_0(
        tick.as_ref().unchecked_ref(),
        1000,
    );
    let visibility = Closure::<dyn FnMut(Event)>::new({
        let tx = tx.clone();
        let document = document.clone();
        move |_| {
            let hidden = document.visibility_state() == web_sys::VisibilityState::Hidden;
            let _ = tx.unbounded_send(Input::Visibility { hidden });
        }
    });
    let _ = document
        .add_event_listener_with_callback("visibilitychange", visibility.as_ref().unchecked_ref());
    // pagehide is the last reliable moment: say goodbye synchronously, then let the loop
    // free the GPU memory.
    let pagehide = Closure::<dyn FnMut(Event)>::new({
        let tx = tx.clone();
        let signal = Rc::clone(signal);
        let current = Rc::clone(current);
        move |_| {
            if let Some(link) = current.borrow_mut().take() {
                link.close("the page was closed");
            }
            signal.close();
            let _ = tx.unbounded_send(Input::PageHide);
        }
    });
    let _ = window.add_event_listener_with_callback("pagehide", pagehide.as_ref().unchecked_ref());
    let pressure_tx = tx.clone();
    wasm_bindgen_futures::spawn_local(async move {
        js::watch_pressure(move |state| {
            let _ = pressure_tx.unbounded_send(Input::Pressure(state));
        })
        .await;
    });
    Some(Watchers {
        _tick: tick,
        _visibility: visibility,
        _pagehide: pagehide,
    })
}

struct Worker {
    stage: PageStage,
    caps: Capabilities,
    signal: Rc<SignalSocket>,
    link_events: UnboundedSender<LinkEvent>,
    /// The link to the coordinator (shared with the pagehide handler).
    current: Rc<RefCell<Option<Rc<PeerLink>>>>,
    my_id: Option<String>,
    /// Meta of the peers in the room, by id.
    peers: HashMap<String, Map<String, Value>>,
    /// What we advertise.
    meta: Map<String, Value>,
    /// Both `Hello`s exchanged.
    link_up: bool,
    joined_once: bool,
    /// Load, close, telemetry and pause rules (the engine's, as native workers have).
    host: WorkerHost,
    /// A telemetry request is with the CPU worker (one at a time: a long step holds it).
    telemetry_asked: bool,
    ticks: u64,
    last_tick_ms: f64,
    /// The tokens-served count `#status` shows.
    shown_tokens: u64,
}

impl Worker {
    fn link(&self) -> Option<Rc<PeerLink>> {
        self.current.borrow().clone()
    }

    fn status(&self) -> String {
        let mut s = if self.link_up {
            "joined: linked to the coordinator".to_owned()
        } else if self.joined_once {
            "link lost: waiting for the coordinator to connect again".to_owned()
        } else if self.my_id.is_some() {
            "in the room: waiting for the coordinator".to_owned()
        } else {
            "joining the room…".to_owned()
        };
        if let Some((a, b)) = self.stage.layers() {
            s.push_str(&format!(
                "; serving layers {a}-{}; {} tokens served",
                b - 1,
                self.stage.tokens_served()
            ));
        }
        if let Some(reason) = self.host.paused() {
            s.push_str(&format!("; paused ({reason})"));
        }
        if let Some(low) = cost::battery_low(self.host.condition().battery.as_ref()) {
            s.push_str(&format!("; {low}"));
        }
        s
    }

    fn show_status(&mut self) {
        self.shown_tokens = self.stage.tokens_served();
        ui::set_status(&self.status());
    }

    /// Handles one input; false when the page is going away.
    async fn on_input(&mut self, input: Input) -> bool {
        match input {
            Input::Signal(e) => self.on_signal(e).await,
            Input::Link(e) => self.on_link(e).await,
            Input::Tick => self.on_tick().await,
            Input::Visibility { hidden } => {
                let change = self.host.set_visibility(if hidden {
                    Visibility::Hidden
                } else {
                    Visibility::Visible
                });
                self.pause_or_resume(change);
            }
            Input::Pressure(state) => {
                let change = self.host.set_pressure(state);
                self.pause_or_resume(change);
            }
            Input::PageHide => {
                // Free GPU memory now: the page may live on in the back-forward cache.
                self.stage.clear();
                self.link_up = false;
                ui::set_status("left the room");
                return false;
            }
            Input::Stage(event) => self.on_stage(event).await,
        }
        true
    }

    /// What the CPU worker said: a reply to pass on, its telemetry, or its end.
    async fn on_stage(&mut self, event: FromStage) {
        match event {
            FromStage::Reply {
                session,
                kind,
                reply,
            } => {
                let reply = match reply {
                    Ok(Some(reply)) => reply,
                    Ok(None) => return,
                    Err(e) => {
                        ui::log(&format!("the CPU worker could not serve {kind}: {e}"));
                        return;
                    }
                };
                if let Some(link) = self.link_for(&session).filter(|_| self.link_up)
                    && let Err(e) = link.send(&reply).await
                {
                    ui::log(&format!("cannot reply to {kind}: {e}"));
                }
            }
            FromStage::Telemetry(t) => {
                self.telemetry_asked = false;
                self.send_telemetry(t);
            }
            FromStage::Failed(why) => {
                ui::log(&why);
                ui::set_status(&format!("error: {why}"));
            }
        }
    }

    async fn on_signal(&mut self, event: SignalEvent) {
        match event {
            SignalEvent::Open => {}
            SignalEvent::Closed { code, reason } => {
                ui::log(&format!("signaling closed: {code} {reason}"));
                if self.my_id.is_none() {
                    ui::set_status(&format!(
                        "could not join the room (signaling closed: {code} {reason})"
                    ));
                }
            }
            SignalEvent::Message(m) => self.on_server_message(m).await,
        }
    }

    fn remember_peer(&mut self, peer: &Value) {
        if let Some(id) = peer["peer_id"].as_str() {
            let meta = peer["meta"].as_object().cloned().unwrap_or_default();
            self.peers.insert(id.to_owned(), meta);
        }
    }

    async fn on_server_message(&mut self, m: Value) {
        match m["type"].as_str().unwrap_or("") {
            "welcome" => {
                self.my_id = m["peer_id"].as_str().map(str::to_owned);
                for p in m["peers"].as_array().cloned().unwrap_or_default() {
                    self.remember_peer(&p);
                }
                self.signal.set_meta(&self.meta);
                ui::log(&format!(
                    "in room as {} with {} other peers",
                    self.my_id.as_deref().unwrap_or("?"),
                    self.peers.len()
                ));
                self.show_status();
            }
            "peer-joined" | "peer-meta" => self.remember_peer(&m["peer"]),
            "peer-left" => {
                let Some(id) = m["peer_id"].as_str() else {
                    return;
                };
                self.peers.remove(id);
                // A link still being set up cannot finish without signaling.
                if !self.link_up
                    && let Some(link) = self.link().filter(|l| l.peer == id)
                {
                    link.close("the peer left");
                    *self.current.borrow_mut() = None;
                }
            }
            "signal" => {
                let from = m["from"].as_str().unwrap_or("").to_owned();
                match serde_json::from_value::<SignalPayload>(m["data"].clone()) {
                    Ok(p) => self.on_payload(from, p).await,
                    Err(_) => ui::log(&format!("ignoring a signal from {from}")),
                }
            }
            "error" => ui::log(&format!(
                "signaling refused a message: {}",
                m["message"].as_str().unwrap_or("")
            )),
            _ => {}
        }
    }

    async fn on_payload(&mut self, from: String, payload: SignalPayload) {
        match payload {
            SignalPayload::Offer { session, sdp } => self.on_offer(from, session, sdp).await,
            SignalPayload::Candidate { session, candidate } => {
                if let Some(link) = self
                    .link()
                    .filter(|l| l.peer == from && l.session == session)
                {
                    link.add_remote_candidate(&candidate).await;
                }
            }
            SignalPayload::Bye { session, reason } => {
                if let Some(link) = self
                    .link()
                    .filter(|l| l.peer == from && l.session == session)
                {
                    ui::log(&format!("the coordinator ended the link: {reason}"));
                    link.close("bye");
                    *self.current.borrow_mut() = None;
                    self.link_up = false;
                    self.show_status();
                }
            }
            SignalPayload::Answer { .. } => {} // we never offer
        }
    }

    async fn on_offer(&mut self, from: String, session: String, sdp: String) {
        if self
            .link()
            .is_some_and(|l| l.peer == from && l.session == session)
        {
            return; // a duplicate
        }
        let role = self
            .peers
            .get(&from)
            .and_then(|m| m.get("role"))
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_owned();
        let bye = |reason: String| {
            ui::log(&format!("refusing the offer of {from}: {reason}"));
            let data = serde_json::to_value(SignalPayload::Bye {
                session: session.clone(),
                reason,
            })
            .unwrap_or(Value::Null);
            self.signal.signal(&from, data);
        };
        let announced = self
            .peers
            .get(&from)
            .and_then(|m| m.get(link::FINGERPRINT_META_KEY))
            .and_then(Value::as_str)
            .map(link::normalize_fingerprint);
        match (announced, link::sdp_fingerprint(&sdp)) {
            (Some(a), Some(s)) if a == s => {}
            (a, s) => {
                bye(format!(
                    "DTLS fingerprint in the offer ({}) does not match the one announced ({})",
                    s.as_deref().unwrap_or("none"),
                    a.as_deref().unwrap_or("none")
                ));
                return;
            }
        }
        let ice = match crate::ice::IceConfig::from_meta(
            self.peers
                .get(&from)
                .and_then(|m| m.get(crate::ice::ICE_META_KEY)),
        ) {
            Ok(ice) => ice,
            Err(e) => {
                bye(e);
                return;
            }
        };
        if let Some(old) = self.current.borrow_mut().take() {
            old.close("replaced by a new offer");
        }
        self.link_up = false;
        ui::log(&format!(
            "offer from {from} ({role}), session {session}{}",
            match &ice {
                Some(i) if i.relay_only => " (relayed through its TURN servers)",
                Some(_) => " (with its STUN/TURN servers)",
                None => "",
            }
        ));
        let hello = Hello::new(
            self.my_id.clone().unwrap_or_default(),
            MAX_MESSAGE_BYTES,
            self.caps.to_json(),
        );
        let (link, answer) = match PeerLink::accept_offer(
            &from,
            &session,
            &sdp,
            ice.as_ref(),
            hello,
            self.link_events.clone(),
        )
        .await
        {
            Ok(r) => r,
            Err(e) => {
                bye(e);
                return;
            }
        };
        // The offerer checks our answer's fingerprint against our meta: announce it first
        // (the server relays our messages in order).
        if let Some(fp) = link::sdp_fingerprint(&answer)
            && self
                .meta
                .get(link::FINGERPRINT_META_KEY)
                .and_then(Value::as_str)
                != Some(&fp)
        {
            self.meta
                .insert(link::FINGERPRINT_META_KEY.into(), Value::String(fp));
            self.signal.set_meta(&self.meta);
        }
        let data = serde_json::to_value(SignalPayload::Answer {
            session: session.clone(),
            sdp: answer,
        })
        .unwrap_or(Value::Null);
        self.signal.signal(&from, data);
        *self.current.borrow_mut() = Some(Rc::new(link));
        ui::set_status("connecting to the coordinator…");
    }

    /// The current link, if `session` is its.
    fn link_for(&self, session: &str) -> Option<Rc<PeerLink>> {
        self.link().filter(|l| l.session == session)
    }

    async fn on_link(&mut self, event: LinkEvent) {
        match event {
            LinkEvent::LocalCandidate { session, candidate } => {
                if let Some(link) = self.link_for(&session) {
                    let data =
                        serde_json::to_value(SignalPayload::Candidate { session, candidate })
                            .unwrap_or(Value::Null);
                    self.signal.signal(&link.peer, data);
                }
            }
            LinkEvent::Up { session } => {
                if let Some(link) = self.link_for(&session) {
                    self.on_link_up(&link);
                }
            }
            LinkEvent::Down { session, reason } => {
                if let Some(link) = self.link_for(&session) {
                    ui::log(&format!("link down: {reason}"));
                    link.close(&reason);
                    *self.current.borrow_mut() = None;
                    self.link_up = false;
                    self.show_status();
                }
            }
            LinkEvent::Message { session, message } => {
                if let Some(link) = self.link_for(&session) {
                    self.on_message(&link, message).await;
                }
            }
        }
    }

    /// Both `Hello`s exchanged (the link's session checked the versions).
    fn on_link_up(&mut self, link: &Rc<PeerLink>) {
        self.link_up = true;
        self.joined_once = true;
        ui::log(&format!("linked to {}", link.peer));
        self.show_status();
        if let Some(pause) = self.host.on_link_up() {
            let _ = link.send_now(&pause);
        }
    }

    async fn on_message(&mut self, link: &Rc<PeerLink>, message: Message) {
        if !self.link_up {
            return; // the session delivers nothing before both Hellos
        }
        match self.host.on_message(message) {
            // A browser keeps only its coordinator link: a chain's output it
            // cannot pass on goes to the coordinator (`Outgoing::into_reply`).
            HostAction::Load(plan) => {
                let reply = self.load(plan).await;
                if let Err(e) = link.send(&reply).await {
                    ui::log(&format!("cannot reply to load-shard: {e}"));
                }
                self.show_status();
            }
            HostAction::Reply(reply) => {
                if let Err(e) = link.send(&reply).await {
                    ui::log(&format!("cannot reply: {e}"));
                }
            }
            HostAction::Close { reason } => {
                ui::log(&format!("the coordinator closed the link: {reason}"));
                link.close("closed by the peer");
                *self.current.borrow_mut() = None;
                self.link_up = false;
                self.show_status();
            }
            HostAction::PeerError { code, text } => {
                ui::log(&format!("the coordinator reported error {code}: {text}"))
            }
            HostAction::Ignore => {}
            HostAction::Stage(other) => {
                let kind = other.kind();
                match &mut self.stage {
                    PageStage::Here { server, .. } => {
                        if let Some(out) = server.handle(other).await
                            && let Err(e) = link.send(&out.into_reply()).await
                        {
                            ui::log(&format!("cannot reply to {kind}: {e}"));
                        }
                    }
                    // The reply comes back as an `Input::Stage`.
                    PageStage::Worker(w) => {
                        if let Err(e) = w.stage(&link.session, &other) {
                            ui::log(&format!("cannot hand {kind} to the CPU worker: {e}"));
                        }
                    }
                }
            }
        }
    }

    /// Fetches and loads a shard (unless it is loaded already); the reply is
    /// `ShardLoaded` or `Error`.
    async fn load(&mut self, plan: LoadPlan) -> Message {
        let (start, end) = (plan.start, plan.end);
        match self.stage.reuse(&plan).await {
            Ok(Some(loaded)) => {
                ui::log(&format!(
                    "layers {start}-{} are loaded already",
                    end.saturating_sub(1)
                ));
                return loaded;
            }
            Ok(None) => {}
            Err(e) => return plan.failed(e),
        }
        ui::set_status(&format!(
            "loading layers {start}-{}…",
            end.saturating_sub(1)
        ));
        // The old shard's memory goes before the new one arrives.
        self.stage.clear();
        let fetched = async {
            let expected = (!plan.model.is_empty()).then_some(plan.model.as_str());
            let header = fetch::fetch_header(&plan.source, expected).await?;
            let (shard, stats) = fetch::fetch_shard(&plan.source, &header, start, end).await?;
            ui::log(&format!(
                "layers {start}-{}: {} ({} from cache)",
                end.saturating_sub(1),
                ui::human_bytes(stats.bytes),
                ui::human_bytes(stats.from_cache)
            ));
            Ok::<_, String>((header, shard))
        }
        .await;
        let reply = match fetched {
            Ok((header, shard)) => {
                ui::set_progress(1, 1, "uploading weights to the device");
                self.stage.load(plan, header, shard).await
            }
            Err(text) => plan.failed(text),
        };
        match &reply {
            Message::Error { text, .. } => ui::log(&format!("load failed: {text}")),
            _ => ui::set_progress(1, 1, "weights loaded"),
        }
        reply
    }

    async fn on_tick(&mut self) {
        // Ticks queue up while a long step runs; send one telemetry for them, not a burst.
        let now = js_sys::Date::now();
        if now - self.last_tick_ms < 900.0 {
            return;
        }
        self.last_tick_ms = now;
        self.ticks += 1;
        if self.ticks % 10 == 1 {
            self.host
                .set_battery(serde_json::from_value(js::read_battery().await).ok());
        }
        if !self.link_up {
            return;
        }
        // The counter grows as it serves; a battery reading may change the status too.
        if self.stage.tokens_served() != self.shown_tokens || self.ticks % 10 == 1 {
            self.show_status();
        }
        match &mut self.stage {
            PageStage::Here { server, .. } => {
                let t = server.telemetry();
                self.send_telemetry(t);
            }
            // It comes back as an `Input::Stage`, once the worker is between steps.
            PageStage::Worker(w) if !self.telemetry_asked => {
                self.telemetry_asked = w.request_telemetry().is_ok();
            }
            PageStage::Worker(_) => {}
        }
    }

    /// Sends the stage's telemetry with the page's condition, if linked.
    fn send_telemetry(&mut self, stage: cairn_engine::protocol::Telemetry) {
        let Some(link) = self.link().filter(|_| self.link_up) else {
            return;
        };
        let t = self.host.telemetry(stage);
        let _ = link.send_now(&Message::Telemetry(Box::new(t)));
    }

    /// Tells the coordinator a change of pause (`Pause` when the tab is hidden or
    /// pressure is serious, `Resume` once neither holds), if linked.
    fn pause_or_resume(&mut self, change: Option<Message>) {
        let Some(message) = change else {
            return;
        };
        match &message {
            Message::Pause { reason } => ui::log(&format!("pausing: {reason}")),
            _ => ui::log("resuming"),
        }
        if let Some(link) = self.link().filter(|_| self.link_up) {
            let _ = link.send_now(&message);
        }
        self.show_status();
    }
}
