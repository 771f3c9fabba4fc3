//! `hrm worker`: the volunteer client of the training network.
//!
//! It owns the client configuration file ([`config`]), the resources a volunteer lends
//! ([`resources`]), the checkpoint cache ([`cache`]), update compression with error feedback ([`compress`]), the
//! fetch–train–upload loop with its IDLE / TRAINING / UPLOADING states ([`session`]), the hub's
//! live status feed ([`network`]), the shared view of all this ([`status`]) and the terminal
//! interface that draws it ([`tui`]). See docs/worker.md.

pub mod cache;
pub mod compress;
pub mod config;
pub mod network;
pub mod resources;
pub mod session;
pub mod status;
pub mod tui;

pub use session::{SessionEnd, Settings, Worker};
pub use status::{Status, View, WorkerState};
