//! The client configuration file (YAML, exactly the specification's keys) and the flags and
//! environment variables that override it.
//!
//! Precedence: flag > environment > file, layered by `hrm_settings` (each flag's id is its key
//! in the file). Only the first run writes the file (with a fresh API key, mode 0600); overrides
//! are never written back.

use anyhow::{Context, Result, bail};
use clap::{ArgMatches, Args};
use hrm_settings::SettingsFile;
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

/// What loading found: the settings (the file's, or the first-run ones it was just written
/// with, under the flags) and whether the file was created now.
pub struct Loaded {
    pub config: WorkerConfig,
    pub created: bool,
}

/// Reads the configuration file, or writes the first-run one (mode 0600) when there is none,
/// with the flags and environment variables that clap parsed into `overrides` over it.
pub fn load(
    path: &Path,
    first_run_url: &str,
    overrides: &ConfigOverrides,
    matches: &ArgMatches,
) -> Result<Loaded> {
    let created = !path.exists();
    if created {
        write_private(path, &WorkerConfig::first_run(first_run_url))?;
    } else {
        warn_if_readable_by_others(path);
    }
    let file = SettingsFile::read(path, None)?;
    let config = hrm_settings::layered_into(overrides, matches, &file, &[])
        .with_context(|| format!("reading the worker configuration {}", path.display()))?;
    Ok(Loaded { config, created })
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

/// Flags and environment variables over the file's settings; each flag's id is its key there.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct ConfigOverrides {
    #[command(flatten)]
    pub server: ServerOverrides,
    #[command(flatten)]
    pub training: TrainingOverrides,
    #[command(flatten)]
    pub uploads: UploadsOverrides,
}

#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct ServerOverrides {
    /// Hub base address (server.url); also the address written on first run.
    #[arg(id = "server.url", long = "server-url", env = "HRM_WORKER_SERVER_URL")]
    pub url: Option<String>,
    /// API key (server.api_key); prefer the file, which only its owner can read.
    #[arg(
        id = "server.api_key",
        long = "api-key",
        env = "HRM_WORKER_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
}

#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct TrainingOverrides {
    /// Rows per forward pass: `auto` or a number (training.batch_size).
    #[arg(
        id = "training.batch_size",
        long = "batch-size",
        env = "HRM_WORKER_BATCH_SIZE"
    )]
    pub batch_size: Option<BatchSize>,
    /// Batches before the session ends (training.max_batches_per_session).
    #[arg(
        id = "training.max_batches_per_session",
        long = "max-batches-per-session",
        env = "HRM_WORKER_MAX_BATCHES_PER_SESSION"
    )]
    pub max_batches_per_session: Option<u64>,
    /// Tries per request before the step counts as failed (training.retry_attempts).
    #[arg(
        id = "training.retry_attempts",
        long = "retry-attempts",
        env = "HRM_WORKER_RETRY_ATTEMPTS"
    )]
    pub retry_attempts: Option<u32>,
    /// Per-request timeout in seconds (training.timeout_seconds).
    #[arg(
        id = "training.timeout_seconds",
        long = "timeout-seconds",
        env = "HRM_WORKER_TIMEOUT_SECONDS"
    )]
    pub timeout_seconds: Option<u64>,
}

#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct UploadsOverrides {
    /// Send top-k sparsified updates (uploads.compress_gradients).
    #[arg(
        id = "uploads.compress_gradients",
        long = "compress-gradients",
        env = "HRM_WORKER_COMPRESS_GRADIENTS"
    )]
    pub compress_gradients: Option<bool>,
    /// Fraction of values kept when compressing (uploads.compression_ratio).
    #[arg(
        id = "uploads.compression_ratio",
        long = "compression-ratio",
        env = "HRM_WORKER_COMPRESSION_RATIO"
    )]
    pub compression_ratio: Option<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file at `path` under `hrm worker ARGV`'s flags.
    fn load_with(path: &Path, first_run_url: &str, argv: &[&str]) -> Result<Loaded> {
        use clap::FromArgMatches;
        let matches = ConfigOverrides::augment_args(clap::Command::new("worker"))
            .try_get_matches_from(std::iter::once("worker").chain(argv.iter().copied()))?;
        let overrides = ConfigOverrides::from_arg_matches(&matches)?;
        load(path, first_run_url, &overrides, &matches)
    }

    #[test]
    fn first_run_writes_exactly_the_spec_keys_with_a_private_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/worker.yaml");
        let first = load_with(&path, "http://hub.example:8090", &[]).unwrap();
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
        let second = load_with(&path, "http://elsewhere:1", &[]).unwrap();
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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("worker.yaml");
        let first = load_with(&path, "http://127.0.0.1:8090", &[])
            .unwrap()
            .config;
        let argv = [
            "--server-url",
            "http://other:9",
            "--compress-gradients",
            "true",
            "--batch-size",
            "4",
        ];
        let config = load_with(&path, "http://unused:1", &argv).unwrap().config;
        assert_eq!(config.server.url, "http://other:9");
        assert_eq!(
            config.server.api_key, first.server.api_key,
            "the file's key"
        );
        assert!(config.uploads.compress_gradients);
        assert_eq!(config.training.batch_size, BatchSize::Rows(4));
        assert_eq!(config.training.retry_attempts, 3);
        let reread = load_with(&path, "http://unused:1", &[]).unwrap().config;
        assert_eq!(reread, first, "overrides are never written back");
    }

    #[test]
    fn a_file_key_of_the_wrong_type_or_unknown_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("worker.yaml");
        let config = WorkerConfig::first_run("http://127.0.0.1:8090");
        let text = serde_norway::to_string(&config).unwrap();
        std::fs::write(
            &path,
            text.replace("retry_attempts: 3", "retry_attempts: often"),
        )
        .unwrap();
        let err = format!(
            "{:#}",
            load_with(&path, "http://unused:1", &[]).err().unwrap()
        );
        assert!(err.contains("retry_attempts"), "{err}");
        std::fs::write(&path, text.replace("uploads:", "uploads:\n  extra: 1")).unwrap();
        let err = format!(
            "{:#}",
            load_with(&path, "http://unused:1", &[]).err().unwrap()
        );
        assert!(err.contains("uploads.extra"), "{err}");
    }
}
