//! A soak of `cairn serve` (with its local worker, on the cpu backend and
//! the default model): 1,000 short greedy requests from 8 clients at once,
//! every tenth a stream the client drops after its first token while the
//! server still has tokens to make. Every request that completes must give
//! `cairn run`'s tokens, and the process's resident memory must stay flat:
//! after the first 200 requests it may grow by at most [`RSS_GROWTH_MB`]
//! over the remaining 800 (a leak of a KV cache, a request's state or a
//! stream per request would pass that well before the end).
//!
//! The requests are short (a prompt of a few tokens, [`TOKENS`] generated)
//! so the thousand fit in about two minutes on a 2-core machine: what is
//! soaked is the per-request machinery (admission, the queue behind
//! `--parallel`, KV caches taken and returned, streams opened and dropped),
//! which costs the same for a short request as for a long one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cairn_tests::model_path;
use cairn_tests::procs::{Serve, SseReader, artifacts, cairn_run_greedy, post_json, wait_for};
use serde_json::json;

const REQUESTS: usize = 1_000;
const CLIENTS: usize = 8;
/// Tokens of a completed request.
const TOKENS: usize = 2;
/// Tokens a dropped stream asks for: the client leaves after the first,
/// so the server must cancel a request that still has work to do.
const STREAM_TOKENS: usize = 16;
/// How much the resident set may grow from request 200 to request 1,000.
const RSS_GROWTH_MB: f64 = 48.0;
/// Short prompts whose first greedy tokens are firm (counting).
/// Six to eight tokens each: prefill is most of a short request's time on the cpu backend.
const PROMPTS: [&str; 3] = ["1, 2, 3,", "a, b, c,", "2, 4, 6,"];

fn rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .expect("VmRSS")
        / 1024.0
}

#[test]
fn a_thousand_requests_with_cancellations_keep_memory_flat_and_outputs_right() {
    let dir = artifacts("soak");
    let model = model_path();
    let model = model.to_str().expect("utf-8 path");
    let refs: Vec<Vec<u64>> = PROMPTS
        .iter()
        .map(|p| cairn_run_greedy(p, TOKENS).0)
        .collect();
    let serve = Serve::start(
        &dir,
        model,
        &[
            "--no-mdns",
            "--ctx",
            "128",
            "--backend",
            "cpu",
            "--parallel",
            "4",
            "--spot-check-rate",
            "0",
        ],
        true,
    );
    let api = serve.api.clone();
    let pid = serve.proc.pid();
    wait_for(Duration::from_secs(180), "a placement", || {
        let c = cairn_tests::procs::get_json(&format!("{api}/api/cluster"))?;
        (c["placement"]["state"] == "ready").then_some(())
    });
    let t0 = Instant::now();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let cancelled = AtomicUsize::new(0);
    let rss_at_200 = std::sync::Mutex::new(None::<f64>);
    let rss_max_after = std::sync::Mutex::new(0.0f64);
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= REQUESTS {
                        break;
                    }
                    let which = i % PROMPTS.len();
                    let stream = i % 10 == 9;
                    let body = json!({
                        "model": "SmolLM2-135M-Instruct",
                        "prompt": PROMPTS[which],
                        "max_tokens": if stream { STREAM_TOKENS } else { TOKENS },
                        "temperature": 0,
                        "stream": stream,
                    });
                    if stream {
                        // The client reads one token and goes away.
                        let mut sse = SseReader::post(&format!("{api}/v1/completions"), &body);
                        assert!(sse.next_event().is_some(), "request {i}: no first event");
                        drop(sse);
                        cancelled.fetch_add(1, Ordering::Relaxed);
                    } else {
                        let (status, out) = post_json(&format!("{api}/v1/completions"), &body);
                        assert_eq!(status, 200, "request {i}: {out}");
                        assert_eq!(
                            out["cairn"]["tokens"],
                            json!(refs[which]),
                            "request {i} ({})",
                            PROMPTS[which]
                        );
                    }
                    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                    let rss = rss_mb(pid);
                    if n == 200 {
                        *rss_at_200.lock().expect("lock") = Some(rss);
                    } else if n > 200 {
                        let mut m = rss_max_after.lock().expect("lock");
                        *m = m.max(rss);
                    }
                }
            });
        }
    });
    // What the cancelled streams left behind has gone once the server is idle.
    wait_for(Duration::from_secs(30), "no request in flight", || {
        let c = cairn_tests::procs::get_json(&format!("{api}/api/cluster"))?;
        (c["requests"]["in_flight"] == 0).then_some(())
    });
    let after_200 = rss_at_200.lock().expect("lock").expect("an RSS at 200");
    let max_after = *rss_max_after.lock().expect("lock");
    let idle = rss_mb(pid);
    let elapsed = t0.elapsed();
    println!(
        "soak: {REQUESTS} requests ({} cancelled) in {:.1} s; RSS {after_200:.1} MB after 200, at most {max_after:.1} MB after, {idle:.1} MB idle",
        cancelled.load(Ordering::Relaxed),
        elapsed.as_secs_f64()
    );
    assert!(
        max_after - after_200 <= RSS_GROWTH_MB,
        "RSS grew from {after_200:.1} MB to {max_after:.1} MB over the last 800 requests"
    );
    assert!(
        idle - after_200 <= RSS_GROWTH_MB,
        "RSS idle at {idle:.1} MB against {after_200:.1} MB after 200"
    );
}
