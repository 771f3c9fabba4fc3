//! The client configuration file (YAML, exactly the specification's keys) and the flags and
//! environment variables that override it.
//!
//! Precedence: flag > environment > file > default. Only the first run writes the file (with a
//! fresh API key, mode 0600); overrides are never written back.

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Longest API key and username the hub accepts.
pub const MAX_KEY_CHARS: usize = 64;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub server: ServerSection,
    pub training: TrainingSection,
    pub uploads: UploadsSection,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    pub url: String,
    pub api_key: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSection {
    pub batch_size: BatchSize,
    pub max_batches_per_session: u64,
    pub retry_attempts: u32,
    pub timeout_seconds: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadsSection {
    pub compress_gradients: bool,
    pub compression_ratio: f32,
}

/// Rows per forward pass: `auto` fits them to the memory limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BatchSize {
    Auto,
    Rows(usize),
}

impl std::str::FromStr for BatchSize {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        if text.eq_ignore_ascii_case("auto") {
            return Ok(BatchSize::Auto);
        }
        match text.parse::<usize>() {
            Ok(rows) if rows > 0 => Ok(BatchSize::Rows(rows)),
            _ => Err(format!(
                "batch_size must be `auto` or a positive integer, not {text:?}"
            )),
        }
    }
}

impl Serialize for BatchSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            BatchSize::Auto => s.serialize_str("auto"),
            BatchSize::Rows(rows) => s.serialize_u64(*rows as u64),
        }
    }
}

impl<'de> Deserialize<'de> for BatchSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => format!("{n}"),
            Raw::Text(t) => t,
        }
        .parse()
        .map_err(serde::de::Error::custom)
    }
}

impl WorkerConfig {
    /// The first-run configuration, with a freshly generated API key.
    pub fn first_run(url: &str) -> Self {
        WorkerConfig {
            server: ServerSection {
                url: url.to_string(),
                api_key: generate_api_key(),
            },
            training: TrainingSection {
                batch_size: BatchSize::Auto,
                max_batches_per_session: 100,
                retry_attempts: 3,
                timeout_seconds: 300,
            },
            uploads: UploadsSection {
                compress_gradients: false,
                compression_ratio: 0.1,
            },
        }
    }

    /// Every rule on the settings, each with its own message.
    pub fn validate(&self) -> Result<()> {
        reqwest::Url::parse(&self.server.url)
            .with_context(|| format!("server.url {:?} is not a URL", self.server.url))?;
        let key_chars = self.server.api_key.chars().count();
        if key_chars == 0 || key_chars > MAX_KEY_CHARS {
            bail!("server.api_key must be 1 to {MAX_KEY_CHARS} characters, not {key_chars}");
        }
        if self.training.max_batches_per_session == 0 {
            bail!("training.max_batches_per_session must be at least 1");
        }
        if self.training.timeout_seconds == 0 {
            bail!("training.timeout_seconds must be at least 1");
        }
        let ratio = self.uploads.compression_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            bail!("uploads.compression_ratio must be in (0, 1], not {ratio}");
        }
        Ok(())
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.training.timeout_seconds)
    }
}

/// 64 hex characters from the OS's random source: the hub's longest key.
pub fn generate_api_key() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// `$XDG_CONFIG_HOME/hrm/worker.yaml`, else `~/.config/hrm/worker.yaml`.
pub fn default_config_path() -> PathBuf {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("hrm").join("worker.yaml")
}

/// What loading found: the file as read (or as first written) and whether it was created now.
pub struct Loaded {
    pub config: WorkerConfig,
    pub created: bool,
}

/// Reads the configuration file, or writes the first-run one (mode 0600) when there is none.
pub fn load_or_create(path: &Path, first_run_url: &str) -> Result<Loaded> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let config: WorkerConfig = serde_norway::from_str(&text)
                .with_context(|| format!("reading the worker configuration {}", path.display()))?;
            warn_if_readable_by_others(path);
            Ok(Loaded {
                config,
                created: false,
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let config = WorkerConfig::first_run(first_run_url);
            write_private(path, &config)?;
            Ok(Loaded {
                config,
                created: true,
            })
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Writes the file readable by its owner only: it holds the API key.
fn write_private(path: &Path, config: &WorkerConfig) -> Result<()> {
    use std::io::Write;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = format!(
        "# hrm worker configuration (written on first run; the API key identifies this worker)\n{}",
        serde_norway::to_string(config)?
    );
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    Ok(())
}

fn warn_if_readable_by_others(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path)
            && meta.permissions().mode() & 0o077 != 0
        {
            tracing::warn!(
                path = %path.display(),
                "the worker configuration holds an API key but others can read it; run chmod 600 on it"
            );
        }
    }
}

