-- The queue's own record of every job and its state history.
CREATE TABLE jobs (
    job_id text PRIMARY KEY,
    tenant text NOT NULL,
    idempotency_key text,
    state text NOT NULL,
    attempt int NOT NULL DEFAULT 0,
    cluster text,
    cancel_requested boolean NOT NULL DEFAULT false,
    reason_code text,
    message text,
    spec jsonb NOT NULL,
    submitted_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_state ON jobs (state) WHERE state IN ('queued', 'placed', 'running');

CREATE TABLE job_history (
    id bigserial PRIMARY KEY,
    job_id text NOT NULL,
    at timestamptz NOT NULL,
    state text NOT NULL,
    event_type text NOT NULL,
    event_id text NOT NULL,
    reason_code text,
    message text
);
CREATE INDEX job_history_job ON job_history (job_id, id);

CREATE TABLE rejections (
    event_id text PRIMARY KEY,
    job_id text,
    tenant text,
    reason_code text NOT NULL,
    message text NOT NULL,
    at timestamptz NOT NULL
);

CREATE TABLE outbox (
    id bigserial PRIMARY KEY,
    topic text NOT NULL,
    key text NOT NULL,
    event_type text NOT NULL,
    value bytea NOT NULL
);
CREATE TABLE processed_events (
    event_id text PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
