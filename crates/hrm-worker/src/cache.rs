//! Checkpoints on disk, named by their SHA-256: a version already here is never downloaded
//! again, and a download that was cut off resumes where it stopped (an HTTP `Range` request).

use anyhow::{Context, Result, bail};
use hrm_wire::update::sha256_hex;
use hrm_wire::{HubClient, ModelVersionInfo};
use reqwest::StatusCode;
use std::path::PathBuf;
use tokio::io::AsyncWriteExt;

pub struct CheckpointCache {
    dir: PathBuf,
}

impl CheckpointCache {
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating the checkpoint cache {}", dir.display()))?;
        Ok(Self { dir })
    }

    /// `$XDG_CACHE_HOME/hrm/checkpoints`, else `~/.cache/hrm/checkpoints`.
    pub fn default_dir() -> PathBuf {
        std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from("."))
            .join("hrm")
            .join("checkpoints")
    }

    pub fn path_of(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}.safetensors"))
    }

    fn partial_path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}.partial"))
    }

    /// The checkpoint of `info`, from the cache or the hub. `progress(done, total)` is called
    /// as bytes arrive. Returns the file's bytes and whether they came from the cache.
    pub async fn fetch(
        &self,
        client: &HubClient,
        info: &ModelVersionInfo,
        mut progress: impl FnMut(u64, Option<u64>),
    ) -> Result<(Vec<u8>, bool)> {
        let sha = &info.sha256;
        if !sha.chars().all(|c| c.is_ascii_hexdigit()) || sha.len() != 64 {
            bail!("the hub sent a malformed checkpoint hash {sha:?}");
        }
        let done = self.path_of(sha);
        if let Ok(bytes) = tokio::fs::read(&done).await {
            if sha256_hex(&bytes) == *sha {
                return Ok((bytes, true));
            }
            tracing::warn!(path = %done.display(), "cached checkpoint is corrupt; downloading it again");
            tokio::fs::remove_file(&done).await.ok();
        }
        let partial = self.partial_path(sha);
        let mut offset = tokio::fs::metadata(&partial).await.map_or(0, |m| m.len());
        let response = match client.download_from(&info.checkpoint_url, offset).await {
            // The partial file is as long as (or longer than) the checkpoint: start over.
            Err(e) if e.status() == Some(StatusCode::RANGE_NOT_SATISFIABLE) => {
                offset = 0;
                client.download_from(&info.checkpoint_url, 0).await?
            }
            other => other?,
        };
        let resumed = response.status() == StatusCode::PARTIAL_CONTENT;
        let total = response
            .content_length()
            .map(|len| len + if resumed { offset } else { 0 });
        let mut file = tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed)
            .truncate(!resumed)
            .open(&partial)
            .await
            .with_context(|| format!("opening {}", partial.display()))?;
        let mut received = if resumed { offset } else { 0 };
        if resumed {
            tracing::info!(offset, "resuming a checkpoint download");
        }
        progress(received, total);
        let mut response = response;
        while let Some(chunk) = response
            .chunk()
            .await
            .context("downloading the checkpoint")?
        {
            file.write_all(&chunk).await?;
            received += chunk.len() as u64;
            progress(received, total);
        }
        file.sync_all().await?;
        drop(file);
        let bytes = tokio::fs::read(&partial).await?;
        if sha256_hex(&bytes) != *sha {
            // A resumed file that does not add up is started over on the next try.
            tokio::fs::remove_file(&partial).await.ok();
            bail!(
                "the downloaded checkpoint of {} does not match its hash; it will be downloaded again",
                info.version
            );
        }
        tokio::fs::rename(&partial, &done).await?;
        Ok((bytes, false))
    }
}
