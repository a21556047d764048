-- Budgets in `block` mode that the meter said are used up this month (budget.exceeded);
-- the queue refuses new jobs of that tenant/project with reason budget_exhausted.
CREATE TABLE budget_blocks (
    budget_id text PRIMARY KEY,
    tenant text NOT NULL,
    project text,
    month text NOT NULL,
    unit text NOT NULL,
    "limit" double precision NOT NULL,
    used double precision NOT NULL,
    currency text
);
