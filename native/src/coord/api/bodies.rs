//! The API's request bodies (OpenAI chat and completions, Ollama show, generate and chat, a
//! placement, a join token) and every check on them that needs nothing of the cluster: sampling ranges,
//! context room, stop strings, roles and content parts, Ollama's options and refused
//! features. What needs the cluster (the model's name, the tokenizer, the vocabulary, the
//! peers) stays with the routes.
//!
//! This file uses only `std`, `serde` and `serde_json`, so the `api_json` fuzz target
//! (`fuzz/fuzz_targets/api_json.rs`) compiles it alone instead of the whole `cairn` crate.

use cairn_engine::placement::StageSplit;
use serde::Deserialize;
use serde_json::Value;

/// A body refused: what is wrong, and the field it names.
#[derive(Debug)]
pub struct Invalid {
    pub message: String,
    pub param: Option<&'static str>,
}

fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Invalid {
    Invalid {
        message: message.into(),
        param,
    }
}

/// A body as `T`: an empty body and JSON that does not fit are refused with what serde saw.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, Invalid> {
    if body.is_empty() {
        return Err(invalid(
            "the request body is empty; send a JSON object",
            None,
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| invalid(format!("the request body is not valid: {e}"), None))
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Deserialize)]
pub struct InMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields both endpoints share; the Ollama routes fill it from their `options`.
#[derive(Deserialize, Default)]
pub struct Common {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Keep generating past end-of-generation tokens (as vLLM and llama.cpp's
    /// server offer): for benchmarks that need a fixed length.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<InMessage>,
    #[serde(flatten)]
    pub common: Common,
}

/// OpenAI's four prompt forms: text, texts, token ids, lists of token ids.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

/// `POST /v1/completions`.
#[derive(Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

/// The one prompt a completion runs: text to tokenize, or token ids to check against the
/// vocabulary.
pub enum OnePrompt {
    Text(String),
    Ids(Vec<i64>),
}

/// The prompt of a completion request, refused when it holds more than one.
pub fn one_prompt(prompt: Prompt) -> Result<OnePrompt, Invalid> {
    match prompt {
        Prompt::One(text) => Ok(OnePrompt::Text(text)),
        Prompt::Many(mut v) if v.len() == 1 => Ok(OnePrompt::Text(v.remove(0))),
        Prompt::Tokens(ids) => Ok(OnePrompt::Ids(ids)),
        Prompt::TokenLists(mut lists) if lists.len() == 1 => Ok(OnePrompt::Ids(lists.remove(0))),
        Prompt::Many(_) | Prompt::TokenLists(_) => Err(invalid(
            "only one prompt per request is supported",
            Some("prompt"),
        )),
    }
}

/// A conversation's turns as the chat template takes them: known roles only (`developer` is
/// `system`), text content only.
pub fn chat_turns(messages: &[InMessage]) -> Result<Vec<(&str, String)>, Invalid> {
    if messages.is_empty() {
        return Err(invalid("messages must not be empty", Some("messages")));
    }
    let mut turns = Vec::with_capacity(messages.len());
    for m in messages {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(invalid(
                format!("unknown message role '{}'", m.role),
                Some("messages"),
            ));
        }
        let text = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(invalid(
                            format!("content parts of type '{}' are not supported", p.kind),
                            Some("messages"),
                        ));
                    }
                    t.push_str(p.text.as_deref().unwrap_or(""));
                }
                t
            }
        };
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        turns.push((role, text));
    }
    Ok(turns)
}

/// The sampling a request asked for, checked; the seed stays the request's (`None`: draw one).
#[derive(Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub max_tokens: usize,
    pub stops: Vec<String>,
}

/// Checks `c`'s sampling fields, and that a prompt of `prompt_len` tokens leaves room for the
/// tokens asked in a context of `ctx`.
pub fn sampling(c: &Common, prompt_len: usize, ctx: usize) -> Result<Sampling, Invalid> {
    if c.n.is_some_and(|n| n != 1) {
        return Err(invalid("only n = 1 is supported", Some("n")));
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid(
            format!("temperature must be between 0 and 2, got {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid(
            format!("top_p must be in (0, 1], got {top_p}"),
            Some("top_p"),
        ));
    }
    let top_k = c.top_k.unwrap_or(0);
    let Ok(top_k) = u32::try_from(top_k) else {
        return Err(invalid("top_k must be 0 or more", Some("top_k")));
    };
    if prompt_len >= ctx {
        return Err(invalid(
            format!("the prompt is {prompt_len} tokens; this cluster's context is {ctx}"),
            Some("messages"),
        ));
    }
    let room = ctx - prompt_len;
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => room.min(1024),
        Some(m) if m < 1 => {
            return Err(invalid(
                format!("max_tokens must be at least 1, got {m}"),
                Some("max_tokens"),
            ));
        }
        Some(m) if m as usize > room => {
            return Err(invalid(
                format!(
                    "max_tokens {m} plus the prompt's {prompt_len} tokens is over the context of {ctx}"
                ),
                Some("max_tokens"),
            ));
        }
        Some(m) => m as usize,
    };
    let stops = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stops.len() > 4 || stops.iter().any(|s| s.is_empty()) {
        return Err(invalid(
            "stop takes up to 4 non-empty strings",
            Some("stop"),
        ));
    }
    Ok(Sampling {
        temperature,
        top_p,
        top_k,
        max_tokens,
        stops,
    })
}

