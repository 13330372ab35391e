//! Who may call what. With `--api-key`, every route needs a key unless it is
//! listed here as open (pages that carry no data, health, the model file
//! with its capability) or readable (`--read-key` suffices); anything else,
//! including routes added later, needs the admin key. Without a key the
//! coordinator listens on loopback only (`cairn serve`), and all is open.
//!
//! Request bodies must be JSON: a browser's cross-site form can send
//! `text/plain`, `multipart/form-data` or `application/x-www-form-urlencoded`
//! without a preflight, never `application/json`. CORS is off unless
//! `--allow-origin` names an origin: only those get CORS headers and
//! preflight answers.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;
use crate::audit::Event;
use crate::coord::Shared;

/// What the caller's key lets it do; handlers read it from the request's
/// extensions (only an admin sees the join URL).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// No key, or a wrong one, on an open route.
    None,
    Read,
    Admin,
}

/// What a route needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Needs {
    Nothing,
    Read,
    Admin,
}

/// Open routes hold no cluster data: the dashboard's and the join page's
/// shells (their data comes from the API), the wasm package, health, and
/// what joining would cost a device (the model's sizes, which every worker
/// fetches anyway).
fn needs(method: &Method, path: &str) -> Needs {
    let read = method == Method::GET || method == Method::HEAD;
    match path {
        "/" | "/join" | "/join/cost" | "/healthz" if read => Needs::Nothing,
        p if read && p.starts_with("/pkg/") => Needs::Nothing,
        "/api/cluster"
        | "/api/events"
        | "/api/placement"
        | "/api/placement/preview"
        | "/metrics"
        | "/v1/models"
            if read =>
        {
            Needs::Read
        }
        _ => Needs::Admin,
    }
}

/// The kind of route the audit log names for a request (never its full
/// path: a model file name or a token id stays out of the log).
pub fn route_class(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" | "/v1/completions" | "/api/generate" | "/api/chat" => "inference",
        "/v1/models" | "/api/tags" | "/api/ps" | "/api/show" | "/api/version" => "models",
        "/api/cluster" | "/api/events" => "cluster",
        "/metrics" => "metrics",
        "/api/join-qr.svg" => "join",
        "/" | "/join" | "/join/cost" | "/healthz" => "page",
        p if p.starts_with("/api/placement") => "placement",
        p if p.starts_with("/api/tokens") => "tokens",
        p if p.starts_with("/api/workers") => "workers",
        p if p.starts_with("/api/model/") => "model_file",
        p if p.starts_with("/pkg/") => "page",
        _ => "other",
    }
}

/// Compares in time independent of where the inputs differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn scope_of(shared: &Shared, request: &Request) -> Scope {
    let Some(admin) = &shared.opts.api_key else {
        return Scope::Admin;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(k) if same(k.as_bytes(), admin.as_bytes()) => Scope::Admin,
        Some(k)
            if shared
                .opts
                .read_key
                .as_ref()
                .is_some_and(|r| same(k.as_bytes(), r.as_bytes())) =>
        {
            Scope::Read
        }
        _ => Scope::None,
    }
}

/// The model file is fetched by workers, which hold no API key: the
/// coordinator puts a capability in the URL it sends them (`?cap=`).
fn has_model_cap(shared: &Shared, request: &Request) -> bool {
    let Some(cap) = &shared.opts.model_cap else {
        return false;
    };
    request.uri().query().is_some_and(|q| {
        q.split('&')
            .filter_map(|kv| kv.strip_prefix("cap="))
            .any(|v| same(v.as_bytes(), cap.as_bytes()))
    })
}

fn forbidden() -> ApiError {
    ApiError {
        status: StatusCode::FORBIDDEN,
        kind: "invalid_request_error",
        message: "this key may only read: placement, join tokens and requests need the admin key"
            .into(),
        param: None,
        code: Some("insufficient_scope"),
    }
}

fn unsupported_media(given: &str) -> ApiError {
    ApiError {
        status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
        kind: "invalid_request_error",
        message: format!("request bodies must be application/json, not '{given}'"),
        param: None,
        code: Some("unsupported_media_type"),
    }
}

/// A body of another type than JSON is refused before any handler reads it
/// (no `Content-Type` at all is taken as JSON: no browser form sends that).
fn json_only(request: &Request) -> Result<(), ApiError> {
    let Some(ty) = request.headers().get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let ty = ty.to_str().unwrap_or("(not text)");
    let essence = ty.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(unsupported_media(ty))
    }
}

