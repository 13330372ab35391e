//! The audit log's hash chain, without IO: making a line and checking a
//! file's lines.
//!
//! A line is one JSON object: `{"seq":N,"at":MS,"prev":"P","event":{..},"hash":"H"}`,
//! where `P` is the previous line's `H` (64 zeros before the first line) and
//! `H` is the SHA-256 of the line's bytes up to `,"hash":`. Editing a line
//! breaks its own hash; deleting, reordering or inserting one breaks the
//! sequence or the next line's `prev`; rewriting every hash after an edit
//! needs nothing secret, so the chain shows tampering by anyone who cannot
//! also replace the whole file (docs/security.md says what that means).

use sha2::{Digest as _, Sha256};

/// The `prev` of a chain's first line.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What a line ends with before its hash and the closing `"}`.
const HASH_KEY: &str = ",\"hash\":\"";
/// `,"hash":"` + 64 hex digits + `"}`.
const SUFFIX_LEN: usize = HASH_KEY.len() + 64 + 2;

/// The last line written: the next one continues from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tip {
    pub seq: u64,
    pub hash: String,
}

impl Tip {
    /// Before the first line.
    pub fn genesis() -> Tip {
        Tip {
            seq: 0,
            hash: GENESIS.to_owned(),
        }
    }
}

/// Makes lines, each chained to the one before.
#[derive(Debug)]
pub struct Chain {
    tip: Tip,
}

impl Chain {
    /// A chain that continues after `tip` (the genesis for a new one).
    pub fn after(tip: Tip) -> Chain {
        Chain { tip }
    }

    pub fn tip(&self) -> &Tip {
        &self.tip
    }

    /// The next line, newline included, for `event` (a JSON object) at
    /// `at_ms` (milliseconds since the Unix epoch).
    pub fn append(&mut self, at_ms: u64, event: &serde_json::Value) -> String {
        let seq = self.tip.seq + 1;
        let body = format!(
            "{{\"seq\":{seq},\"at\":{at_ms},\"prev\":\"{}\",\"event\":{event}",
            self.tip.hash
        );
        let hash = sha256_hex(body.as_bytes());
        let line = format!("{body}{HASH_KEY}{hash}\"}}\n");
        self.tip = Tip { seq, hash };
        line
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One line, read back and checked against its own hash.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub seq: u64,
    pub at_ms: u64,
    pub prev: String,
    pub hash: String,
    pub event: serde_json::Value,
}

impl Record {
    /// The event's `kind` (`joined`, `token_revoked`, ...).
    pub fn kind(&self) -> &str {
        self.event
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("?")
    }
}

/// Why a line breaks the chain.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Broken {
    #[error(
        "it is cut short (no hash at its end, or no newline): a torn write or a truncated file"
    )]
    Torn,
    #[error("it is not an audit record: {0}")]
    NotARecord(String),
    #[error("its content does not match its hash: the line was edited")]
    Edited,
    #[error(
        "sequence number {found} where {expected} was due: lines before it were deleted, inserted or reordered"
    )]
    Sequence { expected: u64, found: u64 },
    #[error(
        "it does not chain to the line before it: that line was replaced, or lines were removed"
    )]
    Unchained,
    #[error(
        "a file's first line must start the chain or continue a rotated file; this one does neither: its first lines were removed"
    )]
    HeadMissing,
}

