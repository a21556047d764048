-- The run the platform ended last: late events of that attempt must not revive it.
ALTER TABLE jobs ADD COLUMN ended_attempt int NOT NULL DEFAULT 0;
