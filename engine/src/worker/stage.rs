use std::collections::HashMap;
use std::sync::Arc;

use web_time::Instant;

use crate::backend::Device;
use crate::gguf::TensorSource;
use crate::kernels::SampleParams;
use crate::model::shard::DEFAULT_MAX_BATCH;
use crate::model::{KvCache, ModelError, Shard, ShardInput, ShardOutput, Want};
use crate::protocol::{DType, LayerRange, Message, Telemetry, Tensor, error_code};

/// Most requests with a live KV cache at once; more are refused (`OVERLOADED`)
/// rather than growing memory without bound.
pub const MAX_REQUESTS: usize = 64;

/// A worker's serving state: its shard and one KV cache per request.
pub struct StageServer {
    device: Arc<Device>,
    shard: Option<Shard>,
    caches: HashMap<u64, KvCache>,
    started: Instant,
    /// Forward calls and the seconds they took since the last telemetry.
    window_calls: u32,
    window_busy_s: f64,
    window_tokens: u64,
    window_start: Instant,
    last_kernel_ms: f64,
}

/// Loads layers `start..end` from `src` and waits until they are on the device;
/// returns the shard and the `ShardLoaded` message that reports it.
pub async fn load_shard(
    device: Arc<Device>,
    src: &dyn TensorSource,
    start: usize,
    end: usize,
) -> Result<(Shard, Message), ModelError> {
    let t0 = Instant::now();
    let before = device.live_bytes();
    let shard = Shard::load(
        device.clone(),
        src,
        start,
        end,
        DEFAULT_MAX_BATCH,
        &mut |_, _| {},
    )?;
    device.sync().await?;
    let loaded = Message::ShardLoaded {
        layers: LayerRange {
            start: start as u32,
            end: end as u32,
        },
        weight_bytes: device.live_bytes().saturating_sub(before),
        load_ms: t0.elapsed().as_millis().min(u32::MAX as u128) as u32,
    };
    Ok((shard, loaded))
}

