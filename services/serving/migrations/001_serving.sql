-- The serving service's books (services/serving/book.py): each service's record and each
-- replica job it made, as JSON documents it writes whole; its outbox and processed ids.
CREATE TABLE services (
    name text PRIMARY KEY,
    tenant text NOT NULL,
    record jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE replicas (
    job_id text PRIMARY KEY,
    service text NOT NULL,
    record jsonb NOT NULL
);

CREATE TABLE outbox (
    id bigserial PRIMARY KEY,
    topic text NOT NULL,
    key text NOT NULL,
    event_type text NOT NULL,
    value bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE processed_events (
    event_id text PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX processed_events_age ON processed_events USING brin (processed_at);
