-- The gateway's read model of usage: every usage.tick, once (tick_id is the stream's natural
-- key). It answers GET /v1/usage and GET /v1/usage/efficiency.
CREATE TABLE usage_ticks (
    tick_id text PRIMARY KEY,
    kind text NOT NULL,
    run_id text NOT NULL,
    job_id text,
    tenant text NOT NULL,
    project text NOT NULL,
    "user" text NOT NULL,
    cluster text NOT NULL,
    accelerator_type text NOT NULL,
    price_tier text NOT NULL,
    interval_index bigint NOT NULL,
    interval_start timestamptz NOT NULL,
    interval_end timestamptz NOT NULL,
    count numeric NOT NULL,
    seconds numeric NOT NULL,
    accelerator_seconds numeric NOT NULL,
    unit_price numeric NOT NULL,
    cost numeric NOT NULL,
    currency text NOT NULL,
    outcome text,
    projected_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX usage_ticks_tenant_time ON usage_ticks (tenant, interval_start);
CREATE INDEX usage_ticks_time ON usage_ticks (interval_start);
