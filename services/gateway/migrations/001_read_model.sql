-- The gateway's read model, projected from the job topics. It answers status and list calls.
CREATE TABLE jobs (
    job_id text PRIMARY KEY,
    tenant text NOT NULL,
    project text,
    "user" text,
    queue text,
    name text,
    state text NOT NULL,
    attempt int NOT NULL DEFAULT 0,
    reason_code text,
    message text,
    cluster text,
    nodes text[],
    replicas int,
    accelerators double precision,
    idempotency_key text,
    spec jsonb,
    submitted_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE INDEX jobs_tenant_state ON jobs (tenant, state, submitted_at DESC);
CREATE INDEX jobs_state ON jobs (state, submitted_at DESC);
CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE TABLE job_events (
    event_id text PRIMARY KEY,
    job_id text NOT NULL,
    at timestamptz NOT NULL,
    type text NOT NULL,
    state text,
    reason_code text,
    message text
);
CREATE INDEX job_events_job ON job_events (job_id, at);
