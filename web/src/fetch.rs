//! A model's bytes over HTTP range requests, through the engine's sans-IO
//! `cairn_engine::gguf::partial`: the first bytes (which name the model and usually hold
//! its header), more of the header if needed, then only the byte ranges of the tensors a
//! shard needs, with a progress bar. Every piece is kept in Cache Storage under the model's
//! id and its byte range, so a rejoin does not download it again.

use std::cell::Cell;
use std::rc::Rc;

use cairn_engine::gguf::{
    GgufFile, HeaderProgress, MODEL_ID_PREFIX_BYTES, PartialGguf, model_id, model_id_prefix_len,
    parse_header, shard_ranges,
};
use wasm_bindgen::prelude::*;

use crate::js;
use crate::ui;

/// Cache keys are `<model>/<what>`; the model part is its id, or the URL without one.
fn cache_prefix(model_key: &str) -> String {
    model_key.chars().filter(|c| !c.is_control()).collect()
}

/// A parsed header, its model id, and its bytes (the CPU fallback's Web Worker parses them
/// again: a `GgufFile` does not cross `postMessage`).
pub struct Header {
    pub file: GgufFile,
    pub model_id: String,
    pub bytes: Vec<u8>,
    pub file_len: u64,
}

/// Fetches and parses the GGUF header of `url`. With `expected_id`, the file's model id
/// must match it (the coordinator names the model it means).
pub async fn fetch_header(url: &str, expected_id: Option<&str>) -> Result<Header, String> {
    let key = expected_id.map(|id| format!("{}/header", cache_prefix(id)));
    if let Some(key) = &key
        && let Some(cached) = js::cache_get(key).await
        && cached.len() > 8
    {
        let file_len = u64::from_le_bytes(cached[..8].try_into().unwrap_or_default());
        if let Ok(HeaderProgress::Done(file)) = parse_header(&cached[8..], file_len) {
            return Ok(Header {
                file,
                model_id: expected_id.unwrap_or_default().to_owned(),
                bytes: cached[8..].to_vec(),
                file_len,
            });
        }
    }
    ui::set_progress(0, 1, "reading the model header");
    let (mut prefix, total) = js::fetch_range(url, 0..MODEL_ID_PREFIX_BYTES, None).await?;
    let file_len =
        total.ok_or("the model server sent no Content-Range: range requests are needed")?;
    if (prefix.len() as u64) < model_id_prefix_len(file_len) {
        return Err(format!(
            "the model server returned {} bytes of the first {}",
            prefix.len(),
            model_id_prefix_len(file_len)
        ));
    }
    let id = model_id(&prefix, file_len);
    if let Some(expected) = expected_id
        && expected != id
    {
        return Err(format!(
            "{url} is model {id}, not the {expected} the coordinator asked for"
        ));
    }
    let file = loop {
        match parse_header(&prefix, file_len).map_err(|e| format!("the model header: {e}"))? {
            HeaderProgress::Done(file) => break file,
            HeaderProgress::NeedMore(n) => {
                let have = prefix.len() as u64;
                ui::set_progress(have, n, "reading the model header");
                let (more, _) = js::fetch_range(url, have..n, None).await?;
                if more.is_empty() {
                    return Err("the model server returned no bytes".into());
                }
                prefix.extend_from_slice(&more);
            }
        }
    };
    // The header only: the tensor bytes of the prefix are cached with their shard.
    let header_len = (file.data_offset as usize).min(prefix.len());
    prefix.truncate(header_len);
    if let Some(key) = &key {
        let mut stored = file_len.to_le_bytes().to_vec();
        stored.extend_from_slice(&prefix);
        js::cache_put(key, &stored).await;
    }
    Ok(Header {
        file,
        model_id: id,
        bytes: prefix,
        file_len,
    })
}

/// What a shard fetch did.
#[derive(Debug, Default, Clone, Copy)]
pub struct FetchStats {
    pub bytes: u64,
    pub from_cache: u64,
}

/// The byte ranges of a shard's tensors, each with its offset in the file.
pub struct ShardBytes {
    pub pieces: Vec<(u64, Vec<u8>)>,
}

impl ShardBytes {
    /// The pieces as a tensor source over `file`.
    pub fn into_source(self, file: GgufFile) -> PartialGguf {
        let mut source = PartialGguf::new(file);
        for (offset, bytes) in self.pieces {
            source.insert(offset, bytes);
        }
        source
    }
}

/// Fetches the tensors of layers `start..end` (cache first), with a progress bar.
pub async fn fetch_shard(
    url: &str,
    header: &Header,
    start: usize,
    end: usize,
) -> Result<(ShardBytes, FetchStats), String> {
    let ranges = shard_ranges(&header.file, start, end).map_err(|e| e.to_string())?;
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let done = Rc::new(Cell::new(0u64));
    let label = format!(
        "fetching layers {start}-{} ({})",
        end.saturating_sub(1),
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
    let prefix = cache_prefix(&header.model_id);
    let mut pieces = Vec::with_capacity(ranges.len());
    let mut stats = FetchStats::default();
    for range in &ranges {
        let key = format!("{prefix}/{}-{}", range.start, range.end);
        let len = range.end - range.start;
        let bytes = match js::cache_get(&key).await {
            Some(b) if b.len() as u64 == len => {
                stats.from_cache += len;
                done.set(done.get() + len);
                ui::set_progress(done.get(), total, &label);
                b
            }
            _ => {
                let (b, _) = js::fetch_range(url, range.clone(), Some(&on_bytes)).await?;
                if b.len() as u64 != len {
                    return Err(format!(
                        "asked for bytes {}..{} of the model, got {} bytes",
                        range.start,
                        range.end,
                        b.len()
                    ));
                }
                js::cache_put(&key, &b).await;
                b
            }
        };
        stats.bytes += len;
        pieces.push((range.start, bytes));
    }
    ui::set_progress(total, total, &format!("{label}: done"));
    Ok((ShardBytes { pieces }, stats))
}
