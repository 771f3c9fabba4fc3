//! `hrm serve` settings: command-line flags, then environment variables, then the `serve:`
//! section of a YAML file, then defaults (highest first), layered by `hrm_settings`.
//!
//! The YAML file is `--config PATH` (or `HRM_SERVE_CONFIG`); without either, `./hrm.yaml` is read
//! when it exists. `--print-config` prints the effective settings with secrets redacted.
//! Environment variables are the specification's (`HRM_MODEL_PATH`, `HRM_TOKENIZER_PATH`,
//! `HRM_DEVICE`, `HRM_MAX_BATCH_SIZE`, `HRM_MAX_NEW_TOKENS`, `HRM_CORS_ORIGINS`) and, for the
//! rest, `HRM_SERVE_*`: no variable of `hrm worker` (`HRM_WORKER_*`) or `hrm hub`
//! (`HRM_HUB_*`) means anything here.

use std::path::{Path, PathBuf};

use clap::{ArgMatches, Args};
use hrm_model::DeviceRequest;
use hrm_settings::SettingsFile;
use serde::{Deserialize, Serialize};

use crate::validation::Limits;

/// The flags of `hrm serve`, which are also the keys of the YAML file's `serve:` section.
/// Every value is optional here; [`ServeConfig::resolve`] fills in the defaults.
#[derive(Args, Debug, Default, Clone, Serialize, Deserialize)]
pub struct ServeArgs {
    /// YAML file whose `serve:` section supplies defaults (default: ./hrm.yaml if present).
    #[arg(long, env = "HRM_SERVE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to bind (default 0.0.0.0).
    #[arg(long)]
    pub host: Option<String>,
    /// Port to bind (default 8000).
    #[arg(long)]
    pub port: Option<u16>,
    /// Checkpoint directory or .gguf file (default models/sample).
    #[arg(long, env = "HRM_MODEL_PATH")]
    pub model_path: Option<PathBuf>,
    /// tokenizer.json overriding the checkpoint's own.
    #[arg(long, env = "HRM_TOKENIZER_PATH")]
    pub tokenizer_path: Option<PathBuf>,
    /// Jinja chat template for /v1/chat/completions, overriding the model's own (default: the
    /// GGUF's or tokenizer_config.json's, if any).
    #[arg(long, env = "HRM_SERVE_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// cpu, cuda or mps (default: auto-detect).
    #[arg(long, env = "HRM_DEVICE")]
    pub device: Option<DeviceRequest>,
    /// Sequences decoded together (default 16).
    #[arg(long, env = "HRM_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<usize>,
    /// Cap on max_tokens per request (default 1024).
    #[arg(long, env = "HRM_MAX_NEW_TOKENS")]
    pub max_new_tokens: Option<usize>,
    /// Context window in tokens (default: the model's max_position_embeddings).
    #[arg(long)]
    pub context_window: Option<usize>,
    /// Tokens of admitted, unfinished work (prompts plus the most they may generate, or the
    /// tokens scored) (default 1048576).
    #[arg(long, env = "HRM_SERVE_MAX_QUEUED_TOKENS")]
    pub max_queued_tokens: Option<usize>,
    /// Beyond --max-queued-tokens, answer 429 with Retry-After (default true); false makes
    /// requests wait instead.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub backpressure: Option<bool>,
    /// Tokens one request may need: its prompts plus the most it may generate, or the tokens it
    /// scores (default 262144).
    #[arg(long, env = "HRM_SERVE_MAX_REQUEST_TOKENS")]
    pub max_request_tokens: Option<usize>,
    /// Log-probability entries one request may return (default 262144).
    #[arg(long, env = "HRM_SERVE_MAX_LOGPROB_ENTRIES")]
    pub max_logprob_entries: Option<usize>,
    /// The most tokens scored between two decode steps (default 2048); chunks are also cut to
    /// about 0.1 s of work, so that scoring never holds up generation for long.
    #[arg(long, env = "HRM_SERVE_SCORE_CHUNK_TOKENS")]
    pub score_chunk_tokens: Option<usize>,
    /// Largest accepted request body in bytes (default 4 MiB).
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Log level: error, warn, info, debug, trace (default info, or a logging config file).
    #[arg(long)]
    pub log_level: Option<String>,
    /// Require `Authorization: Bearer KEY` on every route but the health checks.
    #[arg(long, env = "HRM_SERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Read the bearer key from this file (first line) instead.
    #[arg(long, env = "HRM_SERVE_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Also require the key on /metrics (open by default, for scrapers).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub metrics_auth: Option<bool>,
    /// Answer cross-origin requests from --cors-origins (off by default).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub enable_cors: Option<bool>,
    /// Allowed origins, comma-separated; `*` allows any (for development only).
    #[arg(long, env = "HRM_CORS_ORIGINS", value_delimiter = ',')]
    pub cors_origins: Option<Vec<String>>,
    /// Also serve the manual-test page at /ui.
    #[arg(long)]
    pub ui: bool,
    /// Print the effective configuration (secrets redacted) and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Load the model and tokenizer, report, and exit without listening.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    #[serde(flatten)]
    pub connections: hrm_http::ConnectionArgs,
}

