-- The scheduler's snapshots (services/scheduler/snapshot.py): the latest one is read at start.
-- Written by every replica (leader and standbys); a write never replaces a snapshot that
-- covers more of the log (progress: offsets summed over partitions).
CREATE TABLE snapshots (
    name text PRIMARY KEY,
    taken_at timestamptz NOT NULL,
    progress bigint NOT NULL,
    taken_by text NOT NULL,
    body bytea NOT NULL
);
