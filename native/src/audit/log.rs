//! Writing the audit log: records go through a bounded queue to a thread
//! that chains and appends them, so a slow or failing disk never holds up
//! or fails a request. A full queue drops the record and counts it (a
//! `dropped` record says how many later); a write error is logged once and
//! counted, and the writer reopens the file for the next record.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{error, warn};

use super::Event;
use super::chain::{self, Chain};

/// The log in a state directory, and the file it rotated to.
pub const FILE: &str = "audit.jsonl";
pub const ROTATED: &str = "audit.1.jsonl";
/// A file is rotated before it grows past this; with the one rotated file
/// kept, the log takes at most twice this on disk.
pub const DEFAULT_CAP: u64 = 8 << 20;
/// Records waiting for the writer; more are dropped and counted.
const QUEUE: usize = 4096;

/// What the writer has done, for `/metrics`.
#[derive(Debug, Default)]
pub struct AuditStats {
    pub written: AtomicU64,
    /// Records the queue had no room for.
    pub dropped: AtomicU64,
    pub write_errors: AtomicU64,
    /// Set once the first write error was logged.
    error_logged: AtomicBool,
}

enum Msg {
    Record(u64, serde_json::Value),
    Close,
}

/// The audit log of one coordinator; cheap to share behind an `Arc`.
pub struct AuditLog {
    tx: Option<SyncSender<Msg>>,
    stats: Arc<AuditStats>,
    /// Dropped records not yet reported in the log itself.
    unreported: Arc<AtomicU64>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("on", &self.tx.is_some())
            .finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl AuditLog {
    /// A log that records nothing (no state directory).
    pub fn off() -> AuditLog {
        AuditLog {
            tx: None,
            stats: Arc::default(),
            unreported: Arc::default(),
            thread: Mutex::new(None),
        }
    }

    /// Appends to `<dir>/audit.jsonl`, continuing its chain, rotating it
    /// to `audit.1.jsonl` before it passes `cap` bytes.
    pub fn open(dir: &Path, cap: u64) -> std::io::Result<AuditLog> {
        let path = dir.join(FILE);
        let sink = Sink::open(path)?;
        let (tx, rx) = sync_channel(QUEUE);
        let stats = Arc::new(AuditStats::default());
        let unreported = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stats, unreported) = (stats.clone(), unreported.clone());
            std::thread::Builder::new()
                .name("audit-log".into())
                .spawn(move || write_loop(sink, cap, rx, &stats, &unreported))?
        };
        Ok(AuditLog {
            tx: Some(tx),
            stats,
            unreported,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn stats(&self) -> &AuditStats {
        &self.stats
    }

    /// Queues `event`; never waits.
    pub fn record(&self, event: Event) {
        let Some(tx) = &self.tx else { return };
        let value = match serde_json::to_value(&event) {
            Ok(v) => v,
            Err(_) => return,
        };
        match tx.try_send(Msg::Record(now_ms(), value)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                self.unreported.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Writes what is queued and stops the writer (at shutdown).
    pub fn close(&self) {
        let Some(tx) = &self.tx else { return };
        let _ = tx.send(Msg::Close);
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// The open file, its size and its chain's tip.
struct Sink {
    path: PathBuf,
    file: File,
    size: u64,
    chain: Chain,
}

fn open_append(path: &Path) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.append(true).create(true).read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    options.open(path)
}

impl Sink {
    /// Opens `path` and finds where its chain ends. A damaged tail (a torn
    /// write) is kept as it is, for `cairn audit verify` to show, and the
    /// chain goes on from the last whole record on a line of its own.
    fn open(path: PathBuf) -> std::io::Result<Sink> {
        let mut file = open_append(&path)?;
        // Only a regular file is read back (a device such as /dev/null is written only).
        let bytes = if file.metadata()?.is_file() {
            std::fs::read(&path)?
        } else {
            Vec::new()
        };
        let text = String::from_utf8_lossy(&bytes);
        let (tip, damaged) = chain::resume(&text);
        let mut size = bytes.len() as u64;
        if damaged {
            warn!(path = %path.display(), "the audit log's last lines are damaged; `cairn audit verify` shows where");
            if !bytes.is_empty() && !bytes.ends_with(b"\n") {
                file.write_all(b"\n")?;
                size += 1;
            }
        }
        Ok(Sink {
            path,
            file,
            size,
            chain: Chain::after(tip),
        })
    }

    fn write(&mut self, at: u64, event: &serde_json::Value, cap: u64) -> std::io::Result<()> {
        let saved = self.chain.tip().clone();
        let mut line = self.chain.append(at, event);
        if self.size > 0 && self.size + line.len() as u64 > cap {
            self.chain = Chain::after(saved);
            self.rotate(at)?;
            line = self.chain.append(at, event);
        }
        self.append(line)
    }

    /// Writes a line the chain just made; on failure the chain forgets it.
    fn append(&mut self, line: String) -> std::io::Result<()> {
        match self.file.write_all(line.as_bytes()) {
            Ok(()) => {
                self.size += line.len() as u64;
                Ok(())
            }
            Err(e) => {
                let r = line
                    .strip_suffix('\n')
                    .map(chain::parse_line)
                    .and_then(Result::ok);
                if let Some(r) = r {
                    self.chain = Chain::after(chain::Tip {
                        seq: r.seq - 1,
                        hash: r.prev,
                    });
                }
                Err(e)
            }
        }
    }

    /// Moves the file to `audit.1.jsonl` (replacing the one there) and
    /// starts a new one whose first line continues its chain.
    fn rotate(&mut self, at: u64) -> std::io::Result<()> {
        let rotated = self.path.with_file_name(ROTATED);
        std::fs::rename(&self.path, &rotated)?;
        self.file = open_append(&self.path)?;
        self.size = 0;
        let note = serde_json::to_value(Event::Rotated {
            previous: ROTATED.into(),
        })
        .unwrap_or_default();
        let line = self.chain.append(at, &note);
        self.append(line)
    }
}

fn write_loop(
    mut sink: Sink,
    cap: u64,
    rx: Receiver<Msg>,
    stats: &AuditStats,
    unreported: &AtomicU64,
) {
    let mut broken = false;
    for msg in rx {
        let (at, event) = match msg {
            Msg::Record(at, event) => (at, event),
            Msg::Close => break,
        };
        if broken {
            match Sink::open(sink.path.clone()) {
                Ok(s) => {
                    sink = s;
                    broken = false;
                }
                Err(_) => {
                    stats.write_errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
        }
        let lost = unreported.swap(0, Ordering::Relaxed);
        let mut result = Ok(());
        if lost > 0 {
            let note = serde_json::to_value(Event::Dropped { records: lost }).unwrap_or_default();
            result = sink.write(at, &note, cap);
        }
        if result.is_ok() {
            result = sink.write(at, &event, cap);
        }
        match result {
            Ok(()) => {
                stats.written.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                broken = true;
                stats.write_errors.fetch_add(1, Ordering::Relaxed);
                if !stats.error_logged.swap(true, Ordering::Relaxed) {
                    error!(error = %e, path = %sink.path.display(), "cannot write the audit log; the cluster keeps serving, and /metrics counts the records lost");
                }
            }
        }
    }
    let _ = sink.file.sync_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dir: &Path, name: &str) -> String {
        std::fs::read_to_string(dir.join(name)).unwrap_or_default()
    }

    #[test]
    fn records_continue_the_chain_across_restarts_and_rotations() {
        let dir = tempfile::tempdir().expect("dir");
        let log = AuditLog::open(dir.path(), 600).expect("open");
        log.record(Event::Stop);
        log.close();
        let log = AuditLog::open(dir.path(), 600).expect("reopen");
        for i in 0..6 {
            log.record(Event::TokenRevoked {
                token_id: format!("t{i}"),
                dropped: i,
            });
        }
        log.close();
        assert_eq!(log.stats().written.load(Ordering::Relaxed), 6);
        let old = read(dir.path(), ROTATED);
        let new = read(dir.path(), FILE);
        assert!(new.len() <= 600, "{} bytes", new.len());
        let first = chain::verify(&old, None).expect("the rotated file");
        let second = chain::verify(&new, Some(&first.tip)).expect("the current file");
        assert!(new.lines().next().expect("a line").contains("\"rotated\""));
        assert!(new.contains("\"t5\""));
        assert_eq!(
            second.tip.seq,
            first.tip.seq + second.lines as u64,
            "no record lost"
        );
    }

    #[test]
    fn a_torn_tail_stays_visible_and_new_records_follow_the_last_whole_one() {
        let dir = tempfile::tempdir().expect("dir");
        let log = AuditLog::open(dir.path(), DEFAULT_CAP).expect("open");
        log.record(Event::Stop);
        log.record(Event::Stop);
        log.close();
        let path = dir.path().join(FILE);
        let text = read(dir.path(), FILE);
        std::fs::write(&path, &text[..text.len() - 10]).expect("tear");
        let log = AuditLog::open(dir.path(), DEFAULT_CAP).expect("reopen");
        log.record(Event::Stop);
        log.close();
        let text = read(dir.path(), FILE);
        let broken = chain::verify(&text, None).expect_err("the torn line");
        assert_eq!(broken.line, 2);
        assert_eq!(text.lines().count(), 3);
        let last = chain::parse_line(text.lines().nth(2).expect("line 3")).expect("whole");
        assert_eq!(last.seq, 2, "it follows line 1");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_unwritable_log_counts_errors_and_never_blocks() {
        let dir = tempfile::tempdir().expect("dir");
        // A disk with no room left: every write fails, records still return at once.
        std::os::unix::fs::symlink("/dev/full", dir.path().join(FILE)).expect("link");
        let log = AuditLog::open(dir.path(), DEFAULT_CAP).expect("open");
        let started = std::time::Instant::now();
        for _ in 0..10_000 {
            log.record(Event::Stop);
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        log.close();
        let s = log.stats();
        assert_eq!(
            s.written.load(Ordering::Relaxed)
                + s.write_errors.load(Ordering::Relaxed)
                + s.dropped.load(Ordering::Relaxed),
            10_000
        );
        assert_eq!(s.written.load(Ordering::Relaxed), 0);
        assert!(s.write_errors.load(Ordering::Relaxed) > 0);
    }
}
