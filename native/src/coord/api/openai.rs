//! `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use cairn_engine::kernels::SampleParams;
use cairn_engine::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
use futures::Stream;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::ApiError;
use super::bodies::{self, ChatRequest, Common, CompletionRequest, InMessage, OnePrompt};
use crate::coord::Shared;
use crate::coord::pipeline::{self, FinishReason, GenEvent, GenRequest};

pub(super) fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    Ok(bodies::parse(body)?)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn completion_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// A validated request, ready to run.
pub(super) struct Job {
    pub prompt: Vec<u32>,
    max_tokens: usize,
    sample: SampleParams,
    pub stream: bool,
    include_usage: bool,
    stops: Vec<String>,
    ignore_eos: bool,
}

/// Starts a validated job on the cluster; its tokens come through the returned generation's
/// receiver. Dropping the receiver (a client gone) cancels the request.
pub(super) fn start(
    shared: &Arc<Shared>,
    label: String,
    job: Job,
) -> (mpsc::Receiver<GenEvent>, TextOut) {
    let rx = pipeline::start(
        shared.clone(),
        GenRequest {
            label,
            prompt: job.prompt,
            max_tokens: job.max_tokens,
            sample: job.sample,
            ignore_eos: job.ignore_eos,
        },
    );
    let out = TextOut {
        text: String::new(),
        sent: 0,
        stops: job.stops,
        stopped: false,
    };
    (rx, out)
}

pub(super) fn validate(shared: &Shared, c: &Common, prompt: Vec<u32>) -> Result<Job, ApiError> {
    if let Some(m) = &c.model
        && !m.is_empty()
        && m != &shared.model.name
        && m != &shared.model.id
    {
        return Err(ApiError::model_not_found(m, &shared.model.name));
    }
    let ctx = shared
        .opts
        .ctx
        .min(shared.model.config.context_length.max(1));
    let checked = bodies::sampling(c, prompt.len(), ctx)?;
    Ok(Job {
        prompt,
        max_tokens: checked.max_tokens,
        sample: SampleParams {
            temperature: checked.temperature,
            top_k: checked.top_k,
            top_p: checked.top_p,
            seed: c.seed.unwrap_or_else(rand::random),
            step: 0,
        },
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        stops: checked.stops,
        ignore_eos: c.ignore_eos,
    })
}

pub async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(&body)?;
    let prompt = encode_chat(&shared, &req.messages)?;
    let job = validate(&shared, &req.common, prompt)?;
    respond(shared, job, Kind::Chat).await
}

/// The conversation through the model's chat template, with the roles and content forms
/// both chat APIs accept.
pub(super) fn encode_chat(
    shared: &Shared,
    messages_in: &[InMessage],
) -> Result<Vec<u32>, ApiError> {
    let messages: Vec<ChatMessage> = bodies::chat_turns(messages_in)?
        .into_iter()
        .map(|(role, text)| ChatMessage::new(role, text))
        .collect();
    shared.model.tokenizer.encode_chat(&messages).map_err(|e| {
        ApiError::invalid(
            format!("cannot render the conversation: {e}"),
            Some("messages"),
        )
    })
}

pub async fn completions(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&body)?;
    let prompt = match bodies::one_prompt(req.prompt)? {
        OnePrompt::Text(text) => encode_text(&shared, &text)?,
        OnePrompt::Ids(ids) => checked_ids(&shared, &ids)?,
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    let job = validate(&shared, &req.common, prompt)?;
    respond(shared, job, Kind::Text).await
}

pub async fn models(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": shared.model.name,
            "object": "model",
            "created": 0,
            "owned_by": "cairn",
            "cairn": {"model_id": shared.model.id, "n_layers": shared.model.config.n_layers, "file_bytes": shared.model.file_bytes},
        }],
    }))
}

#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Text,
}

/// Turns token ids into text, holding back what could be the start of a
/// stop string so a stop is never half-sent.
pub(super) struct TextOut {
    text: String,
    sent: usize,
    stops: Vec<String>,
    stopped: bool,
}

