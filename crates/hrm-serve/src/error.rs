//! The one error shape of the service, OpenAI style:
//! `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that goes with it.
//! The table of every status and type is in `docs/api.md`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: &'static str,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

impl ApiError {
    /// 400: a value outside what the field allows.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.to_string()),
            code: "invalid_value",
        }
    }

    /// 422: a body that is not JSON of the request's schema.
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: "invalid_json",
        }
    }

    /// 413: a body over the size limit (`--max-body-bytes`).
    pub fn too_large() -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            message: "the request body is larger than the server's limit (--max-body-bytes)".into(),
            param: None,
            code: "body_too_large",
        }
    }

    /// 401: auth is on and the bearer token is missing or wrong.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            message: "missing or invalid bearer token in the Authorization header".into(),
            param: None,
            code: "invalid_api_key",
        }
    }

    /// 429: backpressure is on and the request queue is full.
    pub fn queue_full(capacity: usize) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            message: format!("the request queue is full ({capacity} waiting); retry later"),
            param: None,
            code: "queue_full",
        }
    }

    /// 503: the model is still loading.
    pub fn not_ready() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: "the model is still loading; see /readyz".into(),
            param: None,
            code: "not_ready",
        }
    }

    /// 404: no such route, or no such model.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: "not_found",
        }
    }

    /// 500: a fault of ours. The details go to the log; the client gets the message only.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: "internal_error",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

impl From<axum::extract::rejection::JsonRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::JsonRejection) -> Self {
        use axum::extract::rejection::JsonRejection as R;
        match &rejection {
            R::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::too_large()
            }
            R::MissingJsonContentType(_) => Self::unprocessable(
                "expected a JSON body with the header Content-Type: application/json",
            ),
            _ => Self::unprocessable(rejection.body_text()),
        }
    }
}
