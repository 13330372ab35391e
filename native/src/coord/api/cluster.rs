//! `/api/cluster`, `/api/events`, `/api/placement[/preview]`, `/metrics`.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use cairn_engine::placement::{self, Stage};
use futures::Stream;
use serde::Deserialize;
use serde_json::{Value, json};

use super::ApiError;
use super::auth::{self, Scope};
use super::bodies;
use crate::coord::Shared;
use crate::coord::core::profiles;

/// The cluster as JSON: peers, links, placement, requests, warnings; the
/// join URL only for the admin (it lets its holder in as a worker).
pub fn cluster_json(shared: &Shared, scope: Scope) -> Value {
    let join_url = if scope == Scope::Admin {
        shared.join_url()
    } else {
        None
    };
    // Before the state's lock: the waiting workers are read under the same one.
    let pending: Vec<Value> = shared
        .pending_workers()
        .into_iter()
        .map(|(peer, w)| {
            let session = shared.opts.sessions.as_ref().and_then(|s| s.get(&peer));
            json!({
                "peer_id": peer.to_string(),
                "kind": w.caps.kind,
                "backend": w.caps.backend,
                "device": w.caps.device.name,
                "memory_budget_bytes": w.caps.memory_budget_bytes,
                "token_id": session.as_ref().map(|s| s.token_id.clone()),
                "addr": session.and_then(|s| s.addr).map(|a| a.to_string()),
                "waiting_s": w.since.elapsed().as_secs(),
            })
        })
        .collect();
    let st = shared.state();
    let mut peers = Vec::new();
    let mut links = Vec::new();
    let mut warnings = st.warnings.clone();
    for (id, p) in &st.peers {
        let layers = st.layers_of(id);
        let status = p.status(layers);
        let t = p.telemetry.as_ref();
        let (level, charging) = p.battery();
        if layers.is_some() && matches!(status, super::super::state::PeerStatus::Throttled) {
            warnings.push(format!(
                "{id} is throttled (pressure {}) and holds layers",
                p.pressure().unwrap_or_else(|| "high".into())
            ));
        }
        peers.push(json!({
            "peer_id": id.to_string(),
            "kind": p.caps.kind,
            "backend": p.caps.backend,
            "device": {
                "id": p.caps.device.id,
                "name": p.caps.device.name,
                "vendor": p.caps.device.vendor.0,
                "device_type": p.caps.device.device_type,
                "memory_bytes": p.caps.device.memory_bytes,
            },
            // A worker over several local devices lists them; its layers are split over them.
            "devices": p.caps.devices.iter().map(|d| json!({
                "id": d.id,
                "name": d.name,
                "memory_bytes": d.memory_bytes,
            })).collect::<Vec<_>>(),
            "memory_budget_bytes": p.caps.memory_budget_bytes,
            "status": status,
            "paused": p.paused,
            "layers": layers.map(|(a, b)| [a, b]),
            "telemetry": {
                "memory_used_bytes": t.map(|t| t.memory_used_bytes),
                "memory_total_bytes": t.map(|t| t.memory_total_bytes),
                "utilization": p.extra.get("utilization"),
                "kernel_ms": p.extra.get("kernel_ms"),
                "forward_ms": p.extra.get("forward_ms"),
                "tokens_per_s": t.map(|t| t.tokens_per_s),
                "pressure": p.pressure(),
                "throttled": p.throttled(),
                "thermal": p.extra.get("thermal"),
                "battery": level.map(|l| json!({"level": l, "charging": charging})),
                "visibility": p.extra.get("visibility"),
                "mean_batch": t.and_then(|t| t.mean_batch),
                "kv": t.and_then(|t| t.kv.as_ref()).map(|k| json!({
                    "blocks_used": k.blocks_used,
                    "blocks_allocated": k.blocks_allocated,
                    "blocks_budget": k.blocks_budget,
                    "block_positions": k.block_positions,
                })),
                "requests": t.map(|t| t.requests),
                // Cumulative, for busy shares over any interval between two reports.
                "uptime_ms": t.map(|t| t.uptime_ms),
                "busy_total_s": t.map(|t| t.busy_total_s),
                "passes_total": t.map(|t| t.passes_total),
                "seqs_total": t.map(|t| t.seqs_total),
            },
            "calibration": p.calibration,
            "joined_s_ago": p.joined.elapsed().as_secs(),
        }));
        if let Some(s) = &p.link {
            links.push(json!({
                "from": shared.local_id().to_string(),
                "to": id.to_string(),
                "rtt_ms": s.rtt_smoothed.or(s.rtt).map(|d| d.as_secs_f64() * 1e3),
                "bandwidth_mb_s": s.throughput_bytes_per_s.map(|b| b / 1e6),
                "loss": s.loss,
                "jitter_ms": s.jitter.as_secs_f64() * 1e3,
                "up": p.online,
            }));
        }
        // Links between workers, as each reports its own.
        if let Some(theirs) = p.extra.get("links").and_then(Value::as_object) {
            for (to, l) in theirs {
                links.push(json!({
                    "from": id.to_string(),
                    "to": to,
                    "rtt_ms": l.get("rtt_ms"),
                    "bandwidth_mb_s": l.get("throughput_mb_s"),
                    "loss": Value::Null,
                    "jitter_ms": Value::Null,
                    "up": p.online,
                }));
            }
        }
    }
    // `direct`: the stage hands its output straight to the next stage's
    // worker; `linked`: that worker reports the link to it as up (until then
    // the coordinator relays).
    let stages: Vec<Value> = match &st.active {
        Some(a) => a
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let next = &a.stages[(i + 1) % a.stages.len()].peer;
                let linked = s.direct
                    && (next == &s.peer
                        || st.peers.get(&s.peer).is_some_and(|p| {
                            p.extra
                                .get("links")
                                .and_then(|l| l.get(next.as_str()))
                                .is_some()
                        }));
                json!({
                    "peer_id": s.peer.to_string(),
                    "start": s.start,
                    "end": s.end,
                    "direct": s.direct,
                    "linked": linked,
                    "split": s.split,
                })
            })
            .collect(),
        None => Vec::new(),
    };
    if let Some(a) = &st.active
        && a.stages.len() > 1
    {
        let n = shared.model.config.n_layers as f64;
        let fair = n / a.stages.len() as f64;
        let idle = st
            .peers
            .iter()
            .any(|(id, p)| p.online && p.calibration.is_some() && st.layers_of(id).is_none());
        if idle
            && a.stages
                .iter()
                .any(|s| (s.end - s.start) as f64 > 2.0 * fair)
        {
            warnings.push(
                "unbalanced placement: a stage holds over twice its share while a worker idles"
                    .into(),
            );
        }
    }
    let requests: Vec<_> = st.requests.values().cloned().collect();
    let m = &shared.metrics;
    let queue = shared.queue.snapshot();
    json!({
        "model": {
            "id": shared.model.id,
            "name": shared.model.name,
            "n_layers": shared.model.config.n_layers,
            "file_bytes": shared.model.file_bytes,
        },
        "coordinator": shared.local_id().to_string(),
        "join_qr_svg": join_url.as_ref().map(|_| "/api/join-qr.svg"),
        "join_url": join_url,
        "peers": peers,
        "links": links,
        "placement": {
            "mode": if st.manual.is_some() { "manual" } else { "auto" },
            "epoch": st.active.as_ref().map(|a| a.epoch),
            "state": st.status,
            "message": st.message,
            "stages": stages,
            "predicted_tokens_per_s": st.prediction.as_ref().map(|p| p.tokens_per_s),
            "predicted_aggregate_tokens_per_s": st.prediction.as_ref().map(|p| p.aggregate_tokens_per_s),
            "concurrency": st.prediction.as_ref().map(|p| p.concurrency),
            "computed": st.placements_computed,
        },
        "requests": {
            "in_flight": m.in_flight.load(Ordering::Relaxed),
            "waiting": requests.iter().filter(|r| r.state == "waiting").count(),
            "running": queue.running,
            "queued": queue.queued,
            "parallel": queue.parallel,
            "oldest_wait_s": queue.oldest_wait.as_secs_f64(),
            "mean_wait_s": queue.mean_wait.as_secs_f64(),
            "refused": m.refused.load(Ordering::Relaxed),
            "queued_total": m.queued.load(Ordering::Relaxed),
            "completed": m.completed.load(Ordering::Relaxed),
            "failed": m.failed.load(Ordering::Relaxed),
            "recoveries": m.recoveries.load(Ordering::Relaxed),
            "relayed": m.relayed.load(Ordering::Relaxed),
            "passed_on": m.passed_on.load(Ordering::Relaxed),
            "tokens_per_s": m.tokens_per_s(),
            "list": requests,
        },
        "warnings": warnings,
        "spot_checks": {
            "rate": shared.opts.spot.rate,
            "tolerance": shared.opts.spot.tolerance,
            "right": m.spot_right.load(Ordering::Relaxed),
            "wrong": m.spot_wrong.load(Ordering::Relaxed),
            "unchecked": m.spot_unchecked.load(Ordering::Relaxed),
        },
        "evicted": st
            .evicted
            .iter()
            .map(|(peer, why)| json!({"peer_id": peer.to_string(), "why": why}))
            .collect::<Vec<_>>(),
        "approve_workers": shared.opts.approve_workers,
        "pending_approval": pending,
    })
}

