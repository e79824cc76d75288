//! The error answer of every route of `casfs serve` (`{"error": {"kind": ...,
//! "message": ...}}`, [`ApiError`]), its kinds for the store's and the middleware's
//! errors, and how the API renders a value as JSON ([`to_json`]).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::checkpoint::CheckpointError;
use crate::middleware::error::MiddlewareError;

/// An error answer: `{"error": {"kind": ..., "message": ...}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    pub(super) fn new(
        status: StatusCode,
        kind: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
        }
    }

    pub(super) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({"error": {"kind": self.kind, "message": self.message}})),
        )
            .into_response()
    }
}

impl From<MiddlewareError> for ApiError {
    fn from(e: MiddlewareError) -> ApiError {
        use MiddlewareError as M;
        let (status, kind) = match &e {
            M::Config(_) => (StatusCode::BAD_REQUEST, "invalid"),
            M::Checkpoint(c) => return checkpoint_error(c, e.to_string()),
            M::HeadMissing { .. } => (StatusCode::CONFLICT, "head_missing"),
            M::WorkspaceMismatch { .. } => (StatusCode::CONFLICT, "workspace_mismatch"),
            M::Sandbox { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "sandbox"),
            M::SandboxBusy { .. } => (StatusCode::CONFLICT, "sandbox_busy"),
            M::SandboxBehind { .. } => (StatusCode::CONFLICT, "head_mismatch"),
            M::TenantAtCapacity { .. } => (StatusCode::TOO_MANY_REQUESTS, "too_many_sandboxes"),
            M::AtCapacity { what, .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                if *what == "runs" {
                    "too_many_runs"
                } else {
                    "too_many_sandboxes"
                },
            ),
            M::Policy(_) => (StatusCode::UNPROCESSABLE_ENTITY, "policy"),
            M::Persistence(_) => (StatusCode::INTERNAL_SERVER_ERROR, "persistence"),
            M::Cancelled(_) => (StatusCode::CONFLICT, "cancelled"),
        };
        ApiError::new(status, kind, e.to_string())
    }
}

impl From<CheckpointError> for ApiError {
    fn from(e: CheckpointError) -> ApiError {
        let m = e.to_string();
        checkpoint_error(&e, m)
    }
}

fn checkpoint_error(e: &CheckpointError, message: String) -> ApiError {
    use CheckpointError as C;
    let (status, kind) = match e {
        C::NotFound(_) | C::EmptyThread(_) => (StatusCode::NOT_FOUND, "not_found"),
        C::LeaseHeld { .. } => (StatusCode::CONFLICT, "lease_held"),
        C::LeaseLost { .. } => (StatusCode::CONFLICT, "lease_lost"),
        C::LeaseExpired { .. } => (StatusCode::CONFLICT, "lease_expired"),
        C::HeadMismatch { .. } => (StatusCode::CONFLICT, "head_mismatch"),
        C::ThreadExists(_) => (StatusCode::CONFLICT, "thread_exists"),
        C::Invalid(_) | C::Ambiguous { .. } => (StatusCode::BAD_REQUEST, "invalid"),
        C::Refused(_) => (StatusCode::UNPROCESSABLE_ENTITY, "policy"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    };
    ApiError::new(status, kind, message)
}

pub(super) type ApiResult = Result<Json<Value>, ApiError>;

/// A value as the API shows it.
pub(super) fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("API values serialize")
}