impl StageServer {
    pub fn new(device: Arc<Device>) -> StageServer {
        StageServer {
            device,
            shard: None,
            caches: HashMap::new(),
            started: Instant::now(),
            window_calls: 0,
            window_busy_s: 0.0,
            window_tokens: 0,
            window_start: Instant::now(),
            last_kernel_ms: 0.0,
        }
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Installs a loaded shard; the old one's caches go with it.
    pub fn set_shard(&mut self, shard: Shard) {
        self.caches.clear();
        self.shard = Some(shard);
    }

    /// Drops every request's cache, keeping the shard.
    pub fn clear_requests(&mut self) {
        self.caches.clear();
    }

    /// Drops the shard and every cache (frees device memory).
    pub fn clear(&mut self) {
        self.caches.clear();
        self.shard = None;
    }

    /// The loaded layer range.
    pub fn layers(&self) -> Option<(usize, usize)> {
        self.shard.as_ref().map(|s| s.range())
    }

    /// Handles a coordinator message; returns the reply, if it has one.
    /// `LoadShard` is the host's (it knows where bytes come from); other
    /// messages not meant for a stage get `None`.
    pub async fn handle(&mut self, msg: Message) -> Option<Message> {
        match msg {
            Message::Forward {
                request,
                seq,
                layers,
                pos0,
                max_len,
                sample,
                tensor,
            } => Some(
                match self
                    .forward(request, layers, pos0, max_len, sample, &tensor)
                    .await
                {
                    Ok(ShardOutput::Token(id)) => Message::Token { request, seq, id },
                    Ok(ShardOutput::Hidden(h)) => {
                        let dim = self.shard.as_ref().map_or(1, |s| s.config().dim);
                        let rows = (h.len() / dim.max(1)) as u64;
                        match Tensor::from_f32(vec![rows, dim as u64], &h) {
                            Ok(tensor) => Message::Activations {
                                request,
                                seq,
                                pos0,
                                tensor,
                            },
                            Err(e) => request_error(request, seq, error_code::INTERNAL, e),
                        }
                    }
                    Ok(ShardOutput::Logits(_)) => request_error(
                        request,
                        seq,
                        error_code::INTERNAL,
                        "the shard returned logits where a token was asked for",
                    ),
                    Err((code, text)) => {
                        // The cache may hold half a step; the coordinator restarts the request.
                        self.caches.remove(&request);
                        request_error(request, seq, code, text)
                    }
                },
            ),
            Message::EndRequest { request } => {
                self.caches.remove(&request);
                None
            }
            Message::Calibrate { config } => Some(match serde_json::from_str(&config) {
                Ok(cfg) => match super::calibrate(self.device.clone(), &cfg).await {
                    Ok(c) => Message::Calibration(c),
                    Err(e) => Message::Error {
                        code: error_code::INTERNAL,
                        text: format!("calibration failed: {e}"),
                    },
                },
                Err(e) => Message::Error {
                    code: error_code::BAD_REQUEST,
                    text: format!("calibration config is not a model config: {e}"),
                },
            }),
            _ => None,
        }
    }

    async fn forward(
        &mut self,
        request: u64,
        layers: LayerRange,
        pos0: u32,
        max_len: u32,
        sample: Option<SampleParams>,
        tensor: &Tensor,
    ) -> Result<ShardOutput, (u16, String)> {
        let bad = |text: String| (error_code::BAD_REQUEST, text);
        let shard = self
            .shard
            .as_ref()
            .ok_or((error_code::UNSUPPORTED, "no shard is loaded".to_owned()))?;
        let (start, end) = shard.range();
        if (layers.start as usize, layers.end as usize) != (start, end) {
            // Not the request's fault: the placement moved; the coordinator retries.
            return Err((
                error_code::UNSUPPORTED,
                format!(
                    "this peer holds layers {start}..{end}, not {}..{}",
                    layers.start, layers.end
                ),
            ));
        }
        let cfg = shard.config();
        let pos0 = pos0 as usize;
        if pos0 == 0 {
            self.caches.remove(&request);
        }
        if !self.caches.contains_key(&request) {
            if pos0 != 0 {
                return Err(bad(format!(
                    "request {request} is unknown here and starts at position {pos0}, not 0"
                )));
            }
            if self.caches.len() >= MAX_REQUESTS {
                return Err((
                    error_code::OVERLOADED,
                    format!("{MAX_REQUESTS} requests already hold a KV cache here"),
                ));
            }
            let capacity = (max_len as usize).clamp(1, cfg.context_length.max(1));
            let cache = shard
                .new_cache(capacity)
                .map_err(|e| (error_code::OVERLOADED, e.to_string()))?;
            self.caches.insert(request, cache);
        }
        let Some(cache) = self.caches.get_mut(&request) else {
            return Err((error_code::INTERNAL, "cache vanished".into()));
        };
        if pos0 > cache.len() {
            return Err(bad(format!(
                "position {pos0} skips past the {} positions request {request} holds",
                cache.len()
            )));
        }
        cache.truncate(pos0);
        let want = if shard.is_last() {
            Want::Sample(sample.unwrap_or_default())
        } else {
            Want::Hidden
        };
        let t0 = Instant::now();
        let tokens;
        let values;
        let hidden;
        let input = match tensor.dtype() {
            DType::U32 if shard.is_first() => {
                values = tensor.to_values::<u32>().map_err(|e| bad(e.to_string()))?;
                tokens = values.len();
                ShardInput::Tokens(&values)
            }
            DType::F32 if !shard.is_first() => {
                hidden = tensor.to_f32().map_err(|e| bad(e.to_string()))?;
                tokens = hidden.len() / cfg.dim.max(1);
                ShardInput::Hidden(&hidden)
            }
            other => {
                return Err(bad(format!(
                    "a shard of layers {}..{} takes {}, not {other:?}",
                    shard.range().0,
                    shard.range().1,
                    if shard.is_first() {
                        "U32 token ids"
                    } else {
                        "F32 hidden states"
                    }
                )));
            }
        };
        let out = shard.forward(cache, input, want).await.map_err(|e| {
            let code = match e {
                ModelError::Backend(_) => error_code::INTERNAL,
                _ => error_code::BAD_REQUEST,
            };
            (code, e.to_string())
        })?;
        let took = t0.elapsed().as_secs_f64();
        self.window_calls += 1;
        self.window_busy_s += took;
        self.window_tokens += tokens as u64;
        self.last_kernel_ms = took * 1e3;
        Ok(out)
    }

    /// Telemetry since the last call: utilization, forward time, memory.
    pub fn telemetry(&mut self) -> Telemetry {
        let window = self.window_start.elapsed().as_secs_f64().max(1e-3);
        let t = Telemetry {
            uptime_ms: self.started.elapsed().as_millis() as u64,
            queue_depth: 0,
            tokens_per_s: (self.window_tokens as f64 / window) as f32,
            memory_used_bytes: self.device.live_bytes(),
            memory_total_bytes: self.device.info().memory_bytes,
            extra: serde_json::json!({
                "utilization": (self.window_busy_s / window).min(1.0),
                "kernel_ms": self.last_kernel_ms,
                // The mean over this window's calls: steadier than the last.
                "forward_ms": (self.window_calls > 0)
                    .then(|| self.window_busy_s * 1e3 / self.window_calls as f64),
                "forwards": self.window_calls,
                "requests": self.caches.len(),
                "layers": self.layers().map(|(a, b)| [a, b]),
            })
            .to_string(),
        };
        self.window_calls = 0;
        self.window_busy_s = 0.0;
        self.window_tokens = 0;
        self.window_start = Instant::now();
        t
    }
}

fn request_error(request: u64, seq: u32, code: u16, text: impl ToString) -> Message {
    Message::RequestError {
        request,
        seq,
        code,
        text: text.to_string(),
    }
}
