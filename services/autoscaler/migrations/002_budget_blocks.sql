-- Tenants whose budget is spent for a month (budget.exceeded is sent once per threshold and
-- month): kept so that a restarted autoscaler, resuming after those records, still grows
-- nothing for them.
CREATE TABLE budget_blocks (
    tenant text NOT NULL,
    month text NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, month)
);
