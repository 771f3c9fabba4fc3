//! The wire protocol of the training network, shared by `hrm-hub` and `hrm-worker`: the request
//! and response bodies of the hub's `/api/v1` REST and WebSocket interface ([`messages`]), the
//! safetensors checkpoint and update files with the checks the hub applies to uploads
//! ([`update`]), the gzip JSON-lines batch files ([`samples`]), and a small typed HTTP client
//! ([`client`]).

#[cfg(feature = "client")]
pub mod client;
pub mod messages;
pub mod pow;
pub mod samples;
pub mod update;

#[cfg(feature = "client")]
pub use client::{ClientError, HubClient, install_tls_provider};
pub use messages::*;
pub use update::{Encoding, ParamSpec, Schema, UpdateError};