/// Flags that the YAML file may not set: the file's own path, the switches of one run, and the
/// key itself (a file tends to be committed; only the path of a key file may be in it).
const NEVER_FROM_FILE: &[&str] = &["config", "api_key", "ui", "print_config", "dry_run"];

/// The effective settings.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    pub model_path: PathBuf,
    pub tokenizer_path: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub device: DeviceRequest,
    pub max_batch_size: usize,
    pub max_new_tokens: usize,
    pub context_window: Option<usize>,
    pub max_queued_tokens: usize,
    pub backpressure: bool,
    pub max_request_tokens: usize,
    pub max_logprob_entries: usize,
    pub score_chunk_tokens: usize,
    pub max_body_bytes: usize,
    pub log_level: String,
    /// The bearer key; never printed or logged.
    #[serde(serialize_with = "redact")]
    pub api_key: Option<String>,
    pub metrics_auth: bool,
    pub enable_cors: bool,
    pub cors_origins: Vec<String>,
    pub ui: bool,
    pub connections: hrm_http::ConnectionLimits,
    /// Where the YAML defaults came from, if anywhere.
    pub config_file: Option<PathBuf>,
}

fn redact<S: serde::Serializer>(key: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match key {
        Some(_) => s.serialize_str("<redacted>"),
        None => s.serialize_none(),
    }
}

impl ServeConfig {
    /// Layers the YAML file under the flags and environment variables that clap parsed into
    /// `args` (from `matches`), then fills in the defaults.
    pub fn resolve(args: ServeArgs, matches: &ArgMatches) -> anyhow::Result<Self> {
        let file =
            SettingsFile::find(args.config.as_deref(), Path::new("hrm.yaml"), Some("serve"))?;
        let args = hrm_settings::layered(args, matches, file.as_ref(), NEVER_FROM_FILE)?;
        let limits = Limits::default();
        let config = Self {
            host: args.host.unwrap_or_else(|| "0.0.0.0".into()),
            port: args.port.unwrap_or(8000),
            model_path: args
                .model_path
                .unwrap_or_else(|| PathBuf::from("models/sample")),
            tokenizer_path: args.tokenizer_path,
            chat_template: args.chat_template,
            device: args.device.unwrap_or_default(),
            max_batch_size: args.max_batch_size.unwrap_or(16),
            max_new_tokens: args.max_new_tokens.unwrap_or(1024),
            context_window: args.context_window,
            max_queued_tokens: args.max_queued_tokens.unwrap_or(1 << 20),
            backpressure: args.backpressure.unwrap_or(true),
            max_request_tokens: args.max_request_tokens.unwrap_or(limits.max_request_tokens),
            max_logprob_entries: args
                .max_logprob_entries
                .unwrap_or(limits.max_logprob_entries),
            score_chunk_tokens: args.score_chunk_tokens.unwrap_or(2048),
            max_body_bytes: args.max_body_bytes.unwrap_or(4 << 20),
            log_level: args.log_level.unwrap_or_else(|| "info".into()),
            api_key: read_api_key(args.api_key, args.api_key_file)?,
            metrics_auth: args.metrics_auth.unwrap_or(false),
            enable_cors: args.enable_cors.unwrap_or(false),
            cors_origins: args.cors_origins.unwrap_or_default(),
            ui: args.ui,
            connections: args.connections.limits()?,
            config_file: file.map(|f| f.path().to_path_buf()),
        };
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.max_batch_size >= 1,
            "max_batch_size must be at least 1"
        );
        anyhow::ensure!(
            self.max_new_tokens >= 1,
            "max_new_tokens must be at least 1"
        );
        anyhow::ensure!(
            self.max_queued_tokens >= 1
                && self.max_request_tokens >= 1
                && self.max_logprob_entries >= 1
                && self.score_chunk_tokens >= 1,
            "max_queued_tokens, max_request_tokens, max_logprob_entries and score_chunk_tokens must be at least 1"
        );
        // The budget is a semaphore whose permits are taken 2^32 - 1 at most at a time.
        anyhow::ensure!(
            self.max_queued_tokens <= u32::MAX as usize,
            "max_queued_tokens must be at most {}",
            u32::MAX
        );
        anyhow::ensure!(
            self.max_body_bytes >= 1024,
            "max_body_bytes must be at least 1024"
        );
        if let Some(window) = self.context_window {
            anyhow::ensure!(window >= 2, "context_window must be at least 2");
        }
        Ok(())
    }

    /// The request limits the validation rules enforce.
    pub fn limits(&self) -> Limits {
        Limits {
            max_new_tokens: self.max_new_tokens,
            max_request_tokens: self.max_request_tokens,
            max_logprob_entries: self.max_logprob_entries,
            ..Limits::default()
        }
    }

    /// The settings as YAML, in the file's own `serve:` shape.
    pub fn to_yaml(&self) -> String {
        let section = serde_json::json!({ "serve": self });
        serde_norway::to_string(&section).expect("settings serialise")
    }
}