/// Flags and environment variables over the file's settings.
#[derive(Debug, Clone, Default, Args)]
pub struct ConfigOverrides {
    /// Hub base address (server.url); also the address written on first run.
    #[arg(long, env = "HRM_WORKER_SERVER_URL")]
    pub server_url: Option<String>,
    /// API key (server.api_key); prefer the file, which only its owner can read.
    #[arg(long, env = "HRM_WORKER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Rows per forward pass: `auto` or a number (training.batch_size).
    #[arg(long, env = "HRM_WORKER_BATCH_SIZE")]
    pub batch_size: Option<BatchSize>,
    /// Batches before the session ends (training.max_batches_per_session).
    #[arg(long, env = "HRM_WORKER_MAX_BATCHES_PER_SESSION")]
    pub max_batches_per_session: Option<u64>,
    /// Tries per request before the step counts as failed (training.retry_attempts).
    #[arg(long, env = "HRM_WORKER_RETRY_ATTEMPTS")]
    pub retry_attempts: Option<u32>,
    /// Per-request timeout in seconds (training.timeout_seconds).
    #[arg(long, env = "HRM_WORKER_TIMEOUT_SECONDS")]
    pub timeout_seconds: Option<u64>,
    /// Send top-k sparsified updates (uploads.compress_gradients).
    #[arg(long, env = "HRM_WORKER_COMPRESS_GRADIENTS")]
    pub compress_gradients: Option<bool>,
    /// Fraction of values kept when compressing (uploads.compression_ratio).
    #[arg(long, env = "HRM_WORKER_COMPRESSION_RATIO")]
    pub compression_ratio: Option<f32>,
}

impl ConfigOverrides {
    pub fn apply(&self, config: &mut WorkerConfig) {
        if let Some(v) = &self.server_url {
            config.server.url = v.clone();
        }
        if let Some(v) = &self.api_key {
            config.server.api_key = v.clone();
        }
        if let Some(v) = self.batch_size {
            config.training.batch_size = v;
        }
        if let Some(v) = self.max_batches_per_session {
            config.training.max_batches_per_session = v;
        }
        if let Some(v) = self.retry_attempts {
            config.training.retry_attempts = v;
        }
        if let Some(v) = self.timeout_seconds {
            config.training.timeout_seconds = v;
        }
        if let Some(v) = self.compress_gradients {
            config.uploads.compress_gradients = v;
        }
        if let Some(v) = self.compression_ratio {
            config.uploads.compression_ratio = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_run_writes_exactly_the_spec_keys_with_a_private_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/worker.yaml");
        let first = load_or_create(&path, "http://hub.example:8090").unwrap();
        assert!(first.created);
        let key = &first.config.server.api_key;
        assert_eq!(key.len(), MAX_KEY_CHARS);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let yaml: serde_norway::Value =
            serde_norway::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut keys = Vec::new();
        for (section, body) in yaml.as_mapping().unwrap() {
            for (key, _) in body.as_mapping().unwrap() {
                keys.push(format!(
                    "{}.{}",
                    section.as_str().unwrap(),
                    key.as_str().unwrap()
                ));
            }
        }
        keys.sort();
        assert_eq!(
            keys,
            [
                "server.api_key",
                "server.url",
                "training.batch_size",
                "training.max_batches_per_session",
                "training.retry_attempts",
                "training.timeout_seconds",
                "uploads.compress_gradients",
                "uploads.compression_ratio",
            ]
        );
        // The second run reads the same key back and writes nothing.
        let second = load_or_create(&path, "http://elsewhere:1").unwrap();
        assert!(!second.created);
        assert_eq!(second.config, first.config);
    }

    #[test]
    fn batch_size_reads_auto_or_a_positive_number() {
        let parse = |text: &str| serde_norway::from_str::<BatchSize>(text);
        assert_eq!(parse("auto").unwrap(), BatchSize::Auto);
        assert_eq!(parse("16").unwrap(), BatchSize::Rows(16));
        assert!(parse("0").is_err());
        assert!(parse("lots").is_err());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        let mut config = WorkerConfig::first_run("http://127.0.0.1:8090");
        let text = serde_norway::to_string(&config)
            .unwrap()
            .replace("uploads:", "uploads:\n  extra: 1");
        assert!(serde_norway::from_str::<WorkerConfig>(&text).is_err());
        config.uploads.compression_ratio = 0.0;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("compression_ratio")
        );
        config.uploads.compression_ratio = 0.1;
        config.server.api_key = "k".repeat(65);
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("api_key")
        );
        config.server.api_key = "key".into();
        config.server.url = "not a url".into();
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("server.url")
        );
    }

    #[test]
    fn overrides_win_over_the_file() {
        let mut config = WorkerConfig::first_run("http://127.0.0.1:8090");
        ConfigOverrides {
            server_url: Some("http://other:9".into()),
            compress_gradients: Some(true),
            batch_size: Some(BatchSize::Rows(4)),
            ..Default::default()
        }
        .apply(&mut config);
        assert_eq!(config.server.url, "http://other:9");
        assert!(config.uploads.compress_gradients);
        assert_eq!(config.training.batch_size, BatchSize::Rows(4));
        assert_eq!(config.training.retry_attempts, 3);
    }
}
