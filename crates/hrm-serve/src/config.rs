//! `hrm serve` settings: command-line flags, then environment variables, then the `serve:`
//! section of a YAML file, then defaults (highest first).
//!
//! The YAML file is `--config PATH` (or `HRM_SERVE_CONFIG`); without either, `./hrm.yaml` is read
//! when it exists. `--print-config` prints the effective settings with secrets redacted.
//! Environment variables are the specification's (`HRM_MODEL_PATH`, `HRM_TOKENIZER_PATH`,
//! `HRM_DEVICE`, `HRM_MAX_BATCH_SIZE`, `HRM_MAX_NEW_TOKENS`, `HRM_CORS_ORIGINS`) and, for the
//! rest, `HRM_SERVE_*`: no variable of `hrm worker` (`HRM_WORKER_*`) or `hrm hub`
//! (`HRM_HUB_*`) means anything here.

use std::path::{Path, PathBuf};

use clap::Args;
use hrm_model::DeviceRequest;
use serde::{Deserialize, Serialize};

use crate::validation::Limits;

/// The flags of `hrm serve`. Every value is optional here so that precedence can be resolved
/// against the YAML file; `clap` itself fills in the environment variables.
#[derive(Args, Debug, Default, Clone)]
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
    pub connections: hrm_http::ConnectionArgs,
}

