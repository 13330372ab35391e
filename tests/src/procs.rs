//! Real processes for end-to-end tests: the `cairn` and `cairn-signal`
//! binaries of this build, on loopback, killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A binary of this workspace's build (`target/<profile>/<name>`), next to
/// the test executable's directory. `cargo test --workspace` builds them.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build -p cairn -p cairn-signal, or cargo test --workspace)",
        path.display()
    );
    path
}

/// Where test logs and artifacts go: `target/test-artifacts/<test>/`.
pub fn artifacts(test: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let target = exe
        .ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let dir = target.join("test-artifacts").join(test);
    std::fs::create_dir_all(&dir).expect("artifact dir");
    dir
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A child process, killed (SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    child: Child,
    stdout: Option<BufReader<ChildStdout>>,
}

impl Proc {
    /// Starts `bin` with `args`; stderr goes to `<log_dir>/<name>.log`.
    pub fn spawn(bin: &Path, args: &[&str], log_dir: &Path, name: &str) -> Proc {
        Proc::spawn_env(bin, args, &[], log_dir, name)
    }

    /// [`Proc::spawn`] with extra environment variables.
    pub fn spawn_env(
        bin: &Path,
        args: &[&str],
        env: &[(&str, &Path)],
        log_dir: &Path,
        name: &str,
    ) -> Proc {
        let log = std::fs::File::create(log_dir.join(format!("{name}.log"))).expect("log file");
        let mut child = Command::new(bin)
            .args(args)
            .envs(env.iter().copied())
            .env(
                "RUST_LOG",
                "warn,cairn=info,cairn_native=info,cairn_signal=info",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let stdout = child.stdout.take().map(BufReader::new);
        Proc {
            name: name.to_owned(),
            child,
            stdout,
        }
    }

    /// The process id (for reading its memory from /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Reads stdout lines until one contains `needle`; returns that line.
    /// Panics (naming the process) if it exits first. Reading blocks, so
    /// only use it for lines the process prints promptly.
    pub fn wait_line(&mut self, needle: &str) -> String {
        let out = self.stdout.as_mut().expect("stdout is piped");
        let mut line = String::new();
        loop {
            line.clear();
            let n = out.read_line(&mut line).expect("reading stdout");
            assert!(n > 0, "{} exited before printing '{needle}'", self.name);
            if line.contains(needle) {
                return line.trim().to_owned();
            }
        }
    }

    /// SIGKILL, as a crash or a pulled plug would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, as a service manager stops a process; its exit status if it
    /// ends within `within` (SIGKILL after that, and `None`).
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
        None
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` every 200 ms until it gives `Some`, or panics after `timeout` saying `what`.
pub fn wait_for<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t0.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// GET a JSON document; `None` on any failure (for polling).
pub fn get_json(url: &str) -> Option<Value> {
    ureq::get(url)
        .timeout(Duration::from_secs(10))
        .call()
        .ok()?
        .into_json()
        .ok()
}

/// POST JSON; returns the status and the JSON body, whatever the status.
pub fn post_json(url: &str, body: &Value) -> (u16, Value) {
    post_raw(url, &body.to_string())
}

/// POST a raw body as JSON; returns the status and the JSON body.
pub fn post_raw(url: &str, body: &str) -> (u16, Value) {
    let r = ureq::post(url)
        .timeout(Duration::from_secs(600))
        .set("Content-Type", "application/json")
        .send_string(body);
    let resp = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("POST {url}: {e}"),
    };
    let status = resp.status();
    let text = resp.into_string().unwrap_or_default();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

/// GET `url`: the status and the body as text, whatever the status.
pub fn get_text(url: &str) -> (u16, String) {
    let resp = match ureq::get(url).timeout(Duration::from_secs(60)).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {url}: {e}"),
    };
    (resp.status(), resp.into_string().unwrap_or_default())
}

/// A `cairn-signal serve` on a loopback port, with a secret file to issue tokens.
pub struct Signal {
    pub proc: Proc,
    pub url: String,
    secret: PathBuf,
}

impl Signal {
    pub fn start(dir: &Path) -> Signal {
        Signal::start_on(dir, "127.0.0.1")
    }

    /// [`Signal::start`] listening on `ip` (an address in the chaos test's namespace).
    pub fn start_on(dir: &Path, ip: &str) -> Signal {
        let secret = dir.join("signal.secret");
        let _ = std::fs::remove_file(&secret);
        let status = Command::new(bin("cairn-signal"))
            .args(["secret", "--out"])
            .arg(&secret)
            .status()
            .expect("cairn-signal secret");
        assert!(status.success(), "cairn-signal secret failed");
        let port = free_port();
        let listen = format!("{ip}:{port}");
        let proc = Self::spawn(dir, &listen, &secret, "cairn-signal");
        Signal {
            proc,
            url: format!("ws://{listen}"),
            secret,
        }
    }

    fn spawn(dir: &Path, listen: &str, secret: &Path, name: &str) -> Proc {
        let proc = Proc::spawn(
            &bin("cairn-signal"),
            &[
                "serve",
                "--listen",
                listen,
                "--no-mdns",
                "--secret-file",
                secret.to_str().expect("utf-8 path"),
            ],
            dir,
            name,
        );
        let health = format!("http://{listen}/healthz");
        wait_for(Duration::from_secs(30), "cairn-signal to answer", || {
            ureq::get(&health).call().ok()
        });
        proc
    }

    /// Kills the server (every session ends at once) and starts it again on
    /// the same address with the same secret, after `down`.
    pub fn restart(&mut self, dir: &Path, down: Duration) {
        self.restart_after(dir, || std::thread::sleep(down));
    }

    /// [`Signal::restart`], with the server down while `down` runs.
    pub fn restart_after(&mut self, dir: &Path, down: impl FnOnce()) {
        self.proc.kill();
        down();
        let listen = self.url.trim_start_matches("ws://").to_owned();
        self.proc = Self::spawn(dir, &listen, &self.secret, "cairn-signal-again");
    }

    /// A token for `role` (worker, coordinator) in `room`.
    pub fn token(&self, room: &str, role: &str) -> String {
        let out = Command::new(bin("cairn-signal"))
            .args(["token", "--room", room, "--role", role, "--secret-file"])
            .arg(&self.secret)
            .output()
            .expect("cairn-signal token");
        assert!(out.status.success(), "cairn-signal token failed");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

/// `cairn serve` with its embedded cairn-signal and no local worker, on a free loopback port;
/// the worker token is read from the join URL it prints.
pub struct Serve {
    pub proc: Proc,
    pub port: u16,
    /// `http://127.0.0.1:PORT`.
    pub api: String,
    /// The embedded cairn-signal, `ws://127.0.0.1:PORT`.
    pub signal: String,
    pub worker_token: String,
}

impl Serve {
    /// Starts it on `model` with `extra` flags; returns once it printed the join URL.
    pub fn embedded(dir: &Path, model: &str, extra: &[&str]) -> Serve {
        Serve::start(dir, model, extra, false)
    }

    /// [`Serve::embedded`] with `cairn serve`'s own local worker (on the
    /// devices and budget `extra` names) when `local_worker`.
    pub fn start(dir: &Path, model: &str, extra: &[&str], local_worker: bool) -> Serve {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        // Its own secret, revocations and join tokens, not the user's.
        let state = dir.join("serve-state");
        let _ = std::fs::remove_dir_all(&state);
        let state = state.to_str().expect("utf-8 path").to_owned();
        let mut args = vec![
            "serve",
            "--listen",
            &listen,
            "--state-dir",
            &state,
            "--model",
            model,
        ];
        if !local_worker {
            args.push("--no-local-worker");
        }
        args.extend_from_slice(extra);
        let mut proc = Proc::spawn(&bin("cairn"), &args, dir, "serve");
        let join = proc.wait_line("join:");
        let worker_token = join
            .split("token=")
            .nth(1)
            .expect("the join URL carries a worker token")
            .trim()
            .to_owned();
        Serve {
            proc,
            port,
            api: format!("http://{listen}"),
            signal: format!("ws://{listen}"),
            worker_token,
        }
    }
}

/// Reads an OpenAI streaming response: yields each `data:` payload as JSON
/// (`[DONE]` ends it).
pub struct SseReader {
    lines: std::io::Lines<BufReader<Box<dyn std::io::Read + Send + Sync>>>,
}

impl SseReader {
    pub fn post(url: &str, body: &Value) -> SseReader {
        let resp = ureq::post(url)
            .timeout(Duration::from_secs(600))
            .send_json(body.clone())
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        SseReader {
            lines: BufReader::new(resp.into_reader()).lines(),
        }
    }

    /// The next data payload, `None` at `[DONE]` or the end.
    pub fn next_event(&mut self) -> Option<Value> {
        for line in self.lines.by_ref() {
            let line = line.ok()?;
            if let Some(data) = line.strip_prefix("data:") {
                let data = data.trim();
                if data == "[DONE]" {
                    return None;
                }
                return serde_json::from_str(data).ok();
            }
        }
        None
    }
}

/// `cairn run`'s greedy tokens and text for a raw prompt on the cpu backend:
/// the single-device reference distributed runs are compared with.
pub fn cairn_run_greedy(prompt: &str, max_tokens: usize) -> (Vec<u64>, String) {
    let out = Command::new(bin("cairn"))
        .args([
            "run",
            "--backend",
            "cpu",
            "--raw",
            "--temperature",
            "0",
            "--json",
        ])
        .args([
            "--max-tokens",
            &max_tokens.to_string(),
            "--prompt",
            prompt,
            "--model",
        ])
        .arg(crate::model_path())
        .output()
        .expect("cairn run");
    assert!(
        out.status.success(),
        "cairn run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("cairn run --json prints an object");
    let tokens = json["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(|t| t.as_u64())
        .collect();
    (tokens, json["text"].as_str().expect("text").to_owned())
}
