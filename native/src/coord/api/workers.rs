//! `/api/workers/{id}/approve|reject`: the admin's decision on a worker
//! that waits for approval (`cairn serve --approve-workers`).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use cairn_signal::protocol::PeerId;
use serde_json::{Value, json};

use super::ApiError;
use crate::coord::Shared;

fn decide(shared: &Shared, id: String, approved: bool) -> Result<Json<Value>, ApiError> {
    if !shared.opts.approve_workers {
        return Err(ApiError::not_found(
            "this coordinator places workers without approval (start it with --approve-workers)",
        ));
    }
    let peer = PeerId(id);
    if !shared.decide_worker(&peer, approved) {
        return Err(ApiError::not_found(format!(
            "no worker '{peer}' waits for approval"
        )));
    }
    Ok(Json(
        json!({ "peer_id": peer.to_string(), "approved": approved }),
    ))
}

pub async fn approve(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    decide(&shared, id, true)
}

pub async fn reject(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    decide(&shared, id, false)
}