pub async fn cluster(State(shared): State<Arc<Shared>>, parts: Parts) -> Json<Value> {
    Json(cluster_json(&shared, auth::scope(&parts.extensions)))
}

/// The cluster JSON on every change, at most every 250 ms and at least every second.
pub async fn events(
    State(shared): State<Arc<Shared>>,
    parts: Parts,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let scope = auth::scope(&parts.extensions);
    let mut changes = shared.subscribe();
    let stream = async_stream::stream! {
        loop {
            yield Ok(Event::default().event("cluster").data(cluster_json(&shared, scope).to_string()));
            tokio::time::sleep(Duration::from_millis(250)).await;
            let _ = tokio::time::timeout(Duration::from_millis(750), changes.changed()).await;
        }
    };
    Sse::new(stream).keep_alive(KeepAlive::default())
}

pub async fn get_placement(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let v = cluster_json(&shared, Scope::Read);
    Json(v["placement"].clone())
}

/// Sets a manual placement after checking it against the cluster as it is.
pub async fn set_placement(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let p = bodies::parse_placement(&body)?;
    let stages: Vec<Stage> = p
        .stages
        .into_iter()
        .map(|s| Stage {
            device: s.peer_id,
            start: s.start,
            end: s.end,
            split: s.split,
        })
        .collect();
    let devices = profiles(&shared.state());
    let prediction = placement::evaluate(&devices, &shared.model.cost, &stages, 64)
        .map_err(|e| ApiError::invalid(format!("placement refused: {e}"), Some("stages")))?;
    shared.set_manual(Some(stages));
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"accepted": true, "prediction": prediction})),
    ))
}

