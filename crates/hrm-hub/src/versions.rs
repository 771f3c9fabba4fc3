//! The model registry: versions named `v0.<line>.<n>` (at most 16 characters), each an f32
//! safetensors checkpoint in the object store with its SHA-256, its parent, and the metrics
//! recorded when it was published; the current version; rollback; and the in-memory copy of
//! the current parameters.
//!
//! Aggregations number versions `v0.<line>.1`, `.2`, … A rollback makes an older version
//! current and starts a new line, so names are never reused: after rolling `v0.1.7` back to
//! `v0.1.5`, the next version is `v0.2.1`, whose parent is `v0.1.5`.

use crate::Hub;
use crate::db::{now_ms, to_datetime};
use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use hrm_wire::ModelVersionInfo;
use hrm_wire::update::{ParamSpec, Schema, read_checkpoint, write_checkpoint};
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Row};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

pub const MAX_VERSION_CHARS: usize = 16;

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn checkpoint_key(version: &str) -> String {
    format!("checkpoints/{version}/model.safetensors")
}

pub fn optimizer_key(version: &str) -> String {
    format!("checkpoints/{version}/outer-optimizer.safetensors")
}

/// The route a checkpoint is downloaded from.
pub fn download_url(version: &str) -> String {
    format!("/api/v1/model/download/{version}")
}

/// A version's parameters in memory.
#[derive(Debug)]
pub struct LoadedVersion {
    pub version: String,
    pub schema: Arc<Schema>,
    pub params: Vec<f32>,
    pub config: serde_json::Value,
}

/// The last version loaded, shared by the upload checks and the aggregator.
#[derive(Default)]
pub struct ModelCache(Mutex<Option<Arc<LoadedVersion>>>);

impl ModelCache {
    pub async fn get(&self, hub: &Hub, version: &str) -> Result<Arc<LoadedVersion>> {
        if let Some(loaded) = self.0.lock().expect("model cache lock").as_ref()
            && loaded.version == version
        {
            return Ok(loaded.clone());
        }
        let row = version_row(hub, version)
            .await?
            .ok_or_else(|| anyhow!("no version {version}"))?;
        let bytes = hub.blobs.get(&row.checkpoint_key).await?;
        if sha256_hex(&bytes) != row.sha256 {
            bail!("checkpoint of {version} does not match its recorded SHA-256");
        }
        let (schema, params) =
            read_checkpoint(&bytes).map_err(|e| anyhow!("checkpoint of {version}: {e}"))?;
        let loaded = Arc::new(LoadedVersion {
            version: version.to_string(),
            schema: Arc::new(schema),
            params,
            config: row.config,
        });
        self.put(loaded.clone());
        Ok(loaded)
    }

    pub fn put(&self, loaded: Arc<LoadedVersion>) {
        *self.0.lock().expect("model cache lock") = Some(loaded);
    }
}

/// A `model_versions` row.
#[derive(Debug, Clone)]
pub struct VersionRow {
    pub version: String,
    pub checkpoint_key: String,
    pub sha256: String,
    pub num_parameters: i64,
    pub parent: Option<String>,
    pub step: i64,
    pub optimizer_key: Option<String>,
    pub config: serde_json::Value,
    pub metrics: serde_json::Value,
    pub created_at: i64,
}

impl VersionRow {
    pub fn info(&self) -> ModelVersionInfo {
        ModelVersionInfo {
            version: self.version.clone(),
            checkpoint_url: download_url(&self.version),
            sha256: self.sha256.clone(),
            num_parameters: self.num_parameters,
            parent: self.parent.clone(),
            created_at: to_datetime(self.created_at),
            metrics: self.metrics.clone(),
            config: self.config.clone(),
        }
    }
}

const VERSION_COLUMNS: &str = "version, checkpoint_url, sha256, num_parameters, parent, step, optimizer_url, config, metrics, created_at";

