//! The cluster end to end, with real processes on loopback: cairn-signal,
//! `cairn serve` (coordinator only) and native `cairn worker`s on the cpu
//! backend, the real default model.
//!
//! - a greedy completion through the API equals `cairn run`'s, and runs as a
//!   chain over links between the workers (the coordinator relays nothing);
//! - `kill -9` of a worker holding layers in the middle of a streamed
//!   generation still yields the identical full output;
//! - a worker joining mid-stream triggers a new placement and the stream
//!   still completes identically;
//! - bad API requests get OpenAI-style errors;
//! - the dashboard, in headless Chromium, lists the workers (screenshot kept
//!   under target/test-artifacts/cluster/).
//!
//! The prompt counts, so every greedy step has a clear margin (two correct
//! placements may otherwise part at near-ties).

use std::time::Duration;

use cairn_tests::model_path;
use cairn_tests::procs::{
    Proc, Serve, Signal, SseReader, artifacts, bin, free_port, get_json, get_text, post_json,
    post_raw, wait_for,
};
use serde_json::{Value, json};

const PROMPT: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,";
const TOKENS: usize = 20;
/// Each worker offers this much, so the model (98 MB with its 30 MB
/// embedding on both ends) needs two of them.
const BUDGET: &str = "100000000";

fn reference() -> (Vec<u64>, String) {
    cairn_tests::procs::cairn_run_greedy(PROMPT, TOKENS)
}

fn worker(
    signal: &Signal,
    token: &str,
    dir: &std::path::Path,
    name: &str,
    budget: Option<&str>,
) -> (Proc, String) {
    let model = model_path();
    let cache = dir.join(format!("{name}-cache"));
    let _ = std::fs::remove_dir_all(&cache);
    // With a budget the worker has the model file at hand; without one it
    // fetches its layers from the coordinator over HTTP (cached under `dir`).
    let args: Vec<&str> = match budget {
        Some(b) => vec![
            "--memory-budget",
            b,
            "--model",
            model.to_str().expect("utf-8 path"),
        ],
        None => vec!["--cache-dir", cache.to_str().expect("utf-8 path")],
    };
    cpu_worker(&signal.url, token, dir, name, &args, &[])
}

/// `cairn worker` on the cpu backend, joined to the room at `signal` with
/// `extra` flags and `env`; its peer id.
fn cpu_worker(
    signal: &str,
    token: &str,
    dir: &std::path::Path,
    name: &str,
    extra: &[&str],
    env: &[(&str, &std::path::Path)],
) -> (Proc, String) {
    let mut args = vec![
        "worker",
        "--signal",
        signal,
        "--token",
        token,
        "--backend",
        "cpu",
        "--loopback",
    ];
    args.extend_from_slice(extra);
    let mut p = Proc::spawn_env(&bin("cairn"), &args, env, dir, name);
    let line = p.wait_line("joined room");
    let id = line.rsplit(' ').next().expect("peer id").to_owned();
    (p, id)
}

