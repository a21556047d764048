-- The cluster's elastic node pools (services/executor/pools.py): each node asked for, whether
-- it is ready, and per pool the size the autoscaler last set and the next node number (node
-- ids are never reused).
CREATE TABLE pool_nodes (
    node_id text PRIMARY KEY,
    pool text NOT NULL,
    requested_at timestamptz NOT NULL,
    ready_at timestamptz,
    stockout boolean NOT NULL DEFAULT false
);
CREATE TABLE pool_sizes (
    pool text PRIMARY KEY,
    desired integer NOT NULL,
    next_seq integer NOT NULL
);