/// Checks one line (without its newline) against its own hash and reads it.
pub fn parse_line(line: &str) -> Result<Record, Broken> {
    if line.len() < SUFFIX_LEN || !line.ends_with("\"}") {
        return Err(if line.trim_start().starts_with('{') {
            Broken::Torn
        } else {
            Broken::NotARecord("not a JSON object".into())
        });
    }
    let split = line.len() - SUFFIX_LEN;
    let (body, suffix) = (&line[..split], &line[split..]);
    let Some(hash) = suffix
        .strip_prefix(HASH_KEY)
        .and_then(|s| s.strip_suffix("\"}"))
        .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
    else {
        return Err(Broken::Torn);
    };
    if sha256_hex(body.as_bytes()) != hash.to_ascii_lowercase() {
        return Err(Broken::Edited);
    }
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| Broken::NotARecord(e.to_string()))?;
    let field = |k: &str| {
        v.get(k)
            .ok_or_else(|| Broken::NotARecord(format!("no '{k}'")))
    };
    let seq = field("seq")?
        .as_u64()
        .ok_or_else(|| Broken::NotARecord("'seq' is not a number".into()))?;
    let at_ms = field("at")?
        .as_u64()
        .ok_or_else(|| Broken::NotARecord("'at' is not a number".into()))?;
    let prev = field("prev")?
        .as_str()
        .ok_or_else(|| Broken::NotARecord("'prev' is not text".into()))?
        .to_owned();
    Ok(Record {
        seq,
        at_ms,
        prev,
        hash: hash.to_owned(),
        event: field("event")?.clone(),
    })
}

/// A line that breaks the chain, numbered from 1 within its file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {why}")]
pub struct BrokenLine {
    pub line: usize,
    pub why: Broken,
}

/// What a file that verified holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub lines: usize,
    /// Where the chain ends, for the file that continues it.
    pub tip: Tip,
    /// Whether its first line continues a file that is no longer here.
    pub continues_rotated: bool,
}

/// Checks a file's text line by line. `after` is the tip of the file it
/// continues (the rotated one, when that is at hand); `None` accepts a
/// first line that starts the chain or says it continues a rotated file.
pub fn verify(text: &str, after: Option<&Tip>) -> Result<Verified, BrokenLine> {
    let mut tip = after.cloned();
    let mut continues_rotated = false;
    let mut lines = 0;
    let mut rest = text;
    while !rest.is_empty() {
        lines += 1;
        let broken = |why| BrokenLine { line: lines, why };
        let Some((line, after_line)) = rest.split_once('\n') else {
            return Err(broken(Broken::Torn));
        };
        rest = after_line;
        let r = parse_line(line).map_err(broken)?;
        match &tip {
            Some(t) => {
                if r.seq != t.seq + 1 {
                    return Err(broken(Broken::Sequence {
                        expected: t.seq + 1,
                        found: r.seq,
                    }));
                }
                if r.prev != t.hash {
                    return Err(broken(Broken::Unchained));
                }
            }
            None if r.seq == 1 && r.prev == GENESIS => {}
            None if r.kind() == "rotated" => continues_rotated = true,
            None => return Err(broken(Broken::HeadMissing)),
        }
        tip = Some(Tip {
            seq: r.seq,
            hash: r.hash,
        });
    }
    Ok(Verified {
        lines,
        tip: tip.unwrap_or_else(|| after.cloned().unwrap_or_else(Tip::genesis)),
        continues_rotated,
    })
}

