-- Runs ended by the platform (node failure, preemption) requeue the job; it then avoids the
-- nodes that failed under it. Requeues are not charged to any retry budget. Events of a run
-- that ended (ended_attempt) arriving late move the job no more.
ALTER TABLE jobs ADD COLUMN requeues int NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN excluded_nodes text[] NOT NULL DEFAULT '{}';
ALTER TABLE jobs ADD COLUMN ended_attempt int NOT NULL DEFAULT 0;
