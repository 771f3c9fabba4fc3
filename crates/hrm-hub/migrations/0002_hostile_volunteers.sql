-- What the hub needs to hold against hostile volunteers (docs/hub-api.md, "Threat model").

-- Re-verifications in a row that agreed with the worker's uploads since its last disagreement:
-- a worker with fewer than --probation-agreements is in probation.
ALTER TABLE workers ADD COLUMN agreements BIGINT NOT NULL DEFAULT 0;

-- What was accepted is what is aggregated: size and SHA-256 of the file at acceptance, checked
-- when it is read again; and its L2 norm, for the norm screen.
ALTER TABLE gradient_updates ADD COLUMN size_bytes BIGINT;
ALTER TABLE gradient_updates ADD COLUMN sha256 TEXT;
ALTER TABLE gradient_updates ADD COLUMN norm DOUBLE PRECISION;
-- A gated update is aggregated only once its re-verification agreed (probation, a flag of the
-- outlier screen, or a suspect of a round that raised the validation loss).
ALTER TABLE gradient_updates ADD COLUMN gated BOOLEAN NOT NULL DEFAULT FALSE;

-- When a batch ran out of attempts; it comes back after --failed-cooldown.
ALTER TABLE training_batches ADD COLUMN failed_at BIGINT;

-- The norm an honest update has: a running geometric mean of the norms of the hub's own
-- recomputations (re-verification), which no upload can move.
ALTER TABLE hub_state ADD COLUMN norm_reference DOUBLE PRECISION;
ALTER TABLE hub_state ADD COLUMN norm_samples BIGINT NOT NULL DEFAULT 0;
-- Signs registration challenges, shared by every replica.
ALTER TABLE hub_state ADD COLUMN challenge_secret TEXT;

-- One live lease per worker, enforced by the database: two concurrent lease requests cannot
-- both claim a batch. Duplicates left by earlier versions go back to the queue first.
UPDATE training_batches SET status = 'pending', assigned_to = NULL, assigned_at = NULL, lease_expires_at = NULL
WHERE status = 'assigned' AND batch_id NOT IN (
    SELECT MIN(batch_id) FROM training_batches WHERE status = 'assigned' GROUP BY assigned_to
);
CREATE UNIQUE INDEX training_batches_one_lease ON training_batches (assigned_to)
    WHERE status = 'assigned';
CREATE INDEX gradient_updates_verification ON gradient_updates (verification, gated, uploaded_at);
