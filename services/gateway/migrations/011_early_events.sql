-- Lifecycle events read before the job they are about: the projector reads every job topic on
-- one consumer, whose partitions are fetched independently, so a job's placement or start can
-- be read before its job.queued (a job submitted on Kafka, which the gateway first hears of
-- there). They wait here, as they came off the broker, and are folded in once the job's view
-- exists; what no view ever claims is dropped after a day.
CREATE TABLE early_events (
    event_id text PRIMARY KEY,
    job_id text NOT NULL,
    topic text NOT NULL,
    value bytea NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX early_events_job ON early_events (job_id);
CREATE INDEX early_events_received ON early_events (received_at);