/// Where a file's chain ends, for a writer that goes on with it: the last
/// line that reads as a record, and whether anything after it is damaged
/// (a torn write the writer must not extend).
pub fn resume(text: &str) -> (Tip, bool) {
    let mut tip = Tip::genesis();
    let mut damaged = false;
    for line in text.split_inclusive('\n') {
        match line
            .strip_suffix('\n')
            .map(parse_line)
            .unwrap_or(Err(Broken::Torn))
        {
            Ok(r) => {
                tip = Tip {
                    seq: r.seq,
                    hash: r.hash,
                };
                damaged = false;
            }
            Err(_) => damaged = true,
        }
    }
    (tip, damaged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn log(n: usize) -> Vec<String> {
        let mut c = Chain::after(Tip::genesis());
        (0..n)
            .map(|i| c.append(1000 + i as u64, &json!({"kind": "test", "i": i})))
            .collect()
    }

    fn broken_at(lines: &[String]) -> BrokenLine {
        verify(&lines.concat(), None).expect_err("a broken chain")
    }

    #[test]
    fn appended_lines_verify_and_read_back() {
        let lines = log(5);
        let v = verify(&lines.concat(), None).expect("intact");
        assert_eq!(v.lines, 5);
        assert_eq!(v.tip.seq, 5);
        assert!(!v.continues_rotated);
        let r = parse_line(lines[2].trim_end()).expect("a record");
        assert_eq!((r.seq, r.at_ms, r.kind()), (3, 1002, "test"));
        assert_eq!(r.event["i"], 2);
        assert_eq!(
            r.prev,
            parse_line(lines[1].trim_end()).expect("record").hash
        );
        assert_eq!(verify("", None).expect("empty").lines, 0);
    }

    #[test]
    fn an_edited_line_is_named() {
        let mut lines = log(5);
        lines[3] = lines[3].replace("\"i\":3", "\"i\":7");
        assert_eq!(
            broken_at(&lines),
            BrokenLine {
                line: 4,
                why: Broken::Edited
            }
        );
    }

    #[test]
    fn an_edited_line_whose_hash_was_recomputed_breaks_the_next_one() {
        let mut lines = log(4);
        let r = parse_line(lines[1].trim_end()).expect("record");
        // The forger rewrites line 2 in full, with a valid hash of its own.
        let mut c = Chain::after(Tip {
            seq: 1,
            hash: r.prev,
        });
        lines[1] = c.append(r.at_ms, &json!({"kind": "test", "i": 99}));
        assert_eq!(
            broken_at(&lines),
            BrokenLine {
                line: 3,
                why: Broken::Unchained
            }
        );
    }

    #[test]
    fn a_deleted_line_is_found() {
        let mut lines = log(5);
        lines.remove(2);
        assert_eq!(
            broken_at(&lines),
            BrokenLine {
                line: 3,
                why: Broken::Sequence {
                    expected: 3,
                    found: 4
                }
            }
        );
        // Deleting the first lines leaves a head that starts nothing.
        let tail = log(5)[2..].to_vec();
        assert_eq!(broken_at(&tail).why, Broken::HeadMissing);
        assert_eq!(broken_at(&tail).line, 1);
    }

    #[test]
    fn reordered_lines_are_found() {
        let mut lines = log(5);
        lines.swap(1, 2);
        assert_eq!(
            broken_at(&lines),
            BrokenLine {
                line: 2,
                why: Broken::Sequence {
                    expected: 2,
                    found: 3
                }
            }
        );
    }

    #[test]
    fn a_truncated_last_line_is_found_and_a_writer_does_not_extend_it() {
        let lines = log(3);
        let whole = lines.concat();
        for cut in [1, 40, lines[2].len() - 1] {
            let text = &whole[..whole.len() - cut];
            assert_eq!(
                verify(text, None).expect_err("torn"),
                BrokenLine {
                    line: 3,
                    why: Broken::Torn
                },
                "cut {cut}"
            );
            let (tip, damaged) = resume(text);
            assert!(damaged);
            assert_eq!(tip.seq, 2);
        }
        let (tip, damaged) = resume(&whole);
        assert!(!damaged);
        assert_eq!(tip, verify(&whole, None).expect("intact").tip);
        assert_eq!(resume(""), (Tip::genesis(), false));
    }

    #[test]
    fn garbage_is_not_a_record() {
        let mut lines = log(2);
        lines.insert(1, "hello\n".into());
        assert!(matches!(broken_at(&lines).why, Broken::NotARecord(_)));
        assert_eq!(broken_at(&lines).line, 2);
    }

    #[test]
    fn a_file_after_rotation_continues_the_previous_one() {
        let mut c = Chain::after(Tip::genesis());
        let old: String = (0..3)
            .map(|i| c.append(i, &json!({"kind": "test"})))
            .collect();
        let new: String = [
            c.append(10, &json!({"kind": "rotated"})),
            c.append(11, &json!({"kind": "test"})),
        ]
        .concat();
        let first = verify(&old, None).expect("old");
        let second = verify(&new, Some(&first.tip)).expect("new continues old");
        assert_eq!(second.tip.seq, 5);
        // Alone (the old file gone), it verifies but says it continues one.
        assert!(verify(&new, None).expect("alone").continues_rotated);
        // A chain that does not continue the old file's tip is refused.
        let other = verify(&log(3).concat(), None).expect("other").tip;
        assert_eq!(
            verify(&new, Some(&other))
                .expect_err("not its successor")
                .line,
            1
        );
    }
}
