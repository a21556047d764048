-- The dashboard: keyset paging over jobs in submission order (everyone's and one tenant's),
-- a job's cost so far, and the audit trail of changes made from the dashboard.
-- One tenant's jobs by state are found through the keyset index too (a state index on top
-- would cost every projected state change another index write).
DROP INDEX jobs_tenant_state;
CREATE INDEX jobs_submitted_keyset ON jobs (submitted_at, job_id);
CREATE INDEX jobs_tenant_submitted_keyset ON jobs (tenant, submitted_at, job_id);
CREATE INDEX usage_ticks_job ON usage_ticks (job_id) WHERE job_id IS NOT NULL;

CREATE TABLE audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    actor text NOT NULL,      -- tenant/role of the person, and how (the dashboard, the API)
    action text NOT NULL,     -- cancel
    job_id text NOT NULL,
    outcome text NOT NULL     -- requested, or why not (already succeeded, not allowed, ...)
);
CREATE INDEX audit_job ON audit (job_id);
