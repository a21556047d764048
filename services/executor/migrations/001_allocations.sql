-- One schema per cluster's executor. What it really runs, so a restarted executor resumes
-- its jobs and never over-commits a node it forgot about.
CREATE TABLE allocations (
    job_id text PRIMARY KEY,
    attempt int NOT NULL,
    epoch bigint NOT NULL,
    replicas jsonb NOT NULL,
    tenant text NOT NULL,
    started_at timestamptz NOT NULL,
    ends_at timestamptz NOT NULL,
    outcome text NOT NULL,
    reason_code text,
    message text
);

-- Highest leader epoch seen: placements from older epochs are refused.
CREATE TABLE fence (
    id int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    epoch bigint NOT NULL
);

-- Stop orders for jobs not running here (yet): a later placement of them is refused.
CREATE TABLE tombstones (
    job_id text PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now()
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
