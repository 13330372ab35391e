//! `cairn bench cluster`: what distribution costs. Real processes on
//! loopback (`cairn serve --no-local-worker` with its embedded cairn-signal,
//! and N `cairn worker`s) serve one model; the figures come from the
//! OpenAI API's token stream, as a client sees them, beside `cairn bench` on
//! one device with the same backend, measured in the same run.
//!
//! For each worker count: single-request decode tokens/s (the layers split
//! evenly, in order, by a manual placement, measured once the links between
//! the workers are up), where a token's time goes (the stages' compute as
//! the workers report it, and the rest), the hops the coordinator relayed
//! and the tokens passed straight from the last stage to the first, the
//! placement preview's prediction for that placement, and the aggregate
//! tokens/s of concurrent requests. Then, on the largest cluster, one worker
//! is killed (SIGKILL) in the middle of a stream: the stall it causes,
//! whether the coordinator recovered, and whether the output still equals
//! the uninterrupted one.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cairn_engine::model::ModelConfig;
use cairn_engine::model::synthetic::SyntheticModel;
use futures::StreamExt as _;
use serde_json::{Value, json};

use super::bench::prompt_ids;
use super::model_args::ModelArgs;

#[derive(clap::Args)]
pub struct Args {
    /// The model; a synthetic one is written to a temporary GGUF file.
    #[command(flatten)]
    model: ModelArgs,
    /// Backend of every worker and of the one-device baseline.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Device ids (from `cairn devices`), given to the workers in turn; the
    /// baseline runs on the first. Default: each process's automatic choice.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Worker counts to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 3])]
    workers: Vec<usize>,
    /// Prompt length; the prompt is token ids (1000 + 7919 i) mod vocab, as in `cairn bench`.
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// Tokens generated per request (greedy, past end-of-generation).
    #[arg(long, default_value_t = 32)]
    gen_tokens: usize,
    /// Measured single requests per worker count (after one warm-up); medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Requests at once for the aggregate figure (0 skips it).
    #[arg(long, default_value_t = 4)]
    concurrent: usize,
    /// Give the N devices to one worker (`cairn worker --device d0,d1,...`, its layers split
    /// over them in one process) instead of starting N workers: the multi-device worker
    /// against the chain across processes. Needs N ids in --devices.
    #[arg(long)]
    one_worker: bool,
    /// How the --one-worker worker spreads its stage over its devices (`cairn worker
    /// --split`): `layers`, `tensor`, or `auto` (the coordinator's placement chooses from the
    /// worker's calibration of both; the bench then places nothing itself).
    #[arg(long, default_value = "auto", requires = "one_worker")]
    split: String,
    /// How the layers are cut between the workers: `layers` (the same count each),
    /// `bytes` (about the same weight bytes each, the output head counted on the last stage:
    /// a decode step reads every weight once, so equal bytes is about equal time where
    /// reading bounds it), or `time` (the slowest stage as fast as it can be, by each
    /// worker's calibration: its call overhead, its time per layer, and on the last stage
    /// the output head), or `served` (cut by time, then a stream served, then cut again
    /// by each stage's forward time as its worker measured it while serving: calibrations
    /// taken on a loaded machine scatter). Equal stage times are what keep every stage of
    /// a pipeline busy under concurrent requests; `calibrated_stage_ms` in the JSON is the
    /// stage times the cut was made for.
    #[arg(long, default_value = "layers", value_parser = ["layers", "bytes", "time", "served"])]
    balance: String,
    /// The coordinator's `--spot-check-rate` (`cairn serve` defaults to 0.01). A checked
    /// token is held back while the coordinator recomputes it on its own cpu engine over the
    /// whole model, which stalls a stream for as long as that prefill takes (seconds for an
    /// 8B): 0 measures distribution alone. Each row counts the checks made.
    #[arg(long, default_value_t = 0.0)]
    spot_check_rate: f64,
    /// Skip killing a worker on the largest cluster.
    #[arg(long)]
    no_recovery: bool,
    /// Keep the processes' logs in this directory.
    #[arg(long)]
    logs: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A child process killed when dropped; its stdout lines arrive on a channel.
struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(exe: &Path, args: &[String], logs: &Path, name: &str) -> Result<Proc> {
        let log = std::fs::File::create(logs.join(format!("{name}.log")))
            .with_context(|| format!("creating a log file in {}", logs.display()))?;
        let mut child = Command::new(exe)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,cairn_native=info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let stdout = child.stdout.take().context("stdout is piped")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Proc {
            name: name.to_owned(),
            child,
            lines,
        })
    }

    /// The first stdout line containing `needle`.
    fn wait_line(&mut self, needle: &str, within: Duration) -> Result<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return Ok(line),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    bail!("{} printed no '{needle}' within {within:?}", self.name)
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    bail!(
                        "{} exited before printing '{needle}' (see its log)",
                        self.name
                    )
                }
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A model file for the run: the one given, or a synthetic one written out.
fn model_file(a: &Args, dir: &Path) -> Result<(PathBuf, String)> {
    match a.model.synthetic_config()? {
        Some((name, cfg)) => {
            let path = dir.join(format!("synthetic-{name}.gguf"));
            let file = std::fs::File::create(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            // Seed 1, as `cairn bench --synthetic` uses.
            SyntheticModel::new(&cfg, 1)
                .write_gguf(std::io::BufWriter::new(file))
                .with_context(|| format!("writing {}", path.display()))?;
            Ok((path, format!("synthetic {name}")))
        }
        None => {
            let path = a.model.path()?;
            let name = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            Ok((path, name))
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `n` contiguous layer ranges, as even as the layer count allows.
fn even_split(layers: usize, n: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|i| (layers * i / n, layers * (i + 1) / n))
        .collect()
}

/// `n` contiguous layer ranges, each ending where the running total of `bytes` (per layer;
/// `tail` more after the last, the output head) first reaches its share, every range at
/// least one layer.
fn byte_split(bytes: &[u64], tail: u64, n: usize) -> Vec<(usize, usize)> {
    let layers = bytes.len();
    let total: u64 = bytes.iter().sum::<u64>() + tail;
    let mut out = Vec::with_capacity(n);
    let (mut start, mut sum) = (0, 0u64);
    for k in 0..n {
        let left = n - k - 1;
        let mut end = start + 1;
        sum += bytes.get(start).copied().unwrap_or(0);
        // Stop at the layer that brings the total nearest to this stage's share.
        let goal = total as f64 * (k + 1) as f64 / n as f64;
        while end + left < layers {
            let next = sum + bytes[end];
            if (next as f64 - goal).abs() >= (sum as f64 - goal).abs() {
                break;
            }
            sum = next;
            end += 1;
        }
        if left == 0 {
            end = layers;
        }
        out.push((start, end));
        start = end;
    }
    out
}

/// Weight bytes per layer of `file`, and the output head's (the token embedding where the
/// head is tied to it).
/// One worker's calibration as the split by time uses it: seconds of a call's fixed cost, of
/// one layer, and of the output head.
#[derive(Clone, Copy, Debug, PartialEq)]
struct StageCost {
    overhead_s: f64,
    layer_s: f64,
    head_s: f64,
}

impl StageCost {
    fn of(&self, layers: usize, last: bool) -> f64 {
        self.overhead_s + layers as f64 * self.layer_s + if last { self.head_s } else { 0.0 }
    }
}

/// Contiguous layer ranges, one per worker in order (each at least one layer), whose
/// slowest stage by `costs` is as fast as any cut makes it (a programme over the cut
/// points: layers × layers × workers).
fn time_split(costs: &[StageCost], layers: usize) -> Vec<(usize, usize)> {
    let n = costs.len();
    if n == 0 || layers < n {
        return even_split(layers, n.max(1));
    }
    // best[i][j]: the slowest of workers 0..=i holding layers 0..j; from[i][j] where
    // worker i's range starts.
    let mut best = vec![vec![f64::INFINITY; layers + 1]; n];
    let mut from = vec![vec![0usize; layers + 1]; n];
    for (i, c) in costs.iter().enumerate() {
        let last = i + 1 == n;
        for j in (i + 1)..=layers {
            if last && j != layers {
                continue;
            }
            for k in i..j {
                let before = if i == 0 {
                    if k > 0 {
                        continue;
                    }
                    0.0
                } else {
                    best[i - 1][k]
                };
                let t = before.max(c.of(j - k, last));
                if t < best[i][j] {
                    best[i][j] = t;
                    from[i][j] = k;
                }
            }
        }
    }
    let mut out = vec![(0, 0); n];
    let mut end = layers;
    for i in (0..n).rev() {
        let start = from[i][end];
        out[i] = (start, end);
        end = start;
    }
    out
}

/// Per-worker costs that give the `served` ms measured on `cut`: each stage but the last
/// costs its served time over its layers a layer (its call overhead folded in); the last
/// stage's layers cost its calibrated layer time scaled as the other stages' served times
/// scale theirs, and its head the rest. None when a stage has no measurement.
fn served_costs(
    calibrated: &[StageCost],
    cut: &[(usize, usize)],
    served: &[Option<f64>],
) -> Option<Vec<StageCost>> {
    let n = cut.len();
    if n < 2 || calibrated.len() != n || served.len() != n {
        return None;
    }
    let ms: Vec<f64> = served.iter().copied().collect::<Option<_>>()?;
    let mut out: Vec<StageCost> = Vec::with_capacity(n);
    let mut scale = Vec::new();
    for i in 0..n - 1 {
        let layers = (cut[i].1 - cut[i].0).max(1) as f64;
        let layer_s = ms[i] / 1e3 / layers;
        scale.push(layer_s / calibrated[i].layer_s.max(1e-12));
        out.push(StageCost {
            overhead_s: 0.0,
            layer_s,
            head_s: 0.0,
        });
    }
    scale.sort_by(f64::total_cmp);
    let last = &calibrated[n - 1];
    let layer_s = last.layer_s * scale[scale.len() / 2];
    let layers = (cut[n - 1].1 - cut[n - 1].0) as f64;
    let head_s = (ms[n - 1] / 1e3 - layers * layer_s).max(0.0);
    out.push(StageCost {
        overhead_s: 0.0,
        layer_s,
        head_s,
    });
    Some(out)
}

fn layer_bytes(file: &cairn_engine::gguf::GgufFile, layers: usize) -> (Vec<u64>, u64) {
    let mut per = vec![0u64; layers];
    for t in &file.tensors {
        let layer = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        if let Some(i) = layer.filter(|&i| i < layers) {
            per[i] += t.n_bytes;
        }
    }
    let head = file
        .tensor("output.weight")
        .or_else(|| file.tensor("token_embd.weight"))
        .map_or(0, |t| t.n_bytes);
    (per, head)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// One streamed completion as the client saw it.
struct Streamed {
    sent: Instant,
    /// When each chunk carrying text arrived.
    stamps: Vec<Instant>,
    text: String,
    completion_tokens: u64,
}

impl Streamed {
    fn decode_tok_s(&self) -> f64 {
        match (self.stamps.first(), self.stamps.last()) {
            (Some(a), Some(b)) if self.stamps.len() > 1 => {
                (self.stamps.len() - 1) as f64 / (*b - *a).as_secs_f64()
            }
            _ => f64::NAN,
        }
    }
    /// The longest wait between two tokens: a stall (a spot check holding tokens back, a
    /// recovery) shows here where a rate averages it away.
    fn longest_gap_ms(&self) -> f64 {
        self.stamps
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
            .fold(f64::NAN, f64::max)
    }
    fn ttft_ms(&self) -> f64 {
        self.stamps
            .first()
            .map_or(f64::NAN, |t| (*t - self.sent).as_secs_f64() * 1e3)
    }
}

struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    async fn get(&self, path: &str) -> Result<Value> {
        let r = self.http.get(format!("{}{path}", self.base)).send().await?;
        let status = r.status();
        let body: Value = r.json().await?;
        if !status.is_success() {
            bail!("GET {path}: {status}: {body}");
        }
        Ok(body)
    }

    async fn post(&self, path: &str, body: &Value) -> Result<Value> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await?;
        let status = r.status();
        let body: Value = r.json().await?;
        if !status.is_success() {
            bail!("POST {path}: {status}: {body}");
        }
        Ok(body)
    }

    /// Streams a greedy completion of `prompt`; `on_chunk(i)` runs as text chunk `i` arrives.
    async fn stream(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        mut on_chunk: impl FnMut(usize),
    ) -> Result<Streamed> {
        let body = json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        });
        let sent = Instant::now();
        let r = self
            .http
            .post(format!("{}/v1/completions", self.base))
            .json(&body)
            .send()
            .await?;
        if !r.status().is_success() {
            let status = r.status();
            bail!("completion refused: {status}: {}", r.text().await?);
        }
        let mut out = Streamed {
            sent,
            stamps: Vec::new(),
            text: String::new(),
            completion_tokens: 0,
        };
        let mut bytes = r.bytes_stream();
        let mut buf = Vec::new();
        while let Some(piece) = bytes.next().await {
            buf.extend_from_slice(&piece?);
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                let event = String::from_utf8_lossy(&event);
                for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                    if data == "[DONE]" {
                        continue;
                    }
                    let v: Value = serde_json::from_str(data)
                        .with_context(|| format!("a stream event is not JSON: {data}"))?;
                    if let Some(err) = v.get("error") {
                        bail!("the stream failed: {err}");
                    }
                    if let Some(t) = v["choices"][0]["text"].as_str()
                        && !t.is_empty()
                    {
                        out.stamps.push(Instant::now());
                        out.text.push_str(t);
                        on_chunk(out.stamps.len() - 1);
                    }
                    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                        out.completion_tokens = n;
                    }
                }
            }
        }
        if out.completion_tokens != max_tokens as u64 {
            bail!(
                "asked for {max_tokens} tokens, the stream reported {}",
                out.completion_tokens
            );
        }
        Ok(out)
    }
}