/// Ollama's `options`: the ones honoured, the rest (num_ctx, mirostat, ...) ignored as Ollama
/// ignores what a runner does not use.
#[derive(Deserialize, Default)]
pub struct Options {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub num_predict: Option<i64>,
    #[serde(default)]
    pub stop: Option<Vec<String>>,
    #[serde(default)]
    pub seed: Option<i64>,
}

/// `POST /api/generate`.
#[derive(Deserialize)]
pub struct GenerateRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub system: Option<String>,
    #[serde(default)]
    pub raw: bool,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub options: Option<Options>,
    #[serde(default)]
    pub format: Option<Value>,
    #[serde(default)]
    pub images: Option<Vec<Value>>,
    #[serde(default)]
    pub suffix: Option<String>,
}

/// `POST /api/chat`.
#[derive(Deserialize)]
pub struct OllamaChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Vec<OllamaMessage>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub options: Option<Options>,
    #[serde(default)]
    pub format: Option<Value>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
}

#[derive(Deserialize)]
pub struct OllamaMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub images: Option<Vec<Value>>,
}

/// `POST /api/show`.
#[derive(Deserialize)]
pub struct ShowRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// What older clients send instead of `model`.
    #[serde(default)]
    pub name: Option<String>,
}

/// An Ollama model name without its `:latest` tag.
pub fn untagged(model: Option<String>) -> Option<String> {
    model.map(|m| m.strip_suffix(":latest").map(str::to_owned).unwrap_or(m))
}

/// Ollama's options as the OpenAI routes' fields, with Ollama's defaults where a request
/// leaves one out (temperature 0.8, top_k 40, top_p 0.9), so a client sees what it would
/// from Ollama.
pub fn ollama_common(
    model: Option<String>,
    o: Option<Options>,
    stream: bool,
) -> Result<Common, Invalid> {
    let o = o.unwrap_or_default();
    let seed = match o.seed {
        Some(s) if s < 0 => {
            return Err(invalid(
                format!("options.seed must be 0 or more, got {s}"),
                Some("seed"),
            ));
        }
        s => s.map(|s| s as u64),
    };
    Ok(Common {
        model: untagged(model),
        // Ollama's -1 (until the end) and -2 (fill the context) are the default here.
        max_tokens: o.num_predict.filter(|&n| n != -1 && n != -2),
        temperature: Some(o.temperature.unwrap_or(0.8)),
        top_p: Some(o.top_p.unwrap_or(0.9)),
        top_k: Some(o.top_k.unwrap_or(40)),
        seed,
        stream,
        stop: o.stop.filter(|s| !s.is_empty()).map(Stop::Many),
        ..Common::default()
    })
}

/// JSON mode and schemas (`format`) are refused; an empty one is none.
pub fn unsupported_format(format: &Option<Value>) -> Result<(), Invalid> {
    match format {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s.is_empty() => Ok(()),
        Some(_) => Err(invalid(
            "format (JSON mode and schemas) is not supported",
            Some("format"),
        )),
    }
}

pub fn no_images(images: &Option<Vec<Value>>) -> Result<(), Invalid> {
    match images {
        Some(v) if !v.is_empty() => Err(invalid(
            "images are not supported: this cluster serves a text model",
            Some("images"),
        )),
        _ => Ok(()),
    }
}

/// What `/api/generate` refuses before any model work: JSON mode, images, fill-in-the-middle.
pub fn generate_unsupported(req: &GenerateRequest) -> Result<(), Invalid> {
    unsupported_format(&req.format)?;
    no_images(&req.images)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(invalid(
            "suffix (fill-in-the-middle) is not supported",
            Some("suffix"),
        ));
    }
    Ok(())
}

