//! HTTP plumbing that `hrm serve` and `hrm hub` share, so that a reader learns it once:
//!
//! * [`error`]: the one error body, `{"error": {"message", "type", "param", "code"}}`, the
//!   [`ApiError`] that converts into it, and extractors whose rejections use it;
//! * [`server`]: the accept loop with the connection hygiene every public server needs
//!   (header and body read timeouts, an idle timeout, a connection cap, and a graceful drain
//!   with a deadline on SIGTERM or Ctrl-C);
//! * [`limit`]: keyed rate limits (per IP address, per worker) that forget idle keys.
//!
//! Invariants: nothing here reads a request body without a bound, and no internal error
//! message reaches a client (it is logged; the client gets a generic message).

pub mod error;
pub mod limit;
pub mod server;

pub use error::{ApiError, ApiResult, ErrorBody, JsonBody, PathParam, QueryParams};
pub use limit::KeyedLimit;
pub use server::{ConnectionArgs, ConnectionLimits, serve, shutdown_signal};
