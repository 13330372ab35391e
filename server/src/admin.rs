//! `POST /admin/revoke`: revokes a token by id on a running server. The
//! caller proves it holds the secret with a short-lived `admin` token in
//! `Authorization: Bearer`; `cairn-signal revoke` does exactly that.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tracing::info;

use crate::client::{ClientError, Endpoint, ServerTrust, open};
use crate::server::AppState;
use crate::token::{Claims, Role, Secret, issue, verify};

/// Longest token id the endpoint accepts.
const MAX_ID_CHARS: usize = 128;

#[derive(Debug, Serialize, Deserialize)]
pub struct RevokeRequest {
    pub id: String,
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeResponse {
    pub id: String,
    /// Live sessions that were dropped.
    pub dropped: usize,
}

pub(crate) async fn revoke_handler(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(bearer) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return (StatusCode::UNAUTHORIZED, "missing bearer token").into_response();
    };
    let claims = match verify(&app.secret, bearer.trim()) {
        Ok(claims) => claims,
        Err(error) => return (StatusCode::UNAUTHORIZED, error.to_string()).into_response(),
    };
    if claims.role != Role::Admin || app.hub.is_revoked(&claims.jti) {
        return (StatusCode::FORBIDDEN, "admin token required").into_response();
    }
    let request: RevokeRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(_) => return (StatusCode::BAD_REQUEST, "expected {\"id\": TOKEN_ID}").into_response(),
    };
    if request.id.is_empty() || request.id.len() > MAX_ID_CHARS {
        return (StatusCode::BAD_REQUEST, "invalid token id").into_response();
    }
    let dropped = app.hub.revoke(&request.id);
    info!(token_id = %request.id, dropped, admin_token = %claims.jti, "token revoked");
    Json(RevokeResponse {
        id: request.id,
        dropped,
    })
    .into_response()
}

/// Revokes token `token_id` on the server at `url` (`http(s)://` or
/// `ws(s)://`), signing a one-minute admin token with `secret`.
pub async fn revoke_remote(
    url: &str,
    secret: &Secret,
    token_id: &str,
    trust: &ServerTrust,
) -> Result<RevokeResponse, ClientError> {
    let endpoint = Endpoint::parse(url)?;
    let admin = issue(
        secret,
        &Claims::new("admin", Role::Admin, Duration::from_secs(60)),
    );
    let body = serde_json::to_vec(&RevokeRequest {
        id: token_id.to_owned(),
    })
    .map_err(|e| ClientError::Protocol(e.to_string()))?;
    let exchange = async {
        let stream = open(&endpoint, trust).await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        tokio::spawn(connection);
        let request = Request::post(format!("{}/admin/revoke", endpoint.prefix))
            .header(header::HOST, endpoint.authority.as_str())
            .header(header::AUTHORIZATION, format!("Bearer {admin}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(ClientError::Refused {
                status: status.as_u16(),
                reason: String::from_utf8_lossy(&bytes).trim().to_owned(),
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Protocol(e.to_string()))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| ClientError::Timeout)?
}
