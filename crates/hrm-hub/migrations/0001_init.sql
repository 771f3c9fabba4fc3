-- One schema for SQLite and PostgreSQL: UUIDs are stored as their text, timestamps as Unix
-- milliseconds (BIGINT) and JSON as text, so the same statements run on both engines.
-- Every piece of workflow state lives in these columns; see docs/hub-api.md for the transitions.

CREATE TABLE workers (
    id TEXT PRIMARY KEY,
    -- SHA-256 (hex) of the client-generated API key; the key itself is never stored.
    api_key_hash TEXT NOT NULL UNIQUE,
    username TEXT UNIQUE,
    hardware_info TEXT NOT NULL DEFAULT '{}',
    total_batches BIGINT NOT NULL DEFAULT 0,
    validated_batches BIGINT NOT NULL DEFAULT 0,
    total_tokens BIGINT NOT NULL DEFAULT 0,
    reputation_score DOUBLE PRECISION NOT NULL DEFAULT 1.0,
    created_at BIGINT NOT NULL,
    last_seen BIGINT
);

CREATE TABLE model_versions (
    version TEXT PRIMARY KEY,
    -- Object-store key of the f32 checkpoint.
    checkpoint_url TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    num_parameters BIGINT NOT NULL,
    parent TEXT REFERENCES model_versions (version),
    -- Aggregations since the first version along this version's lineage.
    step BIGINT NOT NULL,
    -- Object-store key of the outer optimiser's state after this version, if it has any.
    optimizer_url TEXT,
    config TEXT NOT NULL,
    metrics TEXT NOT NULL DEFAULT '{}',
    created_at BIGINT NOT NULL
);

-- A single row: the current version and the counters version names are made from.
CREATE TABLE hub_state (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    current_version TEXT REFERENCES model_versions (version),
    -- The minor number of the next version line; a rollback starts a new line.
    branch BIGINT NOT NULL DEFAULT 1,
    patch BIGINT NOT NULL DEFAULT 0,
    last_aggregation_at BIGINT
);
INSERT INTO hub_state (id) VALUES (1);

CREATE TABLE training_batches (
    batch_id TEXT PRIMARY KEY,
    -- Ingest order: batches are handed out oldest first.
    seq BIGINT NOT NULL,
    dataset_name TEXT NOT NULL,
    data_url TEXT NOT NULL,
    num_samples BIGINT NOT NULL,
    seq_len BIGINT NOT NULL,
    num_tokens BIGINT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    assigned_to TEXT REFERENCES workers (id),
    assigned_at BIGINT,
    lease_expires_at BIGINT,
    attempts BIGINT NOT NULL DEFAULT 0,
    completed_at BIGINT,
    result_hash TEXT
);
CREATE INDEX training_batches_status ON training_batches (status, seq);
CREATE INDEX training_batches_lease ON training_batches (assigned_to, status);

CREATE TABLE gradient_updates (
    update_id TEXT PRIMARY KEY,
    worker_id TEXT NOT NULL REFERENCES workers (id),
    batch_id TEXT NOT NULL REFERENCES training_batches (batch_id),
    model_version TEXT NOT NULL REFERENCES model_versions (version),
    gradient_url TEXT NOT NULL,
    loss DOUBLE PRECISION NOT NULL,
    num_samples BIGINT NOT NULL,
    num_tokens BIGINT NOT NULL,
    uploaded_at BIGINT NOT NULL,
    aggregated BOOLEAN NOT NULL DEFAULT FALSE,
    -- pending, aggregated, discarded (not chosen by Krum), rejected (outlier), stale
    status TEXT NOT NULL DEFAULT 'pending',
    aggregated_into TEXT,
    reason TEXT,
    -- null, queued, agreed, disagreed
    verification TEXT,
    verification_cosine DOUBLE PRECISION
);
-- One live update per batch: a second upload of the same batch is the same update.
CREATE UNIQUE INDEX gradient_updates_batch ON gradient_updates (batch_id)
    WHERE status <> 'rejected' AND status <> 'stale';
CREATE INDEX gradient_updates_status ON gradient_updates (status, uploaded_at);
CREATE INDEX gradient_updates_worker ON gradient_updates (worker_id, status);
