//! `hrm serve`: the HTTP inference service (specification: `shared/spec/inference-service.md`).
//!
//! This crate will own the v1 contract (`/generate`, `/loglikelihood`, `/healthz`, `/readyz`,
//! `/metrics`), the OpenAI-compatible `/v1/completions` and tokenizer routes for
//! lm-evaluation-harness, request validation, the continuous-batching scheduler that drives
//! `hrm_model::Engine`, authentication, CORS, configuration and graceful shutdown.
//!
//! Status: an empty shell. The service lands with its own issue; the engine it drives is in
//! `hrm-model` and already usable through `hrm generate` and `hrm score`.