impl TextOut {
    /// Appends a piece; returns the text now safe to send.
    fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(piece);
        let search_from = self
            .sent
            .saturating_sub(self.stops.iter().map(|s| s.len()).max().unwrap_or(0));
        let search_from = (0..=search_from)
            .rev()
            .find(|&i| self.text.is_char_boundary(i))
            .unwrap_or(0);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| i + search_from)
            })
            .min()
        {
            self.text.truncate(at);
            self.stopped = true;
        }
        let mut safe = self.text.len();
        if !self.stopped {
            for s in &self.stops {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                        safe = safe.min(self.text.len() - k);
                        break;
                    }
                }
            }
        }
        let start = self.sent.min(safe);
        let out = self.text[start..safe].to_owned();
        self.sent = self.sent.max(safe);
        out
    }

    fn finish(&mut self) -> String {
        let out = self.text[self.sent.min(self.text.len())..].to_owned();
        self.sent = self.text.len();
        out
    }
}

pub(super) fn encode_text(shared: &Shared, text: &str) -> Result<Vec<u32>, ApiError> {
    shared
        .model
        .tokenizer
        .encode_prompt(text, true)
        .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some("prompt")))
}

/// Token ids from a client are checked against the vocabulary before any
/// stage sees them.
fn checked_ids(shared: &Shared, ids: &[i64]) -> Result<Vec<u32>, ApiError> {
    let vocab = shared.model.config.vocab_size;
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!("prompt token {i} is {id}, outside the vocabulary of {vocab}"),
                        Some("prompt"),
                    )
                })
        })
        .collect()
}

async fn respond(shared: Arc<Shared>, job: Job, kind: Kind) -> Result<Response, ApiError> {
    let id = completion_id(match kind {
        Kind::Chat => "chatcmpl",
        Kind::Text => "cmpl",
    });
    let prompt_tokens = job.prompt.len();
    let (stream, include_usage) = (job.stream, job.include_usage);
    let (rx, out) = start(&shared, id.clone(), job);
    let ctx = Ctx {
        shared,
        id,
        kind,
        created: now(),
        prompt_tokens,
    };
    if stream {
        Ok(Sse::new(sse(ctx, rx, out, include_usage))
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        whole(ctx, rx, out).await.map(|v| Json(v).into_response())
    }
}

struct Ctx {
    shared: Arc<Shared>,
    id: String,
    kind: Kind,
    created: u64,
    prompt_tokens: usize,
}

impl Ctx {
    fn usage(&self, completion: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }

    fn chunk(&self, text: Option<&str>, first: bool, finish: Option<&str>) -> Value {
        match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.shared.model.name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
            Kind::Text => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.shared.model.name,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
            }),
        }
    }
}

pub(super) fn finish_name(reason: FinishReason, stopped: bool) -> &'static str {
    if stopped {
        return "stop";
    }
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

async fn whole(ctx: Ctx, rx: mpsc::Receiver<GenEvent>, out: TextOut) -> Result<Value, ApiError> {
    let mut g = Generation::new(&ctx.shared.model.tokenizer, rx, out);
    let mut text = String::new();
    let (finish, recoveries) = loop {
        match g.next().await {
            Step::Text(t) => text.push_str(&t),
            Step::Done { finish, recoveries } => break (finish, recoveries),
            Step::Failed(e) => return Err(e),
        }
    };
    let ids = g.tokens;
    let choice = match ctx.kind {
        Kind::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish})
        }
        Kind::Text => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
    };
    Ok(json!({
        "id": ctx.id,
        "object": match ctx.kind { Kind::Chat => "chat.completion", Kind::Text => "text_completion" },
        "created": ctx.created,
        "model": ctx.shared.model.name,
        "choices": [choice],
        "usage": ctx.usage(ids.len()),
        "cairn": {"tokens": ids, "recoveries": recoveries},
    }))
}

