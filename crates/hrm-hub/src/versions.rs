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
use crate::store;
use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use hrm_wire::ModelVersionInfo;
use hrm_wire::update::{ParamSpec, Schema, read_checkpoint, sha256_hex, write_checkpoint};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

pub const MAX_VERSION_CHARS: usize = 16;

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

pub use crate::store::versions::VersionRow;

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

pub async fn version_row(hub: &Hub, version: &str) -> Result<Option<VersionRow>> {
    store::versions::get(&hub.db.pool, version).await
}

/// Every version, oldest first.
pub async fn all_versions(hub: &Hub) -> Result<Vec<VersionRow>> {
    store::versions::all(&hub.db.pool).await
}

pub async fn current_version(hub: &Hub) -> Result<Option<String>> {
    store::versions::current(&hub.db.pool).await
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
        cursor = store::versions::parent_of(&hub.db.pool, &v).await?;
    }
    Ok(None)
}

/// The name of the next version, from the counters in `hub_state`.
pub async fn next_name(hub: &Hub) -> Result<String> {
    let (branch, patch) = store::versions::counters(&hub.db.pool).await?;
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
    let spec = hrm_model::ModelSpec::from_config_file(config_path)?;
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
    hrm_model::ModelSpec::from_config_file(config_path)?;
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
    let row = VersionRow {
        version: version.clone(),
        checkpoint_key: checkpoint_key(&version),
        sha256: sha,
        num_parameters: schema.num_parameters() as i64,
        parent: None,
        step: 0,
        optimizer_key: None,
        config,
        metrics: serde_json::json!({"source": source}),
        created_at: now_ms(),
    };
    store::versions::insert(&mut *tx, &row).await?;
    if !store::versions::start(&mut *tx, &version).await? {
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
    store::versions::roll_back_to(&hub.db.pool, version).await?;
    hub.announce_version(version, row.parent.clone());
    Ok(row.info())
}
