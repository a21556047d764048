-- Elastic node pools as their executors hold them (cluster.capacity), the autoscaler's recent
-- decisions (autoscale.decided; the newest 20 per pool are kept) and the scheduler's latest
-- capacity demand (capacity.demand), for GET /v1/pools and `qm pools`.
CREATE TABLE pools (
    cluster text NOT NULL,
    pool text NOT NULL,
    status jsonb NOT NULL,
    at timestamptz NOT NULL,
    PRIMARY KEY (cluster, pool)
);

CREATE TABLE pool_decisions (
    event_id text PRIMARY KEY,
    cluster text NOT NULL,
    pool text NOT NULL,
    desired_nodes int NOT NULL,
    remove text[] NOT NULL,
    for_jobs text[] NOT NULL,
    reason text NOT NULL,
    at timestamptz NOT NULL
);
CREATE INDEX pool_decisions_by_pool ON pool_decisions (cluster, pool, at DESC);
CREATE INDEX pool_decisions_for_jobs ON pool_decisions USING gin (for_jobs);

CREATE TABLE capacity_demand (
    id int PRIMARY KEY CHECK (id = 1),
    jobs jsonb NOT NULL,
    pending_jobs int NOT NULL,
    truncated boolean NOT NULL,
    at timestamptz NOT NULL
);