fn stages(api: &str) -> Vec<(String, u64, u64)> {
    get_json(&format!("{api}/api/cluster"))
        .and_then(|c| {
            (c["placement"]["state"] == "ready").then(|| {
                c["placement"]["stages"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|s| {
                                (
                                    s["peer_id"].as_str().unwrap_or_default().to_owned(),
                                    s["start"].as_u64().unwrap_or(0),
                                    s["end"].as_u64().unwrap_or(0),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            })
        })
        .unwrap_or_default()
}

/// PROMPT as the API tokenizes it.
fn prompt_ids() -> Vec<u32> {
    let file = cairn_engine::gguf::MappedGguf::open(model_path()).expect("the model opens");
    let spec = file.file.tokenizer_spec().expect("tokenizer metadata");
    cairn_engine::tokenizer::Tokenizer::from_spec(&spec)
        .expect("tokenizer")
        .encode_prompt(PROMPT, true)
        .expect("encodes")
}

/// More prompts whose greedy paths are firm, run beside PROMPT to show that
/// sequences batched together keep to their own keys and values.
const OTHER_PROMPTS: [&str; 2] = [
    "a, b, c, d, e, f, g, h, i, j, k,",
    "2, 4, 6, 8, 10, 12, 14,",
];

fn request(stream: bool) -> Value {
    request_for(PROMPT, stream)
}

fn request_for(prompt: &str, stream: bool) -> Value {
    json!({"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": stream})
}

/// Reads a stream to its end; calls `after(n)` once when `n` text pieces have arrived.
fn read_stream(api: &str, at: usize, after: impl FnMut()) -> (String, Option<String>) {
    read_stream_for(api, PROMPT, at, after)
}

/// Streams of every prompt at once, each on its own thread; their texts in order.
fn concurrent_texts(api: &str, prompts: &[&str]) -> Vec<String> {
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (api, p) = (api.to_owned(), p.to_string());
            std::thread::spawn(move || read_stream_for(&api, &p, 0, || {}).0)
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("a stream's thread"))
        .collect()
}

/// Key/value blocks each placed worker reports in use.
fn kv_blocks_used(api: &str) -> Option<Vec<u64>> {
    let c = get_json(&format!("{api}/api/cluster"))?;
    c["peers"]
        .as_array()?
        .iter()
        .filter(|p| p["layers"].is_array())
        .map(|p| p["telemetry"]["kv"]["blocks_used"].as_u64())
        .collect()
}

fn read_stream_for(
    api: &str,
    prompt: &str,
    at: usize,
    mut after: impl FnMut(),
) -> (String, Option<String>) {
    let mut sse = SseReader::post(&format!("{api}/v1/completions"), &request_for(prompt, true));
    let mut text = String::new();
    let mut pieces = 0;
    let mut finish = None;
    while let Some(ev) = sse.next_event() {
        assert!(
            ev.get("error").is_none(),
            "the stream carried an error: {ev}"
        );
        let choice = &ev["choices"][0];
        if let Some(t) = choice["text"].as_str()
            && !t.is_empty()
        {
            text.push_str(t);
            pieces += 1;
            if pieces == at {
                after();
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    (text, finish)
}

#[test]
fn cluster_serves_survives_a_kill_and_a_join() {
    let dir = artifacts("cluster");
    let (ref_tokens, ref_text) = reference();
    let signal = Signal::start(&dir);
    let worker_token = signal.token("main", "worker");
    let coord_token = signal.token("main", "coordinator");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let api = format!("http://{listen}");
    let model = model_path();
    let _coord = Proc::spawn(
        &bin("cairn"),
        &[
            "serve",
            "--signal",
            &signal.url,
            "--token",
            &coord_token,
            "--no-local-worker",
            "--listen",
            &listen,
            "--ctx",
            "256",
            "--parallel",
            "2",
            "--wait-timeout",
            "120",
            "--model",
            model.to_str().expect("utf-8 path"),
        ],
        &dir,
        "coordinator",
    );
    wait_for(Duration::from_secs(60), "the coordinator's API", || {
        get_json(&format!("{api}/v1/models"))
    });
    // Up, but with no worker nothing can be served: health says so.
    let (status, text) = get_text(&format!("{api}/healthz"));
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("no placement can serve"), "{text}");

    let mut workers: Vec<(Proc, String)> = (0..3)
        .map(|i| {
            worker(
                &signal,
                &worker_token,
                &dir,
                &format!("worker-{i}"),
                Some(BUDGET),
            )
        })
        .collect();
    wait_for(
        Duration::from_secs(120),
        "the three workers to be calibrated",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            let peers = c["peers"].as_array()?;
            (peers.len() == 3 && peers.iter().all(|p| p["calibration"].is_object())).then_some(())
        },
    );
    // Let the placer settle on the last calibration before asserting on it.
    std::thread::sleep(Duration::from_secs(1));
    let placed = wait_for(
        Duration::from_secs(180),
        "a placement over the workers",
        || {
            let s = stages(&api);
            (s.len() >= 2).then_some(s)
        },
    );
    assert_eq!(placed.first().map(|s| s.1), Some(0));
    assert_eq!(placed.last().map(|s| s.2), Some(30));
    assert_eq!(get_text(&format!("{api}/healthz")), (200, "ok\n".into()));

    // Bad requests get OpenAI-style errors with the right status.
    let (status, body) = post_raw(&format!("{api}/v1/completions"), "{not json");
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let (status, body) = post_json(
        &format!("{api}/v1/completions"),
        &json!({"model": "gpt-9", "prompt": "hi"}),
    );
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    let (status, body) = post_json(
        &format!("{api}/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": 0}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "max_tokens");
    let (status, body) = post_json(
        &format!("{api}/v1/chat/completions"),
        &json!({"messages": []}),
    );
    assert_eq!(status, 400, "{body}");

    // Once the workers have linked to one another, a request runs as a chain:
    // each stage hands its output to the next, the last feeds every token but
    // the final one back to the first, and the coordinator relays nothing.
    wait_for(
        Duration::from_secs(60),
        "the links between the stages' workers",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            let stages = c["placement"]["stages"].as_array()?.clone();
            (stages.len() >= 2 && stages.iter().all(|s| s["linked"] == true)).then_some(())
        },
    );
    let hops = || {
        let c = get_json(&format!("{api}/api/cluster")).expect("cluster");
        (
            c["requests"]["relayed"].as_u64().expect("relayed count"),
            c["requests"]["passed_on"]
                .as_u64()
                .expect("passed-on count"),
        )
    };
    let (relayed_before, passed_before) = hops();

    // A greedy completion across the stages equals the single-device run.
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    let (relayed_after, passed_after) = hops();
    assert_eq!(
        (relayed_after - relayed_before, passed_after - passed_before),
        (0, TOKENS as u64 - 1),
        "(hops relayed by the coordinator, tokens passed on by the last stage)"
    );
    let tokens: Vec<u64> = body["cairn"]["tokens"]
        .as_array()
        .expect("token ids")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(
        tokens, ref_tokens,
        "distributed greedy tokens differ from cairn run's"
    );
    assert_eq!(body["choices"][0]["text"], ref_text);
    assert_eq!(body["usage"]["completion_tokens"], TOKENS);
    assert_eq!(body["choices"][0]["finish_reason"], "length");

    // Three requests at once: `--parallel 2` runs two together, batched on
    // every stage, and queues the third; each gets what it gets alone.
    let other_refs: Vec<String> = OTHER_PROMPTS
        .iter()
        .map(|p| cairn_tests::procs::cairn_run_greedy(p, TOKENS).1)
        .collect();
    let queued_before =
        get_json(&format!("{api}/api/cluster")).expect("cluster")["requests"]["queued_total"]
            .as_u64()
            .expect("queued_total");
    let all = [PROMPT, OTHER_PROMPTS[0], OTHER_PROMPTS[1]];
    let texts = concurrent_texts(&api, &all);
    assert_eq!(texts[0], ref_text, "PROMPT among concurrent requests");
    assert_eq!(
        texts[1..],
        other_refs[..],
        "the other prompts, served together"
    );
    let c = get_json(&format!("{api}/api/cluster")).expect("cluster");
    assert!(
        c["requests"]["queued_total"]
            .as_u64()
            .expect("queued_total")
            > queued_before,
        "three requests at --parallel 2 and none waited: {}",
        c["requests"]
    );
    // A stream cancelled mid-way gives its blocks back, as finished ones did.
    let mut sse = SseReader::post(&format!("{api}/v1/completions"), &request(true));
    for _ in 0..3 {
        sse.next_event().expect("a first event");
    }
    drop(sse);
    wait_for(
        Duration::from_secs(30),
        "every stage's key/value blocks back after the requests ended",
        || kv_blocks_used(&api).filter(|u| !u.is_empty() && u.iter().all(|&b| b == 0)),
    );

    // The prompt as token ids (OpenAI's other prompt form) gives the same tokens;
    // an id outside the vocabulary is refused before any stage sees it.
    let ids = prompt_ids();
    let (status, body) = post_json(
        &format!("{api}/v1/completions"),
        &json!({"prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["cairn"]["tokens"],
        json!(ref_tokens),
        "token-id prompt"
    );
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    let (status, body) = post_json(
        &format!("{api}/v1/completions"),
        &json!({"prompt": [ids[0], 49152], "max_tokens": 2}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "prompt");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("outside the vocabulary")),
        "{body}"
    );

    // kill -9 a worker that holds layers, mid-stream, while another stream
    // runs beside it: both recover to their full, identical outputs.
    let victim = placed[placed.len() / 2].0.clone();
    let beside = {
        let api = api.clone();
        std::thread::spawn(move || read_stream_for(&api, OTHER_PROMPTS[1], 0, || {}).0)
    };
    let (text, finish) = read_stream(&api, 5, || {
        let w = workers
            .iter_mut()
            .find(|(_, id)| id == &victim)
            .expect("victim is one of ours");
        w.0.kill();
    });
    assert_eq!(
        text, ref_text,
        "the stream after a kill differs from cairn run's output"
    );
    assert_eq!(finish.as_deref(), Some("length"));
    assert_eq!(
        beside.join().expect("the stream beside"),
        other_refs[1],
        "the stream beside the kill"
    );
    let cluster = get_json(&format!("{api}/api/cluster")).expect("cluster");
    assert!(
        cluster["requests"]["recoveries"].as_u64().unwrap_or(0) >= 1,
        "no recovery recorded: {cluster}"
    );
    let after_kill = stages(&api);
    assert!(
        !after_kill.iter().any(|s| s.0 == victim),
        "the dead worker is still placed"
    );

    // A worker joining mid-stream is calibrated and placement is computed
    // again; the stream goes on unbroken whether or not the layers move.
    let computed = |api: &str| {
        get_json(&format!("{api}/api/cluster"))
            .and_then(|c| c["placement"]["computed"].as_u64())
            .unwrap_or(0)
    };
    let before = computed(&api);
    let mut joiner = None;
    let (text, _) = read_stream(&api, 3, || {
        joiner = Some(worker(&signal, &worker_token, &dir, "worker-joined", None));
    });
    assert_eq!(
        text, ref_text,
        "the stream across a join differs from cairn run's output"
    );
    let (_, joined_id) = joiner.as_ref().expect("joined");
    let joined_id = joined_id.clone();
    wait_for(
        Duration::from_secs(120),
        "the new worker to be calibrated and placement recomputed",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            let peer = c["peers"]
                .as_array()?
                .iter()
                .find(|p| p["peer_id"] == joined_id.as_str())?
                .clone();
            (peer["calibration"].is_object() && c["placement"]["computed"].as_u64()? > before)
                .then_some(())
        },
    );

    // A manual placement puts every layer on the new worker; output is the same.
    let manual = json!({"stages": [{"peer_id": joined_id, "start": 0, "end": 30}]});
    let (status, body) = post_json(&format!("{api}/api/placement"), &manual);
    assert_eq!(status, 202, "{body}");
    let bad = json!({"stages": [{"peer_id": joined_id, "start": 0, "end": 12}]});
    let (status, body) = post_json(&format!("{api}/api/placement"), &bad);
    assert_eq!(status, 400, "a placement with a gap was accepted: {body}");
    wait_for(Duration::from_secs(120), "the manual placement", || {
        (stages(&api) == vec![(joined_id.clone(), 0, 30)]).then_some(())
    });
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["text"], ref_text,
        "single-stage output differs"
    );
    let cached = std::fs::read_dir(dir.join("worker-joined-cache"))
        .map(|d| d.flatten().count())
        .unwrap_or(0);
    assert!(
        cached > 0,
        "the worker without the model file cached no shard"
    );
    let back = ureq::delete(&format!("{api}/api/placement"))
        .call()
        .expect("DELETE /api/placement");
    assert_eq!(back.status(), 202);

    // The dashboard lists the workers.
    dashboard_shows(&api, &joined_id, &dir);
    drop(workers);
}

/// The installed headless browser, if any (CI requires one).
fn chromium() -> Option<&'static str> {
    let chromium = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
    if chromium.is_none() {
        assert!(
            std::env::var_os("CAIRN_TEST_REQUIRE_BROWSER").is_none(),
            "chromium is not installed (CAIRN_TEST_REQUIRE_BROWSER is set)"
        );
        eprintln!("skipping the dashboard check: chromium is not installed");
    }
    chromium
}

/// The dashboard's DOM after its first fetches, when a browser is installed.
fn dashboard_dom(api: &str, dir: &std::path::Path) -> Option<String> {
    let chromium = chromium()?;
    let out = bounded(
        std::process::Command::new(chromium)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--virtual-time-budget=4000",
                "--dump-dom",
            ])
            .arg(format!(
                "--user-data-dir={}",
                dir.join("chromium-dom-profile").display()
            ))
            .arg(format!("{api}/?poll")),
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn dashboard_shows(api: &str, peer: &str, dir: &std::path::Path) {
    let Some(chromium) = chromium() else {
        return;
    };
    let profile = dir.join("chromium-profile");
    let common = [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--virtual-time-budget=4000",
        "--window-size=1280,1000",
    ];
    let shot = dir.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let out = bounded(
        std::process::Command::new(chromium)
            .args(common)
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("--screenshot={}", shot.display()))
            .arg(format!("{api}/?poll")),
    );
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "the screenshot looks empty"
    );
    let out = bounded(
        std::process::Command::new(chromium)
            .args(common)
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("--dump-dom")
            .arg(format!("{api}/?poll")),
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains(&format!("data-peer-id=\"{peer}\"")),
        "the dashboard does not list {peer}"
    );
}

/// Runs a headless browser command, killing it after two minutes.
fn bounded(cmd: &mut std::process::Command) -> std::process::Output {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting chromium");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(out) => out.expect("chromium output"),
        Err(_) => {
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
            panic!("chromium did not finish within 2 minutes");
        }
    }
}

