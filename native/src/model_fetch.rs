//! A worker without the model file fetches the tensors of its layer range from the
//! coordinator over HTTP range requests, keeping them in a disk cache; the coordinator
//! serves its file for such requests.
//!
//! Which bytes to fetch and how they make a tensor source is decided by the sans-IO half in
//! `cairn_engine::gguf` (`parse_header`, `shard_ranges`, `PartialGguf`), shared with the
//! browser worker; this module only does the requests and the files.
//!
//! Cache layout: `<cache_dir>/<model id>/<start>-<end>.bin` holds the file's bytes
//! `start..end` (one planned range). The header is fetched every time: it gives the file's
//! length and the first 8 MiB that the model id is computed from, so a changed file on the
//! coordinator gets a new id and never mixes with cached bytes of the old one.

use std::io;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use cairn_engine::gguf::{
    HeaderProgress, MODEL_ID_PREFIX_BYTES, PartialGguf, model_id, model_id_prefix_len,
    parse_header, shard_ranges,
};
use reqwest::header::{CONTENT_RANGE, RANGE};
use reqwest::{Client, StatusCode};

/// Fetches the tensors of layers `[start, end)` of the GGUF file at `url`, through the cache
/// under `cache_dir` when given. `progress(done, total)` counts the shard's tensor bytes,
/// cached ones included (not the header). Returns the source and the file's model id.
pub async fn fetch_shard(
    url: &str,
    start: usize,
    end: usize,
    cache_dir: Option<&Path>,
    progress: impl FnMut(u64, u64) + Send,
) -> Result<(PartialGguf, String)> {
    let client = Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .context("cannot set up the HTTP client")?;
    fetch_shard_with(&client, url, start, end, cache_dir, progress).await
}

/// [`fetch_shard`] with a client of the caller's (TLS settings, proxies, timeouts).
pub async fn fetch_shard_with(
    client: &Client,
    url: &str,
    start: usize,
    end: usize,
    cache_dir: Option<&Path>,
    mut progress: impl FnMut(u64, u64) + Send,
) -> Result<(PartialGguf, String)> {
    // The first request names the file (its first 8 MiB and its length) and usually holds
    // the whole header.
    let (mut prefix, file_len) = get_range(client, url, 0..MODEL_ID_PREFIX_BYTES, &mut |_| {})
        .await
        .context("cannot fetch the model file's header")?;
    let id = model_id(&prefix, file_len);
    ensure!(
        prefix.len() as u64 >= model_id_prefix_len(file_len),
        "{url}: the server sent {} bytes for the first {MODEL_ID_PREFIX_BYTES} of a {file_len}-byte file",
        prefix.len()
    );
    let file = loop {
        match parse_header(&prefix, file_len)
            .with_context(|| format!("{url} is not a readable GGUF file"))?
        {
            HeaderProgress::Done(file) => break file,
            HeaderProgress::NeedMore(n) => {
                let (more, _) = get_range(client, url, prefix.len() as u64..n, &mut |_| {})
                    .await
                    .context("cannot fetch the rest of the model file's header")?;
                prefix.extend_from_slice(&more);
            }
        }
    };
    drop(prefix);

    let ranges = shard_ranges(&file, start, end)
        .with_context(|| format!("cannot plan layers {start}..{end} of {url}"))?;
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let mut done = 0;
    progress(done, total);
    let dir = match cache_dir {
        Some(d) => {
            let dir = d.join(&id);
            tokio::fs::create_dir_all(&dir)
                .await
                .with_context(|| format!("cannot create the cache folder {}", dir.display()))?;
            Some(dir)
        }
        None => None,
    };
    tracing::info!(%url, model = %id, start, end, bytes = total, ranges = ranges.len(), "fetching shard");

    let mut part = PartialGguf::new(file);
    for r in ranges {
        let path = dir
            .as_ref()
            .map(|d| d.join(format!("{}-{}.bin", r.start, r.end)));
        if let Some(bytes) = read_cached(path.as_deref(), &r).await {
            done += bytes.len() as u64;
            progress(done, total);
            part.insert(r.start, bytes);
            continue;
        }
        let (bytes, len) = get_range(client, url, r.clone(), &mut |n| {
            done += n;
            progress(done, total);
        })
        .await?;
        ensure!(
            len == file_len && bytes.len() as u64 == r.end - r.start,
            "{url} changed while fetching: it is now {len} bytes long, was {file_len}"
        );
        if let Some(path) = &path
            && let Err(e) = write_atomically(path, &bytes).await
        {
            tracing::warn!(path = %path.display(), error = %e, "cannot cache fetched tensors");
        }
        part.insert(r.start, bytes);
    }
    Ok((part, id))
}