/// What `/api/chat` refuses before any model work: JSON mode, tools, images.
pub fn chat_unsupported(req: &OllamaChatRequest) -> Result<(), Invalid> {
    unsupported_format(&req.format)?;
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(invalid("tools are not supported", Some("tools")));
    }
    for m in &req.messages {
        no_images(&m.images)?;
    }
    Ok(())
}

/// One stage of a manual placement: layers `start..end` on the peer, and for a worker over
/// several devices how it spreads them (`"layers"`, the default, or `"tensor"`).
#[derive(Deserialize)]
pub struct StageIn {
    pub peer_id: String,
    pub start: usize,
    pub end: usize,
    #[serde(default)]
    pub split: StageSplit,
}

/// `POST /api/placement` and its preview.
#[derive(Deserialize)]
pub struct PlacementIn {
    pub stages: Vec<StageIn>,
}

pub fn parse_placement(body: &[u8]) -> Result<PlacementIn, Invalid> {
    serde_json::from_slice(body).map_err(|e| {
        invalid(
            format!("expected {{\"stages\":[{{\"peer_id\":ID,\"start\":0,\"end\":15}},...]}} (each stage may add \"split\":\"tensor\"): {e}"),
            Some("stages"),
        )
    })
}

/// `POST /api/tokens`: a join token's lifetime.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IssueBody {
    /// Lifetime in seconds (default: the server's `--join-ttl`).
    pub ttl_s: Option<u64>,
}

/// The lifetime a token request asks for (`None`: the default); an empty body asks none.
pub fn token_ttl(body: &[u8]) -> Result<Option<u64>, Invalid> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let ask: IssueBody = serde_json::from_slice(body)
        .map_err(|e| invalid(format!("expected {{\"ttl_s\": SECONDS}}: {e}"), None))?;
    if ask.ttl_s == Some(0) {
        return Err(invalid("ttl_s must be at least 1", Some("ttl_s")));
    }
    Ok(ask.ttl_s)
}

/// A context for [`parse_bodies`]' checks: the default model's.
const CHECK_CTX: usize = 2048;

