//! The dashboard, the browser worker's join page and wasm package, the join
//! QR code, and the model file (with range requests) workers fetch shards from.

use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use tower::ServiceExt;
use tower_http::services::{ServeDir, ServeFile};

use super::ApiError;
use crate::coord::Shared;

const DASHBOARD: &str = include_str!("../../../assets/dashboard.html");

pub async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD)
}

/// Where the browser worker's page (`www/`) and wasm package (`pkg/`) live:
/// `$CAIRN_WEB_DIR`, else the `web/` directory of this source tree.
pub fn web_dir() -> PathBuf {
    std::env::var_os("CAIRN_WEB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| FsPath::new(env!("CARGO_MANIFEST_DIR")).join("../web"))
}

pub async fn join_page(request: Request) -> Response {
    let page = web_dir().join("www/join.html");
    if !page.exists() {
        return ApiError::not_found(format!(
            "the browser worker's page is not built here ({} is missing; run scripts/build-web.sh)",
            page.display()
        ))
        .into_response();
    }
    serve(ServeFile::new(page), request).await
}

pub async fn pkg(Path(path): Path<String>, request: Request) -> Response {
    let _ = path;
    let dir = web_dir();
    // ServeDir sees the path under /pkg/.
    let (mut parts, body) = request.into_parts();
    let stripped = parts
        .uri
        .path()
        .strip_prefix("/pkg")
        .unwrap_or("/")
        .to_owned();
    parts.uri = match stripped.parse() {
        Ok(u) => u,
        Err(_) => return ApiError::not_found("bad path").into_response(),
    };
    serve(
        ServeDir::new(dir.join("pkg")),
        Request::from_parts(parts, body),
    )
    .await
}

/// The model file, for `LoadShard`'s source; only the served model's id is known.
pub async fn model_file(
    State(shared): State<Arc<Shared>>,
    Path(file): Path<String>,
    request: Request,
) -> Response {
    let id = file.strip_suffix(".gguf").unwrap_or(&file);
    if id != shared.model.id {
        return ApiError::not_found(format!("no model with id {id} here")).into_response();
    }
    serve(ServeFile::new(&shared.model.path), request).await
}

async fn serve<S>(service: S, request: Request) -> Response
where
    S: tower::Service<Request, Error = std::convert::Infallible> + Send,
    S::Response: IntoResponse,
    S::Future: Send,
{
    match service.oneshot(request).await {
        Ok(r) => r.into_response(),
        Err(e) => match e {},
    }
}

pub async fn join_qr(State(shared): State<Arc<Shared>>) -> Response {
    let Some(url) = &shared.opts.join_url else {
        return ApiError::not_found("no join URL is configured").into_response();
    };
    match qrcode::QrCode::new(url.as_bytes()) {
        Ok(code) => {
            let svg = code
                .render::<qrcode::render::svg::Color<'_>>()
                .min_dimensions(200, 200)
                .build();
            ([(header::CONTENT_TYPE, "image/svg+xml")], Body::from(svg)).into_response()
        }
        Err(e) => ApiError::internal(format!("cannot encode the join URL as a QR code: {e}"))
            .into_response(),
    }
}