/// The cached bytes of `r`, if the cache has a file of the right length.
async fn read_cached(path: Option<&Path>, r: &Range<u64>) -> Option<Vec<u8>> {
    let path = path?;
    match tokio::fs::read(path).await {
        Ok(bytes) if bytes.len() as u64 == r.end - r.start => Some(bytes),
        Ok(bytes) => {
            tracing::warn!(path = %path.display(), len = bytes.len(), "cached range has the wrong length; fetching it again");
            None
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read cached range; fetching it again");
            None
        }
    }
}

/// Writes `bytes` to a fresh temporary file beside `path`, then renames it over `path`, so
/// that a reader never sees a half-written file under the final name.
async fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp.{}.{n}", std::process::id()));
    let result = async {
        tokio::fs::write(&tmp, bytes).await?;
        tokio::fs::rename(&tmp, path).await
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    result
}

/// GETs bytes `range` of the file at `url` with a Range request and returns them with the
/// file's length (from `Content-Range`). The server may end the range early only at the end
/// of the file. `on_bytes` is told of each chunk received.
async fn get_range(
    client: &Client,
    url: &str,
    range: Range<u64>,
    on_bytes: &mut (dyn FnMut(u64) + Send),
) -> Result<(Vec<u8>, u64)> {
    ensure!(range.start < range.end, "empty range {range:?} requested");
    let what = format!("{url} bytes {}..{}", range.start, range.end);
    let mut resp = client
        .get(url)
        .header(RANGE, format!("bytes={}-{}", range.start, range.end - 1))
        .send()
        .await
        .with_context(|| format!("GET {what}"))?;
    match resp.status() {
        StatusCode::PARTIAL_CONTENT => {}
        StatusCode::OK => bail!(
            "GET {what}: the server ignored the Range header (200 OK, the whole file, instead of 206 Partial Content); it must support HTTP range requests"
        ),
        StatusCode::RANGE_NOT_SATISFIABLE => bail!(
            "GET {what}: 416 Range Not Satisfiable, the file is shorter (Content-Range: {:?})",
            resp.headers().get(CONTENT_RANGE)
        ),
        status => bail!("GET {what}: HTTP {status}"),
    }
    let content_range = resp
        .headers()
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .with_context(|| format!("GET {what}: 206 reply without a readable Content-Range"))?
        .to_owned();
    let (got, file_len) = parse_content_range(&content_range)
        .with_context(|| format!("GET {what}: bad Content-Range {content_range:?}"))?;
    ensure!(
        got.start == range.start
            && got.end <= range.end
            && (got.end == range.end || got.end == file_len),
        "GET {what}: the server sent {content_range:?} instead"
    );
    let want = got.end - got.start;
    // Bounded by the range asked for: at most a planned range or a header prefix.
    let mut body = Vec::with_capacity(want as usize);
    while let Some(chunk) = resp
        .chunk()
        .await
        .with_context(|| format!("GET {what}: reading the body"))?
    {
        ensure!(
            body.len() as u64 + chunk.len() as u64 <= want,
            "GET {what}: the body is longer than the {want} bytes of {content_range:?}"
        );
        body.extend_from_slice(&chunk);
        on_bytes(chunk.len() as u64);
    }
    ensure!(
        body.len() as u64 == want,
        "GET {what}: short body, {} of {want} bytes",
        body.len()
    );
    Ok((body, file_len))
}

