//! A model's bytes over HTTP: the GGUF header (a growing prefix), then only the byte ranges
//! of the tensors a shard needs, each piece kept in Cache Storage under the model's id and
//! its range so a rejoin does not download it again.

use std::cell::Cell;
use std::ops::Range;
use std::rc::Rc;

use cairn_engine::gguf::{GgufError, GgufFile, TensorSource};
use cairn_engine::model::ModelConfig;
use cairn_engine::model::weights::shard_tensors;
use wasm_bindgen::prelude::*;

use crate::js;
use crate::ui;

/// First header prefix fetched; doubled until the header parses.
const FIRST_PREFIX: u64 = 1 << 20;
/// Ranges closer than this are fetched as one.
const MERGE_GAP: u64 = 64 * 1024;
/// Pieces are cut at multiples of this (absolute offsets), so a rejoin asks for the same keys.
const PIECE: u64 = 8 << 20;

/// A parsed header and the bytes of the tensors fetched so far.
pub struct PartialSource {
    file: GgufFile,
    /// Contiguous byte runs of the file, by absolute start offset.
    runs: Vec<(u64, Vec<u8>)>,
}

impl PartialSource {
    pub fn new(file: GgufFile) -> Self {
        PartialSource {
            file,
            runs: Vec::new(),
        }
    }

    pub fn insert(&mut self, offset: u64, bytes: Vec<u8>) {
        self.runs.push((offset, bytes));
    }
}

impl TensorSource for PartialSource {
    fn gguf(&self) -> &GgufFile {
        &self.file
    }

    fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let t = self.file.require_tensor(name)?;
        let r = self.file.tensor_range(t);
        self.runs
            .iter()
            .find(|(at, b)| *at <= r.start && at + b.len() as u64 >= r.end)
            .map(|(at, b)| &b[(r.start - at) as usize..(r.end - at) as usize])
            .ok_or_else(|| GgufError::TensorOutOfBounds {
                tensor: name.to_owned(),
                start: r.start,
                end: r.end,
                file_len: 0,
            })
    }
}

/// Cache keys are `<model>/<what>`; the model part is its id, or the URL without one.
fn cache_prefix(model_key: &str) -> String {
    model_key.chars().filter(|c| !c.is_control()).collect()
}

/// Fetches and parses the GGUF header of `url`; returns it with the file's length.
pub async fn fetch_header(url: &str, model_key: &str) -> Result<(GgufFile, u64), String> {
    let key = format!("{}/header", cache_prefix(model_key));
    if let Some(cached) = js::cache_get(&key).await
        && cached.len() > 8
    {
        let file_len = u64::from_le_bytes(cached[..8].try_into().unwrap_or_default());
        if let Ok(file) = GgufFile::parse_prefix(&cached[8..], Some(file_len)) {
            return Ok((file, file_len));
        }
    }
    let (mut prefix, total) = js::fetch_range(url, 0..FIRST_PREFIX, None).await?;
    let file_len =
        total.ok_or("the model server sent no Content-Range: range requests are needed")?;
    loop {
        match GgufFile::parse_prefix(&prefix, Some(file_len)) {
            Ok(file) => {
                let mut stored = file_len.to_le_bytes().to_vec();
                stored.extend_from_slice(&prefix);
                js::cache_put(&key, &stored).await;
                return Ok((file, file_len));
            }
            Err(GgufError::NeedMoreBytes { needed_at_least }) => {
                let have = prefix.len() as u64;
                if have >= file_len {
                    return Err("the GGUF header runs past the end of the file".into());
                }
                let want = needed_at_least.max(have * 2).min(file_len);
                ui::set_progress(have, want, "reading the model header");
                let (more, _) = js::fetch_range(url, have..want, None).await?;
                if more.is_empty() {
                    return Err("the model server returned no bytes".into());
                }
                prefix.extend_from_slice(&more);
            }
            Err(e) => return Err(format!("the model header is invalid: {e}")),
        }
    }
}

/// The merged byte ranges of the tensors layers `start..end` need.
pub fn shard_ranges(file: &GgufFile, start: usize, end: usize) -> Result<Vec<Range<u64>>, String> {
    let cfg = ModelConfig::from_gguf(file).map_err(|e| e.to_string())?;
    let mut ranges = Vec::new();
    for (name, _, _) in shard_tensors(&cfg, start, end) {
        let t = file.require_tensor(&name).map_err(|e| e.to_string())?;
        ranges.push(file.tensor_range(t));
    }
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(last) if r.start <= last.end + MERGE_GAP => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    Ok(merged)
}

/// `range` cut at multiples of [`PIECE`].
fn pieces(range: &Range<u64>) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let next = ((at / PIECE) + 1) * PIECE;
        let end = next.min(range.end);
        out.push(at..end);
        at = end;
    }
    out
}

/// What a shard fetch did.
#[derive(Debug, Default, Clone, Copy)]
pub struct FetchStats {
    pub bytes: u64,
    pub from_cache: u64,
}

/// Fetches the tensors of layers `start..end` (cache first), with a progress bar.
pub async fn fetch_shard(
    url: &str,
    model_key: &str,
    file: GgufFile,
    start: usize,
    end: usize,
) -> Result<(PartialSource, FetchStats), String> {
    let ranges = shard_ranges(&file, start, end)?;
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let done = Rc::new(Cell::new(0u64));
    let label = format!(
        "fetching layers {start}-{} ({})",
        end - 1,
        ui::human_bytes(total)
    );
    let on_bytes = Closure::<dyn FnMut(f64)>::new({
        let done = Rc::clone(&done);
        let label = label.clone();
        move |n: f64| {
            done.set(done.get() + n as u64);
            ui::set_progress(done.get(), total, &label);
        }
    });
    ui::set_progress(0, total, &label);
    let prefix = cache_prefix(model_key);
    let mut source = PartialSource::new(file);
    let mut stats = FetchStats::default();
    for range in &ranges {
        let mut run = Vec::with_capacity((range.end - range.start) as usize);
        for piece in pieces(range) {
            let key = format!("{prefix}/{}-{}", piece.start, piece.end);
            let len = piece.end - piece.start;
            let bytes = match js::cache_get(&key).await {
                Some(b) if b.len() as u64 == len => {
                    stats.from_cache += len;
                    done.set(done.get() + len);
                    ui::set_progress(done.get(), total, &label);
                    b
                }
                _ => {
                    let (b, _) = js::fetch_range(url, piece.clone(), Some(&on_bytes)).await?;
                    if b.len() as u64 != len {
                        return Err(format!(
                            "asked for bytes {}..{} of the model, got {} bytes",
                            piece.start,
                            piece.end,
                            b.len()
                        ));
                    }
                    js::cache_put(&key, &b).await;
                    b
                }
            };
            run.extend_from_slice(&bytes);
        }
        stats.bytes += range.end - range.start;
        source.insert(range.start, run);
    }
    ui::set_progress(total, total, &format!("{label}: done"));
    Ok((source, stats))
}
