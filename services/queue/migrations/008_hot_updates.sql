-- A job's row is updated each time its state moves (queued, placed, running, ended), and
-- jobs_state indexed that very column: no update could stay on its page (HOT), so each wrote
-- a new primary-key entry, and a jobs_state one, beside the row. No query of the queue reads
-- jobs by state (it is driven by events; the gateway's read model answers "what is queued"),
-- so the index goes. With room kept on each page, the updates are HOT from now on
-- (docs/performance.md, "What a row write costs").
DROP INDEX IF EXISTS jobs_state;
ALTER TABLE jobs SET (fillfactor = 70);
