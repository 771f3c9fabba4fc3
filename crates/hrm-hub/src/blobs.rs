//! Checkpoints, batch files and update files in an object store: the local filesystem under the
//! data directory by default, an S3 bucket when `S3_BUCKET` is set (endpoint, region and
//! credentials from the usual `AWS_*` variables).
//!
//! With S3, workers move the bulk bytes themselves through presigned URLs (GET for batch files,
//! PUT for update files); with the local store the hub's own routes stand in for them.

use anyhow::{Context, Result};
use bytes::Bytes;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::local::LocalFileSystem;
use object_store::path::Path as Key;
use object_store::signer::Signer;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Blobs {
    store: Arc<dyn ObjectStore>,
    /// Present for S3: signs the URLs workers use directly.
    signer: Option<Arc<AmazonS3>>,
    description: String,
}

impl Blobs {
    /// Files under `dir` (created if missing).
    pub fn local(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let store = LocalFileSystem::new_with_prefix(dir)
            .with_context(|| format!("opening the object directory {}", dir.display()))?;
        Ok(Self {
            store: Arc::new(store),
            signer: None,
            description: format!("local files in {}", dir.display()),
        })
    }

    /// An S3 bucket, configured from the `AWS_*` environment variables (`AWS_ENDPOINT_URL`,
    /// `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ALLOW_HTTP`).
    pub fn s3(bucket: &str) -> Result<Self> {
        Self::s3_with(AmazonS3Builder::from_env().with_bucket_name(bucket), bucket)
    }

    /// An S3 bucket configured by the caller (tests point it at a local server).
    pub fn s3_with(builder: AmazonS3Builder, bucket: &str) -> Result<Self> {
        let s3 = Arc::new(
            builder
                .build()
                .with_context(|| format!("configuring S3 bucket {bucket}"))?,
        );
        Ok(Self {
            store: s3.clone(),
            signer: Some(s3),
            description: format!("S3 bucket {bucket}"),
        })
    }

    pub fn description(&self) -> &str {
        &self.description
    }

    pub fn is_s3(&self) -> bool {
        self.signer.is_some()
    }

    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        self.store
            .put(&Key::from(key), PutPayload::from(bytes))
            .await
            .with_context(|| format!("writing {key} to {}", self.description))?;
        Ok(())
    }

    pub async fn get(&self, key: &str) -> Result<Bytes> {
        let result = self
            .store
            .get(&Key::from(key))
            .await
            .with_context(|| format!("reading {key} from {}", self.description))?;
        Ok(result.bytes().await?)
    }

    /// The object's size, or `None` when there is no such object.
    pub async fn size(&self, key: &str) -> Result<Option<u64>> {
        match self.store.head(&Key::from(key)).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("looking up {key} in {}", self.description)),
        }
    }

    pub async fn delete(&self, key: &str) -> Result<()> {
        match self.store.delete(&Key::from(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("deleting {key} from {}", self.description)),
        }
    }

    /// A presigned URL for `method` on `key`, or `None` for the local store (whose callers use
    /// the hub's routes instead).
    pub async fn presign(
        &self,
        method: object_store::signer::Method,
        key: &str,
        expires_in: Duration,
    ) -> Result<Option<String>> {
        let Some(signer) = &self.signer else {
            return Ok(None);
        };
        let url = signer
            .signed_url(method, &Key::from(key), expires_in)
            .await
            .with_context(|| format!("signing a URL for {key}"))?;
        Ok(Some(url.to_string()))
    }
}
