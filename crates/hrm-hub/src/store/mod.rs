//! The SQL of the hub, one module per table, so that the modules above read as orchestration.
//! Every function takes any executor: the pool, or a transaction when several writes must land
//! together. The statements are portable: the same text runs on SQLite and PostgreSQL through
//! sqlx's `Any` driver (UUIDs as text, timestamps as Unix milliseconds, JSON as text).

pub mod batches;
pub mod updates;
pub mod versions;
pub mod workers;
