//! The browser worker's files the `cairn` binary carries: the join page (`www/join.html`) and
//! the wasm package (`pkg/…`), built and embedded by `build.rs`, and where `cairn serve` takes
//! them from (`CAIRN_WEB_DIR` if set when it starts, else these copies).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::LazyLock;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// `(path, bytes)` for every embedded file; empty in a build made with `CAIRN_SKIP_WEB`.
static FILES: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/web_assets.rs"));

/// The join page's path, in the embedded set and under `CAIRN_WEB_DIR`.
pub const JOIN_PAGE: &str = "www/join.html";

/// Why a binary has no embedded files, for the pages that would have been served.
pub const SKIPPED: &str = "this cairn was built with CAIRN_SKIP_WEB set, without the join page \
     and the browser worker's wasm package: rebuild it without CAIRN_SKIP_WEB, or set \
     CAIRN_WEB_DIR to a directory holding www/join.html and pkg/";

/// Whether this binary carries its web files (it was not built with `CAIRN_SKIP_WEB`).
pub fn embedded() -> bool {
    !FILES.is_empty()
}

/// An embedded file: `www/join.html` or `pkg/<path>`.
pub fn get(path: &str) -> Option<&'static [u8]> {
    FILES.iter().find(|(p, _)| *p == path).map(|(_, b)| *b)
}

/// The paths of every embedded file.
pub fn paths() -> impl Iterator<Item = &'static str> {
    FILES.iter().map(|(p, _)| *p)
}

/// The content type a browser needs for `path`: a module script must be JavaScript, and
/// `WebAssembly.instantiateStreaming` refuses anything but `application/wasm`.
pub fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, ext)| ext) {
        Some("html") => "text/html; charset=utf-8",
        Some("js") => "text/javascript; charset=utf-8",
        Some("wasm") => "application/wasm",
        Some("json") => "application/json",
        Some("ts") => "application/typescript",
        _ => "application/octet-stream",
    }
}

/// Makes the join page cross-origin isolated: on the page and on every file it loads (the
/// package, its snippets, the CPU fallback's worker scripts), so the page and its workers
/// have `crossOriginIsolated` and with it the shared memory the CPU fallback's threads need
/// (web/src/stage_worker.js). The page loads nothing from other origins but CORS fetches
/// (model shards) and the signaling socket, which `require-corp` leaves alone.
pub fn add_isolation_headers(headers: &mut HeaderMap) {
    headers.insert(
        HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(
        HeaderName::from_static("cross-origin-embedder-policy"),
        HeaderValue::from_static("require-corp"),
    );
}

/// A strong validator per embedded file (FNV-1a of its bytes), computed once on first use.
fn etag(path: &str) -> Option<&'static str> {
    static TAGS: LazyLock<HashMap<&'static str, String>> = LazyLock::new(|| {
        FILES
            .iter()
            .map(|(path, bytes)| {
                let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
                });
                (*path, format!("\"{hash:016x}-{:x}\"", bytes.len()))
            })
            .collect()
    });
    TAGS.get(path).map(String::as_str)
}

/// The embedded file at `path` as an HTTP response (`304` when `If-None-Match` names its
/// tag); `None` when there is no such file. Browsers revalidate every time (`no-cache`), so
/// a page reloaded after an upgrade never runs an old package against a new coordinator.
/// Every answer carries [`add_isolation_headers`]'.
pub fn response(path: &str, request_headers: &HeaderMap) -> Option<Response> {
    let bytes = get(path)?;
    let tag = etag(path)?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(content_type(path)),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    add_isolation_headers(&mut headers);
    if let Ok(v) = HeaderValue::from_str(tag) {
        headers.insert(header::ETAG, v);
    }
    let fresh = request_headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            let t = t.trim();
            t == "*" || t.strip_prefix("W/").unwrap_or(t) == tag
        });
    if fresh {
        return Some((StatusCode::NOT_MODIFIED, headers).into_response());
    }
    Some((headers, Body::from(bytes)).into_response())
}

/// Where `cairn serve` takes the join page and the package from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WebSource {
    /// The copies in this binary.
    Embedded,
    /// `$CAIRN_WEB_DIR`: `www/join.html` and `pkg/` under it, read at each request (for
    /// working on the page without rebuilding the binary).
    Dir(PathBuf),
}