pub async fn clear_placement(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    shared.set_manual(None);
    (StatusCode::ACCEPTED, Json(json!({"mode": "auto"})))
}

#[derive(Deserialize)]
pub struct PreviewQuery {
    #[serde(default)]
    prompt_tokens: Option<usize>,
    #[serde(default)]
    alternatives: Option<usize>,
}

/// What the chosen placement and the best alternatives should give.
pub async fn preview(
    State(shared): State<Arc<Shared>>,
    Query(q): Query<PreviewQuery>,
) -> Result<Json<Value>, ApiError> {
    let (devices, manual) = {
        let st = shared.state();
        (profiles(&st), st.manual.clone())
    };
    let cost = &shared.model.cost;
    let prompt = q.prompt_tokens.unwrap_or(64);
    let chosen = match manual {
        Some(m) => m,
        None => placement::place(&devices, cost)
            .map_err(|e| ApiError::unavailable(format!("no placement fits: {e}")))?,
    };
    let predicted = placement::evaluate(&devices, cost, &chosen, prompt)
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    let alternatives: Vec<Value> =
        placement::alternatives(&devices, cost, q.alternatives.unwrap_or(4))
            .into_iter()
            .filter(|a| a != &chosen)
            .filter_map(|a| placement::evaluate(&devices, cost, &a, prompt).ok())
            .map(|p| json!(p))
            .collect();
    Ok(Json(
        json!({"chosen": predicted, "alternatives": alternatives}),
    ))
}