/// `cairn worker` without `--signal` finds the coordinator's embedded
/// cairn-signal on the LAN through mDNS, says which one it chose, and joins.
#[test]
fn worker_finds_the_signal_over_mdns() {
    let dir = artifacts("cluster-mdns");
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let serve = Serve::embedded(&dir, model, &["--mdns"]);
    let (port, api, token) = (serve.port, &serve.api, &serve.worker_token);
    let mut worker = Proc::spawn(
        &bin("cairn"),
        &[
            "worker",
            "--token",
            token,
            "--backend",
            "cpu",
            "--loopback",
            "--model",
            model,
        ],
        &dir,
        "worker",
    );
    let found = worker.wait_line("found cairn-signal");
    assert!(
        found.ends_with(&format!("at ws://127.0.0.1:{port}")),
        "the worker chose another server: {found}"
    );
    let joined = worker.wait_line("joined room main as ");
    let peer = joined.rsplit(' ').next().expect("peer id").to_owned();
    wait_for(
        Duration::from_secs(60),
        "the coordinator to list the worker",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            c["peers"]
                .as_array()?
                .iter()
                .any(|p| p["peer_id"] == peer.as_str())
                .then_some(())
        },
    );
}

/// A fake sysfs thermal zone at `temp_c`, with trip points at 80 °C
/// (passive: throttling) and 100 °C (critical: 95 °C and up takes the
/// worker out of placement). The trip points are written once; the
/// temperature is replaced whole (write, then rename), so the worker never
/// reads a half-written file.
fn set_zone(root: &std::path::Path, temp_c: u32) {
    let z = root.join("class/thermal/thermal_zone0");
    if !z.join("type").exists() {
        std::fs::create_dir_all(&z).expect("zone dir");
        for (name, value) in [
            ("type", "x86_pkg_temp"),
            ("trip_point_0_type", "passive"),
            ("trip_point_0_temp", "80000"),
            ("trip_point_1_type", "critical"),
            ("trip_point_1_temp", "100000"),
        ] {
            std::fs::write(z.join(name), format!("{value}\n")).expect("zone file");
        }
    }
    let tmp = z.join("temp.new");
    std::fs::write(&tmp, format!("{}\n", temp_c * 1000)).expect("temp");
    std::fs::rename(tmp, z.join("temp")).expect("rename");
}

/// A worker whose host overheats (reported through sysfs, here a directory
/// the test controls) loses its layers to the other worker between
/// requests, is shown as throttled, and the cluster keeps answering
/// correctly.
#[test]
fn a_throttled_worker_loses_its_layers() {
    let dir = artifacts("cluster-throttle");
    let (ref_tokens, _) = reference();
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let serve = Serve::embedded(&dir, model, &["--no-mdns", "--ctx", "256"]);
    let (api, signal, token) = (&serve.api, &serve.signal, &serve.worker_token);
    // The embedded cairn-signal's /healthz speaks for the coordinator.
    let (status, text) = get_text(&format!("{api}/healthz"));
    assert_eq!(status, 503, "{text}");
    // The dashboard lists the join tokens issued (the join URL's), each with its revoke button.
    if let Some(dom) = dashboard_dom(api, &dir) {
        assert!(
            dom.contains("data-token-id=") && dom.contains("data-action=\"revoke\""),
            "the dashboard lists no join token to revoke"
        );
    }
    // CORS is off by default: no origin gets CORS headers, on a read or a preflight.
    for method in ["GET", "OPTIONS"] {
        let r = match ureq::request(method, &format!("{api}/v1/models"))
            .set("Origin", "https://page.example")
            .set("Access-Control-Request-Method", "GET")
            .call()
        {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method}: {e}"),
        };
        assert_eq!(r.header("access-control-allow-origin"), None, "{method}");
    }
    let mut workers = Vec::new();
    for name in ["a", "b"] {
        let sys = dir.join(format!("sys-{name}"));
        let _ = std::fs::remove_dir_all(&sys);
        set_zone(&sys, 45);
        let (p, id) = cpu_worker(
            signal,
            token,
            &dir,
            &format!("worker-{name}"),
            &["--model", model],
            &[("CAIRN_SYSFS_ROOT", &sys)],
        );
        workers.push((p, id, sys));
    }
    let peer = |c: &Value, id: &str| -> Option<Value> {
        c["peers"]
            .as_array()?
            .iter()
            .find(|p| p["peer_id"] == id)
            .cloned()
    };
    wait_for(
        Duration::from_secs(120),
        "both workers calibrated, with thermal telemetry",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            workers
                .iter()
                .all(|(_, id, _)| {
                    peer(&c, id).is_some_and(|p| {
                        p["calibration"].is_object()
                            && p["telemetry"].to_string().contains("x86_pkg_temp")
                    })
                })
                .then_some(())
        },
    );
    std::thread::sleep(Duration::from_secs(1));
    let layers_of = |s: &[(String, u64, u64)], id: &str| -> u64 {
        s.iter().filter(|x| x.0 == id).map(|x| x.2 - x.1).sum()
    };
    let before = wait_for(Duration::from_secs(180), "a placement", || {
        let s = stages(api);
        (!s.is_empty()).then_some(s)
    });
    assert_eq!(get_text(&format!("{api}/healthz")), (200, "ok\n".into()));
    let (_, hot, sys) = workers
        .iter()
        .max_by_key(|(_, id, _)| layers_of(&before, id))
        .expect("two workers");
    let held = layers_of(&before, hot);
    assert!(held > 0, "{before:?}");
    // Critical: whatever the two calibrations measured (they are noisy on a
    // loaded machine), the hot worker must give up every layer.
    set_zone(sys, 97);
    wait_for(
        Duration::from_secs(30),
        "the coordinator to see the worker's critical pressure",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            (peer(&c, hot)?["telemetry"]["pressure"] == "critical").then_some(())
        },
    );
    let after = wait_for(
        Duration::from_secs(60),
        "a placement without the overheating worker",
        || {
            let s = stages(api);
            (!s.is_empty() && layers_of(&s, hot) == 0).then_some(s)
        },
    );
    let c = get_json(&format!("{api}/api/cluster")).expect("cluster state");
    assert_eq!(
        peer(&c, hot).map(|p| p["status"].clone()),
        Some(json!("throttled")),
        "{c}"
    );
    assert_eq!(after.first().map(|s| s.1), Some(0));
    assert_eq!(after.last().map(|s| s.2), Some(30));
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cairn"]["tokens"], json!(ref_tokens));
}

/// A step lost on a link between two workers (each worker here loses its
/// fifth pass on purpose, as a link that died with the message in it
/// would) stalls the chain; the coordinator notices the silence, goes on
/// with every hop relayed through itself, and the output is still exactly
/// `cairn run`'s.
#[test]
fn a_step_lost_between_workers_is_carried_through_the_coordinator() {
    let dir = artifacts("cluster-lost-step");
    let (ref_tokens, _) = reference();
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let serve = Serve::embedded(&dir, model, &["--no-mdns", "--ctx", "256"]);
    let (api, signal, token) = (&serve.api, &serve.signal, &serve.worker_token);
    let _workers: Vec<(Proc, String)> = ["a", "b"]
        .iter()
        .map(|name| {
            cpu_worker(
                signal,
                token,
                &dir,
                &format!("worker-{name}"),
                &["--memory-budget", BUDGET, "--model", model],
                &[("CAIRN_DEBUG_LOSE_PASS", std::path::Path::new("5"))],
            )
        })
        .collect();
    wait_for(
        Duration::from_secs(180),
        "two linked stages over the two workers",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            let stages = c["placement"]["stages"].as_array()?.clone();
            (c["placement"]["state"] == "ready"
                && stages.len() == 2
                && stages.iter().all(|s| s["linked"] == true))
            .then_some(())
        },
    );
    let relayed = || {
        get_json(&format!("{api}/api/cluster")).expect("cluster")["requests"]["relayed"]
            .as_u64()
            .expect("relayed count")
    };
    let before = relayed();
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["cairn"]["tokens"],
        json!(ref_tokens),
        "the output across a lost step differs from cairn run's"
    );
    assert!(
        relayed() > before,
        "the coordinator relayed nothing after the chain stalled"
    );
    let lost = ["a", "b"]
        .iter()
        .filter(|name| {
            std::fs::read_to_string(dir.join(format!("worker-{name}.log")))
                .is_ok_and(|log| log.contains("losing this pass on purpose"))
        })
        .count();
    assert!(lost >= 1, "no worker lost a pass");
}

/// A request with `Authorization: Bearer KEY` (none when `key` is `None`):
/// its status and body, whatever the status.
fn call(method: &str, url: &str, key: Option<&str>, body: Option<(&str, &str)>) -> (u16, String) {
    let mut r = ureq::request(method, url).timeout(Duration::from_secs(120));
    if let Some(k) = key {
        r = r.set("Authorization", &format!("Bearer {k}"));
    }
    let resp = match body {
        Some((ty, b)) => r.set("Content-Type", ty).send_string(b),
        None => r.call(),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {url}: {e}"),
    };
    (resp.status(), resp.into_string().unwrap_or_default())
}

