-- Robot deployments (services/serving/deployments.py): each one's record as a JSON document
-- (spec, previous version, waves reached, pins, what each robot was last told to run).
CREATE TABLE deployments (
    name text PRIMARY KEY,
    tenant text NOT NULL,
    record jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
