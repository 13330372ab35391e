//! Chaos: a cluster whose links are delayed, lossy and cut, in network
//! namespaces the test makes itself (`unshare -rn`, no privilege needed
//! where user namespaces are allowed).
//!
//! The test runs itself again inside a new user and network namespace (the
//! "hub"), which holds cairn-signal, `cairn serve` (coordinator only) and a
//! TURN server; each of three `cairn worker`s runs in a network namespace
//! of its own, joined to the hub by a veth pair (10.0.i.2 over there,
//! 10.0.i.1 in the hub, which routes between them). What is done to the
//! traffic, and how:
//! - **delay 20 ms and 2% loss** on every datagram between peers: every
//!   link is relay-only through the hub's TURN server, whose relay sockets
//!   hold each datagram 20 ms (order kept) and drop 2% at random
//!   (`cairn_tests::impaired_relay`). The kernels this runs on may have no
//!   netem qdisc and no tc classifier or action (this machine's has
//!   neither), so the impairment is in userspace, where a lossy router
//!   would be on the path;
//! - **a 5 s partition** of one worker holding layers, in the middle of a
//!   stream: its veth is taken down in the hub (`ip link set wI down`),
//!   cutting everything it has (links, signaling), and brought up again.
//!
//! Every output must equal `cairn run`'s; the figures (how long the stream
//! stalled, when the partitioned worker was back) are printed.
//! Skipped, saying so, only where the namespaces are refused.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cairn_tests::impaired_relay::{self, Impairment};
use cairn_tests::model_path;
use cairn_tests::procs::{
    Proc, Signal, SseReader, artifacts, bin, cairn_run_greedy, free_port, get_json, get_text,
    post_json, wait_for,
};
use serde_json::json;

const INSIDE: &str = "CAIRN_CHAOS_INSIDE";
const PROMPT: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,";
const TOKENS: usize = 24;
/// The model (98 MB) needs two of these; the third worker is the spare.
const BUDGET: &str = "100000000";
const HUB: &str = "10.0.0.1";
const DELAY: Duration = Duration::from_millis(20);
const LOSS: f64 = 0.02;
const PARTITION: Duration = Duration::from_secs(5);