/// `cairn token ARGS` against `api` with the admin key; its stdout.
fn cairn_token(api: &str, key: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(bin("cairn"))
        .args(["token", "--api", api, "--api-key", key])
        .args(args)
        .output()
        .expect("cairn token");
    assert!(
        out.status.success(),
        "cairn token {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `cairn worker` with `token` that must be refused: it exits with an error
/// within a minute instead of joining.
fn worker_is_refused(signal: &str, token: &str, dir: &std::path::Path, name: &str) {
    let mut p = Proc::spawn(
        &bin("cairn"),
        &[
            "worker",
            "--signal",
            signal,
            "--token",
            token,
            "--backend",
            "cpu",
            "--loopback",
        ],
        dir,
        name,
    );
    wait_for(
        Duration::from_secs(60),
        "the refused worker to exit",
        || (!p.is_running()).then_some(()),
    );
    let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
    assert!(!log.contains("joined room"), "{name} joined: {log}");
}

/// Issue 21's first attack: with `--api-key`, nobody without it sees the
/// cluster, the join URL or its QR code, fetches the model, or changes
/// anything; a read key reads but never sees the join URL; the admin's join
/// tokens are short-lived and revocable (`cairn token`), and the signaling
/// secret survives a restart, revocations included. A worker let in with the
/// admin's token fetches its layers through the capability in `LoadShard`'s
/// URL and serves.
#[test]
fn an_api_key_keeps_strangers_out_and_join_tokens_are_revocable() {
    let dir = artifacts("cluster-admission");
    let (ref_tokens, _) = reference();
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let (admin, read) = ("admin-key-for-the-test", "read-key-for-the-test");
    let flags = [
        "--no-mdns",
        "--ctx",
        "256",
        "--api-key",
        admin,
        "--read-key",
        read,
        "--join-ttl",
        "600",
        "--allow-origin",
        "https://ok.example",
    ];
    let serve = Serve::embedded(&dir, model, &flags);
    let (api, signal) = (serve.api.clone(), serve.signal.clone());

    // Strangers: 401 in OpenAI's shape, no data, no join token anywhere.
    for (method, path) in [
        ("GET", "/api/cluster"),
        ("GET", "/api/events"),
        ("GET", "/metrics"),
        ("GET", "/api/join-qr.svg"),
        ("GET", "/api/placement"),
        ("GET", "/api/tokens"),
        ("GET", "/v1/models"),
        ("GET", "/api/model/anything.gguf"),
        ("DELETE", "/api/placement"),
        ("GET", "/api/no-such-route"),
    ] {
        let (status, body) = call(method, &format!("{api}{path}"), None, None);
        assert_eq!(status, 401, "{method} {path}: {body}");
        let v: Value = serde_json::from_str(&body).expect("JSON error");
        assert_eq!(v["error"]["code"], "invalid_api_key", "{path}");
    }
    let (status, _) = call("GET", &format!("{api}/api/cluster"), Some("wrong"), None);
    assert_eq!(status, 401);
    for page in ["/", "/join"] {
        let (_, body) = call("GET", &format!("{api}{page}"), None, None);
        assert!(
            !body.contains(&serve.worker_token),
            "{page} carries the token"
        );
    }
    assert_ne!(call("GET", &format!("{api}/healthz"), None, None).0, 401);
    // The join page's cost estimate is open, and holds sizes only.
    let (status, body) = call(
        "GET",
        &format!("{api}/join/cost?memory=1073741824"),
        None,
        None,
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"download_bytes\"")
            && !body.contains("SmolLM")
            && !body.contains(&serve.worker_token),
        "{body}"
    );
    // CORS only for the origin allowed: its preflight is answered, another's is not.
    let preflight = |origin: &str| match ureq::request("OPTIONS", &format!("{api}/api/cluster"))
        .set("Origin", origin)
        .set("Access-Control-Request-Method", "GET")
        .call()
    {
        Ok(r) | Err(ureq::Error::Status(_, r)) => (
            r.status(),
            r.header("access-control-allow-origin").map(str::to_owned),
        ),
        Err(e) => panic!("OPTIONS: {e}"),
    };
    assert_eq!(
        preflight("https://ok.example"),
        (204, Some("https://ok.example".to_owned()))
    );
    let (status, allowed) = preflight("https://evil.example");
    assert_eq!((status, allowed), (401, None));

    // The read key reads, without the join URL, and changes nothing.
    let (status, body) = call("GET", &format!("{api}/api/cluster"), Some(read), None);
    assert_eq!(status, 200, "{body}");
    let c: Value = serde_json::from_str(&body).expect("cluster JSON");
    assert!(c["join_url"].is_null() && c["join_qr_svg"].is_null(), "{c}");
    assert!(!body.contains(&serve.worker_token));
    assert_eq!(
        call("GET", &format!("{api}/metrics"), Some(read), None).0,
        200
    );
    for (method, path) in [
        ("DELETE", "/api/placement"),
        ("GET", "/api/join-qr.svg"),
        ("GET", "/api/tokens"),
    ] {
        let (status, body) = call(method, &format!("{api}{path}"), Some(read), None);
        assert_eq!(status, 403, "{method} {path}: {body}");
    }
    // The admin sees it; bodies that are not JSON are refused before reading.
    let (_, body) = call("GET", &format!("{api}/api/cluster"), Some(admin), None);
    let c: Value = serde_json::from_str(&body).expect("cluster JSON");
    let join_url = c["join_url"].as_str().expect("the admin sees the join URL");
    assert!(join_url.contains(&serve.worker_token), "{join_url}");
    let (status, body) = call(
        "POST",
        &format!("{api}/v1/completions"),
        Some(admin),
        Some(("text/plain", &request(false).to_string())),
    );
    assert_eq!(status, 415, "{body}");

    // A worker with the admin's token fetches its layers over HTTP and serves.
    let cache = dir.join("worker-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let (mut worker, _) = cpu_worker(
        &signal,
        &serve.worker_token,
        &dir,
        "worker",
        &["--cache-dir", cache.to_str().expect("utf-8 path")],
        &[],
    );
    wait_for(
        Duration::from_secs(300),
        "a placement on the worker",
        || {
            let (_, b) = call("GET", &format!("{api}/api/cluster"), Some(read), None);
            let c: Value = serde_json::from_str(&b).ok()?;
            (c["placement"]["state"] == "ready").then_some(())
        },
    );
    let (status, body) = call(
        "POST",
        &format!("{api}/v1/completions"),
        Some(admin),
        Some(("application/json", &request(false).to_string())),
    );
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["cairn"]["tokens"], json!(ref_tokens));

    // Revoking the join URL's token drops its worker and refuses it after.
    let listed = cairn_token(&api, admin, &["list"]);
    let id = listed
        .lines()
        .find(|l| l.contains("valid"))
        .and_then(|l| l.split_whitespace().next())
        .expect("one valid token listed")
        .to_owned();
    let revoked = cairn_token(&api, admin, &["revoke", &id]);
    assert!(revoked.contains("dropped 1"), "{revoked}");
    wait_for(Duration::from_secs(30), "the revoked worker to go", || {
        let (_, b) = call("GET", &format!("{api}/api/cluster"), Some(admin), None);
        let c: Value = serde_json::from_str(&b).ok()?;
        let online = c["peers"]
            .as_array()?
            .iter()
            .any(|p| p["status"] != "offline");
        (!online).then_some(())
    });
    worker.kill();
    worker_is_refused(&signal, &serve.worker_token, &dir, "revoked-worker");
    let (_, b) = call("GET", &format!("{api}/api/cluster"), Some(admin), None);
    let fresh: Value = serde_json::from_str(&b).expect("cluster JSON");
    assert!(
        !fresh["join_url"]
            .as_str()
            .expect("join URL")
            .contains(&serve.worker_token),
        "the revoked token left the join URL"
    );
    let issued = cairn_token(&api, admin, &["new", "--ttl", "300"]);
    let new_token = issued
        .lines()
        .find_map(|l| l.strip_prefix("token:"))
        .expect("a token")
        .trim()
        .to_owned();

    // A restart on the same state keeps the secret and the revocation.
    let port = serve.port.to_string();
    let revoked_token = serve.worker_token.clone();
    drop(serve);
    let state = dir.join("serve-state");
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec![
        "serve",
        "--listen",
        &listen,
        "--state-dir",
        state.to_str().expect("utf-8"),
        "--no-local-worker",
        "--model",
        model,
    ];
    args.extend_from_slice(&flags);
    let mut again = Proc::spawn(&bin("cairn"), &args, &dir, "serve-again");
    again.wait_line("join:");
    let (_w, _) = cpu_worker(&signal, &new_token, &dir, "worker-after-restart", &[], &[]);
    worker_is_refused(&signal, &revoked_token, &dir, "revoked-after-restart");
}

