//! Fetching only part of a GGUF file: the header, then the tensors of one layer range.
//!
//! A worker without the model file asks the coordinator for byte ranges. This module is the
//! sans-IO half, shared by the native and the browser worker: it says which bytes to fetch
//! ([`parse_header`], [`shard_ranges`]), names the file ([`model_id`]) and assembles what
//! came back into a [`TensorSource`] ([`PartialGguf`]). The host does the requests:
//!
//! ```text
//! prefix = fetch(0 .. MODEL_ID_PREFIX_BYTES)        // the reply also gives file_len
//! id = model_id(&prefix, file_len)
//! loop { match parse_header(&prefix, file_len)? {
//!     Done(file) => break file,
//!     NeedMore(n) => prefix.extend(fetch(prefix.len() .. n)),
//! } }
//! let mut part = PartialGguf::new(file.clone());
//! for r in shard_ranges(&file, start, end)? { part.insert(r.start, fetch(r)) }
//! ```

use std::collections::HashMap;
use std::io;
use std::ops::Range;

use sha2::{Digest, Sha256};

use super::{GgufError, GgufFile, TensorSource};
use crate::model::ModelError;
use crate::model::config::ModelConfig;
use crate::model::weights::shard_tensors;

/// Bytes from the start of the file that [`model_id`] hashes.
pub const MODEL_ID_PREFIX_BYTES: u64 = 8 << 20;

/// The first prefix [`parse_header`] asks for; small models' headers fit in it.
pub const HEADER_FIRST_FETCH: u64 = 1 << 20;

/// The longest header [`parse_header`] will fetch. Real headers are a few MiB (the
/// vocabulary dominates); past this the file is taken as corrupt or hostile.
pub const MAX_HEADER_BYTES: u64 = 256 << 20;

/// Tensors closer than this are fetched in one range, gap included.
pub const MERGE_GAP: u64 = 64 << 10;

/// The longest range [`shard_ranges`] returns; longer runs are split.
pub const MAX_RANGE_BYTES: u64 = 16 << 20;

/// How many bytes from the start of a file of `file_len` bytes [`model_id`] needs.
pub fn model_id_prefix_len(file_len: u64) -> u64 {
    file_len.min(MODEL_ID_PREFIX_BYTES)
}

