-- Retries by failure class (docs/retries.md). Runs that failed by the job's own fault are
-- charged to its spec.retry budget; preemptions for a higher claim back off, doubling with
-- each one. Node and cluster failures count in neither.
ALTER TABLE jobs ADD COLUMN failures int NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN claim_preemptions int NOT NULL DEFAULT 0;