/// `cairn audit verify` on `state`: whether it passed, and what it printed.
fn audit_verify(state: &std::path::Path) -> (bool, String) {
    let out = std::process::Command::new(bin("cairn"))
        .args(["audit", "verify", "--state-dir"])
        .arg(state)
        .output()
        .expect("cairn audit verify");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Issue 21 item 7: the audit log records the coordinator's start, its
/// joining the room (token id and address), uses of the key (scope and
/// route kind, never the key) and refusals, join tokens issued and revoked;
/// `cairn audit verify` passes on it, and names the line once one is edited.
#[test]
fn the_audit_log_records_admission_and_names_an_edited_line() {
    let dir = artifacts("cluster-audit");
    let model = model_path();
    let admin = "admin-key-for-the-audit-test";
    let serve = Serve::embedded(
        &dir,
        model.to_str().expect("utf-8 path"),
        &["--no-mdns", "--ctx", "256", "--api-key", admin],
    );
    let api = serve.api.clone();
    assert_eq!(
        call("GET", &format!("{api}/api/cluster"), Some(admin), None).0,
        200
    );
    assert_eq!(
        call("GET", &format!("{api}/api/cluster"), Some("wrong"), None).0,
        401
    );
    let issued = cairn_token(&api, admin, &["new", "--ttl", "300"]);
    let id = issued
        .lines()
        .find_map(|l| l.strip_prefix("id:"))
        .expect("an id")
        .trim()
        .to_owned();
    cairn_token(&api, admin, &["revoke", &id]);
    let state = dir.join("serve-state");
    let log = state.join("audit.jsonl");
    wait_for(Duration::from_secs(20), "the revocation's record", || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|t| t.contains("token_revoked"))
    });
    // SIGTERM, as a service manager stops it: the log ends with `stop`.
    let mut serve = serve;
    let status = serve.proc.terminate(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let text = std::fs::read_to_string(&log).expect("the audit log");
    assert!(
        text.lines()
            .last()
            .is_some_and(|l| l.contains("\"kind\":\"stop\"")),
        "{text}"
    );
    assert!(!text.contains(admin), "the key itself is in the log");
    let records: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let has = |want: Value| {
        records.iter().any(|r| {
            want.as_object()
                .expect("object")
                .iter()
                .all(|(k, v)| &r["event"][k] == v)
        })
    };
    assert!(has(json!({"kind": "start", "api_key": true})), "{text}");
    assert!(
        has(json!({"kind": "joined", "role": "coordinator", "addr": "127.0.0.1"})),
        "{text}"
    );
    assert!(
        has(json!({"kind": "api_key", "scope": "admin", "route": "cluster", "status": 200})),
        "{text}"
    );
    assert!(
        has(json!({"kind": "api_key", "scope": "none", "route": "cluster", "status": 401})),
        "{text}"
    );
    assert!(
        has(json!({"kind": "token_issued", "token_id": id})),
        "{text}"
    );
    assert!(
        has(json!({"kind": "token_revoked", "token_id": id})),
        "{text}"
    );

    let (ok, out) = audit_verify(&state);
    assert!(ok, "{out}");
    assert!(out.contains("ok:"), "{out}");

    // Someone turns the stranger's refusal into a success.
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let n = lines
        .iter()
        .position(|l| l.contains("\"status\":401"))
        .expect("the refusal");
    lines[n] = lines[n].replace("\"status\":401", "\"status\":200");
    std::fs::write(&log, lines.join("\n") + "\n").expect("edit the log");
    let (ok, out) = audit_verify(&state);
    assert!(!ok, "an edited log verified: {out}");
    assert!(out.contains(&format!("line {}:", n + 1)), "{out}");
    assert!(out.contains("edited"), "{out}");
}

/// Issue 21 item 1: with `--approve-workers` a worker that joins waits,
/// listed with its device, address and token id, and is not placed: a
/// request fails saying so. Once the admin approves it, it is placed and
/// serves, and the decision is in the audit log.
#[test]
fn with_approval_a_worker_serves_only_once_the_admin_lets_it_in() {
    let dir = artifacts("cluster-approval");
    let (ref_tokens, _) = reference();
    let model = model_path();
    let admin = "admin-key-for-the-approval-test";
    let serve = Serve::embedded(
        &dir,
        model.to_str().expect("utf-8 path"),
        &[
            "--no-mdns",
            "--ctx",
            "256",
            "--api-key",
            admin,
            "--approve-workers",
            "--wait-timeout",
            "3",
        ],
    );
    let api = serve.api.clone();
    let (_worker, id) = cpu_worker(&serve.signal, &serve.worker_token, &dir, "worker", &[], &[]);
    let cluster = || {
        let (_, b) = call("GET", &format!("{api}/api/cluster"), Some(admin), None);
        serde_json::from_str::<Value>(&b).expect("cluster JSON")
    };
    let waiting = wait_for(Duration::from_secs(60), "the worker to wait", || {
        let c = cluster();
        c["pending_approval"]
            .as_array()
            .and_then(|p| p.first().cloned())
    });
    assert_eq!(waiting["peer_id"], json!(id), "{waiting}");
    assert_eq!(waiting["addr"], "127.0.0.1", "{waiting}");
    assert!(waiting["token_id"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(waiting["device"].as_str().is_some_and(|d| !d.is_empty()));
    // Not calibrated, not placed; a request says why it cannot be served.
    std::thread::sleep(Duration::from_secs(2));
    let c = cluster();
    assert!(c["peers"].as_array().is_some_and(Vec::is_empty), "{c}");
    let completion = || {
        call(
            "POST",
            &format!("{api}/v1/completions"),
            Some(admin),
            Some(("application/json", &request(false).to_string())),
        )
    };
    let (status, body) = completion();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("approval"), "{body}");

    let decide = |who: &str, verb: &str| {
        call(
            "POST",
            &format!("{api}/api/workers/{who}/{verb}"),
            Some(admin),
            None,
        )
    };
    assert_eq!(decide("no-such-worker", "approve").0, 404);
    let (status, body) = decide(&id, "approve");
    assert_eq!(status, 200, "{body}");
    wait_for(Duration::from_secs(300), "a placement on it", || {
        (cluster()["placement"]["state"] == "ready").then_some(())
    });
    let (status, body) = completion();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["cairn"]["tokens"], json!(ref_tokens));
    let log = std::fs::read_to_string(dir.join("serve-state").join("audit.jsonl"))
        .expect("the audit log");
    let approved = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .any(|r| {
            r["event"]["kind"] == "approval"
                && r["event"]["peer"] == json!(id)
                && r["event"]["approved"] == true
                && r["event"]["token_id"] == waiting["token_id"]
        });
    assert!(approved, "{log}");
}

/// Issue 21: "by default on a LAN without a key a new worker waits for the
/// operator's approval". `cairn serve --lan` without `--api-key` makes a key,
/// says approval is on, serves at once on its own (trusted) local worker,
/// and holds a worker that joins with the join URL's token unplaced.
#[test]
fn a_lan_without_a_key_holds_joining_workers_for_approval_by_default() {
    let dir = artifacts("cluster-lan-approval");
    let (ref_tokens, _) = reference();
    let model = model_path();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let state = dir.join("serve-state");
    let _ = std::fs::remove_dir_all(&state);
    let mut serve = Proc::spawn(
        &bin("cairn"),
        &[
            "serve",
            "--lan",
            "--no-mdns",
            "--listen",
            &listen,
            "--state-dir",
            state.to_str().expect("utf-8 path"),
            "--model",
            model.to_str().expect("utf-8 path"),
            "--backend",
            "cpu",
            "--ctx",
            "256",
            "--spot-check-rate",
            "0",
        ],
        &dir,
        "serve",
    );
    let key = serve
        .wait_line("api key:")
        .split_whitespace()
        .nth(2)
        .expect("the generated key")
        .to_owned();
    let join = serve.wait_line("join:");
    let token = join
        .split("token=")
        .nth(1)
        .expect("the join URL carries a worker token")
        .trim()
        .to_owned();
    let approval = serve.wait_line("approval:");
    assert!(approval.contains("default"), "{approval}");
    let api = format!("http://{listen}");
    let (_worker, id) = cpu_worker(&format!("ws://{listen}"), &token, &dir, "worker", &[], &[]);
    let cluster = || {
        let (_, b) = call("GET", &format!("{api}/api/cluster"), Some(&key), None);
        serde_json::from_str::<Value>(&b).expect("cluster JSON")
    };
    let waiting = wait_for(Duration::from_secs(60), "the worker to wait", || {
        cluster()["pending_approval"]
            .as_array()
            .and_then(|p| p.first().cloned())
    });
    assert_eq!(waiting["peer_id"], json!(id), "{waiting}");
    // The local worker needs no approval: the cluster serves on it alone.
    wait_for(Duration::from_secs(120), "a placement", || {
        (cluster()["placement"]["state"] == "ready").then_some(())
    });
    let (status, body) = call(
        "POST",
        &format!("{api}/v1/completions"),
        Some(&key),
        Some(("application/json", &request(false).to_string())),
    );
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["cairn"]["tokens"], json!(ref_tokens));
    let c = cluster();
    let stages = c["placement"]["stages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        !stages.iter().any(|s| s["peer_id"] == json!(id)),
        "a worker waiting for approval was placed: {c}"
    );
    assert_eq!(c["pending_approval"][0]["peer_id"], json!(id), "{c}");
}

