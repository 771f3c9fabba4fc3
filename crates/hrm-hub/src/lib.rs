//! `hrm hub`: the aggregation server of the volunteer training network
//! (specification: `shared/spec/training-network.md`).
//!
//! This crate will own the model registry, batch leases, gradient validation, aggregation
//! (FedAvg with outer optimisers, Krum, trimmed mean, median), worker trust and the live
//! status feed, with all workflow state in the database (SQLite or PostgreSQL).
//!
//! Status: an empty shell; it lands with its own issue.