/// A stable id for a model file: the hex of the first 16 bytes of the SHA-256 of its first
/// [`model_id_prefix_len`] bytes followed by `file_len` (u64, little-endian); 32 characters.
///
/// This is a fingerprint for naming caches and telling files apart, not an integrity check:
/// two files that differ only past the first 8 MiB (in tensor data) get the same id.
///
/// `prefix` must hold at least `model_id_prefix_len(file_len)` bytes (more are ignored);
/// a shorter prefix gives a different id.
pub fn model_id(prefix: &[u8], file_len: u64) -> String {
    // At most 8 MiB: fits in usize.
    let n = model_id_prefix_len(file_len) as usize;
    debug_assert!(
        prefix.len() >= n,
        "model_id needs {n} bytes, got {}",
        prefix.len()
    );
    let mut hash = Sha256::new();
    hash.update(&prefix[..n.min(prefix.len())]);
    hash.update(file_len.to_le_bytes());
    hash.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What [`parse_header`] made of a prefix.
#[derive(Debug, Clone, PartialEq)]
pub enum HeaderProgress {
    /// The header is complete.
    Done(GgufFile),
    /// Fetch the file's first `n` bytes (more than the prefix given) and call again.
    NeedMore(u64),
}

/// Parses the header of a `file_len`-byte file from its first bytes, or says how long a
/// prefix to fetch next: at least what the parser needs, at least double the prefix given
/// (so a large vocabulary takes few round trips), at least [`HEADER_FIRST_FETCH`], and at
/// most the file. Start with an empty prefix.
///
/// Errors: the prefix is not a GGUF header (bad magic, corrupt counts), the header runs
/// past the end of the file ([`GgufError::Truncated`]), or it would need more than
/// [`MAX_HEADER_BYTES`] ([`GgufError::TooLarge`]).
pub fn parse_header(prefix: &[u8], file_len: u64) -> Result<HeaderProgress, GgufError> {
    match GgufFile::parse_prefix(prefix, Some(file_len)) {
        Ok(file) => Ok(HeaderProgress::Done(file)),
        Err(GgufError::NeedMoreBytes { needed_at_least }) => {
            let have = prefix.len() as u64;
            next_prefix_len(have, needed_at_least, file_len, MAX_HEADER_BYTES)
                .map(HeaderProgress::NeedMore)
        }
        Err(e) => Err(e),
    }
}

/// The next prefix length: see [`parse_header`]. `needed` is above `have` and at most
/// `file_len` (else the parser reports `Truncated`).
fn next_prefix_len(have: u64, needed: u64, file_len: u64, max: u64) -> Result<u64, GgufError> {
    if needed > max {
        return Err(GgufError::TooLarge {
            what: "GGUF header (bytes from the start of the file needed to parse it)".into(),
            offset: 0,
            value: needed,
            limit: max,
        });
    }
    let grown = have.saturating_mul(2).max(HEADER_FIRST_FETCH);
    Ok(grown.min(file_len).min(max).max(needed))
}

/// The byte ranges of the file to fetch for a shard over layers `[start, end)`: the
/// tensors [`shard_tensors`] lists (embedding on the first shard, output norm and head on
/// the last, a tied head reusing the embedding), sorted, with tensors less than
/// [`MERGE_GAP`] apart merged into one range and ranges longer than [`MAX_RANGE_BYTES`]
/// split. A tensor may thus span several ranges; [`PartialGguf`] reassembles it.
pub fn shard_ranges(
    file: &GgufFile,
    start: usize,
    end: usize,
) -> Result<Vec<Range<u64>>, ModelError> {
    let cfg = ModelConfig::from_gguf(file)?;
    if start >= end || end > cfg.n_layers {
        return Err(ModelError::BadRange {
            start,
            end,
            n_layers: cfg.n_layers,
        });
    }
    let spans = shard_tensors(&cfg, start, end)
        .iter()
        .map(|(name, _, _)| Ok(file.tensor_range(file.require_tensor(name)?)))
        .collect::<Result<Vec<_>, GgufError>>()?;
    Ok(plan_ranges(spans, MERGE_GAP, MAX_RANGE_BYTES))
}

/// Sorts `spans`, merges those less than `max_gap` apart (or overlapping) and splits the
/// result into pieces of at most `max_len` bytes. Empty spans are dropped.
fn plan_ranges(mut spans: Vec<Range<u64>>, max_gap: u64, max_len: u64) -> Vec<Range<u64>> {
    spans.retain(|r| r.start < r.end);
    spans.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::new();
    for s in spans {
        match merged.last_mut() {
            Some(last) if s.start < last.end.saturating_add(max_gap) => {
                last.end = last.end.max(s.end);
            }
            _ => merged.push(s),
        }
    }
    let mut out = Vec::new();
    for r in merged {
        let mut at = r.start;
        while at < r.end {
            let to = at.saturating_add(max_len).min(r.end);
            out.push(at..to);
            at = to;
        }
    }
    out
}

/// The tensors of a GGUF file whose bytes were fetched in pieces: a [`TensorSource`] for
/// loading a shard without the whole file.
///
/// Each [`PartialGguf::insert`]ed piece is copied into the tensors it overlaps; bytes
/// between tensors are dropped. Memory is the tensors touched by a piece, each allocated
/// whole on first touch, so insert pieces of the tensors you need (as [`shard_ranges`]
/// plans them), in any order.
#[derive(Debug, Clone)]
pub struct PartialGguf {
    file: GgufFile,
    /// By tensor index in `file.tensors`.
    fetched: HashMap<usize, Fetched>,
}

#[derive(Debug, Clone)]
struct Fetched {
    data: Vec<u8>,
    /// Filled byte ranges of `data`, sorted and disjoint.
    filled: Vec<Range<u64>>,
}

impl Fetched {
    fn filled_bytes(&self) -> u64 {
        self.filled.iter().map(|r| r.end - r.start).sum()
    }

    fn mark(&mut self, r: Range<u64>) {
        self.filled.push(r);
        self.filled.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<u64>> = Vec::with_capacity(self.filled.len());
        for r in self.filled.drain(..) {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        self.filled = merged;
    }
}

impl PartialGguf {
    /// A source with the header only; no tensor is available yet.
    pub fn new(file: GgufFile) -> Self {
        PartialGguf {
            file,
            fetched: HashMap::new(),
        }
    }

    /// Adds the file's bytes `offset .. offset + bytes.len()`. Pieces may come in any order,
    /// overlap, or cover bytes of no interest.
    pub fn insert(&mut self, offset: u64, bytes: impl AsRef<[u8]>) {
        let bytes = bytes.as_ref();
        let piece = offset..offset.saturating_add(bytes.len() as u64);
        for (i, t) in self.file.tensors.iter().enumerate() {
            let range = self.file.tensor_range(t);
            let (from, to) = (range.start.max(piece.start), range.end.min(piece.end));
            if from >= to {
                continue;
            }
            // A tensor too large for this address space stays unfetched (wasm32).
            let Ok(n_bytes) = usize::try_from(t.n_bytes) else {
                continue;
            };
            let entry = self.fetched.entry(i).or_insert_with(|| Fetched {
                data: vec![0; n_bytes],
                filled: Vec::new(),
            });
            // Both ranges lie within buffers that exist, so they fit in usize.
            let (dst, src) = (
                (from - range.start) as usize..(to - range.start) as usize,
                (from - piece.start) as usize..(to - piece.start) as usize,
            );
            entry.data[dst].copy_from_slice(&bytes[src]);
            entry.mark(from - range.start..to - range.start);
        }
    }

    /// Whether every byte of tensor `name` has been inserted.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_data(name).is_ok()
    }

    /// Tensor bytes held, complete tensors or not.
    pub fn held_bytes(&self) -> u64 {
        self.fetched.values().map(|f| f.data.len() as u64).sum()
    }

    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let (i, t) = self
            .file
            .tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.name == name)
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_owned(),
            })?;
        if t.n_bytes == 0 {
            return Ok(&[]);
        }
        let range = self.file.tensor_range(t);
        let have = self.fetched.get(&i).map_or(0, Fetched::filled_bytes);
        match self.fetched.get(&i) {
            Some(f) if have == t.n_bytes => Ok(&f.data),
            _ => Err(GgufError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "tensor `{name}` (bytes {}..{} of the file) has not been fetched: {have} of its {} bytes are here",
                    range.start, range.end, t.n_bytes
                ),
            ))),
        }
    }
}

