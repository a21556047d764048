-- The accelerator type a job asks for (`projection.wanted_type` of its spec: its one type,
-- several joined by `|`, or `any`), written with the spec. The projection reads a stored view
-- back for every event about its job, and needs of the spec only this and the memory its
-- first run asked for: so it reads these instead of parsing the whole spec each time.
-- Rows written before this column have it empty; the projection then reads their spec as
-- before and fills the column at the job's next event.
ALTER TABLE jobs ADD COLUMN wanted_type text;
