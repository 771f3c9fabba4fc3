//! The wire protocol of the training network: the request and response types of the hub's
//! `/api/v1` REST and WebSocket interface, shared by `hrm-hub` and `hrm-worker`, and the small
//! HTTP client the worker and the hub's tests use.
//!
//! Status: an empty shell; it lands with the hub.
