-- The autoscaler keeps no state of its own beyond the outbox (its decisions go out through it,
-- with the alerts, in one transaction) and the ids of the records it has processed.
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
