//! The one error shape of both servers, OpenAI style:
//! `{"error": {"message", "type", "param", "code"}}` with the HTTP status that goes with it.
//!
//! `type` follows from the status (400, 413 and 422 are `invalid_request_error`, 401
//! `authentication_error`, 403 `permission_error`, 404 `not_found_error`, 409 `conflict_error`,
//! 429 `rate_limit_error`, 5xx `server_error`); `code` is stable and machine-readable; `param`
//! names the request field at fault when there is one. Each server lists its codes in its
//! documentation.
//!
//! Internal faults are logged with their cause and answered with a generic message: what a
//! database or object store says about itself (paths, hosts, queries) never reaches a client.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// Stable, machine-readable (`invalid_value`, `queue_full`, `lease_lost`, ...).
    pub code: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// Seconds, sent as `Retry-After` (429 and 503).
    pub retry_after: Option<u64>,
}

/// The body every error is answered with (also its schema in the servers' OpenAPI documents).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail<'a> {
    /// For people.
    pub message: &'a str,
    /// Follows from the HTTP status (`invalid_request_error`, `rate_limit_error`, ...).
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// The request field at fault, when there is one.
    pub param: Option<&'a str>,
    /// Stable and machine-readable; each server documents its codes.
    pub code: &'a str,
}

impl ApiError {
    /// The body this error is answered with (also sent as a streamed response's last event).
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }

    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    /// The `type` of the body, from the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            409 => "conflict_error",
            429 => "rate_limit_error",
            500.. => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// Names the request field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Asks the client to wait this many seconds (`Retry-After`).
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }

    /// 400: a request that breaks a rule; `code` says which.
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 400 `invalid_value`: a field outside what it allows.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::invalid("invalid_value", message).with_param(param)
    }

    /// 422: a well-formed request whose content cannot be processed.
    pub fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }

    /// 401 `invalid_api_key`: the bearer key is missing or unknown.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_api_key", message)
    }

    /// 403: a known caller that may not do this.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    /// 409: the request conflicts with the current state.
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }

    /// 413 `body_too_large`, naming the limit when it is known.
    pub fn too_large(limit: Option<u64>) -> Self {
        let message = match limit {
            Some(limit) => format!("the request body is larger than the limit of {limit} bytes"),
            None => "the request body is larger than the server's limit".to_string(),
        };
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", message)
    }

    /// 429 with `Retry-After`.
    pub fn too_many(code: &'static str, message: impl Into<String>, retry_after: u64) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, code, message).with_retry_after(retry_after)
    }

    /// 503: not able to serve this now (loading, no model, overloaded).
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
    }

    /// 500 `internal_error`. `cause` goes to the log; the client gets a generic message.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal error; the server's log has the details",
        )
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        Self::internal(format!("{e:#}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// A body that is not JSON of the expected shape is a 422 `invalid_json` naming the problem;
/// one over the body limit is a 413.
impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match &rejection {
            JsonRejection::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::too_large(None)
            }
            JsonRejection::BytesRejection(_) => Self::new(
                StatusCode::BAD_REQUEST,
                "body_unreadable",
                "the request body could not be read (the client stopped or was too slow)",
            ),
            JsonRejection::MissingJsonContentType(_) => Self::unprocessable(
                "invalid_json",
                "expected a JSON body with the header Content-Type: application/json",
            ),
            _ => Self::unprocessable("invalid_json", rejection.body_text()),
        }
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::invalid("invalid_path", rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        Self::invalid("invalid_query", rejection.body_text())
    }
}

/// `axum::Json` whose rejection is an [`ApiError`].
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> ApiResult<Self> {
        let axum::Json(value) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Self(value))
    }
}

/// `axum::extract::Path` whose rejection is an [`ApiError`].
pub struct PathParam<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for PathParam<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> ApiResult<Self> {
        let axum::extract::Path(value) =
            axum::extract::Path::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

/// `axum::extract::Query` whose rejection is an [`ApiError`].
pub struct QueryParams<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> ApiResult<Self> {
        let axum::extract::Query(value) =
            axum::extract::Query::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(e: ApiError) -> (StatusCode, Option<String>, serde_json::Value) {
        let response = e.into_response();
        let status = response.status();
        let retry = response
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, retry, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn the_body_carries_type_from_the_status_and_retry_after() {
        let (status, retry, body) =
            body_of(ApiError::too_many("queue_full", "the queue is full", 3)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(retry.as_deref(), Some("3"));
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["code"], "queue_full");
        assert_eq!(body["error"]["param"], serde_json::Value::Null);

        let (status, _, body) = body_of(ApiError::invalid_param("top_p", "too big")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["code"], "invalid_value");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }

    #[tokio::test]
    async fn internal_errors_do_not_reach_the_client() {
        let cause = anyhow::anyhow!("reading /srv/secret/hub.db: permission denied");
        let (status, _, body) = body_of(ApiError::from(cause)).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        let message = body["error"]["message"].as_str().unwrap();
        assert!(!message.contains("/srv/secret"), "{message}");
        assert_eq!(body["error"]["code"], "internal_error");
        assert_eq!(body["error"]["type"], "server_error");
    }
}
