-- Inference services as the serving service publishes them (service.status): the newest
-- status of each, and the history of its changes (the newest 200 per service), for
-- GET /v1/services and `qm services`.
CREATE TABLE services (
    name text PRIMARY KEY,
    tenant text NOT NULL,
    status jsonb NOT NULL,
    revision int NOT NULL,
    at timestamptz NOT NULL
);

CREATE TABLE service_history (
    service text NOT NULL,
    revision int NOT NULL,
    change text NOT NULL,
    reason text NOT NULL,
    version text NOT NULL,
    desired_replicas int NOT NULL,
    ready_replicas int NOT NULL,
    at timestamptz NOT NULL,
    PRIMARY KEY (service, revision)
);