/// The request's `Origin` when `--allow-origin` lists it.
fn allowed_origin(shared: &Shared, request: &Request) -> Option<HeaderValue> {
    let origin = request.headers().get(header::ORIGIN)?;
    let text = origin.to_str().ok()?;
    shared
        .opts
        .allow_origins
        .iter()
        .any(|o| o == text)
        .then(|| origin.clone())
}

pub async fn admit(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let origin = allowed_origin(&shared, &request);
    // A preflight carries no credentials; it is answered only for allowed origins.
    if request.method() == Method::OPTIONS
        && let Some(origin) = &origin
    {
        let mut r = Response::new(axum::body::Body::empty());
        *r.status_mut() = StatusCode::NO_CONTENT;
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, DELETE"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        h.insert(header::VARY, HeaderValue::from_static("origin"));
        return r;
    }
    // Recorded once answered: a request that showed a key, or was refused
    // for its key. The key itself never reaches the log.
    let audit = shared.opts.api_key.is_some().then(|| {
        (
            scope_of(&shared, &request),
            request.headers().contains_key(header::AUTHORIZATION),
            request.method().to_string(),
            route_class(request.uri().path()),
        )
    });
    let mut response = match checked(&shared, request, next).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    if let Some((scope, presented, method, route)) = audit {
        let status = response.status();
        if presented || status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            shared.opts.audit.record(Event::ApiKey {
                scope: match scope {
                    Scope::Admin => "admin",
                    Scope::Read => "read",
                    Scope::None => "none",
                }
                .into(),
                method,
                route: route.into(),
                status: status.as_u16(),
            });
        }
    }
    if let Some(origin) = origin {
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(header::VARY, HeaderValue::from_static("origin"));
    }
    response
}

async fn checked(shared: &Shared, mut request: Request, next: Next) -> Result<Response, ApiError> {
    let scope = scope_of(shared, &request);
    let path = request.uri().path();
    let needs = if path.starts_with("/api/model/")
        && request.method() == Method::GET
        && has_model_cap(shared, &request)
    {
        Needs::Nothing
    } else {
        needs(request.method(), path)
    };
    match (needs, scope) {
        (Needs::Nothing, _) | (Needs::Read, Scope::Read | Scope::Admin) => {}
        (Needs::Admin, Scope::Admin) => {}
        (Needs::Admin, Scope::Read) => return Err(forbidden()),
        (_, Scope::None) => return Err(ApiError::unauthorized()),
    }
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        json_only(&request)?;
    }
    request.extensions_mut().insert(scope);
    Ok(next.run(request).await)
}

/// The scope a handler's request was admitted with (admin when the router
/// runs without this layer, as in unit tests of single handlers).
pub fn scope(extensions: &axum::http::Extensions) -> Scope {
    extensions.get::<Scope>().copied().unwrap_or(Scope::Admin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_data_free_pages_are_open_and_unknown_routes_need_the_admin_key() {
        let get = Method::GET;
        for p in ["/", "/join", "/join/cost", "/healthz", "/pkg/cairn_web.js"] {
            assert_eq!(needs(&get, p), Needs::Nothing, "{p}");
        }
        for p in ["/api/cluster", "/api/events", "/metrics", "/v1/models"] {
            assert_eq!(needs(&get, p), Needs::Read, "{p}");
        }
        for (m, p) in [
            (Method::GET, "/api/join-qr.svg"),
            (Method::GET, "/api/tokens"),
            (Method::GET, "/api/model/x.gguf"),
            (Method::GET, "/api/tags"),
            (Method::POST, "/api/placement"),
            (Method::DELETE, "/api/placement"),
            (Method::POST, "/v1/chat/completions"),
            (Method::POST, "/api/chat"),
            (Method::POST, "/healthz"),
        ] {
            assert_eq!(needs(&m, p), Needs::Admin, "{m} {p}");
        }
    }

    #[test]
    fn the_audit_log_sees_route_kinds_not_paths() {
        assert_eq!(route_class("/v1/chat/completions"), "inference");
        assert_eq!(route_class("/api/tokens/abc123"), "tokens");
        assert_eq!(route_class("/api/model/secret-name.gguf"), "model_file");
        assert_eq!(route_class("/api/placement/preview"), "placement");
        assert_eq!(route_class("/nope"), "other");
    }

    #[test]
    fn keys_compare_whole() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"ab"));
        assert!(!same(b"", b"a"));
    }
}
