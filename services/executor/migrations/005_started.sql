-- Whether the run's job.started has been announced. A simulated run starts with its placement;
-- a run on Kubernetes starts when every pod of its gang runs, which may be after a restart.
ALTER TABLE allocations ADD COLUMN started boolean NOT NULL DEFAULT true;
