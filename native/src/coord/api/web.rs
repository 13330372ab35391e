//! The dashboard, the browser worker's join page and wasm package (embedded in the binary,
//! or from `CAIRN_WEB_DIR`: `crate::web_assets`), the join QR code, and the model file (with
//! range requests) workers fetch shards from.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use tower::ServiceExt;
use tower_http::services::{ServeDir, ServeFile};

use super::ApiError;
use crate::coord::{Shared, share};
use crate::web_assets::{self, WebSource};

const DASHBOARD: &str = include_str!("../../../assets/dashboard.html");

pub async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD)
}

/// Logs where the join page and the package come from, deciding it for the process's life:
/// `CAIRN_WEB_DIR` is read once, here, as `cairn serve` builds its routes.
pub fn log_source() {
    let source = web_assets::source();
    let missing = match source {
        WebSource::Dir(dir) => !dir.join(web_assets::JOIN_PAGE).is_file(),
        WebSource::Embedded => !web_assets::embedded(),
    };
    if missing {
        tracing::warn!("{}; /join will answer 404", source.describe());
    } else {
        tracing::info!("{}", source.describe());
    }
}

pub async fn join_page(request: Request) -> Response {
    join_page_from(web_assets::source(), request).await
}

pub async fn pkg(Path(path): Path<String>, request: Request) -> Response {
    pkg_from(web_assets::source(), &path, request).await
}

async fn join_page_from(source: &WebSource, request: Request) -> Response {
    match source {
        WebSource::Dir(dir) => {
            let page = dir.join(web_assets::JOIN_PAGE);
            if !page.is_file() {
                return ApiError::not_found(format!(
                    "the browser worker's page is not here ({} is missing; CAIRN_WEB_DIR names \
                     a directory holding www/join.html and pkg/)",
                    page.display()
                ))
                .into_response();
            }
            isolated(serve(ServeFile::new(page), request).await)
        }
        WebSource::Embedded => embedded(web_assets::JOIN_PAGE, &request),
    }
}

/// `path` is what follows `/pkg/` in the request's URL.
async fn pkg_from(source: &WebSource, path: &str, request: Request) -> Response {
    match source {
        WebSource::Dir(dir) => {
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
            isolated(
                serve(
                    ServeDir::new(dir.join("pkg")),
                    Request::from_parts(parts, body),
                )
                .await,
            )
        }
        WebSource::Embedded => embedded(&format!("pkg/{path}"), &request),
    }
}

/// A file of the join page's from `CAIRN_WEB_DIR`, with the headers the embedded copies
/// carry (`web_assets::add_isolation_headers`).
fn isolated(mut response: Response) -> Response {
    web_assets::add_isolation_headers(response.headers_mut());
    response
}

fn embedded(path: &str, request: &Request) -> Response {
    if !web_assets::embedded() {
        return ApiError::not_found(web_assets::SKIPPED).into_response();
    }
    web_assets::response(path, request.headers())
        .unwrap_or_else(|| ApiError::not_found(format!("no file {path} here")).into_response())
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

#[derive(serde::Deserialize)]
pub struct CostQuery {
    /// The memory budget the device would advertise, in bytes.
    memory: Option<u64>,
}

/// What joining would cost a device with `?memory=BYTES` to lend, for the join page to
/// say before its button is pressed. Sizes only: no model name, peer or placement.
pub async fn join_cost(State(shared): State<Arc<Shared>>, Query(q): Query<CostQuery>) -> Response {
    let Some(budget) = q.memory else {
        return ApiError::invalid(
            "say the device's memory budget in bytes: /join/cost?memory=BYTES",
            Some("memory"),
        )
        .into_response();
    };
    let devices = shared.state().peers.values().filter(|p| p.online).count();
    Json(share::estimate(
        &shared.model.cost,
        shared.model.file_bytes,
        budget,
        devices,
    ))
    .into_response()
}

pub async fn join_qr(State(shared): State<Arc<Shared>>) -> Response {
    let Some(url) = shared.join_url() else {
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

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    fn get(uri: &str) -> Request {
        Request::builder()
            .uri(uri)
            .body(Body::empty())
            .expect("request")
    }

    async fn body(r: Response) -> Vec<u8> {
        axum::body::to_bytes(r.into_body(), usize::MAX)
            .await
            .expect("body")
            .to_vec()
    }

    /// `CAIRN_WEB_DIR`'s files win over the embedded ones, with the browser's content types.
    #[tokio::test]
    async fn a_web_dir_serves_its_own_page_and_package() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("www")).expect("www");
        std::fs::create_dir_all(dir.path().join("pkg/snippets")).expect("pkg");
        std::fs::write(dir.path().join("www/join.html"), "<p>local page</p>").expect("page");
        std::fs::write(dir.path().join("pkg/cairn_web_bg.wasm"), b"\0asmlocal").expect("wasm");
        std::fs::write(dir.path().join("pkg/snippets/a.js"), "export {}").expect("js");
        let source = WebSource::Dir(dir.path().to_owned());

        let page = join_page_from(&source, get("/join")).await;
        assert_eq!(page.status(), StatusCode::OK);
        assert_eq!(body(page).await, b"<p>local page</p>");

        let wasm = pkg_from(&source, "cairn_web_bg.wasm", get("/pkg/cairn_web_bg.wasm")).await;
        assert_eq!(wasm.status(), StatusCode::OK);
        assert_eq!(wasm.headers()[header::CONTENT_TYPE], "application/wasm");
        assert_eq!(body(wasm).await, b"\0asmlocal");

        let js = pkg_from(&source, "snippets/a.js", get("/pkg/snippets/a.js")).await;
        let ty = js.headers()[header::CONTENT_TYPE].to_str().expect("ascii");
        assert!(ty.contains("javascript"), "{ty}");

        let missing = pkg_from(&source, "nothing.js", get("/pkg/nothing.js")).await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        let escape = pkg_from(&source, "../www/join.html", get("/pkg/../www/join.html")).await;
        assert_eq!(escape.status(), StatusCode::NOT_FOUND);

        std::fs::remove_file(dir.path().join("www/join.html")).expect("rm");
        let gone = join_page_from(&source, get("/join")).await;
        assert_eq!(gone.status(), StatusCode::NOT_FOUND);
    }

    /// Without `CAIRN_WEB_DIR`, the binary's own copies (or a 404 that says why they are not
    /// in it).
    #[tokio::test]
    async fn the_embedded_copies_are_served_by_default() {
        let page = join_page_from(&WebSource::Embedded, get("/join")).await;
        if !web_assets::embedded() {
            assert_eq!(page.status(), StatusCode::NOT_FOUND);
            let text = String::from_utf8(body(page).await).expect("utf-8");
            assert!(text.contains("CAIRN_SKIP_WEB"), "{text}");
            return;
        }
        assert_eq!(page.status(), StatusCode::OK);
        assert_eq!(
            body(page).await,
            web_assets::get(web_assets::JOIN_PAGE).expect("page")
        );
        let glue = pkg_from(
            &WebSource::Embedded,
            "cairn_web.js",
            get("/pkg/cairn_web.js"),
        )
        .await;
        assert_eq!(glue.status(), StatusCode::OK);
        assert_eq!(
            glue.headers()[header::CONTENT_TYPE],
            "text/javascript; charset=utf-8"
        );
        let none = pkg_from(&WebSource::Embedded, "x.js", get("/pkg/x.js")).await;
        assert_eq!(none.status(), StatusCode::NOT_FOUND);
    }
}
