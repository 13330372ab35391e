//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::bodies::Invalid;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn model_not_found(model: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "the model '{model}' does not exist here; this cluster serves '{served}'"
            ),
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            message: "missing or wrong API key: send 'Authorization: Bearer <key>'".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some("no_placement"),
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<Invalid> for ApiError {
    fn from(e: Invalid) -> ApiError {
        ApiError::invalid(e.message, e.param)
    }
}
