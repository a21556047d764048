-- A cancel can overtake its job's submission (they travel on different topics): remember it
-- until the job arrives, which is then cancelled at once.
CREATE TABLE early_cancels (
    job_id text PRIMARY KEY,
    requested_by text NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
);