impl TensorSource for PartialGguf {
    fn gguf(&self) -> &GgufFile {
        &self.file
    }

    fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        PartialGguf::tensor_data(self, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{BytesGguf, GgufWriter};
    use crate::model::config::block_tensor;
    use crate::quant::GgmlType;

    /// A llama-shaped config small enough for a test file of a few hundred KiB.
    fn tiny_config(n_layers: usize, tied_output: bool) -> ModelConfig {
        ModelConfig {
            n_layers,
            dim: 64,
            ffn_dim: 128,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            rope_dim: 16,
            vocab_size: 256,
            tied_output,
            // What `from_gguf` assumes when the file does not say.
            rope_base: 10_000.0,
            context_length: 2048,
            ..ModelConfig::synthetic("135m").unwrap()
        }
    }

    /// A GGUF file for `cfg` in which every tensor holds different bytes, so that a tensor
    /// read from the wrong place cannot pass. `padding` strings of 32 bytes make the header
    /// as long as a real vocabulary would.
    pub(crate) fn tiny_model_file(cfg: &ModelConfig, padding: usize) -> Vec<u8> {
        let a = &cfg.architecture;
        let mut w = GgufWriter::new();
        w.add("general.architecture", a.as_str())
            .add(format!("{a}.block_count"), cfg.n_layers as u32)
            .add(format!("{a}.embedding_length"), cfg.dim as u32)
            .add(format!("{a}.feed_forward_length"), cfg.ffn_dim as u32)
            .add(format!("{a}.attention.head_count"), cfg.n_heads as u32)
            .add(
                format!("{a}.attention.head_count_kv"),
                cfg.n_kv_heads as u32,
            );
        if padding > 0 {
            let strings: Vec<String> = (0..padding).map(|i| format!("{i:032}")).collect();
            w.add("test.padding", strings);
        }
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for (name, rows, cols) in shard_tensors(cfg, 0, cfg.n_layers) {
            let ty = if rows == 1 {
                GgmlType::F32
            } else {
                GgmlType::Q8_0
            };
            let n = ty.row_bytes(rows * cols).unwrap();
            let data: Vec<u8> = (0..n)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng as u8
                })
                .collect();
            w.add_tensor(name, &[cols as u64, rows as u64], ty, data);
        }
        w.finish()
    }

    /// Fetches the header as a host would, counting round trips.
    fn fetch_header(bytes: &[u8]) -> (GgufFile, usize) {
        let len = bytes.len() as u64;
        let mut prefix = Vec::new();
        for round in 1..20 {
            match parse_header(&prefix, len).unwrap() {
                HeaderProgress::Done(file) => return (file, round),
                HeaderProgress::NeedMore(n) => {
                    assert!(n > prefix.len() as u64 && n <= len);
                    prefix.extend_from_slice(&bytes[prefix.len()..n as usize]);
                }
            }
        }
        panic!("header did not converge");
    }

    fn fetch_shard(bytes: &[u8], start: usize, end: usize) -> PartialGguf {
        let (file, _) = fetch_header(bytes);
        let ranges = shard_ranges(&file, start, end).unwrap();
        let mut part = PartialGguf::new(file);
        for r in ranges {
            part.insert(r.start, &bytes[r.start as usize..r.end as usize]);
        }
        part
    }

    fn check_shard(bytes: &[u8], cfg: &ModelConfig, start: usize, end: usize) {
        let whole = BytesGguf::new(bytes.to_vec()).unwrap();
        let part = fetch_shard(bytes, start, end);
        let needed = shard_tensors(cfg, start, end);
        for (name, _, _) in &needed {
            assert_eq!(
                part.tensor_data(name).unwrap(),
                whole.tensor_data(name).unwrap(),
                "{name} in shard {start}..{end}"
            );
        }
        let needed_bytes: u64 = needed
            .iter()
            .map(|(n, _, _)| whole.file.tensor(n).unwrap().n_bytes)
            .sum();
        // Only the shard's tensors are held: the other layers' are far away in the file.
        assert_eq!(part.held_bytes(), needed_bytes, "shard {start}..{end}");
        let outside = block_tensor(if start > 0 { start - 1 } else { end }, "ffn_up");
        let err = part.tensor_data(&outside).unwrap_err().to_string();
        assert!(
            err.contains(&outside) && err.contains("not been fetched"),
            "{err}"
        );
    }

    #[test]
    fn shard_tensors_match_the_whole_file() {
        for tied in [false, true] {
            let cfg = tiny_config(6, tied);
            let bytes = tiny_model_file(&cfg, 0);
            assert_eq!(
                ModelConfig::from_gguf(&GgufFile::parse(&bytes).unwrap()).unwrap(),
                cfg
            );
            check_shard(&bytes, &cfg, 2, 4);
            check_shard(&bytes, &cfg, 0, 2);
            check_shard(&bytes, &cfg, 3, 6);
            let part = fetch_shard(&bytes, 0, 6);
            for t in &part.gguf().tensors {
                assert!(part.has_tensor(&t.name), "{}", t.name);
            }
        }
    }

    #[test]
    fn tied_head_is_fetched_by_the_last_shard() {
        let cfg = tiny_config(4, true);
        let bytes = tiny_model_file(&cfg, 0);
        assert!(fetch_shard(&bytes, 2, 4).has_tensor("token_embd.weight"));
        assert!(!fetch_shard(&bytes, 1, 3).has_tensor("token_embd.weight"));
    }

    #[test]
    fn pieces_in_any_order_reassemble_tensors() {
        let cfg = tiny_config(4, false);
        let bytes = tiny_model_file(&cfg, 0);
        let whole = BytesGguf::new(bytes.clone()).unwrap();
        let (file, _) = fetch_header(&bytes);
        let mut part = PartialGguf::new(file.clone());
        // Small odd-sized pieces, back to front, some twice: tensors straddle pieces.
        let mut pieces = Vec::new();
        for r in shard_ranges(&file, 1, 3).unwrap() {
            let mut at = r.start;
            while at < r.end {
                let to = (at + 1000).min(r.end);
                pieces.push(at..to);
                at = to;
            }
        }
        pieces.reverse();
        for r in pieces.iter().chain(pieces.iter().step_by(3)) {
            part.insert(r.start, &bytes[r.start as usize..r.end as usize]);
        }
        for (name, _, _) in shard_tensors(&cfg, 1, 3) {
            assert_eq!(
                part.tensor_data(&name).unwrap(),
                whole.tensor_data(&name).unwrap()
            );
        }

        // One piece short of a tensor: the error names it and says how much is missing.
        let t = file.require_tensor("blk.1.ffn_down.weight").unwrap();
        let r = file.tensor_range(t);
        let mut short = PartialGguf::new(file.clone());
        short.insert(r.start, &bytes[r.start as usize..r.end as usize - 1]);
        let err = short.tensor_data(&t.name).unwrap_err().to_string();
        assert!(err.contains("blk.1.ffn_down.weight"), "{err}");
        assert!(
            err.contains(&format!("{} of its {}", t.n_bytes - 1, t.n_bytes)),
            "{err}"
        );
        assert!(matches!(
            short.tensor_data("no.such.tensor"),
            Err(GgufError::MissingTensor { .. })
        ));
    }

    #[test]
    fn header_grows_geometrically() {
        let cfg = tiny_config(2, true);
        // About 2.3 MiB of header: 1 MiB, then 2, then 4 (capped at the file).
        let bytes = tiny_model_file(&cfg, 60_000);
        let (file, rounds) = fetch_header(&bytes);
        assert_eq!(file, GgufFile::parse(&bytes).unwrap());
        assert!(file.data_offset > 2 << 20);
        assert_eq!(rounds, 4);

        // A small file's header comes in one fetch of the whole file.
        let small = tiny_model_file(&cfg, 0);
        assert!((small.len() as u64) < HEADER_FIRST_FETCH);
        assert_eq!(
            parse_header(&[], small.len() as u64).unwrap(),
            HeaderProgress::NeedMore(small.len() as u64)
        );
        assert_eq!(fetch_header(&small).1, 2);
    }

    #[test]
    fn bad_prefixes_are_errors() {
        let cfg = tiny_config(2, true);
        let bytes = tiny_model_file(&cfg, 0);
        // The file claims to be only 100 bytes long: its header cannot fit.
        assert!(matches!(
            parse_header(&bytes[..100], 100),
            Err(GgufError::Truncated { .. })
        ));
        assert!(matches!(
            parse_header(b"<!DOCTYPE html>", 1 << 30),
            Err(GgufError::BadMagic { .. })
        ));
        // Garbage after a valid magic and version: corrupt counts, refused at once.
        let mut garbage = bytes[..8].to_vec();
        garbage.extend(std::iter::repeat_n(0xff, 4096));
        assert!(parse_header(&garbage, 1 << 40).is_err());
        // Every prefix of a real header parses or asks for more; as a whole file, it is an
        // error. Never a panic.
        let (file, _) = fetch_header(&bytes);
        for cut in (0..file.data_offset as usize).step_by(7) {
            match parse_header(&bytes[..cut], bytes.len() as u64) {
                Ok(HeaderProgress::NeedMore(n)) => assert!(n > cut as u64),
                // The alignment padding before the data is not needed.
                Ok(HeaderProgress::Done(f)) => assert_eq!(f, file),
                other => panic!("cut at {cut}: {other:?}"),
            }
            assert!(parse_header(&bytes[..cut], cut as u64).is_err());
        }
    }

    #[test]
    fn header_size_is_capped() {
        assert_eq!(next_prefix_len(0, 4, 1 << 40, 256).unwrap(), 256);
        assert_eq!(next_prefix_len(0, 4, 100, 256).unwrap(), 100);
        assert_eq!(next_prefix_len(200, 250, 1 << 40, 256).unwrap(), 256);
        let err = next_prefix_len(200, 300, 1 << 40, 256).unwrap_err();
        assert!(matches!(
            err,
            GgufError::TooLarge {
                value: 300,
                limit: 256,
                ..
            }
        ));
        assert_eq!(
            next_prefix_len(3 << 20, (3 << 20) + 1, 1 << 40, MAX_HEADER_BYTES).unwrap(),
            6 << 20
        );
    }

    #[test]
    fn ranges_merge_near_tensors_and_split_long_runs() {
        let r = plan_ranges(
            vec![50..60, 0..10, 15..20, 100..130, 130..131, 7..7],
            10,
            12,
        );
        assert_eq!(r, vec![0..12, 12..20, 50..60, 100..112, 112..124, 124..131]);
        assert_eq!(
            plan_ranges(vec![0..10, 20..30], 10, 100),
            vec![0..10, 20..30]
        );
        assert_eq!(plan_ranges(vec![0..10, 5..8], 0, 100), vec![0..10]);
        assert!(plan_ranges(vec![], 10, 10).is_empty());

        let cfg = tiny_config(4, false);
        let (file, _) = fetch_header(&tiny_model_file(&cfg, 0));
        // A middle shard's tensors are contiguous in the file: one range.
        let r = shard_ranges(&file, 1, 3).unwrap();
        let first = file.require_tensor("blk.1.attn_norm.weight").unwrap();
        let last = file.require_tensor("blk.2.ffn_down.weight").unwrap();
        assert_eq!(
            r,
            vec![file.tensor_range(first).start..file.tensor_range(last).end]
        );
        for (s, e) in [(2, 2), (3, 2), (0, 5)] {
            assert!(matches!(
                shard_ranges(&file, s, e),
                Err(ModelError::BadRange { .. })
            ));
        }
    }

    #[test]
    fn model_id_is_a_stable_fingerprint() {
        let bytes = tiny_model_file(&tiny_config(2, true), 0);
        let len = bytes.len() as u64;
        let id = model_id(&bytes, len);
        assert_eq!(id.len(), 32);
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(model_id(&bytes, len), id);
        // Pinned, so that an accidental change of the scheme (which orphans every cache)
        // shows up here.
        assert_eq!(model_id(b"", 0), "af5570f5a1810b7af78caf4bc70a660f");
        let mut other = bytes.clone();
        other[100] ^= 1;
        assert_ne!(model_id(&other, len), id);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_ne!(model_id(&longer, len + 1), id);
        // Only the first 8 MiB count: bytes after them are not looked at.
        let big = vec![7u8; (MODEL_ID_PREFIX_BYTES + 10) as usize];
        let big_len = big.len() as u64;
        assert_eq!(
            model_id(&big, big_len),
            model_id(&big[..MODEL_ID_PREFIX_BYTES as usize], big_len)
        );
    }
}
