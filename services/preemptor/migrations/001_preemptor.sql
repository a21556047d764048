-- The preemptor's own record: what the lifecycle topics said about each job (facts that only
-- grow, so they merge in any order), the highest leader epoch seen, and every preemption with
-- its durable timer (stop_at), so a restarted preemptor still stops a victim on time.
CREATE TABLE jobs (
    job_id text PRIMARY KEY,
    started_attempt int,
    started_at timestamptz,
    ended_attempt int,
    finished boolean NOT NULL DEFAULT false,
    closed boolean NOT NULL DEFAULT false,
    placed_at timestamptz,
    preemptible boolean,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Highest scheduler leader epoch seen: requests of older epochs are refused.
CREATE TABLE fence (
    id int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    epoch bigint NOT NULL
);

CREATE TABLE preemptions (
    id text PRIMARY KEY,                 -- the request's event id
    job_id text NOT NULL,                -- the victim
    attempt int NOT NULL,
    cluster text NOT NULL,
    tenant text NOT NULL,
    for_job text NOT NULL,
    for_tenant text NOT NULL,
    reason_code text NOT NULL,
    epoch bigint NOT NULL,
    request jsonb NOT NULL,              -- the PreemptionRequested payload, as received
    trace_id text NOT NULL,
    requested_at timestamptz NOT NULL,   -- the request's occurred_at
    received_at timestamptz NOT NULL,
    state text NOT NULL,                 -- held | signaled | ordered | done | canceled
    hold_until timestamptz,
    grace_s double precision,            -- fleet seconds, after the policy's cap
    signaled_at timestamptz,
    stop_at timestamptz,                 -- wall clock: the durable timer
    ordered_at timestamptz,
    ended_at timestamptz,
    ended_by text,                       -- the topic that reported the victim's run ended
    canceled_at timestamptz,
    cancel_reason text,
    cancel_message text
);
-- At most one live preemption per victim run; canceled ones stay as history.
CREATE UNIQUE INDEX preemptions_one_per_run ON preemptions (job_id, attempt)
    WHERE state <> 'canceled';
CREATE INDEX preemptions_due ON preemptions (stop_at) WHERE state = 'signaled';
CREATE INDEX preemptions_held ON preemptions (hold_until) WHERE state = 'held';
CREATE INDEX preemptions_ordered ON preemptions (job_id) WHERE state = 'ordered';
CREATE INDEX preemptions_budget ON preemptions (tenant, signaled_at)
    WHERE signaled_at IS NOT NULL;

CREATE TABLE outbox (
    id bigserial PRIMARY KEY,
    topic text NOT NULL,
    key text NOT NULL,
    event_type text NOT NULL,
    value bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Only requests are claimed: facts and run ends are idempotent by nature (they only grow),
-- and claiming every placement would grow this table without need.
CREATE TABLE processed_events (
    event_id text PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