/// `/healthz`: 200 while the cluster can serve, 503 and why while it cannot
/// (out of its room, or no placement loaded).
pub async fn health(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    match shared.health() {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("unhealthy: {why}\n"),
        ),
    }
}

/// Prometheus text format.
pub async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let m = &shared.metrics;
    let mut s = String::new();
    let counter = |s: &mut String, name: &str, help: &str, v: u64| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    };
    counter(
        &mut s,
        "cairn_requests_total",
        "Generation requests received.",
        m.requests.load(Ordering::Relaxed),
    );
    counter(
        &mut s,
        "cairn_requests_failed_total",
        "Requests that ended in an error.",
        m.failed.load(Ordering::Relaxed),
    );
    counter(
        &mut s,
        "cairn_prompt_tokens_total",
        "Prompt tokens processed.",
        m.prompt_tokens.load(Ordering::Relaxed),
    );
    counter(
        &mut s,
        "cairn_generated_tokens_total",
        "Tokens generated.",
        m.generated_tokens.load(Ordering::Relaxed),
    );
    counter(
        &mut s,
        "cairn_recoveries_total",
        "Requests rebuilt on a new placement after a loss.",
        m.recoveries.load(Ordering::Relaxed),
    );
    counter(
        &mut s,
        "cairn_relayed_hops_total",
        "Hops between stages the coordinator relayed (no direct link between the workers).",
        m.relayed.load(Ordering::Relaxed),
    );
    let audit = shared.opts.audit.stats();
    counter(
        &mut s,
        "cairn_audit_records_total",
        "Records written to the audit log.",
        audit.written.load(Ordering::Relaxed),
    );
    counter(
        &mut s,
        "cairn_audit_dropped_total",
        "Audit records dropped: more at once than the writer's queue holds.",
        audit.dropped.load(Ordering::Relaxed),
    );
    counter(
        &mut s,
        "cairn_audit_write_errors_total",
        "Audit records that could not be written (see the log's first error).",
        audit.write_errors.load(Ordering::Relaxed),
    );
    for (name, help, v) in [
        (
            "cairn_spot_checks_right_total",
            "Spot checks that found the workers' token right.",
            &m.spot_right,
        ),
        (
            "cairn_spot_checks_wrong_total",
            "Spot checks that found a wrong token (its workers evicted).",
            &m.spot_wrong,
        ),
        (
            "cairn_spot_checks_unchecked_total",
            "Spot checks the trusted device could not run.",
            &m.spot_unchecked,
        ),
    ] {
        counter(&mut s, name, help, v.load(Ordering::Relaxed));
    }
    counter(
        &mut s,
        "cairn_tokens_passed_on_total",
        "Tokens the last stage fed straight back to the first stage.",
        m.passed_on.load(Ordering::Relaxed),
    );
    let _ = writeln!(
        s,
        "# HELP cairn_requests_in_flight Requests being served.\n# TYPE cairn_requests_in_flight gauge\ncairn_requests_in_flight {}",
        m.in_flight.load(Ordering::Relaxed)
    );
    let q = shared.queue.snapshot();
    for (name, help, v) in [
        (
            "cairn_requests_running",
            "Requests admitted and running (at most --parallel).",
            q.running as f64,
        ),
        (
            "cairn_requests_queued",
            "Requests waiting for a place.",
            q.queued as f64,
        ),
        (
            "cairn_queue_oldest_wait_seconds",
            "How long the oldest waiting request has waited.",
            q.oldest_wait.as_secs_f64(),
        ),
        (
            "cairn_queue_mean_wait_seconds",
            "Mean wait of the last requests to start.",
            q.mean_wait.as_secs_f64(),
        ),
    ] {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    counter(
        &mut s,
        "cairn_requests_refused_total",
        "Requests turned away because the queue was full.",
        m.refused.load(Ordering::Relaxed),
    );
    let _ = writeln!(
        s,
        "# HELP cairn_tokens_per_second Generated tokens per second over the last 5 s.\n# TYPE cairn_tokens_per_second gauge\ncairn_tokens_per_second {}",
        m.tokens_per_s()
    );
    let st = shared.state();
    let _ = writeln!(
        s,
        "# HELP cairn_placement_epoch Placements loaded so far.\n# TYPE cairn_placement_epoch gauge\ncairn_placement_epoch {}",
        st.active.as_ref().map_or(0, |a| a.epoch)
    );
    let _ = writeln!(
        s,
        "# HELP cairn_peer_up Whether a worker is online.\n# TYPE cairn_peer_up gauge"
    );
    for (id, p) in &st.peers {
        let _ = writeln!(
            s,
            "cairn_peer_up{{peer=\"{id}\",kind=\"{}\"}} {}",
            json!(p.caps.kind).as_str().unwrap_or(""),
            u8::from(p.online)
        );
    }
    let _ = writeln!(
        s,
        "# HELP cairn_peer_layers Layers a worker serves.\n# TYPE cairn_peer_layers gauge"
    );
    for id in st.peers.keys() {
        let n = st.layers_of(id).map_or(0, |(a, b)| b - a);
        let _ = writeln!(s, "cairn_peer_layers{{peer=\"{id}\"}} {n}");
    }
    let _ = writeln!(
        s,
        "# HELP cairn_link_rtt_seconds Smoothed round trip to a worker.\n# TYPE cairn_link_rtt_seconds gauge"
    );
    for (id, p) in &st.peers {
        if let Some(rtt) = p.link.as_ref().and_then(|l| l.rtt_smoothed) {
            let _ = writeln!(
                s,
                "cairn_link_rtt_seconds{{peer=\"{id}\"}} {}",
                rtt.as_secs_f64()
            );
        }
    }
    // Continuous batching per stage, as each worker's telemetry reports it.
    let _ = writeln!(
        s,
        "# HELP cairn_peer_batch_size Sequences per forward pass on a worker (mean over its last report).\n# TYPE cairn_peer_batch_size gauge\n# HELP cairn_peer_kv_blocks_used Key/value pool blocks in use on a worker.\n# TYPE cairn_peer_kv_blocks_used gauge\n# HELP cairn_peer_kv_blocks_budget Key/value pool blocks a worker may hold.\n# TYPE cairn_peer_kv_blocks_budget gauge"
    );
    for (id, p) in &st.peers {
        let Some(t) = &p.telemetry else { continue };
        if let Some(b) = t.mean_batch {
            let _ = writeln!(s, "cairn_peer_batch_size{{peer=\"{id}\"}} {b}");
        }
        if let Some(k) = &t.kv {
            let _ = writeln!(
                s,
                "cairn_peer_kv_blocks_used{{peer=\"{id}\"}} {}",
                k.blocks_used
            );
            let _ = writeln!(
                s,
                "cairn_peer_kv_blocks_budget{{peer=\"{id}\"}} {}",
                k.blocks_budget
            );
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s)
}