fn parse_row(row: &sqlx::any::AnyRow) -> Result<VersionRow> {
    let json = |column: &str| -> Result<serde_json::Value> {
        let text: String = row.try_get(column)?;
        serde_json::from_str(&text).with_context(|| format!("corrupt {column} JSON"))
    };
    Ok(VersionRow {
        version: row.try_get("version")?,
        checkpoint_key: row.try_get("checkpoint_url")?,
        sha256: row.try_get("sha256")?,
        num_parameters: row.try_get("num_parameters")?,
        parent: row.try_get("parent")?,
        step: row.try_get("step")?,
        optimizer_key: row.try_get("optimizer_url")?,
        config: json("config")?,
        metrics: json("metrics")?,
        created_at: row.try_get("created_at")?,
    })
}

pub async fn version_row(hub: &Hub, version: &str) -> Result<Option<VersionRow>> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {VERSION_COLUMNS} FROM model_versions WHERE version = $1"
    )))
    .bind(version)
    .fetch_optional(&hub.db.pool)
    .await?;
    row.as_ref().map(parse_row).transpose()
}

/// Every version, oldest first.
pub async fn all_versions(hub: &Hub) -> Result<Vec<VersionRow>> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT {VERSION_COLUMNS} FROM model_versions ORDER BY created_at, version"
    )))
    .fetch_all(&hub.db.pool)
    .await?;
    rows.iter().map(parse_row).collect()
}

pub async fn current_version(hub: &Hub) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT current_version FROM hub_state WHERE id = 1")
            .fetch_one(&hub.db.pool)
            .await?,
    )
}

pub async fn current_row(hub: &Hub) -> Result<Option<VersionRow>> {
    match current_version(hub).await? {
        Some(v) => version_row(hub, &v).await,
        None => Ok(None),
    }
}

/// How many versions `version` lags `head` along head's lineage, or `None` when `version` is
/// not an ancestor within `limit` steps (too stale, or on an abandoned line).
pub async fn lag(hub: &Hub, head: &str, version: &str, limit: i64) -> Result<Option<i64>> {
    let mut cursor = Some(head.to_string());
    for distance in 0..=limit {
        let Some(v) = cursor else { return Ok(None) };
        if v == version {
            return Ok(Some(distance));
        }
        cursor = sqlx::query_scalar("SELECT parent FROM model_versions WHERE version = $1")
            .bind(&v)
            .fetch_one(&hub.db.pool)
            .await?;
    }
    Ok(None)
}

/// The name of the next version, from the counters in `hub_state`.
pub async fn next_name(hub: &Hub) -> Result<String> {
    let row = sqlx::query("SELECT branch, patch FROM hub_state WHERE id = 1")
        .fetch_one(&hub.db.pool)
        .await?;
    let (branch, patch): (i64, i64) = (row.try_get("branch")?, row.try_get("patch")?);
    let name = format!("v0.{branch}.{}", patch + 1);
    if name.len() > MAX_VERSION_CHARS {
        bail!("version name {name} would exceed {MAX_VERSION_CHARS} characters");
    }
    Ok(name)
}

/// Publishes the first version from a Hugging Face checkpoint directory (`config.json` and
/// `model.safetensors`; any dtype, stored as f32). Refused once the hub has a version.
pub async fn init(hub: &Hub, model_dir: &Path) -> Result<ModelVersionInfo> {
    let config_path = model_dir.join("config.json");
    let config = read_config(&config_path)?;
    let weights_path = model_dir.join("model.safetensors");
    let bytes = std::fs::read(&weights_path)
        .with_context(|| format!("reading {}", weights_path.display()))?;
    let (schema, params) =
        read_checkpoint(&bytes).map_err(|e| anyhow!("{}: {e}", weights_path.display()))?;
    publish_first(
        hub,
        config,
        &schema,
        &params,
        model_dir.display().to_string(),
    )
    .await
}

