//! The database: connection, migrations and the aggregator lock. SQLite in the data directory
//! by default, PostgreSQL when `DATABASE_URL` says so; one set of portable SQL serves both
//! through sqlx's `Any` driver.

use anyhow::{Context, Result};
use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyPool, ConnectOptions};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: the unit of every timestamp column.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn to_datetime(ms: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Db {
    pub pool: AnyPool,
    pub backend: Backend,
    /// SQLite: the file whose lock is the aggregator role.
    lock_file: Option<PathBuf>,
}

const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../migrations/0001_init.sql")),
    (
        2,
        "hostile volunteers",
        include_str!("../migrations/0002_hostile_volunteers.sql"),
    ),
];

/// An arbitrary constant naming the aggregator's PostgreSQL advisory lock.
const AGGREGATOR_LOCK_KEY: i64 = 0x4852_4d5f_4147_4752;

impl Db {
    /// Connects and applies the migrations. `sqlite://path` files are created when missing.
    pub async fn connect(url: &str) -> Result<Self> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else {
            anyhow::bail!(
                "DATABASE_URL must start with sqlite:// or postgres:// (got {})",
                redact(url)
            );
        };
        let options = AnyConnectOptions::from_str(url)
            .with_context(|| format!("parsing DATABASE_URL {}", redact(url)))?
            .disable_statement_logging();
        let pool = AnyPoolOptions::new()
            .max_connections(if backend == Backend::Sqlite { 8 } else { 32 })
            .acquire_timeout(Duration::from_secs(30))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        // WAL lets readers run beside the writer; a writer waits rather than fails.
                        sqlx::query("PRAGMA journal_mode = WAL")
                            .execute(&mut *conn)
                            .await?;
                        sqlx::query("PRAGMA busy_timeout = 30000")
                            .execute(&mut *conn)
                            .await?;
                        sqlx::query("PRAGMA foreign_keys = ON")
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .with_context(|| format!("connecting to {}", redact(url)))?;
        let migrations = MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    description.into(),
                    MigrationType::Simple,
                    sqlx::SqlSafeStr::into_sql_str(sql),
                    false,
                )
            })
            .collect();
        Migrator::with_migrations(migrations)
            .run(&pool)
            .await
            .context("applying the database migrations")?;
        let lock_file = match backend {
            Backend::Postgres => None,
            Backend::Sqlite => {
                let path = url
                    .trim_start_matches("sqlite://")
                    .trim_start_matches("sqlite:");
                let path = path.split('?').next().unwrap_or(path);
                anyhow::ensure!(
                    !path.is_empty() && !path.contains(":memory:"),
                    "the hub needs a SQLite file (sqlite://path), not an in-memory database"
                );
                Some(PathBuf::from(format!("{path}.aggregator-lock")))
            }
        };
        Ok(Self {
            pool,
            backend,
            lock_file,
        })
    }

    /// Takes the aggregator role if no one holds it: PostgreSQL's session advisory lock, or for
    /// SQLite (one host by nature) an exclusive lock on a file beside the database. Either is
    /// freed by the server or the OS when this process dies.
    pub async fn try_lock_aggregator(&self) -> Result<Option<AggregatorLock>> {
        match &self.lock_file {
            None => {
                let mut conn = self.pool.acquire().await?;
                let (locked,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
                    .bind(AGGREGATOR_LOCK_KEY)
                    .fetch_one(&mut *conn)
                    .await?;
                Ok(locked.then(|| AggregatorLock::Advisory(Some(conn))))
            }
            Some(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                match file.try_lock() {
                    Ok(()) => Ok(Some(AggregatorLock::File(file))),
                    Err(std::fs::TryLockError::WouldBlock) => Ok(None),
                    Err(std::fs::TryLockError::Error(e)) => {
                        Err(e).with_context(|| format!("locking {}", path.display()))
                    }
                }
            }
        }
    }
}

/// The aggregator role, held until [`AggregatorLock::release`] (or the holder's death).
pub enum AggregatorLock {
    Advisory(Option<PoolConnection<Any>>),
    File(std::fs::File),
}

impl AggregatorLock {
    pub async fn release(mut self) -> Result<()> {
        if let AggregatorLock::Advisory(conn) = &mut self
            && let Some(mut conn) = conn.take()
        {
            sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(AGGREGATOR_LOCK_KEY)
                .execute(&mut *conn)
                .await?;
        }
        // A file lock ends when the file is closed, on drop.
        Ok(())
    }
}

impl Drop for AggregatorLock {
    fn drop(&mut self) {
        // Dropped without release (a panic or a cancelled task): closing the connection is what
        // frees a session advisory lock; a pooled connection would keep holding it.
        if let AggregatorLock::Advisory(Some(conn)) = self {
            conn.close_on_drop();
        }
    }
}

/// The URL without its password, for messages and logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}://{}:***@{}", &url[..scheme], user, &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://hub:s3cret@db:5432/hub"),
            "postgres://hub:***@db:5432/hub"
        );
        assert_eq!(
            redact("sqlite://hub-data/hub.db"),
            "sqlite://hub-data/hub.db"
        );
    }
}
