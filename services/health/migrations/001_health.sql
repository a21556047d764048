-- The health service's own record: every node's state machine and the incidents behind
-- quarantines, so a restart neither re-alerts nor forgets a quarantine.
CREATE TABLE nodes (
    node_id text PRIMARY KEY,
    cluster text NOT NULL,
    state text NOT NULL,
    last_heard timestamptz,
    recent jsonb NOT NULL DEFAULT '[]',
    incident_id text,
    cause text,
    quarantined_at timestamptz,
    last_bad_at timestamptz
);

CREATE TABLE incidents (
    incident_id text PRIMARY KEY,
    subject text NOT NULL,
    cluster text NOT NULL,
    node_id text,
    cause text NOT NULL,
    severity text NOT NULL,
    suggested_action text NOT NULL,
    first_seen timestamptz NOT NULL,
    last_seen timestamptz NOT NULL,
    count int NOT NULL,
    closed_at timestamptz
);
CREATE INDEX incidents_open ON incidents (subject) WHERE closed_at IS NULL;

CREATE TABLE outbox (
    id bigserial PRIMARY KEY,
    topic text NOT NULL,
    key text NOT NULL,
    event_type text NOT NULL,
    value bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Only probes are claimed here: heartbeats and inventories are idempotent by nature (the
-- latest time wins), and claiming one row per heartbeat would grow without need.
CREATE TABLE processed_events (
    event_id text PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
