-- The fleet and queue views (GET /v1/fleet, /v1/nodes, /v1/queues; `qm nodes`, `qm top`).

-- Each job's newest placement (per replica: node, accelerators, device indices) and the
-- accelerator type to group it by: the type it holds once placed, else the type it asks for.
ALTER TABLE jobs ADD COLUMN placement jsonb;
ALTER TABLE jobs ADD COLUMN accelerator_type text;
UPDATE jobs SET accelerator_type = CASE
    WHEN jsonb_array_length(COALESCE(spec -> 'resources' -> 'accelerator_types', '[]')) = 0
        THEN 'any'
    ELSE (SELECT string_agg(DISTINCT t, '|' ORDER BY t)
          FROM jsonb_array_elements_text(spec -> 'resources' -> 'accelerator_types') AS t)
    END
WHERE spec IS NOT NULL;

-- The job a preemption made room for, so that the preemptions a tenant caused can be counted.
ALTER TABLE job_events ADD COLUMN for_job text;
UPDATE job_events SET for_job = substring(message FROM 'make room for job (\S+) \(')
WHERE type = 'JobCheckpointRequested';
-- Starts (queue wait) and preemptions in a time window.
CREATE INDEX job_events_starts_preemptions ON job_events (type, at)
    WHERE type IN ('JobStarted', 'JobPreempted');

-- Each cluster's newest inventory (cluster.capacity) and its nodes, replaced as a whole.
CREATE TABLE fleet_clusters (
    cluster text PRIMARY KEY,
    location text NOT NULL,
    kind text NOT NULL,
    nodes int NOT NULL,
    at timestamptz NOT NULL
);

CREATE TABLE fleet_nodes (
    node_id text PRIMARY KEY,
    cluster text NOT NULL,
    block text NOT NULL,
    rack text NOT NULL,
    nvlink_domain text NOT NULL,
    accelerator_type text NOT NULL,
    generation text NOT NULL,
    accelerators int NOT NULL,
    accelerator_memory_gb double precision NOT NULL,
    price_tier text NOT NULL,
    -- false: the executor keeps it out of scheduling (quarantined, or cordoned by an operator).
    schedulable boolean NOT NULL,
    at timestamptz NOT NULL
);
CREATE INDEX fleet_nodes_cluster ON fleet_nodes (cluster, node_id);

-- The health service's verdicts per node (node.unhealthy, node.recovered): the newest decides
-- whether the node is quarantined; the newest 20 per node are kept as its history.
CREATE TABLE node_health (
    node_id text PRIMARY KEY,
    cluster text NOT NULL,
    quarantined boolean NOT NULL,
    cause text NOT NULL,
    incident_id text NOT NULL,
    since timestamptz NOT NULL,
    at timestamptz NOT NULL
);

CREATE TABLE node_verdicts (
    event_id text PRIMARY KEY,
    node_id text NOT NULL,
    cluster text NOT NULL,
    verdict text NOT NULL,
    cause text NOT NULL,
    incident_id text NOT NULL,
    detail text NOT NULL,
    at timestamptz NOT NULL
);
CREATE INDEX node_verdicts_node ON node_verdicts (node_id, at DESC);
