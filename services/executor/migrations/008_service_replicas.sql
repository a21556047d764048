-- A replica of an inference service (issue 13): which service it serves, and when it is ready
-- (on the simulated fleet, after its warm-up); the executor reports it ready and where.
ALTER TABLE allocations ADD COLUMN service text;
ALTER TABLE allocations ADD COLUMN ready_at timestamptz;