/// A coordinator and its workers.
struct Cluster {
    api: Api,
    port: u16,
    token: String,
    _serve: Proc,
    workers: Vec<(Proc, String)>,
}

impl Cluster {
    fn start(a: &Args, exe: &Path, model: &Path, logs: &Path, tag: &str) -> Result<Cluster> {
        let port = free_port()?;
        let ctx = (a.prompt_tokens + 3 * a.gen_tokens + 16).max(256);
        let args: Vec<String> = [
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--model",
            &model.to_string_lossy(),
            "--no-local-worker",
            "--no-mdns",
            "--parallel",
            &a.concurrent.max(1).to_string(),
            "--ctx",
            &ctx.to_string(),
            "--spot-check-rate",
            &a.spot_check_rate.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut serve = Proc::spawn(exe, &args, logs, &format!("{tag}-serve"))?;
        let join = serve.wait_line("join:", Duration::from_secs(60))?;
        let token = join
            .split("token=")
            .nth(1)
            .context("the join URL has no token")?
            .trim()
            .to_owned();
        Ok(Cluster {
            api: Api {
                base: format!("http://127.0.0.1:{port}"),
                http: reqwest::Client::new(),
            },
            port,
            token,
            _serve: serve,
            workers: Vec::new(),
        })
    }

    fn add_worker(
        &mut self,
        a: &Args,
        exe: &Path,
        model: &Path,
        logs: &Path,
        name: &str,
        devices: Option<String>,
    ) -> Result<()> {
        let mut args: Vec<String> = [
            "worker",
            "--signal",
            &format!("ws://127.0.0.1:{}", self.port),
            "--token",
            &self.token,
            "--model",
            &model.to_string_lossy(),
            "--backend",
            &a.backend,
            "--loopback",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(d) = devices {
            args.extend(["--device".to_owned(), d]);
            args.extend(["--split".to_owned(), a.split.clone()]);
        } else if !a.devices.is_empty() {
            let d = &a.devices[self.workers.len() % a.devices.len()];
            args.extend(["--device".to_owned(), d.clone()]);
        }
        let mut p = Proc::spawn(exe, &args, logs, name)?;
        let line = p.wait_line("joined room", Duration::from_secs(60))?;
        let id = line
            .rsplit(' ')
            .next()
            .context("no peer id in the join line")?
            .to_owned();
        self.workers.push((p, id));
        Ok(())
    }

    /// The stages of the ready placement, once it is ready.
    async fn ready_stages(&self) -> Result<Option<Vec<(String, u64, u64)>>> {
        let c = self.api.get("/api/cluster").await?;
        if c["placement"]["state"] != "ready" {
            return Ok(None);
        }
        Ok(c["placement"]["stages"].as_array().map(|a| {
            a.iter()
                .map(|s| {
                    (
                        s["peer_id"].as_str().unwrap_or_default().to_owned(),
                        s["start"].as_u64().unwrap_or(0),
                        s["end"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        }))
    }

    /// Places `split` on the workers in order and waits until it is loaded. With `post`
    /// false the bench places nothing and waits for the coordinator's own placement to be
    /// `split` (one worker holding every layer: the stage split as placement chose).
    async fn place(&self, split: &[(usize, usize)], post: bool) -> Result<Vec<(String, u64, u64)>> {
        let want: Vec<(String, u64, u64)> = self
            .workers
            .iter()
            .zip(split)
            .map(|((_, id), &(s, e))| (id.clone(), s as u64, e as u64))
            .collect();
        let stages: Vec<Value> = want
            .iter()
            .map(|(id, s, e)| json!({"peer_id": id, "start": s, "end": e}))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(300);
        // A worker that has joined is unknown to the placer until its
        // capabilities and calibration arrive.
        if post {
            loop {
                match self
                    .api
                    .post("/api/placement", &json!({ "stages": stages }))
                    .await
                {
                    Ok(_) => break,
                    Err(e)
                        if e.to_string().contains("unknown device")
                            && Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        loop {
            if self.ready_stages().await?.as_ref() == Some(&want) {
                break;
            }
            if Instant::now() > deadline {
                bail!("the placement {want:?} was not ready within 300 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Measure the chain, not the relays that stand in while the links
        // between workers come up.
        let linked_by = Instant::now() + Duration::from_secs(30);
        loop {
            let c = self.api.get("/api/cluster").await?;
            let stages = c["placement"]["stages"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if stages
                .iter()
                .all(|s| s["direct"] != true || s["linked"] == true)
            {
                return Ok(want);
            }
            if Instant::now() > linked_by {
                eprintln!("warning: links between workers not all up after 30 s; measuring anyway");
                return Ok(want);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Each worker's calibration, in worker order, once every one has reported it.
    async fn calibrations(&self) -> Result<Vec<StageCost>> {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let c = self.api.get("/api/cluster").await?;
            let of = |id: &str| {
                let p = c["peers"].as_array()?.iter().find(|p| p["peer_id"] == id)?;
                let k = &p["calibration"];
                Some(StageCost {
                    overhead_s: k["call_overhead_s"].as_f64()?,
                    layer_s: k["decode_s_per_layer"].as_f64()?,
                    head_s: k["head_s"].as_f64()?,
                })
            };
            let got: Option<Vec<StageCost>> = self.workers.iter().map(|(_, id)| of(id)).collect();
            if let Some(got) = got {
                return Ok(got);
            }
            if Instant::now() > deadline {
                bail!("the workers' calibrations did not arrive within 300 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Each stage's mean forward ms over a stream of `tokens`: the workers' telemetry
    /// (windows of about a second) read while it runs and until every stage has reported a
    /// window with passes in it, at most 5 s after.
    async fn served_forward_ms(
        &self,
        stages: &[(String, u64, u64)],
        prompt: &[u32],
        tokens: usize,
    ) -> Result<Vec<Option<f64>>> {
        let finished = std::sync::atomic::AtomicBool::new(false);
        let run = async {
            let r = self.api.stream(prompt, tokens, |_| {}).await;
            finished.store(true, std::sync::atomic::Ordering::SeqCst);
            r
        };
        let poll = async {
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); stages.len()];
            let mut after: Option<Instant> = None;
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if let Ok(now) = self.forward_ms(stages).await {
                    for (s, v) in samples.iter_mut().zip(now) {
                        // One window read twice counts twice: a mean of means, near enough.
                        s.extend(v);
                    }
                }
                if finished.load(std::sync::atomic::Ordering::SeqCst) {
                    let since = *after.get_or_insert_with(Instant::now);
                    if samples.iter().all(|s| !s.is_empty())
                        || since.elapsed() > Duration::from_secs(5)
                    {
                        return samples;
                    }
                }
            }
        };
        let (done, samples) = futures::future::join(run, poll).await;
        done?;
        Ok(samples
            .iter()
            .map(|s| (!s.is_empty()).then(|| s.iter().sum::<f64>() / s.len() as f64))
            .collect())
    }

    /// Each stage's mean forward ms in its worker's last telemetry, in stage order.
    async fn forward_ms(&self, stages: &[(String, u64, u64)]) -> Result<Vec<Option<f64>>> {
        let c = self.api.get("/api/cluster").await?;
        Ok(stages
            .iter()
            .map(|(id, _, _)| {
                c["peers"]
                    .as_array()?
                    .iter()
                    .find(|p| p["peer_id"] == id.as_str())?["telemetry"]["forward_ms"]
                    .as_f64()
            })
            .collect())
    }

    /// Spot checks the coordinator has made (right, wrong or unchecked).
    async fn spot_checks(&self) -> Result<u64> {
        let c = self.api.get("/api/cluster").await?;
        let n = |k: &str| c["spot_checks"][k].as_u64().unwrap_or(0);
        Ok(n("right") + n("wrong") + n("unchecked"))
    }

    /// The coordinator's counts of relayed hops and tokens passed on.
    async fn hop_counts(&self) -> Result<(u64, u64)> {
        let c = self.api.get("/api/cluster").await?;
        Ok((
            c["requests"]["relayed"].as_u64().unwrap_or(0),
            c["requests"]["passed_on"].as_u64().unwrap_or(0),
        ))
    }
}

/// `cairn bench` on one device in a child process: the baseline.
/// A stage's busy share and mean batch inside the concurrent phase, from its cumulative
/// counters (`busy_total_s`, `passes_total`, `seqs_total`) between the second and the last
/// distinct reports seen while the requests ran: the first may have been made before they
/// started, and each report's window straddles whatever came before it, so only differences
/// of later reports are wholly inside the phase. `None` with fewer than three reports (a
/// phase shorter than about three seconds: ask for more `--gen-tokens`).
fn phase_load(samples: &[Value], id: &str) -> (Option<f64>, Option<f64>) {
    let mut reports: Vec<(u64, f64, u64, u64)> = Vec::new();
    for s in samples {
        let Some(t) = s["peers"]
            .as_array()
            .and_then(|peers| peers.iter().find(|p| p["peer_id"] == id))
            .map(|p| &p["telemetry"])
        else {
            continue;
        };
        let (Some(up), Some(busy), Some(passes), Some(seqs)) = (
            t["uptime_ms"].as_u64(),
            t["busy_total_s"].as_f64(),
            t["passes_total"].as_u64(),
            t["seqs_total"].as_u64(),
        ) else {
            continue;
        };
        if reports.last().is_none_or(|r| r.0 != up) {
            reports.push((up, busy, passes, seqs));
        }
    }
    let (Some(first), Some(last)) = (reports.get(1), reports.last()) else {
        return (None, None);
    };
    if last.0 <= first.0 {
        return (None, None);
    }
    let busy = (last.1 - first.1) / ((last.0 - first.0) as f64 / 1e3);
    let passes = last.2.saturating_sub(first.2);
    let batch = (passes > 0).then(|| last.3.saturating_sub(first.3) as f64 / passes as f64);
    (Some(busy.clamp(0.0, 1.0)), batch)
}

fn baseline(a: &Args, exe: &Path, model: &Path, logs: &Path) -> Result<Value> {
    let mut args: Vec<String> = [
        "bench",
        "--model",
        &model.to_string_lossy(),
        "--backend",
        &a.backend,
        "--prompt-tokens",
        &a.prompt_tokens.to_string(),
        "--gen-tokens",
        &a.gen_tokens.to_string(),
        "--runs",
        &a.runs.to_string(),
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(d) = a.devices.first() {
        args.extend(["--device".to_owned(), d.clone()]);
    }
    let mut p = Proc::spawn(exe, &args, logs, "baseline")?;
    let line = p.wait_line("decode_tokens_per_s", Duration::from_secs(1800))?;
    Ok(serde_json::from_str(&line)?)
}

pub fn run(a: Args) -> Result<()> {
    if a.workers.is_empty() || a.workers.contains(&0) || a.runs == 0 || a.gen_tokens < 4 {
        bail!("--workers needs counts of at least 1, --runs at least 1, --gen-tokens at least 4");
    }
    if !(0.0..=1.0).contains(&a.spot_check_rate) {
        bail!("--spot-check-rate is a share, 0 to 1");
    }
    let tmp = std::env::temp_dir().join(format!("cairn-bench-cluster-{}", std::process::id()));
    let logs = a.logs.clone().unwrap_or_else(|| tmp.clone());
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    std::fs::create_dir_all(&tmp)?;
    let exe = std::env::current_exe().context("finding the cairn executable")?;
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(measure(&a, &exe, &tmp, &logs));
    match &result {
        Ok(_) => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Err(_) => eprintln!("logs kept in {}", logs.display()),
    }
    let out = result?;
    if a.json {
        println!("{out}");
    } else {
        print_table(&out);
    }
    Ok(())
}

async fn measure(a: &Args, exe: &Path, tmp: &Path, logs: &Path) -> Result<Value> {
    let (model, what) = model_file(a, tmp)?;
    let (cfg, (bytes, head)) = {
        let f = cairn_engine::gguf::MappedGguf::open(&model)
            .with_context(|| format!("opening {}", model.display()))?;
        let cfg = ModelConfig::from_gguf(&f.file)?;
        let bytes = layer_bytes(&f.file, cfg.n_layers);
        (cfg, bytes)
    };
    let split = |n: usize| match a.balance.as_str() {
        "bytes" => byte_split(&bytes, head, n),
        _ => even_split(cfg.n_layers, n),
    };
    // What each stage of the placement measured costs a token by its worker's
    // calibration (the split by time evens these out).
    let calibrated_ms = |costs: &[StageCost], split: &[(usize, usize)]| -> Vec<f64> {
        costs
            .iter()
            .zip(split)
            .enumerate()
            .map(|(i, (c, &(s, e)))| c.of(e - s, i + 1 == split.len()) * 1e3)
            .collect()
    };
    let say = |s: String| {
        if !a.json {
            eprintln!("{s}");
        }
    };
    say(format!(
        "baseline: cairn bench on one {} device, {what}",
        a.backend
    ));
    let base = baseline(a, exe, &model, logs)?;
    let base_tok_s = base["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
    let prompt = prompt_ids(a.prompt_tokens, cfg.vocab_size);
    let mut clusters = Vec::new();
    let mut recovery = Value::Null;
    let largest = a.workers.iter().copied().max().unwrap_or(1);
    for &n in &a.workers {
        if n > cfg.n_layers {
            bail!("{n} workers for {} layers", cfg.n_layers);
        }
        say(format!("{n} worker(s): starting"));
        let tag = format!("w{n}");
        let mut c = Cluster::start(a, exe, &model, logs, &tag)?;
        let mut calibrated = Vec::new();
        let mut served_split = Value::Null;
        let stages = if a.one_worker && n > 1 {
            if a.devices.len() < n {
                bail!("--one-worker with {n} devices needs {n} ids in --devices");
            }
            let ids = a.devices[..n].join(",");
            c.add_worker(a, exe, &model, logs, &format!("{tag}-worker0"), Some(ids))?;
            c.place(&even_split(cfg.n_layers, 1), a.split != "auto")
                .await?
        } else {
            // One at a time, each after the one before has calibrated: workers sharing a
            // machine that calibrate at once time each other's load.
            for i in 0..n {
                c.add_worker(a, exe, &model, logs, &format!("{tag}-worker{i}"), None)?;
                c.calibrations().await?;
            }
            let costs = c.calibrations().await?;
            let cut = match a.balance.as_str() {
                "time" | "served" => time_split(&costs, cfg.n_layers),
                _ => split(n),
            };
            calibrated = calibrated_ms(&costs, &cut);
            let placed = c.place(&cut, true).await?;
            if a.balance == "served" && n > 1 {
                // Each stage's forward time over a stream, then the cut that evens those out.
                let served = c.served_forward_ms(&placed, &prompt, a.gen_tokens).await?;
                match served_costs(&costs, &cut, &served) {
                    Some(measured) => {
                        let again = time_split(&measured, cfg.n_layers);
                        say(format!(
                            "  served stage ms {served:?} on {cut:?}: cutting {again:?} instead"
                        ));
                        served_split = json!({"first_cut": cut, "served_ms": served});
                        calibrated = calibrated_ms(&measured, &again);
                        c.place(&again, true).await?
                    }
                    None => {
                        eprintln!(
                            "warning: no served stage times ({served:?}); keeping the cut by calibration"
                        );
                        placed
                    }
                }
            } else {
                placed
            }
        };
        // How each stage ran: the coordinator's placement says (a worker told `--split
        // layers` or `tensor` keeps its own whatever the placement says).
        let split_ran: Vec<Value> = c.api.get("/api/cluster").await?["placement"]["stages"]
            .as_array()
            .map(|a| a.iter().map(|s| s["split"].clone()).collect())
            .unwrap_or_default();
        let preview = c
            .api
            .get(&format!(
                "/api/placement/preview?prompt_tokens={}",
                a.prompt_tokens
            ))
            .await?;
        let predicted = preview["chosen"]["tokens_per_s"].as_f64();
        // Warm-up: every stage compiles its kernels and fills its caches once.
        c.api.stream(&prompt, 4, |_| {}).await?;
        let (relayed_before, passed_before) = c.hop_counts().await?;
        let checks_before = c.spot_checks().await?;
        let mut decode = Vec::new();
        let mut ttft = Vec::new();
        let mut e2e = Vec::new();
        let mut gaps = Vec::new();
        let mut reference = String::new();
        for r in 0..a.runs {
            let s = c.api.stream(&prompt, a.gen_tokens, |_| {}).await?;
            say(format!(
                "  run {r}: decode {:.2} tok/s, first token {:.0} ms",
                s.decode_tok_s(),
                s.ttft_ms()
            ));
            decode.push(s.decode_tok_s());
            ttft.push(s.ttft_ms());
            gaps.push(s.longest_gap_ms());
            if let Some(t) = s.stamps.last() {
                e2e.push(a.gen_tokens as f64 / (*t - s.sent).as_secs_f64());
            }
            reference = s.text;
        }
        let decode_tok_s = median(decode);
        let (relayed_after, passed_after) = c.hop_counts().await?;
        let checks_single = c.spot_checks().await?.saturating_sub(checks_before);
        // Where a token's time goes: each stage's compute as its worker
        // reports it (mean forward time), and the rest, which distribution costs.
        let state = c.api.get("/api/cluster").await?;
        let stage_times: Vec<Value> = stages
            .iter()
            .map(|(id, _, _)| {
                let p = state["peers"]
                    .as_array()
                    .and_then(|ps| ps.iter().find(|p| p["peer_id"] == id.as_str()))
                    .cloned()
                    .unwrap_or(Value::Null);
                let compute = p["telemetry"]["forward_ms"]
                    .as_f64()
                    .or(p["telemetry"]["kernel_ms"].as_f64());
                json!({"peer_id": id, "compute_ms": compute})
            })
            .collect();
        let compute_ms: Option<f64> = stage_times.iter().map(|t| t["compute_ms"].as_f64()).sum();
        let token_ms = 1e3 / decode_tok_s;
        let single_e2e = median(e2e);
        let mut row = json!({
            "workers": n,
            "one_worker": a.one_worker && n > 1,
            "split": (a.one_worker && n > 1).then(|| a.split.clone()),
            "placement_split": split_ran,
            "stages": stages.iter().map(|(p, s, e)| json!({"peer_id": p, "start": s, "end": e})).collect::<Vec<_>>(),
            "decode_tokens_per_s": decode_tok_s,
            "vs_one_device": decode_tok_s / base_tok_s,
            "first_token_ms": median(ttft),
            "single_request_tokens_per_s_end_to_end": single_e2e,
            "predicted_tokens_per_s": predicted,
            "predicted_over_measured": predicted.map(|p| p / decode_tok_s),
            "preview": preview["chosen"],
            "balance": a.balance,
            "stage_times": stage_times,
            // Each stage's time a token by its worker's calibration, against its
            // `compute_ms` in `stage_times` (measured while serving).
            "calibrated_stage_ms": calibrated,
            // With `--balance served`: the first cut and each stage's forward ms on it.
            "served_split": served_split,
            "ms_per_token": token_ms,
            "compute_ms_per_token": compute_ms,
            "distribution_ms_per_token": compute_ms.map(|c| token_ms - c),
            // Over the measured single requests: hops the coordinator relayed,
            // and tokens the last stage passed straight to the first.
            "relayed_hops": relayed_after - relayed_before,
            "tokens_passed_on": passed_after - passed_before,
            // Tokens held back for a spot check during the single requests.
            "spot_checks": checks_single,
            "longest_gap_ms": median(gaps),
        });
        if a.concurrent > 0 {
            let checks_before = c.spot_checks().await?;
            let t0 = Instant::now();
            let runs = (0..a.concurrent).map(|_| c.api.stream(&prompt, a.gen_tokens, |_| {}));
            // While they run, each stage's busy share and batch size as its worker reports
            // them (telemetry windows of about a second).
            let finished = std::sync::atomic::AtomicBool::new(false);
            let all = async {
                let r = futures::future::try_join_all(runs).await;
                finished.store(true, std::sync::atomic::Ordering::SeqCst);
                r
            };
            let poll = async {
                let mut samples = Vec::new();
                while !finished.load(std::sync::atomic::Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    if let Ok(s) = c.api.get("/api/cluster").await {
                        samples.push(s);
                    }
                }
                samples
            };
            let (done, samples) = futures::future::join(all, poll).await;
            let done = done?;
            let wall = t0.elapsed().as_secs_f64();
            let stage_load: Vec<Value> = stages
                .iter()
                .map(|(id, _, _)| {
                    let of = |key: &str| {
                        let v: Vec<f64> = samples
                            .iter()
                            .filter_map(|s| {
                                s["peers"]
                                    .as_array()?
                                    .iter()
                                    .find(|p| p["peer_id"] == id.as_str())?["telemetry"][key]
                                    .as_f64()
                            })
                            .collect();
                        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
                    };
                    let (busy, mean_batch) = phase_load(&samples, id);
                    json!({
                        "peer_id": id,
                        "busy": busy,
                        "mean_batch": mean_batch,
                        // The mean of the reports' one-second windows, which straddle the
                        // phase's start and end (what this field held before protocol 7).
                        "busy_windows": of("utilization"),
                        "mean_batch_windows": of("mean_batch"),
                    })
                })
                .collect();
            let tokens: u64 = done.iter().map(|s| s.completion_tokens).sum();
            let checks = c.spot_checks().await?.saturating_sub(checks_before);
            let identical = done.iter().all(|s| s.text == reference);
            let busy: Vec<String> = stage_load
                .iter()
                .map(|s| match (s["busy"].as_f64(), s["mean_batch"].as_f64()) {
                    (Some(b), Some(m)) => format!("{b:.2} (batch {m:.1})"),
                    _ => "?".to_owned(),
                })
                .collect();
            say(format!(
                "  {} at once: {:.2} tok/s in all ({:.2}x one request), identical outputs: {identical}; stages busy {}",
                a.concurrent,
                tokens as f64 / wall,
                tokens as f64 / wall / single_e2e,
                busy.join(" / ")
            ));
            row["concurrent"] = json!({
                "requests": a.concurrent,
                "aggregate_tokens_per_s": tokens as f64 / wall,
                "vs_single_request": tokens as f64 / wall / single_e2e,
                "outputs_identical": identical,
                "stages": stage_load,
                "spot_checks": checks,
            });
        }
        if n == largest && n >= 2 && !a.no_recovery && !a.one_worker {
            recovery = measure_recovery(a, &mut c, &prompt, &reference).await?;
            say(format!(
                "  recovery after killing a worker: stall {:.0} ms (steps {:.0} ms), recovered: {}, output identical: {}",
                recovery["stall_ms"].as_f64().unwrap_or(f64::NAN),
                recovery["median_step_ms"].as_f64().unwrap_or(f64::NAN),
                recovery["recovered"],
                recovery["output_identical"]
            ));
        }
        clusters.push(row);
        drop(c);
    }
    Ok(json!({
        "model": what,
        "backend": a.backend,
        "device": base["device_name"],
        "devices": a.devices,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "runs": a.runs,
        "one_device": {
            "decode_tokens_per_s": base_tok_s,
            "prefill_tokens_per_s": base["prefill_tokens_per_s"],
        },
        "clusters": clusters,
        "recovery": recovery,
    }))
}

/// Kills the worker of the last stage a third of the way through a stream.
async fn measure_recovery(
    a: &Args,
    c: &mut Cluster,
    prompt: &[u32],
    reference: &str,
) -> Result<Value> {
    let victim = c.workers.len() - 1;
    let kill_at = a.gen_tokens / 3;
    let recoveries = |cluster: &Value| cluster["requests"]["recoveries"].as_u64().unwrap_or(0);
    let before = recoveries(&c.api.get("/api/cluster").await?);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let mut killed_at = None;
    let streamed = {
        let api = &c.api;
        let stream = api.stream(prompt, a.gen_tokens, |i| {
            if i + 1 == kill_at {
                let _ = tx.send(());
            }
        });
        tokio::pin!(stream);
        loop {
            tokio::select! {
                r = &mut stream => break r?,
                _ = tokio::time::sleep(Duration::from_millis(1)), if killed_at.is_none() => {
                    if rx.try_recv().is_ok() {
                        c.workers[victim].0.kill();
                        killed_at = Some(Instant::now());
                    }
                }
            }
        }
    };
    let killed_at = killed_at.context("the stream ended before the kill")?;
    let next = streamed
        .stamps
        .iter()
        .find(|t| **t > killed_at)
        .context("no token came after the kill")?;
    let steps: Vec<f64> = streamed.stamps[..kill_at]
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    let metrics = c.api.get("/api/cluster").await.unwrap_or(Value::Null);
    Ok(json!({
        "workers_before": c.workers.len(),
        "killed_after_tokens": kill_at,
        // The chain may have run ahead of the client: when the whole output
        // was made before the kill, nothing had to be recovered.
        "recovered": recoveries(&metrics) > before,
        "stall_ms": (*next - killed_at).as_secs_f64() * 1e3,
        "median_step_ms": median(steps),
        "output_identical": streamed.text == reference,
        "placement_after": metrics["placement"]["stages"],
    }))
}

fn print_table(v: &Value) {
    let f = |x: &Value| x.as_f64().map_or("-".to_owned(), |x| format!("{x:.2}"));
    println!(
        "{} on {} ({}), prompt {} tokens, {} generated, medians of {}",
        v["model"].as_str().unwrap_or_default(),
        v["backend"].as_str().unwrap_or_default(),
        v["device"].as_str().unwrap_or_default(),
        v["prompt_tokens"],
        v["gen_tokens"],
        v["runs"]
    );
    println!(
        "  one device (cairn bench): decode {} tok/s",
        f(&v["one_device"]["decode_tokens_per_s"])
    );
    println!(
        "  {:<8} {:>12} {:>8} {:>10} {:>9} {:>9} {:>11} {:>16} {:>8} {:>10} {:>7}",
        "workers",
        "decode tok/s",
        "vs one",
        "predicted",
        "first ms",
        "ms/token",
        "compute ms",
        "concurrent tok/s",
        "relayed",
        "passed on",
        "checks"
    );
    for c in v["clusters"].as_array().into_iter().flatten() {
        println!(
            "  {:<8} {:>12} {:>8} {:>10} {:>9} {:>9} {:>11} {:>16} {:>8} {:>10} {:>7}",
            c["workers"],
            f(&c["decode_tokens_per_s"]),
            f(&c["vs_one_device"]),
            f(&c["predicted_tokens_per_s"]),
            f(&c["first_token_ms"]),
            f(&c["ms_per_token"]),
            f(&c["compute_ms_per_token"]),
            f(&c["concurrent"]["aggregate_tokens_per_s"]),
            c["relayed_hops"],
            c["tokens_passed_on"],
            c["spot_checks"]
        );
    }
    let r = &v["recovery"];
    if !r.is_null() {
        println!(
            "  recovery: a worker killed after {} tokens stalled the stream {} ms (steps {} ms); recovered: {}; output identical: {}",
            r["killed_after_tokens"],
            f(&r["stall_ms"]),
            f(&r["median_step_ms"]),
            r["recovered"],
            r["output_identical"]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{StageCost, byte_split, even_split, served_costs, time_split};

    /// Two stages on the same device: 15 layers served in 7.5 ms and 15 with the head in
    /// 17.5 ms make a layer 0.5 ms and the head 10 ms, so the cut moves to 25 + 5.
    #[test]
    fn served_times_recut_the_layers() {
        let cal = StageCost {
            overhead_s: 1e-3,
            layer_s: 0.4e-3,
            head_s: 3e-3,
        };
        let costs = served_costs(&[cal; 2], &[(0, 15), (15, 30)], &[Some(7.5), Some(17.5)])
            .expect("both stages measured");
        assert!((costs[0].layer_s - 0.5e-3).abs() < 1e-12, "{costs:?}");
        assert!((costs[1].layer_s - 0.5e-3).abs() < 1e-12, "{costs:?}");
        assert!((costs[1].head_s - 10e-3).abs() < 1e-9, "{costs:?}");
        assert_eq!(time_split(&costs, 30), vec![(0, 25), (25, 30)]);
        assert!(served_costs(&[cal; 2], &[(0, 15), (15, 30)], &[Some(7.5), None]).is_none());
    }

    /// The slowest stage of a split by time is the fastest any cut gives, every worker
    /// keeps a layer, and a heavy head takes layers off the last stage.
    #[test]
    fn time_split_evens_out_the_slowest_stage() {
        let same = |head_s| StageCost {
            overhead_s: 0.5,
            layer_s: 1.0,
            head_s,
        };
        assert_eq!(time_split(&[same(0.0); 2], 30), vec![(0, 15), (15, 30)]);
        // A head worth 8 layers: 19 + 11 (19.5 against 19.5).
        assert_eq!(time_split(&[same(8.0); 2], 30), vec![(0, 19), (19, 30)]);
        // A worker twice as fast takes about twice the layers.
        let fast = StageCost {
            overhead_s: 0.0,
            layer_s: 0.5,
            head_s: 0.0,
        };
        assert_eq!(time_split(&[fast, same(0.0)], 30), vec![(0, 20), (20, 30)]);
        // Nothing better exists: every other cut's slowest stage is at least as slow.
        let costs = [same(3.0), fast, same(7.0)];
        let got = time_split(&costs, 24);
        let slowest = |s: &[(usize, usize)]| {
            s.iter()
                .enumerate()
                .map(|(i, &(a, b))| costs[i].of(b - a, i == 2))
                .fold(0.0, f64::max)
        };
        for x in 1..23 {
            for y in (x + 1)..24 {
                assert!(slowest(&got) <= slowest(&[(0, x), (x, y), (y, 24)]) + 1e-12);
            }
        }
        // A head heavier than the rest still leaves the last stage a layer.
        assert_eq!(time_split(&[same(100.0); 2], 2), vec![(0, 1), (1, 2)]);
        assert_eq!(time_split(&[same(0.0); 3], 3), vec![(0, 1), (1, 2), (2, 3)]);
    }

    /// Equal layers split evenly; a heavy tail (the output head) takes layers off the last
    /// range; every range keeps at least one layer.
    #[test]
    fn byte_split_balances_bytes() {
        assert_eq!(byte_split(&[10; 30], 0, 2), vec![(0, 15), (15, 30)]);
        // 30 layers of 10 and a head of 130: 430 in all, 215 a stage.
        assert_eq!(byte_split(&[10; 30], 130, 2), vec![(0, 21), (21, 30)]);
        assert_eq!(byte_split(&[10; 4], 1000, 3).last(), Some(&(3, 4)));
        for layers in 1..20 {
            for n in 1..=layers {
                let s = byte_split(&vec![7; layers], 50, n);
                assert_eq!(s.len(), n);
                assert_eq!(s[0].0, 0);
                assert_eq!(s[n - 1].1, layers);
                assert!(s.windows(2).all(|w| w[0].1 == w[1].0));
                assert!(s.iter().all(|(a, b)| b > a), "{layers} over {n}: {s:?}");
            }
        }
    }

    #[test]
    fn even_split_covers_every_layer_once() {
        for layers in 1..40 {
            for n in 1..=layers.min(8) {
                let s = even_split(layers, n);
                assert_eq!(s.len(), n);
                assert_eq!(s[0].0, 0);
                assert_eq!(s[n - 1].1, layers);
                assert!(s.windows(2).all(|w| w[0].1 == w[1].0));
                assert!(s.iter().all(|(a, b)| b > a));
            }
        }
    }
}