impl WebSource {
    /// `CAIRN_WEB_DIR` if it is set and not empty, else the embedded copies.
    pub fn from_env() -> WebSource {
        match std::env::var_os("CAIRN_WEB_DIR") {
            Some(dir) if !dir.is_empty() => WebSource::Dir(PathBuf::from(dir)),
            _ => WebSource::Embedded,
        }
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        match self {
            WebSource::Embedded if embedded() => {
                "the join page and the wasm package are the ones built into this binary".into()
            }
            WebSource::Embedded => SKIPPED.into(),
            WebSource::Dir(dir) => format!(
                "the join page and the wasm package come from CAIRN_WEB_DIR={} ({} and pkg/)",
                dir.display(),
                JOIN_PAGE
            ),
        }
    }
}

/// The source this process uses, decided once, from its environment when first asked
/// (`cairn serve` asks as it starts).
pub fn source() -> &'static WebSource {
    static SOURCE: LazyLock<WebSource> = LazyLock::new(WebSource::from_env);
    &SOURCE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types_are_the_ones_browsers_require() {
        assert_eq!(content_type("pkg/cairn_web_bg.wasm"), "application/wasm");
        assert_eq!(
            content_type("pkg/snippets/x/src/probe.js"),
            "text/javascript; charset=utf-8"
        );
        assert_eq!(content_type(JOIN_PAGE), "text/html; charset=utf-8");
        assert_eq!(content_type("pkg/README"), "application/octet-stream");
    }

    /// The binary carries a page and a package that fit together: the page imports the glue,
    /// the glue loads the wasm, and every module the glue imports by a relative path is there.
    #[test]
    fn the_embedded_page_and_package_fit_together() {
        if !embedded() {
            eprintln!("SKIPPED: built with CAIRN_SKIP_WEB");
            return;
        }
        let page = std::str::from_utf8(get(JOIN_PAGE).expect("the join page")).expect("utf-8");
        assert!(
            page.contains("/pkg/cairn_web.js"),
            "the page does not load the glue"
        );
        let wasm = get("pkg/cairn_web_bg.wasm").expect("the wasm module");
        assert!(wasm.starts_with(b"\0asm"), "not a wasm module");
        let glue = std::str::from_utf8(get("pkg/cairn_web.js").expect("the glue")).expect("utf-8");
        assert!(
            glue.contains("cairn_web_bg.wasm"),
            "the glue does not load the wasm"
        );
        let mut imports = 0;
        for line in glue.lines() {
            let Some(rest) = line.trim_start().strip_prefix("import ") else {
                continue;
            };
            let Some(spec) = rest.split(['\'', '"']).nth(1) else {
                continue;
            };
            if let Some(rel) = spec.strip_prefix("./") {
                imports += 1;
                assert!(
                    get(&format!("pkg/{rel}")).is_some(),
                    "the glue imports {spec}, which is not embedded: {:?}",
                    paths().collect::<Vec<_>>()
                );
            }
        }
        // web/src/js.rs binds a module of its own (src/probe.js): a snippet.
        assert!(imports >= 1, "the glue imports no snippet");
    }

    #[test]
    fn a_known_tag_is_not_modified_and_others_get_the_bytes() {
        let Some(bytes) = get(JOIN_PAGE) else {
            eprintln!("SKIPPED: built with CAIRN_SKIP_WEB");
            return;
        };
        let first = response(JOIN_PAGE, &HeaderMap::new()).expect("the page");
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(first.headers()[header::CACHE_CONTROL], "no-cache");
        let tag = first.headers()[header::ETAG].clone();
        let body = futures::executor::block_on(axum::body::to_bytes(first.into_body(), usize::MAX))
            .expect("body");
        assert_eq!(&body[..], bytes);

        let mut again = HeaderMap::new();
        again.insert(header::IF_NONE_MATCH, tag.clone());
        let second = response(JOIN_PAGE, &again).expect("the page");
        assert_eq!(second.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(second.headers()[header::ETAG], tag);

        let mut stale = HeaderMap::new();
        stale.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"0-0\""));
        let third = response(JOIN_PAGE, &stale).expect("the page");
        assert_eq!(third.status(), StatusCode::OK);

        // A wasm tag differs from the page's.
        let wasm = response("pkg/cairn_web_bg.wasm", &HeaderMap::new()).expect("wasm");
        assert_ne!(wasm.headers()[header::ETAG], tag);
        assert!(response("pkg/nothing.js", &HeaderMap::new()).is_none());
    }
}