/// Issue 21: when the signaling server went away, the coordinator stayed out
/// of its room and a standalone worker exited, so nothing was served until
/// every process was restarted. Now both join the room again with backoff
/// once it is back, link again, and the same request gives the same output.
#[test]
fn the_cluster_serves_again_after_the_signaling_server_restarts() {
    let dir = artifacts("cluster-rejoin");
    let (ref_tokens, _) = reference();
    let mut signal = Signal::start(&dir);
    let worker_token = signal.token("main", "worker");
    let coord_token = signal.token("main", "coordinator");
    let listen = format!("127.0.0.1:{}", free_port());
    let api = format!("http://{listen}");
    let model = model_path();
    let _coord = Proc::spawn(
        &bin("cairn"),
        &[
            "serve",
            "--signal",
            &signal.url,
            "--token",
            &coord_token,
            "--no-local-worker",
            "--listen",
            &listen,
            "--ctx",
            "256",
            "--model",
            model.to_str().expect("utf-8 path"),
        ],
        &dir,
        "coordinator",
    );
    let mut workers: Vec<(Proc, String)> = ["a", "b"]
        .iter()
        .map(|n| {
            worker(
                &signal,
                &worker_token,
                &dir,
                &format!("worker-{n}"),
                Some(BUDGET),
            )
        })
        .collect();
    let ready = || {
        wait_for(Duration::from_secs(240), "a placement that serves", || {
            (get_text(&format!("{api}/healthz")).0 == 200).then_some(())
        })
    };
    // The API listens once the coordinator has started; until then a GET is refused.
    wait_for(Duration::from_secs(60), "the coordinator's API", || {
        get_json(&format!("{api}/v1/models"))
    });
    ready();
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cairn"]["tokens"], json!(ref_tokens));

    // While the server is down the coordinator is out of its room: health says so.
    signal.restart_after(&dir, || {
        wait_for(
            Duration::from_secs(10),
            "health to say out of the room",
            || {
                let (status, text) = get_text(&format!("{api}/healthz"));
                (status == 503 && text.contains("out of its room")).then_some(())
            },
        );
        std::thread::sleep(Duration::from_secs(1));
    });
    for (w, _) in &mut workers {
        assert!(
            w.is_running(),
            "{} exited when the signaling server went away",
            w.name
        );
    }
    ready();
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cairn"]["tokens"], json!(ref_tokens));
    for (w, _) in &mut workers {
        assert!(w.is_running(), "{} exited", w.name);
    }
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap_or_default();
    assert!(
        log.contains("back in the room"),
        "the coordinator never rejoined"
    );
}

/// A normal `cairn run`, in a session without a runtime directory and with the automatic
/// device choice (which probes every wgpu adapter), prints no line a newcomer would read as
/// a failure: no Mesa `XDG_RUNTIME_DIR` error, no wgpu probing warnings.
#[test]
fn a_normal_run_prints_nothing_alarming() {
    let out = std::process::Command::new(bin("cairn"))
        .args(["run", "--prompt", "Hi", "--max-tokens", "2", "--model"])
        .arg(model_path())
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("RUST_LOG")
        .output()
        .expect("cairn run starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cairn run failed:\n{stderr}");
    let alarming: Vec<&str> = stderr
        .lines()
        .filter(|l| {
            let l = l.to_lowercase();
            l.contains("error") || l.contains("xdg") || l.contains("warn")
        })
        .collect();
    assert!(
        alarming.is_empty(),
        "cairn run printed alarming lines:\n{}",
        alarming.join("\n")
    );
}

/// `--signal` takes the address the way people paste it: with `/ws?room=...` the room comes
/// from the URL, and without `--room` or a room in the URL it comes from the token.
#[test]
fn the_signal_address_and_the_room_come_as_pasted() {
    let dir = artifacts("cluster-signal-forms");
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let serve = Serve::embedded(&dir, model, &["--room", "bars"]);
    let token = &serve.worker_token;
    let pasted = format!("{}/ws?room=bars", serve.signal);
    let (_a, a) = cpu_worker(&pasted, token, &dir, "from-url", &["--model", model], &[]);
    let http = serve.api.clone();
    let mut b = Proc::spawn(
        &bin("cairn"),
        &[
            "worker",
            "--signal",
            &http,
            "--token",
            token,
            "--backend",
            "cpu",
            "--loopback",
            "--model",
            model,
        ],
        &dir,
        "from-token",
    );
    let joined = b.wait_line("joined room");
    assert!(
        joined.starts_with("joined room bars as "),
        "the room did not come from the token: {joined}"
    );
    let b = joined.rsplit(' ').next().expect("peer id").to_owned();
    wait_for(
        Duration::from_secs(60),
        "the coordinator to list both",
        || {
            let c = get_json(&format!("{}/api/cluster", serve.api))?;
            let peers = c["peers"].as_array()?;
            let listed = |id: &str| peers.iter().any(|p| p["peer_id"] == id);
            (listed(&a) && listed(&b)).then_some(())
        },
    );
}

/// Where scripts/fetch-ollama-client.sh put Ollama's Python client, if it did.
fn ollama_client() -> Option<std::path::PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))?;
    let dir = cache.join("cairn/ollama-client-0.6.3");
    dir.join("ollama").is_dir().then_some(dir)
}

/// Drives the Ollama routes with the official client; prints one JSON object of results.
const OLLAMA_SCRIPT: &str = r#"
import json, sys, ollama
c = ollama.Client(host=sys.argv[1])
r = {}
r["list"] = [m.model for m in c.list().models]
name = r["list"][0]
s = c.show(name)
r["show"] = {"format": s.details.format, "family": s.details.family,
             "context": s.modelinfo.get("llama.context_length")}
opts = {"temperature": 0, "num_predict": 8}
g = c.generate(model=name, prompt="Name a colour.", options=opts)
r["generate"] = {"text": g.response, "done": g.done, "eval_count": g.eval_count,
                 "done_reason": g.done_reason}
parts = [p.response for p in c.generate(model=name, prompt="Name a colour.", options=opts, stream=True)]
r["generate_stream"] = parts
msgs = [{"role": "user", "content": "Name a colour."}]
ch = c.chat(model=name, messages=msgs, options=opts)
r["chat"] = {"text": ch.message.content, "role": ch.message.role, "eval_count": ch.eval_count}
chunks = list(c.chat(model=name, messages=msgs, options=opts, stream=True))
r["chat_stream"] = [x.message.content for x in chunks]
r["chat_stream_done"] = [x.done for x in chunks]
try:
    c.chat(model="no-such-model", messages=msgs, stream=False)
    r["bad"] = None
except ollama.ResponseError as e:
    r["bad"] = {"status": e.status_code, "error": e.error}
try:
    c.generate(model=name, prompt="x", options={"temperature": 7}, stream=False)
    r["bad_option"] = None
except ollama.ResponseError as e:
    r["bad_option"] = {"status": e.status_code, "error": e.error}
print(json.dumps(r))
"#;

