//! The error type of the model crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Candle(#[from] candle_core::Error),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid model config {path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("unsupported checkpoint at {path}: {message}")]
    Unsupported { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("device: {0}")]
    Device(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
