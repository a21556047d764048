-- How each run behaves on the simulated fleet (from its labels, fixed at placement) and the
-- checkpoint it was signalled to take, so a restarted executor keeps the work it saved.
ALTER TABLE allocations
    ADD COLUMN exit_code int,
    ADD COLUMN step_s double precision NOT NULL DEFAULT 1.0,
    ADD COLUMN checkpoint_s double precision NOT NULL DEFAULT 10.0,
    ADD COLUMN checkpoint_every_s double precision,
    ADD COLUMN checkpoint_at timestamptz,
    ADD COLUMN checkpoint_done_at timestamptz,
    ADD COLUMN checkpoint_stop_at timestamptz;