/// The key itself, or the first line of the key file. A key is never read from the YAML file,
/// which tends to be committed; only the path of a key file is.
fn read_api_key(key: Option<String>, file: Option<PathBuf>) -> anyhow::Result<Option<String>> {
    let key = match (key, file) {
        (Some(key), _) => key,
        (None, Some(path)) => std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("cannot read the API key file {}: {e}", path.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string(),
        (None, None) => return Ok(None),
    };
    anyhow::ensure!(!key.is_empty(), "the API key is empty");
    Ok(Some(key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::FromArgMatches;

    fn yaml(dir: &Path, text: &str) -> String {
        let path = dir.join("hrm.yaml");
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }

    /// `hrm serve ARGV`, as the command line resolves it.
    fn resolve(argv: &[&str]) -> anyhow::Result<ServeConfig> {
        let matches = ServeArgs::augment_args(clap::Command::new("serve"))
            .try_get_matches_from(std::iter::once("serve").chain(argv.iter().copied()))?;
        ServeConfig::resolve(ServeArgs::from_arg_matches(&matches)?, &matches)
    }

    #[test]
    fn defaults_apply_without_flags_or_file() {
        let dir = tempfile::tempdir().unwrap();
        let c = resolve(&["--config", &yaml(dir.path(), "other: {}\n")]).unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.max_batch_size, c.max_new_tokens),
            ("0.0.0.0", 8000, 16, 1024)
        );
        assert_eq!(c.model_path, PathBuf::from("models/sample"));
        assert!(c.backpressure, "backpressure is on by default");
    }

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = yaml(
            dir.path(),
            "serve:\n  port: 9001\n  max_batch_size: 4\n  log_level: debug\n  body_timeout: 7\n",
        );
        let c = resolve(&["--config", &path, "--port", "9100"]).unwrap();
        assert_eq!(c.port, 9100, "flag over file");
        assert_eq!(c.max_batch_size, 4, "file over default");
        assert_eq!(c.log_level, "debug");
        assert_eq!(c.max_new_tokens, 1024, "default");
        assert_eq!(
            c.connections.body_timeout,
            std::time::Duration::from_secs(7),
            "the connection settings are the file's too"
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = resolve(&["--config", &yaml(dir.path(), "serve:\n  prot: 1\n")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("prot"), "{err}");
        let err = resolve(&[
            "--config",
            &yaml(dir.path(), "serve:\n  max_batch_size: 0\n"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("max_batch_size"), "{err}");
        let err = resolve(&["--max-queued-tokens", &(1u64 << 40).to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_queued_tokens"), "{err}");
    }

    #[test]
    fn the_key_is_redacted_and_never_read_from_yaml() {
        let dir = tempfile::tempdir().unwrap();
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, "from-file\n").unwrap();
        let path = yaml(
            dir.path(),
            &format!("serve:\n  api_key_file: {}\n", key_file.display()),
        );
        let c = resolve(&["--config", &path]).unwrap();
        assert_eq!(c.api_key.as_deref(), Some("from-file"));
        let printed = c.to_yaml();
        assert!(
            printed.contains("<redacted>") && !printed.contains("from-file"),
            "{printed}"
        );
        let path = yaml(dir.path(), "serve:\n  api_key: inline\n");
        assert!(
            resolve(&["--config", &path]).is_err(),
            "a key in the YAML file is refused"
        );
    }
}