/// Publishes the first version freshly initialised from an architecture `config.json`, with
/// the same seeded initialisation as `hrm train --seed`, so a network run and a centralised
/// run can start from the same weights.
pub async fn init_fresh(hub: &Hub, config_path: &Path, seed: u64) -> Result<ModelVersionInfo> {
    let config = read_config(config_path)?;
    let spec = hrm_model::train::ModelSpec::from_config_file(config_path)?;
    let varmap = candle_nn::VarMap::new();
    spec.build(&varmap, candle_core::DType::F32, &candle_core::Device::Cpu)?;
    spec.initialise(&varmap, seed)?;
    let mut specs = Vec::new();
    let mut tensors = HashMap::new();
    for (name, var) in hrm_model::train::sorted_vars(&varmap) {
        specs.push(ParamSpec {
            name: name.clone(),
            shape: var.dims().to_vec(),
        });
        tensors.insert(name, var.as_tensor().clone());
    }
    let schema = Schema::new(specs);
    let params = hrm_model::train::to_flat(&schema, &tensors)?;
    let source = format!("{} (initialised with seed {seed})", config_path.display());
    publish_first(hub, config, &schema, &params, source).await
}

/// The architecture, checked before anything is stored.
fn read_config(config_path: &Path) -> Result<serde_json::Value> {
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(config_path)
            .with_context(|| format!("reading {}", config_path.display()))?,
    )
    .with_context(|| format!("parsing {}", config_path.display()))?;
    hrm_model::train::ModelSpec::from_config_file(config_path)?;
    config["dtype"] = "float32".into();
    Ok(config)
}

async fn publish_first(
    hub: &Hub,
    config: serde_json::Value,
    schema: &Schema,
    params: &[f32],
    source: String,
) -> Result<ModelVersionInfo> {
    if let Some(v) = current_version(hub).await? {
        bail!(
            "this hub is already initialised (current version {v}); use `hrm hub rollback` to go back"
        );
    }
    let version = "v0.1.0".to_string();
    let file = Bytes::from(write_checkpoint(schema, params, HashMap::new()));
    let sha = sha256_hex(&file);
    hub.blobs.put(&checkpoint_key(&version), file).await?;
    let mut tx = hub.db.pool.begin().await?;
    sqlx::query(
        "INSERT INTO model_versions (version, checkpoint_url, sha256, num_parameters, parent, step, config, metrics, created_at) \
         VALUES ($1, $2, $3, $4, NULL, 0, $5, $6, $7)",
    )
    .bind(&version)
    .bind(checkpoint_key(&version))
    .bind(&sha)
    .bind(schema.num_parameters() as i64)
    .bind(config.to_string())
    .bind(serde_json::json!({"source": source}).to_string())
    .bind(now_ms())
    .execute(&mut *tx)
    .await?;
    let claimed = sqlx::query("UPDATE hub_state SET current_version = $1, branch = 1, patch = 0 WHERE id = 1 AND current_version IS NULL")
        .bind(&version)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if claimed != 1 {
        bail!("another process initialised this hub at the same time");
    }
    tx.commit().await?;
    let row = version_row(hub, &version).await?.expect("just inserted");
    Ok(row.info())
}

/// Makes `version` current again and starts a new version line. Pending updates computed on
/// the abandoned line become stale at the next aggregation and their batches are redone.
pub async fn rollback(hub: &Hub, version: &str) -> Result<ModelVersionInfo> {
    let row = version_row(hub, version)
        .await?
        .ok_or_else(|| anyhow!("no version {version}"))?;
    let current = current_version(hub).await?;
    if current.as_deref() == Some(version) {
        bail!("{version} is already the current version");
    }
    sqlx::query(
        "UPDATE hub_state SET current_version = $1, branch = branch + 1, patch = 0 WHERE id = 1",
    )
    .bind(version)
    .execute(&hub.db.pool)
    .await?;
    hub.announce_version(version, row.parent.clone());
    Ok(row.info())
}