/// The `serve:` section of the YAML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeFileSection {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub model_path: Option<PathBuf>,
    pub tokenizer_path: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub device: Option<DeviceRequest>,
    pub max_batch_size: Option<usize>,
    pub max_new_tokens: Option<usize>,
    pub context_window: Option<usize>,
    pub max_queued_tokens: Option<usize>,
    pub backpressure: Option<bool>,
    pub max_request_tokens: Option<usize>,
    pub max_logprob_entries: Option<usize>,
    pub score_chunk_tokens: Option<usize>,
    pub max_body_bytes: Option<usize>,
    pub log_level: Option<String>,
    pub api_key_file: Option<PathBuf>,
    pub metrics_auth: Option<bool>,
    pub enable_cors: Option<bool>,
    pub cors_origins: Option<Vec<String>>,
    pub header_timeout: Option<u64>,
    pub body_timeout: Option<u64>,
    pub body_deadline: Option<u64>,
    pub max_connections: Option<usize>,
    pub shutdown_timeout: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    serve: Option<ServeFileSection>,
}

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
    /// Resolves flags and environment (already merged by clap) over the YAML file over defaults.
    pub fn resolve(args: &ServeArgs) -> anyhow::Result<Self> {
        let (file, config_file) = read_file(args.config.as_deref())?;
        let pick = |flag: Option<&String>, file: Option<&String>, default: &str| {
            flag.or(file)
                .cloned()
                .unwrap_or_else(|| default.to_string())
        };
        let config = Self {
            host: pick(args.host.as_ref(), file.host.as_ref(), "0.0.0.0"),
            port: args.port.or(file.port).unwrap_or(8000),
            model_path: args
                .model_path
                .clone()
                .or(file.model_path)
                .unwrap_or_else(|| PathBuf::from("models/sample")),
            tokenizer_path: args.tokenizer_path.clone().or(file.tokenizer_path),
            chat_template: args.chat_template.clone().or(file.chat_template),
            device: args.device.or(file.device).unwrap_or_default(),
            max_batch_size: args.max_batch_size.or(file.max_batch_size).unwrap_or(16),
            max_new_tokens: args.max_new_tokens.or(file.max_new_tokens).unwrap_or(1024),
            context_window: args.context_window.or(file.context_window),
            max_queued_tokens: args
                .max_queued_tokens
                .or(file.max_queued_tokens)
                .unwrap_or(1 << 20),
            backpressure: args.backpressure.or(file.backpressure).unwrap_or(true),
            max_request_tokens: args
                .max_request_tokens
                .or(file.max_request_tokens)
                .unwrap_or(Limits::default().max_request_tokens),
            max_logprob_entries: args
                .max_logprob_entries
                .or(file.max_logprob_entries)
                .unwrap_or(Limits::default().max_logprob_entries),
            score_chunk_tokens: args
                .score_chunk_tokens
                .or(file.score_chunk_tokens)
                .unwrap_or(2048),
            max_body_bytes: args
                .max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(4 << 20),
            log_level: pick(args.log_level.as_ref(), file.log_level.as_ref(), "info"),
            api_key: read_api_key(
                args.api_key.clone(),
                args.api_key_file.clone().or(file.api_key_file),
            )?,
            metrics_auth: args.metrics_auth.or(file.metrics_auth).unwrap_or(false),
            enable_cors: args.enable_cors.or(file.enable_cors).unwrap_or(false),
            cors_origins: args
                .cors_origins
                .clone()
                .or(file.cors_origins)
                .unwrap_or_default(),
            ui: args.ui,
            connections: args
                .connections
                .over(&hrm_http::ConnectionArgs {
                    header_timeout: file.header_timeout,
                    body_timeout: file.body_timeout,
                    body_deadline: file.body_deadline,
                    max_connections: file.max_connections,
                    shutdown_timeout: file.shutdown_timeout,
                })
                .limits()?,
            config_file,
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

fn read_file(explicit: Option<&Path>) -> anyhow::Result<(ServeFileSection, Option<PathBuf>)> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let default = PathBuf::from("hrm.yaml");
            if !default.exists() {
                return Ok((ServeFileSection::default(), None));
            }
            default
        }
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("cannot read the config file {}: {e}", path.display()))?;
    let file: ConfigFile = serde_norway::from_str(&text)
        .map_err(|e| anyhow::anyhow!("invalid config file {}: {e}", path.display()))?;
    Ok((file.serve.unwrap_or_default(), Some(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(dir: &Path, text: &str) -> PathBuf {
        let path = dir.join("hrm.yaml");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn defaults_apply_without_flags_or_file() {
        let dir = tempfile::tempdir().unwrap();
        let args = ServeArgs {
            config: Some(yaml(dir.path(), "other: {}\n")),
            ..ServeArgs::default()
        };
        let c = ServeConfig::resolve(&args).unwrap();
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
            "serve:\n  port: 9001\n  max_batch_size: 4\n  log_level: debug\n",
        );
        let args = ServeArgs {
            config: Some(path),
            port: Some(9100),
            ..ServeArgs::default()
        };
        let c = ServeConfig::resolve(&args).unwrap();
        assert_eq!(c.port, 9100, "flag over file");
        assert_eq!(c.max_batch_size, 4, "file over default");
        assert_eq!(c.log_level, "debug");
        assert_eq!(c.max_new_tokens, 1024, "default");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let args = ServeArgs {
            config: Some(yaml(dir.path(), "serve:\n  prot: 1\n")),
            ..ServeArgs::default()
        };
        let err = ServeConfig::resolve(&args).unwrap_err().to_string();
        assert!(err.contains("prot"), "{err}");
        let args = ServeArgs {
            config: Some(yaml(dir.path(), "serve:\n  max_batch_size: 0\n")),
            ..ServeArgs::default()
        };
        assert!(
            ServeConfig::resolve(&args)
                .unwrap_err()
                .to_string()
                .contains("max_batch_size")
        );
        let args = ServeArgs {
            max_queued_tokens: Some(1 << 40),
            ..ServeArgs::default()
        };
        assert!(
            ServeConfig::resolve(&args)
                .unwrap_err()
                .to_string()
                .contains("max_queued_tokens")
        );
    }

    #[test]
    fn the_key_is_redacted_and_never_read_from_yaml() {
        let dir = tempfile::tempdir().unwrap();
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, "from-file\n").unwrap();
        let args = ServeArgs {
            config: Some(yaml(
                dir.path(),
                &format!("serve:\n  api_key_file: {}\n", key_file.display()),
            )),
            ..ServeArgs::default()
        };
        let c = ServeConfig::resolve(&args).unwrap();
        assert_eq!(c.api_key.as_deref(), Some("from-file"));
        let printed = c.to_yaml();
        assert!(
            printed.contains("<redacted>") && !printed.contains("from-file"),
            "{printed}"
        );
        let args = ServeArgs {
            config: Some(yaml(dir.path(), "serve:\n  api_key: inline\n")),
            ..ServeArgs::default()
        };
        assert!(
            ServeConfig::resolve(&args).is_err(),
            "a key in the YAML file is refused"
        );
    }
}