/// Parses `bytes <first>-<last>/<length>` into the half-open range and the file length.
fn parse_content_range(v: &str) -> Option<(Range<u64>, u64)> {
    let (range, len) = v.strip_prefix("bytes ")?.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let (first, last, len): (u64, u64, u64) =
        (first.parse().ok()?, last.parse().ok()?, len.parse().ok()?);
    (first <= last && last < len).then_some((first..last + 1, len))
}

/// The path a coordinator serves its model file under (with HTTP range requests, for workers
/// that call [`fetch_shard`]): `/api/model/<model id>.gguf`.
pub fn model_route(id: &str) -> String {
    format!("/api/model/{id}.gguf")
}

/// The model id of a local file (what [`fetch_shard`] returns for it when served).
pub fn local_model_id(path: &Path) -> Result<String> {
    use std::io::Read;
    let open = || format!("cannot read {}", path.display());
    let f = std::fs::File::open(path).with_context(open)?;
    let len = f.metadata().with_context(open)?.len();
    let mut prefix = Vec::new();
    f.take(model_id_prefix_len(len))
        .read_to_end(&mut prefix)
        .with_context(open)?;
    ensure!(
        prefix.len() as u64 == model_id_prefix_len(len),
        "{} shrank while reading it",
        path.display()
    );
    Ok(model_id(&prefix, len))
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    use axum::Router;
    use axum::extract::Request;
    use axum::middleware::{self, Next};
    use axum::routing::get;
    use cairn_engine::gguf::{GgufWriter, MappedGguf, TensorSource};
    use cairn_engine::model::ModelConfig;
    use cairn_engine::model::weights::shard_tensors;
    use cairn_engine::quant::GgmlType;
    use tower_http::services::ServeFile;

    use super::*;

    /// A 6-layer llama-shaped file whose tensors all hold different bytes, with a header
    /// (padded by a long string array, like a big vocabulary) past the first 8 MiB so that
    /// it takes a second request.
    fn write_model(path: &Path) -> ModelConfig {
        let cfg = ModelConfig {
            n_layers: 6,
            dim: 64,
            ffn_dim: 128,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            rope_dim: 16,
            vocab_size: 256,
            tied_output: true,
            ..ModelConfig::synthetic("135m").unwrap()
        };
        let mut w = GgufWriter::new();
        w.add("general.architecture", "llama")
            .add("llama.block_count", cfg.n_layers as u32)
            .add("llama.embedding_length", cfg.dim as u32)
            .add("llama.feed_forward_length", cfg.ffn_dim as u32)
            .add("llama.attention.head_count", cfg.n_heads as u32)
            .add("llama.attention.head_count_kv", cfg.n_kv_heads as u32)
            .add(
                "test.padding",
                (0..240_000).map(|i| format!("{i:032}")).collect::<Vec<_>>(),
            );
        let mut seed = 1u8;
        for (name, rows, cols) in shard_tensors(&cfg, 0, cfg.n_layers) {
            let ty = if rows == 1 {
                GgmlType::F32
            } else {
                GgmlType::Q8_0
            };
            let n = ty.row_bytes(rows * cols).unwrap();
            seed = seed.wrapping_add(1);
            let data: Vec<u8> = (0..n)
                .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
                .collect();
            w.add_tensor(name, &[cols as u64, rows as u64], ty, data);
        }
        w.write_to(std::fs::File::create(path).unwrap()).unwrap();
        cfg
    }

    /// Serves `app` on a free loopback port until the test's runtime ends.
    async fn serve(app: Router) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    fn client() -> Client {
        // Loopback only: keep any proxy settings of the environment out of it.
        Client::builder().no_proxy().build().unwrap()
    }

    #[tokio::test]
    async fn fetches_a_shard_through_the_cache() {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model.gguf");
        let cfg = write_model(&model);
        let whole = MappedGguf::open(&model).unwrap();
        assert!(whole.file.data_offset > MODEL_ID_PREFIX_BYTES);
        let id = local_model_id(&model).unwrap();

        let requests = Arc::new(AtomicUsize::new(0));
        let counter = requests.clone();
        let app = Router::new()
            .route_service(&model_route(&id), ServeFile::new(model.clone()))
            .layer(middleware::from_fn(move |req: Request, next: Next| {
                counter.fetch_add(1, Ordering::SeqCst);
                next.run(req)
            }));
        let url = format!("http://{}{}", serve(app).await, model_route(&id));
        let cache = tmp.path().join("cache");
        let count = || requests.load(Ordering::SeqCst);

        let (s, e) = (2, 4);
        let check = |part: &PartialGguf| {
            for (name, _, _) in shard_tensors(&cfg, s, e) {
                assert_eq!(
                    part.tensor_data(&name).unwrap(),
                    whole.tensor_data(&name).unwrap(),
                    "{name}"
                );
            }
            assert!(!part.has_tensor("blk.4.attn_q.weight"));
            assert!(!part.has_tensor("token_embd.weight"));
        };
        let mut last = (0, 0);
        let (part, got_id) = fetch_shard_with(&client(), &url, s, e, Some(&cache), |d, t| {
            assert!(d >= last.0 && d <= t);
            last = (d, t);
        })
        .await
        .unwrap();
        assert_eq!(got_id, id);
        assert!(last.1 > 0 && last.0 == last.1, "progress ended at {last:?}");
        check(&part);
        let ranges = shard_ranges(part.gguf(), s, e).unwrap();
        // Two header requests (8 MiB, then the rest), then the ranges.
        assert_eq!(count(), 2 + ranges.len());

        // Again: only the header comes over the network.
        let (part, _) = fetch_shard_with(&client(), &url, s, e, Some(&cache), |_, _| {})
            .await
            .unwrap();
        check(&part);
        assert_eq!(count(), 4 + ranges.len());

        // A cached range of the wrong length is fetched again, and the cache repaired.
        let r = &ranges[0];
        let cached = cache.join(&id).join(format!("{}-{}.bin", r.start, r.end));
        std::fs::write(&cached, b"short").unwrap();
        let (part, _) = fetch_shard_with(&client(), &url, s, e, Some(&cache), |_, _| {})
            .await
            .unwrap();
        check(&part);
        assert_eq!(count(), 7 + ranges.len());
        assert_eq!(std::fs::metadata(&cached).unwrap().len(), r.end - r.start);

        // A bad layer range and a missing file are clear errors.
        let err = fetch_shard_with(&client(), &url, 5, 9, None, |_, _| {})
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("5..9"), "{err:#}");
        let missing = format!("http://{}/api/model/nope", url.split('/').nth(2).unwrap());
        let err = fetch_shard_with(&client(), &missing, 0, 1, None, |_, _| {})
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("404"), "{err:#}");
    }

    #[tokio::test]
    async fn a_server_ignoring_range_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model.gguf");
        write_model(&model);
        let bytes = std::fs::read(&model).unwrap();
        let app = Router::new().route("/model", get(move || async move { bytes }));
        let url = format!("http://{}/model", serve(app).await);
        let err = fetch_shard_with(&client(), &url, 0, 2, None, |_, _| {})
            .await
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("ignored the Range header"), "{msg}");
    }

    #[test]
    fn content_range_parsing() {
        assert_eq!(parse_content_range("bytes 0-99/1000"), Some((0..100, 1000)));
        assert_eq!(parse_content_range("bytes 5-5/6"), Some((5..6, 6)));
        for bad in [
            "bytes 0-99/*",
            "bytes */1000",
            "bytes 9-3/10",
            "bytes 0-10/10",
            "0-1/2",
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }
}
