//! `/api/tokens`: the embedded signaling server's worker join tokens, for
//! the admin (`cairn token list|new|revoke` calls these).

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use serde_json::{Value, json};

use super::ApiError;
use super::bodies;
use crate::coord::Shared;
use crate::coord::join::{JoinError, JoinTokens};

fn tokens(shared: &Shared) -> Result<&Arc<JoinTokens>, ApiError> {
    shared.opts.join_tokens.as_ref().ok_or_else(|| {
        ApiError::not_found(
            "this coordinator issues no join tokens: it uses an outside signaling server \
             (issue and revoke them with cairn-signal)",
        )
    })
}

pub async fn list(State(shared): State<Arc<Shared>>) -> Result<Json<Value>, ApiError> {
    let t = tokens(&shared)?;
    Ok(Json(json!({ "tokens": t.list() })))
}

pub async fn issue(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let t = tokens(&shared)?;
    let ttl_s = bodies::token_ttl(&body)?;
    let (record, token) = t.issue(ttl_s.map(Duration::from_secs));
    Ok(Json(json!({
        "id": record.id,
        "role": record.role,
        "expires_at": record.expires_at,
        "token": token,
    })))
}

pub async fn revoke(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let t = tokens(&shared)?;
    match t.revoke(&id) {
        Ok(dropped) => Ok(Json(
            json!({ "id": id, "revoked": true, "dropped": dropped }),
        )),
        Err(e @ JoinError::Unknown(_)) => Err(ApiError::not_found(e.to_string())),
    }
}