/// Ollama's official Python client against a real `cairn serve`: the model is listed and
/// shown, generate and chat answer streamed and whole with the same greedy text as the
/// OpenAI route, and bad requests come back as Ollama errors with their status.
#[test]
fn the_ollama_client_lists_shows_generates_and_chats() {
    let Some(client) = ollama_client() else {
        assert!(
            std::env::var_os("CAIRN_TEST_REQUIRE_OLLAMA_CLIENT").is_none(),
            "Ollama's Python client is missing: run scripts/fetch-ollama-client.sh"
        );
        eprintln!("Ollama's Python client is missing (scripts/fetch-ollama-client.sh); skipped");
        return;
    };
    let dir = artifacts("cluster-ollama");
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let serve = Serve::embedded(&dir, model, &[]);
    let (_w, _) = cpu_worker(
        &serve.signal,
        &serve.worker_token,
        &dir,
        "worker",
        &["--model", model],
        &[],
    );
    wait_for(Duration::from_secs(120), "a placement", || {
        (!stages(&serve.api).is_empty()).then_some(())
    });
    let out = std::process::Command::new("python3")
        .args(["-c", OLLAMA_SCRIPT, &serve.api])
        .env("PYTHONPATH", &client)
        .output()
        .expect("python3 starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the client script failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("the script prints JSON");
    std::fs::write(dir.join("results.json"), r.to_string()).expect("results saved");

    assert_eq!(r["list"], json!(["SmolLM2-135M-Instruct:latest"]));
    assert_eq!(r["show"]["format"], "gguf");
    assert_eq!(r["show"]["family"], "llama");
    assert_eq!(r["show"]["context"], 8192);

    let g = &r["generate"];
    let text = g["text"].as_str().expect("generate text");
    assert!(!text.is_empty() && g["done"] == true, "{g}");
    assert!(
        g["eval_count"]
            .as_u64()
            .is_some_and(|n| (1..=8).contains(&n)),
        "{g}"
    );
    let streamed: String = r["generate_stream"]
        .as_array()
        .expect("parts")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(streamed, text, "greedy streamed and whole answers differ");
    assert!(r["generate_stream"].as_array().is_some_and(|p| p.len() > 2));

    // The same conversation through the OpenAI route: one request path, one answer.
    let (status, openai) = post_json(
        &format!("{}/v1/chat/completions", serve.api),
        &json!({"messages": [{"role": "user", "content": "Name a colour."}],
                "temperature": 0, "max_tokens": 8}),
    );
    assert_eq!(status, 200, "{openai}");
    let chat = &r["chat"];
    assert_eq!(chat["role"], "assistant");
    assert_eq!(chat["text"], openai["choices"][0]["message"]["content"]);
    assert_eq!(
        chat["text"].as_str(),
        Some(text),
        "generate applies the chat template too"
    );
    let chat_streamed: String = r["chat_stream"]
        .as_array()
        .expect("chunks")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(chat_streamed, chat["text"].as_str().unwrap_or_default());
    let done = r["chat_stream_done"].as_array().expect("done flags");
    assert_eq!(done.last(), Some(&json!(true)));
    assert!(done[..done.len() - 1].iter().all(|d| d == false));

    assert_eq!(r["bad"]["status"], 404, "{}", r["bad"]);
    assert!(
        r["bad"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("no-such-model")),
        "{}",
        r["bad"]
    );
    assert_eq!(r["bad_option"]["status"], 400, "{}", r["bad_option"]);
    assert!(
        r["bad_option"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("temperature")),
        "{}",
        r["bad_option"]
    );
}

/// One worker over three local devices (`--device cpu,cpu,cpu --split tensor`: every layer
/// split over them by its tensors in one process, a key/value head each, partial products
/// summed between them without a network hop) serves the same greedy completion as `cairn
/// run`. When one of its devices fails a pass (a `dev-hooks` fault), it joins again over the
/// other two (the heads split 2 and 1) and the stream in flight is recovered with the
/// identical output; killed (SIGKILL) in the middle of a stream, its request is recovered on
/// a worker that joins afterwards, again identical. (The split by layers has the engine's
/// stage tests, `engine/src/worker/tests.rs`.)
#[test]
fn one_worker_over_several_devices_serves_and_is_recovered() {
    let dir = artifacts("cluster-devices");
    let (ref_tokens, ref_text) = reference();
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let serve = Serve::embedded(
        &dir,
        model,
        &["--no-mdns", "--ctx", "256", "--wait-timeout", "120"],
    );
    let (api, signal, token) = (&serve.api, &serve.signal, &serve.worker_token);
    // 100 MB per device: no device could hold the model alone.
    let (mut multi, multi_id) = cpu_worker(
        signal,
        token,
        &dir,
        "worker-multi",
        &[
            "--memory-budget",
            "300000000",
            "--model",
            model,
            "--device",
            "cpu,cpu,cpu",
            "--split",
            "tensor",
        ],
        // Device 2 fails the 25th pass: the fifth of the second request (the first takes
        // one prefill and 19 decode passes).
        &[("CAIRN_DEBUG_FAIL_DEVICE", std::path::Path::new("2:25"))],
    );
    let placed = wait_for(
        Duration::from_secs(180),
        "a placement on the worker",
        || {
            let s = stages(api);
            (!s.is_empty()).then_some(s)
        },
    );
    assert_eq!(placed, vec![(multi_id.clone(), 0, 30)]);
    let cluster = get_json(&format!("{api}/api/cluster")).expect("cluster");
    let peer = cluster["peers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["peer_id"] == multi_id.as_str()))
        .cloned()
        .expect("the worker is listed");
    assert_eq!(
        peer["devices"].as_array().map(Vec::len),
        Some(3),
        "its devices are listed: {peer}"
    );
    assert_eq!(peer["memory_budget_bytes"], 300_000_000u64);

    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["cairn"]["tokens"],
        json!(ref_tokens),
        "the layers split by tensors over three devices give another output than cairn run"
    );
    let log = std::fs::read_to_string(dir.join("worker-multi.log")).unwrap_or_default();
    assert!(
        log.contains("split over them by tensor") && !log.contains("by layers instead"),
        "the worker did not say it splits its layers by tensors: {log}"
    );

    // A device fails mid-stream: the worker leaves, joins again over two devices (their
    // 200 MB hold the model) and the request goes on there.
    let (text, finish) = read_stream_for(api, PROMPT, 0, || {});
    assert_eq!(finish.as_deref(), Some("length"));
    assert_eq!(
        text, ref_text,
        "the stream across the loss of one device differs"
    );
    let log = std::fs::read_to_string(dir.join("worker-multi.log")).unwrap_or_default();
    assert!(
        log.contains("joining the room again over the others"),
        "the worker did not carry on without its device: {log}"
    );
    let rejoined = wait_for(
        Duration::from_secs(60),
        "the worker over two devices, placed",
        || {
            let c = get_json(&format!("{api}/api/cluster"))?;
            let peers = c["peers"].as_array()?.clone();
            let p = peers
                .iter()
                .find(|p| p["devices"].as_array().map(Vec::len) == Some(2))?;
            let id = p["peer_id"].as_str()?.to_owned();
            (stages(api) == vec![(id.clone(), 0, 30)]).then_some((id, p.clone()))
        },
    );
    assert_ne!(rejoined.0, multi_id, "a new peer after the device's loss");
    assert_eq!(rejoined.1["memory_budget_bytes"], 200_000_000u64);

    // Killed mid-stream; a worker that joins afterwards takes the request over.
    let mut joined = None;
    let (text, finish) = read_stream_for(api, PROMPT, 5, || {
        multi.kill();
        joined = Some(cpu_worker(
            signal,
            token,
            &dir,
            "worker-after",
            &["--memory-budget", "400000000", "--model", model],
            &[],
        ));
    });
    assert!(joined.is_some(), "the stream ended before 5 pieces");
    assert_eq!(finish.as_deref(), Some("length"));
    assert_eq!(
        text, ref_text,
        "the stream across the loss of the multi-device worker differs"
    );
}

/// One worker over two local devices split by layers, with passes in flight across steps
/// (`CAIRN_STAGE_OVERLAP=on`: while one group of requests' pass runs the second device's
/// layers, the next group's runs the first's): three requests at once each give what `cairn
/// run` gives alone, and a stream cancelled mid-way gives its blocks back on both devices.
#[test]
fn one_worker_split_by_layers_keeps_passes_in_flight() {
    let dir = artifacts("cluster-overlap");
    let (_, ref_text) = reference();
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let serve = Serve::embedded(
        &dir,
        model,
        &[
            "--no-mdns",
            "--ctx",
            "256",
            "--parallel",
            "3",
            "--wait-timeout",
            "120",
        ],
    );
    let (api, signal, token) = (&serve.api, &serve.signal, &serve.worker_token);
    let (_worker, id) = cpu_worker(
        signal,
        token,
        &dir,
        "worker-overlap",
        &[
            "--memory-budget",
            "300000000",
            "--model",
            model,
            "--device",
            "cpu,cpu",
            "--split",
            "layers",
        ],
        &[("CAIRN_STAGE_OVERLAP", std::path::Path::new("on"))],
    );
    let placed = wait_for(
        Duration::from_secs(180),
        "a placement on the worker",
        || {
            let s = stages(api);
            (!s.is_empty()).then_some(s)
        },
    );
    assert_eq!(placed, vec![(id, 0, 30)]);
    let other_refs: Vec<String> = OTHER_PROMPTS
        .iter()
        .map(|p| cairn_tests::procs::cairn_run_greedy(p, TOKENS).1)
        .collect();
    let texts = concurrent_texts(api, &[PROMPT, OTHER_PROMPTS[0], OTHER_PROMPTS[1]]);
    assert_eq!(texts[0], ref_text, "PROMPT among concurrent requests");
    assert_eq!(
        texts[1..],
        other_refs[..],
        "the other prompts, served together"
    );
    let log = std::fs::read_to_string(dir.join("worker-overlap.log")).unwrap_or_default();
    assert!(
        log.contains("passes in flight across steps"),
        "no two passes were ever in flight at once: {log}"
    );
    let mut sse = SseReader::post(&format!("{api}/v1/completions"), &request(true));
    for _ in 0..3 {
        sse.next_event().expect("a first event");
    }
    drop(sse);
    wait_for(
        Duration::from_secs(30),
        "the worker's key/value blocks back after the requests ended",
        || kv_blocks_used(api).filter(|u| !u.is_empty() && u.iter().all(|&b| b == 0)),
    );
}

/// A worker that reports wrong tokens (a `dev-hooks` build's
/// `CAIRN_DEBUG_CORRUPT_TOKENS`) is caught by a spot check on the
/// coordinator's own engine before any wrong token goes out, evicted
/// (listed in `/api/cluster`, recorded in the audit log, never placed
/// again), and the request recovers on the honest workers with `cairn
/// run`'s exact output.
#[test]
fn a_worker_returning_wrong_tokens_is_caught_evicted_and_the_request_recovers() {
    let dir = artifacts("cluster-spot-check");
    let (ref_tokens, _) = reference();
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    // The local worker is trusted, and too small to hold the model alone.
    let serve = Serve::start(
        &dir,
        model,
        &[
            "--no-mdns",
            "--ctx",
            "256",
            "--backend",
            "cpu",
            "--memory-budget",
            BUDGET,
            "--spot-check-rate",
            "1",
        ],
        true,
    );
    let (api, signal, token) = (&serve.api, &serve.signal, &serve.worker_token);
    let (bad_proc, bad) = cpu_worker(
        signal,
        token,
        &dir,
        "worker-corrupt",
        &["--memory-budget", BUDGET, "--model", model],
        &[("CAIRN_DEBUG_CORRUPT_TOKENS", std::path::Path::new("1"))],
    );
    let (_good, good) = cpu_worker(
        signal,
        token,
        &dir,
        "worker-honest",
        &["--memory-budget", BUDGET, "--model", model],
        &[],
    );
    let local = wait_for(Duration::from_secs(180), "three calibrated workers", || {
        let c = get_json(&format!("{api}/api/cluster"))?;
        let peers = c["peers"].as_array()?;
        let calibrated: Vec<String> = peers
            .iter()
            .filter(|p| !p["calibration"].is_null())
            .filter_map(|p| p["peer_id"].as_str().map(str::to_owned))
            .collect();
        (calibrated.len() == 3)
            .then(|| calibrated.into_iter().find(|p| p != &bad && p != &good))
            .flatten()
    });
    // The trusted local worker first, the corrupt one last (it samples).
    let (status, body) = post_json(
        &format!("{api}/api/placement"),
        &json!({"stages": [
            {"peer_id": local, "start": 0, "end": 15},
            {"peer_id": bad, "start": 15, "end": 30},
        ]}),
    );
    assert_eq!(status, 202, "{body}");
    // This very placement: the automatic one may have the corrupt worker second too, behind
    // the honest one (CI, 2026-11-27: the request ran there, its check named both untrusted
    // workers, and both were evicted).
    let wanted = vec![(local.clone(), 0, 15), (bad.clone(), 15, 30)];
    wait_for(
        Duration::from_secs(120),
        "the placement with the corrupt worker",
        || (stages(api) == wanted).then_some(()),
    );
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    // On a failure, what the coordinator thought of its workers then (the
    // peers' online flags, the evicted list) says which one went missing.
    let cluster_then = || get_json(&format!("{api}/api/cluster")).unwrap_or_default();
    assert_eq!(status, 200, "{body}\ncluster: {}", cluster_then());
    assert_eq!(
        body["cairn"]["tokens"],
        json!(ref_tokens),
        "the output after the eviction differs from cairn run's"
    );
    assert!(body["cairn"]["recoveries"].as_u64() >= Some(1), "{body}");
    let c = get_json(&format!("{api}/api/cluster")).expect("cluster state");
    let evicted: Vec<&str> = c["evicted"]
        .as_array()
        .expect("an evicted list")
        .iter()
        .filter_map(|e| e["peer_id"].as_str())
        .collect();
    assert_eq!(evicted, vec![bad.as_str()], "{c}");
    assert!(c["spot_checks"]["wrong"].as_u64() >= Some(1), "{c}");
    assert!(c["spot_checks"]["right"].as_u64() >= Some(1), "{c}");
    let s = stages(api);
    assert!(s.iter().all(|st| st.0 != bad), "{s:?}");
    let audit = std::fs::read_to_string(dir.join("serve-state").join("audit.jsonl"))
        .expect("the audit log");
    assert!(
        audit
            .lines()
            .any(|l| l.contains("\"evicted\"") && l.contains(&bad)),
        "no eviction recorded:\n{audit}"
    );
    // Checked again: the honest placement gives the same text.
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cairn"]["tokens"], json!(ref_tokens));

    // The same worker started again (a new peer id, the same token, the same address) is
    // evicted again before it is calibrated or placed.
    drop(bad_proc);
    let (_again, again) = cpu_worker(
        signal,
        token,
        &dir,
        "worker-corrupt-again",
        &["--memory-budget", BUDGET, "--model", model],
        &[("CAIRN_DEBUG_CORRUPT_TOKENS", std::path::Path::new("1"))],
    );
    assert_ne!(again, bad);
    let c = wait_for(Duration::from_secs(60), "the second eviction", || {
        let c = get_json(&format!("{api}/api/cluster"))?;
        c["evicted"]
            .as_array()?
            .iter()
            .any(|e| e["peer_id"] == again.as_str())
            .then_some(c)
    });
    let peers = c["peers"].as_array().expect("peers");
    assert!(
        peers
            .iter()
            .all(|p| p["peer_id"] != again.as_str() || p["calibration"].is_null()),
        "the returning worker was calibrated: {c}"
    );
    let (status, body) = post_json(&format!("{api}/v1/completions"), &request(false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cairn"]["tokens"], json!(ref_tokens));
    assert!(stages(api).iter().all(|st| st.0 != again));
}

/// A model of another family in a K-quant format, end to end: a tiny Qwen2 file (Q/K/V
/// biases, NEOX rope, an untied head; Q4_K, Q8_0 and F32 tensors) that the CLI names, that
/// the coordinator places over two workers which fetch their layers over HTTP ranges (neither
/// has the file), whose greedy output equals the engine's on one device, and that is
/// recovered on a third worker when a stage's worker is killed mid-stream.
#[test]
fn a_qwen2_k_quant_file_is_fetched_placed_served_and_recovered() {
    const N: usize = 16;
    let dir = artifacts("cluster-qwen2");
    let (path, prompt, want) = cairn_tests::families::tiny_qwen2_firm_path(&dir, N);
    let model = path.to_str().expect("utf-8 path");

    // `cairn devices --json --model` names the architecture and each format in use.
    let out = bounded(
        std::process::Command::new(bin("cairn")).args(["devices", "--json", "--model", model]),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).expect("devices JSON");
    assert_eq!(listed["model"]["architecture"], "qwen2", "{listed}");
    let formats: Vec<&str> = listed["model"]["formats"]
        .as_array()
        .expect("formats")
        .iter()
        .filter_map(|f| f["type"].as_str())
        .collect();
    for ty in ["Q4_K", "Q8_0", "F32"] {
        assert!(formats.contains(&ty), "{ty} missing from {formats:?}");
    }

    let serve = Serve::embedded(
        &dir,
        model,
        &[
            "--no-mdns",
            "--ctx",
            "64",
            "--parallel",
            "2",
            "--wait-timeout",
            "120",
        ],
    );
    let (api, signal, token) = (&serve.api, &serve.signal, &serve.worker_token);
    // Enough for a stage of one layer with the embedding or the head, not for both layers.
    let mut workers: Vec<(Proc, String)> = (0..3)
        .map(|i| {
            let name = format!("worker-{i}");
            let cache = dir.join(format!("{name}-cache"));
            let _ = std::fs::remove_dir_all(&cache);
            let cache = cache.to_str().expect("utf-8 path").to_owned();
            cpu_worker(
                signal,
                token,
                &dir,
                &name,
                &["--memory-budget", QWEN2_BUDGET, "--cache-dir", &cache],
                &[],
            )
        })
        .collect();
    let placed = wait_for(
        Duration::from_secs(180),
        "a placement over two workers",
        || {
            let s = stages(api);
            (s.len() == 2).then_some(s)
        },
    );
    assert_eq!((placed[0].1, placed[1].2), (0, 2), "{placed:?}");

    let body = |stream: bool| json!({"prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": true, "stream": stream});
    let (status, got) = post_json(&format!("{api}/v1/completions"), &body(false));
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        got["cairn"]["tokens"],
        json!(want),
        "the tiny qwen2 over two workers differs from the engine on one device"
    );
    let first_text = got["choices"][0]["text"]
        .as_str()
        .expect("the text")
        .to_owned();
    for (i, _) in placed.iter().enumerate() {
        let cached = std::fs::read_dir(dir.join(format!("worker-{i}-cache")))
            .map(|d| d.flatten().count())
            .unwrap_or(0);
        let placed_here = placed.iter().any(|s| s.0 == workers[i].1);
        assert!(
            !placed_here || cached > 0,
            "worker-{i} serves layers it did not fetch"
        );
    }

    // kill -9 the worker of the first stage after 4 pieces: the spare takes its layers and
    // the stream ends as it would have.
    let victim = placed[0].0.clone();
    let mut sse = SseReader::post(&format!("{api}/v1/completions"), &body(true));
    let (mut text, mut pieces) = (String::new(), 0);
    while let Some(ev) = sse.next_event() {
        assert!(
            ev.get("error").is_none(),
            "the stream carried an error: {ev}"
        );
        if let Some(t) = ev["choices"][0]["text"].as_str()
            && !t.is_empty()
        {
            text.push_str(t);
            pieces += 1;
            if pieces == 4 {
                let w = workers
                    .iter_mut()
                    .find(|(_, id)| id == &victim)
                    .expect("the victim is ours");
                w.0.kill();
            }
        }
    }
    assert!(pieces >= 4, "the stream ended after {pieces} pieces");
    assert_eq!(
        text, first_text,
        "the stream across the kill differs from the request before it"
    );
    let after = stages(api);
    assert!(
        !after.iter().any(|s| s.0 == victim),
        "the killed worker is still placed: {after:?}"
    );
}

/// See `a_qwen2_k_quant_file_is_fetched_placed_served_and_recovered`: the coordinator counts
/// a stage's scratch for 256 rows (2.7 MB for this width), so one layer with an end fits
/// and the whole model (about 4.2 MB at `--ctx 64 --parallel 2`) does not.
const QWEN2_BUDGET: &str = "3900000";
