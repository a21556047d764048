-- The meter's own schema: the usage ledger, the runs it is metering, the fleet's pools,
-- budget counters and the thresholds already announced.

-- One row per tick. tick_id is the natural key (run + interval + price tier, or the run's
-- close tick), so a replayed or duplicated event can never count twice.
CREATE TABLE ledger (
    tick_id text PRIMARY KEY,
    kind text NOT NULL,
    run_id text NOT NULL,
    job_id text,
    attempt int,
    tenant text NOT NULL,
    project text NOT NULL,
    "user" text NOT NULL,
    cluster text NOT NULL,
    accelerator_type text NOT NULL,
    price_tier text NOT NULL,
    count numeric NOT NULL,
    interval_index bigint NOT NULL,
    interval_start timestamptz NOT NULL,
    interval_end timestamptz NOT NULL,
    start_offset_s numeric NOT NULL,
    end_offset_s numeric NOT NULL,
    seconds numeric NOT NULL,
    accelerator_seconds numeric NOT NULL,
    unit_price numeric NOT NULL,
    cost numeric NOT NULL,
    outcome text,
    written_at timestamptz NOT NULL DEFAULT now()
);
-- Idle capacity of an interval is computed from the usage ticks of that interval.
CREATE INDEX ledger_interval ON ledger (interval_index);

-- Every run the meter has heard of (job id + attempt). Pending: placement or start missing;
-- open: billed by the clock; closed: done (kept so late duplicates change nothing).
CREATE TABLE runs (
    job_id text NOT NULL,
    attempt int NOT NULL,
    phase text NOT NULL,
    placements jsonb NOT NULL DEFAULT '[]',
    started_at timestamptz,
    nodes text[] NOT NULL DEFAULT '{}',
    ran_s numeric,
    outcome text,
    run jsonb,
    billed_s numeric,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, attempt)
);
CREATE INDEX runs_open ON runs (phase) WHERE phase = 'open';

-- The fleet's inventory per cluster, accelerator type and price tier (from cluster.capacity).
CREATE TABLE pools (
    cluster text NOT NULL,
    accelerator_type text NOT NULL,
    price_tier text NOT NULL,
    accelerators int NOT NULL,
    unit_price numeric NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (cluster, accelerator_type, price_tier)
);

-- Where idle-capacity accounting stands (the last interval done).
CREATE TABLE meter_state (
    id int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    idle_through bigint
);

-- Usage per tenant, project and calendar month, updated with every batch of new ticks.
CREATE TABLE budget_usage (
    tenant text NOT NULL,
    project text NOT NULL,
    month text NOT NULL,
    accelerator_seconds numeric NOT NULL DEFAULT 0,
    cost numeric NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, project, month)
);

-- Thresholds announced: each once per budget and month.
CREATE TABLE budget_alerts (
    budget_id text NOT NULL,
    month text NOT NULL,
    threshold numeric NOT NULL,
    used numeric NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (budget_id, month, threshold)
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
