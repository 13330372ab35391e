//! `cairn audit verify|show`: checks the hash chain of a coordinator's
//! audit log, and prints it for people.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use cairn_native::audit::chain::{self, Tip};
use cairn_native::audit::log::{FILE, ROTATED};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand)]
enum Action {
    /// Check the chain; names the first line that was edited, removed,
    /// reordered or cut short, and exits with 1 if there is one.
    Verify {
        /// The state directory `cairn serve` ran with (its default otherwise).
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
    /// Print the records, oldest first (the chain is not checked: run verify).
    Show {
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Only the last N records.
        #[arg(long)]
        last: Option<usize>,
    },
}

pub fn run(a: Args) -> Result<()> {
    match a.action {
        Action::Verify { state_dir } => verify(&cairn_native::state_dir::locate(state_dir)),
        Action::Show { state_dir, last } => show(&cairn_native::state_dir::locate(state_dir), last),
    }
}

fn read(path: &Path) -> Result<Option<String>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(String::from_utf8_lossy(&bytes).into_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn verify(dir: &Path) -> Result<()> {
    let (rotated, current) = (read(&dir.join(ROTATED))?, read(&dir.join(FILE))?);
    if rotated.is_none() && current.is_none() {
        bail!("no audit log in {} (no {FILE})", dir.display());
    }
    let mut tip: Option<Tip> = None;
    let mut records = 0;
    let mut first_continues = false;
    for (name, text) in [(ROTATED, rotated), (FILE, current)] {
        let Some(text) = text else { continue };
        let path = dir.join(name);
        let v = chain::verify(&text, tip.as_ref())
            .map_err(|b| anyhow::anyhow!("{}: {b}", path.display()))?;
        if tip.is_none() {
            first_continues = v.continues_rotated;
        }
        records += v.lines;
        tip = Some(v.tip);
    }
    let last = tip.map(|t| t.seq).unwrap_or(0);
    println!(
        "ok: {records} records (sequence {}..{last}) in {}, each chained to the one before",
        last + 1 - records.min(last as usize) as u64,
        dir.display()
    );
    if first_continues {
        println!("note: the oldest file kept continues one rotated away (the log keeps two files)");
    }
    Ok(())
}

fn show(dir: &Path, last: Option<usize>) -> Result<()> {
    let mut lines = Vec::new();
    for name in [ROTATED, FILE] {
        if let Some(text) = read(&dir.join(name))? {
            lines.extend(text.lines().map(str::to_owned));
        }
    }
    if lines.is_empty() {
        bail!("no audit log in {} (no {FILE})", dir.display());
    }
    let skip = last.map_or(0, |n| lines.len().saturating_sub(n));
    // A reader that stops (`| head`) ends the listing, not with a panic.
    let mut out = std::io::stdout().lock();
    for line in &lines[skip..] {
        // A line that fails its hash is still shown, marked: verify says more.
        let (record, mark) = match chain::parse_line(line) {
            Ok(r) => (Ok(r), ""),
            Err(e) => match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) => (
                    Ok(chain::Record {
                        seq: v["seq"].as_u64().unwrap_or(0),
                        at_ms: v["at"].as_u64().unwrap_or(0),
                        prev: String::new(),
                        hash: String::new(),
                        event: v["event"].clone(),
                    }),
                    "  [does not verify]",
                ),
                Err(_) => (Err(e), ""),
            },
        };
        let written = match record {
            Ok(r) => {
                let mut fields = String::new();
                if let Some(o) = r.event.as_object() {
                    for (k, v) in o.iter().filter(|(k, _)| *k != "kind") {
                        let v = match v {
                            serde_json::Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        fields.push_str(&format!(" {k}={v}"));
                    }
                }
                writeln!(
                    out,
                    "{:>6}  {}  {}{fields}{mark}",
                    r.seq,
                    utc(r.at_ms),
                    r.kind()
                )
            }
            Err(e) => writeln!(out, "     ?  (unreadable line: {e})"),
        };
        if written.is_err() {
            break;
        }
    }
    Ok(())
}

/// `2026-11-26T00:18:51.123Z` for milliseconds since the Unix epoch.
fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn times_print_in_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(1_764_116_331_123), "2025-11-26T00:18:51.123Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
