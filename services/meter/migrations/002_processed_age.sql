-- Housekeeping deletes processed event ids by age (services.common.housekeeping); ids are
-- inserted in time order, so a BRIN index finds the old ones without scanning the table.
CREATE INDEX processed_events_age ON processed_events USING brin (processed_at);