fn sse(
    ctx: Ctx,
    rx: mpsc::Receiver<GenEvent>,
    out: TextOut,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    async_stream::stream! {
        let mut g = Generation::new(&ctx.shared.model.tokenizer, rx, out);
        let mut first = true;
        if let Kind::Chat = ctx.kind {
            yield Ok(Event::default().data(ctx.chunk(Some(""), true, None).to_string()));
            first = false;
        }
        loop {
            match g.next().await {
                Step::Text(piece) => {
                    yield Ok(Event::default().data(ctx.chunk(Some(&piece), first, None).to_string()));
                    first = false;
                }
                Step::Done { finish, .. } => {
                    yield Ok(Event::default().data(ctx.chunk(None, false, Some(finish)).to_string()));
                    if include_usage {
                        let mut u = ctx.chunk(None, false, None);
                        u["choices"] = json!([]);
                        u["usage"] = ctx.usage(g.tokens.len());
                        yield Ok(Event::default().data(u.to_string()));
                    }
                    break;
                }
                Step::Failed(e) => {
                    yield Ok(Event::default().data(e.body().to_string()));
                    break;
                }
            }
        }
        yield Ok(Event::default().data("[DONE]"));
    }
}

/// What a generation yields next, as text: stop strings held back and cut, pieces never
/// split inside a character. Both APIs' streamed and whole answers read it.
pub(super) enum Step {
    Text(String),
    Done {
        finish: &'static str,
        recoveries: u32,
    },
    Failed(ApiError),
}

pub(super) struct Generation<'t> {
    rx: mpsc::Receiver<GenEvent>,
    /// `None` once finished (finishing consumes it).
    dec: Option<StreamDecoder<'t>>,
    out: TextOut,
    /// Every token generated so far, stop strings included.
    pub tokens: Vec<u32>,
    pending: Option<Step>,
}

impl<'t> Generation<'t> {
    pub fn new(tokenizer: &'t Tokenizer, rx: mpsc::Receiver<GenEvent>, out: TextOut) -> Self {
        Generation {
            rx,
            dec: Some(tokenizer.decoder()),
            out,
            tokens: Vec::new(),
            pending: None,
        }
    }

    /// The next non-empty text, or the end. Not to be called again after `Done` or `Failed`.
    pub async fn next(&mut self) -> Step {
        loop {
            if let Some(step) = self.pending.take() {
                return step;
            }
            match self.rx.recv().await {
                Some(GenEvent::Token(t)) => {
                    self.tokens.push(t);
                    let piece = match self.dec.as_mut().map(|d| d.push(t)) {
                        Some(Ok(Some(p))) => self.out.push(&p),
                        _ => String::new(),
                    };
                    if self.out.stopped {
                        self.pending = Some(Step::Done {
                            finish: finish_name(FinishReason::Stop, true),
                            recoveries: 0,
                        });
                    }
                    if !piece.is_empty() {
                        return Step::Text(piece);
                    }
                }
                Some(GenEvent::Done { reason, recoveries }) => {
                    let mut rest = String::new();
                    if !self.out.stopped {
                        if let Some(r) = self.dec.take().and_then(|d| d.finish()) {
                            rest.push_str(&self.out.push(&r));
                        }
                        rest.push_str(&self.out.finish());
                    }
                    self.pending = Some(Step::Done {
                        finish: finish_name(reason, self.out.stopped),
                        recoveries,
                    });
                    if !rest.is_empty() {
                        return Step::Text(rest);
                    }
                }
                Some(GenEvent::Failed(msg)) => return Step::Failed(ApiError::unavailable(msg)),
                None => {
                    return Step::Failed(ApiError::internal("the request ended without an answer"));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TextOut;

    fn out(stops: &[&str]) -> TextOut {
        TextOut {
            text: String::new(),
            sent: 0,
            stops: stops.iter().map(|s| s.to_string()).collect(),
            stopped: false,
        }
    }

    #[test]
    fn stop_strings_are_never_half_sent() {
        let mut o = out(&["END"]);
        assert_eq!(o.push("abc E"), "abc ");
        assert_eq!(o.push("N"), "");
        assert_eq!(o.push("D and more"), "");
        assert!(o.stopped);
        assert_eq!(o.text, "abc ");
        let mut o = out(&["END"]);
        assert_eq!(o.push("abc E"), "abc ");
        assert_eq!(o.push("x"), "Ex");
        assert!(!o.stopped);
        assert_eq!(o.finish(), "");
    }

    #[test]
    fn no_stops_pass_everything() {
        let mut o = out(&[]);
        assert_eq!(o.push("héllo"), "héllo");
        assert_eq!(o.push(" world"), " world");
    }
}
