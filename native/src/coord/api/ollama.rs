//! Ollama's API beside OpenAI's, for the clients that speak only it (Open WebUI, editors'
//! assistants, scripts): `/api/tags`, `/api/show`, `/api/ps`, `/api/version`,
//! `/api/generate` and `/api/chat`. Requests go through the OpenAI routes' validation and
//! generation (`openai::validate`, `openai::Generation`); only the shapes differ: Ollama's
//! `options`, streamed NDJSON by default, and errors as `{"error": "message"}`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::ApiError;
use super::bodies::{
    self, Content, GenerateRequest, InMessage, OllamaChatRequest, ShowRequest, untagged,
};
use super::openai::{self, Generation, Job, Step};
use crate::coord::Shared;

/// The Ollama API version these routes follow; clients check it before using newer fields.
const OLLAMA_VERSION: &str = "0.6.0";

/// An [`ApiError`] in Ollama's shape: the same status, `{"error": "message"}`.
pub struct OllamaError(ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        OllamaError(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        (self.0.status, Json(json!({"error": self.0.message}))).into_response()
    }
}

/// Ollama names carry a tag; this cluster serves one model, listed as `NAME:latest`.
fn tagged(shared: &Shared) -> String {
    format!("{}:latest", shared.model.name)
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": OLLAMA_VERSION}))
}

/// The served model as Ollama's listings describe one.
fn model_entry(shared: &Shared) -> Value {
    let name = tagged(shared);
    json!({
        "name": name,
        "model": name,
        "modified_at": rfc3339(modified(shared)),
        "size": shared.model.file_bytes,
        "digest": shared.model.id,
        "details": details(shared),
    })
}

fn details(shared: &Shared) -> Value {
    let arch = &shared.model.config.architecture;
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch],
        "parameter_size": parameter_size(shared),
        "quantization_level": quantization(shared),
    })
}

pub async fn tags(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({"models": [model_entry(&shared)]}))
}

/// The loaded models: here the one the cluster serves, loaded while it has a placement.
pub async fn ps(State(shared): State<Arc<Shared>>) -> Json<Value> {
    if shared.health().is_err() {
        return Json(json!({"models": []}));
    }
    let mut m = model_entry(&shared);
    m["size_vram"] = json!(shared.model.file_bytes);
    m["expires_at"] = json!("9999-12-31T23:59:59Z");
    Json(json!({"models": [m]}))
}

pub async fn show(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Json<Value>, OllamaError> {
    let req: ShowRequest = openai::parse(&body)?;
    let asked = untagged(req.model.or(req.name)).unwrap_or_default();
    if asked != shared.model.name && asked != shared.model.id {
        return Err(ApiError::model_not_found(&asked, &tagged(&shared)).into());
    }
    let c = &shared.model.config;
    let arch = &c.architecture;
    Ok(Json(json!({
        "modelfile": "",
        "parameters": "",
        "template": "",
        "license": "",
        "modified_at": rfc3339(modified(&shared)),
        "details": details(&shared),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": parameter_count(&shared),
            format!("{arch}.context_length"): c.context_length,
            format!("{arch}.embedding_length"): c.dim,
            format!("{arch}.block_count"): c.n_layers,
            format!("{arch}.feed_forward_length"): c.ffn_dim,
            format!("{arch}.attention.head_count"): c.n_heads,
            format!("{arch}.attention.head_count_kv"): c.n_kv_heads,
            format!("{arch}.vocab_size"): c.vocab_size,
        },
        "capabilities": ["completion"],
    })))
}