#[test]
fn delay_loss_and_a_partition_leave_outputs_identical() {
    if std::env::var_os(INSIDE).is_some() {
        inside();
        return;
    }
    // iproute2 missing is a broken test setup (scripts/test.sh installs it), not a reason to skip.
    assert!(
        Command::new("ip").arg("-V").output().is_ok(),
        "the chaos test needs `ip` (iproute2) to make its veth pairs"
    );
    let probe = Command::new("unshare")
        .args(["-rn", "ip", "link", "add", "probe", "type", "veth"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "SKIPPED: this system refuses user and network namespaces or veth pairs (`unshare -rn ip link add probe type veth`: {})",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            eprintln!("SKIPPED: `unshare` cannot be run here: {e}");
            return;
        }
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let status = Command::new("unshare")
        .arg("-rn")
        .arg(exe)
        .args([
            "delay_loss_and_a_partition_leave_outputs_identical",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(INSIDE, "1")
        .status()
        .expect("run the test inside a namespace");
    assert!(
        status.success(),
        "the chaos test failed inside its namespace"
    );
}

fn sh(cmd: &str) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().expect("sh");
    assert!(
        out.status.success(),
        "`{cmd}`: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `cairn worker` in a network namespace of its own, reached over veth `w{i}`.
fn worker(i: u8, signal: &str, token: &str, turn: &[String], dir: &Path) -> (Proc, String) {
    let model = model_path();
    // The worker's namespace waits for its end of the veth, sets it up and
    // routes through the hub, then becomes the worker.
    let setup = format!(
        "while ! ip link show eth0 >/dev/null 2>&1; do sleep 0.02; done; \
         ip link set lo up && ip addr add 10.0.{i}.2/24 dev eth0 && ip link set eth0 up && \
         ip route add default via 10.0.{i}.1 && exec \"$@\""
    );
    let cairn = bin("cairn");
    let mut args: Vec<&str> = vec![
        "-n",
        "sh",
        "-c",
        &setup,
        "sh",
        cairn.to_str().expect("utf-8 path"),
        "worker",
        "--signal",
        signal,
        "--token",
        token,
        "--backend",
        "cpu",
        "--memory-budget",
        BUDGET,
        "--model",
        model.to_str().expect("utf-8 path"),
    ];
    args.extend(turn.iter().map(String::as_str));
    let mut p = Proc::spawn(
        &PathBuf::from("unshare"),
        &args,
        dir,
        &format!("worker-{i}"),
    );
    // Its end of the veth goes into its namespace, so only once `unshare`
    // has made one (else it would land in the hub's).
    let ours = std::fs::read_link("/proc/self/ns/net").expect("our network namespace");
    wait_for(Duration::from_secs(10), "the worker's namespace", || {
        std::fs::read_link(format!("/proc/{}/ns/net", p.pid()))
            .ok()
            .filter(|ns| *ns != ours)
    });
    sh(&format!(
        "ip link add w{i} type veth peer name eth0 netns {pid} && ip addr add 10.0.{i}.1/24 dev w{i} && ip link set w{i} up",
        pid = p.pid()
    ));
    let line = p.wait_line("joined room");
    let id = line.rsplit(' ').next().expect("peer id").to_owned();
    (p, id)
}

fn placed(api: &str) -> Vec<String> {
    get_json(&format!("{api}/api/cluster"))
        .filter(|c| c["placement"]["state"] == "ready")
        .and_then(|c| {
            c["placement"]["stages"].as_array().map(|a| {
                a.iter()
                    .filter_map(|s| s["peer_id"].as_str().map(str::to_owned))
                    .collect()
            })
        })
        .unwrap_or_default()
}

fn status_of(api: &str, peer: &str) -> Option<String> {
    let c = get_json(&format!("{api}/api/cluster"))?;
    c["peers"]
        .as_array()?
        .iter()
        .find(|p| p["peer_id"] == peer)
        .and_then(|p| p["status"].as_str().map(str::to_owned))
}

fn inside() {
    let t_start = Instant::now();
    let dir = artifacts("chaos");
    sh(&format!(
        "ip link set lo up && ip addr add {HUB}/32 dev lo && echo 1 > /proc/sys/net/ipv4/ip_forward"
    ));
    let (ref_tokens, ref_text) = cairn_run_greedy(PROMPT, TOKENS);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let imp = Impairment::new(DELAY, LOSS, 0x5eed);
    let (turn_server, turn_addr) = rt.block_on(impaired_relay::start(
        HUB.parse().expect("an address"),
        imp.clone(),
    ));
    let turn = impaired_relay::turn_args(turn_addr);

    let signal = Signal::start_on(&dir, HUB);
    let worker_token = signal.token("main", "worker");
    let coord_token = signal.token("main", "coordinator");
    let listen = format!("127.0.0.1:{}", free_port());
    let api = format!("http://{listen}");
    let model = model_path();
    let mut coord_args: Vec<&str> = vec![
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
        "--spot-check-rate",
        "0",
        "--model",
        model.to_str().expect("utf-8 path"),
    ];
    coord_args.extend(turn.iter().map(String::as_str));
    let _coord = Proc::spawn(&bin("cairn"), &coord_args, &dir, "coordinator");
    let mut workers: Vec<(Proc, String)> = (1..=3)
        .map(|i| worker(i, &signal.url, &worker_token, &turn, &dir))
        .collect();
    wait_for(Duration::from_secs(120), "a placement that serves", || {
        (get_text(&format!("{api}/healthz")).0 == 200).then_some(())
    });
    let formed = t_start.elapsed();

    // Delay and loss alone.
    let body = json!({"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0});
    let t = Instant::now();
    let (status, out) = post_json(&format!("{api}/v1/completions"), &body);
    let impaired_request = t.elapsed();
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["cairn"]["tokens"],
        json!(ref_tokens),
        "under delay and loss"
    );

    // A 5 s partition of a placed worker in the middle of a stream.
    let stages = placed(&api);
    let (victim_i, victim_id) = workers
        .iter()
        .enumerate()
        .find(|(_, (_, id))| stages.contains(id))
        .map(|(i, (_, id))| (i + 1, id.clone()))
        .expect("a placed worker");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let mut sse = SseReader::post(&format!("{api}/v1/completions"), &stream_body);
    let mut text = String::new();
    let mut pieces = 0;
    let mut last = Instant::now();
    let mut longest_gap = Duration::ZERO;
    let mut cut_at = None;
    let mut healer = None;
    while let Some(ev) = sse.next_event() {
        assert!(
            ev.get("error").is_none(),
            "the stream carried an error: {ev}"
        );
        if let Some(piece) = ev["choices"][0]["text"].as_str()
            && !piece.is_empty()
        {
            text.push_str(piece);
            pieces += 1;
            longest_gap = longest_gap.max(last.elapsed());
            last = Instant::now();
            if pieces == 3 {
                sh(&format!("ip link set w{victim_i} down"));
                cut_at = Some(Instant::now());
                healer = Some(std::thread::spawn(move || {
                    std::thread::sleep(PARTITION);
                    sh(&format!("ip link set w{victim_i} up"));
                    Instant::now()
                }));
            }
        }
    }
    let cut_at = cut_at.expect("the stream reached its third piece");
    let stream_done = cut_at.elapsed();
    let healed_at = healer
        .expect("the partition was made")
        .join()
        .expect("the healer thread");
    assert_eq!(text, ref_text, "the stream across the partition");
    let stages_after = placed(&api);

    // The partitioned worker comes back: online again (linked, calibrated).
    let back = wait_for(
        Duration::from_secs(60),
        "the partitioned worker back",
        || {
            status_of(&api, &victim_id)
                .filter(|s| s != "offline" && s != "calibrating")
                .map(|_| healed_at.elapsed())
        },
    );
    let t = Instant::now();
    let (status, out) = post_json(&format!("{api}/v1/completions"), &body);
    let after_request = t.elapsed();
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["cairn"]["tokens"],
        json!(ref_tokens),
        "after the partition"
    );
    for (w, _) in &mut workers {
        assert!(w.is_running(), "{} exited", w.name);
    }

    println!(
        "chaos: delay {} ms, loss {:.0}% ({} datagrams relayed, {} dropped); cluster formed in {:.1} s; \
         a {TOKENS}-token request under delay and loss {:.2} s; partition of {victim_id} ({}) for {} s at the 3rd of {pieces} pieces: \
         stream done {:.1} s after the cut (longest gap {:.1} s), placement after it {:?}; \
         worker back {:.1} s after the link came up; request after {:.2} s; outputs identical; test {:.0} s",
        DELAY.as_millis(),
        LOSS * 100.0,
        imp.sent.load(std::sync::atomic::Ordering::Relaxed),
        imp.dropped.load(std::sync::atomic::Ordering::Relaxed),
        formed.as_secs_f64(),
        impaired_request.as_secs_f64(),
        if stages.len() > 1 {
            "one of the stages"
        } else {
            "the only stage"
        },
        PARTITION.as_secs(),
        stream_done.as_secs_f64(),
        longest_gap.as_secs_f64(),
        stages_after,
        back.as_secs_f64(),
        after_request.as_secs_f64(),
        t_start.elapsed().as_secs_f64(),
    );
    drop(workers);
    rt.block_on(async { turn_server.close().await.ok() });
}
