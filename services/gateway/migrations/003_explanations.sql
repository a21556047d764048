-- The scheduler's latest word on why each pending job waits (scheduling.explained).
CREATE TABLE explanations (
    job_id text PRIMARY KEY,
    codes text[] NOT NULL,
    message text NOT NULL,
    pending_jobs int NOT NULL,
    at timestamptz NOT NULL
);