/// Parses `body` as every body the API takes and runs every check above on what parses, as
/// the routes would with a one-token prompt: how many bodies it is. For the fuzz target and
/// the garbage tests: any bytes give a count, never a panic.
pub fn parse_bodies(body: &[u8]) -> usize {
    let mut n = 0;
    if let Ok(r) = parse::<ChatRequest>(body) {
        n += 1;
        let _ = chat_turns(&r.messages);
        let _ = sampling(&r.common, 1, CHECK_CTX);
    }
    if let Ok(r) = parse::<CompletionRequest>(body) {
        n += 1;
        let _ = sampling(&r.common, 1, CHECK_CTX);
        let _ = one_prompt(r.prompt);
    }
    if let Ok(r) = parse::<ShowRequest>(body) {
        n += 1;
        let _ = untagged(r.model.or(r.name));
    }
    if let Ok(r) = parse::<GenerateRequest>(body) {
        n += 1;
        let _ = generate_unsupported(&r);
        if let Ok(c) = ollama_common(r.model, r.options, r.stream.unwrap_or(true)) {
            let _ = sampling(&c, 1, CHECK_CTX);
        }
    }
    if let Ok(r) = parse::<OllamaChatRequest>(body) {
        n += 1;
        let _ = chat_unsupported(&r);
        if let Ok(c) = ollama_common(r.model, r.options, r.stream.unwrap_or(true)) {
            let _ = sampling(&c, 1, CHECK_CTX);
        }
    }
    if parse_placement(body).is_ok() {
        n += 1;
    }
    if !body.iter().all(u8::is_ascii_whitespace) && token_ttl(body).is_ok() {
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn options_map_onto_the_openai_fields_with_ollama_defaults() {
        let c = ollama_common(Some("m:latest".into()), None, true).expect("valid");
        assert_eq!(c.model.as_deref(), Some("m"));
        assert_eq!(
            (c.temperature, c.top_p, c.top_k, c.max_tokens),
            (Some(0.8), Some(0.9), Some(40), None)
        );
        let o: Options = serde_json::from_value(json!({
            "temperature": 0, "top_p": 0.5, "top_k": 3, "num_predict": 7,
            "stop": ["x"], "seed": 9, "num_ctx": 4096,
        }))
        .expect("options");
        let c = ollama_common(None, Some(o), false).expect("valid");
        assert_eq!(
            (c.temperature, c.top_p, c.top_k, c.max_tokens, c.seed),
            (Some(0.0), Some(0.5), Some(3), Some(7), Some(9))
        );
        assert!(matches!(c.stop, Some(Stop::Many(ref v)) if v == &["x"]));
        for fill in [-1, -2] {
            let o = Options {
                num_predict: Some(fill),
                ..Options::default()
            };
            assert_eq!(
                ollama_common(None, Some(o), true)
                    .expect("valid")
                    .max_tokens,
                None
            );
        }
        let o = Options {
            seed: Some(-3),
            ..Options::default()
        };
        assert!(ollama_common(None, Some(o), true).is_err());
    }

    #[test]
    fn json_mode_and_images_are_refused_by_name() {
        assert!(unsupported_format(&None).is_ok());
        assert!(unsupported_format(&Some(json!(""))).is_ok());
        let e = unsupported_format(&Some(json!("json"))).expect_err("refused");
        assert_eq!(e.param, Some("format"));
        assert!(no_images(&Some(vec![])).is_ok());
        assert!(no_images(&Some(vec![json!("aGk=")])).is_err());
    }

    #[test]
    fn sampling_is_checked_against_its_ranges_and_the_context() {
        let c: Common =
            parse(br#"{"max_tokens":5,"temperature":0.5,"top_k":3,"stop":"x"}"#).expect("parses");
        let s = sampling(&c, 10, 16).expect("valid");
        assert_eq!(
            s,
            Sampling {
                temperature: 0.5,
                top_p: 1.0,
                top_k: 3,
                max_tokens: 5,
                stops: vec!["x".into()],
            }
        );
        assert_eq!(
            sampling(&Common::default(), 10, 16)
                .expect("valid")
                .max_tokens,
            6
        );
        let refused = |body: &str, prompt: usize| {
            let c: Common = parse(body.as_bytes()).expect("parses");
            sampling(&c, prompt, 16).expect_err("refused").param
        };
        assert_eq!(refused(r#"{"max_tokens":7}"#, 10), Some("max_tokens"));
        assert_eq!(refused(r#"{"max_tokens":0}"#, 10), Some("max_tokens"));
        assert_eq!(refused("{}", 16), Some("messages"));
        assert_eq!(refused(r#"{"top_k":-1}"#, 1), Some("top_k"));
        assert_eq!(refused(r#"{"top_k":4294967296}"#, 1), Some("top_k"));
        assert_eq!(refused(r#"{"top_p":0}"#, 1), Some("top_p"));
        assert_eq!(refused(r#"{"temperature":2.5}"#, 1), Some("temperature"));
        assert_eq!(refused(r#"{"n":2}"#, 1), Some("n"));
        assert_eq!(
            refused(r#"{"stop":["a","b","c","d","e"]}"#, 1),
            Some("stop")
        );
        assert_eq!(refused(r#"{"stop":[""]}"#, 1), Some("stop"));
    }

    #[test]
    fn a_token_request_asks_a_lifetime_or_none() {
        assert_eq!(token_ttl(b" \n").expect("empty"), None);
        assert_eq!(token_ttl(br#"{"ttl_s":60}"#).expect("valid"), Some(60));
        assert_eq!(
            token_ttl(br#"{"ttl_s":0}"#).expect_err("0").param,
            Some("ttl_s")
        );
        assert!(
            token_ttl(br#"{"ttl":60}"#).is_err(),
            "unknown fields are refused"
        );
    }

    #[test]
    fn a_completion_runs_one_prompt_and_a_chat_known_roles_and_text_only() {
        let one = |body: &str| {
            let r: CompletionRequest = parse(body.as_bytes()).expect("parses");
            one_prompt(r.prompt)
        };
        assert!(matches!(one(r#"{"prompt":["a"]}"#), Ok(OnePrompt::Text(t)) if t == "a"));
        assert!(matches!(one(r#"{"prompt":[[1,2]]}"#), Ok(OnePrompt::Ids(v)) if v == [1, 2]));
        assert!(one(r#"{"prompt":["a","b"]}"#).is_err());
        let turns = |body: &str| {
            let r: ChatRequest = parse(body.as_bytes()).expect("parses");
            chat_turns(&r.messages)
                .map(|t| {
                    t.into_iter()
                        .map(|(r, t)| format!("{r}:{t}"))
                        .collect::<Vec<_>>()
                })
                .map_err(|e| e.message)
        };
        assert_eq!(
            turns(
                r#"{"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"user"}]}"#
            ),
            Ok(vec!["system:ab".to_owned(), "user:".to_owned()])
        );
        assert!(turns(r#"{"messages":[]}"#).is_err());
        assert!(turns(r#"{"messages":[{"role":"root","content":"x"}]}"#).is_err());
        assert!(
            turns(r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#).is_err()
        );
    }
}
