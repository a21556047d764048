-- What the elastic pools cost this month against the fleet-wide cloud budget
-- (QM_CLOUD_BUDGET_PER_MONTH): the integrated spend, the rate since `at` and when it was
-- counted, so a restarted autoscaler goes on from there (planner.MonthlySpend).
CREATE TABLE monthly_spend (
    month text PRIMARY KEY,
    spent double precision NOT NULL,
    rate double precision NOT NULL,
    at timestamptz NOT NULL
);
