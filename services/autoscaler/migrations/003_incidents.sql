-- Pools whose provisioning is failing and that were alerted: one alert per incident, also
-- across restarts (the row goes when a node of the pool comes again).
CREATE TABLE pool_incidents (
    pool text PRIMARY KEY,
    cluster text NOT NULL,
    cause text NOT NULL,
    since timestamptz NOT NULL
);
