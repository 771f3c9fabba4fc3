//! Checkpoints, batch files and update files in an object store: the local filesystem under the
//! data directory by default, an S3 bucket when `S3_BUCKET` is set (endpoint, region and
//! credentials from the usual `AWS_*` variables).
//!
//! With S3, workers move the bulk bytes themselves through presigned URLs (GET for batch files,
//! PUT for update files); with the local store the hub's own routes stand in for them.

use anyhow::{Context, Result};
use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::local::LocalFileSystem;
use object_store::path::Path as Key;
use object_store::signer::Signer;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use sha2::{Digest, Sha256};
use std::ops::Range;
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
        hrm_wire::install_tls_provider();
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

    /// The whole object, but refused when it holds more than `limit` bytes (only `limit + 1`
    /// bytes are ever read, whatever the store holds). `None` when there is no such object.
    pub async fn get_bounded(&self, key: &str, limit: u64) -> Result<Option<Bounded>> {
        match self.size(key).await? {
            None => return Ok(None),
            Some(size) if size > limit => return Ok(Some(Bounded::TooLarge(size))),
            // A range cannot start on an empty object.
            Some(0) => return Ok(Some(Bounded::Fits(Bytes::new()))),
            Some(_) => {}
        }
        let options = GetOptions {
            range: Some(GetRange::Bounded(0..limit + 1)),
            ..GetOptions::default()
        };
        let result = match self.store.get_opts(&Key::from(key), options).await {
            Ok(result) => result,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => {
                return Err(e).with_context(|| format!("reading {key} from {}", self.description));
            }
        };
        // The object read may have been replaced since the size was asked for.
        if result.meta.size > limit {
            return Ok(Some(Bounded::TooLarge(result.meta.size)));
        }
        Ok(Some(Bounded::Fits(result.bytes().await?)))
    }

    /// A stream of the object's bytes (all of them, or `range`), with the object's size.
    pub async fn get_stream(
        &self,
        key: &str,
        range: Option<Range<u64>>,
    ) -> Result<(u64, impl Stream<Item = object_store::Result<Bytes>> + use<>)> {
        let options = GetOptions {
            range: range.map(GetRange::Bounded),
            ..GetOptions::default()
        };
        let result = self
            .store
            .get_opts(&Key::from(key), options)
            .await
            .with_context(|| format!("reading {key} from {}", self.description))?;
        Ok((result.meta.size, result.into_stream()))
    }

    /// Writes `body` as the object at `key`, chunk by chunk, refusing it once it passes `limit`
    /// bytes (the partial upload is aborted; nothing is stored). Returns its size and SHA-256.
    pub async fn put_stream<E: std::fmt::Display>(
        &self,
        key: &str,
        body: impl Stream<Item = Result<Bytes, E>>,
        limit: u64,
    ) -> Result<Streamed> {
        let upload = self
            .store
            .put_multipart(&Key::from(key))
            .await
            .with_context(|| format!("writing {key} to {}", self.description))?;
        let mut writer = WriteMultipart::new(upload);
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            let chunk = match chunk {
                Ok(chunk) => chunk,
                Err(e) => {
                    writer.abort().await.ok();
                    return Ok(Streamed::Broken(e.to_string()));
                }
            };
            size += chunk.len() as u64;
            if size > limit {
                writer.abort().await.ok();
                return Ok(Streamed::TooLarge);
            }
            hasher.update(&chunk);
            writer.put(chunk);
        }
        writer
            .finish()
            .await
            .with_context(|| format!("writing {key} to {}", self.description))?;
        Ok(Streamed::Stored {
            size,
            sha256: hex::encode(hasher.finalize()),
        })
    }

    /// Every object under `prefix`, with when it was last written.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, chrono::DateTime<chrono::Utc>)>> {
        self.store
            .list(Some(&Key::from(prefix)))
            .map_ok(|meta| (meta.location.to_string(), meta.last_modified))
            .try_collect()
            .await
            .with_context(|| format!("listing {prefix} in {}", self.description))
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

/// What [`Blobs::get_bounded`] found.
#[derive(Debug)]
pub enum Bounded {
    Fits(Bytes),
    /// The object holds this many bytes, more than the limit.
    TooLarge(u64),
}

/// What [`Blobs::put_stream`] did.
#[derive(Debug, PartialEq)]
pub enum Streamed {
    Stored {
        size: u64,
        sha256: String,
    },
    /// The body passed the limit; nothing was stored.
    TooLarge,
    /// The body could not be read (the client stopped, or too slowly); nothing was stored.
    Broken(String),
}
