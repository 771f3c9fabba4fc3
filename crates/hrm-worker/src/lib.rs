//! `hrm worker`: the volunteer client of the training network.
//!
//! This crate will own the client configuration file, the fetch–train–upload loop with its
//! IDLE / TRAINING / UPLOADING states, reconnection, gradient compression, resource limits and
//! the terminal interface.
//!
//! Status: an empty shell; it lands with its own issue.
