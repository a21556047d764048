-- The straggler detector's memory, one row per job with progress reports: per node of its
-- gang the last m verdicts, so a restart neither forgets a half-filled window nor re-alerts.
-- Straggler incidents themselves live in `incidents` (cause 'straggler').
CREATE TABLE straggler_tracks (
    job_id text PRIMARY KEY,
    attempt int NOT NULL,
    cluster text NOT NULL,
    last_at timestamptz NOT NULL,
    -- [{node_id, last_at, recent: "01101" (oldest first, 1 = slow), straggling, replica, ratio}]
    nodes jsonb NOT NULL
);
