//! The coordinator's HTTP side: the OpenAI-compatible API, the cluster and
//! placement endpoints, metrics, the dashboard, the join page and the model
//! file workers fetch their shards from.

pub mod auth;
mod bodies;
mod cluster;
mod error;
mod ollama;
mod openai;
mod tokens;
mod web;
mod workers;

use std::sync::Arc;

use axum::Router;
use axum::middleware;
use axum::routing::{delete, get, post};

use super::Shared;
pub use cluster::cluster_json;
pub use error::ApiError;

/// Every route the coordinator serves. [`auth::admit`] stands before all of
/// them: a route it does not list as open or readable needs the admin key.
pub fn router(shared: Arc<Shared>) -> Router {
    web::log_source();
    let guarded = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/api/version", get(ollama::version))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route(
            "/api/placement",
            post(cluster::set_placement).delete(cluster::clear_placement),
        )
        .route("/api/tokens", get(tokens::list).post(tokens::issue))
        .route("/api/tokens/{id}", delete(tokens::revoke))
        .route("/api/workers/{id}/approve", post(workers::approve))
        .route("/api/workers/{id}/reject", post(workers::reject));
    let open = Router::new()
        .route("/healthz", get(cluster::health))
        .route("/api/cluster", get(cluster::cluster))
        .route("/api/events", get(cluster::events))
        .route("/api/placement", get(cluster::get_placement))
        .route("/api/placement/preview", get(cluster::preview))
        .route("/metrics", get(cluster::metrics))
        .route("/", get(web::dashboard))
        .route("/join", get(web::join_page))
        .route("/join/cost", get(web::join_cost))
        .route("/api/join-qr.svg", get(web::join_qr))
        .route("/api/model/{file}", get(web::model_file))
        .route("/pkg/{*path}", get(web::pkg));
    guarded
        .merge(open)
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(middleware::from_fn_with_state(shared.clone(), auth::admit))
        .with_state(shared)
}

/// Parses `body` as every JSON body the API takes (OpenAI chat and
/// completions, Ollama show, generate and chat, a placement, a join token)
/// and runs the checks that need no cluster: how many it is. For the garbage
/// tests (the fuzz target compiles `bodies.rs` alone): any bytes give a
/// count or errors, never a panic.
#[doc(hidden)]
pub fn parse_bodies(body: &[u8]) -> usize {
    bodies::parse_bodies(body)
}

#[cfg(test)]
mod garbage_tests {

    use super::parse_bodies;

    /// Bodies that parse, to mutate.
    const SEEDS: [&str; 4] = [
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"temperature":0.5,"stop":["x"],"stream":true}"#,
        r#"{"model":"m","prompt":["a","b"],"max_tokens":2,"seed":7,"top_p":0.9}"#,
        r#"{"model":"m","prompt":"p","options":{"num_predict":3,"temperature":0}}"#,
        r#"{"stages":[{"peer_id":"a","start":0,"end":15},{"peer_id":"b","start":15,"end":30}]}"#,
    ];

    #[test]
    fn the_seed_bodies_parse() {
        for s in SEEDS {
            assert!(parse_bodies(s.as_bytes()) >= 1, "{s}");
        }
    }

    #[test]
    fn random_and_mutated_bodies_never_panic() {
        for body in cairn_signal::garbage::bodies(&SEEDS, 20_000, 21) {
            let _ = parse_bodies(&body);
        }
        // Deep nesting is refused by serde_json's recursion limit, not a stack overflow.
        let deep = "[".repeat(100_000);
        assert_eq!(parse_bodies(deep.as_bytes()), 0);
    }
}