pub async fn generate(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Response, OllamaError> {
    let req: GenerateRequest = openai::parse(&body)?;
    bodies::generate_unsupported(&req).map_err(ApiError::from)?;
    let stream = req.stream.unwrap_or(true);
    let c = bodies::ollama_common(req.model, req.options, stream).map_err(ApiError::from)?;
    let prompt_text = req.prompt.unwrap_or_default();
    if prompt_text.is_empty() {
        // Ollama's way to load a model: an empty prompt answers at once.
        openai::validate(&shared, &c, vec![0])?;
        let done = json!({
            "model": tagged(&shared), "created_at": rfc3339(SystemTime::now()),
            "response": "", "done": true, "done_reason": "load",
        });
        return Ok(Json(done).into_response());
    }
    let prompt = if req.raw {
        openai::encode_text(&shared, &prompt_text)?
    } else {
        let mut messages = Vec::new();
        if let Some(system) = req.system.filter(|s| !s.is_empty()) {
            messages.push(message("system", system));
        }
        messages.push(message("user", prompt_text));
        openai::encode_chat(&shared, &messages)?
    };
    let job = openai::validate(&shared, &c, prompt)?;
    Ok(answer(shared, job, Shape::Generate).await?)
}

pub async fn chat(State(shared): State<Arc<Shared>>, body: Bytes) -> Result<Response, OllamaError> {
    let req: OllamaChatRequest = openai::parse(&body)?;
    bodies::chat_unsupported(&req).map_err(ApiError::from)?;
    let stream = req.stream.unwrap_or(true);
    let c = bodies::ollama_common(req.model, req.options, stream).map_err(ApiError::from)?;
    let messages: Vec<InMessage> = req
        .messages
        .into_iter()
        .map(|m| message(&m.role, m.content.unwrap_or_default()))
        .collect();
    let prompt = openai::encode_chat(&shared, &messages)?;
    let job = openai::validate(&shared, &c, prompt)?;
    Ok(answer(shared, job, Shape::Chat).await?)
}

fn message(role: &str, text: String) -> InMessage {
    InMessage {
        role: role.to_owned(),
        content: Some(Content::Text(text)),
    }
}

#[derive(Clone, Copy)]
enum Shape {
    Generate,
    Chat,
}

/// One NDJSON line's text field: `response` for generate, `message` for chat.
fn text_fields(shape: Shape, text: &str) -> (&'static str, Value) {
    match shape {
        Shape::Generate => ("response", json!(text)),
        Shape::Chat => ("message", json!({"role": "assistant", "content": text})),
    }
}

struct Timing {
    started: Instant,
    first_token: Option<Instant>,
    prompt_tokens: usize,
}

impl Timing {
    /// Ollama's closing fields (durations in nanoseconds): the prompt's time is until the
    /// first text, the rest is generation.
    fn closing(&self, done_reason: &str, generated: usize) -> serde_json::Map<String, Value> {
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let ns = |d: std::time::Duration| d.as_nanos() as u64;
        let mut m = serde_json::Map::new();
        m.insert("done".into(), json!(true));
        m.insert("done_reason".into(), json!(done_reason));
        m.insert("total_duration".into(), json!(ns(now - self.started)));
        m.insert("load_duration".into(), json!(0));
        m.insert("prompt_eval_count".into(), json!(self.prompt_tokens));
        m.insert(
            "prompt_eval_duration".into(),
            json!(ns(first - self.started)),
        );
        m.insert("eval_count".into(), json!(generated));
        m.insert("eval_duration".into(), json!(ns(now - first)));
        m
    }
}

async fn answer(shared: Arc<Shared>, job: Job, shape: Shape) -> Result<Response, ApiError> {
    let timing = Timing {
        started: Instant::now(),
        first_token: None,
        prompt_tokens: job.prompt.len(),
    };
    let stream = job.stream;
    let label = format!("ollama-{:016x}", rand::random::<u64>());
    let (rx, out) = openai::start(&shared, label, job);
    if stream {
        let body = Body::from_stream(lines(shared, rx, out, shape, timing));
        return Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response());
    }
    let mut timing = timing;
    let mut g = Generation::new(&shared.model.tokenizer, rx, out);
    let mut text = String::new();
    let finish = loop {
        match g.next().await {
            Step::Text(t) => {
                timing.first_token.get_or_insert_with(Instant::now);
                text.push_str(&t);
            }
            Step::Done { finish, .. } => break finish,
            Step::Failed(e) => return Err(e),
        }
    };
    let mut m = timing.closing(finish, g.tokens.len());
    m.insert("model".into(), json!(tagged(&shared)));
    m.insert("created_at".into(), json!(rfc3339(SystemTime::now())));
    let (k, v) = text_fields(shape, &text);
    m.insert(k.into(), v);
    Ok((StatusCode::OK, Json(Value::Object(m))).into_response())
}

fn lines(
    shared: Arc<Shared>,
    rx: tokio::sync::mpsc::Receiver<crate::coord::pipeline::GenEvent>,
    out: openai::TextOut,
    shape: Shape,
    mut timing: Timing,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> {
    async_stream::stream! {
        let model = tagged(&shared);
        let mut g = Generation::new(&shared.model.tokenizer, rx, out);
        let line = |mut v: serde_json::Map<String, Value>, text: &str| {
            v.insert("model".into(), json!(model));
            v.insert("created_at".into(), json!(rfc3339(SystemTime::now())));
            let (k, t) = text_fields(shape, text);
            v.insert(k.into(), t);
            let mut s = Value::Object(v).to_string();
            s.push('\n');
            Bytes::from(s)
        };
        loop {
            match g.next().await {
                Step::Text(t) => {
                    timing.first_token.get_or_insert_with(Instant::now);
                    let mut m = serde_json::Map::new();
                    m.insert("done".into(), json!(false));
                    yield Ok(line(m, &t));
                }
                Step::Done { finish, .. } => {
                    yield Ok(line(timing.closing(finish, g.tokens.len()), ""));
                    break;
                }
                Step::Failed(e) => {
                    // Mid-stream the status is sent; Ollama's clients read an error line.
                    let mut s = json!({"error": e.message}).to_string();
                    s.push('\n');
                    yield Ok(Bytes::from(s));
                    break;
                }
            }
        }
    }
}

fn modified(shared: &Shared) -> SystemTime {
    std::fs::metadata(&shared.model.path)
        .and_then(|m| m.modified())
        .unwrap_or(UNIX_EPOCH)
}

fn parameter_count(shared: &Shared) -> u64 {
    let c = &shared.model.config;
    let (dim, q) = (c.dim as u64, (c.n_heads * c.head_dim) as u64);
    let kv = (c.n_kv_heads * c.head_dim) as u64;
    let layer = dim * q * 2 + dim * kv * 2 + 3 * dim * c.ffn_dim as u64 + 2 * dim;
    let embed = c.vocab_size as u64 * dim;
    let head = if c.tied_output { 0 } else { embed };
    c.n_layers as u64 * layer + embed + head + dim
}

/// `135M`, `1.2B`: as Ollama shows sizes.
fn parameter_size(shared: &Shared) -> String {
    let n = parameter_count(shared) as f64;
    if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else {
        format!("{:.0}M", n / 1e6)
    }
}

/// The file name's last part when it names a GGML type (`...Q4_1.gguf`).
fn quantization(shared: &Shared) -> String {
    shared
        .model
        .path
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.rsplit('.').next())
        .filter(|q| q.starts_with(['Q', 'q', 'F', 'f', 'B', 'b', 'I', 'i']) && q.len() <= 8)
        .map(str::to_uppercase)
        .unwrap_or_else(|| "unknown".into())
}

/// UTC, seconds precision: `2026-11-25T20:44:10Z`.
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil-from-days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_639_450);
        assert_eq!(rfc3339(t), "2026-11-25T20:44:10Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00Z");
    }
}
