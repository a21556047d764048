-- The meter's own schema: the usage ledger, the runs it is metering, the fleet's pools,
-- budget counters and the thresholds already announced.
-- Columns ending in _u hold millionths of their unit (microseconds, micro-accelerators,
-- millionths of a currency unit): exact integers; the `usage` view shows them as decimals.

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
    count_u bigint NOT NULL,
    interval_index bigint NOT NULL,
    interval_start timestamptz NOT NULL,
    interval_end timestamptz NOT NULL,
    start_offset_u bigint NOT NULL,
    end_offset_u bigint NOT NULL,
    seconds_u bigint NOT NULL,
    accelerator_seconds_u bigint NOT NULL,
    unit_price_u bigint NOT NULL,
    cost_u bigint NOT NULL,
    outcome text,
    written_at timestamptz NOT NULL DEFAULT now()
);
-- Usage per interval and pool, summed as ticks are written: idle capacity is what the pool
-- had minus this. (Cheaper than indexing every ledger row by interval; rows are dropped once
-- their interval's idle capacity is accounted.)
CREATE TABLE interval_usage (
    interval_index bigint NOT NULL,
    cluster text NOT NULL,
    accelerator_type text NOT NULL,
    price_tier text NOT NULL,
    tenant text NOT NULL,
    accelerator_seconds_u bigint NOT NULL,
    PRIMARY KEY (interval_index, cluster, accelerator_type, price_tier, tenant)
);

-- The ledger in units a person reads.
CREATE VIEW usage AS
SELECT tick_id, kind, run_id, job_id, attempt, tenant, project, "user", cluster,
       accelerator_type, price_tier, count_u / 1e6 AS count, interval_index, interval_start,
       interval_end, start_offset_u / 1e6 AS start_offset_s, end_offset_u / 1e6 AS end_offset_s,
       seconds_u / 1e6 AS seconds, accelerator_seconds_u / 1e6 AS accelerator_seconds,
       unit_price_u / 1e6 AS unit_price, cost_u / 1e6 AS cost, outcome, written_at
FROM ledger;

-- Every run the meter has heard of (job id + attempt). Pending: placement or start missing;
-- open: billed by the clock; closed: done (kept so late duplicates change nothing).
CREATE TABLE runs (
    job_id text NOT NULL,
    attempt int NOT NULL,
    phase text NOT NULL,
    placements jsonb NOT NULL DEFAULT '[]',
    started_at timestamptz,
    nodes text[] NOT NULL DEFAULT '{}',
    ran_u bigint,
    outcome text,
    run jsonb,
    billed_u bigint,
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
    unit_price_u bigint NOT NULL,
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
    accelerator_seconds_u bigint NOT NULL DEFAULT 0,
    cost_u bigint NOT NULL DEFAULT 0,
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
