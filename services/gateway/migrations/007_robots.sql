-- Robot fleets as their edge executors report them (robot.inventory, newest per fleet), and
-- robot deployments as the serving service publishes them (deployment.status): the newest
-- status of each and one history row per revision (the newest 200 per deployment), for
-- GET /v1/robots, GET /v1/deployments, `qm robots` and `qm deployments`.
CREATE TABLE robot_fleets (
    cluster text PRIMARY KEY,
    inventory jsonb NOT NULL,
    at timestamptz NOT NULL
);

CREATE TABLE deployments (
    name text PRIMARY KEY,
    tenant text NOT NULL,
    status jsonb NOT NULL,
    revision int NOT NULL,
    at timestamptz NOT NULL
);

CREATE TABLE deployment_history (
    deployment text NOT NULL,
    revision int NOT NULL,
    phase text NOT NULL,
    version text NOT NULL,
    wave int NOT NULL,
    waves int NOT NULL,
    on_version int NOT NULL,
    reason text NOT NULL,
    at timestamptz NOT NULL,
    PRIMARY KEY (deployment, revision)
);
